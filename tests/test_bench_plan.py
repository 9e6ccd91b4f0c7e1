"""``ppharness bench plan``: the calibration's arithmetic (fast), and on docker a real run of the three policies on
one shipped cluster (``slow``, ``docker``): every plan token-exact, predicted and measured per-token times recorded."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from ppharness.benchmarks.plan import PlanBenchResult, PlanCase, calibrated, on_provider, report, shipped_clusters
from ppharness.plan.lang.document import Device, Measured
from ppharness.plan.reader import load_cluster


def test_calibration_gives_every_device_the_probes_speed_and_keeps_its_quota():
    cluster = load_cluster(shipped_clusters()[2])
    stamp = Measured(engine="ppharness 0.1.0/tinygrad 0.12.0/0123456789ab", hardware="here", date="2026-12-03")
    probe = Device(
        id="probe", memory=1 << 30, gflops=0.7, bandwidth_gbs=0.6, overhead_ms=0.9, prefill_ms=3.0, measured=stamp
    )
    got = calibrated(cluster, probe, hop_ms=0.4)
    assert got.hop_ms == 0.4
    assert all((d.gflops, d.overhead_ms, d.prefill_ms) == (0.7, 0.9, 3.0) for d in got.devices)
    assert all(d.measured == stamp for d in got.devices)  # the figures say they are the probe's
    assert [d.source.cpus for d in got.devices] == [d.source.cpus for d in cluster.devices]
    assert {d.source.kind for d in on_provider(cluster, "local").devices} == {"local"}


def test_report_names_the_fastest_policy_and_the_predictions_error():
    res = PlanBenchResult(model="small", provider="docker", tokens=8, repeats=1)
    res.cases = [
        PlanCase("strong", "optimal", "a" * 16, predicted_ms=80.0, measured_ms=76.0, error_pct=5.3),
        PlanCase("strong", "even", "b" * 16, predicted_ms=115.0, measured_ms=114.0, error_pct=0.9),
        PlanCase("strong", "memory", "c" * 16, predicted_ms=115.0, measured_ms=140.0, error_pct=-17.9),
    ]
    text = report(res)
    assert "fastest measured: optimal (the planner: MET)" in text
    assert "within 15 %: MISSED" in text


@pytest.mark.slow
@pytest.mark.docker
def test_bench_plan_runs_every_policy_token_exact_on_docker(tmp_path):
    from click.testing import CliRunner

    from ppharness.cli import main

    homogeneous = str(shipped_clusters()[0])  # whole-CPU containers: the quickest to start
    args = ["bench", "plan", "--cluster", homogeneous, "--tokens", "8", "--repeats", "1", "--out", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "bench-plan.json").read_text())
    assert [c["policy"] for c in data["cases"]] == ["optimal", "even", "memory"]
    for case in data["cases"]:
        assert case["predicted_ms"] > 0 and case["measured_ms"] > 0, case
        assert case["placement"].count("\n") >= 2  # the text form: one line per node and the policy
    assert data["hop_ms"] > 0 and data["probe"]["gflops"] > 0
    # the planner's own plan is its best by the cost model: no other policy is predicted faster
    optimal = data["cases"][0]["predicted_ms"]
    assert all(optimal <= c["predicted_ms"] + 1e-9 for c in data["cases"])
    assert Path(tmp_path / "plans" / "homogeneous-optimal.json").is_file()
    msgspec.json.decode((tmp_path / "plans" / "homogeneous-optimal.json").read_bytes())


def test_bench_planner_prints_seconds_per_size_and_the_heuristics_gap(tmp_path):
    from click.testing import CliRunner

    from ppharness.cli import main

    out = tmp_path / "planner.json"
    args = ["bench", "planner", "--sizes", "2,3", "--blocks", "16", "--repeats", "1", "--gap-instances", "1"]
    result = CliRunner().invoke(main, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "2 devices" in result.output and "3 devices" in result.output and "heuristic against" in result.output
    data = json.loads(out.read_text())
    assert set(data["seconds"]) == {"latency", "throughput", "cost"}
    assert all(g["max"] >= 0 for g in data["gap"].values())
