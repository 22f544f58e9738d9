"""Composite ops: one aten backward kernel each for the reference executor, primitive ops for fusion.

Eager runs a GELU's, a layer norm's or a softmax's backward as one fused aten kernel. The rules
emit these ops so that the reference executor (the CPU path) does the same; each row also holds a
decomposition into the primitive ops of the table, which `passes/decompose.py` expands for the
fused backends before partitioning, so their plans are exactly what the rules emitted before
composites existed (the decompositions are those rules' formulas, op for op).

Types follow the aten kernel: a gradient has its input's dtype (a decomposition computes half and
bfloat16 in float32 and casts back at the end, as the driver's cast did). A composite applies only
where its kernel takes the inputs as they come (equal shapes and dtypes); otherwise its inference
raises `NotComposite` and `emit` writes the decomposition inline instead, with the same gradients.

This module registers into the one op table in `ops.py`; importing it is enough.
"""

from __future__ import annotations

import math

import torch

from .registry import COMPOSITE, get_op, register_op
from .types import TensorType

aten = torch.ops.aten

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class NotComposite(TypeError):
    """The composite's kernel does not take these inputs as they are; use its decomposition."""


def emit(b, op: str, *inputs, **attrs):
    """What rules call: composite `op` when its kernel applies to `inputs`, else its decomposition
    written inline. Returns what `Builder.emit` returns (one Value, or a tuple for several)."""
    opdef = get_op(op)
    try:
        opdef.infer([x.type if hasattr(x, "type") else x for x in inputs], attrs)
    except NotComposite:
        return opdef.decompose(b, *inputs, **attrs)
    return b.emit(op, *inputs, **attrs)


def _opmath(b, x):
    """Half and bfloat16 are computed in float32, as torch's kernels do (rules/pointwise.opmath)."""
    return b.cast(x, torch.float32) if x.dtype in _LOW_PRECISION else x


def _require(ok: bool, op: str, why: str) -> None:
    if not ok:
        raise NotComposite(f"{op}: {why}")


def _same(op: str, *types) -> None:
    first = types[0]
    for t in types:
        _require(isinstance(t, TensorType), op, "every tensor operand must be a tensor")
        _require(t.shape == first.shape, op, f"shapes differ ({', '.join(str(u) for u in types)})")
        _require(t.dtype == first.dtype and t.device == first.device, op, f"dtypes or devices differ ({', '.join(str(u) for u in types)})")
    _require(first.dtype.is_floating_point, op, f"needs a floating dtype, got {first}")


def _pointwise_infer(op: str):
    def infer(ts, attrs):
        _same(op, ts[0], ts[1])
        return [ts[0]]

    return infer


def _composite(name: str, infer, decompose):
    return register_op(name, COMPOSITE, infer, decompose=decompose)


# ---------------------------------------------------------------------------------------------
# Activations: (grad, saved tensor) -> grad input, elementwise

_ONEDNN_GELU = (torch.float32, torch.bfloat16)  # the dtypes aten runs gelu_backward through oneDNN for
_SQRT1_2 = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_KAPPA = 0.044715


def _gelu_decomposed(b, grad, self, *, approximate):
    g, x = _opmath(b, grad), _opmath(b, self)
    if approximate == "tanh":
        # u = sqrt(2/pi) (x + k x^3); grad * (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u')
        x2 = b.mul(x, x)
        t = b.tanh(b.mul(b.add(x, b.mul(b.mul(x2, x), _GELU_KAPPA)), _SQRT_2_OVER_PI))
        du = b.mul(b.add(b.mul(x2, 3 * _GELU_KAPPA), 1.0), _SQRT_2_OVER_PI)
        left = b.mul(b.add(t, 1.0), 0.5)
        right = b.mul(b.mul(b.mul(x, 0.5), b.sub(1.0, b.mul(t, t))), du)
        return b.cast(b.mul(g, b.add(left, right)), grad.dtype)
    # approximate="none": grad * (Phi(x) + x * phi(x))
    cdf = b.mul(b.add(b.erf(b.mul(x, _SQRT1_2)), 1.0), 0.5)
    pdf = b.mul(b.exp(b.mul(b.mul(x, x), -0.5)), _INV_SQRT_2PI)
    return b.cast(b.mul(g, b.add(cdf, b.mul(x, pdf))), grad.dtype)


