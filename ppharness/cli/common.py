"""What every command shares: one-line failures with exit 1, signals that take the clean path, loading a scenario,
running it and printing its summary."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NoReturn

import click

from ppharness.cli.stream import AnswerStream
from ppharness.errors import HarnessError
from ppharness.registry import provider_class
from ppharness.run.seed.locks import RunLabelInUse
from ppharness.run.seed.orchestrator import Progress, RunResult, run_scenario
from ppharness.scenario.schema import Scenario, load_scenario, scenario_from_args
from ppharness.seams.provider import Reaped
from ppharness.version import version_text

SCENARIO_HELP = "Scenario YAML file (see scenarios/); flags given here override its values."


def fail(reason: str, exc: BaseException | None = None, code: int = 1) -> NoReturn:
    click.echo(f"FAILED: {reason}", err=True)
    for note in getattr(exc, "__notes__", []) or []:
        click.echo(note, err=True)
    sys.exit(code)


def version_option(prog: str) -> Callable[[Any], Any]:
    """``--version`` for a click command: print :func:`version_text` and exit 0."""

    def show(ctx: click.Context, param: click.Parameter, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            click.echo(version_text(prog))
            ctx.exit()

    return click.option(
        "--version",
        is_flag=True,
        expose_value=False,
        is_eager=True,
        callback=show,
        help="Print the version (ppharness, tinygrad, the git commit of a checkout) and exit.",
    )


# the signal that interrupted the command (SIGINT unless a handler below saw another): its exit status is 128 + it
_interrupted_by: list[int] = [signal.SIGINT]


@contextlib.contextmanager
def exit_1_on_failure(
    before_exit: Callable[[], object] = lambda: None, interrupted: str = "interrupted; every node was stopped"
) -> Iterator[None]:
    """Around long work: SIGTERM behaves like Ctrl-C, and a HarnessError ends the command with exit 1 and one line,
    an interrupt with one line (``interrupted``) and the shell's convention, 128 + the signal: 130 for Ctrl-C (SIGINT),
    143 for SIGTERM, 129 for SIGHUP; both after ``before_exit`` (e.g. the run's last sweep)."""
    _interrupted_by[0] = signal.SIGINT  # until a handler below sees another
    _sigterm_as_interrupt()
    try:
        yield
    except RunLabelInUse as exc:  # nothing was created, and what the label names is another run's
        fail(str(exc), exc)
    except HarnessError as exc:
        before_exit()
        fail(str(exc), exc)
    except KeyboardInterrupt:
        before_exit()
        fail(interrupted, code=128 + _interrupted_by[0])


def _sigterm_as_interrupt() -> None:
    """SIGTERM and SIGHUP (a closed terminal, a dropped SSH session) take the same clean path as Ctrl-C: unwind,
    destroy every node, exit 128 + the signal. After a hang-up the terminal is gone, so output goes to /dev/null from
    then on (a write to a hung-up terminal fails, and must not break the clean-up)."""

    def handler(signum: int, frame: FrameType | None) -> NoReturn:
        _interrupted_by[0] = signum
        raise KeyboardInterrupt

    def hangup(signum: int, frame: FrameType | None) -> NoReturn:
        _interrupted_by[0] = signum
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(null, fd)
        os.close(null)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, hangup)


def split_csv(csv: str) -> list[str]:
    """``"zmq, iroh"`` -> ``["zmq", "iroh"]``."""
    return [t.strip() for t in csv.split(",") if t.strip()]


