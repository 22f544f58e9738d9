"""The OpInfo sweep: how much of torch's own op catalogue gpuautograd differentiates correctly,
and how much of it runs functionally (no opaque node, no eager fallback).

    python -m bench.coverage [--ops a,b] [--dtypes float64,complex128] [--limit N] [--samples-per-op N]
                             [--out FILE.json] [--top N]

Every OpInfo of torch's `op_db` that supports autograd gives its sample inputs (requires_grad=True)
in each dtype it differentiates on the CPU: float64, and complex128 where it has a complex backward.
Each sample's forward runs once, then its backward runs under gpuautograd (the reference
executor) and under torch.autograd with the same random incoming gradients. A sample is

- "correct" when every gradient matches torch's within the tolerance of gpuautograd.tolerances
  for the sample's dtype (NaN where torch gives NaN counts as agreement); a zero gradient where
  the other side gives none agrees in value and is counted correct, and apart ("zero-vs-none":
  `.grad` would be zeros instead of None),
- "functional" when every gradient matches exactly so, its captured program has no opaque node
  and it did not fall back to eager autograd.

Samples whose backward torch.autograd itself refuses (a non-differentiable sample, a sample with
no differentiable output) are skipped and counted apart. Prints a table (shares, then the most
common opaque nodes by the number of samples they appear in) and writes JSON with `--out`.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import gpuautograd
from gpuautograd.tolerances import TOLERANCES

DTYPES = (torch.float64, torch.complex128)


@dataclass
class SampleResult:
    op: str  # the OpInfo's name, with its variant: "linalg.svd", "nn.functional.conv2d"
    index: int  # position among the op's samples
    # "functional"; "opaque" (correct, with opaque nodes or an eager fallback); "zero-vs-none" (values
    # agree, but one side gives a zero gradient where the other gives none); "wrong"; "error"
    status: str
    opaque: list[str] = field(default_factory=list)
    detail: str = ""
    dtype: str = "float64"


def _op_id(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def _tensors(x) -> list[torch.Tensor]:
    """The tensors in a sample's argument or an op's result, through tuples, lists and dicts."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


def _leaves(sample) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in _tensors([sample.input, list(sample.args), dict(sample.kwargs)]):
        if t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _outputs(op, sample) -> list[torch.Tensor]:
    result = op(sample.input, *sample.args, **sample.kwargs)
    if sample.output_process_fn_grad is not None:
        result = sample.output_process_fn_grad(result)
    return [t for t in _tensors(result) if t.requires_grad and (t.is_floating_point() or t.is_complex())]


def _compare(ours, theirs, dtype) -> tuple[str, str]:
    """(what differs in value, what differs only in presence): each '' when nothing does. A zero
    gradient where torch gives none (or the reverse) agrees in value but not in `.grad`."""
    rtol, atol = TOLERANCES[dtype]
    presence = ""
    for k, (a, e) in enumerate(zip(ours, theirs)):
        if (a is None) != (e is None):
            given = a if e is None else e
            if given.count_nonzero() == 0:
                presence = (
                    presence or f"input {k}: a zero gradient {'from gpuautograd' if e is None else 'from torch'}, none from the other"
                )
                continue
            return f"input {k}: gradient {'missing' if a is None else 'given'} where torch gives {'one' if e is not None else 'none'}", ""
        if a is None:
            continue
        if a.shape != e.shape or a.dtype != e.dtype:
            return f"input {k}: {tuple(a.shape)}/{a.dtype} vs torch's {tuple(e.shape)}/{e.dtype}", ""
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as err:
            return f"input {k}: " + str(err).splitlines()[0], ""
    return "", presence


def run_sample(op, sample, index: int, dtype=torch.float64) -> SampleResult:
    """One sample's backward under gpuautograd and torch.autograd (status "skipped" when torch
    itself refuses it)."""
    result = _run_sample(op, sample, index, dtype)
    result.dtype = str(dtype).replace("torch.", "")
    return result


