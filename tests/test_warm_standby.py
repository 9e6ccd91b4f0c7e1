"""Warm standbys and a failover's answers: a spare that holds a stage's blocks computes what a cold load of them
computes, byte for byte; a former exit's answer still counts after it was replaced, while nothing else it says does."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from ppharness.model.decode.rules import warm_up
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import resolve_model
from ppharness.plan.stages import StagePlan
from ppharness.run.node.standby import Held
from ppharness.run.seed.failover import Failover
from ppharness.run.seed.roles import Roles
from ppharness.wire.messages import Heartbeat, InferenceResponse, StreamedToken, Warm


@pytest.fixture(scope="module")
def tiny() -> GGUFFile:
    return GGUFFile(resolve_model("synthetic:tiny"))


def _program(lo: int, hi: int, first: bool, last: bool, num_stages: int = 3) -> str:
    stage = 0 if first else (num_stages - 1 if last else 1)
    plan = StagePlan(plan_id="p", stage=stage, num_stages=num_stages, lo=lo, hi=hi)
    return msgspec.json.encode(plan).decode()


def test_a_warm_standby_holds_each_stage_and_computes_what_a_cold_load_computes(tiny: GGUFFile) -> None:
    lines: list[str] = []
    held = Held(tiny, lines.append)
    held.warm(Warm(programs=[_program(0, 3, True, False), _program(3, 6, False, False)], lengths=[7]))
    assert len(held.slices) == 2, f"the standby holds {len(held.slices)} slice(s), not the 2 it was sent"
    assert any("holding blocks [0, 3), [3, 6)" in ln for ln in lines), lines
    plan = msgspec.json.decode(_program(3, 6, False, False), type=StagePlan)
    warm = held.take(plan)
    assert warm is not None, "the standby did not hand over the slice it held for blocks [3, 6)"
    assert held.take(plan) is None, "a slice was handed over twice"
    cold = ModelSlice(tiny, 3, 6, False, False, plan.max_context)
    warm_up(cold)
    rng = np.random.default_rng(3)
    prompt = rng.standard_normal((1, 7, tiny.config.dim)).astype(np.float16)
    a, b = warm.prefill(prompt), cold.prefill(prompt)
    assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
    assert a.tobytes() == b.tobytes(), "the warm standby's prefill differs from a cold load's"
    for position in range(7, 12):
        x = rng.standard_normal((1, 1, tiny.config.dim)).astype(np.float16)
        a, b = warm.decode(x, position), cold.decode(x, position)
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
        assert a.tobytes() == b.tobytes(), f"the warm standby's decode at position {position} differs"


def test_a_warm_standby_stops_warming_when_an_assignment_waits(tiny: GGUFFile) -> None:
    lines: list[str] = []
    held = Held(tiny, lines.append)
    held.warm(Warm(programs=[_program(0, 3, True, False)]), interrupted=lambda: True)
    assert held.slices == {}, "the standby went on loading with an Assign waiting"
    assert any("interrupted" in ln for ln in lines), lines


def test_a_replaced_exit_is_heard_only_for_its_answer() -> None:
    progress: list[str] = []
    session = SimpleNamespace(progress=progress.append, roles=Roles(lambda: None, progress.append))
    failover = Failover(session, SimpleNamespace())  # type: ignore[arg-type]
    old_exit, old_middle = "tcp://10.0.0.3:1?curve=aa", "tcp://10.0.0.2:1?curve=bb"
    failover.fenced |= {old_exit, old_middle}
    failover.former_exits.add(old_exit)
    answer = InferenceResponse(
        request_id="r", text="x", token_ids=[1], prompt_tokens=3, token_times=[0.1], finish_reason="length"
    )
    token = StreamedToken(request_id="r", token_id=1, position=5, done=False, plan_id="p")
    assert not failover.fence(old_exit, answer), "the answer of a replaced exit was fenced off"
    assert not failover.fence(old_exit, token), "a token streamed by a replaced exit was fenced off"
    assert failover.fence(old_exit, Heartbeat(stage=2, seq=1)), "a replaced exit's heartbeat still counts"
    assert failover.fence(old_middle, answer), "a replaced middle stage's answer counts"
    assert any("fenced off" in ln for ln in progress)
    assert session.roles.admits(old_exit, answer), "the check of roles dropped a replaced exit's answer"
    assert not session.roles.admits(old_middle, answer), "the check of roles took a middle stage's answer"
