"""Every failure mode of a run (docs/fault-tolerance.md), provoked for real on local pp-node processes: exit 1, a
one-line reason naming the stage, and nothing left behind (the run's labelled processes are counted after the run)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from backends.local import LocalSettings, labelled_pids
from ppharness.benchmarks.watched import WatchedRun
from ppharness.scenario.schema import scenario_from_args
from ppharness.scenario.sections import FaultSection

pytestmark = pytest.mark.local
ROOT = Path(__file__).resolve().parent.parent


def _write(
    tmp_path: Path,
    n: int = 3,
    max_tokens: int = 8,
    faults=(),
    budget: dict | None = None,
    provider_local: LocalSettings | None = None,
    engine: str = "auto",
) -> Path:
    sc = scenario_from_args(num_stages=n, max_tokens=max_tokens)
    sc = msgspec.structs.replace(
        sc,
        faults=tuple(faults),
        budget=msgspec.structs.replace(sc.budget, **(budget or {})),
        cluster=msgspec.structs.replace(sc.cluster, engine=engine),
    )
    if provider_local is not None:
        sc = msgspec.structs.replace(sc, provider=msgspec.structs.replace(sc.provider, local=provider_local))
    path = tmp_path / "scenario.yaml"
    path.write_bytes(msgspec.yaml.encode(sc))
    return path


def _run(scenario: Path, label: str, timeout: float = 240) -> tuple[int, str, float]:
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "ppharness.cli.smoke", "--scenario", str(scenario), "--run-label", label, "--no-trace"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0


def _failed_line(out: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.startswith("FAILED: ")]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.parametrize(
    "fault, budget, needle",
    [
        (FaultSection(stage=1, mode="never-join"), {"join_s": 8.0}, "never converged: stage(s) [1] did not join"),
        (FaultSection(stage=2, mode="no-names"), {"resolve_s": 3.0}, "the name 'pp-stage-2' never resolved"),
        pytest.param(  # waits out its 25 s budget: with the slow tests
            FaultSection(stage=0, mode="stall-before-ready"),
            {"ready_s": 25.0},
            "stage(s) [0] never reported ready",
            marks=pytest.mark.slow,
        ),
        (FaultSection(stage=1, mode="bad-model"), {}, "stage 1: loading the model failed"),
        pytest.param(  # an empty answer's failure line; exit-mid-decode is the default run's failure mid-answer
            FaultSection(stage=2, mode="eos-first"),
            {},
            "stage 2 (last) reported done with no text",
            marks=pytest.mark.slow,
        ),
        (FaultSection(stage=1, mode="exit-mid-decode"), {}, "pp-stage-1 (local"),
    ],
    ids=lambda v: getattr(v, "mode", None) or "",
)
def test_fault_fails_the_run_cleanly(tmp_path, fault, budget, needle):
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    rc, out, _ = _run(_write(tmp_path, faults=[fault], budget=budget), label)
    assert rc == 1, out
    assert needle in _failed_line(out), out
    if fault.mode in ("never-join", "stall-before-ready"):  # the silent stage's own log explains it
        assert f"last lines of pp-stage-{fault.stage}" in out and f"fault {fault.mode}" in out, out
    assert "reaped leftover" not in out, "a node outlived the run and had to be reaped"
    assert not labelled_pids(label)


def test_destroy_failure_warns_destroys_the_others_and_exits_1(tmp_path):
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    rc, out, _ = _run(_write(tmp_path, provider_local=LocalSettings(fail_destroy=(1,))), label)
    assert rc == 1, out
    assert "warning: destroying pp-stage-1" in out and "injected by provider.local.fail_destroy" in out
    assert "could not be destroyed" in _failed_line(out)
    assert not labelled_pids(label)  # it stopped on Shutdown, or the run's last sweep reaped it


def test_reap_command_destroys_a_crashed_runs_leftovers(tmp_path):
    """A node whose orchestrator vanished (simulated: a stand-in pp-node started by hand with a label) is found and
    destroyed."""
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    import os

    node = tmp_path / "pp-node"
    node.write_text("import time\ntime.sleep(120)\n")
    proc = subprocess.Popen(
        [sys.executable, str(node)], env={**os.environ, "PP_RUN_LABEL": label}, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 10
        while not labelled_pids(label) and time.monotonic() < deadline:
            time.sleep(0.05)
        r = subprocess.run(
            [sys.executable, "-m", "ppharness.cli", "reap", "--label", label],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0 and f"process {proc.pid}" in r.stdout, r.stdout + r.stderr
        proc.wait(10)
        assert not labelled_pids(label)
        r = subprocess.run(
            [sys.executable, "-m", "ppharness.cli", "reap", "--label", label],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "nothing to reap" in r.stdout
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize(
    "phase, sig",
    [
        ("membership:", signal.SIGINT),
        ("joined", signal.SIGINT),
        pytest.param("ready", signal.SIGINT, marks=pytest.mark.slow),  # SIGTERM-ready's way, another signal
        ("request:", signal.SIGINT),
        ("ready", signal.SIGTERM),
        pytest.param("request:", signal.SIGHUP, marks=pytest.mark.slow),  # SIGINT-request's way, another signal
    ],
    ids=["SIGINT-membership", "SIGINT-joined", "SIGINT-ready", "SIGINT-request", "SIGTERM-ready", "SIGHUP-request"],
)
def test_an_interrupt_at_any_phase_stops_everything(tmp_path, phase, sig):
    """Ctrl-C, SIGTERM and SIGHUP (a closed terminal) all take the clean way out: every node stopped, exit 128 + the
    signal (the shell's convention: 130 for Ctrl-C)."""
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    cmd = [
        sys.executable,
        "-m",
        "ppharness.cli.smoke",
        "--scenario",
        str(_write(tmp_path, max_tokens=200)),
        "--run-label",
        label,
    ]
    with WatchedRun(cmd, cwd=ROOT) as run:
        run.until(phase)
        run.proc.send_signal(sig)
        out = run.finish(timeout=60)
    assert run.returncode == 128 + sig, out
    if sig != signal.SIGHUP:  # after a hang-up the terminal is gone: the run writes nothing more
        assert "FAILED: interrupted" in out
    assert not labelled_pids(label)


@pytest.mark.parametrize("engine", ["kinship", "heartbeat"])
def test_membership_engine_declares_a_silent_node_dead(engine):
    """With the provider's own exit check out of the way, the membership engine alone notices a SIGSTOPped node."""
    import os

    from ppharness.run.seed.orchestrator import Chain, Progress

    sc = scenario_from_args(num_stages=2, max_tokens=4)
    sc = msgspec.structs.replace(
        sc, cluster=msgspec.structs.replace(sc.cluster, engine=engine, heartbeat_s=0.5, dead_after_s=3.0)
    )
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    with pytest.raises(Exception) as info:
        with Chain(sc, Progress(quiet=True), run_label=label) as chain:
            chain.request("hello", 2)
            victim = int(next(i for i in chain._provider.instances if i.name == "pp-stage-1").id)
            os.kill(victim, signal.SIGSTOP)  # alive to the OS, silent to the cluster
            chain.request("hello again", 50)
    assert "pp-stage-1 died while decoding" in str(info.value), str(info.value)
    assert not labelled_pids(label)
