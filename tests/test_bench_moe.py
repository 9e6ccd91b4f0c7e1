"""``ppharness bench moe``: the per-token breakdown's arithmetic on a hand-made trace; ``slow``: a CI-sized run whose
answers are exact (run_plan checks every request), whose delay-0 run calibrates the fixed costs, and whose delayed
run pays each MoE block's fan-out round trip over the slower links."""

from __future__ import annotations

import pytest

from ppharness.benchmarks.moe import MoEBenchResult, MoECase, breakdown, report
from ppharness.trace.report import TokenRecord, Trace


def test_the_breakdown_takes_each_tokens_fan_out_and_gather_from_the_trace_events():
    records = [
        TokenRecord(0, 5, 100.0, {"stage 0 compute": 50.0}, {}),
        TokenRecord(1, 6, 20.0, {"stage 0 compute": 4.0, "stage 1 compute": 6.0, "hop 0->1": 1.0, "hop 1->0": 2.0}, {}),
        TokenRecord(2, 7, 22.0, {"stage 0 compute": 5.0, "stage 1 compute": 6.0, "hop 0->1": 1.0, "hop 1->0": 2.0}, {}),
    ]
    events = [
        {"name": "fanout 0", "dur": 500.0, "args": {"step": 1}},  # microseconds
        {"name": "gather 0", "dur": 3000.0, "args": {"step": 1}},
        {"name": "gather 1", "dur": 2000.0, "args": {"step": 1}},
        {"name": "fanout 0", "dur": 700.0, "args": {"step": 2}},
        {"name": "gather 0", "dur": 4000.0, "args": {"step": 2}},
        {"name": "gather 0", "dur": 9000.0, "args": {"step": 0}},  # the prefill: not a decode token
    ]
    got = breakdown(Trace("r", 2, records, events))
    # p50 by nearest rank, as every trace figure: the lower of two
    assert got["compute"] == pytest.approx(10.0)  # of 10 and 11
    assert got["fan-out"] == pytest.approx(0.5)  # of 0.5 and 0.7
    assert got["gather"] == pytest.approx(4.0)  # of 5 (3 + 2) and 4
    assert got["hops"] == pytest.approx(3.0)
    assert got["total"] == pytest.approx(20.0)


def test_the_report_counts_only_predicted_rows_against_the_target():
    res = MoEBenchResult(model="m", expert_nodes=2, tokens=8, repeats=1, single_tok_s=100.0)
    res.cases = [MoECase(delay_ms=0, error_pct=40.0, tok_s=20.0), MoECase(delay_ms=10, error_pct=-9.0, tok_s=8.0)]
    assert res.within_target  # the delay-0 row is fitted, not predicted
    assert "every prediction within 15 %" in report(res)
    res.cases[1].error_pct = 16.0
    assert not res.within_target and "NOT within" in report(res)


@pytest.mark.slow
def test_a_ci_sized_moe_bench_is_exact_and_pays_the_fan_out_round_trip(tmp_path):
    from ppharness.benchmarks.moe import run_moe_bench

    res = run_moe_bench("tiny-moe", 8, 1, 2, [10.0], str(tmp_path), lambda _: None)
    assert [c.delay_ms for c in res.cases] == [0.0, 10.0]
    assert res.calibration["hop_ms"] > 0 and res.single_tok_s > 0
    fast, slow = res.cases
    # 4 MoE blocks each wait one 10 ms round trip to their expert nodes, and the loop has two 10 ms hops
    assert slow.measured_ms - fast.measured_ms >= 0.9 * (4 * 2 * 10 + 2 * 10)
    assert slow.breakdown_ms["gather"] >= 0.9 * 4 * 2 * 10
    assert (tmp_path / "bench-moe.json").exists()
