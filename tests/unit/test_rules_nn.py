"""Gradients of nn library nodes against torch.autograd: convolution, batch norm, pooling,
embedding and scaled dot product attention. Nodes that only exist on CUDA (fused attention,
cudnn/miopen batch norm) are checked on meta tensors (the real autograd node, our rule and extern
op, shapes and dtypes against torch's meta backward) and, for batch norm, numerically on a node
built by hand from CPU values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from gpuautograd.capture.nodeview import NodeView
from gpuautograd.ir.builder import Builder
from gpuautograd.ir.program import InputSpec, OutputSpec
from gpuautograd.ir.types import TensorType
from gpuautograd.ir.verifier import verify
from gpuautograd.rules import lookup
from gpuautograd.runtime.reference import compile_reference
from tests.helpers import DTYPES, assert_close, check_node, rand

aten = torch.ops.aten


def program_of(fn, *inputs) -> str:
    out = fn(*inputs)
    return str(gpuautograd.explain([out], [torch.ones_like(out)]).program)


def mask_of(wanted: str) -> tuple[bool, ...]:
    return tuple(name == wanted for name in ("input", "weight", "bias"))


def frozen(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


# -- convolution -----------------------------------------------------------------------------

CONV_CASES = {
    "1d_stride_pad_dilation": (F.conv1d, (2, 3, 13), (4, 3, 5), dict(stride=2, padding=1, dilation=2)),
    "2d_plain": (F.conv2d, (2, 3, 9, 11), (5, 3, 3, 3), {}),
    "2d_groups_mixed": (F.conv2d, (2, 4, 9, 11), (6, 2, 3, 2), dict(groups=2, stride=(2, 1), padding=(1, 2), dilation=(1, 2))),
    "2d_depthwise_same": (F.conv2d, (1, 3, 7, 13), (3, 1, 3, 3), dict(groups=3, padding="same")),
    "2d_unbatched": (F.conv2d, (3, 9, 11), (5, 3, 3, 3), dict(stride=2)),
    "3d": (F.conv3d, (1, 2, 5, 6, 7), (3, 2, 2, 3, 2), dict(padding=1)),
    "transpose2d": (F.conv_transpose2d, (2, 4, 7, 5), (4, 3, 3, 3), dict(stride=2, padding=1, output_padding=1)),
    "transpose1d_groups": (F.conv_transpose1d, (2, 4, 9), (4, 3, 3), dict(groups=2, stride=3)),
}


def _out_channels(fn, w_shape, kwargs):
    transposed = fn in (F.conv_transpose1d, F.conv_transpose2d)
    return w_shape[1] * kwargs.get("groups", 1) if transposed else w_shape[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("case", list(CONV_CASES))
def test_convolution(case, bias, dtype):
    fn, x_shape, w_shape, kwargs = CONV_CASES[case]
    x, w = rand(*x_shape, dtype=dtype), rand(*w_shape, dtype=dtype)
    if bias:
        b = rand(_out_channels(fn, w_shape, kwargs), dtype=dtype)
        check_node(lambda x, w, b: fn(x, w, b, **kwargs), x, w, b, node="ConvolutionBackward0")
    else:
        check_node(lambda x, w: fn(x, w, **kwargs), x, w, node="ConvolutionBackward0")


@pytest.mark.parametrize("wants", ["input", "weight", "bias"])
def test_convolution_output_mask(wants):
    x = rand(2, 3, 9, 11, requires_grad=wants == "input")
    w = rand(5, 3, 3, 3, requires_grad=wants == "weight")
    b = rand(5, requires_grad=wants == "bias")
    fn = lambda x, w, b: F.conv2d(x, w, b, padding=1)  # noqa: E731
    check_node(fn, x, w, b, node="ConvolutionBackward0")
    assert f"output_mask={mask_of(wants)}" in program_of(fn, x, w, b)  # nothing unwanted is computed


def test_convolution_noncontiguous_input():
    x = rand(2, 3, 9, 11).detach().to(memory_format=torch.channels_last).requires_grad_()
    w = rand(5, 3, 3, 3, noncontiguous=True)
    check_node(lambda x, w: F.conv2d(x, w, stride=2), x, w, node="ConvolutionBackward0")


# -- batch norm ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 13), (2, 5, 7, 3), (3, 4, 17)])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("mode", ["train_with_stats", "train_no_stats", "eval"])
def test_native_batch_norm(mode, affine, shape, dtype):
    c = shape[1]
    stats = (frozen(c, dtype=dtype), frozen(c, dtype=dtype).abs() + 0.5) if mode != "train_no_stats" else (None, None)
    x = rand(*shape, dtype=dtype)
    training = mode != "eval"
    if affine:
        w, b = rand(c, dtype=dtype), rand(c, dtype=dtype)
        fn = lambda x, w, b: F.batch_norm(x, *stats, w, b, training=training, eps=1e-3)  # noqa: E731
        check_node(fn, x, w, b, node="NativeBatchNormBackward0")
    else:
        fn = lambda x: F.batch_norm(x, *stats, training=training)  # noqa: E731
        check_node(fn, x, node="NativeBatchNormBackward0")


@pytest.mark.parametrize("only", ["weight", "bias", "input"])
def test_native_batch_norm_output_mask(only):
    x = rand(4, 5, 6, requires_grad=only == "input")
    w, b = rand(5, requires_grad=only == "weight"), rand(5, requires_grad=only == "bias")
    fn = lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True)  # noqa: E731
    check_node(fn, x, w, b, node="NativeBatchNormBackward0")
    assert f"output_mask={mask_of(only)}" in program_of(fn, x, w, b)  # nothing unwanted is computed


def test_native_batch_norm_noncontiguous():
    x = rand(2, 5, 7, 3).detach().to(memory_format=torch.channels_last).requires_grad_()
    w, b = rand(5), rand(5)
    check_node(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), x, w, b, node="NativeBatchNormBackward0")


LEGIT = {
    "NativeBatchNormLegitBackward0": lambda x, w, b: aten._native_batch_norm_legit(
        x, w, b, frozen(5), frozen(5).abs() + 1, True, 0.1, 1e-5
    )[0],
    "NativeBatchNormLegitBackward1": lambda x, w, b: aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)[0],
    "NativeBatchNormLegitNoTrainingBackward0": lambda x, w, b: aten._native_batch_norm_legit_no_training(
        x, w, b, frozen(5), frozen(5).abs() + 1, 0.1, 1e-5
    )[0],
}


@pytest.mark.parametrize("node", list(LEGIT))
def test_native_batch_norm_legit(node):
    check_node(LEGIT[node], rand(3, 5, 7), rand(5), rand(5), node=node)


def run_rule(name: str, saved: dict, grads: list, out_types: list, needs: list) -> list:
    """Run the rule of `name` on a node built by hand (saved tensors and grads are real tensors),
    through the verifier and the reference executor."""
    b, args = Builder(), []

    def value(t, kind):
        args.append(t)
        return b.input(TensorType.of(t), InputSpec(kind, len(args) - 1))

    grad_values = [value(g, "grad") for g in grads]
    saved_values = {k: value(v, "saved") if isinstance(v, torch.Tensor) else v for k, v in saved.items()}
    node = NodeView(name, saved_values, [v.type for v in grad_values], out_types, needs)
    outs = lookup(name)(b, node, grad_values)
    for i, o in enumerate(outs):
        b.output(o, OutputSpec("input", i))
    verify(b.program)
    return list(compile_reference(b.program)(args))


@pytest.mark.parametrize("name", ["CudnnBatchNormBackward0", "MiopenBatchNormBackward0"])
@pytest.mark.parametrize("training", [True, False])
def test_gpu_batch_norm_rule_numerically(name, training):
    # the cudnn/miopen forward saves mean and inverse std (result1, result2), like native_batch_norm
    x, w, bias = rand(4, 5, 3, 2), rand(5), rand(5)
    running_mean, running_var = frozen(5), frozen(5).abs() + 0.5
    out, mean, invstd = torch.native_batch_norm(x, w, bias, running_mean.clone(), running_var.clone(), training, 0.1, 1e-4)
    grad = torch.randn_like(out)
    expected = torch.autograd.grad(out, [x, w, bias], grad)
    saved = dict(
        input=x.detach(),
        weight=w.detach(),
        running_mean=running_mean,
        running_var=running_var,
        result1=mean.detach(),
        result2=invstd.detach(),
        epsilon=1e-4,
        training=training,
    )
    if name.startswith("Cudnn"):
        saved["result3"] = torch.empty(0, dtype=torch.uint8)  # cudnn's reserve space
    types = [TensorType.of(t) for t in (x, w, bias)]
    ours = run_rule(name, saved, [grad], types, [True, True, True])
    for a, e in zip(ours, expected):
        assert_close(a, e)


# -- pooling ---------------------------------------------------------------------------------

POOL_CASES = {
    "max2d_k3_s2_p1": ("MaxPool2DWithIndicesBackward0", (2, 3, 9, 11), lambda x: F.max_pool2d(x, 3, 2, 1)),
    "max2d_overlapping": ("MaxPool2DWithIndicesBackward0", (2, 3, 9, 11), lambda x: F.max_pool2d(x, (3, 2), 1)),
    "max2d_dilation_ceil": ("MaxPool2DWithIndicesBackward0", (1, 2, 13, 7), lambda x: F.max_pool2d(x, 2, 2, 1, dilation=2, ceil_mode=True)),
    "max2d_unbatched": ("MaxPool2DWithIndicesBackward0", (3, 9, 11), lambda x: F.max_pool2d(x, 2)),
    "max1d": ("MaxPool2DWithIndicesBackward0", (2, 3, 13), lambda x: F.max_pool1d(x, 3, 2, 1)),
    "max3d": ("MaxPool3DWithIndicesBackward0", (1, 2, 5, 6, 7), lambda x: F.max_pool3d(x, 2, 1)),
    "adaptive_max2d": ("AdaptiveMaxPool2DBackward0", (2, 3, 9, 11), lambda x: F.adaptive_max_pool2d(x, (4, 5))),
    "adaptive_max1d": ("AdaptiveMaxPool2DBackward0", (2, 3, 13), lambda x: F.adaptive_max_pool1d(x, 5)),
    "adaptive_max3d": ("AdaptiveMaxPool3DBackward0", (1, 2, 5, 6, 7), lambda x: F.adaptive_max_pool3d(x, (2, 3, 4))),
    "avg2d_k3_s2_p1": ("AvgPool2DBackward0", (2, 3, 9, 11), lambda x: F.avg_pool2d(x, 3, 2, 1)),
    "avg2d_no_pad_count_ceil": (
        "AvgPool2DBackward0",
        (2, 3, 9, 11),
        lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
    ),
    "avg2d_divisor": ("AvgPool2DBackward0", (1, 3, 7, 13), lambda x: F.avg_pool2d(x, (2, 3), divisor_override=5)),
    "avg1d": ("AvgPool2DBackward0", (2, 3, 13), lambda x: F.avg_pool1d(x, 3, 2)),
    "adaptive_avg2d": ("AdaptiveAvgPool2DBackward0", (2, 3, 9, 11), lambda x: F.adaptive_avg_pool2d(x, (4, 5))),
    "adaptive_avg2d_unbatched": ("AdaptiveAvgPool2DBackward0", (3, 9, 11), lambda x: F.adaptive_avg_pool2d(x, 3)),
    "adaptive_avg1d": ("AdaptiveAvgPool2DBackward0", (2, 3, 13), lambda x: F.adaptive_avg_pool1d(x, 5)),
    "unfold": ("Im2ColBackward0", (2, 3, 7, 9), lambda x: F.unfold(x, (2, 3), dilation=(1, 2), padding=1, stride=(2, 1))),
    "unfold_unbatched": ("Im2ColBackward0", (3, 6, 5), lambda x: F.unfold(x, 2)),
    # fold's input is (N, C * kh * kw, L): 3 channels of 2x3 windows over a 7x9 image, padding 1, stride (2, 1)
    "fold": ("Col2ImBackward0", (2, 18, 36), lambda x: F.fold(x, (7, 9), (2, 3), padding=1, stride=(2, 1))),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(POOL_CASES))
def test_pooling(case, dtype):
    node, shape, fn = POOL_CASES[case]
    check_node(fn, rand(*shape, dtype=dtype), node=node)


@pytest.mark.parametrize("case", ["max2d_k3_s2_p1", "avg2d_k3_s2_p1", "adaptive_avg2d", "adaptive_max2d"])
def test_pooling_noncontiguous(case):
    node, shape, fn = POOL_CASES[case]
    x = rand(*shape).detach().to(memory_format=torch.channels_last).requires_grad_()
    check_node(fn, x, node=node)
    check_node(fn, rand(*shape, noncontiguous=True), node=node)


# -- embedding -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding_idx", [None, 2, -1])
@pytest.mark.parametrize("scale_grad_by_freq", [False, True])
@pytest.mark.parametrize("index_shape", [(13,), (3, 7)])
def test_embedding(index_shape, scale_grad_by_freq, padding_idx, dtype):
    weight = rand(11, 7, dtype=dtype)
    indices = torch.randint(0, 11, index_shape)
    indices.view(-1)[:3] = torch.tensor([2, 2, 10])  # repeats and the padding rows always occur
    fn = lambda w: F.embedding(indices, w, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)  # noqa: E731
    check_node(fn, weight, node="EmbeddingBackward0")


def test_embedding_sparse_is_refused_by_the_rule():
    weight = rand(5, 3)
    out = F.embedding(torch.tensor([1, 2]), weight, sparse=True)
    saved = {n[len("_saved_") :]: getattr(out.grad_fn, n) for n in dir(out.grad_fn) if n.startswith("_saved_")}
    with pytest.raises(NotImplementedError, match="sparse"):
        run_rule("EmbeddingBackward0", saved, [torch.randn(2, 3, dtype=torch.float64)], [TensorType.of(weight)], [True])


# -- scaled dot product attention on the CPU -------------------------------------------------

SDPA_CPU = "ScaledDotProductFlashAttentionForCpuBackward0"


def _qkv(dtype, batch=2, heads=3, q_len=5, kv_len=7, dim=13, noncontiguous=False):
    def make(length):
        if noncontiguous:  # the usual layout: (batch, length, heads, dim) transposed to heads-first
            return rand(batch, length, heads, dim, dtype=dtype).detach().transpose(1, 2).requires_grad_()
        return rand(batch, heads, length, dim, dtype=dtype)

    return make(q_len), make(kv_len), make(kv_len)


def _bool_mask():
    mask = torch.rand(5, 7) > 0.3
    mask[:, 0] = True  # no fully masked row (those give NaN in both)
    return mask


SDPA_CASES = {
    "plain": lambda dtype: {},
    "causal": lambda dtype: dict(is_causal=True),
    "scale": lambda dtype: dict(scale=0.3),
    "float_mask": lambda dtype: dict(attn_mask=torch.randn(5, 7, dtype=dtype)),
    "float_mask_batched": lambda dtype: dict(attn_mask=torch.randn(2, 1, 5, 7, dtype=dtype)),
    "bool_mask": lambda dtype: dict(attn_mask=_bool_mask()),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_flash_cpu(case, dtype):
    kwargs = SDPA_CASES[case](dtype)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs)  # noqa: E731
    check_node(fn, *_qkv(dtype), node=SDPA_CPU)


def test_sdpa_flash_cpu_noncontiguous_and_odd():
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    check_node(fn, *_qkv(torch.float64, batch=1, heads=5, q_len=33, kv_len=65, dim=17, noncontiguous=True), node=SDPA_CPU)


def test_sdpa_flash_cpu_grouped_query_attention():
    # the kernel reads 2 key/value heads for 6 query heads; their gradients come back per kv head
    q, k, v = rand(2, 6, 5, 13), rand(2, 2, 7, 13), rand(2, 2, 7, 13)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    check_node(fn, q, k, v, node=SDPA_CPU)


def test_sdpa_flash_cpu_only_query_needs_grad():
    q, k, v = _qkv(torch.float64)
    k, v = k.detach(), v.detach()
    check_node(lambda q: F.scaled_dot_product_attention(q, k, v), q, node=SDPA_CPU)


# -- CUDA-only nodes, on meta tensors ---------------------------------------------------------


def meta(*shape, dtype=torch.float16, requires_grad=True):
    return torch.randn(*shape, dtype=dtype, device="meta", requires_grad=requires_grad)


def check_meta(fn, *inputs, node: str):
    """The real node on meta tensors: our program must be free of opaque calls and give gradients
    of the shapes and dtypes torch's meta backward gives, for the same inputs."""
    out = fn(*inputs)
    assert out.grad_fn.name() == node
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    grad = torch.empty_like(out)
    report = gpuautograd.explain([out], [grad])
    assert not report.opaque_nodes, report
    ours = gpuautograd.grad([out], wrt, [grad], retain_graph=True)
    assert not gpuautograd.stats()["fallbacks"], gpuautograd.stats()["fallbacks"]
    theirs = torch.autograd.grad([out], wrt, [grad])
    for a, e in zip(ours, theirs):
        assert (a.shape, a.dtype, a.device) == (e.shape, e.dtype, e.device)
    return report


