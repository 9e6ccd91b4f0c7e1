"""When a run's timed events happen: seconds since the request started, on a clock every process of the run shares.

The orchestrator sends every node a ``NetworkStart`` with the wall-clock time (Unix, ns) at which it sends the
request; each node's emulation layer counts event times from it. Processes on one machine (or containers on one
kernel) share that clock exactly; across machines it is as good as their clock sync (NTP: milliseconds, against event
times in seconds). Before the start, no event holds.
"""

from __future__ import annotations

import threading
import time


class EventClock:
    def __init__(self) -> None:
        self._t0_ns: int | None = None
        self._lock = threading.Lock()

    def start(self, t0_unix_ns: int) -> None:
        """Count from ``t0_unix_ns`` (the first start wins: a repeated NetworkStart changes nothing)."""
        with self._lock:
            if self._t0_ns is None:
                self._t0_ns = t0_unix_ns

    @property
    def started(self) -> bool:
        return self._t0_ns is not None

    def elapsed(self) -> float | None:
        """Seconds since the start, or None before it."""
        t0 = self._t0_ns
        return None if t0 is None else (time.time_ns() - t0) / 1e9
