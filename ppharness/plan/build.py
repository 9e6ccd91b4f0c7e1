"""Building plans in code: a chain over an ordered list of devices with given cut points, and the cuts of the
``memory`` policy (blocks in proportion to each device's memory, as exo splits;
``ppharness.plan.search.planner.policy_plan`` has every named policy)."""

from __future__ import annotations

from collections.abc import Sequence

from ppharness.errors import PlanError
from ppharness.plan.lang.document import (
    Blocks,
    Cluster,
    Device,
    Edge,
    Embed,
    Head,
    ModelGraph,
    Node,
    Objective,
    Op,
    Placement,
    PlanDoc,
    with_id,
)

LATENCY = Objective()


def chain(
    model: ModelGraph,
    cluster: Cluster,
    devices: Sequence[str],
    cuts: Sequence[int],
    objective: Objective = LATENCY,
    policy: str = "",
    spares: Sequence[str] = (),
) -> PlanDoc:
    """The plan whose loop visits ``devices`` in order, device i running blocks [cuts[i-1], cuts[i]) (cuts: the
    N - 1 inner cut points), the first embedding and the last applying the head. A device named more than once (in
    a row) runs those stages co-located, in one process; the nodes are then named ``stage-<i>``."""
    n = len(devices)
    bounds = [0, *cuts, len(model.blocks)]
    if len(bounds) != n + 1 or any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise PlanError(
            f"cut points {list(cuts)} do not make {n} non-empty block ranges of the model's {len(model.blocks)} blocks"
        )
    nodes = []
    shared = len(set(devices)) < n  # stages co-located on a device: the nodes are named by their stage
    for i, dev in enumerate(devices):
        ops: list[Op] = [Embed()] if i == 0 else []
        ops.append(Blocks(lo=bounds[i], hi=bounds[i + 1]))
        if i == n - 1:
            ops.append(Head())
        nodes.append(Node(device=dev, ops=tuple(ops), name=f"stage-{i}" if shared else ""))
    labels = [node.label for node in nodes]
    edges = [Edge(src=a, dst=b) for a, b in zip(labels, labels[1:])]
    edges.append(Edge(src=labels[-1], dst=labels[0], kind="token"))
    placement = Placement(
        nodes=tuple(nodes), edges=tuple(edges), spares=tuple(spares), objective=objective, policy=policy
    )
    return with_id(PlanDoc(version=1, model=model, cluster=cluster, placement=placement))


def memory_cuts(blocks: int, devices: Sequence[Device]) -> list[int]:
    """Cut points giving each device a share of the blocks proportional to its memory (at least one block each,
    rounded so the shares add up), in the order given."""
    n = len(devices)
    if n > blocks:
        raise PlanError(f"{n} devices but the model has {blocks} blocks; use at most {blocks} devices")
    total = sum(d.memory for d in devices)
    cuts: list[int] = []
    acc = 0.0
    for i, d in enumerate(devices[:-1]):
        acc += d.memory / total * blocks
        lo = (cuts[-1] if cuts else 0) + 1
        hi = blocks - (n - 1 - i)
        cuts.append(min(max(round(acc), lo), hi))
    return cuts
