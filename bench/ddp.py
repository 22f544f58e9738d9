"""DistributedDataParallel step time: eager DDP against DDP with gpuautograd, side by side.

    python -m bench.ddp [--world 2] [--model gpt] [--d-model 64] [--layers 2] [--iters 50] [--device cpu|cuda]

Spawns `world` ranks on loopback (gloo on CPU; on CUDA, NCCL when every rank has its own GPU,
else gloo). Every rank trains one DDP-wrapped model of the suite and rotates, iteration by
iteration, through the variants, so machine noise hits them alike. A step is zero_grad, forward,
backward, SGD step; `bwd` is the backward call alone (for DDP it returns after the reducer wrote
the averaged gradients). Every step starts on a barrier and lasts until its slowest rank is done;
reported are the medians of those times and each variant's over eager's.

  eager          DDP forward, loss.backward(): DDP's reducer runs from its C++ hooks
  gpuautograd    DDP forward, gpuautograd.backward(loss): the functional backward accumulates,
                 then drives DDP's reducer (its per-parameter hooks, in eager's order)
  own-allreduce  the alternative design, measured to choose between the two: the functional
                 backward on the bare module, then gpuautograd's own bucketed all-reduce of the
                 .grad tensors through torch.distributed (no reducer, no comm hooks)

Before timing, each rank checks that both gpuautograd variants give eager DDP's gradients.

`--fsdp2` times FSDP2 instead: two copies of the model, each under `fully_shard` (each block of
a ModuleList and every other child module with parameters, then the root; `--reshard` sets reshard_after_forward), one trained with
`loss.backward()` and one inside `gpuautograd.enable()`, interleaved the same way, SGD steps.
Before timing, the first step's gradient shards of the two are compared.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gpuautograd.tolerances import TOLERANCES

from .models import SUITE

VARIANTS = ("eager", "gpuautograd", "own-allreduce")
BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def own_allreduce(params, world: int) -> None:
    """Average the .grad of `params` across ranks: flat buckets of up to BUCKET_BYTES in reverse
    parameter order (DDP's guess at gradient-ready order), all launched, then waited and copied back."""
    grads = [p.grad for p in reversed(params) if p.grad is not None]
    buckets, current, size = [], [], 0
    for g in grads:
        if current and size + g.numel() * g.element_size() > BUCKET_BYTES:
            buckets.append(current)
            current, size = [], 0
        current.append(g)
        size += g.numel() * g.element_size()
    if current:
        buckets.append(current)
    pending = []
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket]).div_(world)
        pending.append((dist.all_reduce(flat, async_op=True), flat, bucket))
    for work, flat, bucket in pending:
        work.wait()
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _forward(variant, ddp, loss_fn, batch):
    return loss_fn(ddp.module if variant == "own-allreduce" else ddp, *batch)


def _backward(variant, loss, ddp, world) -> None:
    import gpuautograd

    if variant == "eager":
        loss.backward()
    else:
        gpuautograd.backward(loss)
    if variant == "own-allreduce":
        own_allreduce(list(ddp.module.parameters()), world)


def _check_gradients(ddp, loss_fn, batch, world, device) -> None:
    """Each gpuautograd variant, from the same weights and batch, gives eager DDP's gradients."""
    from gpuautograd.tolerances import TOLERANCES

    params = list(ddp.module.parameters())
    start = [p.detach().clone() for p in params]
    grads = {}
    for variant in VARIANTS:
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
        ddp.zero_grad(set_to_none=True)
        torch.manual_seed(0)  # the same dropout masks
        _backward(variant, _forward(variant, ddp, loss_fn, batch), ddp, world)
        _sync(device)
        grads[variant] = [p.grad.clone() for p in params]
    for variant in VARIANTS[1:]:
        for k, (a, e) in enumerate(zip(grads[variant], grads["eager"])):
            rtol, atol = TOLERANCES[e.dtype]
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m, k=k, v=variant: f"{v}: gradient {k}\n{m}")


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl" if torch.cuda.device_count() >= world else "gloo"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gpuautograd

    torch.manual_seed(0)
    size = {k: v for k, v in (("d_model", args.d_model), ("n_layers", args.layers)) if v is not None}
    model, make_batch, loss_fn = SUITE[args.model](device=device, **size)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    batch = make_batch(torch.Generator().manual_seed(rank))
    _check_gradients(ddp, loss_fn, batch, world, device)
    for variant in VARIANTS:  # warm up: captures, bucket rebuild, allocator
        for _ in range(2):
            ddp.zero_grad(set_to_none=True)
            _backward(variant, _forward(variant, ddp, loss_fn, batch), ddp, world)
            opt.step()
    gpuautograd.reset()
    step = {v: [] for v in VARIANTS}
    bwd = {v: [] for v in VARIANTS}
    for _ in range(args.iters):
        for variant in VARIANTS:
            _sync(device)
            dist.barrier()  # every rank starts the step together: a step lasts until its slowest rank is done
            t0 = time.perf_counter()
            ddp.zero_grad(set_to_none=True)
            loss = _forward(variant, ddp, loss_fn, batch)
            _sync(device)
            t1 = time.perf_counter()
            _backward(variant, loss, ddp, world)
            _sync(device)
            t2 = time.perf_counter()
            opt.step()
            _sync(device)
            t3 = time.perf_counter()
            step[variant].append(t3 - t0)
            bwd[variant].append(t2 - t1)
    n_params = sum(p.numel() for p in model.parameters())
    title = (
        f"DDP step time: model {args.model} ({n_params:,} parameters, {str(next(model.parameters()).dtype)[6:]}), "
        f"{world} ranks, {backend} on {device.type}, {args.threads} thread(s) per rank"
    )
    _report(rank, world, step, bwd, args.iters, title)
    dist.destroy_process_group()


