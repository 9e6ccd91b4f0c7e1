"""What the expert planner decides over — the candidate nodes, the memory each has free for experts, each
mixture-of-experts block's fan-out over them — and the lower bound on every placement's predicted time.

The bound comes from a mixed-integer programme (``scipy.optimize.milp``, HiGHS) on a linear proxy. Per block L:
x[e, n] (node n holds expert e), z[e, n] (the share of e's tokens sent to n, z <= x, the shares of e adding up to 1),
u[n] (a lower bound on the chance that n gets a message: u >= p_e z[e, n] for each e, and u >= the expected experts
on n over ``active``), and t_L >= c_n * sum_e p_e z[e, n] + r_n * u[n] for each n, where p_e is how often e is among a
token's chosen ones in the routings, c_n the time per expert on n and r_n the round trip's fixed part (0 on the
owner). Memory: the experts on each node fit what it has free. It minimises sum_L t_L. For any placement, its
routings' own shares satisfy these constraints and the mean of a maximum is at least the maximum of the means, so the
programme's bound (HiGHS's dual bound, valid when stopped by the time limit too) is a lower bound on the predicted
time of every placement. A problem too large for the programme gets ``round_trip_bound`` instead.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import numpy.typing as npt

from ppharness.errors import PlanError
from ppharness.plan.lang.check import check_plan, gib, node_kv, routed_bytes
from ppharness.plan.lang.document import Block, ExpertGroup, ModelGraph, PlanDoc
from ppharness.plan.predict import cost
from ppharness.plan.predict.fanout import Fanout

FloatArray = npt.NDArray[np.float64]

# the largest proxy programme solved (variables); a larger problem (Kimi K2: 60 blocks of 384 experts over tens of
# nodes, over a million) gets the round-trip bound instead and starts its search from the greedy placement
PROGRAMME_COLUMNS = 200_000


# --- the problem: candidates, memory, fan-outs ------------------------------------------------------------------


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


class Problem:
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
class Proxy:
    placement: Placed | None
    bound: float  # a lower bound on every placement's predicted time (HiGHS's dual bound); 0 when none is known
    status: str


def programme_columns(problem: Problem) -> int:
    """The proxy programme's variables: per block x and z for every (expert, node), u for every node, and t."""
    return sum(2 * problem.count[layer] * problem.m + problem.m + 1 for layer in problem.moe)


def round_trip_bound(problem: Problem) -> Proxy:
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
    return Proxy(None, max(0.0, bound), "skipped")


def solve_proxy(problem: Problem, replicas: bool, time_limit_s: float) -> Proxy:
    """The mixed-integer programme of the module's docstring, solved by HiGHS within ``time_limit_s``."""
    # scipy is heavy: it loads when the programme runs, not with the planner
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
        return Proxy(None, math.inf, "infeasible")
    status = {0: "optimal", 1: "time limit"}.get(result.status, f"status {result.status}")
    if result.x is None:
        return Proxy(None, max(0.0, bound), status)
    x = result.x
    placement: Placed = {}
    for layer in problem.moe:
        x0 = x_at[layer]
        placement[layer] = [[n for n in range(m) if x[x0 + e * m + n] > 0.5] for e in range(problem.count[layer])]
    return Proxy(placement, max(0.0, bound), status)
