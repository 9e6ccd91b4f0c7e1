"""Expert parallelism: where a mixture-of-experts model's routed experts run, what the fan-out to them costs, and the
planner that places them.

The model of one token through a mixture-of-experts block L whose experts the plan places (``ppharness.plan.cost``
has the parts):

- The block's owner s (the loop node running L) computes attention, the router and any shared expert: its stage's
  compute (``cost.node_ms`` without the routed experts).
- The router chooses ``active`` distinct experts. They are drawn without replacement with weights in proportion to
  the block's ``frequencies`` (uniform when it has none): successive sampling, done as the Gumbel top-k of the log
  weights. Note that with skewed weights and ``active`` above 1 a hot expert is chosen a little less often than its
  frequency says. ``SAMPLES`` routings are drawn per block from a fixed seed (``routings``), so every prediction is
  deterministic, and the planner compares placements on the same routings.
- A chosen expert runs on the owner's own copy if it has one, else on the node holding it with the fewest of this
  token's experts assigned so far (ties: the plan's node order), the chosen experts taken in the router's order
  (``ppharness.run.experts`` routes so).
- The owner sends one message to each other node with k > 0 of the token's experts, all at once, and computes its own
  k_s experts meanwhile: the block's expert time is max(``cost.expert_ms`` of k_s on the owner, the longest
  ``cost.remote_experts_ms``: request, the node's fixed cost per token, its k experts, reply). The local experts
  overlap the remote ones. A block's predicted time (``stage {i} experts {L}`` in ``ppharness.plan.simulate``) is the
  mean over the routings.
- Prefill (a prompt of T tokens) is kept simple: every token is routed the same way on average, so node n gets
  T * sum of frequency(e) * share(e, n) (token, expert) pairs, share being 1 on the owner's own copy, else split
  evenly between an expert's holders; one message to each node with a share, all at once, and the owner's part
  overlapped as in decode (``cost.expert_prefill_ms`` for the compute).
- Busy time (what bounds throughput): a node's expected expert compute per token, its fixed cost included for each
  message it serves.

The planner (``place_experts``) takes a plan whose stages are placed and decides which node computes each routed
expert: the stage nodes in the memory their blocks leave, and new expert nodes on the devices given. It minimises the
sum over the blocks of the predicted expert time (the decode critical path's share that placement changes), under
every device's memory as ``ppharness.plan.check`` counts it:

1. a mixed-integer programme (``scipy.optimize.milp``, HiGHS) on a linear proxy. Per block L: x[e, n] (node n holds
   expert e), z[e, n] (the share of e's tokens sent to n, z <= x, the shares of e adding up to 1), u[n] (a lower
   bound on the chance that n gets a message: u >= p_e z[e, n] for each e, and u >= the expected experts on n over
   ``active``), and t_L >= c_n * sum_e p_e z[e, n] + r_n * u[n] for each n, where p_e is how often e is among a
   token's chosen ones in the routings, c_n the time per expert on n and r_n the round trip's fixed part (0 on the
   owner). Memory: the experts on each node fit what it has free. It minimises sum_L t_L. For any placement, its
   routings' own shares satisfy these constraints and the mean of a maximum is at least the maximum of the means,
   so the programme's bound (HiGHS's dual bound, valid when stopped by the time limit too) is a lower bound on the
   predicted time of every placement;
2. local search from the best of the programme's placement, a greedy one (every block's experts, hottest first,
   each where it raises its block's proxy time the least), a regional one (where the nodes are in several regions:
   each block's experts on the expert nodes in its owner's region) and the round-robin and uniform baselines where
   they fit.
   For each expert, hottest first: move it to another node, copy it into spare memory (``replicas``), drop a copy
   that does not help, swap it with one of the coldest experts (of any block) on another node; a change is kept when
   the predicted time (on the same routings) goes down. Changes are tried in a fixed order, at most
   ``max_evaluations`` of them, so that the answer depends on the input only, unless a time limit stops the
   programme or the search first (the report says so).

The report gives the prediction of the placement chosen, the programme's bound and the gap between them. The bound's
chance u is loose (a node holding many cold experts is charged for the coldest one's chance only), so a large gap
says more about the bound than about the placement where round trips dominate.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

from ppharness.errors import PlanError
from ppharness.plan import cost
from ppharness.plan.check import FREQUENCY_TOLERANCE, check_plan, gib, node_kv, places_experts, routed_bytes
from ppharness.plan.doc import (
    Block,
    Cluster,
    Device,
    Edge,
    ExpertGroup,
    Experts,
    Head,
    ModelGraph,
    Node,
    Op,
    PlanDoc,
    loop,
    with_id,
)

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

SAMPLES = 4000  # routings drawn per block
SEED = 20_250_601  # the routings' seed (with the block's index)
MAX_EVALUATIONS = 20_000  # placements the local search predicts, at most
# the largest proxy programme solved (variables); a larger problem (Kimi K2: 60 blocks of 384 experts over tens of
# nodes, over a million) gets the round-trip bound instead and starts its search from the greedy placement
PROGRAMME_COLUMNS = 200_000
IMPROVEMENT = 1e-9  # a change is kept when it lowers the prediction by more than this share
Baseline = Literal["round-robin", "uniform"]


# --- routings and the fan-out's time ----------------------------------------------------------------------------


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


# --- frequencies ------------------------------------------------------------------------------------------------


def with_frequencies(doc: PlanDoc, freqs: Mapping[int, Sequence[float]], source: str = "routing") -> PlanDoc:
    """``doc`` with block L's expert frequencies set to ``freqs[L]`` (how often each routed expert is among a token's
    chosen ones, e.g. as a probe run measures them). Each list has one value per routed expert, each from 0 to 1,
    adding up to the block's ``active``; a PlanError naming ``source`` and the layer otherwise."""
    blocks = list(doc.model.blocks)
    for layer, values in sorted(freqs.items()):
        at = f"{source}: $.layers.{layer}"
        if not 0 <= layer < len(blocks):
            raise PlanError(f"{at}: the model has blocks 0 to {len(blocks) - 1} — name one of its blocks")
        x = blocks[layer].experts
        if x.count == 0:
            raise PlanError(f"{at}: block {layer} is dense — frequencies belong to mixture-of-experts blocks only")
        if len(values) != x.count:
            raise PlanError(
                f"{at}: {len(values)} frequencies for block {layer}'s {x.count} routed experts — give one per expert"
            )
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise PlanError(
                    f"{at}[{i}]: {str(v)[:40]} is not a frequency — a frequency is the share of tokens that choose "
                    "the expert, a number from 0 to 1"
                )
        total = math.fsum(values)
        if abs(total - x.active) > FREQUENCY_TOLERANCE * x.active:
            raise PlanError(
                f"{at}: the frequencies add up to {total:.6g} but each token chooses {x.active} experts — they add up "
                f"to {x.active}; scale them"
            )
        experts = msgspec.structs.replace(x, frequencies=tuple(float(v) for v in values))
        blocks[layer] = msgspec.structs.replace(blocks[layer], experts=experts)
    model = msgspec.structs.replace(doc.model, blocks=tuple(blocks))
    return with_id(msgspec.structs.replace(doc, model=model))


