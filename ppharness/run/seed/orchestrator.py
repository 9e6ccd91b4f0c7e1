"""Carrying a scenario out: build the model, start N nodes, wait for them, send the request, compare, tear down.

``Chain`` is the run's entry, made of four parts: the session (``ppharness.run.seed.session``: provisioning, the seed's
endpoint, the message loop and death checks, teardown), the client (``ppharness.run.seed.client``: requests, streamed
tokens, responses), failover (``ppharness.run.seed.failover``: dead stages replaced by spares) and the observer
(``ppharness.run.seed.observe``: clocks, traces, digests, the verdict). ``run_scenario`` runs one scenario end to end.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, TextIO

from ppharness.errors import StageError
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.layers import kernels
from ppharness.run.loop import ticking
from ppharness.run.seed.client import Client, Job, Served
from ppharness.run.seed.failover import Failover, Recovery
from ppharness.run.seed.observe import Observer
from ppharness.run.seed.session import Session, StageReport

if TYPE_CHECKING:
    from ppharness.model.decode.exactness import SplitVerdict
    from ppharness.model.decode.oracle import OracleResult
    from ppharness.network.nemesis import Nemesis
    from ppharness.plan.stages import Plan
    from ppharness.run.reliable import Outbox
    from ppharness.run.seed.directory import Directory
    from ppharness.scenario.schema import Scenario
    from ppharness.seams import Instance, Provider
    from ppharness.seams.settings import ProviderSettings
    from ppharness.trace.report import Trace
    from ppharness.wire.messages import InferenceResponse, TraceReport


class Progress:
    """Progress lines on stderr, stamped with seconds since the run started."""

    def __init__(self, quiet: bool = False, stream: TextIO | None = None):
        self.t0, self.quiet, self.stream = time.monotonic(), quiet, stream or sys.stderr

    def __call__(self, text: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", file=self.stream, flush=True)


@dataclass
class RunResult:
    scenario: str
    run_label: str
    plan: Plan
    response: InferenceResponse
    request_s: float  # InferenceRequest sent -> InferenceResponse received, on the orchestrator's clock
    stages: list[StageReport]
    model_path: str
    oracle: OracleResult | None = None  # when the scenario asks to match the oracle
    trace: Trace | None = None  # when tracing was on
    digests: dict[int, list[bytes]] = field(default_factory=dict)  # stage -> digests of the hidden states it sent
    verdict: SplitVerdict | None = None  # when the oracle ran
    notes: list[str] = field(default_factory=list)
    policy: str = "none"  # fault tolerance: none, retry or failover
    recoveries: list[Recovery] = field(default_factory=list)
    resends: int = 0  # messages the orchestrator sent again for want of an acknowledgement

    @property
    def decode_s(self) -> float:
        return decode_span(self.response)

    @property
    def decode_tok_s(self) -> float:
        return decode_tok_s(self.response)

    @property
    def ttft_s(self) -> float:
        """Time to first token: the request's round trip less the decode span measured on the last stage."""
        return self.request_s - self.decode_s

    @property
    def matches_oracle(self) -> bool | None:
        """True only when the tokens and every stage boundary's hidden state equal the unsplit model's."""
        return None if self.verdict is None else self.verdict.exact


def decode_span(response: InferenceResponse) -> float:
    """Seconds from the first token to the last, on the last stage's clock."""
    t = response.token_times
    return t[-1] - t[0] if len(t) > 1 else 0.0


def decode_tok_s(response: InferenceResponse) -> float:
    """Tokens per second after the first token, on the last stage's clock."""
    span = decode_span(response)
    return (len(response.token_times) - 1) / span if span > 0 else 0.0


