"""Membership v1: nodes join through the seed (the orchestrator's address), which hands out the name directory.

The seed collects one ``Join`` per stage; once all N stages joined (bounded wait) it sends every node ``Members``, the
directory of names (``pp-stage-{i}``, ``pp-entry``, ``pp-exit``) to addresses. A node resolves names from that
directory. Failure detection of a member that dies is the provider's ``exited()`` here; heartbeats come later.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ppharness.errors import ClusterError, CodecError, TransportTimeout, WaitTimedOut
from ppharness.wire.messages import Join, Members, Message

POLL_S = 0.2


class Directory:
    """The seed's view: who joined, under which names, at which address."""

    def __init__(self, num_stages: int, expert_nodes: int = 0):
        self.num_stages = num_stages
        self.members = num_stages + expert_nodes  # expert nodes join as members num_stages, num_stages + 1, ...
        self.joins: dict[int, Join] = {}
        self.names: dict[str, str] = {}

    def add(self, msg: Join) -> None:
        """Record a Join; a stage outside the plan or a name already taken is a ClusterError."""
        if msg.num_stages != self.num_stages or not 0 <= msg.stage < self.members:
            raise ClusterError(
                f"stage {msg.stage} of {msg.num_stages} from {msg.address} does not belong to this "
                f"{self.num_stages}-stage run"
            )
        if msg.stage in self.joins and self.joins[msg.stage].address != msg.address:
            raise ClusterError(f"stage {msg.stage} joined twice: {self.joins[msg.stage].address} and {msg.address}")
        self.joins[msg.stage] = msg
        for name in msg.names:
            self.names[name] = msg.address

    def replace(self, msg: Join) -> str:
        """Record the Join of a spare that took over ``msg.stage``: its names now point at the spare. Returns the
        address the stage had."""
        old = self.joins[msg.stage].address
        self.joins[msg.stage] = msg
        for name, address in list(self.names.items()):
            if address == old:
                del self.names[name]
        for name in msg.names:
            self.names[name] = msg.address
        return old

    @property
    def complete(self) -> bool:
        return len(self.joins) == self.members

    def missing(self) -> list[int]:
        return [i for i in range(self.members) if i not in self.joins]

    def resolve(self, name: str) -> str:
        try:
            return self.names[name]
        except KeyError:
            raise ClusterError(f"name {name!r} is not registered; known: {', '.join(sorted(self.names))}") from None


def wait_for(
    recv: Callable[[float], tuple[str, Message]],
    on_message: Callable[[str, Message], bool],
    timeout: float,
    what: str,
    check: Callable[[], None] = lambda: None,
    log: Callable[[str], None] = print,
    done: Callable[[], bool] = lambda: False,
    poll_s: Callable[[], float] = lambda: POLL_S,
) -> None:
    """Pump messages into ``on_message`` until it returns True (or ``done()`` holds), at most ``timeout`` seconds.

    ``check`` runs between polls and raises to abort (e.g. a member died). A bad frame is logged and dropped.
    ``poll_s`` is the longest wait for one message (shorter when ``check`` has timers to keep).
    """
    deadline = time.monotonic() + timeout
    while True:
        check()
        if done():
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise WaitTimedOut(f"timed out after {timeout:g} s waiting for {what}")
        try:
            sender, msg = recv(min(poll_s(), left))
        except TransportTimeout:
            continue
        except CodecError as exc:
            log(f"dropped a bad frame: {exc}")
            continue
        if on_message(sender, msg):
            return


def resolve_members(
    recv: Callable[[float], tuple[str, Message]],
    timeout: float,
    on_other: Callable[[str, Message], None],
    log: Callable[[str], None] = print,
) -> dict[str, str]:
    """Node side: wait (bounded) for the seed's Members; other messages go to ``on_other``."""
    found: dict[str, str] = {}

    def on_message(sender: str, msg: Message) -> bool:
        if isinstance(msg, Members):
            found.update(msg.names)
            return True
        on_other(sender, msg)
        return False

    wait_for(recv, on_message, timeout, "the cluster's name directory (Members) from the seed", log=log)
    return found
