"""Re-placing a lost stage on a surviving device (``ppharness.run.seed.replan``): the survivor with the most room that
holds the stage's weights and KV cache, never a lost device, and the shortfall named when none can."""

from __future__ import annotations

import msgspec

from ppharness.model.synthetic.spec import parse_synthetic
from ppharness.plan.compile import scenario_plan
from ppharness.plan.graph import spec_graph
from ppharness.plan.lang.document import PlanDoc
from ppharness.plan.stages import StagePlan
from ppharness.run.seed.replan import Placed, stage_need, survivor

SOURCE = "synthetic:tiny"


def _plan(memory: list[int]) -> tuple[PlanDoc, dict[int, StagePlan]]:
    doc = scenario_plan(spec_graph(parse_synthetic(SOURCE), SOURCE, 256), 3, None, "local")
    devices = tuple(msgspec.structs.replace(d, memory=m, reserve=0) for d, m in zip(doc.cluster.devices, memory))
    doc = msgspec.structs.replace(doc, cluster=msgspec.structs.replace(doc.cluster, devices=devices))
    ranges = [(0, 3), (3, 6), (6, 8)]
    programs = {k: StagePlan(plan_id="p", stage=k, num_stages=3, lo=lo, hi=hi) for k, (lo, hi) in enumerate(ranges)}
    return doc, programs


def test_a_lost_stage_goes_to_the_survivor_with_the_most_room() -> None:
    doc, programs = _plan([1 << 30, 1 << 30, 2 << 30])
    hosting = dict(enumerate(doc.cluster.devices))
    placed = survivor(doc, programs, hosting, 1, {"local-1"})
    assert isinstance(placed, Placed), placed
    assert placed.device.id == "local-2", "the stage did not go to the survivor with the most room"
    room = (2 << 30) - stage_need(doc, programs[2])
    assert placed.left == room - stage_need(doc, programs[1])


def test_a_lost_device_is_never_chosen_even_with_the_most_room() -> None:
    doc, programs = _plan([1 << 30, 8 << 30, 1 << 30])
    hosting = dict(enumerate(doc.cluster.devices))
    placed = survivor(doc, programs, hosting, 0, {"local-0", "local-1"})
    assert isinstance(placed, Placed) and placed.device.id == "local-2", placed


def test_no_survivor_with_room_names_the_shortfall() -> None:
    doc, programs = _plan([1 << 30, 1 << 30, 0])
    need = [stage_need(doc, programs[k]) for k in range(3)]
    tight = [need[0], need[1], need[2] + need[1] - 1]  # one byte short of holding stage 1 beside stage 2
    doc, programs = _plan(tight)
    hosting = dict(enumerate(doc.cluster.devices))
    why = survivor(doc, programs, hosting, 1, {"local-1"})
    assert isinstance(why, str), "a stage was re-placed on a device without room for it"
    assert "blocks [3, 6) need" in why and "'local-2'" in why, why


def test_the_need_counts_weights_and_the_kv_cache_of_every_request() -> None:
    doc, programs = _plan([1 << 30] * 3)
    one = stage_need(doc, programs[1])
    objective = msgspec.structs.replace(doc.placement.objective, requests=4)
    four = msgspec.structs.replace(doc, placement=msgspec.structs.replace(doc.placement, objective=objective))
    kv = doc.model.max_context * sum(b.kv_bytes for b in doc.model.blocks[3:6])
    assert kv > 0 and stage_need(four, programs[1]) - one == 3 * kv


def test_a_stage_whose_plan_places_the_experts_needs_only_the_experts_its_program_names() -> None:
    """As ``node_weights`` counts a node: its blocks without their routed experts, then each expert it holds, at the
    bytes the runtime holds (Q8_0 experts here, packed)."""
    source = "synthetic:tiny-moe,type=q8_0"
    doc = scenario_plan(spec_graph(parse_synthetic(source), source, 256), 2, None, "local")
    whole = StagePlan(plan_id="p", stage=0, num_stages=2, lo=0, hi=2)
    placed = StagePlan(plan_id="p", stage=0, num_stages=2, lo=0, hi=2, experts={0: (1, 3), 1: (0,)})
    per = [b.experts.bytes_per_expert for b in doc.model.blocks]
    assert per[0] == 3 * 64 * 96 // 32 * 34, "a Q8_0 expert counts its bytes in the file"
    assert stage_need(doc, whole) - stage_need(doc, placed) == (8 - 2) * per[0] + (8 - 1) * per[1], (
        "a stage whose plan places the experts was counted with experts it does not hold"
    )
