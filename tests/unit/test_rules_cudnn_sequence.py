"""cuDNN's recurrent and CTC backward rules (CudnnRnnBackward0, CudnnCtcLossBackward0/1) on the CPU.

These nodes only exist on CUDA, so here each rule runs on a node built by hand from CPU values
(the saved values and gradients as program inputs of a Builder, as the capture makes them):
  - CTC: the rule is three pointwise ops, run for real against the formula on CPU values;
  - RNN: the extern op's kernel, aten._cudnn_rnn_backward, has no CPU or meta kernel, so it is
    replaced by a stand-in with its signature that computes the same gradients with the CPU's
    recurrent layers and torch.autograd. That checks what the rule and the op do around the kernel:
    which saved value goes to which argument, the attributes, grad_input_mask, the optional slots,
    the copy of the reserve space, and which result goes to which edge.
The real CudnnRnnBackward0 node is also built on meta tensors (torch has a meta forward) to check
its edges and saved values as the capture sees them. The GPU tier (tests/gpu/test_cudnn_sequence_gpu.py)
runs both against torch.autograd with the real kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gpuautograd
from gpuautograd.capture.nodeview import NodeView
from gpuautograd.ir import extern_sequence_ops
from gpuautograd.ir.builder import Builder
from gpuautograd.ir.program import InputSpec, OutputSpec
from gpuautograd.ir.types import TensorType
from gpuautograd.ir.verifier import verify
from gpuautograd.rules import lookup
from gpuautograd.runtime.reference import compile_reference
from tests.helpers import assert_close

aten = torch.ops.aten
DT = torch.float64
MODES = {"RNN_RELU": 0, "RNN_TANH": 1, "LSTM": 2, "GRU": 3}  # cuDNN's mode numbers, as _cudnn_rnn takes them
MODULES = {"LSTM": torch.nn.LSTM, "GRU": torch.nn.GRU, "RNN_TANH": torch.nn.RNN}


def build(name: str, saved: dict, grads: list, out_types: list, needs: list):
    """Run the rule of `name` on a node built by hand: the tensors in `saved` and `grads` become
    program inputs (a list of tensors, a list of inputs), as the capture makes them; returns
    (program, run), where run() executes the program on the reference executor and gives one
    result per edge."""
    b, args = Builder(), []

    def value(t, kind):
        if t is None:
            return None
        args.append(t)
        return b.input(TensorType.of(t), InputSpec(kind, len(args) - 1))

    grad_values = [value(g, "grad") for g in grads]
    saved_values = {}
    for k, v in saved.items():
        if isinstance(v, torch.Tensor):
            saved_values[k] = value(v, "saved")
        elif isinstance(v, list):
            saved_values[k] = [value(t, "saved") for t in v]
        else:
            saved_values[k] = v
    input_types = [None if v is None else v.type for v in grad_values]
    node = NodeView(name, saved_values, input_types, out_types, needs)
    outs = lookup(name)(b, node, grad_values)
    assert len(outs) == len(out_types)
    for i, o in enumerate(outs):
        b.output(o, OutputSpec("input", i))
    verify(b.program)
    return b.program, lambda: list(compile_reference(b.program)(args))


# -- RNN: the stand-in kernel --------------------------------------------------------------------


class StandIn:
    """aten._cudnn_rnn_backward's signature, computed with the CPU's recurrent layers and
    torch.autograd. It records what it was called with and scribbles on the reserve space, as
    cuDNN's input pass does."""

    def __init__(self):
        self.calls = []

    def __call__(
        self,
        input,
        weight,
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
        batch_sizes,
        dropout_state,
        reserve,
        output_mask,
    ):
        self.calls.append(dict(locals()))
        assert proj_size == 0 and list(batch_sizes) == [] and weight_stride0 in (2, 4)
        assert isinstance(output_mask, list) and len(output_mask) == 4
        reserve.fill_(7)  # the kernel writes its reserve space: this must be a copy
        with torch.enable_grad():
            x, h = input.detach().requires_grad_(), hx.detach().requires_grad_()
            c = None if cx is None else cx.detach().requires_grad_()
            ws = [w.detach().requires_grad_() for w in weight]
            args = (ws, weight_stride0 == 4, num_layers, dropout, train, bidirectional, batch_first)
            if mode == MODES["LSTM"]:
                outs = torch._VF.lstm(x, (h, c), *args)
            else:
                fn = {MODES["GRU"]: torch._VF.gru, MODES["RNN_TANH"]: torch._VF.rnn_tanh, MODES["RNN_RELU"]: torch._VF.rnn_relu}[mode]
                outs = fn(x, h, *args)
            assert outs[0].shape[-1] == hidden_size * (2 if bidirectional else 1)
            torch.testing.assert_close(outs[0], output)  # `output` is the forward's result0
            pairs = [(o, g) for o, g in zip(outs, (grad_output, grad_hy, grad_cy)) if g is not None]
            wrt = [x, h, *([] if c is None else [c]), *ws]
            got = torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True)
        got = [torch.zeros_like(t) if g is None else g for g, t in zip(got, wrt)]
        dx, dhx = got[0], got[1]
        dcx = None if c is None else got[2]
        dw = got[2 if c is None else 3 :]
        return dx, dhx, dcx, (dw if output_mask[3] else [])


