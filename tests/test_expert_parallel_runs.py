"""Expert parallelism end to end: a plan of 2 stages and 4 expert nodes (6 nodes) runs token-exact against the unsplit
model on local processes, in docker containers and on vast.ai instances through the emulator, and its trace shows the
time each MoE block spends on its expert nodes."""

from __future__ import annotations

import uuid
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from ppharness.model.sources.files import synthetic_path
from ppharness.model.synthetic.spec import parse_synthetic, synthetic_source
from ppharness.plan.build import chain
from ppharness.plan.compile import compile_plan, implicit_cluster, programs
from ppharness.plan.graph import model_graph
from ppharness.plan.lang.document import Edge, ExpertGroup, Node, PlanDoc, Source, pretty, with_id
from ppharness.plan.stages import StageSettings

MAX_CONTEXT = 64
MODEL = synthetic_source(parse_synthetic("synthetic:tiny-moe"))


def moe_plan(kind: str, offer: dict[str, str] | None = None) -> PlanDoc:
    """2 stages (stage 0 keeps experts 0 and 1 of its blocks) and 4 expert nodes holding the rest round robin, with
    expert 3 of every block held twice."""
    path = synthetic_path(parse_synthetic(MODEL))
    graph = model_graph(path, MODEL, MAX_CONTEXT)
    cluster = implicit_cluster(kind, 6)
    if offer is not None:
        devices = tuple(msgspec.structs.replace(d, source=Source(kind="vastai", offer=offer)) for d in cluster.devices)
        cluster = msgspec.structs.replace(cluster, devices=devices)
    ids = [d.id for d in cluster.devices]
    doc = chain(graph, cluster, ids[:2], [2])
    count = graph.blocks[0].experts.count
    held: list[dict[int, set[int]]] = [{} for _ in range(4)]
    for layer in range(len(graph.blocks)):
        for e in range(count):
            if not (layer < 2 and e < 2):
                held[e % 4].setdefault(layer, set()).add(e)
        held[0][layer].add(3)
    nodes = list(doc.placement.nodes)
    nodes[0] = msgspec.structs.replace(
        nodes[0], ops=nodes[0].ops + tuple(ExpertGroup(layer=layer, ids=(0, 1)) for layer in range(2))
    )
    edges = list(doc.placement.edges)
    for j, h in enumerate(held):
        device = ids[2 + j]
        ops = tuple(ExpertGroup(layer=layer, ids=tuple(sorted(v))) for layer, v in sorted(h.items()))
        nodes.append(Node(device=device, ops=ops))
        edges += [Edge(src=ids[0], dst=device, kind="experts"), Edge(src=ids[1], dst=device, kind="experts")]
    placement = msgspec.structs.replace(doc.placement, nodes=tuple(nodes), edges=tuple(edges))
    return with_id(msgspec.structs.replace(doc, placement=placement))


def test_each_expert_node_gets_a_program_naming_what_it_holds():
    doc = moe_plan("local")
    progs = programs(compile_plan(doc), StageSettings())
    stages, experts = progs[:2], progs[2:]
    assert [p.role for p in progs] == ["stage"] * 2 + ["experts"] * 4
    assert stages[0].experts == {0: (0, 1), 1: (0, 1)} and stages[1].experts == {}
    assert [p.stage for p in experts] == [2, 3, 4, 5] and all(p.num_stages == 2 for p in experts)
    first = experts[0]
    assert first.registers[0] == "pp-experts-0" and "moe-expert-0-4" in first.registers
    assert first.owners == {0: "pp-stage-0", 1: "pp-stage-0", 2: "pp-stage-1", 3: "pp-stage-1"}
    # expert 3 of each block is on node 3 (3 % 4) and, as a replica, on node 0: the second holder is .r1
    assert "moe-expert-2-3.r1" in experts[3].registers or "moe-expert-2-3.r1" in first.registers


def _smoke(plan_file: Path, *extra: str) -> str:
    from ppharness.cli.smoke import smoke_run

    result = CliRunner().invoke(smoke_run, ["--plan", str(plan_file), "--max-tokens", "12", *extra])
    assert result.exit_code == 0, result.output
    return result.output


