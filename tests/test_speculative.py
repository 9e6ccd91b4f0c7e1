"""Speculative decoding inside the pipeline: a window of drafted tokens is verified in one trip round the chain, and
every answer is still the greedy answer of the unsplit model decoded one token at a time, token for token and hidden
state for hidden state.

The property drives batched slices of a split directly: after a prefill, windows of random drafts (some rows the true
continuation, some not) run through every stage in one call each, the last stage's greedy tokens decide what is
committed, and every committed row's boundary bytes and token are compared with one-at-a-time decoding through the
same slices. The chain tests run real Stages over the memory transport with each draft and windows in flight.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppharness.document.explain import FieldError
from ppharness.errors import ModelError, ScenarioError
from ppharness.model.decode.drafts import DEFAULT_K, NGramDraft, build_draft, parse_draft
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.engine.slicing import ModelSlice
from ppharness.plan.speculation_gain import acceptance, distinct_experts, predict, tokens_per_trip
from ppharness.run.inprocess import InProcessChain, judge, load_slices, run_inprocess
from ppharness.run.stage.speculation import Speculation, accepted, current, rows_ok
from ppharness.scenario.schema import scenario_from_args

MAX_CONTEXT = 96
SPLITS = [[(0, 8)], [(0, 3), (3, 8)], [(0, 2), (2, 5), (5, 8)]]
_slices: dict = {}


def slices_of(gguf, split):
    return load_slices(gguf, split, MAX_CONTEXT, cache=_slices, slots=3, batched=True)


def digest(x) -> str:
    return hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()[:16]


def one_at_a_time(slices, prompt: list[int], steps: int, slot: int) -> tuple[list[int], list[list[str]]]:
    """Greedy decoding one position per call: tokens, and each decode step's boundary digests."""
    h = prompt
    for s in slices[:-1]:
        h = s.prefill(h, slot)
    tokens, bounds = [slices[-1].prefill(h, slot)], []
    for k in range(steps):
        h, row = [tokens[-1]], []
        for s in slices[:-1]:
            h = s.decode(h, len(prompt) + k, slot)
            row.append(digest(h))
        bounds.append(row)
        tokens.append(slices[-1].decode(h, len(prompt) + k, slot))
    return tokens, bounds


@settings(max_examples=1, deadline=None)
@given(k=st.integers(1, 3), seed=st.integers(0, 2**16), slot=st.integers(0, 2))
def test_a_window_verified_in_one_call_gives_the_bytes_of_one_at_a_time_decoding(tiny_gguf, k, seed, slot):
    """Windows of up to 4 rows (the default run's: each width compiles once per slice), a 2-stage split."""
    window_property(tiny_gguf, SPLITS[1], k, seed, slot, steps=12)


@pytest.mark.slow  # about 3 minutes: every split, windows up to 16 rows
@settings(max_examples=4, deadline=None)
@given(split=st.sampled_from(SPLITS), k=st.integers(1, 9), seed=st.integers(0, 2**16), slot=st.integers(0, 2))
def test_windows_of_every_width_through_every_split_give_one_at_a_time_bytes(tiny_gguf, split, k, seed, slot):
    window_property(tiny_gguf, split, k, seed, slot)


def window_property(tiny_gguf, split, k: int, seed: int, slot: int, steps: int = 24) -> None:
    slices = slices_of(tiny_gguf, split)
    rng = random.Random(seed)
    prompt = [1] + [rng.randrange(tiny_gguf.config.vocab) for _ in range(rng.randrange(1, 12))]
    truth, truth_bounds = one_at_a_time(slices, prompt, steps, 0)
    h = prompt
    for s in slices[:-1]:
        h = s.prefill(h, slot)
    tokens, bounds = [slices[-1].prefill(h, slot)], {}
    windows = 0
    while len(tokens) <= steps:
        p, n = len(prompt) + len(tokens) - 1, len(tokens)
        drafts = [
            truth[n + i] if n + i < len(truth) and rng.random() < 0.75 else rng.randrange(tiny_gguf.config.vocab)
            for i in range(rng.randrange(0, k + 1))
        ]
        rows, seen = [[tokens[-1]]] + [[t] for t in drafts], []
        for s in slices[:-1]:
            rows = s.decode_window(rows, p, slot)
            seen.append([digest(r) for r in rows])
        greedy = slices[-1].decode_window(rows, p, slot)
        committed = accepted([tokens[-1], *drafts], greedy)
        for i in range(len(committed)):
            bounds[n - 1 + i] = [b[i] for b in seen]
        tokens += committed
        windows += 1
    assert tokens[: steps + 1] == truth, "a speculative window changed the greedy answer"
    for step in range(steps):
        assert bounds[step] == truth_bounds[step], f"decode step {step}: a window row's hidden state differs"
    assert windows < steps, "the windows never committed more than one token per call"


