"""The plan's simulator, its pictures and the device probe: predictions are the cost model's parts added up."""

from __future__ import annotations

import math

import pytest

from ppharness.network.spec import Impairment
from ppharness.plan.build import chain
from ppharness.plan.lang.check import check_plan
from ppharness.plan.lang.document import Block, Cluster, Device, Link, ModelGraph, Objective, PlanDoc
from ppharness.plan.predict import cost
from ppharness.plan.predict.simulate import compare, simulate
from ppharness.plan.show import dot, draw_png, mermaid, ops_text, table
from ppharness.trace.report import TokenRecord, Trace

MIB = 1 << 20


def _model(blocks: int = 6) -> ModelGraph:
    return ModelGraph(
        source="synthetic:test",
        sha256="0" * 64,
        arch="llama",
        dim=1024,
        vocab=32000,
        max_context=256,
        embed_bytes=64 * MIB,
        head_bytes=64 * MIB,
        head_flops=65_000_000,
        activation_bytes=2048,
        token_bytes=64,
        blocks=tuple(Block(weight_bytes=40 * MIB, flops=80_000_000, kv_bytes=4096) for _ in range(blocks)),
    )


def _cluster(hop_ms: float = 0.25) -> Cluster:
    devices = (
        Device(id="a", memory=4 << 30, gflops=50.0, bandwidth_gbs=20.0, overhead_ms=0.5, usd_per_hour=0.30),
        Device(id="b", memory=4 << 30, gflops=200.0, overhead_ms=1.0, usd_per_hour=0.10, region="eu"),
        Device(id="c", memory=4 << 30, gflops=20.0, bandwidth_gbs=100.0, region="us"),
    )
    return Cluster(
        devices=devices,
        default=Impairment(delay_ms=1.0),
        links=(Link(src="a", dst="b", delay_ms=12.0, rate_mbit=100.0),),
        region_links=(Link(src="eu", dst="us", delay_ms=40.0, rate_mbit=50.0),),
        hop_ms=hop_ms,
    )


def _plan(requests: int = 1, hop_ms: float = 0.25) -> PlanDoc:
    doc = chain(_model(), _cluster(hop_ms), ["a", "b", "c"], [2, 5], Objective(kind="throughput", requests=requests))
    check_plan(doc)
    return doc


def test_decode_is_the_sum_of_the_cost_model_parts():
    doc = _plan()
    model, cluster = doc.model, doc.cluster
    p = simulate(doc)
    dev = cluster.device
    nodes = [
        cost.node_ms(model, dev("a"), 0, 2, False),
        cost.node_ms(model, dev("b"), 2, 5, False),
        cost.node_ms(model, dev("c"), 5, 6, True),
    ]
    edges = [
        cost.edge_ms(cluster, "a", "b", model.activation_bytes),
        cost.edge_ms(cluster, "b", "c", model.activation_bytes),
        cost.edge_ms(cluster, "c", "a", model.token_bytes),
    ]
    assert [r.name for r in p.rows] == [
        "stage 0 compute",
        "stage 1 compute",
        "stage 2 compute",
        "hop 0->1",
        "hop 1->2",
        "hop 2->0",
    ]
    assert [r.ms for r in p.rows] == nodes + edges
    assert p.per_token_ms == sum(nodes) + sum(edges)
    assert [r.device for r in p.rows[:3]] == ["a", "b", "c"]
    assert p.parts()["per token"] == p.per_token_ms
    # by hand: device a is bound by bandwidth (40 MiB / 20 GB/s), b by FLOPs, c's head by FLOPs
    assert nodes[0] == pytest.approx(0.5 + 2 * 40 * MIB / 20e9 * 1e3)
    assert nodes[1] == pytest.approx(1.0 + 3 * 80e6 / 200e9 * 1e3)
    assert nodes[2] == pytest.approx(80e6 / 20e9 * 1e3 + 65e6 / 20e9 * 1e3)
    # TTFT: each node's prefill (its fixed costs, its blocks for every prompt token, the head once on the exit),
    # prompt_tokens activations per edge, one token back
    ttft = (
        cost.prefill_ms(model, dev("a"), 0, 2, False, 8)
        + cost.prefill_ms(model, dev("b"), 2, 5, False, 8)
        + cost.prefill_ms(model, dev("c"), 5, 6, True, 8)
        + cost.edge_ms(cluster, "a", "b", 8 * model.activation_bytes)
        + cost.edge_ms(cluster, "b", "c", 8 * model.activation_bytes)
        + cost.edge_ms(cluster, "c", "a", model.token_bytes)
    )
    # with no measured prefill costs, a block's prefill is its decode time for every prompt token where FLOPs bind
    # (b), and one prompt token costs what one decode step does (a is bound by bandwidth there)
    assert cost.prefill_ms(model, dev("b"), 2, 5, False, 8) == pytest.approx(
        1.0 + 8 * cost.blocks_ms(model, dev("b"), 2, 5)
    )
    assert cost.prefill_ms(model, dev("a"), 0, 2, False, 1) == pytest.approx(nodes[0])
    assert p.ttft_ms == pytest.approx(ttft)


