"""Fault tolerance on real pp-node processes: hops resent under loss, dead stages replaced by spares, stale nodes
fenced off, and a run without spares left failing cleanly. Every answer is compared with the unsplit model: tokens and
every stage-boundary hidden state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import msgspec
import pytest

from backends.local import labelled_pids
from ppharness.network.spec import Event, Impairment, Network
from ppharness.run.seed.failover import WARM_ANSWER_S
from ppharness.run.seed.orchestrator import Chain, run_scenario
from ppharness.scenario.schema import Scenario, scenario_from_args
from ppharness.scenario.sections import ClusterSection, FaultToleranceSection
from ppharness.wire.messages import Join, Message

pytestmark = pytest.mark.local
ROOT = Path(__file__).resolve().parent.parent


def _scenario(
    events: tuple[Event, ...] = (),
    loss: float = 0.0,
    policy: str = "failover",
    spares: int = 1,
    max_tokens: int = 48,
    heartbeat: bool = False,
) -> Scenario:
    sc = scenario_from_args(num_stages=3, max_tokens=max_tokens)
    cluster = ClusterSection(engine="heartbeat", heartbeat_s=0.25, dead_after_s=1.5) if heartbeat else sc.cluster
    sc = msgspec.structs.replace(
        sc,
        cluster=cluster,
        fault_tolerance=FaultToleranceSection(policy=policy, spares=spares),  # type: ignore[arg-type]
        network=Network(seed=11, default=Impairment(loss=loss), events=events),
    )
    return msgspec.convert(msgspec.to_builtins(sc), type=Scenario)


def _lines(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


@pytest.mark.slow  # 20-40 s; the default run keeps to its 12-minute budget, .ci/run runs it with -m slow
def test_a_middle_stage_killed_mid_decode_under_loss_is_replaced_and_the_answer_is_exact(capsys):
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    sc = _scenario(events=(Event(at_s=0.1, kind="kill", nodes=("stage-1",)),), loss=0.05, max_tokens=240)
    result = run_scenario(sc, run_label=label)
    assert result.matches_oracle, "the run that failed over differs from the unsplit model"
    assert [r.stage for r in result.recoveries] == [1], "stage 1 was not replaced exactly once"
    r = result.recoveries[0]
    assert r.reload_s > 0 and r.load_s > 0 and (r.replay_s or 0) > 0, "a recovery's timings are missing"
    assert labelled_pids(label) == [], "the run left processes behind, the replaced one included"


def test_spares_exhausted_ends_the_run_with_exit_1_and_nothing_left(tmp_path):
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    sc = _scenario(events=(Event(at_s=0.1, kind="kill", nodes=("stage-1",)),), spares=0, max_tokens=240)
    sc = msgspec.structs.replace(sc, fault_tolerance=msgspec.structs.replace(sc.fault_tolerance, replan=False))
    path = tmp_path / "scenario.yaml"
    path.write_bytes(msgspec.yaml.encode(sc))
    r = subprocess.run(
        [sys.executable, "-m", "ppharness.cli.smoke", "--scenario", str(path), "--run-label", label, "--no-trace"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    failed = [ln for ln in out.splitlines() if ln.startswith("FAILED: ")]
    assert len(failed) == 1 and "pp-stage-1" in failed[0], out
    assert "no spare device is left" in out, out
    assert "fault_tolerance.replan: false" in out, "the run did not say why the stage was not re-placed"
    assert labelled_pids(label) == [], "the failed run left processes behind"


@pytest.mark.slow
def test_with_no_spare_a_killed_stage_is_replaced_on_a_surviving_device_and_the_answer_is_exact(capsys):
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    sc = _scenario(events=(Event(at_s=0.1, kind="kill", nodes=("stage-1",)),), spares=0, max_tokens=240)
    result = run_scenario(sc, run_label=label)
    assert result.matches_oracle, "the run re-placed on a survivor differs from the unsplit model"
    assert [(r.stage, r.replanned) for r in result.recoveries] == [(1, True)], result.recoveries
    assert result.recoveries[0].spare in {"local-0", "local-2"}, "the stage went to a device that was not a survivor"
    assert any("no spare left" in ln for ln in _lines(capsys))
    assert labelled_pids(label) == [], "the run left processes behind, the replaced one included"


@pytest.mark.slow
def test_stage_0_and_the_last_stage_killed_in_turn_are_replaced_and_the_answer_is_exact():
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    events = (
        Event(at_s=0.3, kind="kill", nodes=("stage-0",)),
        Event(at_s=0.8, kind="kill", nodes=("stage-2",)),
    )
    result = run_scenario(_scenario(events=events, loss=0.03, spares=2, max_tokens=240), run_label=label)
    assert result.matches_oracle, "the run that failed over twice differs from the unsplit model"
    assert sorted(r.stage for r in result.recoveries) == [0, 2]
    assert [r.epoch for r in result.recoveries] == [1, 2]
    assert labelled_pids(label) == []


@pytest.mark.slow
def test_a_paused_stage_is_replaced_and_fenced_off_when_it_comes_back(capsys):
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    # the pause outlasts detection (1.5 s) and the node comes back while the run, and its recovery, still go on
    # (loss on the stage links keeps the request going for seconds after a warm spare took over)
    events = (Event(at_s=0.4, kind="pause", nodes=("stage-1",), for_s=2.0),)
    result = run_scenario(_scenario(events=events, loss=0.03, heartbeat=True, max_tokens=240), run_label=label)
    assert result.matches_oracle, "the run with a stale node back differs from the unsplit model"
    assert [r.stage for r in result.recoveries] == [1]
    assert "no heartbeat" in result.recoveries[0].cause
    lines = _lines(capsys)
    assert any("network event" in ln and "resume stage-1" in ln for ln in lines), "the paused node never came back"
    assert any("fenced off" in ln for ln in lines), "nothing the stale node sent was fenced off"
    assert labelled_pids(label) == []


@pytest.mark.slow
def test_a_pause_shorter_than_detection_is_ridden_out_by_retries():
    events = (Event(at_s=0.4, kind="pause", nodes=("stage-1",), for_s=0.8),)
    result = run_scenario(_scenario(events=events, heartbeat=True, policy="retry", spares=0))
    assert result.matches_oracle
    assert result.recoveries == [], "a short pause replaced a stage"


@pytest.mark.slow
def test_a_spare_killed_in_turn_is_replaced_by_the_next_and_the_answer_is_exact(capsys):
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    # the second kill finds the first spare coming up or serving (how far it got depends on the machine): either way
    # the next spare takes over, and the request cannot have finished without stage 1
    events = (Event(at_s=0.3, kind="kill", nodes=("stage-1",)), Event(at_s=0.8, kind="kill", nodes=("stage-1",)))
    result = run_scenario(_scenario(events=events, spares=2, max_tokens=240), run_label=label)
    assert result.matches_oracle, "a stage replaced again gave another answer"
    lines = _lines(capsys)
    attempts = [ln for ln in lines if "failover: pp-stage-1" in ln and "takes blocks" in ln]
    assert len(attempts) == 2, "the killed spare was not replaced by the next"
    assert [r.spare for r in result.recoveries][-1] == "local-4", "the last spare does not serve stage 1"
    assert labelled_pids(label) == []


@pytest.mark.slow
def test_two_neighbours_replaced_at_once_are_replayed_through_both_and_the_answer_is_exact(capsys):
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    # stage 2 dies while stage 1 is paused: stage 1 cannot replay to stage 2's spare, and is itself replaced once
    # detection runs out; stage 1's replacement, replayed by stage 0, must pass the whole replay on to stage 2's
    events = (
        Event(at_s=0.1, kind="pause", nodes=("stage-1",), for_s=2.5),
        Event(at_s=0.4, kind="kill", nodes=("stage-2",)),
    )
    result = run_scenario(_scenario(events=events, heartbeat=True, spares=2, max_tokens=200), run_label=label)
    assert result.matches_oracle, "the run with two neighbours replaced differs from the unsplit model"
    assert sorted(r.stage for r in result.recoveries) == [1, 2], result.recoveries
    assert labelled_pids(label) == [], "the run left processes behind"


@pytest.mark.slow
def test_a_standby_that_does_not_answer_its_warm_up_is_a_failed_spare_within_seconds():
    """The standby spare is stopped (SIGSTOP) the moment it joins: it never answers its Warm. The run treats it as a
    failed spare within WARM_ANSWER_S, not the ready budget, destroys it, and serves the request exactly."""
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    sc = _scenario(max_tokens=16)
    sc = msgspec.structs.replace(sc, budget=msgspec.structs.replace(sc.budget, ready_s=120.0))
    lines: list[str] = []
    chain = Chain(sc, progress=lines.append, run_label=label)

    def stop_the_spare(sender: str, msg: Message) -> None:
        if isinstance(msg, Join) and msg.stage < 0:
            os.kill(msg.pid, signal.SIGSTOP)

    chain.session.keepers.append(stop_the_spare)
    with chain:
        ready = [ln for ln in lines if "did not answer its warm-up" in ln]
        assert ready and f"within {WARM_ANSWER_S:g} s" in ready[0] and "treated as failed" in ready[0], lines
        assert not chain.session.standbys, "the silent standby is still counted on"
        response = chain.request(sc.request.prompt, 16)
    waited = [ln for ln in lines if "did not warm up in time" in ln]
    assert not waited, "the run waited the ready budget for the silent standby"
    assert response[0].token_ids, "no answer"
    assert labelled_pids(label) == [], "the silent standby was left behind"
