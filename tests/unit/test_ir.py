"""The IR: builder type inference, printer (golden), verifier errors, and the op table."""

import pytest
import torch

from gpuautograd.ir.builder import Builder, IRError
from gpuautograd.ir.ops import OPS
from gpuautograd.ir.program import InputSpec, Instr, OutputSpec
from gpuautograd.ir.types import TensorType
from gpuautograd.ir.verifier import VerifyError, verify

CPU = torch.device("cpu")


def f32(*shape):
    return TensorType(shape, torch.float32, CPU)


def small_program():
    b = Builder()
    g = b.input(f32(), InputSpec("grad", 0, "grad_output0"))
    x = b.input(f32(4, 5), InputSpec("saved", 0, "MulBackward0.self"))
    b.origin = "SumBackward0"
    e = b.expand(g, (4, 5))
    b.origin = "MulBackward0"
    y = b.mul(e, x)
    z = b.mul(y, 0.5)
    s = b.sum(z, dims=1, keepdim=True)
    b.output(s, OutputSpec("leaf", 3, "leaf3.grad"))
    return b.program


GOLDEN = """\
def backward(
    %g0: f32[] = grad_output0,
    %s0: f32[4, 5] = MulBackward0.self,
):
  %0 = expand %g0 {shape=(4, 5)} : f32[4, 5]  # SumBackward0
  %1 = mul %0, %s0 : f32[4, 5]  # MulBackward0
  %2 = mul %1, 0.5 : f32[4, 5]  # MulBackward0
  %3 = sum %2 {dims=(1,), keepdim=True} : f32[4, 1]  # MulBackward0
  return {leaf3.grad: %3}"""


def test_printer_golden():
    assert str(small_program()) == GOLDEN


def test_builder_infers_promotion_and_broadcast():
    b = Builder()
    x = b.input(f32(3, 1), InputSpec("saved", 0))
    y = b.input(TensorType((1, 4), torch.float64, CPU), InputSpec("saved", 1))
    z = b.add(x, y)
    assert z.shape == (3, 4) and z.dtype == torch.float64
    assert b.mul(x, 2).dtype == torch.float32  # a Python scalar does not promote
    assert b.gt(x, 0.0).dtype == torch.bool
    half = b.input(TensorType((3,), torch.bfloat16, CPU), InputSpec("saved", 2))
    scalar64 = b.input(TensorType((), torch.float64, CPU), InputSpec("saved", 3))
    assert b.mul(half, scalar64).dtype == torch.bfloat16  # a 0-dim tensor is weak too


def test_builder_sum_to_reduces_broadcast_dims():
    b = Builder()
    x = b.input(f32(2, 3, 4), InputSpec("saved", 0))
    assert b.sum_to(x, (3, 1)).shape == (3, 1)
    assert b.sum_to(x, (2, 3, 4)) is x
    with pytest.raises(IRError, match="fewer dims"):
        b.sum_to(b.input(f32(4), InputSpec("saved", 1)), (2, 4))


def test_builder_reports_bad_types_with_context():
    b = Builder()
    b.origin = "MmBackward0"
    x = b.input(f32(2, 3), InputSpec("saved", 0))
    with pytest.raises(IRError, match=r"mm\(f32\[2, 3\], f32\[2, 3\]\).*MmBackward0"):
        b.mm(x, x)


def test_verifier_accepts_built_program():
    verify(small_program())


def test_verifier_shows_window_around_bad_instruction():
    p = small_program()
    bad = p.instrs[2]
    # a recorded type that the op does not infer
    p.instrs[2] = Instr(bad.op, bad.inputs, bad.attrs, (type(bad.outputs[0])(99, f32(7), None),), bad.origin)
    with pytest.raises(VerifyError) as e:
        verify(p)
    text = str(e.value)
    assert "records types (f32[7]) but infers (f32[4, 5])" in text
    assert ">> %99 = mul %1, 0.5" in text  # the bad line is marked
    assert "%0 = expand" in text  # with context around it


def test_verifier_rejects_use_before_definition():
    p = small_program()
    p.instrs[0], p.instrs[1] = p.instrs[1], p.instrs[0]
    with pytest.raises(VerifyError, match="used before it is defined"):
        verify(p)


def test_every_op_has_reference_and_inference():
    for name, op in OPS.items():
        assert callable(op.impl), name
        assert callable(op.infer), name
        assert op.kind in {"pointwise", "reduction", "scan", "layout", "index", "creation", "extern", "opaque", "composite"}, name
        assert (op.kind == "composite") == callable(op.decompose), f"{name}: a composite, and only a composite, has a decomposition"
