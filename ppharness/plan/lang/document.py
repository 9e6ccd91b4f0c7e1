"""The plan language: one typed document saying what runs where.

A plan has three parts:

- ``model``: the computation graph read from the GGUF file: the embedding, every block (its weight bytes, FLOPs and
  KV-cache bytes per token), the final norm and head, and the bytes each edge carries per token. Each block has an
  ``experts`` field reserved for mixture-of-experts models (experts per block, active experts, shared experts, bytes
  per expert), zero for a dense model.
- ``cluster``: the devices (where each comes from: a local process, a docker container with CPU and memory limits,
  a vast.ai offer; its memory, speed, memory bandwidth, fixed cost per token and price) and the links between them
  (one-way latency, bandwidth, loss: per pair, per pair of regions, or a default), in the WAN emulation's
  ``Impairment`` vocabulary.
- ``placement``: the graph itself: nodes (a device running an ordered list of ops: ``embed``, ``blocks [a, b)``,
  ``head``, ``experts`` of one layer), edges (``activation`` from node to node, ``token`` from the exit back to the
  entry, ``experts`` from a mixture-of-experts block's owner to a node computing some of its experts: the fan-out and
  the gather), spare devices and the objective. A node whose ops are all ``experts`` is an expert node, off the loop.
  A plan that places no experts leaves every block's experts with the node running the block.

The canonical form is JSON with its keys sorted and no spaces; the plan id is the first 16 hex digits of the sha256
of that form with ``id`` left empty, so that two equal plans have one id and an edited plan is noticed. People write
YAML (or JSON) with a few conveniences that load into the same document: sizes such as ``2g`` and ``512MiB``, block
ranges as ``0..6`` or ``blk[0:6]``, and the ops ``embed`` and ``head`` as bare words.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ppharness.document.explain import FieldError, explain
from ppharness.document.keys import keys_of
from ppharness.document.reader import parse_text
from ppharness.document.yaml_limits import PLAN_LIMITS
from ppharness.errors import PlanError
from ppharness.network.spec import Impairment
from ppharness.plan.lang import limits
from ppharness.plan.lang.limits import BlockIndex, Bytes, Context, Dim, ExpertCount, ExpertId, Flops, Vocab, at_most
from ppharness.plan.lang.lookup import by_key

PLAN_VERSION = 1
# (?!\n): Python's $ also matches before a final newline, which an id must not end in
ID_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$(?!\n)")
Name = Annotated[str, Meta(pattern=ID_NAME.pattern, description="lower-case letters, digits, - and _, 1 to 63")]
# what the node runtime keeps besides weights and KV cache: Python, tinygrad and their buffers (measured: a node
# serving the tiny model peaks at about 300 MB of RSS); a device entry may set its own
DEFAULT_RESERVE = 512 << 20


class _Doc(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Base of the plan's structs (frozen, unknown keys refused). A field at its default is left out of the canonical
    form, so that a field added later with a default keeps every existing plan's id."""


# --- model ------------------------------------------------------------------------------------------------------


class Experts(_Doc, frozen=True):
    """A mixture-of-experts block's experts (all zero for a dense block)."""

    count: ExpertCount = 0  # routed experts in the block
    active: ExpertCount = 0  # experts each token is routed to
    shared: ExpertCount = 0  # experts every token goes through
    bytes_per_expert: Bytes = 0  # one routed expert's weights (gate, up and down), as the runtime holds them
    # one routed expert's FLOPs per token; 0: as many as its bytes (float16 experts: two of each per parameter; the
    # graph gives it for experts held packed)
    flops_per_expert: Flops = 0
    # how often each routed expert is among a token's chosen ones (a probe run's measure, summing to ``active``);
    # empty: uniform, ``active / count`` each
    frequencies: Annotated[
        tuple[Annotated[float, Meta(ge=0, le=1)], ...], at_most(limits.MAX_EXPERTS, "frequencies")
    ] = ()

    @property
    def expert_flops(self) -> int:
        """One routed expert's FLOPs per token."""
        return self.flops_per_expert or self.bytes_per_expert

    def frequency(self, expert: int) -> float:
        if self.frequencies:
            return self.frequencies[expert]
        return self.active / self.count if self.count else 0.0


