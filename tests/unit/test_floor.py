"""explain().compulsory_bytes: what any backward must move, beside what the plan moves."""

import pytest
import torch

import gpuautograd
from bench.models import SUITE
from gpuautograd.runtime.floor import footprint


def test_the_floor_of_a_matmul_by_hand():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    e = gpuautograd.explain((x @ w).sum())
    # MmBackward0 reads x and w once each, the incoming gradient is one float, and it returns a
    # gradient of each leaf's size
    assert e.compulsory_bytes == (12 + 20) * 4 * 2 + 4


def test_a_tensor_saved_twice_counts_once_and_an_expanded_one_at_its_real_size():
    x = torch.randn(6, requires_grad=True)
    scale = torch.randn(1).expand(1000, 6)  # 4 bytes in memory, 24000 expanded
    y = (x * scale).sum() + (x * scale).sum()  # the same expanded tensor saved by two nodes
    assert footprint(scale) == 4
    e = gpuautograd.explain(y)
    # scale once (4 bytes), the scalar incoming gradient (4), x's gradient (24); x itself is not
    # read (a product's gradient with respect to x reads only the other factor)
    assert e.compulsory_bytes == 4 + 4 + 24


@pytest.mark.parametrize("name", ["mlp", "gpt", "cnn"])
def test_no_plan_moves_less_than_the_floor(name):
    model, make_batch, loss_fn = SUITE[name]()
    e = gpuautograd.explain(loss_fn(model, *make_batch(torch.Generator().manual_seed(0))), backend="interpret")
    assert 0 < e.compulsory_bytes <= e.bytes_moved
