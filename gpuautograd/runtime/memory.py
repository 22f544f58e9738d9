"""The memory plan: intermediates of one backward share one arena, reused by liveness.

Each buffer lives from the step that writes it to the last step that reads it (directly or
through a view). Buffers are placed first-fit at aligned offsets; a buffer may take the place of
one whose last reader ran strictly before its writer. Buffers that escape (a gradient the caller
receives, the input of a call that may return it) are not planned: they are allocated fresh.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..fusion.heuristics import ARENA_ALIGNMENT


@dataclass(frozen=True)
class Interval:
    key: str  # the value's name
    nbytes: int
    start: int  # step that writes it
    end: int  # last step that reads it


@dataclass
class MemoryPlan:
    offsets: dict[str, int]  # value name -> byte offset in the arena
    arena_bytes: int  # the planned peak
    total_bytes: int  # what the intermediates would take without reuse

    def summary(self) -> str:
        saved = 1 - self.arena_bytes / self.total_bytes if self.total_bytes else 0.0
        n = len(self.offsets)
        return f"arena {self.arena_bytes} bytes for {n} intermediates of {self.total_bytes} bytes in all ({saved:.0%} saved by reuse)"


def _align(n: int) -> int:
    return -(-n // ARENA_ALIGNMENT) * ARENA_ALIGNMENT


def plan_memory(intervals: list[Interval]) -> MemoryPlan:
    placed: list[tuple[int, int, int]] = []  # (offset, size, end step)
    offsets: dict[str, int] = {}
    peak = 0
    for iv in sorted(intervals, key=lambda iv: (iv.start, -iv.nbytes)):
        size = _align(max(iv.nbytes, 1))
        live = sorted((o, s) for o, s, end in placed if end >= iv.start)
        offset = 0
        for o, s in live:
            if offset + size <= o:
                break
            offset = max(offset, o + s)
        placed.append((offset, size, iv.end))
        offsets[iv.key] = offset
        peak = max(peak, offset + size)
    total = sum(_align(max(iv.nbytes, 1)) for iv in intervals)
    return MemoryPlan(offsets, peak, total)
