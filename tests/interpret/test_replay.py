"""Replay hazards of the bound plan on CPU: the "interpret-replay" backend runs exactly what the
"cudagraph" backend captures (the fused plan bound through the pointer table, each segment a
function with no arguments over static state), calling each segment again on every backward
instead of replaying a graph. The hazards shared with the GPU tier live in tests/replay_cases.py.
"""

from __future__ import annotations

import re

import pytest
import torch

import gpuautograd
from tests import replay_cases as rc
from tests.helpers import assert_close, gpuautograd_reports, train_side_by_side

CPU = rc.Where("interpret-replay", "cpu", torch.float64)
REPLAY = CPU.backend

pytestmark = pytest.mark.usefixtures("walker")  # every case with both walkers (tests/conftest.py)


@pytest.mark.parametrize("case", rc.CASES, ids=lambda c: c.__name__)
def test_replay_hazard(case):
    case(CPU)


def test_dtype_change_gets_its_own_plan():
    rc.dtype_change_gets_its_own_plan(CPU, torch.float32)


@pytest.mark.parametrize("fn", [rc.Double, rc.PassThrough], ids=lambda f: f.__name__)
def test_opaque_node_splits_the_plan_into_segments(fn):
    rc.opaque_node_splits_the_plan_into_segments(CPU, fn)


def test_number_of_bound_plans_is_bounded(monkeypatch):
    rc.number_of_bound_plans_is_bounded(CPU, monkeypatch)


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama", "cnn", "gpt-ckpt"])
def test_suite_models_train_like_eager(name):
    """Gradients and strides every step, accumulation over micro-batches, set_to_none after each
    optimizer step, against eager and the reference executor (float64)."""
    train_side_by_side(name, torch.float64, steps=4, backend=REPLAY)
    (program,) = rc.bound_programs()
    assert program.replays == 3


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama"])
def test_table_matmul_binding_trains_like_eager(name, monkeypatch):
    """GPUAUTOGRAD_EXTERN_BINDING=table: matmuls read their changing operands from the table
    (triton_kernels.table_matmul) instead of cuBLAS on copies (float32: the kernel's dtypes)."""
    monkeypatch.setenv("GPUAUTOGRAD_EXTERN_BINDING", "table")
    train_side_by_side(name, torch.float32, steps=3, backend=REPLAY)
    (program,) = rc.bound_programs()
    assert "through the table" in program.source and program.replays == 2


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama"])
def test_bitwise_equal_to_the_unbound_fused_plan(name):
    rc.bitwise_equal_to_the_unbound_plan(CPU, name, "interpret")


def test_too_many_segments_run_unreplayed_and_say_so(monkeypatch):
    monkeypatch.setenv("GPUAUTOGRAD_MAX_SEGMENTS", "1")
    first, last = rc.split_model(CPU)
    x = CPU.randn(4, 6)
    with gpuautograd_reports() as messages:
        gpuautograd.backward(last(rc.Double.apply(first(x))).square().mean(), backend=REPLAY)
    assert len(messages) == 1 and re.search("not graphed.*2 captured segments", messages[0]), messages
    assert not rc.bound_programs()
    (reason,) = gpuautograd.stats()["not_graphed"]
    assert "GPUAUTOGRAD_MAX_SEGMENTS=1" in reason


def test_kernels_read_dynamic_pointers_from_the_table():
    model = rc.mlp(CPU)
    x = CPU.randn(4, 6)
    report = gpuautograd.explain(rc.loss_of(model, x), backend=REPLAY)
    assert report.backend == REPLAY
    bound = [k for k in report.kernels if "_ref).to(tl.pointer_type(" in k.source]
    assert bound, "no kernel reads its pointers from the table"
    assert "CI" in report.source  # a library input copied into a static mirror


def test_a_pointer_that_loses_its_alignment_stops_replay_and_says_so():
    """Kernels vectorize table pointers that were 16-byte aligned at capture, so every call checks
    them; an input that arrives misaligned runs the plan unbound from then on."""
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    storage = torch.randn(64, dtype=torch.float64)
    for step, offset in enumerate((0, 6, 1, 2)):  # 0 and 48 bytes keep 16-byte alignment, 8 does not
        x = storage[offset : offset + 24].view(4, 6)
        loss = (x * w).sin().sum()  # the multiplication saves x, which a kernel reads
        with gpuautograd_reports() as messages:
            gpuautograd.backward(loss, backend=REPLAY)
        if step == 2:
            assert len(messages) == 1 and re.search("not graphed.*lost the 16-byte alignment", messages[0]), messages
        else:
            assert not messages
        assert_close(w.grad, ((x * w).cos() * x).sum(0))
        w.grad = None
    assert gpuautograd.stats()["replays"] == 1


def test_a_warm_up_failure_runs_the_plain_fused_plan_and_says_so(monkeypatch):
    from gpuautograd.codegen import compile as compile_module

    def broken(ks, interpret):
        raise RuntimeError("injected: the compiler rejected the kernel")

    monkeypatch.setattr(compile_module, "launchable", broken)
    model = rc.mlp(CPU)
    x = CPU.randn(4, 6)
    with gpuautograd_reports() as messages:
        gpuautograd.backward(rc.loss_of(model, x), backend=REPLAY)
    assert any("not graphed (the warm-up failed: RuntimeError: injected" in m for m in messages), messages
    assert any("its instructions run as reference torch ops" in m for m in messages), messages
    for mine, expected in zip(rc.grads(model), rc.eager_grads(model, x)):
        assert_close(mine, expected)  # the plain plan's kernels fall back to reference ops too
    assert gpuautograd.stats()["not_graphed"]


def test_concurrent_backwards_of_one_bound_plan_match_eager():
    s = rc.concurrent_backwards_share_one_plan(CPU, threads=4, calls=6)
    (program,) = rc.bound_programs()  # one plan served every thread
    # each thread's model has its own weights: the first one at a new address re-binds the plan once
    recaptures = sum(r.startswith("recapture") for r in s["miss_reasons"])
    assert program.replays == s["replays"] and s["replays"] + recaptures == 4 * 6, s


def test_concurrent_backwards_on_the_reference_backend_match_eager():
    s = rc.concurrent_backwards_share_one_plan(rc.Where("reference", "cpu", torch.float64), threads=6, calls=20)
    assert s["cached_programs"] >= 1 and s["cache_hits"] >= 6 * 20
