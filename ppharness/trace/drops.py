"""One bounded log of dropped messages per process.

Every place a process refuses a message (a role it does not hold, a row of an unknown request, a position out of
turn, an old epoch, another plan, a directory not from the seed) reports it here. The process logs its first
``MAX_DROP_LINES`` drops in full; after that each drop is only counted, per reason and sender, and a summary line
(the total and the largest counts) is logged at every power of ten and once more when the process closes. A member
that floods a stage with messages its role does not send costs that stage a counter, not a log: 40,000 forgeries make
16 lines and a handful of summaries. The count keeps at most ``MAX_DROP_KEYS`` reason-sender pairs; further pairs are
counted together.

Each line goes to the log of the part that dropped the message (a stage's, the orchestrator's progress), so it reads
where it did before; only the budget is the process's.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

MAX_DROP_LINES = 16  # dropped messages logged one line each, per process; later ones are counted
MAX_DROP_KEYS = 64  # (reason, sender) pairs counted apart; the rest share one count
SHOWN = 6  # counts a summary line names, the largest first
OTHERS = ("other reasons", "other senders")


def fingerprinted(address: str) -> str:
    """An address as a line shows it: a key it carries (``tcp://h:p?curve=<64 hex>``) cut to its first 8 hex digits,
    its fingerprint; another long address (an iroh ticket) cut short."""
    base, sep, query = address.partition("?")
    name, eq, key = query.partition("=")
    if sep and eq and len(key) > 8:
        return f"{base[:80]} ({name[:16]} key {key[:8]})"
    return address if len(address) <= 72 else f"{address[:48]}... ({len(address)} characters)"


class ProcessDrops:
    """The process's count of dropped messages (module docstring)."""

    def __init__(self, limit: int = MAX_DROP_LINES, max_keys: int = MAX_DROP_KEYS):
        self.limit, self.max_keys = limit, max_keys
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget every drop (a test's fresh start)."""
        with self._lock:
            self.dropped = 0
            self.counts: Counter[tuple[str, str]] = Counter()
            self._summarised = 0  # the total at the last summary line

    def drop(self, log: Callable[[str], None], line: str, reason: str, sender: str) -> None:
        """One message dropped for ``reason`` (a few words) from ``sender`` (an address): ``line`` goes to ``log``
        while the process's budget of lines lasts, then only the count grows."""
        with self._lock:
            self.dropped += 1
            n = self.dropped
            if n <= self.limit:
                out = line + ("" if n < self.limit else "; further drops are counted per reason and sender")
            else:
                key = (reason, fingerprinted(sender))
                if key not in self.counts and len(self.counts) >= self.max_keys:
                    key = OTHERS
                self.counts[key] += 1
                out = self._summary() if str(n).rstrip("0") == "1" else ""
        if out:
            log(out)

    def close(self, log: Callable[[str], None]) -> None:
        """The last summary, when drops were counted since the one before."""
        with self._lock:
            out = self._summary() if self.dropped > max(self._summarised, self.limit) else ""
        if out:
            log(out)

    def _summary(self) -> str:
        self._summarised = self.dropped
        counted = sum(self.counts.values())
        top = self.counts.most_common(SHOWN)
        rest = len(self.counts) - len(top)
        return (
            f"{self.dropped} messages dropped so far (the first {self.limit} logged above, {counted} counted): "
            + "; ".join(f"{c} {reason} from {sender}" for (reason, sender), c in top)
            + (f"; and {rest} more reason-sender pair(s)" if rest > 0 else "")
        )


PROCESS_DROPS = ProcessDrops()


class DropLog:
    """A part's handle on the process's drop log: ``drop(line, reason, sender)`` logs ``line`` to ``log`` while the
    process's lines last, then counts it."""

    def __init__(self, log: Callable[[str], None], drops: ProcessDrops = PROCESS_DROPS):
        self.log, self.drops = log, drops
        self.dropped = 0  # this part's own drops

    def __call__(self, line: str, reason: str = "dropped", sender: str = "") -> None:
        self.dropped += 1
        self.drops.drop(self.log, line, reason, sender)

    def close(self) -> None:
        """The process's last summary, to this part's log."""
        self.drops.close(self.log)
