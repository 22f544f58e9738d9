"""Binding a library matmul in CUDA-graph replay: static buffers + cuBLAS, or a Triton matmul
that reads the pointer table.

    python -m bench.extern_binding [--out DIR] [--quick] [--rounds N]

A captured graph bakes every address, while a backward's saved activations and gradients move
on every call; their addresses live in a device pointer table refreshed before each replay.
cuBLAS can't read that table. Per GPT-like backward product (x @ W, dY @ W^T, X^T @ dY with
x: (B*T, d), W: (d, 4d); d in {768, 2048}, B*T in {2048, 8192}; fp32 and bf16), three graphs
are captured and replayed side by side, interleaved round by round:
  static  TableCopy of A and B into static buffers, torch.mm (cuBLAS) into a static C, TableCopy
          of C out to the table's tensor: (a), what a graph of library calls needs
  table   TableMatmul reading A, B and C from the table: (b), no copies
  floor   torch.mm on the static buffers alone: (c), what (a) costs without its copies
Both (a) and (b) read the same table, so its refresh (one small host-to-device copy, the same
for both) is outside the timing. Reported: median ms per call (CUDA events around a replay of
`inner` calls, divided by `inner`), and the ratios table/static (b/a: below 1, the Triton
matmul wins) and static/floor (a/c: what the copies add). Each graph's result is checked
against a float64 product within the error bound of an fp32-accumulated K-term dot product.
Writes DIR/extern_binding.json. Without CUDA it says timing needs CUDA, checks both paths on
small shapes in Triton's interpreter, and writes what ran.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import triton

from gpuautograd.triton_kernels import TableCopy, TableMatmul, matmul_strides, span

DIMS = (768, 2048)
TOKENS = (2048, 8192)  # B*T
DTYPES = (torch.float32, torch.bfloat16)
PRODUCTS = ("x@W", "dY@W^T", "X^T@dY")
UNIT_ROUNDOFF = {torch.float32: 2**-24, torch.bfloat16: 2**-8}
TARGET_REPLAY_MS = 2.0  # calls captured per graph: enough that one replay takes about this long
MAX_INNER = 20


def operands(product: str, d: int, bt: int, dtype, device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of one product, as the backward sees them: W^T and X^T are transposed views."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    if product == "x@W":
        return rand(bt, d), rand(d, 4 * d)
    if product == "dY@W^T":
        return rand(bt, 4 * d), rand(d, 4 * d).t()
    if product == "X^T@dY":
        return rand(bt, d).t(), rand(bt, 4 * d)
    raise ValueError(f"unknown product {product!r}; known: {PRODUCTS}")


class Case:
    """The dynamic tensors of one product, the table naming them, and the three ways to compute C."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, interpret: bool):
        self.a, self.b = a, b
        (m, k), n = a.shape, b.shape[1]
        self.m, self.n, self.k, self.dtype = m, n, k, a.dtype
        self.c = torch.full((m, n), float("nan"), dtype=a.dtype, device=a.device)
        self.table = torch.tensor([a.data_ptr(), b.data_ptr(), self.c.data_ptr()], dtype=torch.int64, device=a.device)
        # (a) static buffers: spans of A and B viewed with their strides, C contiguous
        self.a_static = torch.empty(span(a), dtype=a.dtype, device=a.device)
        self.b_static = torch.empty(span(b), dtype=a.dtype, device=a.device)
        self.c_static = torch.empty(m * n, dtype=a.dtype, device=a.device)
        self.a_view = torch.as_strided(self.a_static, a.shape, a.stride())
        self.b_view = torch.as_strided(self.b_static, b.shape, b.stride())
        self.c_view = self.c_static.view(m, n)
        self.copy_in = TableCopy(self.table, [(0, self.a_static, span(a)), (1, self.b_static, span(b))], "in", interpret)
        self.copy_out = TableCopy(self.table, [(2, self.c_static, m * n)], "out", interpret)
        # (b) the table matmul
        strides = (matmul_strides(a), matmul_strides(b), matmul_strides(self.c))
        self.table_mm = TableMatmul(self.table, ("slot", 0), ("slot", 1), ("slot", 2), (1, m, n, k), strides, a.dtype, interpret)

    def static_path(self) -> None:
        self.copy_in()
        torch.mm(self.a_view, self.b_view, out=self.c_view)
        self.copy_out()

    def table_path(self) -> None:
        self.table_mm()

    def floor(self) -> None:
        torch.mm(self.a_view, self.b_view, out=self.c_view)

    def copied_bytes(self) -> int:
        return (span(self.a) + span(self.b) + self.m * self.n) * self.a.element_size()

    def check(self) -> dict:
        """C against the float64 product: max |error| and the largest error in units of the bound
        (<= 1 is within it): the accumulation bound K * u * sum|a b| (u = 2**-24), plus, for
        bf16, the final rounding (2**-7 relative)."""
        a, b = self.a.double(), self.b.double()
        exact = a @ b
        bound = self.k * UNIT_ROUNDOFF[torch.float32] * (a.abs() @ b.abs())
        if self.dtype != torch.float32:
            rounding = 2 * UNIT_ROUNDOFF[self.dtype]  # toward zero (the interpreter) stays under it too
            bound = rounding * exact.abs() + (1 + rounding) * bound
        error = (self.c.double() - exact).abs()
        in_bound_units = torch.nan_to_num(error / (bound + 1e-30), nan=float("inf")).max().item()
        return {"max_abs_err": error.max().item(), "err_over_bound": in_bound_units, "ok": in_bound_units <= 1.0}


