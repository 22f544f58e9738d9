"""Backward rules of bag, sequence and recurrent kernels: embedding_bag (recommenders), CTC loss
(speech) and oneDNN's recurrent layer (torch's CPU float32 LSTM). Each is one extern op, the
aten backward kernel (ir/extern_sequence_ops.py), called as one library call in fused plans.

The GRU, LSTM and RNN layers of other dtypes and devices are composites of matmuls, pointwise
gates and unsafe_chunk, whose rules live in their families (views.py has unsafe_split's)."""

from __future__ import annotations

from ..ir import extern_sequence_ops  # noqa: F401 - registers the extern ops used here
from ..ir.extern_ops import emit_optional
from .registry import register

BAG_MODES = {0: "sum", 1: "mean", 2: "max"}


@register("EmbeddingBagBackward0")
def embedding_bag_backward(b, node, grads):
    # weight: _embedding_bag_backward_symint(grad, indices, offsets, result1, result2, result3, weight.sym_size(0),
    #         scale_grad_by_freq, mode, sparse, per_sample_weights, padding_idx)
    # per_sample_weights: _embedding_bag_per_sample_weights_backward(grad, weight, indices, offsets, result1, mode, padding_idx)
    grad = grads[0]  # the other outputs (offset2bag, bag sizes, argmax indices) are integers
    if grad is None:
        return [None, None]
    if node.saved("sparse"):
        raise NotImplementedError("EmbeddingBagBackward0: sparse=True needs a sparse gradient, which the IR has no type for")
    mode, padding_idx = node.saved("mode"), node.saved("padding_idx")
    indices, offset2bag = node.saved("indices"), node.saved("result1")
    weight_grad = None
    if node.needs(0):
        fixed = [grad, indices, node.saved("offsets"), offset2bag, node.saved("result2"), node.saved("result3")]
        weight_grad = emit_optional(
            b,
            "embedding_bag_backward",
            fixed,
            [node.saved("per_sample_weights")],
            num_weights=node.saved("weight_sym_argsize_0"),
            scale_grad_by_freq=node.saved("scale_grad_by_freq"),
            mode=mode,
            padding_idx=padding_idx,
        )
    weights_grad = None
    if node.num_outputs > 1 and node.needs(1):
        weights_grad = b.emit(
            "embedding_bag_per_sample_weights_backward",
            grad,
            node.saved("weight"),
            indices,
            node.saved("offsets"),
            offset2bag,
            mode=mode,
            padding_idx=padding_idx,
        )
    return [weight_grad, weights_grad][: node.num_outputs]


@register("CtcLossBackward0")
def ctc_loss_backward(b, node, grads):
    # log_probs: _ctc_loss_backward(grad, log_probs, targets, input_lengths, target_lengths, result0, result1, blank, zero_infinity)
    grad = grads[0]  # grads[1] belongs to log_alpha, an intermediate that nothing differentiates
    if grad is None:
        return [None] * node.num_outputs
    out = b.emit(
        "ctc_loss_backward",
        grad,
        node.saved("log_probs"),
        node.saved("targets"),
        node.saved("result0"),
        node.saved("result1"),
        input_lengths=tuple(node.saved("input_lengths")),
        target_lengths=tuple(node.saved("target_lengths")),
        blank=node.saved("blank"),
        zero_infinity=node.saved("zero_infinity"),
    )
    return [out] + [None] * (node.num_outputs - 1)


RNN_LAYER_SAVED = ("input", "weight0", "weight1", "weight2", "weight3", "hx_", "cx_", "result0", "result1", "result2", "result3")
RNN_LAYER_ATTRS = ("reverse", "mode", "hidden_size", "num_layers", "has_biases", "train", "bidirectional", "batch_sizes", "batch_first")


@register("MkldnnRnnLayerBackward0")
def mkldnn_rnn_layer_backward(b, node, grads):
    # input, weight0, weight1, weight2, weight3, hx_, cx_: mkldnn_rnn_layer_backward(input, weight0, weight1, weight2,
    #   weight3, hx_, cx_, result0, result1, result2, grads[0], grads[1], grads[2], reverse, mode, hidden_size,
    #   num_layers, has_biases, train, bidirectional, batch_sizes, batch_first, result3)
    fixed = [node.saved(name) for name in RNN_LAYER_SAVED]
    attrs = {name: node.saved(name) for name in RNN_LAYER_ATTRS}
    attrs["batch_sizes"] = tuple(attrs["batch_sizes"])
    outs = emit_optional(b, "mkldnn_rnn_layer_backward", fixed, list(grads[:3]), **attrs)
    return [o if node.needs(i) else None for i, o in enumerate(outs)]
