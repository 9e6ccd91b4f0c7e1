"""``pp-host`` refuses every ``PP_HOST_OWN`` it cannot pass on to its nodes as they are: deep nesting, text no
environment can carry (a lone surrogate, a NUL), names no environment can hold, trailing bytes after the compressed
entries, too many or too large entries. Each is the real ``pp-host`` process: exit 1, one line naming what is wrong,
no traceback; a good value still starts its nodes."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from ppharness.run.node.host import COUNT_VAR, MAX_ENTRIES, MAX_ENTRY_BYTES, OWN_VAR, host_env

DEEP = 10**6
# prints, then waits (10 s at most) until every node of the host has printed, so that none is stopped before it does
FAKE_NODE = """#!/bin/sh
echo "node $STAGE says $GREETING"
touch "$READY/$STAGE"
for _ in $(seq 200); do [ "$(ls "$READY" | wc -l)" -ge "$PP_TEST_NODES" ] && exit 0; sleep 0.05; done
"""


def _packed(raw: bytes, tail: bytes = b"") -> str:
    return "zlib:" + base64.b64encode(zlib.compress(raw, 9) + tail).decode()


def _pp_host(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``pp-host`` with ``env`` over this environment, a ``pp-node`` on its PATH that prints and exits 0."""
    node, ready = tmp_path / "pp-node", tmp_path / "ready"
    node.write_text(FAKE_NODE)
    node.chmod(0o755)
    ready.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("PP_HOST")}
    path = f"{tmp_path}{os.pathsep}{base.get('PATH', '')}"
    full = {**base, "PATH": path, "READY": str(ready), "PP_TEST_NODES": env.get(COUNT_VAR, "1"), **env}
    cmd = [sys.executable, "-m", "ppharness.run.node.host"]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("own", "nodes", "says"),
    [
        pytest.param(
            _packed(b"[" * DEEP + b"]" * DEEP),
            1,
            "PP_HOST_OWN must be a list of objects of text entries, one per node",
            id="list-nested-10^6-deep",
        ),
        pytest.param(
            _packed(b'[{"A":' + b"[" * DEEP + b"]" * DEEP + b"}]"),
            1,
            "PP_HOST_OWN must be a list of objects of text entries, one per node",
            id="value-nested-10^6-deep",
        ),
        pytest.param(
            _packed(b'[{"A":"\\ud800"}]'),
            1,
            "PP_HOST_OWN: node 0's entry A is not valid UTF-8 text (a lone surrogate)",
            id="lone-high-surrogate",
        ),
        pytest.param(
            _packed(b'[{"A":"1"},{"B":"x\\udc80"}]'),
            2,
            "PP_HOST_OWN: node 1's entry B is not valid UTF-8 text (a lone surrogate)",
            id="lone-low-surrogate",
        ),
        pytest.param(
            _packed(b'[{"A":"\\ud800"},' + b"[" * DEEP + b"]" * DEEP + b"]"),
            2,
            "PP_HOST_OWN must be a list of objects of text entries, one per node",
            id="lone-surrogate-then-nested-10^6-deep",
        ),
        pytest.param(
            _packed(b'[{"A\\ud800":"1"}]'),
            1,
            "PP_HOST_OWN: node 0's entry 'A\\ud800' is not an environment variable name",
            id="surrogate-in-name",
        ),
        pytest.param(
            _packed(b'[{"A":"a\\u0000b"}]'),
            1,
            "PP_HOST_OWN: node 0's entry A holds a NUL character, which no environment can carry",
            id="nul-in-value",
        ),
        pytest.param(
            _packed(b'[{"A\\u0000B":"1"}]'),
            1,
            "PP_HOST_OWN: node 0's entry 'A\\x00B' is not an environment variable name",
            id="nul-in-name",
        ),
        pytest.param(
            _packed(b'[{"A=B":"1"}]'),
            1,
            "PP_HOST_OWN: node 0's entry 'A=B' is not an environment variable name",
            id="equals-in-name",
        ),
        pytest.param(
            _packed(b'[{"":"1"}]'),
            1,
            "PP_HOST_OWN: node 0's entry '' is not an environment variable name",
            id="empty-name",
        ),
        pytest.param(
            _packed(b'[{"STAGE":"0"}]', tail=b"more"),
            1,
            "PP_HOST_OWN has trailing bytes after the compressed entries",
            id="trailing-bytes",
        ),
        pytest.param(
            _packed(b'[{"A":"\xff"}]'),
            1,
            "PP_HOST_OWN is not the nodes' own entries: Invalid UTF-8",
            id="bad-utf8-bytes",
        ),
        pytest.param(
            _packed(b'[{"A":"1"}] ['),
            1,
            "PP_HOST_OWN is not the nodes' own entries: JSON is malformed",
            id="trailing-json",
        ),
        pytest.param(
            _packed(("[{" + ",".join(f'"A{i}":""' for i in range(MAX_ENTRIES + 1)) + "}]").encode()),
            1,
            f"PP_HOST_OWN: node 0 has {MAX_ENTRIES + 1:,} entries of its own, more than {MAX_ENTRIES:,}",
            id="too-many-entries",
        ),
        pytest.param(
            _packed(b'[{"PLAN":"' + b"x" * MAX_ENTRY_BYTES + b'"}]'),
            1,
            "PP_HOST_OWN: node 0's entry PLAN is 131,077 bytes, more than one environment entry may hold (131,072)",
            id="entry-too-large",
        ),
    ],
)
def test_a_bad_pp_host_own_is_refused_in_one_line(tmp_path: Path, own: str, nodes: int, says: str) -> None:
    proc = _pp_host(tmp_path, {COUNT_VAR: str(nodes), OWN_VAR: own})
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"pp-host: {says}"), lines[0]
    assert "[node" not in proc.stdout, "no node is started"


def test_a_good_pp_host_own_starts_its_nodes(tmp_path: Path) -> None:
    env = host_env([{"STAGE": str(k), "GREETING": "hello", "CUDA_VISIBLE_DEVICES": str(k)} for k in range(2)])
    proc = _pp_host(tmp_path, env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "[node 0] node 0 says hello" in proc.stdout and "[node 1] node 1 says hello" in proc.stdout