def capture(fn, inner: int) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream (Triton compiles on its first launch, which a capture can't hold),
    then capture `inner` calls. The GPU tests capture with it too."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    torch.cuda.synchronize()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _inner_calls(case: Case) -> int:
    """Calls per graph so that a replay takes about TARGET_REPLAY_MS (launch overhead amortized)."""
    graph = capture(case.floor, 1)
    ms = statistics.median(_replay_ms(graph) for _ in range(5))
    return max(1, min(MAX_INNER, round(TARGET_REPLAY_MS / max(ms, 1e-3))))


VARIANTS = ("static", "table", "floor")


def time_case(product: str, d: int, bt: int, dtype, rounds: int) -> dict:
    a, b = operands(product, d, bt, dtype, "cuda")
    case = Case(a, b, interpret=False)
    row = {"product": product, "d": d, "bt": bt, "dtype": str(dtype).removeprefix("torch."), "m": case.m, "n": case.n, "k": case.k}
    row["a_layout"] = "transposed" if a.stride(0) == 1 and a.shape[1] > 1 else "row-major"
    row["b_layout"] = "transposed" if b.stride(0) == 1 and b.shape[1] > 1 else "row-major"
    row["copied_bytes"] = case.copied_bytes()
    inner = _inner_calls(case)
    graphs = {"static": capture(case.static_path, inner), "table": capture(case.table_path, inner), "floor": capture(case.floor, inner)}
    for name in ("static", "table"):  # each path's own result, from its graph
        case.c.fill_(float("nan"))
        graphs[name].replay()
        torch.cuda.synchronize()
        row[f"{name}_check"] = case.check()
    times = {name: [] for name in VARIANTS}
    for r in range(rounds):
        order = VARIANTS[r % 3 :] + VARIANTS[: r % 3]  # rotate who goes first
        for name in order:
            times[name].append(_replay_ms(graphs[name]) / inner)
    ms = {name: statistics.median(t) for name, t in times.items()}
    row.update({f"{name}_ms": ms[name] for name in VARIANTS})
    row["table_over_static"] = ms["table"] / ms["static"]
    row["static_over_floor"] = ms["static"] / ms["floor"]
    row["table_over_floor"] = ms["table"] / ms["floor"]
    row["inner"], row["rounds"] = inner, rounds
    del graphs
    return row


def check_in_interpreter() -> list[dict]:
    """Both paths on small shapes of the same three products, CPU tensors, Triton's interpreter."""
    rows = []
    for dtype in DTYPES:
        for product in PRODUCTS:
            a, b = operands(product, 24, 40, dtype, "cpu", seed=1)
            case = Case(a, b, interpret=True)
            row = {"product": product, "d": 24, "bt": 40, "dtype": str(dtype).removeprefix("torch."), "m": case.m, "n": case.n, "k": case.k}
            for name, path in (("static", case.static_path), ("table", case.table_path)):
                case.c.fill_(float("nan"))
                path()
                row[f"{name}_check"] = case.check()
            rows.append(row)
    return rows


def _meta(timed: bool) -> dict:
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "timed": timed,
    }
    if timed:
        meta["device"] = torch.cuda.get_device_name()
        meta["fp32_matmul_tf32"] = torch.backends.cuda.matmul.allow_tf32
    return meta


