"""Which runs are alive: a lock file per run label, held by the orchestrator for as long as the run lives.

``RunLock(label)`` is taken when a run starts (``Chain``): ``<state dir>/runs/<label>.lock``, locked with ``flock``
and holding the orchestrator's pid, start time and command line. The kernel drops the lock when the process ends,
however it ends (SIGKILL included), so a lock file that can be locked again belongs to a dead run. From this:

- a second run given a label that a live run holds is refused at start, before it creates anything;
- ``ppharness reap`` without ``--label`` reaps only labels whose run is known here and dead: registered in this
  user's state dir (so started by this user, on this machine) and no longer locked. A live run is never reaped, and
  neither is a label this machine knows nothing about (another user's, another machine's) unless named with
  ``--label``.

The state dir is ``$PPHARNESS_STATE`` or ``~/.local/state/ppharness`` (``.ci/run`` points it at a fresh folder so
that CI reaps only the runs of its own suite).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypedDict

from ppharness.errors import HarnessError

LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

State = Literal["live", "dead", "unknown"]


class LockRecord(TypedDict, total=False):
    """What a lock file holds (JSON): the orchestrator's pid and start time (``time.time()``)."""

    pid: int
    started: float


class RunLabelInUse(HarnessError):
    """Another live run holds this label."""


def state_dir() -> Path:
    return Path(os.environ.get("PPHARNESS_STATE") or Path.home() / ".local" / "state" / "ppharness")


def _lock_path(label: str) -> Path:
    if not LABEL.match(label):
        raise HarnessError(
            f"run label {label!r} must be 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return state_dir() / "runs" / f"{label}.lock"


@dataclass(frozen=True)
class RunInfo:
    label: str
    state: State
    pid: int | None = None
    started: float | None = None


class RunLock:
    """Held for the life of one run; ``acquire`` raises RunLabelInUse when a live run holds the label."""

    def __init__(self, label: str):
        self.label = label
        self.path = _lock_path(label)
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            since = time.strftime("%H:%M:%S", time.localtime(holder["started"])) if holder.get("started") else "?"
            raise RunLabelInUse(
                f"run label {self.label!r} is in use by a live run (pid {holder.get('pid', '?')}, "
                f"started {since}); pick another --run-label, or leave it out for a fresh one"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "started": time.time()}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        """Forget the run: remove its lock file (the run's resources are gone), then let go of the lock."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def abandon(self) -> None:
        """Let go of the lock but keep the file: the run is over, and ``ppharness reap`` will see it as dead."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read(fd: int) -> LockRecord:
    try:
        record: LockRecord = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return record


def run_state(label: str) -> RunInfo:
    """Whether the run holding ``label`` is live, dead (known here, its orchestrator gone) or unknown here."""
    try:
        path = _lock_path(label)
    except HarnessError:
        return RunInfo(label, "unknown")
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return RunInfo(label, "unknown")
    try:
        info = _read(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return RunInfo(label, "live", info.get("pid"), info.get("started"))
        fcntl.flock(fd, fcntl.LOCK_UN)
        return RunInfo(label, "dead", info.get("pid"), info.get("started"))
    finally:
        os.close(fd)


def forget(label: str) -> None:
    """Remove a dead run's lock file once its resources are reaped (a live run's is left alone)."""
    if run_state(label).state == "dead":
        _lock_path(label).unlink(missing_ok=True)


def known_runs() -> list[RunInfo]:
    """Every run registered in this user's state dir, with its state."""
    folder = state_dir() / "runs"
    if not folder.is_dir():
        return []
    return [run_state(p.stem) for p in sorted(folder.glob("*.lock"))]
