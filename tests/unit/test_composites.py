"""Composite ops (ir/composite_ops.py): each one's aten kernel (what the reference executor runs)
and its decomposition (what the fused backends start from) give torch.autograd's gradients, in
float64, float32 and bfloat16; the verifier holds the decomposition to the composite's types."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from gpuautograd.ir.builder import Builder
from gpuautograd.ir.ops import COMPOSITE, OPS, get_op
from gpuautograd.ir.program import InputSpec
from gpuautograd.ir.types import TensorType
from gpuautograd.ir.verifier import VerifyError, verify
from gpuautograd.passes.decompose import decompose_composites
from gpuautograd.runtime import engine
from gpuautograd.runtime.reference import compile_reference
from tests.helpers import DTYPES, assert_close, rand


def _targets(shape, classes, ignore_index):
    t = torch.randint(0, classes, shape)
    t.view(-1)[::3] = ignore_index
    return t


def _nll(reduction, weighted, spatial=False):
    def fn(x, w):
        logp = F.log_softmax(x, 1)
        target = _targets((3, 4, 5) if spatial else (7,), 9, ignore_index=2)
        return F.nll_loss(logp, target, weight=w if weighted else None, ignore_index=2, reduction=reduction)

    def inputs(dtype):
        x = rand(3, 9, 4, 5, dtype=dtype) if spatial else rand(7, 9, dtype=dtype)
        return x, torch.rand(9, dtype=dtype) + 0.5

    return fn, inputs


def _layer_norm(affine: int):
    """Layer norm with `affine` of (weight, bias) given: 0, 1 (weight only) or 2."""

    def fn(x, *params):
        return F.layer_norm(x, (13,), *params, *(None,) * (2 - affine))

    return fn, lambda d: (rand(3, 7, 13, dtype=d, noncontiguous=True), *(rand(13, dtype=d) for _ in range(affine)))


def _unary(f, shape=(7, 13)):
    return (lambda x: f(x)), (lambda d: (rand(*shape, dtype=d, noncontiguous=True),))


def _mse(reduction):
    return (lambda x, y: F.mse_loss(x, y, reduction=reduction)), (lambda d: (rand(5, 9, dtype=d), rand(5, 9, dtype=d)))


def _index_add(dim):
    """index_add's source gradient: the gradient's slices at the index (repeated ones included)."""
    index = torch.tensor([4, 0, 2, 2, 3, 1, 4, 4])

    def fn(base, source):
        return base.index_add(dim, index, source, alpha=1.5)

    shape = [7, 5]
    source_shape = list(shape)
    source_shape[dim] = len(index)
    return fn, lambda d: (rand(*shape, dtype=d), rand(*source_shape, dtype=d, noncontiguous=True))


# (case id, composite op, graph, inputs for a dtype)
CASES = [
    ("gelu", "gelu_backward", *_unary(F.gelu)),
    ("gelu_3d", "gelu_backward", *_unary(F.gelu, (3, 7, 13))),
    ("gelu_column", "gelu_backward", *_unary(F.gelu, (13, 1))),
    ("gelu_tanh", "gelu_backward", *_unary(lambda x: F.gelu(x, approximate="tanh"))),
    ("silu", "silu_backward", *_unary(F.silu)),
    ("sigmoid", "sigmoid_backward", *_unary(torch.sigmoid)),
    ("tanh", "tanh_backward", *_unary(torch.tanh)),
    ("relu", "threshold_backward", *_unary(F.relu)),
    ("threshold", "threshold_backward", *_unary(lambda x: F.threshold(x, 0.25, -1.0))),
    ("softmax", "softmax_backward", *_unary(lambda x: F.softmax(x, -1), (3, 7, 13))),
    ("softmax_dim0", "softmax_backward", *_unary(lambda x: F.softmax(x, 0))),
    ("log_softmax", "log_softmax_backward", *_unary(lambda x: F.log_softmax(x, 1), (3, 7, 13))),
    ("layer_norm", "layer_norm_backward", *_layer_norm(2)),
    ("layer_norm_weight_only", "layer_norm_backward", *_layer_norm(1)),
    ("layer_norm_no_affine", "layer_norm_backward", *_layer_norm(0)),
    ("nll_mean_weighted", "nll_loss_backward", *_nll("mean", True)),
    ("nll_sum", "nll_loss_backward", *_nll("sum", False)),
    ("nll_none", "nll_loss_backward", *_nll("none", True)),
    ("nll_2d", "nll_loss_backward", *_nll("mean", True, spatial=True)),
    ("mse_mean", "mse_loss_backward", *_mse("mean")),
    ("mse_sum", "mse_loss_backward", *_mse("sum")),
    ("mse_none", "mse_loss_backward", *_mse("none")),
    ("index_add_dim0", "index_select", *_index_add(0)),
    ("index_add_dim1", "index_select", *_index_add(1)),
]

# bfloat16 layer norm keeps its float32 decomposition on the reference path (see composite_ops)
DECOMPOSED_IN_BF16 = {"layer_norm_backward"}


def _capture(out, wrt, grad_out):
    """The reference executor's program for grad(out, wrt, grad_out), and its argument list."""
    w, _key, roots, inputs = engine.prepare([out], [grad_out], list(wrt), False, "reference")
    entry = engine.build_entry(w, [grad_out], roots, inputs, False)
    args = [w.saved[i] if kind == "saved" else grad_out if kind == "grad" else w.nodes[i] for kind, i in entry.arg_plan]
    return entry.program, args


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_composite_and_decomposition_match_torch_autograd(case, dtype):
    _id, op, fn, make = case
    torch.manual_seed(0)
    inputs = make(dtype)
    wrt = [x for x in inputs if x.requires_grad]
    out = fn(*inputs)
    grad_out = torch.randn_like(out)
    expected = torch.autograd.grad([out], wrt, [grad_out], retain_graph=True)

    program, args = _capture(out, wrt, grad_out)
    ops = [i.op for i in program.instrs]
    if dtype == torch.bfloat16 and op in DECOMPOSED_IN_BF16:
        assert op not in ops, f"{op} should keep its decomposition in bfloat16\n{program}"
    else:
        assert op in ops, f"the rule did not emit {op}\n{program}"
    decomposed = decompose_composites(program)
    assert not any(get_op(i.op).kind == COMPOSITE for i in decomposed.instrs), decomposed
    verify(decomposed)

    for how, p in (("composite", program), ("decomposed", decomposed)):
        got = compile_reference(p)(list(args))
        for k, (a, e) in enumerate(zip(got, expected)):
            assert a.dtype == e.dtype and a.shape == e.shape, f"{how}: input {k} {a.dtype}{list(a.shape)} vs {e.dtype}{list(e.shape)}"
            assert_close(a, e, msg=f"{how} {op}: gradient of input {k}\n{p}")


