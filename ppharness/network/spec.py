"""The fault vocabulary: what a scenario's ``network:`` section says about the links between a run's nodes.

Names and meanings follow netem and Toxiproxy for link impairments and Jepsen's nemesis for timed events:

- per directed link (``default`` for every link between nodes, ``links`` to override one ``from -> to`` pair):
  ``delay_ms`` one-way delay; ``jitter_ms`` with ``jitter`` its distribution (``normal``, ``uniform``, ``pareto``:
  netem's); ``rate_mbit`` a bandwidth cap (each message or packet waits ``bytes / rate`` behind the ones before it)
  with ``queue_kb`` of queue (tail drop beyond); ``loss`` random loss, or ``bursty`` loss (Gilbert-Elliott: the link
  turns bad with probability ``p`` per message and good again with ``r``, losing ``loss_bad`` of messages while bad
  and ``loss_good`` while good); ``duplicate`` the probability a message arrives twice; ``reorder`` the probability a
  message is held back ``reorder_ms`` more and overtaken by later ones. Otherwise a link keeps order, as TCP and QUIC
  streams do.
- timed ``events``, in seconds from the start of the request: ``partition`` cuts ``nodes`` off from every other node
  (the orchestrator included) for ``for_s`` seconds, then heals; ``pause`` stops them (SIGSTOP) for ``for_s`` seconds,
  then resumes them (SIGCONT); ``kill`` ends them (SIGKILL).

Nodes are named ``stage-<i>``; ``seed`` is the orchestrator. Links to and from the seed are not impaired unless a
``links`` entry names them (the seed drives the run; the token loop runs between the stages).
Everything random draws from generators seeded by ``seed`` and the link's name: the same seed gives the same fate to
the k-th message on every link (lost, duplicated, held back), whatever else happens in the run.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

SEED_NODE = "seed"
NODE_NAME = re.compile(r"^(seed|stage-(0|[1-9][0-9]{0,3}))$")
MAX_DELAY_MS = 60_000.0

Probability = Annotated[float, Meta(ge=0.0, le=1.0, description="a probability, 0 to 1")]
Millis = Annotated[float, Meta(ge=0.0, le=MAX_DELAY_MS, description="milliseconds, 0 to 60000")]
NodeName = Annotated[str, Meta(pattern=NODE_NAME.pattern, description="seed, or stage-<i>")]


class _Spec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of the vocabulary's structs (frozen, unknown keys refused)."""


class Bursty(_Spec, frozen=True):
    """Gilbert-Elliott loss: a good and a bad state; per message the link turns bad with ``p`` and good with ``r``."""

    p: Probability
    r: Annotated[float, Meta(gt=0.0, le=1.0, description="a probability, more than 0 (the link must recover)")]
    loss_bad: Probability = 1.0
    loss_good: Probability = 0.0

    def steady_loss(self) -> float:
        """The long-run fraction of messages lost: the bad state's share times its loss, plus the good state's."""
        bad = self.p / (self.p + self.r) if self.p + self.r > 0 else 0.0
        return bad * self.loss_bad + (1.0 - bad) * self.loss_good


class Impairment(_Spec, frozen=True):
    """What one directed link does to what crosses it. All zero: a perfect link."""

    delay_ms: Millis = 0.0
    jitter_ms: Millis = 0.0
    jitter: Literal["normal", "uniform", "pareto"] = "normal"
    rate_mbit: Annotated[float, Meta(gt=0.0, le=1e6, description="megabits per second")] | None = None
    queue_kb: Annotated[float, Meta(gt=0.0, le=1e6, description="KiB waiting behind the rate cap")] = 1024.0
    loss: Probability = 0.0
    bursty: Bursty | None = None
    duplicate: Probability = 0.0
    reorder: Probability = 0.0
    reorder_ms: Millis = 10.0

    def __post_init__(self) -> None:
        if self.bursty is not None and self.loss:
            raise ValueError("give either loss (random) or bursty (Gilbert-Elliott), not both")

    @property
    def perfect(self) -> bool:
        return self == Impairment()

    def mean_loss(self) -> float:
        return self.bursty.steady_loss() if self.bursty is not None else self.loss


class Link(Impairment, frozen=True, rename={"src": "from", "dst": "to"}):
    """One directed link's impairment, replacing ``default`` for it: ``{from: stage-0, to: stage-1, delay_ms: 50}``."""

    src: NodeName = ""
    dst: NodeName = ""

    def impairment(self) -> Impairment:
        fields = {f: getattr(self, f) for f in Impairment.__struct_fields__}
        return Impairment(**fields)


