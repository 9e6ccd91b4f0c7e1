"""Scenario YAML v1: what to run, decoded straight into frozen msgspec structs.

A scenario names a model (a synthetic preset or a GGUF file), how its blocks are split into stages, the transport and
provider kinds, one request, what to expect of the answer and the time budgets. ``load_scenario`` turns a file into a
``Scenario`` or raises ``ScenarioError`` naming the file, the ``$.field.path`` and the fix; ``scenario_from_args``
builds one in code for the CLI when no file is given; ``scenario_schema`` is the JSON Schema for editors.

A file is read only up to ``MAX_FILE_BYTES`` and screened by ``ppharness.scenario.yaml_limits`` (depth, value size,
aliases expanded, duplicate keys) before it is decoded. When the model is known without running anything (a synthetic
preset, or a local GGUF file's header) the split, ``max_context`` and the prompt's length are checked against it too.
"""

from __future__ import annotations

import functools
import importlib
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeAlias, TypeVar

import msgspec
from msgspec import UNSET, Meta, UnsetType

from ppharness import registry
from ppharness.errors import HarnessError, ModelError, ScenarioError
from ppharness.network.spec import SEED_NODE, Network
from ppharness.scenario.explain import FieldError, explain, explain_yaml, show, untyped
from ppharness.scenario.yaml_limits import MAX_FILE_BYTES, MAX_SCALAR_BYTES, PLAN_LIMITS, YamlLimit, screen

SCENARIO_VERSION: Final = 1
WIRE_DTYPES = ("f16", "bf16", "f32")
MAX_SECONDS = 86_400.0  # a day: the longest any budget, timeout or interval may be
# transports whose endpoints live in one process; every provider in registry.PROVIDERS runs each stage as a process
# (or a container, or a machine) of its own, so a scenario cannot use these
ONE_PROCESS_TRANSPORTS = ("memory",)
# providers that can stop, resume and kill a node on a network event's orders
NODE_SIGNAL_PROVIDERS = ("local", "docker")
# providers that run a node in a network namespace of its own (NodeSpec.own_network): the packet layer
PACKET_LAYER_PROVIDERS = ("local", "docker")

PositiveInt = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(gt=0, le=MAX_SECONDS, description="seconds, more than 0 and at most 86400 (a day)")]
Minutes = Annotated[float, Meta(gt=0, le=MAX_SECONDS / 60, description="minutes, more than 0 and at most 1440")]


# ``frozen`` is inherited at run time; every section repeats ``frozen=True`` because a type checker reads a Struct as a
# dataclass (PEP 681), and takes a subclass that does not say frozen as not frozen
class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class SyntheticModel(_Section, frozen=True):
    """A model ppharness makes itself from a named preset, with optional overrides."""

    preset: Annotated[str, Meta(min_length=1)] = "tiny"
    seed: Annotated[int, Meta(ge=0)] = 0
    blocks: PositiveInt | None = None
    dim: PositiveInt | None = None
    tied_embeddings: bool | None = None
    type: Annotated[str, Meta(description="how the weight matrices are stored: f16, q8_0 or q4_0")] = "f16"

    def __post_init__(self) -> None:
        try:
            modelfile = importlib.import_module("ppharness.model.files")
        except ImportError:
            return
        presets = getattr(modelfile, "PRESETS", None)
        if presets is not None and self.preset not in presets:
            raise FieldError("preset", f"unknown preset {show(self.preset)} — expected one of: {', '.join(presets)}")
        types = getattr(modelfile, "WEIGHT_TYPES", None)
        if types is not None and self.type.lower() not in types:
            raise FieldError("type", f"unknown weight type {show(self.type)} — expected one of: {', '.join(types)}")
        preset_spec = getattr(modelfile, "preset_spec", None)
        if preset_spec is not None:
            try:
                preset_spec(
                    self.preset,
                    seed=self.seed,
                    blocks=self.blocks,
                    dim=self.dim,
                    tied_embeddings=self.tied_embeddings,
                    type=self.type,
                )
            except ModelError as exc:
                raise FieldError("", f"{exc} — change the preset's overrides or the type") from None


