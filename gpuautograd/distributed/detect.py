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


FSDP2 = "FSDP2 (fully_shard)"
FSDP2_POST_BACKWARD = "fsdp2_post_backward"


def _composable_states() -> list:
    try:
        from torch.distributed import _composable_state
    except Exception:
        return []
    return [s for s in (ref() for ref in list(_composable_state._module_state_mapping.values())) if s is not None]


def composable_wrappers() -> list[str]:
    """The composable distributed APIs other than FSDP2 (`replicate`, ...) that manage live modules
    in this process. They run their gradient collectives from hooks and final callbacks of the
    autograd engine that gpuautograd does not drive. (FSDP2's run at the program's yield points.)"""
    names = set()
    for state in _composable_states():
        cls = type(state)
        module = cls.__module__
        if cls.__name__ == "FSDPState":
            continue
        if "fsdp" in module:
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


def fsdp2_leaves() -> set[int]:
    """The ids of the unsharded parameters of every live FSDP2 module: the leaves its forward used.
    FSDP2 reads their .grad in its post-backward (RegisterPostBackwardFunction) and reduce-scatters
    it into the sharded DTensor parameter's .grad; no hook hangs on their AccumulateGrad nodes."""
    ids = set()
    for state in _composable_states():
        if type(state).__name__ != "FSDPState":
            continue
        groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13; 2.11 has one group
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", ()):
                param = getattr(fsdp_param, "_unsharded_param", None)
                if param is not None:
                    ids.add(id(param))
    return ids


def python_node_tag(node_class) -> str | None:
    """For a custom Function's backward node class: "ddp_sink" for DDP's _DDPSink,
    FSDP2_POST_BACKWARD for FSDP2's post-backward, a reason for another FSDP-internal Function,
    else None."""
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
    if module.startswith("torch.distributed.fsdp._fully_shard") and forward_cls.__name__ == "RegisterPostBackwardFunction":
        return FSDP2_POST_BACKWARD
    if module.startswith("torch.distributed.fsdp"):
        return f"the graph contains FSDP's {forward_cls.__name__}, whose backward runs FSDP's gradient collectives"
    return None
