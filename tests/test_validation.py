"""The committed validation runs (``docs/validation/``): each prediction is the simulator's output for its committed
plan today, was written before its run started, and holds against the run's measured per-token p50 within the run's
tolerance; calibration and held-out runs are never the same run; the shipped docker clusters carry the figures the
committed calibration gives; the README's table is the committed runs'."""

from __future__ import annotations

import statistics
from datetime import datetime
from pathlib import Path

import pytest

from ppharness.plan.predict.simulate import simulate
from ppharness.plan.reader import load_cluster
from ppharness.plan.validation import (
    TOLERANCE_PCT,
    VALIDATION,
    Run,
    calibrated_figures,
    expert_plan_figures,
    load_probes,
    load_runs,
    prediction_record,
    table,
)

ROOT = Path(__file__).resolve().parents[1]
RUNS = load_runs()
HELD_OUT = [r for r in RUNS if r.kind == "held-out"]
CALIBRATION = [r for r in RUNS if r.kind == "calibration"]
DOCKER_CLUSTERS = ("strong-cluster.yaml", "mild-cluster.yaml", "homogeneous-cluster.yaml")
WRITTEN = 0.0005 + 1e-12  # the cluster files write the calibrated figures to three decimals (half a unit off)


def _ids(run: Run) -> str:
    return run.name


