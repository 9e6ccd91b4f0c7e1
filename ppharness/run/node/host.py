"""``pp-host``: several nodes on one machine, one ``pp-node`` process per GPU.

A rented machine with K GPUs runs one instance and so one command. A plan placing K nodes on it (devices with the
same ``source.host``) gives that command one environment holding all of them:

- ``PP_HOST_NODES=K``;
- entries every node shares, as they are (``SEED_ADDR``, ``MODEL``, ``PP_BIND_HOST``, ...);
- ``PP_HOST_OWN``: each node's own entries (``STAGE``, ``PLAN``, ``PP_PORT``, ``CUDA_VISIBLE_DEVICES``, ...), a JSON
  list of K objects, compressed together (``zlib:`` and base64, as a long ``PLAN`` is): the nodes of one host have
  much in common (the run's keys, their programs' shape), so the host's environment stays within what one instance
  may carry (vast.ai: 32 KiB) where K programs compressed one by one would not. Decompression stops at
  ``MAX_OWN_BYTES``; anything but K flat objects of entries a process's environment can carry (a name of letters,
  digits and ``_``, UTF-8 text without NUL, at most ``MAX_ENTRIES`` of at most ``MAX_ENTRY_BYTES`` each) is refused
  in one line before any node starts (``split_env`` itself decodes any text ``host_env`` encodes).

``pp-host`` starts node k with the shared entries plus its own, each line of its output prefixed with ``[node k]``. It
ends when the first node ends: the others are stopped (SIGTERM, then SIGKILL after ``GRACE_S``) and it exits with
that node's code, so the instance's status says a node failed as it would for one node. SIGTERM and SIGINT are
passed on to every node. ``host_env``/``split_env`` are the two directions of the encoding; the vast.ai provider
writes it, ``pp-host`` reads it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Mapping
from types import FrameType
from typing import IO

import msgspec

COUNT_VAR, OWN_VAR = "PP_HOST_NODES", "PP_HOST_OWN"
MAX_NODES = 64  # GPUs of one machine, with room to spare
MAX_OWN_BYTES = 16 << 20
MAX_ENTRIES = 1024  # one node's own entries; a node has a handful
MAX_ENTRY_BYTES = 128 << 10  # one NAME=value of a process's environment on Linux (MAX_ARG_STRLEN)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SHOWN = 60  # characters of a refused name in its message
ZLIB_PREFIX = "zlib:"
GRACE_S = 5.0
POLL_S = 0.2


class HostError(ValueError):
    """The environment does not describe the nodes of a host."""


def host_env(envs: list[dict[str, str]]) -> dict[str, str]:
    """One environment for the nodes ``envs``: what they share, and each one's own entries in ``PP_HOST_OWN``."""
    if not 1 <= len(envs) <= MAX_NODES:
        raise HostError(f"a host runs 1 to {MAX_NODES} nodes, not {len(envs)}")
    shared = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}
    own = [{name: value for name, value in env.items() if name not in shared} for env in envs]
    packed = ZLIB_PREFIX + base64.b64encode(zlib.compress(json.dumps(own, separators=(",", ":")).encode(), 9)).decode()
    return {COUNT_VAR: str(len(envs)), OWN_VAR: packed, **shared}


def split_env(env: Mapping[str, str]) -> list[dict[str, str]]:
    """Each node's environment from a host's (``host_env``'s inverse)."""
    shared, own = _split(env)
    return [shared | mine for mine in own]


def _split(env: Mapping[str, str]) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The entries a host's nodes share, and each node's own."""
    try:
        count = int(env.get(COUNT_VAR, ""))
    except ValueError:
        raise HostError(f"{COUNT_VAR} must be a whole number of nodes, 1 to {MAX_NODES}") from None
    if not 1 <= count <= MAX_NODES:
        raise HostError(f"{COUNT_VAR} must be 1 to {MAX_NODES}, not {count}")
    own = _own_entries(env.get(OWN_VAR, ""))
    if len(own) != count:
        raise HostError(f"{OWN_VAR} holds {len(own)} node(s), {COUNT_VAR} says {count}")
    return {k: v for k, v in env.items() if k not in (COUNT_VAR, OWN_VAR)}, own


def _own_entries(packed: str) -> list[dict[str, str]]:
    """The nodes' own entries in ``packed``, ``host_env``'s ``PP_HOST_OWN``."""
    if not packed.startswith(ZLIB_PREFIX):
        raise HostError(f"{OWN_VAR} must be the nodes' own entries, zlib: and base64")
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.b64decode(packed[len(ZLIB_PREFIX) :], validate=True), MAX_OWN_BYTES)
    except (ValueError, zlib.error) as exc:
        raise HostError(f"{OWN_VAR} is not the nodes' own entries: {type(exc).__name__}") from None
    if inflater.unconsumed_tail or not inflater.eof:
        raise HostError(f"{OWN_VAR} inflates past {MAX_OWN_BYTES:,} bytes or is cut short")
    if inflater.unused_data:
        raise HostError(f"{OWN_VAR} has trailing bytes after the compressed entries")
    return _decode(raw)


def _decode(raw: bytes) -> list[dict[str, str]]:
    """``raw`` as a JSON list of flat objects of text, decoded to that type, so that nesting is refused where it
    starts.

    A lone surrogate escape (``\\ud800``) fails the typed decoding without naming its entry. If ``raw`` decodes with
    every surrogate escape made an ordinary one, its shape is known to be flat, and ``json`` decodes it as it is for
    ``_check_entries`` to name the entry."""
    try:
        return msgspec.json.decode(raw, type=list[dict[str, str]])
    except msgspec.DecodeError:
        pass
    try:
        msgspec.json.decode(raw.replace(b"\\ud", b"\\u0").replace(b"\\uD", b"\\u0"), type=list[dict[str, str]])
    except msgspec.ValidationError as exc:
        raise HostError(f"{OWN_VAR} must be a list of objects of text entries, one per node ({exc})") from None
    except msgspec.DecodeError as exc:
        raise HostError(f"{OWN_VAR} is not the nodes' own entries: {exc}") from None
    own: list[dict[str, str]] = json.loads(raw.decode())
    return own


def _check_entries(k: int, entries: dict[str, str]) -> None:
    """Refuse node ``k``'s own entries unless its process's environment can carry each of them."""
    if len(entries) > MAX_ENTRIES:
        raise HostError(f"{OWN_VAR}: node {k} has {len(entries):,} entries of its own, more than {MAX_ENTRIES:,}")
    for name, value in entries.items():
        if not _NAME.fullmatch(name):
            shown = repr(name[:_SHOWN]) + ("..." if len(name) > _SHOWN else "")
            raise HostError(
                f"{OWN_VAR}: node {k}'s entry {shown} is not an environment variable name: letters, digits and _, "
                "not starting with a digit"
            )
        where = f"{OWN_VAR}: node {k}'s entry {name}"
        if "\0" in value:
            raise HostError(f"{where} holds a NUL character, which no environment can carry")
        try:
            size = len(name) + 1 + len(value.encode())
        except UnicodeEncodeError:
            raise HostError(f"{where} is not valid UTF-8 text (a lone surrogate)") from None
        if size > MAX_ENTRY_BYTES:
            raise HostError(
                f"{where} is {size:,} bytes, more than one environment entry may hold ({MAX_ENTRY_BYTES:,})"
            )


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
    """Start ``command`` once per node of ``env``, once every node's own entries are known to be ones a process's
    environment can carry; the first node's exit ends the others. Its exit code."""
    shared, own = _split(env)
    for k, entries in enumerate(own):
        _check_entries(k, entries)
    envs = [shared | mine for mine in own]
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