def _run_sample(op, sample, index: int, dtype) -> SampleResult:
    name = _op_id(op)
    leaves = _leaves(sample)
    try:
        outs = _outputs(op, sample)
        if not outs or not leaves:
            return SampleResult(name, index, "skipped", detail="no differentiable output or input")
        gen = torch.Generator().manual_seed(index)
        grads = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs]
        theirs = torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)
    except Exception as e:  # torch itself cannot differentiate this sample: not ours to score
        return SampleResult(name, index, "skipped", detail=f"torch: {type(e).__name__}")
    # A fresh cache for each sample: one op's many shapes would otherwise reach the recapture
    # limit and run eagerly, which measures the cache policy rather than the rules.
    gpuautograd.reset()
    try:
        report = gpuautograd.explain(outs, grads, backend="reference")
        fallbacks_before = sum(gpuautograd.stats()["fallbacks"].values())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = gpuautograd.grad(outs, leaves, grads, allow_unused=True, backend="reference")
        fell_back = sum(gpuautograd.stats()["fallbacks"].values()) != fallbacks_before
    except Exception as e:  # noqa: BLE001 - any failure of ours is what the sweep reports
        return SampleResult(name, index, "error", detail=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
    wrong, presence = _compare(ours, theirs, dtype)
    if wrong:
        return SampleResult(name, index, "wrong", list(report.opaque_nodes), wrong[:300])
    opaque = list(report.opaque_nodes)
    if presence:
        return SampleResult(name, index, "zero-vs-none", opaque, presence[:300])
    if report.program is None or fell_back:
        reason = report.fallback_reason or "fell back to eager"
        return SampleResult(name, index, "opaque", opaque or [f"eager fallback: {reason}"[:120]], reason[:300])
    return SampleResult(name, index, "opaque" if opaque else "functional", opaque)


def swept_dtypes(op, dtypes=DTYPES) -> list[torch.dtype]:
    """The dtypes of `dtypes` the op differentiates on the CPU (float64 when it runs in it at all)."""
    out = []
    for dtype in dtypes:
        supported = op.supported_backward_dtypes("cpu") if dtype.is_complex else op.supported_dtypes("cpu")
        if dtype in supported:
            out.append(dtype)
    return out


def select_ops(names: list[str] | None = None, limit: int | None = None, dtypes=DTYPES) -> list:
    """The OpInfos of the sweep: autograd, and one of `dtypes` on the CPU; `names` picks by name
    (with or without the variant), `limit` keeps the first N."""
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if op.supports_autograd and swept_dtypes(op, dtypes)]
    if names:
        wanted = set(names)
        ops = [op for op in ops if op.name in wanted or _op_id(op) in wanted]
        missing = wanted - {op.name for op in ops} - {_op_id(op) for op in ops}
        if missing:
            raise ValueError(f"no autograd OpInfo in {[str(d) for d in dtypes]} named {sorted(missing)}")
    return ops[:limit] if limit else ops


def sweep(ops, samples_per_op: int | None = None, dtypes=DTYPES) -> list[SampleResult]:
    results = []
    for op in ops:
        for dtype in swept_dtypes(op, dtypes):
            try:
                samples = list(op.sample_inputs("cpu", dtype, requires_grad=True))
            except Exception as e:  # noqa: BLE001 - an OpInfo that cannot make samples here
                detail = f"sample_inputs: {type(e).__name__}: {e}"[:300]
                results.append(SampleResult(_op_id(op), -1, "error", detail=detail, dtype=str(dtype).replace("torch.", "")))
                continue
            for i, sample in enumerate(samples[:samples_per_op] if samples_per_op else samples):
                results.append(run_sample(op, sample, i, dtype))
    return results


def _shares(results: list[SampleResult]) -> dict:
    n = len(results)
    counts = collections.Counter(r.status for r in results)
    correct = counts["functional"] + counts["opaque"] + counts["zero-vs-none"]
    return {
        "samples": n,
        "correct": correct,
        "functional": counts["functional"],
        "correct_share": round(correct / n, 4) if n else 0.0,
        "functional_share": round(counts["functional"] / n, 4) if n else 0.0,
    }