def _when(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_there_are_calibration_runs_and_held_out_runs_among_them_the_strong_clusters_plan():
    assert CALIBRATION and HELD_OUT
    assert {r.kind for r in RUNS} == {"calibration", "held-out"}
    assert "scenarios/clusters/strong-cluster.yaml" in {r.manifest.get("cluster") for r in HELD_OUT}


@pytest.mark.parametrize("run", RUNS, ids=_ids)
def test_the_prediction_is_the_simulators_output_for_the_committed_plan(run: Run):
    again = prediction_record(simulate(run.plan))
    assert run.prediction["plan_id"] == run.plan.id == run.summary["plan_id"]
    assert run.prediction["per_token_ms"] == pytest.approx(again["per_token_ms"], abs=1e-3)
    assert run.prediction["quota_wait_ms"] == pytest.approx(again["quota_wait_ms"], abs=1e-3)
    assert list(run.prediction["rows_ms"]) == list(again["rows_ms"])
    for name, ms in again["rows_ms"].items():
        assert run.prediction["rows_ms"][name] == pytest.approx(ms, abs=1e-3), name
    cluster = run.cluster_file()
    if cluster is not None:
        assert run.plan.cluster == cluster, (
            f"{run.name}: {run.manifest['cluster']} changed since this run was made from it: make the run again "
            "(docs/validation/README.md says how)"
        )


@pytest.mark.parametrize("run", RUNS, ids=_ids)
def test_the_prediction_was_written_before_the_run_started(run: Run):
    made = _when(run.prediction["made_at"])
    repeats = run.summary["repeats"]
    assert repeats and len(repeats) == run.manifest["repeats"]
    assert all(made < _when(r["started_at"]) < _when(r["finished_at"]) for r in repeats)


@pytest.mark.parametrize("run", RUNS, ids=_ids)
def test_the_measurement_is_the_median_of_the_repeats_per_token_p50(run: Run):
    p50s = [r["per_token_ms"]["p50"] for r in run.summary["repeats"]]
    assert run.measured_ms == pytest.approx(statistics.median(p50s), abs=1e-4)
    for r in run.summary["repeats"]:
        assert 2 <= r["decode_tokens"] == len(r["tokens_ms"]) <= run.manifest["tokens"] - 1
        assert min(r["tokens_ms"]) <= r["per_token_ms"]["p50"] <= max(r["tokens_ms"])


@pytest.mark.parametrize("run", HELD_OUT, ids=_ids)
def test_a_held_out_runs_prediction_holds_within_its_tolerance(run: Run):
    tolerance = run.tolerance_pct
    assert tolerance is not None
    if tolerance != TOLERANCE_PCT:
        assert run.manifest.get("tolerance_reason"), (
            f"{run.name}: a tolerance other than {TOLERANCE_PCT:g} % needs a reason"
        )
    assert abs(run.error_pct) <= tolerance, (
        f"{run.name}: predicted {run.predicted_ms:.2f} ms per token, measured p50 {run.measured_ms:.2f} ms "
        f"({run.error_pct:+.1f} %, tolerance {tolerance:g} %)"
    )


def test_calibration_and_held_out_runs_are_never_the_same_run():
    fitted = {r.plan.id for r in CALIBRATION}
    assert not fitted & {r.plan.id for r in HELD_OUT}, "a held-out plan was also a calibration run"
    tokens = [tuple(rep["tokens_ms"]) for r in RUNS for rep in r.summary["repeats"]]
    assert len(tokens) == len(set(tokens)), "one measurement is committed twice"
    assert not {r.folder.name for r in CALIBRATION} & {r.folder.name for r in HELD_OUT}


@pytest.mark.parametrize("run", HELD_OUT, ids=_ids)
def test_a_held_out_prediction_was_made_after_the_calibration_its_devices_name(run: Run):
    finished = {
        f"calibration/{r.folder.name}": max(_when(x["finished_at"]) for x in r.summary["repeats"]) for r in CALIBRATION
    }
    finished |= {name: _when(probe["finished_at"]) for name, probe in load_probes().items()}
    hows = {d.measured.how for d in run.plan.cluster.devices if d.measured is not None}
    named = {name for name in finished if any(name in how for how in hows)}
    assert named, f"{run.name}: its devices' `measured` names no committed calibration"
    assert all(_when(run.prediction["made_at"]) > finished[name] for name in named)


def test_the_shipped_docker_clusters_carry_the_calibrated_figures_and_say_where_from():
    probe = load_probes()["calibration/probe-small"]
    run = next(r for r in CALIBRATION if r.folder.name == "hop-docker")
    figures = calibrated_figures(probe, run)
    for name in DOCKER_CLUSTERS:
        cluster = load_cluster(ROOT / "scenarios" / "clusters" / name)
        assert cluster.hop_ms == pytest.approx(figures["hop_ms"], abs=WRITTEN), name
        for d in cluster.devices:
            got = {k: getattr(d, k) for k in figures if k != "hop_ms"}
            assert got == pytest.approx({k: v for k, v in figures.items() if k != "hop_ms"}, abs=WRITTEN), d.id
            assert d.measured is not None and d.measured.date and d.measured.hardware, (name, d.id)
            assert "calibration/probe-small" in d.measured.how and "calibration/hop-docker" in d.measured.how


def test_the_kimi_docker_cluster_carries_the_figures_its_calibration_run_gives():
    run = next(r for r in CALIBRATION if r.folder.name == "kimi-docker")
    figures = expert_plan_figures(run)
    cluster = load_cluster(ROOT / "scenarios" / "clusters" / "kimi-docker.yaml")
    assert cluster.hop_ms == pytest.approx(figures["hop_ms"], abs=WRITTEN)
    stages = {n.device for n in run.plan.placement.nodes if not n.expert_only}
    for d in cluster.devices:
        role = "stage" if d.id in stages else "expert"
        assert d.gflops == pytest.approx(figures[f"{role}_gflops"], abs=WRITTEN / 10), d.id
        assert d.overhead_ms == pytest.approx(figures[f"{role}_overhead_ms"], abs=WRITTEN), d.id
        assert d.measured is not None and "calibration/kimi-docker" in d.measured.how, d.id


def test_the_readme_table_is_the_committed_runs():
    text = (VALIDATION / "README.md").read_text()
    assert table(RUNS) in text, "docs/validation/README.md: run `python -m ppharness.plan.validation table`"
