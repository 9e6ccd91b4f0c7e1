"""A stage drops what does not fit its state (stale plan, unknown request, duplicate, bad tensor) and keeps serving."""

from __future__ import annotations

import pytest

from ppharness.errors import TransportTimeout
from ppharness.plan.stages import names_of
from ppharness.registry import transport_class
from ppharness.run.inprocess import load_slices
from ppharness.run.stage.stage import Stage
from ppharness.trace.drops import MAX_DROP_LINES, fingerprinted
from ppharness.wire import codec
from ppharness.wire.messages import Error, InferenceRequest, NextToken, RequestOpen, StageActivation


@pytest.fixture
def two_stage(tiny_gguf):
    """Stage 1 (last) of 2, with a memory transport standing in for stage 0 and the client."""
    memory = transport_class("memory")
    t0, t1, client = memory(), memory(), memory()
    addrs = [t0.start(), t1.start()]
    client.start()
    names = {name: addrs[i] for i in range(2) for name in names_of(i, 2)}
    logs: list[str] = []
    slices = load_slices(tiny_gguf, [(0, 4), (4, 8)], cache=_cache)
    stage = Stage(
        1, 2, slices[1], t1, names, "plan-a", tokenizer=tiny_gguf.tokenizer, log=logs.append, seed=client.address
    )
    yield stage, t0, client, logs, slices
    for t in (t0, t1, client):
        t.close()


_cache: dict = {}


def _activation(slices, request_id="r1", position=0, plan_id="plan-a", ids=(1, 2, 3), **override):
    hidden = slices[0].prefill(list(ids))
    data, shape = codec.pack_hidden(hidden, "f16")
    fields = dict(
        request_id=request_id,
        position=position,
        hidden=data,
        seq_len=shape[1],
        is_prefill=position == 0,
        shape=shape,
        dtype="f16",
        plan_id=plan_id,
    )
    fields.update(override)
    return StageActivation(**fields)


def _open(client, request_id="r1", plan_id="plan-a", max_tokens=3):
    return RequestOpen(
        request_id=request_id, reply_to=client.address, max_tokens=max_tokens, prompt_tokens=3, plan_id=plan_id
    )


