"""The sections of a scenario (``model``, ``stages``, ``transport``, ``provider``, ...), each a frozen msgspec struct
that checks its own fields as it is built and raises ``FieldError`` naming the field and the fix.

The ``transport`` and ``provider`` sections are built from ``ppharness.registry``: a transport kind's own fields (iroh's
``relay``) join the transport section, and each provider kind's settings are the provider section's field of that
kind's name (``provider.docker``). The implementations declare both; the core names none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, UnsetType

from ppharness import registry
from ppharness.document.explain import FieldError, show
from ppharness.document.yaml_limits import MAX_SCALAR_BYTES
from ppharness.errors import ModelError
from ppharness.model.decode.drafts import parse_draft
from ppharness.model.gguf.metadata import MAX_BLOCKS, MAX_WIDTH
from ppharness.model.synthetic.spec import PRESETS, SIMULATION_ONLY, WEIGHT_TYPES, ModelSpec, check_fits, preset_spec
from ppharness.plan.stages import make_plan
from ppharness.seams.settings import PositiveInt, ProviderSettings, Seconds, Settings


class SyntheticModel(Settings, frozen=True):
    """A model ppharness makes itself from a named preset, with optional overrides."""

    preset: Annotated[str, Meta(min_length=1)] = "tiny"
    seed: Annotated[int, Meta(ge=0)] = 0
    blocks: PositiveInt | None = None
    dim: PositiveInt | None = None
    tied_embeddings: bool | None = None
    type: Annotated[str, Meta(description="how the weight matrices are stored: f16, q8_0 or q4_0")] = "f16"

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise FieldError("preset", f"unknown preset {show(self.preset)} — expected one of: {', '.join(PRESETS)}")
        if self.type.lower() not in WEIGHT_TYPES:
            raise FieldError(
                "type", f"unknown weight type {show(self.type)} — expected one of: {', '.join(WEIGHT_TYPES)}"
            )
        for name, most in (("blocks", MAX_BLOCKS), ("dim", MAX_WIDTH)):
            value = getattr(self, name)
            if value is not None and value > most:
                raise FieldError(name, f"{value:,} is above the most a model file holds, {most:,} — lower it")
        try:
            spec = self.spec()
        except ModelError as exc:
            raise FieldError("", f"{exc} — change the preset's overrides or the type") from None
        if self.preset in SIMULATION_ONLY:
            raise FieldError(
                "preset", f"{self.preset} is for the simulator only (plan simulate, plan make) — use a preset that runs"
            )
        try:
            check_fits(spec)
        except ModelError as exc:
            field = "blocks" if self.blocks is not None else "dim" if self.dim is not None else "preset"
            raise FieldError(field, f"{exc} — lower blocks or dim, or use a smaller preset") from None

    def spec(self) -> ModelSpec:
        """The model this section describes: the preset with its overrides."""
        return preset_spec(
            self.preset,
            seed=self.seed,
            blocks=self.blocks,
            dim=self.dim,
            tied_embeddings=self.tied_embeddings,
            type=self.type,
        )


class ModelSection(Settings, frozen=True):
    """Exactly one of ``synthetic`` and ``gguf``; ``max_context`` is the KV cache length every stage allocates."""

    synthetic: SyntheticModel | None = None
    gguf: Annotated[str, Meta(min_length=1, description="a local path or an http(s) URL of a GGUF file")] | None = None
    sha256: Annotated[str, Meta(pattern=r"^[0-9a-fA-F]{64}$", description="hex SHA-256 of the GGUF file")] | None = None
    size: (
        Annotated[
            int,
            Meta(
                ge=1,
                description="the GGUF file's size in bytes: a download stops beyond it, a file of another size is "
                "refused",
            ),
        ]
        | None
    ) = None
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
        if self.size is not None and self.gguf is None:
            raise FieldError("size", "size applies only to a gguf file — remove it or set gguf")


class Stages(Settings, frozen=True):
    """How the blocks are split: ``count`` even stages or explicit split points. An even split gives the remainder
    to the first stages (``split_rule: balanced``: 8 blocks over 5 stages are 2/2/2/1/1); ``split_rule: floor`` is
    k = blocks // count per stage with the last stage taking the rest (1/1/1/1/4)."""

    count: PositiveInt | UnsetType = UNSET
    splits: tuple[Annotated[int, Meta(ge=1)], ...] | None = None
    split_rule: Annotated[
        Literal["balanced", "floor"],
        Meta(
            description="an even split's remainder: balanced (one more block to each of the first stages) or floor "
            "(k = blocks // count per stage, the last stage takes the rest)"
        ),
    ] = "balanced"
    placement: Annotated[
        Literal["separate", "colocated"],
        Meta(
            description="separate (each stage a process of its own, on a device of its own) or colocated (every "
            "stage on the first device, driven by one process, the hidden state handed over in the process)"
        ),
    ] = "separate"

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
        splits = list(self.splits) if self.splits else None
        return list(make_plan(num_blocks, self.num_stages, splits, split_rule=self.split_rule).ranges)