def _transposes(x) -> bool:
    """Whether x.mT is not contiguous (so aten's contiguity test sends it to its own kernel)."""
    return x.dim() >= 2 and x.shape[-1] > 1 and x.shape[-2] > 1


@_composite("gelu_backward", _pointwise_infer("gelu_backward"), _gelu_decomposed)
def _gelu_backward(grad, self, *, approximate):
    if approximate == "none" and self.dtype in _ONEDNN_GELU and self.device.type == "cpu" and _transposes(self):
        # On a contiguous CPU input aten hands the erf GELU to oneDNN, whose call costs more than the
        # arithmetic on the suite's sizes (gpt's run: 0.84x -> 0.77x of eager without it). A
        # transposed view takes aten's own vectorized kernel, whose result, transposed back, has the
        # same values to rounding and the same (contiguous) layout.
        return aten.gelu_backward(grad.mT, self.mT, approximate=approximate).mT
    return aten.gelu_backward(grad, self, approximate=approximate)


def _silu_decomposed(b, grad, self):
    # grad * sigmoid(x) * (1 + x * (1 - sigmoid(x)))
    g, x = _opmath(b, grad), _opmath(b, self)
    s = b.sigmoid(x)
    return b.cast(b.mul(b.mul(g, s), b.add(b.mul(x, b.sub(1.0, s)), 1.0)), grad.dtype)


@_composite("silu_backward", _pointwise_infer("silu_backward"), _silu_decomposed)
def _silu_backward(grad, self):
    return aten.silu_backward(grad, self)


def _tanh_decomposed(b, grad, result):
    # grad * (1 - result * result)
    g, y = _opmath(b, grad), _opmath(b, result)
    return b.cast(b.mul(g, b.sub(1.0, b.mul(y, y))), grad.dtype)


@_composite("tanh_backward", _pointwise_infer("tanh_backward"), _tanh_decomposed)
def _tanh_backward(grad, result):
    return aten.tanh_backward(grad, result)


def _sigmoid_decomposed(b, grad, result):
    # grad * (1 - result) * result
    g, y = _opmath(b, grad), _opmath(b, result)
    return b.cast(b.mul(b.mul(g, b.sub(1.0, y)), y), grad.dtype)


@_composite("sigmoid_backward", _pointwise_infer("sigmoid_backward"), _sigmoid_decomposed)
def _sigmoid_backward(grad, result):
    return aten.sigmoid_backward(grad, result)


def _threshold_decomposed(b, grad, self, *, threshold):
    # where(self <= threshold, 0, grad)
    return b.where(b.le(self, threshold), 0, grad)


@_composite("threshold_backward", _pointwise_infer("threshold_backward"), _threshold_decomposed)
def _threshold_backward(grad, self, *, threshold):
    return aten.threshold_backward(grad, self, threshold)


# ---------------------------------------------------------------------------------------------
# Softmax and log_softmax along `dim` (as saved: it may be negative)


def _softmax_decomposed(b, grad, result, *, dim):
    # result * (grad - sum(grad * result, dim, keepdim=True))
    g, y = _opmath(b, grad), _opmath(b, result)
    return b.cast(b.mul(y, b.sub(g, b.sum(b.mul(g, y), dim, keepdim=True))), result.dtype)


@_composite("softmax_backward", _pointwise_infer("softmax_backward"), _softmax_decomposed)
def _softmax_backward(grad, result, *, dim):
    return torch._softmax_backward_data(grad, result, dim, result.dtype)  # torch's binding: 2.5 us less than aten's


def _log_softmax_decomposed(b, grad, result, *, dim):
    # grad - exp(result) * sum(grad, dim, keepdim=True)
    g, y = _opmath(b, grad), _opmath(b, result)
    return b.cast(b.sub(g, b.mul(b.exp(y), b.sum(g, dim, keepdim=True))), result.dtype)


