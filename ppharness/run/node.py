"""``pp-node``: the one process every provider starts, one per stage.

Inputs come from the environment (the node contract): ``STAGE``, ``NUM_STAGES``, ``SEED_ADDR`` (the orchestrator's
transport address), ``MODEL`` (GGUF path, URL or ``synthetic:`` spec), ``PLAN`` (the node's program from the compiled
plan, a JSON StagePlan: block range, plan id, the names to register, where activations come from and go, wire dtype,
timeouts), ``TRANSPORT`` (registry kind) and ``PP_RUN_LABEL``. Optional: ``PP_BIND_HOST`` and ``PP_ADVERTISE_HOST``
for transports that bind sockets.

The node joins the cluster, loads only its own layers, compiles its decode step, reports Ready, and serves until
Shutdown (exit 0). Any failure is reported to the seed as an Error message with one line of reason, then exit 1.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from ppharness.errors import CodecError, HarnessError, TransportTimeout
from ppharness.model.decoding import warm_up
from ppharness.network.bridge import Bridge
from ppharness.network.clock import EventClock
from ppharness.network.packet import decode_ports, loopback_up, start_bridge
from ppharness.network.spec import SEED_NODE, Network, stage_node
from ppharness.plan.stages import StagePlan, decode_program
from ppharness.registry import impaired_transport, transport_class
from ppharness.run.cluster import resolve_members
from ppharness.run.experts import ExpertParallel, ExpertServer, warm_bank
from ppharness.run.membership import NodeMembership
from ppharness.run.reliable import ack_of
from ppharness.seams.transport import JsonObject, Received, Transport
from ppharness.testing.faults import with_fault
from ppharness.trace.tracer import Tracer, now_ns
from ppharness.wire.messages import (
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
)

if TYPE_CHECKING:
    from tinygrad.apps.llm import SimpleTokenizer

    from ppharness.model.moe import ExpertBank
    from ppharness.model.slicing import GGUFFile, ModelSlice

REQUIRED_ENV = ("STAGE", "NUM_STAGES", "SEED_ADDR", "MODEL", "PLAN", "TRANSPORT")
STANDBY_ENV = ("PP_STANDBY", "SEED_ADDR", "MODEL", "TRANSPORT")
STANDBY_NODE = "standby"  # a standby's name in the network emulation until it becomes a stage


def _log(stage: int | str, text: str) -> None:
    print(f"[pp-node stage {stage}] {text}", file=sys.stderr, flush=True)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def device_bytes() -> int:
    """Bytes of tinygrad buffers this process holds on its device (0 before tinygrad is imported)."""
    helpers = sys.modules.get("tinygrad.helpers")
    return int(helpers.GlobalCounters.mem_used) if helpers is not None else 0


def read_env(env: dict[str, str]) -> tuple[StagePlan, dict[str, str]]:
    missing = [k for k in REQUIRED_ENV if not env.get(k)]
    if missing:
        raise HarnessError(
            f"missing environment variable(s) {', '.join(missing)}; pp-node needs {', '.join(REQUIRED_ENV)}"
        )
    plan = decode_program(env["PLAN"])
    if str(plan.stage) != env["STAGE"] or str(plan.num_stages) != env["NUM_STAGES"]:
        raise HarnessError(
            f"PLAN says stage {plan.stage} of {plan.num_stages}, but STAGE={env['STAGE']} "
            f"NUM_STAGES={env['NUM_STAGES']}"
        )
    return plan, env


def read_network(env: dict[str, str]) -> Network | None:
    """The run's network emulation (``PP_NETWORK``: the scenario's ``network`` section as JSON), if any."""
    text = env.get("PP_NETWORK")
    if not text:
        return None
    try:
        return msgspec.json.decode(text, type=Network)
    except msgspec.DecodeError as exc:
        raise HarnessError(f"PP_NETWORK is not a network section: {exc}") from exc


def make_transport(
    kind: str,
    env: dict[str, str],
    network: Network | None = None,
    clock: EventClock | None = None,
    extra: JsonObject | None = None,
) -> Transport:
    """The node's transport: options from ``PP_TRANSPORT_OPTS`` (JSON, made by the transport's ``plan_endpoints``)
    plus the bind/advertise hosts of providers that set them and ``extra``; with a message-level ``network``,
    impaired."""
    transport = _plain_transport(kind, env, extra or {})
    if network is None or network.layer != "message":
        return transport
    node = stage_node(int(env["STAGE"])) if env.get("STAGE") else STANDBY_NODE
    return impaired_transport(transport, network, node, clock or EventClock(), {env["SEED_ADDR"]: SEED_NODE})


def _plain_transport(kind: str, env: dict[str, str], extra: JsonObject) -> Transport:
    cls = transport_class(kind)
    try:
        opts = msgspec.json.decode(env.get("PP_TRANSPORT_OPTS") or "{}", type=JsonObject)
    except msgspec.DecodeError as exc:
        raise HarnessError(f"PP_TRANSPORT_OPTS is not a JSON object: {exc}") from exc
    if env.get("PP_BIND_HOST"):
        opts["host"] = env["PP_BIND_HOST"]
    if env.get("PP_ADVERTISE_HOST"):
        opts["advertise_host"] = env["PP_ADVERTISE_HOST"]
    return cls(**(opts | extra))


def start_packet_bridge(network: Network, env: dict[str, str], clock: EventClock) -> tuple[Bridge, JsonObject]:
    """The packet layer: this node, in a network namespace of its own, reaches its peers through its bridge only;
    the transport options that go with it."""
    loopback_up()
    node = stage_node(int(env["STAGE"]))
    table = decode_ports(env.get("PP_NETWORK_PORTS", ""))
    bridge, options = start_bridge(network, node, table, env.get("PP_NETWORK_DIR", ""), clock)
    return bridge, dict(options)


def load_stage_model(
    model_source: str, plan: StagePlan, gguf_file: GGUFFile | None = None
) -> tuple[ModelSlice, SimpleTokenizer | None, float]:
    """(ModelSlice, tokenizer or None, seconds): only this stage's tensors, decode step compiled and warmed.
    ``gguf_file``: the model file, when already open."""
    from ppharness.model.files import resolve_model
    from ppharness.model.slicing import GGUFFile, ModelSlice

    t0 = time.monotonic()
    if gguf_file is None:
        gguf_file = GGUFFile(resolve_model(model_source))
    model = ModelSlice(
        gguf_file, plan.lo, plan.hi, plan.first, plan.last, plan.max_context, experts=plan.experts, slots=plan.slots
    )
    tokenizer = gguf_file.tokenizer if plan.first or plan.last else None
    warm_up(model)
    return model, tokenizer, time.monotonic() - t0


def load_expert_bank(model_source: str, plan: StagePlan) -> tuple[ExpertBank, float]:
    """An expert node's bank: the routed experts its program names, loaded and compiled. (bank, seconds)"""
    from ppharness.model.files import resolve_model
    from ppharness.model.moe import ExpertBank
    from ppharness.model.slicing import GGUFFile

    t0 = time.monotonic()
    bank = ExpertBank(GGUFFile(resolve_model(model_source)), plan.experts or {})
    warm_bank(bank)
    return bank, time.monotonic() - t0


