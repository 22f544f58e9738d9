"""The ways the benchmark runs a backward: eager torch, torch's compiled autograd with inductor,
and each gpuautograd backend. Each mode knows how to run a backward, whether it can run on a
device, and how its launches are counted."""

from __future__ import annotations

import contextlib

import torch

import gpuautograd
from gpuautograd import flags

from .counting import count_cuda_kernels, count_launches

COMPILED_AUTOGRAD = "compiled-autograd"


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


class Mode:
    name: str
    # A failure on its first call means "does not work on this machine" (skipped), not a bug (error).
    failure_is_skip = False

    def unavailable_reason(self, device: str) -> str | None:
        return None

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def launches(self, forward, device: str) -> tuple[int | None, str]:
        """(count, how it was counted) or (None, why not) for one steady-state backward."""
        loss = forward()
        return count_launches(lambda: self.backward(loss)), "aten ops dispatched (TorchDispatchMode), views and allocations excluded"

    def end_model(self) -> None:
        """Called after each model: drop per-model compiled state."""


class Eager(Mode):
    name = "eager"

    def backward(self, loss):
        loss.backward()


class CompiledAutograd(Mode):
    """torch._dynamo.compiled_autograd with the inductor backend: the backward graph is traced at
    run time and compiled; the first call pays the compile."""

    name = COMPILED_AUTOGRAD
    failure_is_skip = True

    def __init__(self):
        self._enable = None

    def unavailable_reason(self, device):
        try:
            from torch._dynamo import compiled_autograd
        except Exception as e:  # an install without dynamo support
            return f"torch._dynamo is not importable: {first_line(e)}"
        # `_enable` in recent torch, `enable` in older releases
        self._enable = getattr(compiled_autograd, "_enable", None) or getattr(compiled_autograd, "enable", None)
        if self._enable is None:
            return "torch._dynamo.compiled_autograd has no enable()/_enable() in this torch"
        return None

    @staticmethod
    def _compiler(graph_module):
        return torch.compile(graph_module, backend="inductor")

    def backward(self, loss):
        with self._enable(self._compiler):
            loss.backward()

    def launches(self, forward, device):
        if device != "cuda":
            return None, "not counted on CPU: inductor's generated C++ kernels do not go through the aten dispatcher"
        loss = forward()
        try:
            return count_cuda_kernels(lambda: self.backward(loss)), "CUDA kernels (torch.profiler)"
        except Exception as e:
            return None, f"profiler failed: {first_line(e)}"

    def end_model(self):
        import torch._dynamo
        from torch._dynamo import compiled_autograd

        torch._dynamo.reset()
        with contextlib.suppress(AttributeError):
            compiled_autograd.reset()


class Gpuautograd(Mode):
    def __init__(self, backend: str):
        self.backend = backend
        self.name = f"gpuautograd:{backend}"

    def unavailable_reason(self, device):
        """Try the backend on a tiny graph on the device: a backend that can't run there says so
        with ValueError/RuntimeError (e.g. a CUDA-only backend on the CPU)."""
        x = torch.randn(8, device=device, requires_grad=True)
        try:
            gpuautograd.backward((x * 2).sin().sum(), backend=self.backend)
        except (ValueError, RuntimeError) as e:
            return first_line(e)
        return None

    def backward(self, loss):
        gpuautograd.backward(loss, backend=self.backend)

    def explain(self, forward):
        return gpuautograd.explain(forward(), backend=self.backend)

    def launches(self, forward, device):
        if self.backend == "reference":  # a torch call per IR op: the dispatcher sees every launch
            return super().launches(forward, device)
        report = self.explain(forward)
        count = getattr(report, "launches", None)
        if count is None:
            return None, f"explain() of backend {self.backend!r} reports no launch count"
        return int(count), "explain().launches: generated kernels plus extern calls"


def all_modes() -> list[Mode]:
    """eager, compiled autograd, then every gpuautograd backend except "auto" (which picks one)."""
    return [Eager(), CompiledAutograd()] + [Gpuautograd(b) for b in flags.BACKENDS if b != "auto"]
