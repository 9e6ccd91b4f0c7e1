"""``ppharness bench wan``: the N-stage chain over emulated WAN links, against the bound the network sets.

One case per preset, transport and one-way delay (and, for iroh, per loss rate at ``LOSS_DELAY_MS``). Every case
impairs each stage -> stage link of the token loop (``0->1 ... (N-1)->0``) with the delay; the links to and from the
seed (the orchestrator, off the token path) stay perfect. ZeroMQ is impaired at the message layer, iroh at the packet
layer (its QUIC datagrams, every node in a network namespace of its own). A case starts one traced chain, sends a
warm-up request, then ``repeats`` requests; every answer is checked against the unsplit model's, tokens and stage
boundaries, and a mismatch ends the bench. After each response the bench waits out the last hop's delay: the last
token's NextToken reaches stage 0 over the delayed (N-1)->0 link after the response has reached the seed over a
perfect one, and stage 0 takes no new request, nor records that token's last hop, before it arrives.

Per case:

- measured: decode tokens/s from the response's token times (the last stage's clock), median over the repeats;
- bound: ``1 / (sum of stage compute p50 + sum of configured hop delays)``, the compute p50s from the same requests'
  traces (pooled over their decode tokens): what the model and the network force, with nothing of the harness;
- ratio: measured / bound, against the target ``TARGET_RATIO``;
- the hops' p50/p99 (pooled over every stage -> stage hop and decode token) and the per-token time's components, so
  that a case below its bound shows where the rest of the time went.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from ppharness.benchmarks.provenance import stamped
from ppharness.errors import HarnessError
from ppharness.model.decode.oracle import OracleResult, oracle_decode
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import resolve_model
from ppharness.model.synthetic.spec import PRESETS
from ppharness.network.spec import Impairment, Network, stage_node
from ppharness.run.seed.orchestrator import Chain, decode_tok_s
from ppharness.scenario.schema import Scenario, scenario_from_args
from ppharness.trace.report import STAGE_PARTS, percentile

if TYPE_CHECKING:
    from ppharness.trace.report import TokenRecord

PROMPT = "Pipeline parallel inference over the wide area network"
TARGET_RATIO = 0.90
LOSS_DELAY_MS = 25.0
LAYERS: dict[str, Literal["message", "packet"]] = {"zmq": "message", "iroh": "packet"}
LOSS_TRANSPORTS = ("iroh",)  # QUIC recovers lost packets; a message lost at the message layer would end the run
SETTLE_S, SETTLE_LOSSY_S = 0.2, 1.0  # after a response, beyond the last hop's delay (more: QUIC retransmits a loss)
WARM_UP_TOKENS = 2  # the warm-up request compiles the prefill for the prompt's length; decode is compiled at Ready

# For the estimate printed at the start, measured on a 2-core machine, per preset: seconds per stage to start a chain
# (load, compile the decode step) and warm it up (compile the prefill); the chain's per-token time with no delay at 5
# stages; the oracle's load and decode.
START_PER_STAGE_S = {"tiny": 6.0, "small": 6.0}
TOKEN_MS = {"tiny": 14.0, "small": 53.0}
ORACLE_S = {"tiny": 20.0, "small": 20.0}
PER_REQUEST_S = 2.0  # the prefill, the settling, the oracle check and the trace collection of one request


@dataclass
class Case:
    preset: str
    transport: str
    delay_ms: float
    loss_pct: float = 0.0

    @property
    def layer(self) -> Literal["message", "packet"]:
        return LAYERS[self.transport]

    @property
    def name(self) -> str:
        loss = f", {self.loss_pct:g} % loss" if self.loss_pct else ""
        return f"{self.preset} {self.transport} {self.delay_ms:g} ms{loss}"

    def network(self, seed: int) -> Network:
        return Network(
            seed=seed, layer=self.layer, default=Impairment(delay_ms=self.delay_ms, loss=self.loss_pct / 100)
        )


@dataclass
class CaseResult:
    preset: str
    transport: str
    layer: str
    delay_ms: float
    loss_pct: float
    tok_s: list[float] = field(default_factory=list)  # per repeat, from the response's token times
    tok_s_median: float = 0.0
    compute_ms: dict[str, float] = field(default_factory=dict)  # "stage i compute" -> p50 over the decode tokens
    compute_sum_ms: float = 0.0
    delay_sum_ms: float = 0.0  # the configured one-way delays of the token loop's hops
    bound_tok_s: float = 0.0
    ratio: float = 0.0
    met: bool | None = None  # None where no target applies (the loss cases: the bound knows nothing of retransmission)
    hop_p50_ms: float = 0.0  # pooled over every stage -> stage hop and decode token of every repeat
    hop_p99_ms: float = 0.0
    hop_mean_ms: float = 0.0
    hops_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # "0->1" -> {"p50": ..., "p99": ...}
    components_ms: dict[str, float] = field(default_factory=dict)  # p50 of every trace component, "other", "per token"
    breakdown_ms: dict[str, float] = field(default_factory=dict)  # per-token time: compute, delay, hop excess, ...
    decode_tokens: int = 0  # decode tokens the trace figures pool
    exact: bool = True  # every answer equal to the unsplit model's, tokens and stage boundaries
    elapsed_s: float = 0.0

    @property
    def per_token_ms(self) -> float:
        return 1000.0 / self.tok_s_median if self.tok_s_median > 0 else math.inf


@dataclass
class WanBenchResult:
    num_stages: int
    tokens: int
    repeats: int
    seed: int
    target_ratio: float = TARGET_RATIO
    models: dict[str, str] = field(default_factory=dict)
    cases: list[CaseResult] = field(default_factory=list)
    estimate_s: float = 0.0
    elapsed_s: float = 0.0

    def case(self, preset: str, transport: str, delay_ms: float, loss_pct: float = 0.0) -> CaseResult | None:
        for c in self.cases:
            if (c.preset, c.transport, c.delay_ms, c.loss_pct) == (preset, transport, delay_ms, loss_pct):
                return c
        return None

    @property
    def met(self) -> bool:
        return all(c.met is not False for c in self.cases)


def plan_cases(presets: list[str], transports: list[str], delays: list[float], losses: list[float]) -> list[Case]:
    cases = []
    for preset in presets:
        for transport in transports:
            cases += [Case(preset, transport, d) for d in delays]
            if transport in LOSS_TRANSPORTS:
                cases += [Case(preset, transport, LOSS_DELAY_MS, p) for p in losses if p > 0]
    return cases


def case_estimate_s(case: Case, num_stages: int, tokens: int, repeats: int) -> float:
    """Roughly how long one case takes (see ``START_PER_STAGE_S``)."""
    per_token_s = (TOKEN_MS.get(case.preset, 60.0) * num_stages / 5 + num_stages * case.delay_ms) / 1000
    if case.loss_pct:
        per_token_s *= 1 + case.loss_pct / 15  # retransmissions
    start_s = START_PER_STAGE_S.get(case.preset, 10.0) * num_stages
    return start_s + repeats * (PER_REQUEST_S + (tokens - 1) * per_token_s)


def estimate_s(cases: list[Case], num_stages: int, tokens: int, repeats: int) -> float:
    """Roughly how long the bench takes: every case, and the oracle of every preset."""
    oracles = sum(ORACLE_S.get(p, 30.0) for p in dict.fromkeys(c.preset for c in cases))
    return oracles + sum(case_estimate_s(c, num_stages, tokens, repeats) for c in cases)


def _scenario(case: Case, num_stages: int, tokens: int, max_context: int, seed: int) -> Scenario:

    base = scenario_from_args(num_stages=num_stages, transport=case.transport, prompt=PROMPT, max_tokens=tokens)
    synthetic = base.model.synthetic
    assert synthetic is not None, "the built-in scenario's model is synthetic"
    model = msgspec.structs.replace(
        base.model, synthetic=msgspec.structs.replace(synthetic, preset=case.preset), max_context=max_context
    )
    budget = msgspec.structs.replace(base.budget, total_s=3600.0, ready_s=900.0)
    raw = msgspec.to_builtins(
        msgspec.structs.replace(base, model=model, budget=budget, network=case.network(seed), name="bench-wan")
    )
    return msgspec.convert(raw, type=Scenario)  # checked as a scenario file would be


def _pooled(rows: list[TokenRecord], name: str) -> list[float]:
    return [r.parts[name] for r in rows if name in r.parts]


def _absorb(res: CaseResult, rows: list[TokenRecord], network: Network, num_stages: int) -> None:
    """The bound, the hops and the per-token time's components, from the decode tokens of every repeat's trace."""
    names: list[str] = []
    for r in rows:
        names += [k for k in r.parts if k not in names]
    res.decode_tokens = len(rows)
    res.components_ms = {name: percentile(_pooled(rows, name), 50) for name in names}
    res.components_ms["other"] = percentile([r.other_ms for r in rows], 50)
    res.components_ms["per token"] = percentile([r.total_ms for r in rows], 50)
    compute = [k for k in names if k.startswith("stage ") and k.endswith(" compute")]
    res.compute_ms = {k: res.components_ms[k] for k in compute}
    res.compute_sum_ms = sum(res.compute_ms.values())
    res.delay_sum_ms = sum(
        network.impairment(stage_node(i), stage_node((i + 1) % num_stages)).delay_ms for i in range(num_stages)
    )
    res.bound_tok_s = 1000.0 / (res.compute_sum_ms + res.delay_sum_ms)
    res.ratio = res.tok_s_median / res.bound_tok_s
    res.met = res.ratio >= TARGET_RATIO if not res.loss_pct else None
    hops = [k for k in names if k.startswith("hop ")]
    every_hop = [v for k in hops for v in _pooled(rows, k)]
    res.hop_p50_ms, res.hop_p99_ms = percentile(every_hop, 50), percentile(every_hop, 99)
    res.hop_mean_ms = statistics.fmean(every_hop) if every_hop else math.nan
    res.hops_ms = {
        k.removeprefix("hop "): {"p50": percentile(_pooled(rows, k), 50), "p99": percentile(_pooled(rows, k), 99)}
        for k in hops
    }
    overhead = [k for k in names if k.startswith("stage ") and k.rsplit(" ", 1)[1] in STAGE_PARTS and k not in compute]
    res.breakdown_ms = {
        "per token (trace)": res.components_ms["per token"],
        "stage compute": res.compute_sum_ms,
        "configured delay": res.delay_sum_ms,
        "hops beyond the delay": sum(res.components_ms[k] for k in hops) - res.delay_sum_ms,
        "stage (de)serialise, tokenize": sum(res.components_ms[k] for k in overhead),
        "other": res.components_ms["other"],
    }


def run_case(
    case: Case,
    num_stages: int,
    tokens: int,
    repeats: int,
    max_context: int,
    seed: int,
    oracle: OracleResult,
    progress: Callable[[str], None],
) -> CaseResult:
    """Start the case's chain, warm it, run ``repeats`` requests; every answer checked against ``oracle``."""

    t0 = time.monotonic()
    res = CaseResult(case.preset, case.transport, case.layer, case.delay_ms, case.loss_pct)
    scenario = _scenario(case, num_stages, tokens, max_context, seed)
    assert scenario.network is not None
    rows: list[TokenRecord] = []
    n = num_stages
    last_hop = scenario.network.impairment(stage_node(n - 1), stage_node(0))
    settle_s = last_hop.delay_ms / 1000 + (SETTLE_LOSSY_S if last_hop.mean_loss() else SETTLE_S)
    hops = [f"hop {i}->{(i + 1) % n}" for i in range(n)]
    with Chain(scenario, progress=lambda _: None, trace=True) as chain:
        t_up = time.monotonic()
        progress(f"{case.name}: chain up in {t_up - t0:.1f} s; warm-up request (compiles the prefill)")
        chain.request(PROMPT, WARM_UP_TOKENS)
        time.sleep(settle_s)
        progress(f"{case.name}: warm in {time.monotonic() - t_up:.1f} s")
        for r in range(1, repeats + 1):
            response, _ = chain.request(PROMPT, tokens)
            time.sleep(settle_s)
            verdict = chain.verdict(response, oracle)
            if not verdict.exact:
                raise HarnessError(
                    f"{case.name}: the chain's answer differs from the unsplit model's: "
                    f"{verdict.describe(response.token_ids, oracle.token_ids)}"
                )
            rows += [t for t in chain.trace_of(response).decode if all(h in t.parts for h in hops)]
            res.tok_s.append(decode_tok_s(response))
            progress(
                f"{case.name}: repeat {r}/{repeats}: {res.tok_s[-1]:.1f} tok/s "
                f"(per token {1000 / res.tok_s[-1]:.1f} ms), tokens equal the oracle's"
            )
    res.tok_s_median = statistics.median(res.tok_s)
    _absorb(res, rows, scenario.network, num_stages)
    res.elapsed_s = time.monotonic() - t0
    return res