@_composite("log_softmax_backward", _pointwise_infer("log_softmax_backward"), _log_softmax_decomposed)
def _log_softmax_backward(grad, result, *, dim):
    return torch._log_softmax_backward_data(grad, result, dim, result.dtype)


# ---------------------------------------------------------------------------------------------
# Layer norm: (grad, input, mean, rstd, [weight], [bias]) -> (input, weight, bias) gradients


def _fill(optional, present) -> list:
    it = iter(optional)
    return [next(it) if p else None for p in present]


def _layer_norm_infer(ts, attrs):
    grad, x, mean, rstd, *optional = ts
    _same("layer_norm_backward", grad, x)
    # torch's CPU kernel sums bfloat16 weight and bias gradients over rows less accurately than
    # the decomposition's float32 accumulation, so half types keep the decomposition
    _require(x.dtype not in _LOW_PRECISION, "layer_norm_backward", f"half types keep the float32 decomposition, got {x}")
    _require(mean.dtype == rstd.dtype, "layer_norm_backward", "mean and rstd dtypes differ")
    weight, bias = _fill(optional, attrs["present"])
    for t in (weight, bias):
        _require(t is None or t.dtype == x.dtype, "layer_norm_backward", f"the affine parameters' dtype differs from {x}")
    outs = (x, weight, bias)
    if any(m and t is None for t, m in zip(outs, attrs["output_mask"])):
        raise ValueError(f"layer_norm_backward: output_mask {attrs['output_mask']} asks for the gradient of an absent weight or bias")
    return [t if m else None for t, m in zip(outs, attrs["output_mask"])]


def _layer_norm_decomposed(b, grad, input, mean, rstd, *optional, present, normalized_shape, output_mask):
    # x_hat = (x - mean) * rstd, gx_hat = grad * weight, N = prod(normalized_shape):
    # input: rstd / N * (N * gx_hat - sum(gx_hat) - x_hat * sum(gx_hat * x_hat)) over the normalized dims
    # weight: sum(grad * x_hat) over the outer dims; bias: sum(grad) over the outer dims
    weight, _bias = _fill(optional, present)
    inner = tuple(range(input.ndim - len(normalized_shape), input.ndim))
    outer = tuple(range(input.ndim - len(normalized_shape)))
    n = math.prod(input.shape[d] for d in inner)
    g, xf = _opmath(b, grad), _opmath(b, input)
    mean, rstd = _opmath(b, mean), _opmath(b, rstd)
    x_hat = b.mul(b.sub(xf, mean), rstd)
    d_input = d_weight = d_bias = None
    if output_mask[0]:
        gx_hat = g if weight is None else b.mul(g, _opmath(b, weight))
        mean_part = b.sum(gx_hat, inner, keepdim=True)
        proj_part = b.mul(x_hat, b.sum(b.mul(gx_hat, x_hat), inner, keepdim=True))
        centered = b.sub(b.sub(b.mul(gx_hat, n), mean_part), proj_part)
        d_input = b.mul(b.div(rstd, n), centered)
    if output_mask[1]:
        d_weight = b.sum(b.mul(g, x_hat), outer)
    if output_mask[2]:
        d_bias = b.sum(g, outer)
    # the results in the dtype of what they are gradients of, in edge order (as the driver cast them)
    targets = (input, weight, _bias)
    return tuple(None if d is None else b.cast(d, t.dtype) for d, t in zip((d_input, d_weight, d_bias), targets))


@_composite("layer_norm_backward", _layer_norm_infer, _layer_norm_decomposed)
def _layer_norm_backward(grad, input, mean, rstd, *optional, present, normalized_shape, output_mask):
    weight, bias = _fill(optional, present)
    return aten.native_layer_norm_backward(grad, input, list(normalized_shape), mean, rstd, weight, bias, list(output_mask))


