"""Failure detection: who is alive, suspect or dead, by one of two engines behind one small interface.

- ``kinship``: SWIM with the Lifeguard extensions (the protocol of HashiCorp's memberlist), from the ``kinship``
  package. Every node and the orchestrator gossip over UDP among themselves; a killed node is suspected after a missed
  probe and declared dead when nobody can refute the suspicion. It needs every member to reach every other member's
  UDP port, which holds for local processes and (with a per-run key) for one bridge network.
- ``heartbeat``: carried over the run's own transport, for members that cannot reach each other's UDP ports (a laptop
  behind NAT talking to rented machines through iroh relays). Each node sends a Heartbeat to the seed every
  ``heartbeat_s``; the seed suspects a node after ``suspect_after`` missed beats and declares it dead after
  ``dead_after_s`` of silence, so one lost packet is never a death.

``auto`` picks kinship when the provider says its nodes share a network with the orchestrator, heartbeat otherwise.
The seed side is polled from the orchestrator's wait loop (``dead()``); nodes run their side on a background thread.
"""

from __future__ import annotations

import base64
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from ppharness.errors import ClusterError
from ppharness.plan.stages import stage_name
from ppharness.wire.messages import Heartbeat, Message, Ready

if TYPE_CHECKING:
    from kinship.blocking import Cluster

    from ppharness.seams.transport import Transport

ENGINES = ("auto", "kinship", "heartbeat")


