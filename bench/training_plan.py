"""A training size planned on the CPU: what the fused plan would launch and move, beside eager.

Three steps, each under the command's budget (bench/budget.py):
- `eager`: one `loss.backward()` under the launch counter of bench/counting.py (aten ops that
  launch a kernel, and the bytes they read and write); its gradients are the reference.
- `plan`: `gpuautograd.explain()` on the fused CPU backend: launches, kernels, bytes moved, the
  memory plan (arena, intermediates, resident), autograd nodes and opaque nodes, planning time.
- `plan-run`: one backward on that backend (planning again, then every generated kernel in
  Triton's interpreter), its gradients against eager's. The slowest step: the interpreter runs
  kernels in numpy; at full size it may run out of its share, and then says so.
"""

from __future__ import annotations

import resource
import time

import torch

import gpuautograd
from gpuautograd.tolerances import tolerance

from .budget import Budget
from .counting import count_aten_ops
from .harness import grad_agreement
from .sizes import Size

BACKEND = "interpret-replay"  # the bound plan that "cudagraph" runs, with kernels in Triton's interpreter
STEPS = ("eager", "plan", "plan-run")
# Shares of the budget, by weight: the run of the plan takes most.
WEIGHTS = {"eager": 1.0, "plan": 1.0, "plan-run": 3.0}


def _explain_figures(expl) -> dict:
    """Arena, intermediate and resident bytes of a plan, and the resident bytes by kind."""
    return {
        "arena_bytes": expl.arena_bytes,
        "intermediate_bytes": expl.intermediate_bytes,
        "resident_bytes": expl.resident_bytes,
        "resident": dict(expl.resident),
    }


def peak_rss_bytes() -> int:
    """The process's peak resident set so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PlanRun:
    """One model at one shape on the CPU, and the steps that measure it."""

    def __init__(self, size: Size, batch: int, seq: int):
        self.size, self.batch, self.seq = size, batch, seq
        t0 = time.perf_counter()
        self.model, make_batch, self.loss_fn = size.make("cpu", torch.float32, batch, seq)
        self.inputs = make_batch(torch.Generator().manual_seed(0))
        self.build_s = time.perf_counter() - t0
        self.params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.reference: dict = {}

    def forward(self) -> torch.Tensor:
        self.model.zero_grad(set_to_none=True)
        return self.loss_fn(self.model, *self.inputs)

    def take_grads(self) -> dict:
        """The gradients, moved out of .grad (no copy: at 1B parameters a copy is 4.4 GB)."""
        grads = {n: p.grad for n, p in self.params}
        for _, p in self.params:
            p.grad = None
        return grads

    def eager(self, row: dict) -> None:
        loss = self.forward()
        t0 = time.perf_counter()
        counter = count_aten_ops(loss.backward)
        row.update(backward_s=round(time.perf_counter() - t0, 3), launches=counter.launching, bytes_moved=counter.launching_bytes)
        row["notes"] = ["backward_s is one call under the launch counter"]
        self.reference = self.take_grads()

    def plan(self, row: dict) -> None:
        loss = self.forward()
        t0 = time.perf_counter()
        expl = gpuautograd.explain(loss, backend=BACKEND)
        row["planning_s"] = round(time.perf_counter() - t0, 3)
        row.update(nodes=expl.num_nodes, opaque_nodes=len(expl.opaque_nodes), opaque=sorted(set(expl.opaque_nodes)))
        if expl.program is None:
            row.update(status="error", reason=f"runs eagerly: {expl.fallback_reason}")
            return
        row.update(launches=expl.launches, kernels=len(expl.kernels), bytes_moved=expl.bytes_moved, memory=expl.memory)
        row.update(_explain_figures(expl))

    def plan_run(self, row: dict) -> None:
        if not self.reference:
            row.update(status="skipped", reason="no eager gradients to compare with")
            return
        loss = self.forward()
        t0 = time.perf_counter()
        gpuautograd.backward(loss, backend=BACKEND)
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
        err, ok, missing = grad_agreement(self.take_grads(), self.reference, torch.float32)
        row.update(grad_max_abs=err, grad_ok=ok and not missing, grad_missing=missing)


def run_plan(size: Size, batch: int, seq: int, steps: list[str] | None, budget: Budget, log=print, asked=False, rows=None) -> dict:
    """Rows of the CPU steps; the model is built once, before the first step. Steps the size
    leaves out by default are skipped rows unless `asked` (named in --modes). Rows are appended
    to `rows` as they finish, so that an interrupted run keeps them."""
    steps = [s for s in STEPS if steps is None or s in steps]
    left_out = {} if asked else {s: why for s, why in size.cpu_left_out.items() if s in steps}
    steps = [s for s in steps if s not in left_out]
    gpuautograd.reset()
    run = PlanRun(size, batch, seq)
    log(f"  built {size.name} at batch {batch} x seq {seq} in {run.build_s:.1f} s")
    rows = [] if rows is None else rows
    for i, name in enumerate(steps):
        left = sum(WEIGHTS[s] for s in steps[i:])
        row = {"mode": name, "backend": None if name == "eager" else BACKEND}
        share = budget.share(len(steps) - i, WEIGHTS[name], left)
        budget.run(name, getattr(run, name.replace("-", "_")), share, row)
        row["peak_rss_bytes"] = peak_rss_bytes()
        log(f"  {name}: {row['status']} in {row.get('elapsed_s', 0):.1f} s")
        rows.append(row)
    rows += [{"mode": s, "backend": BACKEND, "status": "skipped", "reason": why} for s, why in left_out.items()]
    return {"rows": rows, "build_s": round(run.build_s, 2)}


def plan_notes() -> list[str]:
    rtol, atol = tolerance(torch.float32)
    return [
        "CPU, float32: the plan is the one the GPU backends would run; figures are the plan's, not GPU times.",
        "launches: eager = aten ops that launch a kernel during one loss.backward() (bench/counting.py: views, detach and "
        f"bare allocations excluded); plan = explain().launches of backend {BACKEND!r} (generated kernels plus library calls).",
        "bytes_moved: eager = bytes read and written by those aten ops; plan = explain().bytes_moved.",
        "arena_bytes: the plan's arena; intermediate_bytes: every intermediate's bytes summed (what no reuse would take); "
        "resident_bytes: explain().resident_bytes, what the cached plan keeps allocated between calls (null where "
        "the installed gpuautograd does not report it).",
        "planning_s: explain() (walk, rules, passes, fusion, memory plan), nothing run. first_call_s of plan-run: a backward "
        "that plans again and runs every kernel in Triton's interpreter.",
        f"grad_ok: every gradient within rtol {rtol:g}, atol {atol:g} of eager's (gpuautograd.tolerances, float32).",
        "peak_rss_bytes: the process's peak resident memory after the step (cumulative).",
    ]
