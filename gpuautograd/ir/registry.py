"""The one table of IR ops, and how a row gets into it.

Each op module registers its rows here (`ops` the primitive ops, `composite_ops`, `extern_ops`,
`extern_sequence_ops`, `linalg_ops`, `decomposition_ops`, `complex_ops` the others); the package's
`__init__` imports every one of them, so that the table is whole before anything reads it. Imports
point one way: an op module imports this registry, nothing here imports an op module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .types import TensorType

# kinds, which later passes and fusion key on
POINTWISE = "pointwise"
REDUCTION = "reduction"
LAYOUT = "layout"  # reshape, permute, expand, slices: pure indexing, no arithmetic
INDEX = "index"  # gather / scatter / index_put: data-dependent indexing
CREATION = "creation"
SCAN = "scan"  # cumulative ops along one dim: the output has the input's shape
EXTERN = "extern"  # one library call (matmul, convolution backward, attention backward, ...)
OPAQUE = "opaque"  # a call of Python on the host: a live autograd node, or a node's hooks
COMPOSITE = "composite"  # one aten backward kernel for the reference executor; `decompose` for fusion


@dataclass(frozen=True)
class OpDef:
    name: str
    kind: str
    impl: Callable[..., Any]
    infer: Callable[[list, dict], list]
    view: bool = False  # the output may alias the first input
    effect: bool = False  # must run even if its outputs are unused
    decompose: Callable[..., Any] | None = None  # composites: (builder, *inputs, **attrs) -> outputs in primitive ops

    def __call__(self, *args, **kwargs):
        return self.impl(*args, **kwargs)


OPS: dict[str, OpDef] = {}


def register_op(name: str, kind: str, infer=None, *, view: bool = False, effect: bool = False, decompose=None):
    """Decorator: register `impl` as the reference implementation of op `name`."""

    def deco(impl):
        if name in OPS:
            raise ValueError(f"IR op {name!r} is registered twice")
        OPS[name] = OpDef(name, kind, impl, infer or _infer_by_meta(impl), view, effect, decompose)
        return impl

    return deco


def get_op(name: str) -> OpDef:
    try:
        return OPS[name]
    except KeyError:
        raise KeyError(f"unknown IR op {name!r}; known ops: {sorted(OPS)}") from None


# ---------------------------------------------------------------------------------------------
# Inference helpers


def _meta(t: TensorType) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def first_device(in_types) -> torch.device:
    for t in in_types:
        if isinstance(t, TensorType):
            return t.device
    return torch.device("cpu")


def _infer_by_meta(impl):
    """Infer output types by running the reference implementation on meta tensors."""

    def infer(in_types, attrs):
        args = [_meta(t) if isinstance(t, TensorType) else t for t in in_types]
        out = impl(*args, **attrs)
        device = attrs.get("device") or first_device(in_types)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [None if o is None else TensorType(tuple(o.shape), o.dtype, torch.device(device)) for o in outs]

    return infer
