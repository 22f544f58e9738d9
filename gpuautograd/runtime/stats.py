"""Counters that `gpuautograd.stats()` reports."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

MISS_REASONS_KEPT = 64


@dataclass
class Stats:
    captures: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    miss_reasons: collections.deque = field(default_factory=lambda: collections.deque(maxlen=MISS_REASONS_KEPT))
    fallbacks: collections.Counter = field(default_factory=collections.Counter)  # reason -> count
    pass_seconds: dict[str, float] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)  # degradation messages already reported (gpuautograd.degrade)
    graph_captures: int = 0  # CUDA graphs captured (one per segment of a bound plan)
    replays: int = 0  # calls of a bound plan after its first
    not_graphed: collections.Counter = field(default_factory=collections.Counter)  # reason -> plans
    conformed: int = 0  # eager-step results copied into the layout the captured segments read
    kernel_fallbacks: collections.Counter = field(default_factory=collections.Counter)  # kernel -> plans running it as reference ops
    cache_thrash: int = 0  # captures of a key the plan cache had evicted (the working set exceeds GPUAUTOGRAD_CACHE_SIZE)
    cache_byte_evictions: int = 0  # plans evicted to keep the resident bytes within GPUAUTOGRAD_CACHE_BYTES
    cache_oversize: int = 0  # plans kept although each alone holds more than GPUAUTOGRAD_CACHE_BYTES
    walker: str | None = None  # "native" or "python": the walk of the latest backward
    python_walks: collections.Counter = field(default_factory=collections.Counter)  # why the native walker passed, per graph

    def record_miss(self, reason: str) -> None:
        """`reason`: the guard that failed, in words."""
        self.cache_misses += 1
        self.miss_reasons.append(reason)

    def snapshot(self) -> dict:
        return {
            "captures": self.captures,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "miss_reasons": list(self.miss_reasons),  # the most recent ones
            "fallbacks": dict(self.fallbacks),
            "pass_seconds": dict(self.pass_seconds),
            "graph_captures": self.graph_captures,
            "replays": self.replays,
            "not_graphed": dict(self.not_graphed),
            "conformed": self.conformed,
            "kernel_fallbacks": dict(self.kernel_fallbacks),
            "cache_thrash": self.cache_thrash,
            "cache_byte_evictions": self.cache_byte_evictions,
            "cache_oversize": self.cache_oversize,
            "walker": self.walker,
            "python_walks": dict(self.python_walks),
        }


STATS = Stats()


def reset() -> None:
    STATS.__init__()  # in place: other modules hold this very object
