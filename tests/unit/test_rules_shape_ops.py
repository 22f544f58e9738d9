"""Gradients of shape and data-movement nodes against torch.autograd: padding, repeat, flip, roll,
diagonals, triangles, index_put / index_add, masked select / scatter, upsampling, pixel shuffle,
unfold. Sizes are odd and windows overlap on purpose, so every element that the forward reads
more than once must collect each contribution."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from tests.helpers import Case, assert_close, check_case, check_grads, const, fixed, idx, leaf, make, one, rand

# A fallback to eager autograd would compare torch with itself: make it an error.
pytestmark = pytest.mark.filterwarnings("error:gpuautograd falls back")

FLOATS = (torch.float64, torch.float32)


def mask(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > 0.5


def fresh(x):
    """A non-leaf copy, so that in-place ops are allowed on it (CloneBackward0 is pointwise's)."""
    return x.clone()


def put(x, i, v, accumulate=False):
    return torch.index_put(x, (i,), v, accumulate=accumulate)


def setitem(x, key, v):
    y = fresh(x)
    y[key] = v
    return y


def masked_count(m):
    return int(m.sum())


def _has_narrow_copy_node() -> bool:
    """torch 2.11 gives narrow_copy no autograd formula (a NotImplemented node)."""
    return torch.narrow_copy(torch.ones(3, requires_grad=True), 0, 0, 1).grad_fn.name() == "NarrowCopyBackward0"


NARROW_COPY = [
    Case("narrow_copy", "NarrowCopyBackward0", lambda x: torch.narrow_copy(x, 1, -9, 5), one(7, 13, nc=True)),
    Case("narrow_copy_empty", "NarrowCopyBackward0", lambda x: torch.narrow_copy(x, 0, 2, 0), one(7, 13)),
    Case("narrow_copy_all", "NarrowCopyBackward0", lambda x: torch.narrow_copy(x, 0, 0, 7), one(7, 13)),
]
NARROW_COPY = NARROW_COPY if _has_narrow_copy_node() else []

M7 = mask(7, 13)
M_ROW = mask(13, seed=1)

CASES = [
    # constant padding: positive pads zero-fill, negative pads crop
    Case("pad_last", "ConstantPadNdBackward0", lambda x: F.pad(x, (2, 3)), one(7, 13, nc=True)),
    Case("pad_crop_mixed", "ConstantPadNdBackward0", lambda x: F.pad(x, (1, -2, -3, 2), value=1.5), one(3, 7, 13)),
    Case("pad_crop_all_sides", "ConstantPadNdBackward0", lambda x: F.pad(x, (-1, -4, -2, -1, 1, 0)), one(3, 7, 13, nc=True)),
    Case("pad_crop_to_empty", "ConstantPadNdBackward0", lambda x: F.pad(x, (-13, 2)) * 2, one(7, 13)),
    Case("pad_big", "ConstantPadNdBackward0", lambda x: F.pad(x, (0, 3, 5, 0)), one(33, 65)),
    # reflection / replication padding: borders sum back onto the positions they copied
    Case("reflect1d", "ReflectionPad1DBackward0", lambda x: F.pad(x, (3, 5), mode="reflect"), one(2, 3, 7)),
    Case("reflect1d_unbatched_nc", "ReflectionPad1DBackward0", lambda x: F.pad(x, (6, 2), mode="reflect"), one(13, 7, nc=True)),
    Case("reflect1d_crop", "ReflectionPad1DBackward0", lambda x: F.pad(x, (-2, 4), mode="reflect"), one(2, 3, 7)),
    Case("reflect2d", "ReflectionPad2DBackward0", lambda x: F.pad(x, (1, 2, 3, 0), mode="reflect"), one(2, 3, 7, 13, nc=True)),
    Case("reflect2d_crop", "ReflectionPad2DBackward0", lambda x: F.pad(x, (4, -3, -1, 5), mode="reflect"), one(3, 7, 13)),
    Case("reflect3d", "ReflectionPad3DBackward0", lambda x: F.pad(x, (1, 2, 2, 1, 0, 3), mode="reflect"), one(1, 2, 5, 6, 7)),
    Case("replicate1d", "ReplicationPad1DBackward0", lambda x: F.pad(x, (4, 9), mode="replicate"), one(2, 3, 7)),
    Case("replicate1d_crop", "ReplicationPad1DBackward0", lambda x: F.pad(x, (-3, -2), mode="replicate"), one(3, 7)),
    Case("replicate2d", "ReplicationPad2DBackward0", lambda x: F.pad(x, (2, 1, 0, 5), mode="replicate"), one(2, 3, 7, 13, nc=True)),
    Case("replicate2d_crop", "ReplicationPad2DBackward0", lambda x: F.pad(x, (-2, 3, 4, -1), mode="replicate"), one(3, 7, 13)),
    Case("replicate3d", "ReplicationPad3DBackward0", lambda x: F.pad(x, (1, 0, 2, 2, 3, 1), mode="replicate"), one(1, 2, 3, 6, 7)),
    # repeat: tiles sum back
    Case("repeat", "RepeatBackward0", lambda x: x.repeat(3, 2), one(7, 13, nc=True)),
    Case("repeat_new_dims", "RepeatBackward0", lambda x: x.repeat(2, 1, 3, 1), one(7, 13)),
    Case("repeat_ones", "RepeatBackward0", lambda x: x.repeat(1, 1), one(33, 65)),
    Case("tile", "RepeatBackward0", lambda x: x.tile((2,)), one(3, 7, 5)),
    Case("repeat_empty", "RepeatBackward0", lambda x: x.repeat(0, 2), one(7, 13)),
    # flip, roll, rot90
    Case("flip", "FlipBackward0", lambda x: x.flip(0, -1), one(3, 7, 13, nc=True)),
    Case("fliplr", "FlipBackward0", lambda x: x.fliplr(), one(33, 65)),
    Case("roll", "RollBackward0", lambda x: x.roll((3, -5), (0, -1)), one(7, 13, nc=True)),
    Case("roll_flat", "RollBackward0", lambda x: x.roll(17), one(7, 13)),
    Case("roll_wrap", "RollBackward0", lambda x: x.roll((20, 7), (1, 0)), one(7, 13)),
    Case("rot90", "Rot90Backward0", lambda x: x.rot90(), one(7, 13, nc=True)),
    Case("rot90_k2", "Rot90Backward0", lambda x: x.rot90(2, (0, 2)), one(3, 7, 13)),
    Case("rot90_k3", "Rot90Backward0", lambda x: x.rot90(-1, (2, 1)), one(3, 7, 13)),
    Case("rot90_k4", "Rot90Backward0", lambda x: x.rot90(4), one(7, 13)),
    # diagonals
    Case("diagonal", "DiagonalBackward0", lambda x: x.diagonal(), one(7, 13, nc=True)),
    Case("diagonal_offset", "DiagonalBackward0", lambda x: x.diagonal(3), one(7, 13)),
    Case("diagonal_neg_offset", "DiagonalBackward0", lambda x: x.diagonal(-2, 2, 0), one(7, 3, 13)),
    Case("diagonal_batched", "DiagonalBackward0", lambda x: x.diagonal(1, -2, -1), one(3, 33, 65, nc=True)),
    Case("diagonal_empty", "DiagonalBackward0", lambda x: x.diagonal(13) * 1, one(7, 13)),
    Case("diag", "DiagonalBackward0_copy", lambda x: torch.diag(x, -1), one(7, 13)),
    Case("diag_embed", "DiagEmbedBackward0", lambda x: torch.diag_embed(x, 1, 0, 2), one(7, 13, nc=True)),
    Case("diag_vector", "DiagEmbedBackward0", lambda x: torch.diag(x, -2), one(13)),
    # triangles
    Case("tril", "TrilBackward0", lambda x: x.tril(), one(7, 13, nc=True)),
    Case("tril_offset", "TrilBackward0", lambda x: x.tril(-2), one(3, 13, 7)),
    Case("tril_", "TrilBackward0", lambda x: fresh(x).tril_(4), one(33, 65)),
    Case("triu", "TriuBackward0", lambda x: x.triu(1), one(7, 13)),
    Case("triu_neg_nc", "TriuBackward0", lambda x: x.triu(-3), one(3, 7, 13, nc=True)),
    # index_put: accumulate both ways, repeated indices, whole dims, broadcast values
    Case("index_put_acc", "IndexPutBackward0", lambda x, i, v: put(x, i, v, True), make(leaf(7, 13), fixed(idx(0, 3, 3, 6)), leaf(4, 13))),
    Case("index_put", "IndexPutBackward0", lambda x, i, v: put(x, i, v), make(leaf(7, 13, nc=True), fixed(idx(5, 1, 5)), leaf(3, 13))),
    Case("index_put_bcast", "IndexPutBackward0", lambda x, i, v: put(x, i, v), make(leaf(7, 13), fixed(idx(2, 4)), leaf(13))),
    Case(
        "index_put_values_only", "IndexPutBackward0", lambda x, i, v: put(x, i, v, True), make(const(7, 13), fixed(idx(1, 1)), leaf(2, 13))
    ),
    Case(
        "setitem_cols",
        "IndexPutBackward0",
        lambda x, i, v: setitem(x, (slice(None), i), v),
        make(leaf(7, 13), fixed(idx(12, 0, 4)), leaf(7, 3)),
    ),
    Case("setitem_scalar", "IndexPutBackward0", lambda x, i: setitem(x, i, 2.0), make(leaf(7, 13), fixed(idx(6, 0)))),
    Case("setitem_2idx", "IndexPutBackward0", lambda x, i, v: setitem(x, (i, i), v), make(leaf(7, 13), fixed(idx(0, 3, 5)), leaf(3))),
    Case("setitem_mask", "IndexPutBackward0", lambda x, v: setitem(x, M7, v), make(leaf(7, 13), leaf(masked_count(M7)))),
    Case("setitem_mask_bcast", "IndexPutBackward0", lambda x, v: setitem(x, M7, v), make(leaf(7, 13), leaf(1))),
    Case("setitem_mask_0d", "IndexPutBackward0", lambda x, v: setitem(x, M7, v), make(leaf(7, 13), leaf())),
    Case(
        "setitem_row_mask",
        "IndexPutBackward0",
        lambda x, v: setitem(x, (slice(None), M_ROW), v),
        make(leaf(3, 13, 5), leaf(masked_count(M_ROW), 5)),
    ),
    Case(
        "setitem_row_mask_bcast", "IndexPutBackward0", lambda x, v: setitem(x, (slice(None), M_ROW), v), make(leaf(3, 13, 5), leaf(3, 1, 5))
    ),
    Case(
        "setitem_mask_acc", "IndexPutBackward0", lambda x, v: torch.index_put(x, (M7,), v, True), make(leaf(7, 13), leaf(masked_count(M7)))
    ),
    # index_add
    Case("index_add", "IndexAddBackward0", lambda x, i, s: x.index_add(0, i, s), make(leaf(7, 13), fixed(idx(6, 0, 6)), leaf(3, 13))),
    Case(
        "index_add_alpha_nc",
        "IndexAddBackward0",
        lambda x, i, s: x.index_add(-1, i, s, alpha=-2.5),
        make(leaf(7, 13, nc=True), fixed(idx(1, 1, 12, 4)), leaf(7, 4, nc=True)),
    ),
    Case(
        "index_add_source_only",
        "IndexAddBackward0",
        lambda x, i, s: x.index_add(1, i, s),
        make(const(3, 7, 13), fixed(idx(0, 2)), leaf(3, 2, 13)),
    ),
    Case("index_add_0d", "IndexAddBackward0", lambda x, i, s: x.index_add(0, i, s), make(leaf(), fixed(idx(0)), leaf())),
    # masked select / scatter
    Case("masked_select", "MaskedSelectBackward0", lambda x: x.masked_select(M7), one(7, 13, nc=True)),
    Case("masked_select_bcast_mask", "MaskedSelectBackward0", lambda x: x.masked_select(M_ROW), one(7, 13)),
    Case("masked_select_bcast_self", "MaskedSelectBackward0", lambda x: x.masked_select(M7), one(13)),
    Case("masked_select_0d_true", "MaskedSelectBackward0", lambda x: x.masked_select(torch.tensor(True)), one()),
    Case("masked_select_0d_false", "MaskedSelectBackward0", lambda x: x.masked_select(torch.tensor(False)), one()),
    Case("masked_scatter", "MaskedScatterBackward0", lambda x, s: x.masked_scatter(M7, s), make(leaf(7, 13), leaf(masked_count(M7) + 5))),
    Case(
        "masked_scatter_2d_src", "MaskedScatterBackward0", lambda x, s: x.masked_scatter(M_ROW, s), make(leaf(7, 13, nc=True), leaf(9, 13))
    ),
    Case("masked_scatter_bcast_self", "MaskedScatterBackward0", lambda x, s: x.masked_scatter(M7, s), make(leaf(13), leaf(91))),
    # pixel shuffle
    Case("pixel_shuffle", "PixelShuffleBackward0", lambda x: F.pixel_shuffle(x, 2), one(2, 12, 3, 5)),
    Case("pixel_shuffle_nc", "PixelShuffleBackward0", lambda x: F.pixel_shuffle(x, 3), one(2, 9, 7, 5, nc=True)),
    Case("pixel_unshuffle", "PixelUnshuffleBackward0", lambda x: F.pixel_unshuffle(x, 2), one(2, 3, 14, 6)),
    Case("pixel_unshuffle_batched", "PixelUnshuffleBackward0", lambda x: F.pixel_unshuffle(x, 3), one(2, 2, 1, 9, 6)),
    # unfold: overlapping, tiling and gapped windows
    Case("unfold_overlap", "UnfoldBackward0", lambda x: x.unfold(1, 5, 2), one(7, 13, nc=True)),
    Case("unfold_step1", "UnfoldBackward0", lambda x: x.unfold(0, 4, 1), one(7, 13)),
    Case("unfold_tile", "UnfoldBackward0", lambda x: x.unfold(-1, 3, 3), one(3, 7, 13)),
    Case("unfold_gap", "UnfoldBackward0", lambda x: x.unfold(1, 2, 5), one(3, 13, 7)),
    Case("unfold_big", "UnfoldBackward0", lambda x: x.unfold(0, 7, 3), one(33, 65)),
    Case("unfold_0d", "UnfoldBackward0", lambda x: x.unfold(0, 1, 1), one()),
    Case("unfold_copy", "UnfoldBackward0_copy", lambda x: torch.unfold_copy(x, 1, 5, 2), one(7, 13, nc=True)),
    Case("diagonal_copy", "DiagonalBackward0_copy", lambda x: torch.diagonal_copy(x, 1, 0, 2), one(7, 3, 13)),
    # scatters into a view: the overwritten part of self gets no gradient
    Case("diagonal_scatter", "DiagonalScatterBackward0", lambda x, s: x.diagonal_scatter(s), make(leaf(7, 13, nc=True), leaf(7))),
    Case(
        "diagonal_scatter_offset",
        "DiagonalScatterBackward0",
        lambda x, s: x.diagonal_scatter(s, -2, 2, 0),
        make(leaf(5, 3, 7), leaf(3, 5, nc=True)),
    ),
    Case("diagonal_scatter_empty", "DiagonalScatterBackward0", lambda x, s: x.diagonal_scatter(s, 13), make(leaf(7, 13), leaf(0))),
    Case("slice_scatter", "SliceScatterBackward0", lambda x, s: x.slice_scatter(s, 1, 2, 11, 3), make(leaf(7, 13, nc=True), leaf(7, 3))),
    Case("slice_scatter_neg", "SliceScatterBackward0", lambda x, s: x.slice_scatter(s, 0, -4), make(leaf(7, 13), leaf(4, 13, nc=True))),
    Case("slice_scatter_src_only", "SliceScatterBackward0", lambda x, s: x.slice_scatter(s, 1, 5, 6), make(const(7, 13), leaf(7, 1))),
    Case("select_scatter", "SelectScatterBackward0", lambda x, s: x.select_scatter(s, 1, -3), make(leaf(7, 13, nc=True), leaf(7))),
    Case("select_scatter_3d", "SelectScatterBackward0", lambda x, s: x.select_scatter(s, 0, 2), make(leaf(3, 7, 13), leaf(7, 13, nc=True))),
    # block_diag: 0-d, 1-d (a row) and 2-d blocks
    Case(
        "block_diag",
        "BlockDiagBackward0",
        lambda a, c, d: torch.block_diag(a, c, d),
        make(leaf(7, 13, nc=True), leaf(), leaf(5)),
    ),
    Case("block_diag_const_first", "BlockDiagBackward0", lambda c, a: torch.block_diag(c, a), make(const(3, 4), leaf(7, 5, nc=True))),
    Case("block_diag_one", "BlockDiagBackward0", lambda a: torch.block_diag(a) * 2, one(3, 7)),
    # copy_ into a tensor that requires grad: src broadcast, cast to another dtype
    Case("copy_", "torch::autograd::CopyBackwards", lambda x, s: fresh(x).copy_(s), make(leaf(7, 13), leaf(7, 13, nc=True))),
    Case("copy_bcast", "torch::autograd::CopyBackwards", lambda x, s: fresh(x).copy_(s) * x, make(leaf(7, 13), leaf(13))),
    Case(
        "copy_dtype",
        "torch::autograd::CopyBackwards",
        lambda x, s: fresh(x).copy_(s.double()[:, :13]),
        make(leaf(7, 13), leaf(7, 15)),
    ),
    Case("copy_src_only", "torch::autograd::CopyBackwards", lambda s: torch.zeros(7, 13, dtype=s.dtype).copy_(s) * 3, one(7, 13)),
    *NARROW_COPY,
    # as_strided_scatter: the src gradient (self's declines, see test_as_strided_declines_and_runs_opaque)
    Case(
        "as_strided_scatter",
        "AsStridedScatterBackward0",
        lambda x, s: torch.as_strided_scatter(x, s, (4, 5), (1, 7), 2),
        make(const(7, 13), leaf(4, 5, nc=True)),
    ),
    Case(
        "as_strided_scatter_3d",
        "AsStridedScatterBackward0",
        lambda x, s: torch.as_strided_scatter(x, s, (3, 2, 2), (35, 3, 1), 1),
        make(const(3, 5, 7), leaf(3, 2, 2)),
    ),
    Case(
        "as_strided_scatter_nc_self",
        "AsStridedScatterBackward0",
        lambda x, s: torch.as_strided_scatter(x.t(), s, (6, 2), (2, 13), 4),
        make(const(13, 7), leaf(6, 2, nc=True)),
    ),
    Case(
        "as_strided_scatter_empty",
        "AsStridedScatterBackward0",
        lambda x, s: torch.as_strided_scatter(x, s, (0, 3), (1, 1)) * 2,
        make(const(7, 13), leaf(0, 3)),
    ),
]


def with_dtypes(cases):
    return [pytest.param(c, d, id=f"{c.id}-{str(d).replace('torch.', '')}") for c in cases for d in c.dtypes]


@pytest.mark.parametrize("case, dtype", with_dtypes(CASES))
def test_shape_rule(case, dtype):
    check_case(case, dtype)


# -- upsampling: one extern call of the aten backward kernel ----------------------------------

UPSAMPLE_CASES = [
    Case("nearest1d", "UpsampleNearest1DBackward0", lambda x: F.interpolate(x, scale_factor=2.5), one(2, 3, 7)),
    Case("nearest1d_size", "UpsampleNearest1DBackward0", lambda x: F.interpolate(x, size=5), one(2, 3, 13, nc=True)),
    Case("nearest2d", "UpsampleNearest2DBackward0", lambda x: F.interpolate(x, size=(9, 20)), one(2, 3, 7, 13, nc=True)),
    Case("nearest2d_scale", "UpsampleNearest2DBackward0", lambda x: F.interpolate(x, scale_factor=(1.5, 0.5)), one(1, 2, 7, 13)),
    Case("nearest3d", "UpsampleNearest3DBackward0", lambda x: F.interpolate(x, scale_factor=2), one(1, 2, 3, 4, 5)),
    Case("nearest_exact1d", "UpsampleNearestExact1DBackward0", lambda x: F.interpolate(x, size=11, mode="nearest-exact"), one(2, 3, 7)),
    Case(
        "nearest_exact2d",
        "UpsampleNearestExact2DBackward0",
        lambda x: F.interpolate(x, scale_factor=1.7, mode="nearest-exact"),
        one(1, 2, 7, 5),
    ),
    Case("linear1d", "UpsampleLinear1DBackward0", lambda x: F.interpolate(x, size=17, mode="linear"), one(2, 3, 7)),
    Case("bilinear", "UpsampleBilinear2DBackward0", lambda x: F.interpolate(x, size=(9, 20), mode="bilinear"), one(2, 3, 7, 13, nc=True)),
    Case(
        "bilinear_corners",
        "UpsampleBilinear2DBackward0",
        lambda x: F.interpolate(x, scale_factor=1.5, mode="bilinear", align_corners=True),
        one(1, 2, 7, 13),
    ),
    Case("bilinear_down", "UpsampleBilinear2DBackward0", lambda x: F.interpolate(x, size=(3, 4), mode="bilinear"), one(1, 2, 7, 13)),
    Case("bicubic", "UpsampleBicubic2DBackward0", lambda x: F.interpolate(x, scale_factor=2, mode="bicubic"), one(1, 2, 5, 7)),
    Case("trilinear", "UpsampleTrilinear3DBackward0", lambda x: F.interpolate(x, size=(4, 6, 9), mode="trilinear"), one(1, 2, 3, 4, 5)),
    Case(
        "bilinear_aa",
        "UpsampleBilinear2DAaBackward0",
        lambda x: F.interpolate(x, size=(3, 5), mode="bilinear", antialias=True),
        one(1, 2, 7, 13),
        dtypes=FLOATS,  # the antialiased kernels have no bfloat16 CPU implementation
    ),
    Case(
        "bicubic_aa",
        "UpsampleBicubic2DAaBackward0",
        lambda x: F.interpolate(x, size=(4, 6), mode="bicubic", antialias=True),
        one(1, 2, 7, 13),
        dtypes=FLOATS,
    ),
]


@pytest.mark.parametrize("case, dtype", with_dtypes(UPSAMPLE_CASES))
def test_upsample_rule(case, dtype):
    check_case(case, dtype)


def test_upsample_is_one_kernel_call():
    x = rand(2, 3, 7, 13)
    out = F.interpolate(x, size=(9, 20), mode="bilinear")
    program = str(gpuautograd.explain([out], [torch.ones_like(out)]).program)
    assert program.count("upsample_backward") == 1 and "upsample_bilinear2d_backward" in program


# -- as_strided: functional where the native walker reads the input's geometry -----------------


AS_STRIDED = [
    ("AsStridedBackward0", lambda x, s: x.t().as_strided((4, 5), (1, 7), 2)),  # the transposed view's strides matter
    ("AsStridedBackward0_copy", lambda x, s: torch.as_strided_copy(x.t(), (4, 5), (1, 7), 2)),
    ("AsStridedBackward0", lambda x, s: (x * 2).as_strided((5, 4), (3, 1), 4)),  # overlapping windows
    ("AsStridedBackward0", lambda x, s: x[1:].as_strided((2, 3), (5, 2))),  # the input's own offset
]


@pytest.mark.parametrize("node, fn", AS_STRIDED)
def test_as_strided_is_functional_with_the_native_walker_and_runs_opaque_without(node, fn, monkeypatch):
    from gpuautograd import native

    x, s = rand(7, 13), rand(4, 5)
    if native.load() is not None:
        out = fn(x, s)
        assert gpuautograd.explain([out], [torch.ones_like(out)]).opaque_nodes == []
        check_grads(fn, x, s)
    monkeypatch.setenv("GPUAUTOGRAD_NATIVE", "0")  # the Python walker: autograd keeps the geometry in C++ only
    out = fn(x, s)
    report = gpuautograd.explain([out], [torch.ones_like(out)])
    assert report.opaque_nodes == [node] and "strides and storage offset" in str(report)
    check_grads(fn, x, s, allow_opaque=True)


def test_as_strided_scatter_self_declines_and_runs_opaque():
    x, s = rand(7, 13), rand(4, 5)

    def fn(x, s):
        return torch.as_strided_scatter(x, s, (4, 5), (1, 7), 2)

    out = fn(x, s)
    report = gpuautograd.explain([out], [torch.ones_like(out)])
    assert report.opaque_nodes == ["AsStridedScatterBackward0"] and "fails gradcheck" in str(report)
    check_grads(fn, x, s, allow_opaque=True)


# -- the gradients are exactly where the forward read -----------------------------------------


def test_unfold_overlap_counts_every_window():
    # with a gradient of ones, each input element's gradient is the number of windows holding it
    x = rand(1, 9)
    (grad,) = gpuautograd.grad([x.unfold(1, 4, 2)], [x], [torch.ones(1, 3, 4, dtype=torch.float64)])
    assert grad.tolist() == [[1, 1, 2, 2, 2, 2, 1, 1, 0]]


def test_reflection_pad_counts_every_copy():
    x = rand(1, 1, 5)
    (grad,) = gpuautograd.grad([F.pad(x, (3, 2), mode="reflect")], [x], [torch.ones(1, 1, 10, dtype=torch.float64)])
    # output reads 3 2 1 | 0 1 2 3 4 | 3 2
    assert grad.flatten().tolist() == [1, 2, 3, 3, 1]


@pytest.mark.parametrize("dtype", FLOATS)
def test_index_put_overwrite_sees_duplicates_like_torch(dtype):
    # with accumulate=False and a repeated index, torch still gives every value the gradient
    x, v = rand(5, 3, dtype=dtype), rand(3, 3, dtype=dtype)
    i = idx(1, 1, 4)
    check_grads(lambda x, v: put(x, i, v), x, v)


@pytest.mark.parametrize(
    "fn, make_value",
    [
        (lambda x, m, v: x.masked_scatter(m, v), lambda: rand(91)),
        (lambda x, m, v: setitem(x, m, v), lambda: rand(40)),
        (lambda x, m, v: setitem(x, m, v), lambda: rand(1)),
    ],
    ids=["masked_scatter", "setitem_mask", "setitem_mask_bcast"],
)
def test_mask_positions_are_computed_on_each_call(fn, make_value):
    # A cache hit must not bake in the positions of the first call's mask: two masks with the
    # same count of true elements give the same graph metadata, so the second run is a hit.
    first, second = torch.zeros(7, 13, dtype=torch.bool), torch.zeros(7, 13, dtype=torch.bool)
    first.view(-1)[:40] = True
    second.view(-1)[-40:] = True
    for m in (first, second):
        x, v = rand(7, 13), make_value()
        out = fn(x, m, v)
        g = torch.randn_like(out)
        ours = gpuautograd.grad([out], [x, v], [g], retain_graph=True)
        for a, e in zip(ours, torch.autograd.grad([out], [x, v], [g])):
            assert_close(a, e)
    assert gpuautograd.stats()["cache_hits"] == 1
