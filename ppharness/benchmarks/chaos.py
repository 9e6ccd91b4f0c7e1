"""``ppharness bench chaos``: random faults in the middle of a request under policy failover, checked token by token.

Each trial runs one request (``--in-flight K``: K requests at once, each in its own slot) on a fresh chain (local
provider, ZeroMQ, the synthetic tiny model unless the base scenario says otherwise), warm before its request (its
standbys and stages compiled for the prompts), whose network carries a fault schedule drawn from
``random.Random(seed + trial)``: one or two faults among

- ``kill``: a random stage is killed (SIGKILL) 0.1-0.8 s into the request; a spare takes over (``--no-spares``: a
  surviving device does, ``ppharness.run.seed.replan``);
- ``pause``: a random stage is stopped (SIGSTOP) for 0.5-4 s: shorter than detection, the retries ride it out;
  longer, the stage is declared dead and a spare takes over. The orchestrator fences the old node off, but its
  neighbours go on using it, once it runs again, until the spare is ready: the request may finish on it first (an
  *overtaken* failover, with no replay to time);
- ``partition``: a random stage is cut off from every other node for 0.5-3 s, with the same outcomes;
- ``loss``: Gilbert-Elliott bursty loss on every stage -> stage link for the whole request (at most one per trial).

Membership runs on heartbeats (``heartbeat_s`` 0.25, dead after 1.5 s) so that pauses and partitions are noticed, and
the run gets a spare for every fault that can kill a stage or outlast detection. The answer of every trial is compared
with the unsplit model's (the oracle, computed once per prompt). Reported:

- divergent answers (target 0) and failed runs (an exception; target 0 while spares remain);
- per fault, the time from the fault to the next token at the client (the first streamed token after it; a kill or
  pause counts from when the orchestrator's nemesis carried it out, up to a poll after its time, a partition from its
  time);
- per failover, its parts: detection (fault -> declared dead), reload (declared dead -> the spare's Ready) and replay
  (Ready -> the next token at the client), whose sum has a target of at most 2 s at the median and 4 s at the 99th
  percentile;
- the price of the policy when nothing fails: decode tokens/s of a failover chain against a chain without fault
  tolerance, interleaved requests on the same model (target: at most 5 % slower).
"""

from __future__ import annotations

import random
import statistics
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from ppharness.model.decode.oracle import oracle_decode
from ppharness.network.spec import Bursty, Event, Impairment, Network, stage_node
from ppharness.run.seed.client import Job
from ppharness.run.seed.failover import Recovery
from ppharness.run.seed.orchestrator import Chain, decode_tok_s
from ppharness.scenario.schema import Scenario, scenario_from_args

FaultKind = Literal["kill", "pause", "partition", "loss"]
KINDS: tuple[FaultKind, ...] = ("kill", "pause", "partition", "loss")
TIMED_KINDS: tuple[FaultKind, ...] = ("kill", "pause", "partition")

# the schedule's ranges, seconds
AT_S = (0.1, 0.8)  # when a timed fault starts, from the start of the request (200 tokens take about 1 s)
PAUSE_S = (0.5, 4.0)
PARTITION_S = (0.5, 3.0)
FAULTS_PER_TRIAL = (1, 2)
LOSS_BURSTS = Bursty(p=0.02, r=0.3, loss_bad=0.5)  # every stage -> stage link, the whole request

# membership: fast enough that a pause or a partition of a couple of seconds ends in a failover
HEARTBEAT_S = 0.25
DEAD_AFTER_S = 1.5

# targets
RECOVERY_TARGET_S = 2.0  # detection + reload + replay, median
RECOVERY_P99_TARGET_S = 4.0  # and its 99th percentile
SLOWDOWN_TARGET = 0.05  # a fault-free failover run at most this much slower than one without fault tolerance

PROMPT = "The quick brown fox"
# the prompts of requests in flight together (``--in-flight``): of different lengths, so that each is its own request
PROMPTS = (PROMPT, "Once upon a time there was", "A B C", "It was a bright cold day in April, and")