@pytest.mark.parametrize("bias", [None, "frozen", "trained"])
def test_sdpa_efficient_attention_on_meta(bias):
    q, k, v = meta(2, 3, 5, 8), meta(2, 3, 7, 8), meta(2, 3, 7, 8)
    attn_bias = None if bias is None else meta(2, 3, 5, 7, requires_grad=bias == "trained")
    fn = lambda q, k, v, b: aten._scaled_dot_product_efficient_attention(q, k, v, b, True, 0.0, True, scale=0.5)[0]  # noqa: E731
    report = check_meta(fn, q, k, v, attn_bias, node="ScaledDotProductEfficientAttentionBackward0")
    assert "sdpa_efficient_backward" in str(report.program)
    assert f"grad_input_mask=(True, True, True, {bias == 'trained'})" in str(report.program)


def test_sdpa_flash_attention_on_meta():
    q, k, v = meta(2, 3, 5, 64, dtype=torch.bfloat16), meta(2, 3, 7, 64, dtype=torch.bfloat16), meta(2, 3, 7, 64, dtype=torch.bfloat16)
    fn = lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]  # noqa: E731
    report = check_meta(fn, q, k, v, node="ScaledDotProductFlashAttentionBackward0")
    assert "sdpa_flash_backward" in str(report.program)


