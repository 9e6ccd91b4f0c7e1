"""Expert parallelism in the plan language: the invariants of a plan that places experts (each refused with its
``$.path`` and the fix), its memory accounting, the text form of experts ops and fan-out edges, the simulator's
prediction of the fan-out, the expert planner against its baselines, and ``ppharness plan make --experts-on``."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from ppharness.errors import PlanError
from ppharness.plan.build import chain
from ppharness.plan.experts.place import baseline_experts, place_experts
from ppharness.plan.experts.problem import without_routed_experts
from ppharness.plan.experts.routing import load_routing, with_frequencies
from ppharness.plan.lang.check import check_plan, node_kv, node_memory, node_weights
from ppharness.plan.lang.document import (
    Block,
    Blocks,
    Cluster,
    Device,
    Edge,
    Embed,
    ExpertGroup,
    Experts,
    Head,
    Impaired,
    Link,
    ModelGraph,
    Node,
    Op,
    Placement,
    PlanDoc,
    expert_holders,
    with_id,
)
from ppharness.plan.lang.parse import parse
from ppharness.plan.lang.text_form import render
from ppharness.plan.predict import cost
from ppharness.plan.predict.fanout import Fanout, layer_times, routings
from ppharness.plan.predict.simulate import simulate
from ppharness.plan.reader import load_plan
from ppharness.plan.show import dot, draw_png, mermaid, table

MiB = 1 << 20
RESERVE = 64 * MiB
BPE = 4 * MiB  # one routed expert's weights
DENSE = 8 * MiB  # a block's attention, router and norms
SKEWED = (0.6, 0.5, 0.3, 0.2, 0.15, 0.1, 0.1, 0.05)  # adds up to 2: eight experts, two per token


def moe_model(layers: int = 4, frequencies: tuple[float, ...] = (), dense_blocks: Sequence[int] = ()) -> ModelGraph:
    """``layers`` blocks of 8 routed experts (2 per token) each, but ``dense_blocks``, which are dense."""

    def block(i: int) -> Block:
        if i in dense_blocks:
            return Block(weight_bytes=DENSE, flops=DENSE, kv_bytes=1024)
        x = Experts(count=8, active=2, bytes_per_expert=BPE, frequencies=frequencies)
        return Block(weight_bytes=DENSE + 8 * BPE, flops=DENSE + 2 * BPE, kv_bytes=1024, experts=x)

    return ModelGraph(
        source="synthetic:moe-test",
        sha256="0" * 64,
        arch="qwen3moe",
        dim=1024,
        vocab=1000,
        max_context=256,
        embed_bytes=2 * MiB,
        head_bytes=2 * MiB,
        head_flops=4 * MiB,
        activation_bytes=2048,
        token_bytes=64,
        blocks=tuple(block(i) for i in range(layers)),
    )


def device(name: str, room_mib: float, **kw: Any) -> Device:
    """A device with ``room_mib`` besides its runtime reserve."""
    kw.setdefault("gflops", 100.0)
    kw.setdefault("bandwidth_gbs", 50.0)
    return Device(id=name, memory=int(room_mib * MiB) + RESERVE, reserve=RESERVE, **kw)


STAGE_ROOM = 2 + 2 * 8 + 1  # MiB: embed or head, two blocks' dense parts, and their KV cache (0.5 MiB)


def cluster(stage_room: float = 1024, near_room: float = 1024, far_room: float = 1024, far_ms: float = 20.0) -> Cluster:
    """Stage devices a and b; expert devices near (1 ms away) and far (``far_ms`` from a and b)."""
    return Cluster(
        devices=(
            device("a", stage_room),
            device("b", stage_room),
            device("near", near_room),
            device("far", far_room),
        ),
        default=Impaired(delay_ms=1.0),
        links=(Link(src="a", dst="far", delay_ms=far_ms), Link(src="b", dst="far", delay_ms=far_ms)),
        hop_ms=0.25,
    )


def stages(model: ModelGraph | None = None, c: Cluster | None = None) -> PlanDoc:
    """a runs blocks 0 and 1 (and the embedding), b blocks 2 and 3 (and the head)."""
    return chain(model or moe_model(), c or cluster(), ["a", "b"], [2])


def placed(doc: PlanDoc, where: Mapping[str, Mapping[int, Sequence[int]]]) -> PlanDoc:
    """``doc`` with experts ops: ``where[label][block]`` the experts that node computes (a label that is not a stage
    is a new expert node on the device of that name), and an experts edge from each block's owner to each other node
    computing its experts."""
    nodes = list(doc.placement.nodes)
    labels = [n.label for n in nodes]
    for label in where:
        if label not in labels:
            nodes.append(Node(device=label, ops=()))
            labels.append(label)
    out = []
    for node in nodes:
        groups: list[Op] = [
            ExpertGroup(layer=b, ids=tuple(ids)) for b, ids in sorted(where.get(node.label, {}).items())
        ]
        body = [op for op in node.ops if not isinstance(op, Head)]
        tail = [op for op in node.ops if isinstance(op, Head)]
        out.append(msgspec.structs.replace(node, ops=tuple(body + groups + tail)))
    owner = {b: n.label for n in out if n.blocks for b in range(*n.blocks)}
    edges = []
    for node in out:
        edges += [e for e in doc.placement.edges if e.src == node.label]
        targets = {
            other for other, blocks in where.items() for b in blocks if owner[b] == node.label and other != node.label
        }
        edges += [Edge(src=node.label, dst=t, kind="experts") for t in labels if t in targets]
    placement = msgspec.structs.replace(doc.placement, nodes=tuple(out), edges=tuple(edges))
    return with_id(msgspec.structs.replace(doc, placement=placement))


ALL = range(8)
LOCAL = {"a": {0: ALL, 1: ALL}, "b": {2: ALL, 3: ALL}}
FAR = {"far": {b: ALL for b in range(4)}}


def experts_rows_ms(doc: PlanDoc) -> float:
    return math.fsum(r.ms for r in simulate(doc).rows if r.kind == "experts")


# --- invariants -------------------------------------------------------------------------------------------------


def _good() -> PlanDoc:
    """Block 0 and 1's experts split between a and near, blocks 2 and 3's on far."""
    where = {"a": {0: range(4), 1: range(4)}, "near": {0: range(4, 8), 1: range(4, 8)}, "far": {2: ALL, 3: ALL}}
    return placed(stages(), where)


def test_a_plan_that_places_experts_checks() -> None:
    doc = _good()
    check_plan(doc)
    assert [n.label for n in doc.placement.nodes] == ["a", "b", "near", "far"]
    assert [(e.src, e.dst, e.kind) for e in doc.placement.edges] == [
        ("a", "b", "activation"),
        ("a", "near", "experts"),
        ("b", "a", "token"),
        ("b", "far", "experts"),
    ]
    assert expert_holders(doc)[0, 5] == ["near"] and expert_holders(doc)[3, 0] == ["far"]
    assert expert_holders(stages()) == {}


def _edit(doc: PlanDoc, node: str | None = None, ops: tuple[Op, ...] | None = None, **placement: Any) -> PlanDoc:
    nodes = doc.placement.nodes
    if node is not None:
        nodes = tuple(msgspec.structs.replace(n, ops=ops) if n.label == node else n for n in nodes)
    return msgspec.structs.replace(doc, placement=msgspec.structs.replace(doc.placement, nodes=nodes, **placement))


def _edges(doc: PlanDoc, *extra: Edge, drop: tuple[str, str] | None = None) -> tuple[Edge, ...]:
    return tuple(e for e in doc.placement.edges if (e.src, e.dst) != drop) + extra


def _model(doc: PlanDoc, block: int, **changes: Any) -> PlanDoc:
    blocks = list(doc.model.blocks)
    blocks[block] = msgspec.structs.replace(
        blocks[block], experts=msgspec.structs.replace(blocks[block].experts, **changes)
    )
    return msgspec.structs.replace(doc, model=msgspec.structs.replace(doc.model, blocks=tuple(blocks)))


def _bad_cases() -> dict[str, tuple[PlanDoc, str, str]]:
    good = _good()
    dense = placed(stages(moe_model(dense_blocks=[1])), {"a": {0: ALL}, "b": {2: ALL, 3: ALL}})
    half = placed(stages(moe_model(dense_blocks=[0, 1])), {"b": {2: range(4), 3: ALL}, "near": {2: range(4, 8)}})
    a_ops = good.placement.nodes[0].ops
    experts_of = {n.label: n.ops for n in good.placement.nodes}
    return {
        # what: (the plan, the message's start after the source, what the fix says)
        "a dense block's experts": (
            _edit(
                dense,
                "a",
                (Embed(), Blocks(lo=0, hi=2), ExpertGroup(layer=0, ids=tuple(ALL)), ExpertGroup(layer=1, ids=(0,))),
            ),
            "$.placement.nodes[0].ops[3].layer: block 1 is dense, it has no experts to place",
            "its mixture-of-experts blocks are 0, 2 to 3",
        ),
        "an expert past the block's count": (
            _edit(good, "near", (ExpertGroup(layer=0, ids=(4, 5, 6, 7, 8)), ExpertGroup(layer=1, ids=(4, 5, 6, 7)))),
            "$.placement.nodes[2].ops[0].ids: expert 8 of block 0, which has 8 routed experts",
            "ids run from 0 to 7",
        ),
        "a block past the model": (
            _edit(good, "near", (*experts_of["near"], ExpertGroup(layer=9, ids=(0,)))),
            "$.placement.nodes[2].ops[2].layer: block 9 is past the model's 4 blocks",
            "the last block is 3",
        ),
        "a block's experts in two ops": (
            _edit(good, "near", (*experts_of["near"], ExpertGroup(layer=0, ids=(0,)))),
            "$.placement.nodes[2].ops[2]: node 'near' lists block 0's experts in ops[0] already",
            "merge the two",
        ),
        "an expert node with the embedding": (
            _edit(good, "near", (Embed(), *experts_of["near"])),
            "$.placement.nodes[2].ops: node 'near' has 0 block ranges",
            "a node whose ops are all experts is an expert node",
        ),
        "an activation edge to an expert node": (
            _edit(good, edges=_edges(good, Edge(src="b", dst="near"), drop=("b", "a"))),
            "$.placement.edges[3].to: 'near' is an expert node (its ops are all experts), off the loop",
            "make this an experts edge",
        ),
        "an expert node nothing sends to": (
            _edit(good, edges=_edges(good, drop=("a", "near"))),
            "$.placement.nodes[2]: expert node 'near' has no experts edge coming in",
            "add an experts edge from the node running its blocks, or remove it",
        ),
        "an experts edge from an expert node": (
            _edit(good, edges=_edges(good, Edge(src="near", dst="far", kind="experts"))),
            "$.placement.edges[4].from: 'near' is an expert node",
            "an experts edge leaves the node on the loop that runs a mixture-of-experts block",
        ),
        "an experts edge from a stage without mixture-of-experts blocks": (
            _edit(half, edges=_edges(half, Edge(src="a", dst="near", kind="experts"))),
            "$.placement.edges[3].from: node 'a' runs no mixture-of-experts block (blocks 0..2)",
            "an experts edge leaves the node running the block whose experts it fans out to",
        ),
        "an experts edge to a node with none of the blocks' experts": (
            _edit(good, edges=_edges(good, Edge(src="a", dst="b", kind="experts"))),
            "$.placement.edges[4].to: node 'b' computes none of the experts of 'a''s blocks (0 to 1)",
            "give 'b' an experts op for one of them, or remove the edge",
        ),
        "an experts edge twice": (
            _edit(good, edges=_edges(good, Edge(src="a", dst="near", kind="experts"))),
            "$.placement.edges[4]: the experts edge a -> near is edges[1] already",
            "keep one",
        ),
        "an expert placed nowhere": (
            _edit(good, "a", (*a_ops[:2], ExpertGroup(layer=0, ids=(0, 1, 2)), *a_ops[3:])),
            "$.placement.nodes: the plan places experts, but expert(s) 3 of block 0 are computed by no node",
            "list them in an experts op (e.g. on 'a', which runs the block: {op: experts, layer: 0, ids: [3]})",
        ),
        "a stage computing another stage's experts": (
            _edit(good, "b", (Blocks(lo=2, hi=4), ExpertGroup(layer=0, ids=(0,)), Head())),
            "$.placement.nodes[1].ops[1]: node 'b' runs blocks 2..4 and computes the experts of those only, not "
            "block 0's",
            "put them on an expert node (or on 'a', which runs the block)",
        ),
        "a holder the owner cannot reach": (
            _edit(good, "far", (*experts_of["far"], ExpertGroup(layer=1, ids=(7,)))),
            "$.placement.edges: node 'far' computes experts of block 1, which 'a' runs, but no experts edge goes "
            "from 'a' to 'far'",
            "add {from: a, to: far, kind: experts}",
        ),
        "frequencies for too few experts": (
            _model(good, 1, frequencies=(1.0, 1.0)),
            "$.model.blocks[1].experts.frequencies: 2 frequencies for block 1's 8 routed experts",
            "give one per expert",
        ),
        "frequencies that do not add up to the experts a token uses": (
            _model(good, 2, frequencies=(0.5,) * 8),
            "$.model.blocks[2].experts.frequencies: they add up to 4 but each token chooses 2 experts",
            "so they add up to 2; scale them",
        ),
        "more experts per token than the block has": (
            _model(good, 0, active=9),
            "$.model.blocks[0].experts.active: block 0 routes each token to 9 of its 8 experts",
            "routes a token to 1 to 8 experts",
        ),
        "an expert node too small": (
            placed(
                stages(c=cluster(near_room=3 * 4)),
                {"a": {0: ALL, 1: range(4)}, "near": {1: range(4, 8)}, "b": {2: ALL, 3: ALL}},
            ),
            "$.placement.nodes[2]: node 'near' needs 80.0 MiB (weights 16.0 MiB, KV cache 0.0 MiB for 256 tokens, "
            "runtime 64.0 MiB) but device 'near' has 76.0 MiB",
            "4.0 MiB short; move experts to another node or use a larger device",
        ),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("what", list(BAD))
def test_a_bad_expert_placement_is_refused_with_its_path_and_fix(what: str) -> None:
    doc, start, fix = BAD[what]
    with pytest.raises(PlanError) as info:
        check_plan(doc, "moe.yaml")
    message = str(info.value)
    assert message.startswith(f"moe.yaml: {start}"), message
    assert fix in message.partition(" — ")[2], message
    assert not re.search(r"ExpertGroup\(|Node\(|Expected `|Traceback", message), message


def test_a_yaml_plan_with_experts_loads_and_names_the_file(tmp_path: Path) -> None:
    good = json.loads(msgspec.json.encode(_good()))
    del good["id"]
    path = tmp_path / "moe.yaml"
    path.write_text(json.dumps(good))
    assert load_plan(path) == _good()
    good["placement"]["nodes"][2]["ops"][0]["ids"] = [5, 4]
    path.write_text(json.dumps(good))
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert str(info.value).startswith(f"{path}: $.placement.nodes[2].ops[0].ids: [5, 4] must be increasing")


# --- memory -----------------------------------------------------------------------------------------------------


def test_memory_counts_a_nodes_dense_blocks_and_the_experts_it_holds() -> None:
    doc = _good()
    a, b, near, far = doc.placement.nodes
    # a: embedding, two blocks without their routed experts, and 4 + 4 experts
    assert node_weights(doc, a) == 2 * MiB + 2 * DENSE + 8 * BPE
    assert node_weights(doc, b) == 2 * MiB + 2 * DENSE
    assert node_weights(doc, near) == 8 * BPE and node_weights(doc, far) == 16 * BPE
    # an expert node holds no KV cache
    assert node_kv(doc, near) == node_kv(doc, far) == 0 and node_kv(doc, a) == 256 * 2 * 1024
    assert node_memory(doc, far) == 16 * BPE + RESERVE
    # a plan that places no experts leaves every expert with its block
    plain = stages()
    assert node_weights(plain, plain.placement.nodes[0]) == 2 * MiB + 2 * (DENSE + 8 * BPE)


def test_a_stage_too_small_for_its_own_experts_fits_once_they_move() -> None:
    small = cluster(stage_room=STAGE_ROOM)
    with pytest.raises(PlanError, match=r"node 'a' needs .* move blocks to another node"):
        check_plan(stages(c=small))
    check_plan(placed(stages(c=small), FAR))


# --- text form --------------------------------------------------------------------------------------------------

HAND_WRITTEN = [
    "a: embed, blk[0:2], experts[0][0-3], experts[1][0-3] -> b => near\n"
    "b: blk[2:4], head -> a => far\n"
    "near: experts[0][4-7], experts[1][4-7]\n"
    "far: experts[2][0-7], experts[3][0-7]\n"
    "policy: optimal-experts\n",
    "x@a: embed, blk[0:1], experts[0][0,1,5,9-11], head -> x => e\ne: experts[0][2-4,6-8]\n",
    "a: experts[7][123456789]\n",
]


@pytest.mark.parametrize("text", HAND_WRITTEN)
def test_hand_written_expert_texts_round_trip_exactly(text: str) -> None:
    assert render(parse(text)) == text


def test_what_an_expert_text_says() -> None:
    p = parse(HAND_WRITTEN[0])
    assert p == msgspec.structs.replace(_good().placement, policy="optimal-experts")
    q = parse("a: embed, blk[0:1], experts[ 0 ][ 0 , 1,2 , 5 - 6 ], head -> a => e\ne: experts[0][3,4,7]")
    assert q.nodes[0].ops[2] == ExpertGroup(layer=0, ids=(0, 1, 2, 5, 6))
    assert render(q).splitlines()[0] == "a: embed, blk[0:1], experts[0][0-2,5,6], head -> a => e"
    # a loop on one line: the targets after => belong to the last node the line defines
    r = parse("a: embed, blk[0:2] -> b: blk[2:4], head -> a => x\nx: experts[2][0-7]")
    assert r.edges == (
        Edge(src="a", dst="b"),
        Edge(src="b", dst="a", kind="token"),
        Edge(src="b", dst="x", kind="experts"),
    )


BAD_TEXT = [
    # (text, line, column, what is wrong, the fix)
    ("a: experts[2][3-1]", 1, 15, "the run 3-1 goes backwards", "here 1-3"),
    ("a: experts[2][1,1]", 1, 17, "expert 1 comes after expert 1", "in increasing order"),
    ("a: experts[2][0-4, 3]", 1, 20, "expert 3 comes after expert 4", "each expert once"),
    ("a: experts[2][]", 1, 15, "an expert id is missing", "e.g. experts[2][0-3,5]"),
    ("a: experts[2]", 1, 4, "'experts[2]' is not an experts op", "write experts[block][ids]"),
    ("a: experts[2][x]", 1, 15, "'x' is not an expert id or run of ids", "write 5 or 0-3"),
    ("a: experts[2][0-99999999]", 1, 15, "more than 65,536 experts in one op", "list the ids of this node's"),
    ("a: experts[2][1234567890]", 1, 15, "more than 9 digits", "experts[2][0-3,5]"),
    ("a: experts[1234567890][1]", 1, 12, "has more than 9 digits", "block numbers"),
    ("a: expert[0][1]", 1, 4, "unknown op 'expert[0][1]'", "the ops are embed, head, blk[a:b], experts[block][ids]"),
    ("a: embed => b -> c", 1, 15, "'->' after '=>'", "successors (-> ...) first"),
    ("a: embed => b => c", 1, 15, "'=>' after '=>'", "once"),
    ("a: embed =>", 1, 10, "nothing after '=>'", "name the node(s) that compute"),
    ("a: embed => ,", 1, 13, "a node after '=>' is missing", "`=> gpu-b`"),
    ("a: embed => zz", 1, 13, "unknown node 'zz'", "a node after '=>' is a node of this placement (a)"),
    ("a: embed\nspares: x => y", 2, 11, "'=>' on the spares: line", "edges belong on node lines"),
]


@pytest.mark.parametrize(("text", "line", "column", "problem", "fix"), BAD_TEXT, ids=[b[3] for b in BAD_TEXT])
def test_expert_text_errors_name_line_column_and_fix(text: str, line: int, column: int, problem: str, fix: str) -> None:
    with pytest.raises(PlanError) as info:
        parse(text, "moe.txt")
    message = str(info.value)
    assert message.startswith(f"moe.txt: line {line}, column {column}: "), message
    problem_part, _, fix_part = message.partition(" — ")
    assert problem in problem_part, message
    assert fix in fix_part, message


def _unchecked(layer: int, ids: tuple[int, ...]) -> ExpertGroup:
    """An experts op as code may build one, past the document's own checks."""
    op = ExpertGroup(layer=0, ids=(0,))
    msgspec.structs.force_setattr(op, "layer", layer)
    msgspec.structs.force_setattr(op, "ids", ids)
    return op


