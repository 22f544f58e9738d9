"""Training scenarios that every rank of a spawned process group runs: an eager DDP model and a
gpuautograd DDP model built from the same weights train side by side on the same per-rank data,
and after every backward and every optimizer step each rank compares gradients and parameters.

`worker` is the spawn target; each scenario asserts on its own rank, so a mismatch on any rank
fails the spawning test with that rank's traceback.
"""

from __future__ import annotations

import copy
import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gpuautograd
from gpuautograd.tolerances import TOLERANCES
from tests.helpers import gpuautograd_reports

DTYPE = torch.float64
D_IN = 6


class Net(nn.Module):
    """Three linear layers on the main path and one on a side branch that a step may skip."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, 16)
        self.mid = nn.Linear(16, 16)
        self.side = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x, use_side=True):
        h = torch.tanh(self.inp(x))
        h = F.gelu(self.mid(h))
        if use_side:
            h = h + torch.sigmoid(self.side(h))
        return self.out(h)


class TwoHeads(Net):
    """Returns the output and a side output; a loss may use only the first."""

    def forward(self, x, use_side=True):
        h = torch.tanh(self.inp(x))
        return self.out(F.gelu(self.mid(h))), self.side(h)


def batch(rank: int, step: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, D_IN, generator=g, dtype=DTYPE).to(device)


def assert_close(actual, expected, what: str) -> None:
    if expected is None or actual is None:
        said = {True: "None", False: "a tensor"}
        assert actual is None and expected is None, f"{what}: gpuautograd gives {said[actual is None]}, eager {said[expected is None]}"
        return
    rtol, atol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"rank {dist.get_rank()}: {what}\n{m}")


def twins(device, model_cls=Net, **ddp_kwargs):
    """(eager DDP, gpuautograd DDP, eager optimizer, gpuautograd optimizer) from one set of weights."""
    torch.manual_seed(1234)
    base = model_cls().to(device=device, dtype=DTYPE)
    device_ids = [device.index] if device.type == "cuda" else None
    eager = DDP(copy.deepcopy(base), device_ids=device_ids, **ddp_kwargs)
    ours = DDP(copy.deepcopy(base), device_ids=device_ids, **ddp_kwargs)
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    return eager, ours, opt_eager, opt_ours


def compare(eager, ours, what: str) -> None:
    for (name, pe), po in zip(eager.module.named_parameters(), ours.module.parameters()):
        assert_close(po.grad, pe.grad, f"{what}: grad of {name}")
        assert_close(po.detach(), pe.detach(), f"{what}: value of {name}")


def step_both(eager, ours, loss_fn, what: str, via_enable: bool = False) -> None:
    """One forward and backward of each model; gpuautograd's must match eager's gradients.
    `via_enable`: gpuautograd's backward is `loss.backward()` inside gpuautograd.enable()."""
    loss_fn(eager).backward()
    if via_enable:
        with gpuautograd.enable():
            loss_fn(ours).backward()
    else:
        gpuautograd.backward(loss_fn(ours))
    compare(eager, ours, what)


def assert_functional(what: str) -> None:
    s = gpuautograd.stats()
    assert not s["fallbacks"], f"{what}: gpuautograd fell back to eager: {s['fallbacks']}"
    assert s["captures"] >= 1 and s["cache_hits"] >= 1, f"{what}: expected captures and cache hits, got {s}"


def fallback_messages(fn) -> list[str]:
    """The fallback reasons `fn()` logged (to the "gpuautograd" logger) and counted in stats()."""
    before = dict(gpuautograd.stats()["fallbacks"])
    with gpuautograd_reports() as messages:
        fn()
    counted = [r for r, n in gpuautograd.stats()["fallbacks"].items() if n > before.get(r, 0)]
    logged = [m for m in messages if "falls back" in m]
    # each reason is logged once per process: a reason counted now was logged now or before
    assert len(logged) <= len(counted) and all(any(r in m for r in counted) for m in logged), (counted, logged)
    return counted


# --- supported: gpuautograd drives DDP's reducer ------------------------------------------------