def test_qwen3_rows_have_the_same_bits_at_every_batch_width(tiny_qwen3_path):
    """The per-head q/k norms are fused by width unless stored: row 0 at width 8 equals row 0 alone."""
    from ppharness.model.gguf_file import GGUFFile

    s = ModelSlice(GGUFFile(tiny_qwen3_path), 0, 2, True, False, 32, slots=8, batched=True)
    out = {}
    for slot in (0, 4, 7):
        s.prefill([1, 5, 7, 9], slot)
        out[slot] = digest(s.decode([3], 4, slot))
    assert len(set(out.values())) == 1, f"a row's bytes depend on the batch width: {out}"


@pytest.fixture(scope="module")
def tiny_qwen3_path() -> str:
    from ppharness.model.sources.files import synthetic_path
    from ppharness.model.synthetic.spec import PRESETS

    return str(synthetic_path(PRESETS["tiny-qwen3"]))


PROMPT = "one two three one two three one two"


@pytest.fixture(scope="module")
def oracle(tiny_gguf, tiny_model_path):
    whole = load_slices(tiny_gguf, [(0, 8)], MAX_CONTEXT, taps=True, slots=3, batched=True)[0]
    return oracle_decode(tiny_model_path, PROMPT, 40, MAX_CONTEXT, model=whole, boundaries=True)


@pytest.mark.parametrize(
    "draft,windows,splits",
    [
        ("ngram:3", 2, SPLITS[1:2]),
        # each of these takes a minute or more here: every split, windows up to 8 rows, a draft model compiled
        pytest.param("ngram:4", 1, SPLITS, marks=pytest.mark.slow),
        pytest.param("ngram:6", 3, SPLITS, marks=pytest.mark.slow),
        pytest.param("layers:2:2", 2, SPLITS, marks=pytest.mark.slow),
        pytest.param("layers:3:3", 1, SPLITS, marks=pytest.mark.slow),
    ],
    ids=lambda v: str(v) if not isinstance(v, list) else f"{len(v)}splits",
)
def test_a_speculating_chain_answers_as_one_at_a_time_greedy_decoding(tiny_gguf, oracle, draft, windows, splits):
    spec = parse_draft(draft)
    speculation = Speculation(spec, build_draft(spec, tiny_gguf, MAX_CONTEXT, 3), windows)
    for split in splits:
        digests: dict[int, list[bytes]] = {}
        response = run_inprocess(tiny_gguf, slices_of(tiny_gguf, split), PROMPT, 40, digests=digests,
                                 speculation=speculation)  # fmt: skip
        verdict = judge(response, oracle, split, digests, speculative=True)
        assert verdict.exact, f"{draft}, {windows} window(s), split {split}: {verdict}"
        assert verdict.boundaries_compared >= 40 * (len(split) - 1), "the hidden states were not all compared"


def test_an_ngram_draft_commits_several_tokens_per_trip_on_a_repeating_answer(tiny_gguf, oracle):
    spec = parse_draft("ngram:3")
    speculation = Speculation(spec, build_draft(spec, tiny_gguf, MAX_CONTEXT, 3), 1)
    from ppharness.wire.messages import InferenceRequest, InferenceResponse

    with InProcessChain(tiny_gguf, slices_of(tiny_gguf, SPLITS[1]), speculation=speculation) as chain:
        chain.ask(InferenceRequest(reply_to=chain.client.address, prompt=PROMPT, max_tokens=40, request_id="r"))
        reply = None
        while reply is None:
            for i in range(2):
                chain.turn(i)
            reply = chain.reply()
        assert isinstance(reply, InferenceResponse)
        last = chain.stages[1].out.windows
        assert reply.token_ids == oracle.token_ids
        per_trip = last.committed / last.trips
        assert last.trips < 39 and per_trip > 1.0, f"{last.trips} trips for 39 tokens: nothing was accepted"


