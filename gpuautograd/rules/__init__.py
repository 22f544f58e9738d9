"""Functional backward rules, one registry (registry.py), grouped by family in modules."""

from . import (  # noqa: F401 - each family module registers its rules on import
    activations,
    complex,
    decompositions,
    householder,
    indexing,
    linalg,
    losses,
    lu,
    math,
    nn,
    norms,
    pointwise,
    reductions,
    scans,
    scatter_reduce,
    sequence,
    shape_ops,
    solves,
    special,
    views,
)
from .registry import RULES, lookup, register

__all__ = ["RULES", "lookup", "register"]