def bucketed_allreduce(rank, device):
    """find_unused_parameters=False, buckets small enough that every layer gets its own."""
    eager, ours, oe, oo = twins(device, bucket_cap_mb=0.0005)
    for step in range(4):
        oe.zero_grad(set_to_none=True)
        oo.zero_grad(set_to_none=True)
        x = batch(rank, step, device)
        step_both(eager, ours, lambda m, x=x: m(x).pow(2).mean(), f"bucketed step {step}")
        oe.step()
        oo.step()
        compare(eager, ours, f"bucketed after optimizer step {step}")
    # DDP starts with one bucket and rebuilds them, in the order the first backward's hooks fired
    assert len(ours.reducer._get_zeros_like_grad_buckets()) > 1, "the scenario should have several buckets"
    assert_functional("bucketed all-reduce")


def find_unused(rank, device, world):
    """find_unused_parameters=True with the side branch used by only some ranks on some steps
    (and by none on step 3), so the reducer's all-reduced used-map decides which .grad is set."""
    eager, ours, oe, oo = twins(device, find_unused_parameters=True, bucket_cap_mb=0.0005)
    for step in range(4):
        use_side = step != 3 and (rank + step) % world == 0
        x = batch(rank, step, device)
        oe.zero_grad(set_to_none=True)
        oo.zero_grad(set_to_none=True)
        step_both(eager, ours, lambda m, x=x, use_side=use_side: m(x, use_side).pow(2).mean(), f"find_unused step {step}")
        oe.step()
        oo.step()
        compare(eager, ours, f"find_unused after optimizer step {step}")
    assert eager.module.side.weight.grad is None, "no rank used the side branch on the last step"
    assert_functional("find_unused_parameters=True")


def no_sync_accumulation(rank, device):
    """Two micro-batches accumulate locally under no_sync(), the third synchronizes all three
    (gpuautograd's backward here through `loss.backward()` inside gpuautograd.enable())."""
    eager, ours, oe, oo = twins(device)
    for step in range(2):
        oe.zero_grad(set_to_none=True)
        oo.zero_grad(set_to_none=True)
        for micro in range(2):
            x = batch(rank, 10 * step + micro, device)
            with eager.no_sync(), ours.no_sync():
                step_both(eager, ours, lambda m, x=x: m(x).pow(2).mean(), f"no_sync step {step} micro-batch {micro}", True)
        x = batch(rank, 10 * step + 2, device)
        step_both(eager, ours, lambda m, x=x: m(x).pow(2).mean(), f"synchronized step {step}", True)
        oe.step()
        oo.step()
        compare(eager, ours, f"no_sync after optimizer step {step}")
    assert_functional("no_sync")


def static_graph(rank, device):
    """static_graph=True (first iteration: delayed all-reduce from _DDPSink's callback), with the side
    branch never used, gradients as bucket views, and set_to_none=False so .grad persists."""
    eager, ours, oe, oo = twins(device, static_graph=True, gradient_as_bucket_view=True, bucket_cap_mb=0.0005)
    for step in range(4):
        oe.zero_grad(set_to_none=False)
        oo.zero_grad(set_to_none=False)
        x = batch(rank, step, device)
        step_both(eager, ours, lambda m, x=x: m(x, use_side=False).pow(2).mean(), f"static_graph step {step}")
        oe.step()
        oo.step()
        compare(eager, ours, f"static_graph after optimizer step {step}")
    assert_functional("static_graph=True")