def test_windows_in_flight_behind_a_rejected_one_are_void():
    assert accepted([5, 6, 7, 8], [6, 7, 9, 1]) == [6, 7, 9]
    assert accepted([5], [3]) == [3]
    assert accepted([5, 6], [6, 2]) == [6, 2]
    assert current(10, 4, [1, 4], 9), "a window at the last committed token continues the answer"
    assert not current(11, 4, [1, 4], 9), "a window past the committed position is void"
    assert not current(10, 3, [1, 4], 9), "a window whose first token is not the committed one is void"


def test_malformed_windows_are_named():
    assert rows_ok(["a", "a", "b"], [4, 5, 9], [1, 2, 3], [1, 1, 2]) == ""
    assert "consecutive" in rows_ok(["a", "a"], [4, 6], [1, 2], [1, 1])
    assert "together" in rows_ok(["a", "b", "a"], [4, 9, 5], [1, 2, 3], [1, 1, 1])
    assert "trip" in rows_ok(["a"], [4], [1], [])


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence():
    d = NGramDraft()
    assert d.propose(0, [1, 2, 3, 9, 1, 2], 3) == [3, 9, 1]
    assert d.propose(0, [7, 8, 7, 8, 7], 5) == [8, 7, 8, 7, 8], "a cycle is proposed round and round"
    assert d.propose(0, [1, 2, 3, 4], 3) == [], "nothing repeats: nothing is proposed"


def test_draft_names_are_read_or_refused_with_the_fix():
    assert parse_draft("ngram").k == DEFAULT_K
    assert parse_draft("ngram:8").k == 8
    assert (parse_draft("layers:4:6").layers, parse_draft("layers:4:6").k) == (4, 6)
    assert parse_draft("model:/x/draft.gguf:3").source == "/x/draft.gguf"
    assert parse_draft("model:synthetic:tiny").source == "synthetic:tiny"
    for bad, words in [
        ("beam:4", "unknown kind"),
        ("ngram:0", "outside 1..31"),
        ("ngram:40", "outside 1..31"),
        ("layers", "how many"),
        ("layers:x", "how many"),
        ("model", "needs the draft model's file"),
    ]:
        with pytest.raises(ModelError, match=words):
            parse_draft(bad)


def test_a_draft_of_as_many_layers_as_the_model_is_refused(tiny_gguf):
    with pytest.raises(ModelError, match="needs N < 8"):
        build_draft(parse_draft("layers:8"), tiny_gguf, MAX_CONTEXT, 1)


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_gguf):
    with pytest.raises(ModelError, match="vocabulary"):
        build_draft(parse_draft("model:synthetic:tiny-qwen3"), tiny_gguf, MAX_CONTEXT, 1)


def test_scenarios_turn_speculation_on_with_one_key_and_refuse_what_cannot_run():
    s = scenario_from_args(speculate="ngram:8", windows=2)
    assert (s.serving.speculate, s.serving.windows, s.serving.batched) == ("ngram:8", 2, True)
    with pytest.raises((ScenarioError, FieldError), match="unknown kind"):
        scenario_from_args(speculate="beam:2")
    base = scenario_from_args()
    import msgspec

    raw = msgspec.to_builtins(base)
    raw["serving"] = {"speculate": "ngram:4"}
    from ppharness.scenario.schema import Scenario

    with pytest.raises(msgspec.ValidationError, match="batched: true"):
        msgspec.convert(raw, type=Scenario)
    raw["serving"] = {"speculate": "ngram:4", "batched": True}
    raw["fault_tolerance"] = {"policy": "failover"}
    with pytest.raises(msgspec.ValidationError, match="not built yet"):
        msgspec.convert(raw, type=Scenario)


