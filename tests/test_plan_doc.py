"""The plan document (``ppharness.plan.lang.document``) and its invariants (``ppharness.plan.lang.check``), on a model
graph made by hand: the canonical form and id, the YAML conveniences, and every bad plan refused with its ``$.path`` and
the fix before anything runs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ppharness.errors import PlanError
from ppharness.network.spec import Impairment
from ppharness.plan.build import chain
from ppharness.plan.lang.check import check_plan
from ppharness.plan.lang.document import (
    DEFAULT_RESERVE,
    Block,
    Cluster,
    Device,
    Link,
    ModelGraph,
    Node,
    Objective,
    PlanDoc,
    Source,
    canonical,
    hops,
    loop,
    plan_id,
    plan_schema,
    pretty,
    with_id,
)
from ppharness.plan.reader import load_cluster, load_plan

MiB = 1 << 20
BLOCK = Block(weight_bytes=MiB, flops=2 * MiB, kv_bytes=512)


def _model(blocks: int = 8) -> ModelGraph:
    return ModelGraph(
        source="synthetic:tiny",
        sha256="0" * 64,
        arch="llama",
        dim=64,
        vocab=256,
        max_context=256,
        embed_bytes=32 * 1024,
        head_bytes=32 * 1024,
        head_flops=32 * 1024,
        activation_bytes=128,
        token_bytes=64,
        blocks=(BLOCK,) * blocks,
    )


def _cluster(*ids: str, gflops: float = 5.0) -> Cluster:
    return Cluster(devices=tuple(Device(id=d, memory=2 << 30, gflops=gflops) for d in ids or ("gpu-a", "gpu-b")))


def _plan() -> PlanDoc:
    """Two devices, blocks 0..4 on gpu-a (with the embedding), 4..8 on gpu-b (with the head)."""
    return chain(_model(), _cluster(), ["gpu-a", "gpu-b"], [4])


def _replace(obj: Any, **changes: Any) -> Any:
    return msgspec.structs.replace(obj, **changes)


def _write(tmp_path: Path, text: str, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- canonical form and id --------------------------------------------------------------------------------------


def test_canonical_json_is_sorted_compact_and_a_fixed_point() -> None:
    doc = _plan()
    body = canonical(doc)
    assert b" " not in body.replace(b"synthetic:tiny", b"")
    assert body == canonical(msgspec.json.decode(body, type=PlanDoc))

    def sorted_everywhere(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        assert keys == sorted(keys)
        return dict(pairs)

    parsed = json.loads(body, object_pairs_hook=sorted_everywhere)
    assert parsed["id"] == plan_id(doc) == doc.id and len(doc.id) == 16
    assert parsed["placement"]["edges"][1] == {"from": "gpu-b", "kind": "token", "to": "gpu-a"}
    # the id in the document does not take part: any id, or none, gives the same canonical form
    assert canonical(_replace(doc, id="")) == canonical(_replace(doc, id="0123456789abcdef")) == body
    assert json.loads(pretty(doc)) == json.loads(body)


def test_id_is_the_same_for_the_same_content() -> None:
    a, b = _plan(), _plan()
    assert a is not b and a.id == b.id == plan_id(_replace(a, id="stale"))
    assert with_id(_replace(a, id="")) == a
    # a field given its default explicitly is the same content
    devices = tuple(_replace(d, reserve=DEFAULT_RESERVE, source=Source()) for d in a.cluster.devices)
    assert plan_id(_replace(a, cluster=_replace(a.cluster, devices=devices))) == a.id


def test_a_whole_number_for_a_float_field_gives_the_same_id() -> None:
    ints, floats = _cluster(gflops=5), _cluster(gflops=5.0)
    a = chain(_model(), ints, ["gpu-a", "gpu-b"], [4])
    b = chain(_model(), floats, ["gpu-a", "gpu-b"], [4])
    assert a.id == b.id and canonical(a) == canonical(b)
    c = _replace(a, cluster=_replace(ints, hop_ms=1, default=Impairment(delay_ms=25)))
    d = _replace(a, cluster=_replace(ints, hop_ms=1.0, default=Impairment(delay_ms=25.0)))
    assert plan_id(c) == plan_id(d) != a.id


def _variants(doc: PlanDoc) -> dict[str, PlanDoc]:
    model, cluster, placement = doc.model, doc.cluster, doc.placement
    blocks = list(model.blocks)
    blocks[3] = _replace(BLOCK, flops=BLOCK.flops + 1)
    devices = list(cluster.devices)
    nodes = list(placement.nodes)
    return {
        "a block's flops": _replace(doc, model=_replace(model, blocks=tuple(blocks))),
        "max_context": _replace(doc, model=_replace(model, max_context=512)),
        "the model file": _replace(doc, model=_replace(model, sha256="1" * 64)),
        "a device's memory": _replace(
            doc, cluster=_replace(cluster, devices=(_replace(devices[0], memory=1), *devices[1:]))
        ),
        "a device's speed": _replace(
            doc, cluster=_replace(cluster, devices=(_replace(devices[0], gflops=5.5), *devices[1:]))
        ),
        "a device's source": _replace(
            doc, cluster=_replace(cluster, devices=(_replace(devices[0], source=Source(kind="docker")), *devices[1:]))
        ),
        "the default link": _replace(doc, cluster=_replace(cluster, default=Impairment(delay_ms=1))),
        "a link": _replace(doc, cluster=_replace(cluster, links=(Link(src="gpu-a", dst="gpu-b", loss=0.01),))),
        "hop_ms": _replace(doc, cluster=_replace(cluster, hop_ms=0.5)),
        "the cluster's name": _replace(doc, cluster=_replace(cluster, name="lab")),
        "a node's name": _replace(doc, placement=_replace(placement, nodes=(_replace(nodes[0], name="x"), nodes[1]))),
        "the node order": _replace(doc, placement=_replace(placement, nodes=tuple(reversed(nodes)))),
        "the edge order": _replace(doc, placement=_replace(placement, edges=tuple(reversed(placement.edges)))),
        "the spares": _replace(doc, placement=_replace(placement, spares=("gpu-c",))),
        "the objective": _replace(doc, placement=_replace(placement, objective=Objective("throughput", 1))),
        "the requests": _replace(doc, placement=_replace(placement, objective=Objective("latency", 2))),
        "the policy": _replace(doc, placement=_replace(placement, policy="even")),
    }


def test_the_id_changes_when_anything_changes() -> None:
    doc = _plan()
    ids = {what: plan_id(changed) for what, changed in _variants(doc).items()}
    for what, changed_id in ids.items():
        assert changed_id != doc.id, what
    assert len(set(ids.values())) == len(ids)


# --- reading files ----------------------------------------------------------------------------------------------

SURFACE = """\
# the plan of _plan(), written by hand with the conveniences
version: 1
placement:
  nodes:
    - {device: gpu-a, ops: [embed, 0..4]}
    - device: gpu-b
      ops: [{blocks: 4..8}, head]
  edges:
    - {from: gpu-a, to: gpu-b}
    - {from: gpu-b, to: gpu-a, kind: token}
