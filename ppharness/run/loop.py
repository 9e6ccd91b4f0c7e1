"""The one message loop every actor of a run turns on: a node, the orchestrator's session, the in-process chains and
the expert fan-out.

A turn runs the due timers (the outbox's resends, network events, an open-loop load's arrivals), the checks (a member's
death, the parent process gone: they raise to end the wait), the actors' ready work (a Stage's ``step``), then waits
for one message — never past the next timer, the wait's deadline or ``poll_s`` — and hands it to the wait's handler;
a loop made with ``drain`` (a batched stage's: ``DRAIN``) also hands it every message that has already arrived behind
it, so that the stage's next step runs all the requests they made ready as one batch.
A frame that does not decode is logged and dropped; nothing a peer sends ends the loop.

A wait may nest: a step that needs answers from other members (the expert fan-out) waits inside the loop for them;
the inner wait keeps the timers and checks running and hands every other message to the handler of the wait it is
nested in, which only records it, and no actor's work starts until the inner wait returns.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Protocol

from ppharness.errors import CodecError, TransportTimeout, WaitTimedOut
from ppharness.seams.transport import Received
from ppharness.trace.drops import DropLog
from ppharness.wire.messages import Message

POLL_S = 0.2  # the longest a turn waits for a message before it looks at the timers and checks again
CHECK_S = 0.02  # the checks run at most this often: a busy stream of messages does not poll every process per message
DRAIN = 256  # a batched stage's loop: messages already waiting that a turn takes before the actors work

Handler = Callable[[str, Message, Received | None], bool]  # True: the wait is over


class Inbox(Protocol):
    """Where a loop's mail comes from: a ``Transport`` (or anything that receives as one does)."""

    def receive(self, timeout: float | None = None) -> Received: ...


class Timed(Protocol):
    """Something with timed work: ``due_in`` seconds until it is due (None: nothing pending), ``tick`` does it."""

    def due_in(self) -> float | None: ...

    def tick(self) -> None: ...


class Worker(Protocol):
    """An actor with work to do between messages (a Stage runs its ready requests); ``step`` returns whether it
    did anything, so the loop turns again at once instead of waiting for mail."""

    def step(self) -> bool: ...