@dataclass(frozen=True)
class Fault:
    """One fault of a trial's schedule: ``kind`` on ``stage`` from ``at_s`` for ``for_s`` (a kill is for good; loss
    holds on every link for the whole request: no stage, no times)."""

    kind: FaultKind
    stage: int | None = None
    at_s: float | None = None
    for_s: float | None = None

    def event(self) -> Event | None:
        """The network event that carries the fault out (None for loss, which is a link impairment)."""
        if self.kind == "loss" or self.stage is None or self.at_s is None:
            return None
        return Event(at_s=self.at_s, kind=self.kind, nodes=(stage_node(self.stage),), for_s=self.for_s)

    def can_outlast_detection(self) -> bool:
        """Whether the fault may end in a failover: a kill always; a pause or partition whose silence, plus the
        heartbeat that may have been due just before it, reaches the detection timeout."""
        if self.kind == "kill":
            return True
        return self.for_s is not None and self.for_s + 2 * HEARTBEAT_S >= DEAD_AFTER_S

    def describe(self) -> str:
        if self.kind == "loss":
            return f"bursty loss (mean {LOSS_BURSTS.steady_loss() * 100:.2g} %)"
        lasting = f" for {self.for_s:.2f} s" if self.for_s is not None else ""
        return f"{self.kind} stage {self.stage} at {self.at_s:.2f} s{lasting}"


def draw_schedule(rng: random.Random, num_stages: int) -> list[Fault]:
    """One trial's faults: one or two, each a kill, pause or partition of a random stage at a random time, or bursty
    loss on every link (at most once); timed faults in time order, loss last."""
    faults: list[Fault] = []
    for _ in range(rng.randint(*FAULTS_PER_TRIAL)):
        kinds = TIMED_KINDS if any(f.kind == "loss" for f in faults) else KINDS
        kind = rng.choice(kinds)
        if kind == "loss":
            faults.append(Fault("loss"))
            continue
        stage = rng.randrange(num_stages)
        at_s = round(rng.uniform(*AT_S), 2)
        span = {"pause": PAUSE_S, "partition": PARTITION_S}.get(kind)
        for_s = round(rng.uniform(*span), 2) if span is not None else None
        faults.append(Fault(kind, stage, at_s, for_s))
    return sorted(faults, key=lambda f: (f.at_s is None, f.at_s or 0.0))


def spares_for(faults: list[Fault]) -> int:
    """The spares a trial gets: one for every fault that may end in a failover, at least one."""
    return max(1, sum(f.can_outlast_detection() for f in faults))


def schedule_network(faults: list[Fault], seed: int) -> Network:
    """The network section that carries ``faults`` out, seeded with ``seed``."""
    events = tuple(e for e in (f.event() for f in faults) if e is not None)
    loss = any(f.kind == "loss" for f in faults)
    return Network(seed=seed, default=Impairment(bursty=LOSS_BURSTS) if loss else Impairment(), events=events)


# --- scenarios ------------------------------------------------------------------------------------------------------


def base_scenario(num_stages: int, tokens: int, in_flight: int = 1) -> Scenario:
    """The built-in scenario with ``num_stages`` stages and ``tokens`` tokens, membership on fast heartbeats, and a
    request slot for each of ``in_flight`` requests."""

    sc = scenario_from_args(num_stages=num_stages, max_tokens=tokens, prompt=PROMPT, name="bench-chaos")
    sc = msgspec.structs.replace(sc, serving=msgspec.structs.replace(sc.serving, slots=in_flight))
    cluster = msgspec.structs.replace(
        sc.cluster, engine="heartbeat", heartbeat_s=HEARTBEAT_S, dead_after_s=DEAD_AFTER_S
    )
    expect = msgspec.structs.replace(sc.expect, match_oracle=False)  # the bench compares with the oracle itself
    return msgspec.structs.replace(sc, cluster=cluster, expect=expect)


