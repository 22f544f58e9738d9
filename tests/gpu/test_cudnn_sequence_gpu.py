"""GPU tier of tests/unit/test_rules_cudnn_sequence.py: cuDNN's recurrent layers and CTC loss run
functional (CudnnRnnBackward0 as the cudnn_rnn_backward extern op, CudnnCtcLossBackward0 as
pointwise ops), with no opaque node, and give torch.autograd's gradients. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence

import gpuautograd
from tests.helpers import assert_close

DEVICE = "cuda"


def node_names(tensors) -> set[str]:
    seen, names, stack = set(), set(), [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(fn.name())
        stack.extend(f for f, _ in fn.next_functions)
    return names


def check(outputs, wrt, node: str, backend: str | None):
    """explain() shows no opaque node and the program calls `node`'s rule; gpuautograd's gradients
    (run twice on the retained graph) then torch's on the same graph agree. torch's run comes last,
    so it also sees whether ours left the saved values (cuDNN's reserve space) as they were.
    `backend` None is the default (cudagraph on CUDA: Triton kernels compiled cold, a second of
    the tier's time each), so most cases run on the reference executor, whose library calls are
    the same."""
    assert node in node_names(outputs), sorted(node_names(outputs))
    grads = [torch.randn_like(o) for o in outputs]
    report = gpuautograd.explain(outputs, grads, backend=backend)
    assert report.program is not None, report.fallback_reason
    assert not report.opaque_nodes, report.opaque_nodes
    runs = [gpuautograd.grad(outputs, wrt, grads, retain_graph=True, backend=backend) for _ in range(2)]
    assert not gpuautograd.stats()["fallbacks"], gpuautograd.stats()["fallbacks"]
    theirs = torch.autograd.grad(outputs, wrt, grads)
    for ours in runs:
        for i, (a, e) in enumerate(zip(ours, theirs)):
            assert_close(a, e, msg=f"{node}: gradient {i}")
    return report


RNN_CASES = {  # layer, its arguments, backend
    "lstm_2layer_bidir_dropout": (torch.nn.LSTM, dict(num_layers=2, bidirectional=True, dropout=0.25), None),
    "lstm_batch_first_proj": (torch.nn.LSTM, dict(batch_first=True, proj_size=3), "reference"),
    "gru_2layer_batch_first": (torch.nn.GRU, dict(num_layers=2, batch_first=True), "reference"),
    "gru_bidir_no_bias": (torch.nn.GRU, dict(bidirectional=True, bias=False), "reference"),
}


@pytest.mark.parametrize("case", list(RNN_CASES))
def test_cudnn_rnn_matches_autograd(case):
    cls, kw, backend = RNN_CASES[case]
    torch.manual_seed(0)
    T, B, In, H = 7, 3, 5, 6
    layer = cls(In, H, **kw).to(DEVICE)
    x = torch.randn(*((B, T, In) if kw.get("batch_first") else (T, B, In)), device=DEVICE, requires_grad=True)
    out, state = layer(x)
    states = list(state) if isinstance(state, tuple) else [state]
    report = check([out, *states], [x, *layer.parameters()], "CudnnRnnBackward0", backend)
    assert "cudnn_rnn_backward" in str(report.program)


def test_cudnn_lstm_packed_sequence():
    torch.manual_seed(0)
    layer = torch.nn.LSTM(4, 5, num_layers=2).to(DEVICE)
    x = torch.randn(6, 3, 4, device=DEVICE, requires_grad=True)
    packed = pack_padded_sequence(x, torch.tensor([6, 4, 2]), enforce_sorted=True)
    out, (h, c) = layer(packed)
    report = check([out.data, h, c], [x, *layer.parameters()], "CudnnRnnBackward0", "reference")
    assert "batch_sizes=(3, 3, 2, 2, 1, 1)" in str(report.program)


@pytest.mark.parametrize("zero_infinity", [False, True])
def test_cudnn_ctc_loss_matches_autograd(zero_infinity):
    torch.manual_seed(0)
    T, N, C = 12, 4, 6
    log_probs = torch.randn(T, N, C, device=DEVICE).log_softmax(2).detach().requires_grad_()
    target_lengths = [3, 5, 2, 4]
    if zero_infinity:
        target_lengths[3] = 10  # ten repeated labels need 19 frames: no alignment in 12, the loss is zeroed
    targets = torch.randint(1, C, (sum(target_lengths),), dtype=torch.int32)  # cuDNN's: int32, 1-d, on the CPU
    if zero_infinity:
        targets[-10:] = 1
    input_lengths = [T] * N
    if not torch._use_cudnn_ctc_loss(log_probs, targets, input_lengths, target_lengths, 0):
        pytest.skip("this build's CTC loss does not take cuDNN's kernel for these inputs")
    losses = F.ctc_loss(log_probs, targets, input_lengths, target_lengths, reduction="none", zero_infinity=zero_infinity)
    report = check([losses], [log_probs], "CudnnCtcLossBackward0", "reference" if zero_infinity else None)
    assert not any(i.op == "ctc_loss_backward" for i in report.program.instrs)