def _transport_fields() -> dict[str, tuple[str, Any]]:
    """Transport field -> (the transport kind that declares it, its type), from ``registry.transport_settings_type``."""
    out: dict[str, tuple[str, Any]] = {}
    for kind in registry.TRANSPORTS:
        declared = registry.transport_settings_type(kind)
        for f in msgspec.structs.fields(declared) if declared is not None else ():
            assert f.name not in out, f"transport field {f.name!r}: declared by {out[f.name][0]} and by {kind}"
            assert f.default is None, f"transport field {f.name!r} of {kind}: its default must be None"
            out[f.name] = (kind, f.type)
    return out


TRANSPORT_FIELDS = _transport_fields()
# provider kind -> the type of its settings section (registry.provider_settings_type), for the kinds that have one
PROVIDER_SETTINGS: dict[str, type[ProviderSettings]] = {
    kind: declared for kind in registry.PROVIDERS if (declared := registry.provider_settings_type(kind)) is not None
}


class _TransportSection(Settings, frozen=True):
    """How stages talk: a kind from ``ppharness.registry.TRANSPORTS``, the dtype hidden states travel in and, for
    iroh, the relay mode."""

    kind: str = "zmq"
    wire_dtype: Literal["f16", "bf16", "f32"] = "f16"

    def __post_init__(self) -> None:
        if self.kind not in registry.TRANSPORTS:
            known = ", ".join(sorted(registry.TRANSPORTS))
            raise FieldError("kind", f"unknown transport kind {show(self.kind)} — expected one of: {known}")
        for name, (owner, _) in TRANSPORT_FIELDS.items():
            if getattr(self, name) is not None and self.kind != owner:
                raise FieldError(
                    name,
                    f"{name} applies only to the {owner} transport, not {self.kind!r} — remove {name} or set kind: "
                    f"{owner}",
                )


class _ProviderSection(Settings, frozen=True):
    """Where stages run: a kind from ``ppharness.registry.PROVIDERS``."""

    kind: str = "local"

    def __post_init__(self) -> None:
        if self.kind not in registry.PROVIDERS:
            known = ", ".join(sorted(registry.PROVIDERS))
            raise FieldError("kind", f"unknown provider kind {show(self.kind)} — expected one of: {known}")
        for kind in PROVIDER_SETTINGS:  # each settings field is named after its provider kind
            if getattr(self, kind) is not None and self.kind != kind:
                raise FieldError(
                    kind,
                    f"{kind} settings apply only to kind {kind}, not {self.kind!r} — remove them or set kind: {kind}",
                )
        settings = PROVIDER_SETTINGS.get(self.kind)
        if settings is not None and settings.always and getattr(self, self.kind) is None:
            msgspec.structs.force_setattr(self, self.kind, settings())


_S = TypeVar("_S", bound=Settings)


def _extended(base: type[_S], name: str, fields: list[tuple[str, Any, None]]) -> type[_S]:
    """``base`` with ``fields`` added (name, type, default None), as the struct ``name`` documented as ``base``."""
    cls = msgspec.defstruct(
        name,
        fields,
        bases=(base,),
        module=__name__,
        namespace={"__doc__": base.__doc__},
        frozen=True,
        forbid_unknown_fields=True,
    )
    assert issubclass(cls, base)
    return cls


# the type checker knows the fields every kind shares; the fields the registered kinds declare are added here
if TYPE_CHECKING:
    TransportSection = _TransportSection
    ProviderSection = _ProviderSection
else:
    TransportSection = _extended(
        _TransportSection, "TransportSection", [(name, t, None) for name, (_, t) in TRANSPORT_FIELDS.items()]
    )
    ProviderSection = _extended(
        _ProviderSection, "ProviderSection", [(kind, t | None, None) for kind, t in PROVIDER_SETTINGS.items()]
    )


class RequestSection(Settings, frozen=True):
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