def _print_rows(rows: list[dict]) -> None:
    head = f"{'product':<9}{'d':>6}{'B*T':>6}{'dtype':>10}{'static ms':>11}{'table ms':>10}{'floor ms':>10}"
    print(head + f"{'table/static':>14}{'static/floor':>14}  checks")
    for r in rows:
        checks = "ok" if r["static_check"]["ok"] and r["table_check"]["ok"] else "MISMATCH"
        print(
            f"{r['product']:<9}{r['d']:>6}{r['bt']:>6}{r['dtype']:>10}{r['static_ms']:>11.4f}{r['table_ms']:>10.4f}{r['floor_ms']:>10.4f}"
            f"{r['table_over_static']:>13.2f}x{r['static_over_floor']:>13.2f}x  {checks}"
        )


def _summary(rows: list[dict]) -> dict:
    """Geometric means of the ratios per dtype."""
    out = {}
    for dtype in sorted({r["dtype"] for r in rows}):
        sel = [r for r in rows if r["dtype"] == dtype]
        for key in ("table_over_static", "static_over_floor", "table_over_floor"):
            out[f"{dtype}_{key}_geomean"] = statistics.geometric_mean([r[key] for r in sel])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.extern_binding", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="bench/out", help="folder for extern_binding.json (default: bench/out)")
    p.add_argument("--quick", action="store_true", help="d=768, B*T=2048 only, fewer rounds")
    p.add_argument("--rounds", type=int, help="timed replays per variant (default 30, --quick 10)")
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    t0 = time.perf_counter()
    if not torch.cuda.is_available():
        print("timing needs CUDA (no CUDA device here): checking both paths in Triton's interpreter on small shapes instead")
        rows = check_in_interpreter()
        for r in rows:
            print(f"  {r['product']:<9}{r['dtype']:>10}  static: {r['static_check']}  table: {r['table_check']}")
        results = {"meta": _meta(False), "ran": "interpreter correctness check (no timing)", "checks": rows, "results": []}
        ok = all(r["static_check"]["ok"] and r["table_check"]["ok"] for r in rows)
    else:
        rounds = args.rounds or (10 if args.quick else 30)
        dims, tokens = ((768,), (2048,)) if args.quick else (DIMS, TOKENS)
        print(f"extern binding in CUDA graphs on {torch.cuda.get_device_name()}: static buffers + cuBLAS vs table matmul, interleaved")
        rows = []
        for dtype in DTYPES:
            for d in dims:
                for bt in tokens:
                    for product in PRODUCTS:
                        rows.append(time_case(product, d, bt, dtype, rounds))
                        torch.cuda.empty_cache()
        _print_rows(rows)
        summary = _summary(rows)
        for key, value in summary.items():
            print(f"  {key}: {value:.3f}")
        results = {"meta": _meta(True), "ran": "CUDA-graph timing", "summary": summary, "results": rows}
        ok = all(r["static_check"]["ok"] and r["table_check"]["ok"] for r in rows)
    results["meta"]["wall_s"] = round(time.perf_counter() - t0, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "extern_binding.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {path}")
    if not ok:
        print("FAILED: a path's result is outside the error bound")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
