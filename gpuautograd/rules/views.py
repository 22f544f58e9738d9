"""Backward rules of layout (view) nodes: reshape, expand, transpose, squeeze, slices, cat, split.

The `*_copy` ops (`torch.expand_copy`, `view_copy`, ...) return a fresh tensor instead of a view;
their nodes (`ExpandBackward0_copy`, ...) have the view's formula and saved values, so they share
its rule.

Every rule here only moves gradient elements around (or sums them, for expand); none does math.
"""

from __future__ import annotations

from .registry import register


def norm_dim(dim: int, ndim: int) -> int:
    """A saved dim (possibly negative) -> a dim in [0, ndim); ndim 0 acts like 1."""
    return dim % max(ndim, 1)


def self_sizes_and_dim(node) -> tuple[tuple, int]:
    """The saved sizes of `self` and the saved `dim`, normalized against them."""
    sizes = tuple(node.saved("self_sym_sizes"))
    return sizes, norm_dim(node.saved("dim"), len(sizes))


def clamp_slice_bounds(start, end, size: int) -> tuple[int, int]:
    """torch's slice bounds: None -> the ends, negatives count from the end, then clamped to
    [0, size] with end >= start. `end` is often INT64_MAX for `x[a:]`."""
    start = 0 if start is None else start
    end = size if end is None else end
    if start < 0:
        start += size
    if end < 0:
        end += size
    start = min(max(start, 0), size)
    end = min(max(end, start), size)
    return start, end


def _zeros_like_type(b, t, dtype=None):
    return b.full(t.shape, 0, dtype or t.dtype, t.device)


# -- reshapes ---------------------------------------------------------------------------------


