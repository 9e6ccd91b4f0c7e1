"""Batched decode: a stage runs the next position of several requests in one model call, and every request's tokens
and stage-boundary hidden states are the bytes it gets alone, whatever ran beside it.

The property drives batched slices of a split directly: requests start at random steps in random free slots, and at
each step a random subset of the running ones advances together through every stage (so the batch's width, its rows'
slots, positions and lengths all vary). Each request is then run alone through the same slices (slot 0, a batch of
one row) and every boundary's bytes and every token are compared. The chain tests run the real Stage objects: a
batched chain answers as the batched unsplit model alone does, and its stages did run batches.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from interleaved import Arrival, run_interleaved

from ppharness.errors import ModelError
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.layers.rows import width_for, widths
from ppharness.run.inprocess import load_slices
from ppharness.wire.messages import InferenceResponse

MAX_CONTEXT = 48
SLOTS = 4
SPLITS = [[(0, 8)], [(0, 3), (3, 8)], [(0, 2), (2, 5), (5, 8)]]
_slices: dict = {}


def slices_of(gguf, split):
    return load_slices(gguf, split, MAX_CONTEXT, cache=_slices, slots=SLOTS, batched=True)


def digest(x) -> str:
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()[:16]


def run_alone(slices, prompt: list[int], steps: int) -> tuple[list[int], list[list[str]]]:
    """One request through ``slices`` by itself (slot 0): its tokens and, per position, each boundary's digest."""
    h = prompt
    bounds: list[list[str]] = [[]]
    for s in slices[:-1]:
        h = s.prefill(h, 0)
        bounds[0].append(digest(h))
    tokens = [slices[-1].prefill(h, 0)]
    for k in range(steps):
        pos = len(prompt) + k
        h, row = [tokens[-1]], []
        for s in slices[:-1]:
            h = s.decode(h, pos, 0)
            row.append(digest(h))
        bounds.append(row)
        tokens.append(slices[-1].decode(h, pos, 0))
    return tokens, bounds


def run_batched(slices, requests: list[tuple[list[int], int, int]], seed: int):
    """``requests`` (prompt, decode steps, start step) through ``slices``, batched: each starts in a random free slot
    at its start step; at every step a random non-empty subset of the running ones decodes one position together.
    Returns each request's tokens and boundary digests, and the widths of the batches run."""
    rng = random.Random(seed)
    state: dict[int, dict] = {}
    free = list(range(SLOTS))
    waiting = sorted(range(len(requests)), key=lambda k: requests[k][2])
    done: dict[int, dict] = {}
    sizes: list[int] = []
    step = 0
    while waiting or state:
        while waiting and requests[waiting[0]][2] <= step and free:
            k = waiting.pop(0)
            slot = free.pop(rng.randrange(len(free)))
            prompt, _, _ = requests[k]
            h, row = prompt, []
            for s in slices[:-1]:
                h = s.prefill(h, slot)
                row.append(digest(h))
            state[k] = {"slot": slot, "tokens": [slices[-1].prefill(h, slot)], "bounds": [row]}
        running = [k for k in state if len(state[k]["tokens"]) <= requests[k][1]]
        if running:
            chosen = rng.sample(running, rng.randint(1, len(running)))
            chosen.sort(key=lambda k: rng.random())  # any row order
            xs = [[state[k]["tokens"][-1]] for k in chosen]
            positions = [len(requests[k][0]) + len(state[k]["tokens"]) - 1 for k in chosen]
            slots = [state[k]["slot"] for k in chosen]
            rows = [[] for _ in chosen]
            for s in slices[:-1]:
                xs = s.decode_rows(xs, positions, slots)
                for r, x in zip(rows, xs):
                    r.append(digest(x))
            tokens = slices[-1].decode_rows(xs, positions, slots)
            sizes.append(len(chosen))
            for k, t, r in zip(chosen, tokens, rows):
                state[k]["tokens"].append(t)
                state[k]["bounds"].append(r)
        for k in [k for k in state if len(state[k]["tokens"]) > requests[k][1]]:
            free.append(state[k]["slot"])
            done[k] = state.pop(k)
        step += 1
    return done, sizes


requests_st = st.lists(
    st.tuples(
        st.lists(st.integers(1, 500), min_size=1, max_size=7),  # the prompt's token ids
        st.integers(1, 12),  # decode steps
        st.integers(0, 6),  # the step it starts at
    ),
    min_size=1,
    max_size=6,
)


