"""A training size measured on CUDA: a bf16-autocast training step in each mode, under a budget.

Per mode: the first call (forward + backward, compile included), its gradients against eager's,
the backward time (CUDA events, bench/harness.py's time_backward), the whole step's time (forward,
backward and a fused AdamW step) and the step's peak memory (torch.cuda.max_memory_allocated,
parameters, gradients and optimizer state included). Every mode starts from the same parameters
(restored from a copy after each mode, since its optimizer steps change them). Runs on the CPU
too, without peak memory, so that its logic is tested where there is no GPU.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time

import torch

import gpuautograd

from .budget import Budget
from .harness import time_backward
from .modes import CompiledAutograd, Eager, Gpuautograd, Mode, first_line
from .sizes import Size

# bf16 autocast: matmuls in bf16, their fp32 gradients summed in different orders by each mode.
# A gradient agrees when its error's norm is within this part of eager's gradient's norm
# (bf16 keeps 8 bits: one rounding is up to 0.4%; a few, compounded through 12-22 layers, stay
# under 2% where a wrong formula is off by tens of percent).
GRAD_REL_TOL = 2e-2
BACKWARD_REPS, STEP_REPS, WARMUP = 20, 10, 2
# Eager's share of the budget against another mode's: it is the reference every mode needs, and
# what it leaves unused goes to the others.
EAGER_WEIGHT = 2.0


class CompiledAutogradCudagraphs(CompiledAutograd):
    """Compiled autograd with inductor in "reduce-overhead" mode: its kernels replayed as CUDA graphs."""

    name = "compiled-autograd-cudagraphs"

    @staticmethod
    def _compiler(graph_module):
        return torch.compile(graph_module, backend="inductor", mode="reduce-overhead")


def training_modes() -> list[Mode]:
    return [Eager(), Gpuautograd("triton"), Gpuautograd("cudagraph"), CompiledAutograd(), CompiledAutogradCudagraphs()]


MODE_NAMES = tuple(m.name for m in training_modes())


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def grad_rel_errors(grads: dict, reference: dict) -> tuple[float, float, list[str]]:
    """(worst ||g - ref|| / ||ref|| over parameters, worst max abs error, parameters missing on one side)."""
    worst_rel, worst_abs, missing = 0.0, 0.0, []
    for name, ref in reference.items():
        g = grads.get(name)
        if (g is None) != (ref is None):
            missing.append(name)
            continue
        if ref is None:
            continue
        diff = g.double() - ref.double()
        worst_abs = max(worst_abs, diff.abs().max().item())
        worst_rel = max(worst_rel, diff.norm().item() / max(ref.double().norm().item(), 1e-30))
    return worst_rel, worst_abs, missing


class MeasureRun:
    """The model, its batch and its initial parameters on one device, and one mode's measurements."""

    def __init__(self, size: Size, device: str, batch: int, seq: int, reps: tuple[int, int] = (BACKWARD_REPS, STEP_REPS)):
        self.device, self.reps = device, reps
        self.model, make_batch, self.loss_fn = size.make(device, torch.float32, batch, seq)
        self.inputs = make_batch(torch.Generator().manual_seed(0))
        self.params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.initial = {n: p.detach().clone() for n, p in self.params}
        self.reference: dict = {}

    def autocast(self):
        return torch.autocast(self.device, dtype=torch.bfloat16)

    def forward(self) -> torch.Tensor:
        with self.autocast():
            return self.loss_fn(self.model, *self.inputs)

    def restore(self) -> None:
        with torch.no_grad():
            for n, p in self.params:
                p.copy_(self.initial[n])
                p.grad = None

    def first_call(self, mode: Mode, row: dict) -> None:
        self.restore()
        loss = self.forward()
        _sync(self.device)
        t0 = time.perf_counter()
        mode.backward(loss)
        _sync(self.device)
        row["first_call_ms"] = (time.perf_counter() - t0) * 1e3
        grads = {n: p.grad for n, p in self.params}
        if mode.name == "eager":
            self.reference = {n: None if g is None else g.clone() for n, g in grads.items()}
            row.update(grad_rel_err=0.0, grad_max_abs=0.0, grad_ok=True)
            return
        rel, err, missing = grad_rel_errors(grads, self.reference)
        row.update(grad_rel_err=rel, grad_max_abs=err, grad_ok=rel <= GRAD_REL_TOL and not missing, grad_missing=missing)

    def backward_times(self, mode: Mode, row: dict, until: float) -> None:
        times = []
        for i in range(WARMUP + self.reps[0]):
            if times and time.monotonic() > until:
                break
            for _, p in self.params:
                p.grad = None
            t = time_backward(mode, self.forward(), self.device)
            if i >= WARMUP:
                times.append(t)
                row["backward_ms"] = statistics.median(x[0] for x in times) * 1e3
                row["host_ms"] = statistics.median(x[1] for x in times) * 1e3
                row["backward_reps"] = len(times)

    def step_times(self, mode: Mode, row: dict, until: float) -> None:
        fused = self.device == "cuda"  # the fused AdamW kernel is CUDA's; foreach elsewhere
        opt = torch.optim.AdamW([p for _, p in self.params], lr=1e-4, fused=fused, foreach=None if fused else True)
        row["optimizer"] = "AdamW(fused=True)" if fused else "AdamW(foreach=True)"
        times = []
        try:
            for i in range(WARMUP + self.reps[1]):
                if times and time.monotonic() > until:
                    break
                _sync(self.device)
                if i == WARMUP and self.device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                mode.backward(self.forward())
                opt.step()
                _sync(self.device)
                if i >= WARMUP:
                    times.append(time.perf_counter() - t0)
                    row["step_ms"] = statistics.median(times) * 1e3
                    row["step_reps"] = len(times)
                    if self.device == "cuda":
                        row["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
        finally:
            del opt  # its state (two fp32 copies of the parameters) goes before the next mode

    def measure(self, mode: Mode, row: dict, share: float | None) -> None:
        """Everything for one mode, in order of value: what runs out of time keeps what came before.
        The timed loops stop early (after one timed call) so that the step's loop ends within the
        share; what the mode leaves unused goes to the modes after it."""
        start, share = time.monotonic(), math.inf if share is None else share
        reason = mode.unavailable_reason(self.device)
        if reason:
            row.update(status="skipped", reason=reason)
            return
        if mode.name != "eager" and not self.reference:
            row.update(status="error", reason="eager failed: nothing to compare with")
            return
        try:
            self.first_call(mode, row)
        except Exception as e:
            if mode.failure_is_skip:
                row.update(status="skipped", reason=f"first call: {first_line(e)}")
                return
            raise
        spent = time.monotonic() - start  # the first call: compile included
        self.backward_times(mode, row, until=start + spent + 0.4 * (share - spent))
        self.step_times(mode, row, until=start + spent + 0.8 * (share - spent))

    def end_mode(self, mode: Mode) -> None:
        with contextlib.suppress(Exception):
            mode.end_model()
        gpuautograd.reset()
        self.restore()
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()


def run_measure(size: Size, device: str, batch: int, seq: int, modes: list[Mode], budget: Budget, log=print, reps=None, rows=None) -> dict:
    """Rows of the modes, eager first (its gradients are the reference); each mode gets an equal
    share of the budget left when it starts. Rows are appended to `rows` as they finish."""
    run = MeasureRun(size, device, batch, seq, **({"reps": reps} if reps else {}))
    rows = [] if rows is None else rows
    for i, mode in enumerate(modes):
        row = {"mode": mode.name, "status": "ok", "reason": None}
        for key in ("first_call_ms", "backward_ms", "host_ms", "step_ms", "peak_mem_bytes", "grad_rel_err", "grad_max_abs", "grad_ok"):
            row[key] = None
        weight = EAGER_WEIGHT if mode.name == "eager" else 1.0
        share = budget.share(len(modes) - i, weight, weight + len(modes) - i - 1)
        budget.run(mode.name, lambda r, mode=mode, share=share: run.measure(mode, r, share), share, row)
        run.end_mode(mode)
        log(f"  {mode.name}: {row['status']} in {row.get('elapsed_s', 0):.1f} s")
        rows.append(row)
    return {"rows": rows}


def measure_notes(device: str) -> list[str]:
    return [
        "bf16 autocast (torch.autocast); parameters, gradients and optimizer state in float32.",
        "backward_ms: CUDA events around the backward call, median of the timed calls (bench/harness.py time_backward); "
        "host_ms: the call's wall time without synchronizing.",
        "step_ms: wall time of zero_grad + forward + backward + AdamW(fused=True).step() with a synchronize, median.",
        "peak_mem_bytes: torch.cuda.max_memory_allocated over the timed steps (parameters, gradients, optimizer state, "
        "activations: absolute, not above a baseline).",
        "first_call_ms: the first forward's backward in the mode (gpuautograd: capture + plan + compile; compiled autograd: "
        "dynamo + inductor compile), with a synchronize.",
        f"grad_ok: every parameter's ||g - g_eager|| / ||g_eager|| <= {GRAD_REL_TOL:g} (grad_rel_err is the worst), on the "
        "first call, from the same parameters and batch.",
        "A mode gets an equal share of the budget left when it starts; one that runs over is interrupted (timed_out) and "
        "keeps the figures it had; one with under a few seconds left is skipped.",
    ]
