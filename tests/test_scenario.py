"""Scenario YAML v1: the shipped files load, and every kind of mistake names the file, the field path and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from ppharness import registry
from ppharness.errors import ScenarioError
from ppharness.scenario import (
    Scenario,
    Stages,
    check_against_model,
    load_scenario,
    scenario_from_args,
    scenario_schema,
)

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


def _write(tmp_path: Path, text: str, name: str = "x.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _error(path: Path) -> str:
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    message = str(info.value)
    assert message.startswith(f"{path}: "), message
    return message


@pytest.mark.parametrize(("name", "stages"), [("smoke-2stage-local", 2), ("smoke-5stage-local", 5)])
def test_smoke_scenarios_load(name: str, stages: int) -> None:
    s = load_scenario(SCENARIOS / f"{name}.yaml")
    assert s.name == name
    assert s.stages.count == stages and s.stages.splits is None
    assert s.model.synthetic is not None and s.model.synthetic.preset == "tiny" and s.model.gguf is None
    assert (s.transport.kind, s.provider.kind) == ("zmq", "local")
    assert s.request.max_tokens == 16 and not s.request.prompt.isascii()


def test_every_shipped_scenario_loads() -> None:
    files = sorted(SCENARIOS.glob("*.yaml"))
    assert files
    for path in files:
        assert isinstance(load_scenario(path), Scenario), path


def test_minimal_file_gets_defaults(tmp_path: Path) -> None:
    s = load_scenario(_write(tmp_path, "version: 1\n", "mini.yaml"))
    assert s.name == "mini"
    assert s.stages.count == 2 and s.model.synthetic is not None and s.model.max_context == 256
    assert s.transport.wire_dtype == "f16" and s.budget.total_s == 300


def test_unknown_field_names_path_and_valid_keys(tmp_path: Path) -> None:
    path = _write(tmp_path, "version: 1\nprovider:\n  backnd: local\n")
    message = _error(path)
    assert "unknown field 'backnd' at $.provider" in message
    assert "expected one of: kind" in message


def test_unknown_top_level_field_lists_sections(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "version: 1\nstagse: {count: 2}\n"))
    assert "unknown field 'stagse' at $ " in message
    for key in ("model", "stages", "transport", "provider", "request", "budget"):
        assert key in message


def test_wrong_type_names_path_and_expected_type(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "version: 1\nstages:\n  count: many\n"))
    assert "$.stages.count" in message and "expected int" in message and "'many'" in message


def test_constraint_violation_names_bound(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "version: 1\nrequest: {max_tokens: 0}\n"))
    assert "$.request.max_tokens" in message and ">= 1" in message


def test_too_many_stages_for_blocks(tmp_path: Path) -> None:
    text = "version: 1\nmodel:\n  synthetic: {preset: tiny, blocks: 4}\nstages: {count: 9}\n"
    message = _error(_write(tmp_path, text))
    assert "$.stages.count" in message and "9 stages" in message and "4 blocks" in message


def test_check_against_model_directly() -> None:
    s = scenario_from_args(num_stages=3)
    check_against_model(s, 3)
    with pytest.raises(ScenarioError, match=r"^src\.yaml: \$\.stages\.count: 3 stages but the model has 2 blocks"):
        check_against_model(s, 2, source="src.yaml")
    split = msgspec.structs.replace(s, stages=Stages(splits=(1, 5)))
    check_against_model(split, 6)
    with pytest.raises(ScenarioError, match=r"\$\.stages\.splits\[1\]"):
        check_against_model(split, 5)


def test_split_point_beyond_blocks(tmp_path: Path) -> None:
    text = "version: 1\nmodel: {synthetic: {blocks: 4}}\nstages: {splits: [1, 4]}\n"
    assert "$.stages.splits[1]" in _error(_write(tmp_path, text))


def test_splits_must_increase(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "version: 1\nstages: {splits: [3, 2]}\n"))
    assert "$.stages.splits[1]" in message and "increasing" in message


def test_splits_and_count_must_agree(tmp_path: Path) -> None:
    assert load_scenario(_write(tmp_path, "version: 1\nstages: {splits: [1, 3]}\n")).stages.count == 3
    message = _error(_write(tmp_path, "version: 1\nstages: {count: 2, splits: [1, 3]}\n", "y.yaml"))
    assert "$.stages.count" in message and "count: 3" in message


def test_split_point_zero_rejected(tmp_path: Path) -> None:
    assert "$.stages.splits[0]" in _error(_write(tmp_path, "version: 1\nstages: {splits: [0, 3]}\n"))


def test_both_synthetic_and_gguf_rejected(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "version: 1\nmodel:\n  synthetic: {preset: tiny}\n  gguf: m.gguf\n"))
    assert "$.model" in message and "exactly one" in message


def test_neither_synthetic_nor_gguf_rejected(tmp_path: Path) -> None:
    assert "$.model: neither" in _error(_write(tmp_path, "version: 1\nmodel: {max_context: 512}\n"))


def test_unknown_transport_kind_lists_known(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "version: 1\ntransport: {kind: carrier-pigeon}\n"))
    assert "$.transport.kind" in message
    assert all(kind in message for kind in registry.TRANSPORTS)


def test_unknown_provider_kind_lists_known(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "version: 1\nprovider: {kind: mainframe}\n"))
    assert "$.provider.kind" in message
    assert all(kind in message for kind in registry.PROVIDERS)


def test_wire_dtype_lists_choices(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "version: 1\ntransport: {wire_dtype: f8}\n"))
    assert "$.transport.wire_dtype" in message and "f16" in message and "bf16" in message


def test_wrong_version(tmp_path: Path) -> None:
    assert "$.version" in _error(_write(tmp_path, "version: 2\n"))
    assert "'version'" in _error(_write(tmp_path, "name: x\n", "y.yaml"))


def test_bad_yaml_gives_line(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "version: 1\nstages:\n  count: 2\n bad: : x\n"))
    assert "not valid YAML" in message and "line 4" in message


def test_empty_file(tmp_path: Path) -> None:
    assert "empty" in _error(_write(tmp_path, ""))


def test_missing_file(tmp_path: Path) -> None:
    assert "no such file" in _error(tmp_path / "absent.yaml")


def test_schema_shape() -> None:
    schema = scenario_schema()
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["title"] and schema["type"] == "object"
    for key in ("version", "model", "stages", "transport", "provider", "request", "expect", "budget"):
        assert key in schema["properties"]
    assert schema["required"] == ["version"]
    assert "Stages" in schema["$defs"]
    json.loads(json.dumps(schema))


def test_yaml_round_trip() -> None:
    s = load_scenario(SCENARIOS / "smoke-5stage-local.yaml")
    assert msgspec.yaml.decode(msgspec.yaml.encode(s), type=Scenario) == s
    split = msgspec.structs.replace(s, stages=Stages(splits=(2, 4)))
    assert msgspec.yaml.decode(msgspec.yaml.encode(split), type=Scenario) == split


def test_scenario_from_args_and_with_stages() -> None:
    s = scenario_from_args(num_stages=3, transport="memory", provider="local", prompt="hi", max_tokens=4)
    assert (s.stages.count, s.transport.kind, s.provider.kind, s.request.prompt, s.request.max_tokens) == (
        3,
        "memory",
        "local",
        "hi",
        4,
    )
    assert s.name
    split = msgspec.structs.replace(s, stages=Stages(splits=(1, 2, 5)))
    four = split.with_stages(4)
    assert four.stages == Stages(count=4) and four.stages.splits is None and four.name == s.name
    with pytest.raises(ScenarioError, match=r"\$\.transport\.kind"):
        scenario_from_args(transport="nope")
    with pytest.raises(ScenarioError, match=r"\$\.stages\.count"):
        scenario_from_args(num_stages=0)


def test_stage_ranges() -> None:
    assert Stages(count=3).ranges(8) == [(0, 2), (2, 4), (4, 8)]
    assert Stages(splits=(1, 3)).ranges(8) == [(0, 1), (1, 3), (3, 8)]
    with pytest.raises(ScenarioError):
        Stages(count=9).ranges(8)


# --- transport.relay (iroh) and the WAN template --------------------------------------------------------------------

WAN_TEMPLATE = SCENARIOS / "templates" / "wan-vastai-iroh.yaml"


def test_iroh_smoke_scenario_disables_relays() -> None:
    s = load_scenario(SCENARIOS / "smoke-5stage-local-iroh.yaml")
    assert (s.transport.kind, s.transport.relay, s.provider.kind, s.stages.count) == ("iroh", "disabled", "local", 5)


def test_relay_applies_only_to_iroh(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "version: 1\ntransport: {kind: zmq, relay: default}\n"))
    assert "$.transport.relay" in message and "only to the iroh transport" in message


def test_relay_value_is_checked(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "version: 1\ntransport: {kind: iroh, relay: sometimes}\n"))
    assert "$.transport.relay" in message and "default, disabled" in message


def test_transport_override_keeps_relay_for_iroh_and_drops_it_otherwise() -> None:
    base = load_scenario(SCENARIOS / "smoke-5stage-local-iroh.yaml")
    assert scenario_from_args(base=base, transport="iroh").transport.relay == "disabled"
    assert scenario_from_args(base=base, transport="zmq").transport.relay is None
    assert scenario_from_args(transport="iroh").transport.relay is None


def test_relay_reaches_every_planned_endpoint() -> None:
    from ppharness.orchestrator import transport_settings

    section = msgspec.structs.replace(load_scenario(SCENARIOS / "smoke-5stage-local-iroh.yaml").transport,
                                      relay="default")
    opts = registry.transport_class("iroh").plan_endpoints(3, transport_settings(section))
    assert [o["relay"] for o in opts] == ["default"] * 3


def test_wan_template_passes_scenario_check(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ppharness.cli import main

    def check(path: Path) -> tuple[int, str]:
        result = CliRunner().invoke(main, ["scenario", "check", str(path)])
        return result.exit_code, result.output

    text = WAN_TEMPLATE.read_text(encoding="utf-8")
    assert "kind: vastai" in text and "relay: default" in text and "kind: iroh" in text
    if "vastai" in registry.PROVIDERS:
        assert check(WAN_TEMPLATE) == (0, f"ok: {WAN_TEMPLATE}\n")
        return
    code, output = check(WAN_TEMPLATE)
    assert code == 1 and "$.provider.kind: unknown provider kind 'vastai'" in output, output
    print("vastai provider not registered yet: checking every field of the WAN template but the provider kind")
    local = _write(tmp_path, text.replace("kind: vastai", "kind: local"), WAN_TEMPLATE.name)
    assert check(local) == (0, f"ok: {local}\n")
    s = load_scenario(local)
    assert (s.transport.kind, s.transport.relay, s.model.synthetic.preset) == ("iroh", "default", "llama-3.2-1b")


@pytest.mark.parametrize("kind", ["local", "docker", "vastai"])
def test_provider_settings_of_another_kind_are_rejected(tmp_path, kind):
    other = "local" if kind == "docker" else "docker"
    path = tmp_path / "s.yaml"
    path.write_text(f"version: 1\nprovider:\n  kind: {other}\n  {kind}: {{}}\n")
    with pytest.raises(ScenarioError, match=rf"\$\.provider\.{kind}: {kind} settings apply only to kind {kind}, "
                                            rf"not '{other}'"):
        load_scenario(path)


# --- quantised synthetic models and the SPEC's request on vast.ai ---------------------------------------------------

SPEC_TEMPLATE = SCENARIOS / "templates" / "acceptance-5stage-vastai-llama3.2-1b.yaml"
# the model layer of ollama's llama3.2:1b: its sha256, and its name in the registry
LLAMA_3_2_1B_Q8_0 = "74701a8c35f6c8d9a4b91f3f3497643001d63e0c7a84e085bed452548fa88d45"


def test_synthetic_weight_type(tmp_path: Path) -> None:
    s = load_scenario(_write(tmp_path, "version: 1\nmodel: {synthetic: {preset: tiny, seed: 0, type: q8_0}}\n"))
    assert s.model.synthetic.type == "q8_0"
    assert load_scenario(_write(tmp_path, "version: 1\n", "plain.yaml")).model.synthetic.type == "f16"
    message = _error(_write(tmp_path, "version: 1\nmodel: {synthetic: {preset: tiny, type: q5_k}}\n", "bad.yaml"))
    assert "$.model.synthetic.type" in message and "unknown weight type 'q5_k'" in message
    assert "f16, q8_0, q4_0" in message
    message = _error(_write(tmp_path, "version: 1\nmodel: {synthetic: {preset: tiny, dim: 48, type: q4_0}}\n",
                            "dim.yaml"))
    assert "$.model.synthetic" in message and "blocks of 32" in message


def test_scenario_weight_type_reaches_the_model(tmp_path: Path) -> None:
    from ppharness.modelfile import parse_synthetic
    from ppharness.orchestrator import model_source

    s = load_scenario(_write(tmp_path, "version: 1\nmodel: {synthetic: {preset: tiny, type: q8_0}}\n"))
    source, sha = model_source(s)
    assert parse_synthetic(source).type == "q8_0" and sha is None


def test_spec_template_is_the_specs_request() -> None:
    from click.testing import CliRunner

    from ppharness.cli import VASTAI_ACCEPTANCE, main

    assert SPEC_TEMPLATE.name == VASTAI_ACCEPTANCE  # what pp-smoke-run --vastai runs by default
    r = CliRunner().invoke(main, ["scenario", "check", str(SPEC_TEMPLATE)])
    assert (r.exit_code, r.output) == (0, f"ok: {SPEC_TEMPLATE}\n")
    s = load_scenario(SPEC_TEMPLATE)
    assert s.model.synthetic is None and s.model.sha256 == LLAMA_3_2_1B_Q8_0
    assert s.model.gguf == f"https://registry.ollama.ai/v2/library/llama3.2/blobs/sha256:{LLAMA_3_2_1B_Q8_0}"
    assert (s.request.prompt, s.request.max_tokens) == ("Say hello", 64)
    assert s.expect.match_oracle and s.provider.kind == "vastai"


def test_vastai_ci_variant_differs_from_the_spec_template_only_in_model_and_request() -> None:
    spec, ci = load_scenario(SPEC_TEMPLATE), load_scenario(SCENARIOS / "acceptance-5stage-vastai.yaml")
    assert ci.model.synthetic is not None and ci.model.synthetic.preset == "tiny" and ci.model.gguf is None
    assert (ci.stages, ci.transport, ci.expect, ci.cluster) == (spec.stages, spec.transport, spec.expect, spec.cluster)
    assert ci.provider.vastai == spec.provider.vastai