def _idle_until_orphaned(parent: int) -> int:
    """Do nothing (a fault under test) until the process that started this node is gone."""
    while os.getppid() == parent:
        time.sleep(0.5)
    return 1


# what only the orchestrator may send a node; replies go to the orchestrator, never to an address a frame names
CONTROL = (Shutdown, ClockProbe, TraceRequest, DigestRequest, NetworkStart, Members)


def _reply(transport: Transport, seed: str, msg: Message, log: Callable[[str], None]) -> None:
    """Answer the orchestrator; a failed answer is logged, never fatal (the orchestrator notices the silence)."""
    try:
        transport.send(seed, msg)
    except HarnessError as exc:
        log(f"could not answer the orchestrator with {type(msg).__name__}: {exc}")


@dataclass
class Standing:
    """What a standby spare prepared before it was assigned a stage: its started transport and the open model."""

    transport: Transport
    address: str
    clock: EventClock
    gguf_file: GGUFFile | None


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
        assigned = _await_assignment(transport, seed, clock, parent, log)
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
    return serve(plan, env, Standing(transport, address, clock, gguf_file))


def _await_assignment(
    transport: Transport, seed: str, clock: EventClock, parent: int, log: Callable[[str], None]
) -> tuple[StagePlan, str] | None:
    """Wait for the orchestrator's Assign: (the program, the gossip name); None on Shutdown. Anything else, and
    anything from another member, is dropped."""
    while True:
        try:
            rx = transport.receive(1.0)
        except TransportTimeout:
            if os.getppid() != parent:
                raise HarnessError("the process that started this node is gone") from None
            continue
        except CodecError as exc:
            log(f"dropped a bad frame: {exc}")
            continue
        if rx.sender != seed:
            log(f"dropped {type(rx.message).__name__} from {rx.sender[:120]}: a standby takes orders from the seed")
            continue
        match rx.message:
            case Shutdown():
                log("shutting down unused")
                return None
            case Assign(program=program, gossip_name=gossip):
                return decode_program(program), gossip
            case NetworkStart(t0_unix_ns=t0):
                clock.start(t0)
            case other:
                log(f"dropped {type(other).__name__}: a standby waits for an Assign")