@pytest.mark.parametrize(
    ("op", "needle"),
    [
        (_unchecked(0, ()), "ops[0].ids: 0 expert ids"),
        (_unchecked(0, (3, 2)), "ops[0].ids: the ids are not increasing"),
        (_unchecked(-1, (1,)), "ops[0].layer: '-1' is not a block"),
        (_unchecked(10**9, (1,)), "ops[0].layer"),
        (_unchecked(0, (10**9,)), "ops[0].ids"),
    ],
)
def test_render_refuses_an_experts_op_it_cannot_write(op: ExpertGroup, needle: str) -> None:
    with pytest.raises(PlanError) as info:
        render(Placement(nodes=(Node(device="a", ops=(op,)),)))
    message = str(info.value)
    assert message.startswith(f"$.placement.nodes[0].{needle}"), message
    assert "the text form writes only what it reads back" in message


names = st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True)


@st.composite
def expert_sets(draw: st.DrawFn) -> tuple[int, ...]:
    """Increasing expert ids made of runs of any length (so that render writes both ids and runs)."""
    ids: list[int] = []
    at = draw(st.integers(0, 10))
    for _ in range(draw(st.integers(1, 5))):
        length = draw(st.integers(1, 5))
        ids.extend(range(at, at + length))
        at += length + draw(st.integers(1, 4))
    return tuple(ids)