@pytest.fixture
def stand_in(monkeypatch):
    kernel = StandIn()
    monkeypatch.setattr(extern_sequence_ops, "CUDNN_RNN_BACKWARD", kernel)
    return kernel


def rnn_case(mode="LSTM", num_layers=1, bidirectional=False, batch_first=False, bias=True, seed=0):
    """A CPU layer of `mode` and its forward, as the cudnn node would save them; returns
    (saved, edges, forward outputs) with edges = [input, *weights, hx, cx (or None)]."""
    torch.manual_seed(seed)
    T, B, In, H = 5, 3, 4, 3
    dirs = 2 if bidirectional else 1
    layer = MODULES[mode](In, H, num_layers, bias=bias, batch_first=batch_first, bidirectional=bidirectional).to(DT)
    weights = [w.detach().clone().requires_grad_() for w in layer._flat_weights]
    x = torch.randn(*((B, T, In) if batch_first else (T, B, In)), dtype=DT, requires_grad=True)
    hx = torch.randn(num_layers * dirs, B, H, dtype=DT, requires_grad=True)
    cx = torch.randn(num_layers * dirs, B, H, dtype=DT, requires_grad=True) if mode == "LSTM" else None
    args = (weights, bias, num_layers, 0.0, True, bidirectional, batch_first)
    if mode == "LSTM":
        outs = torch._VF.lstm(x, (hx, cx), *args)
    else:
        outs = {"GRU": torch._VF.gru, "RNN_TANH": torch._VF.rnn_tanh}[mode](x, hx, *args)
    saved = dict(
        input=x.detach(),
        weight=[w.detach() for w in weights],
        hx=hx.detach(),
        cx=None if cx is None else cx.detach(),
        result0=outs[0].detach(),
        result3=torch.arange(24, dtype=torch.uint8),  # cuDNN's reserve space
        result4=torch.cat([w.detach().flatten() for w in weights]),  # cuDNN's flat weight buffer
        dropout_state=None,
        weight_stride0=4 if bias else 2,
        mode=MODES[mode],
        hidden_size=H,
        proj_size=0,
        num_layers=num_layers,
        batch_first=batch_first,
        dropout=0.0,
        train=True,
        bidirectional=bidirectional,
        batch_sizes=[],
    )
    return saved, [x, *weights, hx, cx], outs


def rnn_grads(outs, present=(True, True, True), seed=1):
    torch.manual_seed(seed)
    grads = [torch.randn_like(o) if p else None for o, p in zip(outs, present)]
    grads += [None] * (3 - len(grads))  # GRU and RNN have no cy
    return grads + [None, None]  # result3, result4: not differentiable


def run_rnn(saved, edges, outs, grads, needs=None):
    needs = needs or [e is not None for e in edges]
    out_types = [None if e is None else TensorType.of(e) for e in edges]
    program, run = build("CudnnRnnBackward0", saved, grads, out_types, needs)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    wrt = [e for e, n in zip(edges, needs) if n]
    if not pairs:
        return program, run(), [None] * len(edges)
    outputs, out_grads = [o for o, _ in pairs], [g for _, g in pairs]
    theirs = iter(torch.autograd.grad(outputs, wrt, out_grads, retain_graph=True, allow_unused=True, materialize_grads=True))
    expected = [next(theirs) if n else None for n in needs]
    return program, run(), expected


def only_extern(program):
    (instr,) = [i for i in program.instrs if i.op == "cudnn_rnn_backward"]
    assert [i.op for i in program.instrs] == ["cudnn_rnn_backward"]
    return instr


