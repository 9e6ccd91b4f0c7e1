"""Carrying a scenario out: build the model, start N nodes, wait for them, send the request, compare, tear down.

The orchestrator is the cluster's seed and the request's ``reply_to``; it is not on the token path. Every wait is
bounded by its phase's timeout and by the run's total budget (the SPEC's 300 s), and checks between polls that no node
died and no node reported an Error. The provider is a context manager, so every path out destroys every node.
"""

from __future__ import annotations

import itertools
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, TextIO, TypeVar

import msgspec

from ppharness.errors import (
    ClusterError,
    CodecError,
    HarnessError,
    PlanError,
    StageBusy,
    StageError,
    TransportTimeout,
    WaitTimedOut,
)
from ppharness.network.bridge import Bridge
from ppharness.network.clock import EventClock
from ppharness.network.nemesis import Nemesis
from ppharness.network.packet import PortTable, plan_ports, start_bridge
from ppharness.network.spec import SEED_NODE, Network, describe_network, stage_node
from ppharness.plan.compile import Compiled, compile_plan, plan_network, scenario_plan
from ppharness.plan.stages import ENTRY, EXIT, Plan, stage_name
from ppharness.registry import impaired_transport, provider_class, transport_class
from ppharness.run.cluster import Directory, wait_for
from ppharness.run.locks import RunLock
from ppharness.run.realise import Endpoints, fault_policy, gossip_name, realise, replacement, standby
from ppharness.run.reliable import Outbox, RetryPolicy, ack_of
from ppharness.trace.tracer import now_ns
from ppharness.wire.messages import (
    Ack,
    Assign,
    ClockProbe,
    ClockReply,
    DigestReport,
    DigestRequest,
    Error,
    InferenceRequest,
    InferenceResponse,
    Join,
    Members,
    Message,
    NetworkStart,
    Ready,
    Resume,
    Shutdown,
    Stopped,
    StreamedToken,
    TraceReport,
    TraceRequest,
)

if TYPE_CHECKING:
    from ppharness.model.exactness import Verdict
    from ppharness.model.oracle import OracleResult
    from ppharness.plan.doc import Device, PlanDoc
    from ppharness.run.membership import Detector
    from ppharness.scenario.schema import ClusterSection, ProviderSettings, Scenario, TransportSection
    from ppharness.seams import Instance, Provider, Transport
    from ppharness.seams.transport import JsonObject
    from ppharness.trace.report import Trace

# what a stage reports for one request when asked (``Chain._ask_every_stage``)
STREAM_PROGRESS_S = 2.0  # at most one progress line per this many seconds about the tokens streamed
BUSY_RETRY_S = 0.1  # the first wait before a request stage 0 refused as busy is sent again (then longer, up to 1 s)
_Report = TypeVar("_Report", TraceReport, DigestReport)