class ModelSection(_Section, frozen=True):
    """Exactly one of ``synthetic`` and ``gguf``; ``max_context`` is the KV cache length every stage allocates."""

    synthetic: SyntheticModel | None = None
    gguf: Annotated[str, Meta(min_length=1, description="a local path or an http(s) URL of a GGUF file")] | None = None
    sha256: Annotated[str, Meta(pattern=r"^[0-9a-fA-F]{64}$", description="hex SHA-256 of the GGUF file")] | None = None
    max_context: Annotated[int, Meta(ge=16)] = 256

    def __post_init__(self) -> None:
        if self.synthetic is not None and self.gguf is not None:
            raise FieldError("", "both synthetic and gguf are set — keep exactly one")
        if self.synthetic is None and self.gguf is None:
            raise FieldError(
                "", "neither synthetic nor gguf is set — add `synthetic: {preset: tiny}` or `gguf: <path or URL>`"
            )
        if self.gguf is not None and "://" in self.gguf:
            scheme = self.gguf.split("://", 1)[0].lower()
            if scheme not in ("http", "https"):
                raise FieldError("gguf", f"unsupported URL scheme {show(scheme)} — use a local path or an http(s) URL")
        if self.sha256 is not None and self.gguf is None:
            raise FieldError("sha256", "sha256 applies only to a gguf file — remove it or set gguf")


class Stages(_Section, frozen=True):
    """How the blocks are split: ``count`` even stages (the last takes the remainder) or explicit split points."""

    count: PositiveInt | UnsetType = UNSET
    splits: tuple[Annotated[int, Meta(ge=1)], ...] | None = None

    def __post_init__(self) -> None:
        if self.splits is None:
            if self.count is UNSET:
                msgspec.structs.force_setattr(self, "count", 2)
            return
        for i in range(1, len(self.splits)):
            if self.splits[i] <= self.splits[i - 1]:
                raise FieldError(
                    f"splits[{i}]",
                    f"split point {self.splits[i]} follows {self.splits[i - 1]} — split points must be strictly "
                    "increasing block indices",
                )
        implied = len(self.splits) + 1
        if self.count is UNSET:
            msgspec.structs.force_setattr(self, "count", implied)
        elif self.count != implied:
            raise FieldError(
                "count",
                f"count is {self.count} but {len(self.splits)} split points make {implied} stages — "
                f"set count: {implied} or leave count out",
            )

    @property
    def num_stages(self) -> int:
        """The stage count as a plain int (``count`` is always set once the struct exists)."""
        assert isinstance(self.count, int)
        return self.count

    def ranges(self, num_blocks: int) -> list[tuple[int, int]]:
        """Half-open block ranges ``[start, end)`` of each stage for a model with ``num_blocks`` blocks."""
        from ppharness.plan.stages import make_plan

        splits = list(self.splits) if self.splits else None
        return list(make_plan(num_blocks, self.num_stages, splits).ranges)


RELAY_HELP = (
    "iroh only: 'disabled' (default; loopback/LAN, no relay, no discovery: no traffic leaves the machine) "
    "or 'default' (WAN through the n0 public relays; direct addresses whenever they work)"
)


class TransportSection(_Section, frozen=True):
    """How stages talk: a kind from ``ppharness.registry.TRANSPORTS``, the dtype hidden states travel in and, for
    iroh, the relay mode."""

    kind: str = "zmq"
    wire_dtype: Literal["f16", "bf16", "f32"] = "f16"
    relay: Annotated[Literal["disabled", "default"], Meta(description=RELAY_HELP)] | None = None

    def __post_init__(self) -> None:
        if self.kind not in registry.TRANSPORTS:
            known = ", ".join(sorted(registry.TRANSPORTS))
            raise FieldError("kind", f"unknown transport kind {show(self.kind)} — expected one of: {known}")
        if self.relay is not None and self.kind != "iroh":
            raise FieldError(
                "relay", f"relay applies only to the iroh transport, not {self.kind!r} — remove relay or set kind: iroh"
            )


class LocalSettings(_Section, frozen=True):
    """Settings of the ``local`` provider. ``fail_destroy`` is a fault switch for failure-mode tests: destroying
    these stages' processes reports an error and leaves them running (for ``ppharness reap`` to find)."""

    fail_destroy: tuple[Annotated[int, Meta(ge=0)], ...] = ()


