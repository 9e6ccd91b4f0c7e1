"""The Kimi-class run: ``scenarios/kimi.json``, a plan of kimi-tiny (61 blocks, 60 of them mixture-of-experts with 384
experts, top 8) over eight docker containers in two regions, stages and expert nodes placed by the planner, runs
token-exact against the unsplit model, writes its per-token trace with a row per MoE block and leaves nothing behind;
``scenarios/kimi-vastai.json``, the same placement on vast.ai offers, runs through the emulator."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from ppharness.model.synthetic.spec import parse_synthetic
from ppharness.plan.lang.document import PlanDoc
from ppharness.plan.reader import load_cluster, load_plan

ROOT = Path(__file__).resolve().parents[1]
KIMI = ROOT / "scenarios" / "kimi.json"
KIMI_VASTAI = ROOT / "scenarios" / "kimi-vastai.json"
CLUSTER = ROOT / "scenarios" / "clusters" / "kimi-docker.yaml"
CLUSTER_VASTAI = ROOT / "scenarios" / "clusters" / "kimi-vastai.yaml"
MAX_TOKENS = 8


def _regions(doc: PlanDoc) -> set[str]:
    return {d.region for d in doc.cluster.devices if d.region is not None}


def test_the_kimi_plan_is_valid_and_made_from_the_shipped_cluster_and_model():
    from ppharness.cli import main as cli

    result = CliRunner().invoke(cli, ["plan", "check", str(KIMI), str(KIMI_VASTAI)])
    assert result.exit_code == 0, result.output
    doc = load_plan(KIMI)
    kimi = parse_synthetic("synthetic:kimi-tiny")
    assert parse_synthetic(doc.model.source) == kimi, f"made for another model: {doc.model.source}"
    assert doc.cluster == load_cluster(CLUSTER), "the plan's cluster is not the cluster file's: run plan make again"
    nodes = doc.placement.nodes
    stages = [n for n in nodes if n.blocks]
    experts = [n for n in nodes if not n.blocks]
    assert len(nodes) >= 8 and len(stages) >= 2 and experts
    assert all(doc.cluster.device(n.device).source.kind == "docker" for n in nodes)
    sources = [doc.cluster.device(n.device).source for n in nodes]
    assert len({s.cpus for s in sources}) >= 3 and len({s.memory_limit for s in sources}) >= 2
    regions = sorted(_regions(doc))
    assert 2 <= len(regions) <= 3
    devices = {d.id: d for d in doc.cluster.devices}
    for a in nodes:
        for b in nodes:
            delay = doc.cluster.link(a.device, b.device).delay_ms
            if a.device == b.device:
                continue
            if devices[a.device].region == devices[b.device].region:
                assert delay <= 2, f"{a.device} -> {b.device}: {delay} ms within a region"
            else:
                assert 5 <= delay <= 60, f"{a.device} -> {b.device}: {delay} ms between regions"
    # every block's experts are in its owner's region: no inter-region round trip per MoE block
    owner = {layer: n.device for n in stages for layer in range(*n.blocks)}  # type: ignore[misc]
    for n in experts:
        for layer in n.experts:
            assert devices[n.device].region == devices[owner[layer]].region, (n.device, layer)
    # the files are in `plan make`'s form, lists of ids filling lines (not one line per id)
    from ppharness.plan.lang.document import PRETTY_WIDTH, pretty

    for path in (KIMI, KIMI_VASTAI):
        text = path.read_text()
        assert text == pretty(load_plan(path)), f"{path.name} is not as plan make writes it"
        assert len(text.splitlines()) < 5000 and max(len(x) for x in text.splitlines()) <= PRETTY_WIDTH
    vast = load_plan(KIMI_VASTAI)
    assert vast.model == doc.model
    assert [(n.device, n.blocks) for n in vast.placement.nodes] == [(n.device, n.blocks) for n in nodes]
    assert vast.cluster == load_cluster(CLUSTER_VASTAI)
    assert all(d.source.kind == "vastai" for d in vast.cluster.devices)


def test_expert_node_programs_are_small_enough_for_any_provider_and_name_every_expert():
    """An expert node of kimi-tiny holds thousands of experts: its program (the PLAN environment variable) travels
    compressed, under vast.ai's 32 KiB of environment, and still registers one name per expert it holds, replicas
    numbered in node order."""
    from ppharness.errors import HarnessError
    from ppharness.plan.compile import compile_plan, programs
    from ppharness.plan.stages import StageSettings, decode_program, encode_program, expert_name

    doc = load_plan(KIMI_VASTAI)
    progs = programs(compile_plan(doc), StageSettings(max_context=64))
    copies: dict[tuple[int, int], int] = {}
    for prog in progs:
        env = encode_program(prog)
        assert len(env) < 8192, f"{prog.node}: a program of {len(env)} characters"
        assert decode_program(env) == prog
        if prog.role != "experts":
            continue
        expected = [f"pp-experts-{prog.stage - prog.num_stages}"]
        for layer, ids in sorted((prog.experts or {}).items()):
            for e in ids:
                k = copies[(layer, e)] = copies.get((layer, e), -1) + 1
                expected.append(expert_name(layer, e, k))
        assert prog.registers == expected
    assert sum(len(p.registers) for p in progs if p.role == "experts") >= 60 * 384 - sum(
        len(ids) for p in progs if p.role == "stage" for ids in (p.experts or {}).values()
    )
    import base64
    import zlib

    bomb = "zlib:" + base64.b64encode(zlib.compress(b"[" * (64 << 20))).decode()
    for bad in (bomb, "zlib:not base64!", "{not json"):
        with pytest.raises(HarnessError, match="PLAN"):
            decode_program(bad)


def _assert_trace(trace: Path, doc: PlanDoc) -> None:
    lines = [json.loads(line) for line in trace.with_suffix(".jsonl").read_text().splitlines()]
    assert len(lines) >= MAX_TOKENS - 1, "one line per token"
    text = trace.with_suffix(".jsonl").read_text()
    moe = [layer for layer, b in enumerate(doc.model.blocks) if b.experts.count]
    owners = {layer: i for i, n in enumerate(n for n in doc.placement.nodes if n.blocks) for layer in range(*n.blocks)}  # type: ignore[misc]
    for layer in moe:
        assert f"stage {owners[layer]} experts {layer}" in text, f"no fan-out/gather row for MoE block {layer}"
    perfetto = json.loads(trace.read_text())
    assert perfetto, "the Perfetto trace is empty"


def _docker_left(label: str) -> list[str]:
    found = []
    for what in ("ps", "network ls"):
        out = subprocess.run(
            ["docker", *what.split(), "-a" if what == "ps" else "-q", "-q", "--filter", f"label=ppharness.run={label}"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        found += out
    return found


@pytest.mark.slow
@pytest.mark.docker
def test_the_kimi_plan_runs_token_exact_in_docker_and_writes_its_trace(tmp_path):
    from ppharness.cli.smoke import smoke_run

    doc = load_plan(KIMI)
    label = f"pp-{uuid.uuid4().hex[:8]}"
    trace = tmp_path / "kimi.json"
    # `pp-smoke-run --plan` as the README runs it, through a scenario naming the plan only to wait 30 s before taking
    # a silent node for dead: in CI another multi-container test shares the 2 cores and starves heartbeats
    scenario = tmp_path / "kimi.yaml"
    scenario.write_text(f"version: 1\nname: kimi\nplan: {KIMI}\ncluster:\n  dead_after_s: 30\n")
    args = ["--scenario", str(scenario), "--max-tokens", str(MAX_TOKENS), "--run-label", label, "--trace", str(trace)]
    result = CliRunner().invoke(smoke_run, args)
    assert result.exit_code == 0, result.output
    assert "MATCH" in result.output and "byte for byte" in result.output
    assert "trace written" in result.output
    _assert_trace(trace, doc)
    assert not _docker_left(label), "containers or the network outlived the run"


@pytest.mark.slow
@pytest.mark.vastai
def test_the_kimi_plan_runs_token_exact_on_vastai_instances(vastai_api, tmp_path):
    from backends.vastai.provider import client_from_env
    from ppharness.run.seed.orchestrator import run_scenario
    from ppharness.scenario.schema import load_scenario, scenario_from_args
    from tests.test_vastai_chain import ACCEPTANCE, needs_emulator

    needs_emulator(vastai_api)
    sc = load_scenario(ACCEPTANCE)
    sc = msgspec.structs.replace(sc, stages=type(sc.stages)())  # the plan says how to split
    sc = scenario_from_args(base=sc, plan=str(KIMI_VASTAI), transport="zmq", max_tokens=MAX_TOKENS)
    settings = msgspec.structs.replace(sc.provider.vastai, poll_s=0.1, max_total_dph=20.0)  # two 8-GPU machines
    sc = msgspec.structs.replace(
        sc,
        provider=msgspec.structs.replace(sc.provider, vastai=settings),
        transport=msgspec.structs.replace(sc.transport, relay=None),
        cluster=msgspec.structs.replace(sc.cluster, dead_after_s=30.0),  # CI's shared cores starve heartbeats
    )
    label = f"pp-{uuid.uuid4().hex[:8]}"
    result = run_scenario(sc, run_label=label, trace=True)
    assert result.matches_oracle is True
    assert len(result.stages) == len(load_plan(KIMI_VASTAI).placement.nodes)
    assert result.trace is not None and "experts" in result.trace.summary()
    with client_from_env() as client:
        assert not [i for i in client.list_instances() if label in str(i.get("label", ""))], "instances left behind"
    # each host is one instance found by its own search, with the GPU name as the API spells it
    assert vastai_api.emulator is not None
    searches = [line for line in vastai_api.emulator.log_text().splitlines() if "search: filters" in line]
    assert len(searches) == 2, searches
    assert any('"gpu_name": {"eq": "RTX 4090"}' in line for line in searches), searches
    assert any('"gpu_name": {"eq": "A100 SXM4"}' in line for line in searches), searches
    assert all('"num_gpus": {"eq": 8}' in line for line in searches), searches
    creates = [line for line in vastai_api.emulator.log_text().splitlines() if " create: " in line]
    assert len(creates) == 2 and all("exec pp-host" in line for line in creates), "one instance per 8-GPU host"


def test_plan_show_keeps_a_large_plans_lines_short_and_plan_text_prints_them_whole():
    from ppharness.cli import main as cli

    shown = CliRunner().invoke(cli, ["plan", "show", str(KIMI)])
    assert shown.exit_code == 0, shown.output
    assert max(len(line) for line in shown.output.splitlines()) < 300
    assert "more characters: `ppharness plan text` prints it" in shown.output
    text = CliRunner().invoke(cli, ["plan", "text", str(KIMI)])
    assert text.exit_code == 0 and max(len(line) for line in text.output.splitlines()) > 1000