def load_routing(path: str | Path) -> dict[int, list[float]]:
    """A routing file: JSON ``{"layers": {"<block>": [frequency of each routed expert, ...]}}`` -> block ->
    frequencies (checked against a model by ``with_frequencies``)."""
    path = Path(path)
    try:
        raw = msgspec.json.decode(path.read_bytes())
    except OSError as exc:
        raise PlanError(f"{path}: cannot read the routing file ({exc.strerror})") from None
    except msgspec.DecodeError as exc:
        raise PlanError(f'{path}: not JSON ({exc}) — write {{"layers": {{"0": [0.25, 0.5, ...]}}}}') from None
    layers = raw.get("layers") if isinstance(raw, dict) else None
    if not isinstance(layers, dict) or set(raw) != {"layers"}:
        raise PlanError(f'{path}: $: a routing file is {{"layers": {{"<block>": [frequency per expert, ...]}}}}')
    out: dict[int, list[float]] = {}
    for key, values in layers.items():
        if not (isinstance(key, str) and re.fullmatch(r"[0-9]{1,9}", key)):
            raise PlanError(f"{path}: $.layers: {str(key)[:40]!r} is not a block number — key each list by its block")
        if not isinstance(values, list):
            raise PlanError(f"{path}: $.layers.{key}: a list of frequencies, one per routed expert")
        out[int(key)] = values
    return out


# --- the problem: candidates, memory, fan-outs -----------------------------------------------------------------


def without_routed_experts(model: ModelGraph) -> ModelGraph:
    """``model`` as its stages see it when the experts go elsewhere: each mixture-of-experts block reduced to its
    dense part (attention, router, shared expert), the blocks' ``experts`` left out. What the chain planner plans
    with for ``ppharness plan make --experts-on``."""
    blocks = []
    for b in model.blocks:
        if b.experts.count:
            flops, nbytes = cost.dense_part(b)
            b = Block(weight_bytes=nbytes, flops=flops, kv_bytes=b.kv_bytes)
        blocks.append(b)
    return msgspec.structs.replace(model, blocks=tuple(blocks))