def test_hop_rows_use_the_links_delay():
    doc = _plan(hop_ms=0.0)
    rows = {r.name: r for r in simulate(doc).rows}
    wire = 2048 * 8 / 100e6 * 1e3
    assert rows["hop 0->1"].ms == pytest.approx(12.0 + wire)  # the pair's own link
    assert rows["hop 1->2"].ms == pytest.approx(40.0 + 2048 * 8 / 50e6 * 1e3)  # eu -> us, the regions' link
    assert rows["hop 2->0"].ms == pytest.approx(1.0)  # the default: 1 ms, no rate cap
    assert rows["hop 0->1"].device == "a->b" and rows["hop 2->0"].kind == "token"
    assert rows["hop 0->1"].nbytes == 2048 and rows["hop 2->0"].nbytes == 64


def test_ttft_exceeds_the_per_token_time_for_longer_prompts():
    doc = _plan()
    assert simulate(doc, prompt_tokens=16).ttft_ms > simulate(doc, prompt_tokens=16).per_token_ms
    assert simulate(doc, prompt_tokens=16).ttft_ms > simulate(doc, prompt_tokens=4).ttft_ms
    one = simulate(doc, prompt_tokens=1)
    assert one.ttft_ms == pytest.approx(one.per_token_ms)  # one prompt token: the same work as a decode step


def test_throughput_is_latency_bound_for_one_request_and_bottleneck_bound_for_many():
    doc = _plan()
    one = simulate(doc, requests=1)
    assert one.throughput_tok_s == pytest.approx(1e3 / one.per_token_ms)
    assert one.throughput_tok_s == pytest.approx(one.tok_s)
    many = simulate(doc, requests=1000)
    busiest = max(max(r.busy_ms for r in many.rows), 0.0)
    assert many.bottleneck_ms == busiest
    assert many.throughput_tok_s == pytest.approx(1e3 / busiest)
    assert many.bottleneck == "stage 2 compute"  # c: 20 GFLOP/s for a block and the head
    assert one.requests == 1 and simulate(_plan(requests=4)).requests == 4  # the objective's count by default
    assert one.throughput(1000) == pytest.approx(many.throughput_tok_s)
    # price: a and b cost 0.40 $/h together; c is free
    assert one.usd_per_hour == pytest.approx(0.40)
    assert one.usd_per_mtoken == pytest.approx(0.40 / 3600 / one.throughput_tok_s * 1e6)


def test_summary_and_compare_name_every_row():
    doc = _plan()
    p = simulate(doc, requests=4)
    text = p.summary()
    assert "tok/s" in text and "first token" in text and "4 in flight" in text and "/Mtoken" in text
    for r in p.rows:
        assert r.name in text
    assert "stage 1 compute" in text.splitlines()[3] and text.splitlines()[3].rstrip().endswith("b")
    parts = {"stage 0 compute": 2.0, "stage 0 serialize": 0.1, "hop 0->1": 15.0, "hop 2->0": 1.5}
    records = [TokenRecord(k, 7, 40.0 + k, dict(parts), {"0->1": 2048}) for k in range(4)]
    trace = Trace(request_id="r1", num_stages=3, records=records)
    out = compare(p, trace)
    assert "per token" in out and "first token" in out
    row = next(line for line in out.splitlines() if line.startswith("hop 0->1"))
    err = 100 * (next(r.ms for r in p.rows if r.name == "hop 0->1") - 15.0) / 15.0
    assert f"{err:+.1f}%" in row
    # the trace's rows the cost model does not predict: one line that names them and adds up their p50s
    rest = next(line for line in out.splitlines() if line.startswith("not predicted"))
    assert "2 trace rows: serialize, other" in rest and f"{0.1 + trace.p50_parts()['other']:.3f}" in rest
    assert "first token" not in compare(p, trace, first_token=False)
    assert "cpu quota wait" not in out  # no device here has a quota


def test_show_mentions_every_node_and_edge():
    doc = _plan()
    assert ops_text(doc.placement.nodes[0]) == "embed, blk[0:2]"
    assert ops_text(doc.placement.nodes[2]) == "blk[5:6], head"
    t, m, d = table(doc), mermaid(doc), dot(doc)
    for node in doc.placement.nodes:
        assert node.label in t and node.label in m and node.label in d
        assert ops_text(node) in t and ops_text(node) in m and ops_text(node) in d
    for e in doc.placement.edges:
        assert f"{e.src} -> {e.dst}" in t
        assert f'"{e.src}" -> "{e.dst}"' in d
    assert m.startswith("flowchart") and m.count("-->") == 2 and m.count("-.->") == 1
    assert d.count("style=dashed") == 1
    ms = simulate(doc).rows[0].ms
    assert f"{ms:.3f}" in t and f"{ms:.3f} ms" in m


