"""Scenario YAML v1: the shipped files load, and every kind of mistake names the file, the field path and the fix."""

from __future__ import annotations

import copy
import json
import re
import struct
from pathlib import Path

import msgspec
import pytest

from ppharness import registry
from ppharness.errors import ScenarioError
from ppharness.scenario.facts import check_against_model
from ppharness.scenario.schema import Scenario, load_scenario, scenario_from_args, scenario_schema
from ppharness.scenario.sections import Stages

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
    s = scenario_from_args(num_stages=3, transport="iroh", provider="local", prompt="hi", max_tokens=4)
    assert (s.stages.count, s.transport.kind, s.provider.kind, s.request.prompt, s.request.max_tokens) == (
        3,
        "iroh",
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
    with pytest.raises(
        ScenarioError,
        match=r"^<arguments>: \$\.transport\.kind: the memory transport works within "
        r"one process only, and provider 'docker'.* use kind: zmq",
    ):
        scenario_from_args(transport="memory", provider="docker")
    with pytest.raises(ScenarioError, match=r"\$\.stages\.count"):
        scenario_from_args(num_stages=0)


def test_stage_ranges() -> None:
    assert Stages(count=3).ranges(8) == [(0, 3), (3, 6), (6, 8)]  # the remainder goes to the first stages
    assert Stages(count=5).ranges(8) == [(0, 2), (2, 4), (4, 6), (6, 7), (7, 8)]
    assert Stages(count=3, split_rule="floor").ranges(8) == [(0, 2), (2, 4), (4, 8)]  # the SPEC's k = blocks // N
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
    from ppharness.run.seed.realise import transport_settings

    section = msgspec.structs.replace(
        load_scenario(SCENARIOS / "smoke-5stage-local-iroh.yaml").transport, relay="default"
    )
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
    with pytest.raises(
        ScenarioError,
        match=rf"\$\.provider\.{kind}: {kind} settings apply only to kind {kind}, "
        rf"not '{other}'",
    ):
        load_scenario(path)


# --- quantised synthetic models and the acceptance request on vast.ai -------------------------------------------------

SPEC_TEMPLATE = SCENARIOS / "templates" / "acceptance-5stage-vastai-llama3.2-1b.yaml"
# the model layer of ollama's llama3.2:1b: its sha256, and its name in the registry
LLAMA_3_2_1B_Q8_0 = "74701a8c35f6c8d9a4b91f3f3497643001d63e0c7a84e085bed452548fa88d45"


def test_synthetic_weight_type(tmp_path: Path) -> None:
    s = load_scenario(_write(tmp_path, "version: 1\nmodel: {synthetic: {preset: tiny, seed: 0, type: q8_0}}\n"))
    assert s.model.synthetic.type == "q8_0"
    assert load_scenario(_write(tmp_path, "version: 1\n", "plain.yaml")).model.synthetic.type == "f16"
    message = _error(_write(tmp_path, "version: 1\nmodel: {synthetic: {preset: tiny, type: q3_k}}\n", "bad.yaml"))
    assert "$.model.synthetic.type" in message and "unknown weight type 'q3_k'" in message
    assert "f16, q8_0, q4_0" in message
    message = _error(
        _write(tmp_path, "version: 1\nmodel: {synthetic: {preset: tiny, dim: 48, type: q4_0}}\n", "dim.yaml")
    )
    assert "$.model.synthetic" in message and "blocks of 32" in message


def test_scenario_weight_type_reaches_the_model(tmp_path: Path) -> None:
    from ppharness.model.synthetic.spec import parse_synthetic
    from ppharness.run.seed.realise import model_source

    s = load_scenario(_write(tmp_path, "version: 1\nmodel: {synthetic: {preset: tiny, type: q8_0}}\n"))
    source, sha = model_source(s)
    assert parse_synthetic(source).type == "q8_0" and sha is None


def test_spec_template_is_the_specs_request() -> None:
    from click.testing import CliRunner

    from ppharness.cli import main
    from ppharness.cli.smoke import VASTAI_ACCEPTANCE

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


# --- hostile and careless files: every one refused before anything starts, with the path and the fix ----------------

MINIMAL = "version: 1\n"
LAUGHS = "version: 1\nname: lol\nlol0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"lol{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 10)
)  # 10**10 values expanded


def _docker(subnet: str) -> str:
    return f"version: 1\nprovider:\n  kind: docker\n  docker: {{subnet: '{subnet}'}}\n"