class DockerSettings(_Section, frozen=True):
    """Settings of the ``docker`` provider, all optional. ``image``: run this node image as is (no build);
    ``base_image``: build ``docker/Dockerfile`` on this image (e.g. ``python:3.11-slim-bookworm``, pulled by the daemon)
    instead of the Debian base built locally; ``subnet``: the run network (default: a free /24 of 10.213.0.0/16;
    IPv4, /28 or larger, host bits zero); ``cpus`` and ``memory``: limits per container (``memory`` as Docker writes
    it: ``512m``, ``2g``)."""

    image: Annotated[str, Meta(min_length=1)] | None = None
    base_image: Annotated[str, Meta(min_length=1)] | None = None
    subnet: Annotated[str, Meta(min_length=1, max_length=64, description="IPv4 network, /28 or larger")] | None = None
    cpus: Annotated[float, Meta(gt=0, le=1024)] | None = None
    memory: Annotated[str, Meta(pattern=r"^[0-9]{1,15}[bkmgBKMG]?$")] | None = None

    def __post_init__(self) -> None:
        if self.image is not None and self.base_image is not None:
            raise FieldError(
                "base_image", "base_image applies only when the image is built, and image is given — keep one of them"
            )
        if self.subnet is not None:
            _check_subnet(self.subnet)


def _check_subnet(text: str) -> None:
    """The same rule as the docker provider's: an IPv4 network, host bits zero, /28 or larger."""
    example = "e.g. 10.213.5.0/24"
    try:
        net = ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise FieldError(
            "subnet", f"{show(text)} is not an IP network — write an IPv4 network as address/prefix, {example}"
        ) from None
    if not isinstance(net, ipaddress.IPv4Network):
        raise FieldError("subnet", f"{show(text)} is an IPv6 network — the run network is IPv4, {example}")
    try:
        ipaddress.ip_network(text, strict=True)
    except ValueError:
        raise FieldError("subnet", f"{show(text)} has host bits set — use the network's address: {net}") from None
    if net.prefixlen > 28:
        raise FieldError(
            "subnet",
            f"{show(text)} is a /{net.prefixlen}, too small for a run — use /28 or larger "
            f"(prefix length 28 or less), {example}",
        )


class VastaiSettings(_Section, frozen=True):
    """Settings of the ``vastai`` provider: the offer search (one instance per stage, cheapest match first: GPU model
    or models, GPUs per instance, GPU RAM in GB, $/hour per instance, reliability 0-1, CUDA version, direct ports),
    ``max_total_dph``, the cap on the whole plan's $/hour, the node image and disk, container ports to open
    (``7000`` or ``7000/udp``), the status poll interval (at least 10 s against vast.ai itself) and the minutes the
    printed cost estimate assumes. The API's address and key never come from a file: ``VAST_URL``/``--vastai-url``,
    ``VAST_API_KEY``/``--api-key``."""

    gpu_name: str | tuple[str, ...] | None = None
    num_gpus: PositiveInt = 1
    min_gpu_ram_gb: Annotated[float, Meta(ge=0, le=4096)] = 0.0
    max_dph: Annotated[float, Meta(gt=0, le=1000)] = 1.0
    max_total_dph: Annotated[float, Meta(gt=0, le=10000)] = 5.0
    min_reliability: Annotated[float, Meta(ge=0, le=1)] = 0.95
    min_cuda: Annotated[float, Meta(ge=0, le=100)] | None = None
    direct_ports: Annotated[int, Meta(ge=0, le=65535)] = 0
    ports: tuple[
        Annotated[str, Meta(pattern=r"^[0-9]{1,5}(/(tcp|udp))?$", description="1..65535, /tcp or /udp")], ...
    ] = ()
    image: Annotated[str, Meta(min_length=1, max_length=1024)] = "ppharness-node:latest"
    disk_gb: Annotated[int, Meta(ge=8, le=1 << 20)] = 16
    poll_s: Seconds = 10.0
    estimate_minutes: Minutes = 30.0

    def __post_init__(self) -> None:
        for i, port in enumerate(self.ports):
            number = int(port.partition("/")[0])
            if not 1 <= number <= 65535:
                raise FieldError(
                    f"ports[{i}]",
                    f"port {number} is outside 1..65535 — use a port number from 1 to 65535, e.g. '7000' or '7000/udp'",
                )


# what a provider kind's settings section can be (ppharness.seams.Provider's settings)
ProviderSettings: TypeAlias = LocalSettings | DockerSettings | VastaiSettings


class ProviderSection(_Section, frozen=True):
    """Where stages run: a kind from ``ppharness.registry.PROVIDERS``."""

    kind: str = "local"
    local: LocalSettings | None = None
    docker: DockerSettings | None = None
    vastai: VastaiSettings | None = None

    def __post_init__(self) -> None:
        if self.kind not in registry.PROVIDERS:
            known = ", ".join(sorted(registry.PROVIDERS))
            raise FieldError("kind", f"unknown provider kind {show(self.kind)} — expected one of: {known}")
        for kind in ("local", "docker", "vastai"):  # each settings field is named after its provider kind
            if getattr(self, kind) is not None and self.kind != kind:
                raise FieldError(
                    kind,
                    f"{kind} settings apply only to kind {kind}, not {self.kind!r} — remove them or set kind: {kind}",
                )
        if self.kind == "vastai" and self.vastai is None:
            msgspec.structs.force_setattr(self, "vastai", VastaiSettings())


