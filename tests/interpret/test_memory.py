"""Memory you can see and bound: the resident bytes a replay plan reports are what it holds, the
cache's byte bound evicts least recently used plans and frees them, and a backward's peak stays
within eager's peak plus what the plan keeps."""

from __future__ import annotations

import gc
import logging
import types

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import gpuautograd
from bench.memory import measure_model
from bench.models import SUITE
from gpuautograd.runtime import engine, resident

BACKEND = "interpret-replay"
MODELS = ["mlp", "gpt"]


def _model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model, make_batch, loss_fn = SUITE[name]()
    return model, make_batch(torch.Generator().manual_seed(seed)), loss_fn


def _step(model, batch, loss_fn) -> None:
    model.zero_grad(set_to_none=True)
    gpuautograd.backward(loss_fn(model, *batch), backend=BACKEND)


def _owned_by_user(model, batch) -> set[int]:
    tensors = [*model.parameters(), *model.buffers(), *(x for x in batch if isinstance(x, torch.Tensor))]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    return {t.untyped_storage().data_ptr() for t in tensors}


def _reachable_storages(root, skip: set[int]) -> int:
    """Bytes of the distinct tensor storages reachable from `root` through Python references,
    found without held_tensors(): module namespaces, modules and classes are not followed."""
    seen, stack, storages = set(), [root], {}
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (types.ModuleType, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            s = obj.untyped_storage()
            if s.data_ptr() not in skip:
                storages[s.data_ptr()] = s.nbytes()
            continue
        if isinstance(obj, dict) and "__name__" in obj:  # a module's globals (a kernel's, Triton's)
            continue
        stack.extend(gc.get_referents(obj))
    return sum(storages.values())


@pytest.mark.parametrize("name", MODELS)
def test_resident_bytes_are_what_the_plan_holds(name):
    model, batch, loss_fn = _model(name)
    for _ in range(2):  # capture, then the first call (mirrors, copy descriptors)
        _step(model, batch, loss_fn)
    (entry,) = engine.CACHE.entries.values()
    reported = resident.of(entry.compiled)
    assert reported["arena"] > 0 and set(reported) <= set(resident.KINDS)
    assert sum(reported.values()) == gpuautograd.stats()["resident_bytes"]
    # measured independently: every storage the plan object reaches, less the user's own
    assert _reachable_storages(entry.compiled, _owned_by_user(model, batch)) == sum(reported.values())


@pytest.mark.usefixtures("walker")  # explain() finds the cached plan under either walker's key
@pytest.mark.parametrize("name", MODELS)
def test_explain_and_stats_agree(name):
    model, batch, loss_fn = _model(name)
    before = gpuautograd.explain(loss_fn(model, *batch), backend=BACKEND)  # not cached yet: as bound
    assert before.arena_bytes > 0 and before.intermediate_bytes >= before.arena_bytes
    assert f"arena {before.arena_bytes} bytes" in before.memory and f"of {before.intermediate_bytes} bytes" in before.memory
    assert before.resident_bytes == sum(before.resident.values()) and "mirror" not in before.resident
    for _ in range(2):
        _step(model, batch, loss_fn)
    after = gpuautograd.explain(loss_fn(model, *batch), backend=BACKEND)  # the cached plan's
    stats = gpuautograd.stats()
    assert {"resident_bytes", "cache_byte_evictions", "cache_oversize"} <= set(stats)
    assert after.resident_bytes == stats["resident_bytes"] == sum(after.resident.values())
    assert after.resident_bytes >= before.resident_bytes
    assert gpuautograd.explain(loss_fn(model, *batch), backend="reference").resident_bytes == 0


def test_stats_total_is_the_sum_over_plans():
    plans = []
    for name in MODELS:
        model, batch, loss_fn = _model(name)
        for _ in range(2):
            _step(model, batch, loss_fn)
        plans.append(gpuautograd.explain(loss_fn(model, *batch), backend=BACKEND).resident_bytes)
    assert gpuautograd.stats()["cached_programs"] == 2
    assert gpuautograd.stats()["resident_bytes"] == sum(plans) > 0


def _plan_storages(entry) -> list[StorageWeakRef]:
    return [StorageWeakRef(t.untyped_storage()) for _, t in entry.compiled.held_tensors()]


def test_byte_bound_evicts_least_recently_used_and_frees(monkeypatch):
    # three mlp plans of one structure, batches of 12, 8 and 4 (distinct keys): the smallest comes last
    models = [_model("mlp", seed) for seed in range(3)]
    sizes = [(m, tuple(x[: 12 - 4 * k] for x in b), f) for k, (m, b, f) in enumerate(models)]
    monkeypatch.setenv("GPUAUTOGRAD_CACHE_BYTES", "none")
    refs = []
    for m, b, f in sizes[:2]:
        for _ in range(2):
            _step(m, b, f)
        refs.append(_plan_storages(list(engine.CACHE.entries.values())[-1]))
    first, second = engine.CACHE.entries.values()
    one, two = resident.total(first.compiled), resident.total(second.compiled)
    _step(*sizes[0])  # the first plan is now the most recently used: the second is evicted first
    del first, second
    monkeypatch.setenv("GPUAUTOGRAD_CACHE_BYTES", str(one + two + 1))  # the third plan won't fit beside both
    for _ in range(2):
        _step(*sizes[2])
    stats = gpuautograd.stats()
    assert stats["cache_byte_evictions"] == 1 and stats["cache_oversize"] == 0
    assert stats["cached_programs"] == 2 and stats["resident_bytes"] <= one + two + 1
    assert all(r.expired() for r in refs[1]), "the evicted plan's memory is still allocated (without a gc pass)"
    assert not any(r.expired() for r in refs[0]), "the plan used last was evicted"


def test_oversize_plan_is_kept_counted_and_logged(monkeypatch, caplog):
    monkeypatch.setenv("GPUAUTOGRAD_CACHE_BYTES", "1K")
    model, batch, loss_fn = _model("gpt")
    with caplog.at_level(logging.WARNING, logger="gpuautograd"):
        for _ in range(3):
            _step(model, batch, loss_fn)
    stats = gpuautograd.stats()
    assert stats["cached_programs"] == 1 and stats["cache_oversize"] == 1 and stats["cache_byte_evictions"] == 0
    assert stats["resident_bytes"] > 1024 and stats["captures"] == 1
    messages = [r.getMessage() for r in caplog.records if "GPUAUTOGRAD_CACHE_BYTES" in r.getMessage()]
    assert len(messages) == 1


def test_auto_bounds_cuda_plans_only(monkeypatch):
    monkeypatch.setenv("GPUAUTOGRAD_CACHE_BYTES", "auto")
    model, batch, loss_fn = _model("mlp")
    for _ in range(2):
        _step(model, batch, loss_fn)
    assert gpuautograd.stats()["cache_oversize"] == 0 and gpuautograd.stats()["resident_bytes"] > 0


@pytest.mark.parametrize("text, value", [("512M", 512 << 20), ("4G", 4 << 30), ("1024", 1024), ("none", None), ("auto", "auto")])
def test_cache_bytes_flag(monkeypatch, text, value):
    from gpuautograd import flags

    monkeypatch.setenv("GPUAUTOGRAD_CACHE_BYTES", text)
    assert flags.cache_bytes() == value


def test_cache_bytes_flag_rejects_garbage(monkeypatch):
    from gpuautograd import flags

    monkeypatch.setenv("GPUAUTOGRAD_CACHE_BYTES", "lots")
    with pytest.raises(flags.FlagError, match="GPUAUTOGRAD_CACHE_BYTES"):
        flags.cache_bytes()


@pytest.mark.parametrize("name", list(SUITE))
def test_peak_within_eager_plus_resident(name):
    eager, replay = measure_model(name, "cpu", ["eager", BACKEND])
    assert replay["backend"] == BACKEND and replay["fallbacks"] == 0 and replay["resident_bytes"] > 0
    assert eager["peak_bytes"] > 0
    assert replay["peak_bytes"] <= eager["peak_bytes"] + replay["resident_bytes"], replay
    assert replay["peak_within_eager_plus_resident"] and replay["frees_like_eager"]
