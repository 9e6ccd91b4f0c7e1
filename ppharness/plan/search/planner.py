"""The planner: which devices run the model, in which order around the loop, and which blocks each one runs — the
exact search up to ``exact_limit`` devices (``ppharness.plan.search.exact``), the heuristic beyond
(``ppharness.plan.search.heuristic``), both minimising ``ppharness.plan.search.objective``'s value; and the named
policies."""

# A plan is a loop over an ordered list of devices d_1 .. d_k, d_i running the contiguous blocks [c_{i-1}, c_i)
# (every range non-empty), d_1 also the embedding and d_k the head; devices may be left out. Its numbers come from
# the cost model: L, one token's time around the loop (node times, activation edges, the token edge back), and b,
# the busiest node's or link's time per token (a node with a CPU quota below one CPU counts its time over its share).
# Each device's memory holds its blocks' weights, their KV cache for max_context tokens of each request, the
# embedding on the entry, the head on the exit and its runtime reserve (``ppharness.plan.lang.check``).
#
# The exact search runs a dynamic programme over (entry, set of devices used, last device, blocks placed) for
# L*(T), the least latency of a plan whose bottleneck is at most T, and finds the best T by branch and bound. The
# heuristic searches ordered device lists locally, each scored by the exact cuts for its order, from the exact plan
# over a pool of ``exact_limit`` devices and other seeds. ``brute_force`` in the tests enumerates every plan, and the
# exact search must equal it. docs/plans.md, "How the planner searches", has the whole argument.

from __future__ import annotations

import bisect
from collections.abc import Callable

from ppharness.errors import PlanError
from ppharness.plan.build import LATENCY, chain, memory_cuts
from ppharness.plan.lang.check import gib
from ppharness.plan.lang.document import Cluster, ModelGraph, Objective, PlanDoc
from ppharness.plan.search.budget import Budget
from ppharness.plan.search.exact import MAX_EXACT, exact_cost, exact_latency, exact_throughput
from ppharness.plan.search.heuristic import heuristic_plan
from ppharness.plan.search.instance import INF, Instance, Plan
from ppharness.plan.search.objective import evaluate
from ppharness.plan.stages import even_splits

# devices the optimal search takes: its widest neighbourhood grows as the cube of them (at 256 devices one step of
# the local search takes seconds; the shipped clusters have up to 63)
MAX_PLAN_DEVICES = 256

# --- what no plan can fix ---------------------------------------------------------------------------------------


def shortfall(inst: Instance, exact: bool) -> PlanError:
    """The resource that no plan has enough of, and by how much. ``exact``: the exact search found no plan (so
    contiguous ranges are known not to fit); otherwise the heuristic found none."""
    model, r = inst.model, inst.requests
    weights = sum(b.weight_bytes for b in model.blocks) + model.embed_bytes + model.head_bytes
    kv = sum(b.kv_bytes for b in model.blocks) * model.max_context * r
    need = weights + kv
    room = [max(0, int(f)) for f in inst.free]
    cap, largest = sum(room), max(room)
    what = (
        f"{gib(weights)} of weights + {gib(kv)} of KV cache for {model.max_context} tokens x {r} "
        f"request{'s' if r != 1 else ''}"
    )
    if need > cap:
        return PlanError(
            f"the model needs {gib(need)} ({what}) but the cluster's devices hold at most {gib(cap)} together after "
            f"their runtime reserves — {gib(need - cap)} short; add a device or memory (or lower max_context or "
            "requests)"
        )
    worst = max(range(inst.nb), key=lambda b: inst.need[b])
    if inst.need[worst] > largest:
        return PlanError(
            f"block {worst} alone needs {gib(inst.need[worst])} (weights + KV cache) but the largest device holds "
            f"{gib(largest)} after its runtime reserve — {gib(inst.need[worst] - largest)} short; a block is not "
            "split: use a device with more memory (or lower max_context or requests)"
        )
    if inst.nb == 1 or inst.n == 1:
        return PlanError(
            f"the only node needs {gib(need)} ({what}) but the largest device holds {gib(largest)} after its runtime "
            f"reserve — {gib(need - largest)} short; use a device with more memory"
        )
    for role, nbytes, parts in (
        ("entry", model.embed_bytes + inst.need[0], "the embedding + block 0"),
        ("exit", model.head_bytes + inst.need[-1], f"block {inst.nb - 1} + the head"),
    ):
        if nbytes > largest:
            return PlanError(
                f"the {role} needs at least {gib(nbytes)} ({parts}) but the largest device holds {gib(largest)} after "
                f"its runtime reserve — {gib(nbytes - largest)} short; use a device with more memory"
            )
    placed, used = _longest_prefix(inst)
    rest = int(inst.pm[inst.nb] - inst.pm[placed]) + model.head_bytes
    left = f"blocks {placed}..{inst.nb} and the head" if placed < inst.nb else "the head"
    on = ", ".join(inst.ids[d] for d in used) or "none"
    if exact:
        return PlanError(
            f"the devices hold {gib(cap)} together after their runtime reserves, enough for the model's {gib(need)}, "
            f"but not in contiguous block ranges: the most any order of them holds from block 0 is blocks "
            f"0..{placed} (on {on}), leaving {left} ({gib(rest)}) — {gib(rest)} short on one more device; add a "
            "device with that much memory after its reserve"
        )
    return PlanError(
        f"the heuristic search over {inst.n} devices found no plan that fits their memory (packing blocks from block "
        f"0 holds blocks 0..{placed} on {on}, leaving {left}, {gib(rest)}), though the devices hold {gib(cap)} "
        f"together for the model's {gib(need)}; raise exact_limit (up to {MAX_EXACT}) or add memory"
    )


