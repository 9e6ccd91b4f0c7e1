"""Membership v1: nodes join through the seed (the orchestrator's address), which hands out the name directory.

The seed collects one ``Join`` per stage; once all N stages joined (bounded wait) it sends every node ``Members``, the
directory of names (``pp-stage-{i}``, ``pp-entry``, ``pp-exit``) to addresses. A node resolves names from that
directory. Failure detection of a member that dies is the provider's ``exited()`` here; heartbeats come later.
"""

from __future__ import annotations

from ppharness.errors import ClusterError
from ppharness.run.loop import Loop
from ppharness.seams.transport import Received
from ppharness.wire.messages import Join, Members, Message


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


def resolve_members(loop: Loop, timeout: float) -> dict[str, str]:
    """Node side: wait (bounded) for the seed's Members; what else comes meanwhile is kept, in order, for the
    node's next wait."""
    found: dict[str, str] = {}
    early: list[tuple[str, Message, Received | None]] = []

    def on_message(sender: str, msg: Message, rx: Received | None) -> bool:
        if isinstance(msg, Members):
            found.update(msg.names)
            return True
        early.append((sender, msg, rx))
        return False

    loop.wait(on_message, timeout, "the cluster's name directory (Members) from the seed")
    for sender, msg, rx in early:
        loop.push(sender, msg, rx)
    return found
