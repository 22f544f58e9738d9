"""Random graphs through the interpret backend: chains of pointwise ops, reductions that broadcast
back, softmax and layer norm, permutes, reshapes, cat, strided slices and broadcasts, on small odd
shapes (size-1 dims included). Each seed builds one graph; its gradients must equal torch.autograd's
within the dtype's tolerance. Catches indexing and fusion bugs no hand-written case thought of."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from tests.helpers import assert_close, no_kernel_fallback

pytestmark = [
    pytest.mark.usefixtures("walker"),  # every case with both walkers (tests/conftest.py)
    pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning"),  # numpy, on discarded lanes
]


def _step(rng: random.Random, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    d = rng.randrange(x.ndim)
    choices = [
        lambda: x * y if x.shape == y.shape else x * 2.5,
        lambda: torch.tanh(x) + x,
        lambda: torch.sigmoid(x) * x,
        lambda: (x - x.sum(d, keepdim=True) / 3).exp() * 0.1,
        lambda: x.softmax(d),
        lambda: x.permute(*rng.sample(range(x.ndim), x.ndim)) * 1.5,
        lambda: x.reshape(-1).reshape(x.shape[::-1]).transpose(0, -1) * 1.5,
        lambda: torch.cat([x, x.narrow(d, 0, 1) * 3], d),
        lambda: x.narrow(d, 0, max(1, x.shape[d] // 2)) * 2,
        lambda: x.pow(2) + x.abs(),
        lambda: x.mean(d),
        lambda: F.gelu(x),
        lambda: F.layer_norm(x, x.shape[-1:]),
        lambda: x[(slice(None),) * d + (slice(None, None, 2),)] * 1.0,
        lambda: x.unsqueeze(0).expand(2, *x.shape) * 0.5,
        lambda: torch.where(x > 0, x, x * 0.1),
    ]
    return rng.choice(choices)()


def random_graph(seed: int, dtype: torch.dtype):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shape = [rng.choice([1, 2, 3, 5, 7]) for _ in range(rng.choice([2, 3]))]
    a, b = (torch.randn(*shape, dtype=dtype, requires_grad=True) for _ in range(2))
    x = a * b if rng.random() < 0.5 else a + 1
    for _ in range(rng.randrange(2, 6)):
        x = _step(rng, x, b)
        if x.ndim == 0:
            break
    return (a, b), x


@pytest.mark.parametrize("seed", range(96))
def test_random_graph_matches_torch_autograd(seed):
    dtype = torch.float32 if seed % 3 == 0 else torch.float64
    leaves, out = random_graph(seed, dtype)
    _same_grads_as_torch(out, leaves, f"seed {seed}")


def _same_grads_as_torch(out, leaves, msg):
    g = torch.randn_like(out)
    with no_kernel_fallback():
        ours = gpuautograd.grad([out], leaves, [g], retain_graph=True, allow_unused=True, backend="interpret")
    theirs = torch.autograd.grad([out], leaves, [g], allow_unused=True)
    for a, e in zip(ours, theirs):
        assert (a is None) == (e is None)
        if e is not None:
            assert_close(a, e, msg=msg)


def _matmul_step(rng: random.Random, x: torch.Tensor, weights: list) -> torch.Tensor:
    """One step of a random 2-D chain with products in it: what the matmul prologues, epilogues,
    column sums and sums of products (issue 26) fuse."""
    n = x.shape[1]

    def weight(cols):  # scaled as a layer's weight is, so values stay near 1 along the chain
        w = (torch.randn(n, cols, dtype=x.dtype) * n**-0.5).requires_grad_()
        weights.append(w)
        return w

    def linear():
        return x @ weight(rng.choice([1, 5, 17, 40]))

    def gated():
        return F.silu(x @ weight(24)) * (x @ weight(24))

    choices = [
        linear,
        linear,
        gated,
        lambda: F.gelu(x) * 1.5,
        lambda: F.layer_norm(x, x.shape[-1:]),
        lambda: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
        lambda: x - x.mean(0, keepdim=True),
        lambda: x.pow(2) * 0.5 + x,
        lambda: torch.cat([x, x * 2], 1),
        lambda: x.t().contiguous().t() * 1.0 + x.sum(0),
    ]
    return rng.choice(choices)()


@pytest.mark.parametrize("mode", ["cost", "always"])
@pytest.mark.parametrize("seed", range(24))
def test_random_matmul_chain_matches_torch_autograd(seed, mode, monkeypatch):
    from gpuautograd.fusion import heuristics as H

    monkeypatch.setattr(H, "MATMUL_EPILOGUES", mode)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    x0 = torch.randn(rng.choice([3, 33, 130]), rng.choice([4, 17, 48]), requires_grad=True)  # float32: generated matmuls
    weights: list = []
    x = x0
    for _ in range(rng.randrange(2, 6)):
        x = _matmul_step(rng, x, weights)
    out = x.pow(2).mean() if rng.random() < 0.5 else x * 1.0
    _same_grads_as_torch(out, [x0] + weights, f"seed {seed}, {mode}")