class RequestSection(_Section, frozen=True):
    """The one request the run sends."""

    prompt: Annotated[
        str,
        Meta(
            min_length=1,
            max_length=MAX_SCALAR_BYTES,
            description="at most 262144 characters (in a file: 256 KiB of UTF-8)",
        ),
    ] = "The quick brown fox"
    max_tokens: Annotated[int, Meta(ge=1, le=4096)] = 16


class ServingSection(_Section, frozen=True):
    """Requests in flight: every stage keeps ``slots`` KV caches (one per request it serves at once); stage 0 keeps up
    to ``queue`` more requests waiting for a free slot and refuses the rest as busy."""

    slots: Annotated[int, Meta(ge=1, le=256)] = 1
    queue: Annotated[int, Meta(ge=0, le=65536)] = 64


class ExpectSection(_Section, frozen=True):
    """What the answer must satisfy: non-empty text, and the same tokens as the single-process oracle."""

    non_empty: bool = True
    match_oracle: bool = True


class BudgetSection(_Section, frozen=True):
    """Time budgets in seconds."""

    total_s: Seconds = 300.0
    join_s: Seconds = 120.0
    resolve_s: Seconds = 60.0
    ready_s: Seconds = 180.0


class TraceSection(_Section, frozen=True):
    """Per-token, per-hop timing: on by default (the run's summary table needs it); ``path`` also writes the
    Perfetto trace JSON there and one JSON line per token next to it (``.jsonl``)."""

    enabled: bool = True
    path: str | None = None


class ClusterSection(_Section, frozen=True):
    """Membership and failure detection: ``auto`` uses kinship (SWIM/Lifeguard over UDP) when the provider's nodes
    share a network with the orchestrator, else heartbeats over the run's transport."""

    engine: Literal["auto", "kinship", "heartbeat"] = "auto"
    heartbeat_s: Seconds = 1.0
    suspect_after: PositiveInt = 3
    dead_after_s: Seconds = 6.0


FaultMode = Literal["never-join", "no-names", "stall-before-ready", "bad-model", "eos-first", "exit-mid-decode"]


class FaultSection(_Section, frozen=True):
    """Inject one failure into one stage, to test that the run fails cleanly: ``never-join`` (the cluster never
    converges), ``no-names`` (a name never resolves), ``stall-before-ready`` / ``bad-model`` (the worker never reports
    ready), ``eos-first`` (the last stage answers with no text), ``exit-mid-decode`` (the node dies while decoding)."""

    stage: Annotated[int, Meta(ge=0)]
    mode: FaultMode


class FaultToleranceSection(_Section, frozen=True):
    """What the run does when a message is lost or a node dies: ``none`` ends the run (exit 1, everything destroyed);
    ``retry`` resends every message on the token's way until its receiver acknowledges it (a dead node still ends the
    run); ``failover`` besides replaces a dead node by a spare device, whose KV cache is rebuilt by replaying the
    request. ``policy`` left out: the plan file's, else none. ``spares``: without a plan file, how many spare devices of
    the run's provider stand by (a plan file names its own). ``ack_timeout_s``: how long a message waits for its
    acknowledgement before it is sent again, until round trips are measured; ``retry_max_s`` the longest wait between
    two sends."""

    policy: Literal["none", "retry", "failover"] | None = None
    spares: Annotated[int, Meta(ge=0, le=64)] = 0
    ack_timeout_s: Seconds = 0.25
    retry_max_s: Seconds = 2.0


def _default_model() -> ModelSection:
    return ModelSection(synthetic=SyntheticModel())