def choose_engine(engine: str, gossip_reachable: bool) -> str:
    """The engine a run uses: the scenario's choice, or for ``auto`` what the provider's network allows."""
    if engine not in ENGINES:
        raise ClusterError(f"unknown membership engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if engine == "auto":
        return "kinship" if gossip_reachable else "heartbeat"
    return engine


# A node that loads its blocks and compiles them may fall silent on a crowded machine (its heartbeat thread waits for
# the interpreter, the machine's cores are busy compiling): until its Ready it is dead only after this long. A node
# whose process exits while loading is reported by its provider at once, whatever this says.
LOADING_GRACE_S = 10.0


class HeartbeatDetector:
    """Seed side of the heartbeat engine: feed it Heartbeats, ask it who is dead."""

    name = "heartbeat"

    def __init__(
        self,
        num_stages: int,
        heartbeat_s: float,
        suspect_after: int,
        dead_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.heartbeat_s, self.suspect_after, self.dead_after_s, self.clock = (
            heartbeat_s,
            suspect_after,
            dead_after_s,
            clock,
        )
        self.last_seen: dict[int, float] = {}
        self.loading: set[int] = set()  # watched, its Ready not yet seen: judged with LOADING_GRACE_S
        self.num_stages = num_stages
        self._deaf_since: float | None = None

    def node_env(self) -> dict[str, str]:
        return {"PP_MEMBERSHIP": "heartbeat", "PP_HEARTBEAT_S": str(self.heartbeat_s)}

    def watch(self, stages: list[int]) -> None:
        """Start the clocks: from now on a stage that stays silent too long is dead (longer while it loads)."""
        now = self.clock()
        for s in stages:
            self.last_seen.setdefault(s, now)
            self.loading.add(s)

    def forget(self, stage: int) -> None:
        """``stage``'s node is being replaced: it is no longer watched (until ``replace``)."""
        self.last_seen.pop(stage, None)

    def replace(self, stage: int, name: str) -> None:
        """A spare took over ``stage`` (it just joined): its clock starts again (the replaced node's beats no longer
        count), and it loads."""
        self.last_seen[stage] = self.clock()
        self.loading.add(stage)

    def deaf(self) -> None:
        """The orchestrator stops reading its messages (between requests): silence from now on is not the nodes'."""
        if self._deaf_since is None:
            self._deaf_since = self.clock()

    def listen(self) -> None:
        """The orchestrator reads its messages again: the clocks resume where they stopped, so beats that queued
        unread while nobody listened are not taken for silence."""
        if self._deaf_since is not None:
            idle = self.clock() - self._deaf_since
            self.last_seen = {s: t + idle for s, t in self.last_seen.items()}
            self._deaf_since = None

    def on_message(self, msg: Message) -> bool:
        """Take a Heartbeat (True), or say it was not one (False). A Ready is noted on its way past: from then on
        ``dead_after_s`` of silence is the stage's death."""
        if isinstance(msg, Ready):
            self.loading.discard(msg.stage)
        if isinstance(msg, Heartbeat):
            if msg.stage in self.last_seen or 0 <= msg.stage < self.num_stages:
                self.last_seen[msg.stage] = self.clock()
            return True
        return False

    def suspects(self) -> list[int]:
        now = self.clock()
        return [s for s, t in self.last_seen.items() if now - t > self.suspect_after * self.heartbeat_s]

    def dead(self) -> list[tuple[int, str]]:
        now = self.clock()
        out = []
        for s, t in sorted(self.last_seen.items()):
            limit = max(self.dead_after_s, LOADING_GRACE_S) if s in self.loading else self.dead_after_s
            if now - t > limit:
                while_ = " while loading" if s in self.loading else ""
                out.append((s, f"no heartbeat for {now - t:.1f} s{while_} (dead after {limit:g} s)"))
        return out

    def close(self) -> None:
        pass


class KinshipDetector:
    """Seed side of the kinship engine: a SWIM/Lifeguard member of its own, which the nodes join."""

    name = "kinship"

    def __init__(self, run_label: str, bind_host: str = "127.0.0.1"):
        import kinship
        from kinship.blocking import Cluster

        self._kinship = kinship
        self._key = base64.b64encode(os.urandom(32)).decode()  # per run: gossip from other runs is unreadable
        self._label = run_label[:64]
        cfg = kinship.Config.local(bind=f"{bind_host}:0", name="pp-seed", cluster=self._label, keys=[self._key])
        self._cluster = Cluster(cfg).start()
        self.address = self._cluster.local.addr
        self._watched: list[int] = []
        self._names: dict[int, str] = {}  # stage -> the name its node gossips under, where not stage_name(stage)

    def node_env(self) -> dict[str, str]:
        return {
            "PP_MEMBERSHIP": "kinship",
            "PP_GOSSIP_SEED": self.address,
            "PP_GOSSIP_KEY": self._key,
            "PP_GOSSIP_CLUSTER": self._label,
        }

    def watch(self, stages: list[int]) -> None:
        self._watched += [s for s in stages if s not in self._watched]

    def forget(self, stage: int) -> None:
        """``stage``'s node is being replaced: it is no longer watched (until ``replace``)."""
        self._watched = [s for s in self._watched if s != stage]

    def replace(self, stage: int, name: str) -> None:
        """A spare took over ``stage``, gossiping under ``name``."""
        self._names[stage] = name
        self.watch([stage])

    def deaf(self) -> None:
        """Gossip goes on in its own thread whether or not the orchestrator reads its messages."""

    def listen(self) -> None:
        pass

    def on_message(self, msg: Message) -> bool:
        return isinstance(msg, Heartbeat)

    def dead(self) -> list[tuple[int, str]]:
        out = []
        for s in self._watched:
            m = self._cluster.member(self._names.get(s, stage_name(s)))
            if m is None:
                continue
            if m.state in (self._kinship.State.DEAD, self._kinship.State.LEFT):
                out.append((s, f"declared {m.state.name.lower()} by SWIM/Lifeguard (kinship)"))
        return out

    def close(self) -> None:
        self._cluster.close()


# the seed side of either engine, as the orchestrator holds it
Detector: TypeAlias = HeartbeatDetector | KinshipDetector


# --- node side ------------------------------------------------------------------------------------------------------


class NodeMembership:
    """A node's side of whichever engine the seed chose (from its environment); ``close()`` leaves cleanly."""

    def __init__(self, env: dict[str, str], stage: int, seed: str, transport: Transport, log: Callable[[str], None]):
        self.engine = env.get("PP_MEMBERSHIP", "")
        self._stop = threading.Event()
        self._cluster: Cluster | None = None
        self._thread: threading.Thread | None = None
        if self.engine == "heartbeat":
            period = float(env.get("PP_HEARTBEAT_S", "1.0"))
            self._thread = threading.Thread(
                target=self._beat, args=(transport, seed, stage, period, log), name="pp-heartbeat", daemon=True
            )
            self._thread.start()
        elif self.engine == "kinship":
            import kinship
            from kinship.blocking import Cluster

            cfg = kinship.Config.local(
                bind=f"{env.get('PP_GOSSIP_BIND', '127.0.0.1')}:0",
                name=env.get("PP_GOSSIP_NAME") or stage_name(stage),
                seeds=[env["PP_GOSSIP_SEED"]],
                cluster=env.get("PP_GOSSIP_CLUSTER") or None,
                keys=[env["PP_GOSSIP_KEY"]],
            )
            self._cluster = Cluster(cfg).start()

    def _beat(self, transport: Transport, seed: str, stage: int, period: float, log: Callable[[str], None]) -> None:
        seq = 0
        while not self._stop.wait(period):
            seq += 1
            try:
                transport.send(seed, Heartbeat(stage=stage, seq=seq))
            except Exception as exc:  # the seed may be gone; the node's own loop decides what that means
                log(f"heartbeat {seq} to the seed failed: {exc}")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._cluster is not None:
            try:
                self._cluster.close()
            except Exception:
                pass
