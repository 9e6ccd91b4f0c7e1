"""Running your own model from one flag: ``pp-smoke-run --model SOURCE`` (a path, a URL, ``synthetic:...``) with
``--chat`` (the file's own chat template, rendered in jinja2's sandbox) and ``--no-oracle``; the answer printed as its
tokens arrive, before the oracle runs, and the verdict after it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ppharness.errors import ModelError
from ppharness.model.text.chat import chat_prompt

ROOT = Path(__file__).resolve().parent.parent
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "hello"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _kv(template: str | None, **more: object) -> dict[str, object]:
    kv: dict[str, object] = {"tokenizer.ggml.tokens": TOKENS, "tokenizer.ggml.bos_token_id": 0}
    kv["tokenizer.ggml.eos_token_id"] = 2
    if template is not None:
        kv["tokenizer.chat_template"] = template
    return {**kv, **more}


def test_the_files_template_makes_a_user_turn_ready_for_the_answer() -> None:
    text = chat_prompt(_kv(CHATML), "What is 2+2?")
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    with_system = chat_prompt(_kv(CHATML), "Hi", system="Be brief.")
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi")


def test_a_template_that_writes_the_bos_does_not_add_a_second_one() -> None:
    template = "{{ bos_token }}" + CHATML
    assert chat_prompt(_kv(template), "x").startswith("<|im_start|>user"), "the BOS the first stage adds came twice"
    kept = chat_prompt(_kv(template, **{"tokenizer.ggml.add_bos_token": False}), "x")
    assert kept.startswith("<|endoftext|><|im_start|>"), "a file that adds no BOS keeps the template's"


@pytest.mark.parametrize(
    ("template", "words"),
    [
        (None, "has no chat template"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "does not render"),
        ("{% if true %}", "does not render"),
        ("{{ raise_exception('only user and assistant roles') }}", "refused the conversation"),
        ("x" * 70_000, "more than"),
        ("{% for i in range(99999) %}{{ 'y' * 100 }}{% endfor %}", "rendered more than"),
        ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "loops more than"),
        ("{{ 'y' * 10**9 }}", "raises to a power"),
        ("{{ ('y' * 100000) * 100000 }}", "builds a value"),
        ("{{ 100000 * ['y'] * 100000 }}", "builds a value"),
    ],
)
def test_a_template_that_cannot_be_used_is_refused_by_name(template: str | None, words: str) -> None:
    with pytest.raises(ModelError, match=words):
        chat_prompt(_kv(template), "x", source="model.gguf")


def _smoke(*args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "ppharness.cli.smoke", *args]
    return subprocess.run(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env
    )


def test_the_answer_streams_before_the_oracle_runs_and_the_verdict_follows() -> None:
    r = _smoke("--model", "synthetic:tiny", "-n", "2", "--max-tokens", "12", "--no-trace")
    out = r.stdout
    assert r.returncode == 0, out
    answer, oracle, verdict = out.find("\nanswer: "), out.find("running the unsplit model"), out.find("MATCH: ")
    assert -1 < answer < oracle < verdict, f"the answer, then the oracle, then its verdict:\n{out}"
    assert "model: synthetic:tiny" in out and "adhoc" not in out


def test_no_oracle_runs_nothing_to_compare() -> None:
    r = _smoke("--model", "synthetic:tiny", "-n", "1", "--max-tokens", "4", "--no-trace", "--no-oracle")
    assert r.returncode == 0, r.stdout
    assert "running the unsplit model" not in r.stdout and "MATCH" not in r.stdout
    assert "not compared with the unsplit model" in r.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--model", "/nonexistent/model.gguf"], "no such file"),
        (["--model", "synthetic:tiny,heads=3"], "unknown field 'heads'"),
        (["--model", "synthetic:tiny", "--chat"], "has no chat template"),
        (["--model", "synthetic:tiny", "--plan", "plan.yaml"], "--model and --plan"),
    ],
)
def test_a_model_flag_that_cannot_run_starts_nothing(args: list[str], words: str) -> None:
    r = _smoke(*args, timeout=60)
    assert r.returncode == 1, r.stdout
    assert words in r.stdout, r.stdout
    assert "starting" not in r.stdout, f"nodes were started:\n{r.stdout}"


@pytest.mark.slow
def test_smollm2_as_shipped_runs_in_three_stages_from_one_flag(smollm2: str) -> None:
    r = _smoke(
        "--model",
        smollm2,
        "-n",
        "3",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "24",
        timeout=600,
    )
    out = r.stdout
    assert r.returncode == 0, out
    assert "<|im_start|>user\\nWhat is the capital of France?<|im_end|>" in out, "the file's template was not applied"
    assert "MATCH: the 3-stage chain's" in out, out
    assert out.find("\nanswer: ") < out.find("running the unsplit model")
