"""The planner's time limit: a deadline its searches look at between steps, and what was cut short when it passed
(``ppharness plan make --time-limit`` says it with the best plan found so far)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

DEFAULT_SECONDS = 60.0  # ``plan make``'s limit unless told otherwise
MAX_SECONDS = 24 * 3600.0


@dataclass
class Budget:
    """``seconds`` from its making (None: no limit). ``phase`` is what the planner is doing now; ``ran_out`` the
    phase that was running when the limit passed (None while it has not)."""

    seconds: float | None = None
    start: float = field(default_factory=time.monotonic)
    phase: str = "planning"
    ran_out: str | None = None

    def expired(self) -> bool:
        """Whether the limit has passed (noting the phase it passed in, the first time)."""
        if self.ran_out is not None:
            return True
        if self.seconds is None or time.monotonic() - self.start <= self.seconds:
            return False
        self.ran_out = self.phase
        return True

    def left(self) -> float | None:
        """Seconds left (None: no limit; never below 0)."""
        return None if self.seconds is None else max(0.0, self.seconds - (time.monotonic() - self.start))

    def elapsed(self) -> float:
        return time.monotonic() - self.start