def human_bytes(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def ending(finish_reason: str, stop_token_id: int | None, stop_token: str) -> str:
    """How an answer ended, in a few words: ``length``, or ``eos '<|eot_id|>' (id 128009)`` naming the
    end-of-generation token that ended it."""
    return finish_reason if stop_token_id is None else f"{finish_reason} {stop_token!r} (id {stop_token_id})"


def plural(n: int, noun: str) -> str:
    """``1 stage``, ``5 stages``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


RUN_FORMAT = "ppharness-run/1"


def run_json(result: RunResult, trace_files: list[str]) -> dict[str, Any]:
    """A run as ``--json`` prints it: stable keys, documented in docs/scenarios.md ("Machine-readable output")."""
    r, o, v = result.response, result.oracle, result.verdict
    parts = result.trace.p50_parts() if result.trace is not None else None
    return {
        "format": RUN_FORMAT,
        "scenario": result.scenario,
        "run_label": result.run_label,
        "match": result.matches_oracle,
        "text": r.text,
        "token_ids": list(r.token_ids),
        "finish_reason": r.finish_reason,
        "nodes": [
            {"index": s.index, "blocks": [s.lo, s.hi] if s.hi > s.lo else None, "load_s": s.load_s}
            for s in result.stages
        ],
        "ttft_ms": round(result.ttft_s * 1000, 3),
        "decode_tok_s": round(result.decode_tok_s, 3),
        "oracle": None
        if o is None
        else {"token_ids": list(o.token_ids), "ttft_ms": round(o.ttft_s * 1000, 3), "decode_tok_s": o.decode_tok_s},
        "boundaries_compared": None if v is None else v.boundaries_compared,
        "policy": result.policy,
        "resends": result.resends,
        "failovers": [{"stage": rec.stage, "spare": rec.spare, "reload_s": rec.reload_s} for rec in result.recoveries],
        "trace": None
        if parts is None
        else {"per_token_p50_ms": parts.pop("per token"), "rows_p50_ms": parts, "files": trace_files},
    }


def print_summary(result: RunResult, err: bool = False) -> None:
    """The chain's answer and figures on stdout (stderr with ``err``: stdout is then the JSON's), before the oracle
    has run: the text, its tokens, the chain's time to first token and decode rate, the stages."""
    echo = functools.partial(click.echo, err=err)
    r = result.response
    echo(f"\ntext: {r.text!r}")
    echo(f"tokens ({len(r.token_ids)}, {ending(r.finish_reason, r.stop_token_id, r.stop_token)}): {r.token_ids}")
    n = len(result.plan.ranges)
    echo(
        f"chain ({plural(n, 'stage')}, as the tokens reached this process): time to first token "
        f"{result.ttft_s * 1000:.0f} ms, decode {result.decode_tok_s:.1f} tok/s"
    )
    if r.trips:
        decoded = max(len(r.token_ids) - 1 + (r.stop_token_id is not None), 0)
        echo(
            f"speculation: {plural(r.trips, 'trip')} round the chain for {decoded} decoded token(s), "
            f"{decoded / r.trips:.2f} per trip; {r.accepted} of {r.drafted} drafted token(s) accepted"
        )
    echo(f"\n{'stage':>5} {'blocks':>9} {'params':>12} {'tied':>10} {'load+compile':>13} {'peak RSS':>9}")
    for s in result.stages:
        blocks = f"[{s.lo},{s.hi})" if s.hi > s.lo else "experts"  # an expert node runs no block range
        echo(
            f"{s.index:>5} {blocks:>9} {s.params:>12,} {s.tied_params:>10,} {s.load_s:>12.1f}s "
            f"{human_bytes(s.peak_rss_bytes):>9}"
        )
    echo(f"{'sum':>5} {'':>9} {sum(s.params for s in result.stages):>12,}")
    if result.policy != "none":
        echo(f"\nfault tolerance: {result.policy}; {result.resends} message(s) the orchestrator sent again")
    for rec in result.recoveries:
        replay = f"{rec.replay_s:.2f} s" if rec.replay_s is not None else "none (no token came after it)"
        echo(
            f"failover: stage {rec.stage} ({rec.cause}) -> spare {rec.spare}, epoch {rec.epoch}: reload "
            f"{rec.reload_s:.2f} s (loading {rec.load_s:.2f} s), replay to the next token {replay}"
        )


