"""Observing a run from the orchestrator: each node's clock against ours, the stages' per-token spans (the trace),
their digests of the hidden states they sent, and the verdict against the unsplit model."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

from ppharness.model.decode.exactness import SplitVerdict, compare
from ppharness.trace.report import Trace, build_trace
from ppharness.trace.tracer import now_ns
from ppharness.wire.messages import (
    ClockProbe,
    ClockReply,
    DigestReport,
    DigestRequest,
    InferenceResponse,
    Message,
    TraceReport,
    TraceRequest,
)

if TYPE_CHECKING:
    from ppharness.model.decode.oracle import OracleResult
    from ppharness.run.seed.failover import Recovery
    from ppharness.run.seed.session import Session

_Report = TypeVar("_Report", TraceReport, DigestReport)  # what a stage reports for one request when asked


class Observer:
    """Asks the session's stages what they saw; ``offsets_ns`` is each node's monotonic clock minus ours (after
    ``probe_clocks``), ``recoveries`` the stages replaced so far (their digests went with the replaced node)."""

    def __init__(self, session: Session, recoveries: list[Recovery]):
        self.session, self.recoveries = session, recoveries
        self.offsets_ns: dict[int, int] = {}

    def probe_clocks(self, probes: int = 5) -> None:
        """Each node's monotonic clock minus ours, from the probe with the shortest round trip (error <= RTT/2)."""
        s = self.session
        best: dict[int, tuple[int, int]] = {}
        assert s.transport is not None, "the chain is not started"
        for _ in range(probes):
            for j in s.directory.joins.values():
                s.transport.send(j.address, ClockProbe(t_seed_ns=now_ns()))
            got: set[int] = set()

            def on_reply(sender: str, msg: Message, got: set[int] = got) -> bool:
                if isinstance(msg, ClockReply):
                    t1 = now_ns()
                    rtt, offset = t1 - msg.t_seed_ns, msg.t_node_ns - (msg.t_seed_ns + t1) // 2
                    if msg.stage not in best or rtt < best[msg.stage][0]:
                        best[msg.stage] = (rtt, offset)
                    got.add(msg.stage)
                return len(got) == len(s.directory.joins)

            s.wait(on_reply, 10.0, "clock probe replies", "probing clocks")
        # Nodes on this host share its monotonic clock: an offset within the probe's error is no offset at all.
        self.offsets_ns = {stage: off if abs(off) > rtt // 2 else 0 for stage, (rtt, off) in best.items()}

    def _ask_every_stage(
        self, ask: Message, report: type[_Report], request_id: str, what: str, phase: str
    ) -> dict[int, _Report]:
        """Send ``ask`` to every stage and gather each stage's ``report`` for ``request_id``, by stage index."""
        s = self.session
        assert s.transport is not None, "the chain is not started"
        for j in s.directory.joins.values():
            s.transport.send(j.address, ask)
        reports: dict[int, _Report] = {}

        def on_report(sender: str, msg: Message) -> bool:
            if isinstance(msg, report) and msg.request_id == request_id:
                reports[msg.stage] = msg
            return len(reports) == len(s.directory.joins)

        s.wait(on_report, 30.0, what, phase)
        return reports

    def collect_trace(self, request_id: str) -> list[TraceReport]:
        """Every stage's spans for ``request_id`` (stage order)."""
        reports = self._ask_every_stage(
            TraceRequest(request_id=request_id),
            TraceReport,
            request_id,
            "the stages' trace reports",
            "collecting the trace",
        )
        return [reports[i] for i in sorted(reports)]

    def trace_of(self, response: InferenceResponse) -> Trace:
        """The per-token trace of a request this chain served (its stages must trace)."""
        reports = self.collect_trace(response.request_id)
        return build_trace(reports, self.offsets_ns, response, self.session.plan.num_stages)

    def collect_digests(self, request_id: str) -> dict[int, list[bytes]]:
        """Every stage's digests of the hidden states it sent for ``request_id`` (ppharness.model.decode.exactness)."""
        reports = self._ask_every_stage(
            DigestRequest(request_id=request_id),
            DigestReport,
            request_id,
            "the stages' hidden-state digests",
            "collecting digests",
        )
        return {stage: r.digests for stage, r in reports.items() if stage < self.session.plan.num_stages}

    def verdict(self, response: InferenceResponse, oracle: OracleResult) -> SplitVerdict:
        """Compare a response this chain gave with the oracle's answer to the same request (run with boundaries)."""
        return self.judge(response, oracle, self.collect_digests(response.request_id))

    def judge(self, response: InferenceResponse, oracle: OracleResult, digests: dict[int, list[bytes]]) -> SplitVerdict:
        """The verdict on ``response`` from the stages' ``digests`` already collected."""
        return compare(
            response.token_ids,
            oracle.token_ids,
            self.session.plan.ranges,
            digests,
            oracle.boundary_digests,
            oracle.prompt_tokens,
            replaced=[r.stage for r in self.recoveries],
            chain_stop=response.stop_token_id,
            oracle_stop=oracle.stop_token_id,
            speculative=bool(self.session.scenario.serving.speculate),
        )
