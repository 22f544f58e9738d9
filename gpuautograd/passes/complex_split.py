"""Complex arithmetic as pairs of reals, for the fused backends.

Triton has no complex type, so a kernel cannot load, compute or store a complex value. This pass
rewrites every complex instruction that has a real-pair form (arithmetic, conjugation, parts,
`where`, casts, `exp`, `==` / `!=`, layout ops, sums, scatters into slices) into the same work on a
real part and an imaginary part, which fuse like any real values. A complex value crosses into
pairs through `view_as_real` (a view on the host: the kernel reads the interleaved pairs through
their strides) and back through `view_as_complex` of the two parts stacked on a last dim of 2
(written by the kernel, viewed on the host), only where a library call (an FFT, a matmul), an
opaque node or a program output needs the complex tensor itself.

An imaginary part known to be zero (a real operand, a real constant) is None here and costs
nothing; the reference executor never sees this pass.
"""

from __future__ import annotations

from ..ir.builder import Builder
from ..ir.complex_ops import real_dtype
from ..ir.program import Instr, Program, Value

LAYOUT = {"reshape", "permute", "expand", "slice", "select", "flip"}
SCATTERS = {"slice_scatter", "select_scatter"}


def _is_complex(x) -> bool:
    return isinstance(x, complex) or (isinstance(x, Value) and hasattr(x.type, "dtype") and x.dtype.is_complex)


def has_complex(program: Program) -> bool:
    return any(_is_complex(o) for i in program.instrs for o in i.outputs if o is not None)