def _longest_prefix(inst: Instance) -> tuple[int, list[int]]:
    """The most blocks an order of some of the devices holds from block 0 (each device one range that fits, the
    first with the embedding; the head left out), and the devices: exact up to MAX_EXACT devices, greedy beyond."""
    n, nb = inst.n, inst.nb
    pm, free = [int(v) for v in inst.pm], [int(v) for v in inst.free]

    def extend(j: int, d: int, entry: bool) -> int:
        """The end of the longest range from block j that device d holds."""
        room = free[d] - (inst.embed if entry else 0)
        return max(j, min(nb, bisect.bisect_right(pm, pm[j] + room) - 1))

    if n > MAX_EXACT:
        used: list[int] = []
        j = 0
        left = set(range(n))
        while left:
            d = max(sorted(left), key=lambda d: extend(j, d, not used))
            k = extend(j, d, not used)
            if k == j:
                break
            used.append(d)
            left.discard(d)
            j = k
        return j, used
    reach: dict[tuple[int, int], tuple[int, list[int]]] = {}
    best: tuple[int, list[int]] = (0, [])
    for d in range(n):
        k = extend(0, d, True)
        if k > 0:
            reach[(1 << d, d)] = (k, [d])
    for mask in range(1, 1 << n):
        for v in range(n):
            got = reach.get((mask, v))
            if got is None:
                continue
            if got[0] > best[0]:
                best = got
            for w in range(n):
                if mask >> w & 1:
                    continue
                k = extend(got[0], w, False)
                key = (mask | 1 << w, w)
                if k > got[0] and (key not in reach or reach[key][0] < k):
                    reach[key] = (k, [*got[1], w])
    return best


# --- the planner ------------------------------------------------------------------------------------------------


def _instance(model: ModelGraph, cluster: Cluster, objective: Objective) -> tuple[Instance, Objective]:
    """The search's instance, and the objective it searches: ``latency`` on a cluster with CPU quotas is max(L, b),
    which is ``throughput`` with one request in flight (the KV cache still counted for ``objective.requests``)."""
    latency = objective.kind == "latency"
    inst = Instance(
        model, cluster, [d.id for d in cluster.devices], objective.requests, 1 if latency else objective.requests
    )
    if latency and inst.quota:
        return inst, Objective(kind="throughput", requests=1)
    return inst, objective


