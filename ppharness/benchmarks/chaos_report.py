"""``ppharness bench chaos``, the bench itself and its figures: trials run one after another (``run_chaos_bench``),
each reported as it ends (``trial_line``), then summed up against the targets (``summarise``, ``report``) and written
as JSON with the provenance of the run (``to_json``). What a trial is and how it is timed:
``ppharness.benchmarks.chaos``.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from ppharness.benchmarks.chaos import (
    AT_S,
    DEAD_AFTER_S,
    FAULTS_PER_TRIAL,
    HEARTBEAT_S,
    LOSS_BURSTS,
    PARTITION_S,
    PAUSE_S,
    PROMPT,
    RECOVERY_P99_TARGET_S,
    RECOVERY_TARGET_S,
    SLOWDOWN_TARGET,
    ChaosResult,
    Trial,
    UnsplitAnswers,
    base_scenario,
    draw_schedule,
    measure_overhead,
    run_trial,
)
from ppharness.benchmarks.provenance import stamped
from ppharness.trace.report import percentile


def run_chaos_bench(
    trials: int,
    seed: int,
    num_stages: int,
    tokens: int,
    overhead_requests: int,
    progress: Callable[[str], None],
    in_flight: int = 1,
    spares: bool = True,
) -> ChaosResult:
    """``trials`` trials under random fault schedules (seeds ``seed`` .. ``seed + trials - 1``), each of
    ``in_flight`` requests served at once, then the fault-free overhead of the policy (one request at a time)."""
    t0 = time.monotonic()
    base = base_scenario(num_stages, tokens, in_flight)
    oracle = UnsplitAnswers(tokens, base.model.max_context, progress)
    res = ChaosResult(num_stages=num_stages, tokens=tokens, seed=seed, in_flight=in_flight, spares=spares)
    for k in range(trials):
        faults = draw_schedule(random.Random(seed + k), num_stages)
        progress(f"trial {k + 1}/{trials} (seed {seed + k}): " + "; ".join(f.describe() for f in faults))
        trial = run_trial(base, k, seed + k, oracle, progress, spares)
        res.trials.append(trial)
        progress(f"trial {k + 1}/{trials}: {trial_line(trial)}")
    if overhead_requests > 0:
        progress(f"overhead: {overhead_requests} fault-free requests each, policy none and failover, interleaved")
        res.overhead = measure_overhead(base_scenario(num_stages, tokens), overhead_requests, oracle, progress)
    res.oracle_tokens = oracle.token_ids.get(PROMPT, [])
    res.elapsed_s = time.monotonic() - t0
    return res


def trial_line(t: Trial) -> str:
    """One trial's outcome in a line."""
    if t.outcome == "failed":
        return f"FAILED after {t.elapsed_s:.1f} s: {t.error.splitlines()[0] if t.error else '?'}"
    verdict = "exact" if t.outcome == "exact" else f"{t.divergent} DIVERGED (first at token {t.first_divergence})"
    if t.in_flight > 1:
        verdict += f" ({t.in_flight} in flight)"
    nxt = ", ".join(_s(s) for s, f in zip(t.next_token_s, t.faults) if f.kind != "loss") or "-"
    return (
        f"{verdict}, {len(t.tokens)} tokens in {t.request_s:.2f} s; {len(t.recoveries)} failover(s); "
        f"fault -> next token {nxt}; {t.resends} resend(s)"
    )


# --- figures --------------------------------------------------------------------------------------------------------


@dataclass
class Summary:
    """The bench's headline figures (seconds), NaN where nothing was measured."""

    trials: int
    exact: int
    diverged: int  # the fault-free overhead requests included
    failed: int
    faults: int
    faults_after_last_token: int  # timed faults with no token after them: the request had ended (or was ending)
    next_token_p50_s: float
    next_token_p99_s: float
    failovers: int
    failovers_overtaken: int  # the request finished before the spare was ready (on a paused node, resumed)
    detection_p50_s: float
    reload_p50_s: float
    replay_p50_s: float
    recovery_p50_s: float  # detection + reload + replay, over the failovers with all three
    recovery_p99_s: float
    slowdown: float | None
    recovery_met: bool | None
    slowdown_met: bool | None


def summarise(res: ChaosResult) -> Summary:
    """The headline figures from the trials' raw ones (the failed trials' figures left out)."""
    done = [t for t in res.trials if t.outcome != "failed"]
    timed = [s for t in done for f, s in zip(t.faults, t.next_token_s) if f.kind != "loss"]
    recoveries = [r for t in done for r in t.recoveries]
    totals = [r.total_s for r in recoveries if r.total_s is not None]
    recovery_p50 = percentile(totals, 50)
    slowdown = res.overhead.slowdown if res.overhead is not None else None
    return Summary(
        trials=len(res.trials),
        exact=sum(t.outcome == "exact" for t in res.trials),
        diverged=res.diverged,
        failed=res.failed,
        faults=sum(len(t.faults) for t in res.trials),
        faults_after_last_token=sum(s is None for s in timed),
        next_token_p50_s=percentile([s for s in timed if s is not None], 50),
        next_token_p99_s=percentile([s for s in timed if s is not None], 99),
        failovers=len(recoveries),
        failovers_overtaken=sum(r.replay_s is None for r in recoveries),
        detection_p50_s=percentile([r.detection_s for r in recoveries if r.detection_s is not None], 50),
        reload_p50_s=percentile([r.reload_s for r in recoveries], 50),
        replay_p50_s=percentile([r.replay_s for r in recoveries if r.replay_s is not None], 50),
        recovery_p50_s=recovery_p50,
        recovery_p99_s=percentile(totals, 99),
        slowdown=slowdown,
        recovery_met=recovery_p50 <= RECOVERY_TARGET_S and percentile(totals, 99) <= RECOVERY_P99_TARGET_S
        if totals
        else None,
        slowdown_met=slowdown <= SLOWDOWN_TARGET if slowdown is not None and not math.isnan(slowdown) else None,
    )


