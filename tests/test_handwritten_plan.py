"""Plans a person writes by hand (``ppharness.plan.reader``): the text form with ``model:`` and ``cluster:``
header lines is a plan file for every command; edges follow the order of the nodes when none are stated; files are
told apart by content; the docs' worked example runs token-exact; every mistake names the file, the place and the
fix."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ppharness.cli.plan import plan
from ppharness.errors import PlanError
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import resolve_model
from ppharness.plan.compile import load_compiled
from ppharness.plan.lang.document import Edge, pretty
from ppharness.plan.lang.parse import parse, parse_document
from ppharness.plan.lang.text_form import render
from ppharness.plan.predict.simulate import simulate
from ppharness.plan.reader import file_kind, load_plan, with_edges
from ppharness.run.inprocess import load_slices, run_inprocess

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "plans.md"
STRONG = ROOT / "scenarios" / "clusters" / "strong-cluster.yaml"
PROMPT = "a plan by hand"
TOKENS = 8

TWO_REGIONS = """\
name: two-regions
hop_ms: 0.35                     # the transport's cost per hop, as a trace measures it
default: {delay_ms: 2}           # any pair not named below
region_links: [{from: east, to: west, delay_ms: 30}]
links: [{from: gpu-a, to: gpu-b, delay_ms: 1, rate_mbit: 1000}]
devices:
  - {id: gpu-a, region: east, memory: 24g, gflops: 80, bandwidth_gbs: 900, overhead_ms: 0.5, usd_per_hour: 0.4}
  - {id: gpu-b, region: east, memory: 16g, gflops: 40, bandwidth_gbs: 450, usd_per_hour: 0.2}
  - {id: box-c, region: west, memory: 8g, gflops: 0.5}
"""


def doc_examples() -> list[str]:
    """The text plans of docs/plans.md's "Write a plan by hand" section, in order."""
    text = DOCS.read_text()
    section = text[text.index("## Write a plan by hand") :]
    section = section[: section.index("\n## ", 5)]
    return re.findall(r"```text\n(.*?)```", section, re.S)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(plan, list(args))
    return result.exit_code, result.output


# --- the docs' worked example ---------------------------------------------------------------------------------


def test_the_docs_worked_example_runs_token_exact_in_one_process(tmp_path):
    hand = _write(tmp_path, "hand.txt", doc_examples()[0])
    doc, compiled = load_compiled(str(hand))
    assert len(doc.model.blocks) == 12 and len(doc.model.sha256) == 64  # read from the small model's file
    assert [n.device for n in doc.placement.nodes] == ["cpu-a", "cpu-b", "cpu-c"]
    assert doc.placement.edges == (
        Edge(src="cpu-a", dst="cpu-b"),
        Edge(src="cpu-b", dst="cpu-c"),
        Edge(src="cpu-c", dst="cpu-a", kind="token"),
    )
    assert compiled.provider_kind == "local" and compiled.runtime.ranges == ((0, 4), (4, 8), (8, 12))
    gguf = GGUFFile(resolve_model(doc.model.source))
    cache: dict = {}
    max_context = doc.model.max_context
    split = run_inprocess(gguf, load_slices(gguf, compiled.runtime.ranges, max_context, cache=cache), PROMPT, TOKENS)
    whole = run_inprocess(gguf, load_slices(gguf, [(0, 12)], max_context, cache=cache), PROMPT, TOKENS)
    assert split.token_ids == whole.token_ids and len(split.token_ids) == TOKENS


@pytest.mark.local
@pytest.mark.slow  # the same plan runs token-exact in one process in the default run; on processes here
def test_pp_smoke_run_runs_the_docs_worked_example_on_local_processes(tmp_path):
    from ppharness.cli.smoke import smoke_run  # the smoke command pulls in the whole run machinery: only here

    hand = _write(tmp_path, "hand.txt", doc_examples()[0])
    result = CliRunner().invoke(smoke_run, ["--plan", str(hand), "--max-tokens", str(TOKENS), "--no-trace"])
    assert result.exit_code == 0, result.output
    assert "MATCH: the 3-stage chain" in result.output


