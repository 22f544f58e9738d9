"""Complex values on the 'interpret' backend: complex arithmetic runs inside the generated kernels
as pairs of reals (passes/complex_split.py), FFTs and complex matmuls stay library calls, and every
gradient agrees with torch.autograd and with the reference executor."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import gpuautograd
from gpuautograd.ir.ops import POINTWISE, get_op
from gpuautograd.passes.complex_split import split_complex
from tests.helpers import check_grads, params, rand, run_case
from tests.unit.test_rules_complex import CASES

BACKEND = "interpret"

pytestmark = [
    pytest.mark.filterwarnings("error:gpuautograd falls back"),
    pytest.mark.filterwarnings("error:gpuautograd. kernel:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning"),  # numpy, on lanes a tl.where discards
]

# One dtype per case keeps the tier quick: complex128 for complex leaves, float64 for real ones.
WIDE = [dataclasses.replace(c, dtypes=tuple(d for d in c.dtypes if d in (torch.complex128, torch.float64))[:1]) for c in CASES]


@pytest.mark.parametrize("case,dtype", params(WIDE))
def test_complex_rule_on_interpret(case, dtype):
    run_case(case, dtype, backend=BACKEND)


def _library_ops(plan: str) -> list[str]:
    """The IR op of each library call in a fused plan's source."""
    return re.findall(r"# library: %\d+(?:, [%_\w]+)* = (\w+)", plan)


def test_complex_arithmetic_is_generated_inside_kernels():
    x, w = rand(4, 9), rand(5, dtype=torch.complex128)

    def fn(x, w):
        return (torch.fft.rfft(x) * w).exp().abs().log()

    check_grads(fn, x, w, backend=BACKEND)
    report = gpuautograd.explain([fn(x, w)], [torch.randn(4, 5, dtype=torch.float64)], backend=BACKEND)
    library = _library_ops(report.plan)
    assert set(library) <= {"fft_c2c", "view_as_real", "view_as_complex"}, library
    assert library.count("fft_c2c") == 1 and len(report.kernels) >= 1


def test_the_split_leaves_no_complex_pointwise_instruction():
    x, w = rand(3, 8), rand(5, dtype=torch.complex128)
    out = (torch.fft.rfft(x) * w / (w + 2j)).conj().exp().real
    program = gpuautograd.explain([out], [torch.randn(3, 5, dtype=torch.float64)]).program
    assert any(o.dtype.is_complex for i in program.instrs for o in i.outputs if o is not None and get_op(i.op).kind == POINTWISE)
    split = split_complex(program)
    complex_pointwise = [i.op for i in split.instrs if get_op(i.op).kind == POINTWISE and any(o.dtype.is_complex for o in i.outputs)]
    assert complex_pointwise == []
    # complex values cross into pairs once each, where a library call made them
    crossings = [i for i in split.instrs if i.op == "view_as_real"]
    assert len({id(i.inputs[0]) for i in crossings}) == len(crossings)


def test_a_real_program_is_left_alone():
    x = rand(3, 4)
    program = gpuautograd.explain((x.exp() * 2).sum()).program
    assert split_complex(program) is program