def test_a_node_box_of_the_png_holds_its_text():
    from ppharness.plan.show import BOX_CHARS, BOX_LINES, _boxed

    long = ", ".join(f"experts[{i}][0-{i}]" for i in range(40))
    lines = _boxed(long).split("\n")
    assert len(lines) == BOX_LINES and all(len(line) <= BOX_CHARS for line in lines)
    assert lines[-1].endswith("…"), "what does not fit is cut, visibly"
    assert _boxed("embed, blk[0:6]") == "embed, blk[0:6]"


def test_draw_png_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = draw_png(_plan(), tmp_path / "plan.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    single = chain(_model(), _cluster(), ["a"], [])
    assert draw_png(single, tmp_path / "one.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = simulate(single)
    assert [r.name for r in p.rows] == ["stage 0 compute"] and p.per_token_ms == p.rows[0].ms


@pytest.mark.slow  # 20-40 s; the default run keeps to its 12-minute budget, .ci/run runs it with -m slow
def test_probe_measures_this_machine(tiny_model_path):
    from ppharness.benchmarks.probe import fit_line, probe_fit

    a, b, r2 = fit_line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0])
    assert (a, b, r2) == pytest.approx((1.0, 2.0, 1.0))
    fit = probe_fit(tiny_model_path, "here", blocks=(1, 2, 4), tokens=8)
    device = fit.device
    assert device.id == "here" and device.region is None
    assert device.gflops > 0 and device.bandwidth_gbs is not None and device.bandwidth_gbs > 0
    assert device.overhead_ms >= 0 and device.memory > 0
    assert sorted(fit.medians_ms) == [1, 2, 4] and all(ms > 0 for ms in fit.medians_ms.values())
    assert "r²" in fit.probe_report and math.isfinite(fit.r2)
    # the device reproduces the fitted slope for one block of this model (both bounds agree)
    from ppharness.plan.graph import model_graph

    graph = model_graph(tiny_model_path, "synthetic:tiny", 64)
    assert cost.blocks_ms(graph, device, 0, 1) == pytest.approx(max(fit.b_ms, 1e-6), rel=1e-6)


@pytest.mark.slow  # 20-40 s: a mixture-of-experts model's probe and a two-stage chain
def test_probe_times_moe_blocks_says_what_it_measured_with_and_a_hop_in_a_running_chain():
    import json

    from ppharness.benchmarks.probe import probe_fit, probe_hop, probe_record
    from ppharness.model.sources.files import resolve_model
    from ppharness.plan.graph import model_graph
    from ppharness.plan.provenance import engine_id

    source = "synthetic:tiny-moe"
    path = str(resolve_model(source))
    fit = probe_fit(path, "moe", blocks=(1, 2), tokens=6, source=source)
    measured = fit.device.measured
    assert fit.moe and measured is not None
    assert measured.engine == engine_id() and measured.date and fit.backend in measured.hardware
    # one MoE block as the cost model reads it (its dense part, then its active experts): the fitted slope at least,
    # as both parts share one speed and one bandwidth
    graph = model_graph(path, source, 64)
    one = cost.blocks_ms(graph, fit.device, 0, 1)
    assert max(fit.b_ms, 1e-6) * (1 - 1e-9) <= one <= 2 * max(fit.b_ms, 1e-6)
    hop = probe_hop(path, tokens=6, source=source)
    assert hop.samples >= 2 and 0 < hop.hop_ms < 100 and hop.activation_bytes > graph.activation_bytes
    assert 0 < hop.handoff_ms < 100, "the co-located hand-over was not measured"
    record = json.loads(json.dumps(probe_record(fit, hop)))
    assert record["moe"] and record["block_ms"] == fit.b_ms and record["hop"]["hop_ms"] == hop.hop_ms
    assert record["hop"]["handoff_ms"] == hop.handoff_ms
    assert record["device"]["measured"]["engine"] == engine_id()


