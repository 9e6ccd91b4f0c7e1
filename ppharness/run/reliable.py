"""Idempotent hops: every message that must arrive is resent until its receiver acknowledges it.

A sender puts each such message in its ``Outbox`` under a key, ``(kind, request_id, position)``, that names it
uniquely within the run's plan; the receiver answers a copy with an ``Ack`` of that key (or a later message of the
chain stands for that Ack, below) and acts only on the first (``ppharness.run.stage.stage`` keeps the positions it has
taken). A message with no Ack in time is sent again, after a retransmission timeout computed as TCP does (RFC 6298:
smoothed round trip plus four deviations, measured only on messages sent once, Karn's rule), doubled on every resend
up to a ceiling, with jitter so that two senders that lost messages together do not resend together. A message still
unacknowledged after the retry budget is given up. A resend's backoff stays with its target role until a round trip
is measured again (RFC 6298, 5.5), so that a path slower than the first timeout is not resent on every message.

Acks cost a message each, so the chain's own traffic stands for most of them. Positions of one request travel each
hop in order, and a kind in ``CUMULATIVE`` is acknowledged through a position: an Ack of position p settles every
earlier one. A decode step is taken by every stage before the next begins, so a stage that is handed position q of a
request knows that every hop took each position before q: it settles those itself (``settle_through``) and its
receivers acknowledge only what no later message will stand for (a prompt's prefill, a request's last token, a copy
already taken).

Targets are roles (``next``, ``entry``, ``client``...) resolved at each send, so a message queued before a spare
replaced its receiver goes to the replacement. The outbox is polled from its owner's loop (``due_in`` and ``tick``):
a stage serves one thread, and a retry is one more event among its messages, not a blocking call.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ppharness.errors import HarnessError
from ppharness.wire.messages import Ack, Message

if TYPE_CHECKING:
    from ppharness.seams.transport import Sent

Key = tuple[str, str, int]  # (kind, request_id, position)
POLICIES = ("none", "retry", "failover")
# Kinds sent in position order along one path and taken only in that order: an Ack of position p stands for every
# position before it too.
CUMULATIVE = frozenset({"activation", "token", "stream"})
EVERY_POSITION = 2**62  # ``settle_through``'s bound that settles all of a request's positions
BACKOFF_MAX = 2**10
STREAM_ACK_EVERY = 8  # new positions of a stream acknowledged at once (its last, and any copy, at once)
STREAMS_KEPT = 1024  # streams a receiver keeps track of, and ended ones it remembers, at most


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
    backoff: int = 1  # the multiple of the role's timeout it waits now


@dataclass
class _Rto:
    """RFC 6298's estimator for one target role."""

    srtt: float | None = None
    rttvar: float = 0.0
    backoff: int = 1  # a resend's doubling, kept for the role's next messages until a round trip is measured

    def sample(self, rtt: float) -> None:
        self.backoff = 1
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
        rto = self.rto.setdefault(item.role, _Rto())
        if first:
            item.backoff = rto.backoff
        else:
            item.backoff = min(BACKOFF_MAX, item.backoff * 2)
            rto.backoff = max(rto.backoff, item.backoff)
        wait = min(rto.timeout(self.policy) * item.backoff, self.policy.max_s)
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
        """Take an Ack; True when it settled a pending message (from the address that message last went to). An
        Ack of a ``CUMULATIVE`` kind settles every earlier position of its request too."""
        if msg.kind in CUMULATIVE:
            return self.settle_through(msg.kind, msg.request_id, msg.position + 1, sender) > 0
        return self.settle((msg.kind, msg.request_id, msg.position), sender)

    def settle_through(self, kind: str, request_id: str, below: int, sender: str | None = None) -> int:
        """Settle every pending ``kind`` of ``request_id`` at a position before ``below``; how many. ``sender``: they
        are answered by its Ack (only those that last went to that address); None: the chain's progress stands for
        their Acks (a later position of the request came round, which it does only once every hop took these).
        The oldest of them sent once measures the round trip: it waited longest for what settled it."""
        keys = [
            key
            for key, item in self.pending.items()
            if key[0] == kind and key[1] == request_id and key[2] < below and sender in (None, item.address)
        ]
        self._settle(keys)
        return len(keys)

    def _settle(self, keys: list[Key]) -> None:
        """Forget ``keys``; the oldest of them sent once measures the round trip (Karn: a resent message's Ack may
        answer any copy, so it says nothing of the round trip)."""
        once = [self.pending[k] for k in keys if self.pending[k].sends == 1]
        if once:
            oldest = min(once, key=lambda p: p.sent_at)
            self.rto.setdefault(oldest.role, _Rto()).sample(self.clock() - oldest.sent_at)
        for key in keys:
            del self.pending[key]

    def settle(self, key: Key, sender: str) -> bool:
        """``key`` is answered by ``sender``, as by its Ack (an answer that stands for one: an ExpertResult); True
        when that settled a pending message (from the address that message last went to)."""
        item = self.pending.get(key)
        if item is None or sender != item.address:
            return False
        self._settle([key])
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


@dataclass
class _Run:
    first: int  # the stream's first position
    through: int  # every position from ``first`` up to this one arrived
    acked: int  # acknowledged through this position


class StreamAcks:
    """The receiving end of a ``CUMULATIVE`` stream that no later message stands for (a request's tokens at the
    client). Positions are acknowledged through the end of the unbroken run from the stream's first: every ``every``
    new ones, at once for the stream's last, and at once for a copy (its sender is resending, so it missed an Ack).
    A stream that ``end``-ed (its whole answer arrived) has every copy acknowledged through its position."""

    def __init__(self, every: int = STREAM_ACK_EVERY, kept: int = STREAMS_KEPT):
        self.every, self.kept = every, kept
        self.runs: OrderedDict[str, _Run] = OrderedDict()
        self.ended: OrderedDict[str, None] = OrderedDict()

    def take(
        self, request_id: str, first: int, position: int, done: bool, fresh: bool, have: Callable[[int], bool]
    ) -> int | None:
        """A position of ``request_id``'s stream arrived (``fresh``: for the first time; ``have(p)``: whether
        position p has); the position to acknowledge through now, or None."""
        if request_id in self.ended:
            return position
        run = self.runs.get(request_id)
        if run is None:
            start = max(0, min(first, position))
            run = self.runs[request_id] = _Run(start, start - 1, start - 1)
            while len(self.runs) > self.kept:
                self.runs.popitem(last=False)
        while have(run.through + 1):
            run.through += 1
        if run.through < run.first or (fresh and not done and run.through < run.acked + self.every):
            return None
        run.acked = run.through
        return run.through

    def unbroken(self, request_id: str) -> range:
        """The positions of the stream's unbroken run from its first (empty: none yet)."""
        run = self.runs.get(request_id)
        return range(0) if run is None else range(run.first, run.through + 1)

    def end(self, request_id: str) -> None:
        self.runs.pop(request_id, None)
        self.ended[request_id] = None
        while len(self.ended) > self.kept:
            self.ended.popitem(last=False)


def ack_of(kind: str, request_id: str, position: int, plan_id: str) -> Ack:
    return Ack(kind=kind, request_id=request_id, position=position, plan_id=plan_id)
