"""pytest plugin for ci/yardstick.py: with GPUAUTOGRAD_YARDSTICK=enable, every test runs inside
`with gpuautograd.enable():`, and records (as a junit property) whether any of its backwards ran
functionally (a capture or a cache hit) or fell back to eager. Without the variable it does nothing,
so the same command line also gives the plain-torch run."""

from __future__ import annotations

import os

import pytest

ENV = "GPUAUTOGRAD_YARDSTICK"


def _counts(stats: dict) -> tuple[int, int]:
    return stats["captures"] + stats["cache_hits"], sum(stats["fallbacks"].values())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    if os.environ.get(ENV) != "enable":
        yield
        return
    import gpuautograd

    functional_before, fallback_before = _counts(gpuautograd.stats())
    with gpuautograd.enable():
        yield
    functional_after, fallback_after = _counts(gpuautograd.stats())
    if functional_after > functional_before:
        item.user_properties.append(("gpuautograd", "functional"))
    if fallback_after > fallback_before:
        item.user_properties.append(("gpuautograd", "fallback"))
