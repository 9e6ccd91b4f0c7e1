"""``pp-node``: the one process every provider starts, one per stage.

Inputs come from the environment (the node contract): ``STAGE``, ``NUM_STAGES``, ``SEED_ADDR`` (the orchestrator's
transport address), ``MODEL`` (GGUF path, URL or ``synthetic:`` spec), ``PLAN`` (the node's program from the compiled
plan, a JSON StagePlan: block range, plan id, the names to register, where activations come from and go, wire dtype,
timeouts), ``TRANSPORT`` (registry kind) and ``PP_RUN_LABEL``. Optional, for transports that bind sockets:
``PP_BIND_HOST``, ``PP_ADVERTISE_HOST``, ``PP_PORT`` and, on vast.ai, ``PUBLIC_IPADDR`` with ``VAST_TCP_PORT_<P>`` /
``VAST_UDP_PORT_<P>`` (``ppharness.run.node.address``).

The node joins the cluster, loads only its own layers, compiles its decode step, reports Ready, and serves until
Shutdown (exit 0). Any failure is reported to the seed as an Error message with one line of reason, then exit 1.

``PP_GROUP`` (a JSON list of member environments) makes one node serve several consecutive stages that a plan
co-locates (``ppharness.run.node.colocated``); ``ppharness.run.node.main`` picks which node a process is.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from ppharness.errors import HarnessError
from ppharness.model.decode.drafts import build_draft
from ppharness.model.decode.rules import warm_up, warm_windows
from ppharness.model.engine.expert_bank import ExpertBank
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import resolve_model
from ppharness.network.bridge import Bridge
from ppharness.network.clock import EventClock
from ppharness.network.spec import stage_node
from ppharness.plan.stages import StagePlan, decode_program
from ppharness.run.loop import DRAIN, Loop
from ppharness.run.membership import NodeMembership
from ppharness.run.node.env import make_transport, read_network, start_packet_bridge
from ppharness.run.node.env import node_log as _log
from ppharness.run.node.experts import ExpertParallel, ExpertServer, warm_bank
from ppharness.run.node.faults import with_fault
from ppharness.run.node.members import members_refusal, needed_names, resolve_members
from ppharness.run.node.standby import MAX_HELD_LENGTHS, Held, assignment_waits, stage_slice
from ppharness.run.reliable import RetryPolicy, ack_of
from ppharness.run.stage.requests import StageModel, StageState
from ppharness.run.stage.speculation import Speculation, speculation_of
from ppharness.run.stage.stage import Stage
from ppharness.seams.transport import JsonObject, Received, Transport
from ppharness.trace.drops import DropLog, fingerprinted
from ppharness.trace.tracer import Tracer, now_ns
from ppharness.wire.messages import (
    Ack,
    Assign,
    ClockProbe,
    ClockReply,
    DigestReport,
    DigestRequest,
    Error,
    ExpertResult,
    Join,
    Members,
    Message,
    NetworkStart,
    Ready,
    Shutdown,
    Stopped,
    TraceReport,
    TraceRequest,
    Warm,
)

if TYPE_CHECKING:
    from ppharness.model.text.tokenizer import Tokenizer

STANDBY_ENV = ("PP_STANDBY", "SEED_ADDR", "MODEL", "TRANSPORT")
POLL_S = 1.0  # the longest a node waits for a message before it looks again whether its parent is gone


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def device_bytes() -> int:
    """Bytes of tinygrad buffers this process holds on its device (0 before tinygrad is imported)."""
    helpers = sys.modules.get("tinygrad.helpers")
    return int(helpers.GlobalCounters.mem_used) if helpers is not None else 0


def load_stage_model(
    model_source: str, plan: StagePlan, gguf_file: GGUFFile | None = None
) -> tuple[ModelSlice, Tokenizer | None, float]:
    """(ModelSlice, tokenizer or None, seconds): only this stage's tensors, decode step compiled and warmed.
    ``gguf_file``: the model file, when already open."""
    t0 = time.monotonic()
    if gguf_file is None:
        gguf_file = GGUFFile(resolve_model(model_source))
    model = stage_slice(gguf_file, plan)
    tokenizer = gguf_file.tokenizer if plan.first or plan.last else None
    warm_up(model)
    speculation = speculation_of(plan.speculate, plan.windows)
    if speculation is not None:
        warm_windows(model, speculation.rows)
    return model, tokenizer, time.monotonic() - t0


def stage_speculation(plan: StagePlan, model: ModelSlice, log: Callable[[str], None]) -> Speculation | None:
    """The run's speculation on this stage (``ppharness.run.stage.speculation``): stage 0 loads and compiles its
    draft."""
    speculation = speculation_of(plan.speculate, plan.windows)
    if speculation is None or not plan.first:
        return speculation
    t0 = time.monotonic()
    draft = build_draft(speculation.spec, model.file, plan.max_context, plan.slots)
    log(f"draft {speculation.spec.text} ready in {time.monotonic() - t0:.1f} s ({plan.windows} window(s) in flight)")
    return dataclasses.replace(speculation, draft=draft)


def load_expert_bank(model_source: str, plan: StagePlan) -> tuple[ExpertBank, float]:
    """An expert node's bank: the routed experts its program names, loaded and compiled. (bank, seconds)"""
    t0 = time.monotonic()
    bank = ExpertBank(GGUFFile(resolve_model(model_source)), plan.experts or {})
    warm_bank(bank)
    return bank, time.monotonic() - t0