def test_the_docs_strong_cluster_example_checks_and_simulates(tmp_path):
    text = doc_examples()[1]
    assert "cluster: scenarios/clusters/strong-cluster.yaml" in text
    (tmp_path / "scenarios" / "clusters").mkdir(parents=True)
    shutil.copy(STRONG, tmp_path / "scenarios" / "clusters")  # the header's path is relative to the plan file
    doc = load_plan(_write(tmp_path, "strong.txt", text))
    assert doc.cluster.name == "strong" and [n.device for n in doc.placement.nodes] == ["dev-a", "dev-c", "dev-d"]
    assert simulate(doc).per_token_ms > 0
    code, out = _run("simulate", str(tmp_path / "strong.txt"))
    assert code == 0 and "per token" in out


def test_every_plan_command_takes_the_text_form(tmp_path):
    hand = _write(tmp_path, "hand.txt", doc_examples()[0])
    for command in ("check", "show", "simulate", "text"):
        code, out = _run(command, str(hand))
        assert code == 0, (command, out)
    assert _run("text", str(hand))[1] == render(load_plan(hand).placement)


def test_a_scenarios_plan_key_takes_the_text_form(tmp_path):
    from ppharness.scenario.schema import load_scenario  # the scenario reader is not this module's subject

    (tmp_path / "plans").mkdir()
    _write(tmp_path / "plans", "hand.txt", doc_examples()[0])
    _write(tmp_path, "run.yaml", "version: 1\nplan: plans/hand.txt\nrequest: {prompt: 'hand', max_tokens: 4}\n")
    scenario = load_scenario(tmp_path / "run.yaml")
    assert scenario.stages.splits == (4, 8) and scenario.provider.kind == "local"


# --- model and cluster: header lines or options ----------------------------------------------------------------


