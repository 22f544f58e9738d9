"""End to end: train the model suite for a few steps with gpuautograd and with eager autograd,
side by side from the same weights and batches, and compare every gradient and parameter."""

import pytest
import torch

import gpuautograd
from bench.models import SUITE
from tests.helpers import assert_close, train_side_by_side

FAMILIES = ["mlp", "cnn", "gpt", "gpt-manual-attn", "llama", "moe", "lstm-lm", "gnn", "stft-loss", "fno"]

pytestmark = pytest.mark.usefixtures("walker")  # every case with both walkers (tests/conftest.py)


@pytest.mark.parametrize("name", FAMILIES)
def test_model_family_matches_eager_float64(name):
    gpuautograd.reset()
    model, make_batch, loss_fn = SUITE[name](dtype=torch.float64)
    loss = loss_fn(model, *make_batch(torch.Generator().manual_seed(0)))
    report = gpuautograd.explain(loss)
    assert report.opaque_nodes == [], f"{name}: opaque nodes {report.opaque_nodes}"
    train_side_by_side(name, torch.float64, steps=4)
    s = gpuautograd.stats()
    assert s["captures"] == 1 and s["cache_hits"] == 3, s


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama", "moe", "lstm-lm", "gnn", "stft-loss", "fno"])
def test_model_family_matches_eager_float32(name):
    model, make_batch, loss_fn = SUITE[name](dtype=torch.float32)
    loss = loss_fn(model, *make_batch(torch.Generator().manual_seed(0)))
    assert gpuautograd.explain(loss).opaque_nodes == [], name  # float32 takes other kernels (oneDNN's LSTM)
    train_side_by_side(name, torch.float32, steps=2)


def test_shape_change_recaptures_with_correct_grads():
    gpuautograd.reset()
    for batch in (2, 2, 3):
        torch.manual_seed(0)
        model, make_batch, loss_fn = SUITE["gpt"](dtype=torch.float64, batch=batch)
        inputs = make_batch(torch.Generator().manual_seed(batch))
        gpuautograd.backward(loss_fn(model, *inputs))
        ours = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        loss_fn(model, *inputs).backward()
        for a, e in zip(ours, (p.grad for p in model.parameters())):
            assert_close(a, e)
    s = gpuautograd.stats()
    assert s["captures"] == 2 and s["cache_hits"] == 1
    assert "new graph structure" != s["miss_reasons"][1]