def _idle_until_orphaned(parent: int) -> int:
    """Do nothing (a fault under test) until the process that started this node is gone."""
    while os.getppid() == parent:
        time.sleep(0.5)
    return 1


class Orphaned(HarnessError):
    """The process that started this node is gone."""


def node_loop(transport: Transport, log: Callable[[str], None], parent: int) -> Loop:
    """A node's loop over its transport: its waits end (Orphaned) when ``parent``, the process that started the node,
    is gone."""

    def orphaned() -> None:
        if os.getppid() != parent:
            raise Orphaned("the process that started this node is gone")

    loop = Loop(transport, log, poll_s=POLL_S)
    loop.add_check(orphaned)
    return loop


# what only the orchestrator may send a node; replies go to the orchestrator, never to an address a frame names
CONTROL = (Shutdown, ClockProbe, TraceRequest, DigestRequest, NetworkStart, Members, Warm)


def _reply(transport: Transport, seed: str, msg: Message, log: Callable[[str], None]) -> None:
    """Answer the orchestrator; a failed answer is logged, never fatal (the orchestrator notices the silence)."""
    try:
        transport.send(seed, msg)
    except HarnessError as exc:
        log(f"could not answer the orchestrator with {type(msg).__name__}: {exc}")


@dataclass
class Standing:
    """A node's started transport and what goes with it: a standby spare's prepared model file (before it was
    assigned a stage), a packet-layer node's bridge."""

    transport: Transport
    address: str
    clock: EventClock
    gguf_file: GGUFFile | None
    bridge: Bridge | None = None
    held: Held | None = None  # a warm standby's slices