def bf16_compress(process_group, bucket):
    """A Python comm hook: cast the bucket to bfloat16, all-reduce the mean, cast back. (torch's
    own bf16_compress_hook refuses to register without NCCL, so the CPU tests bring their own.)"""
    group = process_group if process_group is not None else dist.group.WORLD
    compressed = bucket.buffer().to(torch.bfloat16).div_(group.size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer = bucket.buffer()
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(decompress)


def comm_hooks(rank, device):
    """Gradient compression through comm hooks: a Python hook all-reducing in bfloat16, and DDP's
    built-in C++ fp16 hook. Both round the averaged gradients to their reduced dtype."""
    hooks = [
        ("bf16 Python comm hook", torch.bfloat16, lambda m: m.register_comm_hook(None, bf16_compress)),
        ("built-in fp16 comm hook", torch.float16, lambda m: m._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)),
    ]
    for name, reduced, register in hooks:
        gpuautograd.reset()
        eager, ours, oe, oo = twins(device, bucket_cap_mb=0.0005)
        register(eager)
        register(ours)
        for step in range(3):
            oe.zero_grad(set_to_none=True)
            oo.zero_grad(set_to_none=True)
            x = batch(rank, step, device)
            step_both(eager, ours, lambda m, x=x: m(x).pow(2).mean(), f"{name} step {step}")
            g = ours.module.out.weight.grad
            assert torch.equal(g, g.to(reduced).to(g.dtype)), f"{name}: gradients should be {reduced}-representable"
            oe.step()
            oo.step()
            compare(eager, ours, f"{name} after optimizer step {step}")
        assert_functional(name)


def overlap(rank, device):
    """Each bucket's all-reduce starts while the backward still runs, as in eager: a comm hook and a
    hook on the first layer's output record their order, which must be eager's, with the last
    layer's bucket launched before the first layer's gradient exists."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    eager, ours, oe, oo = twins(device, bucket_cap_mb=0.0005)
    logs = {}
    for model in (eager, ours):
        log = logs[id(model)] = []

        def launch(process_group, bucket, log=log):
            log.append("all-reduce")
            return allreduce_hook(process_group, bucket)

        def watch(module, args, out, log=log):
            out.register_hook(lambda g: log.append("first layer gradient"))

        model.register_comm_hook(None, launch)
        model.module.inp.register_forward_hook(watch)
    for step in range(3):
        for log in logs.values():
            log.clear()
        oe.zero_grad(set_to_none=True)
        oo.zero_grad(set_to_none=True)
        x = batch(rank, step, device)
        step_both(eager, ours, lambda m, x=x: m(x).pow(2).mean(), f"overlap step {step}")
        assert logs[id(ours)] == logs[id(eager)], f"step {step}: {logs[id(ours)]} where eager has {logs[id(eager)]}"
        if step > 0:  # the first backward runs one bucket; DDP rebuilds them after it
            log = logs[id(ours)]
            assert log.index("all-reduce") < log.index("first layer gradient"), log
        oe.step()
        oo.step()
        compare(eager, ours, f"overlap after optimizer step {step}")
    assert_functional("overlap")


# --- unsupported: detected, run eagerly with a warning naming the reason ------------------------


def unknown_leaves(rank, device):
    """Parameters no DDP manages, under a multi-rank process group: their AccumulateGrad nodes may
    carry C++ hooks, so backward() runs eagerly; grad(), which runs none of them, stays functional."""
    torch.manual_seed(0)
    model = Net().to(device=device, dtype=DTYPE)
    x = batch(rank, 0, device)
    messages = fallback_messages(lambda: gpuautograd.backward(model(x).sum()))
    assert any("is not a parameter of a DistributedDataParallel" in m for m in messages), messages
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    for got, want in zip(expected, (p.grad for p in model.parameters())):
        assert_close(got, want, "unknown leaves (eager fallback)")
    # grad() runs no AccumulateGrad node, eager or not, so no hook on one can be skipped: functional
    fallbacks = dict(gpuautograd.stats()["fallbacks"])
    params = list(model.parameters())
    ours = gpuautograd.grad(model(x).sum(), params)
    theirs = torch.autograd.grad(model(x).sum(), params)
    for got, want in zip(ours, theirs):
        assert_close(got, want, "grad() of unknown leaves")
    assert gpuautograd.stats()["fallbacks"] == fallbacks, "grad() should not fall back"


def unused_output(rank, device):
    """find_unused_parameters=True and a loss that ignores one of the DDP module's outputs: the
    undefined gradient through _DDPSink can't be honored functionally."""
    eager, ours, _, _ = twins(device, model_cls=TwoHeads, find_unused_parameters=True)
    x = batch(rank, 0, device)
    eager(x)[0].sum().backward()
    messages = fallback_messages(lambda: gpuautograd.backward(ours(x)[0].sum()))
    assert any("gets no gradient" in m for m in messages), messages
    compare(eager, ours, "unused DDP output (eager fallback)")
    assert ours.module.side.weight.grad is None