@st.composite
def expert_placements(draw: st.DrawFn) -> Placement:
    """Any graph with experts ops and experts edges the text form can carry (valid plan or not); each node's loop
    edges before its experts edges, nodes in order."""
    words = draw(st.lists(names, min_size=1, max_size=6, unique=True))
    op = st.one_of(
        st.just(Embed()),
        st.just(Head()),
        st.integers(0, 100).map(lambda lo: Blocks(lo=lo, hi=lo + 2)),
        st.builds(lambda layer, ids: ExpertGroup(layer=layer, ids=ids), st.integers(0, 999_999_999), expert_sets()),
    )
    nodes = [Node(device=w, ops=tuple(draw(st.lists(op, min_size=1, max_size=4)))) for w in words]
    labels = [n.label for n in nodes]
    edges = []
    for n in nodes:
        kind = "token" if n.heads else "activation"
        edges += [Edge(src=n.label, dst=d, kind=kind) for d in draw(st.lists(st.sampled_from(labels), max_size=2))]
        edges += [Edge(src=n.label, dst=d, kind="experts") for d in draw(st.lists(st.sampled_from(labels), max_size=3))]
    return Placement(nodes=tuple(nodes), edges=tuple(edges), policy=draw(st.sampled_from(["", "experts"])))


@given(expert_placements())
def test_placements_with_experts_round_trip(p: Placement) -> None:
    text = render(p)
    assert parse(text) == p
    assert render(parse(text)) == text


