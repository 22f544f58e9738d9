"""GPU tier for the "triton" backend: the generated kernels compiled by Triton's JIT on CUDA.

Skipped without CUDA. The same plans run in Triton's interpreter in tests/interpret; here the
compiled kernels must give torch.autograd's gradients too, with no kernel falling back.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from bench.models import SUITE
from tests.helpers import assert_close

DEVICE = "cuda"


def _eager_and_ours(name, dtype, backend="triton", **kw):
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name](dtype=dtype, device=DEVICE, **kw)
    eager = copy.deepcopy(model)
    batch = make_batch(torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a kernel falling back must fail the test
        torch.manual_seed(7)
        gpuautograd.backward(loss_fn(model, *batch), backend=backend)
    torch.manual_seed(7)
    loss_fn(eager, *batch).backward()
    return model, eager


@pytest.mark.parametrize("name", sorted(SUITE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_model_suite_matches_eager(name, dtype):
    model, eager = _eager_and_ours(name, dtype)
    for (pname, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), pname
        if q.grad is not None:
            assert_close(p.grad, q.grad, msg=f"{name}: grad of {pname}")


def test_auto_picks_cudagraph_on_cuda():
    x = torch.randn(7, 13, device=DEVICE, requires_grad=True)
    assert gpuautograd.explain((x.sin() * x).sum()).backend == "cudagraph"


def test_odd_sizes_and_a_looped_reduction():
    for shape in [(1,), (7,), (33, 65), (1823, 781), (3, 20000)]:
        x = torch.randn(*shape, device=DEVICE, requires_grad=True)
        w = torch.randn(shape[-1], device=DEVICE, requires_grad=True)
        loss = (F.softmax(x * w, -1) * torch.randn(*shape, device=DEVICE)).sum()
        ours = gpuautograd.grad(loss, (x, w), retain_graph=True, backend="triton")
        theirs = torch.autograd.grad(loss, (x, w))
        for a, e in zip(ours, theirs):
            assert_close(a, e, msg=str(shape))


def test_compiled_kernels_agree_with_the_interpreter():
    model, make_batch, loss_fn = SUITE["llama"](dtype=torch.float64)
    batch = make_batch(torch.Generator().manual_seed(0))
    cpu = gpuautograd.grad(loss_fn(model, *batch), list(model.parameters()), backend="interpret")
    gpu_model = copy.deepcopy(model).to(DEVICE)
    gpu = gpuautograd.grad(loss_fn(gpu_model, *(b.to(DEVICE) for b in batch)), list(gpu_model.parameters()), backend="triton")
    for a, e in zip(gpu, cpu):
        assert_close(a.cpu(), e)


@pytest.mark.parametrize(
    "case,dtype",
    [("squared_error", torch.float32), ("squared_error", torch.bfloat16), ("fused_qkv", torch.bfloat16), ("scaled_norm", torch.float32)],
    ids=str,
)
def test_generated_matmuls_with_prologues_and_partial_sums(case, dtype, monkeypatch):
    """Matmuls that compute an operand as they load it, or add their product up in the tiles
    (tests/interpret/test_matmul_prologue.py), compiled for the GPU: torch's gradients."""
    from gpuautograd.fusion import heuristics as H
    from tests.interpret import test_matmul_prologue as cases

    monkeypatch.setattr(H, "MATMUL_EPILOGUES", "always")
    torch.manual_seed(0)
    m, k, n = 300, 70, 3 * 43

    def leaf(*shape, grad=True):
        return (torch.randn(*shape, device=DEVICE) * shape[0] ** -0.5).to(dtype).requires_grad_(grad)

    if case == "scaled_norm":
        inputs, fn = [leaf(k), leaf(k, n), leaf(m, k, grad=False)], cases.scaled_norm
    else:
        inputs, fn = [leaf(m, k), leaf(k, n)], getattr(cases, case)
    out = fn(*inputs)
    g = torch.randn_like(out)
    assert any(s.startswith("matmul[") for s in (kern.space for kern in gpuautograd.explain([out], [g], backend="triton").kernels))
    wrt = [x for x in inputs if x.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a kernel falling back must fail the test
        ours = gpuautograd.grad([out], wrt, [g], retain_graph=True, backend="triton")
    for a, e in zip(ours, torch.autograd.grad([out], wrt, [g])):
        assert_close(a, e, msg=case)