def test_the_window_model_predicts_tokens_per_trip_and_the_rate():
    assert tokens_per_trip(0.0, 8) == 1.0, "nothing accepted: one token per trip"
    assert tokens_per_trip(1.0, 8) == 9.0, "everything accepted: K + 1"
    assert abs(tokens_per_trip(0.5, 2) - 1.75) < 1e-12  # 1 + 0.5 + 0.25
    assert acceptance(8, 2) == 0.8
    p = predict(0.5, [2, 0], delay_ms=100.0, window_ms=25.0)
    assert abs(p.tokens_per_trip - (1.75 + 1.0) / 2) < 1e-12, "a window with no drafts commits one token"
    assert abs(p.tok_s - p.tokens_per_trip * 1000 / 125.0) < 1e-9


def test_a_window_of_moe_rows_reads_the_experts_its_rows_are_routed_to():
    assert distinct_experts(384, 8, 1) == pytest.approx(8.0)
    assert 8 * 4 > distinct_experts(384, 8, 4) > 8 * 3.5, "four rows read almost four tokens' experts"
    assert distinct_experts(16, 4, 64) == pytest.approx(16.0, rel=1e-6), "many rows read every expert"


@pytest.mark.slow  # a chain of processes, its oracle and two requests: about two minutes
def test_bench_spec_prints_the_speed_up_tokens_per_trip_and_efficiency_beside_the_prediction():
    from ppharness.benchmarks.spec import report, run_spec_bench

    res = run_spec_bench(
        "synthetic:tiny", num_stages=2, delay_ms=5.0, draft="ngram:3", prompt="one two three one two three one",
        tokens=24, repeats=1, progress=lambda _: None,
    )  # fmt: skip
    text = report(res)
    assert res.exact, "a bench request's answer differs from the unsplit model's"
    assert res.trips >= 1 and res.decode_tokens == 23, f"{res.trips} trips for {res.decode_tokens} decode tokens"
    for line in ("speed-up vs greedy:", "tokens per trip:", "efficiency:", "speculative tok/s  predicted"):
        assert line in text, f"the bench's report lacks {line!r}"