class Block(_Doc, frozen=True):
    """One transformer block: what it weighs and what one token costs in it."""

    weight_bytes: Bytes
    flops: Flops  # per token, decode (two per multiply-add)
    kv_bytes: Bytes  # KV cache per token of context
    experts: Experts = Experts()


class ModelGraph(_Doc, frozen=True):
    """The computation graph: embed -> blocks[0] -> ... -> blocks[-1] -> norm + head -> token."""

    source: str  # what resolve_model takes: a path, a URL or a synthetic: spec
    sha256: str  # of the GGUF file; a plan runs only on the model it was made for
    arch: str
    dim: Dim
    vocab: Vocab
    max_context: Context
    embed_bytes: Bytes
    head_bytes: Bytes  # final norm and output matrix (the embedding again when tied)
    head_flops: Flops
    activation_bytes: Bytes  # one token's hidden state on an activation edge
    token_bytes: Bytes  # one token on the feedback edge
    blocks: Annotated[tuple[Block, ...], at_most(limits.MAX_BLOCKS, "blocks", 1)]
    # how the weight bytes are counted: "" as the node runtime holds them (each tensor in the file's own type, packed
    # or float16: ppharness.model.held); an override (--weights: a quantised GGUF type, q4_k, ..., or bits per
    # weight): for the simulator only (ppharness.plan.graph), a run refuses the plan
    weights: str = ""


# --- cluster ----------------------------------------------------------------------------------------------------


class Source(_Doc, frozen=True):
    """Where a device comes from: a process here, a docker container (with limits), or a vast.ai offer.

    Devices with the same ``host`` are GPUs of one machine, ``gpu`` each (its index there, as
    ``CUDA_VISIBLE_DEVICES`` counts): on vast.ai one instance of the host's offer runs a node per GPU; a local or
    docker node sees only its own GPU. A hop between two of them is costed by the cluster's ``host_link``."""

    kind: Literal["local", "docker", "vastai"] = "local"
    cpus: Annotated[float, Meta(gt=0, le=1024)] | None = None  # docker: the container's CPU quota
    memory_limit: Bytes | None = None  # docker: the container's memory limit (default: the run's docker settings)
    # vastai: the offer search, in provider.vastai's words, e.g. {gpu_name: RTX 4090, num_gpus: "8"}
    # (backends/vastai/offers.py: the keys and their values)
    offer: Annotated[dict[str, str], Meta(max_length=16)] | None = None
    host: Name | None = None
    gpu: Annotated[int, Meta(ge=0, le=63, description="a GPU index, 0 to 63")] | None = None


class Measured(_Doc, frozen=True):
    """What a device's speeds were measured with: the engine (``ppharness.plan.provenance.engine_id``: its version and
    the digest of the code that computes), the hardware and the day. A device without it is assumed, not measured."""

    engine: Annotated[str, Meta(max_length=200)] = ""
    hardware: Annotated[str, Meta(max_length=200)] = ""
    date: Annotated[str, Meta(max_length=40)] = ""
    how: Annotated[str, Meta(max_length=400)] = ""  # the command (or derivation) that gave the figures


class Device(_Doc, frozen=True):
    """One machine (or a share of one) that can run a node."""

    id: Name
    memory: Bytes
    # each float field has an upper bound: the canonical form is JSON, which has no infinity
    # effective decode speed: FLOPs per token / seconds per token
    gflops: Annotated[float, Meta(gt=0, le=1e12, description="GFLOP/s, more than 0, at most 1e12")]
    # memory bandwidth; None: not the bound
    bandwidth_gbs: Annotated[float, Meta(gt=0, le=1e12, description="GB/s, more than 0, at most 1e12")] | None = None
    # fixed cost per token of a node on this device
    overhead_ms: Annotated[float, Meta(ge=0, le=60_000, description="milliseconds, 0 to 60000")] = 0.0
    # a prompt's prefill on this device: a fixed cost per node and per block (the runtime lowers an un-captured graph
    # for it each time), as ``ppharness plan probe`` measures them
    prefill_ms: Annotated[float, Meta(ge=0, le=600_000)] = 0.0
    prefill_block_ms: Annotated[float, Meta(ge=0, le=600_000)] = 0.0
    # a batch of prompt tokens through a block: FLOPs per second (None: ``gflops``, as in decode)
    prefill_gflops: Annotated[float, Meta(gt=0, le=1e12)] | None = None
    reserve: Bytes = DEFAULT_RESERVE  # memory the runtime needs besides weights and KV cache
    usd_per_hour: Annotated[float, Meta(ge=0, le=1e6, description="US dollars per hour, 0 to 1e6")] = 0.0
    region: Name | None = None
    source: Source = Source()
    measured: Measured | None = None


