"""``ppharness bench failover``: how long a run takes to fail cleanly after a stage dies mid-decode.

Each run starts ``pp-smoke-run`` with a long request, waits until decoding has begun, signals one stage's process
(SIGKILL: the process is gone and the provider sees it exit; SIGSTOP: the process stays but goes silent, so only the
membership engine can notice), and times until ``pp-smoke-run`` exits. It checks every run exited 1 and left no
process with the run's label, and prints the median over the runs.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import msgspec

from ppharness.benchmarks.watched import WatchedRun
from ppharness.errors import HarnessError
from ppharness.registry import provider_class
from ppharness.scenario.schema import scenario_from_args

if TYPE_CHECKING:
    from backends.local import LocalProvider

SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP}


@dataclass
class FailoverRun:
    seconds: float
    exit_code: int
    reason: str
    leftovers: int


def _labelled_pids(label: str) -> list[int]:
    # the registry types every kind as a plain Provider; ``labelled`` is the local provider's own
    local = cast("type[LocalProvider]", provider_class("local"))
    return local.labelled(label)


def _scenario_file(num_stages: int, engine: str) -> str:
    sc = scenario_from_args(num_stages=num_stages, max_tokens=200)
    sc = msgspec.structs.replace(sc, cluster=msgspec.structs.replace(sc.cluster, engine=engine))
    fd, path = tempfile.mkstemp(prefix="ppharness-failover-", suffix=".yaml")
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.yaml.encode(sc))
    return path


def run_once(num_stages: int, victim: int, sig: str, engine: str, timeout: float = 120.0) -> FailoverRun:
    """One pp-smoke-run, one signalled stage; the time from the signal to pp-smoke-run's exit."""
    label = f"pp-failover-{uuid.uuid4().hex[:8]}"
    scenario = _scenario_file(num_stages, engine)
    cmd = [sys.executable, "-m", "ppharness.cli.smoke", "--scenario", scenario, "--no-trace", "--run-label", label]
    try:
        with WatchedRun(cmd) as run:
            run.until("request:")
            time.sleep(0.5)  # well into decoding
            pids = _labelled_pids(label)
            stage_pids = [p for p in pids if _stage_of(p) == victim]
            if not stage_pids:
                raise HarnessError(f"no process of stage {victim} found among {pids}")
            t0 = time.monotonic()
            os.kill(stage_pids[0], SIGNALS[sig])
            out = run.finish(timeout)
            seconds = time.monotonic() - t0
            exit_code = run.returncode
            assert exit_code is not None, "finish() returns once the command has ended"
    finally:
        os.unlink(scenario)
    reason = next((ln for ln in out.splitlines() if ln.startswith("FAILED: ")), "(no FAILED line)")
    left = _labelled_pids(label)
    return FailoverRun(seconds=seconds, exit_code=exit_code, reason=reason, leftovers=len(left))


def _stage_of(pid: int) -> int | None:
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    for v in env:
        if v.startswith(b"STAGE="):
            return int(v[6:])
    return None


def run_failover_bench(
    num_stages: int, runs: int, sig: str, engine: str, progress: Callable[[str], None]
) -> list[FailoverRun]:
    victim = num_stages // 2
    results = []
    for i in range(runs):
        r = run_once(num_stages, victim, sig, engine)
        progress(
            f"run {i + 1}/{runs}: SIG{sig} of stage {victim} -> exit {r.exit_code} after {r.seconds:.2f} s; "
            f"{r.leftovers} leftover(s); {r.reason}"
        )
        results.append(r)
    return results


def report(results: list[FailoverRun], num_stages: int, sig: str, engine: str) -> str:
    secs = [r.seconds for r in results]
    ok = all(r.exit_code == 1 and r.leftovers == 0 for r in results)
    return (
        f"{num_stages} stages, SIG{sig} of a middle stage mid-decode, membership {engine}: time to exit 1 "
        f"median {statistics.median(secs):.2f} s (min {min(secs):.2f}, max {max(secs):.2f}, {len(secs)} runs); "
        f"{'every run exited 1 and left nothing' if ok else 'SOME RUNS DID NOT EXIT 1 CLEANLY'}"
    )
