"""The benchmark harness: backward of the model suite in every mode, side by side.

    python -m bench [--quick] [--device cpu|cuda] [--out DIR] [--models a,b] [--modes a,b]

Modes: eager torch backward, torch's compiled autograd with inductor, each gpuautograd backend.
Per model and mode: backward time, host time, launches, peak memory (CUDA), first-call time and
gradient agreement with eager. Prints a table, writes DIR/results.json and DIR/speedup.png.
Every ratio is measured side by side in this one run. Exits 1 when a gpuautograd mode failed or
its gradients disagree with eager.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .harness import Config, run
from .report import print_table, write_chart, write_json


def _split(text: str | None) -> list[str] | None:
    return [s.strip() for s in text.split(",") if s.strip()] if text else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few repetitions; slow modes on the smallest model only (< 2 min on 2 CPU cores)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", default="bench/out", help="folder for results.json and speedup.png (default: bench/out)")
    p.add_argument("--models", help="comma-separated subset of the model suite")
    p.add_argument("--modes", help="comma-separated subset of the modes (eager always runs: it is the reference)")
    p.add_argument("--reps", type=int, help="timed calls per mode, at most")
    p.add_argument("--warmup", type=int, help="warm-up calls per mode")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads on the CPU (default 1: ratios stay stable when another process takes a core; 0 keeps torch's default)",
    )
    p.add_argument("--no-transformers", action="store_true", help="leave out the transformers models even when installed")
    args = p.parse_args(argv)

    cfg = Config.for_run(args.device, args.quick, reps=args.reps, warmup=args.warmup)
    cfg.models, cfg.modes, cfg.include_transformers = _split(args.models), _split(args.modes), not args.no_transformers
    cfg.threads = args.threads or None
    print(f"benchmarking backward on {cfg.device}{' (--quick)' if cfg.quick else ''}: every mode side by side, interleaved, in this run")
    t0 = time.perf_counter()
    try:
        results = run(cfg)
    except (ValueError, RuntimeError) as e:  # what run() raises before measuring: a bad device, model or mode name
        p.error(str(e))
    results["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    print_table(results)
    print(f"wrote {write_json(results, out)}")
    chart = write_chart(results, out)
    if chart:
        print(f"wrote {chart}")
    print(f"total {results['meta']['wall_s']} s")
    bad = [
        r
        for r in results["results"]
        if r["mode"].startswith("gpuautograd:") and (r["status"] == "error" or (r["status"] == "ok" and r["grad_ok"] is False))
    ]
    for r in bad:
        print(f"FAILED: {r['model']} / {r['mode']}: {r['reason'] or 'gradients disagree with eager'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
