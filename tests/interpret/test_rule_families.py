"""Every rule family through the 'interpret' backend: generated Triton kernels run by Triton's
interpreter, compared with torch.autograd and with the reference executor on the same graph.

The interpret tier reuses the unit tier's case tables (tests/unit/test_rules_*.py): the same
graphs, odd sizes and non-contiguous inputs, now partitioned into kernels and library calls.
Families that the unit tier tests with plain functions instead of tables (linalg, nn) get a
representative table here, built from the unit tier's own sizes and configurations.

Every case runs in float32 (or in the one dtype a case is limited to); the families where half
precision accumulation matters (reductions, statistics, norms, softmax / NLL / cross-entropy,
losses) also run in float64 and bfloat16. A kernel that fails and falls back to reference ops is
an error (`check_grads` with a fused backend), as is any fallback to eager autograd.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from tests.helpers import DTYPES, Case, assert_close, check_grads, graph_node_names, no_kernel_fallback, rand, run_case
from tests.helpers import same_grads_as_torch as helpers_same_grads_as_torch
from tests.unit import (
    test_rules_activations,
    test_rules_coverage,
    test_rules_decompositions,
    test_rules_indexing,
    test_rules_losses,
    test_rules_math,
    test_rules_nn,
    test_rules_norms,
    test_rules_norms_more,
    test_rules_pointwise,
    test_rules_pool_backward,
    test_rules_reductions,
    test_rules_shape_ops,
    test_rules_views,
)
from tests.unit.test_rules_linalg import ONE_SIDED, SIZES

BACKEND = "interpret"

# A fallback to eager autograd would compare torch with itself, a kernel fallback would hide a
# broken kernel behind the reference ops: both are errors in this tier.
pytestmark = [
    pytest.mark.filterwarnings("error:gpuautograd falls back"),
    pytest.mark.filterwarnings("error:gpuautograd. kernel:RuntimeWarning"),
    # numpy's notes on the lanes a tl.where discards (the interpreter evaluates both sides)
    pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning"),
]

# -- linalg: the unit tier tests these with parametrized functions; the same shapes as Cases ----


def _leaf(*shape, dtype, noncontiguous=False):
    if not shape:
        return torch.randn((), dtype=dtype).requires_grad_()
    return rand(*shape, dtype=dtype, noncontiguous=noncontiguous)


def _linalg_cases() -> list[Case]:
    cases = []
    for m, k, n in SIZES:
        cases.append(
            Case(
                f"mm_{m}x{k}x{n}_nc",
                "MmBackward0",
                torch.mm,
                lambda d, m=m, k=k, n=n: (rand(m, k, dtype=d, noncontiguous=True), rand(k, n, dtype=d)),
            )
        )
        cases.append(
            Case(f"bmm_{m}x{k}x{n}", "BmmBackward0", torch.bmm, lambda d, m=m, k=k, n=n: (rand(3, m, k, dtype=d), rand(3, k, n, dtype=d)))
        )
    for bias_shape, (alpha, beta) in [((17,), (1, 1)), ((1, 17), (0.5, 2.0)), ((33, 1), (3, 0)), ((), (0.5, 2.0))]:
        cases.append(
            Case(
                f"addmm_bias{list(bias_shape)}_a{alpha}_b{beta}",
                "AddmmBackward0",
                lambda c, x, y, alpha=alpha, beta=beta: torch.addmm(c, x, y, alpha=alpha, beta=beta),
                lambda d, s=bias_shape: (_leaf(*s, dtype=d), rand(33, 65, dtype=d, noncontiguous=True), rand(65, 17, dtype=d)),
            )
        )
    cases += [
        Case(
            "baddbmm_bcast_bias",
            "BaddbmmBackward0",
            lambda c, x, y: torch.baddbmm(c, x, y, alpha=0.5, beta=-1.5),
            lambda d: (rand(1, 1, 5, dtype=d), rand(3, 7, 13, dtype=d), rand(3, 13, 5, dtype=d, noncontiguous=True)),
        ),
        Case(
            "addbmm_0d_bias",
            "AddbmmBackward0",
            lambda c, x, y: torch.addbmm(c, x, y, alpha=0.5, beta=-1.5),
            lambda d: (_leaf(dtype=d), rand(3, 13, 7, dtype=d, noncontiguous=True), rand(3, 7, 5, dtype=d)),
        ),
        Case("mv_nc", "MvBackward0", torch.mv, lambda d: (rand(33, 65, dtype=d, noncontiguous=True), rand(65, dtype=d))),
        Case(
            "addmv_bcast_bias",
            "AddmvBackward0",
            lambda c, m, v: torch.addmv(c, m, v, alpha=2.5, beta=0),
            lambda d: (rand(1, dtype=d), rand(33, 65, dtype=d, noncontiguous=True), rand(65, dtype=d)),
        ),
        Case(
            "addr_col_bias",
            "AddrBackward0",
            lambda c, u, v: torch.addr(c, u, v, alpha=-0.5, beta=3),
            lambda d: (rand(7, 1, dtype=d), rand(7, dtype=d), rand(13, dtype=d)),
        ),
        Case("dot_65", "DotBackward0", torch.dot, lambda d: (rand(65, dtype=d), rand(65, dtype=d))),
        Case("dot_1", "DotBackward0", torch.dot, lambda d: (rand(1, dtype=d), rand(1, dtype=d))),
        Case("vdot_13", "VdotBackward0", torch.vdot, lambda d: (rand(13, dtype=d), rand(13, dtype=d))),
        Case("matmul_batched_by_matrix", "MmBackward0", torch.matmul, lambda d: (rand(2, 7, 13, dtype=d), rand(13, 5, dtype=d))),
        Case("matmul_vector_by_matrix", "MmBackward0", torch.matmul, lambda d: (rand(13, dtype=d), rand(13, 5, dtype=d))),
        Case("matmul_broadcast_batch", "BmmBackward0", torch.matmul, lambda d: (rand(2, 1, 7, 13, dtype=d), rand(3, 13, 5, dtype=d))),
        Case("linear_bias_batched", "AddmmBackward0", F.linear, lambda d: (rand(7, 13, dtype=d), rand(5, 13, dtype=d), rand(5, dtype=d))),
        Case("linear_3d_no_bias", "MmBackward0", F.linear, lambda d: (rand(2, 7, 13, dtype=d), rand(5, 13, dtype=d))),
    ]
    for node, (op, shapes) in ONE_SIDED.items():  # torch saves a factor only when the other side needs it
        for which in range(len(shapes)):
            cases.append(
                Case(
                    f"{node}_only_input{which}",
                    node,
                    op,
                    lambda d, shapes=shapes, which=which: [rand(*s, dtype=d, requires_grad=i == which) for i, s in enumerate(shapes)],
                )
            )
    return cases


# -- nn: the unit tier's convolution, pooling, attention tables, plus batch norm and embedding --


def _nn_cases() -> list[Case]:
    unit = test_rules_nn
    cases = []
    for name, (fn, x_shape, w_shape, kwargs) in unit.CONV_CASES.items():
        channels = unit._out_channels(fn, w_shape, kwargs)
        cases.append(
            Case(
                f"conv_{name}",
                "ConvolutionBackward0",
                lambda x, w, b, fn=fn, kwargs=kwargs: fn(x, w, b, **kwargs),
                lambda d, xs=x_shape, ws=w_shape, c=channels: (rand(*xs, dtype=d), rand(*ws, dtype=d), rand(c, dtype=d)),
            )
        )
    for name, (node, shape, fn) in unit.POOL_CASES.items():
        cases.append(Case(f"pool_{name}", node, fn, lambda d, s=shape: (rand(*s, dtype=d),)))
    cases.append(
        Case(
            "pool_max2d_channels_last",
            "MaxPool2DWithIndicesBackward0",
            lambda x: F.max_pool2d(x, 3, 2, 1),
            lambda d: (rand(2, 3, 9, 11, dtype=d).detach().to(memory_format=torch.channels_last).requires_grad_(),),
        )
    )
    for name, kwargs_of in unit.SDPA_CASES.items():
        cases.append(
            Case(
                f"sdpa_{name}",
                unit.SDPA_CPU,
                lambda q, k, v, kw: F.scaled_dot_product_attention(q, k, v, **kw),
                lambda d, kwargs_of=kwargs_of: (*unit._qkv(d), kwargs_of(d)),
            )
        )
    cases.append(
        Case(
            "sdpa_causal_noncontiguous_odd",
            unit.SDPA_CPU,
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            lambda d: unit._qkv(d, batch=1, heads=5, q_len=33, kv_len=65, dim=17, noncontiguous=True),
        )
    )
    for mode in ("train_with_stats", "train_no_stats", "eval"):
        cases.append(
            Case(
                f"batch_norm_{mode}",
                "NativeBatchNormBackward0",
                lambda x, w, b, stats, training=mode != "eval": F.batch_norm(x, *stats, w, b, training=training, eps=1e-3),
                lambda d, mode=mode: (
                    rand(2, 5, 7, 3, dtype=d),
                    rand(5, dtype=d),
                    rand(5, dtype=d),
                    (torch.randn(5, dtype=d), torch.rand(5, dtype=d) + 0.5) if mode != "train_no_stats" else (None, None),
                ),
            )
        )
    cases.append(
        Case(
            "batch_norm_channels_last",
            "NativeBatchNormBackward0",
            lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
            lambda d: (
                rand(2, 5, 7, 3, dtype=d).detach().to(memory_format=torch.channels_last).requires_grad_(),
                rand(5, dtype=d),
                rand(5, dtype=d),
            ),
        )
    )
    for padding_idx, by_freq in [(None, False), (2, True), (-1, False)]:
        cases.append(
            Case(
                f"embedding_pad{padding_idx}_freq{by_freq}",
                "EmbeddingBackward0",
                lambda w, i, p=padding_idx, f=by_freq: F.embedding(i, w, padding_idx=p, scale_grad_by_freq=f),
                lambda d: (rand(11, 7, dtype=d), torch.tensor([[2, 2, 10, 0, 5, 2, 9], [1, 10, 3, 3, 7, 2, 0]])),
            )
        )
    return cases


# -- the tables, and which of them also run in float64 and bfloat16 -----------------------------

FAMILIES = {
    "pointwise": test_rules_pointwise.ARITHMETIC
    + test_rules_pointwise.UNARY
    + test_rules_pointwise.ACTIVATIONS
    + test_rules_pointwise.SELECTION,
    "activations": test_rules_activations.CASES,
    "math": test_rules_math.UNARY + test_rules_math.ZERO + test_rules_math.MULTI + test_rules_math.SCANS + test_rules_math.NORMS,
    "statistics": test_rules_math.STATS,
    "reductions": test_rules_reductions.CASES,
    "norms": test_rules_norms.LAYER_NORM_FLOAT + test_rules_norms.SOFTMAX + test_rules_norms.NLL + test_rules_norms.COMPOSITIONS,
    "norms_more": test_rules_norms_more.GROUP_NORM + test_rules_norms_more.COMPOSED,
    "losses": test_rules_losses.CASES,
    "views": test_rules_views.CASES,
    "shape_ops": test_rules_shape_ops.CASES + test_rules_shape_ops.UPSAMPLE_CASES,
    "indexing": test_rules_indexing.CASES,
    "linalg": _linalg_cases(),
    "decompositions": test_rules_decompositions.CASES,
    "pool_backward": test_rules_pool_backward.CASES,
    "nn": _nn_cases(),
    "selection": test_rules_coverage.SELECTION,
    "scans": test_rules_coverage.SCANS,
    "special": test_rules_coverage.SPECIAL,
    "scatter_reduce": test_rules_coverage.SCATTER_REDUCE,
    "layers": test_rules_coverage.LAYERS,
    "recurrent": test_rules_coverage.RECURRENT,
    "sampling": test_rules_coverage.SAMPLING,
    "tail": test_rules_coverage.TAIL,
}

# Where kernels accumulate: these families also run in float64 and bfloat16 (the dtypes each case allows).
ALL_DTYPES = {"reductions", "statistics", "norms", "norms_more", "losses", "scans", "special", "scatter_reduce", "tail"}


# Cases that fail today because of a bug in the generated kernels: (case id, dtype or None for
# every dtype) -> the bug. Strict, so a fix turns them into failures until the entry is removed.
def _dtypes(family: str, case: Case) -> tuple:
    if family in ALL_DTYPES:
        return case.dtypes
    return (torch.float32,) if torch.float32 in case.dtypes else case.dtypes[:1]


def _params():
    out = []
    for family, cases in FAMILIES.items():
        for case in cases:
            for dtype in _dtypes(family, case):
                out.append(pytest.param(case, dtype, id=f"{family}-{case.id}-{str(dtype).replace('torch.', '')}"))
    return out


@pytest.mark.parametrize("case, dtype", _params())
def test_rule_family_on_interpret(case, dtype):
    run_case(case, dtype, backend=BACKEND)


@pytest.mark.parametrize("case", test_rules_norms.LAYER_NORM, ids=lambda c: c.id)
def test_layer_norm_bfloat16_matches_float64_truth(case):
    # As in the unit tier: torch's CPU bfloat16 layer norm sums the weight and bias gradients less
    # accurately than float32 accumulation, so the reference is float64 autograd on the same values.
    inputs = case.make(torch.bfloat16)
    out = case.fn(*inputs)
    grad_out = torch.randn_like(out)
    wrt = [x for x in inputs if x.requires_grad]
    with no_kernel_fallback():
        ours = gpuautograd.grad([out], wrt, [grad_out], retain_graph=True, backend=BACKEND)
    reference = gpuautograd.grad([out], wrt, [grad_out], backend="reference")
    assert gpuautograd.stats()["captures"] == 2 and not gpuautograd.stats()["fallbacks"]
    wide = [x.detach().double().requires_grad_(x.requires_grad) for x in inputs]
    truth = torch.autograd.grad([case.fn(*wide)], [x for x in wide if x.requires_grad], [grad_out.double()])
    for a, r, e in zip(ours, reference, truth):
        assert a.dtype == torch.bfloat16
        assert_close(a, e.to(torch.bfloat16), msg="against float64 autograd")
        assert_close(a, r, msg="against the reference executor")


# -- the unit tier's edge tests: branch boundaries, decomposed losses, infinities and NaNs --------


def _boundaries():
    out = []
    for name, fn, values in test_rules_activations.BOUNDARIES:
        for dtype in DTYPES:
            out.append(pytest.param(name, fn, values, dtype, id=f"{name}-{str(dtype).replace('torch.', '')}"))
    return out


@pytest.mark.parametrize("name, fn, values, dtype", _boundaries())
def test_branch_boundaries_on_interpret(name, fn, values, dtype):
    x = torch.tensor(values, dtype=dtype, requires_grad=True)
    check_grads(fn, x, grad_output=[torch.linspace(1.0, 2.0, len(values), dtype=dtype)], backend=BACKEND)


@pytest.mark.parametrize("name", list(test_rules_losses.DECOMPOSED))
def test_losses_that_decompose_on_interpret(name):
    fn, nodes = test_rules_losses.DECOMPOSED[name]
    x, y = rand(7, 13, dtype=torch.float32), rand(7, 13, dtype=torch.float32)
    assert nodes <= graph_node_names(fn(x, y)), f"{name} no longer builds {nodes}"
    check_grads(fn, x, y, backend=BACKEND)


def same_grads_as_torch(fn, *inputs, **kwargs):
    """tests.helpers.same_grads_as_torch on the interpret backend (also against the reference executor)."""
    helpers_same_grads_as_torch(fn, *inputs, backend=BACKEND, **kwargs)


@pytest.mark.parametrize("reduction", test_rules_losses.REDUCTIONS)
def test_bce_at_the_ends_of_its_domain_on_interpret(reduction):
    fn, inputs = test_rules_losses.bce_at_the_ends(reduction)
    same_grads_as_torch(fn, *inputs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_bce_with_logits_far_from_zero_on_interpret(dtype):
    fn, inputs, rtol = test_rules_losses.bce_with_logits_far_from_zero(dtype)
    same_grads_as_torch(fn, *inputs, rtol=rtol)


@pytest.mark.parametrize("zero_grad_every", [0, 2, 3])
def test_xlogy_special_values_on_interpret(zero_grad_every):
    same_grads_as_torch(torch.xlogy, test_rules_losses.xlogy_self(), test_rules_losses.xlogy_other(), zero_grad_every=zero_grad_every)


@pytest.mark.parametrize("other", [2.5, 0.0, -1.0, float("nan")])
def test_xlogy_scalar_other_special_values_on_interpret(other):
    same_grads_as_torch(lambda x: torch.xlogy(x, other), test_rules_losses.xlogy_self(), zero_grad_every=3)


def test_xlogy_scalar_self_special_values_on_interpret():
    same_grads_as_torch(lambda y: torch.xlogy(2.5, y), test_rules_losses.xlogy_other())


# -- value-dependent results on a cache hit: the plan must not bake in the first call's values ----


def grads_agree_on_interpret(fn, *inputs, expect_hit=False):
    """The interpret backend against torch.autograd and the reference executor, NaN == NaN;
    returns the interpret backend's gradients."""
    out = fn(*inputs)
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    grad = torch.randn_like(out)
    hits = gpuautograd.stats()["cache_hits"]
    with no_kernel_fallback():
        ours = gpuautograd.grad([out], wrt, [grad], retain_graph=True, allow_unused=True, backend=BACKEND)
    if expect_hit:
        assert gpuautograd.stats()["cache_hits"] == hits + 1, "expected the cached plan to run"
    reference = gpuautograd.grad([out], wrt, [grad], retain_graph=True, allow_unused=True, backend="reference")
    eager = torch.autograd.grad([out], wrt, [grad], allow_unused=True)
    assert not gpuautograd.stats()["fallbacks"]
    for a, r, e in zip(ours, reference, eager):
        assert (a is None) == (e is None)
        if e is not None:
            assert_close(a, e, msg="against torch.autograd")
            assert_close(a, r, msg="against the reference executor")
    return ours