def _batch_norm_infer(ts, attrs):
    grad, x, *optional = ts
    op = "batch_norm_backward"
    _same(op, grad, x)
    _require(x.ndim >= 2, op, f"needs (N, C, ...) inputs, got {x}")
    weight, running_mean, running_var, save_mean, save_invstd = _fill(optional, attrs["present"])
    stats = (save_mean, save_invstd) if attrs["train"] else (running_mean, running_var)
    _require(all(t is not None for t in stats), op, "the statistics its formula reads are absent")
    outs = (x, weight, weight if weight is not None else x)
    per_channel = [None if t is None else TensorType((x.shape[1],), t.dtype, x.device) for t in outs[1:]]
    return [t if m else None for t, m in zip([x, *per_channel], attrs["output_mask"])]


def _batch_norm_decomposed(b, grad, input, *optional, present, train, eps, output_mask):
    # x_hat = (x - mean) * invstd per channel, sums over every dim but the channel's (N = their size):
    # train: input: weight * invstd * (grad - sum(grad) / N - x_hat * sum(grad * x_hat) / N)
    # eval (running statistics, invstd = 1 / sqrt(running_var + eps)): input: weight * invstd * grad
    # weight: sum(grad * x_hat); bias: sum(grad)
    weight, running_mean, running_var, save_mean, save_invstd = _fill(optional, present)
    channels = input.shape[1]
    dims = tuple(d for d in range(input.ndim) if d != 1)
    per_channel = tuple(channels if d == 1 else 1 for d in range(input.ndim))
    n = math.prod(input.shape[d] for d in dims)
    g, xf = _opmath(b, grad), _opmath(b, input)
    if train:
        mean, invstd = _opmath(b, save_mean), _opmath(b, save_invstd)
    else:
        mean, invstd = _opmath(b, running_mean), b.pow(b.add(_opmath(b, running_var), eps), -0.5)
    mean, invstd = b.reshape(mean, per_channel), b.reshape(invstd, per_channel)
    x_hat = b.mul(b.sub(xf, mean), invstd)
    sum_g = b.sum(g, dims, keepdim=True)
    d_input = d_weight = d_bias = None
    if output_mask[0]:
        scale = invstd if weight is None else b.mul(b.reshape(_opmath(b, weight), per_channel), invstd)
        inner = g
        if train:
            proj = b.mul(x_hat, b.div(b.sum(b.mul(g, x_hat), dims, keepdim=True), n))
            inner = b.sub(b.sub(g, b.div(sum_g, n)), proj)
        d_input = b.cast(b.mul(scale, inner), input.dtype)
    affine = weight.dtype if weight is not None else input.dtype
    if output_mask[1]:
        d_weight = b.cast(b.reshape(b.sum(b.mul(g, x_hat), dims, keepdim=True), (channels,)), affine)
    if output_mask[2]:
        d_bias = b.cast(b.reshape(sum_g, (channels,)), affine)
    return d_input, d_weight, d_bias


@_composite("batch_norm_backward", _batch_norm_infer, _batch_norm_decomposed)
def _batch_norm_backward(grad, input, *optional, present, train, eps, output_mask):
    """aten's batch norm backward for the reference executor; its formula for the fused backends,
    where the per-channel sums and the input's gradient become one generated kernel."""
    weight, running_mean, running_var, save_mean, save_invstd = _fill(optional, present)
    return aten.native_batch_norm_backward(
        grad, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps, list(output_mask)
    )


# ---------------------------------------------------------------------------------------------
# Losses

_REDUCTION_MEAN = 1  # at::Reduction: 0 none, 1 mean, 2 sum


def _nll_infer(ts, attrs):
    grad, x, target, total_weight, *weight = ts
    op = "nll_loss_backward"
    _require(x.ndim in (1, 2, 4), op, f"aten's kernels take 1-, 2- or 4-dim inputs, got {x}")
    _require(x.dtype.is_floating_point and grad.dtype == x.dtype == total_weight.dtype, op, "dtypes differ")
    _require(all(w.dtype == x.dtype for w in weight), op, "the class weight's dtype differs")
    return [x]