# -- RNN: the program's structure ---------------------------------------------------------------


def test_rnn_program_is_one_extern_call_wired_to_the_edges(stand_in):
    saved, edges, outs = rnn_case("LSTM", num_layers=2, bidirectional=True)
    grads = rnn_grads(outs)
    program, ours, _ = run_rnn(saved, edges, outs, grads)
    instr = only_extern(program)
    n = len(saved["weight"])
    assert n == 16
    # operands: input, hx, output, reserve, the weights, then weight_buf, cx, dropout_state (absent), the three grads
    grad_ins, saved_ins = [v for v, s in program.inputs if s.kind == "grad"], [v for v, s in program.inputs if s.kind == "saved"]
    # saved inputs were made in `saved`'s order: input, 16 weights, hx, cx, result0, result3, result4
    s_input, s_weights, s_hx, s_cx, s_out, s_reserve, s_buf = saved_ins[0], saved_ins[1:17], *saved_ins[17:22]
    assert list(instr.inputs) == [s_input, s_hx, s_out, s_reserve, *s_weights, s_buf, s_cx, *grad_ins]
    assert instr.attrs["present"] == (True, True, False, True, True, True)
    assert instr.attrs["output_mask"] == (True, True, True, True)
    assert instr.attrs["num_weights"] == n and instr.attrs["batch_sizes"] == ()
    expected_attrs = dict(weight_stride0=4, mode=2, hidden_size=3, proj_size=0, num_layers=2, batch_first=False, dropout=0.0)
    assert {k: instr.attrs[k] for k in expected_attrs} == expected_attrs
    assert instr.attrs["train"] is True and instr.attrs["bidirectional"] is True
    # results: (dx, dhx, dcx, *dw) go to edges input, weights..., hx, cx
    dx, dhx, dcx, *dw = instr.outputs
    assert [v for v, _ in program.outputs] == [dx, *dw, dhx, dcx]
    assert [v.type for v in (dx, dhx, dcx, *dw)] == [TensorType.of(e) for e in (edges[0], edges[-2], edges[-1], *edges[1:-2])]


def test_rnn_grad_input_mask_follows_the_edges(stand_in):
    saved, edges, outs = rnn_case("LSTM", num_layers=2)
    n = len(saved["weight"])
    needs = [False] + [False] * n + [True, False]  # only hx
    program, ours, expected = run_rnn(saved, edges, outs, rnn_grads(outs), needs)
    instr = only_extern(program)
    assert instr.attrs["output_mask"] == (False, True, False, False)
    dx, dhx, dcx, *dw = instr.outputs
    assert dx is None and dcx is None and all(w is None for w in dw) and dhx is not None
    assert ours[-2] is not None and all(o is None for i, o in enumerate(ours) if i != n + 1)
    assert_close(ours[-2], expected[-2])
    # one weight asks for all of them (the mask has one entry for the list), the rest stay None
    needs = [False] * (n + 3)
    needs[3] = True
    program, ours, expected = run_rnn(saved, edges, outs, rnn_grads(outs), needs)
    assert only_extern(program).attrs["output_mask"] == (False, False, False, True)
    assert [o is not None for o in ours] == needs
    assert_close(ours[3], expected[3])


def test_rnn_without_gradients_emits_nothing(stand_in):
    saved, edges, outs = rnn_case("GRU")
    program, ours, _ = run_rnn(saved, edges, outs, rnn_grads(outs, (False, False)))
    assert not program.instrs and all(o is None for o in ours)
    assert not stand_in.calls


# -- RNN: gradients through the stand-in ---------------------------------------------------------

RNN_CASES = {
    "lstm": dict(mode="LSTM"),
    "lstm_2layer_bidir": dict(mode="LSTM", num_layers=2, bidirectional=True),
    "lstm_batch_first_no_bias": dict(mode="LSTM", batch_first=True, bias=False),
    "gru_2layer": dict(mode="GRU", num_layers=2),
    "gru_bidir_batch_first": dict(mode="GRU", bidirectional=True, batch_first=True),
    "rnn_tanh": dict(mode="RNN_TANH", num_layers=2),
}