TOKENS = [*"ab:,-[]019 \n", "experts[", "][", "=>", "->", "embed", "head", "blk[0:1]", "spares:"]


@given(st.lists(st.sampled_from(TOKENS), max_size=30).map("".join))
def test_any_expert_text_reads_or_is_refused_with_a_line(text: str) -> None:
    try:
        p = parse(text, "fuzz.txt")
    except PlanError as exc:
        assert re.match(r"^fuzz\.txt: (line \d+, column \d+: |no node lines)", str(exc)), str(exc)
        assert " — " in str(exc)
    else:
        assert parse(render(p)) == p


def test_a_planned_placement_round_trips_through_text() -> None:
    doc, _ = place_experts(stages(moe_model(frequencies=SKEWED), cluster(stage_room=STAGE_ROOM)), ["near", "far"])
    assert parse(render(doc.placement)) == doc.placement
    check_plan(msgspec.structs.replace(doc, placement=parse(render(doc.placement))))


# --- the simulator ----------------------------------------------------------------------------------------------


def test_experts_kept_with_their_blocks_predict_what_a_plan_without_experts_ops_does() -> None:
    plain = stages()
    local = placed(plain, LOCAL)
    check_plan(local)
    a, b = simulate(plain), simulate(local)
    assert math.isclose(a.per_token_ms, b.per_token_ms, rel_tol=1e-9)
    assert math.isclose(a.ttft_ms, b.ttft_ms, rel_tol=1e-9)
    assert [r.name for r in b.rows] == [
        "stage 0 compute",
        "stage 0 experts 0",
        "stage 0 experts 1",
        "stage 1 compute",
        "stage 1 experts 2",
        "stage 1 experts 3",
        "hop 0->1",
        "hop 1->0",
    ]
    assert [r.name for r in a.rows] == ["stage 0 compute", "stage 1 compute", "hop 0->1", "hop 1->0"]
    row = b.rows[1]
    assert (row.kind, row.device, row.node) == ("experts", "a", "a")
    assert row.ms == pytest.approx(cost.expert_ms(plain.cluster.device("a"), plain.model.blocks[0], 2), rel=1e-12)
    assert math.isclose(sum(r.ms for r in b.rows), b.per_token_ms, rel_tol=1e-12)