@pytest.mark.parametrize("with_bias", [False, True])
def test_sdpa_cudnn_attention_on_meta(with_bias):
    q, k, v = meta(2, 3, 5, 64), meta(2, 3, 7, 64), meta(2, 3, 7, 64)
    bias = meta(2, 3, 5, 7, requires_grad=False) if with_bias else None
    fn = lambda q, k, v: aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True)[0]  # noqa: E731
    report = check_meta(fn, q, k, v, node="ScaledDotProductCudnnAttentionBackward0")
    assert "sdpa_cudnn_backward" in str(report.program)


@pytest.mark.parametrize("kind", ["cudnn", "miopen"])
@pytest.mark.parametrize("training", [True, False])
def test_gpu_batch_norm_on_meta(kind, training):
    x, w, b = meta(4, 5, 6, dtype=torch.float32), meta(5, dtype=torch.float32), meta(5, dtype=torch.float32)
    stats = [torch.zeros(5, device="meta"), torch.ones(5, device="meta")]
    op = aten.cudnn_batch_norm if kind == "cudnn" else aten.miopen_batch_norm
    node = "CudnnBatchNormBackward0" if kind == "cudnn" else "MiopenBatchNormBackward0"
    check_meta(lambda x, w, b: op(x, w, b, *stats, training, 0.1, 1e-5)[0], x, w, b, node=node)
