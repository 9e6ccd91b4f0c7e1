"""The expert planner: where a mixture-of-experts model's routed experts run.

``place_experts`` takes a plan whose stages are placed and decides which node computes each routed expert: the stage
nodes in the memory their blocks leave, and new expert nodes on the devices given. It minimises the sum over the
blocks of the predicted expert time (``ppharness.plan.predict.fanout``; the decode critical path's share that placement
changes), under every device's memory as ``ppharness.plan.lang.check`` counts it: a mixed-integer programme on a linear
proxy gives a lower bound and a placement (``ppharness.plan.experts.problem``), then local search from the best start
improves it (``ppharness.plan.experts.local_search``).

The report gives the prediction of the placement chosen, the programme's bound and the gap between them. The bound's
chance u is loose (a node holding many cold experts is charged for the coldest one's chance only), so a large gap
says more about the bound than about the placement where round trips dominate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from ppharness.errors import PlanError
from ppharness.plan.experts.local_search import (
    MAX_EVALUATIONS,
    Baseline,
    Search,
    baseline_placement,
    greedy_placement,
    regional_placement,
)
from ppharness.plan.experts.problem import (
    PROGRAMME_COLUMNS,
    Placed,
    Problem,
    Proxy,
    programme_columns,
    round_trip_bound,
    solve_proxy,
)
from ppharness.plan.lang.check import check_plan, gib
from ppharness.plan.lang.document import Edge, ExpertGroup, Head, Node, Op, PlanDoc, with_id


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


def _emit(problem: Problem, placement: Placed, policy: str) -> PlanDoc:
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
    problem: Problem,
    placement: Placed,
    policy: str,
    started: float,
    proxy: Proxy | None = None,
    search: Search | None = None,
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
    problem = Problem(doc, expert_devices)
    if programme_columns(problem) <= PROGRAMME_COLUMNS:
        proxy = solve_proxy(problem, replicas, time_limit_s / 4)
    else:
        proxy = round_trip_bound(problem)
    if proxy.status == "infeasible":
        raise PlanError(
            f"the routed experts ({sum(problem.count.values())} of {gib(problem.size[problem.moe[0]])} each in block "
            f"{problem.moe[0]}) fit the free memory in total but cannot be packed onto the nodes (free: "
            + ", ".join(f"{label} {gib(f)}" for label, f in zip(problem.labels, problem.free))
            + ") — add an expert device or memory"
        )
    starts = [p for p in (proxy.placement, greedy_placement(problem)) if p is not None]
    regional = regional_placement(problem)
    if regional is not None and problem.fits(regional):
        starts.append(regional)
    kinds: tuple[Baseline, ...] = ("round-robin", "uniform")
    for kind in kinds:
        base = baseline_placement(problem, kind)
        if problem.fits(base):
            starts.append(base)
    if not starts:
        raise PlanError("no placement of the routed experts was found within the time limit — raise it, or add memory")
    best = min(starts, key=problem.total)
    placement = {layer: [list(h) for h in held] for layer, held in best.items()}
    search = Search(problem, replicas, started + time_limit_s, max_evaluations)
    placement = search.run(placement)
    return _emit(problem, placement, "experts"), _report(problem, placement, "optimal", started, proxy, search)


def baseline_experts(doc: PlanDoc, expert_devices: Sequence[str], kind: Baseline) -> tuple[PlanDoc, ExpertReport]:
    """A placement that ignores frequencies and links, for comparison: ``round-robin`` or ``uniform`` over the
    expert devices (see ``baseline_placement``). PlanError naming the node when it does not fit."""
    started = time.monotonic()
    problem = Problem(doc, expert_devices)
    placement = baseline_placement(problem, kind)
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