def with_policy(
    base: Scenario,
    policy: Literal["none", "failover"],
    spares: int,
    network: Network | None,
    dead_after_s: float = DEAD_AFTER_S,
) -> Scenario:
    """``base`` with a fault-tolerance policy, its spares, a network and a detection timeout, checked as a scenario
    file would be."""

    ft = msgspec.structs.replace(base.fault_tolerance, policy=policy, spares=spares)
    cluster = msgspec.structs.replace(base.cluster, dead_after_s=dead_after_s)
    sc = msgspec.structs.replace(base, fault_tolerance=ft, network=network, cluster=cluster)
    return msgspec.convert(msgspec.to_builtins(sc), type=Scenario)


# --- one trial ------------------------------------------------------------------------------------------------------


@dataclass
class RecoveryFigures:
    """One failover: which stage, why, and its parts in seconds (detection counts from the fault it is laid to)."""

    stage: int
    cause: str
    spare: str
    fault: int | None  # index into the trial's faults; None when no fault on that stage came before it
    detection_s: float | None
    reload_s: float
    replay_s: float | None  # None: no token came after the spare's Ready (the request had finished without it)
    load_s: float  # the spare's own report of loading and compiling (part of reload)

    @property
    def total_s(self) -> float | None:
        """Detection + reload + replay: from the fault to the first token after the spare took over."""
        if self.detection_s is None or self.replay_s is None:
            return None
        return self.detection_s + self.reload_s + self.replay_s


@dataclass
class Trial:
    """One request under one fault schedule: its outcome and raw figures."""

    index: int
    seed: int
    faults: list[Fault]
    spares: int
    outcome: Literal["exact", "diverged", "failed"] = "failed"
    error: str = ""
    tokens: list[int] = field(default_factory=list)
    first_divergence: int | None = None
    request_s: float = 0.0
    carried_out: list[tuple[float, str, str]] = field(default_factory=list)  # the nemesis's (elapsed, action, node)
    struck_s: list[float | None] = field(default_factory=list)  # per fault: when it struck (``fault_times``)
    arrivals_s: list[float] = field(default_factory=list)  # each streamed token's arrival, from the request's start
    next_token_s: list[float | None] = field(default_factory=list)  # per fault: fault -> next token at the client
    recoveries: list[RecoveryFigures] = field(default_factory=list)
    resends: int = 0
    elapsed_s: float = 0.0
    in_flight: int = 1  # requests served at once
    divergent: int = 0  # of them, answers that differ from the unsplit model's


