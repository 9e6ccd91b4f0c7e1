"""Carrying a scenario out: build the model, start N nodes, wait for them, send the request, compare, tear down.

The orchestrator is the cluster's seed and the request's ``reply_to``; it is not on the token path. Every wait is
bounded by its phase's timeout and by the run's total budget (the SPEC's 300 s), and checks between polls that no node
died and no node reported an Error. The provider is a context manager, so every path out destroys every node.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from ppharness.cluster import Directory, wait_for
from ppharness.errors import ClusterError, HarnessError, StageError
from ppharness.messages import (
    Error,
    InferenceRequest,
    InferenceResponse,
    Join,
    Members,
    Message,
    Ready,
    Shutdown,
    Stopped,
)
from ppharness.plan import ENTRY, Plan, make_plan, stage_name
from ppharness.registry import provider_class, transport_class


class Progress:
    """Progress lines on stderr, stamped with seconds since the run started."""

    def __init__(self, quiet: bool = False, stream: Any = None):
        self.t0, self.quiet, self.stream = time.monotonic(), quiet, stream or sys.stderr

    def __call__(self, text: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", file=self.stream, flush=True)


@dataclass
class StageReport:
    index: int
    lo: int
    hi: int
    params: int = 0
    tied_params: int = 0
    load_s: float = 0.0
    peak_rss_bytes: int = 0


@dataclass
class RunResult:
    scenario: str
    run_label: str
    plan: Plan
    response: InferenceResponse
    request_s: float  # InferenceRequest sent -> InferenceResponse received, on the orchestrator's clock
    stages: list[StageReport]
    model_path: str
    oracle: Any = None  # OracleResult when the scenario asks to match the oracle
    notes: list[str] = field(default_factory=list)

    @property
    def decode_s(self) -> float:
        t = self.response.token_times
        return t[-1] - t[0] if len(t) > 1 else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens per second after the first token, on the last stage's clock."""
        n = len(self.response.token_times)
        return (n - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def ttft_s(self) -> float:
        """Time to first token: the request's round trip less the decode span measured on the last stage."""
        return self.request_s - self.decode_s

    @property
    def matches_oracle(self) -> bool | None:
        return None if self.oracle is None else self.response.token_ids == self.oracle.token_ids


def model_source(scenario: Any) -> tuple[str, str | None]:
    """The scenario's model as a source string for ``resolve_model`` (and its sha256)."""
    from dataclasses import asdict

    from ppharness.modelfile import preset_spec, synthetic_source

    m = scenario.model
    if m.synthetic is not None:
        s = m.synthetic
        spec = preset_spec(s.preset, seed=s.seed, blocks=s.blocks, dim=s.dim, tied_embeddings=s.tied_embeddings)
        asdict(spec)  # validated by ModelSpec.__post_init__
        return synthetic_source(spec), None
    return m.gguf, m.sha256


def run_scenario(scenario: Any, progress: Callable[[str], None] = Progress(), run_label: str | None = None,
                 log_dir: str | None = None) -> RunResult:
    """Run ``scenario`` end to end; raise a HarnessError (after destroying everything) on any failure."""
    from ppharness.modelfile import resolve_model
    from ppharness.slicing import GGUFFile

    budget = scenario.budget
    deadline = time.monotonic() + budget.total_s
    run_label = run_label or f"pp-{uuid.uuid4().hex[:8]}"

    def left(phase_s: float, what: str) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise HarnessError(f"the run's budget of {budget.total_s:g} s ran out before {what}")
        return min(phase_s, remaining)

    source, sha = model_source(scenario)
    progress(f"model: {source if not source.startswith('synthetic:') else 'synthetic ' + scenario.model.synthetic.preset}"
             " (building or fetching once, then cached)")
    model_path = str(resolve_model(source, sha))
    cfg = GGUFFile(model_path).config
    plan = make_plan(cfg.blocks, scenario.stages.count, list(scenario.stages.splits) if scenario.stages.splits else None,
                     model_id=model_path)
    n = plan.num_stages
    progress(f"model {model_path}: {cfg.blocks} blocks, dim {cfg.dim}, vocab {cfg.vocab}; "
             f"plan {plan.plan_id}: {', '.join(f'[{lo},{hi})' for lo, hi in plan.ranges)}")

    reports = [StageReport(i, lo, hi) for i, (lo, hi) in enumerate(plan.ranges)]
    transport_cls = transport_class(scenario.transport.kind)
    endpoint_opts = transport_cls.plan_endpoints(n + 1, transport_settings(scenario.transport))
    transport = transport_cls(**endpoint_opts[0])
    seed = transport.start()
    provider_cls = provider_class(scenario.provider.kind)
    provider = provider_cls(run_label, log_dir=log_dir) if log_dir else provider_cls(run_label)
    try:
        with provider:
            specs = []
            for i in range(n):
                sp = plan.stage(i, wire_dtype=scenario.transport.wire_dtype, max_context=scenario.model.max_context,
                                join_s=budget.join_s, resolve_s=budget.resolve_s)
                env = _node_env(i, n, seed, model_path, scenario.transport.kind, sp)
                if endpoint_opts[i + 1]:
                    env["PP_TRANSPORT_OPTS"] = json.dumps(endpoint_opts[i + 1])
                specs.append(provider.spec(stage_name(i), env))
            progress(f"starting {n} {scenario.provider.kind} node(s) over {scenario.transport.kind} (run {run_label})")
            provider.provision(specs)
            watch = _watchdog(provider, "starting up")

            directory = Directory(n)

            def on_join(sender: str, msg: Message) -> bool:
                _raise_on_error(msg)
                if isinstance(msg, Join):
                    directory.add(msg)
                    progress(f"stage {msg.stage} joined from {msg.address}")
                return directory.complete

            wait_for(transport.recv, on_join, left(budget.join_s, "all stages joined"),
                     f"all {n} stages to join (missing: stages {directory.missing()})", check=watch, log=progress)
            for j in directory.joins.values():
                transport.send(j.address, Members(names=directory.names))

            ready: set[int] = set()

            def on_ready(sender: str, msg: Message) -> bool:
                _raise_on_error(msg)
                if isinstance(msg, Ready):
                    ready.add(msg.stage)
                    r = reports[msg.stage]
                    r.params, r.tied_params, r.load_s, r.peak_rss_bytes = msg.params, msg.tied_params, msg.load_s, msg.rss_bytes
                    progress(f"stage {msg.stage} ready: {msg.params:,} parameters, loaded and compiled in "
                             f"{msg.load_s:.1f} s ({len(ready)}/{n})")
                return len(ready) == n

            wait_for(transport.recv, on_ready, left(budget.ready_s, "all stages were ready"),
                     "every stage to load its blocks and compile (Ready)", check=watch, log=progress)

            req = scenario.request
            request_id = uuid.uuid4().hex[:12]
            progress(f"request {request_id}: {req.max_tokens} tokens after {req.prompt!r}")
            t_req = time.monotonic()
            transport.send(directory.resolve(ENTRY), InferenceRequest(reply_to=seed, prompt=req.prompt,
                                                                      max_tokens=req.max_tokens, request_id=request_id))
            got: list[InferenceResponse] = []
            watch = _watchdog(provider, "decoding")

            def on_response(sender: str, msg: Message) -> bool:
                _raise_on_error(msg)
                if isinstance(msg, InferenceResponse) and msg.request_id == request_id:
                    got.append(msg)
                return bool(got)

            wait_for(transport.recv, on_response, left(budget.total_s, "the response arrived"),
                     "the InferenceResponse from the last stage", check=watch, log=progress)
            request_s = time.monotonic() - t_req
            _shutdown(transport, directory, reports, provider, progress)
    finally:
        transport.close()

    result = RunResult(scenario=scenario.name, run_label=run_label, plan=plan, response=got[0], request_s=request_s,
                       stages=reports, model_path=model_path)
    if scenario.expect.non_empty and not result.response.token_ids:
        raise StageError(f"stage {n - 1} (last) reported done with no text ({result.response.finish_reason})")
    if scenario.expect.match_oracle:
        from ppharness.oracle import oracle_decode

        progress("running the unsplit model in this process (the oracle)")
        result.oracle = oracle_decode(model_path, req.prompt, req.max_tokens, scenario.model.max_context)
    return result


def transport_settings(section: Any) -> dict[str, Any]:
    """The scenario's transport section less what every transport shares (kind, wire dtype)."""
    return {k: v for k, v in msgspec.structs.asdict(section).items() if k not in ("kind", "wire_dtype")}


def _node_env(i: int, n: int, seed: str, model_path: str, transport_kind: str, sp: Any) -> dict[str, str]:
    """The node contract's environment for stage ``i``."""
    return {"STAGE": str(i), "NUM_STAGES": str(n), "SEED_ADDR": seed, "MODEL": model_path, "TRANSPORT": transport_kind,
            "PLAN": msgspec.json.encode(sp).decode()}


def _raise_on_error(msg: Message) -> None:
    if isinstance(msg, Error):
        raise StageError(f"stage {msg.stage}: {msg.reason}")


def _watchdog(provider: Any, phase: str) -> Callable[[], None]:
    """A check for wait_for: any node that exited during ``phase`` fails the run, with its last log lines."""

    def check() -> None:
        for inst, rc in provider.exited():
            err = ClusterError(f"{inst.name} ({provider.kind} {inst.id}) exited with code {rc} while {phase}")
            tail = provider.logs(inst, 15).rstrip()
            if tail:
                err.add_note(f"last lines of {inst.name}:\n{tail}")
            raise err

    return check


def _shutdown(transport: Any, directory: Directory, reports: list[StageReport], provider: Any,
              progress: Callable[[str], None]) -> None:
    """Ask every node to stop, collect their Stopped reports (peak RSS) for a few seconds, wait for exits."""
    for j in directory.joins.values():
        transport.send(j.address, Shutdown(reason="run complete"))
    stopped: set[int] = set()

    def on_stopped(sender: str, msg: Message) -> bool:
        if isinstance(msg, Stopped):
            stopped.add(msg.stage)
            reports[msg.stage].peak_rss_bytes = msg.peak_rss_bytes
        return len(stopped) == len(directory.joins)

    try:
        wait_for(transport.recv, on_stopped, 10.0, "every stage to stop", log=progress)
    except ClusterError as exc:
        progress(f"warning: {exc}; destroying the rest")
    wait_exited = getattr(provider, "wait_exited", None)
    if wait_exited is not None:
        wait_exited(5.0)
