"""``ppharness bench plan``: the planner's plan against the even and the memory-proportional split, predicted and
measured, on real heterogeneous clusters.

Every cluster file's devices are docker containers on this machine, each with the CPU quota and memory limit its
entry gives, joined by links the WAN emulation delays (message level, ZeroMQ). Before any plan runs, the bench
measures what the cost model needs on this machine:

- the CPU's decode speed and fixed cost per token (``ppharness.benchmarks.probe``; every device of the cluster files
  shares this CPU, so each gets the probe's figures and keeps its quota);
- the transport's cost per hop: a two-node chain with perfect links, traced; its hops' p50.

Then per cluster and per policy (``optimal``, ``even``, ``memory``): make the plan, predict its per-token time
(``ppharness.plan.predict.simulate``), run it (a warm-up request, then ``repeats`` requests, each checked against the
unsplit model, tokens and stage boundaries) and measure the mean time per decode token (the decode span over the tokens,
on the last stage's clock; a quota-bound node makes a few tokens wait much longer than the rest, which the mean counts
and a median hides). Reported per plan: predicted and measured ms per token, the prediction's error, and the trace's
components beside the prediction's, row for row.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from ppharness.benchmarks.probe import probe_fit
from ppharness.benchmarks.provenance import stamped
from ppharness.errors import HarnessError
from ppharness.model.decode.oracle import OracleResult, oracle_decode
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import resolve_model
from ppharness.model.synthetic.spec import PRESETS, preset_spec, synthetic_source
from ppharness.plan.build import chain
from ppharness.plan.graph import model_graph
from ppharness.plan.lang.document import Cluster, Device, Impaired, ModelGraph, Objective, PlanDoc, Source, hops, pretty
from ppharness.plan.lang.text_form import render
from ppharness.plan.predict.simulate import compare, simulate
from ppharness.plan.reader import load_cluster
from ppharness.plan.search.planner import policy_plan
from ppharness.run.seed.orchestrator import Chain, decode_tok_s
from ppharness.scenario.schema import Scenario, scenario_from_args, with_plan
from ppharness.trace.report import percentile

PROMPT = "Which devices, in which order, and how many blocks each"
POLICIES = ("optimal", "even", "memory")
SHIPPED = ("homogeneous-cluster.yaml", "mild-cluster.yaml", "strong-cluster.yaml")
TARGET_ERROR_PCT = 15.0
WARM_UP_TOKENS = 2
SETTLE_S = 0.2


def shipped_clusters() -> list[Path]:
    root = Path(__file__).resolve().parents[2] / "scenarios" / "clusters"
    return [root / name for name in SHIPPED]


@dataclass
class PlanCase:
    cluster: str
    policy: str
    plan_id: str = ""
    placement: str = ""  # the compact text form
    predicted_ms: float = 0.0
    measured_ms: float = 0.0  # mean per decode token, median over the repeats
    measured_p50_ms: float = 0.0  # the trace's per-token p50, pooled over the repeats
    per_repeat_ms: list[float] = field(default_factory=list)
    error_pct: float = 0.0
    rows: str = ""  # simulate.compare: predicted against measured, row for row
    elapsed_s: float = 0.0


@dataclass
class PlanBenchResult:
    model: str
    provider: str
    tokens: int
    repeats: int
    probe: dict[str, float] = field(default_factory=dict)
    probe_device: dict[str, object] = field(default_factory=dict)  # the device entry the probe wrote
    hop_ms: float = 0.0
    cases: list[PlanCase] = field(default_factory=list)
    elapsed_s: float = 0.0

    def best(self, cluster: str) -> str:
        """The policy whose plan measured fastest on ``cluster``."""
        rows = [c for c in self.cases if c.cluster == cluster]
        return min(rows, key=lambda c: c.measured_ms).policy if rows else ""

    @property
    def clusters(self) -> list[str]:
        return list(dict.fromkeys(c.cluster for c in self.cases))


def oracle_prompt_tokens(path: str) -> list[int]:
    """The bench prompt's tokens as the entry node sees them (BOS included)."""
    f = GGUFFile(path)
    bos = [f.config.bos_id] if f.config.bos_id is not None else []
    return bos + list(f.tokenizer.encode(PROMPT))


def calibrated(cluster: Cluster, probe: Device, hop_ms: float) -> Cluster:
    """``cluster`` with this machine's measured speed in every device (each keeps its quota, and takes the probe's
    ``measured``: what its figures now come from) and the measured hop."""
    devices = tuple(
        msgspec.structs.replace(
            d,
            gflops=probe.gflops,
            bandwidth_gbs=probe.bandwidth_gbs,
            overhead_ms=probe.overhead_ms,
            prefill_ms=probe.prefill_ms,
            prefill_block_ms=probe.prefill_block_ms,
            prefill_gflops=probe.prefill_gflops,
            measured=probe.measured,
        )
        for d in cluster.devices
    )
    return msgspec.structs.replace(cluster, devices=devices, hop_ms=hop_ms)