class Scenario(_Section, frozen=True):
    """A whole scenario file (format version 1)."""

    version: Literal[1]
    name: Annotated[str, Meta(description="defaults to the file's stem")] = ""
    model: ModelSection = msgspec.field(default_factory=_default_model)
    stages: Stages = Stages()
    transport: TransportSection = TransportSection()
    provider: ProviderSection = ProviderSection()
    request: RequestSection = RequestSection()
    serving: ServingSection = ServingSection()
    expect: ExpectSection = ExpectSection()
    budget: BudgetSection = BudgetSection()
    trace: TraceSection = TraceSection()
    cluster: ClusterSection = ClusterSection()
    faults: tuple[FaultSection, ...] = ()
    network: Network | None = None
    fault_tolerance: FaultToleranceSection = FaultToleranceSection()
    plan: (
        Annotated[
            str,
            Meta(
                min_length=1,
                description="a plan file (JSON or YAML; relative to the scenario's folder): the model, the devices "
                "and the placement come from it, and stages are its nodes",
            ),
        ]
        | None
    ) = None

    def __post_init__(self) -> None:
        if self.transport.kind in ONE_PROCESS_TRANSPORTS:
            raise FieldError(
                "transport.kind",
                f"the {self.transport.kind} transport works within one process only, "
                f"and provider {self.provider.kind!r} runs every stage in a process of "
                "its own — use kind: zmq (or iroh)",
            )
        for i, fault in enumerate(self.faults):
            if fault.stage >= self.stages.num_stages:
                raise FieldError(
                    f"faults[{i}].stage",
                    f"stage {fault.stage} does not exist in a "
                    f"{self.stages.num_stages}-stage run — use 0..{self.stages.num_stages - 1}",
                )
        if self.request.max_tokens >= self.model.max_context:
            raise FieldError(
                "request.max_tokens",
                f"{self.request.max_tokens} tokens do not fit max_context {self.model.max_context} — "
                "lower max_tokens or raise model.max_context",
            )
        if self.network is not None:
            self._check_network(self.network)
        ft = self.fault_tolerance
        if ft.spares and self.plan is not None:
            raise FieldError(
                "fault_tolerance.spares",
                "the plan file names its spare devices (placement.spares) — remove spares here, or add them to the "
                "plan",
            )
        if ft.policy == "failover" and self.network is not None and self.network.layer == "packet":
            raise FieldError(
                "fault_tolerance.policy",
                "a spare cannot join the packet layer's bridges, which are laid out when the run starts — use "
                "network layer: message, or policy retry",
            )

    def _check_network(self, network: Network) -> None:
        n = self.stages.num_stages
        for where, nodes in [(f"links[{i}]", (link.src, link.dst)) for i, link in enumerate(network.links)] + [
            (f"events[{i}].nodes", e.nodes) for i, e in enumerate(network.events)
        ]:
            for node in nodes:
                if node != SEED_NODE and int(node.removeprefix("stage-")) >= n:
                    raise FieldError(
                        f"network.{where}", f"{node} does not exist in a {n}-stage run — use stage-0..stage-{n - 1}"
                    )
        if network.layer == "packet" and self.transport.kind != "iroh":
            raise FieldError(
                "network.layer",
                f"the packet layer impairs iroh's QUIC packets, and this run's transport is {self.transport.kind} — "
                "use transport kind iroh, or layer: message",
            )
        if network.layer == "packet" and self.provider.kind not in PACKET_LAYER_PROVIDERS:
            raise FieldError(
                "network.layer",
                f"the packet layer puts every node in a network namespace of its own, which the {self.provider.kind} "
                f"provider does not do yet — use provider {' or '.join(PACKET_LAYER_PROVIDERS)}, or layer: message",
            )
        if network.layer == "packet" and self.cluster.engine == "kinship":
            raise FieldError(
                "cluster.engine",
                "kinship gossips over UDP of its own, which cannot leave a node's network namespace under the packet "
                "layer — use engine: heartbeat (or auto, which picks it)",
            )
        stops = [i for i, e in enumerate(network.events) if e.kind in ("pause", "kill")]
        if stops and self.provider.kind not in NODE_SIGNAL_PROVIDERS:
            raise FieldError(
                f"network.events[{stops[0]}].kind",
                f"the {self.provider.kind} provider cannot pause or kill a node — use provider "
                f"{' or '.join(NODE_SIGNAL_PROVIDERS)}, or a partition",
            )

    def with_stages(self, n: int) -> Scenario:
        """A copy split evenly into ``n`` stages (explicit splits dropped)."""
        return scenario_from_args(base=self, num_stages=n)


