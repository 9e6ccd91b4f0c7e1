"""The planner's reference: every plan tried one by one (``brute_force``), what the exact search must equal."""

from __future__ import annotations

import functools
import itertools

from ppharness.plan.lang.document import Cluster, ModelGraph, Objective
from ppharness.plan.predict.cost import Part, busy_ms, edge_ms, loop_time, node_ms, serialization_ms
from ppharness.plan.search.instance import Instance
from ppharness.plan.search.objective import block_bytes, objective_value
from ppharness.plan.search.planner import shortfall


def brute_force(model: ModelGraph, cluster: Cluster, objective: Objective) -> tuple[float, list[str], list[int]]:
    """Every ordered subset of the devices and every cut of the blocks into that many non-empty ranges, each checked
    for memory and valued by ``evaluate``'s arithmetic (``ppharness.plan.predict.cost``): the exact answer, for small
    instances (it grows as n! * C(B - 1, n - 1)). Raise PlanError when no plan fits."""
    nb, r = len(model.blocks), objective.requests
    ids = [d.id for d in cluster.devices]
    need = [0, *itertools.accumulate(block_bytes(model, b, r) for b in range(nb))]
    room = {d.id: d.memory - d.reserve for d in cluster.devices}
    price = {d.id: d.usd_per_hour for d in cluster.devices}

    @functools.cache
    def node(dev: str, lo: int, hi: int, head: bool) -> Part:
        device = cluster.device(dev)
        ms = node_ms(model, device, lo, hi, head)
        return Part(ms, busy_ms(ms, device))

    @functools.cache
    def link(a: str, b: str, token: bool) -> Part:
        nbytes = model.token_bytes if token else model.activation_bytes
        return Part(edge_ms(cluster, a, b, nbytes), serialization_ms(cluster, a, b, nbytes))

    best: tuple[float, list[str], list[int]] | None = None
    for k in range(1, min(len(ids), nb) + 1):
        for devices in itertools.permutations(ids, k):
            for cuts in itertools.combinations(range(1, nb), k - 1):
                bounds = (0, *cuts, nb)
                ok = True
                for i, dev in enumerate(devices):
                    extra = (model.embed_bytes if i == 0 else 0) + (model.head_bytes if i == k - 1 else 0)
                    if need[bounds[i + 1]] - need[bounds[i]] + extra > room[dev]:
                        ok = False
                        break
                if not ok:
                    continue
                parts = [node(dev, bounds[i], bounds[i + 1], i == k - 1) for i, dev in enumerate(devices)]
                parts += [link(a, b, False) for a, b in zip(devices, devices[1:])]
                parts.append(link(devices[-1], devices[0], True))
                total, busiest = loop_time(parts)
                value = objective_value(objective.kind, r, total, busiest, sum(price[d] for d in devices))
                if best is None or value < best[0]:
                    best = (value, list(devices), list(cuts))
    if best is None:
        raise shortfall(Instance(model, cluster, ids, r), exact=True)
    return best
