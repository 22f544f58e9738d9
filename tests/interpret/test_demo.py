"""The main job (`python -m bench.demo`) runs end to end and reports validated gradients."""

from __future__ import annotations

from bench import demo


def test_demo_validates_trains_and_reports(capsys):
    assert demo.main(["--steps", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "parameter gradients match torch.autograd" in out
    assert "generated Triton kernels" in out and "its kernels in Triton's interpreter: 29 gradients match" in out
    assert "bound through the pointer table and replayed (1 replay): 29 gradients match" in out
    assert "fallbacks to eager: none" in out