def print_verdict(result: RunResult, err: bool = False) -> None:
    """The oracle's figures beside the chain's and, when they agree, the MATCH line (a mismatch fails the command
    in ``run_and_report``); nothing when the oracle did not run."""
    echo = functools.partial(click.echo, err=err)
    r, o, n = result.response, result.oracle, len(result.plan.ranges)
    if o is None:
        echo("\nnot compared with the unsplit model (the oracle did not run)")
        return
    ratio = f"; chain/oracle decode {result.decode_tok_s / o.decode_tok_s:.2f}" if o.decode_tok_s else ""
    echo(
        f"\noracle (the unsplit model, {o.n_params:,} parameters, in this process): time to first token "
        f"{o.ttft_s * 1000:.0f} ms, decode {o.decode_tok_s:.1f} tok/s{ratio}"
    )
    if result.matches_oracle is True and result.verdict is not None:
        v = result.verdict
        boundaries = (
            f"and all {v.boundaries_compared} stage-boundary hidden states byte for byte"
            if n > 1
            else "with no stage boundary to compare (one stage)"
        )
        echo(
            f"MATCH: the {n}-stage chain's {len(r.token_ids)} tokens equal the unsplit model's, token for token, "
            + boundaries
            + (
                f" (those of stage(s) {v.unverified} went with the node a spare replaced: not compared)"
                if v.unverified
                else ""
            )
        )


def reap_own(kind: str, run_label: str) -> list[Reaped]:
    """The last sweep of every run: destroy whatever still carries its label; say what that was."""
    try:
        found = provider_class(kind).reap(run_label)
    except HarnessError as exc:
        click.echo(f"warning: reaping run {run_label} failed: {exc}", err=True)
        return []
    for what in found:
        click.echo(f"warning: reaped leftover of run {run_label}: {what}", err=True)
    return found


def run_and_report(
    scenario: Scenario,
    quiet: bool = False,
    run_label: str | None = None,
    trace_path: str | None = None,
    trace: bool | None = None,
    json_out: bool = False,
) -> None:
    """Run ``scenario``: its answer printed as the tokens arrive, then the chain's summary, then the oracle's verdict
    once it has run; exit 1 on failure or mismatch. ``json_out``: the summary goes to stderr and stdout holds only the
    run's JSON (``run_json``), printed whether or not it matched."""
    run_label = run_label or f"pp-{uuid.uuid4().hex[:8]}"
    trace_path = trace_path or scenario.trace.path
    trace_on = bool(trace_path) or (scenario.trace.enabled if trace is None else trace)
    answer = AnswerStream(err=json_out)

    def answered(result: RunResult) -> None:  # the chain's part, before the oracle runs
        answer.end()
        print_summary(result, err=json_out)

    with exit_1_on_failure(lambda: reap_own(scenario.provider.kind, run_label)):
        result = run_scenario(
            scenario,
            progress=Progress(quiet=quiet),
            run_label=run_label,
            trace=trace_on,
            shown=answer.start,
            answered=answered,
        )
    if reap_own(scenario.provider.kind, run_label):
        fail(f"resources of run {run_label} outlived it and were reaped")
    print_verdict(result, err=json_out)
    files: list[str] = []
    if result.trace is not None:
        click.echo("\n" + result.trace.summary(), err=json_out)
        if trace_path:
            files = result.trace.write(trace_path)
            click.echo(f"trace written: {', '.join(files)} (open the .json in ui.perfetto.dev)", err=json_out)
    if json_out:
        click.echo(json.dumps(run_json(result, files), indent=1))
    if result.matches_oracle is False:
        assert result.oracle is not None and result.verdict is not None, "a verdict needs the oracle's answer"
        o, c = result.oracle.token_ids, result.response.token_ids
        fail(f"MISMATCH: {result.verdict.describe(c, o)}; chain {c}, oracle {o}")


def load_scenario_or_fail(scenario_file: str | None, **overrides: Any) -> Scenario:
    try:
        base = load_scenario(scenario_file) if scenario_file else None
        return scenario_from_args(base=base, **overrides)
    except HarnessError as exc:
        fail(str(exc))