def test_activation_for_unknown_request_is_dropped(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle(t0.address, _activation(slices, request_id="nobody"))
    assert any("unknown request 'nobody'" in line for line in logs)
    with pytest.raises(TransportTimeout):
        t0.recv(0)


def test_stale_plan_is_dropped(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle(t0.address, _open(client, plan_id="plan-old"))
    assert not stage.state.reqs and "plan plan-old" in logs[-1]


def test_tensor_of_wrong_size_is_dropped_then_the_request_goes_on(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle(t0.address, _open(client))
    good = _activation(slices)
    stage.handle(
        t0.address,
        StageActivation(**{**{f: getattr(good, f) for f in good.__struct_fields__}, "hidden": good.hidden[:-2]}),
    )
    assert "needs" in logs[-1]
    stage.handle(
        t0.address,
        StageActivation(
            **{
                **{f: getattr(good, f) for f in good.__struct_fields__},
                "shape": (1, 3, 7),
                "hidden": good.hidden[: 3 * 7 * 2],
            }
        ),
    )
    assert "shape" in logs[-1]
    stage.deliver(t0.address, good)  # the real prefill still works
    _, msg = t0.recv(0)
    assert isinstance(msg, NextToken) and msg.position == 3 and not msg.done


def test_duplicate_activation_is_dropped(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle(t0.address, _open(client))
    act = _activation(slices)
    stage.deliver(t0.address, act)
    t0.recv(0)
    stage.handle(t0.address, act)
    assert "duplicate" in logs[-1]
    with pytest.raises(TransportTimeout):
        t0.recv(0)


def test_unexpected_message_type_is_dropped(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle(client.address, InferenceRequest(reply_to=client.address, prompt="hi", max_tokens=2))
    assert "unexpected InferenceRequest" in logs[-1]


# --- only the member whose role sends a message is heard -----------------------------------------------------------


def test_a_request_open_from_another_member_cannot_take_the_stage_over(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle(t0.address, _open(client))
    stage.handle(client.address, _open(client, request_id="hijack"))
    assert list(stage.state.reqs) == ["r1"]
    assert "dropped RequestOpen from" in logs[-1] and "only stage 0 sends it" in logs[-1]


def test_an_activation_from_another_member_is_dropped_before_compute(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle(t0.address, _open(client))
    stage.handle(client.address, _activation(slices))
    assert "only stage 0 sends it" in logs[-1] and stage.state.reqs["r1"].next_position == 0
    with pytest.raises(TransportTimeout):
        t0.recv(0)


def test_answers_go_only_to_the_orchestrator(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle(
        t0.address, RequestOpen(request_id="r1", reply_to=t0.address, max_tokens=3, prompt_tokens=3, plan_id="plan-a")
    )
    assert not stage.state.reqs and "is not the orchestrator" in logs[-1]


@pytest.mark.parametrize(
    "seq_len, shape",
    [(2, (1, 2, 64)), (3, (1, 3, 32)), (3, (2, 3, 64)), (1, (1, 1, 64))],
    ids=["short", "narrow", "batch", "decode-sized-prefill"],
)
def test_an_activation_of_the_wrong_shape_for_the_plan_is_refused_before_compute(two_stage, seq_len, shape):
    stage, t0, client, logs, slices = two_stage
    stage.handle(t0.address, _open(client))
    n = 1
    for d in shape:
        n *= d
    stage.handle(t0.address, _activation(slices, seq_len=seq_len, shape=shape, hidden=b"\0\0" * n))
    assert "the plan expects (1, 3, 64)" in logs[-1] and stage.state.reqs["r1"].next_position == 0
    stage.deliver(t0.address, _activation(slices))  # the real prefill still works
    assert isinstance(t0.recv(0)[1], NextToken)


def test_a_next_token_from_another_stage_is_dropped(tiny_gguf):
    memory = transport_class("memory")
    ts = [memory() for _ in range(4)]
    addrs = [t.start() for t in ts]
    names = {name: addrs[i] for i in range(3) for name in names_of(i, 3)}
    logs: list[str] = []
    stage = Stage(
        0,
        3,
        load_slices(tiny_gguf, [(0, 3), (3, 5), (5, 8)], cache=_cache)[0],
        ts[0],
        names,
        "p",
        tokenizer=tiny_gguf.tokenizer,
        log=logs.append,
        seed=addrs[3],
    )
    stage.handle(addrs[1], NextToken(request_id="r", token_id=1, position=5, done=True, plan_id="p"))
    assert "only stage 2 sends it" in logs[-1]
    stage.handle(addrs[1], InferenceRequest(reply_to=addrs[1], prompt="hi", max_tokens=2))
    assert "only the orchestrator sends it" in logs[-1] and not stage.state.reqs
    for t in ts:
        t.close()


def test_first_stage_rejects_impossible_max_tokens(tiny_gguf):
    memory = transport_class("memory")
    t0, client = memory(), memory()
    t0.start(), client.start()
    names = {n: t0.address for n in names_of(0, 1)}
    stage = Stage(
        0,
        1,
        load_slices(tiny_gguf, [(0, 8)], cache=_cache)[0],
        t0,
        names,
        "p",
        tokenizer=tiny_gguf.tokenizer,
        log=lambda _: None,
        seed=client.address,
    )
    stage.handle(client.address, InferenceRequest(reply_to=client.address, prompt="hi", max_tokens=10_000))
    _, msg = client.recv(0)
    assert isinstance(msg, Error) and "max_tokens 10000" in msg.reason
    t0.close(), client.close()


def test_a_request_beyond_the_slots_and_the_queue_is_refused_as_busy_and_the_orchestrator_sends_it_again(tiny_gguf):
    """With every slot taken and no room in the queue, stage 0 refuses; the refusal is told apart by type
    (Error.busy -> StageBusy), which Chain.request retries; other errors fail."""
    from ppharness.errors import StageBusy, StageError
    from ppharness.run.seed.session import raise_on_error as _raise_on_error

    memory = transport_class("memory")
    t0, t1, client = memory(), memory(), memory()
    addrs = [t0.start(), t1.start()]
    client.start()
    names = {name: addrs[i] for i in range(2) for name in names_of(i, 2)}
    slices = load_slices(tiny_gguf, [(0, 4), (4, 8)], cache=_cache)
    stage = Stage(0, 2, slices[0], t0, names, "plan-a", tokenizer=tiny_gguf.tokenizer, seed=client.address, queue=0)
    try:
        stage.handle(
            client.address, InferenceRequest(reply_to=client.address, prompt="hi", max_tokens=3, request_id="a")
        )
        stage.handle(
            client.address, InferenceRequest(reply_to=client.address, prompt="hi", max_tokens=3, request_id="b")
        )
        _, refusal = client.recv(0)
        assert isinstance(refusal, Error) and refusal.busy and refusal.request_id == "b"
        assert list(stage.state.reqs) == ["a"], "the refusal left the request in flight alone"
        assert "1 request(s) in flight (its 1 slot(s)) and 0 waiting (its queue of 0)" in refusal.reason
        with pytest.raises(StageBusy):
            _raise_on_error(refusal)
        with pytest.raises(StageError) as failed:
            _raise_on_error(Error(stage=1, reason="compute failed"))
        assert not isinstance(failed.value, StageBusy)
    finally:
        for t in (t0, t1, client):
            t.close()


# --- positions out of turn: refused, and the member that sent them named to the orchestrator -------------------------


def _blame(client) -> Error:
    _, msg = client.recv(1.0)
    assert isinstance(msg, Error), f"the orchestrator got {type(msg).__name__}, not the stage's Error"
    return msg


def test_an_activation_past_the_requests_end_is_refused_and_its_sender_named(two_stage):
    """Positions past what the request can reach (its prompt and max_tokens, inside the context) come from no stage
    doing its work: refused before compute, and the orchestrator is told which member sent them."""
    stage, t0, client, logs, slices = two_stage
    stage.handle(t0.address, _open(client, max_tokens=3))
    stage.deliver(t0.address, _activation(slices))  # the prefill: positions 0-2
    t0.recv(0)
    end = stage.state.end_of(stage.state.reqs["r1"])
    stage.handle(t0.address, _activation(slices, position=end, ids=(1,), is_prefill=False))
    error = _blame(client)
    assert error.stage == 1 and error.request_id == "r1"
    assert "pp-stage-0" in error.reason and f"position {end} is past the request's end" in error.reason, error
    assert stage.state.reqs["r1"].next_position == 3, "the stage computed a position past the request's end"
    assert "refused an activation of r1 from pp-stage-0" in logs[-1]


def test_an_activation_skipping_ahead_is_refused_and_its_sender_named_once(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle(t0.address, _open(client, max_tokens=6))
    stage.deliver(t0.address, _activation(slices))
    t0.recv(0)
    for _ in range(3):
        stage.handle(t0.address, _activation(slices, position=5, ids=(1,), is_prefill=False))
    error = _blame(client)
    assert "pp-stage-0" in error.reason and "position 5 skips ahead of 3" in error.reason, error
    with pytest.raises(TransportTimeout):  # the orchestrator is told once; the run ends on it
        client.recv(0.2)
    stage.deliver(t0.address, _activation(slices, position=3, ids=(1,), is_prefill=False))  # the real step still runs
    _, msg = t0.recv(0)
    assert isinstance(msg, NextToken) and msg.position == 4


# --- a flood of drops costs a counter, not a log --------------------------------------------------------------------


def test_forty_thousand_drops_from_two_members_make_a_bounded_log(two_stage):
    """Wrong-role activations from one member and rows of unknown requests from another: the process logs its first
    16 drops, then counts them per reason and sender, and says so at every power of ten and when it closes."""
    stage, t0, client, logs, slices = two_stage
    forged, unknown = _activation(slices), _activation(slices, request_id="nobody")
    for _ in range(20_000):
        stage.handle(client.address, forged)  # only stage 0 sends activations
        stage.handle(t0.address, unknown)
    stage.state.drop.close()
    assert len(logs) <= MAX_DROP_LINES + 6, f"{len(logs)} lines for 40,000 drops"
    summary = logs[-1]
    assert summary.startswith("40000 messages dropped so far"), summary
    assert f"StageActivation not its role's from {fingerprinted(client.address)}" in summary, summary
    assert f"an unknown request from {fingerprinted(t0.address)}" in summary, summary


def test_a_second_activation_for_a_position_that_differs_from_the_first_is_refused_and_its_sender_named(two_stage):
    """A resent copy is the same bytes; another activation for a position already taken (a member racing the real
    one) means a member lies: refused, and the orchestrator told."""
    stage, t0, client, logs, slices = two_stage
    stage.handle(t0.address, _open(client, max_tokens=6))
    first = _activation(slices)
    stage.deliver(t0.address, first)
    t0.recv(0)
    stage.handle(t0.address, first)  # a copy: dropped as a duplicate, nobody blamed
    assert "duplicate" in logs[-1]
    with pytest.raises(TransportTimeout):
        client.recv(0.2)
    other = _activation(slices, ids=(4, 5, 6))
    stage.handle(t0.address, other)
    error = _blame(client)
    assert "pp-stage-0" in error.reason and "differs from the one taken for position 0" in error.reason, error
