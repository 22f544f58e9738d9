"""Host time per autograd node on the replay path, next to eager backward, in one run.

    python -m bench.host_overhead [--device cuda|cpu] [--iters N] [--models gpt,llama,...] [--out DIR]

The host time of a backward is how long the Python call takes to return; on CUDA the GPU work is
queued, not waited for (the device is synchronized before each call, outside the timed region,
so a full launch queue never blocks the host). Variants are interleaved iteration by iteration,
so machine noise hits them alike; the figures are medians and the ratios are what to compare.

  eager      torch's loss.backward()
  replay     gpuautograd.backward(loss) on a cache hit of the "cudagraph" backend: walk the graph,
             build the key, look the plan up, fill and upload the pointer table, replay the
             graph(s), deliver the gradients
  walk+key   the part of `replay` that walks the graph and builds and looks up the key

On a machine without CUDA the graphs can't be replayed. The CPU run then measures the same path
on the "interpret-replay" backend with each segment's work left out (on CUDA that work is one
graph launch per segment); its eager column includes eager's CPU compute, so its ratio is a
bound on the bookkeeping, not the GPU figure. The JSON says which was measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time

import torch

import gpuautograd
from gpuautograd.runtime import engine
from gpuautograd.runtime.bound import Segment
from gpuautograd.runtime.replay import BoundProgram

from .models import SUITE

MODELS = ("gpt", "llama", "mlp", "cnn")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def _segments_left_out(program: BoundProgram):
    """CPU only: skip the interpreter's kernel work so what is timed is the replay's bookkeeping."""
    saved = {s.name: program.env[s.name] for s in program.schedule if isinstance(s, Segment)}
    for name in saved:
        program.env[name] = lambda: None
    try:
        yield
    finally:
        program.env.update(saved)


def measure(name: str, device: str, iters: int) -> dict:
    backend = "cudagraph" if device == "cuda" else "interpret-replay"
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name](device=device)
    batch = make_batch(torch.Generator().manual_seed(0))

    def forward():
        torch.manual_seed(0)
        return loss_fn(model, *batch)

    nodes = gpuautograd.explain(forward(), backend=backend).num_nodes
    for _ in range(2):  # capture, then one replay
        gpuautograd.backward(forward(), backend=backend)
    program = list(engine.CACHE.entries.values())[-1].compiled  # the most recently used plan
    assert isinstance(program, BoundProgram), f"{name} on {backend} is not bound: {gpuautograd.stats()['not_graphed']}"
    left_out = _segments_left_out(program) if device != "cuda" else contextlib.nullcontext()
    times: dict[str, list[float]] = {"eager": [], "replay": [], "walk+key": []}
    with left_out:
        for _ in range(iters):
            model.zero_grad(set_to_none=True)
            loss = forward()
            _sync(device)
            t0 = time.perf_counter()
            loss.backward()
            times["eager"].append(time.perf_counter() - t0)

            model.zero_grad(set_to_none=True)
            loss = forward()
            _sync(device)
            gc.disable()  # as engine.run does around the walk
            t0 = time.perf_counter()
            engine.prepare([loss], [torch.ones_like(loss)], [], True, backend)
            times["walk+key"].append(time.perf_counter() - t0)
            gc.enable()

            model.zero_grad(set_to_none=True)
            _sync(device)
            t0 = time.perf_counter()
            gpuautograd.backward(loss, backend=backend)
            times["replay"].append(time.perf_counter() - t0)
    _sync(device)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": name,
        "nodes": nodes,
        "segments": len(program.segments),
        "graphs": program.graphs,
        "us_per_node": {k: 1e6 * v / nodes for k, v in med.items()},
        "replay_vs_eager": med["replay"] / med["eager"],
        "walk_key_share_of_replay": med["walk+key"] / med["replay"],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default=None, help="directory for host_overhead.json")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    what = (
        "CUDA graph replay, host time per call"
        if args.device == "cuda"
        else "CPU: interpret-replay bookkeeping with segment work left out; eager includes CPU compute"
    )
    rows = [measure(m, args.device, args.iters) for m in args.models.split(",")]
    print(f"host time per autograd node ({what}), median of {args.iters} interleaved iterations")
    print(f"{'model':8} {'nodes':>5} {'eager µs':>9} {'replay µs':>10} {'walk+key µs':>12} {'replay/eager':>13}")
    for r in rows:
        u = r["us_per_node"]
        print(f"{r['model']:8} {r['nodes']:5d} {u['eager']:9.2f} {u['replay']:10.2f} {u['walk+key']:12.2f} {r['replay_vs_eager']:12.2f}x")
    result = {"device": args.device, "measured": what, "torch": torch.__version__, "iters": args.iters, "rows": rows}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
