"""Will a GGUF file load here? ``ppharness.model.verdict`` answers from the header alone, and every entry point asks
before it starts anything: a file with an unknown tokenizer pre-type, an unknown architecture, a tensor type the
engine does not hold, a block tensor it does not compute with, or no file at all, is refused by ``model info``,
``scenario check``, ``plan check`` and ``pp-smoke-run`` with the reason, within two seconds, with no node started."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ppharness.cli import main
from ppharness.cli.smoke import smoke_run
from ppharness.errors import ModelError
from ppharness.model.synthetic.spec import ModelSpec
from ppharness.model.synthetic.writer import make_synthetic
from ppharness.model.verdict import judge_file, refuse_unloadable
from ppharness.plan.lang.document import pretty
from ppharness.plan.reader import load_plan
from tests.test_gguf_hardening import ARRAY, F32, STRING, gguf_bytes, parts_of

REFUSE_S = 2.0  # every refusal, from the command's start to its exit
Q5_0 = 6  # a ggml type the engine does not hold (blocks of 32: 22 bytes)

Parts = tuple[dict[str, tuple[int, Any]], list[tuple[str, tuple[int, ...], int, bytes]]]


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Parts:
    """The key-values and tensors of a small real synthetic llama (two blocks, vocabulary 300), which loads."""
    spec = ModelSpec(blocks=2, dim=16, ffn=32, heads=2, kv_heads=1, vocab=300)
    return parts_of(make_synthetic(spec, tmp_path_factory.mktemp("verdict") / "good.gguf"))


def _unknown_pre(kv: dict[str, Any], tensors: list[Any]) -> None:
    kv["tokenizer.ggml.pre"] = (STRING, "nonesuch")


def _unknown_arch(kv: dict[str, Any], tensors: list[Any]) -> None:
    for key in [k for k in kv if k.startswith("llama.")]:
        kv["mamba9." + key.removeprefix("llama.")] = kv.pop(key)
    kv["general.architecture"] = (STRING, "mamba9")


def _unheld_type(kv: dict[str, Any], tensors: list[Any]) -> None:
    for i, (name, ne, _, _) in enumerate(tensors):
        if name.endswith("ffn_down.weight"):  # (32, 16): 16 rows of one Q5_0 block each
            tensors[i] = (name, ne, Q5_0, bytes(22 * ne[1]))


def _unknown_block_tensor(kv: dict[str, Any], tensors: list[Any]) -> None:
    tensors.append(("blk.1.attn_sinks.weight", (16,), 0, bytes(64)))


# case -> (how the file is changed, words of the refusal)
CASES = {
    "pre": (_unknown_pre, "unknown tokenizer pre-tokenizer 'nonesuch' (tokenizer.ggml.pre)"),
    "arch": (_unknown_arch, "architecture 'mamba9' is not one this engine computes: expected one of llama"),
    "type": (_unheld_type, "stored as Q5_0, which this engine does not compute with (it reads F32, F16"),
    "tensor": (_unknown_block_tensor, "tensor(s) blk.1.attn_sinks.weight are not part of llama"),
}


def bad_file(parts: Parts, tmp_path: Path, case: str) -> Path:
    kv, tensors = dict(parts[0]), list(parts[1])
    CASES[case][0](kv, tensors)
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(gguf_bytes(kv, tensors))
    return path


def scenario(tmp_path: Path, model: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(f"version: 1\nmodel:\n  gguf: {model}\n  max_context: 64\nstages: {{count: 2}}\n")
    return path


def invoke(command: Any, args: list[str]) -> Any:
    """The click result of ``command args``, which must refuse (exit 1, no traceback) within ``REFUSE_S``."""
    t0 = time.monotonic()
    result = CliRunner().invoke(command, args)
    took = time.monotonic() - t0
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert took < REFUSE_S, f"{args} took {took:.1f} s to refuse"
    return result


@pytest.fixture
def no_run(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every attempt to run a scenario (to start its nodes), recorded instead of made."""
    started: list[object] = []
    monkeypatch.setattr("ppharness.cli.smoke.run_and_report", lambda scenario, **kw: started.append(scenario))
    monkeypatch.setattr("ppharness.cli.common.run_scenario", lambda scenario, **kw: started.append(scenario))
    return started