class Impaired(Impairment, frozen=True, omit_defaults=True):
    """A link's impairment as the plan writes it: the WAN emulation's vocabulary, defaults left out."""


class Link(Impairment, frozen=True, rename={"src": "from", "dst": "to"}, omit_defaults=True):
    """One directed link between two devices (or regions): ``{from: a, to: b, delay_ms: 25, rate_mbit: 100}``.
    Given one way only, it holds both ways."""

    src: str = ""
    dst: str = ""

    def impairment(self) -> Impairment:
        return Impairment(**{f: getattr(self, f) for f in Impairment.__struct_fields__})


class Cluster(_Doc, frozen=True):
    """Devices and links. A pair's link is its own entry in ``links``, else ``host_link`` when both are GPUs of one
    host, else its regions' entry in ``region_links``, else ``default``. Fixed costs: a hop's, a hand-over's."""

    devices: Annotated[tuple[Device, ...], at_most(limits.MAX_DEVICES, "devices", 1)]
    default: Impaired = Impaired()
    region_links: Annotated[tuple[Link, ...], at_most(limits.MAX_LINKS, "links")] = ()
    links: Annotated[tuple[Link, ...], at_most(limits.MAX_LINKS, "links")] = ()
    hop_ms: Annotated[float, Meta(ge=0, le=60_000, description="milliseconds, 0 to 60000")] = 0.0  # one hop's cost
    handoff_ms: Annotated[float, Meta(ge=0, le=60_000, description="milliseconds, 0 to 60000")] = 0.0  # co-located
    name: str = ""
    host_link: Impaired = Impaired()  # between two GPUs of one host (devices with the same source.host)

    def device(self, device_id: str) -> Device:
        return by_key(self.devices, _device_id)[device_id]  # KeyError for an unknown id

    def link(self, src: str, dst: str) -> Impairment:
        """What the link from device ``src`` to device ``dst`` does."""
        found = _find_link(self.links, src, dst)
        if found is not None:
            return found
        if self.same_host(src, dst):
            return _impairment(self.host_link)
        a, b = self.device(src).region, self.device(dst).region
        if a is not None and b is not None and a != b:
            found = _find_link(self.region_links, a, b)
            if found is not None:
                return found
        return _impairment(self.default)

    def same_host(self, a: str, b: str) -> bool:
        """Whether devices ``a`` and ``b`` are GPUs of one host."""
        host = self.device(a).source.host
        return host is not None and host == self.device(b).source.host


def _device_id(device: Device) -> str:
    return device.id


def _impairment(value: Impairment) -> Impairment:
    """``value`` as a plain Impairment (a plan's link types are subclasses of it)."""
    if type(value) is Impairment:
        return value
    return Impairment(**{f: getattr(value, f) for f in Impairment.__struct_fields__})


def _find_link(links: tuple[Link, ...], src: str, dst: str) -> Impairment | None:
    back = None
    for link in links:
        if (link.src, link.dst) == (src, dst):
            return link.impairment()
        if (link.src, link.dst) == (dst, src):
            back = link.impairment()
    return back


# --- placement --------------------------------------------------------------------------------------------------


class Embed(_Doc, frozen=True, tag="embed", tag_field="op"):
    """Token ids -> hidden states (the entry node's first op)."""


class Blocks(_Doc, frozen=True, tag="blocks", tag_field="op"):
    """Blocks ``lo`` to ``hi - 1``."""

    lo: BlockIndex
    hi: BlockIndex

    def __post_init__(self) -> None:
        if self.hi <= self.lo:
            raise FieldError("hi", f"the range {self.lo}..{self.hi} is empty — hi must be more than lo")


class Head(_Doc, frozen=True, tag="head", tag_field="op"):
    """Final norm, output matrix and argmax: hidden state -> next token (the exit node's last op)."""