def _s(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.2f} s"


def _met(ok: bool | None) -> str:
    return "" if ok is None else ("  met" if ok else "  NOT MET")


def _rows(res: ChaosResult) -> Iterator[str]:
    """The per-trial table."""
    yield f"{'trial':>5}  {'seed':>5}  {'outcome':<9} {'failovers':>9}  {'fault -> next token':<22}  faults"
    for t in res.trials:
        outcome = t.outcome.upper() if t.outcome != "exact" else t.outcome
        nxt = ", ".join(_s(s) for s, f in zip(t.next_token_s, t.faults) if f.kind != "loss") or "-"
        faults = "; ".join(f.describe() for f in t.faults)
        yield f"{t.index + 1:>5}  {t.seed:>5}  {outcome:<9} {len(t.recoveries):>9}  {nxt:<22}  {faults}"
        if t.outcome == "failed":
            yield f"{'':>7}{t.error.splitlines()[0] if t.error else ''}"


def report(res: ChaosResult) -> str:
    """The plain-text table and the headline figures against their targets."""
    s = summarise(res)
    lines = [
        f"chaos: {s.trials} trial(s) of {res.in_flight} request(s) in flight, {res.num_stages} stages, "
        f"{res.tokens} tokens, seeds {res.seed}.."
        f"{res.seed + max(0, s.trials - 1)}, policy failover"
        f"{'' if res.spares else ' without spares (dead stages re-placed on surviving devices)'}, "
        f"heartbeats every {HEARTBEAT_S:g} s "
        f"(dead after {DEAD_AFTER_S:g} s)",
        "",
        *_rows(res),
        "",
        f"divergent outputs: {s.diverged} (target 0){_met(s.diverged == 0)}",
        f"failed runs:       {s.failed} (target 0 while spares remain){_met(s.failed == 0)}",
        f"fault -> next token at the client: p50 {_s(s.next_token_p50_s)}, p99 {_s(s.next_token_p99_s)} "
        f"({s.faults} fault(s); {s.faults_after_last_token} timed one(s) after the last token)",
        f"failovers: {s.failovers} ({s.failovers_overtaken} overtaken: the request finished before the spare was "
        f"ready); parts, p50: detection {_s(s.detection_p50_s)} (timeout {DEAD_AFTER_S:g} s), "
        f"reload {_s(s.reload_p50_s)}, replay {_s(s.replay_p50_s)}",
        f"fault -> first token after the failover (detection + reload + replay): p50 {_s(s.recovery_p50_s)}, "
        f"p99 {_s(s.recovery_p99_s)} (target <= {RECOVERY_TARGET_S:g} s and <= {RECOVERY_P99_TARGET_S:g} s)"
        f"{_met(s.recovery_met)}",
    ]
    o = res.overhead
    if o is not None and s.slowdown is not None:
        lines.append(
            f"fault-free decode, {o.requests} interleaved request(s) each: none "
            f"{_median(o.none_tok_s):.1f} tok/s, failover {_median(o.failover_tok_s):.1f} tok/s: "
            f"{abs(s.slowdown) * 100:.1f} % {'slower' if s.slowdown >= 0 else 'faster'} "
            f"(target <= {SLOWDOWN_TARGET * 100:g} % slower){_met(s.slowdown_met)}"
        )
    return "\n".join(lines)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def to_json(res: ChaosResult) -> dict[str, object]:
    """Every raw figure, and the summary."""
    out = asdict(res)
    for t, raw in zip(res.trials, out["trials"]):
        for r, raw_r in zip(t.recoveries, raw["recoveries"]):
            raw_r["total_s"] = r.total_s
    if res.overhead is not None:
        out["overhead"] |= {"ratio": res.overhead.ratio, "slowdown": res.overhead.slowdown}
    out["summary"] = asdict(summarise(res))
    out["settings"] = {
        "at_s": AT_S,
        "pause_s": PAUSE_S,
        "partition_s": PARTITION_S,
        "faults_per_trial": FAULTS_PER_TRIAL,
        "loss_bursts": {"p": LOSS_BURSTS.p, "r": LOSS_BURSTS.r, "loss_bad": LOSS_BURSTS.loss_bad},
        "heartbeat_s": HEARTBEAT_S,
        "dead_after_s": DEAD_AFTER_S,
        "recovery_target_s": RECOVERY_TARGET_S,
        "slowdown_target": SLOWDOWN_TARGET,
    }
    return out


def write_json(res: ChaosResult, path: str) -> None:
    """The report and its provenance as JSON; NaN is not JSON: a figure nothing measured is null."""
    Path(path).write_text(json.dumps(_nan_to_none(stamped(to_json(res))), indent=1) + "\n")


def _nan_to_none(v: object) -> object:
    if isinstance(v, float) and math.isnan(v):
        return None
    if isinstance(v, dict):
        return {k: _nan_to_none(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_nan_to_none(x) for x in v]
    return v
