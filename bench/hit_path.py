"""Host cost of a cache hit, per autograd node, next to eager backward of the same model.

    python -m bench.hit_path [--iters N] [--model gpt|mlp|llama|cnn|gpt-ckpt] [--json] [--phases] [--opaque] [--hooks]

Every figure comes from one run with the variants interleaved iteration by iteration, so machine
noise hits them alike; ratios are what to compare. Reported per iteration, median of N:
  eager      torch's loss.backward()
  hit        gpuautograd.backward(loss) on a cache hit (walk + key + bind + run + accumulate)
  walk+key   the part of `hit` that is not running the ops: walking the graph, building and
             hashing the key, and looking the plan up
Each of `hit` and `walk+key` is measured with the native walker and with the Python walk.
--phases splits a hit into its steps instead, in this thread's CPU time (steady when other
processes take the cores): walk+key, bind+release (the argument list, releasing the saved
tensors as eager does), run (the compiled program) and deliver (.grad accumulation), per walker.
`--opaque` passes the loss through a custom autograd.Function (an identity), so the backward has
an opaque node: what a backward that runs a custom Function's backward costs. `--graph-task-ab`
(with --opaque) measures, in alternating rounds, that backward run inside its one-node graph task
(as gpuautograd runs it) and called directly (as it ran before), to price the graph task.
`--hooks` gives every nn.Linear a module full backward hook that returns nothing (as Opacus and
Captum hang them): both backwards call them, gpuautograd's at its yield points (one eager step per
hook, and the leaves delivered at eager's point). Native walker only: without the extension a
backward with hooks runs eagerly.
`--model gpt-ckpt` is gpt with each block under non-reentrant activation checkpointing: both
backwards recompute the blocks, and gpuautograd runs the checkpointed nodes opaque.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

import gpuautograd
from gpuautograd import native
from gpuautograd.distributed import graph_task
from gpuautograd.runtime import engine

from .host_overhead import WALKERS, available_walkers, look_up, walker_env
from .models import CHECKPOINTED, SUITE

MODELS = {**SUITE, **CHECKPOINTED}


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


def _hook_every_linear(model) -> int:
    calls = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_full_backward_hook(lambda module, grad_input, grad_output: calls.append(None))
    return sum(isinstance(m, torch.nn.Linear) for m in model.modules())


def measure(name: str = "gpt", iters: int = 50, threads: int = 1, walkers=WALKERS, opaque: bool = False, hooks: bool = False) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, make_batch, loss_fn = MODELS[name]()
    hooked = _hook_every_linear(model) if hooks else 0
    if hooks:  # the Python walk's variant disables the extension, and without it hooks run eagerly
        walkers = [w for w in walkers if w == "native"]
    batch = make_batch(torch.Generator().manual_seed(0))
    loss = _forward(model, make_batch, loss_fn, batch, opaque)
    num_nodes = gpuautograd.explain(loss).num_nodes
    for walker in walkers:  # capture: each walker keys its own plan
        with walker_env(walker):
            gpuautograd.backward(_forward(model, make_batch, loss_fn, batch, opaque))
    times = {"eager": []}
    for walker in walkers:
        times[f"hit[{walker}]"], times[f"walk+key[{walker}]"] = [], []
    for _ in range(iters):
        model.zero_grad(set_to_none=True)
        loss = _forward(model, make_batch, loss_fn, batch, opaque)
        t0 = time.perf_counter()
        loss.backward()
        times["eager"].append(time.perf_counter() - t0)
        for walker in walkers:
            with walker_env(walker):
                model.zero_grad(set_to_none=True)
                loss = _forward(model, make_batch, loss_fn, batch, opaque)
                grads = [torch.ones_like(loss)]  # the backward's prefix makes it; `hit` times that
                ext = native.load() if walker == "native" else None
                gc.disable()  # as engine.run does around the walk
                t0 = time.perf_counter()
                w, entry, _ = look_up(loss, grads, walker, None, ext)
                times[f"walk+key[{walker}]"].append(time.perf_counter() - t0)
                gc.enable()
                assert entry is not None, f"the plan should be cached ({walker} walker)"
                del w, entry
                # the hit on a graph of its own: the walk just made would leave this one's caches warm
                model.zero_grad(set_to_none=True)
                loss = _forward(model, make_batch, loss_fn, batch, opaque)
                t0 = time.perf_counter()
                gpuautograd.backward(loss)
                times[f"hit[{walker}]"].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": name + (" + custom Function" if opaque else "") + (f" + {hooked} module backward hooks" if hooks else ""),
        "nodes": num_nodes,
        "threads": threads,
        "walkers": list(walkers),
        **{f"{k}_us": v * 1e6 for k, v in med.items()},
        **{f"{k}_us_per_node": v * 1e6 / num_nodes for k, v in med.items()},
        "hit_over_eager": {w: med[f"hit[{w}]"] / med["eager"] for w in walkers},
        "walk_key_over_eager": {w: med[f"walk+key[{w}]"] / med["eager"] for w in walkers},
    }


def _hit_in_phases(loss, clock, walker) -> dict:
    """One cache hit of a backward() whose sinks are leaves, as engine.run does it, timed per step."""
    t0 = clock()
    grads = [torch.ones_like(loss)]
    w, entry, short = look_up(loss, grads, walker)
    t1 = clock()
    args = w.arguments(entry.native_arguments, grads, True) if short else engine.bind(w, entry, grads, release=True)
    t2 = clock()
    with torch.no_grad():
        if entry.opaque_nodes:  # as engine.run runs a backward with opaque nodes
            outs = list(graph_task.call_in_graph_task(lambda: entry.compiled(args), accumulate=True))
            engine._release(w, entry.opaque_nodes)
        else:
            outs = list(entry.compiled(args))  # as engine._execute: the list holds the only references
    t3 = clock()
    assert all(kind == "leaf" for kind, *_ in entry.sinks), "--phases times models whose gradients all go to leaves"
    if short:
        w.deliver(entry.leaf_delivery, outs)
    else:
        engine._deliver(w, entry, outs, [], True, ())
    t4 = clock()
    return {"walk+key": t1 - t0, "bind+release": t2 - t1, "run": t3 - t2, "deliver": t4 - t3, "hit": t4 - t0}


def measure_phases(name: str = "gpt", iters: int = 100, threads: int = 1, walkers=WALKERS) -> dict:
    """Median thread CPU time (us) per phase, keyed "phase[walker]", and "eager"."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, make_batch, loss_fn = MODELS[name]()
    batch = make_batch(torch.Generator().manual_seed(0))
    for walker in walkers:  # capture: each walker keys its own plan
        with walker_env(walker):
            gpuautograd.backward(_forward(model, make_batch, loss_fn, batch))
    clock = time.thread_time
    times: dict[str, list] = {"eager": []}
    for _ in range(iters):
        model.zero_grad(set_to_none=True)
        loss = _forward(model, make_batch, loss_fn, batch)
        t0 = clock()
        loss.backward()
        times["eager"].append(clock() - t0)
        for walker in walkers:
            with walker_env(walker):
                model.zero_grad(set_to_none=True)
                loss = _forward(model, make_batch, loss_fn, batch)
                gc.disable()  # as engine.run does
                for k, v in _hit_in_phases(loss, clock, walker).items():
                    times.setdefault(f"{k}[{walker}]", []).append(v)
                gc.enable()
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def graph_task_ab(name: str, iters: int, rounds: int = 3) -> None:
    """Alternate rounds with the engine's graph task and with a direct call of the same body."""
    real = engine.graph_task.call_in_graph_task
    direct = lambda body, **kw: body()  # noqa: E731 - what the engine did before the graph task
    try:
        for _ in range(rounds):
            for how, fn in (("direct", direct), ("graph task", real)):
                engine.graph_task.call_in_graph_task = fn
                r = measure(name, iters, 1, available_walkers(), opaque=True)
                ratios = ", ".join(f"{w} {x:.2f}x" for w, x in r["hit_over_eager"].items())
                print(f"{r['model']}, {how:>10}: eager {r['eager_us']:8.1f} us, hit/eager {ratios}")
    finally:
        engine.graph_task.call_in_graph_task = real


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--model", default="gpt", choices=sorted(MODELS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    p.add_argument("--phases", action="store_true", help="split a hit into its steps, in thread CPU time")
    p.add_argument("--opaque", action="store_true", help="pass the loss through a custom autograd.Function")
    p.add_argument("--graph-task-ab", action="store_true", help="price the graph task a backward with an opaque node runs in")
    p.add_argument("--hooks", action="store_true", help="a module full backward hook on every nn.Linear")
    args = p.parse_args(argv)
    if args.graph_task_ab:
        return graph_task_ab(args.model, args.iters)
    if args.phases:
        med = measure_phases(args.model, args.iters, args.threads, available_walkers())
        print(f"model {args.model}: thread CPU time, median of {args.iters} interleaved runs")
        for k, v in med.items():
            print(f"{k:>22} {v:>10.1f} us {v / med['eager']:>6.2f}x eager")
        if args.json:
            print(json.dumps(med))
        return
    r = measure(args.model, args.iters, args.threads, available_walkers(), args.opaque, args.hooks)
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