@pytest.mark.parametrize("case", list(RNN_CASES))
def test_rnn_gradients_match_autograd(case, stand_in):
    saved, edges, outs = rnn_case(**RNN_CASES[case])
    program, ours, expected = run_rnn(saved, edges, outs, rnn_grads(outs))
    assert len(ours) == len(edges)
    for (v, _), a in zip(program.outputs, ours):  # the stated types are what the kernel gives
        assert (v is None) == (a is None) and (v is None or (tuple(a.shape), a.dtype) == (v.shape, v.dtype))
    for i, (a, e) in enumerate(zip(ours, expected)):
        assert (a is None) == (e is None), i
        if e is not None:
            assert_close(a, e, msg=f"{case}: edge {i}")
    (call,) = stand_in.calls
    # the optional slots reach the kernel where they belong, the saved tensors as they are ...
    assert call["weight_buf"] is saved["result4"] and call["dropout_state"] is None
    assert (call["cx"] is None) == (saved["cx"] is None)
    assert call["batch_sizes"] == [] and call["output_mask"] == [True, True, saved["cx"] is not None, True]
    # ... except the reserve space, which the kernel gets a copy of: the saved one is untouched
    assert call["reserve"] is not saved["result3"]
    assert torch.equal(saved["result3"], torch.arange(24, dtype=torch.uint8))


@pytest.mark.parametrize("present", [(True, False, False), (False, True, False), (False, False, True), (False, True, True)])
def test_rnn_absent_output_gradients(present, stand_in):
    saved, edges, outs = rnn_case("LSTM", num_layers=2, bidirectional=True)
    grads = rnn_grads(outs, present)
    program, ours, expected = run_rnn(saved, edges, outs, grads)
    assert only_extern(program).attrs["present"] == (True, True, False, *present)
    for i, (a, e) in enumerate(zip(ours, expected)):
        assert_close(a, e, msg=f"edge {i}")
    (call,) = stand_in.calls
    for name, p, g in zip(("grad_output", "grad_hy", "grad_cy"), present, grads):
        assert (call[name] is None) != p
        if p:
            assert call[name] is g


def test_rnn_dropout_state_is_passed_through(stand_in):
    saved, edges, outs = rnn_case("GRU")
    saved["dropout_state"] = torch.arange(8, dtype=torch.uint8)  # dropout 0: the kernel ignores it
    program, ours, expected = run_rnn(saved, edges, outs, rnn_grads(outs))
    assert only_extern(program).attrs["present"] == (True, False, True, True, True, False)
    assert stand_in.calls[0]["dropout_state"] is saved["dropout_state"]
    for a, e in zip(ours, expected):
        if e is not None:
            assert_close(a, e)


def test_rnn_op_infers_types_without_running_the_kernel():
    """aten._cudnn_rnn_backward has no meta kernel: the op states its types."""
    with pytest.raises(NotImplementedError):
        m = torch.empty(1, device="meta")
        aten._cudnn_rnn_backward(m, [m], 2, m, m, None, m, m, None, None, 1, 1, 0, 1, False, 0.0, True, False, [], None, m, [True] * 4)
    saved, edges, outs = rnn_case("GRU", bidirectional=True)
    types = [None if e is None else TensorType.of(e) for e in edges]
    program, _ = build("CudnnRnnBackward0", saved, rnn_grads(outs), types, [e is not None for e in edges])
    instr = only_extern(program)
    assert instr.attrs["output_mask"] == (True, True, False, True)
    assert instr.outputs[2] is None  # GRU: no cx, no grad cx
    assert [o.type for o in instr.outputs if o is not None] == [types[0], types[-2], *types[1:-2]]


# -- RNN: the real node, built on meta tensors --------------------------------------------------


def _meta(*shape, requires_grad=True):
    return torch.empty(*shape, device="meta", requires_grad=requires_grad)


def _shape_only(input, weight, weight_stride0, weight_buf, hx, cx, *rest):
    """A stand-in for the kernel on meta tensors: results of the right shapes."""
    output_mask = rest[-1]
    return (
        torch.empty_like(input),
        torch.empty_like(hx),
        None if cx is None else torch.empty_like(cx),
        [torch.empty_like(w) for w in weight] if output_mask[3] else [],
    )


