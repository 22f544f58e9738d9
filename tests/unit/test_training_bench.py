"""`python -m bench --size`: shrunk sizes planned on the CPU end to end (valid JSON, the plan's
gradients equal to eager's), the measuring path on the CPU, and the budget: a mode that runs over
its share is interrupted and recorded, one with no time left is skipped, and the JSON is written.
Nothing here asserts a duration."""

import json
import os
import signal

import pytest
import torch

import gpuautograd
from bench import budget as budget_mod
from bench import training
from bench.__main__ import main
from bench.budget import Budget, StepTimeout, time_limit
from bench.modes import Eager, Mode
from bench.sizes import SIZES
from bench.training import run_size
from bench.training_plan import _explain_figures

TINY = {
    "gpt2-small": dict(vocab=96, d_model=32, n_heads=4, n_layers=1, max_len=16),
    "llama-1b": dict(vocab=96, d_model=32, n_heads=4, n_kv_heads=2, n_layers=1, hidden=48, max_len=16),
}


def tiny(name):
    return SIZES[name].with_config(**TINY[name])


@pytest.mark.parametrize("name", ["gpt2-small", "llama-1b"])
def test_tiny_plan_end_to_end(tmp_path, name):
    # llama-1b leaves its plan's run out by default (memory at full size): asked for here
    results = run_size(tiny(name), "cpu", tmp_path, seq=16, modes=["plan", "plan-run"], log=lambda *a: None)
    data = json.loads((tmp_path / f"training_{name}.json").read_text())
    assert data["meta"]["kind"] == "plan" and data["meta"]["batch"] == 1 and data["meta"]["seq"] == 16
    rows = {r["mode"]: r for r in data["rows"]}
    assert [r["mode"] for r in data["rows"]] == ["eager", "plan", "plan-run"]
    assert all(r["status"] == "ok" for r in rows.values()), [r["reason"] for r in rows.values()]
    eager, plan, ran = rows["eager"], rows["plan"], rows["plan-run"]
    assert eager["launches"] > 0 and eager["bytes_moved"] > 0
    assert 0 < plan["kernels"] <= plan["launches"]
    assert plan["nodes"] > 0 and plan["opaque_nodes"] == 0
    assert 0 < plan["arena_bytes"] <= plan["intermediate_bytes"]
    assert ran["grad_ok"] is True and ran["grad_missing"] == []
    assert data["meta"]["params"] == sum(p.numel() for p in tiny(name).make("cpu", torch.float32, 1, 4)[0].parameters())
    assert results["rows"] == data["rows"]


def test_a_step_left_out_by_default_is_a_skipped_row(tmp_path):
    results = run_size(tiny("llama-1b"), "cpu", tmp_path, seq=8, log=lambda *a: None)
    rows = {r["mode"]: r for r in results["rows"]}
    assert rows["plan"]["status"] == "ok"
    assert rows["plan-run"]["status"] == "skipped" and "--modes plan-run" in rows["plan-run"]["reason"]


def test_cli_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(SIZES, "gpt2-small", tiny("gpt2-small"))
    code = main(["--size", "gpt2-small", "--device", "cpu", "--out", str(tmp_path), "--seq", "8", "--modes", "plan"])
    assert code == 0
    data = json.loads((tmp_path / "training_gpt2-small.json").read_text())
    assert [r["mode"] for r in data["rows"]] == ["eager", "plan"]
    assert "plan" in capsys.readouterr().out


def test_explain_figures_are_the_plans_own_counts():
    from bench.models import SUITE

    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE["mlp"]()
    expl = gpuautograd.explain(loss_fn(model, *make_batch(torch.Generator().manual_seed(0))), backend="interpret-replay")
    figures = _explain_figures(expl)
    assert figures["arena_bytes"] == expl.arena_bytes and figures["intermediate_bytes"] == expl.intermediate_bytes
    assert 0 < figures["arena_bytes"] <= figures["intermediate_bytes"]
    assert figures["resident_bytes"] == sum(figures["resident"].values()) >= figures["arena_bytes"]
    assert str(figures["arena_bytes"]) in expl.memory


def test_time_limit_interrupts_a_loop():
    with pytest.raises(StepTimeout):
        with time_limit(0.05):
            while True:
                pass


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Jump(Mode):
    """Eager backward that moves the fake clock to `at`: the budget left for the next modes shrinks."""

    def __init__(self, name, clock, at, hang=False):
        self.name, self.clock, self.at, self.hang = name, clock, at, hang

    def unavailable_reason(self, device):
        self.clock.now = self.at  # first thing in a mode's share: the jump does not wait on the machine's speed
        return None

    def backward(self, loss):
        while self.hang:  # a mode that never ends: only its share's alarm stops it
            pass
        loss.backward()


def test_budget_times_out_a_slow_mode_and_skips_one_without_time(tmp_path, monkeypatch):
    monkeypatch.setattr(budget_mod, "MIN_START_S", 0.01)
    monkeypatch.setattr(budget_mod, "RESERVE_S", 0.0)
    clock = FakeClock()
    modes = [Eager(), Jump("spend", clock, 99.0), Jump("hang", clock, 100.0, hang=True), Jump("late", clock, 100.0)]
    monkeypatch.setattr(training, "training_modes", lambda: modes)
    results = run_size(tiny("gpt2-small"), "cpu", tmp_path, seq=8, budget=Budget(100.0, clock), kind="measure", log=lambda *a: None)
    data = json.loads((tmp_path / "training_gpt2-small.json").read_text())
    assert data["rows"] == results["rows"]
    rows = {r["mode"]: r for r in data["rows"]}
    assert rows["eager"]["status"] == "ok" and rows["eager"]["backward_ms"] is not None and rows["eager"]["step_ms"] is not None
    assert rows["spend"]["status"] == "ok" and rows["spend"]["grad_ok"] is True
    assert rows["hang"]["status"] == "timed_out" and "share" in rows["hang"]["reason"]
    assert rows["hang"]["first_call_ms"] is None
    assert rows["late"]["status"] == "skipped" and "budget" in rows["late"]["reason"]
    assert data["meta"]["budget_s"] == 100.0


def test_a_failing_step_is_an_error_row():
    row = Budget(None).run("boom", lambda r: 1 / 0, None, {"mode": "boom"})
    assert row["status"] == "error" and "ZeroDivisionError" in row["reason"]


class Kill(Mode):
    name = "kill"

    def backward(self, loss):
        os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_still_writes_the_rows_so_far(tmp_path, monkeypatch):
    monkeypatch.setattr(training, "training_modes", lambda: [Eager(), Kill()])
    run_size(tiny("gpt2-small"), "cpu", tmp_path, seq=8, kind="measure", log=lambda *a: None)
    data = json.loads((tmp_path / "training_gpt2-small.json").read_text())
    assert "SIGTERM" in data["error"]
    assert [r["mode"] for r in data["rows"]] == ["eager"] and data["rows"][0]["status"] == "ok"


class BrokenEager(Mode):
    name = "eager"

    def backward(self, loss):
        raise RuntimeError("no backward today")


def test_other_modes_are_errors_when_eager_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(training, "training_modes", lambda: [BrokenEager(), Jump("other", FakeClock(), 0.0)])
    results = run_size(tiny("gpt2-small"), "cpu", tmp_path, seq=8, kind="measure", log=lambda *a: None)
    assert [r["status"] for r in results["rows"]] == ["error", "error"]
    assert "nothing to compare with" in results["rows"][1]["reason"]