# --- loading ------------------------------------------------------------------------------------------------------


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; every problem is a ``ScenarioError`` naming the file, field and fix."""
    path = Path(path)
    src = str(path)
    text = _read(path)
    try:
        screen(text)
    except YamlLimit as exc:
        raise ScenarioError(f"{src}: {exc.path}: {exc}") from None
    try:
        scenario = msgspec.yaml.decode(text, type=Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{src}: {explain(exc, untyped(text), Scenario, SCENARIO_VERSION)}") from None
    except msgspec.DecodeError as exc:
        raise ScenarioError(f"{src}: {explain_yaml(exc)}") from None
    if not scenario.name:
        scenario = msgspec.structs.replace(scenario, name=path.stem)
    if scenario.plan is not None:
        raw = untyped(text)
        if isinstance(raw, dict) and "stages" in raw:
            raise ScenarioError(
                f"{src}: $.stages: a scenario with a plan takes its stages from the plan ({scenario.plan}) — remove "
                "stages, or the plan"
            )
        return with_plan(scenario, str((path.parent / scenario.plan).resolve()), src)
    model = known_model(scenario, source=src)
    if model is not None:
        check_against_model(scenario, model, source=src)
    return scenario


def with_plan(scenario: Scenario, plan_file: str, source: str = "<arguments>") -> Scenario:
    """``scenario`` running the plan in ``plan_file``: its stages are the plan's nodes (their block ranges), its
    provider the kind of the plan's devices, its ``max_context`` the plan's. The plan is read and checked here, so
    that a bad plan is refused before anything starts."""
    from ppharness.plan.compile import compile_plan
    from ppharness.plan.doc import load_plan

    doc = load_plan(plan_file)
    compiled = compile_plan(doc)
    if scenario.stages != Stages() and scenario.plan is None:
        raise ScenarioError(
            f"{source}: $.stages: a run with a plan takes its stages from the plan ({compiled.num_stages} nodes) — "
            "leave out stages (and --num-stages)"
        )
    cuts = [hi for _, hi in compiled.runtime.ranges[:-1]]
    raw = msgspec.to_builtins(scenario)
    raw["plan"] = plan_file
    raw["stages"] = {"splits": cuts} if cuts else {"count": 1}
    raw["model"]["max_context"] = doc.model.max_context
    if scenario.provider.kind != compiled.provider_kind:
        raw["provider"]["kind"] = compiled.provider_kind
    try:
        return msgspec.convert(raw, type=Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{source}: {explain(exc, raw, Scenario, SCENARIO_VERSION)}") from None


@dataclass(frozen=True)
class ModelFacts:
    """What is known about a scenario's model before anything runs: its blocks and, when known, its own context
    length, whether a BOS token precedes the prompt and the byte length of its vocabulary's longest token."""

    blocks: int
    context: int | None = None
    bos: bool = True
    longest_token: int | None = None
    name: str = "the model"


def check_against_model(scenario: Scenario, model: int | ModelFacts, source: str = "<file>") -> None:
    """Raise ``ScenarioError`` if the stage split, ``max_context`` or the prompt does not fit the model (a bare int is
    its block count)."""
    facts = model if isinstance(model, ModelFacts) else ModelFacts(blocks=model)
    num_blocks = facts.blocks
    stages = scenario.stages
    n = stages.num_stages
    if n > num_blocks:
        raise ScenarioError(
            f"{source}: $.stages.count: {n} stages but the model has {num_blocks} blocks — "
            f"use at most {num_blocks} stages or fewer split points"
        )
    for i, point in enumerate(stages.splits or ()):
        if point >= num_blocks:
            raise ScenarioError(
                f"{source}: $.stages.splits[{i}]: split point {point} is outside the model's {num_blocks} blocks — "
                f"split points must lie in 1..{num_blocks - 1}"
            )
    max_context = scenario.model.max_context
    if facts.context is not None and max_context > facts.context:
        raise ScenarioError(
            f"{source}: $.model.max_context: {max_context} is above the {facts.context}-token context of "
            f"{facts.name} — set max_context to at most {facts.context}"
        )
    if facts.longest_token is not None:
        _check_prompt_fits(scenario, facts, source)


