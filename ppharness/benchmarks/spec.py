"""``ppharness bench spec``: greedy and speculative decoding on the same chain, over emulated WAN links, with the
prediction (``ppharness.plan.speculation_gain``) printed beside what was measured.

One chain is started with the draft (``serving.speculate``); each repeat sends the prompt twice, greedy (a request
with ``speculate=False``: windows of one row, the same kernels) then speculative, and both answers are checked
against the unsplit model's, tokens and every stage boundary. Every stage -> stage link of the token loop carries the
one-way delay; the seed's links stay perfect.

Measured, per kind: decode tokens/s from the response's token times (the last stage's clock), median over the
repeats; for the speculative requests, the windows the last stage verified (trips), what they drafted and accepted.
Derived: the speed-up (speculative over greedy), tokens per trip (decode tokens over trips), the efficiency (the
speed-up over the tokens per trip: 1 when a trip costs what a greedy step does). Predicted, from measured inputs:
``alpha`` (the geometric estimate from the windows), the mean drafts per window, the configured delays and each
stage's compute p50 of a window and of one row (the traces).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from ppharness.benchmarks.provenance import stamped
from ppharness.errors import HarnessError
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.sources.files import resolve_model
from ppharness.network.spec import Impairment, Network
from ppharness.plan.speculation_gain import SpecPrediction, acceptance, predict
from ppharness.run.seed.orchestrator import Chain, decode_tok_s
from ppharness.scenario.schema import Scenario, scenario_from_args
from ppharness.trace.report import percentile
from ppharness.wire.messages import InferenceResponse

PROMPT = "Repeat this line five times: the cat sat on the mat and looked at the hat."
SETTLE_S = 0.3  # after a response, beyond the last hop's delay: stage 0 takes the last tokens before the next request


@dataclass
class SpecBenchResult:
    model: str
    num_stages: int
    delay_ms: float
    draft: str
    windows: int
    prompt: str
    tokens: int
    repeats: int
    transport: str
    greedy_tok_s: list[float] = field(default_factory=list)
    spec_tok_s: list[float] = field(default_factory=list)
    trips: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0
    decode_tokens: int = 0
    window_drafts: list[int] = field(default_factory=list)  # each speculative window's drafts, every repeat
    greedy_compute_ms: float = math.nan  # the stages' compute p50 of one row, summed
    window_compute_ms: float = math.nan  # the stages' compute p50 of a window, summed
    delay_sum_ms: float = 0.0
    exact: bool = True
    prediction: dict[str, float] = field(default_factory=dict)
    predicted_greedy_tok_s: float = math.nan
    elapsed_s: float = 0.0

    @property
    def speedup(self) -> float:
        g, s = statistics.median(self.greedy_tok_s), statistics.median(self.spec_tok_s)
        return s / g if g > 0 else math.nan

    @property
    def tokens_per_trip(self) -> float:
        return self.decode_tokens / self.trips if self.trips else math.nan

    @property
    def efficiency(self) -> float:
        return self.speedup / self.tokens_per_trip if self.trips else math.nan


def _scenario(source: str, num_stages: int, transport: str, prompt: str, tokens: int, draft: str, windows: int,
              delay_ms: float, seed: int) -> Scenario:  # fmt: skip
    base = scenario_from_args(
        model=source, num_stages=num_stages, transport=transport, prompt=prompt, max_tokens=tokens,
        speculate=draft, windows=windows,
    )  # fmt: skip
    room = len(prompt.encode()) + tokens + 2 + 32  # a token per byte at most, a BOS, and a window's rows
    model = msgspec.structs.replace(base.model, max_context=max(base.model.max_context, -(-room // 64) * 64))
    budget = msgspec.structs.replace(base.budget, total_s=3600.0, ready_s=900.0)
    network = Network(seed=seed, layer="message", default=Impairment(delay_ms=delay_ms))
    raw = msgspec.to_builtins(
        msgspec.structs.replace(base, model=model, budget=budget, network=network, name="bench-spec")
    )
    return msgspec.convert(raw, type=Scenario)  # checked as a scenario file would be


def _compute_sum(chain: Chain, response: InferenceResponse, num_stages: int) -> float:
    """The stages' compute p50 over the request's decode steps (a speculative request's: its windows), summed."""
    rows = chain.trace_of(response).decode
    total = 0.0
    for i in range(num_stages):  # a window's compute is under its first row's step: the tokens after it have none
        got = [r.parts[f"stage {i} compute"] for r in rows if r.parts.get(f"stage {i} compute", 0.0) > 0.0]
        if not got:
            return math.nan
        total += percentile(got, 50)
    return total


def run_spec_bench(
    source: str,
    num_stages: int = 5,
    delay_ms: float = 25.0,
    draft: str = "ngram:8",
    prompt: str = PROMPT,
    tokens: int = 96,
    repeats: int = 3,
    windows: int = 1,
    transport: str = "zmq",
    seed: int = 0,
    progress: Callable[[str], None] = print,
) -> SpecBenchResult:
    """Greedy and speculative requests on one chain (module docstring); a mismatch with the unsplit model raises."""
    t0 = time.monotonic()
    res = SpecBenchResult(source, num_stages, delay_ms, draft, windows, prompt, tokens, repeats, transport)
    scenario = _scenario(source, num_stages, transport, prompt, tokens, draft, windows, delay_ms, seed)
    res.delay_sum_ms = delay_ms * num_stages  # every stage -> stage hop of the token loop
    progress(f"the unsplit model (the oracle), batched as the chain is: {tokens} tokens")
    path = resolve_model(source)
    oracle = oracle_decode(path, prompt, tokens, scenario.model.max_context, boundaries=True, batched=True)
    greedy_compute: list[float] = []
    window_compute: list[float] = []
    with Chain(scenario, progress=lambda _: None, trace=True) as chain:
        progress(f"chain of {num_stages} stages up in {time.monotonic() - t0:.1f} s; warm-up requests")
        for speculate in (False, True):
            chain.request(prompt, 4, speculate=speculate)
            time.sleep(delay_ms / 1000 + SETTLE_S)
        for r in range(1, repeats + 1):
            for speculate in (False, True):
                response, _ = chain.request(prompt, tokens, speculate=speculate)
                time.sleep(delay_ms / 1000 + SETTLE_S)
                verdict = chain.verdict(response, oracle)
                if not verdict.exact:
                    res.exact = False
                    raise HarnessError(
                        f"{'speculative' if speculate else 'greedy'} request {r}: the chain's answer differs from the "
                        f"unsplit model's: {verdict.describe(response.token_ids, oracle.token_ids)}"
                    )
                if len(response.token_ids) < 2:
                    raise HarnessError(
                        f"the answer to {prompt[:60]!r} has {len(response.token_ids)} token(s): nothing to decode, "
                        f"so nothing to measure — give a prompt the model continues (--prompt), or more --tokens"
                    )
                rate = decode_tok_s(response)
                compute = _compute_sum(chain, response, num_stages)
                if speculate:
                    res.spec_tok_s.append(rate)
                    res.trips += response.trips
                    res.drafted += response.drafted
                    res.accepted += response.accepted
                    res.rejected += response.rejected
                    res.decode_tokens += max(len(response.token_ids) - 1, 0)
                    res.window_drafts += response.window_drafts
                    window_compute.append(compute)
                else:
                    res.greedy_tok_s.append(rate)
                    greedy_compute.append(compute)
            progress(
                f"repeat {r}/{repeats}: greedy {res.greedy_tok_s[-1]:.2f} tok/s, speculative {res.spec_tok_s[-1]:.2f} "
                f"tok/s (both equal to the unsplit model's answer)"
            )
    res.greedy_compute_ms = statistics.median(greedy_compute)
    res.window_compute_ms = statistics.median(window_compute)
    alpha = acceptance(res.accepted, res.rejected)
    pred: SpecPrediction = predict(alpha, res.window_drafts, res.delay_sum_ms, res.window_compute_ms)
    res.prediction = asdict(pred)
    res.predicted_greedy_tok_s = 1000.0 / (res.delay_sum_ms + res.greedy_compute_ms)
    res.elapsed_s = time.monotonic() - t0
    return res


def _err(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured * 100:+.0f} %" if measured > 0 and math.isfinite(predicted) else "—"


def report(res: SpecBenchResult) -> str:
    """The result as the bench prints it."""
    g, s = statistics.median(res.greedy_tok_s), statistics.median(res.spec_tok_s)
    p = res.prediction
    lines = [
        f"bench spec: {res.model}, {res.num_stages} stages, {res.delay_ms:g} ms links ({res.transport}), draft "
        f"{res.draft}, {res.windows} window(s) in flight, {res.tokens} tokens x {res.repeats} repeats",
        f"  greedy:       {g:.2f} tok/s (median; {', '.join(f'{v:.2f}' for v in res.greedy_tok_s)})",
        f"  speculative:  {s:.2f} tok/s (median; {', '.join(f'{v:.2f}' for v in res.spec_tok_s)})",
        f"  speed-up vs greedy: {res.speedup:.2f}",
        f"  tokens per trip: {res.tokens_per_trip:.2f} ({res.decode_tokens} decode tokens in {res.trips} trips; "
        f"{res.accepted} of {res.drafted} drafts accepted, {res.rejected} windows rejected one)",
        f"  efficiency: {res.efficiency:.2f} (speed-up over tokens per trip: 1 when a window costs what a row does)",
        f"  compute per trip (the stages' p50s, summed): one row {res.greedy_compute_ms:.1f} ms, a window "
        f"{res.window_compute_ms:.1f} ms; link delays {res.delay_sum_ms:.0f} ms",
        "  predicted (ppharness.plan.speculation_gain; inputs measured here) beside measured:",
        f"    alpha {p['alpha']:.3f}, drafts per window {p['k']:.2f}",
        f"    tokens per trip  predicted {p['tokens_per_trip']:.2f}  measured {res.tokens_per_trip:.2f}  "
        f"({_err(p['tokens_per_trip'], res.tokens_per_trip)})",
        f"    speculative tok/s  predicted {p['tok_s']:.2f}  measured {s:.2f}  ({_err(p['tok_s'], s)})",
        f"    greedy tok/s  predicted {res.predicted_greedy_tok_s:.2f}  measured {g:.2f}  "
        f"({_err(res.predicted_greedy_tok_s, g)})",
        f"  every answer equal to the unsplit model's: {'yes' if res.exact else 'NO'}; {res.elapsed_s:.0f} s",
    ]
    return "\n".join(lines)


def write_json(res: SpecBenchResult, path: str) -> None:
    doc = asdict(res) | {"speedup": res.speedup, "tokens_per_trip": res.tokens_per_trip, "efficiency": res.efficiency}
    Path(path).write_text(json.dumps(stamped(doc), indent=2) + "\n")
