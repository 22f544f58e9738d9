"""The benchmark harness (bench/): the regression gate's verdicts and exit codes, the schema of
results.json from a tiny real run, and the launch counter. No timing is asserted: only the shape
of the output and properties that hold on any machine."""

import json
import time

import pytest
import torch

import gpuautograd
from bench import compare
from bench.counting import count_aten_ops, launches_kernel
from bench.harness import Config, measure_model, run
from bench.models import make_mlp
from bench.modes import Eager, Gpuautograd
from bench.report import plain_table, write_json
from bench.suite import BenchModel


def _row(model, mode, speedup, grad_ok=True):
    return {"model": model, "mode": mode, "device": "cpu", "status": "ok", "speedup_vs_eager": speedup, "grad_ok": grad_ok, "reason": None}


def _write(path, rows):
    path.write_text(json.dumps({"meta": {}, "results": rows}))
    return str(path)


def _gate(tmp_path, base_rows, new_rows, tolerance="0.1", *extra):
    base = _write(tmp_path / "base.json", base_rows)
    new = _write(tmp_path / "new.json", new_rows)
    return compare.main([base, new, "--tolerance", tolerance, *extra])


def test_gate_fails_on_a_speedup_that_fell_beyond_the_tolerance(tmp_path, capsys):
    rows = [_row("mlp", "eager", 1.0), _row("gpt", "gpuautograd:reference", 0.5)]
    slower = [_row("mlp", "eager", 1.0), _row("gpt", "gpuautograd:reference", 0.42)]  # -16%
    assert _gate(tmp_path, rows, slower) == 1
    out = capsys.readouterr().out
    assert "REGRESSION" in out and "gpt" in out and "-16.0%" in out


def test_gate_passes_improvements_and_changes_within_the_tolerance(tmp_path, capsys):
    base = [_row("gpt", "gpuautograd:reference", 0.5), _row("mlp", "gpuautograd:reference", 0.4)]
    new = [_row("gpt", "gpuautograd:reference", 0.8), _row("mlp", "gpuautograd:reference", 0.37)]  # +60%, -7.5%
    assert _gate(tmp_path, base, new) == 0
    out = capsys.readouterr().out
    assert "improved" in out and "REGRESSION" not in out
    # the same -7.5% fails a tighter gate
    assert _gate(tmp_path, base, new, tolerance="0.05") == 1


def test_gate_reports_new_rows_and_vanished_ungated_rows_without_failing(tmp_path, capsys):
    base = [_row("gpt", "gpuautograd:reference", 0.5), _row("cnn", "compiled-autograd", 0.5)]
    new = [_row("gpt", "gpuautograd:reference", 0.5), _row("llama", "gpuautograd:triton", 3.0)]
    assert _gate(tmp_path, base, new) == 0
    out = capsys.readouterr().out
    assert "only in the baseline: cnn / compiled-autograd" in out
    assert "only in the new run: llama / gpuautograd:triton" in out


def test_gate_fails_when_a_gated_mode_vanished(tmp_path, capsys):
    base = [_row("gpt", "gpuautograd:reference", 0.5), _row("cnn", "gpuautograd:reference", 0.5)]
    new = [_row("gpt", "gpuautograd:reference", 0.5)]
    assert _gate(tmp_path, base, new) == 1
    out = capsys.readouterr().out
    assert "BROKEN: cnn / gpuautograd:reference: measured in the baseline, missing from the new run" in out
    assert "FAILED" in out


@pytest.mark.parametrize("status", ["error", "skipped"])
def test_gate_fails_when_a_gated_mode_now_errors_or_is_skipped(tmp_path, capsys, status):
    base = [_row("gpt", "gpuautograd:reference", 0.5), _row("mlp", "gpuautograd:reference", 0.4)]
    broken = dict(_row("mlp", "gpuautograd:reference", None), status=status, reason="capture raised KeyError")
    assert _gate(tmp_path, base, [_row("gpt", "gpuautograd:reference", 0.5), broken]) == 1
    out = capsys.readouterr().out
    assert f"BROKEN: mlp / gpuautograd:reference: measured in the baseline, {status} in the new run (capture raised KeyError)" in out


