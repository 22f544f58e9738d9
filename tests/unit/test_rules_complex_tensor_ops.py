"""Complex values through the tensor-op rules: norms, prod, logsumexp, dist, the scans,
pow, the inverse trigonometric / hyperbolic functions and the other unary math, var / std, the
multi-input pointwise ops, and the data-movement rules (repeat, rot90, roll, diagonals, masked
select, put / take, indexing, gather / scatter, unfold, im2col / col2im, padding, splits),
against torch.autograd on the reference executor.

Every case runs in complex128 and complex64, with odd sizes and, where a case has one, a
transposed (non-contiguous) leaf; run_case asserts that no node ran as the live node.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import Case, fixed, make, params, rand, run_case

COMPLEX = (torch.complex128, torch.complex64)


def cleaf(*shape, nc=False):
    """A maker of one random complex leaf (transposed storage when `nc`)."""
    return lambda dtype: (rand(*shape, dtype=dtype, noncontiguous=nc),)


def leaf(*shape, nc=False):
    return lambda dtype: rand(*shape, dtype=dtype, noncontiguous=nc)


def with_zeros(*shape, at, nc=False):
    """A complex leaf with exact zeros at the flat positions `at` (the prod / cumprod zero paths)."""

    def maker(dtype):
        x = rand(*shape, dtype=dtype, noncontiguous=nc).detach()
        flat = x.view(-1) if x.is_contiguous() else None
        if flat is None:
            x = x.contiguous()
            flat = x.view(-1)
        flat[list(at)] = 0
        return (x.requires_grad_(),)

    return maker


def index(*values):
    return torch.tensor(values, dtype=torch.long)


def mask(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > 0.5


def positions(high, *shape, seed=0):
    return torch.randint(high, shape, generator=torch.Generator().manual_seed(seed))


NORMS = [
    Case("vector_norm-2", "LinalgVectorNormBackward0", lambda x: torch.linalg.vector_norm(x), cleaf(5, 7, nc=True), COMPLEX),
    Case("vector_norm-1-dim", "LinalgVectorNormBackward0", lambda x: torch.linalg.vector_norm(x, 1, dim=1), cleaf(5, 7), COMPLEX),
    Case(
        "vector_norm-3-keepdim",
        "LinalgVectorNormBackward0",
        lambda x: torch.linalg.vector_norm(x, 3, dim=0, keepdim=True),
        cleaf(5, 7, nc=True),
        COMPLEX,
    ),
    Case("vector_norm-1.5", "LinalgVectorNormBackward0", lambda x: torch.linalg.vector_norm(x, 1.5, dim=(0, 2)), cleaf(3, 5, 7), COMPLEX),
    Case("vector_norm-0.5", "LinalgVectorNormBackward0", lambda x: torch.linalg.vector_norm(x, 0.5, dim=-1), cleaf(5, 7), COMPLEX),
    Case(
        "vector_norm-inf",
        "LinalgVectorNormBackward0",
        lambda x: torch.linalg.vector_norm(x, float("inf"), dim=1),
        cleaf(5, 7, nc=True),
        COMPLEX,
    ),
    Case(
        "vector_norm-0d",
        "LinalgVectorNormBackward0",
        lambda x: torch.linalg.vector_norm(x, 3),
        lambda d: (torch.randn((), dtype=d, requires_grad=True),),
        COMPLEX,
    ),
    Case("normalize", "LinalgVectorNormBackward0", lambda x: F.normalize(x, dim=1), cleaf(5, 7), COMPLEX),
    Case("norm-p", "NormBackward1", lambda x: torch.ops.aten.norm.ScalarOpt_dim(x, 2.5, [1]), cleaf(5, 7, nc=True), COMPLEX),
    Case(
        "dist-2",
        "DistBackward0",
        lambda x, y: torch.dist(x, y),
        lambda d: (rand(5, 7, dtype=d, noncontiguous=True), rand(5, 7, dtype=d)),
        COMPLEX,
    ),
    Case("dist-1-broadcast", "DistBackward0", lambda x, y: torch.dist(x, y, 1), lambda d: (rand(5, 7, dtype=d), rand(7, dtype=d)), COMPLEX),
    Case(
        "dist-inf",
        "DistBackward0",
        lambda x, y: torch.dist(x, y, float("inf")),
        lambda d: (rand(3, 5, dtype=d), rand(3, 5, dtype=d)),
        COMPLEX,
    ),
    Case("dist-3", "DistBackward0", lambda x, y: torch.dist(x, y, 3), lambda d: (rand(3, 5, dtype=d), rand(3, 5, dtype=d)), COMPLEX),
]

REDUCTIONS = [
    Case("prod", "ProdBackward0", torch.prod, cleaf(3, 5, nc=True), COMPLEX),
    Case("prod-one-zero", "ProdBackward0", torch.prod, with_zeros(3, 5, at=(7,)), COMPLEX),
    Case("prod-two-zeros", "ProdBackward0", torch.prod, with_zeros(3, 5, at=(2, 11)), COMPLEX),
    Case("prod-dim", "ProdBackward1", lambda x: x.prod(1), cleaf(5, 7, nc=True), COMPLEX),
    Case("prod-dim-keepdim-zeros", "ProdBackward1", lambda x: x.prod(0, keepdim=True), with_zeros(5, 7, at=(3, 8, 10)), COMPLEX),
    Case("logsumexp", "LogsumexpBackward0", lambda x: torch.logsumexp(x, 1), cleaf(5, 7, nc=True), COMPLEX),
    Case("logsumexp-dims-keepdim", "LogsumexpBackward0", lambda x: torch.logsumexp(x, (0, 2), keepdim=True), cleaf(3, 5, 7), COMPLEX),
    Case("var", "VarBackward0", lambda x: torch.var(x, 1), cleaf(5, 7, nc=True), COMPLEX),
    Case("var-all", "VarBackward0", torch.var, cleaf(5, 7), COMPLEX),
    Case("std-correction", "StdBackward0", lambda x: torch.std(x, 0, correction=0, keepdim=True), cleaf(5, 7, nc=True), COMPLEX),
    Case("var_mean", "VarMeanBackward0", lambda x: torch.var_mean(x, 1), cleaf(5, 7), COMPLEX),
    Case("std_mean", "StdMeanBackward0", lambda x: torch.std_mean(x, (0, 1)), cleaf(3, 5, 7), COMPLEX),
]

SCANS = [
    Case("cumsum", "CumsumBackward0", lambda x: x.cumsum(1), cleaf(5, 7, nc=True), COMPLEX),
    Case("cumsum-dim0", "CumsumBackward0", lambda x: x.cumsum(0), cleaf(5, 3), COMPLEX),
    Case("cumprod", "CumprodBackward0", lambda x: x.cumprod(1), cleaf(5, 7, nc=True), COMPLEX),
    Case("cumprod-zeros", "CumprodBackward0", lambda x: x.cumprod(1), with_zeros(3, 7, at=(2, 9, 11, 19)), COMPLEX),
    Case("logcumsumexp", "LogcumsumexpBackward0", lambda x: torch.logcumsumexp(x, 1), cleaf(5, 7, nc=True), COMPLEX),
    Case("logcumsumexp-dim0", "LogcumsumexpBackward0", lambda x: torch.logcumsumexp(x, 0), cleaf(5, 3), COMPLEX),
]

POW = [
    Case("pow-scalar", "PowBackward0", lambda x: x**3, cleaf(5, 7, nc=True), COMPLEX),
    Case("pow-fractional", "PowBackward0", lambda x: x**1.5, cleaf(7), COMPLEX),
    Case("pow-complex-exponent", "PowBackward0", lambda x: x ** (0.5 - 1.5j), cleaf(7), COMPLEX),
    Case("pow-square", "PowBackward0", torch.square, cleaf(3, 5), COMPLEX),
    Case("pow-tensor", "PowBackward1", torch.pow, lambda d: (rand(5, 3, dtype=d, noncontiguous=True), rand(5, 3, dtype=d)), COMPLEX),
    Case("pow-tensor-broadcast", "PowBackward1", torch.pow, lambda d: (rand(5, 3, dtype=d), rand(3, dtype=d)), COMPLEX),
    Case("pow-scalar-base", "PowBackward2", lambda e: torch.pow(2.5, e), cleaf(5, 3, nc=True), COMPLEX),
    Case("pow-negative-base", "PowBackward2", lambda e: torch.pow(-1.5, e), cleaf(7), COMPLEX),
    Case("pow-complex-base", "PowBackward2", lambda e: torch.pow(1 - 2j, e), cleaf(7), COMPLEX),
]

UNARY = [
    Case(name, node, fn, cleaf(3, 5, nc=True), COMPLEX)
    for name, node, fn in [
        ("tan", "TanBackward0", torch.tan),
        ("asin", "AsinBackward0", torch.asin),
        ("acos", "AcosBackward0", torch.acos),
        ("atan", "AtanBackward0", torch.atan),
        ("sinh", "SinhBackward0", torch.sinh),
        ("cosh", "CoshBackward0", torch.cosh),
        ("asinh", "AsinhBackward0", torch.asinh),
        ("acosh", "AcoshBackward0", torch.acosh),
        ("atanh", "AtanhBackward0", torch.atanh),
        ("exp2", "Exp2Backward0", torch.exp2),
        ("log2", "Log2Backward0", torch.log2),
        ("log10", "Log10Backward0", torch.log10),
        ("sgn", "SgnBackward0", torch.sgn),
        ("sinc", "SincBackward0", torch.sinc),
    ]
]

MULTI = [
    Case(
        "lerp-scalar",
        "LerpBackward0",
        lambda a, b: torch.lerp(a, b, 0.3),
        lambda d: (rand(5, 3, dtype=d), rand(5, 3, dtype=d, noncontiguous=True)),
        COMPLEX,
    ),
    Case(
        "lerp-tensor",
        "LerpBackward1",
        torch.lerp,
        lambda d: (rand(5, 3, dtype=d), rand(5, 3, dtype=d), rand(5, 3, dtype=d, noncontiguous=True)),
        COMPLEX,
    ),
    Case(
        "addcmul",
        "AddcmulBackward0",
        lambda a, b, c: torch.addcmul(a, b, c, value=0.5 - 2j),
        lambda d: (rand(5, 3, dtype=d), rand(5, 3, dtype=d), rand(3, dtype=d)),
        COMPLEX,
    ),
    Case(
        "addcdiv",
        "AddcdivBackward0",
        lambda a, b, c: torch.addcdiv(a, b, c, value=1 + 1j),
        lambda d: (rand(5, 3, dtype=d), rand(5, 3, dtype=d, noncontiguous=True), rand(5, 3, dtype=d)),
        COMPLEX,
    ),
    Case(
        "logaddexp",
        "LogaddexpBackward0",
        torch.logaddexp,
        lambda d: (rand(5, 3, dtype=d, noncontiguous=True), rand(5, 3, dtype=d)),
        COMPLEX,
    ),
    Case(
        "cross",
        "LinalgCrossBackward0",
        lambda a, b: torch.linalg.cross(a, b, dim=1),
        lambda d: (rand(5, 3, dtype=d), rand(5, 3, dtype=d, noncontiguous=True)),
        COMPLEX,
    ),
    Case(
        "cross-broadcast",
        "LinalgCrossBackward0",
        lambda a, b: torch.linalg.cross(a, b),
        lambda d: (rand(5, 3, dtype=d), rand(1, 3, dtype=d)),
        COMPLEX,
    ),
]

M57 = mask(5, 7)

LAYOUT = [
    Case("repeat", "RepeatBackward0", lambda x: x.repeat(2, 1, 3), cleaf(5, 3, nc=True), COMPLEX),
    Case("tile", "RepeatBackward0", lambda x: x.tile(3), cleaf(5), COMPLEX),
    Case("rot90", "Rot90Backward0", lambda x: torch.rot90(x, 1, (0, 1)), cleaf(5, 3, nc=True), COMPLEX),
    Case("rot90-k3", "Rot90Backward0", lambda x: torch.rot90(x, -1, (1, 2)), cleaf(3, 5, 7), COMPLEX),
    Case("roll", "RollBackward0", lambda x: torch.roll(x, (2, -1), (0, 1)), cleaf(5, 7, nc=True), COMPLEX),
    Case("roll-flat", "RollBackward0", lambda x: torch.roll(x, 4), cleaf(5, 3), COMPLEX),
    Case("fftshift", "RollBackward0", torch.fft.fftshift, cleaf(5, 7), COMPLEX),
    Case("flip", "FlipBackward0", lambda x: x.flip(0, 1), cleaf(5, 7, nc=True), COMPLEX),
    Case("diagonal", "DiagonalBackward0", lambda x: x.diagonal(1), cleaf(5, 7, nc=True), COMPLEX),
    Case("diagonal-dims", "DiagonalBackward0", lambda x: x.diagonal(-1, 0, 2), cleaf(5, 3, 7), COMPLEX),
    Case("diagonal_copy", "DiagonalBackward0_copy", lambda x: torch.diagonal_copy(x), cleaf(5, 7), COMPLEX),
    Case("diag_embed", "DiagEmbedBackward0", lambda x: torch.diag_embed(x, 1), cleaf(3, 5, nc=True), COMPLEX),
    Case(
        "diagonal_scatter", "DiagonalScatterBackward0", torch.diagonal_scatter, lambda d: (rand(5, 7, dtype=d), rand(5, dtype=d)), COMPLEX
    ),
    Case("trace", "TraceBackward0", torch.trace, cleaf(5, 5, nc=True), COMPLEX),
    Case("tril", "TrilBackward0", lambda x: x.tril(1), cleaf(5, 7, nc=True), COMPLEX),
    Case("triu", "TriuBackward0", lambda x: x.triu(-1), cleaf(5, 7), COMPLEX),
    Case("split", "SplitBackward0", lambda x: x.split(2, 1)[1], cleaf(5, 7, nc=True), COMPLEX),
    Case("split_with_sizes", "SplitWithSizesBackward0", lambda x: x.split([1, 4], 0)[0], cleaf(5, 3), COMPLEX),
    Case("unbind", "UnbindBackward0", lambda x: x.unbind(1)[2], cleaf(5, 3, nc=True), COMPLEX),
    Case("unfold", "UnfoldBackward0", lambda x: x.unfold(1, 3, 2), cleaf(5, 9, nc=True), COMPLEX),
    Case("reflection_pad", "ReflectionPad1DBackward0", lambda x: F.pad(x, (2, 3), mode="reflect"), cleaf(2, 3, 7), COMPLEX),
    Case("replication_pad", "ReplicationPad2DBackward0", lambda x: F.pad(x, (1, 2, 2, 0), mode="replicate"), cleaf(2, 5, 7), COMPLEX),
    Case("pixel_shuffle", "PixelShuffleBackward0", lambda x: F.pixel_shuffle(x, 2), cleaf(1, 8, 3, 5), COMPLEX),
    Case("block_diag", "BlockDiagBackward0", torch.block_diag, lambda d: (rand(2, 3, dtype=d), rand(3, dtype=d)), COMPLEX),
    Case("im2col", "Im2ColBackward0", lambda x: F.unfold(x, (2, 3), dilation=(1, 2), padding=1, stride=(2, 1)), cleaf(2, 3, 7, 9), COMPLEX),
    Case("col2im", "Col2ImBackward0", lambda x: F.fold(x, (5, 7), (2, 3), padding=1), cleaf(2, 12, 42, nc=True), COMPLEX),
    Case(
        "copy_",
        "torch::autograd::CopyBackwards",
        lambda x, y: x.clone().copy_(y),
        lambda d: (rand(5, 3, dtype=d), rand(3, dtype=d)),
        COMPLEX,
    ),
]

INDEXING = [
    Case("masked_select", "MaskedSelectBackward0", lambda x, m: x.masked_select(m), make(leaf(5, 7, nc=True), fixed(M57)), COMPLEX),
    Case("masked_select-broadcast", "MaskedSelectBackward0", lambda x, m: x.masked_select(m), make(leaf(7), fixed(M57)), COMPLEX),
    Case(
        "masked_scatter", "MaskedScatterBackward0", lambda x, m, s: x.masked_scatter(m, s), make(leaf(5, 7), fixed(M57), leaf(40)), COMPLEX
    ),
    Case("put", "PutBackward0", lambda x, i, s: x.put(i, s), make(leaf(5, 7, nc=True), fixed(index(3, 0, 34, 11)), leaf(4)), COMPLEX),
    Case(
        "put-accumulate",
        "PutBackward0",
        lambda x, i, s: x.put(i, s, accumulate=True),
        make(leaf(5, 7), fixed(index(3, 3, -1)), leaf(3)),
        COMPLEX,
    ),
    Case("take", "TakeBackward0", lambda x, i: x.take(i), make(leaf(5, 7, nc=True), fixed(positions(35, 3, 4))), COMPLEX),
    Case("index", "IndexBackward0", lambda x, i: x[i], make(leaf(5, 7, nc=True), fixed(index(0, 3, 3, -1))), COMPLEX),
    Case("index-mask", "IndexBackward0", lambda x, m: x[m], make(leaf(5, 7), fixed(M57)), COMPLEX),
    Case(
        "index_put",
        "IndexPutBackward0",
        lambda x, i, v: torch.index_put(x, (i,), v),
        make(leaf(5, 7), fixed(index(1, 4)), leaf(2, 7)),
        COMPLEX,
    ),
    Case(
        "index_select",
        "IndexSelectBackward0",
        lambda x, i: x.index_select(1, i),
        make(leaf(5, 7, nc=True), fixed(index(6, 0, 6, 2))),
        COMPLEX,
    ),
    Case(
        "index_add",
        "IndexAddBackward0",
        lambda x, i, s: x.index_add(0, i, s, alpha=2),
        make(leaf(5, 3), fixed(index(4, 0, 4)), leaf(3, 3)),
        COMPLEX,
    ),
    Case("gather", "GatherBackward0", lambda x, i: x.gather(1, i), make(leaf(5, 7, nc=True), fixed(positions(7, 5, 9))), COMPLEX),
    Case(
        "scatter",
        "ScatterBackward0",
        lambda x, i, s: x.scatter(1, i, s),
        make(leaf(5, 7), fixed(torch.tensor([[0, 3], [6, 1], [2, 5], [4, 0], [1, 2]])), leaf(5, 2)),
        COMPLEX,
    ),
    Case(
        "scatter-value",
        "ScatterBackward1",
        lambda x, i: x.scatter(0, i, 1.5),
        make(leaf(5, 7, nc=True), fixed(positions(5, 2, 7))),
        COMPLEX,
    ),
    Case(
        "scatter_add",
        "ScatterAddBackward0",
        lambda x, i, s: x.scatter_add(1, i, s),
        make(leaf(5, 7), fixed(positions(7, 5, 4)), leaf(5, 4)),
        COMPLEX,
    ),
]

CASES = NORMS + REDUCTIONS + SCANS + POW + UNARY + MULTI + LAYOUT + INDEXING


@pytest.mark.parametrize("case,dtype", params(CASES))
def test_complex_tensor_op_rule(case, dtype):
    run_case(case, dtype)


# Graphs from real leaves through complex values and back: the rules' gradients flow into real
# inputs, which keep the real part.
REAL_TO_COMPLEX = [
    Case(
        "prod-of-complex-from-real",
        "ProdBackward1",
        lambda x: torch.complex(x, x.flip(0)).prod(1),
        lambda d: (rand(5, 3, dtype=d),),
        (torch.float64, torch.float32),
    ),
    Case(
        "pow-real-base-complex-exponent",
        "PowBackward1",
        lambda x, e: torch.pow(x, e),
        lambda d: (rand(5, 3, dtype=d), rand(5, 3, dtype=torch.complex128)),
        (torch.float64,),
    ),
    Case(
        "vector_norm-of-fft",
        "LinalgVectorNormBackward0",
        lambda x: torch.linalg.vector_norm(torch.fft.fft(x), 3, dim=1),
        lambda d: (rand(3, 7, dtype=d, noncontiguous=True),),
        (torch.float64, torch.float32),
    ),
]


@pytest.mark.parametrize("case,dtype", params(REAL_TO_COMPLEX))
def test_real_leaves_through_complex_tensor_ops(case, dtype):
    run_case(case, dtype)


# The fused backends leave complex values to library calls; an instruction that reads complex
# memory for a real result (|z|, z == 0 in prod / cumprod / the norms) must not land in a
# generated kernel either (Triton has no complex type). On the CPU, Triton's interpreter.
FUSED = ["prod-one-zero", "prod-dim-keepdim-zeros", "cumprod-zeros", "vector_norm-inf", "vector_norm-0.5", "dist-1-broadcast", "sgn", "var"]


@pytest.mark.parametrize("case", [c for c in CASES if c.id in FUSED], ids=lambda c: c.id)
def test_complex_inputs_stay_out_of_generated_kernels(case):
    run_case(case, torch.complex128, backend="interpret")