def _search(
    model: ModelGraph, cluster: Cluster, objective: Objective, exact_limit: int, budget: Budget | None = None
) -> Plan:
    if not 0 <= exact_limit <= MAX_EXACT:
        raise ValueError(
            f"exact_limit must be 0 to {MAX_EXACT} (the exact search's tables grow as 2^n), got {exact_limit}"
        )
    if len(cluster.devices) > MAX_PLAN_DEVICES:
        raise PlanError(
            f"the cluster has {len(cluster.devices):,} devices but the planner searches at most {MAX_PLAN_DEVICES:,} "
            "— plan over a part of it (a cluster file with fewer devices), or use --policy even or memory"
        )
    budget = budget or Budget()
    budget.phase = f"costing {len(cluster.devices)} devices and their links"
    inst, objective = _instance(model, cluster, objective)
    if inst.n <= exact_limit:
        solver: Callable[[Instance], tuple[float, Plan | None]] = {
            "latency": exact_latency,
            "throughput": exact_throughput,
            "cost": exact_cost,
        }[objective.kind]
        plan = solver(inst)[1]
        if plan is None:
            raise shortfall(inst, exact=True)
        return plan
    plan = heuristic_plan(inst, objective, pool=exact_limit, budget=budget)
    if plan is None and budget.ran_out is not None:
        raise PlanError(
            f"the time limit of {budget.seconds:g} s ran out during {budget.ran_out}, before any plan that fits was "
            "found — raise the time limit (plan make --time-limit) or plan over fewer devices"
        )
    if plan is None:
        raise shortfall(inst, exact=False)
    return plan


def plan_optimal(
    model: ModelGraph, cluster: Cluster, objective: Objective, exact_limit: int = 8, budget: Budget | None = None
) -> PlanDoc:
    """The best plan for ``objective``: exact for up to ``exact_limit`` devices (at most 12), the heuristic with an
    exact seed over a pool of ``exact_limit`` devices beyond (``ppharness.plan.search.heuristic``). Unused devices are
    left out (not listed as spares). Raise PlanError naming the short resource, and by how much, when no plan fits.
    ``budget``: the heuristic's time limit (then the best plan met when it passed; ``budget.ran_out`` says so)."""
    devices, cuts = _search(model, cluster, objective, exact_limit, budget)
    return chain(model, cluster, devices, cuts, objective, policy="optimal")


def policy_plan(
    policy: str,
    model: ModelGraph,
    cluster: Cluster,
    objective: Objective = LATENCY,
    num_devices: int | None = None,
    budget: Budget | None = None,
) -> PlanDoc:
    """A plan by one of the named policies over the cluster's devices in the file's order (``even``, ``memory``);
    ``optimal`` is the planner's search (``plan_optimal``, within ``budget``)."""
    if policy == "optimal":
        return plan_optimal(model, cluster, objective, budget=budget)
    devices = list(cluster.devices[: num_devices or len(cluster.devices)])
    blocks = len(model.blocks)
    if len(devices) > blocks:
        devices = devices[:blocks]
    if policy == "even":
        cuts = even_splits(blocks, len(devices))
    elif policy == "memory":
        cuts = memory_cuts(blocks, devices)
    else:
        raise PlanError(f"unknown policy {policy!r} — use even, memory or optimal")
    ids = [d.id for d in devices]
    return chain(model, cluster, ids, cuts, objective, policy)


def solve(
    model: ModelGraph, cluster: Cluster, objective: Objective, exact_limit: int = 8
) -> tuple[float, tuple[str, ...], tuple[int, ...]]:
    """``plan_optimal``'s choice as (value by ``evaluate``, devices in loop order, inner cuts)."""
    devices, cuts = _search(model, cluster, objective, exact_limit)
    return evaluate(model, cluster, devices, cuts, objective), devices, cuts


def solve_heuristic(
    model: ModelGraph, cluster: Cluster, objective: Objective, pool: int
) -> tuple[float, tuple[str, ...], tuple[int, ...]]:
    """The heuristic's choice whatever the number of devices (its exact seed over a pool of ``pool`` devices; 0: no
    exact seed), as (value, devices, cuts)."""
    inst, searched = _instance(model, cluster, objective)
    plan = heuristic_plan(inst, searched, pool)
    if plan is None:
        raise shortfall(inst, exact=False)
    return evaluate(model, cluster, plan[0], plan[1], objective), plan[0], plan[1]


def measure_gap(model: ModelGraph, cluster: Cluster, objective: Objective, pool: int) -> dict[str, float]:
    """The heuristic with a pool of ``pool`` devices (fewer than the cluster's, so that it searches) against the exact
    search on one instance: both values and gap = heuristic / exact - 1 (0 when both are 0; never below 0)."""
    exact = solve(model, cluster, objective, exact_limit=MAX_EXACT)[0]
    heuristic = solve_heuristic(model, cluster, objective, pool)[0]
    if exact == 0:
        gap = 0.0 if heuristic == 0 else INF
    else:
        gap = heuristic / exact - 1
    return {"exact": exact, "heuristic": heuristic, "gap": gap}
