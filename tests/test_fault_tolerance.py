"""Fault tolerance in one process: idempotent hops and stage replacement, on the real Stage objects and wire format.

The chain runs over the memory transport, pumped by this test: every message a stage or the client receives passes
through a ``fate`` that may lose it or deliver it twice, and time is a fake clock that jumps to the next resend when
nothing is left to deliver, so hundreds of losses take milliseconds. A replacement is a new Stage on a fresh slice (an
empty KV cache) at a new address, as a spare would be; the others get the newer directory, and for stage 0 the client
resumes the request. Every run's tokens, and every hidden state each stage sent, must equal the fault-free run's.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppharness.errors import TransportTimeout
from ppharness.plan.stages import ENTRY, names_of
from ppharness.registry import transport_class
from ppharness.run.inprocess import load_slices
from ppharness.run.reliable import GaveUp, Outbox, RetryPolicy, StreamAcks, ack_of
from ppharness.run.stage.stage import Stage
from ppharness.wire.messages import (
    Ack,
    InferenceRequest,
    InferenceResponse,
    Message,
    Replay,
    Resume,
    StageActivation,
    StreamedToken,
)

PROMPT, TOKENS, MAX_CONTEXT = "The quick brown fox", 24, 256
RANGES = [(0, 3), (3, 5), (5, 8)]  # the tiny preset's 8 blocks in three stages
Fate = Callable[[str, Message, int], int]  # (receiver, message, copy number of its kind) -> copies delivered


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _kind(msg: Message) -> str:
    if isinstance(msg, StageActivation):
        return "prefill" if msg.is_prefill else "decode"
    if isinstance(msg, Ack):
        return f"Ack/{msg.kind}"
    return type(msg).__name__


@dataclass
class Run:
    response: InferenceResponse
    digests: dict[int, list[bytes]]
    resends: int
    delivered: Counter[str] = field(default_factory=Counter)
    streamed: dict[int, int] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)


def run_chain(
    gguf,
    fate: Fate = lambda to, msg, k: 1,
    policy: str = "retry",
    replace: tuple[int, str, int] | None = None,
    fresh_slice: Callable[[int], object] | None = None,
    max_steps: int = 200_000,
) -> Run:
    """One request through three stages under ``fate``. ``replace=(stage, kind, k)``: when the k-th message of
    ``kind`` reaches ``stage``, that stage dies (the message with it) and a spare on ``fresh_slice(stage)`` replaces
    it."""
    memory = transport_class("memory")
    clock = FakeClock()
    slices = load_slices(gguf, RANGES, MAX_CONTEXT, cache=_SLICES)
    n = len(RANGES)
    transports = [memory() for _ in range(n + 1)]
    addrs = [t.start() for t in transports]
    client_t = transports[n]
    names = {name: addrs[i] for i in range(n) for name in names_of(i, n)}
    logs: list[str] = []
    retry = RetryPolicy(first_s=0.05, max_s=0.4, budget_s=1e6)

    def make_stage(i: int, model: object, transport, directory: dict[str, str], epoch: int) -> Stage:
        stage = Stage(
            i, n, model, transport, dict(directory), "plan-ft", "f16",
            gguf.tokenizer if i in (0, n - 1) else None, log=logs.append, seed=client_t.address,
            policy=policy, retry=retry, epoch=epoch,
        )  # fmt: skip
        stage.out.outbox.clock = clock
        stage.out.outbox.rng = random.Random(i)
        return stage

    stages = [make_stage(i, slices[i], transports[i], names, 0) for i in range(n)]
    live = list(transports[:n])
    client = Outbox(client_t.send, lambda role: names[ENTRY] if role == "entry" else role, retry, clock=clock)
    request = InferenceRequest(reply_to=client_t.address, prompt=PROMPT, max_tokens=TOKENS, request_id="r0")
    if policy == "none":
        client_t.send(names[ENTRY], request)
    else:
        client.put(("request", "r0", -1), "entry", request)
    seen: Counter[tuple[str, str]] = Counter()
    delivered: Counter[str] = Counter()
    streamed: dict[int, int] = {}
    stream_acks = StreamAcks()  # acknowledges the stream as the orchestrator's client does
    response: list[InferenceResponse] = []
    epoch = 0
    try:
        for _ in range(max_steps):
            moved = False
            for i in range(n):
                try:
                    sender, msg = live[i].recv(0)
                except TransportTimeout:
                    continue
                moved = True
                kind = _kind(msg)
                seen[(str(i), kind)] += 1
                if (
                    replace is not None
                    and replace[0] == i
                    and replace[1] == kind
                    and seen[(str(i), kind)] == replace[2]
                ):
                    # stage i dies with this message; a spare at a new address takes its range, in a newer epoch
                    replace, epoch = None, epoch + 1
                    live[i].close()
                    live[i] = memory()
                    address = live[i].start()
                    for name in names_of(i, n):
                        names[name] = address
                    assert fresh_slice is not None
                    stages[i] = make_stage(i, fresh_slice(i), live[i], names, epoch)
                    for j, other in enumerate(stages):
                        if j != i:
                            other.rejoin(dict(names), epoch)
                    if i == 0:
                        tokens = [streamed[p] for p in stream_acks.unbroken("r0")]
                        resume = Resume(request=request, tokens=tokens, plan_id="plan-ft", epoch=epoch)
                        client.put(("resume", "r0", -1), "entry", resume)
                    continue
                for _copy in range(fate(str(i), msg, seen[(str(i), kind)])):
                    delivered[kind] += 1
                    stages[i].deliver(sender, msg)
            try:
                sender, msg = client_t.recv(0)
            except TransportTimeout:
                pass
            else:
                moved = True
                kind = _kind(msg)
                seen[("client", kind)] += 1
                for _copy in range(fate("client", msg, seen[("client", kind)])):
                    delivered[kind] += 1
                    match msg:
                        case Ack():
                            client.ack(sender, msg)
                        case StreamedToken():
                            fresh = msg.position not in streamed
                            streamed.setdefault(msg.position, msg.token_id)
                            through = stream_acks.take(
                                "r0", msg.first, msg.position, msg.done, fresh, streamed.__contains__
                            )
                            if through is not None:
                                client_t.send(sender, ack_of("stream", msg.request_id, through, msg.plan_id))
                        case InferenceResponse():
                            client_t.send(sender, ack_of("response", msg.request_id, -1, "plan-ft"))
                            stream_acks.end("r0")
                            response.append(msg)
            if response and not any(s.out.outbox.pending for s in stages) and not client.pending:
                break
            if not moved:  # nothing in flight: time jumps to the next resend
                dues = [d for d in [s.due_in() for s in stages] + [client.due_in()] if d is not None]
                assert dues, f"the chain stalled with nothing to resend; log tail: {logs[-5:]}"
                clock.now += min(dues)
                for s in stages:
                    s.tick()
                client.tick()
        else:
            raise AssertionError(f"no response after {max_steps} steps; log tail: {logs[-5:]}")
    finally:
        for t in transports + live:
            t.close()
    resends = client.resends + sum(s.out.outbox.resends for s in stages)
    return Run(
        response[0], {s.state.index: s.state.digests.get("r0", []) for s in stages}, resends, delivered, streamed, logs
    )


_SLICES: dict = {}


@pytest.fixture(scope="module")
def baseline(tiny_gguf) -> Run:
    """The fault-free run with every message delivered once: what every faulty run must equal."""
    return run_chain(tiny_gguf, policy="none")


def _same(run: Run, baseline: Run) -> None:
    assert run.response.token_ids == baseline.response.token_ids, "the tokens differ from the fault-free run's"
    assert run.digests == baseline.digests, "a stage sent a hidden state that differs from the fault-free run's"


KINDS = [
    "InferenceRequest",
    "RequestOpen",
    "prefill",
    "decode",
    "NextToken",
    "StreamedToken",
    "InferenceResponse",
    "Ack/request",
    "Ack/open",
    "Ack/activation",
    "Ack/token",
]


STOOD_FOR = {"Ack/activation"}  # the prefill's Acks: the token that comes round stands for them when they are lost


@pytest.mark.parametrize("kind", KINDS)
def test_a_lost_message_of_each_kind_is_resent_and_the_answer_does_not_change(tiny_gguf, baseline, kind):
    def lose_first_copies(to: str, msg: Message, k: int) -> int:
        return 0 if _kind(msg) == kind and k <= 2 else 1

    run = run_chain(tiny_gguf, lose_first_copies)
    _same(run, baseline)
    if kind in STOOD_FOR:
        assert run.resends == 0, f"a lost {kind} was resent although a later message of the chain stands for it"
    else:
        assert run.resends >= 1, f"losing {kind} messages made nobody send anything again"


def test_a_perfect_link_carries_far_fewer_acks_than_tokens(tiny_gguf, baseline):
    run = run_chain(tiny_gguf)
    _same(run, baseline)
    per_token = {k: run.delivered[k] for k in ("Ack/activation", "Ack/token", "Ack/stream")}
    # the prefill's Ack at each of stages 1 and 2, the last token's, and one Ack of the stream per 8 tokens and its last
    assert per_token["Ack/activation"] == 2 and per_token["Ack/token"] == 1, per_token
    assert per_token["Ack/stream"] <= TOKENS // 8 + 1, per_token
    assert run.resends == 0, "a message was resent on a perfect link"


@pytest.mark.parametrize("kind", KINDS)
def test_a_duplicated_message_of_each_kind_is_taken_once(tiny_gguf, baseline, kind):
    def twice(to: str, msg: Message, k: int) -> int:
        return 2 if _kind(msg) == kind else 1

    run = run_chain(tiny_gguf, twice)
    _same(run, baseline)  # a position computed twice would send (and digest) its hidden state twice
    assert run.delivered[kind] >= 2


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), loss=st.floats(0.0, 0.3), dup=st.floats(0.0, 0.2))
def test_random_loss_and_duplication_on_every_link_give_the_same_answer(tiny_gguf, baseline, seed, loss, dup):
    rng = random.Random(seed)

    def fate(to: str, msg: Message, k: int) -> int:
        if rng.random() < loss:
            return 0
        return 2 if rng.random() < dup else 1

    _same(run_chain(tiny_gguf, fate), baseline)


def test_the_client_sees_every_token_as_it_is_made(tiny_gguf, baseline):
    run = run_chain(tiny_gguf)
    tokens = [run.streamed[p] for p in sorted(run.streamed)]
    assert tokens == baseline.response.token_ids, "the streamed tokens are not the response's"
    assert run.delivered["StreamedToken"] == len(tokens), "a token was streamed more than once on a perfect link"


def test_policy_none_sends_each_message_once_and_acknowledges_nothing(tiny_gguf, baseline):
    assert baseline.resends == 0
    assert not any(k.startswith("Ack/") for k in baseline.delivered), "policy none acknowledged a message"
    assert baseline.delivered["StreamedToken"] == 0, "policy none streamed tokens"


# --- replacement ------------------------------------------------------------------------------------------------------


def _fresh(gguf) -> Callable[[int], object]:
    """A spare's slice of stage i's range: loaded anew, its KV cache empty (warm-up positions aside)."""
    from ppharness.model.decode.rules import warm_up
    from ppharness.model.engine.slicing import ModelSlice

    def fresh_slice(i: int) -> object:
        lo, hi = RANGES[i]
        model = ModelSlice(gguf, lo, hi, i == 0, i == len(RANGES) - 1, MAX_CONTEXT)
        warm_up(model)
        return model

    return fresh_slice


@pytest.mark.parametrize(
    ("stage", "kind", "k"),
    [
        (1, "prefill", 1),  # the middle stage dies before its first computation
        (1, "decode", 7),  # ... mid-decode
        (2, "decode", 3),  # the last stage
        (2, "prefill", 1),
        (0, "NextToken", 5),  # stage 0, resumed by the client from the streamed tokens
        (0, "NextToken", 1),
    ],
    ids=["middle-at-prefill", "middle-mid-decode", "last-mid-decode", "last-at-prefill", "first-mid", "first-early"],
)
def test_a_replaced_stage_rebuilds_its_cache_by_replay_and_the_answer_does_not_change(
    tiny_gguf, baseline, stage, kind, k
):
    run = run_chain(tiny_gguf, policy="failover", replace=(stage, kind, k), fresh_slice=_fresh(tiny_gguf))
    _same(run, baseline)
    replayed = [line for line in run.logs if "replayed" in line or "resumed" in line]
    assert replayed, "the replacement never replayed the request"


def test_a_replaced_stage_under_loss_still_gives_the_same_answer(tiny_gguf, baseline):
    rng = random.Random(5)

    def lossy(to: str, msg: Message, k: int) -> int:
        return 0 if rng.random() < 0.15 else 1

    run = run_chain(tiny_gguf, lossy, policy="failover", replace=(1, "decode", 4), fresh_slice=_fresh(tiny_gguf))
    _same(run, baseline)


def test_a_replaced_node_is_fenced_off_by_address_and_by_epoch(tiny_gguf):
    from ppharness.wire.messages import NextToken

    memory = transport_class("memory")
    transports = [memory() for _ in range(4)]
    try:
        addrs = [t.start() for t in transports]
        names = {name: addrs[i] for i in range(3) for name in names_of(i, 3)}
        logs: list[str] = []
        slices = load_slices(tiny_gguf, RANGES, MAX_CONTEXT, cache=_SLICES)
        first = Stage(
            0, 3, slices[0], transports[0], names, "plan-ft", tokenizer=tiny_gguf.tokenizer, log=logs.append,
            policy="failover",
        )  # fmt: skip
        stale, spare = addrs[2], addrs[3]
        first.rejoin({**names, "pp-stage-2": spare, "pp-exit": spare}, epoch=1)
        token = NextToken(request_id="r0", token_id=7, position=5, done=False, plan_id="plan-ft", epoch=0)
        first.handle(stale, token)
        assert "only stage 2 sends it" in logs[-1], "a message from the replaced node's address was not refused"
        first.handle(spare, token)
        assert "fenced off NextToken of epoch 0" in logs[-1], "a message of an older epoch was not refused"
        with pytest.raises(TransportTimeout):  # neither was acknowledged
            transports[2].recv(0)
        with pytest.raises(TransportTimeout):
            transports[3].recv(0)
    finally:
        for t in transports:
            t.close()


# --- the outbox ---------------------------------------------------------------------------------------------------


class _Wire:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Message]] = []

    def send(self, address: str, msg: Message):
        self.sent.append((address, msg))
        return None


def _outbox(**policy) -> tuple[Outbox, _Wire, FakeClock, dict[str, str]]:
    wire, clock, where = _Wire(), FakeClock(), {"next": "addr-a"}
    box = Outbox(wire.send, where.get, RetryPolicy(**policy), clock=clock, rng=random.Random(0))
    return box, wire, clock, where


def _msg() -> Message:
    return ack_of("activation", "r", 3, "p")  # any message will do as the payload


def test_resends_back_off_doubling_up_to_the_ceiling_with_bounded_jitter():
    box, wire, clock, _ = _outbox(first_s=0.1, max_s=0.8, jitter=0.25)
    box.put(("activation", "r", 3), "next", _msg())
    waits, last = [], 0.0
    for _ in range(6):
        due = box.due_in()
        assert due is not None
        waits.append(due)
        clock.now += due
        last = clock.now
        box.tick()
    assert len(wire.sent) == 7 and last > 0
    nominal = [0.1, 0.2, 0.4, 0.8, 0.8, 0.8]
    for got, want in zip(waits, nominal, strict=True):
        assert want * 0.75 <= got <= want * 1.25, f"a wait of {got:.3f} s strays from {want} s +- 25 %"


def test_an_ack_from_another_address_settles_nothing():
    box, _, _, _ = _outbox()
    box.put(("activation", "r", 3), "next", _msg())
    assert not box.ack("addr-b", ack_of("activation", "r", 3, "p"))
    assert box.ack("addr-a", ack_of("activation", "r", 3, "p"))
    assert box.due_in() is None


def test_a_resend_goes_to_the_role_s_address_now():
    box, wire, clock, where = _outbox(first_s=0.1)
    box.put(("activation", "r", 3), "next", _msg())
    where["next"] = "addr-replacement"
    clock.now += 1.0
    box.tick()
    assert [a for a, _ in wire.sent] == ["addr-a", "addr-replacement"]


def test_round_trips_measured_on_first_sends_set_the_timeout():
    box, _, clock, _ = _outbox(first_s=1.0, min_s=0.01)
    for i in range(20):
        box.put(("activation", "r", i), "next", _msg())
        clock.now += 0.02
        assert box.ack("addr-a", ack_of("activation", "r", i, "p"))
    box.put(("activation", "r", 99), "next", _msg())
    due = box.due_in()
    assert due is not None and due < 0.2, f"after 20 round trips of 20 ms the timeout is still {due:.2f} s"


def test_a_message_never_acknowledged_is_given_up_after_the_budget():
    box, _, clock, _ = _outbox(first_s=0.1, max_s=0.2, budget_s=2.0)
    box.put(("token", "r", 9), "entry", _msg())
    with pytest.raises(GaveUp, match="no acknowledgement of token 9 of request r"):
        for _ in range(100):
            clock.now += 0.25
            box.tick()


def test_an_ack_of_a_position_settles_every_earlier_one_of_its_request_and_kind():
    box, _, _, _ = _outbox()
    for key in [("activation", "r", 3), ("activation", "r", 4), ("activation", "s", 2), ("token", "r", 3)]:
        box.put(key, "next", _msg())
    assert box.ack("addr-a", ack_of("activation", "r", 4, "p"))
    assert sorted(box.pending) == [("activation", "s", 2), ("token", "r", 3)]
    assert box.settle_through("token", "r", 4) == 1, "the chain's progress did not settle the token before it"
    assert not box.ack("addr-b", ack_of("activation", "s", 9, "p")), "an Ack from elsewhere settled a message"


def test_a_path_slower_than_the_first_timeout_is_not_resent_on_every_message():
    box, wire, clock, _ = _outbox(first_s=0.1, max_s=2.0, jitter=0.0)
    for i in range(6):  # each message takes 0.5 s to be settled by the chain's progress
        box.put(("activation", "r", i), "next", _msg())
        for _ in range(50):
            clock.now += 0.01
            box.tick()
        box.settle_through("activation", "r", i + 1)
    resent = [m for _, m in wire.sent].count(_msg()) - 6
    assert resent <= 3, f"{resent} resends: the backoff was forgotten between messages"


def test_a_stream_is_acknowledged_through_its_unbroken_run_every_eight_tokens_and_at_its_end():
    acks, got = StreamAcks(every=8), set()

    def arrive(p: int, done: bool = False) -> int | None:
        fresh = p not in got
        got.add(p)
        return acks.take("r", 10, p, done, fresh, got.__contains__)

    assert [arrive(p) for p in range(10, 17)] == [None] * 7
    assert arrive(17) == 17
    assert arrive(19) is None and arrive(20) is None, "a position after a gap was acknowledged"
    assert arrive(19) == 17, "a copy was not acknowledged at once (through the unbroken run only)"
    assert list(acks.unbroken("r")) == list(range(10, 18)), "a resumed request would skip the gap"
    assert arrive(18) is None and arrive(21, done=True) == 21
    acks.end("r")
    assert acks.take("r", 10, 12, False, False, got.__contains__) == 12, "a copy after the answer went unanswered"


def test_replay_and_resume_cross_the_wire_unchanged():
    from ppharness.wire import codec
    from ppharness.wire.messages import RequestOpen

    opened = RequestOpen(request_id="r", reply_to="x", max_tokens=3, prompt_tokens=2, plan_id="p", epoch=1)
    replay = Replay(open=opened, activations=[], epoch=1)
    request = InferenceRequest(reply_to="x", prompt="hi", max_tokens=3, request_id="r")
    resume = Resume(request=request, tokens=[1, 2], plan_id="p", epoch=2)
    for msg in (replay, resume):
        assert codec.decode(codec.encode(msg)) == msg


def test_a_message_waiting_for_a_replaced_node_goes_to_its_replacement_at_once():
    box, wire, clock, where = _outbox(first_s=0.1, max_s=2.0)
    box.put(("token", "r", 4), "next", _msg())
    for _ in range(4):  # the receiver is dead: the waits grow to 0.8 s
        clock.now += box.due_in() or 0.0
        box.tick()
    where["next"] = "addr-replacement"
    assert box.redirect() == 1
    assert box.due_in() == 0.0, "the message still waits out its backoff"
    box.tick()
    assert wire.sent[-1][0] == "addr-replacement"


@pytest.mark.parametrize(
    ("stage", "kind"),
    [(1, "Replay"), (2, "Replay"), (0, "Resume"), (1, "Ack/replay"), (0, "Ack/resume")],
)
@pytest.mark.parametrize("copies", [0, 2], ids=["lost", "duplicated"])
def test_a_lost_or_duplicated_replay_or_resume_changes_nothing(tiny_gguf, baseline, stage, kind, copies):
    def fate(to: str, msg: Message, k: int) -> int:
        return copies if _kind(msg) == kind and k == 1 else 1

    trigger = ("NextToken", 4) if stage == 0 else ("decode", 4)
    run = run_chain(tiny_gguf, fate, policy="failover", replace=(stage, *trigger), fresh_slice=_fresh(tiny_gguf))
    _same(run, baseline)
    assert run.delivered[kind] >= (1 if copies == 0 else 2), f"no {kind} went through"
