"""The main job: train a small GPT-style model with gpuautograd.backward.

    python -m bench.demo [--steps N] [--device cpu|cuda]

1. checks the first step's gradients against torch.autograd (gpuautograd.validate); on the CPU
   also those of the fused plan in Triton's interpreter, first as launched and then bound through
   the pointer table and replayed, as the "cudagraph" backend runs it on a GPU;
2. trains for a few steps with gpuautograd.backward and AdamW, printing the loss;
3. times the backward of gpuautograd and of eager torch side by side, interleaved in one run;
4. prints the cache stats (captures, hits, misses with their reason, fallbacks).
Runs on the CPU when there is no GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gpuautograd

from .models import make_gpt


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default=None, help="gpuautograd backend (default: GPUAUTOGRAD_BACKEND or auto)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model, _, loss_fn = make_gpt(device=device, batch=4, seq=32, d_model=64, n_layers=2)
    gen = torch.Generator().manual_seed(0)

    def make_batch(g):
        # A learnable language: each token is the previous one plus a per-sequence stride.
        start = torch.randint(0, 96, (4, 1), generator=g)
        stride = torch.randint(1, 4, (4, 1), generator=g)
        seq = (start + stride * torch.arange(33)) % 96
        return seq[:, :-1].to(device), seq[:, 1:].to(device)

    print(f"gpuautograd demo: tiny GPT ({sum(p.numel() for p in model.parameters()):,} parameters) on {device}")

    # 1. The first step's gradients against torch.autograd, on the very same graph.
    batch = make_batch(gen)
    rows = gpuautograd.validate(loss_fn(model, *batch), backend=args.backend)
    worst = max(rows, key=lambda r: r.max_abs)
    print(f"step 0: {len(rows)} parameter gradients match torch.autograd (worst max abs error {worst.max_abs:.2e})")
    report = gpuautograd.explain(loss_fn(model, *batch))
    opaque = report.opaque_nodes or "none"
    print(f"captured program: {report.num_nodes} autograd nodes -> {report.program.num_ops()} IR ops, opaque nodes: {opaque}")
    fused_backend = "cudagraph" if device.type == "cuda" else "interpret"
    fused = gpuautograd.explain(loss_fn(model, *batch), backend=fused_backend)
    kernels = len(fused.kernels)
    print(f"fused plan ({fused_backend}): {kernels} generated Triton kernels + library calls = {fused.launches} launches; {fused.memory}")
    if device.type == "cpu":  # the same kernels, run once in Triton's interpreter, against torch.autograd
        rows = gpuautograd.validate(loss_fn(model, *batch), backend="interpret")
        worst = max(r.max_abs for r in rows)
        print(f"         its kernels in Triton's interpreter: {len(rows)} gradients match torch.autograd (worst {worst:.2e})")
        # the plan bound through the pointer table, as "cudagraph" captures it: a first call, then
        # a replay on another batch (new tensors at new addresses)
        for _ in range(2):
            rows = gpuautograd.validate(loss_fn(model, *make_batch(gen)), backend="interpret-replay")
        worst = max(r.max_abs for r in rows)
        replays = gpuautograd.stats()["replays"]
        print(f"         bound through the pointer table and replayed ({replays} replay): {len(rows)} gradients match (worst {worst:.2e})")

    # 2. Train.
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(1, args.steps + 1):
        loss = loss_fn(model, *make_batch(gen))
        gpuautograd.backward(loss, backend=args.backend)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 1 or step % 5 == 0 or step == args.steps:
            print(f"step {step:>3}: loss {loss.item():.4f}")

    # 3. Backward time, side by side: the same forward, eager then gpuautograd, interleaved.
    times = {"eager": [], "gpuautograd": []}
    for _ in range(15):
        for mode in times:
            loss = loss_fn(model, *batch)
            _sync(device)
            t0 = time.perf_counter()
            if mode == "eager":
                loss.backward()
            else:
                gpuautograd.backward(loss, backend=args.backend)
            _sync(device)
            times[mode].append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    eager, ours = (statistics.median(times[m]) * 1e3 for m in ("eager", "gpuautograd"))
    print(f"backward, median of 15 interleaved runs: eager {eager:.2f} ms, gpuautograd {ours:.2f} ms ({eager / ours:.2f}x eager's speed)")

    # 4. Cache stats.
    s = gpuautograd.stats()
    print(f"stats: captures {s['captures']}, cache hits {s['cache_hits']}, misses {s['cache_misses']} {s['miss_reasons']}")
    print(f"       fallbacks to eager: {s['fallbacks'] or 'none'}")

    # 5. What the time figure means.
    if device.type == "cpu" and (args.backend or "auto") in ("auto", "reference"):
        walker = "C++" if gpuautograd.stats()["walker"] == "native" else "Python"
        print(
            f"what this means: on the CPU gpuautograd runs its reference executor (a {walker} walk of the graph, then one\n"
            f"  aten kernel per IR op); {eager / ours:.2f}x is that fallback's speed, not the GPU path's. On a GPU the same\n"
            f"  backward is {kernels} generated kernels plus library calls ({fused.launches} launches), replayed as a CUDA graph:\n"
            f"  not measured here."
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