def test_a_moe_block_costs_its_dense_part_and_the_experts_a_token_uses() -> None:
    model, dev = moe_model(), device("d", 1024, gflops=10.0, bandwidth_gbs=1.0)
    block = model.blocks[0]
    # bandwidth-bound: the dense weights and two experts' are read, not all eight experts'
    assert cost.blocks_ms(model, dev, 0, 1) == pytest.approx((DENSE + 2 * BPE) / 1e9 * 1e3)
    assert cost.blocks_ms(model, dev, 0, 1, routed=False) == pytest.approx(DENSE / 1e9 * 1e3)
    assert cost.dense_part(block) == (DENSE, DENSE)


def test_experts_on_a_far_node_cost_the_round_trip_per_block() -> None:
    plain = stages()
    far = placed(plain, FAR)
    check_plan(far)
    near, away = simulate(placed(plain, LOCAL)), simulate(far)
    link = 2 * (20.0 + 0.25)  # one way 20 ms and the hop's fixed cost, there and back, for every block
    assert away.per_token_ms - near.per_token_ms == pytest.approx(4 * link, rel=1e-3)
    rows = {r.name: r for r in away.rows}
    assert rows["stage 1 experts 3"].device == "b->far"
    # the far node's own time per token: two experts for each of the four blocks
    busy = sum(t.busy["far"] for t in layer_times(far))
    assert busy == pytest.approx(4 * cost.expert_ms(plain.cluster.device("far"), plain.model.blocks[0], 2))


