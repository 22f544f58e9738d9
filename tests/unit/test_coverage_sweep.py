"""bench.coverage, the OpInfo sweep, on a handful of ops: its counts add up, its shares follow
from them, and it notices a missing rule (opaque), a wrong rule (wrong) and a good one."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest (pip install expecttest)")

import torch  # noqa: E402

from bench import coverage  # noqa: E402
from gpuautograd.rules.registry import RULES  # noqa: E402

OPS = ["linalg.inv", "linalg.det", "mul"]
REAL = (torch.float64,)


def _summary(**kwargs):
    return coverage.summarize(coverage.sweep(coverage.select_ops(OPS, dtypes=REAL), samples_per_op=4, dtypes=REAL), **kwargs)


def _consistent(s):
    statuses = s["functional"] + (s["correct"] - s["functional"]) + s["wrong"] + s["errors"]
    assert statuses == s["samples"] > 0
    assert s["correct_share"] == round(s["correct"] / s["samples"], 4)
    assert s["functional_share"] == round(s["functional"] / s["samples"], 4)
    assert s["ops"] == len(OPS)


def test_rules_that_exist_run_functionally():
    s = _summary()
    _consistent(s)
    assert s["wrong"] == s["errors"] == 0
    assert all("LinalgInvExBackward0" != row["node"] for row in s["top_opaque"])


def test_a_missing_rule_shows_as_the_top_opaque_node(monkeypatch):
    monkeypatch.delitem(RULES, "LinalgInvExBackward0")
    s = _summary()
    _consistent(s)
    inv = [r for r in coverage.sweep(coverage.select_ops(["linalg.inv"]), samples_per_op=4, dtypes=REAL) if r.status != "skipped"]
    assert inv and all(r.status == "opaque" and r.opaque == ["LinalgInvExBackward0"] for r in inv)
    top = s["top_opaque"][0]
    assert top["node"] == "LinalgInvExBackward0" and top["samples"] == len(inv) and top["ops"] == ["linalg.inv"]
    assert s["correct"] == s["samples"] and s["functional"] == s["samples"] - len(inv)


def test_a_wrong_rule_is_counted_wrong(monkeypatch):
    right = RULES["LinalgDetBackward0"]

    def doubled(b, node, grads):
        return [None if g is None else b.mul(g, 2) for g in right(b, node, grads)]

    monkeypatch.setitem(RULES, "LinalgDetBackward0", doubled)
    results = coverage.sweep(coverage.select_ops(["linalg.det"]), samples_per_op=8, dtypes=REAL)
    wrong = [r for r in results if r.status == "wrong"]
    assert wrong and all("input 0" in r.detail for r in wrong), [(r.status, r.detail) for r in results]
    assert coverage.summarize(results)["wrong"] == len(wrong)


def test_main_writes_the_summary_as_json(tmp_path, capsys):
    out = tmp_path / "coverage.json"
    assert coverage.main(["--ops", "mul", "--samples-per-op", "2", "--out", str(out)]) == 0
    s = json.loads(out.read_text())
    assert s["samples"] == 4 and s["functional"] == 4 and s["functional_share"] == 1.0
    assert s["by_dtype"] == {
        d: dict(samples=2, correct=2, functional=2, correct_share=1.0, functional_share=1.0) for d in ("complex128", "float64")
    }
    printed = capsys.readouterr().out
    assert "| functional (no opaque node) | 4 | 100.0% |" in printed and "| complex128: correct / functional of 2 | 2 / 2 |" in printed


def test_complex_samples_are_swept_and_a_rule_not_written_for_them_runs_opaque(monkeypatch):
    from gpuautograd.rules import registry

    monkeypatch.setattr(registry, "COMPLEX_READY", set(registry.COMPLEX_READY) - {"MulBackward0"})
    results = [r for r in coverage.sweep(coverage.select_ops(["mul"]), samples_per_op=3) if r.status != "skipped"]
    by_dtype = {d: [r for r in results if r.dtype == d] for d in ("float64", "complex128")}
    assert all(r.status == "functional" for r in by_dtype["float64"]) and by_dtype["float64"]
    assert by_dtype["complex128"] and all(r.status == "opaque" and "MulBackward0" in r.opaque for r in by_dtype["complex128"])


def test_unknown_op_names_are_refused():
    with pytest.raises(ValueError, match="no_such_op"):
        coverage.select_ops(["no_such_op"])


def test_a_leaf_without_a_gradient_accumulator_is_an_unused_input():
    # istft's complex samples 8 and 9 pass a window that is a leaf view whose grad accumulator
    # Python can't reach (get_gradient_edge asserts): eager's engine finds it unused, and so must we
    results = coverage.sweep(coverage.select_ops(["istft"]), dtypes=(torch.complex128,))
    assert len(results) >= 10 and all(r.status == "functional" for r in results), [(r.index, r.status, r.detail) for r in results]
