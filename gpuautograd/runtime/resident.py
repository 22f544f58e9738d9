"""Resident bytes: what a cached plan keeps allocated between calls.

A bound plan (cudagraph, interpret-replay) holds its arena of intermediates, static buffers for
library results, static mirrors of library inputs, the pointer table and its copy descriptors,
and on CUDA the private memory pool of its captured graphs. `BoundProgram.held_tensors()` lists
the tensors, each with a kind; here their distinct storages are counted once each (views of one
arena are one storage), by the storage's own size. The graph pool is what the caching allocator
reserved for the pool during capture (a `memory_reserved` delta), which BoundProgram measures.

Not counted: tensors the plan reads but does not own (a parameter a library call reads in place),
the pinned host buffers of the table (host memory, a few words a slot), cuBLAS workspaces, and
what the caching allocator keeps cached outside the plan. Plans that hold nothing between calls
(reference, and fused plans without replay, which allocate their arena per call) count 0.

Computed when a plan is bound and again after its first call (mirrors and graphs exist only from
then on), never on a cache hit.
"""

from __future__ import annotations

import torch

# Kinds in the order a storage shared by two of them is counted (the first one wins).
KINDS = ("arena", "static", "mirror", "table", "host_copy", "other", "graph_pool")


def count(held: list[tuple[str, torch.Tensor]], extra: dict[str, int] | None = None) -> dict[str, int]:
    """Bytes per kind of the distinct storages in `held` ((kind, tensor) pairs), plus `extra`
    (bytes measured otherwise, such as a CUDA graph pool). Kinds with no bytes are left out."""
    order = {kind: k for k, kind in enumerate(KINDS)}
    seen: dict[tuple, str] = {}
    sizes: dict[tuple, int] = {}
    for kind, t in sorted(held, key=lambda kt: order.get(kt[0], len(KINDS))):
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen[key] = kind
        sizes[key] = storage.nbytes()
    out: dict[str, int] = {}
    for key, kind in seen.items():
        out[kind] = out.get(kind, 0) + sizes[key]
    for kind, n in (extra or {}).items():
        if n:
            out[kind] = out.get(kind, 0) + n
    return out


def of(compiled) -> dict[str, int]:
    """The resident bytes per kind of a compiled plan (as last computed; empty: it holds nothing)."""
    return getattr(compiled, "resident", None) or {}


def total(compiled) -> int:
    return sum(of(compiled).values())


__all__ = ["KINDS", "count", "of", "total"]
