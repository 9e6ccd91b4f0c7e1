"""The orchestrator's side of a network's timed events: pausing, resuming and killing nodes through the provider.

Partitions need no orders: every endpoint's emulation layer drops what crosses the cut while it holds. ``tick()`` is
called from the orchestrator's wait loops; each action happens once, at the first tick at or after its time. Before
the request starts (the clock is not started) nothing happens; ``heal()`` resumes every node still paused (before
teardown: a stopped node cannot shut down).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ppharness.network.clock import EventClock
from ppharness.network.spec import Network
from ppharness.seams.provider import Instance, NodeAction, Provider


@dataclass(frozen=True)
class _Order:
    at_s: float
    action: NodeAction
    node: str  # stage-<i>


class Nemesis:
    def __init__(
        self,
        network: Network,
        provider: Provider[Any],
        clock: EventClock,
        log: Callable[[str], None] = lambda line: None,
        instance_of: Callable[[str], Instance | None] | None = None,
    ) -> None:
        """``instance_of(node)``: the instance that is ``node`` (``stage-3``) now; by default the provider's instance
        named ``pp-stage-3``."""
        self.provider, self.clock, self.log = provider, clock, log
        self._instance_of = instance_of
        orders: list[_Order] = []
        for e in network.events:
            for node in e.nodes:
                if e.kind == "pause" and e.for_s is not None:
                    orders += [_Order(e.at_s, "pause", node), _Order(e.at_s + e.for_s, "resume", node)]
                elif e.kind == "kill":
                    orders.append(_Order(e.at_s, "kill", node))
        self._pending = sorted(orders, key=lambda o: o.at_s)
        self._paused: dict[str, Instance] = {}  # node -> the instance paused (a spare may have replaced it since)
        self.done: list[tuple[float, NodeAction, str]] = []  # (seconds since the start, action, node) as carried out

    def _instance(self, node: str) -> Instance | None:
        """The instance that is ``node`` now (a spare that replaced it, if any)."""
        if self._instance_of is not None:
            return self._instance_of(node)
        name = "pp-" + node  # stage-3 -> pp-stage-3
        return next((i for i in reversed(self.provider.instances) if i.name == name), None)

    def due_in(self) -> float | None:
        """Seconds until the next order is due (None: none left, or the clock has not started)."""
        elapsed = self.clock.elapsed()
        if elapsed is None or not self._pending:
            return None
        return max(0.0, self._pending[0].at_s - elapsed)

    def tick(self) -> None:
        elapsed = self.clock.elapsed()
        while elapsed is not None and self._pending and self._pending[0].at_s <= elapsed:
            order = self._pending.pop(0)
            self._carry_out(order.action, order.node, elapsed)

    def _carry_out(self, action: NodeAction, node: str, elapsed: float) -> None:
        inst = self._paused.get(node) if action == "resume" else self._instance(node)
        if inst is None:
            return
        self.log(f"network event at {elapsed:.2f} s: {action} {node}")
        self.provider.signal_node(inst, action)
        self.done.append((elapsed, action, node))
        if action == "pause":
            self._paused[node] = inst
        else:
            self._paused.pop(node, None)

    def heal(self) -> None:
        for node in sorted(self._paused):
            self._carry_out("resume", node, self.clock.elapsed() or 0.0)
        self._pending.clear()
