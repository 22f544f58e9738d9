"""Host cost of a cache hit, per autograd node, next to eager backward of the same model.

    python -m bench.hit_path [--iters N] [--model gpt|mlp|llama|cnn] [--opaque]

Every figure comes from one run with the variants interleaved iteration by iteration, so machine
noise hits them alike; ratios are what to compare. Reported per iteration, median of N:
  eager      torch's loss.backward()
  hit        gpuautograd.backward(loss) on a cache hit (walk + key + bind + run + accumulate)
  walk+key   the part of `hit` that is not running the ops: walking the graph, building and
             hashing the key, and looking the plan up
`--opaque` passes the loss through a custom autograd.Function (an identity), so the backward has
an opaque node: what a backward that runs a custom Function's backward costs. `--graph-task-ab`
(with --opaque) measures, in alternating rounds, that backward run inside its one-node graph task
(as gpuautograd runs it) and called directly (as it ran before), to price the graph task.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import gpuautograd
from gpuautograd.runtime import engine

from .models import SUITE


class _Identity(torch.autograd.Function):
    """A custom Function: gpuautograd runs its backward as an opaque node."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _forward(model, make_batch, loss_fn, batch, opaque=False):
    torch.manual_seed(0)
    loss = loss_fn(model, *batch)
    return _Identity.apply(loss) if opaque else loss


def measure(name: str = "gpt", iters: int = 50, threads: int = 1, opaque: bool = False) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name]()
    batch = make_batch(torch.Generator().manual_seed(0))
    loss = _forward(model, make_batch, loss_fn, batch, opaque)
    num_nodes = gpuautograd.explain(loss).num_nodes
    gpuautograd.backward(loss)  # capture
    times = {"eager": [], "hit": [], "walk+key": []}
    for _ in range(iters):
        model.zero_grad(set_to_none=True)
        loss = _forward(model, make_batch, loss_fn, batch, opaque)
        t0 = time.perf_counter()
        loss.backward()
        times["eager"].append(time.perf_counter() - t0)

        model.zero_grad(set_to_none=True)
        loss = _forward(model, make_batch, loss_fn, batch, opaque)
        gc.disable()  # as engine.run does around the walk
        t0 = time.perf_counter()
        w, key, *_ = engine.prepare([loss], [torch.ones_like(loss)], [], True, None)
        hit = engine.CACHE.get(key) is not None
        times["walk+key"].append(time.perf_counter() - t0)
        gc.enable()
        assert hit, "the plan should be cached"
        del w
        t0 = time.perf_counter()
        gpuautograd.backward(loss)
        times["hit"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": name + (" + custom Function" if opaque else ""),
        "nodes": num_nodes,
        "threads": threads,
        **{f"{k}_us": v * 1e6 for k, v in med.items()},
        **{f"{k}_us_per_node": v * 1e6 / num_nodes for k, v in med.items()},
        "hit_over_eager": med["hit"] / med["eager"],
        "walk_key_over_eager": med["walk+key"] / med["eager"],
    }


def graph_task_ab(name: str, iters: int, rounds: int = 3) -> None:
    """Alternate rounds with the engine's graph task and with a direct call of the same body."""
    real = engine.graph_task.call_in_graph_task
    direct = lambda body, **kw: body()  # noqa: E731 - what the engine did before the graph task
    try:
        for _ in range(rounds):
            for how, fn in (("direct", direct), ("graph task", real)):
                engine.graph_task.call_in_graph_task = fn
                r = measure(name, iters, 1, opaque=True)
                print(f"{r['model']}, {how:>10}: eager {r['eager_us']:8.1f} us, hit {r['hit_us']:8.1f} us, {r['hit_over_eager']:.2f}x")
    finally:
        engine.graph_task.call_in_graph_task = real


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--model", default="gpt", choices=sorted(SUITE))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--opaque", action="store_true", help="pass the loss through a custom autograd.Function")
    p.add_argument("--graph-task-ab", action="store_true", help="price the graph task a backward with an opaque node runs in")
    args = p.parse_args(argv)
    if args.graph_task_ab:
        return graph_task_ab(args.model, args.iters)
    r = measure(args.model, args.iters, args.threads, args.opaque)
    print(f"model {r['model']}: {r['nodes']} autograd nodes, {r['threads']} thread(s), median of {args.iters} interleaved runs")
    print(f"{'':>10} {'us/backward':>12} {'us/node':>9} {'vs eager':>9}")
    for k in ("eager", "hit", "walk+key"):
        print(f"{k:>10} {r[k + '_us']:>12.1f} {r[k + '_us_per_node']:>9.2f} {r[k + '_us'] / r['eager_us']:>8.2f}x")
    print("(ratios are measured side by side in one run; absolute times depend on the machine)")


if __name__ == "__main__":
    main()