class ExpertGroup(_Doc, frozen=True, tag="experts", tag_field="op"):
    """Routed experts ``ids`` of the mixture-of-experts block ``layer``, computed on this node for whichever node
    runs the block (a fan-out edge joins the two)."""

    layer: BlockIndex
    ids: Annotated[tuple[ExpertId, ...], at_most(limits.MAX_EXPERTS, "expert ids", 1)]

    def __post_init__(self) -> None:
        if any(a >= b for a, b in zip(self.ids, self.ids[1:])):
            raise FieldError("ids", f"{list(self.ids)[:20]} must be increasing, each expert once — sort them")


Op = Embed | Blocks | Head | ExpertGroup


class Node(_Doc, frozen=True):
    """A device running an ordered list of ops. ``name`` defaults to the device's id."""

    device: Name
    ops: Annotated[tuple[Op, ...], at_most(limits.MAX_OPS, "ops", 1)]
    name: str = ""

    def __post_init__(self) -> None:
        if self.name and not ID_NAME.match(self.name):
            raise FieldError("name", f"{self.name[:70]!r} is not a node name — use lower-case letters, digits, - and _")

    @property
    def label(self) -> str:
        return self.name or self.device

    @property
    def blocks(self) -> tuple[int, int] | None:
        """The block range this node runs, or None."""
        ranges = [(op.lo, op.hi) for op in self.ops if isinstance(op, Blocks)]
        return (ranges[0][0], ranges[-1][1]) if ranges else None

    @property
    def embeds(self) -> bool:
        return any(isinstance(op, Embed) for op in self.ops)

    @property
    def experts(self) -> dict[int, tuple[int, ...]]:
        """Layer -> the routed experts of that layer this node computes (its ``experts`` ops)."""
        out: dict[int, tuple[int, ...]] = {}
        for op in self.ops:
            if isinstance(op, ExpertGroup):
                out[op.layer] = tuple(sorted({*out.get(op.layer, ()), *op.ids}))
        return out

    @property
    def expert_only(self) -> bool:
        """An expert node: it computes experts and nothing else (it is not on the loop)."""
        return all(isinstance(op, ExpertGroup) for op in self.ops)

    @property
    def heads(self) -> bool:
        return any(isinstance(op, Head) for op in self.ops)


class Edge(_Doc, frozen=True, rename={"src": "from", "dst": "to"}):
    """What flows from node to node: ``activation`` (hidden states), ``token`` (the exit's token, to the entry) or
    ``experts`` (a MoE block's owner fans its tokens out to an expert node and gathers the results)."""

    src: Name
    dst: Name
    kind: Literal["activation", "token", "experts"] = "activation"


class Objective(_Doc, frozen=True):
    """What the plan is best at: per-token ``latency`` of one request, ``throughput`` with ``requests`` in flight,
    or ``cost`` in $ per token."""

    kind: Literal["latency", "throughput", "cost"] = "latency"
    requests: Annotated[int, Meta(ge=1, le=4096)] = 1


class Placement(_Doc, frozen=True):
    nodes: Annotated[tuple[Node, ...], at_most(limits.MAX_DEVICES, "nodes", 1)]
    edges: Annotated[tuple[Edge, ...], at_most(limits.MAX_EDGES, "edges")] = ()
    spares: Annotated[tuple[Name, ...], at_most(limits.MAX_DEVICES, "spares")] = ()
    objective: Objective = Objective()
    policy: str = ""  # what made it: optimal, even, memory, or "" for a hand-written plan
    # what a run of it does when a message is lost or a node dies (ppharness.run.reliable); "" leaves it to the
    # scenario (default none). ``failover`` replaces a dead node by one of ``spares``.
    fault_tolerance: Literal["", "none", "retry", "failover"] = ""


class PlanDoc(_Doc, frozen=True):
    """A whole plan. ``id`` is the hash of the canonical form (empty in a hand-written file)."""

    version: Literal[1]
    model: ModelGraph
    cluster: Cluster
    placement: Placement
    id: str = ""


# --- canonical form and id --------------------------------------------------------------------------------------

_encoder = msgspec.json.Encoder(order="sorted")