def stand_by(env: dict[str, str]) -> int:
    """A standby spare (``PP_STANDBY``: its device): join as a spare, pay what every node pays before its blocks
    (starting Python and tinygrad, compiling tinygrad's own rewrite rules, opening the model file), then wait for an
    Assign and become the stage it names; or exit 0 on Shutdown."""
    missing = [k for k in STANDBY_ENV if not env.get(k)]
    if missing:
        _log("spare", f"failed: missing environment variable(s) {', '.join(missing)}")
        return 1
    seed, device = env["SEED_ADDR"], env["PP_STANDBY"]

    def log(text: str) -> None:
        _log(f"spare {device}", text)

    parent = os.getppid()
    clock = EventClock()
    try:
        transport = make_transport(env["TRANSPORT"], env, read_network(env), clock)
        address = transport.start()
    except HarnessError as exc:
        log(f"failed: could not start the {env['TRANSPORT']} transport: {exc}")
        return 1
    try:
        join = Join(
            stage=-1,
            num_stages=0,
            address=address,
            names=[f"spare:{device}"],
            run_label=env.get("PP_RUN_LABEL", ""),
            pid=os.getpid(),
        )
        transport.send(seed, join)
        gguf_file = _prepare(env["MODEL"], int(env.get("PP_MAX_CONTEXT") or 256), log)
        log("standing by")
        held = Held(gguf_file, log)
        loop = node_loop(transport, log, parent)
        assigned = _await_assignment(loop, seed, clock, log, held, transport)
    except (HarnessError, msgspec.DecodeError) as exc:
        log(f"failed: {exc}")
        transport.close()
        return 1
    if assigned is None:
        transport.close()
        return 0
    plan, gossip = assigned
    log(f"assigned stage {plan.stage}: blocks [{plan.lo}, {plan.hi})")
    rename = getattr(transport, "become", None)
    if rename is not None:  # the network emulation: from now on this node is that stage
        rename(stage_node(plan.stage))
    env = env | {"STAGE": str(plan.stage), "NUM_STAGES": str(plan.num_stages)}
    if gossip:
        env["PP_GOSSIP_NAME"] = gossip
    return serve(plan, env, Standing(transport, address, clock, gguf_file, held=held))


def _await_assignment(
    loop: Loop, seed: str, clock: EventClock, log: Callable[[str], None], held: Held, transport: Transport
) -> tuple[StagePlan, str] | None:
    """Wait for the orchestrator's Assign: (the program, the gossip name); None on Shutdown. A Warm is carried out
    meanwhile (``ppharness.run.node.standby``). Anything else, and anything from another member, is dropped."""
    assigned: list[tuple[StagePlan, str] | None] = []
    drop = DropLog(log)

    def on_message(sender: str, msg: Message, rx: Received | None) -> bool:
        if sender != seed:
            line = f"dropped {type(msg).__name__} from {fingerprinted(sender)}: a standby takes orders from the seed"
            drop(line, f"{type(msg).__name__} not its role's", sender)
            return False
        match msg:
            case Shutdown():
                log("shutting down unused")
                assigned.append(None)
            case Assign(program=program, gossip_name=gossip):
                assigned.append((decode_program(program), gossip))
            case NetworkStart(t0_unix_ns=t0):
                clock.start(t0)
            case Warm():  # answered at once (the seed's bound on a silent spare), then when warm
                _reply(transport, seed, Ack(kind="warming", request_id="", position=0, plan_id=""), log)
                held.warm(msg, lambda: assignment_waits(loop))
                _reply(transport, seed, Ack(kind="warm", request_id="", position=0, plan_id=""), log)
            case other:
                drop(f"dropped {type(other).__name__}: a standby waits for an Assign", "unexpected", sender)
        return bool(assigned)

    loop.wait(on_message, None, "an Assign from the orchestrator")
    return assigned[0]


def _prepare(model: str, max_context: int, log: Callable[[str], None]) -> GGUFFile | None:
    """What a node does before its blocks that does not depend on which blocks: opening the model file, then loading
    one block with the run's context and compiling its prefill and decode step (then dropping it). Every block of a
    model has the same shapes, and tinygrad keeps what it scheduled and compiled for the whole process, so the range
    the standby is later assigned loads and warms up several times faster (on the tiny model, 0.3 s and 0.8 s instead
    of 2.1 s and 2.3 s). It costs one block's memory while it lasts."""
    try:
        t0 = time.monotonic()
        gguf_file = GGUFFile(resolve_model(model))
        if gguf_file.config.blocks > 0:
            block = ModelSlice(gguf_file, 0, 1, False, False, max_context)
            warm_up(block)
            del block
        log(f"prepared in {time.monotonic() - t0:.1f} s")
        return gguf_file
    except Exception as exc:  # the assignment loads the model again and reports what fails then
        log(f"preparing failed ({type(exc).__name__}: {exc}); the model is opened when assigned")
        return None


