"""Plan -> run: the plan a scenario's run realises, and a pure function from (scenario, compiled plan, the run's
addresses) to every node's spec.

What the orchestrator hands each provider is decided here, with no I/O: the node contract's environment (the node's
compiled program as ``PLAN``), the membership settings, the faults the scenario injects, the run's network and the
node's own limits from its device. The orchestrator's session (``ppharness.run.seed.session``) does the I/O: starting
the seed's endpoint, provisioning these specs, and the phases (join, ready, request, shutdown).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from ppharness.errors import PlanError
from ppharness.model.layers.kernels import TABLE_ENV
from ppharness.model.synthetic.spec import preset_spec, synthetic_source
from ppharness.network.packet import PortTable, encode_ports
from ppharness.plan.compile import Compiled, check_model, compile_plan, load_compiled, programs, scenario_plan
from ppharness.plan.graph import file_sha256, model_graph
from ppharness.plan.stages import StagePlan, StageSettings, encode_program, expert_node_name, stage_name
from ppharness.run.node.env import GROUP_ENV

if TYPE_CHECKING:
    from ppharness.network.spec import Network
    from ppharness.plan.lang.document import Device, PlanDoc
    from ppharness.scenario.schema import Scenario
    from ppharness.scenario.sections import TransportSection
    from ppharness.seams.provider import NodeOptions
    from ppharness.seams.transport import JsonObject


@dataclass(frozen=True)
class Endpoints:
    """Where the run's nodes find the seed and each other: the seed's address, the model as nodes read it, each
    node's transport options, the membership's environment, and the packet layer's ports and bridge folder."""

    seed: str
    node_model: str
    transport_opts: list[JsonObject]  # per node, in loop order (then the spares')
    membership_env: dict[str, str] = field(default_factory=dict)
    network: Network | None = None
    ports: PortTable = field(default_factory=dict)
    bridge_dir: str = ""
    kernel_table: str = ""  # the run's kernel table (model/kernels.py), handed to every node; "" without one


@dataclass(frozen=True)
class NodeRequest:
    """One node for the provider: ``Provider.spec(name, env, **options)``."""

    name: str
    env: dict[str, str]
    options: NodeOptions
    program: StagePlan | None  # None: a standby spare, which gets its program when it takes over a stage
    stages: tuple[int, ...] = ()  # a node serving co-located stages: them (its program is the first one's)


def model_source(scenario: Scenario) -> tuple[str, str | None]:
    """The scenario's model as a source string for ``resolve_model`` (and its sha256)."""
    m = scenario.model
    if m.synthetic is not None:
        s = m.synthetic
        spec = preset_spec(
            s.preset, seed=s.seed, blocks=s.blocks, dim=s.dim, tied_embeddings=s.tied_embeddings, type=s.type
        )
        return synthetic_source(spec), None
    assert m.gguf is not None  # a model section has exactly one of synthetic and gguf
    return m.gguf, m.sha256


def realise_plan(scenario: Scenario, source: str, model_path: str) -> tuple[PlanDoc, Compiled]:
    """The plan a run of ``scenario`` realises, compiled: its plan file (compiled once, when the scenario was read;
    checked against the model file the run resolved), else the chain its stages section describes."""
    compiled: Compiled | None = None
    if scenario.plan is not None:
        doc, compiled = load_compiled(scenario.plan)
        check_model(doc, file_sha256(model_path), model_path, scenario.plan)
    else:
        graph = model_graph(model_path, source, scenario.model.max_context, scenario.transport.wire_dtype, digest=False)
        st = scenario.stages
        # an even split under the default rule is the plan's "even" policy; another rule's cuts are explicit
        splits = list(st.splits) if st.splits else None
        if splits is None and st.split_rule != "balanced":
            splits = [hi for _, hi in st.ranges(len(graph.blocks))[:-1]]
        doc = scenario_plan(
            graph,
            st.num_stages,
            splits,
            scenario.provider.kind,
            scenario.fault_tolerance.spares,
            requests=scenario.serving.slots,
            colocated=st.placement == "colocated",
        )
    slots, counted = scenario.serving.slots, doc.placement.objective.requests
    if slots > counted:
        raise PlanError(
            f"{scenario.plan}: $.placement.objective.requests: the plan counts the KV cache of {counted} request(s) "
            f"per stage, the scenario serves {slots} at once (serving.slots) — make the plan with --requests {slots} "
            "or lower serving.slots"
        )
    compiled = compiled if compiled is not None else compile_plan(doc)
    shared = [d for d, k in Counter(n.device for n in compiled.doc.placement.nodes).items() if k > 1]
    if shared and fault_policy(scenario, compiled) == "failover":
        raise PlanError(
            f"{scenario.plan or 'the scenario'}: $.fault_tolerance.policy: failover replaces one stage's process, but "
            f"device {shared[0]!r} runs several stages in one process (co-located) — set policy none or retry, or "
            "place one stage per device"
        )
    return doc, compiled


