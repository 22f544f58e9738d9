"""Gradients of layout (view) nodes against torch.autograd: one case per node and form of it."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import DTYPES, Case, check_case, check_grads, const, graph_node_names, leaf, make, one, rand

# A fallback to eager autograd would compare torch with itself: make it an error.
pytestmark = pytest.mark.filterwarnings("error:gpuautograd falls back")


def fresh(x):
    """A non-view, non-leaf copy made by a rule of this module (cat), so in-place view ops
    (t_, squeeze_, ...) are allowed on it without involving other rule families."""
    return torch.cat([x])


CASES = [
    # reshapes
    Case("view", "ViewBackward0", lambda x: x.view(13, 7), one(7, 13)),
    Case("view_flat", "ViewBackward0", lambda x: x.view(-1), one(3, 7, 13)),
    Case("flatten", "ViewBackward0", lambda x: x.flatten(1), one(3, 7, 13)),
    Case("unflatten_nc", "ViewBackward0", lambda x: x.unflatten(0, (7, 1)), one(7, 13, nc=True)),
    # a reshape that cannot be a view copies (CloneBackward0, another family) and then _unsafe_view
    Case("flatten_nc", "UnsafeViewBackward0", lambda x: x.flatten(), one(7, 13, nc=True)),
    Case("reshape_nc", "UnsafeViewBackward0", lambda x: x.reshape(99, 65), one(3, 33, 65, nc=True)),
    Case("unsafe_view", "UnsafeViewBackward0", lambda x: torch.ops.aten._unsafe_view(x, (13, 7)), one(7, 13)),
    Case("reshape_alias", "ReshapeAliasBackward0", lambda x: torch.ops.aten._reshape_alias(x, (13, 7), (7, 1)), one(7, 13)),
    Case("alias", "AliasBackward0", lambda x: torch.ops.aten.alias(x), one(7, 13, nc=True)),
    # expand
    Case("expand_mid", "ExpandBackward0", lambda x: x.expand(7, 5, 13), one(7, 1, 13)),
    Case("expand_lead", "ExpandBackward0", lambda x: x.expand(3, 7, 13), one(13)),
    Case("expand_nc", "ExpandBackward0", lambda x: x.expand(2, 13, 9), one(13, 1, nc=True)),
    # dim permutations
    Case("t_nc", "TBackward0", lambda x: x.t(), one(7, 13, nc=True)),
    Case("t_1d", "TBackward0", lambda x: x.t(), one(13)),
    Case("t_inplace", "TBackward1", lambda x: fresh(x).t_(), one(7, 13)),
    Case("transpose", "TransposeBackward0", lambda x: x.transpose(0, 2), one(3, 7, 13)),
    Case("mT_nc", "TransposeBackward0", lambda x: x.mT, one(3, 7, 13, nc=True)),
    Case("swapaxes_neg", "TransposeBackward0", lambda x: x.swapaxes(-1, -3), one(3, 7, 13)),
    Case("transpose_inplace", "TransposeBackward1", lambda x: fresh(x).transpose_(0, -1), one(3, 7, 13)),
    Case("permute", "PermuteBackward0", lambda x: x.permute(2, 0, 1), one(3, 7, 13)),
    Case("permute_neg_nc", "PermuteBackward0", lambda x: x.permute(-1, 0, -2), one(3, 7, 13, nc=True)),
    Case("T", "PermuteBackward0", lambda x: x.T, one(7, 13)),
    Case("movedim", "PermuteBackward0", lambda x: x.movedim(0, -1), one(3, 7, 13)),
    # squeeze / unsqueeze
    Case("squeeze_all", "SqueezeBackward0", lambda x: x.squeeze(), one(7, 1, 13, 1)),
    Case("squeeze_dim", "SqueezeBackward1", lambda x: x.squeeze(1), one(7, 1, 13, 1)),
    Case("squeeze_neg", "SqueezeBackward1", lambda x: x.squeeze(-1), one(7, 1, 13, 1)),
    Case("squeeze_noop", "SqueezeBackward1", lambda x: x.squeeze(0), one(7, 13, nc=True)),
    Case("squeeze_dims", "SqueezeBackward2", lambda x: x.squeeze((1, -1)), one(7, 1, 13, 1)),
    Case("squeeze_all_", "SqueezeBackward3", lambda x: fresh(x).squeeze_(), one(7, 1, 13, 1)),
    Case("squeeze_dim_", "SqueezeBackward4", lambda x: fresh(x).squeeze_(-1), one(7, 1, 13, 1)),
    Case("squeeze_dims_", "SqueezeBackward5", lambda x: fresh(x).squeeze_((1, 3)), one(7, 1, 13, 1)),
    Case("unsqueeze", "UnsqueezeBackward0", lambda x: x.unsqueeze(1), one(7, 13, nc=True)),
    Case("unsqueeze_neg", "UnsqueezeBackward0", lambda x: x.unsqueeze(-1), one(7, 13)),
    Case("none_index", "UnsqueezeBackward0", lambda x: x[..., None], one(7, 13)),
    Case("unsqueeze_", "UnsqueezeBackward1", lambda x: fresh(x).unsqueeze_(-2), one(7, 13)),
    # slices
    Case("slice_from", "SliceBackward0", lambda x: x[:, 1:], one(7, 13, nc=True)),
    Case("slice_step", "SliceBackward0", lambda x: x[:, 1::3], one(7, 13)),
    Case("slice_neg", "SliceBackward0", lambda x: x[:, -5:-1], one(7, 13)),
    Case("slice_rows", "SliceBackward0", lambda x: x[2:5], one(33, 65, nc=True)),
    Case("slice_past_end", "SliceBackward0", lambda x: x[:, 4:100], one(7, 13)),
    Case("slice_empty", "SliceBackward0", lambda x: x[:, 20:], one(7, 13)),
    Case("narrow", "SliceBackward0", lambda x: x.narrow(2, 1, 3), one(3, 7, 13)),
    Case("tensor_split", "SliceBackward0", lambda x: x.tensor_split(3, 1), one(7, 13)),
    Case("select", "SelectBackward0", lambda x: x[:, 2], one(7, 13, nc=True)),
    Case("select_neg", "SelectBackward0", lambda x: x.select(-2, -1), one(3, 7, 13)),
    Case("select_scalar", "SelectBackward0", lambda x: x[6][12], one(7, 13)),
    # cat / stack
    Case("cat", "CatBackward0", lambda x, y: torch.cat([x, y], 1), make(leaf(7, 13, nc=True), leaf(7, 5))),
    Case("cat_neg_dim", "CatBackward0", lambda x, y: torch.cat([x, y, x], -1), make(leaf(3, 7, 13), leaf(3, 7, 2))),
    Case("cat_const_first", "CatBackward0", lambda c, x: torch.cat([c, x]), make(const(4, 13), leaf(7, 13))),
    Case("cat_const_middle", "CatBackward0", lambda x, c, y: torch.cat([x, c, y]), make(leaf(3, 13), const(4, 13), leaf(7, 13))),
    Case("cat_legacy_empty", "CatBackward0", lambda x, e: torch.cat([x, e], 1), make(leaf(7, 13), leaf(0))),
    Case("stack", "StackBackward0", lambda x, y: torch.stack([x, y], 1), make(leaf(7, 13, nc=True), leaf(7, 13))),
    Case("stack_same_neg", "StackBackward0", lambda x: torch.stack([x, x, x], -1), one(7, 13)),
    # split / unbind (multi-output nodes: some outputs may carry no gradient)
    Case("split_all", "SplitBackward0", lambda x: x.split(4, 1), one(7, 13, nc=True)),
    Case("split_one", "SplitBackward0", lambda x: x.split(4, 1)[1], one(7, 13)),
    Case("split_some", "SplitBackward0", lambda x: x.split(3, -1)[::2], one(3, 7, 13)),
    Case("chunk", "SplitBackward0", lambda x: x.chunk(3, 0)[1:], one(7, 13)),
    Case("split_sizes", "SplitWithSizesBackward0", lambda x: x.split([2, 5, 6], 1), one(7, 13, nc=True)),
    Case("split_sizes_one", "SplitWithSizesBackward0", lambda x: x.split([2, 5, 6], 1)[1], one(7, 13)),
    Case("unbind_all", "UnbindBackward0", lambda x: x.unbind(1), one(7, 13, nc=True)),
    Case("unbind_one", "UnbindBackward0", lambda x: x.unbind(0)[3], one(7, 13)),
    Case("unbind_neg", "UnbindBackward0", lambda x: x.unbind(-1)[::4], one(3, 7, 5)),
    # the *_copy ops: a fresh tensor, the view's formula
    Case("view_copy", "ViewBackward0_copy", lambda x: torch.view_copy(x, (13, 7)), one(7, 13)),
    Case("reshape_alias_copy", "ReshapeAliasBackward0_copy", lambda x: torch.ops.aten._reshape_alias_copy(x, (91,), (1,)), one(7, 13)),
    Case("alias_copy", "AliasBackward0_copy", lambda x: torch.alias_copy(x), one(7, 13, nc=True)),
    Case("expand_copy", "ExpandBackward0_copy", lambda x: torch.expand_copy(x, (3, 7, 13)), one(7, 1, nc=True)),
    Case("squeeze_copy", "SqueezeBackward0_copy", lambda x: torch.squeeze_copy(x), one(7, 1, 13)),
    Case("squeeze_copy_dim", "SqueezeBackward1_copy", lambda x: torch.squeeze_copy(x, -1), one(7, 13, 1)),
    Case("squeeze_copy_dims", "SqueezeBackward2_copy", lambda x: torch.squeeze_copy(x, (0, 2)), one(1, 13, 1)),
    Case("unsqueeze_copy", "UnsqueezeBackward0_copy", lambda x: torch.unsqueeze_copy(x, -2), one(7, 13, nc=True)),
    Case("t_copy", "TBackward0_copy", lambda x: torch.t_copy(x), one(7, 13, nc=True)),
    Case("transpose_copy", "TransposeBackward0_copy", lambda x: torch.transpose_copy(x, 0, -1), one(3, 7, 13)),
    Case("permute_copy", "PermuteBackward0_copy", lambda x: torch.permute_copy(x, (2, 0, 1)), one(3, 7, 13, nc=True)),
    Case("select_copy", "SelectBackward0_copy", lambda x: torch.select_copy(x, 1, -3), one(7, 13, nc=True)),
    Case("slice_copy", "SliceBackward0_copy", lambda x: torch.slice_copy(x, 1, 2, 11, 3), one(7, 13)),
    Case("split_copy", "SplitBackward0_copy", lambda x: torch.split_copy(x, 4, 1)[1:], one(7, 13, nc=True)),
    Case("split_sizes_copy", "SplitWithSizesBackward0_copy", lambda x: torch.split_with_sizes_copy(x, [2, 5], 0)[0], one(7, 13)),
    Case("unbind_copy", "UnbindBackward0_copy", lambda x: torch.unbind_copy(x, 1)[::5], one(7, 13)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_view_rule(case, dtype):
    check_case(case, dtype)


def test_attention_style_layout_chain():
    # qkv split, head reshapes and transposes, a slice and a stack: gradients of one tensor
    # meet again at the split node and must be summed in the right places.
    def fn(x):
        q, k, v = x.split(8, -1)
        heads = [t.view(2, 7, 2, 4).transpose(1, 2) for t in (q, k, v)]
        mixed = torch.stack([heads[0], heads[1].mT.mT, heads[2]], 0)[:, :, 1:]
        return torch.cat([mixed.flatten(0, 1), heads[0][:, :1]], 0).permute(3, 0, 2, 1)

    x = rand(2, 7, 24)
    assert {"SplitBackward0", "ViewBackward0", "StackBackward0", "CatBackward0"} <= graph_node_names(fn(x))
    check_grads(fn, x)
