"""What a device's speeds were measured with: the engine's id names the code that computes and changes with it;
`plan make` and `plan simulate` say which devices were measured with another engine and how many carry no
measurement; `--probe` re-measures the local and docker devices only; the consumer clusters put eight cards on a host
whose hops cost less than the hops between hosts, derive every card's figures from one measurement, and the best
plan's prediction moves the expected way with each assumption."""

from __future__ import annotations

import importlib
import json
from collections import Counter
from itertools import combinations
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from backends.vastai.settings import VastaiSettings
from ppharness.benchmarks.probe import ProbeFit, probe_record
from ppharness.cli.plan import plan
from ppharness.model.layers import kernels
from ppharness.model.synthetic.spec import parse_synthetic
from ppharness.plan import provenance
from ppharness.plan.consumer import (
    H200,
    HOST_CARDS,
    MOE_BLOCKS_PER_CARD,
    SHIPPED,
    Assumptions,
    basis_from_probes,
    consumer_cluster,
    sensitivity,
    sensitivity_table,
)
from ppharness.plan.graph import spec_graph
from ppharness.plan.lang.check import check_cluster
from ppharness.plan.lang.document import Cluster, Device, Measured, Source
from ppharness.plan.predict.cost import edge_ms
from ppharness.plan.provenance import engine_id, stale_warnings
from ppharness.plan.reader import load_plan

OLD = Measured(engine="ppharness 0.0.9/tinygrad 0.12.0/0123456789ab", hardware="a CPU", date="2026-11-30", how="probe")


def _device(device_id: str, measured: Measured | None = None, kind: str = "local", **source: object) -> Device:
    return Device(
        id=device_id,
        memory=8 << 30,
        gflops=2.0,
        bandwidth_gbs=5.0,
        overhead_ms=0.3,
        source=Source(kind=kind, **source),  # type: ignore[arg-type]
        measured=measured,
    )


def _write_cluster(path: Path, *devices: Device) -> Path:
    path.write_text(msgspec.yaml.encode(msgspec.to_builtins(Cluster(devices=devices, hop_ms=0.3))).decode())
    return path


@pytest.fixture
def no_table(monkeypatch):
    """No kernel table in this process or its environment."""
    monkeypatch.setattr(kernels, "_active", None)
    monkeypatch.delenv(kernels.ENV, raising=False)
    monkeypatch.delenv(kernels.TABLE_ENV, raising=False)


# --- the engine's id ----------------------------------------------------------------------------------------------


def test_the_engine_id_is_stable_and_names_ppharness_tinygrad_and_a_digest():
    first = engine_id()
    assert engine_id() == first
    name, tinygrad, digest = first.split("/")
    assert name.startswith("ppharness ") and tinygrad == f"tinygrad {kernels.tinygrad_version()}"
    assert len(digest) == provenance.DIGEST_HEX and int(digest, 16) >= 0


def test_the_engine_id_changes_when_the_code_that_computes_changes(tmp_path, monkeypatch, no_table):
    code = tmp_path / "model"
    code.mkdir()
    (code / "slicing.py").write_text("STEP = 1\n")
    monkeypatch.setattr(provenance, "CODE", (code,))
    first = engine_id()
    (code / "slicing.py").write_text("STEP = 2  # another kernel order\n")
    changed = engine_id()
    assert changed != first
    (code / "slicing.py").write_text("STEP = 1\n")
    assert engine_id() == first  # the same code, the same engine
    (code / "arch").mkdir()
    (code / "arch" / "new.py").write_text("")
    assert engine_id() not in (first, changed)


def test_the_kernel_table_in_use_is_part_of_the_engine(tmp_path, monkeypatch, no_table):
    bare = engine_id()
    table = kernels.new_table("CPU", "ClangRenderer", 2)
    table.kernels["a" * 64] = [("UPCAST", 0, 4)]
    path = tmp_path / "kernels.json"
    kernels.save_table(table, path)
    monkeypatch.setenv(kernels.ENV, str(path))
    from_file = engine_id()
    assert from_file != bare
    # the same table as a run hands it to its nodes: the same engine
    monkeypatch.delenv(kernels.ENV)
    monkeypatch.setenv(kernels.TABLE_ENV, msgspec.json.encode(table).decode())
    assert engine_id() == from_file


# --- warnings -----------------------------------------------------------------------------------------------------


