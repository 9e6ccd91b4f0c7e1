"""A plan's value under its objective, from the cost model (``ppharness.plan.predict.cost``): what the planner
minimises, with the memory check it honours (``ppharness.plan.lang.check`` requires the same).

With L one token's time around the loop and b the busiest node's or link's time per token (``cost.loop_time``), and
R requests in flight: ``latency`` is max(L, b) (``cost.loop_ms``; b exceeds L only on a node with a CPU quota below
one CPU), ``throughput`` is ms per token, max(L / R, b), and ``cost`` is $ per token, the used devices' hourly price
times that over 3.6e6. Lower is better.
"""

from __future__ import annotations

from collections.abc import Sequence

from ppharness.plan.lang.document import Cluster, ModelGraph, Objective
from ppharness.plan.predict.cost import LoopNode, loop_ms, loop_parts, loop_time

MS_PER_HOUR = 3.6e6


def loop_metrics(
    model: ModelGraph, cluster: Cluster, devices: Sequence[str], cuts: Sequence[int]
) -> tuple[float, float]:
    """(L, b) in ms of the loop over ``devices`` cut at ``cuts``: ``cost.loop_time`` of its ``cost.loop_parts``."""
    bounds = [0, *cuts, len(model.blocks)]
    k = len(devices)
    nodes = [LoopNode(cluster.device(d), bounds[i], bounds[i + 1], i == k - 1) for i, d in enumerate(devices)]
    compute, edges = loop_parts(model, cluster, nodes)
    return loop_time([*compute, *edges])


def objective_value(kind: str, requests: int, latency: float, busiest: float, usd: float) -> float:
    """The objective ``kind``'s value of a loop of (L, b) = (``latency``, ``busiest``) whose devices cost ``usd`` per
    hour, with ``requests`` in flight."""
    if kind == "latency":
        return loop_ms(latency, busiest)
    per_token = max(latency / requests, busiest)
    return per_token if kind == "throughput" else usd * per_token / MS_PER_HOUR


def evaluate(
    model: ModelGraph, cluster: Cluster, devices: Sequence[str], cuts: Sequence[int], objective: Objective
) -> float:
    """The objective's value of the loop over ``devices`` cut at ``cuts`` (lower is better): latency in ms per token
    of one request, ms per token with ``objective.requests`` in flight (1 / throughput), or $ per token. Memory is
    not checked here (``fits`` does)."""
    latency, busiest = loop_metrics(model, cluster, devices, cuts)
    usd = sum(cluster.device(d).usd_per_hour for d in devices)
    return objective_value(objective.kind, objective.requests, latency, busiest, usd)


def fits(model: ModelGraph, cluster: Cluster, devices: Sequence[str], cuts: Sequence[int], requests: int) -> bool:
    """Whether every node's weights, KV cache (``requests`` x ``max_context``), embedding or head and reserve fit its
    device's memory (what ``ppharness.plan.lang.check`` requires)."""
    bounds = [0, *cuts, len(model.blocks)]
    k = len(devices)
    for i, dev in enumerate(devices):
        device = cluster.device(dev)
        need = sum(block_bytes(model, b, requests) for b in range(bounds[i], bounds[i + 1]))
        need += (model.embed_bytes if i == 0 else 0) + (model.head_bytes if i == k - 1 else 0) + device.reserve
        if need > device.memory:
            return False
    return True


def block_bytes(model: ModelGraph, index: int, requests: int) -> int:
    """Block ``index``'s weights and its KV cache for ``requests`` x ``max_context`` tokens."""
    block = model.blocks[index]
    return block.weight_bytes + block.kv_bytes * model.max_context * requests
