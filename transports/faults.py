"""Message-level WAN emulation: a Transport that applies the network's fault vocabulary to whole messages, over any
other transport (memory, zmq, iroh).

Each endpoint impairs what it *sends*, per directed link (this node -> the destination's node), with the link's
``LinkShaper`` (``ppharness.network.shaper``): a message is delayed (one-way delay, jitter, the rate cap's queue),
lost, duplicated or held back, and dropped while a partition separates the two nodes. Delayed copies are handed to
the inner transport by one scheduler thread at their due time, in due order; a message with no delay goes out on the
caller's thread, so a perfect link costs one dictionary lookup.

Which node an address belongs to is learnt from the membership messages the transport carries: a ``Join`` (at the
seed) names a stage's address, ``Members`` (at a node) names every stage's and every expert node's (``pp-experts-j``
is member ``stages + j``). Addresses it does not know (a client's
``reply_to``) are not impaired.

A send to a peer that fails on the scheduler thread (the peer is gone) is logged on stderr and raised by the next send
to that address, as the inner transport would have raised it. ``close()`` drops what is still scheduled.
"""

from __future__ import annotations

import heapq
import itertools
import sys
import threading
import time
from dataclasses import dataclass, field

from ppharness.errors import HarnessError, TransportClosed
from ppharness.network.clock import EventClock
from ppharness.network.shaper import LinkStats, ShapedLink
from ppharness.network.spec import Network, stage_node
from ppharness.seams.transport import JsonObject, Received, Transport
from ppharness.wire.messages import Join, Members

STAGE_PREFIX = "pp-stage-"
EXPERTS_PREFIX = "pp-experts-"


@dataclass(order=True)
class _Due:
    at: float
    seq: int
    address: str = field(compare=False)
    frame: bytes = field(compare=False)
    link: ShapedLink = field(compare=False)


class ImpairedTransport(Transport):
    """``inner`` with the network's impairments applied to what it sends (see the module's docstring)."""

    kind = "impaired"

    def __init__(
        self,
        inner: Transport,
        network: Network,
        node: str,
        clock: EventClock | None = None,
        known: dict[str, str] | None = None,
    ) -> None:
        self.inner, self.network, self.node = inner, network, node
        self.clock = clock or EventClock()
        self._names: dict[str, str] = dict(known or {})  # address -> node name
        self._since: dict[str, float] = {}  # address -> when it became its node (a spare), seconds into the request
        self._own_since = 0.0
        self._links: dict[str, ShapedLink] = {}  # destination node -> the link this node -> it
        self._heap: list[_Due] = []
        self._seq = itertools.count()
        self._failed: dict[str, HarnessError] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    @classmethod
    def plan_endpoints(cls, count: int, settings: JsonObject) -> list[JsonObject]:
        raise TypeError("an ImpairedTransport wraps a planned transport; plan that one")

    # --- who is where ----------------------------------------------------------------------------------------------

    def learn(self, address: str, node: str) -> None:
        """``address`` belongs to ``node`` (``seed`` or ``stage-<i>``)."""
        if self._names.get(address) != node:
            self._since[address] = self.clock.elapsed() or 0.0
        self._names[address] = node

    def _learn_from(self, got: Received) -> None:
        msg = got.message
        if isinstance(msg, Join) and msg.address == got.sender:
            self.learn(msg.address, stage_node(msg.stage))
        elif isinstance(msg, Members):
            stages = 0
            for name, address in msg.names.items():
                if name.startswith(STAGE_PREFIX) and name[len(STAGE_PREFIX) :].isdigit():
                    self.learn(address, stage_node(int(name[len(STAGE_PREFIX) :])))
                    stages += 1
            for name, address in msg.names.items():  # expert node j is member stages + j, after the loop's
                if name.startswith(EXPERTS_PREFIX) and name[len(EXPERTS_PREFIX) :].isdigit():
                    self.learn(address, stage_node(stages + int(name[len(EXPERTS_PREFIX) :])))

    def become(self, node: str) -> None:
        """This endpoint is ``node`` from now on (a standby spare that took over a stage): its links are that
        node's."""
        with self._cond:
            self.node = node
            self._own_since = self.clock.elapsed() or 0.0
            self._links.clear()

    # --- Transport ---------------------------------------------------------------------------------------------------

    def start(self) -> str:
        address = self.inner.start()
        self._thread = threading.Thread(target=self._deliver, name=f"impair-{self.node}", daemon=True)
        self._thread.start()
        return address

    @property
    def address(self) -> str:
        return self.inner.address

    def send_frame(self, address: str, frame: bytes) -> None:
        if self._closed:
            raise TransportClosed("the impaired transport is closed")
        failed = self._failed.pop(address, None)
        if failed is not None:
            raise failed
        dst = self._names.get(address)
        if dst is None:  # not a node of the run (a client's reply_to): not impaired
            self.inner.send_frame(address, frame)
            return
        link = self._link(dst)
        link.stats.sent += 1
        elapsed = self.clock.elapsed()
        if elapsed is not None and self.network.cut(
            self.node, dst, elapsed, self._own_since, self._since.get(address, 0.0)
        ):
            link.stats.cut += 1
            return
        now = time.monotonic()
        arrivals = link.shaper.fate(len(frame), now)
        with self._cond:
            for at in arrivals:
                if at <= now and not self._heap:
                    self.inner.send_frame(address, frame)
                    link.stats.delivered += 1
                else:
                    heapq.heappush(self._heap, _Due(at, next(self._seq), address, frame, link))
                    self._cond.notify()

    @property
    def counters(self) -> dict[str, LinkStats]:
        """What each outgoing link did so far, by destination node."""
        return {dst: link.snapshot() for dst, link in self._links.items()}

    def recv_frame(self, timeout: float | None = None) -> tuple[str, bytes]:
        return self.inner.recv_frame(timeout)

    def receive(self, timeout: float | None = None) -> Received:
        got = super().receive(timeout)
        self._learn_from(got)
        return got

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.inner.close()

    # --- delivery ----------------------------------------------------------------------------------------------------

    def _link(self, dst: str) -> ShapedLink:
        link = self._links.get(dst)
        if link is None:
            link = self._links[dst] = ShapedLink(self.network, self.node, dst)
        return link

    def _deliver(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0].at > time.monotonic()):
                    wait = None if not self._heap else max(0.0, self._heap[0].at - time.monotonic())
                    self._cond.wait(wait)
                if self._closed:
                    return
                due = heapq.heappop(self._heap)
            try:
                self.inner.send_frame(due.address, due.frame)
                due.link.stats.delivered += 1
            except HarnessError as exc:
                due.link.stats.send_errors += 1
                if not self._closed:
                    print(f"[{self.node}] a delayed message to {due.address[:120]} failed: {exc}", file=sys.stderr)
                    self._failed[due.address] = exc