def _assert_exact_with_expert_rows(output: str) -> None:
    assert "MATCH" in output and "byte for byte" in output
    assert "stage 0 experts 0" in output and "stage 1 experts 3" in output, output


@pytest.mark.slow
def test_a_plan_with_expert_nodes_runs_token_exact_on_local_processes(tmp_path):
    plan_file = tmp_path / "moe-plan.json"
    plan_file.write_text(pretty(moe_plan("local")))
    _assert_exact_with_expert_rows(_smoke(plan_file))


@pytest.mark.slow
@pytest.mark.docker
def test_a_plan_with_expert_nodes_runs_token_exact_in_docker(tmp_path):
    plan_file = tmp_path / "moe-plan.json"
    plan_file.write_text(pretty(moe_plan("docker")))
    scenario = tmp_path / "moe-docker.yaml"
    # six containers loading on a shared machine: membership waits longer than its default before calling one dead
    scenario.write_text(
        f"version: 1\nname: moe-docker\nplan: {plan_file}\nprovider:\n  kind: docker\ncluster:\n  dead_after_s: 30\n"
    )
    from ppharness.cli.smoke import smoke_run

    result = CliRunner().invoke(smoke_run, ["--scenario", str(scenario), "--max-tokens", "12"])
    assert result.exit_code == 0, result.output
    _assert_exact_with_expert_rows(result.output)


@pytest.mark.slow
@pytest.mark.vastai
def test_a_plan_with_expert_nodes_runs_token_exact_on_vastai_instances(vastai_api, tmp_path):
    from backends.vastai.provider import client_from_env
    from ppharness.run.seed.orchestrator import run_scenario
    from ppharness.scenario.schema import load_scenario
    from tests.test_vastai_chain import ACCEPTANCE, needs_emulator

    needs_emulator(vastai_api)
    plan_file = tmp_path / "moe-plan.json"
    plan_file.write_text(pretty(moe_plan("vastai", offer={"num_gpus": "1"})))
    sc = load_scenario(ACCEPTANCE)
    settings = msgspec.structs.replace(sc.provider.vastai, poll_s=0.1)
    sc = msgspec.structs.replace(
        sc,
        plan=str(plan_file),
        stages=type(sc.stages)(),
        provider=msgspec.structs.replace(sc.provider, vastai=settings),
        transport=msgspec.structs.replace(sc.transport, kind="zmq", relay=None),
        cluster=msgspec.structs.replace(sc.cluster, dead_after_s=30.0),
    )
    label = f"pp-{uuid.uuid4().hex[:8]}"
    result = run_scenario(sc, run_label=label)
    assert result.matches_oracle is True
    assert len(result.stages) == 6
    with client_from_env() as client:
        assert not [i for i in client.list_instances() if label in str(i.get("label", ""))], "instances left behind"


@pytest.mark.slow  # generates with the whole model
def test_plan_probe_routing_measures_frequencies_that_a_plan_takes(tmp_path):
    import json

    from ppharness.cli import main as cli
    from ppharness.plan.experts.routing import load_routing, with_frequencies

    out = tmp_path / "routing.json"
    args = ["plan", "probe", "--routing", "--model", MODEL, "--tokens", "4", "--prompt", "experts, chosen", "-o"]
    result = CliRunner().invoke(cli, [*args, str(out)])
    assert result.exit_code == 0, result.output
    layers = json.loads(out.read_text())["layers"]
    assert sorted(layers) == ["0", "1", "2", "3"]
    assert all(len(f) == 8 and abs(sum(f) - 2.0) < 1e-4 for f in layers.values()), "each token chooses 2 experts"
    assert "hottest expert" in result.output
    doc = with_frequencies(moe_plan("local"), load_routing(out))
    assert doc.model.blocks[2].experts.frequencies == tuple(layers["2"])


def test_plan_probe_routing_refuses_a_model_without_experts():
    from ppharness.cli import main as cli

    result = CliRunner().invoke(cli, ["plan", "probe", "--routing", "--model", "tiny", "--tokens", "2"])
    assert result.exit_code == 1
    assert "without experts has no routing to measure" in result.output