def _stages_only(doc: PlanDoc) -> PlanDoc:
    """``doc`` without its expert placement: no experts ops, no expert nodes, no experts edges."""
    nodes = tuple(
        msgspec.structs.replace(n, ops=tuple(op for op in n.ops if not isinstance(op, ExpertGroup)))
        for n in doc.placement.nodes
        if not n.expert_only
    )
    edges = tuple(e for e in doc.placement.edges if e.kind != "experts")
    placement = msgspec.structs.replace(doc.placement, nodes=nodes, edges=edges)
    return msgspec.structs.replace(doc, placement=placement, id="")


class _Problem:
    """What the planner decides over: the candidate nodes (the stage nodes, then one expert node per device given),
    the memory each has free for experts, and each mixture-of-experts block's fan-out over them."""

    def __init__(self, doc: PlanDoc, expert_devices: Sequence[str]):
        base = _stages_only(doc)
        self.doc = base
        model, cluster = base.model, base.cluster
        # the stages must make a plan of their own with the routed experts left out
        check_plan(msgspec.structs.replace(base, model=without_routed_experts(model)), "<stages>")
        stages = list(base.placement.nodes)  # in the plan's order, which breaks routing ties
        used = {n.device: n.label for n in base.placement.nodes}
        known = {d.id for d in cluster.devices}
        seen: set[str] = set()
        for i, dev in enumerate(expert_devices):
            if dev not in known:
                raise PlanError(
                    f"expert device {i + 1}: unknown device {dev!r} — the cluster's devices are: "
                    f"{', '.join(sorted(known))}"
                )
            if dev in used:
                raise PlanError(
                    f"expert device {dev!r} runs stage node {used[dev]!r} — a stage's device keeps experts in the "
                    "memory its blocks leave anyway; name only devices without a stage"
                )
            if dev in base.placement.spares:
                raise PlanError(f"expert device {dev!r} is a spare of the plan — a spare runs no node; take it out")
            if dev in seen:
                raise PlanError(f"expert device {dev!r} is named twice — name each device once")
            seen.add(dev)
        self.moe = [layer for layer, b in enumerate(model.blocks) if b.experts.count]
        if not self.moe:
            raise PlanError(
                f"the model ({model.source}) has no mixture-of-experts blocks — there are no experts to place"
            )
        self.stages = stages
        self.labels = [n.label for n in stages] + list(expert_devices)
        self.devices = [cluster.device(n.device) for n in stages] + [cluster.device(d) for d in expert_devices]
        self.m = len(self.labels)
        requests = base.placement.objective.requests
        free = []
        for node, device in zip(stages, self.devices):
            lo, hi = node.blocks or (0, 0)
            weights = sum(b.weight_bytes for b in model.blocks[lo:hi]) - routed_bytes(model, lo, hi)
            weights += (model.embed_bytes if node.embeds else 0) + (model.head_bytes if node.heads else 0)
            free.append(device.memory - device.reserve - weights - node_kv(base, node, requests))
        free += [max(0, d.memory - d.reserve) for d in self.devices[len(stages) :]]
        self.free = free
        owner_of = {layer: i for i, n in enumerate(stages) if n.blocks for layer in range(*n.blocks)}
        self.owner = {layer: owner_of[layer] for layer in self.moe}
        self.size = {layer: model.blocks[layer].experts.bytes_per_expert for layer in self.moe}
        self.count = {layer: model.blocks[layer].experts.count for layer in self.moe}
        self.fan = {layer: Fanout(model, cluster, self.devices, self.owner[layer], layer) for layer in self.moe}
        self._fits()

    def _fits(self) -> None:
        need = sum(self.count[layer] * self.size[layer] for layer in self.moe)
        room = sum(self.free)
        if need > room:
            raise PlanError(
                f"the routed experts need {gib(need)} ({sum(self.count.values())} experts of {len(self.moe)} blocks) "
                f"but the stage devices' spare memory and the expert devices hold {gib(room)} together — "
                f"{gib(need - room)} short; add expert devices or memory"
            )
        largest = max(self.free)
        for layer in self.moe:
            if self.size[layer] > largest:
                raise PlanError(
                    f"one expert of block {layer} needs {gib(self.size[layer])} but the most any node has free is "
                    f"{gib(largest)} — an expert is not split; use a device with more memory"
                )

    def allowed(self, layer: int, n: int) -> bool:
        """Whether candidate ``n`` may compute block ``layer``'s experts: an expert node, or the block's owner (a stage
        computes the experts of its own blocks only)."""
        return n >= len(self.stages) or n == self.owner[layer]

    def value(self, layer: int, holders: Sequence[Sequence[int]]) -> float:
        fan = self.fan[layer]
        return fan.ms(fan.counts(holders))

    def total(self, placement: Mapping[int, Sequence[Sequence[int]]]) -> float:
        return math.fsum(self.value(layer, placement[layer]) for layer in self.moe)

    def fits(self, placement: Mapping[int, Sequence[Sequence[int]]]) -> bool:
        used = [0] * self.m
        for layer in self.moe:
            for held in placement[layer]:
                for n in held:
                    used[n] += self.size[layer]
        return all(u <= f for u, f in zip(used, self.free))