class Chain:
    """A running N-stage chain: provisioned, joined and ready on ``__enter__``, torn down on ``__exit__``.

    ``request()`` can be called many times in between (benchmarks interleave requests across chains). Every wait is
    bounded by its phase's timeout and by the total budget; any failure destroys every node before it propagates.
    """

    def __init__(
        self,
        scenario: Scenario,
        progress: Callable[[str], None] | None = None,
        run_label: str | None = None,
        log_dir: str | None = None,
        trace: bool = False,
    ):
        self.session = session = Session(
            scenario, progress or Progress(), run_label or f"pp-{uuid.uuid4().hex[:8]}", log_dir, trace
        )
        self.client = client = Client(session)
        self.failover = failover = Failover(session, client)
        self.observer = Observer(session, failover.recoveries)
        session.screens += [failover.fence, client.refusal]  # a replaced node's word, then a busy refusal
        session.keepers.append(client.take)
        session.on_deaths = failover.on_deaths
        client.on_token = failover.token_arrived
        client.on_prompts = failover.warm

    def __enter__(self) -> Chain:
        self.session.open()  # whatever fails in it is torn down before it propagates
        try:
            if self.session.trace_on:
                self.observer.probe_clocks()
        except BaseException as exc:
            self.session.close(type(exc), exc, exc.__traceback__)
            raise
        self.session.ready = True
        self.failover.warm()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.session.close(exc_type, exc, tb)

    # --- the client and the observer --------------------------------------------------------------------------------

    def request(
        self, prompt: str, max_tokens: int, stream: bool = False, digests: bool = True, speculate: bool = True
    ) -> tuple[InferenceResponse, float]:
        """Send one request to pp-entry; return the response and its round trip in seconds (``Client.request``;
        ``stream``: its tokens come back as they are sampled, to ``client.on_stream``; ``digests``: the stages keep
        the digests ``verdict`` compares, which read every hidden state on the host; ``speculate``: drafted windows
        for it in a run that speculates)."""
        return self.client.request(prompt, max_tokens, stream, digests, speculate)

    def serve(self, jobs: list[Job]) -> list[Served]:
        """Serve an open-loop load (``Client.serve``); the results are in job order."""
        return self.client.serve(jobs)

    def trace_of(self, response: InferenceResponse) -> Trace:
        """The per-token trace of a request this chain served (its stages must trace)."""
        return self.observer.trace_of(response)

    def collect_trace(self, request_id: str) -> list[TraceReport]:
        return self.observer.collect_trace(request_id)

    def collect_digests(self, request_id: str) -> dict[int, list[bytes]]:
        return self.observer.collect_digests(request_id)

    def verdict(self, response: InferenceResponse, oracle: OracleResult) -> SplitVerdict:
        """Compare a response this chain gave with the oracle's answer to the same request (run with boundaries)."""
        return self.observer.verdict(response, oracle)

    # --- what a run kept --------------------------------------------------------------------------------------------

    @property
    def scenario(self) -> Scenario:
        return self.session.scenario

    @property
    def run_label(self) -> str:
        return self.session.run_label

    @property
    def plan(self) -> Plan:
        return self.session.plan

    @property
    def model_path(self) -> str:
        return self.session.model_path

    @property
    def reports(self) -> list[StageReport]:
        return self.session.reports

    @property
    def directory(self) -> Directory:
        return self.session.directory

    @property
    def seed(self) -> str:
        """The orchestrator's own address (the cluster's seed and every request's ``reply_to``)."""
        return self.session.seed

    @property
    def policy(self) -> str:
        return self.session.policy

    @property
    def outbox(self) -> Outbox | None:
        return self.session.outbox

    @property
    def nemesis(self) -> Nemesis | None:
        return self.session.nemesis

    @property
    def stage_instances(self) -> dict[int, Instance]:
        return self.session.stage_instances

    @property
    def instance_stages(self) -> dict[str, int]:
        return self.session.instance_stages

    @property
    def _provider(self) -> Provider[ProviderSettings | None] | None:
        return self.session.provider

    @property
    def streams(self) -> dict[str, dict[int, tuple[int, float]]]:
        return self.client.streams

    @property
    def request_started(self) -> float:
        return self.client.request_started

    @property
    def recoveries(self) -> list[Recovery]:
        return self.failover.recoveries


def run_scenario(
    scenario: Scenario,
    progress: Callable[[str], None] | None = None,
    run_label: str | None = None,
    log_dir: str | None = None,
    trace: bool = False,
    shown: Callable[[str], Callable[[list[int]], None]] | None = None,
    answered: Callable[[RunResult], None] | None = None,
) -> RunResult:
    """Run ``scenario`` end to end; raise a HarnessError (after destroying everything) on any failure.

    ``shown(model_path)``, where given, makes the function that is told the answer's token ids so far each time a
    token arrives (the request streams them). ``answered(result)`` is told the chain's answer before the oracle runs."""
    req = scenario.request
    progress = progress or Progress()
    with Chain(scenario, progress, run_label, log_dir, trace=trace) as chain:
        if shown is not None:
            chain.client.on_stream = streamed(shown(chain.model_path))
        progress(f"request: {req.max_tokens} tokens after {req.prompt!r}")
        response, request_s = chain.request(req.prompt, req.max_tokens, stream=shown is not None)
        traced = None
        if trace and chain.recoveries:
            progress("no trace for this request: the replaced stage's spans went with it")
        elif trace:
            traced = chain.trace_of(response)
        digests = chain.collect_digests(response.request_id) if scenario.expect.match_oracle else {}
    n = chain.plan.num_stages
    result = RunResult(
        scenario=scenario.name,
        run_label=chain.run_label,
        plan=chain.plan,
        response=response,
        request_s=request_s,
        stages=chain.reports,
        model_path=chain.model_path,
        trace=traced,
        digests=digests,
        policy=chain.policy,
        recoveries=chain.recoveries,
        resends=chain.outbox.resends if chain.outbox is not None else 0,
    )
    if scenario.expect.non_empty and not response.token_ids:
        raise StageError(f"stage {n - 1} (last) reported done with no text ({response.finish_reason})")
    if answered is not None:
        answered(result)
    if scenario.expect.match_oracle:
        progress(f"running the unsplit model in this process (the oracle): {req.max_tokens} tokens, compiled first")
        with ticking("running the oracle", progress):
            result.oracle = oracle_decode(
                chain.model_path,
                req.prompt,
                req.max_tokens,
                scenario.model.max_context,
                boundaries=True,
                batched=scenario.serving.batched,
            )
        result.verdict = chain.observer.judge(response, result.oracle, digests)
        pinning = kernels.active()
        if pinning is not None:  # the nodes read the same table (PPHARNESS_KERNELS travels in their environment)
            progress(f"the oracle's {pinning.summary()}")
    return result


def streamed(show: Callable[[list[int]], None]) -> Callable[[str, int, dict[int, tuple[int, float]]], None]:
    """``Client.on_stream`` for ``show``: the answer's ids from its first position on, as far as they have come
    without a gap (a token that overtook the one before it waits for it), each time that prefix grows."""
    seen: dict[str, int] = {}

    def on_stream(request_id: str, first: int, got: dict[int, tuple[int, float]]) -> None:
        n = seen.get(request_id, 0)
        while first + n in got:
            n += 1
        if n > seen.get(request_id, 0):
            seen[request_id] = n
            show([got[first + i][0] for i in range(n)])

    return on_stream
