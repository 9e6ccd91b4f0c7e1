"""The per-token trace: it adds up, it is valid trace-event JSON, and the benchmark that uses it runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ppharness.run.seed.orchestrator import Progress, run_scenario
from ppharness.scenario.schema import scenario_from_args
from ppharness.trace.report import build_trace
from ppharness.wire.messages import InferenceResponse, Span, TraceReport

ROOT = Path(__file__).resolve().parent.parent


def _check_trace_event_format(doc: dict) -> None:
    """The Chrome trace-event format as Perfetto reads it: a traceEvents list of well-formed events."""
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    for ev in doc["traceEvents"]:
        assert ev["ph"] in ("X", "M"), ev
        assert isinstance(ev["pid"], int) and isinstance(ev["name"], str)
        if ev["ph"] == "X":
            assert isinstance(ev["tid"], int)
            assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0
        else:
            assert ev["name"] in ("process_name", "thread_name") and "name" in ev["args"]
    json.dumps(doc)


def test_synthetic_spans_make_exact_records():
    """Two stages, hand-made spans: the hop and loop arithmetic is what the module docstring says."""
    ms = 1_000_000
    stage0 = [
        Span(0, "recv", 0, 0, 50),
        Span(0, "tokenize", 0, 1 * ms),
        Span(0, "compute", 1 * ms, 5 * ms),
        Span(0, "serialize", 5 * ms, 6 * ms),
        Span(0, "send", 6 * ms, 6 * ms, 100),
        Span(1, "recv", 20 * ms, 20 * ms, 30),
        Span(1, "deserialize", 20 * ms, 21 * ms),
        Span(1, "compute", 21 * ms, 23 * ms),
        Span(1, "serialize", 23 * ms, 24 * ms),
        Span(1, "send", 24 * ms, 24 * ms, 100),
        Span(2, "recv", 40 * ms, 40 * ms, 30),
    ]
    # stage 1 runs on a clock 1000 s ahead; its offset says so
    off = 1000 * 10**9
    stage1 = [
        Span(0, "recv", 8 * ms + off, 8 * ms + off, 100),
        Span(0, "compute", 8 * ms + off, 17 * ms + off),
        Span(0, "send", 17 * ms + off, 17 * ms + off, 30),
        Span(1, "recv", 27 * ms + off, 27 * ms + off, 100),
        Span(1, "compute", 27 * ms + off, 37 * ms + off),
        Span(1, "send", 37 * ms + off, 37 * ms + off, 30),
    ]
    response = InferenceResponse(
        request_id="r", text="ab", token_ids=[5, 6], prompt_tokens=3, token_times=[0, 1], finish_reason="length"
    )
    trace = build_trace([TraceReport(0, "r", stage0), TraceReport(1, "r", stage1)], {1: off}, response, 2)
    first, second = trace.records
    assert first.total_ms == pytest.approx(20) and second.total_ms == pytest.approx(20)
    assert first.parts["hop 0->1"] == pytest.approx(2) and first.parts["hop 1->0"] == pytest.approx(3)
    assert first.parts["stage 1 compute"] == pytest.approx(9)
    assert second.parts["hop 0->1"] == pytest.approx(3) and second.parts["hop 1->0"] == pytest.approx(3)
    assert first.other_ms == pytest.approx(20 - (1 + 4 + 1 + 2 + 9 + 3))
    assert first.hop_bytes == {"0->1": 100, "1->0": 30}
    _check_trace_event_format(trace.chrome())


@pytest.mark.local
@pytest.mark.slow  # 20-40 s; the default run keeps to its 12-minute budget, .ci/run runs it with -m slow
def test_traced_chain_adds_up_and_writes_perfetto_json(tmp_path):
    scenario = scenario_from_args(num_stages=3, max_tokens=12)
    result = run_scenario(scenario, progress=Progress(quiet=True), trace=True)
    trace = result.trace
    assert result.matches_oracle
    assert [r.token_id for r in trace.records] == result.response.token_ids
    decode = trace.decode
    assert len(decode) == len(result.response.token_ids) - 1
    covered = sorted(sum(r.parts.values()) / r.total_ms for r in decode)
    assert 0.9 <= covered[len(covered) // 2] <= 1.1, covered
    for r in decode:
        assert {f"stage {i} compute" for i in range(3)} <= set(r.parts)
        assert {"hop 0->1", "hop 1->2", "hop 2->0"} <= set(r.parts)
        assert all(v >= 0 for k, v in r.parts.items() if not k.startswith("hop")), r.parts
    assert decode[-1].hop_bytes["0->1"] > 64 * 2  # an f16 (1, 1, 64) activation plus its framing
    paths = trace.write(str(tmp_path / "t.json"))
    doc = json.loads(Path(paths[0]).read_text())
    _check_trace_event_format(doc)
    names = {ev["args"]["name"] for ev in doc["traceEvents"] if ev["name"] == "thread_name"}
    assert names == {"stage 0", "stage 1", "stage 2", "hop 0->1", "hop 1->2", "hop 2->0"}
    lines = Path(paths[1]).read_text().splitlines()
    assert len(lines) == len(trace.records) and json.loads(lines[1])["step"] == 1
    assert "per token (decode" in trace.summary()


@pytest.mark.local
@pytest.mark.slow  # the CLI end to end; the traced chain above checks the trace itself
def test_smoke_run_trace_flag_writes_both_files(tmp_path):
    out = tmp_path / "run.json"
    r = subprocess.run(
        [sys.executable, "-m", "ppharness.cli.smoke", "-n", "2", "--max-tokens", "6", "-q", "--trace", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MATCH" in r.stdout and "component" in r.stdout and "hop 0->1" in r.stdout
    _check_trace_event_format(json.loads(out.read_text()))
    assert (tmp_path / "run.jsonl").exists()


@pytest.mark.local
@pytest.mark.slow
def test_bench_runs_and_its_numbers_are_consistent(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ppharness.cli",
            "bench",
            "-n",
            "2",
            "--preset",
            "tiny",
            "--tokens",
            "8",
            "--repeats",
            "2",
            "--no-sweep",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert len(res["single_tok_s"]) == 2 and all(v > 0 for v in res["single_tok_s"])
    assert set(res["chain_tok_s"]) == {"one node", "zmq", "co-located", "zmq+trace"}
    assert 0.9 <= res["components_share"] <= 1.1
    assert set(res["hop_p50_ms"]) == {"0->1", "1->0"}
    assert all(len(v) == (1 if k == "one node" else 2) and min(v) > 0 for k, v in res["peak_rss_mib"].items())
    assert "ratio to single" in r.stdout and "2-stage chain co-located" in r.stdout
    assert all(not why for why in res["mismatch"].values()), res["mismatch"]


def test_the_bench_png_without_a_sweep_has_one_panel_and_colours_by_kind(tmp_path):
    """`ppharness bench --no-sweep` draws the per-token stack alone (no empty panel), its stages' compute in one
    family of colours and its hops in another, each component its own shade."""
    import matplotlib.image

    from ppharness.benchmarks.chain import BenchResult, _component_colour, plot

    parts = {f"stage {i} compute": 1.0 for i in range(5)} | {f"hop {i}->{i + 1}": 0.3 for i in range(4)}
    res = BenchResult(
        model="synthetic:tiny",
        num_stages=5,
        tokens=8,
        repeats=1,
        single_tok_s=[100.0],
        chain_tok_s=[60.0],
        raw_rtt_ms=0.1,
        activation_bytes=512,
        hop_p50_ms=0.3,
        components_ms=parts,
        per_token_ms=6.2,
        components_share={},
        peak_rss_mib={},
        sweep_tok_s={},
        mismatch=None,
    )
    plot(res, tmp_path / "bench.png")
    height, width = matplotlib.image.imread(tmp_path / "bench.png").shape[:2]
    assert width / height < 1.6, f"one panel, not two: {width}x{height}"
    colours = [_component_colour(name, parts) for name in parts]
    assert len(set(colours)) == len(parts), "every component its own shade"
    blue = [c for name, c in zip(parts, colours) if "compute" in name]
    orange = [c for name, c in zip(parts, colours) if name.startswith("hop")]
    assert all(c[2] > c[0] for c in blue) and all(c[0] > c[2] for c in orange), "compute blue, hops orange"


def test_a_bench_preset_carries_a_synthetic_specs_overrides() -> None:
    from ppharness.benchmarks.chain import _scenario  # the bench's own scenario builder, tested here

    sc = _scenario("qwen3-30b-a3b,blocks=8", 4, "zmq", 16, 256)
    assert sc.model.synthetic is not None
    assert (sc.model.synthetic.preset, sc.model.synthetic.blocks) == ("qwen3-30b-a3b", 8)
    assert sc.stages.num_stages == 4
