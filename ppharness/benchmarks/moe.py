"""``ppharness bench moe``: a mixture-of-experts model decoded in one process against the same model with its routed
experts on expert nodes, on this machine, and the simulator's prediction of the expert-parallel run.

The expert-parallel run is a plan of two stages (the blocks split evenly; attention, router and combine) and
``expert_nodes`` expert nodes holding every routed expert round robin, on local processes over ZeroMQ. Before it is
predicted, the bench measures what the cost model needs here: the CPU's decode speed (``ppharness.benchmarks.probe``,
every device gets it), then, from a first traced run with perfect links (delay 0, always run first), the transport's
cost per hop, each stage's fixed cost per token beyond its FLOPs (the host-side routing and combine, one compiled step
per block), and the expert nodes' fixed cost per request, each the trace's p50 less the cost model's figure without it.
The delay-0 row is therefore fitted; every other delay is a prediction.

Then for each link delay (the WAN emulation's message level, every link of the plan) it predicts the per-token time
(``ppharness.plan.predict.simulate``), runs the plan (a warm-up request, then ``repeats`` requests, each checked against
the unsplit model, tokens and stage boundaries) and measures the mean time per decode token. The trace splits each token
into the stages' own compute (attention, router, shared expert and the combine: one compiled step per block, and
numpy), each MoE block's fan-out (packing and sending the requests), its gather (waiting for the slowest expert node),
and the hops along the loop.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from ppharness.benchmarks.plan import PROMPT, oracle_prompt_tokens, plan_scenario, run_plan
from ppharness.benchmarks.probe import probe_fit
from ppharness.benchmarks.provenance import stamped
from ppharness.errors import HarnessError
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import resolve_model
from ppharness.model.synthetic.spec import preset_spec, synthetic_source
from ppharness.plan.build import chain
from ppharness.plan.compile import implicit_cluster
from ppharness.plan.experts.place import baseline_experts
from ppharness.plan.graph import model_graph
from ppharness.plan.lang.document import Device, Impaired, PlanDoc, pretty, with_id
from ppharness.plan.predict.simulate import compare, simulate
from ppharness.run.seed.client import Job
from ppharness.run.seed.orchestrator import Chain, decode_tok_s
from ppharness.trace.report import Trace, percentile

TARGET_ERROR_PCT = 15.0


@dataclass
class MoECase:
    delay_ms: float
    plan_id: str = ""
    predicted_ms: float = 0.0
    measured_ms: float = 0.0  # mean per decode token, median over the repeats
    error_pct: float = 0.0
    tok_s: float = 0.0
    breakdown_ms: dict[str, float] = field(default_factory=dict)  # p50 per decode token, by part
    rows: str = ""  # the prediction's rows beside the trace's


@dataclass
class MoEBenchResult:
    model: str
    expert_nodes: int
    tokens: int
    repeats: int
    single_tok_s: float = 0.0  # the unsplit model in one process, median over the repeats
    hop_ms: float = 0.0
    calibration: dict[str, object] = field(default_factory=dict)
    probe: dict[str, float] = field(default_factory=dict)
    cases: list[MoECase] = field(default_factory=list)
    wall_s: float = 0.0
    # --in-flight: the delay-0 plan batched (serving.batched), one request alone and that many at once, same chain
    in_flight: int = 1
    in_flight_alone_tok_s: float = 0.0
    in_flight_tok_s: float = 0.0
    in_flight_exact: bool | None = None

    @property
    def within_target(self) -> bool:
        """Every prediction (the delay-0 row is fitted, not predicted) within the target."""
        return all(abs(c.error_pct) <= TARGET_ERROR_PCT for c in self.cases if c.delay_ms != 0)


def breakdown(trace: Trace) -> dict[str, float]:
    """Per decode token, p50 over the tokens: the stages' own compute, the fan-out, the gather and the hops (each
    summed over stages and MoE blocks)."""
    per_token: dict[str, list[float]] = {"compute": [], "fan-out": [], "gather": [], "hops": [], "total": []}
    events: dict[int, dict[str, float]] = {}
    for ev in trace.events:
        name, step = ev["name"], ev.get("args", {}).get("step", -1)
        for prefix, part in (("fanout ", "fan-out"), ("gather ", "gather")):
            if name.startswith(prefix):
                got = events.setdefault(step, {})
                got[part] = got.get(part, 0.0) + ev["dur"] / 1e3
    for r in trace.decode:
        parts = events.get(r.step, {})
        compute = sum(v for k, v in r.parts.items() if k.endswith(" compute"))
        per_token["compute"].append(compute)
        per_token["fan-out"].append(parts.get("fan-out", 0.0))
        per_token["gather"].append(parts.get("gather", 0.0))
        per_token["hops"].append(sum(v for k, v in r.parts.items() if k.startswith("hop ")))
        per_token["total"].append(r.total_ms)
    return {k: percentile(v, 50) if v else 0.0 for k, v in per_token.items()}


@dataclass(frozen=True)
class Calibration:
    """What the delay-0 run measured: the hop, each stage's fixed cost per token, the expert nodes' per request."""

    hop_ms: float = 0.0
    stage_overhead_ms: tuple[float, ...] = ()
    expert_overhead_ms: float = 0.0


def moe_plan(
    graph_path: str,
    source: str,
    max_context: int,
    expert_nodes: int,
    delay_ms: float,
    probe: Device,
    calibration: Calibration = Calibration(),
) -> PlanDoc:
    """Two stages and ``expert_nodes`` expert nodes (round robin) on local devices with this machine's measured
    speed and the calibration's fixed costs, every link ``delay_ms`` one way."""
    graph = model_graph(graph_path, source, max_context)
    base = implicit_cluster("local", 2 + expert_nodes)
    overheads = list(calibration.stage_overhead_ms or (0.0, 0.0)) + [calibration.expert_overhead_ms] * expert_nodes
    devices = tuple(
        msgspec.structs.replace(
            d,
            gflops=probe.gflops,
            bandwidth_gbs=probe.bandwidth_gbs,
            overhead_ms=max(0.0, overheads[i]),
            prefill_ms=probe.prefill_ms,
            prefill_block_ms=probe.prefill_block_ms,
            prefill_gflops=probe.prefill_gflops,
        )
        for i, d in enumerate(base.devices)
    )
    cluster = msgspec.structs.replace(
        base,
        devices=devices,
        default=Impaired(delay_ms=delay_ms),
        hop_ms=calibration.hop_ms,
        name=f"moe {delay_ms:g} ms",
    )
    ids = [d.id for d in devices]
    doc = chain(graph, cluster, ids[:2], [len(graph.blocks) // 2], policy="even")
    placed, _ = baseline_experts(doc, ids[2:], "round-robin")
    return placed


def calibrate(doc: PlanDoc, trace: Trace, prompt_tokens: int) -> Calibration:
    """The fixed costs a delay-0 run shows beyond the cost model's figures for ``doc`` (built with no fixed costs)."""
    measured = trace.p50_parts()
    rows = {r.name: r.ms for r in simulate(doc, prompt_tokens=prompt_tokens).rows}
    hops = [v for r in trace.decode for name, v in r.parts.items() if name.startswith("hop ")]
    stages = tuple(measured.get(f"stage {i} compute", 0.0) - rows.get(f"stage {i} compute", 0.0) for i in range(2))
    experts = [measured[n] - rows[n] for n in rows if " experts " in n and n in measured]
    return Calibration(
        hop_ms=percentile(hops, 50) if hops else 0.0,
        stage_overhead_ms=stages,
        expert_overhead_ms=statistics.median(experts) if experts else 0.0,
    )


def run_moe_bench(
    preset: str,
    tokens: int,
    repeats: int,
    expert_nodes: int,
    delays_ms: list[float],
    out_dir: str,
    progress: Callable[[str], None],
    in_flight: int = 1,
) -> MoEBenchResult:
    """Single process, then the expert-parallel plan at each delay (the first delay also calibrates the hop); with
    ``in_flight`` above 1, the delay-0 plan batched, serving that many requests at once (``serve_batched``)."""
    if tokens < 2 or repeats < 1 or expert_nodes < 1:
        raise HarnessError("the MoE bench needs at least 2 tokens, 1 repeat and 1 expert node")
    t0 = time.monotonic()
    source = synthetic_source(preset_spec(preset))
    path = str(resolve_model(source))
    f = GGUFFile(path)
    if not f.config.moe:
        raise HarnessError(f"preset {preset!r} has no experts: use a mixture-of-experts preset such as tiny-moe")
    max_context = 64 + tokens + 16
    res = MoEBenchResult(
        model=f"{preset} ({f.config.blocks} blocks, dim {f.config.dim}, {f.config.experts} experts, top "
        f"{f.config.experts_used})",
        expert_nodes=expert_nodes,
        tokens=tokens,
        repeats=repeats,
    )
    out = Path(out_dir)
    (out / "plans").mkdir(parents=True, exist_ok=True)
    progress("the unsplit model in one process (the oracle), timed")
    whole = ModelSlice(f, 0, f.config.blocks, True, True, max_context, taps=True)
    runs = [oracle_decode(path, PROMPT, tokens, max_context, model=whole, boundaries=True) for _ in range(repeats + 1)]
    oracle = runs[-1]
    res.single_tok_s = statistics.median(r.decode_tok_s for r in runs[1:])
    progress(f"one process: {res.single_tok_s:.1f} tok/s (median of {repeats})")
    progress("probing this machine's decode speed")
    fit = probe_fit(path, "probe", source=source)
    res.probe = {"gflops": fit.device.gflops, "overhead_ms": fit.device.overhead_ms, "r2": fit.r2}
    prompt_tokens = len(oracle_prompt_tokens(path))
    calibration = Calibration()
    for k, delay in enumerate([0.0] + [d for d in delays_ms if d != 0]):
        doc = moe_plan(path, source, max_context, expert_nodes, delay, fit.device, calibration)
        progress(f"delay {delay:g} ms: plan {doc.id}, running {repeats} request(s) of {tokens} tokens")
        per_repeat, _, trace = run_plan(doc, out / "plans" / f"moe-{delay:g}ms.json", tokens, repeats, oracle, progress)
        assert trace is not None
        if k == 0:  # the fixed costs, measured with perfect links; every later delay is predicted with them
            calibration = calibrate(doc, trace, prompt_tokens)  # type: ignore[arg-type]
            res.calibration = asdict(calibration)
            res.hop_ms = calibration.hop_ms
            doc = moe_plan(path, source, max_context, expert_nodes, delay, fit.device, calibration)
        prediction = simulate(doc, prompt_tokens=prompt_tokens)
        measured = statistics.median(per_repeat)
        case = MoECase(
            delay_ms=delay,
            plan_id=doc.id,
            predicted_ms=prediction.per_token_ms,
            measured_ms=measured,
            error_pct=(prediction.per_token_ms - measured) / measured * 100,
            tok_s=1000.0 / measured,
            breakdown_ms=breakdown(trace),  # type: ignore[arg-type]
            rows=compare(prediction, trace),  # type: ignore[arg-type]
        )
        res.cases.append(case)
        progress(
            f"delay {delay:g} ms: predicted {case.predicted_ms:.2f} ms, measured {case.measured_ms:.2f} ms per token "
            f"({case.error_pct:+.1f} %)"
        )
        res.wall_s = time.monotonic() - t0
        (out / "bench-moe.json").write_text(json.dumps(stamped(asdict(res)), indent=1))
    if in_flight > 1:
        doc = moe_plan(path, source, max_context, expert_nodes, 0.0, fit.device, calibration)
        serve_batched(res, doc, out / "plans" / "moe-batched.json", path, tokens, repeats, in_flight, progress)
        res.wall_s = time.monotonic() - t0
        (out / "bench-moe.json").write_text(json.dumps(stamped(asdict(res)), indent=1))
    return res


def serve_batched(
    res: MoEBenchResult,
    doc: PlanDoc,
    plan_file: Path,
    path: str,
    tokens: int,
    repeats: int,
    in_flight: int,
    progress: Callable[[str], None],
) -> None:
    """``doc`` batched with ``in_flight`` request slots: one request alone (median of ``repeats``), then ``in_flight``
    sent at once (aggregate decode tok/s, median of ``repeats``), every answer held to the batched unsplit model's."""
    max_context = doc.model.max_context
    objective = msgspec.structs.replace(doc.placement.objective, requests=in_flight)  # its memory check counts them
    doc = with_id(msgspec.structs.replace(doc, placement=msgspec.structs.replace(doc.placement, objective=objective)))
    f = GGUFFile(path)
    whole = ModelSlice(f, 0, f.config.blocks, True, True, max_context, slots=1, batched=True)
    want = oracle_decode(path, PROMPT, tokens, max_context, model=whole).token_ids
    plan_file.write_text(pretty(doc))
    scenario = plan_scenario(plan_file, tokens, max_context)
    scenario = msgspec.structs.replace(
        scenario, serving=msgspec.structs.replace(scenario.serving, slots=in_flight, batched=True)
    )
    res.in_flight, res.in_flight_exact = in_flight, True
    alone: list[float] = []
    together: list[float] = []
    with Chain(scenario, progress=lambda _: None) as chain:
        chain.request(PROMPT, 2)
        for _ in range(repeats):
            response, _ = chain.request(PROMPT, tokens)
            res.in_flight_exact &= response.token_ids == want
            alone.append(decode_tok_s(response))
        for _ in range(repeats):
            served = chain.serve([Job(PROMPT, tokens)] * in_flight)
            for s in served:
                if s.response is None:
                    raise HarnessError(f"batched plan {doc.id}: a request was refused: {s.refused}")
                res.in_flight_exact &= s.response.token_ids == want
            first = min(s.token_at[0] for s in served)
            last = max(s.token_at[-1] for s in served)
            together.append(sum(len(s.token_at) - 1 for s in served) / (last - first))
    res.in_flight_alone_tok_s = statistics.median(alone)
    res.in_flight_tok_s = statistics.median(together)
    progress(
        f"batched, {in_flight} in flight: {res.in_flight_tok_s:.1f} tok/s aggregate against "
        f"{res.in_flight_alone_tok_s:.1f} for one request alone; answers equal the batched model's: "
        f"{'yes' if res.in_flight_exact else 'NO'}"
    )


def report(res: MoEBenchResult) -> str:
    lines = [
        f"model {res.model}; {res.expert_nodes} expert node(s); {res.tokens} tokens x {res.repeats}",
        f"one process: {res.single_tok_s:.1f} tok/s; hop (calibrated) {res.hop_ms:.3f} ms",
        "",
        f"{'delay ms':>8} {'tok/s':>7} {'x one':>6} {'predicted':>10} {'measured':>9} {'error':>7}   "
        "per token p50 (ms): compute, fan-out, gather, hops",
    ]
    for c in res.cases:
        b = c.breakdown_ms
        lines.append(
            f"{c.delay_ms:>8g} {c.tok_s:>7.1f} {c.tok_s / res.single_tok_s if res.single_tok_s else 0:>6.2f} "
            f"{c.predicted_ms:>10.2f} {c.measured_ms:>9.2f} {c.error_pct:>+6.1f}%   "
            f"{b.get('compute', 0):.2f}, {b.get('fan-out', 0):.2f}, {b.get('gather', 0):.2f}, {b.get('hops', 0):.2f}"
        )
    if res.in_flight > 1:
        lines.append(
            f"\nbatched, {res.in_flight} in flight (delay 0): {res.in_flight_tok_s:.1f} tok/s aggregate, "
            f"{res.in_flight_tok_s / res.in_flight_alone_tok_s if res.in_flight_alone_tok_s else 0:.2f}x one request "
            f"alone in the same chain ({res.in_flight_alone_tok_s:.1f}); every answer equals the batched unsplit "
            f"model's: {'yes' if res.in_flight_exact else 'NO'}"
        )
    verdict = "within" if res.within_target else "NOT within"
    lines.append(
        f"\ndelay 0 calibrates the fixed costs ({res.calibration}); every prediction {verdict} "
        f"{TARGET_ERROR_PCT:g} % of its measurement ({res.wall_s:.0f} s)"
    )
    return "\n".join(lines)
