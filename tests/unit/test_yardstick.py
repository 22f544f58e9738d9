"""ci/yardstick.py on a tiny stand-in for PyTorch's test_autograd.py: it must report exactly the
tests that pass plain and fail under enable(), and mark the ones that ran functionally."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci"))

import yardstick  # noqa: E402

STAND_IN = """
import unittest
import torch
from autograd.test_complex import TestAutogradComplex  # noqa: F401  (dropped by the runner)

EAGER_BACKWARD = torch.autograd.backward


class TestStandIn(unittest.TestCase):
    def test_functional_and_passes(self):
        x = torch.randn(3, requires_grad=True)
        (x * 2).sum().backward()
        self.assertTrue(torch.equal(x.grad, torch.full((3,), 2.0)))

    def test_fails_only_when_routed(self):
        x = torch.randn(3, requires_grad=True)
        (x.exp()).sum().backward()
        self.assertIs(torch.autograd.backward, EAGER_BACKWARD)

    def test_fails_always(self):
        self.assertEqual(1, 2)

    @unittest.skip("not here")
    def test_skipped(self):
        pass
"""


def test_runner_reports_regressions_and_functional_runs(tmp_path, capsys):
    source = tmp_path / "test_autograd.py"
    source.write_text(STAND_IN)
    out = tmp_path / "summary.json"
    assert yardstick.main([str(source), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["tests"] == 4
    assert summary["passed_plain"] == 2
    assert summary["passed_plain_ran_functional"] == 2
    assert [r["id"] for r in summary["regression_list"]] == ["TestStandIn::test_fails_only_when_routed"]
    assert summary["regression_list"][0]["functional"] is True
    assert "sibling-module imports dropped: 1" in capsys.readouterr().out