def transport_settings(section: TransportSection) -> JsonObject:
    """The scenario's transport section less what every transport shares (kind, wire dtype)."""
    return {k: v for k, v in msgspec.structs.asdict(section).items() if k not in ("kind", "wire_dtype")}


def fault_policy(scenario: Scenario, compiled: Compiled) -> str:
    """The run's fault-tolerance policy: the scenario's, else the plan's, else none."""
    return scenario.fault_tolerance.policy or compiled.doc.placement.fault_tolerance or "none"


def _settings(scenario: Scenario, compiled: Compiled, trace: bool) -> StageSettings:
    budget, ft = scenario.budget, scenario.fault_tolerance
    return StageSettings(
        wire_dtype=scenario.transport.wire_dtype,
        max_context=scenario.model.max_context,
        slots=scenario.serving.slots,
        batched=scenario.serving.batched,
        max_batch=scenario.serving.max_batch,
        speculate=scenario.serving.speculate,
        windows=scenario.serving.windows,
        queue=scenario.serving.queue,
        join_s=budget.join_s,
        resolve_s=budget.resolve_s,
        trace=trace,
        fault_tolerance=fault_policy(scenario, compiled),
        ack_timeout_s=ft.ack_timeout_s,
        retry_max_s=ft.retry_max_s,
        retry_budget_s=budget.total_s,
    )


def realise(scenario: Scenario, compiled: Compiled, at: Endpoints, trace: bool) -> list[NodeRequest]:
    """Every node of the run: the loop's stages in order, then the expert nodes. Consecutive stages the plan puts on
    one device are one node, which serves them all (``ppharness.run.node.colocated``)."""
    progs = programs(compiled, _settings(scenario, compiled, trace))
    devices = compiled.all_devices
    nodes = [_node(scenario, at, program, devices[i], at.transport_opts[i]) for i, program in enumerate(progs)]
    out: list[NodeRequest] = []
    for node in nodes:
        last = out[-1] if out else None
        program, before = node.program, last.program if last is not None else None
        if (
            last is None
            or program is None
            or before is None
            or program.role != "stage"
            or before.role != "stage"
            or program.device != before.device
        ):
            out.append(node)
            continue
        out[-1] = _grouped(last, node)
    return out


# what a member of a group has of its own; the rest of its environment is the group's
MEMBER_ENV = ("STAGE", "PLAN", "PP_TRANSPORT_OPTS", "PP_FAULT", "PP_GOSSIP_NAME")


def _grouped(group: NodeRequest, node: NodeRequest) -> NodeRequest:
    """``group`` (one node, or a group already) serving ``node``'s stage too."""
    members: list[dict[str, str]]
    if GROUP_ENV in group.env:
        members = json.loads(group.env[GROUP_ENV])
    else:
        members = [{k: group.env[k] for k in MEMBER_ENV if k in group.env}]
    members.append({k: node.env[k] for k in MEMBER_ENV if k in node.env})
    env = {k: v for k, v in group.env.items() if k not in MEMBER_ENV} | {GROUP_ENV: json.dumps(members)}
    env["STAGE"] = members[0]["STAGE"]  # the group's first stage, as providers and reapers see it
    first = group.stages[0] if group.stages else int(group.env["STAGE"])
    last = int(node.env["STAGE"])
    return NodeRequest(
        f"{stage_name(first)}-{last}", env, group.options, group.program, stages=tuple(range(first, last + 1))
    )


