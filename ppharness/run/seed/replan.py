"""Re-placing a lost stage on a surviving device, when policy failover has no spare left.

The plan is changed as little as the loss demands: the dead stage keeps its blocks and its place in the loop, and its
program moves to the surviving device with the most memory left that can hold them (weights, and the KV cache for
``max_context`` tokens of each request the plan serves, beside what that device already runs). The new node starts
in a new membership epoch under a member identity the run reserved for the purpose, loads the blocks, and rebuilds
their KV cache by replay, exactly as a spare would; stages before and after it are untouched. Where no survivor has
room, the run fails as it would without spares, with the shortfall named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ppharness.plan.lang.check import gib, routed_bytes

if TYPE_CHECKING:
    from ppharness.plan.lang.document import Device, PlanDoc
    from ppharness.plan.stages import StagePlan


def stage_need(doc: PlanDoc, program: StagePlan) -> int:
    """The memory a stage's program takes on its device: its weights as the runtime holds them (the plan's bytes:
    ``ppharness.plan.graph``; blocks, the embedding on the first stage, the head on the last; where the plan places
    the experts, its blocks without their routed experts and each expert its program names, as
    ``ppharness.plan.lang.check.node_weights`` counts them) and the KV cache of its blocks for ``max_context`` tokens of
    every request the plan serves."""
    model = doc.model
    blocks = model.blocks[program.lo : program.hi]
    weights = sum(b.weight_bytes for b in blocks)
    if program.experts is not None:  # the plan places the experts: the stage loads those its program names
        weights -= routed_bytes(model, program.lo, program.hi)
        weights += sum(
            len(ids) * model.blocks[layer].experts.bytes_per_expert for layer, ids in program.experts.items()
        )
    weights += (model.embed_bytes if program.first else 0) + (model.head_bytes if program.last else 0)
    kv = doc.placement.objective.requests * model.max_context * sum(b.kv_bytes for b in blocks)
    return weights + kv


@dataclass(frozen=True)
class Placed:
    """Where a lost stage goes: the surviving device, and the memory it has left once the stage is on it."""

    device: Device
    left: int


def survivor(
    doc: PlanDoc, programs: dict[int, StagePlan], hosting: dict[int, Device], stage: int, lost: set[str]
) -> Placed | str:
    """The surviving device with the most room for ``stage`` (``hosting``: the device each stage runs on now;
    ``lost``: device ids no longer used), or why none can hold it."""
    need = stage_need(doc, programs[stage])
    used: dict[str, int] = {}
    devices: dict[str, Device] = {}
    for k, device in hosting.items():
        if k != stage and device.id not in lost:
            used[device.id] = used.get(device.id, 0) + stage_need(doc, programs[k])
            devices[device.id] = device
    if not devices:
        return "no device of the run survives"
    room = {d: devices[d].memory - devices[d].reserve - used[d] for d in devices}
    best = max(room, key=lambda d: (room[d], d))
    if room[best] < need:
        return (
            f"blocks [{programs[stage].lo}, {programs[stage].hi}) need {gib(need)} (weights and KV cache); the "
            f"most room on a surviving device is {gib(max(room[best], 0))} on {best!r}"
        )
    return Placed(devices[best], room[best] - need)
