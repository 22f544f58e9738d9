"""Interpret tier of tests/unit/test_rules_cudnn_sequence.py: the cuDNN recurrent and CTC programs,
built by hand as there, compiled by the fused backend (the CTC backward's pointwise ops as a
generated kernel, the recurrent backward as a library call) and run in Triton's interpreter; each
must give what the reference executor gives. The recurrent kernel is the unit tier's stand-in."""

from __future__ import annotations

import pytest
import torch

from gpuautograd.ir import extern_sequence_ops
from gpuautograd.ir.types import TensorType
from gpuautograd.runtime.fused import compile_fused, input_strides_of
from tests.unit.test_rules_cudnn_sequence import StandIn, build, rnn_case, rnn_grads


def fused_and_reference(program, run, args):
    fused = compile_fused(program, input_strides_of(program, args), interpret=True)
    return fused, fused(args), run()


@pytest.mark.parametrize("zero_infinity", [False, True])
def test_ctc_plan_is_one_kernel(zero_infinity):
    raw, loss, grad = torch.randn(7, 4, 5), torch.tensor([1.0, 0.0, 2.0, 0.0]), torch.randn(4)
    saved = dict(result0=loss, result1=raw, zero_infinity=zero_infinity)
    program, run = build("CudnnCtcLossBackward0", saved, [grad, None], [TensorType.of(raw)], [True])
    fused, (ours,), (reference,) = fused_and_reference(program, run, [grad, loss, raw])
    assert len(fused.plan.kernels) == 1
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_rnn_plan_calls_the_kernel(mode, monkeypatch):
    kernel = StandIn()
    monkeypatch.setattr(extern_sequence_ops, "CUDNN_RNN_BACKWARD", kernel)
    saved, edges, outs = rnn_case(mode, num_layers=2, bidirectional=True)
    grads = rnn_grads(outs)
    types = [None if e is None else TensorType.of(e) for e in edges]
    program, run = build("CudnnRnnBackward0", saved, grads, types, [e is not None for e in edges])
    args = [g for g in grads if g is not None]  # in the order `build` made the inputs: grads, then saved
    for v in saved.values():
        args += v if isinstance(v, list) else [v] if isinstance(v, torch.Tensor) else []
    fused, ours, reference = fused_and_reference(program, run, args)
    assert len(kernel.calls) == 2  # once each
    for a, r in zip(ours, reference, strict=True):
        assert (a is None) == (r is None)
        if r is not None:
            torch.testing.assert_close(a, r, rtol=0, atol=0)
    assert torch.equal(saved["result3"], torch.arange(24, dtype=torch.uint8))
