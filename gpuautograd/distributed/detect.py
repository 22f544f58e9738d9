"""Name what gpuautograd doesn't drive under torch.distributed, so that a fallback says why.

Everything here only reads public classes and Python attributes; it never decides that something
is supported, only how to describe something that isn't.
"""

from __future__ import annotations

import torch


def _fsdp1_flat_parameter_class():
    try:
        from torch.distributed.fsdp._flat_param import FlatParameter
    except Exception:
        return None
    return FlatParameter


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except Exception:
        try:
            from torch.distributed._tensor import DTensor
        except Exception:
            return None
    return DTensor


def composable_wrappers() -> list[str]:
    """The composable distributed APIs (FSDP2's `fully_shard`, `replicate`) that manage live
    modules in this process. They run their gradient collectives from hooks and final callbacks
    of the autograd engine, which a functional backward does not run."""
    try:
        from torch.distributed import _composable_state
    except Exception:
        return []
    names = set()
    for state_ref in list(_composable_state._module_state_mapping.values()):
        state = state_ref()
        if state is None:
            continue
        cls = type(state)
        module = cls.__module__
        if cls.__name__ == "FSDPState":
            names.add("FSDP2 (fully_shard)")
        elif "fsdp" in module:
            names.add(f"FSDP ({cls.__name__})")
        elif "replicate" in module:
            names.add("replicate()")
        elif "checkpoint" not in module:  # composable activation checkpointing needs no collective
            names.add(f"{cls.__name__} ({module})")
    return sorted(names)


def describe_unknown_leaf(var: torch.Tensor) -> str:
    """Why a leaf of a multi-rank backward can't run functionally: its AccumulateGrad node may carry
    C++ hooks that gpuautograd can neither see nor run."""
    shape = list(var.shape)
    flat = _fsdp1_flat_parameter_class()
    if flat is not None and isinstance(var, flat):
        return f"a FullyShardedDataParallel (FSDP1) flat parameter {shape} is a leaf; its gradient hooks live in C++"
    dtensor = _dtensor_class()
    if dtensor is not None and isinstance(var, dtensor):
        return f"a DTensor parameter {shape} is a leaf (tensor parallel or FSDP2); its gradient hooks are not run functionally"
    wrappers = composable_wrappers()
    if wrappers:
        return f"{', '.join(wrappers)} manages modules in this process; its gradient collectives run from hooks gpuautograd does not drive"
    return (
        f"a leaf {shape} ({var.dtype}) is not a parameter of a DistributedDataParallel that gpuautograd knows, so C++ hooks "
        "on its AccumulateGrad node would be skipped (DDP modules built before `import gpuautograd` are not known)"
    )


def python_node_tag(node_class) -> str | None:
    """For a custom Function's backward node class: "ddp_sink" for DDP's _DDPSink, a reason for
    an FSDP-internal Function, else None."""
    forward_cls = getattr(node_class, "_forward_cls", None)
    if forward_cls is None:
        return None
    try:
        from torch.nn.parallel.distributed import _DDPSink
    except Exception:
        _DDPSink = None
    if _DDPSink is not None and forward_cls is _DDPSink:
        return "ddp_sink"
    module = getattr(forward_cls, "__module__", "") or ""
    if module.startswith("torch.distributed.fsdp"):
        return f"the graph contains FSDP's {forward_cls.__name__}, whose backward runs FSDP's gradient collectives"
    return None