@pytest.mark.parametrize(
    "fn, make_value",
    [
        (lambda x, m, v: x.masked_scatter(m, v), lambda: rand(91, dtype=torch.float32)),
        (lambda x, m, v: test_rules_shape_ops.setitem(x, m, v), lambda: rand(40, dtype=torch.float32)),
    ],
    ids=["masked_scatter", "setitem_mask"],
)
def test_mask_positions_are_computed_on_each_call_on_interpret(fn, make_value):
    first, second = torch.zeros(7, 13, dtype=torch.bool), torch.zeros(7, 13, dtype=torch.bool)
    first.view(-1)[:40] = True
    second.view(-1)[-40:] = True
    for k, m in enumerate((first, second)):
        x, v = rand(7, 13, dtype=torch.float32), make_value()
        grads_agree_on_interpret(lambda x, v, m=m: fn(x, m, v), x, v, expect_hit=k == 1)


@pytest.mark.parametrize("ord", [2, 3, 1.5, 0.5, float("inf")])
def test_norm_plan_serves_zero_vectors_on_a_cache_hit(ord):
    norm = test_rules_math.vector_norm(ord, 1)
    grads_agree_on_interpret(norm, rand(7, 13))
    (g,) = grads_agree_on_interpret(norm, test_rules_math.zero_rows(7, 13, rows=(1, 4)), expect_hit=True)
    assert torch.all(g[[1, 4]] == 0) and not torch.isnan(g).any()


