"""Memory of one backward: the peak during it, what the plan keeps resident, and the saved
activations left alive after it, for eager torch and each backend side by side.

    python -m bench.memory [--device cpu|cuda] [--backends a,b] [--models a,b] [--out DIR]

For each suite model and backend, after a warm-up (the plan is captured and has run once):
- peak: the most bytes allocated at once during one backward, above what was allocated before it.
  On CUDA the allocator's own peak (`max_memory_allocated`); on the CPU the running total of the
  profiler's allocation events (`profile_memory=True`), with GPUAUTOGRAD_WHEN_OBSERVED=functional
  so that the profiler does not send the backward to eager autograd.
- resident: what the cached plan keeps allocated between calls (`stats()["resident_bytes"]`),
  allocated before the measured backward, so it is not part of its peak.
- the check: backend peak <= eager peak + resident (a plan may hold its intermediates in its
  arena instead of allocating them, but must not need more than eager besides what it keeps).
- retained: bytes of saved activations still alive after the backward while `loss` is held.
  Eager releases every executed node's saved tensors, and gpuautograd must too.
Writes DIR/memory.json with one row per model and backend.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef

import gpuautograd
from gpuautograd.capture.walk import walk

from .counting import observed_functional
from .models import SUITE

BACKENDS = {"cpu": ("eager", "reference", "interpret-replay"), "cuda": ("eager", "triton", "cudagraph")}
# The check gates the backends that run a memory plan (an arena, by liveness). "reference" is the
# validation executor: it runs each op in torch and plans no memory, so its row is a figure only.
UNPLANNED = ("eager", "reference")
WARM_UP = 2  # captures the plan, then its first call (warm-up, graph capture): the third is steady


def _saved_activations(loss, held: set[int]) -> list[tuple[StorageWeakRef, int]]:
    """Weak references to the storages the graph saved, except those of parameters and inputs."""
    seen, out = set(), []
    for t in walk([loss.grad_fn]).saved:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or key in held or storage.nbytes() == 0:
            continue
        seen.add(key)
        out.append((StorageWeakRef(storage), storage.nbytes()))
    return out


def cpu_allocations(fn) -> tuple[int, int]:
    """(peak, net) bytes of CPU tensor memory while `fn()` runs, above what was allocated before:
    the profiler's allocation (+) and free (-) events summed in order."""
    with observed_functional():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    # the raw allocation events, in time order (FunctionEvents attribute them to the ops around them)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    running = peak = 0
    for _, n in events:
        running += n
        peak = max(peak, running)
    return peak, running


def cuda_peak(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def run_backward(loss, backend: str) -> None:
    if backend == "eager":
        loss.backward()
    else:
        gpuautograd.backward(loss, backend=backend)


def measure(name: str, device: str, backend: str) -> dict:
    """One backward of suite model `name` on `backend`, after the warm-up."""
    torch.manual_seed(0)
    model, make_batch, loss_fn = SUITE[name](device=device)
    batch = make_batch(torch.Generator().manual_seed(0))
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    held |= {x.untyped_storage().data_ptr() for x in batch if isinstance(x, torch.Tensor)}
    gpuautograd.reset()  # one cached plan: the resident bytes are this backend's plan's
    for _ in range(WARM_UP):
        model.zero_grad(set_to_none=True)
        run_backward(loss_fn(model, *batch), backend)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = loss_fn(model, *batch)
    refs = _saved_activations(loss, held)
    if device == "cuda":
        peak = cuda_peak(functools.partial(run_backward, loss, backend))
    else:
        peak, _ = cpu_allocations(functools.partial(run_backward, loss, backend))
    stats = gpuautograd.stats()
    row = {
        "model": name,
        "device": device,
        "backend": backend,
        "peak_bytes": peak,
        "resident_bytes": 0 if backend == "eager" else stats["resident_bytes"],
        "saved_bytes": sum(n for _, n in refs),
        "retained_bytes": sum(n for ref, n in refs if not ref.expired()),
    }
    if backend != "eager":
        row["fallbacks"] = sum(stats["fallbacks"].values())
    del loss
    gpuautograd.reset()
    return row


def measure_model(name: str, device: str, backends) -> list[dict]:
    """Rows for `name`, each backend's with the check against eager's peak (eager runs first)."""
    rows = [measure(name, device, b) for b in ("eager", *(b for b in backends if b != "eager"))]
    eager = rows[0]
    for r in rows:
        r["eager_peak_bytes"] = eager["peak_bytes"]
        r["peak_within_eager_plus_resident"] = r["peak_bytes"] <= eager["peak_bytes"] + r["resident_bytes"]
        r["frees_like_eager"] = r["retained_bytes"] <= eager["retained_bytes"]
        r["gated"] = r["backend"] not in UNPLANNED
    return rows if "eager" in backends else rows[1:]


def _passes(row: dict) -> bool:
    return row["peak_within_eager_plus_resident"] and row["frees_like_eager"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--backends", help="comma-separated (default: eager and the device's backends)")
    p.add_argument("--models", help="comma-separated suite models (default: all)")
    p.add_argument("--out", help="directory for memory.json")
    args = p.parse_args(argv)
    backends = args.backends.split(",") if args.backends else list(BACKENDS[args.device])
    models = args.models.split(",") if args.models else list(SUITE)
    print(f"one backward's peak and the plan's resident bytes, KiB ({args.device}); check: peak <= eager peak + resident")
    print(f"{'model':>16} {'backend':>17} {'peak':>10} {'eager peak':>10} {'resident':>10} {'retained':>9}  check")
    rows = []
    for name in models:
        for r in measure_model(name, args.device, backends):
            rows.append(r)
            ok = ("ok" if _passes(r) else "FAIL") if r["gated"] else ("ok" if _passes(r) else "over (not gated)")
            print(
                f"{name:>16} {r['backend']:>17} {r['peak_bytes'] / 1024:>10.1f} {r['eager_peak_bytes'] / 1024:>10.1f} "
                f"{r['resident_bytes'] / 1024:>10.1f} {r['retained_bytes'] / 1024:>9.1f}  {ok}"
            )
    ok = all(_passes(r) for r in rows if r["gated"])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory.json").write_text(json.dumps({"device": args.device, "ok": ok, "rows": rows}, indent=1) + "\n")
    if not ok:
        print("FAILED: a planned backend's peak is above eager's peak plus its resident bytes, or it kept saved tensors")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