cluster:
  devices:
    - {id: gpu-a, memory: 2g, gflops: 5}
    - {id: gpu-b, memory: 2GiB, gflops: 5.0, reserve: 512MiB}
model:
  source: synthetic:tiny
  sha256: "0000000000000000000000000000000000000000000000000000000000000000"
  arch: llama
  dim: 64
  vocab: 256
  max_context: 256
  embed_bytes: 32k
  head_bytes: 32768
  head_flops: 32768
  activation_bytes: 128
  token_bytes: 64
  blocks:
    - &block {weight_bytes: 1048576, flops: 2097152, kv_bytes: 512}
    - *block
    - *block
    - *block
    - *block
    - *block
    - *block
    - *block
"""


def test_a_yaml_file_with_conveniences_loads_to_the_same_document_as_its_canonical_json(tmp_path: Path) -> None:
    # embed_bytes: 32k is not a size field; only memory, memory_limit and reserve take sizes
    text = SURFACE.replace("embed_bytes: 32k", "embed_bytes: 32768")
    from_yaml = load_plan(_write(tmp_path, text))
    assert from_yaml == _plan()
    from_json = load_plan(_write(tmp_path, canonical(from_yaml).decode(), "plan.json"))
    assert from_json == from_yaml and canonical(from_json) == canonical(from_yaml)
    assert load_plan(_write(tmp_path, pretty(from_yaml), "pretty.json")) == from_yaml
    # the other ways to write a range: blk[a:b] in a block list, {blocks: [a, b]}, {blocks: blk[a:b]}
    for ops in ("\n        - embed\n        - blk[0:4]", "[embed, {blocks: [0, 4]}]", "[embed, {blocks: 'blk[0:4]'}]"):
        other = text.replace("- {device: gpu-a, ops: [embed, 0..4]}", f"- device: gpu-a\n      ops: {ops}")
        assert other != text
        assert load_plan(_write(tmp_path, other, "other.yaml")) == from_yaml, ops


def test_sizes_in_a_non_size_field_are_refused(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as info:
        load_plan(_write(tmp_path, SURFACE))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'plan.yaml'}: $.model.embed_bytes: "), message


@pytest.mark.parametrize(
    ("change", "path", "fix"),
    [
        ("gflops: .inf", "$.cluster.devices[0].gflops", "GFLOP/s, more than 0, at most 1e12"),
        ("gflops: 5, bandwidth_gbs: .inf", "$.cluster.devices[0].bandwidth_gbs", "GB/s"),
        ("gflops: 5, overhead_ms: .inf", "$.cluster.devices[0].overhead_ms", "milliseconds, 0 to 60000"),
        ("gflops: 5, usd_per_hour: .inf", "$.cluster.devices[0].usd_per_hour", "US dollars per hour"),
        ("gflops: .nan", "$.cluster.devices[0].gflops", "GFLOP/s"),
    ],
)
def test_a_number_json_cannot_hold_is_refused_with_its_path(tmp_path: Path, change: str, path: str, fix: str) -> None:
    """The canonical form is JSON: infinity has no place in it (and a NaN never equals itself)."""
    text = SURFACE.replace("embed_bytes: 32k", "embed_bytes: 32768").replace("gflops: 5}", change + "}")
    file = _write(tmp_path, text)
    with pytest.raises(PlanError) as info:
        load_plan(file)
    message = str(info.value)
    assert message.startswith(f"{file}: {path}: expected float"), message
    assert message.endswith(f" — {fix}") or f"— {fix}" in message, message


def test_a_plan_whose_id_does_not_match_its_content_is_refused(tmp_path: Path) -> None:
    doc = _plan()
    good = _write(tmp_path, canonical(doc).decode(), "plan.json")
    assert load_plan(good).id == doc.id
    edited = json.loads(canonical(doc))
    edited["placement"]["policy"] = "even"
    path = _write(tmp_path, json.dumps(edited), "edited.json")
    with pytest.raises(PlanError) as info:
        load_plan(path)
    message = str(info.value)
    assert message.startswith(f"{path}: $.id: the plan says id {doc.id!r} but its content hashes to "), message
    assert "remove the id line" in message
    # without the id the edit is taken, and the plan gets its new id
    del edited["id"]
    assert load_plan(_write(tmp_path, json.dumps(edited), "taken.json")).id == plan_id(
        _replace(doc, placement=_replace(doc.placement, policy="even"))
    )


def test_a_cluster_file_loads_with_its_conveniences(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "devices:\n"
        "  - {id: gpu-a, memory: 2g, gflops: 5, region: eu}\n"
        "  - {id: gpu-b, memory: 24GiB, gflops: 50, region: us, source: {kind: vastai, offer: {gpu_name: RTX_4090}}}\n"
        "  - {id: box, memory: 512m, gflops: 1, source: {kind: docker, cpus: 2, memory_limit: 1.5g}}\n"
        "region_links: [{from: eu, to: us, delay_ms: 40}]\n"
        "links: [{from: gpu-a, to: box, rate_mbit: 100}]\n",
        "lab-cluster.yaml",
    )
    cluster = load_cluster(path)
    assert cluster.name == "lab-cluster"
    assert cluster.device("box").memory == 512 * MiB and cluster.device("box").source.memory_limit == 3 << 29
    assert cluster.device("gpu-a").gflops == 5.0 and isinstance(cluster.device("gpu-a").gflops, float)
    assert cluster.link("box", "gpu-a") == Impairment(rate_mbit=100)
    assert cluster.link("gpu-b", "gpu-a") == Impairment(delay_ms=40) and cluster.link("gpu-b", "box") == Impairment()


def test_a_hop_between_gpus_of_one_host_takes_the_host_link() -> None:
    from ppharness.plan.lang.document import Cluster, Device, Impaired, Source

    def gpu(i: int, host: str) -> Device:
        return Device(id=f"{host}-{i}", memory=1 << 30, gflops=1.0, region="r", source=Source(host=host, gpu=i))

    cluster = Cluster(
        devices=(gpu(0, "a"), gpu(1, "a"), gpu(0, "b")),
        default=Impaired(delay_ms=2.0),
        host_link=Impaired(delay_ms=0.01, rate_mbit=200_000),
    )
    assert cluster.link("a-0", "a-1").delay_ms == 0.01 and cluster.link("a-0", "a-1").rate_mbit == 200_000
    assert cluster.link("a-1", "b-0").delay_ms == 2.0, "GPUs of two hosts are joined by the cluster's links"


def test_loop_and_hops_follow_the_edges_not_the_node_order() -> None:
    doc = chain(_model(), _cluster("a", "b", "c"), ["b", "c", "a"], [2, 5])
    shuffled = _replace(doc, placement=_replace(doc.placement, nodes=tuple(reversed(doc.placement.nodes))))
    check_plan(shuffled)
    assert [n.label for n in loop(shuffled)] == ["b", "c", "a"]
    assert [(h.src.label, h.dst.label, h.kind) for h in hops(shuffled)] == [
        ("b", "c", "activation"),
        ("c", "a", "activation"),
        ("a", "b", "token"),
    ]


def test_plan_schema_has_a_title() -> None:
    schema = plan_schema()
    assert schema["title"] == "ppharness plan"
    assert "PlanDoc" in json.dumps(schema) and "Placement" in schema["$defs"]
    json.dumps(schema)


# --- bad plans ----------------------------------------------------------------------------------------------------

Mutation = Callable[[dict[str, Any]], None]


def _refused(tmp_path: Path, mutate: Mutation) -> str:
    """The message ``load_plan`` refuses ``_plan()`` changed by ``mutate`` with (its id dropped), checked to name the
    file and a ``$.path``."""
    raw = json.loads(canonical(_plan()))
    del raw["id"]
    mutate(raw)
    path = _write(tmp_path, json.dumps(raw, indent=1), "bad.yaml")
    with pytest.raises(PlanError) as info:
        load_plan(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "$" in message, message
    return message.removeprefix(f"{path}: ")


def _three(raw: dict[str, Any]) -> None:
    """A third device, gpu-c, in the cluster."""
    raw["cluster"]["devices"].append({"id": "gpu-c", "memory": 2 << 30, "gflops": 5.0})


def _set(path: str, value: object) -> Mutation:
    def mutate(raw: dict[str, Any]) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        node: Any = raw
        for p in parents:
            node = node[p]
        node[last] = value

    return mutate


def _both(*mutations: Mutation) -> Mutation:
    def mutate(raw: dict[str, Any]) -> None:
        for m in mutations:
            m(raw)

    return mutate


BLOCKS_4_8 = {"op": "blocks", "lo": 4, "hi": 8}


def _off_loop(raw: dict[str, Any]) -> None:
    """gpu-a -> gpu-b -> (token) gpu-a, and gpu-c, which runs blocks, on no edge."""
    _three(raw)
    raw["placement"]["nodes"].append({"device": "gpu-c", "ops": [{"op": "blocks", "lo": 6, "hi": 8}]})


BAD: dict[str, tuple[Mutation, str, list[str]]] = {
    # what: (the change, the message's start, what else it says: the amount and the fix)
    "device too small": (
        _set("cluster.devices.1.memory", 256 * MiB),
        "$.placement.nodes[1]: node 'gpu-b' needs 516.5 MiB (weights 4.0 MiB, KV cache 0.5 MiB for 256 tokens, "
        "runtime 512.0 MiB) but device 'gpu-b' has 256.0 MiB",
        ["260.5 MiB short", "move blocks to another node or use a larger device"],
    ),
    "a gap in the blocks": (
        _set("placement.nodes.1.ops.0", {"op": "blocks", "lo": 5, "hi": 8}),
        "$.placement.nodes[1].ops: node 'gpu-b' starts at block 5",
        ["blocks 4..5 are placed nowhere", "start this range at 4"],
    ),
    "blocks missing at the end": (
        _set("placement.nodes.1.ops.0", {"op": "blocks", "lo": 4, "hi": 7}),
        "$.placement: the loop's blocks end at 7 but the model has 8",
        ["extend the exit's range"],
    ),
    "an overlap": (
        _set("placement.nodes.1.ops.0", {"op": "blocks", "lo": 3, "hi": 8}),
        "$.placement.nodes[1].ops: node 'gpu-b' starts at block 3",
        ["blocks 3..4 are placed twice", "start this range at 4"],
    ),
    "a range past the model": (
        _set("placement.nodes.1.ops.0", {"op": "blocks", "lo": 4, "hi": 9}),
        "$.placement.nodes[1].ops[0]: blocks 4..9 go past the model's 8 blocks",
        ["a range ends at 8 at most"],
    ),
    "an empty range": (
        _set("placement.nodes.1.ops.0", {"op": "blocks", "lo": 4, "hi": 4}),
        "$.placement.nodes[1].ops[0].hi: the range 4..4 is empty",
        ["hi must be more than lo"],
    ),
    "unknown device in a cluster link": (
        _set("cluster.links", [{"from": "gpu-a", "to": "gpu-z", "delay_ms": 5}]),
        "$.cluster.links[0].to: unknown device 'gpu-z'",
        ["the cluster's devices are: gpu-a, gpu-b"],
    ),
    "a link to itself": (
        _set("cluster.links", [{"from": "gpu-a", "to": "gpu-a", "delay_ms": 5}]),
        "$.cluster.links[0]: a link from 'gpu-a' to itself",
        ["a link joins two different devices"],
    ),
    "unknown device in a node": (
        _set("placement.nodes.1.device", "gpu-z"),
        "$.placement.nodes[1].device: unknown device 'gpu-z'",
        ["the cluster's devices are: gpu-a, gpu-b"],
    ),
    "two entries": (
        _set("placement.nodes.1.ops", [{"op": "embed"}, BLOCKS_4_8, {"op": "head"}]),
        "$.placement.nodes: a plan has one entry (the node whose ops include embed); nodes gpu-a, gpu-b have it",
        ["put embed on exactly one node"],
    ),
    "no exit": (
        _set("placement.nodes.1.ops", [BLOCKS_4_8]),
        "$.placement.nodes: a plan has one exit (the node whose ops include head); no node has it",
        ["put head on exactly one node"],
    ),
    "head before the blocks": (
        _set("placement.nodes.1.ops", [{"op": "head"}, BLOCKS_4_8]),
        "$.placement.nodes[1].ops[0]: head comes last",
        ["after the node's blocks"],
    ),
    "no token edge": (
        lambda raw: raw["placement"]["edges"].pop(),
        "$.placement.edges: a plan has one token edge, from the exit (gpu-b) to the entry (gpu-a); found 0",
        ["add {from: gpu-b, to: gpu-a, kind: token}"],
    ),
    "a token edge the wrong way": (
        _set("placement.edges.1", {"from": "gpu-a", "to": "gpu-b", "kind": "token"}),
        "$.placement.edges[1]: a token edge goes from the exit (gpu-b) to the entry (gpu-a), not gpu-a -> gpu-b",
        [],
    ),
    "an edge to an unknown node": (
        _set("placement.edges.0.to", "gpu-q"),
        "$.placement.edges[0].to: 'gpu-q' is not a node of the placement",
        ["nodes: gpu-a, gpu-b"],
    ),
    "a node off the loop": (
        _both(_off_loop, _set("placement.nodes.1.ops", [{"op": "blocks", "lo": 4, "hi": 6}, {"op": "head"}])),
        "$.placement.edges: node(s) gpu-c are not on the loop gpu-a -> gpu-b",
        ["link them in with activation edges or remove them"],
    ),
    "a docker limit on a local device": (
        _set("cluster.devices.0.source", {"kind": "local", "cpus": 2}),
        "$.cluster.devices[0].source: cpus and memory_limit are docker's container limits, but this device's source "
        "is local",
        ["set kind: docker or drop them"],
    ),
    "a vast.ai device without an offer": (
        _set("cluster.devices.0.source", {"kind": "vastai"}),
        "$.cluster.devices[0].source.offer: a vast.ai device needs an offer filter",
        [],
    ),
    "an unknown offer field": (
        _set("cluster.devices.0.source", {"kind": "vastai", "offer": {"gpu_model": "RTX 4090"}}),
        "$.cluster.devices[0].source.offer.gpu_model: unknown offer field 'gpu_model'",
        ["a device's offer may set: gpu_name, num_gpus"],
    ),
    "an offer value of the wrong type": (
        _set("cluster.devices.0.source", {"kind": "vastai", "offer": {"num_gpus": "eight"}}),
        "$.cluster.devices[0].source.offer.num_gpus: expected int",
        [],
    ),
    "an offer on a local device": (
        _set("cluster.devices.0.source", {"kind": "local", "offer": {"num_gpus": "1"}}),
        "$.cluster.devices[0].source.offer: an offer filter is for vast.ai devices, this one is local",
        ["drop it"],
    ),
    "a gpu without a host": (
        _set("cluster.devices.0.source", {"kind": "local", "gpu": 1}),
        "$.cluster.devices[0].source.gpu: a GPU index names a GPU of a host",
        ["set source.host"],
    ),
    "two devices on one gpu of a host": (
        _both(
            _set("cluster.devices.0.source", {"kind": "local", "host": "h", "gpu": 0}),
            _set("cluster.devices.1.source", {"kind": "local", "host": "h", "gpu": 0}),
        ),
        "$.cluster.devices[1].source.gpu: GPU 0 of host 'h' is already devices[0]",
        ["its own index"],
    ),
    "a gpu of a host without its index": (
        _both(
            _set("cluster.devices.0.source", {"kind": "local", "host": "h", "gpu": 0}),
            _set("cluster.devices.1.source", {"kind": "local", "host": "h"}),
        ),
        "$.cluster.devices[1].source.gpu: a GPU of host 'h' needs its index there",
        [],
    ),
    "a host of two offers": (
        _both(
            _set("cluster.devices.0.source", {"kind": "vastai", "host": "h", "gpu": 0, "offer": {"num_gpus": "2"}}),
            _set("cluster.devices.1.source", {"kind": "vastai", "host": "h", "gpu": 1, "offer": {"num_gpus": "4"}}),
        ),
        "$.cluster.devices[1].source: the GPUs of host 'h' come from one machine",
        ["the same kind and offer as devices[0]"],
    ),
    "a gpu beyond the hosts offer": (
        _both(
            _set("cluster.devices.0.source", {"kind": "vastai", "host": "h", "gpu": 0, "offer": {"num_gpus": "2"}}),
            _set("cluster.devices.1.source", {"kind": "vastai", "host": "h", "gpu": 2, "offer": {"num_gpus": "2"}}),
        ),
        "$.cluster.devices[1].source.gpu: host 'h' is rented as one offer of 2 GPU(s)",
        ["raise num_gpus or renumber"],
    ),
    "a spare that runs a node": (
        _set("placement.spares", ["gpu-a"]),
        "$.placement.spares[0]: device 'gpu-a' runs node 'gpu-a'",
        ["a spare is a device no node uses"],
    ),
    "a device id ending in a newline": (
        _set("cluster.devices.0.id", "gpu-a\n"),
        "$.cluster.devices[0].id: ",
        ["lower-case letters, digits, - and _"],
    ),
    "an unknown field": (
        _set("placement.policies", "even"),
        "unknown field 'policies' at $.placement — ",
        ["expected one of: nodes, edges, spares, objective, policy", "did you mean 'policy'?"],
    ),
}


@pytest.mark.parametrize("what", list(BAD))
def test_a_bad_plan_is_refused_with_its_path_and_the_fix(tmp_path: Path, what: str) -> None:
    mutate, start, says = BAD[what]
    message = _refused(tmp_path, mutate)
    assert message.startswith(start), message
    for words in says:
        assert words in message, message


def test_check_plan_names_the_source_it_is_given() -> None:
    doc = _plan()
    check_plan(doc)
    bad = _replace(doc, placement=_replace(doc.placement, edges=doc.placement.edges[:1]))
    with pytest.raises(PlanError, match=r"^cluster/two\.yaml: \$\.placement\.edges: a plan has one token edge"):
        check_plan(bad, "cluster/two.yaml")


def test_a_node_name_is_checked_when_made() -> None:
    with pytest.raises(ValueError, match="is not a node name"):
        Node(device="gpu-a", ops=(), name="Not A Name")


# --- hostile files ------------------------------------------------------------------------------------------------


def _laughs(levels: int = 9) -> str:
    lines = ["version: 1", 'l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (_laughs(), "aliases expanded"),
        ("version: 1\nmodel: " + "[" * 100 + "]" * 100 + "\n", "nested more than 32 levels"),
        ("version: 1\nmodel: " + "[" * 5000 + "]" * 5000 + "\n", "nesting depth"),
        ("version: 1\nmodel: " + "{a: " * 2000 + "1" + "}" * 2000 + "\n", "nested more than 32 levels"),
        ("version: 1\nplacement: &p {a: *p}\n", "a scenario cannot be recursive"),
        ("version: 1\nplacement: {}\nplacement: {}\n", "key 'placement' appears twice"),
        ("version: 1\nmodel: !!python/object:os.system x\n", "is not one the safe loader reads"),
        ("version: 1\nmodel: [\n", "not valid YAML at line"),
    ],
    ids=[
        "billion laughs",
        "deep lists",
        "very deep lists",
        "deep mappings",
        "recursive alias",
        "duplicate key",
        "python tag",
        "broken",
    ],
)
def test_a_hostile_yaml_is_refused_quickly(tmp_path: Path, text: str, needle: str) -> None:
    path = _write(tmp_path, text)
    start = time.perf_counter()
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert time.perf_counter() - start < 1.0
    message = str(info.value)
    assert message.startswith(f"{path}: $"), message
    assert needle in message and len(message) < 500, message


def test_an_empty_or_oversized_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"\$: the file is empty — a plan needs version, model, cluster and placement"):
        load_plan(_write(tmp_path, "# nothing\n"))
    # a plan is written by a program and names every expert it places: its limit is larger than a scenario's
    with pytest.raises(PlanError, match=r"over the limit of 33,554,432 bytes \(32 MiB\)"):
        load_plan(_write(tmp_path, "version: 1\n" + "#" * (32 << 20)))
