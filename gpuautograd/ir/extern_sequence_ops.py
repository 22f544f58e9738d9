"""Extern ops for bags, sequence losses and recurrent layers: each is one aten backward kernel.

Their math is long (embedding bags with offsets and a max mode, CTC's alpha-beta recursion, a
whole recurrent layer run backwards in time), and the library already has the kernel on every
device, so the fused plan calls it as one library call, like convolution backward.

These kernels have no meta implementation to infer from, so each op states its result types:
they are the types of the forward tensors the gradients belong to. This module registers into
the one op table in `ops.py`; importing it is enough.
"""

from __future__ import annotations

import torch

from .extern_ops import _fill_absent
from .registry import EXTERN, register_op
from .types import TensorType

aten = torch.ops.aten


# ---------------------------------------------------------------------------------------------
# embedding_bag


def _bag_weight_infer(ts, attrs):
    grad = ts[0]
    return [TensorType((attrs["num_weights"], grad.shape[-1]), grad.dtype, grad.device)]


@register_op("embedding_bag_backward", EXTERN, _bag_weight_infer)
def _embedding_bag_backward(
    grad, indices, offsets, offset2bag, bag_size, maximum_indices, *weights, present, num_weights, scale_grad_by_freq, mode, padding_idx
):
    """The dense weight gradient; `weights` holds the per-sample weights when present. This is the
    entry point derivatives.yaml calls, not the dense kernel: on the CPU's fast path the forward
    leaves offset2bag empty and this one rebuilds it from the offsets."""
    (per_sample_weights,) = _fill_absent(weights, present)
    return aten._embedding_bag_backward(
        grad,
        indices,
        offsets,
        offset2bag,
        bag_size,
        maximum_indices,
        num_weights,
        scale_grad_by_freq,
        mode,
        False,
        per_sample_weights,
        padding_idx,
    )


@register_op("embedding_bag_per_sample_weights_backward", EXTERN, lambda ts, a: [ts[2].with_(dtype=ts[0].dtype)])
def _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, *, mode, padding_idx):
    return aten._embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, offset2bag, mode, padding_idx)


# ---------------------------------------------------------------------------------------------
# CTC loss


@register_op("ctc_loss_backward", EXTERN, lambda ts, a: [ts[1]])
def _ctc_loss_backward(grad, log_probs, targets, neg_log_likelihood, log_alpha, *, input_lengths, target_lengths, blank, zero_infinity):
    """The gradient of the per-sample losses with respect to `log_probs`."""
    return aten._ctc_loss_backward(
        grad, log_probs, targets, list(input_lengths), list(target_lengths), neg_log_likelihood, log_alpha, blank, zero_infinity
    )


# ---------------------------------------------------------------------------------------------
# oneDNN's recurrent layer (torch's CPU float32 LSTM)


def _rnn_layer_infer(ts, attrs):
    return [ts[i] for i in range(7)]  # input, weight1..4, hx, cx: one gradient each


@register_op("mkldnn_rnn_layer_backward", EXTERN, _rnn_layer_infer)
def _mkldnn_rnn_layer_backward(
    input,
    weight1,
    weight2,
    weight3,
    weight4,
    hx,
    cx,
    output,
    hy,
    cy,
    workspace,
    *grads,
    present,
    reverse,
    mode,
    hidden_size,
    num_layers,
    has_biases,
    train,
    bidirectional,
    batch_sizes,
    batch_first,
):
    """`grads` holds the present ones of the gradients of (output, hy, cy). In bfloat16 the kernel
    returns float32 gradients; they are cast to their tensors' dtypes, as torch's engine does (so
    is a float32 layer's bfloat16 bias, which torch's LSTM accepts)."""
    grad_output, grad_hy, grad_cy = _fill_absent(grads, present)
    outs = aten.mkldnn_rnn_layer_backward(
        input,
        weight1,
        weight2,
        weight3,
        weight4,
        hx,
        cx,
        output,
        hy,
        cy,
        grad_output,
        grad_hy,
        grad_cy,
        reverse,
        mode,
        hidden_size,
        num_layers,
        has_biases,
        train,
        bidirectional,
        list(batch_sizes),
        batch_first,
        workspace,
    )
    targets = (input, weight1, weight2, weight3, weight4, hx, cx)
    # `to` only where the dtype differs: seven no-op casts per layer cost 13 us, the test 2 us
    return tuple(g if g.dtype is t.dtype else g.to(t.dtype) for g, t in zip(outs, targets))


# ---------------------------------------------------------------------------------------------
# cuDNN's recurrent layers (torch's CUDA LSTM, GRU and RNN): the whole stack in one kernel

# The kernel the op calls, looked up at each call: a CPU build has the op's schema but no kernel
# for it, so the CPU tests put a stand-in with the same signature here.
CUDNN_RNN_BACKWARD = aten._cudnn_rnn_backward

# The op's optional slots, in order (`present` says which hold a tensor). weight_buf is the
# forward's result4, which cuDNN always returns; only the meta kernel leaves it undefined.
CUDNN_RNN_OPTIONAL = ("weight_buf", "cx", "dropout_state", "grad_output", "grad_hy", "grad_cy")


def _cudnn_rnn_infer(ts, attrs):
    """Each gradient has its tensor's type; None where `output_mask` does not ask for it, and for
    cx where there is none (GRU, RNN). aten._cudnn_rnn_backward has no meta kernel to infer from."""
    n = attrs["num_weights"]
    input, hx = ts[0], ts[1]
    weights = ts[4 : 4 + n]
    _, cx, *_ = _fill_absent(ts[4 + n :], attrs["present"])
    mask = attrs["output_mask"]
    return [input if mask[0] else None, hx if mask[1] else None, cx if mask[2] else None] + [w if mask[3] else None for w in weights]


@register_op("cudnn_rnn_backward", EXTERN, _cudnn_rnn_infer)
def _cudnn_rnn_backward(
    input,
    hx,
    output,
    reserve,
    *rest,
    num_weights,
    present,
    weight_stride0,
    mode,
    hidden_size,
    proj_size,
    num_layers,
    batch_first,
    dropout,
    train,
    bidirectional,
    batch_sizes,
    output_mask,
):
    """(grad input, grad hx, grad cx, *grad weights). `rest` holds the `num_weights` weights, then
    the present ones of CUDNN_RNN_OPTIONAL. The kernel writes into the reserve space (its input
    pass leaves state there for the weight pass), so it gets a copy: the program's values are never
    written, whether the graph is retained, the plan replayed or the node run live after all."""
    weights, optional = list(rest[:num_weights]), rest[num_weights:]
    weight_buf, cx, dropout_state, grad_output, grad_hy, grad_cy = _fill_absent(optional, present)
    dx, dhx, dcx, dw = CUDNN_RNN_BACKWARD(
        input,
        weights,
        weight_stride0,
        weight_buf,
        hx,
        cx,
        output,
        grad_output,
        grad_hy,
        grad_cy,
        mode,
        hidden_size,
        proj_size,
        num_layers,
        batch_first,
        dropout,
        train,
        bidirectional,
        list(batch_sizes),
        dropout_state,
        reserve.clone(),
        list(output_mask),
    )
    grad_weights = tuple(dw) if output_mask[3] else (None,) * num_weights
    grad_cx = dcx if output_mask[2] and cx is not None else None
    return (dx if output_mask[0] else None, dhx if output_mask[1] else None, grad_cx) + grad_weights
