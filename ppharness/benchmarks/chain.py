"""``ppharness bench``: the chain against single-process decode and the raw transport, interleaved in one run.

One invocation, one model, one machine. Every chain (one per transport, one whose stages are co-located in one
process, plus a traced ZeroMQ chain that measures the cost of tracing and breaks the token down by component) is
started once and kept up; then each repeat runs, in turn,
single-process decode, one request on every chain, and raw round trips of the activation's size, so that noise on the
shared machine hits every contender alike. Figures are medians over the repeats and ratios within this run.
"""

from __future__ import annotations

import io
import json
import statistics
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ppharness.benchmarks.provenance import stamped
from ppharness.benchmarks.transport import run_transport_bench
from ppharness.errors import HarnessError
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.decode.rules import warm_up
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import resolve_model
from ppharness.model.synthetic.spec import PRESETS
from ppharness.run.seed.orchestrator import Chain, decode_tok_s
from ppharness.scenario.schema import scenario_from_args

if TYPE_CHECKING:
    from ppharness.scenario.schema import Scenario
    from ppharness.wire.messages import InferenceResponse

PROMPT = "Pipeline parallel inference over the wide area network"
COLOCATED = "co-located"  # the chain whose stages one process drives (``ppharness.run.node.colocated``), beside zmq's
ONE_NODE = "one node"  # every block in one pp-node process: one process as the chains' own code runs it


@dataclass
class BenchResult:
    model: str
    num_stages: int
    tokens: int
    repeats: int
    single_tok_s: list[float] = field(default_factory=list)
    chain_tok_s: dict[str, list[float]] = field(default_factory=dict)  # transport (or "zmq+trace") -> per repeat
    raw_rtt_ms: dict[str, list[float]] = field(default_factory=dict)  # transport -> p50 raw round trip per repeat
    activation_bytes: int = 0
    hop_p50_ms: dict[str, float] = field(default_factory=dict)  # "0->1" -> ms, from the traced chain
    components_ms: dict[str, float] = field(default_factory=dict)  # p50 per component, traced chain
    per_token_ms: float = 0.0  # p50 of the traced chain's per-token time
    components_share: float = 0.0  # median over tokens of (sum of components) / per-token time
    peak_rss_mib: dict[str, list[float]] = field(default_factory=dict)  # chain -> per stage
    sweep_tok_s: dict[int, float] = field(default_factory=dict)  # N -> median tok/s over ZeroMQ
    # chain -> "" when its first answer equals the oracle's bit for bit (tokens and boundaries), else what differs
    mismatch: dict[str, str] = field(default_factory=dict)

    def medians(self) -> dict[str, float]:
        out = {"single": statistics.median(self.single_tok_s)}
        out.update({k: statistics.median(v) for k, v in self.chain_tok_s.items()})
        return out


def _scenario(preset: str, n: int, kind: str, tokens: int, max_context: int) -> Scenario:
    """The chain's scenario; ``preset`` may carry the scenario's overrides as a synthetic spec does
    (``qwen3-30b-a3b,blocks=8``)."""
    base = scenario_from_args(num_stages=n, transport=kind, prompt=PROMPT, max_tokens=tokens)
    synthetic = base.model.synthetic
    assert synthetic is not None, "the built-in scenario's model is synthetic"
    name, *overrides = preset.split(",")
    fields = msgspec.to_builtins(synthetic) | {"preset": name} | dict(kv.split("=", 1) for kv in overrides)
    section = msgspec.convert(fields, type=type(synthetic), strict=False)
    model = msgspec.structs.replace(base.model, synthetic=section, max_context=max_context)
    budget = msgspec.structs.replace(base.budget, total_s=3600.0, ready_s=900.0)
    return msgspec.structs.replace(base, model=model, budget=budget)


def _raw_rtt_ms(kinds: list[str], nbytes: int, count: int) -> dict[str, float]:
    """p50 round trip of the raw library under each transport, at ``nbytes`` (the transport benchmark's paths)."""

    rows = run_transport_bench([nbytes], count, kinds, out=io.StringIO())
    raw = {"zmq": "raw zmq", "iroh": "raw iroh, bulk copy"}
    return {k: next(r.p50_ms for r in rows if r.path == raw[k]) for k in kinds if k in raw}


