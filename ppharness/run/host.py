"""``pp-host``: several nodes on one machine, one ``pp-node`` process per GPU.

A rented machine with K GPUs runs one instance and so one command. A plan placing K nodes on it (devices with the
same ``source.host``) gives that command one environment holding all of them:

- ``PP_HOST_NODES=K``;
- entries every node shares, as they are (``SEED_ADDR``, ``MODEL``, ...);
- each node's own entries with the prefix ``PP_N<k>_`` (``PP_N0_STAGE``, ``PP_N0_PLAN``, ``PP_N0_CUDA_VISIBLE_DEVICES``,
  ...), ``k`` from 0.

``pp-host`` starts node k with the shared entries plus its own (prefix removed), each line of its output prefixed
with ``[node k]``. It ends when the first node ends: the others are stopped (SIGTERM, then SIGKILL after
``GRACE_S``) and it exits with that node's code, so the instance's status says a node failed as it would for one
node. SIGTERM and SIGINT are passed on to every node. ``split_env``/``host_env`` are the two directions of the
encoding; the vast.ai provider writes it, ``pp-host`` reads it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from types import FrameType
from typing import IO

COUNT_VAR = "PP_HOST_NODES"
MAX_NODES = 64  # GPUs of one machine, with room to spare
GRACE_S = 5.0
POLL_S = 0.2
_PREFIX = re.compile(r"^PP_N(\d{1,2})_(.+)$")


class HostError(ValueError):
    """The environment does not describe the nodes of a host."""


def node_prefix(k: int) -> str:
    return f"PP_N{k}_"


def host_env(envs: list[dict[str, str]]) -> dict[str, str]:
    """One environment for the nodes ``envs``: what they share, and each one's own entries under ``PP_N<k>_``."""
    if not 1 <= len(envs) <= MAX_NODES:
        raise HostError(f"a host runs 1 to {MAX_NODES} nodes, not {len(envs)}")
    shared = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}
    out = {COUNT_VAR: str(len(envs)), **shared}
    for k, env in enumerate(envs):
        out.update({node_prefix(k) + name: value for name, value in env.items() if name not in shared})
    return out


def split_env(env: Mapping[str, str]) -> list[dict[str, str]]:
    """Each node's environment from a host's (``host_env``'s inverse; entries of neither kind are shared)."""
    try:
        count = int(env.get(COUNT_VAR, ""))
    except ValueError:
        raise HostError(f"{COUNT_VAR} must be a whole number of nodes, 1 to {MAX_NODES}") from None
    if not 1 <= count <= MAX_NODES:
        raise HostError(f"{COUNT_VAR} must be 1 to {MAX_NODES}, not {count}")
    shared: dict[str, str] = {}
    own: list[dict[str, str]] = [{} for _ in range(count)]
    for name, value in env.items():
        m = _PREFIX.match(name)
        if name == COUNT_VAR:
            continue
        if m is None:
            shared[name] = value
        elif int(m[1]) < count:
            own[int(m[1])][m[2]] = value
        else:
            raise HostError(f"{name}: node {m[1]} of a host of {count} ({COUNT_VAR})")
    return [shared | mine for mine in own]


def _relay(k: int, stream: IO[bytes]) -> None:
    """Copy node ``k``'s output to ours, a line at a time, each line prefixed with ``[node k]``."""
    out = sys.stdout.buffer
    for line in iter(stream.readline, b""):
        out.write(f"[node {k}] ".encode() + line)
        out.flush()


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_host(env: Mapping[str, str], command: list[str]) -> int:
    """Start ``command`` once per node of ``env``; the first node's exit ends the others. Its exit code."""
    envs = split_env(env)
    procs: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    relays = []
    try:
        for k, node_env in enumerate(envs):
            p = subprocess.Popen(command, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            procs.append(p)
            assert p.stdout is not None, "stdout is a pipe"
            relays.append(threading.Thread(target=_relay, args=(k, p.stdout), daemon=True))
            relays[-1].start()
        while True:
            ended = [(k, p.returncode) for k, p in enumerate(procs) if p.poll() is not None]
            if ended:
                k, code = ended[0]
                print(f"pp-host: node {k} exited with code {code}; stopping the other nodes", flush=True)
                return code
            time.sleep(POLL_S)
    finally:
        _stop(procs)
        for t in relays:
            t.join(timeout=1.0)
        for p in procs:
            if p.stdout is not None:
                p.stdout.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main() -> None:
    try:
        code = run_host(os.environ, ["pp-node"])
    except (HostError, OSError) as exc:
        print(f"pp-host: {exc}", file=sys.stderr, flush=True)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