def each_request_as_alone(tiny_gguf, split, requests, seed) -> None:
    slices = slices_of(tiny_gguf, split)
    done, sizes = run_batched(slices, requests, seed)
    for k, (prompt, steps, _) in enumerate(requests):
        tokens, bounds = run_alone(slices, prompt, steps)
        got = done[k]
        where = f"request {k} (prompt {prompt}, {steps} steps), split {split}, seed {seed}, batches {sizes}"
        for pos, (want_row, got_row) in enumerate(zip(bounds, got["bounds"], strict=True)):
            assert got_row == want_row, f"{where}: a boundary's bytes differ from its run alone at step {pos}"
        assert got["tokens"] == tokens, f"{where}: its tokens differ from its run alone"


@settings(
    max_examples=min(2, settings.default.max_examples),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(split=st.sampled_from(SPLITS), requests=requests_st, seed=st.integers(0, 2**16))
@example(split=SPLITS[2], requests=[([5, 6, 7], 10, 0), ([9], 12, 0), ([1, 2], 8, 2), ([3, 4, 5, 6], 9, 1)], seed=3)
def test_each_row_is_the_bytes_its_request_gets_alone(tiny_gguf, split, requests, seed):
    each_request_as_alone(tiny_gguf, split, requests, seed)


@pytest.mark.slow
@settings(max_examples=max(50, settings.default.max_examples), deadline=None)
@given(split=st.sampled_from(SPLITS), requests=requests_st, seed=st.integers(0, 2**16))
def test_each_row_is_the_bytes_its_request_gets_alone_thoroughly(tiny_gguf, split, requests, seed):
    each_request_as_alone(tiny_gguf, split, requests, seed)


def test_a_batched_chain_answers_as_the_batched_model_alone_and_runs_batches(tiny_model_path, tiny_gguf):
    """Four requests at once through a 3-stage batched chain of Stage objects: every answer is the unsplit batched
    model's answer alone, and the middle stages ran steps of more than one request."""
    split = SPLITS[2]
    slices = slices_of(tiny_gguf, split)
    whole = load_slices(tiny_gguf, [(0, 8)], MAX_CONTEXT, cache=_slices, slots=SLOTS, batched=True)[0]
    prompts = ["The quick brown fox", "héllo wörld", "a", "Pipeline parallel inference"]
    load = [Arrival(p, 14, 0) for p in prompts]
    widest: list[int] = [0] * len(split)

    def observe(stages) -> None:
        for s in stages:
            widest[s.state.index] = max([widest[s.state.index], *s.state.batches])

    answers = run_interleaved(tiny_gguf, slices, load, seed=5, observe=observe, drain=True)
    for arrival, answer in zip(load, answers):
        assert isinstance(answer, InferenceResponse)
        want = oracle_decode(tiny_model_path, arrival.prompt, 14, MAX_CONTEXT, model=whole)
        assert answer.token_ids == want.token_ids, f"{arrival.prompt!r} answered differently from the model alone"
    assert max(widest) > 1, f"no stage ran a step of more than one request (widest batches {widest})"


def test_batch_widths_cover_every_slot():
    assert widths(1) == [1] and widths(4) == [1, 2, 4] and widths(6) == [1, 2, 4, 6] and widths(16)[-1] == 16
    assert width_for(6, 0) == 1 and width_for(6, 4) == 6 and width_for(16, 8) == 16


def test_rows_that_share_a_slot_or_leave_the_context_are_refused(tiny_gguf):
    m = slices_of(tiny_gguf, SPLITS[0])[0]
    with pytest.raises(ModelError, match="each row needs its own slot"):
        m.decode_rows([[1], [2]], [3, 4], [1, 1])
    with pytest.raises(ModelError, match="must be inside"):
        m.decode_rows([[1]], [MAX_CONTEXT], [0])
    free = load_slices(tiny_gguf, [(0, 8)], MAX_CONTEXT, cache=_slices)[0]
    with pytest.raises(ModelError, match="needs a batched slice"):
        free.decode_rows([[1]], [3], [0])


@pytest.mark.parametrize(
    "preset",
    [pytest.param("tiny-qwen2", marks=pytest.mark.slow), pytest.param("tiny-qwen3", marks=pytest.mark.slow)]
    + ["tiny-moe", pytest.param("tiny-deepseek", marks=pytest.mark.slow)],  # each has a faster sibling by default
)
def test_every_architecture_batches_rows_exactly(preset):
    """qwen2 (q/k/v biases), qwen3 (per-head q/k norms), qwen3moe and deepseek2 (MLA attention, sigmoid routing,
    shared experts): a batch's rows compute (route, call their experts and combine) as each request alone does, split
    in two."""
    from ppharness.model.gguf_file import GGUFFile
    from ppharness.model.sources.files import synthetic_path
    from ppharness.model.synthetic.spec import PRESETS

    f = GGUFFile(synthetic_path(PRESETS[preset]))
    cut = f.config.blocks // 2
    slices = [
        ModelSlice(f, 0, cut, True, False, MAX_CONTEXT, slots=SLOTS, batched=True),
        ModelSlice(f, cut, f.config.blocks, False, True, MAX_CONTEXT, slots=SLOTS, batched=True),
    ]
    requests = [([5, 6, 7], 8, 0), ([9], 10, 0), ([1, 2], 6, 1), ([3, 4, 5, 6], 7, 2)]
    done, sizes = run_batched(slices, requests, seed=11)
    assert max(sizes) > 1, f"no step ran more than one row: {sizes}"
    for k, (prompt, steps, _) in enumerate(requests):
        tokens, bounds = run_alone(slices, prompt, steps)
        assert done[k]["bounds"] == bounds, f"{preset} request {k}: a boundary's bytes differ from its run alone"
        assert done[k]["tokens"] == tokens, f"{preset} request {k}: its tokens differ from its run alone"


@pytest.mark.parametrize("policy", [pytest.param("retry", marks=pytest.mark.slow), "failover"])  # failover holds more
def test_batched_rows_go_as_one_message_per_hop_per_step_under_every_policy(tiny_gguf, policy):
    """Four requests in flight, batched, under a policy that acknowledges every message: each decode step crosses
    each hop as one ActivationRows (and one TokenRows back), acknowledged once, and every answer is the one the same
    chain gives under policy none."""
    from ppharness.run.inprocess import InProcessChain, load_slices
    from ppharness.wire.messages import (
        Ack,
        ActivationRows,
        InferenceRequest,
        InferenceResponse,
        StageActivation,
        TokenRows,
    )

    slices = load_slices(tiny_gguf, [(0, 3), (3, 6), (6, 8)], 64, slots=4, batched=True)
    prompts = ["rows in one message", "héllo", "a b c d e f", "batched"]
    answers: dict[str, dict[str, list[int]]] = {}
    for run in ("none", policy):
        seen: dict[int, list[object]] = {0: [], 1: [], 2: []}
        with InProcessChain(tiny_gguf, slices, policy=run) as chain:
            for k, prompt in enumerate(prompts):
                chain.ask(InferenceRequest(chain.client.address, prompt, 8, request_id=f"r{k}"))
            got: dict[str, list[int]] = {}
            for _ in range(5000):
                for i in range(3):
                    chain.turn(i, lambda stage, msg, seen=seen: seen[stage].append(msg), drain=True)
                while (reply := chain.reply()) is not None:
                    if isinstance(reply, InferenceResponse):
                        got[reply.request_id] = reply.token_ids
                if len(got) == len(prompts):
                    break
            chain.turn(0, lambda stage, msg, seen=seen: seen[stage].append(msg), drain=True)  # the last Acks
        answers[run] = got
        decode_singles = [m for m in seen[1] + seen[2] if isinstance(m, StageActivation) and not m.is_prefill]
        rows = [m for m in seen[1] if isinstance(m, ActivationRows)]
        assert not decode_singles, f"policy {run}: decode steps went as one StageActivation per request"
        assert rows and max(len(m.request_ids) for m in rows) == len(prompts), f"policy {run}: no step of 4 rows"
        assert any(isinstance(m, TokenRows) for m in seen[0]), f"policy {run}: the tokens came back one by one"
        if run != "none":  # one Ack answers a step's message, from the stage it went to
            acks = [m for m in seen[0] if isinstance(m, Ack) and m.kind == "rows"]
            assert len(acks) >= len(rows), f"policy {run}: {len(rows)} ActivationRows, {len(acks)} Acks of them"
    assert answers[policy] == answers["none"], f"policy {policy} changed an answer"
