"""Gradients of indexing nodes against torch.autograd. Indices repeat on purpose: the gradient of
a repeated read must accumulate every contribution, not keep the last one."""

from __future__ import annotations

import pytest
import torch

import gpuautograd
from tests.helpers import DTYPES, Case, check_case, const, fixed, idx, leaf, make, rand

# A fallback to eager autograd would compare torch with itself: make it an error.
pytestmark = pytest.mark.filterwarnings("error:gpuautograd falls back")


def rand_index(high, *shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, shape, generator=g)


CASES = [
    # advanced indexing: IndexBackward0 = index_put(accumulate=True) into zeros
    Case("index_rows", "IndexBackward0", lambda x, i: x[i], make(leaf(7, 13), fixed(idx(0, 3, 3, 6, 0, 3)))),
    Case("index_gap_nc", "IndexBackward0", lambda x, i: x[:, i], make(leaf(7, 13, nc=True), fixed(idx(12, -1, 4, 4)))),
    Case("index_2d_index", "IndexBackward0", lambda x, i: x[i], make(leaf(7, 13), fixed(rand_index(7, 5, 9)))),
    Case(
        "index_two_adjacent",
        "IndexBackward0",
        lambda x, i, j: x[:, i, j],
        make(leaf(3, 7, 13), fixed(idx(1, 1, 6)), fixed(idx(2, 2, 12))),
    ),
    Case("index_two_split", "IndexBackward0", lambda x, i, j: x[i, :, j], make(leaf(3, 7, 13), fixed(idx(2, 0, 2)), fixed(idx(-1, 5, -1)))),
    Case(
        "index_broadcast",
        "IndexBackward0",
        lambda x, i, j: x[i, j],
        make(leaf(7, 13, nc=True), fixed(rand_index(7, 4, 1)), fixed(rand_index(13, 1, 6))),
    ),
    Case("index_ellipsis", "IndexBackward0", lambda x, i: x[..., i], make(leaf(3, 7, 13), fixed(rand_index(13, 40)))),
    Case("index_mask", "IndexBackward0", lambda x, m: x[m], make(leaf(7, 13), fixed(rand_index(2, 7, 13).bool()))),
    Case("index_row_mask", "IndexBackward0", lambda x, m: x[:, m], make(leaf(3, 13, 7), fixed(rand_index(2, 13, seed=1).bool()))),
    Case("index_int32", "IndexBackward0", lambda x, i: x[i], make(leaf(33, 65), fixed(rand_index(33, 50).int()))),
    # gather: scatter_add into zeros
    Case("gather", "GatherBackward0", lambda x, i: x.gather(1, i), make(leaf(7, 13), fixed(rand_index(13, 7, 20)))),
    Case("gather_neg_nc", "GatherBackward0", lambda x, i: x.gather(-1, i), make(leaf(3, 7, 13, nc=True), fixed(rand_index(13, 3, 5, 4)))),
    Case("gather_dim0", "GatherBackward0", lambda x, i: x.gather(0, i), make(leaf(33, 65), fixed(rand_index(33, 40, 65)))),
    Case("take_along_dim", "GatherBackward0", lambda x, i: x.take_along_dim(i, 0), make(leaf(7, 13), fixed(rand_index(7, 9, 1)))),
    # index_select: index_add into zeros
    Case("index_select", "IndexSelectBackward0", lambda x, i: x.index_select(0, i), make(leaf(7, 13), fixed(idx(6, 0, 6, 6, 2)))),
    Case(
        "index_select_neg_nc",
        "IndexSelectBackward0",
        lambda x, i: x.index_select(-1, i),
        make(leaf(3, 7, 13, nc=True), fixed(rand_index(13, 30))),
    ),
    Case(
        "index_select_0d_index",
        "IndexSelectBackward0",
        lambda x, i: x.index_select(1, i),
        make(leaf(7, 13), fixed(torch.tensor(5))),
    ),
    Case("index_select_0d_self", "IndexSelectBackward0", lambda x, i: x.index_select(0, i), make(leaf(), fixed(idx(0)))),
    # scatter family
    Case(
        "scatter_add",
        "ScatterAddBackward0",
        lambda x, i, s: x.scatter_add(1, i, s),
        make(leaf(7, 13), fixed(rand_index(13, 7, 20)), leaf(7, 20)),
    ),
    Case(
        "scatter_add_nc",
        "ScatterAddBackward0",
        lambda x, i, s: x.scatter_add(-2, i, s),
        make(leaf(7, 13, nc=True), fixed(rand_index(7, 9, 13)), leaf(9, 13, nc=True)),
    ),
    Case(
        "scatter_add_src_only",
        "ScatterAddBackward0",
        lambda x, i, s: x.scatter_add(0, i, s),
        make(const(7, 13), fixed(rand_index(7, 3, 13)), leaf(3, 13)),
    ),
    Case(
        "scatter_src",
        "ScatterBackward0",
        lambda x, i, s: x.scatter(1, i, s),
        make(leaf(7, 13), fixed(rand_index(13, 7, 4)), leaf(7, 4)),
    ),
    Case("scatter_value", "ScatterBackward1", lambda x, i: x.scatter(0, i, 2.5), make(leaf(7, 13, nc=True), fixed(rand_index(7, 3, 13)))),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_indexing_rule(case, dtype):
    check_case(case, dtype)


def test_repeated_index_accumulates():
    # The gradient of x[i] at row r is the sum of the output rows that read r: count them.
    x = rand(5, 3)
    i = idx(4, 4, 4, 1, 0, 4)
    (gx,) = gpuautograd.grad([x[i]], [x], [torch.ones(6, 3, dtype=x.dtype)])
    counts = torch.bincount(i, minlength=5).to(x.dtype)
    torch.testing.assert_close(gx, counts[:, None].expand(5, 3))
