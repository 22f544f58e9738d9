"""Generated matmuls (fused epilogues, prologues, sums of products) against cuBLAS plus separate
kernels, on the backward of three blocks.

    python -m bench.matmul_epilogue [--out DIR] [--quick] [--rounds N] [--blocks a,b] [--device cuda]

- gelu-mlp: y = gelu(x @ W1) @ W2 with x: (B*T, d), W1: (d, 4d), W2: (4d, d). The backward's
  product dY @ W2^T feeds GELU's backward (an epilogue).
- swiglu: y = (silu(x @ W1) * (x @ W3)) @ W2, hidden 8d/3 rounded to 64. x's gradient is a sum of
  two products (one kernel with two K loops) after the gate's backward (an epilogue).
- squared-error: mean((x @ W)^2), W: (d, d). Both products read 2 * out * g / N, computed as they
  load it (a prologue) instead of stored.

The plan either keeps every product a library call (cuBLAS) whose result generated kernels read
back ("never"), or generates every product that fusion touches ("always"); the default plan
chooses per matmul with the cost model of `fusion/heuristics.py`, whose assumed efficiency of a
generated matmul this measures. Per block, dtype (float32, bfloat16) and size, both plans run on
the "triton" backend, captured afresh and timed side by side, interleaved round by round: median
ms per backward (CUDA events), the ratio always/never (below 1: the generated kernels win), and
each plan's bytes moved and launches. Gradients of both are checked against eager's. Writes
DIR/matmul_epilogue.json. Without CUDA it prints and writes the plans' bytes and launches only,
and says that timing needs CUDA. --quick: gelu-mlp at d=768, B*T=2048 only (the GPU check's step).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import gpuautograd
from gpuautograd.fusion import heuristics
from gpuautograd.tolerances import tolerance

SIZES = ((768, 2048), (2048, 4096))  # (d, B*T)
POLICIES = ("never", "always")


def _weight(g, device, dtype, fan_in: int, fan_out: int):
    """Scaled as a layer's weight is (1/sqrt(fan_in)), so activations stay near 1."""
    return (torch.randn(fan_in, fan_out, generator=g) * fan_in**-0.5).to(device, dtype).requires_grad_()


def gelu_mlp(d: int, tokens: int, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, d, generator=g).to(device, dtype).requires_grad_()
    w1, w2 = _weight(g, device, dtype, d, 4 * d), _weight(g, device, dtype, 4 * d, d)
    return [x, w1, w2], lambda: F.gelu(x @ w1) @ w2


def swiglu(d: int, tokens: int, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = -(-8 * d // 3 // 64) * 64
    x = torch.randn(tokens, d, generator=g).to(device, dtype).requires_grad_()
    w1, w3, w2 = _weight(g, device, dtype, d, hidden), _weight(g, device, dtype, d, hidden), _weight(g, device, dtype, hidden, d)
    return [x, w1, w3, w2], lambda: (F.silu(x @ w1) * (x @ w3)) @ w2


def squared_error(d: int, tokens: int, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, d, generator=g).to(device, dtype).requires_grad_()
    w = _weight(g, device, dtype, d, d)
    return [x, w], lambda: (x @ w).pow(2).mean()


BLOCKS = {"gelu-mlp": gelu_mlp, "swiglu": swiglu, "squared-error": squared_error}


def plan(policy: str, params, forward, backend: str):
    heuristics.MATMUL_EPILOGUES = policy
    gpuautograd.reset()
    out = forward()
    report = gpuautograd.explain([out], [torch.ones_like(out)], backend=backend)
    return report.bytes_moved, report.launches, sum(k.space.startswith("matmul[") for k in report.kernels)


def timed(policy: str, params, forward, inner: int) -> float:
    heuristics.MATMUL_EPILOGUES = policy
    gpuautograd.reset()
    for _ in range(2):  # capture and compile, then a warm call
        gpuautograd.backward(forward().sum(), backend="triton")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    outs = [forward() for _ in range(inner)]
    losses = [o.sum() for o in outs]
    torch.cuda.synchronize()
    start.record()
    for loss in losses:
        gpuautograd.backward(loss, backend="triton")
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / inner


def check(policy: str, params, forward) -> float:
    """Largest difference from eager's gradients, over the tolerance of the dtype (below 1: right)."""
    heuristics.MATMUL_EPILOGUES = policy
    gpuautograd.reset()
    for p in params:
        p.grad = None
    forward().sum().backward()
    expected = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    gpuautograd.backward(forward().sum(), backend="triton")
    rtol, atol = tolerance(params[0].dtype)
    worst = 0.0
    for p, e in zip(params, expected):
        worst = max(worst, ((p.grad.float() - e.float()).abs() / (atol + rtol * e.float().abs())).max().item())
        p.grad = None
    return worst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--quick", action="store_true", help="gelu-mlp at d=768, B*T=2048 only")
    parser.add_argument("--blocks", default=",".join(BLOCKS), help="comma-separated, of: " + ", ".join(BLOCKS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda" and torch.cuda.is_available()
    backend = "triton" if cuda else "interpret"
    saved_policy = heuristics.MATMUL_EPILOGUES
    rows = []
    try:
        blocks = ["gelu-mlp"] if args.quick else args.blocks.split(",")
        cases = [
            (b, d, t, dtype) for b in blocks for d, t in (SIZES[:1] if args.quick else SIZES) for dtype in (torch.float32, torch.bfloat16)
        ]
        for name, d, tokens, dtype in cases:
            params, forward = BLOCKS[name](d, tokens, dtype, args.device if cuda else "cpu")
            row = {"block": name, "d": d, "tokens": tokens, "dtype": str(dtype).removeprefix("torch.")}
            for policy in POLICIES:
                bytes_moved, launches, fused = plan(policy, params, forward, backend)
                row[policy] = {"bytes_moved": bytes_moved, "launches": launches, "fused_matmuls": fused}
            if cuda:
                for policy in POLICIES:
                    row[policy]["max_error_over_tolerance"] = check(policy, params, forward)
                times: dict[str, list[float]] = {p: [] for p in POLICIES}
                for r in range(args.rounds):
                    for policy in POLICIES if r % 2 == 0 else reversed(POLICIES):
                        times[policy].append(timed(policy, params, forward, args.inner))
                for policy in POLICIES:
                    row[policy]["ms"] = statistics.median(times[policy])
                row["always_over_never"] = row["always"]["ms"] / row["never"]["ms"]
            rows.append(row)
            line = f"{name:<14} d={d:<5} B*T={tokens:<5} {row['dtype']:<9}"
            for policy in POLICIES:
                r = row[policy]
                line += f" {policy}: {r['bytes_moved'] / 1e6:8.2f} MB {r['launches']:3d} launches"
                line += f" {r['ms']:7.3f} ms" if "ms" in r else ""
            if cuda:
                line += f"  always/never {row['always_over_never']:.3f}x"
            print(line)
    finally:
        heuristics.MATMUL_EPILOGUES = saved_policy
    if not cuda:
        print("timing needs CUDA: the plans above were made on the CPU (the same partition as on a GPU)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "matmul_epilogue.json").write_text(json.dumps({"device": args.device if cuda else "cpu", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