def summarize(results: list[SampleResult], top: int = 15) -> dict:
    skipped = sum(r.status == "skipped" for r in results)
    results = [r for r in results if r.status != "skipped"]
    counts = collections.Counter(r.status for r in results)
    n = len(results)
    correct = counts["functional"] + counts["opaque"] + counts["zero-vs-none"]
    by_node = collections.Counter(name for r in results for name in set(r.opaque))
    ops_by_node = collections.defaultdict(set)
    for r in results:
        for name in set(r.opaque):
            ops_by_node[name].add(r.op)
    return {
        "samples": n,
        "skipped": skipped,
        "ops": len({r.op for r in results}),
        "correct": correct,
        "functional": counts["functional"],
        "correct_share": round(correct / n, 4) if n else 0.0,
        "functional_share": round(counts["functional"] / n, 4) if n else 0.0,
        "zero_vs_none": counts["zero-vs-none"],
        "wrong": counts["wrong"],
        "errors": counts["error"],
        "top_opaque": [{"node": name, "samples": c, "ops": sorted(ops_by_node[name])[:8]} for name, c in by_node.most_common(top)],
        "failures": [asdict(r) for r in results if r.status in ("wrong", "error", "zero-vs-none")],
        "by_dtype": {d: _shares([r for r in results if r.dtype == d]) for d in sorted({r.dtype for r in results})},
    }


def print_report(summary: dict) -> None:
    s = summary
    dtypes = ", ".join(s.get("by_dtype", {"float64": None}))
    print(f"OpInfo sweep, {dtypes} on the CPU: {s['samples']} samples of {s['ops']} ops")
    print(f"({s['skipped']} more skipped: torch itself cannot differentiate them)")
    print("| measure | samples | share |")
    print("|---|---|---|")
    print(f"| correct gradients | {s['correct']} | {100 * s['correct_share']:.1f}% |")
    print(f"| of which a zero gradient where the other side gives none | {s['zero_vs_none']} | |")
    print(f"| functional (no opaque node) | {s['functional']} | {100 * s['functional_share']:.1f}% |")
    print(f"| wrong gradients | {s['wrong']} | |")
    print(f"| errors | {s['errors']} | |")
    for d, row in s.get("by_dtype", {}).items():
        print(
            f"| {d}: correct / functional of {row['samples']} | {row['correct']} / {row['functional']} | "
            f"{100 * row['correct_share']:.1f}% / {100 * row['functional_share']:.1f}% |"
        )
    if s["top_opaque"]:
        print("\n| opaque node | samples | ops (first few) |")
        print("|---|---|---|")
        for row in s["top_opaque"]:
            print(f"| {row['node']} | {row['samples']} | {', '.join(row['ops'])} |")
    for f in [f for f in s["failures"] if f["status"] != "zero-vs-none"][:20]:
        print(f"  {f['status']}: {f['op']}[{f['index']}]: {f['detail']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.coverage", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help="comma-separated OpInfo names (default: every autograd op)")
    p.add_argument("--dtypes", default="float64,complex128", help="comma-separated dtypes to sweep (default float64,complex128)")
    p.add_argument("--limit", type=int, help="only the first N ops")
    p.add_argument("--samples-per-op", type=int, help="at most N samples per op")
    p.add_argument("--top", type=int, default=15, help="how many opaque nodes to list (default 15)")
    p.add_argument("--out", help="write the summary as JSON to this file")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [s.strip() for s in args.ops.split(",") if s.strip()] if args.ops else None
    try:
        dtypes = tuple(getattr(torch, d.strip()) for d in args.dtypes.split(",") if d.strip())
        ops = select_ops(names, args.limit, dtypes)
    except (ValueError, AttributeError) as e:
        p.error(str(e))
    t0 = time.perf_counter()
    summary = summarize(sweep(ops, args.samples_per_op, dtypes), args.top)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    summary["torch"] = torch.__version__
    print_report(summary)
    print(f"({summary['wall_s']} s)")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=1))
        print(f"wrote {out}")
    return 1 if summary["wrong"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
