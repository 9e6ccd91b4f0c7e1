"""`ppharness reap` touches only dead runs of this user; a live run is never reaped; one label, one live run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from backends.local import labelled_pids
from ppharness.run.seed.locks import RunLabelInUse, RunLock, known_runs, run_state

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def state(tmp_path, monkeypatch):
    """A state dir of this test's own, for this process and the commands it runs."""
    monkeypatch.setenv("PPHARNESS_STATE", str(tmp_path / "state"))
    return tmp_path / "state"


def _label(what: str) -> str:
    return f"pp-test-{what}-{uuid.uuid4().hex[:6]}"


def _fake_node(tmp_path: Path, label: str) -> subprocess.Popen:
    """A stand-in pp-node process carrying ``label`` (sleeps until killed)."""
    script = tmp_path / "pp-node"
    script.write_text("import time\ntime.sleep(120)\n")
    proc = subprocess.Popen(
        [sys.executable, str(script)], env={**os.environ, "PP_RUN_LABEL": label}, start_new_session=True
    )
    deadline = time.monotonic() + 10
    while not labelled_pids(label) and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def _dead_run(label: str) -> None:
    """A run whose orchestrator is gone: it took the lock, then died without letting go of it properly."""
    code = f"import os; from ppharness.run.seed.locks import RunLock; RunLock({label!r}).acquire(); os._exit(9)"
    subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, timeout=60)


def _reap(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ppharness.cli", "reap", "--provider", "local", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_a_label_is_held_by_one_live_run(state):
    label = _label("lock")
    with RunLock(label):
        assert run_state(label).state == "live" and run_state(label).pid == os.getpid()
        with pytest.raises(RunLabelInUse, match="is in use by a live run"):
            RunLock(label).acquire()
    assert run_state(label).state == "unknown"  # a clean end forgets the run
    _dead_run(label)
    assert run_state(label).state == "dead"
    RunLock(label).acquire().release()  # a dead run's label can be used again


def test_reap_takes_dead_runs_and_keeps_live_and_unknown_ones(state, tmp_path):
    live, dead, unknown = _label("live"), _label("dead"), _label("unknown")
    _dead_run(dead)
    procs = {}
    with RunLock(live):
        for label in (live, dead, unknown):
            (tmp_path / label).mkdir()
            procs[label] = _fake_node(tmp_path / label, label)
        try:
            listed = _reap("--dry-run")
            assert listed.returncode == 0, listed.stderr
            assert f"would destroy local: process {procs[dead].pid} (run {dead})" in listed.stdout
            assert f"process {procs[live].pid} (run {live}): live run, kept" in listed.stdout
            assert f"process {procs[unknown].pid} (run {unknown}): unknown run, kept" in listed.stdout
            assert all(labelled_pids(label) for label in procs), "a dry run destroyed something"

            reaped = _reap()
            assert reaped.returncode == 0, reaped.stderr
            assert f"destroyed local: process {procs[dead].pid} (run {dead})" in reaped.stdout
            procs[dead].wait(10)
            assert not labelled_pids(dead) and labelled_pids(live) and labelled_pids(unknown)
            assert dead not in {r.label for r in known_runs()}, "a reaped dead run stays registered"

            refused = _reap("--label", live)
            assert refused.returncode == 1 and f"run {live} is live" in refused.stdout + refused.stderr
            assert labelled_pids(live)

            named = _reap("--label", unknown)  # named, a run this machine does not know is reaped
            assert named.returncode == 0 and f"process {procs[unknown].pid}" in named.stdout
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()


def test_a_shell_with_the_label_in_its_environment_is_not_killed(state):
    label = _label("shell")
    shell = subprocess.Popen(
        ["sh", "-c", "sleep 60"], env={**os.environ, "PP_RUN_LABEL": label}, start_new_session=True
    )
    try:
        r = _reap("--label", label)
        assert r.returncode == 0 and "nothing to reap" in r.stdout, r.stdout
        assert shell.poll() is None, "reap killed a process that is not a node"
    finally:
        shell.kill()
        shell.wait()


def test_a_second_run_with_a_live_runs_label_is_refused_and_touches_nothing(state, tmp_path):
    label = _label("twice")
    with RunLock(label):
        node = _fake_node(tmp_path, label)
        try:
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ppharness.cli.smoke",
                    "-n",
                    "2",
                    "--max-tokens",
                    "4",
                    "-q",
                    "--run-label",
                    label,
                ],
                capture_output=True,
                text=True,
                timeout=300,
                cwd=ROOT,
            )
            assert r.returncode == 1
            assert f"run label '{label}' is in use by a live run (pid {os.getpid()}" in r.stdout + r.stderr
            assert node.poll() is None and labelled_pids(label), "the refused run destroyed the live run's node"
        finally:
            node.kill()
            node.wait()


def test_strict_fails_on_anything_left_but_a_live_run(state, tmp_path):
    label = _label("strict")
    node = _fake_node(tmp_path, label)
    try:
        r = _reap("--strict", "--dry-run")
        assert r.returncode == 1 and "leftover resource(s)" in r.stdout + r.stderr
    finally:
        node.kill()
        node.wait()


def test_a_run_that_fails_before_any_node_starts_lets_go_of_its_label(state, tmp_path):
    """The lock is taken first; a failure after it (here: a model file that does not exist) still releases it."""
    from ppharness.errors import HarnessError
    from ppharness.run.seed.orchestrator import Chain
    from ppharness.scenario.schema import Scenario
    from ppharness.scenario.sections import ModelSection

    label = _label("early")
    scenario = Scenario(version=1, model=ModelSection(gguf=str(tmp_path / "missing.gguf")))
    with pytest.raises(HarnessError):
        with Chain(scenario, lambda line: None, label):
            pass
    assert run_state(label).state == "unknown", "a run that failed cleanly stays registered"
    RunLock(label).acquire().release()  # the label is free in this very process