def run_chain_bench(
    preset: str,
    num_stages: int,
    transports: list[str],
    tokens: int,
    repeats: int,
    out_dir: str,
    sweep: bool,
    progress: Callable[[str], None],
) -> BenchResult:
    """Measure; write ``bench.json`` and ``bench.png`` into ``out_dir``; return the result."""

    if preset not in PRESETS:
        raise HarnessError(f"unknown preset {preset!r}: expected one of {', '.join(PRESETS)}")
    path = str(resolve_model(f"synthetic:{preset}"))
    cfg = GGUFFile(path).config
    max_context = min(cfg.context, 64 + tokens + 16)
    res = BenchResult(
        model=f"{preset} ({cfg.blocks} blocks, dim {cfg.dim})",
        num_stages=num_stages,
        tokens=tokens,
        repeats=repeats,
        activation_bytes=2 * cfg.dim,
    )
    progress(f"single process: loading {res.model}")

    single = ModelSlice(GGUFFile(path), 0, cfg.blocks, True, True, max_context, taps=True)
    warm_up(single)
    # compiles the prefill for this prompt; the answer every chain must give, bit for bit
    oracle = oracle_decode(path, PROMPT, tokens, max_context, model=single, boundaries=True)

    chains: dict[str, Chain] = {}
    with ExitStack() as stack:
        for kind in [ONE_NODE, *transports, COLOCATED, "zmq+trace"]:
            transport = "zmq" if kind in (COLOCATED, ONE_NODE) else kind.removesuffix("+trace")
            n = 1 if kind == ONE_NODE else num_stages
            if kind == ONE_NODE:
                progress("starting one node (every block in one pp-node process)")
            else:
                progress(f"starting the {n}-stage chain " + ("in one process" if kind == COLOCATED else f"over {kind}"))
            scenario = _scenario(preset, n, transport, tokens, max_context)
            if kind == COLOCATED:
                scenario = scenario_from_args(base=scenario, colocated=True)
            chain = Chain(scenario, progress=lambda _: None, trace=kind.endswith("+trace"))
            chains[kind] = stack.enter_context(chain)
            first, _ = chains[kind].request(PROMPT, tokens)  # warm: compiles the prefill for this prompt length
            verdict = chains[kind].verdict(first, oracle)
            res.mismatch[kind] = "" if verdict.exact else verdict.describe(first.token_ids, oracle.token_ids)
        for r in range(repeats):
            progress(f"repeat {r + 1}/{repeats}")
            res.single_tok_s.append(oracle_decode(path, PROMPT, tokens, max_context, model=single).decode_tok_s)
            for kind, chain in chains.items():  # the verdict is the first request's: no digests kept now
                response, _ = chain.request(PROMPT, tokens, digests=False)
                res.chain_tok_s.setdefault(kind, []).append(decode_tok_s(response))
                if kind == "zmq+trace" and r == repeats - 1:
                    _absorb_trace(res, chain, response)
            for kind, ms in _raw_rtt_ms(transports, res.activation_bytes, 50).items():
                res.raw_rtt_ms.setdefault(kind, []).append(ms)
    for kind, chain in chains.items():
        res.peak_rss_mib[kind] = [s.peak_rss_bytes / 2**20 for s in chain.reports]

    if sweep:
        for n in range(1, min(5, cfg.blocks) + 1):
            progress(f"tokens/s vs N: {n} stage(s) over zmq")
            with Chain(_scenario(preset, n, "zmq", tokens, max_context), progress=lambda _: None) as chain:
                chain.request(PROMPT, tokens)
                res.sweep_tok_s[n] = statistics.median(
                    decode_tok_s(chain.request(PROMPT, tokens)[0]) for _ in range(max(1, repeats // 2))
                )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(stamped(asdict(res) | {"medians_tok_s": res.medians()}), indent=2))
    plot(res, out / "bench.png")
    return res


def _absorb_trace(res: BenchResult, chain: Chain, response: InferenceResponse) -> None:
    trace = chain.trace_of(response)
    rows = trace.decode
    res.components_ms = trace.p50_parts()
    res.per_token_ms = res.components_ms.pop("per token")
    res.hop_p50_ms = {k.removeprefix("hop "): v for k, v in res.components_ms.items() if k.startswith("hop ")}
    res.components_share = statistics.median(sum(r.parts.values()) / r.total_ms for r in rows if r.total_ms > 0)


def report(res: BenchResult) -> str:
    """The table printed at the end of ``ppharness bench``."""
    med = res.medians()
    single = med["single"]
    lines = [
        f"model {res.model}; {res.num_stages} stages; {res.tokens} tokens; {res.repeats} repeats (medians)",
        f"{'contender':<26} {'tok/s':>9} {'ratio to single':>16}",
        f"{'single process':<26} {single:>9.1f} {1.0:>16.2f}",
    ]
    for kind, v in med.items():
        if kind == ONE_NODE:
            lines.append(f"{'1 stage, one node':<26} {v:>9.1f} {v / single:>16.2f}")
        elif kind != "single":
            lines.append(f"{f'{res.num_stages}-stage chain {kind}':<26} {v:>9.1f} {v / single:>16.2f}")
    if ONE_NODE in med:
        lines.append(
            "against one node (every block in one pp-node process, as the chains run): "
            + ", ".join(f"{k} {v / med[ONE_NODE]:.2f}" for k, v in med.items() if k not in ("single", ONE_NODE))
        )
    if "zmq" in med and "zmq+trace" in med:
        lines.append(f"tracing cost: traced/untraced zmq chain tok/s = {med['zmq+trace'] / med['zmq']:.3f}")
    lines.append(f"\nhops ({res.activation_bytes} B activations): harness hop p50 vs raw one-way (RTT/2) p50")
    for kind, rtts in res.raw_rtt_ms.items():
        one_way = statistics.median(rtts) / 2
        lines.append(f"  raw {kind:<5} one-way p50 {one_way:.3f} ms")
    raw_zmq = statistics.median(res.raw_rtt_ms["zmq"]) / 2 if "zmq" in res.raw_rtt_ms else float("nan")
    for hop, ms in res.hop_p50_ms.items():
        lines.append(f"  zmq hop {hop:<5} p50 {ms:.3f} ms = {ms / raw_zmq:.2f} x raw zmq one-way")
    lines.append(
        f"\nper-token p50 {res.per_token_ms:.3f} ms (traced zmq chain); the components below cover "
        f"{100 * res.components_share:.1f}% of it (median over tokens); p50 ms each:"
    )
    for name, ms in res.components_ms.items():
        lines.append(f"  {name:<22} {ms:>8.3f}")
    lines.append(
        "peak RSS per stage (MiB): "
        + "; ".join(f"{k}: {', '.join(f'{x:.0f}' for x in v)}" for k, v in res.peak_rss_mib.items())
    )
    if res.sweep_tok_s:
        lines.append("tokens/s vs N (zmq): " + ", ".join(f"N={n}: {v:.1f}" for n, v in res.sweep_tok_s.items()))
    for kind, why in res.mismatch.items():
        lines.append(
            f"{kind} chain: "
            + (
                f"MISMATCH: {why}"
                if why
                else f"MATCH: {res.tokens} tokens and every stage-boundary hidden state equal the unsplit model's"
            )
        )
    return "\n".join(lines)


def _kind(component: str) -> str:
    return "compute" if "compute" in component else "hop" if component.startswith("hop") else "other"


def _component_colour(name: str, components: dict[str, float]) -> tuple[float, float, float, float]:
    """A component's colour: its kind's colour map (compute, hop, other), its place among that kind's components."""
    import matplotlib

    same = [n for n in components if _kind(n) == _kind(name)]
    shade = 0.35 + 0.55 * (same.index(name) / max(1, len(same) - 1))
    cmap = {"compute": "Blues", "hop": "Oranges", "other": "Greys"}[_kind(name)]
    rgba: tuple[float, float, float, float] = matplotlib.colormaps[cmap](shade)
    return rgba


def plot(res: BenchResult, path: Path) -> None:
    """Per-token time stacked by component, coloured by kind (stages' compute in blues, hops in oranges, the rest in
    greys, darker further along the chain); with a sweep, a second panel of tokens/s against N."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = bool(res.sweep_tok_s)
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(12 if sweep else 7, 5), squeeze=False)
    a = axes[0][0]
    bottom = 0.0
    for name, ms in res.components_ms.items():
        a.bar(["per token"], [ms], bottom=[bottom], label=name, color=_component_colour(name, res.components_ms))
        bottom += ms
    a.set_ylabel("ms (p50 per component)")
    a.set_title(f"{res.num_stages}-stage zmq chain: per-token time by component")
    a.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if sweep:
        b = axes[0][1]
        ns = sorted(res.sweep_tok_s)
        b.plot(ns, [res.sweep_tok_s[n] for n in ns], marker="o", label="chain over zmq")
        b.set_xticks(ns)
        b.axhline(statistics.median(res.single_tok_s), color="gray", linestyle="--", label="single process")
        b.set_xlabel("stages (N)")
        b.set_ylabel("decode tokens/s")
        b.set_title(f"tokens/s vs N ({res.model})")
        b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
