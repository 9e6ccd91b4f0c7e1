"""Property: for any N, any split points and any prompt, the chain's tokens equal the unsplit model's.

Runs the real Stage objects and wire format in one process over the memory transport (ppharness.inprocess), so many
splits fit in CI. Model slices are cached per (range, role) and reused across examples, which also checks that a
stage serves consecutive requests independently.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppharness.inprocess import load_slices, run_inprocess
from ppharness.oracle import oracle_decode

BLOCKS = 8  # the tiny preset
_slices: dict = {}
_oracle_model: list = []


def _oracle(path: str, gguf, prompt: str, max_tokens: int):
    if not _oracle_model:
        _oracle_model.extend(load_slices(gguf, [(0, gguf.config.blocks)], cache={}))
    return oracle_decode(path, prompt, max_tokens, model=_oracle_model[0])


@st.composite
def splits(draw):
    n = draw(st.integers(1, BLOCKS))
    cuts = sorted(draw(st.sets(st.integers(1, BLOCKS - 1), min_size=n - 1, max_size=n - 1)))
    return [0, *cuts, BLOCKS]


prompts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=0, max_size=24)


@given(cuts=splits(), prompt=prompts, max_tokens=st.integers(1, 6), wire=st.sampled_from(["f16", "f32"]))
def test_any_split_equals_unsplit_model(tiny_model_path, tiny_gguf, cuts, prompt, max_tokens, wire):
    assert tiny_gguf.config.blocks == BLOCKS
    ranges = list(zip(cuts, cuts[1:]))
    chain = run_inprocess(tiny_gguf, load_slices(tiny_gguf, ranges, cache=_slices), prompt, max_tokens, wire)
    expected = _oracle(tiny_model_path, tiny_gguf, prompt, max_tokens)
    assert chain.token_ids == expected.token_ids, f"split {ranges} changed the answer"
    assert chain.text == expected.text
    assert chain.finish_reason == expected.finish_reason


def test_bf16_wire_runs_and_stays_close(tiny_model_path, tiny_gguf):
    """bf16 is lossy: it must still produce a full answer; it is not required to equal the oracle."""
    ranges = [(0, 4), (4, 8)]
    chain = run_inprocess(tiny_gguf, load_slices(tiny_gguf, ranges, cache=_slices), "hello", 6, "bf16")
    assert len(chain.token_ids) == 6 or chain.finish_reason == "eos"


@pytest.mark.parametrize("prompt", ["", "héllo wörld ✓ 日本語", "<|end_of_text|> after a special token"])
def test_edge_prompts_match(tiny_model_path, tiny_gguf, prompt):
    ranges = [(0, 3), (3, 5), (5, 8)]
    chain = run_inprocess(tiny_gguf, load_slices(tiny_gguf, ranges, cache=_slices), prompt, 4)
    assert chain.token_ids == _oracle(tiny_model_path, tiny_gguf, prompt, 4).token_ids
