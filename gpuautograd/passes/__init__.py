"""Pure Program -> Program passes, run in a fixed pipeline, each named and timed."""

from __future__ import annotations

import time

from ..ir.program import Program
from .cse import common_subexpression_elimination
from .dce import dead_code_elimination
from .view_fold import view_folding

PIPELINE = (
    ("view_folding", view_folding),
    ("cse", common_subexpression_elimination),
    ("dce", dead_code_elimination),
)


def optimize(program: Program, timings: dict[str, float] | None = None) -> Program:
    for name, fn in PIPELINE:
        start = time.perf_counter()
        program = fn(program)
        if timings is not None:
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
    return program


__all__ = ["optimize", "dead_code_elimination", "common_subexpression_elimination", "view_folding", "PIPELINE"]
