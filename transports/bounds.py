"""Limits on what peers can make a transport spend: the refusal log, connection caps, the process's file limit.

A stranger (or a member) that keeps connecting must not fill stderr, memory or the process's file descriptors:

- ``RefusalLog`` logs the first ``MAX_REFUSAL_LOGS`` distinct refused keys one line each, then one line saying it no
  longer logs each one, then at most one count line per ``REFUSAL_COUNT_EVERY_S`` ("refused N more connections")
  and a last one at ``flush()`` (the transport's close); the recent keys are kept in a deque of ``RECENT_REFUSALS``;
- ``ConnectionCaps`` counts open connections by key (a host, an endpoint id) and admits one only while both its
  key's count and the total are under their caps;
- ``raise_open_file_limit`` lifts the process's soft ``RLIMIT_NOFILE`` to its hard limit, so a node under the common
  default of 1024 has room for the connections its caps allow next to the files its model needs.
"""

from __future__ import annotations

import resource
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable

MAX_REFUSAL_LOGS = 32  # distinct refused keys logged one line each; later refusals are counted
REFUSAL_COUNT_EVERY_S = 10.0  # once silenced, at most one "refused N more" line this often
RECENT_REFUSALS = 256  # refused keys remembered (most recent last)
FILE_LIMIT_CEILING = 1 << 20  # the soft limit raise_open_file_limit sets when the hard limit is unlimited


class RefusalLog:
    """Refused connections: remembered (``recent``, bounded), counted (``total``) and logged within bounds.

    ``log`` writes one line; ``where`` names the endpoint in every line. Safe to call from any thread."""

    def __init__(self, log: Callable[[str], None], where: Callable[[], str]) -> None:
        self.recent: deque[str] = deque(maxlen=RECENT_REFUSALS)
        self.total = 0
        self._log, self._where = log, where
        self._logged: set[str] = set()
        self._silenced = False
        self._unlogged = 0
        self._last_count = 0.0
        self._lock = threading.Lock()

    def refuse(self, key: str, line: str) -> None:
        """Record one refusal of ``key``; ``line`` is what is logged when this key is logged for the first time."""
        with self._lock:
            self.recent.append(key)
            self.total += 1
            if key in self._logged:
                return
            if len(self._logged) < MAX_REFUSAL_LOGS:
                self._logged.add(key)
                self._log(f"{self._where()}: {line}")
                return
            if not self._silenced:
                self._silenced = True
                self._last_count = time.monotonic()
                self._log(f"{self._where()}: refusing more strangers; no longer logging each one")
            self._unlogged += 1
            if time.monotonic() - self._last_count >= REFUSAL_COUNT_EVERY_S:
                self._write_count()

    def flush(self) -> None:
        """Log the count of refusals not yet logged, if any (the transport is closing)."""
        with self._lock:
            if self._unlogged:
                self._write_count()

    def _write_count(self) -> None:
        self._log(f"{self._where()}: refused {self._unlogged} more connections ({self.total} in all)")
        self._unlogged = 0
        self._last_count = time.monotonic()


class ConnectionCaps:
    """Open connections counted by key; ``admit`` says why one may not open (None: it may, and is counted)."""

    def __init__(self, total: int, per_key: int) -> None:
        self.total, self.per_key = total, per_key
        self.open: Counter[Hashable] = Counter()
        self.shed = 0  # connections refused because a cap was reached
        self._count = 0

    def refusal(self, key: Hashable) -> str | None:
        """Why one more connection of ``key`` may not open; None when it may (nothing is counted)."""
        if self._count >= self.total:
            return f"{self.total} connections are open, the most this endpoint allows"
        if self.open[key] >= self.per_key:
            return f"{self.per_key} connections of this peer are open, the most one peer may hold"
        return None

    def add(self, key: Hashable) -> None:
        self.open[key] += 1
        self._count += 1

    def admit(self, key: Hashable) -> str | None:
        """Count one more connection of ``key`` and return None, or count it shed and return why it may not open."""
        why = self.refusal(key)
        if why is None:
            self.add(key)
        else:
            self.shed += 1
        return why

    def release(self, key: Hashable) -> None:
        """One connection of ``key`` closed (one ``admit`` let in)."""
        if key not in self.open:
            return
        self._count -= 1
        if self.open[key] <= 1:
            del self.open[key]
        else:
            self.open[key] -= 1

    def count(self) -> int:
        return self._count


def raise_open_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (capped at ``FILE_LIMIT_CEILING`` when
    unlimited); never lowers it. Returns the soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FILE_LIMIT_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return FILE_LIMIT_CEILING if soft == resource.RLIM_INFINITY else soft
