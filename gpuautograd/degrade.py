"""One way to report what still runs correctly, only slower: an eager fallback, a plan that runs
its kernels without replay, a kernel that runs as reference ops, a plan cache that thrashes.

torch.compile's convention for graph breaks: each report is logged to the "gpuautograd" logger
once per reason (until gpuautograd.reset()), and its caller counts it in stats(). It becomes a
Python RuntimeWarning only when GPUAUTOGRAD_WARN_FALLBACKS=1: a warning changes what code that
counts warnings, or turns them into errors, does. Errors and wrong results never come here; they
raise.
"""

from __future__ import annotations

import logging
import sys
import warnings

from . import flags
from .runtime import stats as stats_module

LOG = logging.getLogger("gpuautograd")


class Fallback(Exception):
    """This backward can't be honored functionally; run eager autograd instead (reason in args).
    Raised by the engine, and by the distributed planner it calls (which so needs no import of it)."""


def report(message: str) -> None:
    """Log `message` once (per gpuautograd.reset()); also warn when the flag asks for it."""
    reported = stats_module.STATS.warned
    if message in reported:
        return
    reported.add(message)
    LOG.warning(message)
    if flags.warn_fallbacks():
        warnings.warn(message, RuntimeWarning, stacklevel=user_stacklevel())


def describe_error(e: BaseException) -> str:
    """An exception in one line, for a report's reason: its type and the first line of its message."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def user_stacklevel() -> int:
    """The stacklevel, for a warnings.warn in our caller, that points at the first frame outside
    gpuautograd."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("gpuautograd"):
        frame, level = frame.f_back, level + 1
    return level


__all__ = ["report", "LOG", "describe_error", "user_stacklevel"]
