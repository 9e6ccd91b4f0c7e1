"""Plans that run: every plan the planner makes is token-exact against the unsplit model; a plan file runs through
``pp-smoke-run --plan`` and a scenario's ``plan:`` key on real processes; bad plans are refused before anything
starts; every shipped cluster file makes a plan that checks, simulates and draws."""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from ppharness.errors import PlanError
from ppharness.model.synthetic.spec import PRESETS, synthetic_source
from ppharness.plan.build import chain
from ppharness.plan.compile import compile_plan, plan_network, programs
from ppharness.plan.graph import model_graph
from ppharness.plan.lang.check import check_plan
from ppharness.plan.lang.document import Cluster, Device, Impaired, Link, Objective, Source, pretty
from ppharness.plan.reader import load_plan
from ppharness.plan.search.planner import plan_optimal
from ppharness.plan.stages import ENTRY, EXIT, StageSettings
from ppharness.run.inprocess import load_slices, run_inprocess

ROOT = Path(__file__).resolve().parent.parent
CLUSTERS = sorted((ROOT / "scenarios" / "clusters").glob("*cluster*.yaml"))
MAX_CONTEXT = 64
PROMPT = "plans that run"
_slices: dict = {}
_oracle: list = []


@pytest.fixture(scope="module")
def tiny_graph(tiny_model_path):
    return model_graph(tiny_model_path, synthetic_source(PRESETS["tiny"]), MAX_CONTEXT)


def _oracle_tokens(gguf, tokens: int) -> list[int]:
    if not _oracle:
        whole = load_slices(gguf, [(0, gguf.config.blocks)], MAX_CONTEXT, cache=_slices)
        _oracle.extend(run_inprocess(gguf, whole, PROMPT, tokens).token_ids)
    return _oracle


@st.composite
def clusters(draw) -> Cluster:
    n = draw(st.integers(2, 5))
    regions = ["east", "west"]
    devices = tuple(
        Device(
            id=f"d{i}",
            memory=draw(st.integers(1 << 20, 4 << 20)),  # 1 to 4 MiB: the tiny model's 0.8 MiB of blocks, split
            reserve=0,
            gflops=draw(st.floats(0.05, 2.0)),
            overhead_ms=draw(st.floats(0.0, 2.0)),
            region=draw(st.sampled_from(regions)),
            source=Source(kind="docker", cpus=draw(st.sampled_from([None, 1.0, 0.5, 0.25]))),
        )
        for i in range(n)
    )
    links = tuple(
        Link(src=f"d{i}", dst=f"d{j}", delay_ms=draw(st.floats(0.0, 40.0)))
        for i in range(n)
        for j in range(n)
        if i < j and draw(st.booleans())
    )
    return Cluster(
        devices=devices,
        default=Impaired(delay_ms=draw(st.floats(0.0, 10.0))),
        links=links,
        hop_ms=draw(st.floats(0.0, 1.0)),
    )


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(cluster=clusters(), objective=st.sampled_from(["latency", "throughput"]))
def test_every_plan_the_planner_makes_runs_token_exact(tiny_graph, tiny_gguf, cluster, objective):
    try:
        doc = plan_optimal(tiny_graph, cluster, Objective(kind=objective))
    except PlanError as exc:  # a cluster too small for the model: the planner says so, naming the shortfall
        assert "short" in str(exc)
        return
    check_plan(doc)
    compiled = compile_plan(doc)
    ranges = list(compiled.runtime.ranges)
    assert ranges[0][0] == 0 and ranges[-1][1] == tiny_graph.blocks.__len__()
    got = run_inprocess(tiny_gguf, load_slices(tiny_gguf, ranges, MAX_CONTEXT, cache=_slices), PROMPT, 24)
    assert got.token_ids == _oracle_tokens(tiny_gguf, 24), f"plan {ranges} diverged from the unsplit model"


def _three_devices(kind: str = "local") -> Cluster:
    return Cluster(
        devices=tuple(Device(id=f"dev-{c}", memory=8 << 30, gflops=1.0, source=Source(kind=kind)) for c in "abc"),
        links=(Link(src="dev-b", dst="dev-a", delay_ms=3.0),),
    )


def test_programs_name_the_loop_and_route_each_message(tiny_graph):
    doc = chain(tiny_graph, _three_devices(), ["dev-b", "dev-a", "dev-c"], [3, 5])
    progs = programs(compile_plan(doc), StageSettings(max_context=MAX_CONTEXT))
    assert [(p.node, p.lo, p.hi) for p in progs] == [("dev-b", 0, 3), ("dev-a", 3, 5), ("dev-c", 5, 8)]
    assert progs[0].registers == ["pp-stage-0", ENTRY] and progs[2].registers == ["pp-stage-2", EXIT]
    assert (progs[1].prev, progs[1].next) == ("pp-stage-0", "pp-stage-2")
    assert all(p.plan_id == doc.id for p in progs)


