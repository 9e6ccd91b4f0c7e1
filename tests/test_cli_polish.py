"""The small frictions a new user met: --version, a balanced default split, models named as people name them, the
lines a run prints, reaping without a vast.ai key, a percentage where a fraction belongs, ``model info``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ppharness.cli import main
from ppharness.cli.smoke import smoke_run
from ppharness.model.synthetic.spec import PRESETS, preset_spec, short_source, synthetic_source
from ppharness.run.seed.session import member_name
from ppharness.scenario.schema import load_scenario, scenario_from_args, scenario_warnings
from ppharness.trace.drops import fingerprinted

ROOT = Path(__file__).resolve().parent.parent
VERSION = re.compile(r"^(ppharness|pp-smoke-run) \d+\.\d+\S* \(tinygrad \S+(, commit [0-9a-f]+(-dirty)?)?\)$")


@pytest.mark.parametrize("command, name", [(main, "ppharness"), (smoke_run, "pp-smoke-run")])
def test_version_names_the_package_tinygrad_and_the_commit(command, name):
    result = CliRunner().invoke(command, ["--version"])
    assert result.exit_code == 0, result.output
    line = result.output.strip()
    assert VERSION.match(line) and line.startswith(name + " "), line
    if (ROOT / ".git").exists():
        assert ", commit " in line, line


def test_pp_node_prints_its_version_without_starting():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "ppharness.run.node.main", "--version"], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.startswith("pp-node "), done.stdout + done.stderr


def test_a_scenario_split_is_balanced_unless_it_asks_for_floor(tmp_path):
    """8 blocks over 5 stages (the tiny model): 2/2/2/1/1 by default; the SPEC's k = blocks // N on request."""
    assert scenario_from_args(num_stages=5).stages.ranges(8) == [(0, 2), (2, 4), (4, 6), (6, 7), (7, 8)]
    path = tmp_path / "floor.yaml"
    path.write_text("version: 1\nstages: {count: 5, split_rule: floor}\n")
    floor = load_scenario(path)
    assert floor.stages.ranges(8) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 8)]
    assert scenario_from_args(base=floor, num_stages=3).stages.ranges(8) == [(0, 2), (2, 4), (4, 8)]  # kept by -n
    path.write_text("version: 1\nstages: {count: 5, split_rule: ceil}\n")
    with pytest.raises(Exception, match="split_rule"):
        load_scenario(path)


def test_a_synthetic_model_is_named_by_its_preset_and_its_overrides():
    assert short_source(synthetic_source(PRESETS["small"])) == "synthetic:small"
    assert short_source(synthetic_source(preset_spec("small", blocks=4))) == "synthetic:small,blocks=4"
    assert short_source(synthetic_source(PRESETS["tiny-moe"])) == "synthetic:tiny-moe"
    assert short_source("synthetic:tiny,seed=3") == "synthetic:tiny,seed=3"
    assert short_source("/models/x.gguf") == "/models/x.gguf"


def test_run_lines_name_expert_nodes_and_show_a_key_fingerprint():
    assert member_name(1, 2) == "stage 1"
    assert member_name(2, 2) == "expert node 0" and member_name(7, 2) == "expert node 5"
    key = "ab12cd34" + "0" * 56
    assert fingerprinted(f"tcp://127.0.0.1:4000?curve={key}") == "tcp://127.0.0.1:4000 (curve key ab12cd34)"
    assert fingerprinted("tcp://127.0.0.1:4000") == "tcp://127.0.0.1:4000"
    assert len(fingerprinted("iroh:" + "x" * 400)) < 80