def first_divergence(got: list[int], want: list[int]) -> int | None:
    """The first position where ``got`` and ``want`` differ (the shorter's length when one is a prefix); None when
    they are equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def next_token_after(arrivals: list[float], t: float) -> float | None:
    """Seconds from ``t`` to the first arrival after it (None when none came after)."""
    later = [a for a in arrivals if a > t]
    return min(later) - t if later else None


def lay_recoveries(
    recoveries: list[Recovery], faults: list[Fault], struck_s: list[float | None], started: float
) -> list[RecoveryFigures]:
    """Each recovery's parts, laid to the latest fault on its stage that struck (``struck_s``, seconds after
    ``started``) before the death was detected; each fault at most once."""
    taken: set[int] = set()
    out: list[RecoveryFigures] = []
    for r in sorted(recoveries, key=lambda r: r.detected_at):
        candidates = [
            (t, i)
            for i, (f, t) in enumerate(zip(faults, struck_s))
            if i not in taken and f.stage == r.stage and t is not None and started + t <= r.detected_at
        ]
        cause: int | None = None
        detection: float | None = None
        if candidates:
            t, cause = max(candidates)
            taken.add(cause)
            detection = r.detected_at - (started + t)
        replay = r.replay_s if r.next_token_at else None
        out.append(RecoveryFigures(r.stage, r.cause, r.spare, cause, detection, r.reload_s, replay, r.load_s))
    return out


def fault_times(faults: list[Fault], done: list[tuple[float, str, str]]) -> list[float | None]:
    """When each fault struck, in seconds from the start of the request: a kill or pause when the nemesis carried it
    out (``done``: its first tick at or after ``at_s``, up to a poll later), a partition at ``at_s`` (every endpoint
    applies it on its own clock); None for loss, and for a kill or pause never carried out (the request had ended)."""
    out: list[float | None] = []
    used: set[int] = set()
    for f in faults:
        if f.at_s is None or f.kind == "partition":
            out.append(f.at_s)
            continue
        node = stage_node(f.stage or 0)
        hit = next(
            (i for i, (t, action, n) in enumerate(done) if i not in used and action == f.kind and n == node), None
        )
        if hit is not None:
            used.add(hit)
        out.append(done[hit][0] if hit is not None else None)
    return out


def _read_chain(trial: Trial, chain: Chain, arrivals: list[float]) -> None:
    """What the chain kept of the requests: the faults carried out, the token arrivals (``arrivals``: of every
    request in flight, on the orchestrator's clock), the recoveries, the resends."""
    started = chain.request_started
    arrivals = sorted(arrivals)
    trial.arrivals_s = [round(at - started, 4) for at in arrivals]
    trial.carried_out = [(round(t, 3), str(a), n) for t, a, n in (chain.nemesis.done if chain.nemesis else [])]
    trial.struck_s = fault_times(trial.faults, trial.carried_out)
    trial.next_token_s = [next_token_after(arrivals, started + t) if t is not None else None for t in trial.struck_s]
    trial.recoveries = lay_recoveries(chain.recoveries, trial.faults, trial.struck_s, started)
    trial.resends = chain.outbox.resends if chain.outbox is not None else 0


Oracle = Callable[[str, str], list[int]]  # (model path, prompt) -> the unsplit model's tokens


def run_trial(
    base: Scenario, index: int, seed: int, oracle: Oracle, log: Callable[[str], None], spares: bool = True
) -> Trial:
    """One request (or ``serving.slots`` requests in flight together) under the schedule drawn from ``seed``; any
    exception ends the trial as failed, not the bench. ``spares``: False runs without spares, so that a dead stage
    is re-placed on a surviving device (``ppharness.run.seed.replan``)."""

    faults = draw_schedule(random.Random(seed), base.stages.num_stages)
    trial = Trial(
        index=index, seed=seed, faults=faults, spares=spares_for(faults) if spares else 0, in_flight=base.serving.slots
    )
    scenario = with_policy(base, "failover", trial.spares, schedule_network(faults, seed))
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(trial.in_flight)]
    t0 = time.monotonic()
    try:
        with Chain(scenario, progress=_chain_lines(log), trace=False) as chain:
            if trial.in_flight == 1:
                response, trial.request_s = chain.request(base.request.prompt, base.request.max_tokens)
                got = chain.streams.get(response.request_id, {})
                _read_chain(trial, chain, [at for _, at in got.values()])
                answers = [response]
            else:
                served = chain.serve([Job(p, base.request.max_tokens) for p in prompts])
                trial.request_s = max(x.token_at[-1] - x.sent_at for x in served if x.token_at)
                _read_chain(trial, chain, [at for x in served for at in x.token_at])
                answers = [x.response for x in served if x.response is not None]
                if len(answers) < len(served):
                    raise RuntimeError(f"{len(served) - len(answers)} request(s) refused: {served[0].refused}")
        trial.tokens = list(answers[0].token_ids)
        for prompt, answer in zip(prompts, answers, strict=True):
            diverged = first_divergence(list(answer.token_ids), oracle(chain.model_path, prompt))
            if diverged is not None:
                trial.divergent += 1
                trial.first_divergence = diverged if trial.first_divergence is None else trial.first_divergence
        trial.outcome = "exact" if trial.divergent == 0 else "diverged"
    except Exception as exc:  # a failed run is a finding of the bench, not the end of it
        trial.error = f"{type(exc).__name__}: {exc}" + "".join(f"\n{n}" for n in getattr(exc, "__notes__", []))
        log("".join(traceback.format_exception_only(exc)).rstrip())
    trial.elapsed_s = time.monotonic() - t0
    return trial


def _chain_lines(log: Callable[[str], None]) -> Callable[[str], None]:
    """The chain's progress, less its start-up chatter: failovers, network events and warnings only."""

    def forward(line: str) -> None:
        if line.startswith(("failover:", "network event", "warning")):
            log(f"  {line}")

    return forward