@pytest.mark.parametrize("shape", [(2, 5, 7), (7, 13), (5, 1), (9,)])
def test_gelu_backward_has_atens_layout(shape):
    # float32 CPU inputs reach aten's own kernel through transposed views (not oneDNN's call)
    g, x = torch.randn(shape), torch.randn(shape)
    got = get_op("gelu_backward").impl(g, x, approximate="none")
    expected = torch.ops.aten.gelu_backward(g, x)
    assert got.stride() == expected.stride() and got.dtype == expected.dtype
    assert_close(got, expected)


def test_decomposition_renumbers_values_in_order():
    x, w = rand(7, 13), rand(13)
    out = F.layer_norm(F.gelu(x), (13,), w, None)
    program, _ = _capture(out, [x, w], torch.randn_like(out))
    decomposed = decompose_composites(program)
    ids = [o.id for i in decomposed.instrs for o in i.outputs if o is not None]
    assert ids == list(range(len(ids))), "computed values are numbered 0, 1, 2, ... in program order"
    assert decompose_composites(decomposed) is decomposed, "a program without composites passes through"


def test_composite_that_does_not_apply_is_written_out():
    # softmax's kernel wants the gradient in the result's dtype; a mismatch gets the decomposition
    b = Builder()
    g = b.input(TensorType((4, 5), torch.float64, torch.device("cpu")), InputSpec("grad", 0))
    y = b.input(TensorType((4, 5), torch.float32, torch.device("cpu")), InputSpec("saved", 0))
    from gpuautograd.ir import composite_ops

    out = composite_ops.emit(b, "softmax_backward", g, y, dim=1)
    assert "softmax_backward" not in [i.op for i in b.program.instrs]
    assert out.dtype == torch.float32


def test_verifier_rejects_a_decomposition_of_another_type(monkeypatch):
    x = rand(4, 6)
    out = torch.tanh(x)
    program, _ = _capture(out, [x], torch.randn_like(out))
    verify(program)
    real = OPS["tanh_backward"]

    def wrong(b, grad, result):
        return b.cast(real.decompose(b, grad, result), torch.float32)

    monkeypatch.setitem(OPS, "tanh_backward", dataclasses.replace(real, decompose=wrong))
    with pytest.raises(VerifyError, match="its decomposition infers"):
        verify(program)
