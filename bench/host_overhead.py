"""Host time per autograd node on the replay path, next to eager backward, in one run.

    python -m bench.host_overhead [--device cuda|cpu] [--iters N] [--models gpt,llama,...] [--out DIR]

The host time of a backward is how long the Python call takes to return; on CUDA the GPU work is
queued, not waited for (the device is synchronized before each call, outside the timed region,
so a full launch queue never blocks the host). Variants are interleaved iteration by iteration,
so machine noise hits them alike; the figures are medians and the ratios are what to compare.

  eager      torch's loss.backward()
Each of the two walkers (the native one, the Python walk) is measured, interleaved with the rest.

  replay     gpuautograd.backward(loss) on a cache hit of the "cudagraph" backend: walk the graph,
             build the key, look the plan up, fill and upload the pointer table, replay the
             graph(s), deliver the gradients
  walk+key   the part of `replay` that walks the graph and builds and looks up the key (the
             incoming gradient is made before it is timed)

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
from gpuautograd import native
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


WALKERS = ("native", "python")


@contextlib.contextmanager
def walker_env(walker: str):
    """Run gpuautograd with `walker` ("python": GPUAUTOGRAD_NATIVE=0) inside the block."""
    before = os.environ.get("GPUAUTOGRAD_NATIVE")
    os.environ["GPUAUTOGRAD_NATIVE"] = "0" if walker == "python" else (before if before not in (None, "0") else "auto")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("GPUAUTOGRAD_NATIVE", None)
        else:
            os.environ["GPUAUTOGRAD_NATIVE"] = before


def available_walkers() -> tuple[str, ...]:
    """Both walkers where the native one builds; else the Python walk alone (said in the output)."""
    from gpuautograd import native

    with walker_env("native"):
        return WALKERS if native.load() is not None else ("python",)


def measure(name: str, device: str, iters: int, walkers=WALKERS) -> dict:
    backend = "cudagraph" if device == "cuda" else "interpret-replay"
    gpuautograd.reset()  # this model's plans alone in the cache
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name](device=device)
    batch = make_batch(torch.Generator().manual_seed(0))

    def forward():
        torch.manual_seed(0)
        return loss_fn(model, *batch)

    nodes = gpuautograd.explain(forward(), backend=backend).num_nodes
    for walker in walkers:  # each walker keys its own plan: capture, then one replay
        with walker_env(walker):
            for _ in range(2):
                gpuautograd.backward(forward(), backend=backend)
    programs = [e.compiled for e in engine.CACHE.entries.values() if isinstance(e.compiled, BoundProgram)]
    assert len(programs) == len(walkers), f"{name} on {backend} is not bound: {gpuautograd.stats()['not_graphed']}"
    left_out = contextlib.ExitStack()
    if device != "cuda":
        for program in programs:
            left_out.enter_context(_segments_left_out(program))
    times: dict[str, list[float]] = {"eager": []}
    for walker in walkers:
        times[f"replay[{walker}]"], times[f"walk+key[{walker}]"] = [], []
    with left_out:
        for _ in range(iters):
            model.zero_grad(set_to_none=True)
            loss = forward()
            _sync(device)
            t0 = time.perf_counter()
            loss.backward()
            times["eager"].append(time.perf_counter() - t0)
            for walker in walkers:
                _time_walker(walker, forward, model, device, backend, times)
    _sync(device)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": name,
        "nodes": nodes,
        "segments": len(programs[0].segments),
        "graphs": programs[0].graphs,
        "walkers": list(walkers),
        "us_per_node": {k: 1e6 * v / nodes for k, v in med.items()},
        "replay_vs_eager": {w: med[f"replay[{w}]"] / med["eager"] for w in walkers},
        "walk_key_vs_eager": {w: med[f"walk+key[{w}]"] / med["eager"] for w in walkers},
        "walk_key_share_of_replay": {w: med[f"walk+key[{w}]"] / med[f"replay[{w}]"] for w in walkers},
    }


def look_up(loss, grads, walker: str, backend: str | None = None, ext=None) -> tuple:
    """What a hit of `loss.backward()` runs before it binds, as engine.run does it with `walker`:
    (the walk, the cached entry or None, whether the native short path takes it). `ext`: the
    native extension, where the caller fetched it already (native.load())."""
    if walker == "native":
        entry, nw = engine.native_lookup(ext or native.load(), [loss], grads, True, backend)
        if entry is not None:
            return nw, entry, True
    w, key, *_ = engine.prepare([loss], grads, [], True, backend, walker)
    return w, engine.CACHE.get(key), False


def _time_walker(walker: str, forward, model, device: str, backend: str, times: dict) -> None:
    with walker_env(walker):
        model.zero_grad(set_to_none=True)
        loss = forward()
        grads = [torch.ones_like(loss)]  # the backward's prefix makes it; `replay` times that
        ext = native.load() if walker == "native" else None
        _sync(device)
        gc.disable()  # as engine.run does around the walk
        t0 = time.perf_counter()
        w, entry, _ = look_up(loss, grads, walker, backend, ext)
        times[f"walk+key[{walker}]"].append(time.perf_counter() - t0)
        gc.enable()
        assert entry is not None, f"the plan should be cached ({walker} walker)"
        del w, entry  # the walk is let go of outside the timed part, as the hit lets go of it after delivery

        # the replay on a graph of its own: the walk just made would leave this one's caches warm
        model.zero_grad(set_to_none=True)
        loss = forward()
        _sync(device)
        t0 = time.perf_counter()
        gpuautograd.backward(loss, backend=backend)
        times[f"replay[{walker}]"].append(time.perf_counter() - t0)


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
    walkers = available_walkers()
    rows = [measure(m, args.device, args.iters, walkers) for m in args.models.split(",")]
    print(f"host time per autograd node ({what}), median of {args.iters} interleaved iterations")
    if walkers != WALKERS:
        from gpuautograd import native

        print(f"(the native walker is unavailable: {native.reason()}; Python walk only)")
    header = f"{'model':8} {'nodes':>5} {'walker':>7} {'eager µs':>9} {'replay µs':>10} {'walk+key µs':>12}"
    print(f"{header} {'replay/eager':>13} {'walk+key/eager':>15}")
    for r in rows:
        u = r["us_per_node"]
        for w in walkers:
            print(
                f"{r['model']:8} {r['nodes']:5d} {w:>7} {u['eager']:9.2f} {u[f'replay[{w}]']:10.2f} {u[f'walk+key[{w}]']:12.2f}"
                f" {r['replay_vs_eager'][w]:12.2f}x {r['walk_key_vs_eager'][w]:14.3f}x"
            )
    result = {"device": args.device, "measured": what, "torch": torch.__version__, "iters": args.iters, "rows": rows}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
