"""Membership v1: nodes join through the seed (the orchestrator's address), which hands out the name directory.

The seed collects one ``Join`` per stage; once all N stages joined (bounded wait) it sends every node ``Members``, the
directory of names (``pp-stage-{i}``, ``pp-entry``, ``pp-exit``) to addresses, and a newer one after a failover
(``replace``). A node takes the directory only from the seed (``ppharness.run.node.members``); the seed takes each
member's messages only from the address its role holds here (``ppharness.run.seed.roles``). Failure detection is
``ppharness.run.membership``'s.
"""

from __future__ import annotations

from ppharness.errors import ClusterError
from ppharness.wire.messages import Join


class Directory:
    """The seed's view: who joined, under which names, at which address."""

    def __init__(self, num_stages: int, expert_nodes: int = 0):
        self.num_stages = num_stages
        self.members = num_stages + expert_nodes  # expert nodes join as members num_stages, num_stages + 1, ...
        self.joins: dict[int, Join] = {}
        self.names: dict[str, str] = {}

    def add(self, msg: Join) -> None:
        """Record a Join; a stage outside the plan, a stage that joined from another address, or an address that joined
        as another stage (one key, one member) is a ClusterError."""
        if msg.num_stages != self.num_stages or not 0 <= msg.stage < self.members:
            raise ClusterError(
                f"stage {msg.stage} of {msg.num_stages} from {msg.address} does not belong to this "
                f"{self.num_stages}-stage run"
            )
        if msg.stage in self.joins and self.joins[msg.stage].address != msg.address:
            raise ClusterError(f"stage {msg.stage} joined twice: {self.joins[msg.stage].address} and {msg.address}")
        self._one_stage_per_address(msg)
        self.joins[msg.stage] = msg
        for name in msg.names:
            self.names[name] = msg.address

    def _one_stage_per_address(self, msg: Join) -> None:
        """One key, one member: a Join from the address another stage holds is a ClusterError."""
        other = next((s for s, j in self.joins.items() if j.address == msg.address and s != msg.stage), None)
        if other is not None:
            raise ClusterError(f"stage {msg.stage} joined from {msg.address}, the address stage {other} joined from")

    def replace(self, msg: Join) -> str:
        """Record the Join of a spare that took over ``msg.stage``: its names now point at the spare. Returns the
        address the stage had. A spare joining from the address another stage holds is a ClusterError."""
        self._one_stage_per_address(msg)
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