def test_a_real_synthetic_file_loads_and_its_facts_are_those_of_its_header(parts, tmp_path):
    path = tmp_path / "good.gguf"
    path.write_bytes(gguf_bytes(*parts))
    v = judge_file(path)
    assert v.loads and v.reasons == [], v.reasons
    assert (v.arch, v.tokenizer, v.tokenizer_pre, v.vocab, v.chat_template) == (
        "llama",
        "gpt2",
        "llama-bpe",
        300,
        False,
    )
    assert v.fields["blocks"] == 2 and v.fields["head_dim"] == 8 and "experts" not in v.fields
    assert v.tensor_types == {"F16": 16, "F32": 5}
    refuse_unloadable(str(path))  # nothing to refuse


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_file_that_does_not_load_is_refused_by_model_info_scenario_check_and_pp_smoke_run(
    parts, tmp_path, no_run, case
):
    path = bad_file(parts, tmp_path, case)
    words = CASES[case][1]
    v = judge_file(path)
    assert not v.loads and any(words in r for r in v.reasons), v.reasons
    with pytest.raises(ModelError, match="this engine cannot run this file"):
        refuse_unloadable(str(path))

    info = invoke(main, ["model", "info", str(path)])
    assert "loads here: no (" in info.stdout and words in info.stdout, info.output
    assert "Traceback" not in info.output
    doc = json.loads(invoke(main, ["model", "info", str(path), "--json"]).stdout)
    assert doc["format"] == "ppharness-model/2" and doc["loads"] is False and any(words in r for r in doc["reasons"])

    s = scenario(tmp_path, str(path))
    checked = invoke(main, ["scenario", "check", str(s)])
    assert f"FAILED: {s}: $.model.gguf: {path}: this engine cannot run this file" in checked.output
    assert words in checked.output and "Will my file load?" in checked.output, checked.output

    run = invoke(smoke_run, ["--scenario", str(s)])
    assert f"{s}: $.model.gguf: {path}" in run.output and words in run.output, run.output
    assert no_run == [], "a node was started"


def test_a_missing_file_is_refused_before_anything_starts(tmp_path, no_run):
    missing = tmp_path / "models" / "x.gguf"
    info = invoke(main, ["model", "info", str(missing)])
    assert f"model file {missing} does not exist" in info.output
    s = scenario(tmp_path, str(missing))
    for command, args in ((main, ["scenario", "check", str(s)]), (smoke_run, ["--scenario", str(s)])):
        out = invoke(command, args).output
        assert f"{s}: $.model.gguf: {missing}: no such file" in out and "point gguf at a GGUF file" in out, out
    s.write_text("version: 1\nmodel:\n  gguf: ~/ppharness-no-such-dir/x.gguf\n")
    out = invoke(main, ["scenario", "check", str(s)]).output
    assert f"$.model.gguf: ~/ppharness-no-such-dir/x.gguf: no such file ({Path.home()}/ppharness" in out, out
    with pytest.raises(ModelError, match="no such file"):
        refuse_unloadable(str(missing))
    assert no_run == [], "a node was started"


def test_plan_check_refuses_a_plan_whose_model_is_gone_or_does_not_load(parts, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_bytes(*parts))
    plan = tmp_path / "p.txt"
    plan.write_text(f"model: {path}\ncluster: local\na: embed, blk[0:1]\nb: blk[1:2], head\n")
    doc = tmp_path / "p.json"
    doc.write_text(pretty(load_plan(plan)))
    assert CliRunner().invoke(main, ["plan", "check", str(doc)]).exit_code == 0

    path.write_bytes(bad_file(parts, tmp_path, "pre").read_bytes())
    out = invoke(main, ["plan", "check", str(doc)]).output
    assert f"FAILED: {doc}: $.model.source: {path}: this engine cannot run this file" in out, out
    assert CASES["pre"][1] in out
    path.unlink()
    out = invoke(main, ["plan", "check", str(doc)]).output
    assert f"FAILED: {doc}: $.model.source: {path}: no such file" in out and "make the plan again" in out, out


def test_synthetic_and_url_sources_are_not_built_or_fetched_to_be_judged(tmp_path, monkeypatch):
    monkeypatch.setenv("PPHARNESS_CACHE", str(tmp_path / "cache"))
    refuse_unloadable("synthetic:tiny")  # its spec is the engine's own: always supported
    refuse_unloadable("https://example.invalid/m.gguf")  # judged once downloaded
    assert not (tmp_path / "cache").exists()


def test_a_vocabulary_of_200k_tokens_is_judged_well_under_two_seconds(parts, tmp_path):
    kv, tensors = dict(parts[0]), list(parts[1])
    n = 200_000
    kv["tokenizer.ggml.tokens"] = (ARRAY, (STRING, [f"t{i}" for i in range(n)]))
    kv["tokenizer.ggml.token_type"] = (ARRAY, (5, [1] * n))
    kv["tokenizer.ggml.merges"] = (ARRAY, (STRING, [f"t {i}" for i in range(n)]))
    kv["tokenizer.ggml.eos_token_id"] = (4, n - 1)
    kv["tokenizer.chat_template"] = (STRING, "{{ messages }}")
    kv["llama.rope.freq_base"] = (F32, 500000.0)
    path = tmp_path / "big.gguf"
    path.write_bytes(gguf_bytes(kv, tensors))
    t0 = time.monotonic()
    v = judge_file(path)
    took = time.monotonic() - t0
    assert took < 1.0, f"judging a 200k-token header took {took:.2f} s"
    assert v.vocab == n and v.chat_template and v.fields["rope_theta"] == 500000.0
