"""Backward rules of shape and data-movement nodes: padding, repeat, flip, roll, rot90, diagonals,
triangles, index_put / index_add, masked select / scatter, upsampling, pixel shuffle, unfold.

Each moves gradient elements back to where the forward read them from, and sums where the forward
read one element several times (repeat, overlapping unfold windows, reflected or replicated
borders). All but upsampling are compositions of layout and indexing ops; the interpolation
kernels are one library call each (`upsample_backward` in ir/extern_ops.py).
"""

from __future__ import annotations

import functools
import math

import torch

from ..ir import composite_ops
from ..ir.extern_ops import UPSAMPLE_KERNELS  # the import also registers the extern op
from ..ir.ops import broadcast_shapes
from .pointwise import scaled
from .registry import register
from .views import clamp_slice_bounds, norm_dim


def _zeros(b, shape, like):
    return b.full(tuple(shape), 0, like.dtype, like.device)


def _with_dim(shape, dim: int, size: int) -> tuple:
    return tuple(size if i == dim else s for i, s in enumerate(shape))


def _add_at(b, acc, piece, dim: int, start: int, shape):
    """`acc` (None: zeros of `shape`) with `piece` added at [start, start + len) along `dim`."""
    n = piece.shape[dim]
    if n == 0:
        return acc
    end = start + n
    if acc is None:
        if n == shape[dim]:
            return piece
        return b.slice_scatter(_zeros(b, shape, piece), piece, dim, start, end)
    if n == shape[dim]:
        return b.add(acc, piece)
    return b.slice_scatter(acc, b.add(b.slice(acc, dim, start, end), piece), dim, start, end)


def _arange(b, n: int, device):
    return b.emit("arange", length=n, dtype=torch.int64, device=device)


def _numel(shape) -> int:
    return math.prod(shape)


# -- padding ----------------------------------------------------------------------------------