def _check_prompt_fits(scenario: Scenario, facts: ModelFacts, source: str) -> None:
    """Refuse a prompt that cannot leave room for ``max_tokens``, judged from its UTF-8 length alone.

    A stage needs ``BOS + prompt tokens + max_tokens <= max_context``. Encoding the prompt would give the exact count,
    but building the tokenizer costs most of a second (and the vocabulary of a large synthetic preset far more), so
    only a lower bound on the token count is used: every token the byte-level BPE emits stands for at most
    ``longest_token`` bytes of the prompt (a special token, matched literally, for its UTF-8 length), so a prompt of
    ``b`` bytes is at least ``ceil(b / longest_token)`` tokens. The converse bound (``tokens <= b + 1``) is an upper
    bound and proves nothing here: a prompt is refused only when even its fewest possible tokens leave no room, so a
    prompt that passes can still be refused at run time by the stage's exact count.
    """
    assert facts.longest_token is not None
    request, max_context = scenario.request, scenario.model.max_context
    n_bytes = len(request.prompt.encode("utf-8", "surrogatepass"))
    fewest = -(-n_bytes // facts.longest_token) + int(facts.bos)
    if fewest + request.max_tokens > max_context:
        bos = ", counting the BOS token" if facts.bos else ""
        raise ScenarioError(
            f"{source}: $.request.prompt: the prompt is {n_bytes:,} bytes, so at least {fewest:,} tokens of "
            f"{facts.name}{bos} (its longest token is {facts.longest_token} bytes); with max_tokens "
            f"{request.max_tokens} that is more than max_context {max_context} — shorten the prompt, lower "
            "request.max_tokens or raise model.max_context"
        )


SMALL_VOCAB = 4096  # a synthetic vocabulary this size or smaller is built at check time (well under 0.1 s)


def known_model(scenario: Scenario, source: str = "<file>") -> ModelFacts | None:
    """The model's facts when they are known without running anything: a synthetic preset's (its vocabulary built
    when small, else read from the model cache when the file exists) or a local GGUF file's header (memory-mapped);
    ``None`` for a URL, or a path with no file behind it yet."""
    model = scenario.model
    if model.synthetic is not None:
        return _synthetic_facts(model.synthetic)
    if model.gguf is None or "://" in model.gguf:
        return None
    path = Path(model.gguf).expanduser()
    if not path.is_file():
        return None
    try:
        return _gguf_facts(path)
    except ModelError as exc:
        raise ScenarioError(f"{source}: $.model.gguf: {exc} — point gguf at a llama-family GGUF file") from None


def _synthetic_facts(synthetic: SyntheticModel) -> ModelFacts:
    from ppharness.model import files as modelfile

    spec = modelfile.preset_spec(
        synthetic.preset,
        seed=synthetic.seed,
        blocks=synthetic.blocks,
        dim=synthetic.dim,
        tied_embeddings=synthetic.tied_embeddings,
        type=synthetic.type,
    )
    name = f"synthetic preset {synthetic.preset!r}"
    longest: int | None = None
    if spec.vocab <= SMALL_VOCAB:
        longest = _synthetic_longest_token(spec.vocab, spec.seed)
    else:
        cached = modelfile.cache_dir() / "models" / f"{spec.slug()}.gguf"  # where synthetic_path builds it
        if cached.is_file():
            try:
                longest = _gguf_facts(cached).longest_token
            except ModelError:
                pass  # a broken cache file is rebuilt by the run
    return ModelFacts(blocks=spec.blocks, context=spec.context, bos=True, longest_token=longest, name=name)


@functools.lru_cache(maxsize=8)
def _synthetic_longest_token(vocab: int, seed: int) -> int:
    from ppharness.model.files import SPECIAL_TOKENS, build_vocab

    tokens, _ = build_vocab(vocab - 256 - len(SPECIAL_TOKENS), seed)
    # measured as the GGUF stores them: a normal token's characters stand for one byte each, and their UTF-8 length is
    # never less than that; a special token is matched in the text as itself
    return max(len(t.encode("utf-8")) for t in (*tokens, *SPECIAL_TOKENS))


def _gguf_facts(path: Path) -> ModelFacts:
    """A GGUF file's facts from its header; ``ModelError`` if it is not a readable llama-family GGUF file."""
    stat = path.stat()
    return _gguf_header_facts(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _gguf_header_facts(path: str, size: int, mtime_ns: int) -> ModelFacts:
    from ppharness.model.gguf_header import read_header

    h = read_header(path)
    return ModelFacts(
        blocks=h.blocks,
        context=h.context,
        bos=h.bos,
        longest_token=h.longest_token,
        name=f"model file {Path(path).name}",
    )


def _read(path: Path) -> str:
    return read_text_file(path, "scenario", "*.yaml", ScenarioError)


def read_text_file(path: Path, what: str, pattern: str, error: type[HarnessError]) -> str:
    """A small UTF-8 text file's contents, read only up to its kind's limit (``MAX_FILE_BYTES``; a plan's or a
    cluster's: ``PLAN_LIMITS``); every problem is ``error`` naming the file and the fix (``what``: "scenario", "plan",
    "cluster"; ``pattern``: the siblings to suggest when it is missing)."""
    if not path.is_file():
        hint = f"pass the path of a {what} file"
        siblings = sorted(p.name for p in path.parent.glob(pattern)) if path.parent.is_dir() else []
        if siblings:
            more = ", ..." if len(siblings) > 8 else ""
            hint += f" (in {path.parent}/: {', '.join(siblings[:8])}{more})"
        kind = "is a directory" if path.is_dir() else "no such file"
        raise error(f"{path}: {kind} — {hint}")
    limit = PLAN_LIMITS.file_bytes if what in ("plan", "cluster") else MAX_FILE_BYTES
    usual = "a few KiB" if limit <= MAX_FILE_BYTES else "far smaller"
    too_big = (
        f"{path}: $: the file is over the limit of {limit:,} bytes ({limit >> 20} MiB) — a {what} is {usual}; "
        f"check that this is the {what} file"
    )
    try:
        if path.stat().st_size > limit:
            raise error(too_big)
        with path.open("rb") as f:
            data = f.read(limit + 1)  # the file may have grown since stat
        if len(data) > limit:
            raise error(too_big)
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start}) — save the file as UTF-8") from None
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror}") from None