@pytest.mark.usefixtures("walker")  # both walkers read its saved weight list and undefined tensors
@pytest.mark.parametrize("mode", ["LSTM", "GRU"])
def test_real_cudnn_rnn_node_on_meta(mode, monkeypatch):
    monkeypatch.setattr(extern_sequence_ops, "CUDNN_RNN_BACKWARD", _shape_only)
    T, B, In, H, layers = 5, 2, 3, 4, 2
    gates = 4 if mode == "LSTM" else 3
    x = _meta(T, B, In)
    weights = []
    for layer in range(layers):
        for _ in range(2):  # two directions
            weights += [_meta(gates * H, In if layer == 0 else 2 * H), _meta(gates * H, H), _meta(gates * H), _meta(gates * H)]
    hx = _meta(2 * layers, B, H)
    cx = _meta(2 * layers, B, H) if mode == "LSTM" else None
    outs = aten._cudnn_rnn(x, weights, 4, None, hx, cx, MODES[mode], H, 0, layers, False, 0.0, True, True, [], None)
    node = outs[0].grad_fn
    assert node.name() == "CudnnRnnBackward0"
    # the edges the rule returns gradients for: input, the weights, hx, cx
    leaves = [x, *weights, hx, cx]
    assert len(node.next_functions) == len(leaves)
    for (fn, _), leaf in zip(node.next_functions, leaves):
        assert (fn is None) == (leaf is None) and (fn is None or fn.variable is leaf)
    grads = [torch.empty_like(outs[0]), torch.empty_like(outs[1])] + ([torch.empty_like(outs[2])] if cx is not None else [])
    differentiable = list(outs[: len(grads)])
    report = gpuautograd.explain(differentiable, grads)
    assert not report.opaque_nodes, report
    assert "cudnn_rnn_backward" in str(report.program)
    wrt = [t for t in leaves if t is not None]
    ours = gpuautograd.grad(differentiable, wrt, grads)
    assert not gpuautograd.stats()["fallbacks"], gpuautograd.stats()["fallbacks"]
    for a, t in zip(ours, wrt):
        assert (a.shape, a.dtype, a.device) == (t.shape, t.dtype, t.device)


# -- CTC -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["CudnnCtcLossBackward0", "CudnnCtcLossBackward1"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_ctc_matches_autograd(name, zero_infinity):
    torch.manual_seed(3)
    T, N, C = 6, 4, 5
    log_probs = torch.randn(T, N, C).log_softmax(2).requires_grad_()
    targets = torch.randint(1, C, (N, 3))
    target_lengths = [3, 2, 3, 3]
    if zero_infinity:
        T_short = [T, T, T, 2]  # 3 labels cannot fit 2 frames: an infinite loss, zeroed
    else:
        T_short = [T] * N
    losses = F.ctc_loss(log_probs, targets, T_short, target_lengths, reduction="none", zero_infinity=zero_infinity)
    assert bool(zero_infinity) == bool((losses == 0).any())
    (raw,) = torch.autograd.grad(losses.sum(), log_probs, retain_graph=True)  # each loss has its own column
    grad = torch.randn(N)
    (expected,) = torch.autograd.grad(losses, log_probs, grad)
    saved = dict(result0=losses.detach(), result1=raw, zero_infinity=zero_infinity)
    program, run = build(name, saved, [grad, None], [TensorType.of(log_probs)], [True])
    assert {i.op for i in program.instrs} <= {"reshape", "mul", "eq", "where"}
    assert ("where" in {i.op for i in program.instrs}) == zero_infinity
    (ours,) = run()
    assert (ours.shape, ours.dtype) == (log_probs.shape, log_probs.dtype)
    assert_close(ours, expected)
    if zero_infinity:
        assert not ours[:, 3].any()


def test_ctc_zero_infinity_zeroes_where_the_loss_is_zero():
    """torch's formula, on values where the raw gradient is nonzero where the loss is 0."""
    raw, loss, grad = torch.randn(3, 4, 5), torch.tensor([1.0, 0.0, 2.0, 0.0]), torch.randn(4)
    saved = dict(result0=loss, result1=raw, zero_infinity=True)
    program, run = build("CudnnCtcLossBackward0", saved, [grad, None], [TensorType.of(raw)], [True])
    (ours,) = run()
    expected = torch.where(loss[None, :, None] == 0, torch.zeros(()), raw * grad[None, :, None])
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_ctc_without_gradient():
    saved = dict(result0=torch.ones(2), result1=torch.ones(3, 2, 4), zero_infinity=False)
    program, run = build("CudnnCtcLossBackward0", saved, [None, None], [TensorType.of(saved["result1"])], [True])
    assert not program.instrs and run() == [None]
