"""The fan-out of a mixture-of-experts block whose experts a plan places, predicted: one token through block L
(``ppharness.plan.predict.cost`` has the parts).

- The block's owner s (the loop node running L) computes attention, the router and any shared expert: its stage's
  compute (``cost.node_ms`` without the routed experts).
- The router chooses ``active`` distinct experts. They are drawn without replacement with weights in proportion to
  the block's ``frequencies`` (uniform when it has none): successive sampling, done as the Gumbel top-k of the log
  weights. Note that with skewed weights and ``active`` above 1 a hot expert is chosen a little less often than its
  frequency says. ``SAMPLES`` routings are drawn per block from a fixed seed (``routings``), so every prediction is
  deterministic, and the planner compares placements on the same routings.
- A chosen expert runs on the owner's own copy if it has one, else on the node holding it with the fewest of this
  token's experts assigned so far (ties: the plan's node order), the chosen experts taken in the router's order
  (``ppharness.run.node.experts`` routes so).
- The owner sends one message to each other node with k > 0 of the token's experts, all at once, and computes its own
  k_s experts meanwhile: the block's expert time is max(``cost.expert_ms`` of k_s on the owner, the longest
  ``cost.remote_experts_ms``: request, the node's fixed cost per token, its k experts, reply). The local experts
  overlap the remote ones. A block's predicted time (``stage {i} experts {L}`` in ``ppharness.plan.predict.simulate``)
  is the mean over the routings.
- Prefill (a prompt of T tokens) is kept simple: every token is routed the same way on average, so node n gets
  T * sum of frequency(e) * share(e, n) (token, expert) pairs, share being 1 on the owner's own copy, else split
  evenly between an expert's holders; one message to each node with a share, all at once, and the owner's part
  overlapped as in decode (``cost.expert_prefill_ms`` for the compute).
- Busy time (what bounds throughput): a node's expected expert compute per token, its fixed cost included for each
  message it serves.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ppharness.errors import PlanError
from ppharness.plan.lang.check import places_experts
from ppharness.plan.lang.document import Block, Cluster, Device, Experts, ModelGraph, Node, PlanDoc, loop
from ppharness.plan.predict import cost

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

SAMPLES = 4000  # routings drawn per block
SEED = 20_250_601  # the routings' seed (with the block's index)


@functools.lru_cache(maxsize=256)
def _routings(count: int, active: int, frequencies: tuple[float, ...], layer: int, samples: int) -> IntArray:
    rng = np.random.default_rng([SEED, layer])
    if frequencies:
        with np.errstate(divide="ignore"):
            keys = np.log(np.asarray(frequencies, dtype=np.float64)) + rng.gumbel(size=(samples, count))
    else:  # equal weights: the Gumbel keys' order is their uniform draws' order, reversed (the same routings)
        keys = -rng.random((samples, count))
    top = np.argpartition(-keys, active - 1, axis=1)[:, :active]
    order = np.argsort(-np.take_along_axis(keys, top, axis=1), axis=1, kind="stable")
    chosen = np.take_along_axis(top, order, axis=1).astype(np.int64)
    chosen.flags.writeable = False
    return chosen


def routings(experts: Experts, layer: int, samples: int = SAMPLES) -> IntArray:
    """``samples`` routings of block ``layer``: each row the ``active`` distinct experts one token is sent to, in the
    order they are drawn (the router's order, most likely first), drawn without replacement with weights in
    proportion to the frequencies (a fixed seed per block: the same every call). An expert of frequency 0 is drawn
    only when fewer than ``active`` have more."""
    if experts.count == 0 or not 1 <= experts.active <= experts.count:
        raise PlanError(f"block {layer} routes a token to {experts.active} of {experts.count} experts — none to draw")
    return _routings(experts.count, experts.active, experts.frequencies, layer, samples)


class Fanout:
    """One mixture-of-experts block's fan-out over a fixed list of nodes (by index, on ``devices``), its owner among
    them: what k of a token's experts cost on each node, and the routings. ``ms`` predicts a placement's expert
    time."""

    def __init__(self, model: ModelGraph, cluster: Cluster, devices: Sequence[Device], owner: int, layer: int):
        self.layer, self.owner = layer, owner
        self.block: Block = model.blocks[layer]
        x = self.block.experts
        self.count, self.active = x.count, x.active
        self.nodes = len(devices)
        home = devices[owner].id
        # table[n, k]: node n computing k of a token's experts, the round trip included (none on the owner);
        # busy[n, k]: what of it keeps n's device busy; r + c * k: the same, for k >= 1, as a line (the proxy's)
        table = np.zeros((self.nodes, self.active + 1))
        busy = np.zeros((self.nodes, self.active + 1))
        self.c: FloatArray = np.zeros(self.nodes)
        self.r: FloatArray = np.zeros(self.nodes)
        for n, device in enumerate(devices):
            one = cost.expert_ms(device, self.block, 1)
            if n == owner:
                self.c[n] = one
            else:
                there = [cost.edge_ms(cluster, home, device.id, cost.request_bytes(model, k)) for k in (0, 1)]
                back = [cost.edge_ms(cluster, device.id, home, cost.reply_bytes(model, k)) for k in (0, 1)]
                self.r[n] = there[0] + device.overhead_ms + back[0]
                self.c[n] = one + there[1] - there[0] + back[1] - back[0]
            for k in range(1, self.active + 1):
                compute = cost.expert_ms(device, self.block, k)
                if n == owner:
                    table[n, k] = busy[n, k] = compute
                else:
                    table[n, k] = cost.remote_experts_ms(model, cluster, home, device, self.block, k)
                    busy[n, k] = device.overhead_ms + compute
        self.table: FloatArray = table
        self.busy_table: FloatArray = busy
        self.chosen = routings(x, layer)
        self.samples = len(self.chosen)
        # how often each expert is among a token's chosen ones, in these routings
        self.p: FloatArray = np.bincount(self.chosen.ravel(), minlength=self.count) / self.samples
        self._rows = np.arange(self.samples)
        self._columns = np.arange(self.nodes)

    def counts(self, holders: Sequence[Sequence[int]]) -> IntArray:
        """How many of each routing's experts each node computes (samples x nodes), ``holders[e]`` the nodes holding
        expert e in plan order (routed as the module's docstring says; none: the owner)."""
        single = np.full(self.count, -1, dtype=np.int64)
        width = max(1, max((len(h) for h in holders), default=1))
        choice = np.full((self.count, width), -1, dtype=np.int64)
        for e, held in enumerate(holders):
            if not held or self.owner in held:
                single[e] = self.owner
            elif len(held) == 1:
                single[e] = held[0]
            else:
                choice[e, : len(held)] = sorted(held)
        counts = np.zeros((self.samples, self.nodes), dtype=np.int64)
        if (single >= 0).all():
            nodes = single[self.chosen]
            flat = (self._rows[:, None] * self.nodes + nodes).ravel()
            return np.bincount(flat, minlength=self.samples * self.nodes).reshape(self.samples, self.nodes)
        for j in range(self.active):
            experts = self.chosen[:, j]
            node = single[experts]
            open_ = node < 0
            if open_.any():
                options = choice[experts[open_]]
                load = counts[self._rows[open_][:, None], np.maximum(options, 0)]
                load = np.where(options >= 0, load, np.iinfo(np.int64).max)
                node = node.copy()
                node[open_] = options[np.arange(len(options)), load.argmin(axis=1)]
            counts[self._rows, node] += 1
        return counts

    def ms(self, counts: IntArray) -> float:
        """The predicted expert time of the block: the mean over the routings of the slowest node's time."""
        return float(self.table[self._columns, counts].max(axis=1).mean())

    def busy(self, counts: IntArray) -> FloatArray:
        """Each node's expected expert compute per token for this block (its fixed cost for each message served)."""
        return np.asarray(self.busy_table[self._columns, counts].mean(axis=0), dtype=np.float64)


def _prefill_ms(doc: PlanDoc, layer: int, owner: Node, holders: Mapping[int, Sequence[Node]], tokens: int) -> float:
    """The block's expert time for a prompt of ``tokens`` (the module's docstring: expected shares, one message per
    node, the owner's part overlapped)."""
    model, cluster = doc.model, doc.cluster
    block = model.blocks[layer]
    x = block.experts
    load: dict[str, float] = {}
    distinct: dict[str, float] = {}
    for e in range(x.count):
        held = holders.get(e) or [owner]
        on = [owner] if owner in held else list(held)
        f = min(1.0, x.frequency(e))
        for node in on:
            share = f / len(on)
            load[node.label] = load.get(node.label, 0.0) + tokens * share
            distinct[node.label] = distinct.get(node.label, 0.0) + 1.0 - (1.0 - share) ** tokens
    nodes = {n.label: n for n in doc.placement.nodes}
    home = cluster.device(owner.device)
    worst = 0.0
    for label, pairs in load.items():
        if pairs <= 0:
            continue
        device = cluster.device(nodes[label].device)
        compute = cost.busy_ms(cost.expert_prefill_ms(device, block, pairs, distinct[label]), device)
        if label == owner.label:
            worst = max(worst, compute)
            continue
        k = max(1, round(pairs))
        worst = max(
            worst,
            cost.edge_ms(cluster, home.id, device.id, cost.request_bytes(model, k, tokens))
            + device.overhead_ms
            + compute
            + cost.edge_ms(cluster, device.id, home.id, cost.reply_bytes(model, k)),
        )
    return worst


@dataclass(frozen=True)
class LayerTime:
    """One mixture-of-experts block's experts as a plan places them, predicted."""

    layer: int
    stage: int  # the owner's position along the loop
    owner: str  # the owner's label
    remote: tuple[str, ...]  # the other nodes computing some of its experts, in plan order
    ms: float  # decode: the mean over the routings of the slowest node (the owner's own experts included)
    prefill_ms: float
    busy: dict[str, float]  # node label -> its expected expert compute per token for this block


def layer_times(doc: PlanDoc, prompt_tokens: int = 8) -> list[LayerTime]:
    """Every mixture-of-experts block's predicted expert time, in block order; empty when the plan places no experts
    (each block's experts are then part of its stage's compute). The plan must have passed ``check_plan``."""
    if not places_experts(doc):
        return []
    nodes = doc.placement.nodes
    index = {n.label: i for i, n in enumerate(nodes)}
    devices = [doc.cluster.device(n.device) for n in nodes]
    order = loop(doc)
    out = []
    for stage, owner in enumerate(order):
        lo, hi = owner.blocks or (0, 0)
        for layer in range(lo, hi):
            x = doc.model.blocks[layer].experts
            if x.count == 0:
                continue
            holders: dict[int, list[Node]] = {}
            for node in nodes:
                for e in node.experts.get(layer, ()):
                    holders.setdefault(e, []).append(node)
            fan = Fanout(doc.model, doc.cluster, devices, index[owner.label], layer)
            counts = fan.counts([[index[n.label] for n in holders.get(e, [])] for e in range(x.count)])
            busy = fan.busy(counts)
            remote = tuple(n.label for n in nodes if n is not owner and any(n in h for h in holders.values()))
            out.append(
                LayerTime(
                    layer=layer,
                    stage=stage,
                    owner=owner.label,
                    remote=remote,
                    ms=fan.ms(counts),
                    prefill_ms=_prefill_ms(doc, layer, owner, holders, prompt_tokens),
                    busy={n.label: float(busy[i]) for i, n in enumerate(nodes) if busy[i] > 0},
                )
            )
    return out