def test_gate_fails_when_nothing_gated_was_compared(tmp_path, capsys):
    base = [_row("gpt", "gpuautograd:reference", 0.5)]
    broken = dict(_row("gpt", "gpuautograd:reference", None), status="error", reason="import failed")
    assert _gate(tmp_path, base, [broken]) == 1
    assert _gate(tmp_path, [], []) == 1
    out = capsys.readouterr().out
    assert "nothing was gated" in out and "passed" not in out


def test_gate_fails_when_gradients_start_to_disagree(tmp_path, capsys):
    base = [_row("gpt", "gpuautograd:reference", 0.5)]
    new = [_row("gpt", "gpuautograd:reference", 0.5, grad_ok=False)]
    assert _gate(tmp_path, base, new) == 1
    assert "gradients now disagree" in capsys.readouterr().out


def test_gate_shows_but_does_not_gate_modes_other_than_gpuautograd(tmp_path, capsys):
    base = [_row("mlp", "compiled-autograd", 0.8), _row("mlp", "gpuautograd:reference", 0.4)]
    new = [_row("mlp", "compiled-autograd", 0.4), _row("mlp", "gpuautograd:reference", 0.4)]
    assert _gate(tmp_path, base, new) == 0
    assert "regression (not gated)" in capsys.readouterr().out


def test_gate_does_not_gate_the_interpreters_speed_but_gates_its_gradients(tmp_path, capsys):
    base = [_row("mlp", "gpuautograd:interpret", 0.02)]
    assert _gate(tmp_path, base, [_row("mlp", "gpuautograd:interpret", 0.01)]) == 0  # -50%: the interpreter's speed
    assert "speed not gated" in capsys.readouterr().out
    assert _gate(tmp_path, base, [_row("mlp", "gpuautograd:interpret", 0.02, grad_ok=False)]) == 1


def test_gate_compares_the_chosen_metric(tmp_path):
    base = [dict(_row("gpt", "gpuautograd:reference", 0.5), cpu_speedup_vs_eager=0.5)]
    new = [dict(_row("gpt", "gpuautograd:reference", 0.3), cpu_speedup_vs_eager=0.49)]  # wall ratio fell, CPU-time ratio held
    assert _gate(tmp_path, base, new) == 1
    assert _gate(tmp_path, base, new, "0.1", "--metric", "cpu_speedup_vs_eager") == 0