def test_attention_style_layout_chain_on_interpret():
    # split, head reshapes and transposes, a slice, a stack and a cat: all indexing inside kernels
    def fn(x):
        q, k, v = x.split(8, -1)
        heads = [t.view(2, 7, 2, 4).transpose(1, 2) for t in (q, k, v)]
        mixed = torch.stack([heads[0], heads[1].mT.mT, heads[2]], 0)[:, :, 1:]
        return torch.cat([mixed.flatten(0, 1), heads[0][:, :1]], 0).permute(3, 0, 2, 1)

    check_grads(fn, rand(2, 7, 24, dtype=torch.float32), backend=BACKEND)


def test_statistics_compose_with_other_nodes_on_interpret():
    x, w = rand(33, 65, noncontiguous=True), rand(65)

    def fn(x, w):
        mean = x.mean(1, keepdim=True)
        z = (x - mean) / x.std(1, keepdim=True) * w
        return torch.logsumexp(z, 1).sum() + torch.linalg.vector_norm(z, 3) + z.cumsum(0).pow(2).sum()

    grads_agree_on_interpret(fn, x, w)


@pytest.mark.parametrize("op", [torch.remainder, torch.fmod], ids=["remainder", "fmod"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_rounded_quotients_bit_for_bit_on_interpret(op, dtype):
    # the kernel's floor / trunc division is torch's, signed zeros, infinities and NaNs included
    # (assert_close would not see the sign of a zero)
    a, b = test_rules_coverage.exact_quotients(dtype)
    out = op(a, b)
    g = torch.linspace(1.0, 2.0, out.numel(), dtype=dtype).reshape(out.shape)
    with no_kernel_fallback():
        (ours,) = gpuautograd.grad([out], [b], [g], retain_graph=True, backend=BACKEND)
    (theirs,) = torch.autograd.grad([out], [b], [g])
    assert torch.equal(ours.isnan(), theirs.isnan())
    assert torch.equal(ours.nan_to_num(0.5), theirs.nan_to_num(0.5))
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_attention_math_path_safe_softmax_on_interpret(dtype):
    # a mask that requires grad sends CPU attention down the math path: bmm + _safe_softmax
    q = rand(2, 3, 5, 8, dtype=dtype, noncontiguous=True)
    k, v = rand(2, 3, 7, 8, dtype=dtype), rand(2, 3, 7, 8, dtype=dtype)
    mask = rand(5, 7, dtype=dtype)
    assert "SafeSoftmaxBackward0" in graph_node_names(F.scaled_dot_product_attention(q, k, v, mask))
    check_grads(F.scaled_dot_product_attention, q, k, v, mask, backend=BACKEND)