HOSTILE = [
    pytest.param(
        LAUGHS, "$.lol3[7]: the document grows past 10,000 values at line 6 (aliases expanded)", id="alias-bomb"
    ),
    pytest.param(
        MINIMAL + "name: " + "[" * 100 + "]" * 100 + "\n",
        "$.name" + "[0]" * 31 + ": nested more than 32 levels deep at line 2",
        id="deep-flow-nesting",
    ),
    pytest.param(MINIMAL + "name: " + "[" * 300_000 + "\n", "$.name[0]: not valid YAML at line 2", id="deeper-flow"),
    pytest.param(
        MINIMAL + "".join(f"{'  ' * i}k{i}:\n" for i in range(40)),
        ": nested more than 32 levels deep at line 34",
        id="deep-block-nesting",
    ),
    pytest.param(
        MINIMAL + "s0: &s0 [x]\n" + "".join(f"s{i}: &s{i} [*s{i - 1}]\n" for i in range(1, 40)),
        "$.s31[0]: alias *s30 at line 33 nests the document more than 32 levels deep",
        id="deep-through-aliases",
    ),
    pytest.param(
        MINIMAL + "request: {prompt: '" + "a" * (1 << 20) + "'}\n",
        "$: the file is over the limit of 1,048,576 bytes (1 MiB)",
        id="file-over-1MiB",
    ),
    pytest.param(
        MINIMAL + "request: {prompt: '" + "é" * 200_000 + "'}\n",
        "$.request.prompt: a value of 400,000 bytes at line 2 is over the limit of 262,144 bytes (256 KiB) per value",
        id="huge-scalar",
    ),
    pytest.param(
        MINIMAL + "request:\n  prompt: '" + "x" * 1_000_000 + "'\n",
        "$.request.prompt: a value of 1,000,000 bytes",
        id="1MB-prompt",
    ),
    pytest.param(
        MINIMAL + "request:\n  prompt: '" + "The quick brown fox. " * 4000 + "'\n  max_tokens: 16\n",
        "$.request.prompt: the prompt is 84,000 bytes, so at least 4,423 tokens of synthetic preset 'tiny', "
        "counting the BOS token (its longest token is 19 bytes); with max_tokens 16 that is more than "
        "max_context 256",
        id="84KB-prompt",
    ),
    pytest.param(MINIMAL + "name: '" + "9" * 300_000 + "'\n", "$.name: a value of 300,000 bytes", id="huge-name"),
    pytest.param(
        MINIMAL + "stages: {count: " + "9" * 5000 + "}\n",
        "$.stages.count: a number of 5,000 characters",
        id="huge-number",
    ),
    pytest.param(
        "version: 1\nrequest:\n  max_tokens: 8\n  prompt: hi\n  max_tokens: 200\n",
        "$.request: key 'max_tokens' appears twice, at lines 3 and 5 — keep one",
        id="duplicate-keys",
    ),
    pytest.param(
        "version: 1\nstages: {count: 2}\nstages: {count: 3}\n",
        "$: key 'stages' appears twice, at lines 2 and 3",
        id="duplicate-sections",
    ),
    pytest.param(
        MINIMAL + "budget: {total_s: .inf}\n",
        "$.budget.total_s: expected float <= 86400.0, got inf — seconds, more than 0 and at most 86400 (a day)",
        id="budget-inf",
    ),
    pytest.param(
        MINIMAL + "budget: {join_s: .nan}\n", "$.budget.join_s: expected float > 0.0, got nan", id="budget-nan"
    ),
    pytest.param(
        MINIMAL + "budget: {ready_s: -5}\n", "$.budget.ready_s: expected float > 0.0, got -5", id="budget-negative"
    ),
    pytest.param(
        MINIMAL + "cluster: {heartbeat_s: 1.0e+308}\n",
        "$.cluster.heartbeat_s: expected float <= 86400.0",
        id="heartbeat-huge",
    ),
    pytest.param(
        _docker("999.999.999.999/99"),
        "$.provider.docker.subnet: '999.999.999.999/99' is not an IP "
        "network — write an IPv4 network as address/prefix, e.g. 10.213.5.0/24",
        id="subnet-999",
    ),
    pytest.param(
        _docker("10.213.5.0/30"),
        "$.provider.docker.subnet: '10.213.5.0/30' is a /30, too small for a run — use /28 or larger",
        id="subnet-too-small",
    ),
    pytest.param(
        _docker("10.213.5.7/24"),
        "$.provider.docker.subnet: '10.213.5.7/24' has host bits set — use the network's address: 10.213.5.0/24",
        id="subnet-host-bits",
    ),
    pytest.param(
        _docker("fd00::/64"),
        "$.provider.docker.subnet: 'fd00::/64' is an IPv6 network — the run network is IPv4",
        id="subnet-ipv6",
    ),
    pytest.param(
        MINIMAL + "provider:\n  kind: vastai\n  vastai: {ports: ['7000', '99999/udp']}\n",
        "$.provider.vastai.ports[1]: port 99999 is outside 1..65535",
        id="port-99999",
    ),
    pytest.param(
        MINIMAL + "provider:\n  kind: vastai\n  vastai: {ports: ['0']}\n",
        "$.provider.vastai.ports[0]: port 0 is outside 1..65535",
        id="port-0",
    ),
    pytest.param(
        MINIMAL + "model: {synthetic: {preset: tiny}, max_context: 8192}\nrequest: {max_tokens: 4096}\n",
        "$.model.max_context: 8192 is above the 2048-token context of synthetic preset 'tiny' — set "
        "max_context to at most 2048",
        id="max_context-above-model",
    ),
    pytest.param(
        MINIMAL + "transport: {kind: memory}\nprovider: {kind: local}\n",
        "$.transport.kind: the memory "
        "transport works within one process only, and provider 'local' runs every stage in a process of its "
        "own — use kind: zmq (or iroh)",
        id="memory-transport-local",
    ),
    pytest.param(
        MINIMAL + "transport: {kind: memory}\nprovider: {kind: docker}\n",
        "$.transport.kind: the memory transport works within one process only, and provider 'docker'",
        id="memory-transport-docker",
    ),
    pytest.param(
        MINIMAL + "request: {max_tokens: 256}\n",
        "$.request.max_tokens: 256 tokens do not fit max_context 256",
        id="max_tokens-over-context",
    ),
    pytest.param(
        MINIMAL
        + "model: {synthetic: {preset: tiny}, max_context: 2048}\nrequest: {prompt: '"
        + "<|start_header_id|>" * 100
        + "', max_tokens: 1948}\n",
        "$.request.prompt: the prompt is 1,900 bytes, so at least 101 tokens",
        id="special-tokens-prompt",
    ),
    pytest.param(
        "version: 1\nname: &n [*n]\n",
        "$.name[0]: alias *n at line 2 refers to a node that contains it",
        id="recursive-alias",
    ),
    pytest.param(
        "version: 1\nname: *nowhere\n",
        "$.name: alias *nowhere at line 2 names no anchor defined before it",
        id="undefined-alias",
    ),
    pytest.param("version: 1\n---\nversion: 1\n", "$: a second YAML document starts at line 2", id="two-documents"),
    pytest.param(
        "version: 1\nname: !!python/object:os.system x\n",
        "$.name: tag '!!python/object:os.system' at line 2 is not one the safe loader reads — remove it",
        id="python-tag",
    ),
    pytest.param('version: 1\nname: "\\q"\n', "$.name: not valid YAML at line 2, column 8", id="bad-escape"),
    pytest.param(
        "version: 1\nname: !!binary " + "QUFB" * 100 + "\n",
        "$.name: expected str, got binary data (!!binary)",
        id="binary-name",
    ),
    pytest.param(
        MINIMAL + "model: {synthetic: {preset: '" + "p" * 100_000 + "'}}\n",
        f"$.model.synthetic.preset: unknown preset {'p' * 60!r}… (100,000 characters)",
        id="long-unknown-preset",
    ),
    pytest.param(
        MINIMAL + "transport: {wire_dtype: '" + "f" * 100_000 + "'}\n",
        "$.transport.wire_dtype: 'ffff",
        id="long-enum-value",
    ),
    pytest.param(
        MINIMAL + "stages: {splits: [" + ", ".join(str(i) for i in range(1, 20_000)) + "]}\n",
        "$.stages.splits[9993]: the document grows past 10,000 values",
        id="long-list",
    ),
]


