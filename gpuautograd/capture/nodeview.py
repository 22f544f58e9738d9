"""What a rule sees of one autograd node: its saved values as IR values or Python constants,
its metadata, and which of its edges need a gradient."""

from __future__ import annotations

from typing import Any

from ..ir.types import TensorType

_INT64_WRAP = 1 << 64
_INT64_MAX = (1 << 63) - 1


def as_signed(value: Any) -> Any:
    """torch hands saved int64 values (dims, indices, ignore_index) to Python as unsigned 64-bit
    numbers (-1 reads as 2**64 - 1); fold them back, in ints and in tuples of ints."""
    if isinstance(value, (tuple, list)):
        return tuple(as_signed(v) for v in value)
    if isinstance(value, int) and not isinstance(value, bool) and value > _INT64_MAX:
        return value - _INT64_WRAP
    return value


class NodeView:
    def __init__(
        self,
        name: str,
        saved: dict[str, Any],
        input_types: list,
        output_types: list,
        needs: list[bool],
        contiguous: dict | None = None,
        geometry=None,
    ) -> None:
        self.name = name
        self._saved = saved  # attribute name without "_saved_" -> Value, list of Values or constant
        self.input_types = input_types  # TensorType per forward output (gradient flowing in)
        self.output_types = output_types  # TensorType or None per edge (what the next node expects)
        self._needs = needs
        self._contiguous = contiguous or {}  # saved tensor name -> whether it was contiguous at capture
        self._geometry = geometry

    def input_geometry(self):
        """(sizes, strides, storage offset) of the node's forward input where autograd keeps it in
        C++ only (as_strided) and the cache key guards it (the native walker's), else None."""
        return self._geometry() if self._geometry is not None else None

    def saved(self, name: str) -> Any:
        """The saved value `name` (as in `grad_fn._saved_<name>`): a Value for a tensor, a list of
        Values (or None) for a tensor list, else the Python constant."""
        try:
            return self._saved[name]
        except KeyError:
            raise KeyError(f"{self.name} has no saved value {name!r}; it has {sorted(self._saved)}") from None

    def saved_is_contiguous(self, name: str) -> bool:
        """Whether the saved tensor `name` is contiguous. The cache key holds every saved tensor's
        strides, so a program that depends on this is only reused for the same layout (torch's
        linalg_solve factors A^T instead of A when A is contiguous, for one)."""
        try:
            return self._contiguous[name]
        except KeyError:
            raise KeyError(f"{self.name}: no layout recorded for saved tensor {name!r}") from None

    def saved_tensors(self):
        """Every saved tensor's Value, tensor lists included."""
        for v in self._saved.values():
            for x in v if isinstance(v, (list, tuple)) else (v,):
                if hasattr(x, "type") and isinstance(x.type, TensorType):
                    yield x

    def has_saved(self, name: str) -> bool:
        return name in self._saved

    @property
    def num_outputs(self) -> int:
        """The number of `next_functions` edges, i.e. of gradients the rule returns."""
        return len(self.output_types)

    def needs(self, i: int) -> bool:
        """Whether edge i leads to a node that uses its gradient."""
        return self._needs[i]

    def input_type(self, i: int = 0) -> TensorType:
        return self.input_types[i]

    def output_type(self, i: int) -> TensorType | None:
        return self.output_types[i]

    def __repr__(self) -> str:
        return f"NodeView({self.name}, saved={sorted(self._saved)})"
