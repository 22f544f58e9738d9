"""Measure every (model, mode) pair: backward time, host time, launches, peak memory, first-call
time and gradient agreement with eager. All modes of one model run in the same process on the same
parameters and inputs, interleaved round by round, so their ratios share the machine's noise.
"""

from __future__ import annotations

import gc
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import gpuautograd
from gpuautograd.tolerances import tolerance

from .counting import count_cuda_kernels
from .modes import COMPILED_AUTOGRAD, Gpuautograd, Mode, all_modes, first_line
from .suite import BenchModel, bench_models, transformers_available

# Modes too slow to run on every model in --quick: their compile (inductor) or execution (the
# Triton interpreter runs every kernel in numpy) costs seconds to tens of seconds per model.
SLOW_MODES = {
    COMPILED_AUTOGRAD: "its inductor compile takes 5-20 s per model",
    "gpuautograd:interpret": "the Triton interpreter is slow",
    "gpuautograd:interpret-replay": "the Triton interpreter is slow",
}
QUICK_SLOW_MODELS = ("mlp",)


@dataclass
class Config:
    device: str = "cpu"
    quick: bool = False
    warmup: int = 5
    reps: int = 50  # timed calls per mode, at most
    min_reps: int = 5  # at least, whatever the budget
    budget_s: float = 10.0  # timed-loop seconds per (model, mode): slow modes get fewer reps
    models: list[str] | None = None  # None: the whole suite
    modes: list[str] | None = None  # None: every mode
    include_transformers: bool = True
    threads: int | None = None  # torch intra-op threads on the CPU; None keeps torch's default
    notes: list[str] = field(default_factory=list)

    @classmethod
    def for_run(cls, device: str, quick: bool, **overrides) -> Config:
        if device == "cpu":
            base = dict(warmup=3, reps=60, min_reps=3, budget_s=2.0) if quick else dict(warmup=5, reps=100, min_reps=5, budget_s=10.0)
        else:
            base = dict(warmup=5, reps=100, min_reps=5, budget_s=2.0) if quick else dict(warmup=10, reps=300, min_reps=10, budget_s=10.0)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(device=device, quick=quick, **base)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_backward(mode: Mode, loss: torch.Tensor, device: str) -> tuple[float, float, float | None]:
    """(backward seconds, host seconds, CPU seconds) of one call. On CUDA the backward time comes
    from events around the call, the host time is the call's wall time without synchronizing, and
    there is no CPU time. On the CPU the backward and host times are the call's wall time, and the
    CPU time is the process's CPU time during the call (all its threads): unlike wall time, it does
    not grow while other processes hold the cores."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        mode.backward(loss)
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, host, None
    t0, c0 = time.perf_counter(), time.process_time()
    mode.backward(loss)
    c1, t1 = time.process_time(), time.perf_counter()
    return t1 - t0, t1 - t0, c1 - c0


def grad_agreement(grads: dict, reference: dict, dtype: torch.dtype) -> tuple[float, bool, list[str]]:
    """(max abs error, all within the dtype's tolerance, parameters whose gradient is missing on one side)."""
    rtol, atol = tolerance(dtype)
    worst, ok, missing = 0.0, True, []
    for name, expected in reference.items():
        actual = grads.get(name)
        if (actual is None) != (expected is None):
            ok = False
            missing.append(name)
            continue
        if expected is None:
            continue
        worst = max(worst, (actual.double() - expected.double()).abs().max().item())
        ok = ok and bool(torch.isclose(actual, expected, rtol=rtol, atol=atol, equal_nan=True).all())
    return worst, ok, missing


class ModelRun:
    """One model on one device: its forward, the rows of its modes, and the measurement steps."""

    def __init__(self, spec: BenchModel, cfg: Config):
        self.spec, self.cfg, self.device = spec, cfg, cfg.device
        torch.manual_seed(0)
        self.model, make_batch, self.loss_fn = spec.factory(device=cfg.device)
        self.batch = make_batch(torch.Generator().manual_seed(0))
        self.params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.dtype = self.params[0][1].dtype
        self.reference: dict = {}

    def forward(self) -> torch.Tensor:
        """A fresh loss with no .grad set, and the same dropout masks every time."""
        self.model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        return self.loss_fn(self.model, *self.batch)

    def grads(self) -> dict:
        return {n: None if p.grad is None else p.grad.detach().clone() for n, p in self.params}

    def check_grads(self, row: dict) -> None:
        err, ok, missing = grad_agreement(self.grads(), self.reference, self.dtype)
        row["grad_max_abs"] = max(row["grad_max_abs"] or 0.0, err)
        row["grad_ok"] = ok and row["grad_ok"] is not False
        if missing:
            row["notes"].append(f"gradient present on one side only: {', '.join(missing[:4])}")

    def timed(self, mode: Mode) -> tuple[float, float, float | None]:
        loss = self.forward()
        return time_backward(mode, loss, self.device)

    def peak_memory(self, mode: Mode) -> int:
        loss = self.forward()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        mode.backward(loss)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base


def _base_row(spec: BenchModel, mode: Mode, cfg: Config, dtype: torch.dtype) -> dict:
    rtol, atol = tolerance(dtype)
    return {
        "model": spec.name,
        "mode": mode.name,
        "device": cfg.device,
        "dtype": str(dtype).removeprefix("torch."),
        "status": "ok",
        "reason": None,
        "backward_ms": None,
        "host_ms": None,
        "speedup_vs_eager": None,
        "host_speedup_vs_eager": None,
        "cpu_ms": None,
        "cpu_speedup_vs_eager": None,
        "reps": 0,
        "launches": None,
        "launches_source": None,
        "cuda_kernels": None,
        "peak_mem_bytes": None,
        "first_call_ms": None,
        "grad_max_abs": None,
        "grad_ok": None,
        "grad_tolerance": {"rtol": rtol, "atol": atol},
        "notes": [],
    }


def _fail(row: dict, mode: Mode, error: BaseException, stage: str, first_call: bool) -> None:
    row["status"] = "skipped" if (first_call and mode.failure_is_skip) else "error"
    row["reason"] = f"{stage}: {first_line(error)}"


def measure_model(spec: BenchModel, modes: list[Mode], cfg: Config, unavailable: dict[str, tuple[str, str]]) -> list[dict]:
    """The rows of one model, one per mode; `unavailable` maps a mode that can't run on the
    device to (status, reason)."""
    gpuautograd.reset()
    try:
        model_run = ModelRun(spec, cfg)
    except Exception as e:  # one model that can't be built must not end the run
        rows = [_base_row(spec, m, cfg, torch.get_default_dtype()) for m in modes]
        for row in rows:
            row.update(status="error", reason=f"building the model: {first_line(e)}")
        return rows
    rows = {m.name: _base_row(spec, m, cfg, model_run.dtype) for m in modes}
    active: list[Mode] = []
    tried: list[Mode] = []  # modes that ran at least once and may hold compiled state for this model

    # 1. First call of each mode (eager first: its gradients are the reference).
    for mode in modes:
        row = rows[mode.name]
        if mode.name in unavailable:
            row["status"], row["reason"] = unavailable[mode.name]
            continue
        if cfg.quick and mode.name in SLOW_MODES and spec.name not in QUICK_SLOW_MODELS:
            row.update(status="skipped", reason=f"--quick runs it on {', '.join(QUICK_SLOW_MODELS)} only ({SLOW_MODES[mode.name]})")
            continue
        if mode.name != "eager" and not model_run.reference:
            row.update(status="error", reason="eager backward failed, nothing to compare with")
            continue
        tried.append(mode)
        try:
            loss = model_run.forward()
            _sync(cfg.device)
            t0 = time.perf_counter()
            mode.backward(loss)
            _sync(cfg.device)
            row["first_call_ms"] = (time.perf_counter() - t0) * 1e3
        except Exception as e:
            _fail(row, mode, e, "first call", first_call=True)
            continue
        if mode.name == "eager":
            model_run.reference = model_run.grads()
            row.update(grad_max_abs=0.0, grad_ok=True)
        else:
            model_run.check_grads(row)
        active.append(mode)

    def attempt(mode: Mode, stage: str, fn):
        """Run one step of a mode; a failure marks its row as an error and drops the mode."""
        try:
            return fn()
        except Exception as e:
            _fail(rows[mode.name], mode, e, stage, first_call=False)
            active.remove(mode)
            return None

    # 2. Warm-up, interleaved; its times size each mode's timed loop to the budget (a slow mode
    # stops warming up once it has spent the budget).
    warm: dict[str, list[float]] = {m.name: [] for m in active}
    for _ in range(cfg.warmup):
        for mode in list(active):
            if sum(warm[mode.name]) > cfg.budget_s:
                continue
            t = attempt(mode, "warm-up", lambda mode=mode: model_run.timed(mode))
            if t is not None:
                warm[mode.name].append(max(t[0], t[1]))
    per_call = {m.name: max(statistics.median(warm[m.name] or [1.0]), 1e-6) for m in active}
    reps = {name: max(cfg.min_reps, min(cfg.reps, int(cfg.budget_s / t))) for name, t in per_call.items()}
    if "eager" in reps:  # eager, the reference, runs in every round, next to every timed call of the others
        reps["eager"] = max(reps.values())

    # 3. Timed rounds: every mode once per round, the order rotating so none always goes first.
    times: dict[str, list[tuple]] = {m.name: [] for m in active}
    for i in range(max(reps.values(), default=0)):
        order = active[i % len(active) :] + active[: i % len(active)] if active else []
        for mode in order:
            if len(times[mode.name]) < reps[mode.name]:
                t = attempt(mode, "timed loop", lambda mode=mode: model_run.timed(mode))
                if t is not None:
                    times[mode.name].append(t)

    # 4. Probes, one steady-state call each: gradients again, peak memory, launches.
    for mode in list(active):
        row = rows[mode.name]
        row["backward_ms"] = statistics.median(t[0] for t in times[mode.name]) * 1e3
        row["host_ms"] = statistics.median(t[1] for t in times[mode.name]) * 1e3
        if cfg.device == "cpu":
            row["cpu_ms"] = statistics.median(t[2] for t in times[mode.name]) * 1e3
        row["reps"] = len(times[mode.name])
        # a steady-state call whose gradients are checked; on CUDA it also measures the peak memory
        probe = model_run.peak_memory if cfg.device == "cuda" else model_run.timed
        probed = attempt(mode, "steady-state call", lambda mode=mode, probe=probe: probe(mode))
        if mode not in active:
            continue
        if mode.name != "eager":
            model_run.check_grads(row)
        if cfg.device == "cuda":
            row["peak_mem_bytes"] = probed
        counted = attempt(mode, "launch count", lambda mode=mode: mode.launches(model_run.forward, cfg.device))
        if counted is not None:
            row["launches"], row["launches_source"] = counted
        if cfg.device == "cuda" and mode in active:
            row["cuda_kernels"] = _cuda_kernels(model_run, mode, row)
        if isinstance(mode, Gpuautograd) and mode in active:
            report = attempt(mode, "explain", lambda mode=mode: mode.explain(model_run.forward))
            if report is not None:
                if report.fallback_reason:
                    row["notes"].append(f"runs eagerly: {report.fallback_reason}")
                if report.opaque_nodes:
                    row["notes"].append(f"{len(report.opaque_nodes)} opaque node(s) run eagerly: {', '.join(report.opaque_nodes[:3])}")

    eager = rows.get("eager")
    for row in rows.values():
        if row["status"] == "ok" and eager and eager["status"] == "ok" and row["backward_ms"]:
            row["speedup_vs_eager"] = eager["backward_ms"] / row["backward_ms"]
            row["host_speedup_vs_eager"] = eager["host_ms"] / row["host_ms"]
            if row["cpu_ms"]:
                row["cpu_speedup_vs_eager"] = eager["cpu_ms"] / row["cpu_ms"]
    for mode in tried:
        try:
            mode.end_model()
        except Exception as e:  # cleanup must not lose the measurements
            rows[mode.name]["notes"].append(f"cleanup failed: {first_line(e)}")
    return list(rows.values())


def _cuda_kernels(run: ModelRun, mode: Mode, row: dict) -> int | None:
    loss = run.forward()
    try:
        return count_cuda_kernels(lambda: mode.backward(loss))
    except Exception as e:
        row["notes"].append(f"CUDA kernel count failed: {first_line(e)}")
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def notes_for(cfg: Config, mode_names: list[str]) -> list[str]:
    cuda = cfg.device == "cuda"
    notes = [
        "Ratios are measured side by side in this one run on this machine: compare them, not absolute times across machines. "
        "'vs eager' (speedup_vs_eager) is eager's median backward time / the mode's, the modes interleaved call by call on the same "
        "parameters and inputs; above 1 is faster than eager.",
        (
            "Backward time: CUDA events around the backward call, median of the timed calls."
            if cuda
            else "Backward time: perf_counter around the backward call, median of the timed calls."
        ),
        (
            "Host time: wall time of the backward call on the host, without synchronizing."
            if cuda
            else "Host time: on the CPU the host runs the kernels, so it equals the backward time (not shown in the table). "
            "'cpu vs eager' (cpu_speedup_vs_eager) is the same ratio on the process's CPU time during the call (cpu_ms): it stays "
            "steady when other processes take the cores, where wall-time ratios move."
        ),
        "Launches: for eager and gpuautograd:reference, aten ops dispatched during one backward (TorchDispatchMode), excluding "
        "views/metadata ops (view, t, expand, detach, ...) and bare allocations (empty*); for other gpuautograd backends, "
        "explain().launches (kernels plus extern calls); for compiled autograd, CUDA kernels from the profiler on CUDA, none on the CPU.",
        (
            "Peak memory: torch.cuda.max_memory_allocated during one backward minus the memory allocated before it "
            "(new .grad tensors included)."
            if cuda
            else "Peak memory: not measured on the CPU (torch keeps no allocator statistics for CPU tensors)."
        ),
        "First call: the first backward of the model in that mode (gpuautograd: capture + compile; compiled autograd: dynamo + inductor "
        "compile), wall time with a synchronize.",
        "Gradients: max abs error against eager on the first call and on a steady-state call; "
        "ok = within gpuautograd.tolerances for the dtype.",
    ]
    if not cuda:
        threads = torch.get_num_threads()
        notes.append(
            f"CPU threads: torch runs with {threads} thread(s) (--threads; 1 keeps ratios steadier when another process takes a core)."
        )
    if cuda:
        notes.append("CUDA kernels: every mode, one steady-state backward under torch.profiler (memcpy/memset excluded).")
    notes.append(
        f"Repetitions: {cfg.warmup} warm-up calls, then as many timed calls per mode as fit {cfg.budget_s:g} s, "
        f"between {cfg.min_reps} and {cfg.reps} (column 'reps'); eager runs as many as the most-repeated mode."
    )
    slow = ", ".join(m for m in SLOW_MODES if m in mode_names)
    if cfg.quick and slow:
        notes.append(f"--quick: {slow} run on {', '.join(QUICK_SLOW_MODELS)} only (slow compile or execution).")
    return notes + cfg.notes


def run(cfg: Config, log=print) -> dict:
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    models = bench_models(cfg.include_transformers)
    if cfg.models:
        unknown = set(cfg.models) - {m.name for m in models}
        if unknown:
            raise ValueError(f"unknown model(s) {sorted(unknown)}; known: {[m.name for m in models]}")
        models = [m for m in models if m.name in cfg.models]
    modes = all_modes()
    if cfg.modes:
        unknown = set(cfg.modes) - {m.name for m in modes}
        if unknown:
            raise ValueError(f"unknown mode(s) {sorted(unknown)}; known: {[m.name for m in modes]}")
        modes = [m for m in modes if m.name == "eager" or m.name in cfg.modes]  # eager is the reference
    unavailable = {}
    for mode in modes:
        try:
            reason = mode.unavailable_reason(cfg.device)
        except Exception as e:  # not the "can't run here" answer: a failure worth an error row
            unavailable[mode.name] = ("error", f"availability probe: {first_line(e)}")
            continue
        if reason:
            unavailable[mode.name] = ("skipped", reason)
    if cfg.device == "cpu" and cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.include_transformers and not transformers_available():
        cfg.notes.append("transformers is not installed: the hf-* models are left out.")
    rows = []
    for spec in models:
        t0 = time.perf_counter()
        rows += measure_model(spec, modes, cfg, unavailable)
        gc.collect()  # the model and its batch go before the next one is built
        if cfg.device == "cuda":
            torch.cuda.empty_cache()
        log(f"  {spec.name}: {time.perf_counter() - t0:.1f} s")
    meta = {
        "device": cfg.device,
        "device_name": torch.cuda.get_device_name() if cfg.device == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "gpuautograd": gpuautograd.__version__,
        "commit": _git_commit(),
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "quick": cfg.quick,
        "warmup": cfg.warmup,
        "max_reps": cfg.reps,
        "budget_s": cfg.budget_s,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    return {"meta": meta, "notes": notes_for(cfg, [m.name for m in modes]), "results": rows}
