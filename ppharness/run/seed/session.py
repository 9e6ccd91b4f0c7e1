"""The orchestrator's session: the nodes provisioned, the seed's endpoint, the one message loop every wait turns on,
the death checks, and teardown.

The session is the cluster's seed. Every wait runs on its ``Loop``: the timers (the outbox's resends, the network's
timed events, a load's arrivals) and the death check run between messages, and every message passes one handler
before the wait's own: what the run's parts screen off (a replaced node, a refusal the client deals with), what the
sender's role does not send (``ppharness.run.seed.roles``: dropped), a stage's Error (raised), the membership's
heartbeats, then what is kept whatever the wait is for (acknowledgements, a standby's Join, the client's tokens and
responses). Every wait is bounded by its phase's timeout and by the run's total budget; the provider is a context
manager, so every path out destroys every node.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from ppharness.errors import ClusterError, HarnessError, PlanError, StageBusy, StageError, WaitTimedOut
from ppharness.model.layers.kernels import table_for_nodes
from ppharness.model.sources.files import resolve_model
from ppharness.model.synthetic.spec import short_source
from ppharness.model.verdict import judge_file
from ppharness.network.bridge import Bridge
from ppharness.network.clock import EventClock
from ppharness.network.nemesis import Nemesis
from ppharness.network.packet import PortTable, plan_ports, start_bridge
from ppharness.network.spec import SEED_NODE, Network, describe_network, stage_node
from ppharness.plan.compile import load_compiled, plan_network
from ppharness.plan.stages import ENTRY, EXIT, stage_name
from ppharness.registry import impaired_transport, provider_class, transport_class
from ppharness.run.loop import Handler, Loop, heartbeat
from ppharness.run.membership import HeartbeatDetector, KinshipDetector, choose_engine
from ppharness.run.reliable import Outbox, RetryPolicy
from ppharness.run.seed.directory import Directory
from ppharness.run.seed.locks import RunLock
from ppharness.run.seed.realise import (
    Endpoints,
    fault_policy,
    model_source,
    realise,
    realise_plan,
    standby,
    transport_settings,
)
from ppharness.run.seed.roles import Identities, Roles, member_name, member_role, spare_role
from ppharness.trace.drops import fingerprinted
from ppharness.wire.messages import Ack, Error, Join, Members, Message, Ready, Shutdown, Stopped

if TYPE_CHECKING:
    from ppharness.plan.lang.document import Device
    from ppharness.run.membership import Detector
    from ppharness.scenario.schema import Scenario
    from ppharness.scenario.sections import ClusterSection
    from ppharness.seams import Instance, Provider, Transport
    from ppharness.seams.settings import ProviderSettings
    from ppharness.seams.transport import JsonObject, Received

OnMessage = Callable[[str, Message], bool]  # a wait's own handler: True when the wait is over


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


def members(indices: list[int], num_stages: int) -> str:
    """``stage 1, expert node 0``: the first six, then how many more."""
    names = [member_name(i, num_stages) for i in sorted(indices)]
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


@dataclass
class Standby:
    """A spare device's standby node: its instance, and its address once it joined as a spare."""

    instance: Instance
    address: str = ""


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


def stage_deaths(deaths: list[Death], phase: str) -> list[Death]:
    """Without fault tolerance every stage's death ends the run."""
    return [d for d in deaths if d.stage >= 0]