def test_the_clusters_links_become_the_runs_network_between_stages(tiny_graph):
    doc = chain(tiny_graph, _three_devices(), ["dev-b", "dev-a", "dev-c"], [3, 5])
    network = plan_network(compile_plan(doc), None)
    assert network is not None
    # dev-b -> dev-a is stage 0 -> stage 1 (and, given one way only, the way back too); nothing else is impaired
    assert network.impairment("stage-0", "stage-1").delay_ms == 3.0
    assert network.impairment("stage-1", "stage-0").delay_ms == 3.0
    assert network.impairment("stage-1", "stage-2").perfect


def test_a_plan_whose_devices_come_from_two_providers_is_refused(tiny_graph):
    cluster = _three_devices()
    devices = (*cluster.devices[:2], msgspec.structs.replace(cluster.devices[2], source=Source(kind="docker")))
    doc = chain(tiny_graph, msgspec.structs.replace(cluster, devices=devices), ["dev-a", "dev-b", "dev-c"], [3, 5])
    with pytest.raises(PlanError, match="one run uses one provider"):
        compile_plan(doc)


@pytest.mark.local
def test_pp_smoke_run_runs_a_plan_file_token_exact(tiny_graph, tmp_path):
    from ppharness.cli.smoke import smoke_run

    doc = chain(tiny_graph, _three_devices(), ["dev-c", "dev-a", "dev-b"], [2, 7])
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(pretty(doc))
    result = CliRunner().invoke(smoke_run, ["--plan", str(plan_file), "--max-tokens", "12"])
    assert result.exit_code == 0, result.output
    assert "MATCH" in result.output
    assert f"plan {doc.id}" in result.output
    # a plan run leaves its per-token trace behind by default, in the cache directory, named after the plan
    from ppharness.model.sources.files import cache_dir

    line = next(x for x in result.output.splitlines() if x.startswith("trace written: "))
    written = [Path(p) for p in line.removeprefix("trace written: ").split(" (")[0].split(", ")]
    try:
        assert [p.parent for p in written] == [cache_dir() / "traces"] * 2 and written[0].name.startswith("plan-")
        assert json.loads(written[0].read_text())["traceEvents"] and written[1].read_text().count("\n") >= 11
    finally:
        for p in written:
            p.unlink(missing_ok=True)


def test_a_scenarios_plan_key_is_read_relative_to_the_scenario(tiny_graph, tmp_path):
    from ppharness.scenario.schema import load_scenario

    doc = chain(tiny_graph, _three_devices(), ["dev-a", "dev-b"], [5])
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "two.json").write_text(pretty(doc))
    (tmp_path / "run.yaml").write_text("version: 1\nplan: plans/two.json\nrequest: {prompt: 'plans', max_tokens: 8}\n")
    scenario = load_scenario(tmp_path / "run.yaml")
    assert scenario.plan == str(tmp_path / "plans" / "two.json")
    assert scenario.stages.num_stages == 2 and scenario.stages.splits == (5,)
    assert scenario.provider.kind == "local" and scenario.model.max_context == MAX_CONTEXT


def test_a_plan_for_another_model_is_refused_before_anything_starts(tiny_graph, tmp_path):
    from ppharness.cli.smoke import smoke_run

    other = msgspec.structs.replace(tiny_graph, sha256="0" * 64)
    doc = chain(other, _three_devices(), ["dev-a", "dev-b"], [4])
    plan_file = tmp_path / "other.json"
    plan_file.write_text(pretty(doc))
    t0 = time.monotonic()
    result = CliRunner().invoke(smoke_run, ["--plan", str(plan_file)])
    assert result.exit_code == 1
    assert "$.model.sha256" in result.output and "make the plan again" in result.output
    assert "starting" not in result.output, "nodes were started for a plan made for another model"
    assert time.monotonic() - t0 < 30


def test_a_plan_and_a_stage_count_together_are_refused(tiny_graph, tmp_path):
    from ppharness.cli.smoke import smoke_run

    plan_file = tmp_path / "p.json"
    plan_file.write_text(pretty(chain(tiny_graph, _three_devices(), ["dev-a", "dev-b"], [4])))
    result = CliRunner().invoke(smoke_run, ["--plan", str(plan_file), "--num-stages", "3"])
    assert result.exit_code == 1
    assert "give one of them" in result.output


