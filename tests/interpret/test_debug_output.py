"""GPUAUTOGRAD_DEBUG shows the fused plan (level 2) and every fusion decision with its reason (3)."""

from __future__ import annotations

import torch

import gpuautograd


def _backward():
    x = torch.randn(9, 17, requires_grad=True)
    w = torch.randn(17, 5, requires_grad=True)
    loss = (torch.cumsum(torch.tanh(x @ w), 0) * 0.5).sum()
    gpuautograd.backward(loss, backend="interpret")
    return x, w


def test_level_3_prints_the_plan_and_each_decision_not_to_fuse(monkeypatch, capsys):
    monkeypatch.setenv("GPUAUTOGRAD_DEBUG", "3")
    _backward()
    out = capsys.readouterr().out
    assert "[gpuautograd] fused plan (" in out and "launches):" in out
    assert "[gpuautograd] fusion decisions:" in out
    assert "not fused: " in out and "cumsum" in out and "scan op" in out
    assert "not fused: " in out and "= mm " in out and "extern op" in out


def test_level_0_is_quiet(monkeypatch, capsys):
    monkeypatch.setenv("GPUAUTOGRAD_DEBUG", "0")
    _backward()
    assert capsys.readouterr().out == ""
