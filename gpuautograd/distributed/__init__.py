"""gpuautograd under torch.distributed: DistributedDataParallel and FSDP2 run functionally; what
would skip C++ hooks (FSDP1, tensor parallel, unknown wrappers) runs eagerly with a warning naming it.

The core calls three functions, each from one marked place:
- `global_fallback_reason()` from api's fallback predicate: what rules out every multi-rank
  backward (a torch whose DDP can't be recognized, replicate() modules alive).
- `run_engine(engine.run, ...)` from api: when a process group is initialized, the backward runs
  inside an autograd graph task (`graph_task.py`), and the reducer hooks planned for it fire after
  it has accumulated every gradient.
- `check_graph(...)` from the engine, right after the walk: plans those hooks, or raises the
  engine's Fallback with the reason this graph can't run functionally (`ddp.py`).
"""

from __future__ import annotations

import threading

import torch

from ..degrade import Fallback
from . import ddp, graph_task, registry


class _Frames(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Frame] = []  # one per gpuautograd backward running under torch.distributed


_frames = _Frames()


class _Frame:
    __slots__ = ("world_size", "hooks")

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.hooks: ddp.HookPlan | None = None


def install() -> None:
    registry.install()


_AVAILABLE = torch.distributed.is_available()  # how torch was built: fixed for the process
# is_initialized() reaches the default group through two Python properties (GroupMember.WORLD,
# then _world.default_pg), five frames on every backward; the field they end at answers the same
# in one read, where this torch has it (else is_initialized() runs).
_C10D = torch.distributed.distributed_c10d if _AVAILABLE else None
_READ_WORLD = _C10D is not None and hasattr(getattr(_C10D, "_world", None), "_default_pg")


def _initialized() -> bool:
    if _READ_WORLD:
        return _C10D._world._default_pg is not None
    return _AVAILABLE and torch.distributed.is_initialized()


def global_fallback_reason() -> str | None:
    """Why no backward can run functionally in this process right now (None: each graph decides)."""
    if not _initialized():
        return None
    world = torch.distributed.get_world_size()
    if world <= 1:
        return None
    if registry.install_problem is not None:
        return f"a torch.distributed process group with world size {world} is initialized and {registry.install_problem}"
    from .detect import composable_wrappers

    wrappers = composable_wrappers()
    if wrappers:
        return (
            f"{', '.join(wrappers)} manages modules in this process (world size {world}); its gradient "
            "collectives run from autograd hooks and callbacks that gpuautograd does not drive"
        )
    return None


def run_engine(run, *args):
    """`run(*args)`; under an initialized process group, inside an autograd graph task, followed by
    the reducer hooks that `check_graph` planned for it."""
    if not _initialized():
        return run(*args)
    frame = _Frame(torch.distributed.get_world_size())
    stack = _frames.stack
    stack.append(frame)

    def body():
        result = run(*args)
        if frame.hooks is not None:
            frame.hooks.fire()
        return result

    try:
        _roots, _grads, retain_graph, _inputs, accumulate, _backend = args
        return graph_task.call_in_graph_task(body, keep_graph=retain_graph, accumulate=accumulate)
    finally:
        stack.pop()


def active() -> bool:
    """Is a process group initialized, or a backward of this thread inside run_engine's graph
    task? Then a backward goes through run_engine (api.backward's short entry leaves it)."""
    return bool(_frames.stack) or _initialized()


def in_graph_task() -> bool:
    """Is a backward of this thread running under an initialized process group, inside
    run_engine's graph task? (Its walk must then be the Python one, which `ddp.plan` reads.)"""
    return bool(_frames.stack)


def check_graph(w, root_edges, input_edges, accumulate: bool) -> None:
    """Called by the engine after the walk. Plans the reducer hooks of this backward, or raises
    the engine's Fallback when a leaf may carry hooks gpuautograd can't run."""
    stack = _frames.stack
    if not stack:
        return  # no process group: nothing distributed hangs off this graph
    frame = stack[-1]
    result = ddp.plan(w, root_edges, input_edges, accumulate, frame.world_size)
    if isinstance(result, str):
        raise Fallback(result)
    frame.hooks = result


__all__ = ["install", "global_fallback_reason", "run_engine", "active", "check_graph"]