def _report(rank: int, world: int, step: dict, bwd: dict, iters: int, title: str, note: str = "") -> None:
    """Gather every rank's times (after checking this rank never fell back) and print, on rank 0,
    the median over iterations of the slowest rank's time, per variant and over eager's."""
    import gpuautograd

    stats = gpuautograd.stats()
    assert not stats["fallbacks"], f"gpuautograd fell back to eager: {stats['fallbacks']}"
    gathered = [None] * world
    dist.all_gather_object(gathered, (step, bwd))
    if rank != 0:
        return
    # The job's step time is its slowest rank's: per iteration, the maximum over ranks.
    med = {v: tuple(statistics.median(max(g[j][v][i] for g in gathered) for i in range(iters)) for j in (0, 1)) for v in step}
    print(title)
    print(f"median over {iters} interleaved iterations of the slowest rank's time{note}")
    print(f"{'variant':>14} {'step ms':>9} {'bwd ms':>9} {'step vs eager':>14} {'bwd vs eager':>13}")
    for v, (st, b) in med.items():
        print(f"{v:>14} {st * 1e3:>9.2f} {b * 1e3:>9.2f} {st / med['eager'][0]:>13.2f}x {b / med['eager'][1]:>12.2f}x")
    print("(ratios are measured side by side in one run; absolute times depend on the machine)")


def _fsdp2_worker(rank: int, world: int, port: int, args) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(args.threads)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    from torch.distributed.fsdp import fully_shard

    import gpuautograd

    size = {k: v for k, v in (("d_model", args.d_model), ("n_layers", args.layers)) if v is not None}
    models, opts = {}, {}
    for variant in ("eager", "gpuautograd"):
        torch.manual_seed(0)
        model, make_batch, loss_fn = SUITE[args.model](device=device, **size)
        for child in model.children():  # each block of a ModuleList, every other child with parameters
            units = list(child.children()) if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)) else [child]
            for unit in units:
                if any(True for _ in unit.parameters()):
                    fully_shard(unit, reshard_after_forward=args.reshard)
        fully_shard(model, reshard_after_forward=args.reshard)
        models[variant], opts[variant] = model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    batch = make_batch(torch.Generator().manual_seed(rank))

    def backward(variant, loss):
        if variant == "eager":
            loss.backward()
        else:
            with gpuautograd.enable():
                loss.backward()

    grads = {}
    for variant, model in models.items():
        model.zero_grad(set_to_none=True)
        backward(variant, loss_fn(model, *batch))
        grads[variant] = [p.grad.to_local().clone() for p in model.parameters()]
    rtol, atol = TOLERANCES[next(models["eager"].parameters()).dtype]
    for k, (a, e) in enumerate(zip(grads["gpuautograd"], grads["eager"])):
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m, k=k: f"FSDP2 gradient shard {k}\n{m}")
    gpuautograd.reset()
    step = {v: [] for v in models}
    bwd = {v: [] for v in models}
    for it in range(args.iters + 2):  # two warm-up iterations: captures, allocator
        for variant, model in models.items():
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, *batch)
            _sync(device)
            t1 = time.perf_counter()
            backward(variant, loss)
            _sync(device)
            t2 = time.perf_counter()
            opts[variant].step()
            _sync(device)
            if it >= 2:
                step[variant].append(time.perf_counter() - t0)
                bwd[variant].append(t2 - t1)
    n_params = sum(p.numel() for p in models["eager"].parameters())
    title = f"FSDP2 step time: model {args.model} ({n_params:,} parameters), {world} ranks, reshard_after_forward={args.reshard}"
    _report(rank, world, step, bwd, args.iters, title, f"; plan hits: {gpuautograd.stats()['cache_hits']}")
    models = opts = None  # FSDP2's state goes before its process group does
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", default="gpt", choices=sorted(SUITE))
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--d-model", type=int, default=None, help="width of the gpt / llama models (default: the suite's)")
    p.add_argument("--layers", type=int, default=None, help="blocks of the gpt model (default: the suite's)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--fsdp2", action="store_true", help="time FSDP2 (fully_shard) instead of DDP")
    p.add_argument("--reshard", action="store_true", help="with --fsdp2: reshard_after_forward=True")
    args = p.parse_args(argv)
    worker = _fsdp2_worker if args.fsdp2 else _worker
    mp.spawn(worker, args=(args.world, _free_port(), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
