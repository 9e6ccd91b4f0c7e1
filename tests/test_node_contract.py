"""pp-node refuses a bad environment with one clear line and exit 1."""

from __future__ import annotations

import os
import subprocess
import sys


def _node(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("STAGE", "NUM_STAGES", "SEED_ADDR", "MODEL", "PLAN", "TRANSPORT")
    }
    return subprocess.run(
        [sys.executable, "-m", "ppharness.run.node.main"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_missing_environment_is_named():
    r = _node({"STAGE": "0"})
    assert r.returncode == 1
    assert "missing environment variable(s) NUM_STAGES, SEED_ADDR, MODEL, PLAN, TRANSPORT" in r.stderr


def test_plan_that_disagrees_with_stage_is_rejected():
    plan = '{"plan_id":"p","stage":1,"num_stages":2,"lo":0,"hi":4}'
    r = _node(
        {
            "STAGE": "0",
            "NUM_STAGES": "2",
            "SEED_ADDR": "tcp://127.0.0.1:1",
            "MODEL": "x",
            "PLAN": plan,
            "TRANSPORT": "zmq",
        }
    )
    assert r.returncode == 1 and "PLAN says stage 1 of 2, but STAGE=0" in r.stderr


def test_unknown_plan_field_is_rejected():
    r = _node(
        {
            "STAGE": "0",
            "NUM_STAGES": "1",
            "SEED_ADDR": "tcp://127.0.0.1:1",
            "MODEL": "x",
            "PLAN": '{"plan_id":"p","stage":0,"num_stages":1,"lo":0,"hi":4,"colour":1}',
            "TRANSPORT": "zmq",
        }
    )
    assert r.returncode == 1 and "PLAN is not a valid stage plan" in r.stderr and "colour" in r.stderr
