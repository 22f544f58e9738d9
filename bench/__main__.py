"""The benchmark harness: backward of the model suite in every mode, side by side.

    python -m bench [--quick] [--device cpu|cuda] [--out DIR] [--models a,b] [--modes a,b]
    python -m bench --size gpt2-small|llama-1b [--device cpu|cuda] [--out DIR] [--batch N] [--seq N] [--modes a,b] [--budget S]

Modes: eager torch backward, torch's compiled autograd with inductor, each gpuautograd backend.
Per model and mode: backward time, host time, launches, peak memory (CUDA), first-call time and
gradient agreement with eager. Prints a table, writes DIR/results.json and DIR/speedup.png.
Every ratio is measured side by side in this one run. Exits 1 when a gpuautograd mode failed or
its gradients disagree with eager.

With --size, one training size (bench/sizes.py) instead of the suite: on CUDA a bf16 training step
per mode (bench/training_measure.py), on the CPU its backward planned (bench/training_plan.py);
writes DIR/training_<size>.json. --budget caps the whole command's seconds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from .harness import Config, run
from .report import print_table, write_chart, write_json
from .sizes import SIZES
from .training import modes_for, run_size, table


def _split(text: str | None) -> list[str] | None:
    return [s.strip() for s in text.split(",") if s.strip()] if text else None


def _run_size(p: argparse.ArgumentParser, args) -> int:
    size = SIZES[args.size] if args.layers is None else SIZES[args.size].with_config(n_layers=args.layers)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device")
    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    try:
        modes_for("measure" if args.device == "cuda" else "plan", _split(args.modes))
    except ValueError as e:
        p.error(str(e))
    what = "a bf16 training step per mode" if args.device == "cuda" else "the backward's plan"
    print(f"{args.size} on {args.device}: {what}" + (f", budget {args.budget:g} s" if args.budget else ""))
    results = run_size(size, args.device, Path(args.out), args.batch, args.seq, _split(args.modes), args.budget)
    print(table(results))
    print(f"wrote {Path(args.out) / f'training_{size.name}.json'}")
    bad = [r for r in results["rows"] if r["mode"] != "eager" and (r["status"] == "error" or r.get("grad_ok") is False)]
    return 1 if bad or "error" in results else 0


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
    sizes = p.add_argument_group("training sizes (--size)")
    sizes.add_argument("--size", choices=tuple(SIZES), help="one training size instead of the model suite")
    sizes.add_argument("--batch", type=int, help="batch size (default: the size's for the device)")
    sizes.add_argument("--seq", type=int, help="sequence length (default: the size's for the device)")
    sizes.add_argument("--layers", type=int, help="fewer layers, for a quick look (the figures are then not the size's)")
    sizes.add_argument("--budget", type=float, help="seconds for the whole command; modes share it (default: no limit)")
    args = p.parse_args(argv)
    if args.size:
        return _run_size(p, args)

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
