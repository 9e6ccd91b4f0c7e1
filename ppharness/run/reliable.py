"""Idempotent hops: every message that must arrive is resent until its receiver acknowledges it.

A sender puts each such message in its ``Outbox`` under a key, ``(kind, request_id, position)``, that names it
uniquely within the run's plan; the receiver answers every copy it gets with an ``Ack`` of that key and acts only on
the first (``ppharness.run.stage`` keeps the positions it has taken). A message with no Ack in time is sent again,
after a retransmission timeout computed as TCP does (RFC 6298: smoothed round trip plus four deviations, measured only
on messages sent once, Karn's rule), doubled on every resend up to a ceiling, with jitter so that two senders that
lost messages together do not resend together. A message still unacknowledged after the retry budget is given up.

Targets are roles (``next``, ``entry``, ``client``...) resolved at each send, so a message queued before a spare
replaced its receiver goes to the replacement. The outbox is polled from its owner's loop (``due_in`` and ``tick``):
a stage serves one thread, and a retry is one more event among its messages, not a blocking call.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ppharness.errors import HarnessError
from ppharness.wire.messages import Ack, Message

if TYPE_CHECKING:
    from ppharness.seams.transport import Sent

Key = tuple[str, str, int]  # (kind, request_id, position)
POLICIES = ("none", "retry", "failover")


@dataclass(frozen=True)
class RetryPolicy:
    """How a sender waits for an Ack: ``first_s`` before the first resend (until a round trip is measured),
    never less than ``min_s``, doubling per resend up to ``max_s``, with +- ``jitter`` of each wait drawn at random;
    given up after ``budget_s`` without an Ack."""

    first_s: float = 0.25
    min_s: float = 0.05
    max_s: float = 2.0
    budget_s: float = 300.0
    jitter: float = 0.25


class GaveUp(HarnessError):
    """A message was never acknowledged within the retry budget."""


@dataclass
class _Pending:
    role: str
    msg: Message
    first_ns: float  # when it was first sent
    sent_at: float  # when it was last sent
    due: float  # when it is sent again
    sends: int = 1
    address: str = ""  # where it last went (an Ack must come from there)


@dataclass
class _Rto:
    """RFC 6298's estimator for one target role."""

    srtt: float | None = None
    rttvar: float = 0.0

    def sample(self, rtt: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt

    def timeout(self, policy: RetryPolicy) -> float:
        if self.srtt is None:
            return policy.first_s
        return min(policy.max_s, max(policy.min_s, self.srtt + 4 * self.rttvar))


@dataclass
class Outbox:
    """Messages awaiting their Ack. ``send(address, msg)`` puts one on the wire; ``resolve(role)`` is the role's
    address now (None: unknown yet, try again later); ``stamp(msg)`` refreshes a message before a resend (the run's
    epoch may have moved on)."""

    send: Callable[[str, Message], Sent]
    resolve: Callable[[str], str | None]
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    stamp: Callable[[Message], Message] = lambda m: m
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    on_resend: Callable[[Key, str], None] = lambda key, role: None  # told of every resend, before it goes
    pending: dict[Key, _Pending] = field(default_factory=dict)
    rto: dict[str, _Rto] = field(default_factory=dict)
    resends: int = 0  # messages sent again, over the outbox's life

    def put(self, key: Key, role: str, msg: Message) -> Sent | None:
        """Send ``msg`` to ``role`` now and keep it until ``key`` is acknowledged; the send's report (None when it
        could not go yet)."""
        now = self.clock()
        item = _Pending(role, msg, now, now, now)
        self.pending[key] = item
        return self._transmit(item, now, first=True)

    def _transmit(self, item: _Pending, now: float, first: bool) -> Sent | None:
        backoff = 1 if first else 2 ** min(item.sends - 1, 30)
        wait = min(self.rto.setdefault(item.role, _Rto()).timeout(self.policy) * backoff, self.policy.max_s)
        wait *= 1 + self.policy.jitter * (2 * self.rng.random() - 1)
        item.due = now + wait
        address = self.resolve(item.role)
        if address is None:
            return None
        item.address, item.sent_at = address, now
        try:
            return self.send(address, item.msg)
        except HarnessError:
            return None  # the peer is gone or unreachable: the next resend tries again, maybe at a replacement

    def ack(self, sender: str, msg: Ack) -> bool:
        """Take an Ack; True when it settled a pending message (from the address that message last went to)."""
        return self.settle((msg.kind, msg.request_id, msg.position), sender)

    def settle(self, key: Key, sender: str) -> bool:
        """``key`` is answered by ``sender``, as by its Ack (an answer that stands for one: an ExpertResult); True
        when that settled a pending message (from the address that message last went to)."""
        item = self.pending.get(key)
        if item is None or sender != item.address:
            return False
        if item.sends == 1:  # Karn: a resent message's Ack may answer any copy, so it says nothing of the round trip
            self.rto.setdefault(item.role, _Rto()).sample(self.clock() - item.sent_at)
        del self.pending[key]
        return True

    def drop(self, keep: Callable[[Key, str], bool]) -> None:
        """Forget pending messages ``keep(key, role)`` rejects (a replay that carries them replaces them)."""
        self.pending = {k: v for k, v in self.pending.items() if keep(k, v.role)}

    def redirect(self) -> int:
        """Make every pending message whose role now resolves elsewhere (a spare replaced its receiver) due at once,
        instead of after its backed-off wait; returns how many."""
        now, moved = self.clock(), 0
        for item in self.pending.values():
            address = self.resolve(item.role)
            if address is not None and address != item.address:
                item.due, moved = now, moved + 1
        return moved

    def due_in(self) -> float | None:
        """Seconds until the next resend (0 when one is due), None when nothing waits."""
        if not self.pending:
            return None
        return max(0.0, min(p.due for p in self.pending.values()) - self.clock())

    def tick(self) -> None:
        """Resend what is due; raise GaveUp for a message unacknowledged past the budget."""
        now = self.clock()
        for key, item in list(self.pending.items()):
            if item.due > now:
                continue
            if now - item.first_ns > self.policy.budget_s:
                del self.pending[key]
                raise GaveUp(
                    f"no acknowledgement of {key[0]} {key[2]} of request {key[1]} from {item.role} after "
                    f"{item.sends} sends in {now - item.first_ns:.1f} s"
                )
            item.sends += 1
            self.resends += 1
            self.on_resend(key, item.role)
            item.msg = self.stamp(item.msg)
            self._transmit(item, now, first=False)


def ack_of(kind: str, request_id: str, position: int, plan_id: str) -> Ack:
    return Ack(kind=kind, request_id=request_id, position=position, plan_id=plan_id)
