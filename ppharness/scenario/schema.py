"""Scenario YAML v1: what to run, decoded straight into frozen msgspec structs.

A scenario names a model (a synthetic preset or a GGUF file), how its blocks are split into stages, the transport and
provider kinds, one request, what to expect of the answer and the time budgets (its sections:
``ppharness.scenario.sections``). ``load_scenario`` turns a file into a ``Scenario`` or raises ``ScenarioError``
naming the file, the ``$.field.path`` and the fix; ``scenario_from_args`` builds one in code for the CLI when no file
is given; ``scenario_schema`` is the JSON Schema for editors.

A file is read and screened by ``ppharness.document.reader`` (its size, depth, value size, aliases expanded, duplicate
keys) before it is decoded. When the model is known without running anything the scenario is checked against it too
(``ppharness.scenario.facts``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
from msgspec import Meta

from ppharness import registry
from ppharness.document.explain import FieldError, explain, explain_yaml, untyped
from ppharness.document.reader import read_text_file, screen_text
from ppharness.document.yaml_limits import SCENARIO_LIMITS
from ppharness.errors import ScenarioError
from ppharness.network.spec import SEED_NODE, Network
from ppharness.plan.compile import load_compiled
from ppharness.scenario.facts import check_against_model, known_model
from ppharness.scenario.sections import (
    TRANSPORT_FIELDS,
    BudgetSection,
    ClusterSection,
    ExpectSection,
    FaultSection,
    FaultToleranceSection,
    ModelSection,
    ProviderSection,
    RequestSection,
    ServingSection,
    Stages,
    SyntheticModel,
    TraceSection,
    TransportSection,
)
from ppharness.seams.settings import Settings

SCENARIO_VERSION: Final = 1


def _default_model() -> ModelSection:
    return ModelSection(synthetic=SyntheticModel())


class Scenario(Settings, frozen=True):
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
        if registry.transport_class(self.transport.kind).one_process:
            apart = registry.transports_where(lambda cls: not cls.one_process)
            others = f" (or {' or '.join(apart[1:])})" if len(apart) > 1 else ""
            raise FieldError(
                "transport.kind",
                f"the {self.transport.kind} transport works within one process only, "
                f"and provider {self.provider.kind!r} runs every stage in a process of "
                f"its own — use kind: {apart[0]}{others}",
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
        if ft.policy == "failover" and self.serving.speculate:
            raise FieldError(
                "fault_tolerance.policy",
                "a spare's replay of a speculating request is not built yet — use policy retry with "
                "serving.speculate, or leave speculate out",
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
        if network.layer == "packet" and not registry.provider_class(self.provider.kind).own_networks:
            able = " or ".join(registry.providers_where(lambda cls: cls.own_networks))
            raise FieldError(
                "network.layer",
                f"the packet layer puts every node in a network namespace of its own, which the {self.provider.kind} "
                f"provider does not do yet — use provider {able}, or layer: message",
            )
        if network.layer == "packet" and self.cluster.engine == "kinship":
            raise FieldError(
                "cluster.engine",
                "kinship gossips over UDP of its own, which cannot leave a node's network namespace under the packet "
                "layer — use engine: heartbeat (or auto, which picks it)",
            )
        stops = [i for i, e in enumerate(network.events) if e.kind in ("pause", "kill")]
        if stops and not registry.provider_class(self.provider.kind).signals_nodes:
            able = " or ".join(registry.providers_where(lambda cls: cls.signals_nodes))
            raise FieldError(
                f"network.events[{stops[0]}].kind",
                f"the {self.provider.kind} provider cannot pause or kill a node — use provider {able}, or a partition",
            )

    def with_stages(self, n: int) -> Scenario:
        """A copy split evenly into ``n`` stages (explicit splits dropped)."""
        return scenario_from_args(base=self, num_stages=n)


# --- loading ------------------------------------------------------------------------------------------------------


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file; every problem is a ``ScenarioError`` naming the file, field and fix."""
    path = Path(path)
    src = str(path)
    text = read_text_file(path, "scenario", "*.yaml", ScenarioError)
    screen_text(text, src, SCENARIO_LIMITS, ScenarioError)
    try:
        scenario = msgspec.yaml.decode(text, type=Scenario)
    except msgspec.ValidationError as exc:
        reason = _percent_hint(explain(exc, untyped(text), Scenario, SCENARIO_VERSION))
        raise ScenarioError(f"{src}: {reason}") from None
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


# a probability written as a percentage (``loss: 2%``), as the decoder reports it
_PERCENT = re.compile(r"\.(loss|loss_good|loss_bad|duplicate|reorder|p|r): expected float, got str '([0-9.]+) ?%'$")


def _percent_hint(message: str) -> str:
    """``message`` with the fix when it refuses a probability written as a percentage."""
    m = _PERCENT.search(message)
    if m is None:
        return message
    try:
        fraction = float(m.group(2)) / 100
    except ValueError:
        return message
    return f"{message} — write {fraction:g}: {m.group(1)} is a fraction 0..1"


def scenario_warnings(scenario: Scenario) -> list[str]:
    """What is allowed but likely not meant: a network that loses whole messages (the message layer; the packet
    layer's QUIC resends lost packets itself) under fault tolerance ``none``, where the first lost activation or token
    leaves the run waiting out its whole budget (``budget.total_s``) before it fails."""
    network, policy = scenario.network, scenario.fault_tolerance.policy
    if network is None or network.layer != "message" or policy not in (None, "none") or scenario.plan is not None:
        return []
    links = [network.default, *(link.impairment() for link in network.links)]
    if not any(i.mean_loss() > 0 for i in links):
        return []
    return [
        "$.network: links lose messages, but fault_tolerance.policy is none: the first lost message ends the run "
        f"after its whole budget ({scenario.budget.total_s:g} s) — set fault_tolerance: {{policy: retry}}"
    ]


