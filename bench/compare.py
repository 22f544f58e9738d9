"""The regression gate: compare two benchmark runs by their ratios to eager, not absolute times.

    python -m bench.compare BASELINE.json NEW.json [--tolerance 0.1] [--metric speedup_vs_eager]

For every (model, gpuautograd mode) present in both files with a measured speedup (eager backward
time / mode backward time, measured side by side within each run), a regression is a speedup that
fell by more than the tolerance (0.1: below 90% of the baseline's), or gradients that agreed with
eager in the baseline and no longer do. Other modes (compiled autograd) are shown, not gated: their
ratio moves with torch, not with this code; the interpret backend's speed is the Triton
interpreter's, so only its gradients are gated. A gated mode that the baseline measured and the new
run did not (it errors, was skipped, or vanished from the file) fails the gate: a broken run must
not pass for a fast one; and so does a comparison in which no gated pair was measured in both runs.
Other rows present in one file only, or skipped in both, are reported, not failed.
`--metric cpu_speedup_vs_eager` compares the CPU-time ratio of CPU runs instead, which stays steady
on a shared machine. Exits 1 on a regression or a broken gated mode, 2 on an unreadable file, 0
otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class GateInputError(Exception):
    pass


def load(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GateInputError(f"{path}: cannot read a benchmark result: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise GateInputError(f"{path}: not a benchmark result (expected a dict with a 'results' list)")
    return data


def _rows(data: dict) -> dict[tuple[str, str], dict]:
    return {(r["model"], r["mode"]): r for r in data["results"] if r.get("mode") != "eager"}


GATED_PREFIX = "gpuautograd:"
# Validation-only modes: their speed is the Triton interpreter's, not this code's; their gradients stay gated.
SPEED_NOT_GATED = {"gpuautograd:interpret", "gpuautograd:interpret-replay"}
METRICS = ("speedup_vs_eager", "cpu_speedup_vs_eager", "host_speedup_vs_eager")


def compare(baseline: dict, new: dict, tolerance: float, metric: str = "speedup_vs_eager") -> tuple[list[list[str]], list[str], int]:
    """(table rows, notes, number of failures: regressions, broken gated modes, or nothing gated
    compared)."""
    base_rows, new_rows = _rows(baseline), _rows(new)
    table, notes, failures, skipped_in_both = [], [], 0, 0
    base_dev = {r.get("device") for r in baseline["results"]}
    new_dev = {r.get("device") for r in new["results"]}
    if base_dev != new_dev:
        notes.append(f"warning: devices differ (baseline {sorted(map(str, base_dev))}, new {sorted(map(str, new_dev))})")
    for key, b in base_rows.items():
        n = new_rows.get(key)
        gated = key[1].startswith(GATED_PREFIX)
        if n is None:
            if gated and b.get(metric) is not None:
                failures += 1
                notes.append(f"BROKEN: {key[0]} / {key[1]}: measured in the baseline, missing from the new run")
            else:
                notes.append(f"only in the baseline: {key[0]} / {key[1]}")
            continue
        bs, ns = b.get(metric), n.get(metric)
        if b.get("status") == "skipped" and n.get("status") == "skipped":
            skipped_in_both += 1
            continue
        if bs is None or ns is None:
            reason = n.get("reason") or b.get("reason")
            if gated and bs is not None:
                failures += 1
                notes.append(f"BROKEN: {key[0]} / {key[1]}: measured in the baseline, {n.get('status')} in the new run ({reason})")
            else:
                notes.append(f"not compared: {key[0]} / {key[1]}: baseline {b.get('status')}, new {n.get('status')} ({reason})")
            continue
        row = _verdict(key, b, n, bs, ns, tolerance)
        failures += row[-1].startswith("REGRESSION")
        table.append(row)
    for key in new_rows.keys() - base_rows.keys():
        notes.append(f"only in the new run: {key[0]} / {key[1]}")
    notes = sorted(notes)
    if skipped_in_both:
        notes.append(f"{skipped_in_both} pair(s) skipped in both runs (see each run's reasons)")
    if not any(row[1].startswith(GATED_PREFIX) for row in table):
        failures += 1
        notes.append(f"BROKEN: no gpuautograd mode was measured in both runs ({metric}): nothing was gated")
    return table, notes, failures


def _verdict(key, b: dict, n: dict, bs: float, ns: float, tolerance: float) -> list[str]:
    change = ns / bs - 1.0
    verdict = "ok"
    if change < -tolerance:
        verdict = "REGRESSION"
    elif change > tolerance:
        verdict = "improved"
    if key[1] in SPEED_NOT_GATED and verdict != "ok":
        verdict = f"{verdict.split()[0].lower()} (speed not gated)"
    if b.get("grad_ok") is True and n.get("grad_ok") is False:
        verdict = "REGRESSION (gradients now disagree with eager)"
    if not key[1].startswith(GATED_PREFIX) and verdict != "ok":
        verdict = f"{verdict.split()[0].lower()} (not gated)"
    return [key[0], key[1], f"{bs:.3f}", f"{ns:.3f}", f"{change:+.1%}", verdict]


def _format(table: list[list[str]]) -> str:
    header = ["model", "mode", "baseline", "new", "change", "verdict"]
    rows = [header] + table
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i in (0, 1, 5) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("baseline")
    p.add_argument("new")
    p.add_argument("--tolerance", type=float, default=0.1, help="relative fall in speedup vs eager that fails (default 0.1 = 10%%)")
    p.add_argument(
        "--metric", default="speedup_vs_eager", choices=METRICS, help="which ratio to eager to compare (default speedup_vs_eager)"
    )
    args = p.parse_args(argv)
    if args.tolerance < 0:
        p.error("--tolerance must be >= 0")
    try:
        baseline, new = load(args.baseline), load(args.new)
    except GateInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    table, notes, failures = compare(baseline, new, args.tolerance, args.metric)
    print(f"{args.metric}: eager time / mode time, each measured side by side within its own run; tolerance {args.tolerance:.0%}")
    print(_format(table) if table else "(no (model, mode) pair measured in both runs)")
    for note in notes:
        print(note)
    if failures:
        print(f"FAILED: {failures} failure(s): regressions beyond {args.tolerance:.0%} or gated modes not measured (BROKEN above)")
        return 1
    print(f"passed: {len(table)} pair(s) compared, no regression beyond {args.tolerance:.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
