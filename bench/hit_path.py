"""Host cost of a cache hit, per autograd node, next to eager backward of the same model.

    python -m bench.hit_path [--iters N] [--model gpt|mlp|llama|cnn] [--json]

Every figure comes from one run with the variants interleaved iteration by iteration, so machine
noise hits them alike; ratios are what to compare. Reported per iteration, median of N:
  eager      torch's loss.backward()
  hit        gpuautograd.backward(loss) on a cache hit (walk + key + bind + run + accumulate)
  walk+key   the part of `hit` that is not running the ops: walking the graph, building and
             hashing the key, and looking the plan up
Each of `hit` and `walk+key` is measured with the native walker and with the Python walk.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

import gpuautograd
from gpuautograd.runtime import engine

from .host_overhead import WALKERS, available_walkers, walker_env
from .models import SUITE


def _forward(model, make_batch, loss_fn, batch):
    torch.manual_seed(0)
    return loss_fn(model, *batch)


def measure(name: str = "gpt", iters: int = 50, threads: int = 1, walkers=WALKERS) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name]()
    batch = make_batch(torch.Generator().manual_seed(0))
    loss = _forward(model, make_batch, loss_fn, batch)
    num_nodes = gpuautograd.explain(loss).num_nodes
    for walker in walkers:  # capture: each walker keys its own plan
        with walker_env(walker):
            gpuautograd.backward(_forward(model, make_batch, loss_fn, batch))
    times = {"eager": []}
    for walker in walkers:
        times[f"hit[{walker}]"], times[f"walk+key[{walker}]"] = [], []
    for _ in range(iters):
        model.zero_grad(set_to_none=True)
        loss = _forward(model, make_batch, loss_fn, batch)
        t0 = time.perf_counter()
        loss.backward()
        times["eager"].append(time.perf_counter() - t0)
        for walker in walkers:
            with walker_env(walker):
                model.zero_grad(set_to_none=True)
                loss = _forward(model, make_batch, loss_fn, batch)
                gc.disable()  # as engine.run does around the walk
                t0 = time.perf_counter()
                w, key, *_ = engine.prepare([loss], [torch.ones_like(loss)], [], True, None, walker)
                hit = engine.CACHE.get(key) is not None
                times[f"walk+key[{walker}]"].append(time.perf_counter() - t0)
                gc.enable()
                assert hit, f"the plan should be cached ({walker} walker)"
                del w
                t0 = time.perf_counter()
                gpuautograd.backward(loss)
                times[f"hit[{walker}]"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": name,
        "nodes": num_nodes,
        "threads": threads,
        "walkers": list(walkers),
        **{f"{k}_us": v * 1e6 for k, v in med.items()},
        **{f"{k}_us_per_node": v * 1e6 / num_nodes for k, v in med.items()},
        "hit_over_eager": {w: med[f"hit[{w}]"] / med["eager"] for w in walkers},
        "walk_key_over_eager": {w: med[f"walk+key[{w}]"] / med["eager"] for w in walkers},
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--model", default="gpt", choices=sorted(SUITE))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = p.parse_args(argv)
    r = measure(args.model, args.iters, args.threads, available_walkers())
    print(f"model {r['model']}: {r['nodes']} autograd nodes, {r['threads']} thread(s), median of {args.iters} interleaved runs")
    print(f"{'':>16} {'us/backward':>12} {'us/node':>9} {'vs eager':>9}")
    rows = ["eager"] + [f"{k}[{w}]" for w in r["walkers"] for k in ("hit", "walk+key")]
    for k in rows:
        print(f"{k:>16} {r[k + '_us']:>12.1f} {r[k + '_us_per_node']:>9.2f} {r[k + '_us'] / r['eager_us']:>8.3f}x")
    if args.json:
        print(json.dumps(r))
    print("(ratios are measured side by side in one run; absolute times depend on the machine)")


if __name__ == "__main__":
    main()
