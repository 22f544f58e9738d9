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
    g = torch.randn_like(out)
    with no_kernel_fallback():
        ours = gpuautograd.grad([out], leaves, [g], retain_graph=True, allow_unused=True, backend="interpret")
    theirs = torch.autograd.grad([out], leaves, [g], allow_unused=True)
    for a, e in zip(ours, theirs):
        assert (a is None) == (e is None)
        if e is not None:
            assert_close(a, e, msg=f"seed {seed}")