@functools.cache
def _defaults(kind: type[msgspec.Struct]) -> tuple[tuple[str, str, object], ...]:
    """Each field of the struct type ``kind``: its name, its name in the document and its default value (NODEFAULT
    for a required field), worked out once per type (``msgspec.structs.fields`` resolves the annotations each call)."""
    out = []
    for f in msgspec.structs.fields(kind):
        default = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
        out.append((f.name, f.encode_name, default))
    return tuple(out)


def _plain(value: object) -> object:
    """``value`` as JSON data with every struct field that equals its default left out (by value: msgspec's own
    ``omit_defaults`` compares a struct-valued default by identity), tags kept."""
    if isinstance(value, msgspec.Struct):
        out: dict[str, object] = {}
        config = value.__struct_config__
        if isinstance(config.tag_field, str) and config.tag is not None:
            out[config.tag_field] = config.tag
        for name, encode_name, default in _defaults(type(value)):
            v = getattr(value, name)
            if default is not msgspec.NODEFAULT and v == default:
                continue
            out[encode_name] = _plain(v)
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _body(doc: PlanDoc) -> bytes:
    """The canonical bytes of ``doc`` as it is (after a round trip through the typed form, so that a whole number
    given for a float field reads as the float it becomes)."""
    typed = msgspec.json.decode(_encoder.encode(doc), type=PlanDoc)
    return _encoder.encode(_plain(typed))


def canonical(doc: PlanDoc) -> bytes:
    """The plan's canonical JSON (keys sorted, no spaces, defaults left out), with its id."""
    return _body(with_id(doc))


def plan_id(doc: PlanDoc) -> str:
    """The content hash of the plan's canonical form with ``id`` left empty."""
    return hashlib.sha256(_body(msgspec.structs.replace(doc, id=""))).hexdigest()[:16]


def with_id(doc: PlanDoc) -> PlanDoc:
    return msgspec.structs.replace(doc, id=plan_id(doc))


PRETTY_WIDTH = 120  # a list of numbers (expert ids, frequencies) wraps at this width


def pretty(doc: PlanDoc) -> str:
    """The canonical form, indented for people (the same sorted keys, one space per level); a list of numbers fills
    lines up to PRETTY_WIDTH instead of taking a line per number (a large MoE plan names tens of thousands of
    experts)."""
    return _pretty(msgspec.json.decode(canonical(doc)), 0) + "\n"


def _pretty(value: object, level: int) -> str:
    pad, inner = " " * level, " " * (level + 1)
    if isinstance(value, dict):
        if not value:
            return "{}"
        items = [f"{inner}{json.dumps(k)}: {_pretty(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(value, list):
        if not value:
            return "[]"
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            lines, line = [], ""
            for text in (json.dumps(v) for v in value):
                if line and len(inner) + len(line) + len(text) + 3 > PRETTY_WIDTH:
                    lines.append(line + ",")
                    line = ""
                line = f"{line}, {text}" if line else text
            lines.append(line)
            return "[\n" + "\n".join(inner + x for x in lines) + "\n" + pad + "]"
        return "[\n" + ",\n".join(inner + _pretty(v, level + 1) for v in value) + "\n" + pad + "]"
    return json.dumps(value)


# --- reading ----------------------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.I)
_RANGE = re.compile(r"^\s*(?:blk\s*\[\s*(\d{1,30})\s*:\s*(\d{1,30})\s*\]|(\d{1,30})\s*\.\.\s*(\d{1,30}))\s*$")
_SIZE_KEYS = {"memory", "memory_limit", "reserve"}
_CONVENIENCES = (("Blocks", "blocks"),)  # keys a file may write that ``_op`` turns into the struct's own
_SIZE_DIGITS = 4000  # Python converts at most 4300 digits to an int: a longer number is left as text


def parse_size(text: str) -> int | None:
    """``2g``, ``512MiB``, ``1.5GB``, ``4096`` -> bytes (powers of 1024), computed exactly whatever its digits (a
    size over ``limits.MAX_BYTES`` is refused by the field's bound); None if it is not a size."""
    m = _SIZE.match(text)
    if m is None or len(m[1]) > _SIZE_DIGITS:
        return None
    unit = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}[m[2].lower()]
    whole, _, fraction = str(m[1]).partition(".")
    return int(whole + fraction) * unit // int(10 ** len(fraction))


