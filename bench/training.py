"""`python -m bench --size NAME`: one training size, measured on CUDA or planned on the CPU.

Writes DIR/training_<size>.json whatever happens to the modes (a mode that fails, runs out of its
share or has no time left to start is a row that says so) and prints a table.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

import gpuautograd

from .budget import Budget, Terminated, terminate_raises
from .harness import _git_commit
from .sizes import Size
from .training_measure import measure_notes, run_measure, training_modes
from .training_plan import STEPS, peak_rss_bytes, plan_notes, run_plan


def modes_for(kind: str, names: list[str] | None) -> list[str]:
    """The modes ("measure") or steps ("plan") to run, in order; eager always first (the reference)."""
    known = [m.name for m in training_modes()] if kind == "measure" else list(STEPS)
    if names is None:
        return known
    unknown = set(names) - set(known)
    if unknown:
        raise ValueError(f"unknown mode(s) {sorted(unknown)} for --size ({kind}); known: {known}")
    return [m for m in known if m == "eager" or m in names]


def _meta(size: Size, device: str, kind: str, batch: int, seq: int, budget: Budget) -> dict:
    return {
        "size": size.name,
        "description": size.description,
        "config": asdict(size.config),
        "params": size.count(size.config),
        "kind": kind,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
        "dtype": "bfloat16 autocast" if kind == "measure" else "float32",
        "batch": batch,
        "seq": seq,
        "budget_s": budget.total_s,
        "torch": torch.__version__,
        "gpuautograd": gpuautograd.__version__,
        "commit": _git_commit(),
        "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def run_size(
    size: Size,
    device: str,
    out: Path,
    batch: int | None = None,
    seq: int | None = None,
    modes: list[str] | None = None,
    budget: Budget | float | None = None,
    log=print,
    kind: str | None = None,
) -> dict:
    """Run the size, write DIR/training_<size>.json, return the results. `kind` "measure" (the
    default on CUDA) times training steps, "plan" (the default on the CPU) plans the backward;
    tests measure on the CPU. `budget`: seconds, or a Budget (tests give it a clock)."""
    kind = kind or ("measure" if device == "cuda" else "plan")
    shape = size.shapes[device]
    batch, seq = batch or shape.batch, seq or shape.seq
    names = modes_for(kind, modes)
    budget = budget if isinstance(budget, Budget) else Budget(budget)
    results = {"meta": _meta(size, device, kind, batch, seq, budget), "notes": [], "rows": []}
    rows = results["rows"]
    try:
        with terminate_raises():
            if kind == "measure":
                results["notes"] = measure_notes(device)
                chosen = [m for m in training_modes() if m.name in names]
                results.update(run_measure(size, device, batch, seq, chosen, budget, log, rows=rows))
            else:
                results["notes"] = plan_notes()
                results.update(run_plan(size, batch, seq, names, budget, log, asked=modes is not None and "plan-run" in modes, rows=rows))
    except (Exception, Terminated) as e:  # building the model failed, or a kill: the JSON still says so
        results["error"] = f"{type(e).__name__}: {e}"
    finally:
        results["meta"]["wall_s"] = round(budget.clock() - budget.start, 1)
        results["meta"]["peak_rss_bytes"] = peak_rss_bytes()
        write_json(results, out)
    return results


def write_json(results: dict, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"training_{results['meta']['size']}.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return path


def _fmt(value, scale: float = 1.0, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value / scale, fmt)


COLUMNS = {
    "measure": (
        ("backward ms", "backward_ms", 1, ".1f"),
        ("step ms", "step_ms", 1, ".1f"),
        ("peak GiB", "peak_mem_bytes", 2**30, ".1f"),
        ("1st call s", "first_call_ms", 1e3, ".1f"),
        ("grad rel err", "grad_rel_err", 1, ".1e"),
        ("grad ok", "grad_ok", None, None),
    ),
    "plan": (
        ("launches", "launches", 1, ".0f"),
        ("kernels", "kernels", 1, ".0f"),
        ("GB moved", "bytes_moved", 1e9, ".2f"),
        ("arena GB", "arena_bytes", 1e9, ".2f"),
        ("interm. GB", "intermediate_bytes", 1e9, ".2f"),
        ("nodes", "nodes", 1, ".0f"),
        ("opaque", "opaque_nodes", 1, ".0f"),
        ("plan s", "planning_s", 1, ".1f"),
        ("grad ok", "grad_ok", None, None),
    ),
}


def table(results: dict) -> str:
    columns = COLUMNS[results["meta"]["kind"]]
    header = ["mode", "status", *(c[0] for c in columns), "time s"]
    lines = [header]
    for row in results["rows"]:
        cells = [row["mode"], row["status"]]
        for _, key, scale, fmt in columns:
            value = row.get(key)
            cells.append({True: "yes", False: "NO", None: "-"}[value] if fmt is None else _fmt(value, scale, fmt))
        lines.append(cells + [_fmt(row.get("elapsed_s"))])
    widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
    text = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in lines]
    text.insert(1, "  ".join("-" * w for w in widths))
    for row in results["rows"]:
        if row.get("reason"):
            text.append(f"{row['status']}: {row['mode']}: {row['reason']}")
    meta = results["meta"]
    text.append(
        f"{meta['size']} ({meta['params']:,} params) on {meta['device']}, batch {meta['batch']} x seq {meta['seq']}, "
        f"{meta['dtype']}; {meta['wall_s']} s, peak RSS {meta['peak_rss_bytes'] / 1e9:.1f} GB"
    )
    if "error" in results:
        text.append(f"ERROR: {results['error']}")
    return "\n".join(text)