@pytest.mark.parametrize("path", CLUSTERS, ids=lambda p: p.stem)
def test_shipped_cluster_makes_a_plan_that_checks_simulates_and_draws(path, tmp_path):
    from ppharness.cli import main

    out = tmp_path / "plan.json"
    made = CliRunner().invoke(main, ["plan", "make", "--model", "small", "--cluster", str(path), "-o", str(out)])
    assert made.exit_code == 0, made.output
    doc = load_plan(out)
    assert doc.placement.policy == "optimal" and len(doc.placement.nodes) >= 2  # no device holds the whole model
    sim = CliRunner().invoke(main, ["plan", "simulate", str(out)])
    assert sim.exit_code == 0 and "per token" in sim.output
    png = tmp_path / "plan.png"
    shown = CliRunner().invoke(main, ["plan", "show", str(out), "--png", str(png)])
    assert shown.exit_code == 0, shown.output
    assert all(n.device in shown.output for n in doc.placement.nodes)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_cluster_on_which_no_plan_fits_says_what_is_short(tiny_graph):
    small = Cluster(devices=(Device(id="a", memory=512 << 10, reserve=0, gflops=1.0),))  # the model needs 0.9 MiB
    with pytest.raises(PlanError, match="short"):
        plan_optimal(tiny_graph, small, Objective())


def test_a_scenario_with_both_a_plan_and_stages_is_refused(tiny_graph, tmp_path):
    from ppharness.errors import ScenarioError
    from ppharness.scenario.schema import load_scenario

    (tmp_path / "p.json").write_text(pretty(chain(tiny_graph, _three_devices(), ["dev-a", "dev-b"], [4])))
    (tmp_path / "both.yaml").write_text("version: 1\nplan: p.json\nstages: {count: 3}\n")
    with pytest.raises(ScenarioError, match=r"\$\.stages: a scenario with a plan takes its stages from the plan"):
        load_scenario(tmp_path / "both.yaml")


def test_realise_gives_each_node_its_program_and_its_devices_docker_limits(tiny_graph):
    from ppharness.run.seed.realise import Endpoints, realise
    from ppharness.scenario.schema import scenario_from_args

    cluster = _three_devices("docker")
    limited = msgspec.structs.replace(cluster.devices[1], source=Source(kind="docker", cpus=0.5, memory_limit=1 << 30))
    cluster = msgspec.structs.replace(cluster, devices=(cluster.devices[0], limited, cluster.devices[2]))
    compiled = compile_plan(chain(tiny_graph, cluster, ["dev-a", "dev-b"], [4]))
    at = Endpoints(seed="tcp://127.0.0.1:1", node_model="/m.gguf", transport_opts=[{}, {}])
    nodes = realise(scenario_from_args(provider="docker"), compiled, at, trace=False)
    assert [n.name for n in nodes] == ["pp-stage-0", "pp-stage-1"]
    assert [n.env["STAGE"] for n in nodes] == ["0", "1"] and nodes[1].env["SEED_ADDR"] == "tcp://127.0.0.1:1"
    assert msgspec.json.decode(nodes[1].env["PLAN"])["names"] == ["pp-stage-1", "pp-exit"]
    # a device without limits of its own leaves them to the run's docker settings
    assert (nodes[0].options.get("cpus"), nodes[0].options.get("memory")) == (None, None)
    assert (nodes[1].options["cpus"], nodes[1].options["memory"]) == (0.5, 1 << 30)


def test_the_readmes_cluster_example_loads_and_plans(tiny_graph, tmp_path):
    from ppharness.plan.reader import load_cluster

    text = (ROOT / "docs" / "plans.md").read_text()
    start = text.index("name: two-regions")
    (tmp_path / "readme-cluster.yaml").write_text(text[start : text.index("```", start)])
    cluster = load_cluster(tmp_path / "readme-cluster.yaml")
    assert [d.id for d in cluster.devices] == ["gpu-a", "gpu-b", "box-c"]
    assert cluster.link("gpu-a", "box-c").delay_ms == 30  # east -> west, the regions' link
    check_plan(plan_optimal(tiny_graph, cluster, Objective()))


def test_a_scenario_serving_more_requests_than_its_plan_counted_is_refused(tiny_graph, tiny_model_path, tmp_path):
    """The plan's memory check counts the KV cache of ``objective.requests`` per stage: a scenario asking for more
    slots is refused with the fix; a scenario's own chain plan counts its slots."""
    from ppharness.run.seed.realise import realise_plan
    from ppharness.scenario.schema import load_scenario

    (tmp_path / "two.json").write_text(pretty(chain(tiny_graph, _three_devices(), ["dev-a", "dev-b"], [5])))
    (tmp_path / "run.yaml").write_text("version: 1\nplan: two.json\nserving: {slots: 3}\n")
    with pytest.raises(PlanError) as refused:
        realise_plan(load_scenario(tmp_path / "run.yaml"), "synthetic:tiny", tiny_model_path)
    assert "$.placement.objective.requests" in str(refused.value) and "--requests 3" in str(refused.value)
    (tmp_path / "own.yaml").write_text("version: 1\nstages: {count: 2}\nserving: {slots: 3}\n")
    doc, _ = realise_plan(load_scenario(tmp_path / "own.yaml"), "synthetic:tiny", tiny_model_path)
    assert doc.placement.objective.requests == 3