def run_wan_bench(
    presets: list[str],
    transports: list[str],
    delays: list[float],
    losses: list[float],
    tokens: int,
    repeats: int,
    num_stages: int,
    out_dir: str,
    seed: int,
    progress: Callable[[str], None],
) -> WanBenchResult:
    """Run every case; write ``bench-wan.json`` (after every case) into ``out_dir``; return the result."""

    for p in presets:
        if p not in PRESETS:
            raise HarnessError(f"unknown preset {p!r}: expected one of {', '.join(PRESETS)}")
    for t in transports:
        if t not in LAYERS:
            raise HarnessError(f"transport {t!r} cannot be impaired here: expected one of {', '.join(LAYERS)}")
    if num_stages < 2:
        raise HarnessError("the chain needs at least 2 stages to have links between them")
    if tokens < 2 or repeats < 1:
        raise HarnessError("decode speed needs at least 2 tokens and 1 repeat")
    if any(d < 0 for d in delays) or any(not 0 <= p <= 100 for p in losses):
        raise HarnessError("delays are milliseconds (0 or more), losses percent (0 to 100)")
    cases = plan_cases(presets, transports, delays, losses)
    res = WanBenchResult(num_stages=num_stages, tokens=tokens, repeats=repeats, seed=seed)
    res.estimate_s = estimate_s(cases, num_stages, tokens, repeats)
    progress(
        f"{len(cases)} cases ({num_stages} stages, {tokens} tokens, {repeats} repeats each): "
        f"about {res.estimate_s / 60:.0f} min on a 2-core machine"
    )
    t0 = time.monotonic()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    k, done_est = 0, 0.0
    for preset in presets:
        path = str(resolve_model(f"synthetic:{preset}"))
        cfg = GGUFFile(path).config
        if cfg.blocks < num_stages:
            raise HarnessError(f"the {preset} model has {cfg.blocks} blocks, fewer than {num_stages} stages")
        max_context = min(cfg.context, 64 + tokens + 16)
        res.models[preset] = f"{cfg.blocks} blocks, dim {cfg.dim}"
        progress(f"{preset}: the unsplit model's answer (the oracle)")
        oracle = oracle_decode(path, PROMPT, tokens, max_context, boundaries=True)
        for case in (c for c in cases if c.preset == preset):
            k += 1
            progress(f"case {k}/{len(cases)}: {case.name} ({case.layer} layer)")
            r = run_case(case, num_stages, tokens, repeats, max_context, seed, oracle, progress)
            res.cases.append(r)
            done_est += case_estimate_s(case, num_stages, tokens, repeats)
            left = sum(case_estimate_s(c, num_stages, tokens, repeats) for c in cases[k:])
            pace = (time.monotonic() - t0) / (done_est + sum(ORACLE_S.get(p, 30.0) for p in res.models))
            progress(
                f"case {k}/{len(cases)}: {case_line(r)} ({r.elapsed_s:.0f} s; about {left * pace / 60:.1f} min left)"
            )
            res.elapsed_s = time.monotonic() - t0
            write_json(res, out / "bench-wan.json")
    res.elapsed_s = time.monotonic() - t0
    write_json(res, out / "bench-wan.json")
    return res