@register("ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "ViewBackward0_copy", "ReshapeAliasBackward0_copy", complex=True)
def view_backward(b, node, grads):
    # self: grad.reshape_symint(self.sym_sizes())
    return [b.reshape(grads[0], node.saved("self_sym_sizes"))]


@register("AliasBackward0", "AliasBackward0_copy", complex=True)
def alias_backward(b, node, grads):
    # self: grad
    return [grads[0]]


@register("ExpandBackward0", "ExpandBackward0_copy", complex=True)
def expand_backward(b, node, grads):
    # self: at::sum_to(grad, self.sym_sizes())
    return [b.sum_to(grads[0], node.saved("self_sym_sizes"))]


@register(
    "SqueezeBackward0",
    "SqueezeBackward1",
    "SqueezeBackward2",
    "SqueezeBackward3",
    "SqueezeBackward4",
    "SqueezeBackward5",
    "SqueezeBackward0_copy",
    "SqueezeBackward1_copy",
    "SqueezeBackward2_copy",
    complex=True,
)
def squeeze_backward(b, node, grads):
    # self: unsqueeze_to(grad, [dim(s),] self.sym_sizes()); squeeze only drops size-1 dims, so
    # restoring them is a reshape to the saved sizes whichever dims were named.
    return [b.reshape(grads[0], node.saved("self_sym_sizes"))]


@register("UnsqueezeBackward0", "UnsqueezeBackward1", "UnsqueezeBackward0_copy", complex=True)
def unsqueeze_backward(b, node, grads):
    # self: grad.squeeze(dim)   (dim counts in the output's dims, which grad has)
    grad = grads[0]
    return [b.squeeze(grad, norm_dim(node.saved("dim"), grad.ndim))]


# -- dim permutations -------------------------------------------------------------------------


@register("TBackward0", "TBackward1", "TBackward0_copy", complex=True)
def t_backward(b, node, grads):
    # self: grad.t()   (identity for 0-d and 1-d tensors)
    grad = grads[0]
    return [b.transpose(grad, 0, 1) if grad.ndim == 2 else grad]


@register("TransposeBackward0", "TransposeBackward1", "TransposeBackward0_copy", complex=True)
def transpose_backward(b, node, grads):
    # self: grad.transpose(dim0, dim1)
    grad = grads[0]
    return [b.transpose(grad, norm_dim(node.saved("dim0"), grad.ndim), norm_dim(node.saved("dim1"), grad.ndim))]


@register("PermuteBackward0", "PermuteBackward0_copy", complex=True)
def permute_backward(b, node, grads):
    # self: permute_backwards(grad, dims): grad.permute(inverse of dims)
    grad = grads[0]
    dims = [norm_dim(d, grad.ndim) for d in node.saved("dims")]
    inverse = [0] * len(dims)
    for i, d in enumerate(dims):
        inverse[d] = i
    return [b.permute(grad, inverse)]


# -- slices -----------------------------------------------------------------------------------


@register("SliceBackward0", "SliceBackward0_copy", complex=True)
def slice_backward(b, node, grads):
    # self: slice_backward_wrapper(grad, self.sym_sizes(), dim, start, end, step)
    #       = zeros(self.sizes).slice_scatter(grad, dim, start, end, step)
    grad = grads[0]
    sizes, dim = self_sizes_and_dim(node)
    step = node.saved("step")
    start, end = clamp_slice_bounds(node.saved("start"), node.saved("end"), sizes[dim])
    if start == 0 and end == sizes[dim] and step == 1:
        return [grad]  # the slice took the whole dim
    base = b.full(sizes, 0, grad.dtype, grad.device)
    return [b.slice_scatter(base, grad, dim, start, end, step)]


@register("SelectBackward0", "SelectBackward0_copy", complex=True)
def select_backward(b, node, grads):
    # self: select_backward_symint(grad, self.sym_sizes(), dim, index)
    #       = zeros(self.sizes).select_scatter(grad, dim, index)
    grad = grads[0]
    sizes, dim = self_sizes_and_dim(node)
    index = node.saved("index") % sizes[dim]
    base = b.full(sizes, 0, grad.dtype, grad.device)
    return [b.select_scatter(base, grad, dim, index)]


# -- cat / stack and their inverses -----------------------------------------------------------


def _is_legacy_empty(t, ndim: int) -> bool:
    """cat skips 1-d empty inputs whatever the rank of the others (legacy behavior)."""
    return t is not None and t.shape == (0,) and ndim != 1


def _cat_piece_sizes(node, ndim: int, dim: int) -> list:
    """The size along `dim` of each cat input, None where unknown. Autograd keeps these sizes in
    C++ only, so they come from the edges' metadata, which an input without grad lacks."""
    sizes = []
    for j in range(node.num_outputs):
        t = node.output_type(j)
        if t is None:
            sizes.append(None)
        else:
            sizes.append(0 if _is_legacy_empty(t, ndim) else t.shape[dim])
    return sizes


def _cat_offset(node, sizes: list, j: int, total: int) -> int:
    """Where input j starts: counted from the front, or from the back when an input before it
    has no metadata (e.g. `cat([constant, x])`)."""
    if all(s is not None for s in sizes[:j]):
        return sum(sizes[:j])
    if all(s is not None for s in sizes[j:]):
        return total - sum(sizes[j:])
    raise NotImplementedError(
        f"{node.name}: input {j} sits between concatenated inputs that need no gradient; their "
        "sizes are not visible from Python, so its offset is ambiguous"
    )


@register("CatBackward0", complex=True)
def cat_backward(b, node, grads):
    # tensors: cat_tensors_backward(grad, tensors sizes, tensors dtypes, dim): grad.narrow per input
    grad = grads[0]
    dim = norm_dim(node.saved("dim"), grad.ndim)
    sizes = _cat_piece_sizes(node, grad.ndim, dim)
    out = []
    for j, size in enumerate(sizes):
        if not node.needs(j):
            out.append(None)
        elif _is_legacy_empty(node.output_type(j), grad.ndim):
            out.append(b.full((0,), 0, grad.dtype, grad.device))  # torch gives it an empty gradient
        else:
            start = _cat_offset(node, sizes, j, grad.shape[dim])
            out.append(b.slice(grad, dim, start, start + size))
    return out


@register("StackBackward0", complex=True)
def stack_backward(b, node, grads):
    # tensors: stack_tensors_backward(grad, dim, dtypes): grad.unbind(dim)
    grad = grads[0]
    dim = norm_dim(node.saved("dim"), grad.ndim)
    return [b.select(grad, dim, j) if node.needs(j) else None for j in range(node.num_outputs)]


def _join_pieces(b, grads, piece_types, dim: int, unsqueeze: bool):
    """cat (or stack, with `unsqueeze`) the output gradients; a missing one is a zero piece of its
    output's size, since the input gradient is defined wherever any piece's gradient is."""
    ref = next(g for g in grads if g is not None)
    pieces = []
    for g, t in zip(grads, piece_types):
        piece = g if g is not None else _zeros_like_type(b, t, ref.dtype)
        pieces.append(b.unsqueeze(piece, dim) if unsqueeze else piece)
    return b.cat(pieces, dim)


@register(
    "SplitBackward0",
    "SplitWithSizesBackward0",
    "UnsafeSplitBackward0",
    "UnsafeSplitWithSizesBackward0",
    "SplitBackward0_copy",
    "SplitWithSizesBackward0_copy",
    complex=True,
)
def split_backward(b, node, grads):
    # self: split_backward / split_with_sizes_backward(grads, split_size(s), dim, sizes, options):
    #       cat(grads, dim) with zeros for the outputs without a gradient (unsafe_split and
    #       unsafe_chunk, whose outputs skip the view check, have the same formula)
    _, dim = self_sizes_and_dim(node)
    pieces = [node.input_type(i) for i in range(len(grads))]
    return [_join_pieces(b, grads, pieces, dim, unsqueeze=False)]


@register("UnbindBackward0", "UnbindBackward0_copy", complex=True)
def unbind_backward(b, node, grads):
    # self: unbind_backward(grads, dim): stack(grads, dim) with zeros for missing ones
    pieces = [node.input_type(i) for i in range(len(grads))]
    dim = norm_dim(node.saved("dim"), pieces[0].ndim + 1)
    return [_join_pieces(b, grads, pieces, dim, unsqueeze=True)]


# -- copy_ ------------------------------------------------------------------------------------


@register("torch::autograd::CopyBackwards", complex=True)
def copy_backward(b, node, grads):
    # self: zeros_like(grad) (copy_ overwrote it);  src: grad, which the driver sums, casts and
    # moves to src's shape, dtype and device like validate_outputs
    grad = grads[0]
    self_grad = _zeros_like_type(b, grad) if node.needs(0) else None
    return [self_grad, grad if node.needs(1) else None]