Placed = dict[int, list[list[int]]]  # block -> per expert the candidate nodes holding it, increasing


# --- the proxy programme ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Proxy:
    placement: Placed | None
    bound: float  # a lower bound on every placement's predicted time (HiGHS's dual bound); 0 when none is known
    status: str


def programme_columns(problem: _Problem) -> int:
    """The proxy programme's variables: per block x and z for every (expert, node), u for every node, and t."""
    return sum(2 * problem.count[layer] * problem.m + problem.m + 1 for layer in problem.moe)


def _round_trip_bound(problem: _Problem) -> _Proxy:
    """A lower bound on every placement's predicted time that needs no programme, for problems too large for it.

    A token's expert time in block L is at least ``t_L``, the cheapest round trip to another node with one expert
    (``Fanout.table[n, 1]``), whenever one of its experts is not on the owner; the chance of that is at least the
    expected number of its experts off the owner over ``active``, and that number is ``active`` less the summed
    frequencies of the experts the owner holds. The owner holds at most its free memory's worth of its blocks'
    experts, so no placement beats the sum over the blocks of ``t_L`` less the most that free memory can take off:
    a fractional knapsack of the owner's experts, each worth ``t_L * p_e / active`` for its bytes."""
    bound = 0.0
    for owner in sorted(set(problem.owner.values())):
        layers = [layer for layer in problem.moe if problem.owner[layer] == owner]
        worth: list[FloatArray] = []
        weight: list[FloatArray] = []
        for layer in layers:
            fan = problem.fan[layer]
            remote = [n for n in range(problem.m) if n != owner and problem.allowed(layer, n)]
            t = min((float(fan.table[n, 1]) for n in remote), default=0.0)
            bound += t
            worth.append(t * fan.p / fan.active)
            weight.append(np.full(problem.count[layer], float(problem.size[layer])))
        value, size = np.concatenate(worth), np.concatenate(weight)
        order = np.argsort(-value / np.maximum(size, 1.0), kind="stable")
        value, size = value[order], size[order]
        room = max(0.0, float(problem.free[owner]))
        whole = int(np.searchsorted(np.cumsum(size), room, side="right"))
        taken = float(value[:whole].sum())
        if whole < len(value):
            taken += float(value[whole]) * (room - float(size[:whole].sum())) / float(size[whole])
        bound -= taken
    return _Proxy(None, max(0.0, bound), "skipped")


