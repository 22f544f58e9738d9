"""A time budget shared by the steps of one command: each step gets a share of what is left, a
step that cannot start in what is left is skipped, and one that runs over its share is interrupted.

The interruption is a SIGALRM timer (main thread, POSIX): the step's Python code gets a
`StepTimeout` at its next bytecode, so a step stuck inside one long C call ends when that call
returns. Whatever the steps do, the caller gets a row per step and can always write its JSON.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from contextlib import contextmanager

from .modes import first_line

# Below this many seconds a step is not started: a training size's first call alone takes longer.
MIN_START_S = 3.0
# Kept back from the last step's share, for writing the results after it.
RESERVE_S = 2.0


class StepTimeout(BaseException):
    """Raised in the running step when its share is spent (a BaseException, so that the step's own
    `except Exception` handlers do not swallow it)."""


class Terminated(BaseException):
    """SIGTERM arrived (a job's timeout, a kill): the caller still writes what it has."""


@contextmanager
def terminate_raises():
    """Turn SIGTERM into Terminated for the block."""

    def on_term(signum, frame):
        raise Terminated("interrupted by SIGTERM")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def time_limit(seconds: float | None):
    """Raise StepTimeout in this (main) thread after `seconds`; None means no limit."""
    if seconds is None or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise StepTimeout(f"ran past its share of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Budget:
    """The seconds left to a command, handed out step by step. `total_s` None: no limit."""

    def __init__(self, total_s: float | None, clock: Callable[[], float] = time.monotonic):
        self.total_s, self.clock = total_s, clock
        self.start = clock()

    def left(self) -> float | None:
        return None if self.total_s is None else self.total_s - (self.clock() - self.start)

    def share(self, steps_left: int, weight: float = 1.0, weights_left: float | None = None) -> float | None:
        """This step's seconds: its weight's part of what is left, minus the reserve."""
        left = self.left()
        if left is None:
            return None
        weights_left = weights_left if weights_left is not None else float(steps_left)
        return max(0.0, (left - RESERVE_S) * weight / max(weights_left, weight))

    def run(self, name: str, fn: Callable[[dict], None], share: float | None, row: dict) -> dict:
        """Run `fn(row)` under `share` seconds and fill the row's status: ok, skipped (no time to
        start), timed_out (interrupted; what fn put in the row before stays) or error."""
        row.setdefault("status", "ok")
        row.setdefault("reason", None)
        row["share_s"] = None if share is None else round(share, 1)
        if share is not None and share < MIN_START_S:
            row.update(status="skipped", reason=f"{share:.0f} s of the budget left for it, under the {MIN_START_S:.0f} s a start needs")
            return row
        t0 = self.clock()
        try:
            with time_limit(share):
                fn(row)
        except StepTimeout as e:
            row.update(status="timed_out", reason=f"{name}: {e}")
        except Exception as e:  # one failing step must not lose the others' figures
            row.update(status="error", reason=f"{name}: {first_line(e)}")
        row["elapsed_s"] = round(self.clock() - t0, 2)
        return row