@pytest.mark.parametrize(("text", "expected"), HOSTILE)
def test_hostile_file_is_refused_with_path_and_fix(tmp_path: Path, text: str, expected: str) -> None:
    path = _write(tmp_path, text)
    message = _error(path)
    assert expected in message, message
    assert " $" in message or ": $" in message, message  # the field path
    assert len(message) < 1000, message  # values are shown cut, never whole


def _leaves(node: object, path: str = "$"):
    """(path, value) of every scalar in a decoded YAML document, lists and mappings walked."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaves(value, f"{path}[{i}]")
    else:
        yield path, node


def _mappings(node: object, path: str = "$"):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _mappings(value, f"{path}.{key}")


def _nullable(path: str) -> bool:
    """Whether the scenario field at ``path`` accepts null (its type is optional)."""
    from msgspec import inspect as mi

    from ppharness.document.explain import _type_at

    *parent, last = path.rsplit(".", 1)
    if "[" in last:
        return False
    for t in _type_at(Scenario, parent[0]):
        for f in getattr(t, "fields", ()):
            if f.encode_name == last:
                inner = f.type.type if isinstance(f.type, mi.Metadata) else f.type
                types = inner.types if isinstance(inner, mi.UnionType) else (inner,)
                return any(isinstance(u, mi.NoneType) for u in types)
    return False


def _set_at(doc: dict, path: str, value: object) -> None:
    parts = re.findall(r"\.([^.\[]+)|\[(\d+)\]", path[1:])
    node = doc
    for key, index in parts[:-1]:
        node = node[key] if key else node[int(index)]
    key, index = parts[-1]
    node[key if key else int(index)] = value


def _mutations(count: int = 30, seed: int = 12):
    """``count`` single mutations of the shipped scenarios, each of which no valid scenario has: a value of the wrong
    type, an unknown key, a null where a value is needed, the required version removed."""
    import random

    import yaml

    rng = random.Random(seed)
    files = sorted(SCENARIOS.glob("*.yaml")) + sorted((SCENARIOS / "templates").glob("*.yaml"))
    docs = {f: yaml.safe_load(f.read_text(encoding="utf-8")) for f in files}
    cases = []
    while len(cases) < count:
        f = rng.choice(files)
        doc = copy.deepcopy(docs[f])
        kind = rng.choice(["wrong-type", "wrong-type", "unknown-key", "null", "no-version"])
        if kind == "no-version":
            del doc["version"]
            expected = "$: missing required field 'version' — add `version: 1`"
        elif kind == "unknown-key":
            path, mapping = rng.choice(list(_mappings(doc)))
            mapping["colour"] = "blue"
            expected = f"unknown field 'colour' at {path} — expected one of:"
        else:
            leaves = [(p, v) for p, v in _leaves(doc) if kind != "null" or not _nullable(p)]
            path, value = rng.choice(leaves)
            if kind == "null":
                _set_at(doc, path, None)
            else:
                _set_at(doc, path, [1, 2] if isinstance(value, str) else "many")
            expected = f"{path}: expected"
        text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
        cases.append(pytest.param(text, expected, id=f"{len(cases):02d}-{f.stem}-{kind}"))
    return cases


MUTATED = _mutations()


@pytest.mark.parametrize(("text", "expected"), MUTATED)
def test_mutated_shipped_scenario_is_refused_with_its_path(tmp_path: Path, text: str, expected: str) -> None:
    message = _error(_write(tmp_path, text))
    assert expected in message, message


def test_limits_leave_ordinary_use_alone(tmp_path: Path) -> None:
    text = 'version: 1\nname: &n "aliased"\nmodel: {gguf: "https://example.org/m.gguf"}\nrequest:\n  prompt: *n\n'
    s = load_scenario(_write(tmp_path, text))
    assert s.name == s.request.prompt == "aliased"
    long_prompt = "y" * (256 << 10)  # exactly the limit: read; the model (a URL) is not known, so nothing more is said
    s = load_scenario(
        _write(
            tmp_path,
            f"version: 1\nmodel: {{gguf: 'https://example.org/m.gguf'}}\nrequest: {{prompt: '{long_prompt}'}}\n",
            "long.yaml",
        )
    )
    assert len(s.request.prompt) == 256 << 10
    nested = (
        "version: 1\nfaults: [{stage: 0, mode: eos-first}]\n"
        "provider: {kind: vastai, vastai: {ports: ['65535/udp', '1']}}\n"
    )
    assert load_scenario(_write(tmp_path, nested, "n.yaml")).provider.vastai.ports == ("65535/udp", "1")
    s = load_scenario(_write(tmp_path, _docker("10.213.5.0/28"), "d.yaml"))
    assert s.provider.docker.subnet == "10.213.5.0/28"


def test_prompt_bound_refuses_only_what_cannot_fit() -> None:
    """A prompt of b bytes is at least ceil(b / longest token) tokens; it is refused only when even that many leave no
    room for max_tokens."""
    from ppharness.scenario.facts import ModelFacts

    facts = ModelFacts(blocks=8, context=2048, bos=True, longest_token=4, name="m")
    s = scenario_from_args(max_tokens=16)  # max_context 256: the prompt may be 256 - 16 - 1 = 239 tokens at the fewest
    fits = scenario_from_args(base=s, prompt="z" * (239 * 4))
    check_against_model(fits, facts)
    with pytest.raises(
        ScenarioError,
        match=r"^<file>: \$\.request\.prompt: the prompt is 957 bytes, so at least 241 "
        r"tokens of m, counting the BOS token \(its longest token is 4 bytes\)",
    ):
        check_against_model(scenario_from_args(base=s, prompt="z" * (239 * 4 + 1)), facts)
    long = msgspec.structs.replace(s, request=msgspec.structs.replace(s.request, prompt="z" * 10_000))
    check_against_model(long, ModelFacts(blocks=8))  # nothing known of the vocabulary: nothing said


def _fake_gguf(
    path: Path, *, context: int = 1024, blocks: int = 4, tokens: tuple[str, ...] = ("a", "bcd"), truncate: int = 0
) -> Path:
    """A GGUF v3 header with no tensors: the architecture, block count, context length, a token list, and the rest of
    what the engine reads of a model (its header judged loadable)."""

    def string(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    kvs = [
        string("general.architecture") + struct.pack("<I", 8) + string("llama"),
        string("llama.block_count") + struct.pack("<I", 4) + struct.pack("<I", blocks),
        string("llama.context_length") + struct.pack("<I", 4) + struct.pack("<I", context),
        string("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, len(tokens)) + b"".join(map(string, tokens)),
        string("tokenizer.ggml.bos_token_id") + struct.pack("<I", 4) + struct.pack("<I", 0),
        string("tokenizer.ggml.eos_token_id") + struct.pack("<I", 4) + struct.pack("<I", len(tokens) - 1),
        string("tokenizer.ggml.model") + struct.pack("<I", 8) + string("gpt2"),
        string("tokenizer.ggml.merges") + struct.pack("<IIQ", 9, 8, 1) + string("b cd"),
        string("llama.embedding_length") + struct.pack("<I", 4) + struct.pack("<I", 8),
        string("llama.feed_forward_length") + struct.pack("<I", 4) + struct.pack("<I", 16),
        string("llama.attention.head_count") + struct.pack("<I", 4) + struct.pack("<I", 2),
        string("llama.attention.layer_norm_rms_epsilon") + struct.pack("<I", 6) + struct.pack("<f", 1e-5),
    ]
    data = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + b"".join(kvs)
    path.write_bytes(data[: len(data) - truncate])
    return path


def test_local_gguf_header_bounds_the_scenario(tmp_path: Path) -> None:
    model = _fake_gguf(tmp_path / "m.gguf")

    def scenario(body: str, name: str) -> Path:
        return _write(tmp_path, f"version: 1\nmodel:\n  gguf: {model}\n{body}", name)

    assert load_scenario(scenario("  max_context: 1024\nstages: {count: 4}\n", "ok.yaml")).stages.count == 4
    assert (
        "$.model.max_context: 2048 is above the 1024-token context of model file m.gguf — set max_context to at "
        "most 1024" in _error(scenario("  max_context: 2048\n", "ctx.yaml"))
    )
    assert "$.stages.count: 5 stages but the model has 4 blocks" in _error(scenario("stages: {count: 5}\n", "n.yaml"))
    message = _error(scenario(f"request: {{prompt: '{'q' * 3000}', max_tokens: 16}}\n", "p.yaml"))
    assert "$.request.prompt: the prompt is 3,000 bytes, so at least 1,001 tokens of model file m.gguf" in message
    _fake_gguf(model, truncate=3)
    assert "$.model.gguf:" in (message := _error(scenario("", "t.yaml"))) and "runs past the end" in message
    model.write_bytes(b"not a model at all")
    assert "$.model.gguf:" in (message := _error(scenario("", "g.yaml"))) and "not a GGUF file" in message


def test_scenario_check_reports_every_bad_file(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ppharness.cli import main

    good = SCENARIOS / "smoke-2stage-local.yaml"
    bad1 = _write(tmp_path, LAUGHS, "bomb.yaml")
    bad2 = _write(tmp_path, MINIMAL + "budget: {total_s: .inf}\n", "inf.yaml")
    result = CliRunner().invoke(main, ["scenario", "check", str(bad1), str(good), str(bad2)])
    assert result.exit_code == 1
    assert f"FAILED: {bad1}: $.lol3[7]: the document grows past 10,000 values" in result.output
    assert f"ok: {good}" in result.output
    assert f"FAILED: {bad2}: $.budget.total_s:" in result.output
    assert "FAILED: 2 of 3 scenario files" in result.output


def test_serving_slots_and_queue_are_checked(tmp_path: Path) -> None:
    message = _error(_write(tmp_path, "version: 1\nserving: {slots: 0}\n"))
    assert "$.serving.slots" in message and ">= 1" in message
    s = load_scenario(_write(tmp_path, "version: 1\nserving: {slots: 4, queue: 0}\n", "ok.yaml"))
    assert (s.serving.slots, s.serving.queue) == (4, 0)
