"""The floor of a backward's memory traffic: the bytes any backward run apart from its forward and
optimizer must touch. Every saved tensor and incoming gradient it reads, once (a tensor several
nodes save counts once), and every gradient it returns, once. `explain().compulsory_bytes` puts it
beside `bytes_moved`, so that a plan shows how far it is from its limit."""

from __future__ import annotations

import torch

from ..fusion.indexing import span_elements
from ..ir.program import Program


def footprint(t: torch.Tensor) -> int:
    """The bytes a tensor's elements occupy: an expanded (stride-0) tensor is charged at the size it
    really has in memory, not at its expanded size; a strided view (a slice of a wider buffer) at
    its elements' size, not at the span between its first and last."""
    return min(span_elements(t.shape, t.stride()), t.numel()) * t.element_size()


def compulsory_bytes(program: Program, arguments: list) -> int:
    """`arguments`: the program's argument list, in program.inputs order (nodes among them ignored)."""
    seen: set[tuple] = set()
    total = 0
    for t in arguments:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            continue
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += footprint(t)
    returned: set[int] = set()
    for v, _ in program.outputs:
        if v is not None and id(v) not in returned:
            returned.add(id(v))
            total += v.type.numel() * v.type.dtype.itemsize
    return total
