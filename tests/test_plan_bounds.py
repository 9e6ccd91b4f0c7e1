"""Plans and clusters within bounds: every size, count and number is range-checked before use (refused with the file,
the ``$.path`` and the fix), the checks are linear in the plan's size, a document's unknown key is refused before its
value is walked, and ``plan make`` keeps to its device cap and its time limit."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from click.testing import CliRunner

from ppharness.cli import main
from ppharness.errors import PlanError
from ppharness.plan.build import chain
from ppharness.plan.lang import limits
from ppharness.plan.lang.check import check_plan
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
    Objective,
    Op,
    Placement,
    PlanDoc,
    Source,
    decode_text,
    parse_size,
    plan_id,
    pretty,
    with_id,
)
from ppharness.plan.predict.cost import edge_ms, serialization_ms
from ppharness.plan.reader import load_cluster, load_plan
from ppharness.plan.search.budget import Budget
from ppharness.plan.search.instance import Instance
from ppharness.plan.search.planner import MAX_PLAN_DEVICES, policy_plan

MiB = 1 << 20


def _model(blocks: int = 8, experts: Experts | None = None) -> ModelGraph:
    block = Block(weight_bytes=MiB, flops=MiB, kv_bytes=64, experts=experts or Experts())
    return ModelGraph(
        source="synthetic:tiny",
        sha256="0" * 64,
        arch="llama",
        dim=64,
        vocab=256,
        max_context=16,
        embed_bytes=1024,
        head_bytes=1024,
        head_flops=1024,
        activation_bytes=128,
        token_bytes=64,
        blocks=(block,) * blocks,
    )


def _cluster_text(devices: int, extra: str = "") -> str:
    lines = ["devices:"]
    lines += [
        f"  - {{id: d{i}, memory: {1 + i % 7}g, gflops: {50 + i % 13}, region: r{i % 5}}}" for i in range(devices)
    ]
    return "\n".join(lines) + "\n" + extra


def _write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- sizes, counts and numbers ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("memory", "9" * 400 + "g"), ("reserve", "99999999999999t"), ("memory", "2p"), ("memory", 1 << 60)],
    ids=["400 digits", "reserve of 99999999999999t", "2 PiB", "2^60 bytes"],
)
def test_a_size_past_the_maximum_is_refused_with_its_path_and_the_fix(
    tmp_path: Path, field: str, value: object
) -> None:
    path = _write(
        tmp_path, f"devices:\n  - {{id: a, memory: 8g, gflops: 100}}\n  - {{id: b, gflops: 1, {field}: {value}}}\n"
    )
    if field == "reserve":
        path = _write(tmp_path, f"devices:\n  - {{id: a, memory: 8g, gflops: 100, reserve: {value}}}\n")
    with pytest.raises(PlanError) as info:
        load_cluster(path)
    message = str(info.value)
    assert message.startswith(f"{path}: $.devices["), message
    assert f"].{field}: " in message and "0 to 1 PiB" in message, message


@pytest.mark.parametrize("command", ["check", "make"])
def test_plan_check_and_make_refuse_an_oversized_size_without_a_traceback(tmp_path: Path, command: str) -> None:
    path = _write(tmp_path, "devices:\n  - {id: a, memory: 8g, gflops: 100, reserve: 99999999999999t}\n")
    args = ["plan", "check", str(path)] if command == "check" else ["plan", "make", "--model", "tiny"]
    if command == "make":
        args += ["--cluster", str(path), "-o", str(tmp_path / "p.json")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "$.devices[0].reserve" in result.output and "0 to 1 PiB" in result.output, result.output


def test_sizes_are_read_exactly_in_powers_of_1024() -> None:
    assert parse_size("1.5g") == 3 << 29
    assert parse_size("512MiB") == 512 * MiB
    assert parse_size("1p") == limits.MAX_BYTES
    assert parse_size("9" * 400) == int("9" * 400)  # exact, refused later by the field's bound
    assert parse_size("blue") is None


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        ("model.blocks.0.experts.count", limits.MAX_EXPERTS + 1, "experts, at most 65,536"),
        ("model.blocks.0.flops", 10**19, "FLOPs per token"),
        ("model.max_context", 1 << 30, "tokens of context"),
        ("model.dim", 0, "the hidden size"),
        ("placement.nodes.0.ops.1.hi", limits.MAX_BLOCKS + 1, "a block index"),
        ("placement.objective.requests", 5000, "<= 4096"),
    ],
)
def test_each_count_has_a_stated_maximum(path: str, value: int, needle: str) -> None:
    doc = msgspec.to_builtins(chain(_model(), Cluster(devices=(Device(id="a", memory=8 << 30, gflops=1),)), ["a"], []))
    node = doc
    *parents, last = path.split(".")
    for part in parents:
        node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
    node[int(last) if last.isdigit() else last] = value
    text = msgspec.json.encode(doc).decode()
    with pytest.raises(PlanError) as info:
        decode_text(text, "plan.json")
    where = "$." + ".".join(f"[{p}]" if p.isdigit() else p for p in path.split(".")).replace(".[", "[")
    assert str(info.value).startswith(f"plan.json: {where}: "), info.value
    assert needle in str(info.value), info.value


def test_a_list_past_its_maximum_is_refused_as_it_is_read(tmp_path: Path) -> None:
    """A list under a known key longer than its field allows is refused when it grows past it, without reading on."""
    items = ", ".join(["0.0"] * (limits.MAX_EXPERTS + 10))
    text = f"version: 1\nmodel:\n  blocks:\n    - experts:\n        frequencies: [{items}]\n"
    with pytest.raises(PlanError) as info:
        decode_text(text, "plan.yaml")
    message = str(info.value)
    assert "$.model.blocks[0].experts.frequencies" in message and "at most 65,536" in message, message


# --- linear checks ----------------------------------------------------------------------------------------------


def _chain_of(n: int) -> PlanDoc:
    """``n`` nodes on ``n`` devices, a block each, around one loop."""
    nodes = []
    for i in range(n):
        ops: list[Op] = [Embed()] if i == 0 else []
        ops += [Blocks(lo=i, hi=i + 1)] + ([Head()] if i == n - 1 else [])
        nodes.append(Node(device=f"d{i}", ops=tuple(ops)))
    edges = [Edge(src=f"d{i}", dst=f"d{i + 1}") for i in range(n - 1)] + [Edge(src=f"d{n - 1}", dst="d0", kind="token")]
    devices = tuple(Device(id=f"d{i}", memory=1 << 30, gflops=10.0) for i in range(n))
    placement = Placement(nodes=tuple(nodes), edges=tuple(edges))
    return PlanDoc(version=1, model=_model(n), cluster=Cluster(devices=devices), placement=placement)


def _experts_of(n: int) -> PlanDoc:
    """One stage and ``n - 1`` expert nodes, one routed expert each, of a block of ``n`` experts."""
    model = _model(1, Experts(count=n, active=2, bytes_per_expert=1024))
    nodes = [Node(device="d0", ops=(Embed(), Blocks(lo=0, hi=1), ExpertGroup(layer=0, ids=(0,)), Head()))]
    nodes += [Node(device=f"d{i}", ops=(ExpertGroup(layer=0, ids=(i,)),)) for i in range(1, n)]
    edges = [Edge(src="d0", dst="d0", kind="token")] + [
        Edge(src="d0", dst=f"d{i}", kind="experts") for i in range(1, n)
    ]
    devices = tuple(Device(id=f"d{i}", memory=1 << 30, gflops=10.0) for i in range(n))
    placement = Placement(nodes=tuple(nodes), edges=tuple(edges))
    return PlanDoc(version=1, model=model, cluster=Cluster(devices=devices), placement=placement)


@pytest.mark.parametrize("make", [_chain_of, _experts_of], ids=["20,000 stages", "20,000 expert nodes"])
def test_a_plan_of_20000_nodes_is_checked_and_hashed_in_seconds(make) -> None:  # type: ignore[no-untyped-def]
    doc = make(20_000)
    start = time.perf_counter()
    check_plan(doc, "big.json")
    checked = time.perf_counter() - start
    start = time.perf_counter()
    plan_id(doc)
    hashed = time.perf_counter() - start
    assert checked <= 5.0 and hashed <= 5.0, f"check {checked:.1f} s, id {hashed:.1f} s"


def test_an_error_in_a_large_plan_lists_a_few_names_not_all() -> None:
    doc = _chain_of(5_000)
    bad = msgspec.structs.replace(doc.placement.nodes[7], device="nowhere")
    nodes = doc.placement.nodes[:7] + (bad,) + doc.placement.nodes[8:]
    with pytest.raises(PlanError) as info:
        check_plan(msgspec.structs.replace(doc, placement=msgspec.structs.replace(doc.placement, nodes=nodes)), "p")
    message = str(info.value)
    assert "$.placement.nodes[7].device: unknown device 'nowhere'" in message and "more" in message
    assert len(message) < 500, message


# --- unknown keys -----------------------------------------------------------------------------------------------


def test_an_unknown_key_is_refused_before_its_value_is_walked(tmp_path: Path) -> None:
    numbers = "\n".join(f"  - {i}" for i in range(500_000))
    path = _write(tmp_path, _cluster_text(2) + "junk:\n" + numbers + "\n")
    start = time.perf_counter()
    with pytest.raises(PlanError) as info:
        load_cluster(path)
    took = time.perf_counter() - start
    message = str(info.value)
    assert message.startswith(f"{path}: unknown field 'junk' at $ — expected one of: devices"), message
    assert took < 3.0, f"{took:.1f} s to refuse an unknown key"


def test_an_unknown_key_inside_a_device_names_it_and_the_close_match(tmp_path: Path) -> None:
    path = _write(tmp_path, "devices:\n  - {id: a, memory: 8g, gflop: 100}\n")
    with pytest.raises(PlanError, match=r"unknown field 'gflop' at \$\.devices\[0\] — .*did you mean 'gflops'"):
        load_cluster(path)


# --- plan make: the device cap and the time limit ---------------------------------------------------------------


def test_plan_make_refuses_more_devices_than_the_planner_takes(tmp_path: Path) -> None:
    path = _write(tmp_path, _cluster_text(MAX_PLAN_DEVICES + 1))
    start = time.perf_counter()
    result = CliRunner().invoke(main, ["plan", "make", "--model", "tiny", "--cluster", str(path)])
    assert result.exit_code == 1, result.output
    assert f"the cluster has {MAX_PLAN_DEVICES + 1:,} devices but the planner searches at most" in result.output
    assert "--policy even or memory" in result.output
    assert time.perf_counter() - start < 10


class _Steps(Budget):
    """A time limit that passes after ``steps`` looks at it (what a slow machine would see)."""

    def __init__(self, steps: int) -> None:
        super().__init__(seconds=1.0)
        self.steps = steps

    def expired(self) -> bool:
        self.steps -= 1
        if self.steps < 0 and self.ran_out is None:
            self.ran_out = self.phase
        return self.ran_out is not None


def _cluster(devices: int) -> Cluster:
    return Cluster(devices=tuple(Device(id=f"d{i}", memory=1 << 30, gflops=10.0 + i) for i in range(devices)))


def test_the_search_stops_at_its_time_limit_with_the_best_plan_found_so_far() -> None:
    budget = _Steps(3)
    doc = policy_plan("optimal", _model(), _cluster(20), Objective(), budget=budget)
    check_plan(doc)
    assert budget.ran_out is not None and "local search over 20 devices" in budget.ran_out


def test_the_search_says_which_phase_ran_out_when_it_found_no_plan() -> None:
    with pytest.raises(PlanError, match=r"the time limit of 1 s ran out during the local search over 20 devices"):
        policy_plan("optimal", _model(), _cluster(20), Objective(), budget=_Steps(0))


def test_plan_make_keeps_to_its_time_limit(tmp_path: Path) -> None:
    path = _write(tmp_path, _cluster_text(MAX_PLAN_DEVICES))
    start = time.perf_counter()
    result = CliRunner().invoke(
        main,
        ["plan", "make", "--model", "tiny", "--cluster", str(path), "--time-limit", "1", "-o", str(tmp_path / "p")],
    )
    took = time.perf_counter() - start
    assert "time limit of 1 s reached during the local search over" in result.output or (
        "the time limit of 1 s ran out during" in result.output
    ), result.output
    assert took < 8, f"plan make took {took:.1f} s with a time limit of 1 s"


def test_plan_make_refuses_a_time_limit_out_of_range(tmp_path: Path) -> None:
    path = _write(tmp_path, _cluster_text(2))
    for bad in ("0", "-1", "1e9"):
        result = CliRunner().invoke(
            main, ["plan", "make", "--model", "tiny", "--cluster", str(path), "--time-limit", bad]
        )
        assert result.exit_code == 2 and "--time-limit" in result.output, result.output


# --- the planner's links, as arrays -----------------------------------------------------------------------------


def test_the_planners_link_costs_follow_the_clusters_link_rule() -> None:
    devices = (
        Device(id="a", memory=1 << 30, gflops=1, region="east", source=Source(host="h", gpu=0)),
        Device(id="b", memory=1 << 30, gflops=1, region="east", source=Source(host="h", gpu=1)),
        Device(id="c", memory=1 << 30, gflops=1, region="west"),
        Device(id="d", memory=1 << 30, gflops=1, region="north"),
        Device(id="e", memory=1 << 30, gflops=1),
    )
    cluster = Cluster(
        devices=devices,
        default=Impaired(delay_ms=1.0),
        host_link=Impaired(delay_ms=0.1, rate_mbit=10_000),
        region_links=(
            Link(src="east", dst="west", delay_ms=30, rate_mbit=100),
            Link(src="west", dst="east", delay_ms=31),
        ),
        links=(Link(src="a", dst="d", delay_ms=7, rate_mbit=5), Link(src="e", dst="c", delay_ms=3)),
        hop_ms=0.5,
    )
    ids = [d.id for d in devices]
    inst = Instance(_model(), cluster, ids, 1)
    for nbytes, e, s in ((128, inst.e_act, inst.s_act), (64, inst.e_tok, inst.s_tok)):
        want_e = np.array([[edge_ms(cluster, x, y, nbytes) for y in ids] for x in ids])
        want_s = np.array([[serialization_ms(cluster, x, y, nbytes) for y in ids] for x in ids])
        assert np.allclose(e, want_e) and np.allclose(s, want_s)


def test_a_vastai_offer_of_more_gpus_than_a_machine_has_is_refused(tmp_path: Path) -> None:
    offer = '{gpu_name: RTX 4090, num_gpus: "99999999999999999999999"}'
    path = _write(
        tmp_path,
        f"devices:\n  - {{id: a, memory: 8g, gflops: 1, source: {{kind: vastai, host: h, gpu: 0, offer: {offer}}}}}\n",
    )
    with pytest.raises(PlanError) as info:
        load_cluster(path)
    message = str(info.value)
    assert message.startswith(f"{path}: $.devices[0].source.offer.num_gpus: "), message
    assert "an offer has 1 to 64 GPUs" in message, message


@pytest.mark.parametrize(("option", "value"), [("--requests", "5000"), ("--max-context", str(1 << 30))])
def test_plan_make_refuses_counts_past_their_maximum(tmp_path: Path, option: str, value: str) -> None:
    path = _write(tmp_path, _cluster_text(2))
    result = CliRunner().invoke(main, ["plan", "make", "--model", "tiny", "--cluster", str(path), option, value])
    assert result.exit_code == 2 and option in result.output, result.output


# --- reading a large plan file ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_plan_file_of_20000_nodes_is_read_and_checked_in_seconds(tmp_path: Path) -> None:
    doc = _experts_of(20_000)
    path = _write(tmp_path, pretty(with_id(doc)), "big.json")
    start = time.perf_counter()
    loaded = load_plan(path)
    took = time.perf_counter() - start
    assert loaded.id == plan_id(doc) and len(loaded.placement.nodes) == 20_000
    assert took < 30, f"{took:.1f} s to read and check a plan of 20,000 nodes"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda text: text.replace('"version": 1', '"version": 1, "version": 1', 1), "key 'version' appears twice"),
        (lambda text: text.replace('"version": 1', '"version": 1, "junk": [1, 2]', 1), "unknown field 'junk' at $"),
        (lambda text: text.replace('"max_context": 16', '"max_context": ' + "1" * 70, 1), "a number of 70 characters"),
    ],
    ids=["a key twice", "an unknown key", "a long number"],
)
def test_a_json_plan_is_screened_as_a_yaml_one(change, needle: str) -> None:  # type: ignore[no-untyped-def]
    text = change(pretty(_chain_of(3)))
    with pytest.raises(PlanError) as info:
        decode_text(text, "plan.json")
    assert needle in str(info.value), info.value
    assert decode_text(pretty(_chain_of(3)), "plan.json") == with_id(_chain_of(3))
