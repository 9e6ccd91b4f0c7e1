"""A command run in the background whose output is read line by line until a marker shows: how the failover
benchmark and the tests reach a phase of ``pp-smoke-run`` (joined, decoding, ...) before they interrupt it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from types import TracebackType
from typing import TypedDict, Unpack

from ppharness.errors import HarnessError


class PopenOptions(TypedDict, total=False):
    """What ``WatchedRun`` passes on to ``subprocess.Popen`` besides the command (whose output it always reads)."""

    cwd: str | os.PathLike[str]
    env: Mapping[str, str]


class WatchedRun:
    """``cmd`` started with stdout and stderr merged; ``until(marker)`` reads up to the first line containing it;
    ``finish(timeout)`` waits for the end and returns all the output. Leaving the ``with`` kills it if still running
    and closes its pipe."""

    def __init__(self, cmd: list[str], **popen: Unpack[PopenOptions]):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
        self.lines: list[str] = []

    def until(self, marker: str) -> str:
        """Read until a line containing ``marker``, and return that line; HarnessError if the output ends first."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if marker in line:
                return line
        raise HarnessError(f"{marker!r} never showed before the command ended:\n{''.join(self.lines[-15:])}")

    def finish(self, timeout: float) -> str:
        """Wait (bounded) for the command to end; return everything it printed."""
        rest, _ = self.proc.communicate(timeout=timeout)
        return "".join(self.lines) + rest

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def __enter__(self) -> WatchedRun:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