def _prepare(model: str, max_context: int, log: Callable[[str], None]) -> GGUFFile | None:
    """What a node does before its blocks that does not depend on which blocks: opening the model file, then loading
    one block with the run's context and compiling its prefill and decode step (then dropping it). Every block of a
    model has the same shapes, and tinygrad keeps what it scheduled and compiled for the whole process, so the range
    the standby is later assigned loads and warms up several times faster (on the tiny model, 0.3 s and 0.8 s instead
    of 2.1 s and 2.3 s). It costs one block's memory while it lasts."""
    from ppharness.model.files import resolve_model
    from ppharness.model.slicing import GGUFFile, ModelSlice

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


def serve(plan: StagePlan, env: dict[str, str], standing: Standing | None = None) -> int:
    """Serve stage ``plan.stage`` until Shutdown; ``standing``: what a standby spare prepared (its transport is
    started and has joined as a spare)."""
    from ppharness.run.reliable import RetryPolicy
    from ppharness.run.stage import Stage, StageModel

    seed = env["SEED_ADDR"]

    def log(text: str) -> None:
        _log(plan.stage, text)

    parent = os.getppid()
    bridge: Bridge | None = None
    gguf_file: GGUFFile | None = None
    if standing is not None:
        transport, address, clock, gguf_file = standing.transport, standing.address, standing.clock, standing.gguf_file
    else:
        try:
            network = read_network(env)
            clock = EventClock()
            extra: JsonObject = {}
            if network is not None and network.layer == "packet":
                bridge, extra = start_packet_bridge(network, env, clock)
            transport = make_transport(env["TRANSPORT"], env, network, clock, extra)
            address = transport.start()
        except HarnessError as exc:
            log(f"failed: could not start the {env['TRANSPORT']} transport: {exc}")
            if bridge is not None:
                bridge.close()
            return 1

    fault = env.get("PP_FAULT", "")
    membership: NodeMembership | None = None
    try:
        if fault == "never-join":
            log("fault never-join: not joining the cluster")
            return _idle_until_orphaned(parent)
        names = [] if fault == "no-names" else plan.registers
        transport.send(
            seed,
            Join(
                stage=plan.stage,
                num_stages=plan.num_stages,
                address=address,
                names=names,
                run_label=env.get("PP_RUN_LABEL", ""),
                pid=os.getpid(),
            ),
        )
        membership = NodeMembership(env, plan.stage, seed, transport, log)
        log(
            f"joined seed {seed} from {address} ({membership.engine or 'no'} membership); "
            + (
                f"loading blocks [{plan.lo}, {plan.hi})"
                if plan.role == "stage"
                else f"loading experts of block(s) {', '.join(map(str, sorted(plan.experts or {})))}"
            )
        )
        bank: ExpertBank | None = None
        try:
            if plan.role == "experts":
                bank, load_s = load_expert_bank(env["MODEL"], plan)
                params, tied_params = bank.n_params, 0
            else:
                model, tokenizer, load_s = load_stage_model(
                    "/nonexistent/bad-model.gguf" if fault == "bad-model" else env["MODEL"], plan, gguf_file
                )
                params, tied_params = model.n_params, model.tied_params
        except Exception as exc:
            raise HarnessError(f"loading the model failed: {type(exc).__name__}: {exc}") from exc
        log(f"loaded {params} parameters and compiled the decode step in {load_s:.1f} s")
        if fault == "stall-before-ready":
            log("fault stall-before-ready: never reporting Ready")
            return _idle_until_orphaned(parent)

        early: list[tuple[str, Message]] = []
        directory = resolve_members(transport.recv, plan.resolve_s, lambda s, m: early.append((s, m)), log=log)
        _reply(transport, seed, ack_of("members", address, plan.epoch, plan.plan_id), log)  # resent till then
        tracer = Tracer() if plan.trace else None
        fanout: ExpertParallel | None = None
        stage: Stage | ExpertServer
        if bank is not None:
            stage = ExpertServer(bank, transport, directory, plan.owners, plan.plan_id, plan.wire_dtype, log)
        else:
            served_model: StageModel = with_fault(model, fault)
            if plan.experts is not None and model.config.moe:  # the plan puts (some of) its blocks' experts elsewhere
                fanout = ExpertParallel(
                    model, transport, directory, plan.plan_id, plan.wire_dtype, log, tracer, plan.ack_timeout_s * 4
                )
                served_model = fanout
            stage = Stage(
                plan.stage,
                plan.num_stages,
                served_model,
                transport,
                directory,
                plan.plan_id,
                plan.wire_dtype,
                tokenizer,
                log=log,
                tracer=tracer,
                seed=seed,
                route=(plan.prev, plan.next),
                policy=plan.fault_tolerance,
                retry=RetryPolicy(first_s=plan.ack_timeout_s, max_s=plan.retry_max_s, budget_s=plan.retry_budget_s),
                epoch=plan.epoch,
                queue=plan.queue,
            )
        transport.send(
            seed,
            Ready(
                stage=plan.stage,
                params=params,
                tied_params=tied_params,
                load_s=load_s,
                rss_bytes=peak_rss_bytes(),
            ),
        )
        while True:
            rx: Received | None = None
            stage.tick()  # resend what waits for an acknowledgement too long
            kept = fanout.take_deferred() if fanout is not None else None
            if kept is not None:
                sender, msg, rx = kept
            elif early:
                sender, msg = early.pop(0)
            else:
                due = stage.due_in()
                try:
                    rx = transport.receive(1.0 if due is None else min(1.0, max(due, 0.001)))
                    sender, msg = rx.sender, rx.message
                except TransportTimeout:
                    if os.getppid() != parent:
                        log("the process that started this node is gone; exiting")
                        return 1
                    continue
                except CodecError as exc:
                    log(f"dropped a bad frame: {exc}")
                    continue
            if isinstance(msg, CONTROL) and sender != seed:
                log(f"dropped {type(msg).__name__} from {sender[:120]}: only the orchestrator sends it")
                continue
            match msg:
                case Shutdown():
                    _reply(
                        transport,
                        seed,
                        Stopped(
                            stage=plan.stage,
                            served=stage.served,
                            peak_rss_bytes=peak_rss_bytes(),
                            device_bytes=device_bytes(),
                        ),
                        log,
                    )
                    log(f"shutting down after {stage.served} request(s)")
                    return 0
                case NetworkStart():
                    clock.start(msg.t0_unix_ns)
                case Members():
                    stage.rejoin(msg.names, msg.epoch)
                    if fanout is not None:
                        fanout.set_directory(msg.names, msg.epoch)
                    _reply(transport, seed, ack_of("members", address, msg.epoch, plan.plan_id), log)
                case ExpertResult():  # a copy of an answer whose step is done
                    if fanout is not None:
                        fanout.late += 1
                case ClockProbe():
                    _reply(
                        transport, seed, ClockReply(stage=plan.stage, t_seed_ns=msg.t_seed_ns, t_node_ns=now_ns()), log
                    )
                case TraceRequest():
                    spans = tracer.take(msg.request_id) if tracer else []
                    _reply(transport, seed, TraceReport(stage=plan.stage, request_id=msg.request_id, spans=spans), log)
                case DigestRequest():
                    _reply(
                        transport,
                        seed,
                        DigestReport(
                            stage=plan.stage, request_id=msg.request_id, digests=stage.digests.get(msg.request_id, [])
                        ),
                        log,
                    )
                case _:
                    stage.handle(sender, msg, rx)
    except HarnessError as exc:
        log(f"failed: {exc}")
        try:
            transport.send(seed, Error(stage=plan.stage, reason=str(exc)))
        except HarnessError:
            pass
        return 1
    finally:
        if membership is not None:
            membership.close()
        transport.close()
        if bridge is not None:
            bridge.close()


def main() -> None:
    if os.environ.get("PP_STANDBY"):
        sys.exit(stand_by(dict(os.environ)))
    try:
        plan, env = read_env(dict(os.environ))
    except HarnessError as exc:
        _log(os.environ.get("STAGE", "?"), f"failed: {exc}")
        sys.exit(1)
    sys.exit(serve(plan, env))


if __name__ == "__main__":
    main()
