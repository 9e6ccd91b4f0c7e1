"""``ppharness bench load``: an open-loop client against the chain — many requests in flight at once.

Requests arrive at a rate (exponential gaps, seeded; rate 0 sends them all at once), whatever is in flight: the client
never waits for an answer before sending the next (an open loop, as real users arrive). Prompt and answer lengths are
drawn from uniform ranges. The chain serves up to ``slots`` requests at once (a KV cache each on every stage); stage 0
queues the rest (bounded) and refuses beyond the queue.

One chain, started once and warmed (every distinct prompt's prefill compiled), serves, in one run:

- the baseline: one request alone, ``BASELINE_REPEATS`` times (median), with the load's median answer length;
- the load: every request, at its arrival time.

Reported: aggregate tokens/s (every generated token over the load's wall time, first send to last answer) and its
ratio to the single request's (its tokens over its own wall time); per request, time to first token (sent -> first
token streamed back) and inter-token latency (gaps between streamed tokens), p50 and p99; refusals. Every answer is
checked against the unsplit model's answer to that prompt alone (one process, greedy): a difference fails the bench.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import msgspec

from ppharness.benchmarks.chain import _scenario as chain_scenario
from ppharness.benchmarks.provenance import stamped
from ppharness.errors import HarnessError
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.decode.rules import warm_up
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import resolve_model
from ppharness.model.synthetic.spec import PRESETS
from ppharness.network.spec import Impairment, Network
from ppharness.run.seed.client import Job, Served
from ppharness.run.seed.orchestrator import Chain
from ppharness.scenario.schema import Scenario
from ppharness.trace.report import percentile

WORDS = (
    "pipeline parallel inference over the wide area network keeps every stage busy while requests arrive at random "
    "times from many users who ask short and long questions about models experts caches and tokens"
).split()
BASELINE_REPEATS = 3


@dataclass
class LoadSpec:
    """What the bench sends: ``requests`` at ``rate`` per second (0: all at once), prompts of ``prompt_words`` words
    and answers of ``max_tokens`` tokens (inclusive uniform ranges), drawn with ``seed``."""

    requests: int
    rate: float
    prompt_words: tuple[int, int] = (2, 12)
    max_tokens: tuple[int, int] = (16, 32)
    seed: int = 0

    def jobs(self) -> list[Job]:
        rng = random.Random(self.seed)
        out, t = [], 0.0
        for k in range(self.requests):
            if k and self.rate > 0:
                t += rng.expovariate(self.rate)
            words = rng.randint(*self.prompt_words)
            start = rng.randrange(len(WORDS))
            prompt = " ".join(WORDS[(start + i) % len(WORDS)] for i in range(words))
            out.append(Job(prompt, rng.randint(*self.max_tokens), round(t, 4)))
        return out


@dataclass
class LoadResult:
    preset: str
    num_stages: int
    transport: str
    network: str
    slots: int
    batched: bool
    max_batch: int
    queue: int
    spec: dict[str, object]
    single_tok_s: list[float] = field(default_factory=list)  # one request alone: its tokens / its wall time
    single_tokens: int = 0
    aggregate_tok_s: float = 0.0
    ratio: float = 0.0  # aggregate / median single
    wall_s: float = 0.0
    tokens: int = 0
    answered: int = 0
    refused: int = 0
    ttft_ms: dict[str, float] = field(default_factory=dict)  # p50, p99
    itl_ms: dict[str, float] = field(default_factory=dict)
    most_in_flight: int = 0  # the most requests sent and not yet answered at once, as the client saw it
    exact: bool = True


def _scenario(
    preset: str,
    num_stages: int,
    transport: str,
    network: Network | None,
    slots: int,
    queue: int,
    max_context: int,
    batched: bool = False,
    max_batch: int = 0,
) -> Scenario:

    base = chain_scenario(preset, num_stages, transport, 1, max_context)  # its request is not sent: the load is
    serving = msgspec.structs.replace(base.serving, slots=slots, queue=queue, batched=batched, max_batch=max_batch)
    raw = msgspec.to_builtins(msgspec.structs.replace(base, serving=serving, network=network, name="bench-load"))
    return msgspec.convert(raw, type=Scenario)  # checked as a scenario file would be


def delay_network(delay_ms: float, seed: int = 0) -> Network | None:
    """Every stage -> stage link delayed by ``delay_ms`` one way (the links to the seed stay perfect); None for 0."""
    if delay_ms <= 0:
        return None
    return Network(seed=seed, layer="message", default=Impairment(delay_ms=delay_ms))


def _answers(
    path: str, jobs: list[Job], max_context: int, progress: Callable[[str], None], batched: bool = False
) -> dict[str, list[int]]:
    """The unsplit model's answer to each distinct prompt alone, as long as the longest asked of it (``batched``: as
    a batched slice computes it alone, a batch of one row)."""

    longest: dict[str, int] = {}
    for j in jobs:
        longest[j.prompt] = max(longest.get(j.prompt, 0), j.max_tokens)
    progress(f"oracle: {len(longest)} distinct prompt(s) in one process")
    f = GGUFFile(path)
    model = ModelSlice(f, 0, f.config.blocks, True, True, max_context, batched=batched)
    warm_up(model)
    out = {}
    for prompt, n in longest.items():
        got = oracle_decode(path, prompt, n, max_context, model=model)
        out[prompt] = got.token_ids
    return out


def _most_in_flight(served: list[Served]) -> int:
    events = sorted(
        [(s.sent_at, 1) for s in served] + [(s.token_at[-1] if s.token_at else s.sent_at, -1) for s in served]
    )
    most = now = 0
    for _, d in events:
        now += d
        most = max(most, now)
    return most


def run_load_bench(
    preset: str,
    num_stages: int,
    transport: str,
    spec: LoadSpec,
    slots: int,
    queue: int,
    network: Network | None,
    network_name: str,
    progress: Callable[[str], None],
    json_out: str | None = None,
    batched: bool = True,
    max_batch: int = 0,
) -> LoadResult:
    """Start the chain, warm it, measure the single request and the load; every answer checked."""

    if preset not in PRESETS:
        raise HarnessError(f"unknown preset {preset!r}: expected one of {', '.join(PRESETS)}")
    path = str(resolve_model(f"synthetic:{preset}"))
    f = GGUFFile(path)
    jobs = spec.jobs()
    longest_prompt = max(len(f.tokenizer.encode(j.prompt)) for j in jobs) + 1
    max_context = min(f.config.context, max(16, longest_prompt + spec.max_tokens[1] + 8))  # a scenario's least: 16
    single_tokens = int(statistics.median(j.max_tokens for j in jobs))
    expected = _answers(path, [*jobs, Job(jobs[0].prompt, single_tokens)], max_context, progress, batched)
    scenario = _scenario(preset, num_stages, transport, network, slots, queue, max_context, batched, max_batch)
    res = LoadResult(preset, num_stages, transport, network_name, slots, batched, max_batch, queue, asdict(spec))
    res.single_tokens = single_tokens

    def check(s: Served) -> None:
        assert s.response is not None
        want = expected[s.job.prompt][: s.job.max_tokens]
        if s.response.token_ids != want:
            res.exact = False
            raise HarnessError(
                f"request {s.request_id} ({s.job.prompt!r}, {s.job.max_tokens} tokens) answered differently from "
                f"the unsplit model alone: {s.response.token_ids[:12]}... against {want[:12]}..."
            )

    t0 = time.monotonic()
    with Chain(scenario, progress=lambda _: None) as chain:
        progress(
            f"chain of {num_stages} stage(s) over {transport} up in {time.monotonic() - t0:.1f} s ({slots} slot(s))"
        )
        _warm(chain, jobs, progress)
        for r in range(BASELINE_REPEATS):
            (alone,) = chain.serve([Job(jobs[0].prompt, single_tokens)])
            if alone.response is None:
                raise HarnessError(f"the single request was refused: {alone.refused}")
            check(alone)
            wall = alone.token_at[-1] - alone.sent_at
            res.single_tok_s.append(len(alone.token_at) / wall)
            progress(f"one request alone {r + 1}/{BASELINE_REPEATS}: {res.single_tok_s[-1]:.1f} tok/s")
        progress(f"load: {spec.requests} request(s) at {spec.rate:g}/s (0: all at once)")
        served = chain.serve(jobs)
    answered = [s for s in served if s.response is not None]
    for s in answered:
        check(s)
    res.answered, res.refused = len(answered), len(served) - len(answered)
    if answered:
        start = min(s.sent_at for s in served)
        end = max(s.token_at[-1] for s in answered)
        res.tokens = sum(len(s.token_at) for s in answered)
        res.wall_s = end - start
        res.aggregate_tok_s = res.tokens / res.wall_s
        res.ratio = res.aggregate_tok_s / statistics.median(res.single_tok_s)
        ttft = [1000 * s.ttft_s for s in answered]
        itl = [1000 * g for s in answered for g in s.itl_s]
        res.ttft_ms = {"p50": percentile(ttft, 50), "p99": percentile(ttft, 99)}
        res.itl_ms = {"p50": percentile(itl, 50), "p99": percentile(itl, 99)}
        res.most_in_flight = _most_in_flight(answered)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(stamped(asdict(res)), indent=2) + "\n")
    return res


def _warm(chain: Chain, jobs: list[Job], progress: Callable[[str], None]) -> None:
    """One token of each distinct prompt, twice: a prompt length's first prefill compiles its kernels, the second
    captures the compiled step that later ones replay (``ModelSlice.prefill``)."""

    t0 = time.monotonic()
    prompts = list(dict.fromkeys(j.prompt for j in jobs))
    for _ in range(2):
        for s in chain.serve([Job(p, 1) for p in prompts]):
            if s.response is None:
                raise HarnessError(f"a warm-up request was refused: {s.refused}")
    progress(f"warm: {len(prompts)} prompt(s) prefilled in {time.monotonic() - t0:.1f} s")


def report(res: LoadResult) -> str:
    single = statistics.median(res.single_tok_s) if res.single_tok_s else float("nan")
    spec = res.spec
    lines = [
        f"bench load: {res.preset}, {res.num_stages} stage(s) over {res.transport}, network {res.network}, "
        f"{res.slots} slot(s), {'batched' if res.batched else 'one request per model call'}"
        f"{f' (at most {res.max_batch} per step)' if res.max_batch else ''}, queue {res.queue}",
        f"load: {spec['requests']} request(s) at {spec['rate']} per s (0: all at once), prompts of "
        f"{spec['prompt_words']} words, answers of {spec['max_tokens']} tokens, seed {spec['seed']}",
        "",
        f"{'':<28}{'tok/s':>10}{'TTFT p50':>10}{'p99':>9}{'ITL p50':>10}{'p99':>9}  (ms)",
        f"{'one request alone':<28}{single:>10.1f}",
        f"{'the load':<28}{res.aggregate_tok_s:>10.1f}{res.ttft_ms.get('p50', float('nan')):>10.1f}"
        f"{res.ttft_ms.get('p99', float('nan')):>9.1f}{res.itl_ms.get('p50', float('nan')):>10.1f}"
        f"{res.itl_ms.get('p99', float('nan')):>9.1f}",
        "",
        f"aggregate / one request alone: {res.ratio:.2f}x ({res.tokens} tokens in {res.wall_s:.2f} s; at most "
        f"{res.most_in_flight} request(s) in flight)",
        f"answered {res.answered}, refused {res.refused}; every answer equals the unsplit model's: "
        f"{'yes' if res.exact else 'NO'}",
    ]
    return "\n".join(lines)
