"""Counters that `gpuautograd.stats()` reports."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class Stats:
    captures: int = 0
    cache_hits: int = 0
    cache_misses: list[str] = field(default_factory=list)  # the guard that failed, per miss
    fallbacks: collections.Counter = field(default_factory=collections.Counter)  # reason -> count
    pass_seconds: dict[str, float] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)  # fallback reasons already warned about

    def snapshot(self) -> dict:
        return {
            "captures": self.captures,
            "cache_hits": self.cache_hits,
            "cache_misses": len(self.cache_misses),
            "miss_reasons": list(self.cache_misses),
            "fallbacks": dict(self.fallbacks),
            "pass_seconds": dict(self.pass_seconds),
        }


STATS = Stats()


def reset() -> None:
    global STATS
    STATS.__init__()
