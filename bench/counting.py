"""Counting what a backward launches: the one definition every benchmark and RESULTS.md uses.

A launch is a kernel that does work on the device. For torch ops (eager backward, the reference
backend) that is the aten ops dispatched while the backward runs, seen by a TorchDispatchMode,
minus the ops that launch no kernel: views and other metadata ops (every output aliases an input,
nothing is written: view, t, expand, detach, ...) and bare allocations (empty, empty_strided, ...).
For a fused plan it is its generated kernels plus its library calls (`explain().launches`). On
CUDA the kernels themselves can also be counted with the profiler (`count_cuda_kernels`).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpuautograd.runtime.floor import footprint

# Allocation without a kernel: the memory is handed out, nothing runs on the device.
_ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "empty_permuted"}


def launches_kernel(func: torch._ops.OpOverload) -> bool:
    """False for ops that only make a view / change metadata or only allocate."""
    if func._schema.name.split("::")[-1] in _ALLOCATIONS:
        return False
    returns = func._schema.returns
    is_view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    return not is_view


class AtenOpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside the block, by overload, which ones launch, and the
    bytes those read and write (every tensor argument and result)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.launching = 0
        self.total = 0
        self.launching_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        self.ops[str(func)] += 1
        out = func(*args, **(kwargs or {}))
        if launches_kernel(func):
            self.launching += 1
            tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(a, torch.Tensor)]
            # each at its real size in memory (an expanded index at its storage's), as the plan's are
            self.launching_bytes += sum(footprint(t) for t in tensors if t.layout == torch.strided)
        return out


@contextlib.contextmanager
def observed_functional():
    """gpuautograd runs eagerly while a dispatch mode or the profiler watches it, unless told to
    run its program anyway: here the program's launches are what is counted."""
    previous = os.environ.get("GPUAUTOGRAD_WHEN_OBSERVED")
    os.environ["GPUAUTOGRAD_WHEN_OBSERVED"] = "functional"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["GPUAUTOGRAD_WHEN_OBSERVED"]
        else:
            os.environ["GPUAUTOGRAD_WHEN_OBSERVED"] = previous


def count_launches(fn: Callable[[], object]) -> int:
    """Launches of torch ops while `fn` runs (views, detach and bare allocations excluded)."""
    return count_aten_ops(fn).launching


def count_aten_ops(fn: Callable[[], object]) -> AtenOpCounter:
    """Run `fn` once under the counter; `.launching` is the launch count, `.total` every op seen."""
    with observed_functional(), AtenOpCounter() as counter:
        fn()
    return counter


def count_cuda_kernels(fn: Callable[[], object]) -> int:
    """CUDA kernels that `fn` launched, from the profiler's device events (memcpy/memset excluded)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with observed_functional(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = 0
    for event in prof.events():
        if getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        if "memcpy" in name or "memset" in name or getattr(event, "is_user_annotation", False):
            continue
        kernels += 1
    return kernels