def _verdict(r: CaseResult) -> str:
    return "n/a" if r.met is None else "MET" if r.met else "MISSED"


def case_line(r: CaseResult) -> str:
    return (
        f"{r.tok_s_median:.2f} tok/s, bound {r.bound_tok_s:.2f}, ratio {r.ratio:.3f} {_verdict(r)}; "
        f"hop p50 {r.hop_p50_ms:.2f} ms, p99 {r.hop_p99_ms:.2f} ms"
    )


def report(res: WanBenchResult) -> str:
    """The tables printed at the end of ``ppharness bench wan``."""
    models = "; ".join(f"{p}: {m}" for p, m in res.models.items())
    lines = [
        f"{res.num_stages}-stage chain over emulated WAN ({models}); {res.tokens} tokens, {res.repeats} repeats "
        f"(medians); delay one-way on each of the {res.num_stages} stage->stage hops; seed {res.seed}",
        "bound = 1 / (sum of stage compute p50 + sum of configured hop delays); "
        f"target: ratio >= {res.target_ratio:.2f}",
        f"{'preset':<7} {'transport':<9} {'delay ms':>8} {'loss %':>6} {'tok/s':>8} {'bound':>8} {'ratio':>6} "
        f"{'target':<6} {'hop p50':>8} {'hop p99':>8}",
    ]
    for c in res.cases:
        lines.append(
            f"{c.preset:<7} {c.transport:<9} {c.delay_ms:>8g} {c.loss_pct:>6g} {c.tok_s_median:>8.2f} "
            f"{c.bound_tok_s:>8.2f} {c.ratio:>6.3f} {_verdict(c):<6} {c.hop_p50_ms:>8.2f} {c.hop_p99_ms:>8.2f}"
        )
    lines.append(
        "\nper-token time in ms: 1/tok/s (the mean over a request's decode tokens) against the trace's p50 of the "
        "per-token time and of each of its parts, and the bound's per-token time"
    )
    keys = list(res.cases[0].breakdown_ms) if res.cases else []
    heads = ["per token", "compute", "delay", "hop excess", "stage ovh", "other"]
    lines.append(f"{'case':<28} {'1/tok/s':>8} " + " ".join(f"{h:>10}" for h in heads) + f" {'bound':>8}")
    for c in res.cases:
        name = f"{c.preset} {c.transport} {c.delay_ms:g} ms" + (f" {c.loss_pct:g}%" if c.loss_pct else "")
        lines.append(
            f"{name:<28} {c.per_token_ms:>8.2f} "
            + " ".join(f"{c.breakdown_ms[k]:>10.2f}" for k in keys)
            + f" {1000 / c.bound_tok_s:>8.2f}"
        )
    loss_lines = []
    for preset in res.models:
        for transport in LOSS_TRANSPORTS:
            losses = sorted({c.loss_pct for c in res.cases if c.transport == transport and c.preset == preset})
            for loss in losses:
                lc = res.case(preset, transport, LOSS_DELAY_MS, loss)
                if lc is not None:
                    loss_lines.append(
                        f"  {preset:<7} {transport:<5} {loss:>4g} % loss: hop p50 {lc.hop_p50_ms:7.2f} ms, "
                        f"p99 {lc.hop_p99_ms:7.2f} ms, mean {lc.hop_mean_ms:7.2f} ms; {lc.tok_s_median:.2f} tok/s "
                        f"(ratio {lc.ratio:.3f})"
                    )
    if loss_lines:
        lines.append(f"\nhops under packet loss ({LOSS_DELAY_MS:g} ms delay):")
        lines += loss_lines
    met = [c for c in res.cases if c.met is not None]
    missed = [c for c in met if not c.met]
    lines.append(
        f"\ntarget ratio >= {res.target_ratio:.2f}: met by {len(met) - len(missed)} of {len(met)} loss-free cases"
        + (f"; missed: {', '.join(f'{c.preset} {c.transport} {c.delay_ms:g} ms' for c in missed)}" if missed else "")
    )
    lines.append(
        f"every answer ({len(res.cases) * res.repeats} requests) equal to the unsplit model's, tokens and "
        f"stage boundaries; {res.elapsed_s / 60:.1f} min (estimated {res.estimate_s / 60:.1f})"
    )
    return "\n".join(lines)


