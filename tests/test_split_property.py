"""Property: for any N, any split points and any prompt, the chain equals the unsplit model bit for bit.

Runs the real Stage objects and wire format in one process over the memory transport (ppharness.run.inprocess), so
many splits fit in CI. Outputs are long as well as short (up to the whole context), because a split that rounds a
hidden state differently shows only after tens of tokens, when a near-tie in the logits turns a last-bit difference into
another token. Tokens are compared, and so is every hidden state a stage sends: byte for byte against the unsplit
model's output of the same block at the same step, taken from the wire as the next stage received it.

Model slices are cached per (range, role) and reused across examples, which also checks that a stage serves
consecutive requests independently.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ppharness.model.decode.exactness import compare
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.engine.hidden import digest
from ppharness.run.inprocess import judge, load_slices, run_inprocess
from ppharness.wire import codec
from ppharness.wire.messages import StageActivation

BLOCKS = 8  # the tiny preset
MAX_CONTEXT = 256
_slices: dict = {}
_oracle_model: list = []
_seen: list[tuple[int, int, int]] = []  # per example: stages, tokens, boundary hidden states compared


@pytest.fixture(scope="module", autouse=True)
def _report_what_the_property_saw(request):
    """One line in the test log: how many examples ran, the longest output, the boundaries compared."""
    yield
    if _seen:
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            stages = [n for n, _, _ in _seen]
            tokens = [t for _, t, _ in _seen]
            print(
                f"\nsplit property: {len(_seen)} examples, N = {min(stages)}..{max(stages)}, longest output "
                f"{max(tokens)} tokens, {sum(t >= 200 for t in tokens)} "
                f"examples of 200+ tokens, {sum(b for _, _, b in _seen)} stage-boundary hidden states compared "
                "byte for byte"
            )


def _oracle(path: str, gguf, prompt: str, max_tokens: int):
    """The unsplit model's answer, with the digest of every block's output at every step."""
    if not _oracle_model:
        _oracle_model.extend(load_slices(gguf, [(0, gguf.config.blocks)], MAX_CONTEXT, cache={}, taps=True))
    return oracle_decode(path, prompt, max_tokens, MAX_CONTEXT, model=_oracle_model[0], boundaries=True)


def _room(gguf, prompt: str) -> int:
    """The most tokens a request may ask for after ``prompt``: the rest of the context."""
    cfg = gguf.config
    return MAX_CONTEXT - len(([cfg.bos_id] if cfg.bos_id is not None else []) + gguf.tokenizer.encode(prompt))


@st.composite
def splits(draw):
    n = draw(st.integers(1, BLOCKS))
    cuts = sorted(draw(st.sets(st.integers(1, BLOCKS - 1), min_size=n - 1, max_size=n - 1)))
    return [0, *cuts, BLOCKS]


prompts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=0, max_size=24)
# short answers, or as long as the context allows
lengths = st.one_of(st.integers(1, 8), st.just("context"))


# the default run's random examples, on top of the three explicit ones (the profile's budget when smaller); the slow
# checks run the same property with THOROUGH of them, or the profile's budget when larger ("thorough": 200)
DEFAULT_EXAMPLES, THOROUGH = 2, 40


@settings(max_examples=min(DEFAULT_EXAMPLES, settings.default.max_examples))
@given(cuts=splits(), prompt=prompts, length=lengths, wire=st.sampled_from(["f16", "f32"]))
@example(cuts=[0, 4, 8], prompt="The quick brown fox", length="context", wire="f16")
@example(cuts=[0, 3, 6, 8], prompt="The quick brown fox", length="context", wire="f32")
@example(cuts=list(range(BLOCKS + 1)), prompt="héllo wörld", length="context", wire="f16")
def test_any_split_equals_unsplit_model(tiny_model_path, tiny_gguf, cuts, prompt, length, wire):
    split_equals_unsplit(tiny_model_path, tiny_gguf, cuts, prompt, length, wire)


@pytest.mark.slow
@settings(max_examples=max(THOROUGH, settings.default.max_examples))
@given(cuts=splits(), prompt=prompts, length=lengths, wire=st.sampled_from(["f16", "f32"]))
def test_any_split_equals_unsplit_model_thoroughly(tiny_model_path, tiny_gguf, cuts, prompt, length, wire):
    split_equals_unsplit(tiny_model_path, tiny_gguf, cuts, prompt, length, wire)


def split_equals_unsplit(tiny_model_path, tiny_gguf, cuts, prompt, length, wire) -> None:
    """The property: the chain over ``cuts`` answers ``prompt`` as the unsplit model does, tokens and every hidden
    state on the wire byte for byte."""
    assert tiny_gguf.config.blocks == BLOCKS
    ranges = list(zip(cuts, cuts[1:]))
    max_tokens = _room(tiny_gguf, prompt) if length == "context" else length
    received: list[tuple[int, StageActivation]] = []

    def on_message(stage: int, msg) -> None:
        if isinstance(msg, StageActivation):
            received.append((stage, msg))

    digests: dict[int, list[bytes]] = {}
    chain = run_inprocess(
        tiny_gguf,
        load_slices(tiny_gguf, ranges, MAX_CONTEXT, cache=_slices),
        prompt,
        max_tokens,
        wire,
        digests=digests,
        on_message=on_message,
    )
    expected = _oracle(tiny_model_path, tiny_gguf, prompt, max_tokens)
    verdict = judge(chain, expected, ranges, digests)
    assert verdict.exact, f"split {ranges} changed the answer: {verdict.describe(chain.token_ids, expected.token_ids)}"
    assert chain.text == expected.text
    assert (chain.finish_reason, chain.stop_token) == (expected.finish_reason, expected.stop_token)
    # what the wire delivered is what the sender digested: every boundary of every step, byte for byte
    steps = len(expected.token_ids) + (expected.finish_reason == "eos")
    assert len(received) == (len(ranges) - 1) * steps
    for stage, msg in received:
        hidden = codec.unpack_hidden(msg)
        step = 0 if msg.is_prefill else msg.position - expected.prompt_tokens + 1
        block = ranges[stage][0] - 1
        assert digest(hidden) == expected.boundary_digests[block][step], (
            f"the hidden state entering stage {stage} (after block {block}) at step {step} differs from the unsplit "
            f"model's"
        )
    assert verdict.boundaries_compared == len(received)
    _seen.append((len(ranges), len(chain.token_ids), len(received)))


def test_the_boundary_check_finds_a_changed_hidden_state(tiny_model_path, tiny_gguf):
    """A boundary digest that differs is reported with its stage, block and step, even when the tokens agree."""
    ranges = [(0, 3), (3, 8)]
    digests: dict[int, list[bytes]] = {}
    chain = run_inprocess(
        tiny_gguf, load_slices(tiny_gguf, ranges, MAX_CONTEXT, cache=_slices), "fox", 5, digests=digests
    )
    expected = _oracle(tiny_model_path, tiny_gguf, "fox", 5)
    digests[0][2] = digest(np.ones((1, 1, tiny_gguf.config.dim), dtype=np.float16))
    verdict = compare(
        chain.token_ids, expected.token_ids, ranges, digests, expected.boundary_digests, expected.prompt_tokens
    )
    assert verdict.tokens_equal and not verdict.exact
    assert (verdict.boundary_diff.stage, verdict.boundary_diff.block, verdict.boundary_diff.step) == (0, 2, 2)
    assert "after block 2" in verdict.describe(chain.token_ids, expected.token_ids)


def test_bf16_wire_runs_and_stays_close(tiny_model_path, tiny_gguf):
    """bf16 is lossy: it must still produce a full answer, and what crosses the wire is the fp16 hidden state rounded
    to bf16 and nothing worse: each element within bf16's rounding (2^-8 of its size, plus fp16's smallest step for
    values fp16 holds as subnormals) of the lossless wire's. Compared at the prefill, where both chains computed the
    same thing; the answers may part later, as any lossy wire's may."""
    ranges = [(0, 4), (4, 8)]
    sent: dict[str, np.ndarray] = {}

    def keep(wire: str):
        def on_message(stage: int, msg) -> None:
            if stage == 1 and isinstance(msg, StageActivation) and msg.is_prefill:
                sent[wire] = codec.unpack_hidden(msg).astype(np.float32)

        return on_message

    slices = load_slices(tiny_gguf, ranges, MAX_CONTEXT, cache=_slices)
    chain = run_inprocess(tiny_gguf, slices, "hello", 6, "bf16", on_message=keep("bf16"))
    assert len(chain.token_ids) == 6 or chain.finish_reason == "eos"
    run_inprocess(tiny_gguf, slices, "hello", 1, "f16", on_message=keep("f16"))
    exact, rounded = sent["f16"], sent["bf16"]
    assert exact.shape == rounded.shape and np.any(rounded != exact), "the bf16 wire carried the fp16 values unrounded"
    bound = np.abs(exact) * 2.0**-8 + 2.0**-24
    worst = float(np.max(np.abs(rounded - exact) - bound))
    assert worst <= 0, f"a bf16 activation element is {worst:g} beyond bf16's rounding of the lossless one"


@pytest.mark.parametrize("prompt", ["", "héllo wörld ✓ 日本語", "<|end_of_text|> after a special token"])
def test_edge_prompts_match(tiny_model_path, tiny_gguf, prompt):
    ranges = [(0, 3), (3, 5), (5, 8)]
    chain = run_inprocess(tiny_gguf, load_slices(tiny_gguf, ranges, MAX_CONTEXT, cache=_slices), prompt, 4)
    assert chain.token_ids == _oracle(tiny_model_path, tiny_gguf, prompt, 4).token_ids