def test_frequencies_decide_what_a_far_node_costs() -> None:
    def split(model: ModelGraph, hot_far: bool) -> float:
        hot, cold = range(4), range(4, 8)
        where = {
            "near": {b: (cold if hot_far else hot) for b in range(4)},
            "far": {b: (hot if hot_far else cold) for b in range(4)},
        }
        return experts_rows_ms(placed(stages(model), where))

    skewed = moe_model(frequencies=SKEWED)
    assert split(skewed, hot_far=True) > 1.5 * split(skewed, hot_far=False)
    uniform = moe_model()
    assert split(uniform, hot_far=True) == pytest.approx(split(uniform, hot_far=False), rel=0.05)
    # the predictions are the same every time (the routings come from a fixed seed)
    assert split(skewed, hot_far=True) == split(skewed, hot_far=True)


def test_routings_draw_distinct_experts_as_often_as_their_frequencies_say() -> None:
    uniform = routings(Experts(count=8, active=2, bytes_per_expert=1), 0)
    assert uniform.shape == (4000, 2) and (uniform[:, 0] != uniform[:, 1]).all()
    assert np.bincount(uniform.ravel(), minlength=8) / 4000 == pytest.approx([0.25] * 8, abs=0.03)
    skewed = routings(Experts(count=8, active=2, bytes_per_expert=1, frequencies=SKEWED), 0)
    share = np.bincount(skewed.ravel(), minlength=8) / 4000
    assert share[0] > share[3] > share[7] > 0 and share.sum() == pytest.approx(2)
    # in the order drawn: the first of a token's experts is expert e with probability frequency(e) / 2
    assert np.bincount(skewed[:, 0], minlength=8) / 4000 == pytest.approx([f / 2 for f in SKEWED], abs=0.025)
    # an expert no token chooses is never drawn
    never = routings(Experts(count=4, active=2, bytes_per_expert=1, frequencies=(1.0, 0.5, 0.5, 0.0)), 1)
    assert 3 not in never


def test_a_replicated_expert_goes_to_the_local_copy_else_to_the_least_busy_replica() -> None:
    doc = stages(moe_model(layers=4))
    nodes = [*doc.placement.nodes, Node(device="near", ops=(ExpertGroup(layer=0, ids=(0,)),))]
    devices = [doc.cluster.device(n.device) for n in nodes]
    fan = Fanout(doc.model, doc.cluster, devices, 0, 0)
    # every expert on b (node 1); expert 0 also on the owner: it stays home
    counts = fan.counts([[0, 1]] + [[1]] * 7)
    chose0 = (fan.chosen == 0).any(axis=1)
    assert (counts[chose0, 0] == 1).all() and (counts[~chose0, 0] == 0).all()
    # every expert on b and on near: the first chosen goes to b (plan order), the second to near (less work)
    counts = fan.counts([[1, 2]] * 8)
    assert (counts[:, 1] == 1).all() and (counts[:, 2] == 1).all()


def test_show_lists_expert_nodes_edges_and_each_blocks_fan_out(tmp_path: Path) -> None:
    doc = _good()
    text = table(doc)
    assert "near             near             experts[0][4-7], experts[1][4-7]" in text
    assert re.search(r"b -> far\s+experts\s+2\.1 KiB\s+20\.250", text), text
    assert re.search(r"^2\s+b\s+far\s+\d+\.\d{3}$", text, re.M), text
    total = float(re.search(r"per token (\d+\.\d+) ms", text)[1])  # type: ignore[index]
    assert total == pytest.approx(simulate(doc).per_token_ms, abs=1e-3)
    assert "==>" in mermaid(doc) and "style=dotted" in dot(doc)
    assert draw_png(doc, tmp_path / "moe.png").read_bytes().startswith(b"\x89PNG")


# --- the planner ------------------------------------------------------------------------------------------------


def _tight(far_ms: float = 20.0) -> PlanDoc:
    """Skewed frequencies; the stages keep no expert; near and far hold 5 of each block's 8 experts each."""
    return stages(moe_model(frequencies=SKEWED), cluster(STAGE_ROOM, 5 * 4 * 4, 5 * 4 * 4, far_ms))