def _finite(value: object) -> object:
    """JSON has no NaN or infinity: null instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def write_json(res: WanBenchResult, path: Path) -> None:
    path.write_text(json.dumps(_finite(stamped(asdict(res) | {"met": res.met})), indent=2))


def plot(res: WanBenchResult, path: Path) -> bool:
    """Tokens/s against delay, one panel per preset, a line per transport and its bound dashed; False without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    presets = list(res.models)
    fig, axes = plt.subplots(1, len(presets), figsize=(6 * len(presets), 4.5), squeeze=False)
    for ax, preset in zip(axes[0], presets, strict=True):
        for i, transport in enumerate(dict.fromkeys(c.transport for c in res.cases if c.preset == preset)):
            color = plt.get_cmap("tab10")(i)
            rows = sorted(
                (c for c in res.cases if (c.preset, c.transport) == (preset, transport) and not c.loss_pct),
                key=lambda c: c.delay_ms,
            )
            xs = [c.delay_ms for c in rows]
            ax.plot(xs, [c.tok_s_median for c in rows], marker="o", color=color, label=f"{transport} measured")
            ax.plot(xs, [c.bound_tok_s for c in rows], linestyle="--", color=color, label=f"{transport} bound")
            for c in (c for c in res.cases if (c.preset, c.transport) == (preset, transport) and c.loss_pct):
                ax.scatter([c.delay_ms], [c.tok_s_median], marker="x", color=color)
                ax.annotate(
                    f"{c.loss_pct:g} % loss",
                    (c.delay_ms, c.tok_s_median),
                    xytext=(6, -3),
                    textcoords="offset points",
                    fontsize=7,
                    color=color,
                )
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("one-way delay per stage->stage hop (ms)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(f"{preset} ({res.models[preset]}), {res.num_stages} stages")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