def replacement(
    scenario: Scenario,
    compiled: Compiled,
    at: Endpoints,
    stage: int,
    spare: Device,
    epoch: int,
    transport_opts: JsonObject,
    trace: bool,
) -> NodeRequest:
    """The node that takes over ``stage`` on the spare device ``spare``, in the membership epoch ``epoch``."""
    program = programs(compiled, _settings(scenario, compiled, trace))[stage]
    program = msgspec.structs.replace(program, device=spare.id, epoch=epoch)
    node = _node(scenario, at, program, spare, transport_opts)
    if at.membership_env.get("PP_MEMBERSHIP") == "kinship":  # gossip knows the dead node by its name for good
        node.env["PP_GOSSIP_NAME"] = gossip_name(stage, epoch)
    return node


def standby(scenario: Scenario, at: Endpoints, spare: Device, transport_opts: JsonObject, k: int) -> NodeRequest:
    """A standby spare on ``spare``: started with the run, it joins as a spare and prepares what does not depend on
    a stage (``ppharness.run.node.node.stand_by``) until the orchestrator assigns it a dead stage's program."""
    env = {
        "PP_STANDBY": spare.id,
        "PP_MAX_CONTEXT": str(scenario.model.max_context),
        "SEED_ADDR": at.seed,
        "MODEL": at.node_model,
        "TRANSPORT": scenario.transport.kind,
    } | at.membership_env
    if at.kernel_table:
        env[TABLE_ENV] = at.kernel_table
    if at.network is not None:
        env["PP_NETWORK"] = msgspec.json.encode(at.network).decode()
    if transport_opts:
        env["PP_TRANSPORT_OPTS"] = json.dumps(transport_opts)
    return NodeRequest(f"pp-spare-{k}", env, _options(at, spare), None)


def gossip_name(stage: int, epoch: int) -> str:
    """The name stage ``stage``'s node gossips under: a replacement's carries its epoch."""
    return stage_name(stage) if epoch == 0 else f"{stage_name(stage)}.{epoch}"


def _node(scenario: Scenario, at: Endpoints, program: StagePlan, device: Device, opts: JsonObject) -> NodeRequest:
    i, n = program.stage, program.num_stages
    env = {
        "STAGE": str(i),
        "NUM_STAGES": str(n),
        "SEED_ADDR": at.seed,
        "MODEL": at.node_model,
        "TRANSPORT": scenario.transport.kind,
        "PLAN": encode_program(program),
    } | at.membership_env
    if at.kernel_table:
        env[TABLE_ENV] = at.kernel_table
    for fault in scenario.faults:
        if fault.stage == i and program.epoch == 0:  # a replacement does not inherit the fault it replaces
            env["PP_FAULT"] = fault.mode
    if at.network is not None:
        env["PP_NETWORK"] = msgspec.json.encode(at.network).decode()
    if at.ports:
        env["PP_NETWORK_PORTS"] = encode_ports(at.ports)
        env["PP_NETWORK_DIR"] = at.bridge_dir
    if opts:
        env["PP_TRANSPORT_OPTS"] = json.dumps(opts)
    name = stage_name(i) if program.role == "stage" else expert_node_name(i - n)
    return NodeRequest(name, env, _options(at, device), program)


def _options(at: Endpoints, device: Device) -> NodeOptions:
    src = device.source
    options: NodeOptions = {"own_network": bool(at.ports), "host": src.host, "gpu": src.gpu, "offer": src.offer}
    if src.kind == "docker":
        options["cpus"] = src.cpus
        options["memory"] = src.memory_limit  # None: the run's docker settings decide
    return options