def test_the_planner_beats_round_robin_where_frequencies_and_links_differ() -> None:
    doc = _tight()
    best, report = place_experts(doc, ["near", "far"], time_limit_s=10)
    rr, rr_report = baseline_experts(doc, ["near", "far"], "round-robin")
    uniform, uniform_report = baseline_experts(doc, ["near", "far"], "uniform")
    check_plan(best)
    assert report.predicted_ms < 0.6 * rr_report.predicted_ms
    assert report.predicted_ms < uniform_report.predicted_ms
    # the predictions are the simulator's
    assert report.predicted_ms == pytest.approx(experts_rows_ms(best), rel=1e-12)
    assert rr_report.predicted_ms == pytest.approx(experts_rows_ms(rr), rel=1e-12)
    assert simulate(best).per_token_ms < min(simulate(rr).per_token_ms, simulate(uniform).per_token_ms)
    # the hot experts stay near; the far node gets cold ones only
    far = {e for (b, e), where in expert_holders(best).items() if "far" in where}
    assert far and max(SKEWED[e] for e in far) <= 0.15
    # the bound is below every placement's prediction; the gap is reported, never below 0
    assert 0 < report.bound_ms <= report.predicted_ms and report.bound_ms <= rr_report.predicted_ms
    assert report.gap >= 0 and report.gap == pytest.approx(report.predicted_ms / report.bound_ms - 1)
    assert report.status == "optimal" and not report.stopped_by_time
    assert "bound" in report.summary() and "gap" in report.summary()
    assert best.placement.policy == "experts" and rr.placement.policy == "round-robin"


def test_the_planner_respects_memory_and_is_deterministic() -> None:
    doc = _tight()
    one, report = place_experts(doc, ["near", "far"], replicas=False, time_limit_s=10)
    two, _ = place_experts(doc, ["near", "far"], replicas=False, time_limit_s=10)
    assert one == two and one.id == two.id
    for node in one.placement.nodes:
        assert node_memory(one, node) <= one.cluster.device(node.device).memory
    holders = expert_holders(one)
    assert len(holders) == 32 and all(len(h) == 1 for h in holders.values()) and report.replicas == 0


def test_the_planner_keeps_the_experts_a_token_needs_together() -> None:
    # the stages have room for two experts each: both of one block's hottest pair keeps a token's fan-out home
    # more often than one expert of each of two blocks (a token needs two experts)
    doc = stages(moe_model(frequencies=SKEWED), cluster(STAGE_ROOM + 2 * 4, 1, 64 * 4))
    best, _ = place_experts(doc, ["far"], time_limit_s=10)
    for node in best.placement.nodes[:2]:
        assert [set(ids) for ids in node.experts.values()] == [{0, 1}]


def test_the_planner_copies_experts_where_a_token_needs_two_at_once() -> None:
    # slow expert devices, equally near, with room for everything: a copy of each expert on both lets every token's
    # two experts run side by side
    slow = {"gflops": 0.2, "bandwidth_gbs": 0.5}
    c = Cluster(
        devices=(
            device("a", STAGE_ROOM),
            device("b", STAGE_ROOM),
            device("x", 1024, **slow),
            device("y", 1024, **slow),
        ),
        default=Impaired(delay_ms=1.0),
    )
    doc = stages(moe_model(frequencies=SKEWED), c)
    copies, report = place_experts(doc, ["x", "y"], time_limit_s=10)
    single, plain = place_experts(doc, ["x", "y"], replicas=False, time_limit_s=10)
    assert report.replicas > 0 and plain.replicas == 0
    assert report.predicted_ms < 0.9 * plain.predicted_ms
    assert report.predicted_ms == pytest.approx(experts_rows_ms(copies), rel=1e-12)
    assert max(len(h) for h in expert_holders(copies).values()) == 2


def test_memory_that_cannot_hold_the_experts_is_refused_clearly() -> None:
    doc = stages(moe_model(), cluster(STAGE_ROOM, 3 * 4 * 4, 3 * 4 * 4))
    with pytest.raises(PlanError) as info:
        place_experts(doc, ["near", "far"])
    assert str(info.value).startswith(
        "the routed experts need 128.0 MiB (32 experts of 4 blocks) but the stage devices' spare memory and the "
        "expert devices hold 97.0 MiB together — 31.0 MiB short"
    ), str(info.value)
    lopsided = stages(moe_model(), cluster(STAGE_ROOM, 3 * 4 * 4, 1024))
    with pytest.raises(PlanError, match=r"puts 64\.0 MiB of experts on 'near', which has 48\.0 MiB free — 16\.0 MiB"):
        baseline_experts(lopsided, ["near", "far"], "round-robin")
    for bad, needle in (
        (["nowhere"], "unknown device 'nowhere'"),
        (["a"], "expert device 'a' runs stage node 'a'"),
        (["near", "near"], "named twice"),
    ):
        with pytest.raises(PlanError, match=needle):
            place_experts(stages(), bad)
    with pytest.raises(PlanError, match="has no mixture-of-experts blocks"):
        place_experts(stages(moe_model(dense_blocks=range(4))), ["near"])


def test_the_stages_are_planned_on_their_dense_part() -> None:
    dense = without_routed_experts(moe_model())
    assert all(b.weight_bytes == DENSE and b.flops == DENSE and b.experts == Experts() for b in dense.blocks)


# --- frequencies ------------------------------------------------------------------------------------------------