def on_provider(cluster: Cluster, provider: str) -> Cluster:
    """``cluster`` on another provider (``local``: processes here, without the containers' limits)."""
    if provider == "docker":
        return cluster
    devices = tuple(msgspec.structs.replace(d, source=Source(kind="local")) for d in cluster.devices)
    return msgspec.structs.replace(cluster, devices=devices)


def plan_scenario(plan_file: Path, tokens: int, max_context: int) -> Scenario:
    base = scenario_from_args(transport="zmq", prompt=PROMPT, max_tokens=tokens)
    budget = msgspec.structs.replace(base.budget, total_s=3600.0, ready_s=900.0, join_s=600.0)
    model = msgspec.structs.replace(base.model, max_context=max_context)
    raw = msgspec.to_builtins(msgspec.structs.replace(base, budget=budget, model=model, name="bench-plan"))
    return with_plan(msgspec.convert(raw, type=Scenario), str(plan_file))


def run_plan(
    doc: PlanDoc,
    plan_file: Path,
    tokens: int,
    repeats: int,
    oracle: OracleResult,
    progress: Callable[[str], None],
) -> tuple[list[float], list[float], object]:
    """Run ``doc``: warm-up, then ``repeats`` requests checked against ``oracle``. Returns the mean ms per decode
    token of each repeat, the trace's per-token times (pooled) and the last repeat's trace."""
    plan_file.write_text(pretty(doc))
    scenario = plan_scenario(plan_file, tokens, doc.model.max_context)
    per_repeat: list[float] = []
    pooled: list[float] = []
    trace = None
    with Chain(scenario, progress=lambda _: None, trace=True) as chain:
        chain.request(PROMPT, WARM_UP_TOKENS)
        time.sleep(SETTLE_S + _last_hop_s(doc))
        for _ in range(repeats):
            response, _ = chain.request(PROMPT, tokens)
            time.sleep(SETTLE_S + _last_hop_s(doc))
            verdict = chain.verdict(response, oracle)
            if not verdict.exact:
                raise HarnessError(
                    f"plan {doc.id}: the chain's answer differs from the unsplit model's: "
                    f"{verdict.describe(response.token_ids, oracle.token_ids)}"
                )
            per_repeat.append(1000.0 / decode_tok_s(response))
            trace = chain.trace_of(response)
            pooled += [r.total_ms for r in trace.decode]
    progress(f"plan {doc.id}: {', '.join(f'{ms:.2f}' for ms in per_repeat)} ms per token; tokens equal the oracle's")
    return per_repeat, pooled, trace


def _last_hop_s(doc: PlanDoc) -> float:
    last = hops(doc)[-1]
    return doc.cluster.link(last.src.device, last.dst.device).delay_ms / 1000