class Session:
    """The run's nodes and the seed's endpoint: provisioned, joined and ready on ``open``, torn down on ``close``.

    The parts of a run hook into its waits: ``screens`` take a message out before anything else sees it (True: taken),
    ``keepers`` see every message that passed, whatever the wait is for, and ``on_deaths`` decides which deaths end
    the run (the rest it deals with, e.g. by replacing the dead stage)."""

    def __init__(
        self,
        scenario: Scenario,
        progress: Callable[[str], None],
        run_label: str,
        log_dir: str | None = None,
        trace: bool = False,
    ):
        self.scenario, self.progress, self.run_label = scenario, progress, run_label
        self.log_dir, self.trace_on = log_dir, trace
        self.deadline = time.monotonic() + scenario.budget.total_s
        self.provider: Provider[ProviderSettings | None] | None = None
        self._lock: RunLock | None = None
        self.transport: Transport | None = None
        self.loop: Loop | None = None
        self.detector: Detector | None = None
        self.clock = EventClock()  # the network's timed events count from the request (NetworkStart)
        self.nemesis: Nemesis | None = None
        self.ports: PortTable = {}  # the packet layer's ports: node -> (QUIC port, virtual port)
        self.bridge: Bridge | None = None  # the packet layer's bridge of this endpoint
        self.bridge_dir: str | None = None  # where the bridges' Unix sockets live
        self.network: Network | None = None  # the scenario's network with the plan's links
        self.policy = "none"  # fault tolerance (ppharness.run.reliable): none, retry or failover
        self.outbox: Outbox | None = None
        self.spares: list[Device] = []  # the spare devices not used yet
        self.spare_opts: dict[str, JsonObject] = {}  # spare device -> its endpoint's transport options
        self.reserve_opts: list[JsonObject] = []  # member identities not used yet, for re-placed stages
        self.identities = Identities()  # which key is which member's: bound to the transport's in ``open``
        self.standbys: dict[str, Standby] = {}  # spare device -> its standby node
        self.stage_instances: dict[int, Instance] = {}  # stage -> the instance serving it now
        self.instance_stages: dict[str, int] = {}  # instance id -> the stage it serves or served
        self.retired: set[str] = set()  # instance ids of replaced or lost nodes
        self.ready = False
        self.screens: list[Callable[[str, Message], bool]] = []
        self.roles = Roles(lambda: getattr(self, "directory", None), progress)  # after the screens, in every wait
        self.keepers: list[Callable[[str, Message], None]] = []
        self.on_deaths: Callable[[list[Death], str], list[Death]] = stage_deaths
        self._waits: list[tuple[str, Handler]] = []  # the running waits' phases and handlers, the innermost last

    # --- provisioning -----------------------------------------------------------------------------------------------

    def open(self) -> None:
        """Build the model, start the seed's endpoint and every node, wait for their Joins and Ready; whatever fails
        closes what was opened before it propagates."""
        sc, progress = self.scenario, self.progress
        self._lock = RunLock(self.run_label).acquire()  # a label a live run holds is refused before anything exists
        try:  # from here on, whatever fails releases the lock and closes what was opened
            if sc.plan is not None:
                source, sha = load_compiled(sc.plan)[0].model.source, None  # the plan's model is what the run resolves
            else:
                source, sha = model_source(sc)
            self.model_source = source
            progress(f"model: {short_source(source)} (building or fetching once, then cached)")
            size = sc.model.size if sc.plan is None else None  # a plan file pins its model by sha256
            deadline = self.left(sc.budget.total_s, "the model")
            self.model_path = str(resolve_model(source, sha, size=size, deadline_s=deadline))
            judge_file(self.model_path).refuse()  # a downloaded file is judged here, before any node starts
            self.plan_doc, self.compiled = realise_plan(sc, source, self.model_path)
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
            provider_cls = provider_class(sc.provider.kind)
            settings: ProviderSettings | None = getattr(sc.provider, sc.provider.kind, None)
            self.provider = provider = provider_cls(self.run_label, settings, log_dir=self.log_dir)
            self.node_model = provider.node_model(self.model_source, self.model_path)
            self.policy = fault_policy(sc, self.compiled)
            if self.compiled.expert_nodes and self.policy == "failover":
                raise PlanError(
                    f"plan {plan.plan_id}: fault_tolerance failover does not replace expert nodes yet — run this plan "
                    "with policy none or retry"
                )
            placement = self.plan_doc.placement
            if self.policy == "failover":
                self.spares = [self.plan_doc.cluster.device(d) for d in placement.spares]
            transport_cls = transport_class(sc.transport.kind)
            # the spares are members from the start: their keys are among those every endpoint admits; so are the
            # identities kept for stages re-placed on surviving devices once the spares are used up (run/replan.py)
            reserved = n if self.policy == "failover" and provider.colocates and sc.fault_tolerance.replan else 0
            endpoint_opts = transport_cls.plan_endpoints(
                n + 1 + len(self.spares) + reserved, transport_settings(sc.transport)
            )
            spare_opts = endpoint_opts[n + 1 : n + 1 + len(self.spares)]
            self.spare_opts = {d.id: o for d, o in zip(self.spares, spare_opts, strict=True)}
            self.reserve_opts = endpoint_opts[n + 1 + len(self.spares) :]
            endpoint_opts = endpoint_opts[: n + 1]
            self.identities = Identities(transport_cls.identity, transport_cls.identity_of)  # keys bound to roles
            for i, opts in enumerate(endpoint_opts[1:]):
                self.identities.give(member_role(i), opts)
            for device, opts in self.spare_opts.items():
                self.identities.give(spare_role(device), opts)
            seed_opts = endpoint_opts[0] | provider.seed_transport_options(sc.transport.kind)
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
                self.nemesis = Nemesis(network, provider, self.clock, progress, self._instance_of_node)
                progress(f"network emulation ({network.layer} level): {describe_network(network)}")
            self.seed = self.transport.start()
            self.loop = Loop(self.transport, progress)
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
            for timer in (self.nemesis, self.outbox):
                if timer is not None:
                    self.loop.add_timer(timer)
            self.loop.add_check(self._check_deaths)
            self.detector = _make_detector(sc.cluster, provider, n, self.run_label, bool(self.ports))
            progress(f"membership: {self.detector.name}")
            provider.__enter__()
            self._start(endpoint_opts)
        except BaseException as exc:
            self.close(type(exc), exc, exc.__traceback__)
            raise

    def _start(self, endpoint_opts: list[JsonObject]) -> None:
        sc, progress, n = self.scenario, self.progress, self.compiled.members
        provider, transport, detector = self.provider, self.transport, self.detector
        assert provider is not None and transport is not None and detector is not None, "the session is not open"
        budget = sc.budget
        self.endpoints = endpoints = Endpoints(
            seed=self.seed,
            node_model=self.node_model,
            transport_opts=endpoint_opts[1:],
            membership_env=detector.node_env(),
            network=self.network,
            ports=self.ports,
            bridge_dir=self.bridge_dir or "",
            kernel_table=table_for_nodes(),
        )
        nodes = realise(sc, self.compiled, endpoints, self.trace_on)
        specs = [provider.spec(r.name, r.env, **r.options) for r in nodes]
        spares = [standby(sc, endpoints, d, self.spare_opts[d.id], k) for k, d in enumerate(self.spares)]
        specs += [provider.spec(r.name, r.env, **r.options) for r in spares]
        groups = [r for r in nodes if r.stages]
        progress(
            f"starting {len(nodes)} {sc.provider.kind} node(s) over {sc.transport.kind} (run {self.run_label})"
            + "".join(f", {r.name} serving stages {r.stages[0]}-{r.stages[-1]} in one process" for r in groups)
            + (f", and {len(spares)} standby spare(s)" if spares else "")
        )
        started = provider.provision(specs)
        # a node serving co-located stages (``ppharness.run.node.colocated``) is every one of them; it dies as its first
        served = [r.stages or (int(r.env["STAGE"]) if r.program is None else r.program.stage,) for r in nodes]
        self.stage_instances = {i: inst for inst, stages in zip(started, served, strict=False) for i in stages}
        self.instance_stages = {inst.id: stages[0] for inst, stages in zip(started, served, strict=False)}
        for d, inst in zip(self.spares, started[len(nodes) :], strict=True):
            self.standbys[d.id] = Standby(inst)

        self.directory = directory = Directory(self.plan.num_stages, len(self.compiled.expert_nodes))

        def on_join(sender: str, msg: Message) -> bool:
            if isinstance(msg, Join) and msg.stage >= 0 and self.join_ok(sender, msg):  # a spare's: _take
                directory.add(msg)
                detector.watch([msg.stage])
                progress(f"{member_name(msg.stage, self.plan.num_stages)} joined from {fingerprinted(msg.address)}")
            return directory.complete

        try:
            waiting = lambda: f"{members(directory.missing(), self.plan.num_stages)} to join"  # noqa: E731
            self.wait(on_join, budget.join_s, f"all {n} nodes to join", "starting up", pending=waiting)
        except WaitTimedOut as exc:
            raise self.with_logs(
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
                    f"{member_name(msg.stage, self.plan.num_stages)} ready: {msg.params:,} parameters, loaded and "
                    "compiled in "
                    f"{msg.load_s:.1f} s ({len(ready)}/{n})"
                )
            return len(ready) == n

        try:
            waiting = lambda: f"{members([i for i in range(n) if i not in ready], self.plan.num_stages)} to compile"  # noqa: E731
            what = "every stage to load its blocks and compile (Ready)"
            self.wait(on_ready, budget.ready_s, what, "starting up", pending=waiting)
        except WaitTimedOut as exc:
            missing = [i for i in range(n) if i not in ready]
            raise self.with_logs(
                ClusterError(
                    f"stage(s) {missing} never reported ready within {budget.ready_s:g} s "
                    "(loading the model and compiling)"
                ),
                missing,
            ) from exc

    def resolve(self, name: str, timeout: float) -> str:
        """The address registered under ``name``, waiting (bounded) for a Join that registers it."""
        if name in self.directory.names:
            return self.directory.names[name]

        def on_join(sender: str, msg: Message) -> bool:
            if isinstance(msg, Join) and msg.stage >= 0 and self.join_ok(sender, msg):
                self.directory.add(msg)
            return name in self.directory.names

        try:
            self.wait(on_join, timeout, f"the name {name!r} to be registered", "resolving names")
        except WaitTimedOut as exc:
            raise ClusterError(
                f"the name {name!r} never resolved within {timeout:g} s; registered: "
                f"{', '.join(sorted(self.directory.names)) or 'none'}"
            ) from exc
        return self.directory.names[name]

    def _instance_of_node(self, node: str) -> Instance | None:
        """The instance that is the network emulation's ``stage-<i>`` now."""
        tail = node.removeprefix("stage-")
        return self.stage_instances.get(int(tail)) if tail.isdigit() else None

    def _address_of(self, role: str) -> str | None:
        """Where the orchestrator's reliable messages go: ``entry`` is stage 0, whichever node that is now."""
        return self.directory.names.get(ENTRY) if role == "entry" else role

    # --- the message loop -------------------------------------------------------------------------------------------

    def left(self, phase_s: float, what: str) -> float:
        """``phase_s``, or less when the run's budget ends sooner; a HarnessError when it ran out."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise HarnessError(f"the run's budget of {self.scenario.budget.total_s:g} s ran out before {what}")
        return min(phase_s, remaining)

    def wait(
        self,
        on_message: OnMessage,
        phase_s: float,
        what: str,
        phase: str,
        done: Callable[[], bool] = lambda: False,
        pending: Callable[[], str] | None = None,
    ) -> None:
        """Turn the loop, handing messages to ``on_message``, until it returns True or ``done()``; at most
        ``phase_s`` seconds and what is left of the run's budget. ``phase`` names the wait in a death's report;
        ``pending``, what is still awaited, said every ``loop.HEARTBEAT_S`` of waiting."""
        loop = self.loop
        assert self.provider is not None and loop is not None, "the session is not open"
        handle = self._handler(on_message)
        done = done if pending is None else heartbeat(done, pending, self.progress)
        outermost = loop.depth == 0  # a failover waits within the request's wait
        if outermost and self.detector is not None:
            self.detector.listen()
        self._waits.append((phase, handle))
        try:
            loop.wait(handle, self.left(phase_s, what), what, done)
        finally:
            self._waits.pop()
            if outermost and self.detector is not None:
                self.detector.deaf()

    def _handler(self, on_message: OnMessage) -> Handler:
        def handle(sender: str, msg: Message, rx: Received | None = None) -> bool:
            if any(screen(sender, msg) for screen in self.screens) or not self.roles.admits(sender, msg):
                return False
            raise_on_error(msg)
            if self.detector is not None and self.detector.on_message(msg):
                return False
            self._take(sender, msg)
            return on_message(sender, msg)

        return handle

    def _take(self, sender: str, msg: Message) -> None:
        """What the session keeps whatever it is waiting for: acknowledgements, a standby's Join; then the parts'."""
        match msg:
            case Ack() if self.outbox is not None:
                self.outbox.ack(sender, msg)
            case Join(stage=-1, names=[name]) if self.join_ok(sender, msg):
                sb = self.standbys.get(name.removeprefix("spare:"))
                if sb is not None and not sb.address:
                    sb.address = sender
                    self.progress(f"spare {name.removeprefix('spare:')} standing by")
        for keep in self.keepers:
            keep(sender, msg)

    def join_ok(self, sender: str, msg: Join) -> bool:
        """Whether a Join is taken: it names its own address and comes with the key made for the member it announces
        (``ppharness.run.seed.roles.Identities``); a refusal goes to the drop log."""
        why = self.identities.refusal(sender, msg)
        if why:
            self.roles.drop(why, "Join as another member", sender)
        return not why

    def _check_deaths(self) -> None:
        """Between messages: a death ``on_deaths`` does not deal with ends the wait, after the node's own last words."""
        if self.provider is None or not self._waits:
            return
        phase, handle = self._waits[-1]
        ended = self.on_deaths(self.deaths(), phase)
        if ended:
            self.drain(handle)  # a node's own Error, sent before it went, says more than its death
            # a node declared dead for its silence, whose beats were in the mail not yet read (the orchestrator was
            # slow to read it, not the node to send), lives on
            standing = {d.stage for d in self.deaths()}
            ended = [d for d in ended if d.exit_code is not None or d.stage in standing]
            if ended:
                raise self.death_error(ended[0], phase)

    def drain(self, handle: Handler, limit: int = 100) -> None:
        """Hand what has already arrived to ``handle`` (which raises on an Error), without waiting for more."""
        assert self.loop is not None, "the session is not open"
        for _ in range(limit):
            got = self.loop.next(0.05)
            if got is None:
                return
            handle(*got)

    def deaths(self) -> list[Death]:
        """Every node, not yet replaced, that exited or was declared dead; a standby spare's death has stage -1."""
        assert self.provider is not None, "the session is not open"
        out: list[Death] = []
        for inst, rc in self.provider.exited():
            if inst.id not in self.retired:
                out.append(Death(self.instance_stages.get(inst.id, -1), inst, exit_code=rc))
        for stage, why in self.detector.dead() if self.detector is not None else []:
            if any(d.stage == stage for d in out):
                continue
            out.append(Death(stage, self.stage_instances.get(stage), why=why))
        return out

    def death_error(self, death: Death, phase: str) -> ClusterError:
        assert self.provider is not None, "the session is not open"
        err = ClusterError(death.describe(self.provider.kind, phase))
        inst = death.instance
        tail = self.provider.logs(inst, 15).rstrip() if inst is not None else ""
        if inst is not None and tail:
            err.add_note(f"last lines of {inst.name}:\n{tail}")
        return err

    def with_logs(self, err: HarnessError, stages: list[int]) -> HarnessError:
        """``err`` with the last log lines of each of ``stages``' instances attached as notes."""
        assert self.provider is not None, "the session is not open"
        for inst in self.provider.instances:
            if any(inst.name == stage_name(s) for s in stages):
                tail = self.provider.logs(inst, 15).rstrip()
                if tail:
                    err.add_note(f"last lines of {inst.name}:\n{tail}")
        return err

    # --- teardown ---------------------------------------------------------------------------------------------------

    def close(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        """Stop every node (asked to, after a clean run; destroyed in any case), close the endpoint, forget the run."""
        destroyed = False
        self.roles.drop.close()  # the process's last count of dropped messages, if any were only counted
        if self.nemesis is not None:
            try:
                self.nemesis.heal()  # a paused node cannot shut down
            except HarnessError as heal_error:
                self.progress(f"warning: resuming paused nodes failed: {heal_error}")
        try:
            if exc_type is None and self.provider is not None and self.transport is not None:
                for sb in self.standbys.values():  # unused standbys exit without a report
                    if sb.address:
                        self.transport.send(sb.address, Shutdown(reason="run complete"))
                self._shutdown(self.transport, self.provider)
        finally:
            try:
                if self.detector is not None:
                    self.detector.close()
                if self.provider is not None:
                    self.provider.__exit__(exc_type, exc, tb)
                    self.provider = None
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

    def _shutdown(self, transport: Transport, provider: Provider[ProviderSettings | None]) -> None:
        """Ask every node to stop, collect their Stopped reports (peak RSS) for a few seconds, wait for exits."""
        directory, reports = self.directory, self.reports
        for j in directory.joins.values():
            transport.send(j.address, Shutdown(reason="run complete"))
        stopped: set[int] = set()

        def on_stopped(sender: str, msg: Message, rx: Received | None = None) -> bool:
            if isinstance(msg, Stopped) and self.roles.admits(sender, msg):
                stopped.add(msg.stage)
                reports[msg.stage].peak_rss_bytes = msg.peak_rss_bytes
                reports[msg.stage].device_bytes = msg.device_bytes
            return len(stopped) == len(directory.joins)

        try:  # a loop of its own: no timers, and nodes that exit now are no deaths
            Loop(transport, self.progress).wait(on_stopped, 10.0, "every stage to stop")
        except ClusterError as exc:
            self.progress(f"warning: {exc}; destroying the rest")
        provider.wait_exited(5.0)


def raise_on_error(msg: Message) -> None:
    """A stage's Error as the exception it stands for (a busy refusal: StageBusy)."""
    if isinstance(msg, Error):
        raise (StageBusy if msg.busy else StageError)(f"stage {msg.stage}: {msg.reason}")


def _make_detector(
    section: ClusterSection,
    provider: Provider[ProviderSettings | None],
    n: int,
    run_label: str,
    own_networks: bool = False,
) -> Detector:
    # nodes in network namespaces of their own (the packet layer) reach the seed only over the transport
    engine = choose_engine(section.engine, provider.gossip_reachable and not own_networks)
    if engine == "kinship":
        return KinshipDetector(run_label)
    return HeartbeatDetector(n, section.heartbeat_s, section.suspect_after, section.dead_after_s)
