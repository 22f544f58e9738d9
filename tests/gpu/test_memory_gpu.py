"""GPU tier of tests/interpret/test_memory.py: resident bytes of cudagraph plans (their CUDA graph
pools included), the byte bound with its CUDA default, and peaks against eager's. Skipped without
CUDA."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import gpuautograd
from bench.memory import measure_model
from bench.models import SUITE
from gpuautograd.runtime import cache, engine, resident

BACKEND = "cudagraph"
DEVICE = "cuda"


def _model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    model, make_batch, loss_fn = SUITE[name](device=DEVICE)
    return model, make_batch(torch.Generator().manual_seed(seed)), loss_fn


def _step(model, batch, loss_fn) -> None:
    model.zero_grad(set_to_none=True)
    gpuautograd.backward(loss_fn(model, *batch), backend=BACKEND)


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_resident_bytes_of_a_captured_plan(name):
    model, batch, loss_fn = _model(name)
    for _ in range(2):
        _step(model, batch, loss_fn)
    (entry,) = engine.CACHE.entries.values()
    assert entry.compiled.graphs > 0
    held = resident.count(entry.compiled.held_tensors())
    reported = resident.of(entry.compiled)
    # the storages it holds, plus what the allocator reserved for its graphs' pool at capture
    assert sum(reported.values()) == sum(held.values()) + reported.get("graph_pool", 0)
    assert reported["arena"] > 0 and all(t.is_cuda for kind, t in entry.compiled.held_tensors() if kind == "arena")
    explanation = gpuautograd.explain(loss_fn(model, *batch), backend=BACKEND)
    assert explanation.resident_bytes == gpuautograd.stats()["resident_bytes"] == sum(reported.values())
    assert explanation.resident == reported


def test_auto_bound_is_a_quarter_of_the_device(monkeypatch):
    monkeypatch.setenv("GPUAUTOGRAD_CACHE_BYTES", "auto")
    device = torch.device("cuda", torch.cuda.current_device())
    assert cache._auto_bound(device) == torch.cuda.get_device_properties(device).total_memory // 4
    model, batch, loss_fn = _model("gpt")
    for _ in range(2):
        _step(model, batch, loss_fn)
    assert gpuautograd.stats()["cache_oversize"] == 0 and gpuautograd.stats()["cache_byte_evictions"] == 0


def test_byte_bound_evicts_and_frees_device_memory(monkeypatch):
    models = [_model("mlp", seed) for seed in range(2)]
    sizes = [(m, tuple(x[: 12 - 4 * k] for x in b), f) for k, (m, b, f) in enumerate(models)]
    monkeypatch.setenv("GPUAUTOGRAD_CACHE_BYTES", "none")
    for _ in range(2):
        _step(*sizes[0])
    (first,) = engine.CACHE.entries.values()
    refs = [StorageWeakRef(t.untyped_storage()) for _, t in first.compiled.held_tensors()]
    one = resident.total(first.compiled)
    del first
    monkeypatch.setenv("GPUAUTOGRAD_CACHE_BYTES", str(one))  # the second plan can't sit beside the first
    torch.cuda.synchronize()
    for _ in range(2):
        _step(*sizes[1])
    torch.cuda.synchronize()
    stats = gpuautograd.stats()
    assert stats["cache_byte_evictions"] == 1 and stats["cached_programs"] == 1
    assert all(r.expired() for r in refs), "the evicted plan's device memory is still allocated"


def test_oversize_plan_is_kept_and_logged_once(monkeypatch, caplog):
    monkeypatch.setenv("GPUAUTOGRAD_CACHE_BYTES", "1K")
    model, batch, loss_fn = _model("gpt")
    with caplog.at_level(logging.WARNING, logger="gpuautograd"):
        for _ in range(3):
            _step(model, batch, loss_fn)
    stats = gpuautograd.stats()
    assert stats["cache_oversize"] == 1 and stats["cached_programs"] == 1 and stats["replays"] >= 1
    assert len([r for r in caplog.records if "GPUAUTOGRAD_CACHE_BYTES" in r.getMessage()]) == 1


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama"])
def test_peak_within_eager_plus_resident(name):
    eager, replay = measure_model(name, DEVICE, ["eager", BACKEND])
    assert eager["peak_bytes"] > 0 and replay["resident_bytes"] > 0 and replay["fallbacks"] == 0
    assert replay["peak_bytes"] <= eager["peak_bytes"] + replay["resident_bytes"], replay