def _start(env: dict[str, str], log: Callable[[str], None]) -> Standing | None:
    """Start the node's transport (behind its bridge, on the packet layer); None, logged, when it fails."""
    bridge: Bridge | None = None
    try:
        network = read_network(env)
        clock = EventClock()
        extra: JsonObject = {}
        if network is not None and network.layer == "packet":
            bridge, extra = start_packet_bridge(network, env, clock)
        transport = make_transport(env["TRANSPORT"], env, network, clock, extra)
        return Standing(transport, transport.start(), clock, None, bridge)
    except HarnessError as exc:
        log(f"failed: could not start the {env['TRANSPORT']} transport: {exc}")
        if bridge is not None:
            bridge.close()
        return None


def serve(plan: StagePlan, env: dict[str, str], standing: Standing | None = None) -> int:
    """Serve stage ``plan.stage`` until Shutdown; ``standing``: what a standby spare prepared (its transport is
    started and has joined as a spare)."""

    def log(text: str) -> None:
        _log(plan.stage, text)

    started = standing if standing is not None else _start(env, log)
    if started is None:
        return 1
    node = Node(plan, env, started, log)
    try:
        return node.run()
    finally:
        node.close()


class Node:
    """A started node from its Join to its exit: load, learn the directory, report Ready, then serve on its loop
    (``ppharness.run.loop``): control messages from the orchestrator are answered here, every other message goes to
    the stage (or expert server), whose steps the loop runs between messages."""

    def __init__(self, plan: StagePlan, env: dict[str, str], started: Standing, log: Callable[[str], None]):
        self.plan, self.env, self.log, self.seed = plan, env, log, env["SEED_ADDR"]
        self.drops = DropLog(log)
        self.transport, self.address, self.clock = started.transport, started.address, started.clock
        self.gguf_file, self.bridge, self.held = started.gguf_file, started.bridge, started.held
        self.fault = env.get("PP_FAULT", "")
        self.parent = os.getppid()
        self.loop = node_loop(self.transport, log, self.parent)
        self.membership: NodeMembership | None = None
        self.tracer = Tracer() if plan.trace else None
        self.fanout: ExpertParallel | None = None
        self.served: Stage | ExpertServer | None = None

    def run(self) -> int:
        """Join, load, serve until Shutdown (0); any failure is reported to the seed as an Error (1)."""
        try:
            if self.fault == "never-join":
                self.log("fault never-join: not joining the cluster")
                return _idle_until_orphaned(self.parent)
            self._join()
            loaded = self.load()
            if self.fault == "stall-before-ready":
                self.log("fault stall-before-ready: never reporting Ready")
                return _idle_until_orphaned(self.parent)
            self.ready(*loaded)
            self.loop.wait(self._on_message, None, "a Shutdown from the orchestrator")
            self.stopped()
            return 0
        except Orphaned:
            self.log("the process that started this node is gone; exiting")
            return 1
        except HarnessError as exc:
            self.fail(exc)
            return 1

    def load(self) -> tuple[ModelSlice | ExpertBank, Tokenizer | None, int, int, float]:
        """Load this node's blocks (or experts) and compile its steps, with one log line."""
        loaded = self._load()
        self.log(f"loaded {loaded[2]} parameters and compiled the decode step in {loaded[4]:.1f} s")
        return loaded

    def ready(
        self,
        loaded: ModelSlice | ExpertBank,
        tokenizer: Tokenizer | None,
        params: int,
        tied_params: int,
        load_s: float,
    ) -> None:
        """Learn the directory, build the stage (or expert server) and report Ready to the seed."""
        plan = self.plan
        directory = resolve_members(self.loop, plan.resolve_s, self.seed, needed_names(plan), self.log)
        self._reply(ack_of("members", self.address, plan.epoch, plan.plan_id))  # resent till then
        self.served = self._build(loaded, tokenizer, directory)
        ready = Ready(
            stage=plan.stage, params=params, tied_params=tied_params, load_s=load_s, rss_bytes=peak_rss_bytes()
        )
        self.transport.send(self.seed, ready)

    def stopped(self) -> None:
        """Tell the seed this node stopped, and what it served."""
        served = self._record().served
        stopped = Stopped(
            stage=self.plan.stage, served=served, peak_rss_bytes=peak_rss_bytes(), device_bytes=device_bytes()
        )
        self._reply(stopped)
        self.log(f"shutting down after {served} request(s)")

    def _record(self) -> StageState | ExpertServer:
        """What the node serves records (its stage's ``state``, or the expert server itself): the requests served,
        the digests of what it sent."""
        served = self.served
        assert served is not None  # asked once the node serves
        return served.state if isinstance(served, Stage) else served

    def fail(self, exc: HarnessError) -> None:
        """Report a failure to the seed (an Error with one line of reason), as far as the transport still can."""
        self.log(f"failed: {exc}")
        try:
            self.transport.send(self.seed, Error(stage=self.plan.stage, reason=str(exc)))
        except HarnessError:
            pass

    def close(self) -> None:
        self.drops.close()  # the process's last count of dropped messages, if any were only counted
        if self.membership is not None:
            self.membership.close()
        self.transport.close()
        if self.bridge is not None:
            self.bridge.close()

    def _join(self) -> None:
        """Join the cluster through the seed (under this node's names), and start the membership engine's side."""
        plan = self.plan
        join = Join(
            stage=plan.stage,
            num_stages=plan.num_stages,
            address=self.address,
            names=[] if self.fault == "no-names" else plan.registers,
            run_label=self.env.get("PP_RUN_LABEL", ""),
            pid=os.getpid(),
        )
        self.transport.send(self.seed, join)
        self.membership = NodeMembership(self.env, plan.stage, self.seed, self.transport, self.log)
        loading = (
            f"loading blocks [{plan.lo}, {plan.hi})"
            if plan.role == "stage"
            else f"loading experts of block(s) {', '.join(map(str, sorted(plan.experts or {})))}"
        )
        self.log(
            f"joined seed {self.seed} from {self.address} ({self.membership.engine or 'no'} membership); {loading}"
        )

    def _load(self) -> tuple[ModelSlice | ExpertBank, Tokenizer | None, int, int, float]:
        """(the slice or the expert bank, the tokenizer, parameters, tied parameters, seconds)."""
        try:
            if self.plan.role == "experts":
                bank, load_s = load_expert_bank(self.env["MODEL"], self.plan)
                return bank, None, bank.n_params, 0, load_s
            source = "/nonexistent/bad-model.gguf" if self.fault == "bad-model" else self.env["MODEL"]
            t0 = time.monotonic()
            warm = self.held.take(self.plan) if self.held is not None and self.fault != "bad-model" else None
            if warm is not None and self.gguf_file is not None:  # a warm standby held this very stage
                tokenizer = self.gguf_file.tokenizer if self.plan.first or self.plan.last else None
                self.log("took over the blocks this standby held, loaded and compiled")
                return warm, tokenizer, warm.n_params, warm.tied_params, time.monotonic() - t0
            model, tokenizer, load_s = load_stage_model(source, self.plan, self.gguf_file)
            return model, tokenizer, model.n_params, model.tied_params, load_s
        except Exception as exc:
            raise HarnessError(f"loading the model failed: {type(exc).__name__}: {exc}") from exc

    def _build(
        self, loaded: ModelSlice | ExpertBank, tokenizer: Tokenizer | None, directory: dict[str, str]
    ) -> Stage | ExpertServer:
        """The stage (or expert server) this node serves, on the node's loop."""
        plan = self.plan
        if isinstance(loaded, ExpertBank):
            return ExpertServer(loaded, self.transport, directory, plan.owners, plan.plan_id, plan.wire_dtype, self.log)
        served_model: StageModel = with_fault(loaded, self.fault)
        if plan.experts is not None and loaded.config.moe:  # the plan puts (some of) its blocks' experts elsewhere
            self.fanout = ExpertParallel(
                loaded,
                self.transport,
                directory,
                plan.plan_id,
                plan.wire_dtype,
                self.log,
                self.tracer,
                plan.ack_timeout_s * 4,
                loop=self.loop,
            )
            served_model = self.fanout
        stage = Stage(
            plan.stage,
            plan.num_stages,
            served_model,
            self.transport,
            directory,
            plan.plan_id,
            plan.wire_dtype,
            tokenizer,
            log=self.log,
            tracer=self.tracer,
            seed=self.seed,
            route=(plan.prev, plan.next),
            policy=plan.fault_tolerance,
            retry=RetryPolicy(first_s=plan.ack_timeout_s, max_s=plan.retry_max_s, budget_s=plan.retry_budget_s),
            epoch=plan.epoch,
            queue=plan.queue,
            max_batch=plan.max_batch,
            speculation=stage_speculation(plan, loaded, self.log),
        )
        stage.serve_on(self.loop)
        if plan.batched:  # its steps run what every waiting message made ready
            self.loop.drain = DRAIN
        return stage

    def _on_message(self, sender: str, msg: Message, rx: Received | None) -> bool:
        """The node's handler: what the orchestrator alone sends is answered here, everything else goes to the stage
        (which records it); True on Shutdown."""
        served = self.served
        assert served is not None  # the loop runs once the node serves
        if isinstance(msg, CONTROL) and sender != self.seed:
            self.drops(
                f"dropped {type(msg).__name__} from {fingerprinted(sender)}: only the orchestrator sends it",
                f"{type(msg).__name__} not its role's",
                sender,
            )
            return False
        stage = self.plan.stage
        match msg:
            case Shutdown():
                return True
            case NetworkStart():
                self.clock.start(msg.t0_unix_ns)
            case Members() if refusal := members_refusal(sender, msg, self.seed, needed_names(self.plan)):
                self.log(refusal)
            case Members():
                served.rejoin(msg.names, msg.epoch)
                if self.fanout is not None:
                    self.fanout.set_directory(msg.names, msg.epoch)
                self._reply(ack_of("members", self.address, msg.epoch, self.plan.plan_id))
            case Warm():  # the prefill of a prompt length compiled before a request of that length comes
                model = served.state.model if isinstance(served, Stage) else None
                warm: Callable[[int], bool] | None = getattr(model, "warm_prefill", None)
                if warm is not None:
                    for length in msg.lengths[:MAX_HELD_LENGTHS]:
                        warm(length)
                self._reply(Ack(kind="warm", request_id="", position=0, plan_id=self.plan.plan_id))
            case ExpertResult():  # a copy of an answer whose step is done
                if self.fanout is not None:
                    self.fanout.late += 1
            case ClockProbe():
                self._reply(ClockReply(stage=stage, t_seed_ns=msg.t_seed_ns, t_node_ns=now_ns()))
            case TraceRequest():
                spans = self.tracer.take(msg.request_id) if self.tracer else []
                self._reply(TraceReport(stage=stage, request_id=msg.request_id, spans=spans))
            case DigestRequest():
                digests = self._record().digests.get(msg.request_id, [])
                self._reply(DigestReport(stage=stage, request_id=msg.request_id, digests=digests))
            case _:
                served.handle(sender, msg, rx)
        return False

    def _reply(self, msg: Message) -> None:
        _reply(self.transport, self.seed, msg, self.log)
