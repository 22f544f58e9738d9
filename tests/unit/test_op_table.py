"""The op table: every op's type inference agrees with what its reference implementation computes.

Programs are captured from real graphs (the model suite and a zoo of small graphs) and then run
one instruction at a time; each result must have exactly the shape and dtype the instruction
recorded at capture. Every op of the table must be exercised here, except the CUDA-only ones,
whose inference is checked against torch's meta kernels in the nn rule tests (cudnn_rnn_backward,
which has none, against its CPU stand-in in test_rules_cudnn_sequence.py).
"""

import pytest
import torch
import torch.nn.functional as F

from bench.models import SUITE
from gpuautograd import native
from gpuautograd.ir.ops import OPS, get_op
from gpuautograd.ir.program import Value
from gpuautograd.passes.decompose import decompose_composites
from gpuautograd.runtime import engine

CUDA_ONLY = {"sdpa_efficient_backward", "sdpa_flash_backward", "sdpa_cudnn_backward", "cudnn_rnn_backward", "to_device"}


class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * g


def _leaf(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def zoo():
    """Small graphs whose backward uses the ops the model suite does not."""
    x, y = _leaf(5, 7), _leaf(5, 7)
    idx = torch.tensor([0, 2, 2, 4])
    yield "indexing", (x[idx] * x[:, [1, 1, 3]].sum()).sum() + x.gather(1, torch.tensor([[0, 6]] * 5)).sum()
    yield "scatter", torch.scatter(x, 1, torch.tensor([[0], [1], [2], [3], [4]]), y[:, :1]).pow(2).sum()
    yield "scatter_add", torch.scatter_add(x, 0, torch.tensor([[0, 1, 2, 3, 4, 0, 1]]), y[:1]).exp().sum()
    yield "index_add", x.index_add(0, idx, y[:4], alpha=2.0).pow(2).sum()
    yield "select_slice", (x[2] * 3).sum() + x[1:4:2, ::3].abs().sum() + x.unbind(1)[3].sum()
    yield "reductions", x.amax(1).sum() + y.amin(0).sum() + x.max() + torch.maximum(x, y).clamp(-0.5, 0.5).sum()
    yield "math", (x.sqrt().log1p() + y.sin().cos() * x.expm1() - x.reciprocal() + y.sign() + x.rsqrt()).nansum()
    yield "cast", (x.float().half().double() * torch.where(x > y, x, y)).sum() + x.to(torch.bfloat16).sum().double()
    yield "cat", torch.cat([x, y * 2], 1).tanh().sum() + torch.stack([x, y]).sigmoid().sum()
    yield "bmm", torch.bmm(_leaf(2, 3, 4), _leaf(2, 4, 5)).sum()
    yield "opaque", Cube.apply(x).sum()
    yield "mask", x.masked_fill(x > 0, 0.0).erf().sum() + (x / y).sum() + (x ** y.abs()).sum()
    yield "shape", F.pad(x[None], (2, 1), mode="reflect").tril(1).sum() + F.interpolate(x[None, None], scale_factor=2).sum()
    yield "scans", x.cumsum(1).cosh().sum() + (x.sigmoid() - 0.5).erfinv().sum() + x.prod(1).sum()
    yield "group_norm", F.group_norm(_leaf(2, 6, 5), 3, _leaf(6), _leaf(6)).pow(2).sum()
    cols = F.unfold(_leaf(1, 2, 5, 6), (2, 3), padding=1, stride=(2, 1))
    yield "im2col", F.fold(cols.exp(), (5, 6), (2, 3), padding=1, stride=(2, 1)).pow(2).sum()
    yield "mse", F.mse_loss(x, y) + F.mse_loss(x.exp(), y.detach(), reduction="sum") + F.threshold(x, 0.1, 2.0).sum()
    a, tri = _leaf(4, 4), torch.randn(3, 4, 4, dtype=torch.float64).tril().add(4 * torch.eye(4, dtype=torch.float64)).requires_grad_()
    solves = torch.linalg.det(a + 4 * torch.eye(4, dtype=torch.float64)) + torch.linalg.solve_triangular(tri, y[:4, :3], upper=False).sum()
    yield "linalg_solves", solves + torch.cholesky_solve(y[:4, :2], tri).sum()
    yield "cdist", torch.cdist(x, y[:3], p=1.0).sum()
    yield "lstsq", torch.linalg.lstsq(a[:, :3], y[:4, :2]).solution.sum()
    yield "eig", torch.view_as_real(torch.linalg.eigvals(a + 4 * torch.eye(4, dtype=torch.float64))).sum()
    reflectors, tau = (t.requires_grad_() for t in torch.geqrf(torch.randn(5, 3, dtype=torch.float64)))
    yield "ormqr", torch.ormqr(reflectors, tau, y[:, :2]).pow(2).sum()
    yield (
        "lu_solve",
        torch.linalg.lu_solve(*torch.linalg.lu_factor(a + 4 * torch.eye(4, dtype=torch.float64)), y[:4, :3], adjoint=True).sum(),
    )
    yield "gamma", (torch.lgamma(x.abs() + 1) + torch.polygamma(2, y.abs() + 1) + x.logcumsumexp(1)).sum()
    idx2 = torch.tensor([[0, 1, 2, 3, 4, 0, 1]] * 2)
    yield "reducing_scatters", (x.scatter_reduce(0, idx2, y[:2], "prod") + x.index_reduce(0, idx, y[:4], "prod")).sum()
    bag = F.embedding_bag(torch.tensor([1, 4, 4, 0, 2]), x, torch.tensor([0, 2]), mode="sum", per_sample_weights=_leaf(5))
    yield "embedding_bag", bag.pow(2).sum()
    log_probs = _leaf(6, 2, 4).log_softmax(2)
    yield "ctc", F.ctc_loss(log_probs, torch.tensor([[1, 2], [3, 3]]), [6, 5], [2, 2])
    w = torch.randn(4, dtype=torch.complex128, requires_grad=True)
    spectrum = torch.fft.rfft(x) * w
    waves = torch.fft.irfft(torch.fft.fft(spectrum).conj() / (1 + 2j), n=7)
    parts = torch.view_as_complex(torch.stack([x, y], -1)).exp().abs() + torch.complex(x, y).imag
    sign, logabsdet = torch.linalg.slogdet(torch.randn(3, 3, dtype=torch.complex128).requires_grad_())
    yield "complex", waves.pow(2).sum() + torch.view_as_real(spectrum).sum() + parts.sum() + (sign * logabsdet).abs()
    lstm = torch.nn.LSTM(7, 3)  # float32 on the CPU: oneDNN's fused layer
    yield "onednn_lstm", lstm(x.float()[None])[0].sum()
    grid = (torch.rand(1, 3, 4, 2, dtype=torch.float64) * 2 - 1).requires_grad_()
    yield "grid_sample", F.grid_sample(x[None, None], grid, align_corners=False).pow(2).sum()
    yield "segment_reduce", torch.segment_reduce(x, "max", lengths=torch.tensor([2, 3])).pow(2).sum()
    yield "rounded_quotients", (torch.remainder(x, y.abs() + 0.5) + torch.fmod(x, y.abs() + 0.5) + torch.i0(x)).sum()
    vol = _leaf(1, 2, 5, 7, 6)
    yield "pool3d", (F.avg_pool3d(vol, 3, stride=2, padding=1).pow(2).sum() + F.adaptive_avg_pool3d(vol, (2, 3, 2)).exp().sum())
    margins = F.multi_margin_loss(x, torch.tensor([0, 3, 6, 1, 1])) + F.multilabel_margin_loss(
        y, torch.tensor([[2, 0, -1, 0, 0, 0, 0]] * 5)
    )
    yield "pdist_margins", F.pdist(x).sum() + margins
    if native.load() is not None:  # hooks yield to the host through the extension (node_hooks)
        h = x.exp()
        h.register_hook(lambda g: g * 2)  # (a hook on a node would outlive the test: parametrize keeps it)
        y.register_post_accumulate_grad_hook(lambda p: None)
        yield "hooks", (h.sin() * y).sum()
    yield "nll", F.nll_loss(F.log_softmax(x, 1), torch.tensor([0, 3, 6, 1, 1]), ignore_index=1, weight=torch.rand(7, dtype=torch.float64))


def graphs():
    for name in ("mlp", "cnn", "gpt", "gpt-manual-attn", "llama"):
        torch.manual_seed(0)
        model, make_batch, loss_fn = SUITE[name](dtype=torch.float64)
        yield name, loss_fn(model, *make_batch(torch.Generator().manual_seed(0)))
    yield from zoo()


def run_checked(loss):
    """Capture `loss`'s backward and run it instruction by instruction, checking every type; then
    the same for its composites decomposed (what the fused backends start from)."""
    grads = [torch.ones_like(loss)]
    w, key, roots, inputs = engine.prepare([loss], grads, [], True, None)
    entry = engine.build_entry(w, grads, roots, inputs, True)
    used = set()
    for program in (entry.program, decompose_composites(entry.program)):
        env = {}
        for (v, _spec), (kind, i) in zip(program.inputs, entry.arg_plan):
            env[id(v)] = w.saved[i] if kind == "saved" else grads[i] if kind == "grad" else w.nodes[i]
        _run_instructions(program, env, used)
    return used


def _run_instructions(program, env, used):
    with torch.no_grad():
        for instr in program.instrs:
            args = [env[id(x)] if isinstance(x, Value) else x for x in instr.inputs]
            out = get_op(instr.op).impl(*args, **instr.attrs)
            outs = out if isinstance(out, tuple) else (out,)
            for o, t in zip(outs, instr.outputs):
                if t is None:
                    continue
                assert o is not None, f"{instr.op} gave no value for {t.name}"
                assert (tuple(o.shape), o.dtype) == (t.shape, t.dtype), f"{instr.op}: ran to {o.dtype}{list(o.shape)}, inferred {t.type}"
                env[id(t)] = o
            used.add(instr.op)


@pytest.fixture(scope="module")
def exercised():
    return {}


@pytest.mark.parametrize("name, loss", list(graphs()), ids=lambda v: v if isinstance(v, str) else "")
def test_inferred_types_match_reference(name, loss, exercised):
    exercised[name] = run_checked(loss)


def test_every_op_is_exercised(exercised):
    if len(exercised) < len(list(graphs())):
        pytest.skip("needs the whole module to run")
    used = set().union(*exercised.values())
    missing = set(OPS) - used - CUDA_ONLY - (set() if native.load() is not None else {"node_hooks"})
    assert not missing, f"ops of the table that no captured program exercises: {sorted(missing)}"
