"""A custom Function's backward runs inside an autograd graph task, as in eager: queued callbacks,
the task's keep_graph, checkpoint's refusal of .grad(), and deep reentrant backwards behave as
torch.autograd's do. Each behaviour is compared with eager on the same graph."""

import contextlib

import pytest
import torch
from torch.autograd import Variable
from torch.utils.checkpoint import checkpoint

import gpuautograd
from tests.helpers import assert_close, rand
from tests.replay_cases import Failing


def eager_and_ours():
    """The two ways to run a backward: plain torch, and the same code under gpuautograd.enable()."""
    return [("eager", contextlib.nullcontext), ("gpuautograd", gpuautograd.enable)]


class Recorder(torch.autograd.Function):
    """x * 3, whose backward queues a callback and records the graph task's keep_graph."""

    log: list = []

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        Recorder.log.append(("keep_graph", torch._C._autograd._get_current_graph_task_keep_graph()))
        Variable._execution_engine.queue_callback(lambda: Recorder.log.append("callback"))
        return g * 3


def _record(how, call: str, retain: bool):
    Recorder.log = []
    x = rand(4, 3)
    with how():
        loss = Recorder.apply(x.sin()).square().sum()
        if call == "backward":
            loss.backward(retain_graph=retain)
            g = x.grad
        else:
            (g,) = torch.autograd.grad(loss, x, retain_graph=retain)
        Recorder.log.append("returned")
    return Recorder.log, g


@pytest.mark.parametrize("call", ["backward", "grad"])
@pytest.mark.parametrize("retain", [False, True])
def test_a_custom_backward_queues_callbacks_and_sees_keep_graph_as_in_eager(call, retain):
    (_, eager), (_, ours) = eager_and_ours()
    torch.manual_seed(0)
    expected_log, expected = _record(eager, call, retain)
    torch.manual_seed(0)
    log, got = _record(ours, call, retain)
    assert expected_log == [("keep_graph", retain), "callback", "returned"]
    assert log == expected_log
    assert_close(got, expected)
    s = gpuautograd.stats()
    assert s["captures"] == 1 and not s["fallbacks"], s


def _checkpointed(x, w):
    return checkpoint(lambda a, b: (a @ b).tanh(), x, w, use_reentrant=True).sum()


def test_reentrant_checkpoint_refuses_grad_as_in_eager():
    x, w = rand(5, 4), rand(4, 3)
    with pytest.raises(RuntimeError, match="incompatible with .grad") as eager_error:
        torch.autograd.grad(_checkpointed(x, w), [w])
    with gpuautograd.enable(), pytest.raises(RuntimeError) as ours_error:
        torch.autograd.grad(_checkpointed(x, w), [w])
    assert str(ours_error.value) == str(eager_error.value)


def test_reentrant_checkpoint_runs_under_backward_as_in_eager():
    x, w = rand(5, 4), rand(4, 3)
    _checkpointed(x, w).backward()
    expected = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    with gpuautograd.enable():
        _checkpointed(x, w).backward()
    assert_close(x.grad, expected[0])
    assert_close(w.grad, expected[1])
    assert gpuautograd.stats()["captures"] >= 1 and not gpuautograd.stats()["fallbacks"]


class Deep(torch.autograd.Function):
    """Identity whose backward runs the backward of a fresh graph of `depth - 1` more levels."""

    reached: list = []

    @staticmethod
    def forward(ctx, x, depth):
        ctx.depth = depth
        return x * 1

    @staticmethod
    def backward(ctx, g):
        if ctx.depth > 0:
            with torch.enable_grad():
                y = torch.ones(2, dtype=torch.float64, requires_grad=True)
                Deep.apply(y * 2, ctx.depth - 1).sum().backward()
                Deep.reached.append(float(y.grad.sum()))
        return g * 2, None


@pytest.mark.parametrize("how", ["eager", "gpuautograd"])
def test_a_2000_deep_reentrant_backward_completes(how):
    Deep.reached = []
    x = rand(2)
    with gpuautograd.enable() if how == "gpuautograd" else contextlib.nullcontext():
        Deep.apply(x, 2000).sum().backward()
    assert_close(x.grad, torch.full((2,), 2.0, dtype=torch.float64))
    assert Deep.reached == [8.0] * 2000  # every level delivered d(sum(2 * Deep(2y)))/dy = 4 per element
    if how == "gpuautograd":
        s = gpuautograd.stats()
        assert not s["fallbacks"] and s["cache_hits"] >= 1998, s


def test_an_error_in_a_custom_backward_comes_out_unchanged():
    x = rand(3)
    with pytest.raises(ValueError, match="the user's backward failed"):
        gpuautograd.backward(Failing.apply(x).sum())