def _nll_decomposed(b, grad, self, target, total_weight, *weight, present, reduction, ignore_index):
    # zeros_like(self).scatter(C, target, -weight[target] * grad [/ total_weight]), 0 at
    # ignore_index; C is the class dim (0 for an unbatched input, else 1)
    (weight,) = _fill(weight, present)
    class_dim = 0 if self.ndim < 2 else 1
    target = b.unsqueeze(target, class_dim)
    valid = b.ne(target, ignore_index)
    safe_target = b.where(valid, target, 0)
    g = grad  # per sample for reduction="none", else 0-dim
    if reduction == _REDUCTION_MEAN:
        g = b.div(g, total_weight)
    if g.ndim > 0:
        g = b.unsqueeze(g, class_dim)
    coeff = b.neg(g)
    if weight is not None:
        coeff = b.mul(coeff, b.index(weight, [safe_target]))
    coeff = b.expand(b.where(valid, coeff, 0), safe_target.shape)
    base = b.full(self.shape, 0, self.dtype, self.device)
    return b.scatter(base, class_dim, safe_target, b.cast(coeff, self.dtype))


@_composite("nll_loss_backward", _nll_infer, _nll_decomposed)
def _nll_loss_backward(grad, self, target, total_weight, *weight, present, reduction, ignore_index):
    (weight,) = _fill(weight, present)
    kernel = aten.nll_loss2d_backward if self.ndim == 4 else aten.nll_loss_backward
    return kernel(grad, self, target, weight, reduction, ignore_index, total_weight)


def _mse_infer(ts, attrs):
    grad, x, target = ts
    _same("mse_loss_backward", x, target)
    _require(grad.dtype == x.dtype and grad.shape in ((), x.shape), "mse_loss_backward", f"the gradient {grad} does not fit {x}")
    return [x if m else None for m in attrs["output_mask"]]


def _mse_decomposed(b, grad, self, target, *, reduction, output_mask):
    # self: norm * (self - target) * grad, norm = 2 (/ numel for mean); target: -(the self gradient)
    g = _opmath(b, grad)
    d = b.sub(_opmath(b, self), _opmath(b, target))
    gs = b.mul(b.mul(d, 2.0), g)
    scale = 1.0 / self.type.numel() if reduction == _REDUCTION_MEAN else 1.0
    if scale != 1.0:
        gs = b.mul(gs, scale)
    gt = b.neg(gs) if output_mask[1] else None
    return (b.cast(gs, self.dtype) if output_mask[0] else None, None if gt is None else b.cast(gt, self.dtype))


@_composite("mse_loss_backward", _mse_infer, _mse_decomposed)
def _mse_loss_backward(grad, self, target, *, reduction, output_mask):
    gs = aten.mse_loss_backward(grad, self, target, reduction) if output_mask[0] else None
    gt = aten.mse_loss_backward(grad, target, self, reduction) if output_mask[1] else None
    return gs, gt


# ---------------------------------------------------------------------------------------------
# Indexing along one dim: (x, index) -> x's slices at index, as index_add's source gradient


def _index_select_infer(ts, attrs):
    x, index = ts
    dim = attrs["dim"]
    _require(isinstance(x, TensorType) and isinstance(index, TensorType), "index_select", "needs two tensors")
    _require(0 <= dim < x.ndim, "index_select", f"dim {dim} is not a dim of {x}")
    _require(index.ndim == 1 and index.dtype in (torch.int64, torch.int32), "index_select", f"needs a 1-d integer index, got {index}")
    return [x.with_(shape=(*x.shape[:dim], *index.shape, *x.shape[dim + 1 :]))]


def _index_select_decomposed(b, x, index, *, dim):
    return b.index(x, [None] * dim + [index])


@_composite("index_select", _index_select_infer, _index_select_decomposed)
def _index_select(x, index, *, dim):
    # aten.index (x[..., index]) costs three times this on a CPU: it builds a TensorIterator over an
    # advanced index. The two differ only for negative indices, which index_select refuses, and an
    # index that its caller's forward already checked (index_add's) holds none.
    return torch.index_select(x, dim, index)