def test_a_batched_step_reads_the_weights_once_and_each_requests_cache():
    """Batched serving: a node's step of B rows costs its fixed cost and its weights once, and B times the FLOPs and
    the KV reads: a step of 8 costs less than 8 single steps, and throughput grows with the batch."""
    doc = _plan(requests=8)
    one, eight = simulate(doc, prompt_tokens=32, requests=8), simulate(doc, prompt_tokens=32, requests=8, batch=8)
    assert eight.batch == 8 and one.batch == 1
    a = next(n for n in doc.cluster.devices if n.id == "a")
    block = doc.model.blocks[0]
    want = a.overhead_ms + 2 * 1e3 * max(
        8 * block.flops / (a.gflops * 1e9), (block.weight_bytes + 8 * block.kv_bytes * 32) / (a.bandwidth_gbs * 1e9)
    )
    assert math.isclose(eight.parts()["stage 0 compute"], want, rel_tol=1e-9)
    assert eight.parts()["stage 0 compute"] < 8 * one.parts()["stage 0 compute"]
    # one batch of 8 in flight: 8 tokens per loop, or 8 per bottleneck step
    assert math.isclose(eight.throughput_tok_s, 1e3 * min(8 / eight.per_token_ms, 8 / eight.bottleneck_ms))
    # a memory-bound device: 8 requests batched are far faster than 8 one after the other
    fast = Device(id="m", memory=4 << 30, gflops=1e5, bandwidth_gbs=20.0, overhead_ms=0.5)
    solo = chain(_model(), Cluster(devices=(fast,)), ["m"], [], Objective(kind="throughput", requests=8))
    check_plan(solo)
    assert simulate(solo, requests=8, batch=8).throughput_tok_s > 6 * simulate(solo, requests=8).throughput_tok_s
    assert "batched 8 per step" in eight.header()
    with pytest.raises(ValueError, match="batch must be at least 1"):
        simulate(doc, batch=0)


def test_plan_make_show_and_simulate_print_one_per_token_figure_the_quota_wait_included(tmp_path, tiny_model_path):
    """The three commands print the simulator's per-token time for one plan. Here a quarter-CPU device's node keeps
    its share busy four times as long as its compute, so the figure is the quota's bound, more than the rows add up
    to, and each command says so."""
    from click.testing import CliRunner

    from ppharness.cli import main
    from ppharness.plan.reader import load_plan

    cluster = tmp_path / "quota-cluster.yaml"
    cluster.write_text(
        "name: quota\nhop_ms: 0.3\ndefault: {delay_ms: 1}\ndevices:\n"
        "  - {id: a, memory: 1g, reserve: 0, gflops: 1.0, overhead_ms: 0.5, source: {kind: docker, cpus: 0.25}}\n"
    )
    out = tmp_path / "plan.json"
    made = CliRunner().invoke(main, ["plan", "make", "--model", "tiny", "--cluster", str(cluster), "-o", str(out)])
    assert made.exit_code == 0, made.output
    shown = CliRunner().invoke(main, ["plan", "show", str(out)])
    simulated = CliRunner().invoke(main, ["plan", "simulate", str(out)])
    assert shown.exit_code == 0 and simulated.exit_code == 0, shown.output + simulated.output
    p = simulate(load_plan(out))
    assert p.quota_wait_ms > 0 and p.per_token_ms > sum(r.ms for r in p.rows)
    figure = f"{p.per_token_ms:.3f}"
    assert f"per token (decode, predicted) {figure} ms" in made.output
    assert f"per token (decode, predicted) {figure} ms" in simulated.output
    assert f"\nper token {figure} ms" in shown.output
    assert "cpu quota wait" in shown.output and "cpu quota wait" in simulated.output


def test_a_plan_run_prints_its_prediction_beside_its_trace_row_for_row(tmp_path, capsys):
    """What ``pp-smoke-run --plan`` prints after the run: each predicted row with the trace's p50 and the error, the
    rows the cost model does not predict on a line that says so, the per-token total; nothing to compare with when
    the run wrote no trace."""
    import time

    from ppharness.cli.smoke import print_prediction
    from ppharness.plan.lang.document import pretty

    doc = _plan()
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(pretty(doc))
    started = time.time()
    parts = {"stage 0 compute": 4.0, "stage 0 serialize": 0.1, "hop 0->1": 15.0, "hop 2->0": 1.5}
    Trace("r0", 3, [TokenRecord(k, 7, 40.0, dict(parts), {}) for k in range(5)]).write(str(tmp_path / "run.json"))
    print_prediction(str(plan_file), str(tmp_path / "run.json"), started)
    out = capsys.readouterr().out
    p = simulate(doc)
    stage0 = next(line for line in out.splitlines() if line.startswith("stage 0 compute"))
    assert f"{p.rows[0].ms:.3f}" in stage0 and "4.000" in stage0 and f"{100 * (p.rows[0].ms - 4) / 4:+.1f}%" in stage0
    assert "not predicted" in out and "serialize" in out
    per_token = next(line for line in out.splitlines() if line.startswith("per token"))
    assert f"{p.per_token_ms:.3f}" in per_token and "40.000" in per_token
    print_prediction(str(plan_file), None, started)
    assert "not compared" in capsys.readouterr().out
