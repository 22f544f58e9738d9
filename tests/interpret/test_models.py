"""End to end on the 'interpret' backend: the model suite of bench/models.py at odd sizes, trained
for a few steps side by side with eager autograd and with the reference executor (same weights,
batches and dropout masks), every gradient and parameter compared. The plans must really be
fused: kernels, fewer launches than IR instructions, no opaque node."""

from __future__ import annotations

import pytest
import torch

import gpuautograd
from bench.models import SUITE
from tests.helpers import train_side_by_side

BACKEND = "interpret"

pytestmark = [
    pytest.mark.usefixtures("walker"),  # every case with both walkers (tests/conftest.py)
    pytest.mark.filterwarnings("error:gpuautograd falls back"),
    pytest.mark.filterwarnings("error:gpuautograd. kernel:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning"),  # numpy, on lanes a tl.where discards
]

# Odd sizes where the factories take them: batch 3, sequence 13, d_model 48 (4 heads of 12).
# The MLP's and the CNN's widths are fixed by their factories.
ODD = {
    "mlp": dict(batch=3),
    "cnn": dict(batch=3),
    "gpt": dict(batch=3, seq=13, d_model=48),
    "gpt-manual-attn": dict(batch=3, seq=13, d_model=48),
    "llama": dict(batch=3, seq=13, d_model=48),
    "moe": dict(batch=3, seq=13, d_model=24),
    "lstm-lm": dict(batch=3, seq=13, d_model=20),
    "gnn": dict(nodes=37, edges=101),
    "stft-loss": dict(batch=3, samples=203),
    "fno": dict(batch=3, size=13),
}


def test_every_model_of_the_suite_is_covered():
    assert set(ODD) == set(SUITE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(ODD))
def test_model_trains_like_eager_and_the_reference_executor(name, dtype):
    steps = 3
    train_side_by_side(name, dtype, steps=steps, backend=BACKEND, **ODD[name])
    s = gpuautograd.stats()
    # one capture per backend, every later step a cache hit on each
    assert s["captures"] == 2 and s["cache_hits"] == 2 * (steps - 1) and not s["fallbacks"], s


@pytest.mark.parametrize("name", list(ODD))
def test_model_plan_is_fused(name):
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name](dtype=torch.float32, **ODD[name])
    loss = loss_fn(model, *make_batch(torch.Generator().manual_seed(0)))
    report = gpuautograd.explain(loss, backend=BACKEND)
    assert report.backend == BACKEND
    assert report.opaque_nodes == [], f"{name}: opaque nodes {report.opaque_nodes}"
    instructions = report.program.num_ops()
    assert report.kernels, f"{name}: no kernels\n{report}"
    assert report.launches < instructions, f"{name}: {report.launches} launches for {instructions} IR instructions\n{report.plan}"
    assert len(report.kernels) <= report.launches
    for k in report.kernels:
        assert f"def {k.name}(" in k.source and k.members, k.source
        assert f"{k.name}(" in report.plan, f"{k.name} is never launched\n{report.plan}"
    # explain() runs nothing: the same graph still backpropagates, through the plan it showed
    gpuautograd.backward(loss, backend=BACKEND)
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", ["gpt", "llama", "cnn"])
def test_gpu_block_sizes_run_right_in_the_interpreter(name, monkeypatch):
    """The interpreter normally runs large blocks (fewer Python-level programs); here it runs the
    GPU's block sizes and grids, so the exact launches the "triton" backend makes are validated."""
    from gpuautograd.fusion import heuristics as H

    for suffix in ("TILE_ELEMENTS", "POINTWISE_BLOCK", "LOOP_COLS", "LOOP_ROWS", "COLUMN_ROWS"):
        monkeypatch.setattr(H, f"INTERPRET_{suffix}", getattr(H, f"GPU_{suffix}"))
    train_side_by_side(name, torch.float32, steps=2, backend=BACKEND, **ODD[name])