class Loop:
    """Turns one endpoint's mail (``transport``) into handler calls, between timers, checks and actors' work."""

    def __init__(self, transport: Inbox, log: Callable[[str], None], poll_s: float = POLL_S, drain: int = 0):
        self.transport, self.log, self.poll_s = transport, log, poll_s
        self.drop = DropLog(log)
        self.drain = drain  # messages already waiting that a turn also takes (a batched stage's loop: DRAIN)
        self.timers: list[Timed] = []
        self.checks: list[Callable[[], None]] = []
        self._checked = -float("inf")  # when the checks last ran
        self.workers: list[Worker] = []
        self.mail: deque[tuple[str, Message, Received | None]] = deque()  # delivered before the transport's
        self._kept: list[tuple[str, Message, Received | None]] = []  # what the outermost wait forwarded: mail after it
        self._handlers: list[Handler] = []  # the running waits' handlers, the innermost last
        self._over: set[int] = set()  # depths of waits whose handler said done while a wait nested in them ran

    @property
    def depth(self) -> int:
        """How many waits are running, one inside the other."""
        return len(self._handlers)

    def add_timer(self, timer: Timed) -> None:
        self.timers.append(timer)

    def remove_timer(self, timer: Timed) -> None:
        self.timers = [t for t in self.timers if t is not timer]

    def add_check(self, check: Callable[[], None]) -> None:
        self.checks.append(check)

    def add_worker(self, worker: Worker) -> None:
        self.workers.append(worker)

    def push(self, sender: str, msg: Message, rx: Received | None = None) -> None:
        """Deliver ``msg`` before anything the transport holds (mail that arrived while nobody waited for it)."""
        self.mail.append((sender, msg, rx))

    def forward(self, sender: str, msg: Message, rx: Received | None = None) -> None:
        """Hand a message a nested wait does not take to the handler of the wait it is nested in (with no enclosing
        wait, keep it for the next wait, after this one ends)."""
        if not self._handlers:
            self.push(sender, msg, rx)
            return
        if len(self._handlers) < 2:
            self._kept.append((sender, msg, rx))
            return
        outer = len(self._handlers) - 2
        if self._handlers[outer](sender, msg, rx):
            self._over.add(outer)

    def due_in(self) -> float | None:
        """Seconds until the first timer is due (0: now), None when none has anything pending."""
        dues = [d for d in (t.due_in() for t in self.timers) if d is not None]
        return max(0.0, min(dues)) if dues else None

    def tick(self) -> None:
        """Run the timers that are due and, at most every ``CHECK_S``, the checks (which raise to end the wait)."""
        for timer in list(self.timers):
            due = timer.due_in()
            if due is not None and due <= 0:
                timer.tick()
        now = time.monotonic()
        if now - self._checked < CHECK_S:
            return
        self._checked = now
        for check in list(self.checks):
            check()

    def work(self) -> bool:
        """Let each actor run its ready work, unless a wait is nested (a step in progress waits for its answers)."""
        if self.depth > 1:
            return False
        did = False
        for worker in list(self.workers):
            did = worker.step() or did
        return did

    def next(self, timeout: float) -> tuple[str, Message, Received | None] | None:
        """The next message within ``timeout`` seconds (shorter when a timer is due sooner); None when none came.
        A frame that does not decode is logged and dropped."""
        if self.mail:
            return self.mail.popleft()
        due = self.due_in()
        end = time.monotonic() + max(0.0, min(timeout, self.poll_s, due if due is not None else timeout))
        while True:
            try:
                rx = self.transport.receive(max(0.0, end - time.monotonic()))
                break
            except TransportTimeout:
                return None
            except CodecError as exc:  # dropped; what else came within the time left is still taken
                self.drop(f"dropped a bad frame: {exc}", "a bad frame", "")
        return rx.sender, rx.message, rx

    def wait(
        self,
        handle: Handler,
        timeout: float | None,
        what: str,
        done: Callable[[], bool] = lambda: False,
    ) -> None:
        """Turn until ``handle`` returns True or ``done()`` holds; at most ``timeout`` seconds (None: no limit), then
        raise WaitTimedOut naming ``what``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        level = len(self._handlers)
        self._handlers.append(handle)
        try:
            while True:
                self.tick()
                busy = self.work()
                if level in self._over or done():
                    return
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WaitTimedOut(f"timed out after {timeout:g} s waiting for {what}")
                got = self.next(0.0 if busy else (self.poll_s if left is None else left))
                if got is not None and handle(*got):
                    return
                # and what else has come already: the actors' next step sees all of it at once (a batch)
                for _ in range(self.drain if got is not None else 0):
                    more = self.next(0.0)
                    if more is None:
                        break
                    if handle(*more):
                        return
        finally:
            self._handlers.pop()
            self._over.discard(level)
            if not self._handlers and self._kept:
                self.mail.extend(self._kept)
                self._kept.clear()


HEARTBEAT_S = 10.0  # a wait this long says what it still waits for


def heartbeat(
    done: Callable[[], bool], pending: Callable[[], str], say: Callable[[str], None], every_s: float = HEARTBEAT_S
) -> Callable[[], bool]:
    """``done`` (a wait's ``done``), saying ``still waiting for <pending()> (N s)`` every ``every_s`` seconds it is
    asked: a long phase is never silent."""
    start = last = time.monotonic()

    def check() -> bool:
        nonlocal last
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            say(f"still waiting for {pending()} ({now - start:.0f} s)")
        return done()

    return check


@contextlib.contextmanager
def ticking(what: str, say: Callable[[str], None], every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """While the block runs (work that turns no loop: the oracle, a planner), say ``still <what> (N s)`` every
    ``every_s`` seconds from a thread of its own; the thread ends with the block."""
    stop = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not stop.wait(every_s):
            say(f"still {what} ({time.monotonic() - start:.0f} s)")

    thread = threading.Thread(target=tick, name="ticking", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
