"""The heartbeat engine's judge (``HeartbeatDetector``): silence past ``dead_after_s`` is death once a stage is
Ready; while it loads its blocks (a crowded machine may keep its heartbeat thread waiting) only past the loading
grace; a spare that takes a stage over loads again."""

from __future__ import annotations

from ppharness.run.membership import LOADING_GRACE_S, HeartbeatDetector
from ppharness.wire.messages import Ready


def ready(stage: int) -> Ready:
    return Ready(stage=stage, params=1, tied_params=0, load_s=0.1, rss_bytes=1)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_loading_stage_is_judged_by_the_grace_and_a_ready_one_by_dead_after():
    clock = Clock()
    d = HeartbeatDetector(2, heartbeat_s=0.25, suspect_after=2, dead_after_s=1.5, clock=clock)
    d.watch([0, 1])
    assert d.on_message(ready(1)) is False, "a Ready is not a heartbeat: the session still gets it"
    clock.t += 3.0
    assert [s for s, _ in d.dead()] == [1], "a Ready stage silent for 3 s is dead; a loading one is not yet"
    clock.t += LOADING_GRACE_S
    dead = dict(d.dead())
    assert sorted(dead) == [0, 1] and "while loading" in dead[0] and "while loading" not in dead[1]


def test_a_spare_that_takes_over_loads_again():
    clock = Clock()
    d = HeartbeatDetector(1, heartbeat_s=0.25, suspect_after=2, dead_after_s=1.5, clock=clock)
    d.watch([0])
    d.on_message(ready(0))
    d.forget(0)
    d.replace(0, "stage-0-e1")
    clock.t += 3.0
    assert d.dead() == []
    d.on_message(ready(0))
    assert [s for s, _ in d.dead()] == [0]