def _fsdp2_api():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


# FSDP2 configurations: reshard_after_forward, a bf16 MixedPrecisionPolicy (fp32 reduce), and
# gradient accumulation over micro-batches with set_requires_gradient_sync(False).
FSDP2_CONFIGS = {
    "fsdp2_reshard": dict(reshard=True),
    "fsdp2_keep": dict(reshard=False),
    "fsdp2_bf16": dict(reshard=True, bf16=True),
    "fsdp2_accumulate": dict(reshard=True, micro_batches=2),
}


def fsdp2(rank, device, reshard=True, bf16=False, micro_batches=1):
    """FSDP2 runs functionally: nested fully_shard (each layer, then the root), trained side by
    side with an eager twin over AdamW steps; every rank's gradient shards and full parameters equal
    eager's, no fallback, and the backward hits its plan from the second step on."""
    fully_shard, MixedPrecisionPolicy = _fsdp2_api()
    torch.manual_seed(1234)
    base = Net().to(device=device, dtype=DTYPE)
    kwargs = {"reshard_after_forward": reshard}
    if bf16:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    models = []
    for _ in range(2):
        model = copy.deepcopy(base)
        for layer in (model.inp, model.mid, model.side, model.out):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        models.append(model)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    rtol, atol = TOLERANCES[torch.bfloat16 if bf16 else DTYPE]

    def close(actual, expected, what):
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"rank {dist.get_rank()}: {what}\n{m}")

    what = f"FSDP2 reshard_after_forward={reshard} bf16={bf16} micro-batches={micro_batches}"
    for step in range(3):
        for opt in optimizers:
            opt.zero_grad()
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            if micro_batches > 1:
                for model in models:
                    model.set_requires_gradient_sync(last)
            x = batch(rank, 10 * step + micro, device)
            models[0](x).pow(2).mean().backward()
            with gpuautograd.enable():
                models[1](x).pow(2).mean().backward()
        for (name, pe), po in zip(models[0].named_parameters(), models[1].parameters()):
            close(po.grad.to_local(), pe.grad.to_local(), f"{what}, step {step}: grad of {name}")
        for opt in optimizers:
            opt.step()
        for (name, pe), po in zip(models[0].named_parameters(), models[1].parameters()):
            close(po.full_tensor(), pe.full_tensor(), f"{what}, step {step}: {name}")
    assert_functional(what)
    models = optimizers = None  # drop the FSDP2 modules, so that their state leaves the process
    gc.collect()


SCENARIOS = {
    "bucketed": lambda rank, world, device: bucketed_allreduce(rank, device),
    "find_unused": lambda rank, world, device: find_unused(rank, device, world),
    "no_sync": lambda rank, world, device: no_sync_accumulation(rank, device),
    "static_graph": lambda rank, world, device: static_graph(rank, device),
    "comm_hooks": lambda rank, world, device: comm_hooks(rank, device),
    "overlap": lambda rank, world, device: overlap(rank, device),
    "unknown_leaves": lambda rank, world, device: unknown_leaves(rank, device),
    "unused_output": lambda rank, world, device: unused_output(rank, device),
    **{name: (lambda rank, world, device, c=config: fsdp2(rank, device, **c)) for name, config in FSDP2_CONFIGS.items()},
}


def worker(rank: int, world: int, port: int, backend: str, names: list[str]) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        for name in names:
            gpuautograd.reset()
            SCENARIOS[name](rank, world, device)
        # no rank tears its process group down while another still talks to it (on a loaded
        # machine the ranks finish far apart, and gloo aborts a rank torn down mid-exchange)
        dist.barrier()
    finally:
        dist.destroy_process_group()