class ServingSection(Settings, frozen=True):
    """Requests in flight: every stage keeps ``slots`` KV caches (one per request it serves at once); stage 0 keeps up
    to ``queue`` more requests waiting for a free slot and refuses the rest as busy. ``batched``: each stage runs the
    next position of all its ready requests in one model call (``ppharness.model.layers.rows``), with batch-invariant
    kernels, so each request's answer stays the one it gets alone; else one call per request, with the fastest
    kernels for one row. ``max_batch``: the most requests a batched step runs (0: every ready one); a smaller batch
    leaves the rest for the next step, so that several batches travel the chain at once. ``speculate``: a draft
    (``ppharness.model.decode.drafts``) whose windows the chain verifies, several tokens per trip, every answer still
    the greedy one; ``windows``: how many a request keeps in flight."""

    slots: Annotated[int, Meta(ge=1, le=256)] = 1
    queue: Annotated[int, Meta(ge=0, le=65536)] = 64
    batched: bool = False
    max_batch: Annotated[int, Meta(ge=0, le=256)] = 0
    # speculative decoding inside the pipeline (ppharness.run.stage.speculation): a draft name
    # (ppharness.model.decode.drafts: ngram[:K], layers:N[:K], model:SOURCE[:K]; empty: none) and how many windows a
    # request keeps in flight
    speculate: Annotated[str, Meta(max_length=4096)] = ""
    windows: Annotated[int, Meta(ge=1, le=8)] = 1

    def __post_init__(self) -> None:
        if not self.speculate:
            return
        try:
            parse_draft(self.speculate)
        except ModelError as exc:
            raise FieldError("speculate", str(exc)) from None
        if not self.batched:
            raise FieldError(
                "speculate",
                "speculative windows are rows of one batched step — add `batched: true` to serving",
            )


class ExpectSection(Settings, frozen=True):
    """What the answer must satisfy: non-empty text, and the same tokens as the single-process oracle."""

    non_empty: bool = True
    match_oracle: bool = True


class BudgetSection(Settings, frozen=True):
    """Time budgets in seconds."""

    total_s: Seconds = 300.0
    join_s: Seconds = 120.0
    resolve_s: Seconds = 60.0
    ready_s: Seconds = 180.0


class TraceSection(Settings, frozen=True):
    """Per-token, per-hop timing: on by default (the run's summary table needs it); ``path`` also writes the
    Perfetto trace JSON there and one JSON line per token next to it (``.jsonl``)."""

    enabled: bool = True
    path: str | None = None


class ClusterSection(Settings, frozen=True):
    """Membership and failure detection: ``auto`` uses kinship (SWIM/Lifeguard over UDP) when the provider's nodes
    share a network with the orchestrator, else heartbeats over the run's transport."""

    engine: Literal["auto", "kinship", "heartbeat"] = "auto"
    heartbeat_s: Seconds = 1.0
    suspect_after: PositiveInt = 3
    dead_after_s: Seconds = 6.0


FaultMode = Literal["never-join", "no-names", "stall-before-ready", "bad-model", "eos-first", "exit-mid-decode"]


class FaultSection(Settings, frozen=True):
    """Inject one failure into one stage, to test that the run fails cleanly: ``never-join`` (the cluster never
    converges), ``no-names`` (a name never resolves), ``stall-before-ready`` / ``bad-model`` (the worker never reports
    ready), ``eos-first`` (the last stage answers with no text), ``exit-mid-decode`` (the node dies while decoding)."""

    stage: Annotated[int, Meta(ge=0)]
    mode: FaultMode


class FaultToleranceSection(Settings, frozen=True):
    """What the run does when a message is lost or a node dies: ``none`` ends the run (exit 1, everything destroyed);
    ``retry`` resends every message on the token's way until its receiver acknowledges it (a dead node still ends the
    run); ``failover`` besides replaces a dead node by a spare device, whose KV cache is rebuilt by replaying the
    request. ``policy`` left out: the plan file's, else none. ``spares``: without a plan file, how many spare devices of
    the run's provider stand by (a plan file names its own). ``ack_timeout_s``: how long a message waits for its
    acknowledgement before it is sent again, until round trips are measured; ``retry_max_s`` the longest wait between
    two sends. ``replan``: under failover with no spare left, a dead stage is re-placed on the surviving device with
    the most memory left that holds it (false: the run ends, as with no spare)."""

    policy: Literal["none", "retry", "failover"] | None = None
    spares: Annotated[int, Meta(ge=0, le=64)] = 0
    ack_timeout_s: Seconds = 0.25
    retry_max_s: Seconds = 2.0
    replan: bool = True
