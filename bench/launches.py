"""Launches and bytes moved per backward: gpuautograd's fused plan against eager torch.

For each model of the suite, launches counted one way (bench/counting.py: kernels that do work;
views, detach and bare allocations excluded): eager `loss.backward()`'s (aten ops seen by a
TorchDispatchMode that launch a kernel), the fused plan's (generated kernels plus library calls,
from `explain().launches`), and the bytes each moves (eager: inputs plus outputs of every
launching op; fused: the plan's kernels and library calls), beside the floor any backward must
move (`explain().compulsory_bytes`: saved tensors and incoming gradients read once, gradients
returned once) and the plan's bytes over it.
For "cudagraph": the launches inside its graphs (the plan plus the table copies of library inputs
and outputs) and what the host issues per replay (graph launches, table uploads, eager steps).

    python -m bench.launches [--dtype float32] [--scale] [--epilogues cost|always|never] [--json OUT.json]

--scale plans gpt at d_model 768 (2 layers, seq 256, batch 2) and llama at d_model 512 (seq 256,
batch 2) instead of the suite's sizes: the widths at which a GPU's backward is bound by bytes.
--epilogues picks where matmuls take their consumers' pointwise work (fusion/heuristics.py): where
the H200 cost model says it is faster (the default), wherever it saves bytes, or never (the plan
before issue 26), for side by side ratios of what fused epilogues save.

The plan is the same partition on every device; planning happens on the CPU here.
"""

from __future__ import annotations

import argparse
import json

import torch

import gpuautograd
from gpuautograd.fusion import heuristics
from gpuautograd.runtime import engine

from .counting import count_aten_ops
from .models import SUITE, make_gpt, make_llama

# GPU-scale sizes: where a backward's time on a GPU follows the bytes it moves.
SCALED = {
    "gpt-d768": lambda dtype: make_gpt(dtype=dtype, d_model=768, seq=256, batch=2, n_layers=2),
    "llama-d512": lambda dtype: make_llama(dtype=dtype, d_model=512, seq=256, batch=2),
}


def _replayed(model, make_batch, loss_fn) -> tuple[int, int]:
    """The bound plan of "cudagraph", as "interpret-replay" runs it on the CPU, after its first
    call (parameters read in place are known then): launches inside the graphs, and what the host
    issues per replay (graph launches, table uploads, eager steps)."""
    gpuautograd.reset()
    batch = make_batch(torch.Generator().manual_seed(0))
    gpuautograd.backward(loss_fn(model, *batch), backend="interpret-replay")
    model.zero_grad(set_to_none=True)
    program = list(engine.CACHE.entries.values())[-1].compiled
    return program.launches_per_replay()


def measure(name: str, dtype: torch.dtype) -> dict:
    model, make_batch, loss_fn = (SCALED[name] if name in SCALED else SUITE[name])(dtype=dtype)
    batch = make_batch(torch.Generator().manual_seed(0))
    try:
        loss = loss_fn(model, *batch)
    except RuntimeError as e:  # the forward has no kernel for the dtype (an FFT in bfloat16)
        return {"model": name, "skipped": f"its forward fails in {dtype} ({str(e).splitlines()[0]})"}
    e = gpuautograd.explain(loss, backend="interpret")
    in_graph, host_calls = _replayed(model, make_batch, loss_fn)
    counter = count_aten_ops(loss.backward)
    return {
        "model": name,
        "nodes": e.num_nodes,
        "eager_launches": counter.launching,
        "launches": e.launches,
        "in_graph": in_graph,
        "host_calls": host_calls,
        "kernels": len(e.kernels),
        "eager_bytes": counter.launching_bytes,
        "planned_bytes": e.bytes_moved,
        "compulsory_bytes": e.compulsory_bytes,
        "memory": e.memory,
        "arena_bytes": e.arena_bytes,
        "intermediate_bytes": e.intermediate_bytes,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--scale", action="store_true", help="gpt at d_model 768 and llama at 512 instead of the suite")
    parser.add_argument("--epilogues", default="cost", choices=["cost", "always", "never"], help="matmul epilogue fusion")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    heuristics.MATMUL_EPILOGUES = args.epilogues
    rows = []
    header = f"{'model':<16}{'nodes':>6}{'eager':>7}{'fused':>7}{'kernels':>8}{'eager/fused':>12}"
    header += f"{'eager MB':>9}{'plan MB':>9}{'bytes':>7}{'floor MB':>9}{'plan/floor':>11}{'in graph':>9}{'host/replay':>12}"
    print(f"launches per backward, {args.dtype} (kernels that do work; views, detach and allocations excluded)")
    print(header)
    for name in SCALED if args.scale else SUITE:
        r = measure(name, dtype)
        rows.append(r)
        if "skipped" in r:
            print(f"{name:<16}skipped: {r['skipped']}")
            continue
        print(
            f"{r['model']:<16}{r['nodes']:>6}{r['eager_launches']:>7}{r['launches']:>7}{r['kernels']:>8}"
            f"{r['eager_launches'] / r['launches']:>11.1f}x{r['eager_bytes'] / 1e6:>9.2f}{r['planned_bytes'] / 1e6:>9.2f}"
            f"{r['planned_bytes'] / r['eager_bytes']:>6.2f}x{r['compulsory_bytes'] / 1e6:>9.2f}"
            f"{r['planned_bytes'] / r['compulsory_bytes']:>10.2f}x{r['in_graph']:>9}{r['host_calls']:>12}"
        )
        print(f"{'':<16}memory: {r['memory']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "epilogues": args.epilogues, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