class Event(_Spec, frozen=True):
    """A timed fault: ``at_s`` seconds after the request starts, ``kind`` acts on ``nodes`` for ``for_s`` seconds
    (``partition``, ``pause``; ``kill`` is for good)."""

    at_s: Annotated[float, Meta(ge=0.0, le=86_400.0)]
    kind: Literal["partition", "pause", "kill"]
    nodes: Annotated[tuple[NodeName, ...], Meta(min_length=1)]
    for_s: Annotated[float, Meta(gt=0.0, le=86_400.0)] | None = None

    def __post_init__(self) -> None:
        if self.kind == "kill" and self.for_s is not None:
            raise ValueError("a kill is for good: leave out for_s")
        if self.kind != "kill" and self.for_s is None:
            raise ValueError(f"a {self.kind} needs for_s, how long it lasts")
        if SEED_NODE in self.nodes:
            raise ValueError("events act on stages; the seed (the orchestrator) is never cut off, paused or killed")

    def active(self, t_s: float) -> bool:
        """Whether this event holds ``t_s`` seconds after the request started."""
        return self.at_s <= t_s and (self.for_s is None or t_s < self.at_s + self.for_s)


class Network(_Spec, frozen=True):
    """A scenario's ``network:`` section: link impairments and timed events, seeded. ``layer``: ``message`` applies
    them to whole messages on any transport; ``packet`` to the UDP packets of iroh's QUIC (a bridge between
    endpoints, each in a network namespace of its own), so that QUIC's own loss recovery and congestion control are
    what gets exercised."""

    seed: Annotated[int, Meta(ge=0)] = 0
    layer: Literal["message", "packet"] = "message"
    default: Impairment = Impairment()
    links: tuple[Link, ...] = ()
    events: tuple[Event, ...] = ()

    def __post_init__(self) -> None:
        seen: set[tuple[str, str]] = set()
        for link in self.links:
            if not link.src or not link.dst:
                raise ValueError("every link names both ends: {from: stage-0, to: stage-1, ...}")
            if link.src == link.dst:
                raise ValueError(f"a link from {link.src} to itself")
            if (link.src, link.dst) in seen:
                raise ValueError(f"the link {link.src} -> {link.dst} is given twice")
            seen.add((link.src, link.dst))

    def impairment(self, src: str, dst: str) -> Impairment:
        """What the link ``src -> dst`` does: its own entry, else ``default`` between stages, else nothing."""
        for link in self.links:
            if (link.src, link.dst) == (src, dst):
                return link.impairment()
        return Impairment() if SEED_NODE in (src, dst) else self.default

    def cut(self, src: str, dst: str, t_s: float, src_since: float = 0.0, dst_since: float = 0.0) -> bool:
        """Whether a partition separates ``src`` from ``dst`` at ``t_s`` seconds after the request started.
        ``src_since``/``dst_since``: when each endpoint became that node (a spare that replaced it); a partition cuts
        off the endpoints that were its nodes when it began, not a spare that took one's place during it."""
        for e in self.events:
            if e.kind != "partition" or not e.active(t_s):
                continue
            if (src in e.nodes and src_since <= e.at_s) != (dst in e.nodes and dst_since <= e.at_s):
                return True
        return False

    @property
    def loses(self) -> bool:
        """Whether some link may lose a message (randomly, in bursts, or by a full rate-cap queue)."""
        links = [self.default] + [link.impairment() for link in self.links]
        return any(i.mean_loss() > 0 or i.rate_mbit is not None for i in links)

    @property
    def idle(self) -> bool:
        """Nothing to emulate: every link perfect and no events."""
        return self.default.perfect and all(link.impairment().perfect for link in self.links) and not self.events


def stage_node(index: int) -> str:
    return f"stage-{index}"


def describe_impairment(i: Impairment) -> str:
    """One link's impairment in a few words (``25 ms +- 2 ms normal, 0.5 % loss``)."""
    parts = []
    if i.delay_ms or i.jitter_ms:
        parts.append(f"{i.delay_ms:g} ms" + (f" +- {i.jitter_ms:g} ms {i.jitter}" if i.jitter_ms else ""))
    if i.rate_mbit is not None:
        parts.append(f"{i.rate_mbit:g} Mbit/s")
    if i.bursty is not None:
        parts.append(f"bursty loss (mean {i.bursty.steady_loss() * 100:.2g} %)")
    elif i.loss:
        parts.append(f"{i.loss * 100:.3g} % loss")
    if i.duplicate:
        parts.append(f"{i.duplicate * 100:.3g} % duplicated")
    if i.reorder:
        parts.append(f"{i.reorder * 100:.3g} % reordered")
    return ", ".join(parts) or "perfect"


def describe_network(n: Network) -> str:
    """The section in one line, for the run's progress output."""
    text = f"stage links {describe_impairment(n.default)}"
    if n.links:
        text += f"; {len(n.links)} link(s) of their own"
    if n.events:
        text += "; events: " + ", ".join(f"{e.kind} {'+'.join(e.nodes)} at {e.at_s:g} s" for e in n.events)
    return text + f" (seed {n.seed})"
