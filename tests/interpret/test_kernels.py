"""Properties of the generated kernels, run by Triton's interpreter: masks on odd sizes, reductions
that are row-persistent and reductions too long to be, non-contiguous and broadcast operands, how
far the usual normalization backwards fuse, float32 accumulation of bfloat16 values, the
GPUAUTOGRAD_DUMP_DIR files, and a plan that reruns on a cache hit with an arena it reuses."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from gpuautograd.fusion import heuristics as H
from tests.helpers import assert_close, check_grads, no_kernel_fallback, rand
from tests.replay_cases import Double

BACKEND = "interpret"
F32, BF16 = torch.float32, torch.bfloat16

pytestmark = [
    pytest.mark.filterwarnings("error:gpuautograd falls back"),
    pytest.mark.filterwarnings("error:gpuautograd. kernel:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning"),  # numpy, on lanes a tl.where discards
]


# Bugs these tests found in the generated kernels; strict, so that a fix shows up as a failure
# until the mark goes.
def explain(out, grad):
    return gpuautograd.explain([out], [grad], backend=BACKEND)


def reduction_kernels(report):
    return [k for k in report.kernels if k.space.startswith("reduce[")]


# -- masks on odd sizes ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1,), (7,), (33, 65), (1823, 781)], ids=lambda s: "x".join(map(str, s)))
def test_pointwise_masks_cover_exactly_the_elements(shape):
    x, y = rand(*shape, dtype=F32), rand(*shape, dtype=F32)
    fn = lambda x, y: torch.sigmoid(x) * y + x.sin()  # noqa: E731
    out = fn(x, y)
    report = explain(out, torch.randn_like(out))
    numel = x.numel()
    assert report.kernels and all(k.space == f"pointwise[{'x'.join(map(str, shape))}]" for k in report.kernels), report.plan
    for k in report.kernels:
        assert f"xmask = xindex < {numel}" in k.source, k.source
    check_grads(fn, x, y, backend=BACKEND)


REDUCTIONS = [
    # (input shape, the weight's shape: its gradient sums the input's other dims)
    ((7, 13), (1, 13)),
    ((7, 13), (7, 1)),
    ((33, 65), (1, 65)),
    ((33, 65), (33, 1)),
    ((3, 7, 13), (3, 1, 13)),  # the reduced dim sits between kept ones
    ((3, 7, 13), (7, 1)),  # two reduced dims, not adjacent, and a broadcast
    ((1823, 781), (1823, 1)),
    ((1823, 781), (781,)),
]


@pytest.mark.parametrize("x_shape, w_shape", REDUCTIONS, ids=lambda s: "x".join(map(str, s)))
def test_reduction_masks_cover_exactly_rows_and_columns(x_shape, w_shape):
    x, w = torch.randn(*x_shape), rand(*w_shape, dtype=F32)
    out = x * w
    report = explain(out, torch.randn_like(out))
    (k,) = reduction_kernels(report)
    # rows are masked at their exact count; columns at theirs, or at COLS (= the count) in a column loop
    assert f"rmask = rindex < {w.numel()}" in k.source, k.source
    assert re.search(rf"cmask = cindex < ({x.numel() // w.numel()}|COLS)\n", k.source), k.source
    check_grads(lambda w: x * w, w, backend=BACKEND)


@pytest.mark.parametrize("shape", [(7, 13), (1, 91), (20000,)], ids=["7x13", "1x91", "20000_looped"])
def test_reduction_to_one_element(shape):
    x, w = torch.randn(*shape), torch.randn((), requires_grad=True)  # w's gradient sums every element
    check_grads(lambda w: x * w, w, backend=BACKEND)


# -- reductions too long to keep a row in one block: a loop over column chunks ---------------------

LONG = [(3, 9001), (37, 20000)]


@pytest.mark.parametrize("rows, cols", LONG, ids=lambda n: str(n))
def test_looped_reduction(rows, cols):
    assert cols > H.MAX_PERSISTENT_COLS
    x, w = torch.randn(rows, cols), rand(rows, 1, dtype=F32)
    out = x * w
    (k,) = reduction_kernels(explain(out, torch.randn_like(out)))
    assert "for c0 in range(0, COLS, CBLOCK)" in k.source, k.source
    check_grads(lambda w: x * w, w, backend=BACKEND)


def test_looped_reduction_over_a_transposed_operand():
    x, w = torch.randn(20000, 3).t(), rand(3, 1, dtype=F32)  # the reduced dim has stride 3
    check_grads(lambda w: x * w, w, backend=BACKEND)


def test_softmax_over_a_row_too_long_to_keep():
    # the looped sum can't feed its broadcast consumers in the same kernel: they run in another
    check_grads(lambda x: x.softmax(-1), rand(5, 9001, dtype=F32), backend=BACKEND)


# -- non-contiguous and broadcast operands ------------------------------------------------------


def _grad_outputs():
    return {
        "expanded_stride_0": torch.randn(13).expand(7, 13),
        "transposed": torch.randn(13, 7).t(),
        "sliced_with_step": torch.randn(7, 39)[:, ::3],
    }


@pytest.mark.parametrize("layout", list(_grad_outputs()))
def test_incoming_gradient_in_any_layout(layout):
    grad = _grad_outputs()[layout]
    assert not grad.is_contiguous()
    check_grads(lambda x: x.exp() * 2.5, rand(7, 13, dtype=F32), grad_output=[grad], backend=BACKEND)


SAVED = {
    "transposed": lambda: torch.randn(13, 7).t(),
    "sliced_with_step": lambda: torch.randn(7, 26)[:, ::2],
    "expanded_stride_0": lambda: torch.randn(1, 13).expand(7, 13),
    "channels_last": lambda: torch.randn(2, 3, 5, 7).to(memory_format=torch.channels_last)[:, :, :, 3],
}


@pytest.mark.parametrize("layout", list(SAVED))
def test_saved_operands_in_any_layout(layout):
    c = SAVED[layout]()
    assert not c.is_contiguous()
    x = rand(*c.shape, dtype=F32, noncontiguous=True)
    w = rand(c.shape[-1], dtype=F32)  # its gradient reduces over the strided operand
    check_grads(lambda x, w: (x * c).tanh() * w, x, w, backend=BACKEND)


def test_library_result_read_with_its_strides_at_run_time():
    # the input gradient adds a reverse cumsum (a library call, whose strides the plan does not fix)
    # to a pointwise term, inside a kernel that reads the scan's strides when it launches
    x, w = rand(7, 13, dtype=F32), rand(7, 13, dtype=F32)
    fn = lambda x, w: (x.cumsum(0) + x.tanh()) * w  # noqa: E731
    out = fn(x, w)
    report = explain(out, torch.randn_like(out))
    assert ".stride()" in report.plan, report.plan
    check_grads(fn, x, w, backend=BACKEND)


def test_matmul_results_are_read_as_row_major():
    # torch.mm always returns a row-major result, so kernels index it statically (coalesced loads);
    # the plan keeps that true even if a library ever returned another layout
    x, w = rand(7, 13, dtype=F32), rand(5, 13, dtype=F32)
    fn = lambda x, w: F.pad(x @ w.t(), (0, 8)) + x.tanh()  # noqa: E731
    out = fn(x, w)
    report = explain(out, torch.randn_like(out))
    assert ".stride()" not in report.plan and ".is_contiguous()" in report.plan, report.plan
    check_grads(fn, x, w, backend=BACKEND)


# -- normalization backwards fuse into at most two kernels --------------------------------------

FUSED = {
    "softmax": (lambda x: x.softmax(-1), ()),
    "log_softmax": (lambda x: x.log_softmax(-1), ()),
    "softmax_middle_dim": (lambda x: x.reshape(3, 11, 65).softmax(1), ()),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (65,), w, b), ((65,), (65,))),
    "rms_norm": (lambda x, w: F.rms_norm(x, (65,), w, 1e-6), ((65,),)),
    "rms_norm_composed": (lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w, ((65,),)),  # as bench's Llama
    "cross_entropy": (lambda x: F.cross_entropy(x, _targets()), ()),
    "cross_entropy_label_smoothing": (lambda x: F.cross_entropy(x, _targets(), label_smoothing=0.1), ()),
}


def _targets():
    return torch.arange(33) * 7 % 65


@pytest.mark.parametrize("name", list(FUSED))
def test_normalization_backward_is_at_most_two_kernels(name):
    fn, param_shapes = FUSED[name]
    x = rand(33, 65, dtype=F32)
    params = [rand(*s, dtype=F32) for s in param_shapes]
    out = fn(x, *params)
    report = explain(out, torch.randn_like(out))
    assert report.opaque_nodes == []
    assert 1 <= len(report.kernels) <= 2 and report.launches == len(report.kernels), report.plan
    check_grads(fn, x, *params, backend=BACKEND)


# -- bfloat16 values accumulate in float32 -------------------------------------------------------


@pytest.mark.parametrize("cols", [4001, 20000], ids=["persistent", "looped"])
def test_bfloat16_sums_accumulate_in_float32(cols):
    # 4001 or 20000 positive terms per row: a bfloat16 accumulator (8 significant bits) stalls or
    # drifts by many units in the last place; float32 accumulation rounds once, at the store.
    x = (torch.rand(3, cols) + 0.5).to(BF16)
    w = rand(3, 1, dtype=BF16)
    grad = torch.ones(3, cols, dtype=BF16)
    with no_kernel_fallback():
        (ours,) = gpuautograd.grad([x * w], [w], [grad], retain_graph=True, backend=BACKEND)
    (reference,) = gpuautograd.grad([x * w], [w], [grad], backend="reference")
    truth = x.double().sum(1, keepdim=True)
    assert ours.dtype == BF16
    assert_close(ours, truth.to(BF16), msg="against the float64 truth")
    assert_close(ours, reference, msg="against the reference executor")
    # within one bfloat16 unit in the last place of the truth: only a wide accumulator gets there
    ulp = torch.exp2(torch.floor(torch.log2(truth)) - 7)
    assert ((ours.double() - truth).abs() <= ulp).all(), (ours, truth)


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "layer_norm", "rms_norm"])
def test_bfloat16_row_reductions_match_float64_truth(name):
    fns = {
        "softmax": lambda x: x.softmax(-1),
        "log_softmax": lambda x: x.log_softmax(-1),
        "layer_norm": lambda x: F.layer_norm(x, (4001,)),
        "rms_norm": lambda x: F.rms_norm(x, (4001,), eps=1e-6),
    }
    fn = fns[name]
    x = rand(5, 4001, dtype=BF16)
    out = fn(x)
    grad = torch.randn_like(out)
    with no_kernel_fallback():
        (ours,) = gpuautograd.grad([out], [x], [grad], backend=BACKEND)
    wide = x.detach().double().requires_grad_()
    (truth,) = torch.autograd.grad([fn(wide)], [wide], [grad.double()])
    assert ours.dtype == BF16
    assert_close(ours, truth.to(BF16))


# -- GPUAUTOGRAD_DUMP_DIR ----------------------------------------------------------------------


def test_dump_dir_receives_every_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUAUTOGRAD_DUMP_DIR", str(tmp_path))
    gpuautograd.reset()
    # the scale 0.8125 appears in no other test, so these kernel sources are compiled here first
    fn = lambda x: (x * 0.8125).softmax(-1) * x  # noqa: E731
    x = rand(11, 43, dtype=F32)
    out = fn(x)
    report = explain(out, torch.randn_like(out))
    check_grads(fn, x, backend=BACKEND)
    files = {p.name: p.read_text() for p in tmp_path.glob("*.py")}
    assert len(files) == len(report.kernels) >= 1, sorted(files)
    for k in report.kernels:
        (text,) = [t for name, t in files.items() if re.fullmatch(rf"{k.name}_[0-9a-f]+\.py", name)]
        assert k.source in text and "import triton.language as tl" in text
        compile(text, k.name, "exec")  # a file that runs as it is


def test_dump_dir_set_after_the_kernel_was_compiled(tmp_path, monkeypatch):
    fn = lambda x: (x * 0.6875).exp()  # noqa: E731 - a scale no other test uses
    x = rand(5, 9, dtype=F32)
    check_grads(fn, x, backend=BACKEND)
    monkeypatch.setenv("GPUAUTOGRAD_DUMP_DIR", str(tmp_path))
    gpuautograd.reset()
    check_grads(fn, x, backend=BACKEND)
    assert list(tmp_path.glob("*.py"))


# -- the hit path: the same plan, kernels and arena, with new values ------------------------------


def test_cache_hit_reruns_the_plan_with_new_values():
    ws = [rand(13, 13, dtype=F32) for _ in range(4)]

    def fn(x):
        for w in ws:
            x = torch.tanh(x @ w)
        return x

    x = rand(7, 13, dtype=F32)
    out = fn(x)
    report = explain(out, torch.randn_like(out))
    assert 0 < report.arena_bytes < report.intermediate_bytes, report.memory  # intermediates share arena space
    for step in range(3):
        x = rand(7, 13, dtype=F32)
        out = fn(x)
        grad = torch.randn_like(out)
        with no_kernel_fallback():
            ours = gpuautograd.grad([out], [x, *ws], [grad], retain_graph=True, backend=BACKEND)
        theirs = torch.autograd.grad([out], [x, *ws], [grad])
        for a, e in zip(ours, theirs):
            assert_close(a, e, msg=f"step {step}")
    s = gpuautograd.stats()
    assert s["captures"] == 1 and s["cache_hits"] == 2 and not s["fallbacks"], s


def test_identical_kernels_of_repeated_layers_share_one_function():
    # the same block in every layer generates kernels that differ only in name and header: each
    # distinct body is loaded (on a GPU: compiled) once
    from bench.models import SUITE
    from gpuautograd.codegen import compile as kernel_compile

    model, make_batch, loss_fn = SUITE["gpt"](batch=1, seq=11, d_model=40, n_layers=4)  # shapes no other test uses
    loss = loss_fn(model, *make_batch(torch.Generator().manual_seed(0)))
    kernels = gpuautograd.explain(loss, backend=BACKEND).kernels
    before = len(kernel_compile._FUNCTIONS)
    with no_kernel_fallback():
        gpuautograd.backward(loss, backend=BACKEND)
    loaded = len(kernel_compile._FUNCTIONS) - before
    assert 0 < loaded <= len(kernels) // 2, (loaded, len(kernels))
    report = gpuautograd.compile_check(loss_fn(model, *make_batch(torch.Generator().manual_seed(0))), archs=(90,))
    assert report.compiled == report.kernels and not report.failures


def test_an_opaque_node_between_kernels():
    """A custom Function's backward runs as a library call of the live node between generated
    kernels (the planner once read its node-typed input as a tensor)."""
    x = rand(5, 7)
    w = rand(7)
    with no_kernel_fallback():
        report = gpuautograd.explain((Double.apply(x.sin() * w)).exp().sum(), backend="interpret")
        assert report.opaque_nodes == ["DoubleBackward"]
        ours = gpuautograd.grad((Double.apply(x.sin() * w)).exp().sum(), (x, w), backend="interpret")
    theirs = torch.autograd.grad((Double.apply(x.sin() * w)).exp().sum(), (x, w))
    for a, b in zip(ours, theirs):
        assert_close(a, b)


def test_a_widening_cast_read_several_times_is_recomputed_not_stored(monkeypatch):
    """bfloat16 rules cast the incoming gradient to float32 and read it in several places; storing
    the float32 copy would write and read back twice the bytes of recomputing it from the
    bfloat16 value where it is read (issue 26)."""
    from gpuautograd.fusion.analysis import Analysis

    torch.manual_seed(0)
    x = rand(64, 48, dtype=BF16)
    w, b = rand(48, dtype=BF16), rand(48, dtype=BF16)
    w1 = (torch.randn(48, 96, dtype=BF16) * 0.1).requires_grad_()

    def fn(x, w, b, w1):
        return F.layer_norm(F.layer_norm(x, (48,), w, b) @ w1, (96,)).sin()

    out = fn(x, w, b, w1)
    g = torch.randn_like(out)

    def stored_casts(report):
        program = report.program
        producers = {o.name: i for i in program.instrs for o in i.outputs if o is not None}
        names = [d.split(" lives in memory")[0] for d in report.decisions if "lives in memory: read by several" in d]
        return [n for n in names if producers[n].op == "cast" and producers[n].outputs[0].dtype == torch.float32]

    recomputed = gpuautograd.explain([out], [g], backend=BACKEND)
    assert stored_casts(recomputed) == []
    monkeypatch.setattr(Analysis, "recomputes_cheaply", lambda self, v: False)  # the rule of earlier versions
    stored = gpuautograd.explain([out], [g], backend=BACKEND)
    assert stored_casts(stored) and recomputed.bytes_moved < stored.bytes_moved