class Progress:
    """Progress lines on stderr, stamped with seconds since the run started."""

    def __init__(self, quiet: bool = False, stream: TextIO | None = None):
        self.t0, self.quiet, self.stream = time.monotonic(), quiet, stream or sys.stderr

    def __call__(self, text: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", file=self.stream, flush=True)


@dataclass(frozen=True)
class Job:
    """One request of an open-loop load: sent ``at_s`` seconds after the load starts, whatever is in flight."""

    prompt: str
    max_tokens: int
    at_s: float = 0.0


@dataclass
class Served:
    """What became of one ``Job`` (``Chain.serve``), on the orchestrator's monotonic clock: when it was sent, when
    each token streamed in, the response, or stage 0's refusal."""

    job: Job
    request_id: str
    sent_at: float = 0.0
    token_at: list[float] = field(default_factory=list)
    response: InferenceResponse | None = None
    refused: str = ""

    @property
    def done(self) -> bool:
        return self.response is not None or bool(self.refused)

    @property
    def ttft_s(self) -> float:
        """Time to first token: sent -> the first token streamed in."""
        return self.token_at[0] - self.sent_at

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive streamed tokens."""
        return [b - a for a, b in zip(self.token_at, self.token_at[1:])]


class _Timer:
    """Sends a load's jobs when they are due (``Chain.serve``): ticked by the wait between messages."""

    def __init__(self, due: list[Served], send: Callable[[Served], None]):
        self.pending, self.send = sorted(due, key=lambda s: s.job.at_s), send
        self.t0 = time.monotonic()

    def due_in(self) -> float | None:
        return max(0.0, self.t0 + self.pending[0].job.at_s - time.monotonic()) if self.pending else None

    def tick(self) -> None:
        while self.pending and self.t0 + self.pending[0].job.at_s <= time.monotonic():
            self.send(self.pending.pop(0))


@dataclass
class StageReport:
    index: int
    lo: int
    hi: int
    params: int = 0
    tied_params: int = 0
    load_s: float = 0.0
    peak_rss_bytes: int = 0
    device_bytes: int = 0


@dataclass
class Recovery:
    """One dead stage replaced by a spare (policy failover), on the orchestrator's monotonic clock: when the death
    was detected, when the spare had loaded its blocks (Ready), and when the next token reached the client."""

    stage: int
    cause: str
    spare: str  # the device id
    epoch: int
    detected_at: float
    ready_at: float = 0.0
    load_s: float = 0.0  # the spare's own report: loading and compiling its blocks
    next_token_at: float | None = None  # None: no token came after it (the request had finished)

    @property
    def reload_s(self) -> float:
        """Detection to the spare's Ready: starting it, loading, compiling."""
        return self.ready_at - self.detected_at

    @property
    def replay_s(self) -> float | None:
        """The spare's Ready to the next token at the client: the replay and the token's way round (None: no token
        came after it)."""
        return self.next_token_at - self.ready_at if self.next_token_at is not None else None


@dataclass
class Standby:
    """A spare device's standby node: its instance, and its address once it joined as a spare."""

    instance: Instance
    address: str = ""


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
    verdict: Verdict | None = None  # when the oracle ran
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


def model_source(scenario: Scenario) -> tuple[str, str | None]:
    """The scenario's model as a source string for ``resolve_model`` (and its sha256)."""
    from ppharness.model.files import preset_spec, synthetic_source

    m = scenario.model
    if m.synthetic is not None:
        s = m.synthetic
        spec = preset_spec(
            s.preset, seed=s.seed, blocks=s.blocks, dim=s.dim, tied_embeddings=s.tied_embeddings, type=s.type
        )
        return synthetic_source(spec), None
    assert m.gguf is not None  # a model section has exactly one of synthetic and gguf
    return m.gguf, m.sha256


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
        self.scenario, self.log_dir, self.trace_on = scenario, log_dir, trace
        self.progress: Callable[[str], None] = progress or Progress()
        self.run_label = run_label or f"pp-{uuid.uuid4().hex[:8]}"
        self.deadline = time.monotonic() + scenario.budget.total_s
        self.offsets_ns: dict[int, int] = {}
        self._provider: Provider[ProviderSettings | None] | None = None
        self._lock: RunLock | None = None
        self.transport: Transport | None = None
        self.detector: Detector | None = None
        self.clock = EventClock()  # the network's timed events count from the request (NetworkStart)
        self.nemesis: Nemesis | None = None
        self.ports: PortTable = {}  # the packet layer's ports: node -> (QUIC port, virtual port)
        self.bridge: Bridge | None = None  # the packet layer's bridge of this endpoint
        self.bridge_dir: str | None = None  # where the bridges' Unix sockets live
        self.network: Network | None = None  # the scenario's network with the plan's links
        # fault tolerance (ppharness.run.reliable): the run's policy, the membership epoch, the spares left, the
        # addresses and instances of replaced nodes, what each request streamed, and the recoveries so far
        self.policy = "none"
        self.epoch = 0
        self.spares: list[Device] = []
        self.spare_opts: dict[str, JsonObject] = {}  # spare device -> its endpoint's transport options
        self.standbys: dict[str, Standby] = {}  # spare device -> its standby node
        self.stage_instances: dict[int, Instance] = {}  # stage -> the instance serving it now
        self.instance_stages: dict[str, int] = {}  # instance id -> the stage it serves or served
        self.fenced: set[str] = set()
        self.retired: set[str] = set()  # instance ids
        self.streams: dict[str, dict[int, tuple[int, float]]] = {}  # request -> position -> (token, arrival)
        self.responses: dict[str, InferenceResponse] = {}
        self.loads: dict[str, Served] = {}  # the requests of ``serve`` in progress
        self.recoveries: list[Recovery] = []
        self.active: InferenceRequest | None = None
        self.request_started = 0.0
        self.ready = False
        self.outbox: Outbox | None = None
        self._replacing = False
        self._replacing_id = ""
        self._waiting = False  # inside a wait (a failover waits within the request's wait)
        self._fenced_seen: set[str] = set()
        self._streamed_said = time.monotonic()

    def _left(self, phase_s: float, what: str) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise HarnessError(f"the run's budget of {self.scenario.budget.total_s:g} s ran out before {what}")
        return min(phase_s, remaining)

    def _wait(
        self,
        on_message: Callable[[str, Message], bool],
        phase_s: float,
        what: str,
        phase: str,
        done: Callable[[], bool] = lambda: False,
        timer: _Timer | None = None,
    ) -> None:
        """Pump messages into ``on_message`` until it returns True or ``done()``; ``timer`` is ticked between
        messages, when it is due (an open-loop load's arrivals)."""
        assert self._provider is not None and self.transport is not None, "the chain is not started"

        def handle(sender: str, msg: Message) -> bool:
            if sender in self.fenced:  # a replaced node that came back: nothing it says counts
                self._fenced_note(sender, msg)
                return False
            if isinstance(msg, Error) and msg.busy and msg.request_id in self.loads:
                self.loads[msg.request_id].refused = msg.reason  # a refusal ends that request, not the run
                return on_message(sender, msg)
            _raise_on_error(msg)
            if self.detector is not None and self.detector.on_message(msg):
                return False
            self._take(sender, msg)
            return on_message(sender, msg)

        def check() -> None:
            if timer is not None:
                timer.tick()
            if self.nemesis is not None:
                self.nemesis.tick()
            if self.outbox is not None:
                self.outbox.tick()
            deaths = _deaths(self._provider, self.detector, self.retired, self) if self._provider else []
            for d in [d for d in deaths if d.stage < 0 and d.instance is not None]:
                if d.instance is not None and d.instance.id == self._replacing_id:
                    raise _SpareLost(d)
                self._standby_lost(d)
            deaths = [d for d in deaths if d.stage >= 0]
            if not deaths:
                return
            if self.policy == "failover" and self.ready and not self._replacing:
                for death in deaths:
                    self._failover(death, phase)
                return
            if self._replacing:  # another death while a spare comes up waits for it, unless it is that spare's
                mine = [d for d in deaths if d.instance is not None and d.instance.id == self._replacing_id]
                if mine:
                    raise _SpareLost(mine[0])
                return
            self._drain(handle)  # a node's own Error, sent before it went, says more than its death
            raise self._death_error(deaths[0], phase)

        def poll_s() -> float:
            """At most 0.2 s, less when a resend or a network event is due sooner."""
            dues = [d for d in (self.outbox, self.nemesis, timer) if d is not None]
            return min([0.2] + [max(t, 0.001) for t in (d.due_in() for d in dues) if t is not None])

        outermost = not self._waiting
        if outermost and self.detector is not None:
            self.detector.listen()
        self._waiting = True
        try:
            wait_for(
                self.transport.recv,
                handle,
                self._left(phase_s, what),
                what,
                check=check,
                log=self.progress,
                done=done,
                poll_s=poll_s,
            )
        finally:
            if outermost:
                self._waiting = False
                if self.detector is not None:
                    self.detector.deaf()

    def _take(self, sender: str, msg: Message) -> None:
        """What the orchestrator keeps whatever it is waiting for: acknowledgements, streamed tokens, responses."""
        match msg:
            case Ack() if self.outbox is not None:
                self.outbox.ack(sender, msg)
            case StreamedToken():
                self._ack(sender, "stream", msg.request_id, msg.position)
                got = self.streams.setdefault(msg.request_id, {})
                if msg.position not in got:
                    got[msg.position] = (msg.token_id, time.monotonic())
                    if time.monotonic() - self._streamed_said >= STREAM_PROGRESS_S:
                        self._streamed_said = time.monotonic()
                        self.progress(f"decoding: {len(got)} token(s) streamed so far")
                    for r in self.recoveries:
                        if r.next_token_at is None and r.ready_at:
                            r.next_token_at = time.monotonic()
            case InferenceResponse():
                self._ack(sender, "response", msg.request_id, -1)
                self.responses.setdefault(msg.request_id, msg)
            case Join(stage=-1, names=[name]) if msg.address == sender:
                sb = self.standbys.get(name.removeprefix("spare:"))
                if sb is not None and not sb.address:
                    sb.address = sender
                    self.progress(f"spare {name.removeprefix('spare:')} standing by")

    def _ack(self, to: str, kind: str, request_id: str, position: int) -> None:
        if self.policy != "none" and self.transport is not None:
            try:
                self.transport.send(to, ack_of(kind, request_id, position, self.plan.plan_id))
            except HarnessError as exc:  # the stage sends it again; that copy is acknowledged again
                self.progress(f"warning: acknowledging {kind} {position} to {to[:60]} failed: {exc}")

    def _standby_lost(self, death: Death) -> None:
        """A standby spare exited before it was needed: its device is started afresh if a stage dies."""
        assert death.instance is not None
        self.retired.add(death.instance.id)
        for device, sb in list(self.standbys.items()):
            if sb.instance.id == death.instance.id:
                del self.standbys[device]
                self.progress(f"warning: the standby on spare {device} {death.cause}; it is started afresh if needed")

    def _fenced_note(self, sender: str, msg: Message) -> None:
        key = f"{sender}|{type(msg).__name__}"
        if key not in self._fenced_seen:
            self._fenced_seen.add(key)
            self.progress(f"fenced off a {type(msg).__name__} from a replaced node ({sender[:60]})")

    def _death_error(self, death: Death, phase: str) -> ClusterError:
        assert self._provider is not None
        err = ClusterError(death.describe(self._provider.kind, phase))
        inst = death.instance
        tail = self._provider.logs(inst, 15).rstrip() if inst is not None else ""
        if inst is not None and tail:
            err.add_note(f"last lines of {inst.name}:\n{tail}")
        return err

    def _drain(self, handle: Callable[[str, Message], bool], limit: int = 100) -> None:
        """Hand what has already arrived to ``handle`` (which raises on an Error), without waiting for more."""
        assert self.transport is not None, "the chain is not started"
        for _ in range(limit):
            try:
                sender, msg = self.transport.recv(0.05)
            except TransportTimeout:
                return
            except CodecError:
                continue
            handle(sender, msg)

    def __enter__(self) -> Chain:
        from ppharness.model.files import resolve_model

        sc, progress = self.scenario, self.progress
        self._lock = RunLock(self.run_label).acquire()  # a label a live run holds is refused before anything exists
        try:  # from here on, whatever fails releases the lock and closes what was opened
            plan_doc: PlanDoc | None = None
            if sc.plan is not None:
                from ppharness.plan.doc import load_plan

                plan_doc = load_plan(sc.plan)  # read once: its model is what the run resolves
                source, sha = plan_doc.model.source, None
            else:
                source, sha = model_source(sc)
            self.model_source = source
            synthetic = sc.model.synthetic
            shown = (
                source
                if not source.startswith("synthetic:") or synthetic is None or sc.plan is not None
                else "synthetic " + synthetic.preset
            )
            progress(f"model: {shown} (building or fetching once, then cached)")
            self.model_path = str(resolve_model(source, sha))
            self.plan_doc, self.compiled = realise_plan(sc, source, self.model_path, plan_doc)
            self.plan = plan = self.compiled.runtime
            graph = self.plan_doc.model
            progress(
                f"model {self.model_path}: {len(graph.blocks)} blocks, dim {graph.dim}, vocab {graph.vocab}; "
                f"plan {plan.plan_id} ({self.plan_doc.placement.policy or 'hand-written'}): "
                + ", ".join(
                    f"{d.id} [{lo},{hi})" for d, (lo, hi) in zip(self.compiled.devices, plan.ranges, strict=True)
                )
            )
            n = self.compiled.members  # the loop's stages, then the expert nodes
            self.reports = [StageReport(i, lo, hi) for i, (lo, hi) in enumerate(plan.ranges)]
            self.reports += [StageReport(i, 0, 0) for i in range(plan.num_stages, n)]
            if self.compiled.expert_nodes and self.policy == "failover":
                raise PlanError(
                    f"plan {plan.plan_id}: fault_tolerance failover does not replace expert nodes yet — run this plan "
                    "with policy none or retry"
                )
            provider_cls = provider_class(sc.provider.kind)
            settings: ProviderSettings | None = getattr(sc.provider, sc.provider.kind, None)
            self._provider = provider_cls(self.run_label, settings, log_dir=self.log_dir)
            self.node_model = self._provider.node_model(self.model_source, self.model_path)
            self.policy = fault_policy(sc, self.compiled)
            placement = self.plan_doc.placement
            if self.policy == "failover":
                if sc.serving.slots > 1:
                    raise PlanError(
                        f"fault_tolerance failover replays one request at a time; this run serves {sc.serving.slots} "
                        "at once (serving.slots) — use policy retry, or serving.slots: 1"
                    )
                self.spares = [self.plan_doc.cluster.device(d) for d in placement.spares]
            transport_cls = transport_class(sc.transport.kind)
            # the spares are members from the start: their keys are among those every endpoint admits
            endpoint_opts = transport_cls.plan_endpoints(n + 1 + len(self.spares), transport_settings(sc.transport))
            self.spare_opts = {d.id: o for d, o in zip(self.spares, endpoint_opts[n + 1 :], strict=True)}
            endpoint_opts = endpoint_opts[: n + 1]
            seed_opts = endpoint_opts[0] | self._provider.seed_transport_options(sc.transport.kind)
            self.network = network = plan_network(self.compiled, sc.network)
            if network is not None and network.layer == "packet":
                # every endpoint reaches the others through the bridges alone, the seed included (on loopback)
                seed_opts = dict(endpoint_opts[0])
                self.ports = plan_ports([SEED_NODE] + [stage_node(i) for i in range(n)])
                self.bridge_dir = tempfile.mkdtemp(prefix=f"ppharness-{self.run_label}-net-")
                self.bridge, extra = start_bridge(network, SEED_NODE, self.ports, self.bridge_dir, self.clock)
                seed_opts |= extra
            self.transport = transport_cls(**seed_opts)
            if network is not None:
                if network.layer == "message":
                    self.transport = impaired_transport(self.transport, network, SEED_NODE, self.clock)
                self.nemesis = Nemesis(network, self._provider, self.clock, progress, self._instance_of_node)
                progress(f"network emulation ({network.layer} level): {describe_network(network)}")
            self.seed = self.transport.start()
            if self.policy != "none":
                retry = RetryPolicy(
                    first_s=sc.fault_tolerance.ack_timeout_s,
                    max_s=sc.fault_tolerance.retry_max_s,
                    budget_s=sc.budget.total_s,
                )
                self.outbox = Outbox(self.transport.send, self._address_of, retry)
                progress(
                    f"fault tolerance: {self.policy}"
                    + (f", {len(self.spares)} spare(s): {', '.join(d.id for d in self.spares)}" if self.spares else "")
                )
            self.detector = _make_detector(sc.cluster, self._provider, n, self.run_label, bool(self.ports))
            progress(f"membership: {self.detector.name}")
            self._provider.__enter__()
            self._start(endpoint_opts)
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    def _start(self, endpoint_opts: list[JsonObject]) -> None:
        sc, progress, n = self.scenario, self.progress, self.compiled.members
        provider, transport, detector = self._provider, self.transport, self.detector
        assert provider is not None and transport is not None and detector is not None, "the chain is not started"
        budget = sc.budget
        self.endpoints = endpoints = Endpoints(
            seed=self.seed,
            node_model=self.node_model,
            transport_opts=endpoint_opts[1:],
            membership_env=detector.node_env(),
            network=self.network,
            ports=self.ports,
            bridge_dir=self.bridge_dir or "",
        )
        specs = [
            provider.spec(r.name, r.env, **r.options) for r in realise(sc, self.compiled, endpoints, self.trace_on)
        ]
        spares = [standby(sc, endpoints, d, self.spare_opts[d.id], k) for k, d in enumerate(self.spares)]
        specs += [provider.spec(r.name, r.env, **r.options) for r in spares]
        progress(
            f"starting {n} {sc.provider.kind} node(s) over {sc.transport.kind} (run {self.run_label})"
            + (f", and {len(spares)} standby spare(s)" if spares else "")
        )
        started = provider.provision(specs)
        self.stage_instances = {i: inst for i, inst in enumerate(started[:n])}
        self.instance_stages = {inst.id: i for i, inst in enumerate(started[:n])}
        for d, inst in zip(self.spares, started[n:], strict=True):
            self.standbys[d.id] = Standby(inst)

        self.directory = directory = Directory(self.plan.num_stages, len(self.compiled.expert_nodes))

        def on_join(sender: str, msg: Message) -> bool:
            if isinstance(msg, Join) and msg.stage < 0:  # a standby spare (_take)
                pass
            elif isinstance(msg, Join) and msg.address != sender:
                progress(
                    f"warning: ignored a Join of stage {msg.stage} from {sender[:120]} naming another address "
                    f"({msg.address[:120]})"
                )
            elif isinstance(msg, Join):
                directory.add(msg)
                detector.watch([msg.stage])
                progress(f"stage {msg.stage} joined from {msg.address}")
            return directory.complete

        try:
            self._wait(on_join, budget.join_s, f"all {n} nodes to join", "starting up")
        except WaitTimedOut as exc:
            raise self._with_logs(
                ClusterError(
                    f"the cluster never converged: stage(s) {directory.missing()} did "
                    f"not join within {budget.join_s:g} s"
                ),
                directory.missing(),
            ) from exc
        for i in range(self.plan.num_stages):  # every stage's names, resolved (bounded) before anything is sent
            self.resolve(stage_name(i), budget.resolve_s)
        self.resolve(ENTRY, budget.resolve_s)
        self.resolve(EXIT, budget.resolve_s)
        for j in directory.joins.values():
            transport.send(j.address, Members(names=directory.names))

        ready: set[int] = set()

        def on_ready(sender: str, msg: Message) -> bool:
            if isinstance(msg, Ready):
                ready.add(msg.stage)
                r = self.reports[msg.stage]
                r.params, r.tied_params, r.load_s, r.peak_rss_bytes = (
                    msg.params,
                    msg.tied_params,
                    msg.load_s,
                    msg.rss_bytes,
                )
                progress(
                    f"stage {msg.stage} ready: {msg.params:,} parameters, loaded and compiled in "
                    f"{msg.load_s:.1f} s ({len(ready)}/{n})"
                )
            return len(ready) == n

        try:
            self._wait(on_ready, budget.ready_s, "every stage to load its blocks and compile (Ready)", "starting up")
        except WaitTimedOut as exc:
            missing = [i for i in range(n) if i not in ready]
            raise self._with_logs(
                ClusterError(
                    f"stage(s) {missing} never reported ready within {budget.ready_s:g} s "
                    "(loading the model and compiling)"
                ),
                missing,
            ) from exc
        if self.trace_on:
            self._probe_clocks()
        self.ready = True

    def _send_members(self, address: str, members: Members) -> None:
        """A newer directory, resent until the node acknowledges it (failover is a reliable policy): a node that
        missed it would go on talking to the replaced one."""
        assert self.outbox is not None
        self.outbox.put(("members", address, members.epoch), address, members)

    def _instance_of_node(self, node: str) -> Instance | None:
        """The instance that is the network emulation's ``stage-<i>`` now."""
        tail = node.removeprefix("stage-")
        return self.stage_instances.get(int(tail)) if tail.isdigit() else None

    def _address_of(self, role: str) -> str | None:
        """Where the orchestrator's reliable messages go: ``entry`` is stage 0, whichever node that is now."""
        return self.directory.names.get(ENTRY) if role == "entry" else role

    def _failover(self, death: Death, phase: str) -> None:
        """Replace the dead ``death.stage`` by the first spare device: start it in a new epoch, wait for its Join and
        Ready, hand every node the new directory (the dead node's address is fenced off), and resume the request in
        progress where the replaced stage was stage 0 (the others replay to their new neighbour themselves)."""
        assert self._provider is not None and self.transport is not None and self.detector is not None
        stage, progress = death.stage, self.progress
        detected = time.monotonic()
        if not self.spares:
            raise _no_spare(self._death_error(death, phase), len(self.recoveries))
        spare = self.spares.pop(0)
        self.epoch += 1
        epoch = self.epoch
        old = self.directory.joins[stage].address
        self.fenced.add(old)
        if death.instance is not None:
            self.retired.add(death.instance.id)
        self.detector.forget(stage)  # declared dead once; the spare is watched from its Join
        progress(
            f"failover: {stage_name(stage)} {death.cause} while {phase}; spare {spare.id} takes blocks "
            f"{list(self.plan.ranges[stage])} (epoch {epoch})"
        )
        recovery = Recovery(stage=stage, cause=death.cause, spare=spare.id, epoch=epoch, detected_at=detected)
        node = replacement(
            self.scenario, self.compiled, self.endpoints, stage, spare, epoch, self.spare_opts[spare.id], self.trace_on
        )
        sb = self.standbys.pop(spare.id, None)
        self._replacing = True
        try:
            if sb is not None and sb.address:  # the standby takes the stage's program
                assert node.program is not None
                program = msgspec.json.encode(node.program).decode()
                self.transport.send(sb.address, Assign(program=program, gossip_name=node.env.get("PP_GOSSIP_NAME", "")))
                inst = sb.instance
            else:  # no standby ready: the spare device gets a node of its own now
                if sb is not None:
                    self.retired.add(sb.instance.id)
                    self._provider.destroy(sb.instance)
                name = f"pp-spare-{self.plan_doc.placement.spares.index(spare.id)}"  # a name no other node had
                spec = self._provider.spec(name, node.env, **node.options)
                (inst,) = self._provider.provision([spec])
            self._replacing_id = inst.id
            self.stage_instances[stage], self.instance_stages[inst.id] = inst, stage
            joined: list[Join] = []

            def on_join(sender: str, msg: Message) -> bool:
                if isinstance(msg, Join) and msg.stage == stage and msg.address == sender and sender not in self.fenced:
                    joined.append(msg)
                return bool(joined)

            budget = self.scenario.budget
            self._wait(on_join, budget.join_s, f"the spare for {stage_name(stage)} to join", "replacing a stage")
            self.directory.replace(joined[0])
            self.detector.replace(stage, gossip_name(stage, epoch))  # watched from its Join on, as at the start
            members = Members(names=self.directory.names, epoch=epoch)
            self._send_members(joined[0].address, members)
            ready: list[Ready] = []

            def on_ready(sender: str, msg: Message) -> bool:
                if isinstance(msg, Ready) and sender == joined[0].address:
                    ready.append(msg)
                return bool(ready)

            what = f"the spare for {stage_name(stage)} to load (Ready)"
            self._wait(on_ready, budget.ready_s, what, "replacing a stage")
        except _SpareLost as lost:  # the next spare, if any, replaces the one that died coming up
            self._replacing, self._replacing_id = False, ""
            progress(f"failover: the spare {spare.id} for {stage_name(stage)} {lost.death.cause} before it was ready")
            return self._failover(lost.death, "replacing a stage")
        finally:
            self._replacing, self._replacing_id = False, ""
        recovery.ready_at, recovery.load_s = time.monotonic(), ready[0].load_s
        self.reports[stage].load_s = ready[0].load_s
        for j in self.directory.joins.values():
            if j.stage != stage:
                self._send_members(j.address, members)
        if self.outbox is not None:
            self.outbox.redirect()
        self.recoveries.append(recovery)
        progress(
            f"failover: {stage_name(stage)} is back on {spare.id} after {recovery.reload_s:.2f} s "
            f"(loading {recovery.load_s:.2f} s); {len(self.spares)} spare(s) left"
        )
        active = self.active
        if stage == 0 and active is not None and active.request_id not in self.responses:
            got = self.streams.get(active.request_id, {})
            tokens = [got[p][0] for p in sorted(got)]
            resume = Resume(request=active, tokens=tokens, plan_id=self.plan.plan_id, epoch=epoch)
            assert self.outbox is not None  # failover is a reliable policy
            self.outbox.put(("resume", active.request_id, -1), "entry", resume)

    def _with_logs(self, err: HarnessError, stages: list[int]) -> HarnessError:
        """``err`` with the last log lines of each of ``stages``' instances attached as notes."""
        assert self._provider is not None, "the chain is not started"
        for inst in self._provider.instances:
            if any(inst.name == stage_name(s) for s in stages):
                tail = self._provider.logs(inst, 15).rstrip()
                if tail:
                    err.add_note(f"last lines of {inst.name}:\n{tail}")
        return err

    def resolve(self, name: str, timeout: float) -> str:
        """The address registered under ``name``, waiting (bounded) for a Join that registers it."""
        if name in self.directory.names:
            return self.directory.names[name]

        def on_join(sender: str, msg: Message) -> bool:
            if isinstance(msg, Join) and msg.stage >= 0:
                self.directory.add(msg)
            return name in self.directory.names

        try:
            self._wait(on_join, timeout, f"the name {name!r} to be registered", "resolving names")
        except WaitTimedOut as exc:
            raise ClusterError(
                f"the name {name!r} never resolved within {timeout:g} s; registered: "
                f"{', '.join(sorted(self.directory.names)) or 'none'}"
            ) from exc
        return self.directory.names[name]

    def _probe_clocks(self, probes: int = 5) -> None:
        """Each node's monotonic clock minus ours, from the probe with the shortest round trip (error <= RTT/2)."""
        best: dict[int, tuple[int, int]] = {}
        assert self.transport is not None, "the chain is not started"
        for _ in range(probes):
            for j in self.directory.joins.values():
                self.transport.send(j.address, ClockProbe(t_seed_ns=now_ns()))
            got: set[int] = set()

            def on_reply(sender: str, msg: Message, got: set[int] = got) -> bool:
                if isinstance(msg, ClockReply):
                    t1 = now_ns()
                    rtt, offset = t1 - msg.t_seed_ns, msg.t_node_ns - (msg.t_seed_ns + t1) // 2
                    if msg.stage not in best or rtt < best[msg.stage][0]:
                        best[msg.stage] = (rtt, offset)
                    got.add(msg.stage)
                return len(got) == len(self.directory.joins)

            self._wait(on_reply, 10.0, "clock probe replies", "probing clocks")
        # Nodes on this host share its monotonic clock: an offset within the probe's error is no offset at all.
        self.offsets_ns = {stage: off if abs(off) > rtt // 2 else 0 for stage, (rtt, off) in best.items()}

    def request(self, prompt: str, max_tokens: int) -> tuple[InferenceResponse, float]:
        """Send one request to pp-entry; return the response and its round trip in seconds on our clock.

        A request sent right after another may find stage 0 still waiting for that one's last token (over a slow
        link it arrives after the response reached us): stage 0 refuses it as busy, and it is sent again, within the
        run's budget."""
        for attempt in itertools.count():
            try:
                return self._request_once(prompt, max_tokens)
            except StageBusy:
                time.sleep(self._left(min(BUSY_RETRY_S * (attempt + 1), 1.0), "stage 0 was free for the request"))
        raise AssertionError("unreachable")

    def _request_once(self, prompt: str, max_tokens: int) -> tuple[InferenceResponse, float]:
        request_id = uuid.uuid4().hex[:12]
        assert self.transport is not None, "the chain is not started"
        self.request_started = time.monotonic()  # what the network's event times count from, on this clock
        if self.nemesis is not None:  # the network's events count from here, in every process of the run
            t0_unix_ns = time.time_ns()
            self.clock.start(t0_unix_ns)
            for j in self.directory.joins.values():
                self.transport.send(j.address, NetworkStart(t0_unix_ns=t0_unix_ns))
        t0 = time.monotonic()
        request = InferenceRequest(reply_to=self.seed, prompt=prompt, max_tokens=max_tokens, request_id=request_id)
        self.active = request
        try:
            if self.outbox is not None:  # resent until stage 0 acknowledges it
                self.outbox.put(("request", request_id, -1), "entry", request)
            else:
                self.transport.send(self.directory.resolve(ENTRY), request)
            self._wait(
                lambda sender, msg: request_id in self.responses,
                self.scenario.budget.total_s,
                "the InferenceResponse from the last stage",
                "decoding",
                done=lambda: request_id in self.responses,
            )
        except WaitTimedOut as exc:
            network = self.network
            if self.policy == "none" and network is not None and (network.loses or network.events):
                exc.add_note(
                    "the scenario's network loses or cuts off messages, and this run does not retry them: "
                    "one lost activation or token ends the run — fault_tolerance: {policy: retry} resends them"
                )
            raise
        finally:
            self.active = None
            if self.outbox is not None:
                self.outbox.drop(lambda key, role: key[1] != request_id)
        return self.responses.pop(request_id), time.monotonic() - t0

    def serve(self, jobs: list[Job]) -> list[Served]:
        """Send every job at its time, whatever is in flight (an open loop: arrivals do not wait for answers), and
        wait for every answer or refusal. Tokens stream back as they are sampled; the results are in job order."""
        transport = self.transport
        assert transport is not None, "the chain is not started"
        served = [Served(job, uuid.uuid4().hex[:12]) for job in jobs]
        self.loads = {s.request_id: s for s in served}
        entry = self.directory.resolve(ENTRY)

        def send(s: Served) -> None:
            s.sent_at = time.monotonic()
            request = InferenceRequest(
                reply_to=self.seed,
                prompt=s.job.prompt,
                max_tokens=s.job.max_tokens,
                request_id=s.request_id,
                stream=True,
            )
            if self.outbox is not None:
                self.outbox.put(("request", s.request_id, -1), "entry", request)
            else:
                transport.send(entry, request)

        def on_message(sender: str, msg: Message) -> bool:
            s = self.loads.get(getattr(msg, "request_id", ""))
            if s is not None and s.response is None and s.request_id in self.responses:
                s.response = self.responses.pop(s.request_id)
                s.token_at = [t for _, (_, t) in sorted(self.streams.get(s.request_id, {}).items())]
            return all(x.done for x in served)

        try:
            self._wait(
                on_message,
                self.scenario.budget.total_s,
                f"the answers to {len(jobs)} request(s)",
                "serving",
                done=lambda: all(x.done for x in served),
                timer=_Timer(served, send),
            )
        finally:
            for s in served:
                self.streams.pop(s.request_id, None)
            self.loads = {}
            if self.outbox is not None:
                ids = {s.request_id for s in served}
                self.outbox.drop(lambda key, role: key[1] not in ids)
        return served

    def trace_of(self, response: InferenceResponse) -> Trace:
        """The per-token trace of a request this chain served (its stages must trace)."""
        from ppharness.trace.report import build_trace

        return build_trace(self.collect_trace(response.request_id), self.offsets_ns, response, self.plan.num_stages)

    def _ask_every_stage(
        self, ask: Message, report: type[_Report], request_id: str, what: str, phase: str
    ) -> dict[int, _Report]:
        """Send ``ask`` to every stage and gather each stage's ``report`` for ``request_id``, by stage index."""
        assert self.transport is not None, "the chain is not started"
        for j in self.directory.joins.values():
            self.transport.send(j.address, ask)
        reports: dict[int, _Report] = {}

        def on_report(sender: str, msg: Message) -> bool:
            if isinstance(msg, report) and msg.request_id == request_id:
                reports[msg.stage] = msg
            return len(reports) == len(self.directory.joins)

        self._wait(on_report, 30.0, what, phase)
        return reports

    def collect_digests(self, request_id: str) -> dict[int, list[bytes]]:
        """Every stage's digests of the hidden states it sent for ``request_id`` (ppharness.model.exactness)."""
        reports = self._ask_every_stage(
            DigestRequest(request_id=request_id),
            DigestReport,
            request_id,
            "the stages' hidden-state digests",
            "collecting digests",
        )
        return {stage: r.digests for stage, r in reports.items() if stage < self.plan.num_stages}

    def verdict(self, response: InferenceResponse, oracle: OracleResult) -> Verdict:
        """Compare a response this chain gave with the oracle's answer to the same request (run with boundaries)."""
        from ppharness.model.exactness import compare

        return compare(
            response.token_ids,
            oracle.token_ids,
            self.plan.ranges,
            self.collect_digests(response.request_id),
            oracle.boundary_digests,
            oracle.prompt_tokens,
            replaced=[r.stage for r in self.recoveries],
        )

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

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        destroyed = False
        if self.nemesis is not None:
            try:
                self.nemesis.heal()  # a paused node cannot shut down
            except HarnessError as heal_error:
                self.progress(f"warning: resuming paused nodes failed: {heal_error}")
        try:
            if exc_type is None and self._provider is not None and self.transport is not None:
                for sb in self.standbys.values():  # unused standbys exit without a report
                    if sb.address:
                        self.transport.send(sb.address, Shutdown(reason="run complete"))
                _shutdown(self.transport, self.directory, self.reports, self._provider, self.progress)
        finally:
            try:
                if self.detector is not None:
                    self.detector.close()
                if self._provider is not None:
                    self._provider.__exit__(exc_type, exc, tb)
                    self._provider = None
                destroyed = True
            finally:
                try:
                    if self.transport is not None:
                        self.transport.close()
                    if self.bridge is not None:
                        self.bridge.close()
                    if self.bridge_dir is not None:
                        shutil.rmtree(self.bridge_dir, ignore_errors=True)
                finally:
                    if self._lock is not None:
                        # everything gone: forget the run; otherwise it stays registered, dead, for `ppharness reap`
                        self._lock.release() if destroyed else self._lock.abandon()
                        self._lock = None


def run_scenario(
    scenario: Scenario,
    progress: Callable[[str], None] | None = None,
    run_label: str | None = None,
    log_dir: str | None = None,
    trace: bool = False,
) -> RunResult:
    """Run ``scenario`` end to end; raise a HarnessError (after destroying everything) on any failure."""
    req = scenario.request
    progress = progress or Progress()
    with Chain(scenario, progress, run_label, log_dir, trace=trace) as chain:
        progress(f"request: {req.max_tokens} tokens after {req.prompt!r}")
        response, request_s = chain.request(req.prompt, req.max_tokens)
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
    if scenario.expect.match_oracle:
        from ppharness.model.exactness import compare
        from ppharness.model.oracle import oracle_decode

        progress("running the unsplit model in this process (the oracle)")
        result.oracle = oracle_decode(
            chain.model_path, req.prompt, req.max_tokens, scenario.model.max_context, boundaries=True
        )
        result.verdict = compare(
            response.token_ids,
            result.oracle.token_ids,
            chain.plan.ranges,
            digests,
            result.oracle.boundary_digests,
            result.oracle.prompt_tokens,
            replaced=[r.stage for r in chain.recoveries],
        )
    return result


def realise_plan(
    scenario: Scenario, source: str, model_path: str, plan_doc: PlanDoc | None = None
) -> tuple[PlanDoc, Compiled]:
    """The plan a run of ``scenario`` realises, compiled: its plan file (``plan_doc`` when already read; checked
    against the model file the run resolved), else the chain its stages section describes."""
    from ppharness.plan.compile import check_model
    from ppharness.plan.doc import load_plan
    from ppharness.plan.graph import file_sha256, model_graph

    if scenario.plan is not None:
        doc = plan_doc if plan_doc is not None else load_plan(scenario.plan)
        check_model(doc, file_sha256(model_path), model_path, scenario.plan)
    else:
        graph = model_graph(model_path, source, scenario.model.max_context, scenario.transport.wire_dtype, digest=False)
        st = scenario.stages
        doc = scenario_plan(
            graph,
            st.num_stages,
            list(st.splits) if st.splits else None,
            scenario.provider.kind,
            scenario.fault_tolerance.spares,
            requests=scenario.serving.slots,
        )
    slots, counted = scenario.serving.slots, doc.placement.objective.requests
    if slots > counted:
        raise PlanError(
            f"{scenario.plan}: $.placement.objective.requests: the plan counts the KV cache of {counted} request(s) "
            f"per stage, the scenario serves {slots} at once (serving.slots) — make the plan with --requests {slots} "
            "or lower serving.slots"
        )
    return doc, compile_plan(doc)


def transport_settings(section: TransportSection) -> JsonObject:
    """The scenario's transport section less what every transport shares (kind, wire dtype)."""
    return {k: v for k, v in msgspec.structs.asdict(section).items() if k not in ("kind", "wire_dtype")}


def _raise_on_error(msg: Message) -> None:
    if isinstance(msg, Error):
        raise (StageBusy if msg.busy else StageError)(f"stage {msg.stage}: {msg.reason}")


def _make_detector(
    section: ClusterSection,
    provider: Provider[ProviderSettings | None],
    n: int,
    run_label: str,
    own_networks: bool = False,
) -> Detector:
    from ppharness.run.membership import HeartbeatDetector, KinshipDetector, choose_engine

    # nodes in network namespaces of their own (the packet layer) reach the seed only over the transport
    engine = choose_engine(section.engine, provider.gossip_reachable and not own_networks)
    if engine == "kinship":
        return KinshipDetector(run_label)
    return HeartbeatDetector(n, section.heartbeat_s, section.suspect_after, section.dead_after_s)


@dataclass(frozen=True)
class Death:
    """A node that exited (``exit_code``) or that membership declared dead (``why``)."""

    stage: int
    instance: Instance | None
    exit_code: int | None = None
    why: str = ""

    def describe(self, kind: str, phase: str) -> str:
        if self.exit_code is not None and self.instance is not None:
            return f"{self.instance.name} ({kind} {self.instance.id}) exited with code {self.exit_code} while {phase}"
        return f"{stage_name(self.stage)} died while {phase}: {self.why}"

    @property
    def cause(self) -> str:
        return f"exited with code {self.exit_code}" if self.exit_code is not None else self.why


def _deaths(
    provider: Provider[ProviderSettings | None], detector: Detector | None, retired: set[str], chain: Chain
) -> list[Death]:
    """Every node, not yet replaced, that exited or was declared dead; a standby spare's death has stage -1."""
    out: list[Death] = []
    for inst, rc in provider.exited():
        if inst.id not in retired:
            out.append(Death(chain.instance_stages.get(inst.id, -1), inst, exit_code=rc))
    for stage, why in detector.dead() if detector is not None else []:
        if any(d.stage == stage for d in out):
            continue
        out.append(Death(stage, chain.stage_instances.get(stage), why=why))
    return out


class _SpareLost(ClusterError):
    """The spare coming up for a dead stage died too."""

    def __init__(self, death: Death) -> None:
        super().__init__(f"the spare for {stage_name(death.stage)} {death.cause}")
        self.death = death


def _no_spare(err: ClusterError, used: int) -> ClusterError:
    err.add_note(
        f"no spare device is left to replace it (policy failover; {used} replacement(s) so far) — name more spares "
        "in the plan (placement.spares) or the scenario (fault_tolerance.spares)"
    )
    return err


def _shutdown(
    transport: Transport,
    directory: Directory,
    reports: list[StageReport],
    provider: Provider[ProviderSettings | None],
    progress: Callable[[str], None],
) -> None:
    """Ask every node to stop, collect their Stopped reports (peak RSS) for a few seconds, wait for exits."""
    for j in directory.joins.values():
        transport.send(j.address, Shutdown(reason="run complete"))
    stopped: set[int] = set()

    def on_stopped(sender: str, msg: Message) -> bool:
        if isinstance(msg, Stopped):
            stopped.add(msg.stage)
            reports[msg.stage].peak_rss_bytes = msg.peak_rss_bytes
            reports[msg.stage].device_bytes = msg.device_bytes
        return len(stopped) == len(directory.joins)

    try:
        wait_for(transport.recv, on_stopped, 10.0, "every stage to stop", log=progress)
    except ClusterError as exc:
        progress(f"warning: {exc}; destroying the rest")
    provider.wait_exited(5.0)