def with_plan(scenario: Scenario, plan_file: str, source: str = "<arguments>", provider: str | None = None) -> Scenario:
    """``scenario`` running the plan in ``plan_file``: its stages are the plan's nodes (their block ranges), its
    provider the kind of the plan's devices, its ``max_context`` the plan's. The plan is read and checked here, so
    that a bad plan is refused before anything starts; the run takes the same compiled plan."""
    doc, compiled = load_compiled(plan_file)
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
    if provider is not None and provider != compiled.provider_kind:  # asked for on the command line: not overridden
        raise ScenarioError(
            f"{source}: --provider {provider}: the plan's devices run on the {compiled.provider_kind} provider "
            f"({plan_file}) — leave out --provider, or make the plan for a {provider} cluster"
        )
    if scenario.provider.kind != compiled.provider_kind:
        raw["provider"]["kind"] = compiled.provider_kind
    try:
        return msgspec.convert(raw, type=Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{source}: {explain(exc, raw, Scenario, SCENARIO_VERSION)}") from None


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
    model: str | None = None,
    max_context: int | None = None,
    match_oracle: bool | None = None,
    colocated: bool | None = None,
    speculate: str | None = None,
    windows: int | None = None,
) -> Scenario:
    """``base`` (default: the built-in scenario) with the given overrides; ``None`` keeps the base value. ``plan``:
    a plan file the run realises (``with_plan``); ``model``: a source (``model_section``); ``colocated``: every
    stage in one process (``stages.placement``); ``speculate``: a draft (``serving.speculate``, batched with it),
    ``windows`` its windows in flight."""
    s = base if base is not None else Scenario(version=SCENARIO_VERSION)
    if model is not None:
        section = model_section(model, s.model.max_context)
        s = _set(s, "$", model=section)
        if name is None and base is None:
            name = (
                f"{Path(model).stem if section.gguf else model.removeprefix('synthetic:')}-{s.stages.num_stages}stage"
            )
    if max_context is not None:
        s = _set(s, "$", model=_set(s.model, "$.model", max_context=max_context))
    if match_oracle is not None:
        s = _set(s, "$", expect=_set(s.expect, "$.expect", match_oracle=match_oracle))
    if num_stages is not None:
        s = _set(s, "$", stages=Stages(count=num_stages, split_rule=s.stages.split_rule, placement=s.stages.placement))
    if colocated is not None:
        s = _set(s, "$", stages=_set(s.stages, "$.stages", placement="colocated" if colocated else "separate"))
    if speculate is not None or windows is not None:  # speculative windows are rows of a batched step
        draft = s.serving.speculate if speculate is None else speculate
        more = {"windows": windows} if windows is not None else {}
        s = _set(
            s,
            "$",
            serving=_set(s.serving, "$.serving", speculate=draft, batched=s.serving.batched or bool(draft), **more),
        )
    if provider is not None:  # before the transport, whose checks name the provider
        s = _set(s, "$", provider=_set(s.provider, "$.provider", kind=provider))
    if transport is not None:  # a field of one transport kind is kept for that kind and dropped for the others
        own = {f: getattr(s.transport, f) if owner == transport else None for f, (owner, _) in TRANSPORT_FIELDS.items()}
        s = _set(s, "$", transport=_set(s.transport, "$.transport", kind=transport, **own))
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
        return with_plan(checked, str(Path(plan).resolve()), provider=provider)
    if checked.plan is not None:
        return checked
    facts = known_model(checked, source="<arguments>")
    if facts is not None:
        check_against_model(checked, facts, source="<arguments>")
    return checked


# the fields of ``synthetic:PRESET,key=value`` a scenario's model section takes
_SYNTHETIC_KEYS = ("seed", "blocks", "dim", "tied_embeddings", "type")


def model_section(source: str, max_context: int) -> ModelSection:
    """A model section for ``--model SOURCE``: ``synthetic:PRESET[,key=value...]`` (keys: seed, blocks, dim,
    tied_embeddings, type), an http(s) URL, or a local path (``~`` expanded, made absolute)."""
    where = f"<arguments>: --model {source}"
    if source.startswith("synthetic:"):
        preset, *pairs = source.removeprefix("synthetic:").split(",")
        fields: dict[str, object] = {"preset": preset or "tiny"}
        for pair in pairs:
            key, _, value = pair.partition("=")
            if key not in _SYNTHETIC_KEYS:
                raise ScenarioError(
                    f"{where}: unknown field {key!r}; a run's synthetic model takes {', '.join(_SYNTHETIC_KEYS)}"
                )
            fields[key] = (
                value if key == "type" else value.lower() in ("1", "true", "yes") if key == "tied_embeddings" else value
            )
        raw = {"synthetic": fields, "max_context": max_context}
    elif "://" in source:
        raw = {"gguf": source, "max_context": max_context}
    else:
        raw = {"gguf": str(Path(source).expanduser().resolve()), "max_context": max_context}
    try:
        return msgspec.convert(raw, type=ModelSection, strict=False)
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{where}: {exc}") from None


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


if __name__ == "__main__":
    print(json.dumps(scenario_schema(), indent=2))