class _Splitter:
    def __init__(self, program: Program) -> None:
        self.b = Builder()
        self.b.program.inputs = list(program.inputs)
        self.subst: dict[int, Value] = {}  # old value -> its new value (real values; complex values kept whole)
        self.pairs: dict[int, tuple] = {}  # old complex value -> (re, im) new real values, im None when 0
        self.whole: dict[int, Value] = {}  # old complex value -> a new complex value

    # -- crossing between whole complex tensors and pairs -----------------------------------
    def pair(self, x) -> tuple:
        """(re, im) of an operand; im None where it is known to be 0."""
        if isinstance(x, complex):
            return x.real, (x.imag or None)
        if not _is_complex(x):
            return (self.subst.get(id(x), x) if isinstance(x, Value) else x), None
        if id(x) not in self.pairs:
            b = self.b
            interleaved = b.emit("view_as_real", self.whole[id(x)])
            self.pairs[id(x)] = (b.select(interleaved, -1, 0), b.select(interleaved, -1, 1))
        return self.pairs[id(x)]

    def materialize(self, x) -> Value:
        """The whole complex tensor of an old complex value."""
        if id(x) not in self.whole:
            b = self.b
            re, im = self.pairs[id(x)]
            im = im if im is not None else b.full(re.shape, 0.0, re.dtype, re.device)
            stacked = b.cat([b.unsqueeze(re, re.ndim), b.unsqueeze(im, im.ndim)], re.ndim)
            self.whole[id(x)] = b.emit("view_as_complex", stacked)
        return self.whole[id(x)]

    def operand(self, x):
        """An operand for an instruction that is copied as it is."""
        if isinstance(x, Value):
            return self.materialize(x) if _is_complex(x) else self.subst.get(id(x), x)
        return x

    # -- pair arithmetic (None is an exact zero) --------------------------------------------
    def add(self, a, c):
        if a is None:
            return c
        return a if c is None else self.b.add(a, c)

    def sub(self, a, c):
        if c is None:
            return a
        return self.b.neg(c) if a is None else self.b.sub(a, c)

    def mul(self, a, c):
        return None if a is None or c is None else self.b.mul(a, c)

    def split(self, instr: Instr) -> tuple | None:
        """The (re, im) of the instruction's one output, or None where it has no pair form."""
        b, op, attrs = self.b, instr.op, instr.attrs
        out = instr.outputs[0]
        if op in LAYOUT or op == "sum":
            re, im = self.pair(instr.inputs[0])
            attrs = dict(attrs)
            if op == "sum" and attrs.get("dtype") is not None:
                attrs["dtype"] = real_dtype(attrs["dtype"])
            return b.emit(op, re, **attrs), (None if im is None else b.emit(op, im, **attrs))
        if op == "full":
            value = complex(attrs["value"])
            dtype = real_dtype(attrs["dtype"])
            im = b.full(attrs["shape"], value.imag, dtype, attrs["device"]) if value.imag else None
            return b.full(attrs["shape"], value.real, dtype, attrs["device"]), im
        if op in SCATTERS:
            (br, bi), (sr, si) = self.pair(instr.inputs[0]), self.pair(instr.inputs[1])
            if bi is None and si is None:
                return b.emit(op, br, sr, **attrs), None
            bi = bi if bi is not None else b.full(br.shape, 0.0, br.dtype, br.device)
            si = si if si is not None else b.full(sr.shape, 0.0, sr.dtype, sr.device)
            return b.emit(op, br, sr, **attrs), b.emit(op, bi, si, **attrs)
        if op == "cat":
            parts = [self.pair(x) for x in instr.inputs]
            res = b.cat([re for re, _ in parts], **attrs)
            if all(im is None for _, im in parts):
                return res, None
            ims = [im if im is not None else b.full(re.shape, 0.0, re.dtype, re.device) for re, im in parts]
            return res, b.cat(ims, **attrs)
        if op == "where":
            cond = self.operand(instr.inputs[0])
            (ar, ai), (cr, ci) = self.pair(instr.inputs[1]), self.pair(instr.inputs[2])
            im = None if ai is None and ci is None else b.where(cond, 0.0 if ai is None else ai, 0.0 if ci is None else ci)
            return b.where(cond, ar, cr), im
        if op == "cast":
            re, im = self.pair(instr.inputs[0])
            dtype = real_dtype(attrs["dtype"])
            return b.cast(re, dtype), (None if im is None else b.cast(im, dtype))
        return self._arithmetic(op, [self.pair(x) for x in instr.inputs], out)

    def _arithmetic(self, op: str, pairs: list, out) -> tuple | None:
        b = self.b
        if op == "add":
            (ar, ai), (cr, ci) = pairs
            return b.add(ar, cr), self.add(ai, ci)
        if op == "sub":
            (ar, ai), (cr, ci) = pairs
            return b.sub(ar, cr), self.sub(ai, ci)
        if op == "mul":
            (ar, ai), (cr, ci) = pairs
            return self.sub(b.mul(ar, cr), self.mul(ai, ci)), self.add(self.mul(ar, ci), self.mul(ai, cr))
        if op == "div":
            (ar, ai), (cr, ci) = pairs
            if ci is None:
                return b.div(ar, cr), (None if ai is None else b.div(ai, cr))
            denominator = b.add(b.mul(cr, cr), b.mul(ci, ci))
            re = b.div(self.add(b.mul(ar, cr), self.mul(ai, ci)), denominator)
            im = b.div(self.sub(self.mul(ai, cr), b.mul(ar, ci)), denominator)
            return re, im
        if op == "neg":
            ((ar, ai),) = pairs
            return b.neg(ar), (None if ai is None else b.neg(ai))
        if op == "conj":
            ((ar, ai),) = pairs
            return ar, (None if ai is None else b.neg(ai))
        if op == "exp":
            ((ar, ai),) = pairs
            magnitude = b.exp(ar)
            return (magnitude, None) if ai is None else (b.mul(magnitude, b.cos(ai)), b.mul(magnitude, b.sin(ai)))
        if op == "complex":
            (ar, _), (cr, _) = pairs
            return ar, cr
        if op in ("eq", "ne"):
            (ar, ai), (cr, ci) = pairs
            compare, combine = (b.eq, b.logical_and) if op == "eq" else (b.ne, b.logical_or)
            parts = compare(ar, cr)
            if ai is not None or ci is not None:
                parts = combine(parts, compare(0.0 if ai is None else ai, 0.0 if ci is None else ci))
            return parts, None
        # (abs stays a library call: torch computes |z| as a hypot, and rules compare it with the
        # forward's |z| (a max norm's ties): the textbook sqrt(re^2 + im^2) can differ in the last bit)
        if op in ("real", "imag") and not out.dtype.is_complex:
            ((ar, ai),) = pairs
            if op == "real":
                return ar, None
            return (ai if ai is not None else b.full(ar.shape, 0.0, ar.dtype, ar.device)), None
        return None

    # -- the walk ---------------------------------------------------------------------------
    def run(self, program: Program) -> Program:
        b = self.b
        for v, _ in program.inputs:
            if _is_complex(v):
                self.whole[id(v)] = v
        for instr in program.instrs:
            b.origin = instr.origin
            touches = any(_is_complex(x) for x in (*instr.inputs, *instr.outputs))
            single = len(instr.outputs) == 1 and instr.outputs[0] is not None
            result = self.split(instr) if touches and single else None
            if result is not None:
                out = instr.outputs[0]
                re, im = result
                dtype = real_dtype(out.dtype)
                re = b.cast(re, dtype) if isinstance(re, Value) else re
                if out.dtype.is_complex:
                    self.pairs[id(out)] = (re, None if im is None else b.cast(im, dtype))
                else:
                    self.subst[id(out)] = re
                continue
            outs = b.copy(instr, [self.operand(x) for x in instr.inputs])
            for old, new in zip(instr.outputs, outs):
                if old is None:
                    continue
                if _is_complex(old):
                    self.whole[id(old)] = new
                else:
                    self.subst[id(old)] = new
        outputs = [(None if v is None else self.operand(v), spec) for v, spec in program.outputs]
        return Program(list(program.inputs), b.program.instrs, outputs, list(program.executed), list(program.declined))


def split_complex(program: Program) -> Program:
    """The program with complex arithmetic on pairs of reals (unchanged when nothing is complex)."""
    if not has_complex(program):
        return program
    return _Splitter(program).run(program)