# --- the price of the policy ----------------------------------------------------------------------------------------


@dataclass
class Overhead:
    """Decode tokens/s of fault-free requests, interleaved, with and without policy failover."""

    requests: int
    none_tok_s: list[float] = field(default_factory=list)
    failover_tok_s: list[float] = field(default_factory=list)
    diverged: int = 0  # fault-free answers that differ from the oracle's

    @property
    def ratio(self) -> float:
        """The failover chain's median tokens/s over the plain chain's."""
        return slowdown_ratio(self.none_tok_s, self.failover_tok_s)

    @property
    def slowdown(self) -> float:
        """How much slower the failover chain decodes (0.05: 5 % slower; negative: faster)."""
        return 1.0 - self.ratio


def slowdown_ratio(baseline: list[float], contender: list[float]) -> float:
    """The contender's median over the baseline's (NaN without figures)."""
    if not baseline or not contender or statistics.median(baseline) <= 0:
        return float("nan")
    return statistics.median(contender) / statistics.median(baseline)


def measure_overhead(base: Scenario, requests: int, oracle: Oracle, log: Callable[[str], None]) -> Overhead:
    """Two chains on the same model, policy none and failover, no faults: a warm-up request each, then ``requests``
    each, interleaved (in turns, neither always first)."""

    res = Overhead(requests=requests)
    prompt, tokens = base.request.prompt, base.request.max_tokens
    chains: list[Chain] = []
    with ExitStack() as stack:
        contenders: tuple[tuple[Literal["none", "failover"], int], ...] = (("none", 0), ("failover", 1))
        for policy, spares in contenders:
            scenario = with_policy(base, policy, spares, None, DEAD_AFTER_S)
            chains.append(stack.enter_context(Chain(scenario, progress=_chain_lines(log))))
        plain, guarded = chains
        want = oracle(plain.model_path, prompt)
        for chain in (plain, guarded):
            chain.request(prompt, tokens)
        for i in range(requests):
            pairs = [(plain, res.none_tok_s), (guarded, res.failover_tok_s)]
            for chain, into in pairs if i % 2 == 0 else pairs[::-1]:  # neither always goes first
                response, _ = chain.request(prompt, tokens)
                res.diverged += list(response.token_ids) != want
                into.append(decode_tok_s(response))
            log(
                f"overhead {i + 1}/{requests}: none {res.none_tok_s[-1]:.1f} tok/s, "
                f"failover {res.failover_tok_s[-1]:.1f} tok/s"
            )
    return res


# --- the bench ------------------------------------------------------------------------------------------------------


@dataclass
class ChaosResult:
    num_stages: int
    tokens: int
    seed: int
    trials: list[Trial] = field(default_factory=list)
    overhead: Overhead | None = None
    oracle_tokens: list[int] = field(default_factory=list)
    elapsed_s: float = 0.0
    in_flight: int = 1  # requests served at once in each trial
    spares: bool = True  # False: no spares, dead stages re-placed on surviving devices

    @property
    def diverged(self) -> int:
        fault_free = self.overhead.diverged if self.overhead is not None else 0
        return sum(t.divergent for t in self.trials) + fault_free  # answers, every request in flight counted

    @property
    def failed(self) -> int:
        return sum(t.outcome == "failed" for t in self.trials)


class UnsplitAnswers:
    """The unsplit model's tokens for each of the bench's prompts, computed once each (the model path comes from the
    first chain to resolve it)."""

    def __init__(self, tokens: int, max_context: int, log: Callable[[str], None]):
        self.tokens, self.max_context, self.log = tokens, max_context, log
        self.token_ids: dict[str, list[int]] = {}

    def __call__(self, model_path: str, prompt: str) -> list[int]:
        if prompt not in self.token_ids:
            self.log(f"running the unsplit model in this process (the oracle, once for {prompt!r})")
            self.token_ids[prompt] = list(oracle_decode(model_path, prompt, self.tokens, self.max_context).token_ids)
        return self.token_ids[prompt]
