"""``ppharness bench wan``: the chain over emulated WAN links, measured against the bound the network sets."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ppharness.benchmarks.wan_chain import TARGET_RATIO, plan_cases

ROOT = Path(__file__).resolve().parent.parent


def test_cases_cover_every_delay_and_loss_only_where_quic_recovers_it():
    cases = plan_cases(["tiny"], ["zmq", "iroh"], [0, 25], [1, 5])
    assert [(c.transport, c.layer, c.delay_ms, c.loss_pct) for c in cases] == [
        ("zmq", "message", 0, 0),
        ("zmq", "message", 25, 0),
        ("iroh", "packet", 0, 0),
        ("iroh", "packet", 25, 0),
        ("iroh", "packet", 25, 1),
        ("iroh", "packet", 25, 5),
    ]
    network = cases[-1].network(seed=3)
    assert network.layer == "packet" and network.seed == 3
    assert network.impairment("stage-0", "stage-1").delay_ms == 25 and network.impairment("stage-0", "stage-1").loss
    assert network.impairment("seed", "stage-0").perfect and network.impairment("stage-2", "seed").perfect


@pytest.mark.local
@pytest.mark.slow
def test_bench_wan_measures_the_chain_against_its_bound(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ppharness.cli",
            "bench",
            "wan",
            "--presets",
            "tiny",
            "--transports",
            "zmq",
            "--delays",
            "0,25",
            "--repeats",
            "1",
            "--tokens",
            "16",
            "--num-stages",
            "3",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "bench-wan.json").read_text())
    assert (tmp_path / "bench-wan.png").stat().st_size > 10_000
    assert (res["num_stages"], res["tokens"], res["repeats"]) == (3, 16, 1)
    assert [(c["transport"], c["layer"], c["delay_ms"], c["loss_pct"]) for c in res["cases"]] == [
        ("zmq", "message", 0, 0),
        ("zmq", "message", 25, 0),
    ]
    for c in res["cases"]:
        assert c["exact"] and len(c["tok_s"]) == 1 and c["tok_s_median"] > 0
        assert set(c["compute_ms"]) == {f"stage {i} compute" for i in range(3)}
        assert c["delay_sum_ms"] == pytest.approx(3 * c["delay_ms"])
        assert c["bound_tok_s"] == pytest.approx(1000 / (c["compute_sum_ms"] + c["delay_sum_ms"]))
        assert c["ratio"] == pytest.approx(c["tok_s_median"] / c["bound_tok_s"])
        assert c["met"] == (c["ratio"] >= TARGET_RATIO)
        assert set(c["hops_ms"]) == {"0->1", "1->2", "2->0"} and 0 < c["hop_p50_ms"] <= c["hop_p99_ms"]
        assert c["decode_tokens"] >= 10
    delayed = res["cases"][1]
    assert 1000 / delayed["tok_s_median"] >= 3 * 25  # three hops of 25 ms each per token, at the least
    assert delayed["hop_p50_ms"] >= 25
    assert "bound" in r.stdout and "ratio" in r.stdout and ("MET" in r.stdout or "MISSED" in r.stdout)