def _proxy(problem: _Problem, replicas: bool, time_limit_s: float) -> _Proxy:
    """The mixed-integer programme of the module's docstring, solved by HiGHS within ``time_limit_s``."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    m = problem.m
    columns = 0
    x_at: dict[int, int] = {}
    z_at: dict[int, int] = {}
    u_at: dict[int, int] = {}
    t_at: dict[int, int] = {}
    for layer in problem.moe:  # per block: x[e, n], z[e, n], u[n], t
        e = problem.count[layer]
        x_at[layer], z_at[layer], u_at[layer] = columns, columns + e * m, columns + 2 * e * m
        t_at[layer] = columns + 2 * e * m + m
        columns += 2 * e * m + m + 1
    lower, upper = np.zeros(columns), np.ones(columns)
    integral = np.zeros(columns)
    objective = np.zeros(columns)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(entries: list[tuple[int, float]], low: float, high: float) -> None:
        r = len(lo)
        for c, v in entries:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        lo.append(low)
        hi.append(high)

    memory: list[list[tuple[int, float]]] = [[] for _ in range(m)]
    for layer in problem.moe:
        fan, e_count, owner = problem.fan[layer], problem.count[layer], problem.owner[layer]
        c, r, p = fan.c, fan.r, fan.p
        x0, z0, u0, t = x_at[layer], z_at[layer], u_at[layer], t_at[layer]
        upper[t] = math.inf
        objective[t] = 1.0
        for e in range(e_count):
            for n in range(m):
                x, z = x0 + e * m + n, z0 + e * m + n
                integral[x] = 1
                if problem.free[n] < problem.size[layer] or not problem.allowed(layer, n):
                    upper[x] = upper[z] = 0
                row([(z, 1.0), (x, -1.0)], -math.inf, 0.0)
                memory[n].append((x, float(problem.size[layer])))
                if n != owner and p[e] > 0:
                    row([(z, float(p[e])), (u0 + n, -1.0)], -math.inf, 0.0)
            row([(z0 + e * m + n, 1.0) for n in range(m)], 1.0, 1.0)
            if not replicas:
                row([(x0 + e * m + n, 1.0) for n in range(m)], 1.0, 1.0)
        for n in range(m):
            load = [(z0 + e * m + n, float(p[e])) for e in range(e_count) if p[e] > 0]
            if n != owner:
                row([(z, v / fan.active) for z, v in load] + [(u0 + n, -1.0)], -math.inf, 0.0)
            terms = [(z, float(c[n]) * v) for z, v in load] + [(t, -1.0)]
            if n != owner:
                terms.append((u0 + n, float(r[n])))
            row(terms, -math.inf, 0.0)
    for n in range(m):
        if memory[n]:
            row(memory[n], -math.inf, float(problem.free[n]))
    matrix = coo_array((vals, (rows, cols)), shape=(len(lo), columns)).tocsr()
    result = milp(
        objective,
        integrality=integral,
        bounds=Bounds(lower, upper),
        constraints=LinearConstraint(matrix, np.array(lo), np.array(hi)),
        options={"time_limit": max(0.1, time_limit_s), "disp": False},
    )
    bound = getattr(result, "mip_dual_bound", None)
    bound = float(bound) if bound is not None and math.isfinite(bound) else 0.0
    if result.status == 2:
        return _Proxy(None, math.inf, "infeasible")
    status = {0: "optimal", 1: "time limit"}.get(result.status, f"status {result.status}")
    if result.x is None:
        return _Proxy(None, max(0.0, bound), status)
    x = result.x
    placement: Placed = {}
    for layer in problem.moe:
        x0 = x_at[layer]
        placement[layer] = [[n for n in range(m) if x[x0 + e * m + n] > 0.5] for e in range(problem.count[layer])]
    return _Proxy(placement, max(0.0, bound), status)


# --- starting points and local search ---------------------------------------------------------------------------


def _greedy(problem: _Problem) -> Placed | None:
    """The experts of all blocks, hottest first, each on the node where it raises its block's proxy time (the slowest
    node's expected load and round trip) the least, among the nodes with room (ties: the first node); None when an
    expert finds no room."""
    left = np.asarray(problem.free, dtype=np.float64)
    load = {layer: np.zeros(problem.m) for layer in problem.moe}
    chance = {layer: np.zeros(problem.m) for layer in problem.moe}
    allowed = {layer: np.array([problem.allowed(layer, n) for n in range(problem.m)]) for layer in problem.moe}
    placement: Placed = {layer: [[] for _ in range(problem.count[layer])] for layer in problem.moe}
    columns = np.arange(problem.m)
    for layer, e in _items(problem):
        fan = problem.fan[layer]
        p = fan.p[e]
        remote = columns != fan.owner
        base = fan.c * load[layer] + fan.r * chance[layer]
        new = fan.c * (load[layer] + p) + fan.r * np.where(remote, np.maximum(chance[layer], p), chance[layer])
        # the slowest other node, for each candidate: the largest of base without the candidate
        order = np.argsort(-base, kind="stable")
        first, second = base[order[0]], base[order[1]] if problem.m > 1 else -math.inf
        others = np.where(columns == order[0], second, first)
        score = np.maximum(new, others)
        ok = allowed[layer] & (left >= problem.size[layer])
        if not ok.any():
            return None
        n = int(np.argmin(np.where(ok, score, math.inf)))
        load[layer][n] += p
        if n != fan.owner:
            chance[layer][n] = max(chance[layer][n], p)
        left[n] -= problem.size[layer]
        placement[layer][e] = [n]
    return placement


def _items(problem: _Problem) -> list[tuple[int, int]]:
    """Every (block, expert), hottest first (ties: block, then expert)."""
    items = [(layer, e) for layer in problem.moe for e in range(problem.count[layer])]
    return sorted(items, key=lambda item: (-problem.fan[item[0]].p[item[1]], item))


def _baseline(problem: _Problem, kind: Baseline) -> Placed:
    """Every expert on one expert node, ignoring frequencies and links: ``round-robin`` deals the experts of all
    blocks to the expert nodes in turn; ``uniform`` gives each expert node an equal run of each block's experts. With
    no expert device, every block keeps its experts on its owner."""
    first = len(problem.stages)
    k = problem.m - first
    placement: Placed = {}
    dealt = 0
    for layer in problem.moe:
        count = problem.count[layer]
        if k == 0:
            placement[layer] = [[problem.owner[layer]] for _ in range(count)]
            continue
        if kind == "round-robin":
            placement[layer] = [[first + (dealt + e) % k] for e in range(count)]
            dealt += count
        else:
            placement[layer] = [[first + e * k // count] for e in range(count)]
    return placement


def _regional(problem: _Problem) -> Placed | None:
    """Each block's experts dealt in turn to the expert nodes in its owner's region: a start that pays no
    inter-region round trip. None when the candidates are all in one region or a block's region has no expert node."""
    first = len(problem.stages)
    regions = [d.region for d in problem.devices]
    if len(set(regions)) < 2:
        return None
    placement: Placed = {}
    for layer in problem.moe:
        local = [n for n in range(first, problem.m) if regions[n] == regions[problem.owner[layer]]]
        if not local:
            return None
        placement[layer] = [[local[e % len(local)]] for e in range(problem.count[layer])]
    return placement


