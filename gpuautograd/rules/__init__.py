"""Functional backward rules, one registry (registry.py), grouped by family in modules."""

import importlib

from .registry import RULES, lookup, register

# Each family module registers its rules on import.
for _family in ("pointwise", "reductions", "norms", "views", "indexing", "linalg", "nn", "activations", "losses", "shape_ops", "math"):
    try:
        importlib.import_module(f"{__name__}.{_family}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{_family}":
            raise

__all__ = ["RULES", "lookup", "register"]
