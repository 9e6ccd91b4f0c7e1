"""A stage drops what does not fit its state (stale plan, unknown request, duplicate, bad tensor) and keeps serving."""

from __future__ import annotations

import pytest

from ppharness import codec
from ppharness.errors import TransportTimeout
from ppharness.inprocess import load_slices
from ppharness.messages import Error, InferenceRequest, NextToken, RequestOpen, StageActivation
from ppharness.plan import names_of
from ppharness.registry import transport_class
from ppharness.stage import Stage


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
    stage = Stage(1, 2, slices[1], t1, names, "plan-a", tokenizer=tiny_gguf.tokenizer, log=logs.append)
    yield stage, t0, client, logs, slices
    for t in (t0, t1, client):
        t.close()


_cache: dict = {}


def _activation(slices, request_id="r1", position=0, plan_id="plan-a", ids=(1, 2, 3), **override):
    hidden = slices[0].prefill(list(ids))
    data, shape = codec.pack_hidden(hidden, "f16")
    fields = dict(request_id=request_id, position=position, hidden=data, seq_len=shape[1], is_prefill=position == 0,
                  shape=shape, dtype="f16", plan_id=plan_id)
    fields.update(override)
    return StageActivation(**fields)


def _open(client, request_id="r1", plan_id="plan-a", max_tokens=3):
    return RequestOpen(request_id=request_id, reply_to=client.address, max_tokens=max_tokens, prompt_tokens=3,
                       plan_id=plan_id)


def test_activation_for_unknown_request_is_dropped(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle("x", _activation(slices, request_id="nobody"))
    assert any("unknown request 'nobody'" in line for line in logs)
    with pytest.raises(TransportTimeout):
        t0.recv(0)


def test_stale_plan_is_dropped(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle("x", _open(client, plan_id="plan-old"))
    assert stage.req is None and "plan plan-old" in logs[-1]


def test_tensor_of_wrong_size_is_dropped_then_the_request_goes_on(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle("x", _open(client))
    good = _activation(slices)
    stage.handle("x", StageActivation(**{**{f: getattr(good, f) for f in good.__struct_fields__},
                                         "hidden": good.hidden[:-2]}))
    assert "needs" in logs[-1]
    stage.handle("x", StageActivation(**{**{f: getattr(good, f) for f in good.__struct_fields__},
                                         "shape": (1, 3, 7), "hidden": good.hidden[: 3 * 7 * 2]}))
    assert "shape" in logs[-1]
    stage.handle("x", good)  # the real prefill still works
    _, msg = t0.recv(0)
    assert isinstance(msg, NextToken) and msg.position == 3 and not msg.done


def test_duplicate_activation_is_dropped(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle("x", _open(client))
    act = _activation(slices)
    stage.handle("x", act)
    t0.recv(0)
    stage.handle("x", act)
    assert "duplicate" in logs[-1]
    with pytest.raises(TransportTimeout):
        t0.recv(0)


def test_unexpected_message_type_is_dropped(two_stage):
    stage, t0, client, logs, slices = two_stage
    stage.handle("x", InferenceRequest(reply_to=client.address, prompt="hi", max_tokens=2))
    assert "unexpected InferenceRequest" in logs[-1]


def test_first_stage_rejects_impossible_max_tokens(tiny_gguf):
    memory = transport_class("memory")
    t0, client = memory(), memory()
    t0.start(), client.start()
    names = {n: t0.address for n in names_of(0, 1)}
    stage = Stage(0, 1, load_slices(tiny_gguf, [(0, 8)], cache=_cache)[0], t0, names, "p",
                  tokenizer=tiny_gguf.tokenizer, log=lambda _: None)
    stage.handle(client.address, InferenceRequest(reply_to=client.address, prompt="hi", max_tokens=10_000))
    _, msg = client.recv(0)
    assert isinstance(msg, Error) and "max_tokens 10000" in msg.reason
    t0.close(), client.close()
