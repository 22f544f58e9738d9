"""Writing a benchmark run out: a table on the terminal (rich when installed, plain text
otherwise), DIR/results.json, and DIR/speedup.png (matplotlib, when installed)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def headers(device: str) -> tuple[str, ...]:
    """On CUDA the host time has its own column; on the CPU it equals the backward time, and the
    CPU-time ratio takes its place."""
    fourth = "host ms" if device == "cuda" else "cpu vs eager"
    return ("model", "mode", "backward ms", "vs eager", fourth, "launches", "peak MiB", "1st call ms", "grad max err", "grad ok", "reps")


def _num(value, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def cells(row: dict) -> list[str]:
    if row["status"] != "ok":
        return [row["model"], row["mode"], "-", row["status"].upper() if row["status"] == "error" else row["status"]] + ["-"] * 7
    grad_ok = {True: "yes", False: "NO", None: "-"}[row["grad_ok"]]
    peak = None if row["peak_mem_bytes"] is None else row["peak_mem_bytes"] / 2**20
    fourth = _num(row["host_ms"], ".3f") if row["device"] == "cuda" else _num(row.get("cpu_speedup_vs_eager"), ".2f", "x")
    return [
        row["model"],
        row["mode"],
        _num(row["backward_ms"], ".3f"),
        _num(row["speedup_vs_eager"], ".2f", "x"),
        fourth,
        _num(row["launches"], "d"),
        _num(peak, ".2f"),
        _num(row["first_call_ms"], ".1f"),
        _num(row["grad_max_abs"], ".1e"),
        grad_ok,
        str(row["reps"]),
    ]


def footnotes(results: dict) -> list[str]:
    """Why rows were skipped or failed (grouped), then per-row notes, then the run's notes."""
    lines = []
    grouped = defaultdict(list)
    for row in results["results"]:
        if row["status"] != "ok":
            grouped[(row["status"], row["mode"], row["reason"])].append(row["model"])
    for (status, mode, reason), models in grouped.items():
        lines.append(f"{status}: {mode} on {', '.join(models)}: {reason}")
    uncounted = defaultdict(list)
    for row in results["results"]:
        for note in row["notes"]:
            lines.append(f"note: {row['model']} / {row['mode']}: {note}")
        if row["launches"] is None and row["status"] == "ok" and row["launches_source"]:
            uncounted[(row["mode"], row["launches_source"])].append(row["model"])
    for (mode, why), models in uncounted.items():
        lines.append(f"launches of {mode} on {', '.join(models)}: {why}")
    meta = results["meta"]
    versions = f"torch {meta['torch']}, gpuautograd {meta['gpuautograd']} at {meta['commit']}"
    lines.append(f"run: {meta['device']} ({meta['device_name']}), {versions}, {meta['threads']} thread(s), {meta.get('wall_s', '?')} s")
    lines += results["notes"]
    return lines


def plain_table(results: dict) -> str:
    header = headers(results["meta"]["device"])
    rows = [list(header)] + [cells(r) for r in results["results"]]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    out = []
    for k, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def print_table(results: dict) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(plain_table(results))
        print("(rich is not installed: plain table; `pip install -e .[bench]` for the rich one)")
    else:
        title = f"gpuautograd benchmark, {results['meta']['device']}{' (--quick)' if results['meta']['quick'] else ''}"
        table = Table(title=title)
        for i, header in enumerate(headers(results["meta"]["device"])):
            table.add_column(header, justify="left" if i < 2 else "right", no_wrap=i < 2)
        previous = None
        for row in results["results"]:
            if previous is not None and row["model"] != previous:
                table.add_section()
            previous = row["model"]
            style = "red" if row["status"] == "error" or row["grad_ok"] is False else ("dim" if row["status"] == "skipped" else None)
            table.add_row(*cells(row), style=style)
        Console(width=max(140, Console().width)).print(table)
    for line in footnotes(results):
        print(line)


def write_json(results: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


_TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 7, 10, 20, 50, 100, 200, 500)


def write_chart(results: dict, out_dir: Path) -> Path | None:
    """A grouped bar chart of speedup against eager per model, one bar per mode. None (with a
    printed note) when matplotlib is missing or no mode other than eager ran."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter
    except ImportError:
        print("note: matplotlib is not installed, no chart written (`pip install -e .[bench]`)")
        return None
    rows = [r for r in results["results"] if r["mode"] != "eager" and r["speedup_vs_eager"] is not None]
    if not rows:
        print("note: no mode besides eager has a speedup, no chart written")
        return None
    models = list(dict.fromkeys(r["model"] for r in results["results"]))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(models) + 2), 4.5))
    for k, mode in enumerate(modes):
        by_model = {r["model"]: r["speedup_vs_eager"] for r in rows if r["mode"] == mode}
        xs = [i + (k - (len(modes) - 1) / 2) * width for i, m in enumerate(models) if m in by_model]
        speedups = [by_model[m] for m in models if m in by_model]
        # bars grow from 1 (eager): up when faster, down when slower, on a log axis
        bars = ax.bar(xs, [s - 1 for s in speedups], width, bottom=1.0, label=mode)
        ax.bar_label(bars, labels=[f"{s:.2f}" for s in speedups], fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(models)), models, rotation=30, ha="right")
    ax.set_yscale("log")
    values = [r["speedup_vs_eager"] for r in rows] + [1.0]
    low, high = min(values) / 1.25, max(values) * 1.25
    ax.set_ylim(low, high)
    ax.set_yticks([t for t in _TICKS if low <= t <= high], [f"{t:g}x" for t in _TICKS if low <= t <= high])
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("speedup vs eager (log axis, >1 is faster)")
    meta = results["meta"]
    where = f"{meta['device']} ({meta['device_name']}){' --quick' if meta['quick'] else ''}"
    ax.set_title(f"backward speedup vs eager, {where}, measured side by side in one run", fontsize=9)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = out_dir / "speedup.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