def test_frequencies_are_set_per_block_and_checked(tmp_path: Path) -> None:
    doc = stages()
    path = tmp_path / "routing.json"
    path.write_text(json.dumps({"layers": {"0": list(SKEWED), "3": list(SKEWED)}}))
    set_ = with_frequencies(doc, load_routing(path), str(path))
    assert set_.model.blocks[0].experts.frequencies == SKEWED and set_.model.blocks[1].experts.frequencies == ()
    assert set_.id != doc.id
    check_plan(set_)
    for freqs, needle in (
        ({0: [0.25] * 7}, "$.layers.0: 7 frequencies for block 0's 8 routed experts — give one per expert"),
        ({1: [1.5] + [0.5 / 7] * 7}, "$.layers.1[0]: 1.5 is not a frequency — a frequency is the share"),
        ({2: [0.1] * 8}, "$.layers.2: the frequencies add up to 0.8 but each token chooses 2 experts"),
        ({9: [0.25] * 8}, "$.layers.9: the model has blocks 0 to 3"),
    ):
        with pytest.raises(PlanError) as info:
            with_frequencies(doc, freqs, "r.json")
        assert str(info.value).startswith(f"r.json: {needle}"), str(info.value)
    with pytest.raises(PlanError, match="is dense"):
        with_frequencies(stages(moe_model(dense_blocks=[0])), {0: [0.25] * 8})
    for text, needle in (
        ("[1, 2]", "a routing file is"),
        ('{"layers": {"x": []}}', "'x' is not a block number"),
        ('{"layers": {"0": 3}}', "a list of frequencies"),
        ("{", "not JSON"),
    ):
        path.write_text(text)
        with pytest.raises(PlanError, match=re.escape(needle)):
            load_routing(path)


# --- the model graph and the command ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_graphs() -> dict[str, ModelGraph]:
    from ppharness.model.sources.files import resolve_model
    from ppharness.model.synthetic.spec import preset_spec, synthetic_source
    from ppharness.plan.graph import model_graph

    out = {}
    for preset in ("tiny-moe", "tiny-moe-shared"):
        source = synthetic_source(preset_spec(preset))
        out[preset] = model_graph(resolve_model(source), source, 256, digest=False)
    return out


def test_the_model_graph_of_a_moe_gguf_has_its_experts(moe_graphs: dict[str, ModelGraph]) -> None:
    for preset, shared in (("tiny-moe", 0), ("tiny-moe-shared", 1)):
        g = moe_graphs[preset]
        per_expert = 3 * g.dim * 96  # gate, up, down of width expert_ffn = 96
        for block in g.blocks:
            assert block.experts == Experts(count=8, active=2, shared=shared, bytes_per_expert=2 * per_expert)
            # float16 but for the router, the norm before it and the shared expert's gate: float32, two more bytes each
            f32 = (8 + 1 + shared) * g.dim
            dense = (block.weight_bytes - 2 * f32) // 2 - 8 * per_expert
            attention = 2 * 2 * 4 * 16 * 128  # q.k and p.v for 4 heads of 16 over half the context
            assert block.flops == 2 * dense + 2 * 2 * per_expert + attention
    assert moe_graphs["tiny-moe-shared"].blocks[0].weight_bytes > moe_graphs["tiny-moe"].blocks[0].weight_bytes


def test_plan_make_places_experts_on_the_devices_named(tmp_path: Path) -> None:
    from ppharness.cli import main

    cluster_file = tmp_path / "moe-cluster.yaml"
    cluster_file.write_text(
        "devices:\n"
        "  - {id: a, memory: 512.5m, gflops: 5, reserve: 512m}\n"
        "  - {id: near, memory: 513m, gflops: 5, reserve: 512m}\n"
        "  - {id: far, memory: 513m, gflops: 5, reserve: 512m}\n"
        "default: {delay_ms: 1}\n"
        "links: [{from: a, to: far, delay_ms: 15}]\n"
    )
    routing = tmp_path / "routing.json"
    routing.write_text(json.dumps({"layers": {"0": list(SKEWED)}}))
    out = tmp_path / "plan.json"
    args = ["plan", "make", "--model", "tiny-moe", "--cluster", str(cluster_file), "--experts-on", "near,far"]
    made = CliRunner().invoke(main, [*args, "--routing", str(routing), "--expert-time-limit", "4", "-o", str(out)])
    assert made.exit_code == 0, made.output
    assert "experts (optimal): predicted" in made.output
    doc = load_plan(out)
    assert doc.model.blocks[0].experts.frequencies == SKEWED
    assert {n.label for n in doc.placement.nodes if n.expert_only} <= {"near", "far"}
    assert any(e.kind == "experts" for e in doc.placement.edges)
    simulated = CliRunner().invoke(main, ["plan", "simulate", str(out)])
    assert simulated.exit_code == 0 and "stage 0 experts 0" in simulated.output, simulated.output
    shown = CliRunner().invoke(main, ["plan", "show", str(out)])
    assert shown.exit_code == 0 and "experts of block" in shown.output, shown.output
    routing.write_text(json.dumps({"layers": {"0": [0.5] * 3}}))
    bad = CliRunner().invoke(main, [*args, "--routing", str(routing)])
    assert bad.exit_code == 1 and f"{routing}: $.layers.0: 3 frequencies" in bad.output, bad.output
    everything = CliRunner().invoke(main, [*args[:-1], "a,near,far"])
    assert everything.exit_code == 1 and "leave at least one for the stages" in everything.output
