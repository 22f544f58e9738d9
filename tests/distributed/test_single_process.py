"""The distributed integration's parts in one process: the graph-task runner, the DDP registry,
and DDP on a process group of one rank (where DDP still runs its reducer and comm hooks)."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.distributed as dist

import gpuautograd
from gpuautograd.distributed import graph_task, registry

from .scenarios import DTYPE, Net, batch, bf16_compress, compare, twins

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is unavailable"
)


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_process_group_check_reads_what_is_initialized_says():
    """distributed.active() reads the default group's field directly (a frame per read less than
    torch.distributed.is_initialized()); both must agree before, during and after a group."""
    from gpuautograd import distributed

    assert distributed._READ_WORLD  # this torch has the field; else is_initialized() runs
    assert distributed.active() is dist.is_initialized() is False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert distributed.active() is dist.is_initialized() is True
    finally:
        dist.destroy_process_group()
    assert distributed.active() is dist.is_initialized() is False


def test_graph_task_runs_body_then_queued_callbacks_and_returns_its_result():
    order = []

    def body():
        torch.autograd.Variable._execution_engine.queue_callback(lambda: order.append("callback"))
        order.append("body")
        return 42

    assert graph_task.call_in_graph_task(body) == 42
    assert order == ["body", "callback"]
    with torch.no_grad():  # a backward may be called with grad mode off; the one-node graph is built anyway
        assert graph_task.call_in_graph_task(body) == 42
    assert order == ["body", "callback"] * 2


def test_graph_task_passes_exceptions_through_unchanged():
    class Marker(Exception):
        pass

    def body():
        raise Marker("from inside the graph task")

    with pytest.raises(Marker, match="from inside the graph task"):
        graph_task.call_in_graph_task(body)


def test_registry_maps_parameters_to_reducer_indices_and_forgets_the_module(world_of_one):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = Net().to(DTYPE)
    model.side.bias.requires_grad_(False)  # not in the reducer
    ddp = DDP(model)
    params = [p for p in model.parameters() if p.requires_grad]
    for k, p in enumerate(params):
        (owner, _rec, index) = registry.owners(p)[0]
        assert owner is ddp and index == k
    assert registry.owners(model.side.bias) == []
    del ddp, owner, _rec
    gc.collect()
    assert all(registry.owners(p) == [] for p in params)


def test_ddp_on_one_rank_runs_its_comm_hook_functionally(world_of_one):
    """With one rank DDP still buckets and calls its comm hook; bf16 compression changes the
    gradients, so skipping the reducer would show."""
    eager, ours, opt_eager, opt_ours = twins(torch.device("cpu"))
    eager.register_comm_hook(None, bf16_compress)
    ours.register_comm_hook(None, bf16_compress)
    for step in range(3):
        x = batch(0, step, "cpu")
        opt_eager.zero_grad(set_to_none=True)
        opt_ours.zero_grad(set_to_none=True)
        eager(x).pow(2).mean().backward()
        gpuautograd.backward(ours(x).pow(2).mean())
        compare(eager, ours, f"step {step}")
        g = ours.module.mid.weight.grad
        assert torch.equal(g, g.bfloat16().to(g.dtype))
        opt_eager.step()
        opt_ours.step()
    s = gpuautograd.stats()
    assert not s["fallbacks"] and s["captures"] == 1 and s["cache_hits"] == 2, s


def test_removed_reducer_hooks_are_not_fired(world_of_one):
    """After ddp._remove_autograd_hooks() eager accumulates plain local gradients; so must we."""
    eager, ours, _, _ = twins(torch.device("cpu"))
    for m in (eager, ours):
        m.register_comm_hook(None, bf16_compress)
        m._remove_autograd_hooks()
    x = batch(0, 0, "cpu")
    eager(x).pow(2).mean().backward()
    gpuautograd.backward(ours(x).pow(2).mean())
    compare(eager, ours, "hooks removed")
    g = ours.module.mid.weight.grad
    assert not torch.equal(g, g.bfloat16().to(g.dtype)), "no comm hook should have rounded the gradient"
    assert not gpuautograd.stats()["fallbacks"]


def test_one_rank_without_ddp_runs_functionally(world_of_one):
    model = Net().to(DTYPE)
    x = batch(0, 0, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gpuautograd.backward(model(x).sum())
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    for a, e in zip(ours, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, e)
    assert gpuautograd.stats()["captures"] == 1


def test_a_ddp_module_the_registry_missed_runs_eagerly_with_its_hooks(world_of_one, monkeypatch):
    """A DDP built while gpuautograd's registry wasn't watching (as one built before the import):
    the AccumulateGrad nodes themselves show the reducer's hooks, so the backward runs eagerly and
    the comm hook still shapes the gradients."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gpuautograd import native

    if native.load() is None:
        pytest.skip(f"the hook count needs the native extension: {native.reason()}")
    unwatched = DDP._ddp_init_helper.__wrapped__
    eager, _, _, _ = twins(torch.device("cpu"))
    monkeypatch.setattr(DDP, "_ddp_init_helper", unwatched)
    _, ours, _, _ = twins(torch.device("cpu"))
    monkeypatch.undo()
    assert all(registry.owners(p) == [] for p in ours.parameters())
    for m in (eager, ours):
        m.register_comm_hook(None, bf16_compress)
    x = batch(0, 0, "cpu")
    eager(x).pow(2).mean().backward()
    gpuautograd.backward(ours(x).pow(2).mean())
    compare(eager, ours, "unrecorded DDP")
    g = ours.module.mid.weight.grad
    assert torch.equal(g, g.bfloat16().to(g.dtype)), "the comm hook must have run"
    (reason,) = gpuautograd.stats()["fallbacks"]
    assert "post hook(s) where gpuautograd knows of 0" in reason, reason