@pytest.mark.local
@pytest.mark.slow  # a whole run for its wording; the default run keeps to its 12-minute budget
def test_a_one_stage_run_says_stage_and_that_there_is_no_boundary():
    r = subprocess.run(
        [sys.executable, "-m", "ppharness.cli.smoke", "--num-stages", "1", "--max-tokens", "4", "--no-trace"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "chain (1 stage, as the tokens reached this process)" in out
    assert "with no stage boundary to compare (one stage)" in out and "all 0 stage-boundary" not in out
    assert "model: synthetic:tiny (building" in out
    joined = [line for line in out.splitlines() if " joined from " in line]
    assert joined and all(re.search(r"\(curve key [0-9a-f]{8}\)$", line) for line in joined), joined


def test_reap_without_a_vastai_key_says_so_once():
    env = {k: v for k, v in os.environ.items() if k != "VAST_API_KEY"}
    r = subprocess.run(
        [sys.executable, "-m", "ppharness.cli", "reap", "--dry-run", "--provider", "vastai"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert (r.stdout + r.stderr).count("VAST_API_KEY is not set") == 1, r.stdout + r.stderr


def test_loss_as_a_percentage_is_refused_with_the_fraction_to_write(tmp_path):
    path = tmp_path / "lossy.yaml"
    path.write_text("version: 1\nnetwork:\n  default: {delay_ms: 10, loss: 2%}\n")
    result = CliRunner().invoke(main, ["scenario", "check", str(path)])
    assert result.exit_code == 1
    assert "$.network.default.loss: expected float, got str '2%' — write 0.02: loss is a fraction 0..1" in (
        result.output
    )


def test_a_lossy_network_without_retries_is_warned_about(tmp_path):
    """A warning, not a refusal: the run is valid and may even finish (no message lost), but the first lost message
    costs it its whole budget."""
    lossy = tmp_path / "lossy.yaml"
    lossy.write_text("version: 1\nnetwork:\n  default: {delay_ms: 10, loss: 0.02}\n")
    retry = tmp_path / "retry.yaml"
    retry.write_text(lossy.read_text() + "fault_tolerance: {policy: retry}\n")
    result = CliRunner().invoke(main, ["scenario", "check", str(lossy), str(retry)])
    assert result.exit_code == 0, result.output
    assert result.output.count("warning: ") == 1
    assert f"warning: {lossy}: $.network: links lose messages, but fault_tolerance.policy is none" in result.output
    assert "set fault_tolerance: {policy: retry}" in result.output
    assert f"ok: {lossy}" in result.output and f"ok: {retry}" in result.output
    assert scenario_warnings(load_scenario(retry)) == []


def test_model_info_prints_words_and_the_parameter_count():
    result = CliRunner().invoke(main, ["model", "info", "synthetic:tiny-moe"])
    assert result.exit_code == 0, result.output
    assert "frozenset" not in result.output and "()" not in result.output
    rows = dict(line.strip().split(": ", 1) for line in result.output.splitlines())
    assert rows["parameters"] == f"{PRESETS['tiny-moe'].n_params:,}"
    assert rows["moe blocks"] == "0-3" and rows["tied embeddings"] == "no" and rows["loads here"] == "yes"


def _strong_plan(path: Path):
    """``plan make`` of the tiny model on the strong cluster, written to ``path``: the click result."""
    cluster = str(ROOT / "scenarios/clusters/strong-cluster.yaml")
    return CliRunner().invoke(main, ["plan", "make", "--model", "tiny", "--cluster", cluster, "-o", str(path)])


def test_plan_make_says_what_it_is_planning(tmp_path):
    out = _strong_plan(tmp_path / "p.json")
    assert out.exit_code == 0, out.output
    assert "planning 8 blocks over" in out.stderr


def test_provider_with_a_plan_is_applied_when_it_agrees_and_refused_when_not(tmp_path):
    """`pp-smoke-run --plan strong.json --provider local` used to start docker nodes silently."""
    plan = tmp_path / "strong.json"
    made = _strong_plan(plan)
    assert made.exit_code == 0, made.output
    assert scenario_from_args(plan=str(plan), provider="docker").provider.kind == "docker"
    refused = CliRunner().invoke(smoke_run, ["--plan", str(plan), "--provider", "local"])
    assert refused.exit_code == 1
    assert "--provider local: the plan's devices run on the docker provider" in refused.output
    assert "leave out --provider, or make the plan for a local cluster" in refused.output


def test_plan_simulate_and_model_info_speak_json():
    import json

    plan = str(ROOT / "scenarios" / "kimi.json")
    out = CliRunner().invoke(main, ["plan", "simulate", plan, "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert doc["format"] == "ppharness-prediction/1" and doc["rows"]
    text = CliRunner().invoke(main, ["plan", "simulate", plan]).stdout
    assert f"{doc['per_token_ms']:.3f} ms" in text, "the JSON's figure is the one printed"
    assert abs(sum(r["ms"] for r in doc["rows"]) + doc["quota_wait_ms"] - doc["per_token_ms"]) < 1e-3
    info = CliRunner().invoke(main, ["model", "info", "synthetic:tiny-moe", "--json"])
    model = json.loads(info.stdout)
    assert model["format"] == "ppharness-model/2" and model["arch"] == "qwen3moe" and model["loads"] is True
    shown = CliRunner().invoke(main, ["model", "info", "synthetic:tiny-moe"]).stdout
    assert f"parameters: {model['parameters']:,}" in shown


@pytest.mark.local
def test_a_run_prints_one_json_document_on_stdout_with_ppharness_run_as_pp_smoke_run(tmp_path):
    """`ppharness run FILE --json` takes pp-smoke-run's options; stdout is the run's JSON alone, the summary on
    stderr."""
    import json

    scenario = ROOT / "scenarios" / "smoke-2stage-local.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "ppharness.cli", "run", str(scenario), "--max-tokens", "6", "--json", "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["format"] == "ppharness-run/1" and doc["match"] is True
    assert doc["token_ids"] == doc["oracle"]["token_ids"] and len(doc["token_ids"]) <= 6
    assert [n["blocks"] for n in doc["nodes"]] == [[0, 4], [4, 8]]
    assert doc["boundaries_compared"] > 0 and doc["trace"]["per_token_p50_ms"] > 0 and doc["trace"]["files"] == []
    assert "MATCH" in done.stderr, "the human summary still goes to stderr"


def test_a_long_wait_says_what_it_still_waits_for():
    import time

    from ppharness.run.loop import heartbeat, ticking

    said: list[str] = []
    check = heartbeat(lambda: False, lambda: "stage 1, expert node 0 to compile", said.append, every_s=0.05)
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        assert check() is False
        time.sleep(0.01)
    assert said and all(s.startswith("still waiting for stage 1, expert node 0 to compile (") for s in said)
    said.clear()
    with ticking("running the oracle", said.append, every_s=0.05):
        time.sleep(0.3)
    count = len(said)
    time.sleep(0.15)
    assert count >= 2 and len(said) == count, "it ticks while the work runs and stops with it"
    assert said[0].startswith("still running the oracle (")