def test_model_and_cluster_come_from_the_options_over_the_header_lines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "c.yaml", TWO_REGIONS)
    bare = _write(tmp_path, "bare.txt", "gpu-a: embed, blk[0:6]\ngpu-b: blk[6:12], head\n")
    doc = load_plan(bare, model="small", cluster="c.yaml")
    assert doc.cluster.name == "two-regions" and len(doc.model.blocks) == 12
    code, out = _run("check", str(bare), "--model", "small", "--cluster", "c.yaml")
    assert code == 0 and "ok: c.yaml (cluster two-regions" in out and "ok: " + str(bare) in out
    headed = _write(tmp_path, "headed.txt", "model: tiny\ncluster: local\n" + bare.read_text())
    assert load_plan(headed, model="small", cluster="c.yaml").cluster.name == "two-regions"
    document = _write(tmp_path, "plan.json", pretty(load_plan(bare, model="small", cluster="c.yaml")))
    code, out = _run("check", str(document), str(bare), "--model", "small", "--cluster", "c.yaml")
    assert code == 0 and f"ok: {document}" in out, out
    with pytest.raises(PlanError, match="leave out --model and --cluster"):
        load_plan(document, cluster="c.yaml")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("cluster: local\na: embed, blk[0:12], head\n", ["no model", "model: small", "--model"]),
        ("model: small\na: embed, blk[0:12], head\n", ["no cluster", "cluster: local", "--cluster"]),
        ("model: nope.gguf\ncluster: local\na: embed, blk[0:12], head\n", ["line 1", "no such file", "preset"]),
        ("model: small\ncluster: gone.yaml\na: embed, blk[0:12], head\n", ["line 2", "no such cluster file"]),
        ("model: small\nmodel: tiny\na: embed, blk[0:12], head\n", ["line 2, column 1", "a second model:", "keep one"]),
        ("model:\na: embed, blk[0:12], head\n", ["line 1", "model: says nothing", "@model"]),
    ],
)
def test_a_missing_or_bad_header_names_the_file_the_line_and_the_fix(tmp_path, text, words):
    path = _write(tmp_path, "hand.txt", text)
    with pytest.raises(PlanError) as info:
        load_plan(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    for word in words:
        assert word in message, message


def test_header_lines_are_read_and_a_device_called_model_is_written_with_an_at():
    placement, headers = parse_document("model: synthetic:small\ncluster: ../c.yaml\n@model: embed, blk[0:2], head\n")
    assert headers == {"model": ("synthetic:small", 1), "cluster": ("../c.yaml", 2)}
    assert placement.nodes[0].device == "model"
    assert render(placement).startswith("@model: ")
    assert parse(render(placement)) == placement


# --- edges from the order of the nodes -------------------------------------------------------------------------


def test_edges_follow_the_order_of_the_nodes_when_none_are_stated():
    placement = with_edges(parse("a: embed, blk[0:2]\nb: blk[2:4]\nx: experts[1][0-3]\nc: blk[4:6], head => x\n"))
    assert placement.edges == (
        Edge(src="a", dst="b"),
        Edge(src="b", dst="c"),
        Edge(src="c", dst="a", kind="token"),
        Edge(src="c", dst="x", kind="experts"),
    )
    stated = parse("a: embed, blk[0:2] -> b\nb: blk[2:4], head -> a\n")
    assert with_edges(stated) is stated


def test_a_yaml_plan_without_edges_gets_them_from_the_order_of_its_nodes(tmp_path):
    doc = load_plan(_write(tmp_path, "hand.txt", doc_examples()[0]))
    body = json.loads(pretty(doc))
    del body["id"], body["placement"]["edges"]
    again = load_plan(_write(tmp_path, "plan.json", json.dumps(body)))
    assert again.placement.edges == doc.placement.edges and again.id == doc.id


# --- files told apart by content -------------------------------------------------------------------------------


def test_file_kinds_are_told_by_content_not_by_name(tmp_path):
    assert file_kind(TWO_REGIONS) == "cluster"
    assert file_kind(doc_examples()[0]) == "text"
    assert file_kind("version: 1\nmodel: {}\n") == "plan"
    assert file_kind('{\n "cluster": {"devices": []},\n "placement": {}\n}') == "plan"
    two = _write(tmp_path, "two-regions.yaml", TWO_REGIONS)  # the README's example, no "cluster" in its name
    hand = _write(tmp_path, "hand.yaml", doc_examples()[0])
    code, out = _run("check", str(two), str(hand))
    assert code == 0 and "ok: " + str(two) + " (cluster two-regions: 3 devices)" in out, out
    code, out = _run("check", "--cluster", str(hand))  # --cluster forces the kind
    assert code == 1 and "unknown field" in out
    with pytest.raises(PlanError, match=r"this is a cluster file .*ppharness plan make --model M --cluster"):
        load_plan(two)


# --- errors in plain words -------------------------------------------------------------------------------------


def test_an_unquoted_block_range_in_a_yaml_flow_sequence_says_to_quote_it(tmp_path):
    path = _write(
        tmp_path, "plan.yaml", "version: 1\nplacement:\n  nodes:\n    - {device: a, ops: [embed, blk[0:5]]}\n"
    )
    with pytest.raises(PlanError) as info:
        load_plan(path)
    message = str(info.value)
    assert message.startswith(f"{path}: line 4, column 32: blk[0:5]"), message
    assert "write '- \"blk[0:5]\"'" in message and "a YAML flow sequence takes [ as a list" in message


def test_a_missing_activation_edge_names_the_node_where_the_chain_stops_and_the_fix(tmp_path):
    text = "model: small\ncluster: local\ngpu-a: embed, blk[0:4]\ngpu-b: blk[4:8] -> gpu-c\n"
    text += "gpu-c: blk[8:12], head -> gpu-a\n"
    with pytest.raises(PlanError) as info:
        load_plan(_write(tmp_path, "gap.txt", text))
    message = str(info.value)
    assert "the activations stop at node 'gpu-a' (the entry)" in message, message
    assert "never reach the exit 'gpu-c'" in message and "`gpu-a: ... -> gpu-b`" in message
    assert "go gpu-a and never" not in message
    circle = text.replace("gpu-a: embed, blk[0:4]", "gpu-a: embed, blk[0:4] -> gpu-b").replace(
        "blk[4:8] -> gpu-c", "blk[4:8] -> gpu-a"
    )
    with pytest.raises(PlanError, match=r"go round in a circle \(gpu-b -> gpu-a -> gpu-b\)"):
        load_plan(_write(tmp_path, "circle.txt", circle))