SWAP_PARTNERS = 4  # the coldest experts on a node that the local search tries to swap a hotter one with


@dataclass
class _Search:
    """First-improvement local search over placements (the module's docstring), on the predicted time."""

    problem: _Problem
    replicas: bool
    deadline: float
    max_evaluations: int
    evaluations: int = 0
    accepted: int = 0
    stopped_by_time: bool = False

    def out_of_budget(self) -> bool:
        if self.evaluations >= self.max_evaluations:
            return True
        if time.monotonic() > self.deadline:
            self.stopped_by_time = True
            return True
        return False

    def run(self, placement: Placed) -> Placed:
        """Improve ``placement`` (in place) until no change helps or the budget is spent."""
        problem = self.problem
        self.placement = placement
        self.left = list(problem.free)
        for layer in problem.moe:
            for held in placement[layer]:
                for n in held:
                    self.left[n] -= problem.size[layer]
        self.values = {layer: problem.value(layer, placement[layer]) for layer in problem.moe}
        items = _items(problem)
        improved = True
        while improved and not self.out_of_budget():
            improved = False
            # each node's experts, coldest first, as the pass starts (swap partners; checked again when used)
            cold = [[item for item in reversed(items) if n in placement[item[0]][item[1]]] for n in range(problem.m)]
            for layer, e in items:
                if self.out_of_budget():
                    break
                improved |= self._item(layer, e, cold)
        return placement

    def _try(self, changes: dict[tuple[int, int], list[int]], keep_equal: bool = False) -> bool:
        """Apply ``changes`` ((block, expert) -> its new holders) when the predicted time of the blocks they touch
        goes down (or stays, with ``keep_equal``) and the memory allows; True when applied."""
        problem, placement = self.problem, self.placement
        delta = [0] * problem.m
        for (layer, e), held in changes.items():
            for n in held:
                delta[n] += problem.size[layer]
            for n in placement[layer][e]:
                delta[n] -= problem.size[layer]
        if any(d > room for d, room in zip(delta, self.left)):
            return False
        self.evaluations += 1
        trial = {layer: [list(h) for h in placement[layer]] for layer, _ in changes}
        for (layer, e), held in changes.items():
            trial[layer][e] = sorted(held)
        values = {layer: problem.value(layer, block) for layer, block in trial.items()}
        before = math.fsum(self.values[layer] for layer in trial)
        after = math.fsum(values.values())
        slack = IMPROVEMENT * before
        if not (after < before - slack or (keep_equal and after <= before + slack)):
            return False
        for layer, block in trial.items():
            placement[layer] = block
            self.values[layer] = values[layer]
        self.left = [room - d for room, d in zip(self.left, delta)]
        self.accepted += 1
        return True

    def _item(self, layer: int, e: int, cold: list[list[tuple[int, int]]]) -> bool:
        """Every change to (``layer``, ``e``): move it, copy it, drop a copy, swap it with a colder expert."""
        problem, m = self.problem, self.problem.m
        placement = self.placement
        hot = problem.fan[layer].p[e]
        changed = False
        targets = [b for b in range(m) if problem.allowed(layer, b)]
        for a in list(placement[layer][e]):
            for b in targets:
                held = placement[layer][e]
                if a in held and b not in held and self._try({(layer, e): [n for n in held if n != a] + [b]}):
                    changed = True
        if self.replicas:
            for b in targets:
                held = placement[layer][e]
                if b not in held and self._try({(layer, e): [*held, b]}):
                    changed = True
        for a in list(placement[layer][e]):
            held = placement[layer][e]
            if len(held) > 1 and self._try({(layer, e): [n for n in held if n != a]}, keep_equal=True):
                changed = True
        for a in list(placement[layer][e]):
            for b in targets:
                if b in placement[layer][e] or a not in placement[layer][e]:
                    continue
                partners = [
                    (other, f)
                    for other, f in cold[b]
                    if b in placement[other][f]
                    and a not in placement[other][f]
                    and (other, f) != (layer, e)
                    and problem.allowed(other, a)
                ]
                for other, f in partners[:SWAP_PARTNERS]:
                    if problem.fan[other].p[f] >= hot:
                        break
                    mine = [n for n in placement[layer][e] if n != a] + [b]
                    theirs = [n for n in placement[other][f] if n != b] + [a]
                    if self._try({(layer, e): mine, (other, f): theirs}):
                        changed = True
                        break
        return changed