# --- building in code ---------------------------------------------------------------------------------------------


def scenario_from_args(
    *,
    base: Scenario | None = None,
    name: str | None = None,
    num_stages: int | None = None,
    transport: str | None = None,
    provider: str | None = None,
    prompt: str | None = None,
    max_tokens: int | None = None,
    plan: str | None = None,
) -> Scenario:
    """``base`` (default: the built-in scenario) with the given overrides; ``None`` keeps the base value. ``plan``:
    a plan file the run realises (``with_plan``)."""
    s = base if base is not None else Scenario(version=SCENARIO_VERSION)
    if num_stages is not None:
        s = _set(s, "$", stages=Stages(count=num_stages))
    if provider is not None:  # before the transport, whose checks name the provider
        s = _set(s, "$", provider=_set(s.provider, "$.provider", kind=provider))
    if transport is not None:
        relay = s.transport.relay if transport == "iroh" else None
        s = _set(s, "$", transport=_set(s.transport, "$.transport", kind=transport, relay=relay))
    if prompt is not None:
        s = _set(s, "$", request=_set(s.request, "$.request", prompt=prompt))
    if max_tokens is not None:
        s = _set(s, "$", request=_set(s.request, "$.request", max_tokens=max_tokens))
    if name is not None or not s.name:
        s = _set(s, "$", name=name or f"adhoc-{s.stages.num_stages}stage-{s.provider.kind}")
    raw = msgspec.to_builtins(s)
    try:
        checked = msgspec.convert(raw, type=Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"<arguments>: {explain(exc, raw, Scenario, SCENARIO_VERSION)}") from None
    if plan is not None:
        if num_stages is not None:
            raise ScenarioError("<arguments>: --plan and --num-stages both say how to split — give one of them")
        return with_plan(checked, str(Path(plan).resolve()))
    if checked.plan is not None:
        return checked
    model = known_model(checked, source="<arguments>")
    if model is not None:
        check_against_model(checked, model, source="<arguments>")
    return checked


_S = TypeVar("_S", bound=msgspec.Struct)


def _set(obj: _S, where: str, **changes: object) -> _S:
    """``msgspec.structs.replace`` whose failed checks become ``ScenarioError`` naming ``where``'s field."""
    try:
        return msgspec.structs.replace(obj, **changes)
    except FieldError as exc:
        sub = f"{'' if exc.field.startswith('[') else '.'}{exc.field}" if exc.field else ""
        raise ScenarioError(f"<arguments>: {where}{sub}: {exc}") from None
    except (ValueError, TypeError) as exc:
        raise ScenarioError(f"<arguments>: {where}: {exc}") from None


def scenario_schema() -> dict[str, Any]:
    """JSON Schema of the scenario format, for editors (``# yaml-language-server: $schema=...``)."""
    schema = msgspec.json.schema(Scenario)
    defs = dict(schema.get("$defs", {}))
    root = defs.pop("Scenario")
    out: dict[str, Any] = {"$schema": "https://json-schema.org/draft/2020-12/schema", **root}
    out["title"] = f"ppharness scenario v{SCENARIO_VERSION}"
    if defs:
        out["$defs"] = defs
    return out


# --- error messages -----------------------------------------------------------------------------------------------

if __name__ == "__main__":
    print(json.dumps(scenario_schema(), indent=2))
