"""Complex values on the 'interpret' backend: complex arithmetic runs inside the generated kernels
as pairs of reals (passes/complex_split.py), FFTs and complex matmuls stay library calls, and every
gradient agrees with torch.autograd and with the reference executor."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import gpuautograd
from gpuautograd.ir.builder import Builder
from gpuautograd.ir.ops import POINTWISE, get_op
from gpuautograd.ir.program import InputSpec, OutputSpec, Value
from gpuautograd.ir.types import TensorType
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
    assert set(library) <= {"fft_c2c", "view_as_real", "view_as_complex", "abs"}, library  # abs: torch's hypot
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


def _evaluate(program, args):
    """Run a program op by op through the table's reference implementations."""
    env = {id(v): a for (v, _), a in zip(program.inputs, args)}
    for instr in program.instrs:
        out = get_op(instr.op).impl(*[env[id(x)] if isinstance(x, Value) else x for x in instr.inputs], **instr.attrs)
        for o, t in zip(out if isinstance(out, tuple) else (out,), instr.outputs):
            env[id(t)] = o
    return [env[id(v)] for v, _ in program.outputs]


def test_comparisons_of_complex_values_split_into_their_parts():
    b = Builder()
    t = TensorType((6,), torch.complex128, torch.device("cpu"))
    x, y = b.input(t, InputSpec("grad", 0, "x")), b.input(t, InputSpec("grad", 1, "y"))
    same, differ = b.eq(x, y), b.ne(x, b.mul(y, 1j))
    b.output(b.where(same, b.real(x), b.where(differ, b.emit("imag", y), -1.0)), OutputSpec("input", 0, "out"))
    split = split_complex(b.program)
    assert {"eq", "ne"} <= {i.op for i in split.instrs}
    assert not any(i.op in ("eq", "ne") and any(_complex(x) for x in i.inputs) for i in split.instrs)
    xs = torch.randn(6, dtype=torch.complex128)
    ys = xs.clone()
    ys[1::2] = torch.randn(3, dtype=torch.complex128)
    ys[2] = xs[2].real.item()  # equal real parts only
    ys[4] = xs[4] / 1j  # y * 1j == x there
    (expected,), (actual,) = _evaluate(b.program, [xs, ys]), _evaluate(split, [xs, ys])
    torch.testing.assert_close(actual, expected)


def _complex(x) -> bool:
    return isinstance(x, Value) and x.dtype.is_complex
