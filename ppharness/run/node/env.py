"""A node's inputs from its environment (the node contract, ``ppharness.run.node.node``): its program, the run's network
emulation, and its transport, started behind the network emulation and, on the packet layer, its bridge."""

from __future__ import annotations

import sys

import msgspec

from ppharness.errors import HarnessError
from ppharness.network.bridge import Bridge
from ppharness.network.clock import EventClock
from ppharness.network.packet import decode_ports, loopback_up, start_bridge
from ppharness.network.spec import SEED_NODE, Network, stage_node
from ppharness.plan.stages import StagePlan, decode_program
from ppharness.registry import impaired_transport, transport_class
from ppharness.run.node.address import SOCKET_OPTIONS, describe, published
from ppharness.seams.transport import JsonObject, Transport

REQUIRED_ENV = ("STAGE", "NUM_STAGES", "SEED_ADDR", "MODEL", "PLAN", "TRANSPORT")
STANDBY_NODE = "standby"  # a standby's name in the network emulation until it becomes a stage
GROUP_ENV = "PP_GROUP"  # a node serving co-located stages: each member's own environment (ppharness.run.node.colocated)


def node_log(stage: int | str, text: str) -> None:
    """One line of a node's log, on stderr, naming its stage."""
    print(f"[pp-node stage {stage}] {text}", file=sys.stderr, flush=True)


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
    plus the bind/advertise address the environment gives (``ppharness.run.node.address``; one log line says what it
    binds and advertises, and why) and ``extra``; with a message-level ``network``, impaired."""
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
    socket_opts, why = published(cls, env)
    why |= {name: "the node's network emulation" for name in extra if name in SOCKET_OPTIONS}
    opts |= socket_opts | extra
    node_log(env.get("STAGE") or STANDBY_NODE, describe(kind, opts, why))
    return cls(**opts)


def start_packet_bridge(network: Network, env: dict[str, str], clock: EventClock) -> tuple[Bridge, JsonObject]:
    """The packet layer: this node, in a network namespace of its own, reaches its peers through its bridge only;
    the transport options that go with it."""
    loopback_up()
    node = stage_node(int(env["STAGE"]))
    table = decode_ports(env.get("PP_NETWORK_PORTS", ""))
    bridge, options = start_bridge(network, node, table, env.get("PP_NETWORK_DIR", ""), clock)
    return bridge, dict(options)
