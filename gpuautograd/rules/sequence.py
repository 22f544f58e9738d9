"""Backward rules of bag, sequence and recurrent kernels: embedding_bag (recommenders), CTC loss
(speech), oneDNN's recurrent layer (torch's CPU float32 LSTM) and cuDNN's recurrent stack (torch's
CUDA LSTM, GRU and RNN). Each is one extern op, the aten backward kernel
(ir/extern_sequence_ops.py), called as one library call in fused plans; cuDNN's CTC loss, whose
backward is a scaling of the gradient its forward already computed, is three pointwise ops.

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


CUDNN_RNN_ATTRS = ("weight_stride0", "mode", "hidden_size", "proj_size", "num_layers", "batch_first", "dropout", "train", "bidirectional")


@register("CudnnRnnBackward0")
def cudnn_rnn_backward(b, node, grads):
    """Edges: input, the weights (as many as the saved weight list), hx, cx (an empty edge for GRU
    and RNN). grad_input_mask is (input, hx, cx, any weight), as derivatives.yaml orders its keys.

    The reserve space (result3): the kernel writes into it, and torch passes `result3.clone()` when
    the graph is retained, else result3 itself. A program here is pure and its saved values may be
    read again (retain_graph, a replayed plan, the live node run after a fallback), and the rule
    cannot see retain_graph, so the extern op always runs the kernel on a copy of the reserve:
    torch's retain_graph=True behaviour, at the cost of one device copy of the reserve space."""
    # input, hx, cx, weight: _cudnn_rnn_backward_symint(input, weight, weight_stride0, result4, hx, cx, result0, grads[0],
    #   grads[1], grads[2], mode, hidden_size, proj_size, num_layers, batch_first, dropout, train, bidirectional,
    #   batch_sizes, dropout_state, retain_variables ? result3.clone() : result3, grad_input_mask)
    weights = list(node.saved("weight"))
    n = len(weights)
    if any(w is None for w in weights) or node.num_outputs != n + 3:
        raise NotImplementedError(f"CudnnRnnBackward0: {node.num_outputs} edges for {n} saved weights")
    none = [None] * node.num_outputs
    grad_output, grad_hy, grad_cy = grads[:3]  # result3 (reserve) and result4 (weight_buf) are not differentiable
    if grad_output is None and grad_hy is None and grad_cy is None:
        return none
    mask = (node.needs(0), node.needs(n + 1), node.needs(n + 2), any(node.needs(1 + i) for i in range(n)))
    if not any(mask):
        return none
    fixed = [node.saved("input"), node.saved("hx"), node.saved("result0"), node.saved("result3"), *weights]
    optional = [node.saved("result4"), node.saved("cx"), node.saved("dropout_state"), grad_output, grad_hy, grad_cy]
    attrs = {name: node.saved(name) for name in CUDNN_RNN_ATTRS}
    attrs["batch_sizes"] = tuple(node.saved("batch_sizes"))
    dx, dhx, dcx, *dw = emit_optional(b, "cudnn_rnn_backward", fixed, optional, num_weights=n, output_mask=mask, **attrs)
    return [dx, *(g if node.needs(1 + i) else None for i, g in enumerate(dw)), dhx, dcx]


@register("CudnnCtcLossBackward0", "CudnnCtcLossBackward1")
def cudnn_ctc_loss_backward(b, node, grads):
    """cuDNN's forward returns the per-sample losses (result0, [N]) and their gradient with respect
    to log_probs (result1, [T, N, C]); the backward scales that by the incoming gradient. It is no
    aten op (a helper of torch's autograd), so there is no kernel to call: three pointwise ops,
    which fuse with what consumes them. The Tensor-lengths overload (Backward1) has the same row."""
    # log_probs: _cudnn_ctc_loss_backward(grad, result0, result1, zero_infinity)
    #   = raw_grad * grad[None, :, None], zeroed where the loss is 0 when zero_infinity
    none = [None] * node.num_outputs
    grad = grads[0]  # grads[1] belongs to result1, which is not differentiable
    if grad is None or not node.needs(0):
        return none
    out = b.mul(node.saved("result1"), b.unsqueeze(b.unsqueeze(grad, 0), 2))
    if node.saved("zero_infinity"):
        # as torch's helper does: no gradient wherever the saved loss is 0
        loss = b.unsqueeze(b.unsqueeze(node.saved("result0"), 0), 2)
        out = b.where(b.eq(loss, 0), 0.0, out)
    return [out] + none[1:]