def _pad_pairs(pad, ndim: int) -> list[tuple[int, int, int]]:
    """torch's pad lists run from the last dim backwards: (dim, left, right) per padded dim."""
    return [(ndim - 1 - i, pad[2 * i], pad[2 * i + 1]) for i in range(len(pad) // 2)]


def _zero_pad(b, x, dim: int, left: int, right: int):
    """x with `left` zeros before and `right` after along dim; a negative amount crops instead."""
    n = x.shape[dim]
    out = n + left + right
    # output positions [lo, hi) hold input positions [lo - left, hi - left)
    lo = min(max(left, 0), out)
    hi = max(min(n + left, out), lo)
    if hi == lo:
        return _zeros(b, _with_dim(x.shape, dim, out), x)
    pieces = [b.slice(x, dim, lo - left, hi - left)]
    if lo:
        pieces.insert(0, _zeros(b, _with_dim(x.shape, dim, lo), x))
    if out > hi:
        pieces.append(_zeros(b, _with_dim(x.shape, dim, out - hi), x))
    return b.cat(pieces, dim)


@register("ConstantPadNdBackward0", complex=True)
def constant_pad_nd_backward(b, node, grads):
    # self: constant_pad_nd_backward(grad, pad) = constant_pad_nd(grad, -pad): crop what was padded, zero-fill what was cropped
    grad = grads[0]
    for dim, left, right in _pad_pairs(node.saved("pad"), grad.ndim):
        grad = _zero_pad(b, grad, dim, -left, -right)
    return [grad]


def _border_pad_backward(b, g, dim: int, n: int, left: int, right: int, reflect: bool):
    """The gradient of reflection or replication padding along one dim, input size n. Output
    position j reads input j - left inside, a mirrored position (reflect) or the edge element
    (replicate) in the borders; negative amounts crop and leave that border empty."""
    out = g.shape[dim]
    shape = _with_dim(g.shape, dim, n)
    lo, hi = max(left, 0), min(n + left, out)
    acc = _add_at(b, None, b.slice(g, dim, lo, hi), dim, lo - left, shape)
    if left > 0:  # output [0, left) reads input left, left - 1, ..., 1 (reflect) or 0 (replicate)
        edge = b.slice(g, dim, 0, left)
        if reflect:
            acc = _add_at(b, acc, b.emit("flip", edge, dims=(dim,)), dim, left + 1 - edge.shape[dim], shape)
        else:
            acc = _add_at(b, acc, b.sum(edge, dim, keepdim=True), dim, 0, shape)
    if right > 0:  # output [n + left, out) reads input n - 2, ..., n - 1 - right (reflect) or n - 1
        edge = b.slice(g, dim, n + left, out)
        if reflect:
            acc = _add_at(b, acc, b.emit("flip", edge, dims=(dim,)), dim, n - 1 - right, shape)
        else:
            acc = _add_at(b, acc, b.sum(edge, dim, keepdim=True), dim, n - 1, shape)
    return acc if acc is not None else _zeros(b, shape, g)


def _border_pad_rule(reflect: bool):
    def rule(b, node, grads):
        # self: {reflection,replication}_pad{1,2,3}d_backward(grad, self, padding): per padded dim, the inside plus each border summed back onto the input positions it read
        grad = grads[0]
        sizes = node.saved("self").shape
        # the padded dims are independent (the forward pads one dim after the other)
        for dim, left, right in _pad_pairs(node.saved("padding"), grad.ndim):
            grad = _border_pad_backward(b, grad, dim, sizes[dim], left, right, reflect)
        return [grad]

    return rule


register("ReflectionPad1DBackward0", "ReflectionPad2DBackward0", "ReflectionPad3DBackward0", complex=True)(_border_pad_rule(reflect=True))
register("ReplicationPad1DBackward0", "ReplicationPad2DBackward0", "ReplicationPad3DBackward0", complex=True)(
    _border_pad_rule(reflect=False)
)


# -- repeat, flip, roll, rot90 ----------------------------------------------------------------


@register("RepeatBackward0", complex=True)
def repeat_backward(b, node, grads):
    # self: repeat_backward(grad, repeats, self.sym_sizes()): view grad as [r0, s0, r1, s1, ...] and sum the r dims
    grad = grads[0]
    sizes = tuple(node.saved("self_sym_sizes"))
    repeats = tuple(node.saved("repeats"))
    padded = (1,) * (len(repeats) - len(sizes)) + sizes  # repeat may add leading dims
    if _numel(grad.shape) == 0:
        return [_zeros(b, sizes, grad)]
    split = [s for pair in zip(repeats, padded) for s in pair]
    tiles = b.reshape(grad, split)
    return [b.reshape(b.sum(tiles, range(0, len(split), 2)), sizes)]


def _flip(b, x, dims):
    dims = tuple(sorted({norm_dim(d, x.ndim) for d in dims}))
    if x.ndim == 0 or not dims:
        return x
    return b.emit("flip", x, dims=dims)


@register("FlipBackward0", complex=True)
def flip_backward(b, node, grads):
    # self: grad.flip(dims)
    return [_flip(b, grads[0], node.saved("dims"))]


def _roll(b, x, shifts, dims):
    """torch.roll as slices and a cat per rolled dim."""
    if not dims:  # roll of the flattened tensor, shape restored after
        return b.reshape(_roll(b, b.reshape(x, (-1,)), shifts, (0,)), x.shape)
    for shift, dim in zip(shifts, dims):
        dim = norm_dim(dim, x.ndim)
        n = x.shape[dim]
        if n == 0 or shift % n == 0:
            continue
        s = shift % n
        x = b.cat([b.slice(x, dim, n - s, n), b.slice(x, dim, 0, n - s)], dim)
    return x


@register("RollBackward0", complex=True)
def roll_backward(b, node, grads):
    # self: grad.roll(-reversed(shifts), reversed(dims))   (rolls of distinct dims commute)
    return [_roll(b, grads[0], [-s for s in node.saved("shifts")], node.saved("dims"))]


@register("Rot90Backward0", complex=True)
def rot90_backward(b, node, grads):
    # self: grad.rot90(-k, dims)
    grad = grads[0]
    d0, d1 = (norm_dim(d, grad.ndim) for d in node.saved("dims"))
    k = -node.saved("k") % 4
    if k == 1:  # torch's rot90: flip one dim, then transpose
        return [b.transpose(_flip(b, grad, (d1,)), d0, d1)]
    if k == 2:
        return [_flip(b, grad, (d0, d1))]
    if k == 3:
        return [b.transpose(_flip(b, grad, (d0,)), d0, d1)]
    return [grad]


# -- diagonals and triangles ------------------------------------------------------------------


def _diagonal_layout(sizes, node):
    """Where the node's diagonal of a tensor of `sizes` lies once dims (dim1, dim2) are moved last
    and flattened together: the permutation, the other dims' sizes, (n1, n2), and (start, end,
    step, length) along the flat dim."""
    offset = node.saved("offset")
    d1, d2 = norm_dim(node.saved("dim1"), len(sizes)), norm_dim(node.saved("dim2"), len(sizes))
    rest = [d for d in range(len(sizes)) if d not in (d1, d2)]
    n1, n2 = sizes[d1], sizes[d2]
    length = max(0, min(n1 + min(offset, 0), n2 - max(offset, 0)))
    start = offset if offset >= 0 else -offset * n2
    end = start + (length - 1) * (n2 + 1) + 1 if length else start
    return rest + [d1, d2], tuple(sizes[d] for d in rest), (n1, n2), (start, end, n2 + 1, length)


@register("DiagonalBackward0", "DiagonalBackward0_copy", complex=True)
def diagonal_backward(b, node, grads):
    # self: diagonal_backward(grad, self.sym_sizes(), offset, dim1, dim2) = zeros(self.sizes).diagonal_scatter(grad, offset, dim1, dim2)
    grad = grads[0]
    sizes = tuple(node.saved("self_sym_sizes"))
    perm, rest, (n1, n2), (start, end, step, length) = _diagonal_layout(sizes, node)
    if length == 0:
        return [_zeros(b, sizes, grad)]
    flat = b.slice_scatter(_zeros(b, rest + (n1 * n2,), grad), grad, -1, start, end, step)
    inverse = [perm.index(d) for d in range(len(sizes))]
    return [b.permute(b.reshape(flat, rest + (n1, n2)), inverse)]


@register("DiagonalScatterBackward0", complex=True)
def diagonal_scatter_backward(b, node, grads):
    # self: grad.diagonal_scatter(zeros_like(src), offset, dim1, dim2);  src: grad.diagonal(offset, dim1, dim2)
    grad = grads[0]
    perm, rest, (n1, n2), (start, end, step, length) = _diagonal_layout(grad.shape, node)
    flat = b.reshape(b.permute(grad, perm), rest + (n1 * n2,))
    self_grad = src_grad = None
    if node.needs(0):
        self_grad = grad
        if length:  # the overwritten diagonal never reaches the output
            cleared = b.slice_scatter(flat, _zeros(b, rest + (length,), grad), -1, start, end, step)
            inverse = [perm.index(d) for d in range(grad.ndim)]
            self_grad = b.permute(b.reshape(cleared, rest + (n1, n2)), inverse)
    if node.needs(1):
        src_grad = b.slice(flat, -1, start, end, step) if length else _zeros(b, rest + (0,), grad)
    return [self_grad, src_grad]


@register("SliceScatterBackward0", complex=True)
def slice_scatter_backward(b, node, grads):
    # self: slice_scatter(grad, zeros_like(src), dim, start, end, step);  src: grad.slice(dim, start, end, step)
    grad = grads[0]
    dim = norm_dim(node.saved("dim"), grad.ndim)
    start, end = clamp_slice_bounds(node.saved("start"), node.saved("end"), grad.shape[dim])
    step = node.saved("step")
    piece = b.slice(grad, dim, start, end, step)
    self_grad = None
    if node.needs(0):
        self_grad = b.slice_scatter(grad, _zeros(b, piece.shape, grad), dim, start, end, step) if _numel(piece.shape) else grad
    return [self_grad, piece if node.needs(1) else None]


@register("SelectScatterBackward0", complex=True)
def select_scatter_backward(b, node, grads):
    # self: select_scatter(grad, zeros_like(src), dim, index);  src: grad.select(dim, index)
    grad = grads[0]
    dim = norm_dim(node.saved("dim"), grad.ndim)
    index = node.saved("index") % grad.shape[dim]
    piece = b.select(grad, dim, index)
    self_grad = b.select_scatter(grad, _zeros(b, piece.shape, grad), dim, index) if node.needs(0) else None
    return [self_grad, piece if node.needs(1) else None]


@functools.cache
def _trace_backward_fills_tall_matrices_past_the_diagonal() -> bool:
    """Whether this torch's trace_backward writes grad at every (m + 1)-th element of a tall
    (n > m) matrix, past the diagonal (torch 2.11 does; 2.13 writes the diagonal only)."""
    x = torch.zeros(3, 1, requires_grad=True)
    (g,) = torch.autograd.grad(x.trace(), x)
    return bool(g[1:].any())


@register("TraceBackward0", complex=True)
def trace_backward(b, node, grads):
    # self: trace_backward_symint(grad, self.sym_sizes()) = zeros(n * m) with grad at every
    #       (m + 1)-th position (the main diagonal), viewed as (n, m)
    grad = grads[0]
    n, m = tuple(node.saved("self_sym_sizes"))
    if n > m and _trace_backward_fills_tall_matrices_past_the_diagonal():
        raise NotImplementedError("this torch's trace backward fills a tall matrix past its diagonal: the node runs as eager does")
    k = min(n, m)
    if k == 0:
        return [_zeros(b, (n, m), grad)]
    flat = b.slice_scatter(_zeros(b, (n * m,), grad), b.expand(grad, (k,)), 0, 0, (k - 1) * (m + 1) + 1, m + 1)
    return [b.reshape(flat, (n, m))]


@register("DiagEmbedBackward0", complex=True)
def diag_embed_backward(b, node, grads):
    # self: grad.diagonal(offset, dim1, dim2)
    grad = grads[0]
    perm, rest, (n1, n2), (start, end, step, length) = _diagonal_layout(grad.shape, node)
    if length == 0:
        return [_zeros(b, rest + (0,), grad)]
    flat = b.reshape(b.permute(grad, perm), rest + (n1 * n2,))
    return [b.slice(flat, -1, start, end, step)]


def _triangle(b, grad, diagonal: int, lower: bool):
    """grad with the elements outside the kept triangle of its last two dims set to zero."""
    rows, cols = grad.shape[-2:]
    # column minus row: the diagonal an element lies on
    where_on = b.sub(_arange(b, cols, grad.device), b.reshape(_arange(b, rows, grad.device), (rows, 1)))
    keep = b.le(where_on, diagonal) if lower else b.ge(where_on, diagonal)
    return b.where(keep, grad, 0)


@register("TrilBackward0", complex=True)
def tril_backward(b, node, grads):
    # self: grad.tril(diagonal)
    return [_triangle(b, grads[0], node.saved("diagonal"), lower=True)]


@register("TriuBackward0", complex=True)
def triu_backward(b, node, grads):
    # self: grad.triu(diagonal)
    return [_triangle(b, grads[0], node.saved("diagonal"), lower=False)]


# -- index_put, index_add ---------------------------------------------------------------------


def _is_mask(index) -> bool:
    return index is not None and index.dtype in (torch.bool, torch.uint8)


def _compact(b, values, mask, count: int):
    """The rows of `values` (P, M, R) where the flat `mask` (M,) is true, in order, as (P, count, R);
    rows past the number of true elements are zero. A true element's row is the count of true
    elements before it (a cumsum); false ones go to a spare row that is dropped."""
    p, m, r = values.shape
    flags = b.cast(mask, torch.int64)
    row = b.where(mask, b.sub(b.emit("cumsum", flags, dim=0, reverse=False), 1), count)
    row = b.expand(b.reshape(row, (1, m, 1)), (p, m, r))
    picked = b.where(b.reshape(mask, (1, m, 1)), values, 0)
    rows = b.scatter_add(_zeros(b, (p, count + 1, r), values), 1, row, picked)
    return b.slice(rows, 1, 0, count)


def _index_by_mask(b, node, grad, indices):
    """grad[indices] for one bool mask after whole dims (x[mask], x[:, mask]), whose result has a
    data-dependent length. The values' shape gives it where it is not broadcast; where it is
    broadcast (size 1 or absent), the sum over the masked elements is what reaches the values."""
    lead = len(indices) - 1
    mask = indices[-1]
    sizes = grad.shape
    rest = sizes[lead + mask.ndim :]
    values = node.output_type(1).shape
    values = (1,) * (lead + 1 + len(rest) - len(values)) + values  # values broadcast from the right
    flat = b.reshape(grad, (_numel(sizes[:lead]), _numel(mask.shape), _numel(rest)))
    flat_mask = b.reshape(mask if mask.dtype == torch.bool else b.ne(mask, 0), (-1,))
    count = values[lead]
    if count == 1:
        picked = b.sum(b.where(b.reshape(flat_mask, (1, -1, 1)), flat, 0), 1, keepdim=True)
    else:
        picked = _compact(b, flat, flat_mask, count)
    return b.reshape(picked, sizes[:lead] + (count,) + rest)


@register("IndexPutBackward0", complex=True)
def index_put_backward(b, node, grads):
    # self: accumulate ? grad : grad.index_put(indices, zeros_like(values), false);  values: grad.index(indices)
    grad = grads[0]
    indices = list(node.saved("indices"))
    self_grad = values_grad = None
    if node.needs(0):
        self_grad = grad
        if not node.saved("accumulate"):  # overwritten elements never reach the output
            self_grad = b.index_put(grad, indices, _zeros(b, (), grad), accumulate=False)
    if node.needs(1):
        if any(_is_mask(i) for i in indices):
            while indices and indices[-1] is None:  # trailing whole dims are implicit
                indices.pop()
            if not _is_mask(indices[-1]) or sum(i is not None for i in indices) > 1:
                raise NotImplementedError(f"{node.name}: a bool mask mixed with other index tensors has a data-dependent gradient shape")
            values_grad = _index_by_mask(b, node, grad, indices)
        else:
            values_grad = b.index(grad, indices)
    return [self_grad, values_grad]


@register("IndexAddBackward0", complex=True)
def index_add_backward(b, node, grads):
    # self: grad;  source: maybe_multiply(source.dim() > 0 ? grad.index_select(dim, index).expand_as(source) : grad.index_select(dim, index.squeeze(0)), alpha)
    grad = grads[0]
    source = None
    if node.needs(1):
        index = b.reshape(node.saved("index"), (-1,))
        source = grad
        if grad.ndim:  # index_add refused any index out of [0, size): index_select takes it as is
            source = composite_ops.emit(b, "index_select", grad, index, dim=norm_dim(node.saved("dim"), grad.ndim))
        if node.saved("source_dim") == 0:
            source = b.reshape(source, ())
        source = scaled(b, source, node.saved("alpha"))
    return [grad if node.needs(0) else None, source]


# -- masked select / scatter ------------------------------------------------------------------


@register("MaskedSelectBackward0", complex=True)
def masked_select_backward(b, node, grads):
    # self: masked_select_backward(grad, self, mask) = zeros(broadcast(self, mask)).masked_scatter_(mask, grad)
    grad = grads[0]
    mask = node.saved("mask")
    shape = broadcast_shapes(node.saved("self").shape, mask.shape)
    # x[mask] = v puts v's elements at the true positions in row-major order, as masked_scatter does;
    # a 0-dim result goes through one element (a boolean index needs a dimension to index)
    work = shape or (1,)
    full = b.reshape(b.expand(mask, shape), work) if not shape else b.expand(mask, shape)
    out = b.index_put(_zeros(b, work, grad), [full], grad, accumulate=False)
    return [b.reshape(out, shape) if not shape else out]


@register("MaskedScatterBackward0", complex=True)
def masked_scatter_backward(b, node, grads):
    # self: grad.masked_fill(mask, 0);  source: masked_scatter_backward(grad, mask, source.sizes()) = grad.masked_select(mask) zero-padded to source.numel()
    grad = grads[0]
    mask = node.saved("mask")
    self_grad = b.where(mask, 0, grad) if node.needs(0) else None
    source_grad = None
    if node.needs(1):
        sizes = tuple(node.saved("source_sym_sizes"))
        flat = b.reshape(grad, (1, -1, 1))
        flat_mask = b.reshape(b.expand(mask, grad.shape), (-1,))
        source_grad = b.reshape(_compact(b, flat, flat_mask, _numel(sizes)), sizes)
    return [self_grad, source_grad]


# -- upsampling -------------------------------------------------------------------------------

# node -> (aten backward kernel, spatial dims, takes align_corners)
_UPSAMPLE = {
    "UpsampleNearest1DBackward0": ("upsample_nearest1d_backward", 1, False),
    "UpsampleNearest2DBackward0": ("upsample_nearest2d_backward", 2, False),
    "UpsampleNearest3DBackward0": ("upsample_nearest3d_backward", 3, False),
    "UpsampleNearestExact1DBackward0": ("_upsample_nearest_exact1d_backward", 1, False),
    "UpsampleNearestExact2DBackward0": ("_upsample_nearest_exact2d_backward", 2, False),
    "UpsampleNearestExact3DBackward0": ("_upsample_nearest_exact3d_backward", 3, False),
    "UpsampleLinear1DBackward0": ("upsample_linear1d_backward", 1, True),
    "UpsampleBilinear2DBackward0": ("upsample_bilinear2d_backward", 2, True),
    "UpsampleTrilinear3DBackward0": ("upsample_trilinear3d_backward", 3, True),
    "UpsampleBicubic2DBackward0": ("upsample_bicubic2d_backward", 2, True),
    "UpsampleBilinear2DAaBackward0": ("_upsample_bilinear2d_aa_backward", 2, True),
    "UpsampleBicubic2DAaBackward0": ("_upsample_bicubic2d_aa_backward", 2, True),
}
assert {k for k, _, _ in _UPSAMPLE.values()} <= UPSAMPLE_KERNELS
_SCALES = {1: ("scales",), 2: ("scales_h", "scales_w"), 3: ("scales_d", "scales_h", "scales_w")}


@register(*_UPSAMPLE)
def upsample_backward(b, node, grads):
    # self: upsample_<mode><n>d_backward(grad, output_size, self.sym_sizes(), [align_corners,] scales...)
    kernel, spatial, interp = _UPSAMPLE[node.name]
    out = b.emit(
        "upsample_backward",
        grads[0],
        kernel=kernel,
        output_size=tuple(node.saved("output_size")),
        input_size=tuple(node.saved("self_sym_sizes")),
        align_corners=node.saved("align_corners") if interp else None,
        scales=tuple(node.saved(s) for s in _SCALES[spatial]),
    )
    return [out]


# -- pixel shuffle, unfold, as_strided --------------------------------------------------------


def _pixel_shuffle(b, x, r: int):
    """(..., c*r*r, h, w) -> (..., c, h*r, w*r)"""
    *lead, c, h, w = x.shape
    k = len(lead)
    x = b.reshape(x, (*lead, c // (r * r), r, r, h, w))
    x = b.permute(x, [*range(k), k, k + 3, k + 1, k + 4, k + 2])
    return b.reshape(x, (*lead, c // (r * r), h * r, w * r))


def _pixel_unshuffle(b, x, r: int):
    """(..., c, h*r, w*r) -> (..., c*r*r, h, w)"""
    *lead, c, h, w = x.shape
    k = len(lead)
    x = b.reshape(x, (*lead, c, h // r, r, w // r, r))
    x = b.permute(x, [*range(k), k, k + 2, k + 4, k + 1, k + 3])
    return b.reshape(x, (*lead, c * r * r, h // r, w // r))


@register("PixelShuffleBackward0", complex=True)
def pixel_shuffle_backward(b, node, grads):
    # self: pixel_unshuffle(grad, upscale_factor)
    return [_pixel_unshuffle(b, grads[0], node.saved("upscale_factor"))]


@register("PixelUnshuffleBackward0", complex=True)
def pixel_unshuffle_backward(b, node, grads):
    # self: pixel_shuffle(grad, downscale_factor)
    return [_pixel_shuffle(b, grads[0], node.saved("downscale_factor"))]


@register("UnfoldBackward0", "UnfoldBackward0_copy", complex=True)
def unfold_backward(b, node, grads):
    # self: unfold_backward(grad, self.sym_sizes(), dimension, size, step): window w's element k adds into position w*step + k
    grad = grads[0]
    sizes = tuple(node.saved("self_sym_sizes"))
    if not sizes:  # a 0-d input unfolds to one window of one element
        return [b.reshape(grad, ())]
    size, step = node.saved("size"), node.saved("step")
    dim = norm_dim(node.saved("dimension"), len(sizes))
    n, windows = sizes[dim], grad.shape[dim]
    # move the window elements next to the window index: (..., windows, size, ...)
    g = b.permute(grad, [*range(dim + 1), grad.ndim - 1, *range(dim + 1, grad.ndim - 1)])
    # Element k = q*step + j of window w lands on (w + q)*step + j: for each q, the slice of
    # elements [q*step, (q+1)*step), zero-filled to `step` wide, is one contiguous run.
    acc = None
    for q in range(-(-size // step)):
        width = min(step, size - q * step)
        piece = b.slice(g, dim + 1, q * step, q * step + width)
        if width < step:
            piece = b.cat([piece, _zeros(b, _with_dim(piece.shape, dim + 1, step - width), grad)], dim + 1)
        run = b.reshape(piece, sizes[:dim] + (windows * step,) + sizes[dim + 1 :])
        run = b.slice(run, dim, 0, min(windows * step, n - q * step))  # past the input: zero fill only
        acc = _add_at(b, acc, run, dim, q * step, sizes)
    return [acc if acc is not None else _zeros(b, sizes, grad)]


@register("UnfoldBackwardBackward0", complex=True)
def unfold_backward_backward(b, node, grads):
    # grad_in: grad.unfold(dim, size, step): window w's element k reads position w * step + k
    grad = grads[0]
    if grad.ndim == 0:
        raise NotImplementedError("the unfold of a 0-d gradient")
    dim, size, step = norm_dim(node.saved("dim"), grad.ndim), node.saved("size"), node.saved("step")
    windows = (grad.shape[dim] - size) // step + 1
    starts = b.reshape(b.mul(_arange(b, windows, grad.device), step), (windows, 1))
    positions = b.add(starts, b.reshape(_arange(b, size, grad.device), (1, size)))
    windowed = b.index(grad, [None] * dim + [positions])  # (..., windows, size, ...)
    order = [*range(dim + 1), *range(dim + 2, grad.ndim + 1), dim + 1]
    return [b.permute(windowed, order)]


def _block_shape(t) -> tuple[int, int] | None:
    """The (rows, cols) block of one block_diag input: a 0-d tensor is 1x1, a 1-d one a row."""
    if t is None:
        return None
    shape = tuple(t.shape)
    return {0: (1, 1), 1: (1, shape[0] if shape else 1)}.get(len(shape), shape)


def _block_offset(node, blocks, j: int, total: tuple) -> tuple[int, int]:
    """Where block j starts (row, col): counted from the front, or from the back when a block
    before it has no metadata (an input that needs no gradient)."""
    if all(s is not None for s in blocks[:j]):
        return tuple(sum(s[k] for s in blocks[:j]) for k in (0, 1))
    if all(s is not None for s in blocks[j:]):
        return tuple(total[k] - sum(s[k] for s in blocks[j:]) for k in (0, 1))
    raise NotImplementedError(f"{node.name}: block {j} sits between inputs that need no gradient; its offset is not visible from Python")


@register("BlockDiagBackward0", complex=True)
def block_diag_backward(b, node, grads):
    # tensors: block_diag_backward(grad, sizes, dtypes): the diagonal block of each input, reshaped to its size
    grad = grads[0]
    blocks = [_block_shape(node.output_type(j)) for j in range(node.num_outputs)]
    out = []
    for j, block in enumerate(blocks):
        if not node.needs(j):
            out.append(None)
            continue
        r, c = _block_offset(node, blocks, j, grad.shape)
        piece = b.slice(b.slice(grad, 0, r, r + block[0]), 1, c, c + block[1])
        out.append(b.reshape(piece, node.output_type(j).shape))
    return out


@register("NarrowCopyBackward0", complex=True)
def narrow_copy_backward(b, node, grads):
    # self: slice_backward_symint(grad, self.sym_sizes(), dim, start, start + length, 1)
    grad = grads[0]
    sizes = tuple(node.saved("self_sym_sizes"))
    dim = norm_dim(node.saved("dim"), len(sizes))
    start = node.saved("start") % sizes[dim] if sizes[dim] else 0
    if node.saved("length") == sizes[dim]:
        return [grad]
    if node.saved("length") == 0:
        return [_zeros(b, sizes, grad)]
    return [b.slice_scatter(_zeros(b, sizes, grad), grad, dim, start, start + node.saved("length"))]


@register("AsStridedBackward0", "AsStridedBackward0_copy", complex=True)
def as_strided_backward(b, node, grads):
    # self: as_strided_backward(grad, TensorGeometry(self), size, stride, storage_offset):
    #   scatter-add grad into a zero "storage" at the output's positions, then read the storage
    #   back at the input's positions (both relative to the smaller of the two offsets)
    # Which input element each output element aliases follows from the input's strides and storage
    # offset, which autograd keeps in C++ only: the native walker reads them (and its key guards
    # them); under the Python walker no layout is provable and the node runs live.
    geometry = node.input_geometry()
    if geometry is None:
        raise NotImplementedError(
            "the gradient depends on the strides and storage offset of the input, which autograd keeps "
            "in C++ only (the native walker reads them)"
        )
    in_size, in_stride, in_offset = (tuple(x) if isinstance(x, (list, tuple)) else x for x in geometry)
    grad = grads[0]
    size, stride = tuple(node.saved("size")), tuple(node.saved("stride"))
    offset = node.saved("storage_offset")
    offset = in_offset if offset is None else offset
    if _numel(in_size) == 0 or _numel(size) == 0:
        return [_zeros(b, in_size, grad)]
    if _may_overlap(in_size, in_stride):
        # torch divides by how often each position is read, and gives NaN outside the input's reach
        raise NotImplementedError("the input's geometry overlaps itself")
    shared = min(in_offset, offset)
    storage_size = max(_storage_extent(in_size, in_stride, in_offset - shared), _storage_extent(size, stride, offset - shared))
    storage = b.full((storage_size,), 0, grad.dtype, grad.device)
    out_positions = b.reshape(_strided_positions(b, size, stride, offset - shared, grad.device), (-1,))
    storage = b.index_put(storage, [out_positions], b.reshape(grad, (-1,)), True)
    return [b.index(storage, [_strided_positions(b, in_size, in_stride, in_offset - shared, grad.device)])]


def _storage_extent(size, stride, offset: int) -> int:
    """_min_storage_size: one past the last position a geometry reaches."""
    return offset + 1 + sum((n - 1) * st for n, st in zip(size, stride))


def _may_overlap(size, stride) -> bool:
    """_maybe_overlapping_memory: dims of size > 1 sorted by stride, each stride must exceed the
    extent of the dims below it."""
    dims = sorted((st, n) for n, st in zip(size, stride) if n > 1)
    extent = 0
    for st, n in dims:
        if st <= extent:
            return True
        extent += (n - 1) * st
    return False


def _strided_positions(b, size, stride, offset: int, device):
    """The flat positions `offset + sum(i_k * stride_k)` that as_strided(size, stride, offset) reads
    from a contiguous tensor, as an int64 tensor of shape `size`."""
    pos = b.full((), offset, torch.int64, device)
    for k, (n, st) in enumerate(zip(size, stride)):
        axis = b.reshape(b.mul(_arange(b, n, device), st), (n,) + (1,) * (len(size) - k - 1))
        pos = b.add(pos, axis)
    return b.expand(pos, tuple(size))


@register("AsStridedScatterBackward0", complex=True)
def as_strided_scatter_backward(b, node, grads):
    # src: grad.contiguous().as_strided(size, stride, storage_offset)
    # self: as_strided_scatter_backward(grad, TensorGeometry(self), TensorGeometry(src), ...); torch
    # 2.11 and 2.13 return grad kept at the overwritten positions and zero elsewhere, the opposite of
    # the math (gradcheck fails on it). Neither copy of that is right here, so self declines and
    # runs as the live node, giving what eager gives.
    if node.needs(0):
        raise NotImplementedError(
            f"{node.name}: torch's self gradient masks the opposite positions from the math (it fails gradcheck); "
            "the live node keeps eager's result"
        )
    grad = grads[0]
    size, stride = tuple(node.saved("size")), tuple(node.saved("stride"))
    if _numel(size) == 0:
        return [None, _zeros(b, size, grad)]
    offset = node.saved("storage_offset") or 0  # None: the contiguous grad's own offset, 0
    return [None, b.index(b.reshape(grad, (-1,)), [_strided_positions(b, size, stride, offset, grad.device)])]
