"""Requests in flight: a chain serves several requests at once, each in a request slot (a KV cache of its own) of
every stage, and each answer equals the unsplit model's answer to that request alone, whatever the interleaving.

The property runs the real Stage objects over the memory transport in one process (``run_interleaved``): requests
arrive at random points of the run, with random prompts and lengths, and a seeded scheduler picks which stage gets
its next message, so the requests' messages interleave differently in every example. Beyond the slots, stage 0 keeps
requests in a bounded queue, and refuses the rest as busy: never dropped in silence.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from interleaved import Arrival, run_interleaved

from ppharness.model.decode.oracle import oracle_decode
from ppharness.run.inprocess import load_slices
from ppharness.wire.messages import Error, InferenceResponse

MAX_CONTEXT = 64
LONGEST = 32  # the longest answer asked for
SPLITS = [[(0, 8)], [(0, 4), (4, 8)], [(0, 2), (2, 5), (5, 8)], [(0, 1), (1, 3), (3, 6), (6, 8)]]
PROMPTS = ["The quick brown fox", "héllo wörld", "a", "Pipeline parallel inference over the wide area network"]
_slices: dict = {}
_oracle: dict[str, tuple[list[int], str]] = {}
_whole: list = []


def expected(gguf, path: str, prompt: str, max_tokens: int) -> list[int]:
    """The unsplit model's answer to ``prompt`` alone: the first ``max_tokens`` of its longest answer (greedy decoding
    of a shorter answer is its prefix), ending early at EOS."""
    if prompt not in _oracle:
        if not _whole:
            _whole.extend(load_slices(gguf, [(0, 8)], MAX_CONTEXT, cache={}))
        got = oracle_decode(path, prompt, LONGEST, MAX_CONTEXT, model=_whole[0])
        _oracle[prompt] = (got.token_ids, got.finish_reason)
    ids, _ = _oracle[prompt]
    return ids[:max_tokens]


arrivals = st.lists(
    st.builds(Arrival, prompt=st.sampled_from(PROMPTS), max_tokens=st.integers(1, LONGEST), after=st.integers(0, 80)),
    min_size=1,
    max_size=6,
)


# what each example draws: a split, the slots per stage, stage 0's queue, the requests, the delivery order's seed
DRAWS = {
    "split": st.sampled_from(SPLITS),
    "slots": st.sampled_from([1, 3]),
    "queue": st.sampled_from([0, 1, 8]),
    "load": arrivals,
    "seed": st.integers(0, 2**16),
}


def serves_each_request_as_alone(tiny_model_path, tiny_gguf, split, slots, queue, load, seed) -> None:
    slices = load_slices(tiny_gguf, split, MAX_CONTEXT, cache=_slices, slots=slots)
    answers = run_interleaved(tiny_gguf, slices, load, seed=seed, queue=queue)
    refused = [a for a in answers if isinstance(a, Error)]
    for k, (arrival, answer) in enumerate(zip(load, answers)):
        if isinstance(answer, Error):
            assert answer.busy and "stage 0 is full" in answer.reason, f"request {k} failed: {answer.reason}"
            continue
        assert isinstance(answer, InferenceResponse)
        want = expected(tiny_gguf, tiny_model_path, arrival.prompt, arrival.max_tokens)
        assert answer.token_ids == want, (
            f"request {k} ({arrival}) answered differently from the unsplit model alone, split {split}, {slots} "
            f"slot(s), seed {seed}"
        )
    if slots + queue >= len(load):
        assert not refused, "a request was refused although the slots and the queue had room for all"


@settings(max_examples=min(1, settings.default.max_examples))
@given(**DRAWS)
@example(split=SPLITS[2], slots=3, queue=8, load=[Arrival(p, LONGEST, 0) for p in PROMPTS], seed=1)
@example(split=SPLITS[3], slots=1, queue=8, load=[Arrival(p, 5, 3 * k) for k, p in enumerate(PROMPTS)], seed=2)
def test_each_request_is_answered_as_if_alone_whatever_the_interleaving(
    tiny_model_path, tiny_gguf, split, slots, queue, load, seed
):
    serves_each_request_as_alone(tiny_model_path, tiny_gguf, split, slots, queue, load, seed)


@pytest.mark.slow
@settings(max_examples=max(60, settings.default.max_examples))
@given(**DRAWS)
def test_each_request_is_answered_as_if_alone_whatever_the_interleaving_thoroughly(
    tiny_model_path, tiny_gguf, split, slots, queue, load, seed
):
    serves_each_request_as_alone(tiny_model_path, tiny_gguf, split, slots, queue, load, seed)


def test_requests_are_in_flight_at_once_on_every_stage(tiny_model_path, tiny_gguf):
    """Three requests sent together are all admitted at once: every stage holds three in flight at some point."""
    split = SPLITS[2]
    most = [0] * len(split)

    def observe(stages) -> None:
        for s in stages:
            most[s.state.index] = max(most[s.state.index], len(s.state.reqs))

    load = [Arrival(p, 12, 0) for p in PROMPTS[:3]]
    slices = load_slices(tiny_gguf, split, MAX_CONTEXT, cache=_slices, slots=3)
    answers = run_interleaved(tiny_gguf, slices, load, seed=7, observe=observe)
    assert most == [3, 3, 3], f"the most requests in flight per stage were {most}, not 3 on each"
    for arrival, answer in zip(load, answers):
        assert isinstance(answer, InferenceResponse)
        assert answer.token_ids == expected(tiny_gguf, tiny_model_path, arrival.prompt, 12)


def test_beyond_the_slots_requests_wait_in_order_and_beyond_the_queue_they_are_refused(tiny_gguf):
    """One slot, a queue of two: of four requests sent together, the first is served, the next two wait and are
    served in the order they came, the fourth is refused as busy with what to do."""
    split = SPLITS[1]
    started: list[str] = []

    def observe(stages) -> None:
        for rid in stages[0].state.reqs:
            if rid not in started:
                started.append(rid)

    load = [Arrival("a", 4, 0) for _ in range(4)]
    slices = load_slices(tiny_gguf, split, MAX_CONTEXT, cache=_slices)
    answers = run_interleaved(tiny_gguf, slices, load, seed=3, queue=2, observe=observe)
    assert [type(a).__name__ for a in answers] == ["InferenceResponse"] * 3 + ["Error"]
    refusal = answers[3]
    assert isinstance(refusal, Error) and refusal.busy
    assert "1 request(s) in flight (its 1 slot(s)) and 2 waiting (its queue of 2)" in refusal.reason
    assert "send it again later" in refusal.reason
    assert started == ["r0", "r1", "r2"], "the waiting requests did not start in the order they came"