# --- the plan ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertReport:
    """What the expert planner did and what it predicts: ``predicted_ms`` is the sum over the mixture-of-experts
    blocks of the predicted expert time (what ``simulate``'s ``stage {i} experts {L}`` rows add up to)."""

    policy: str  # optimal, round-robin or uniform
    predicted_ms: float
    bound_ms: float  # the proxy programme's lower bound on every placement's prediction (nan for a baseline)
    proxy_ms: float  # the prediction of the programme's own placement (nan when it found none, or a baseline)
    status: str  # the programme's: optimal, time limit, ...; skipped (too large: the round-trip bound)
    evaluations: int  # placements the local search predicted
    accepted: int  # changes it kept
    stopped_by_time: bool
    seconds: float
    expert_nodes: tuple[str, ...]  # devices given that received experts
    replicas: int  # copies beyond one per expert

    @property
    def gap(self) -> float:
        """predicted / bound - 1 (0 when both are 0, infinite when only the bound is): how far the placement may
        be from the best one. Never below 0 (HiGHS's tolerances may put its bound a hair above)."""
        if math.isnan(self.bound_ms):
            return math.nan
        if self.bound_ms <= 0:
            return 0.0 if self.predicted_ms <= 0 else math.inf
        return max(0.0, self.predicted_ms / self.bound_ms - 1)

    def summary(self) -> str:
        line = f"experts ({self.policy}): predicted {self.predicted_ms:.3f} ms per token over the expert blocks"
        if not math.isnan(self.bound_ms) and self.status == "skipped":
            line += (
                f"; round-trip bound {self.bound_ms:.3f} ms (gap {100 * self.gap:.1f}%; the programme is too large "
                f"and was skipped); local search kept {self.accepted} of {self.evaluations} changes"
                + (" (stopped by the time limit)" if self.stopped_by_time else "")
            )
        elif not math.isnan(self.bound_ms):
            line += (
                f"; bound {self.bound_ms:.3f} ms (gap {100 * self.gap:.1f}%, programme {self.status}"
                + (f", its placement {self.proxy_ms:.3f} ms" if not math.isnan(self.proxy_ms) else "")
                + f"); local search kept {self.accepted} of {self.evaluations} changes"
                + (" (stopped by the time limit)" if self.stopped_by_time else "")
            )
        nodes = ", ".join(self.expert_nodes) or "none"
        return f"{line}; expert nodes: {nodes}; {self.replicas} replica(s); {self.seconds:.2f} s"


def _emit(problem: _Problem, placement: Placed, policy: str) -> PlanDoc:
    """The plan with ``placement``: experts ops on the stage nodes (after their blocks) and on one node per expert
    device that received experts, an experts edge from each block's owner to each other node holding its experts."""
    doc = problem.doc
    first = len(problem.stages)
    ops: list[list[ExpertGroup]] = [[] for _ in range(problem.m)]
    for layer in problem.moe:
        by_node: dict[int, list[int]] = {}
        for e, held in enumerate(placement[layer]):
            for n in held:
                by_node.setdefault(n, []).append(e)
        for n, ids in sorted(by_node.items()):
            ops[n].append(ExpertGroup(layer=layer, ids=tuple(ids)))
    stage_index = {n.label: i for i, n in enumerate(problem.stages)}
    nodes: list[Node] = []
    for node in doc.placement.nodes:
        groups = ops[stage_index[node.label]]
        body: list[Op] = [op for op in node.ops if not isinstance(op, Head)]
        tail: list[Op] = [op for op in node.ops if isinstance(op, Head)]
        nodes.append(msgspec.structs.replace(node, ops=tuple(body + list(groups) + tail)))
    for n in range(first, problem.m):
        if ops[n]:
            nodes.append(Node(device=problem.labels[n], ops=tuple(ops[n])))
    fans: dict[str, list[str]] = {}
    for layer in problem.moe:
        owner = problem.owner[layer]
        src = problem.labels[owner]
        for n in sorted({n for held in placement[layer] for n in held if n != owner}):
            if problem.labels[n] not in fans.setdefault(src, []):
                fans[src].append(problem.labels[n])
    order = {label: i for i, label in enumerate(problem.labels)}
    edges: list[Edge] = []
    for node in nodes:
        edges += [e for e in doc.placement.edges if e.src == node.label]
        for dst in sorted(fans.get(node.label, []), key=order.__getitem__):
            edges.append(Edge(src=node.label, dst=dst, kind="experts"))
    policy = f"{doc.placement.policy}-{policy}" if doc.placement.policy else policy
    placement_ = msgspec.structs.replace(doc.placement, nodes=tuple(nodes), edges=tuple(edges), policy=policy)
    out = with_id(msgspec.structs.replace(doc, placement=placement_))
    check_plan(out, "<expert placement>")
    return out


