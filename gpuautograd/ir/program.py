"""The program: SSA values, instructions and the binding of inputs and outputs.

A program is a straight-line list of instructions. Every instruction defines fresh values; an
operand is either a Value or a Python scalar literal (bool, int or float). Inputs say where the
runtime finds each tensor (a root gradient, a saved tensor, a live node); outputs say where each
gradient goes (a leaf's .grad, a retained non-leaf, a result of grad()).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .printer import format_program
from .types import NodeType, TensorType

Scalar = bool | int | float | complex


class Value:
    __slots__ = ("id", "type", "origin", "prefix")

    def __init__(self, id: int, type: TensorType | NodeType, origin: str | None, prefix: str = "") -> None:
        self.id = id
        self.type = type
        self.origin = origin  # the autograd node this value was computed for
        self.prefix = prefix  # "g" root gradient, "s" saved tensor, "n" node, "" computed

    @property
    def name(self) -> str:
        return f"%{self.prefix}{self.id}"

    # Shorthands that rules use all the time.
    @property
    def shape(self) -> tuple[int, ...]:
        return self.type.shape

    @property
    def dtype(self):
        return self.type.dtype

    @property
    def device(self):
        return self.type.device

    @property
    def ndim(self) -> int:
        return len(self.type.shape)

    def __repr__(self) -> str:
        return f"{self.name}: {self.type}"


Operand = Value | Scalar


@dataclass
class Instr:
    op: str
    inputs: tuple[Operand, ...]
    attrs: dict[str, Any]
    outputs: tuple[Value | None, ...]
    origin: str | None = None

    def values_in(self) -> list[Value]:
        return [x for x in self.inputs if isinstance(x, Value)]


@dataclass(frozen=True)
class InputSpec:
    """Where the runtime finds an input: ("grad", i), ("saved", slot) or ("node", node_index)."""

    kind: str
    index: int
    label: str = ""  # readable provenance, e.g. "MulBackward0.other"


@dataclass(frozen=True)
class OutputSpec:
    """Where a gradient goes: ("leaf", i) a leaf's .grad, ("retain", i) a retained non-leaf,
    ("input", i) the i-th result of grad()."""

    kind: str
    index: int
    label: str = ""
    slot: int = 0  # for "retain": which output of node `index` the retained tensor is
    # The custom Function outputs (node index, edge) it comes from, when it comes from nothing else:
    # undefined (None, as in eager) where each of those backwards returned None. None: always defined.
    sources: frozenset | None = None


@dataclass
class Program:
    inputs: list[tuple[Value, InputSpec]] = field(default_factory=list)
    instrs: list[Instr] = field(default_factory=list)
    outputs: list[tuple[Value | None, OutputSpec]] = field(default_factory=list)
    # the autograd nodes (walk indices) whose backward this program performs: their saved
    # tensors are released after it runs, as eager releases exactly the nodes it executes
    executed: list[int] = field(default_factory=list)
    declined: list[str] = field(default_factory=list)  # "Node: reason" for rules that declined

    def __str__(self) -> str:
        return format_program(self)

    def num_ops(self) -> int:
        return len(self.instrs)