def parse_range(text: str) -> tuple[int, int] | None:
    """``0..6`` or ``blk[0:6]`` -> (0, 6); None if it is neither."""
    m = _RANGE.match(text)
    if m is None:
        return None
    lo, hi = (m[1], m[2]) if m[1] is not None else (m[3], m[4])
    return int(lo), int(hi)


def _surface(raw: object, key: str = "") -> object:
    """The people's conveniences turned into the document's plain form (sizes, ranges, bare op words)."""
    if isinstance(raw, dict):
        return {k: _surface(v, k if isinstance(k, str) else "") for k, v in raw.items()}
    if isinstance(raw, list):
        if key == "ops":
            return [_op(item) for item in raw]
        return [_surface(v) for v in raw]
    if isinstance(raw, str) and key in _SIZE_KEYS:
        size = parse_size(raw)
        return raw if size is None else size
    return raw


def _op(item: object) -> object:
    if isinstance(item, str):
        if item.strip() in ("embed", "head"):
            return {"op": item.strip()}
        r = parse_range(item)
        return {"op": "blocks", "lo": r[0], "hi": r[1]} if r is not None else item
    if isinstance(item, dict) and set(item) == {"blocks"}:
        value = item["blocks"]
        r = parse_range(value) if isinstance(value, str) else None
        if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value):
            r = (value[0], value[1])
        return {"op": "blocks", "lo": r[0], "hi": r[1]} if r is not None else item
    return item


def decode_text(text: str, source: str, kind: type[PlanDoc] | type[Cluster] = PlanDoc) -> Any:
    """A plan (or cluster) from YAML or JSON text: screened for hostile YAML, conveniences applied, typed, checked
    field by field. Every problem is a PlanError naming ``source``, the ``$.path`` and the fix."""
    raw = parse_text(text, source, PLAN_LIMITS, PlanError, keys_of(kind, _CONVENIENCES))
    if raw is None:
        what = "a plan needs version, model, cluster and placement" if kind is PlanDoc else "a cluster needs devices"
        raise PlanError(f"{source}: $: the file is empty — {what}")
    plain = _surface(raw)
    try:
        return msgspec.convert(plain, type=kind, strict=False)
    except msgspec.ValidationError as exc:
        raise PlanError(f"{source}: {explain(exc, plain, kind, PLAN_VERSION)}") from None


def plan_schema() -> dict[str, Any]:
    """The JSON Schema of the plan document (``ppharness plan schema``)."""
    schema: dict[str, Any] = msgspec.json.schema(PlanDoc)
    schema["title"] = "ppharness plan"
    return schema


@dataclass(frozen=True)
class Hop:
    """One edge of the loop, in order: from node ``src`` to node ``dst``, carrying ``kind``."""

    src: Node
    dst: Node
    kind: Literal["activation", "token"]


def expert_holders(doc: PlanDoc) -> dict[tuple[int, int], list[str]]:
    """(layer, expert) -> the labels of the nodes computing it, in node order; empty when the plan places no experts
    (every stage then computes the experts of its own blocks)."""
    out: dict[tuple[int, int], list[str]] = {}
    for node in doc.placement.nodes:
        for layer, ids in node.experts.items():
            for e in ids:
                out.setdefault((layer, e), []).append(node.label)
    return out


def expert_nodes(doc: PlanDoc) -> list[Node]:
    """The nodes off the loop that only compute experts, in node order."""
    return [n for n in doc.placement.nodes if n.expert_only]


def loop(doc: PlanDoc) -> list[Node]:
    """The nodes in the order the activations visit them, entry first (the plan must have passed ``check_plan``)."""
    by_label = {n.label: n for n in doc.placement.nodes}
    entry = next(n for n in doc.placement.nodes if n.embeds)
    nxt = {e.src: e.dst for e in doc.placement.edges if e.kind == "activation"}
    order = [entry]
    while order[-1].label in nxt and len(order) <= len(by_label):
        order.append(by_label[nxt[order[-1].label]])
    return order


def hops(doc: PlanDoc) -> list[Hop]:
    """The loop's edges in order: activations along the chain, then the token back to the entry."""
    order = loop(doc)
    out = [Hop(a, b, "activation") for a, b in zip(order, order[1:])]
    out.append(Hop(order[-1], order[0], "token"))
    return out