def test_gate_rejects_a_file_that_is_not_a_benchmark_result(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    good = _write(tmp_path / "good.json", [])
    assert compare.main([str(bad), good]) == 2
    assert "expected a dict with a 'results' list" in capsys.readouterr().err


def test_results_json_schema_from_a_tiny_run(tmp_path):
    cfg = Config.for_run("cpu", quick=True, warmup=1, reps=3)
    cfg.models, cfg.modes, cfg.include_transformers = ["mlp"], ["gpuautograd:reference"], False
    results = run(cfg, log=lambda *_: None)
    loaded = json.loads(write_json(results, tmp_path).read_text())
    assert loaded["meta"]["device"] == "cpu" and loaded["meta"]["quick"] is True
    assert any("side by side" in note for note in loaded["notes"])
    rows = {r["mode"]: r for r in loaded["results"]}
    assert set(rows) == {"eager", "gpuautograd:reference"}
    required = {"model", "mode", "device", "status", "backward_ms", "host_ms", "launches", "peak_mem_bytes", "first_call_ms"}
    required |= {"grad_max_abs", "grad_ok", "speedup_vs_eager", "cpu_ms", "cpu_speedup_vs_eager", "reps"}
    for row in rows.values():
        assert required <= set(row), required - set(row)
        assert row["model"] == "mlp" and row["device"] == "cpu" and row["status"] == "ok", row
        assert row["backward_ms"] > 0 and row["host_ms"] == row["backward_ms"]  # on the CPU host time is the backward time
        assert row["cpu_ms"] > 0 and row["cpu_speedup_vs_eager"] > 0
        assert row["first_call_ms"] > 0 and row["reps"] >= cfg.min_reps
        assert row["peak_mem_bytes"] is None  # not measured on the CPU
        assert isinstance(row["launches"], int) and row["launches"] > 0
        assert row["grad_ok"] is True
    assert rows["eager"]["speedup_vs_eager"] == 1.0 == rows["eager"]["cpu_speedup_vs_eager"]
    assert rows["eager"]["grad_max_abs"] == 0.0
    ours = rows["gpuautograd:reference"]
    assert ours["speedup_vs_eager"] == pytest.approx(rows["eager"]["backward_ms"] / ours["backward_ms"])
    assert ours["grad_max_abs"] <= ours["grad_tolerance"]["atol"] + 1e-3  # float32 gradients of an MLP
    assert "mlp" in plain_table(loaded) and "gpuautograd:reference" in plain_table(loaded)


class _BreaksAfterFirstCall(Eager):
    """Runs its first backward like eager, then raises: the harness must record an error row."""

    name = "breaks-after-first-call"

    def __init__(self):
        self.calls = 0

    def backward(self, loss):
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("broken on purpose\nsecond line")
        loss.backward()


def test_unavailable_backend_is_skipped_and_a_failing_mode_is_an_error():
    missing = Gpuautograd("no-such-backend")
    reason = missing.unavailable_reason("cpu")
    assert reason is not None and reason.startswith("ValueError") and "no-such-backend" in reason
    cfg = Config.for_run("cpu", quick=True, warmup=1, reps=2)
    spec = BenchModel("mlp", make_mlp, "test")
    rows = {
        r["mode"]: r for r in measure_model(spec, [Eager(), missing, _BreaksAfterFirstCall()], cfg, {missing.name: ("skipped", reason)})
    }
    assert rows["gpuautograd:no-such-backend"]["status"] == "skipped" and rows["gpuautograd:no-such-backend"]["reason"] == reason
    broken = rows["breaks-after-first-call"]
    assert broken["status"] == "error" and broken["reason"] == "warm-up: RuntimeError: broken on purpose"
    assert broken["grad_ok"] is True  # its first call was a real eager backward
    assert rows["eager"]["status"] == "ok" and rows["eager"]["backward_ms"] > 0


def test_launch_counter_sees_the_aten_ops_of_an_eager_backward():
    model, make_batch, loss_fn = make_mlp()
    loss = loss_fn(model, *make_batch(torch.Generator().manual_seed(0)))
    counter = count_aten_ops(loss.backward)
    # 3 Linear layers: a weight-gradient mm each, an input-gradient mm for the two that have an input needing one
    assert counter.ops["aten.mm.default"] == 5
    assert counter.ops["aten.t.default"] > 0 and counter.total > counter.launching  # views are seen but not counted
    assert counter.launching >= 15, counter.ops


def test_launch_classification():
    aten = torch.ops.aten
    assert launches_kernel(aten.mm.default) and launches_kernel(aten.add_.Tensor) and launches_kernel(aten.ones_like.default)
    assert not launches_kernel(aten.view.default) and not launches_kernel(aten.expand.default) and not launches_kernel(aten.detach.default)
    assert not launches_kernel(aten.empty.memory_format) and not launches_kernel(aten.empty_strided.default)


@pytest.mark.parametrize("walker", ["native", "python"])
def test_the_phased_hit_of_bench_hit_path_leaves_eagers_gradients(walker):
    """bench.hit_path --phases repeats the engine's steps one by one: they must still add up to a
    hit that leaves the gradients eager's backward leaves."""
    from bench import hit_path

    if walker not in hit_path.available_walkers():
        pytest.skip("the native walker is unavailable here")
    torch.manual_seed(0)
    model, make_batch, loss_fn = hit_path.MODELS["mlp"]()
    batch = make_batch(torch.Generator().manual_seed(0))
    forward = lambda: hit_path._forward(model, make_batch, loss_fn, batch)  # noqa: E731 (seeded: dropout)
    with hit_path.walker_env(walker):
        gpuautograd.backward(forward())  # the capture
        model.zero_grad(set_to_none=True)
        phases = hit_path._hit_in_phases(forward(), time.perf_counter, walker)
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    forward().backward()
    for a, e in zip(ours, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)
    assert set(phases) == {"walk+key", "bind+release", "run", "deliver", "hit"}