@pytest.mark.slow  # three node processes and the oracle: about a minute
def test_pp_smoke_run_speculates_with_one_flag_and_matches_the_oracle(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "ppharness.cli.smoke", "--num-stages", "3", "--speculate", "ngram:4",
         "--max-tokens", "24", "--prompt", "one two three one two three", "--no-trace"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "MATCH" in out.stdout + out.stderr, "the speculating chain's answer was not the unsplit model's"


def test_under_retry_a_speculating_chain_acknowledges_windows_and_answers_the_same(tiny_gguf, oracle):
    """Policy retry: every window and every trip's tokens are acknowledged (or resent); the answer is the same."""
    from ppharness.wire.messages import InferenceRequest, InferenceResponse

    spec = parse_draft("ngram:3")
    speculation = Speculation(spec, build_draft(spec, tiny_gguf, MAX_CONTEXT, 3), 2)
    with InProcessChain(tiny_gguf, slices_of(tiny_gguf, SPLITS[1]), speculation=speculation, policy="retry") as chain:
        chain.ask(InferenceRequest(reply_to=chain.client.address, prompt=PROMPT, max_tokens=40, request_id="r"))
        reply = None
        for _ in range(100_000):
            for i in range(2):
                chain.turn(i, drain=True)
            reply = chain.reply()
            if isinstance(reply, InferenceResponse):
                break
        assert isinstance(reply, InferenceResponse), "the speculating chain under retry gave no answer"
        assert reply.token_ids == oracle.token_ids, "under retry the speculating chain's answer changed"


def _rows(request_id: str, start: int, n: int, dim: int, tokens: bool = True, trip: int = 1):
    from ppharness.model.engine.hidden import Hidden
    from ppharness.wire import codec
    from ppharness.wire.messages import ActivationRows

    hidden = np.zeros((n, 1, dim), dtype=np.float16)
    msg = ActivationRows(
        request_ids=[request_id] * n, positions=list(range(start, start + n)), hidden=b"", shape=hidden.shape,
        dtype="f16", plan_id="inprocess", tokens=[5] * n if tokens else [], trips=[trip] * n if tokens else [],
    )  # fmt: skip
    return codec.attach(msg, Hidden(hidden))


def test_a_stage_refuses_windows_that_skip_ahead_replay_a_trip_or_do_not_fit_the_run(tiny_gguf):
    from ppharness.model.engine.hidden import Hidden
    from ppharness.wire import codec
    from ppharness.wire.messages import RequestOpen

    spec = parse_draft("ngram:3")
    dim = tiny_gguf.config.dim
    with InProcessChain(tiny_gguf, slices_of(tiny_gguf, SPLITS[1]), speculation=Speculation(spec)) as chain:
        stage, logs = chain.stages[1], []
        stage.state.log = logs.append
        sender = chain.names["pp-stage-0"]
        opened = RequestOpen(request_id="r", reply_to=chain.client.address, max_tokens=8, prompt_tokens=3,
                             plan_id="inprocess")  # fmt: skip
        stage.handle(sender, opened)
        prefill = codec.header(Hidden(np.zeros((1, 3, dim), np.float16)), "f16", request_id="r", position=0,
                               is_prefill=True, plan_id="inprocess", epoch=0)  # fmt: skip
        stage.handle(sender, codec.attach(prefill, Hidden(np.zeros((1, 3, dim), np.float16))))
        stage.handle(sender, _rows("r", 5, 2, dim))
        assert any("computed up to 2" in line for line in logs), f"a window skipping ahead was taken: {logs}"
        stage.handle(sender, _rows("r", 3, 2, dim, trip=1))
        assert stage.state.reqs["r"].trip == 1 and stage.state.reqs["r"].next_position == 5, (
            "a good window was not taken"
        )
        stage.handle(sender, _rows("r", 4, 2, dim, trip=1))
        assert any("took trip 1" in line for line in logs), f"a replayed trip was taken: {logs}"
        stage.handle(sender, _rows("r", 5, 1, dim, tokens=False))
        assert any("without speculative windows" in line for line in logs), f"rows without windows taken: {logs}"
    with InProcessChain(tiny_gguf, slices_of(tiny_gguf, SPLITS[1])) as plain:
        stage, logs = plain.stages[1], []
        stage.state.log = logs.append
        stage.handle(plain.names["pp-stage-0"], _rows("r", 3, 2, dim))
        assert any("with speculative windows" in line for line in logs), (
            f"a run without speculation took a window: {logs}"
        )


def test_plan_simulate_predicts_a_plan_with_speculation_beside_greedy():
    import json
    from pathlib import Path

    from click.testing import CliRunner

    from ppharness.cli import main as cli

    plan = str(Path(__file__).resolve().parent.parent / "scenarios" / "kimi.json")
    out = CliRunner().invoke(cli, ["plan", "simulate", plan, "--speculate", "0.9:8", "--json"])
    assert out.exit_code == 0, out.output
    spec = json.loads(out.stdout)["speculation"]
    assert spec["tokens_per_trip"] == pytest.approx(tokens_per_trip(0.9, 8))
    assert spec["trip_ms"] > spec["greedy_ms"], "a window of 9 rows read no more experts than one row"
    assert spec["tok_s"] > 1000 / spec["greedy_ms"], "speculation at alpha 0.9 predicted no gain"
    bad = CliRunner().invoke(cli, ["plan", "simulate", plan, "--speculate", "1.5:8"])
    assert bad.exit_code == 2 and "acceptance must be in (0, 1]" in bad.output


def test_the_trace_says_which_trip_committed_each_token_and_what_its_window_drafted():
    from ppharness.trace.report import trips_of
    from ppharness.wire.messages import InferenceResponse

    response = InferenceResponse(
        request_id="r", text="", token_ids=[1] * 7, prompt_tokens=3, token_times=[0.0] * 7, finish_reason="length",
        trips=3, window_drafts=[4, 4, 4], window_accepted=[4, 0, 3],
    )  # fmt: skip
    trips = trips_of(response, 6)
    assert [t["n"] for t in trips] == [1, 1, 1, 1, 1, 2], "each decoded token names the trip that committed it"
    assert trips[0] == {"n": 1, "drafted": 4, "accepted": 4, "committed": 5, "row": 0}
    assert trips[-1]["committed"] == 1 and len(trips) == 6, "the last trip is cut at the end of the answer"