def _report(
    problem: _Problem,
    placement: Placed,
    policy: str,
    started: float,
    proxy: _Proxy | None = None,
    search: _Search | None = None,
) -> ExpertReport:
    first = len(problem.stages)
    used = sorted({n for layer in problem.moe for held in placement[layer] for n in held if n >= first})
    return ExpertReport(
        policy=policy,
        predicted_ms=problem.total(placement),
        bound_ms=proxy.bound if proxy is not None else math.nan,
        proxy_ms=problem.total(proxy.placement) if proxy is not None and proxy.placement is not None else math.nan,
        status=proxy.status if proxy is not None else "",
        evaluations=search.evaluations if search is not None else 0,
        accepted=search.accepted if search is not None else 0,
        stopped_by_time=search.stopped_by_time if search is not None else False,
        seconds=time.monotonic() - started,
        expert_nodes=tuple(problem.labels[n] for n in used),
        replicas=sum(len(held) - 1 for layer in problem.moe for held in placement[layer]),
    )


def place_experts(
    doc: PlanDoc,
    expert_devices: Sequence[str],
    *,
    replicas: bool = True,
    time_limit_s: float = 10.0,
    max_evaluations: int = MAX_EVALUATIONS,
) -> tuple[PlanDoc, ExpertReport]:
    """Place the routed experts of ``doc``'s mixture-of-experts blocks on its stage nodes and on new expert nodes on
    ``expert_devices``: the proxy programme, then local search (the module's docstring). ``doc``'s stages are placed
    already and must pass ``check_plan`` with their blocks' routed experts left out; any expert placement it has is
    replaced. A quarter of ``time_limit_s`` goes to the programme (its bound seldom improves past the root
    relaxation), the rest to the search. Returns the plan (checked; policy ``experts``, after the stages' policy) and
    the report. A PlanError names the device or the memory that is short when the experts cannot be placed."""
    started = time.monotonic()
    problem = _Problem(doc, expert_devices)
    if programme_columns(problem) <= PROGRAMME_COLUMNS:
        proxy = _proxy(problem, replicas, time_limit_s / 4)
    else:
        proxy = _round_trip_bound(problem)
    if proxy.status == "infeasible":
        raise PlanError(
            f"the routed experts ({sum(problem.count.values())} of {gib(problem.size[problem.moe[0]])} each in block "
            f"{problem.moe[0]}) fit the free memory in total but cannot be packed onto the nodes (free: "
            + ", ".join(f"{label} {gib(f)}" for label, f in zip(problem.labels, problem.free))
            + ") — add an expert device or memory"
        )
    starts = [p for p in (proxy.placement, _greedy(problem)) if p is not None]
    regional = _regional(problem)
    if regional is not None and problem.fits(regional):
        starts.append(regional)
    kinds: tuple[Baseline, ...] = ("round-robin", "uniform")
    for kind in kinds:
        base = _baseline(problem, kind)
        if problem.fits(base):
            starts.append(base)
    if not starts:
        raise PlanError("no placement of the routed experts was found within the time limit — raise it, or add memory")
    best = min(starts, key=problem.total)
    placement = {layer: [list(h) for h in held] for layer, held in best.items()}
    search = _Search(problem, replicas, started + time_limit_s, max_evaluations)
    placement = search.run(placement)
    return _emit(problem, placement, "experts"), _report(problem, placement, "optimal", started, proxy, search)


def baseline_experts(doc: PlanDoc, expert_devices: Sequence[str], kind: Baseline) -> tuple[PlanDoc, ExpertReport]:
    """A placement that ignores frequencies and links, for comparison: ``round-robin`` or ``uniform`` over the
    expert devices (see ``_baseline``). PlanError naming the node when it does not fit."""
    started = time.monotonic()
    problem = _Problem(doc, expert_devices)
    placement = _baseline(problem, kind)
    used = [0] * problem.m
    for layer in problem.moe:
        for held in placement[layer]:
            for n in held:
                used[n] += problem.size[layer]
    for n in range(problem.m):
        if used[n] > problem.free[n]:
            raise PlanError(
                f"the {kind} placement puts {gib(used[n])} of experts on {problem.labels[n]!r}, which has "
                f"{gib(problem.free[n])} free — {gib(used[n] - problem.free[n])} short; add expert devices"
            )
    return _emit(problem, placement, kind), _report(problem, placement, kind, started)