def measure_hop_ms(
    graph: ModelGraph, base: Cluster, tokens: int, oracle: OracleResult, out: Path, log: Callable[[str], None]
) -> float:
    """The transport's cost per hop on this provider: a two-node even chain over the first two devices, links perfect,
    traced; the p50 of its hops over the decode tokens."""
    free = tuple(
        msgspec.structs.replace(d, memory=1 << 40, source=msgspec.structs.replace(d.source, cpus=None))
        for d in base.devices[:2]
    )
    two = msgspec.structs.replace(base, devices=free, default=Impaired(), links=(), region_links=(), hop_ms=0.0)
    doc = chain(graph, two, [d.id for d in two.devices], [len(graph.blocks) // 2], policy="even")
    _, _, trace = run_plan(doc, out / "calibration-plan.json", tokens, 1, oracle, log)
    values = [v for r in trace.decode for k, v in r.parts.items() if k.startswith("hop ")]  # type: ignore[attr-defined]
    return percentile(values, 50)


def run_plan_bench(
    cluster_files: list[str],
    preset: str,
    tokens: int,
    repeats: int,
    provider: str,
    out_dir: str,
    progress: Callable[[str], None],
) -> PlanBenchResult:
    """Calibrate, then run every policy's plan on every cluster; write ``bench-plan.json`` after every plan."""
    if preset not in PRESETS:
        raise HarnessError(f"unknown preset {preset!r}: expected one of {', '.join(PRESETS)}")
    if tokens < 2 or repeats < 1:
        raise HarnessError("decode speed needs at least 2 tokens and 1 repeat")
    clusters = [on_provider(load_cluster(f), provider) for f in cluster_files]
    t0 = time.monotonic()
    out = Path(out_dir)
    (out / "plans").mkdir(parents=True, exist_ok=True)
    source = synthetic_source(preset_spec(preset))
    path = str(resolve_model(source))
    max_context = 64 + tokens + 16
    graph = model_graph(path, source, max_context)
    res = PlanBenchResult(
        model=f"{preset} ({len(graph.blocks)} blocks, dim {graph.dim})",
        provider=provider,
        tokens=tokens,
        repeats=repeats,
    )
    prompt_tokens = len(oracle_prompt_tokens(path))
    progress("the unsplit model's answer (the oracle)")
    oracle = oracle_decode(path, PROMPT, tokens, max_context, boundaries=True)
    progress("probing this machine's decode speed")
    fit = probe_fit(path, "probe", source=source)
    progress(fit.probe_report)
    res.probe_device = msgspec.to_builtins(fit.device)
    res.probe = {
        "gflops": fit.device.gflops,
        "bandwidth_gbs": fit.device.bandwidth_gbs or 0.0,
        "overhead_ms": fit.device.overhead_ms,
        "r2": fit.r2,
    }
    progress("measuring the cost of one hop (a two-node chain, perfect links)")
    res.hop_ms = measure_hop_ms(graph, clusters[0], tokens, oracle, out / "plans", progress)
    progress(f"one hop: {res.hop_ms:.3f} ms (p50)")
    for cluster in clusters:
        cluster = calibrated(cluster, fit.device, res.hop_ms)
        for policy in POLICIES:
            t_case = time.monotonic()
            doc = policy_plan(policy, graph, cluster, Objective())
            prediction = simulate(doc, prompt_tokens=prompt_tokens)
            case = PlanCase(
                cluster=cluster.name,
                policy=policy,
                plan_id=doc.id,
                placement=render(doc.placement),
                predicted_ms=prediction.per_token_ms,
            )
            progress(
                f"{cluster.name} / {policy}: plan {doc.id}, predicted {prediction.per_token_ms:.2f} ms per token\n"
                + case.placement.rstrip()
            )
            per_repeat, pooled, trace = run_plan(
                doc, out / "plans" / f"{cluster.name}-{policy}.json", tokens, repeats, oracle, progress
            )
            case.per_repeat_ms = per_repeat
            case.measured_ms = statistics.median(per_repeat)
            case.measured_p50_ms = statistics.median(pooled) if pooled else float("nan")
            case.error_pct = 100 * (case.predicted_ms - case.measured_ms) / case.measured_ms
            case.rows = compare(prediction, trace)  # type: ignore[arg-type]
            case.elapsed_s = time.monotonic() - t_case
            res.cases.append(case)
            res.elapsed_s = time.monotonic() - t0
            write_json(res, out / "bench-plan.json")
            progress(
                f"{cluster.name} / {policy}: measured {case.measured_ms:.2f} ms per token "
                f"(predicted {case.predicted_ms:.2f}, {case.error_pct:+.1f} %) in {case.elapsed_s:.0f} s"
            )
    res.elapsed_s = time.monotonic() - t0
    write_json(res, out / "bench-plan.json")
    return res


def write_json(res: PlanBenchResult, path: Path) -> None:
    path.write_text(json.dumps(stamped(asdict(res)), indent=1) + "\n")


def report(res: PlanBenchResult) -> str:
    lines = [
        f"plans on {len(res.clusters)} cluster(s) ({res.provider}); model {res.model}; {res.tokens} tokens x "
        f"{res.repeats} repeats",
        f"this machine: {res.probe.get('gflops', 0):.3f} GFLOP/s, {res.probe.get('overhead_ms', 0):.3f} ms per token "
        f"per node (probe r² {res.probe.get('r2', 0):.3f}); one hop {res.hop_ms:.3f} ms",
        f"{'cluster':<14} {'policy':<8} {'plan':<17} {'predicted':>10} {'measured':>10} {'error':>8}",
    ]
    for c in res.cases:
        lines.append(
            f"{c.cluster:<14} {c.policy:<8} {c.plan_id:<17} {c.predicted_ms:>8.2f}ms {c.measured_ms:>8.2f}ms "
            f"{c.error_pct:>+7.1f}%"
        )
    for name in res.clusters:
        best = res.best(name)
        within = all(abs(c.error_pct) <= TARGET_ERROR_PCT for c in res.cases if c.cluster == name)
        lines.append(
            f"{name}: fastest measured: {best} ({'the planner: MET' if best == 'optimal' else 'MISSED'}); every "
            f"prediction within {TARGET_ERROR_PCT:g} %: {'MET' if within else 'MISSED'}"
        )
    return "\n".join(lines)


def plot(res: PlanBenchResult, path: Path) -> bool:
    """Predicted and measured ms per token, per cluster and policy (bars); False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    clusters = res.clusters
    fig, axes = plt.subplots(1, len(clusters), figsize=(4.5 * len(clusters), 4), squeeze=False)
    for ax, name in zip(axes[0], clusters):
        rows = [c for c in res.cases if c.cluster == name]
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [c.predicted_ms for c in rows], 0.4, label="predicted")
        ax.bar([x + 0.2 for x in xs], [c.measured_ms for c in rows], 0.4, label="measured")
        ax.set_xticks(list(xs), [c.policy for c in rows])
        ax.set_title(name)
        ax.set_ylabel("ms per token")
        ax.legend()
    fig.suptitle(f"bench plan: {res.model}, {res.provider}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
