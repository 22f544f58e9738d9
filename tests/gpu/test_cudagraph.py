"""GPU tier for the "cudagraph" backend: the bound plan captured into CUDA graphs and replayed.

Skipped without CUDA. The replay hazards are the ones tests/interpret/test_replay.py runs on CPU
(tests/replay_cases.py); here they run on real graphs, plus what only CUDA has: graph counts,
streams, and a host that runs ahead of the GPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import gpuautograd
from bench.models import SUITE
from tests import replay_cases as rc
from tests.helpers import assert_close, train_side_by_side

GPU = rc.Where("cudagraph", "cuda", torch.float32)


@pytest.mark.parametrize("case", rc.CASES, ids=lambda c: c.__name__)
def test_replay_hazard(case):
    case(GPU)


def test_dtype_change_gets_its_own_graph():
    rc.dtype_change_gets_its_own_plan(GPU, torch.float64)
    assert gpuautograd.stats()["graph_captures"] == 2


@pytest.mark.parametrize("fn", [rc.Double, rc.PassThrough], ids=lambda f: f.__name__)
def test_opaque_node_splits_the_graph_into_two(fn):
    program = rc.opaque_node_splits_the_plan_into_segments(GPU, fn)
    assert program.graphs == 2


def test_number_of_graphs_is_bounded(monkeypatch):
    rc.number_of_bound_plans_is_bounded(GPU, monkeypatch)
    assert sum(p.graphs for p in rc.bound_programs()) <= 2
    assert gpuautograd.stats()["graph_captures"] == 6


def test_auto_is_cudagraph_on_cuda():
    x = torch.randn(7, 13, device="cuda", requires_grad=True)
    assert gpuautograd.explain((x.sin() * x).sum()).backend == "cudagraph"


@pytest.mark.parametrize("name", [*sorted(SUITE), "gpt-ckpt"])  # gpt-ckpt: checkpointed nodes run between graphs
def test_suite_models_train_like_eager(name):
    train_side_by_side(name, torch.float32, steps=4, backend="cudagraph", device="cuda")
    (program,) = rc.bound_programs()
    assert program.graphs >= 1 and program.replays == 3


@pytest.mark.parametrize("name", ["mlp", "gpt-manual-attn", "cnn"])
def test_identical_to_the_unbound_triton_backend(name, monkeypatch):
    """The graph replays the same kernels and library calls as the "triton" backend runs, so the
    gradients are equal bit for bit. (Models whose library calls are deterministic: the fused
    attention backward accumulates with atomics, so sdpa models differ run to run even in eager;
    cuDNN is asked for deterministic convolution algorithms.)"""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    rc.bitwise_equal_to_the_unbound_plan(GPU, name, "triton")


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama"])
def test_table_matmul_binding_trains_like_eager(name, monkeypatch):
    monkeypatch.setenv("GPUAUTOGRAD_EXTERN_BINDING", "table")
    train_side_by_side(name, torch.float32, steps=3, backend="cudagraph", device="cuda")
    (program,) = rc.bound_programs()
    assert "through the table" in program.source and program.graphs >= 1


def test_one_capture_then_replays():
    model = rc.mlp(GPU)
    for _ in range(5):
        GPU.backward(rc.loss_of(model, GPU.randn(8, 6)))
    st = gpuautograd.stats()
    assert st["graph_captures"] == 1 and st["replays"] == 4 and st["captures"] == 1


def test_host_running_ahead_of_the_gpu():
    """Many backwards queued without a synchronization: each must read its own addresses, so a
    pinned table buffer is never rewritten while its copy is still queued."""
    model = rc.mlp(GPU)
    GPU.backward(rc.loss_of(model, GPU.randn(64, 6)))
    model.zero_grad(set_to_none=True)
    xs = [GPU.randn(64, 6) for _ in range(12)]
    got = []
    torch.cuda._sleep(100_000_000)  # keep the GPU busy, so the host really runs ahead of it
    for x in xs:
        GPU.backward(rc.loss_of(model, x))
        got.append([g.clone() for g in rc.grads(model)])  # queued on the stream, no sync
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    for x, mine in zip(xs, got):
        for a, e in zip(mine, rc.eager_grads(model, x)):
            GPU.close(a, e)


def test_backward_on_another_stream():
    model = rc.mlp(GPU)
    GPU.backward(rc.loss_of(model, GPU.randn(8, 6)))
    model.zero_grad(set_to_none=True)
    side = torch.cuda.Stream()
    for stream in (side, torch.cuda.current_stream(), side):
        x = GPU.randn(8, 6)
        stream.wait_stream(torch.cuda.current_stream())
        torch.cuda._sleep(50_000_000)  # the last replay is still queued when the stream changes
        with torch.cuda.stream(stream):
            GPU.backward(rc.loss_of(model, x))
        torch.cuda.current_stream().wait_stream(stream)
        for a, e in zip(rc.grads(model), rc.eager_grads(model, x)):
            GPU.close(a, e)
        model.zero_grad(set_to_none=True)
    assert gpuautograd.stats()["replays"] == 3


def test_no_activation_is_copied_for_generated_kernels():
    """Only library inputs are mirrored: a pointwise-only backward has no copy step at all."""
    x = torch.randn(4096, device="cuda", requires_grad=True)
    report = gpuautograd.explain((x.sin() * x.exp()).sum())
    assert "CI" not in report.source and report.launches == len(report.kernels)
    for _ in range(3):
        x = torch.randn(4096, device="cuda", requires_grad=True)
        GPU.backward((x.sin() * x.exp()).sum())
        assert_close(x.grad, x.cos() * x.exp() + x.sin() * x.exp(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("streams", ["current stream", "a stream per thread"])
def test_concurrent_backwards_of_one_graph_match_eager(streams):
    in_thread = (lambda: torch.cuda.stream(torch.cuda.Stream())) if streams == "a stream per thread" else contextlib.nullcontext
    s = rc.concurrent_backwards_share_one_plan(GPU, threads=4, calls=10, in_thread=in_thread)
    (program,) = rc.bound_programs()
    recaptures = sum(r.startswith("recapture") for r in s["miss_reasons"])
    assert program.replays == s["replays"] and s["replays"] + recaptures == 4 * 10, s


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_the_native_short_path_replays_through_its_replay_plan(name, monkeypatch):
    from gpuautograd import native

    monkeypatch.delenv("GPUAUTOGRAD_NATIVE", raising=False)
    if native.load() is None:
        pytest.skip(f"the native walker is unavailable: {native.reason()}")
    rc.native_replay_delivers_like_eager(GPU, name, monkeypatch)