def test_speeds_measured_with_another_engine_are_named_once_per_engine_and_day():
    now = Measured(engine=engine_id(), hardware="this machine", date="2026-12-03")
    cluster = Cluster(
        devices=(_device("east-gpu", OLD), _device("west-gpu", OLD), _device("here", now), _device("bare"))
    )
    stale, bare = stale_warnings(cluster)
    assert stale.startswith("device speeds of east-gpu, west-gpu were measured with engine ")
    assert f"engine {OLD.engine} on 2026-11-30; this engine is {engine_id()}" in stale
    assert "`--probe`" in stale and "`ppharness plan probe`" in stale and "here" not in stale
    assert bare == "1 of 4 devices carry no `measured` (bare): their speeds are assumptions"
    assert stale_warnings(Cluster(devices=(_device("here", now),))) == []


def test_plan_make_and_simulate_warn_for_a_stale_device_and_not_for_a_current_one(tmp_path, tiny_model_path):
    now = Measured(engine=engine_id(), hardware="this machine", date="2026-12-03")
    runner = CliRunner()
    stale = _write_cluster(tmp_path / "stale-cluster.yaml", _device("east-gpu", OLD), _device("west-gpu", OLD))
    made = runner.invoke(plan, ["make", "--model", "tiny", "--cluster", str(stale), "-o", str(tmp_path / "p.json")])
    assert made.exit_code == 0, made.output
    warnings = [line for line in made.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "east-gpu, west-gpu were measured with engine" in warnings[0]
    simulated = runner.invoke(plan, ["simulate", str(tmp_path / "p.json")])
    assert simulated.exit_code == 0, simulated.output
    assert [line for line in simulated.stderr.splitlines() if line.startswith("warning:")] == warnings
    current = _write_cluster(tmp_path / "current-cluster.yaml", _device("east-gpu", now), _device("west-gpu", now))
    made = runner.invoke(plan, ["make", "--model", "tiny", "--cluster", str(current), "-o", str(tmp_path / "q.json")])
    assert made.exit_code == 0, made.output
    assert "warning:" not in made.stderr
    assert "warning:" not in runner.invoke(plan, ["simulate", str(tmp_path / "q.json")]).stderr


def test_probe_stamps_measured_on_local_and_docker_devices_only(tmp_path, tiny_model_path, monkeypatch):
    stamp = Measured(engine=engine_id(), hardware="this machine", date="2026-12-03", how="the probe")
    measured = Device(id="probe", memory=1 << 30, gflops=3.5, bandwidth_gbs=7.0, overhead_ms=0.05, measured=stamp)
    calls = []

    def fake_probe(path, device_id, blocks, tokens, **kw):
        calls.append((path, blocks, tokens))
        return ProbeFit(measured, "CPU", tokens, {1: 0.1, 2: 0.2}, 0.05, 0.1, 1.0, {})

    # the module, not the click group that ppharness.cli exports under the same name
    monkeypatch.setattr(importlib.import_module("ppharness.cli.plan"), "probe_fit", fake_probe)
    card = _device("card", kind="vastai", offer={"gpu_name": "RTX 4090", "num_gpus": "1"})
    cluster = _write_cluster(
        tmp_path / "mixed-cluster.yaml", _device("here"), _device("box", OLD, "docker", cpus=0.5), card
    )
    out = tmp_path / "plan.json"
    done = CliRunner().invoke(plan, ["make", "--model", "tiny", "--cluster", str(cluster), "--probe", "-o", str(out)])
    assert done.exit_code == 0, done.output
    assert len(calls) == 1  # this machine once, for every local and docker device
    devices = {d.id: d for d in load_plan(out).cluster.devices}
    for name in ("here", "box"):
        assert devices[name].measured == stamp
        assert (devices[name].gflops, devices[name].overhead_ms) == (3.5, 0.05)
    assert devices["box"].source.cpus == 0.5  # the quota stays: the cost model applies it
    assert devices["card"] == card
    assert "--probe: 1 vast.ai device(s) left as they are" in done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: 1 of 3 devices carry no `measured` (card): their speeds are assumptions"]


# --- the consumer clusters ----------------------------------------------------------------------------------------


def test_eight_cards_share_a_host_and_hops_inside_it_cost_less_than_between_hosts():
    cluster = consumer_cluster("4090", 32, "hosts8")
    check_cluster(cluster, "consumer-4090x32-hosts8")
    hosts = Counter(d.source.host for d in cluster.devices)
    assert len(hosts) == 4 and set(hosts.values()) == {HOST_CARDS}
    for host in hosts:
        assert sorted(d.source.gpu for d in cluster.devices if d.source.host == host) == list(range(HOST_CARDS))
    assert {d.source.offer["num_gpus"] for d in cluster.devices if d.source.offer} == {str(HOST_CARDS)}
    hidden_state = 7168 * 2  # Kimi K2's activation in float16
    inside, across = [], []
    for a, b in combinations(cluster.devices, 2):
        (inside if a.source.host == b.source.host else across).append(edge_ms(cluster, a.id, b.id, hidden_state))
    assert max(inside) < min(across)
    one_host = [d.id for d in cluster.devices if d.source.host == cluster.devices[0].source.host]
    assert cluster.link(one_host[0], one_host[1]).delay_ms == 0  # through the host's memory, not the network


def test_every_consumer_card_is_offered_as_the_api_spells_it_and_derived_from_the_h200():
    for card, count, layout in SHIPPED:
        for d in consumer_cluster(card, count, layout).devices:
            offer = d.source.offer
            assert offer is not None and " " in offer["gpu_name"]
            assert VastaiSettings().for_device(offer).gpu_names == (offer["gpu_name"],)
            assert d.measured is not None and d.measured.hardware == H200.hardware
            assert "derived from H200 measurement by bandwidth ratio" in d.measured.how


def test_a_probe_record_is_a_basis_the_consumer_generator_derives_from():
    def record(moe: bool, a: float, b: float, nbytes: float) -> dict[str, object]:
        stamp = Measured(engine="e", hardware="card x", date="2026-12-03")
        dev = Device(id="this", memory=1 << 30, gflops=1.0, measured=stamp)
        fit = ProbeFit(dev, "CUDA", 8, {1: a + b, 2: a + 2 * b}, a, b, 1.0, {}, moe=moe, block_read_bytes=nbytes)
        return json.loads(json.dumps(probe_record(fit, None)))

    dense, moe = record(False, 0.2, 0.1, 100e6), record(True, 0.0, 1.3, 50e6)
    basis = basis_from_probes([dense, moe], gemv_gbs=2000.0)
    assert (basis.step_ms, basis.dense_block_ms, basis.engine_gbs) == pytest.approx((0.2, 0.1, 1000.0))
    assert basis.moe_block_ms == pytest.approx(1.3 - 50e6 / 1000e9 * 1e3)  # beyond its bytes at the dense rate
    assert (basis.engine, basis.hardware, basis.date) == ("e", "card x", "2026-12-03")
    d = consumer_cluster("4090", 24, "region", basis).devices[0]
    assert d.overhead_ms == pytest.approx((0.2 + MOE_BLOCKS_PER_CARD * basis.moe_block_ms) * 2000 / 1008, abs=1e-4)
    assert d.bandwidth_gbs == pytest.approx(1008 * 1000 / 2000, abs=0.1)


def test_the_best_plan_is_slower_with_less_bandwidth_more_fixed_cost_and_dearer_hops():
    source = "synthetic:kimi-k2,blocks=9"  # Kimi K2's blocks, fewer of them: one host's cards hold them
    graph = spec_graph(parse_synthetic(source), source, 4096, weights="q4_k")
    rows = sensitivity(graph, "4090", 8, "hosts8")
    by = {(r.assumptions.share, r.assumptions.fixed, r.assumptions.hop): r for r in rows}
    assert len(by) == 12 and all(r.cards > 1 for r in rows)
    for (share, fixed, hop), r in by.items():
        if share < 1.0:
            better = by[(0.8 if share == 0.7 else 1.0, fixed, hop)]
            assert r.per_token_ms > better.per_token_ms and r.tok_s < better.tok_s
        if fixed > 1:
            assert r.per_token_ms > by[(share, 1.0, hop)].per_token_ms
        if hop > 1:
            assert r.per_token_ms > by[(share, fixed, 1.0)].per_token_ms
    table = sensitivity_table(rows, "title").splitlines()
    assert table[2].startswith("| bandwidth (of published) |") and len(table) == 4 + 12
    base = by[(1.0, 1.0, 1.0)]
    assert base.assumptions == Assumptions() and f"| {base.per_token_ms:.1f} | {base.tok_s:.1f} |" in table[4]
