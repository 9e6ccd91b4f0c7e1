"""What a plan asks of its devices: stages that share one are co-located (one process drives them), and every
device holds what its nodes need. Part of ``ppharness.plan.lang.check``'s invariants."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ppharness.errors import PlanError
from ppharness.plan.lang.document import Blocks, Embed, ExpertGroup, Head

if TYPE_CHECKING:
    from ppharness.plan.lang.document import ModelGraph, Node, PlanDoc

SHOWN = 12  # names (or loop nodes) an error lists before saying how many more there are


def some(names: Iterable[str], order: bool = True) -> str:
    """Up to SHOWN of ``names`` (sorted when ``order``), with how many more there are."""
    listed = sorted(names) if order else list(names)
    more = f" and {len(listed) - SHOWN:,} more" if len(listed) > SHOWN else ""
    return ", ".join(listed[:SHOWN]) + more


def chain_text(path: list[str]) -> str:
    """``a -> b -> c``, its middle left out for a long loop."""
    if len(path) <= SHOWN:
        return " -> ".join(path)
    half = SHOWN // 2
    return f"{' -> '.join(path[:half])} -> ({len(path) - SHOWN:,} more) -> {' -> '.join(path[-half:])}"


def gib(n: float) -> str:
    """Bytes for people: ``1.50 GiB``, ``312.0 MiB``."""
    return f"{n / (1 << 30):.2f} GiB" if abs(n) >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def places_experts(doc: PlanDoc) -> bool:
    """Whether the plan says where the experts are (any ``experts`` op); if not, each block's experts stay with it."""
    return any(isinstance(op, ExpertGroup) for n in doc.placement.nodes for op in n.ops)


def routed_bytes(model: ModelGraph, lo: int, hi: int) -> int:
    """The weights of every routed expert of blocks [lo, hi)."""
    return sum(b.experts.count * b.experts.bytes_per_expert for b in model.blocks[lo:hi])


def node_weights(doc: PlanDoc, node: Node, placed: bool | None = None) -> int:
    """Bytes of weights ``node`` loads: its blocks, plus the embedding on the entry and the head on the exit; where
    the plan places the experts, its blocks without their routed experts and each expert its ``experts`` ops list.
    ``placed``: ``places_experts(doc)`` when the caller knows it (it reads every node)."""
    model, total = doc.model, 0
    placed = places_experts(doc) if placed is None else placed
    for op in node.ops:
        if isinstance(op, Embed):
            total += model.embed_bytes
        elif isinstance(op, Head):
            total += model.head_bytes
        elif isinstance(op, Blocks):
            total += sum(b.weight_bytes for b in model.blocks[op.lo : op.hi])
            if placed:
                total -= routed_bytes(model, op.lo, op.hi)
        elif op.layer < len(model.blocks):
            total += len(op.ids) * model.blocks[op.layer].experts.bytes_per_expert
    return total


def node_kv(doc: PlanDoc, node: Node, requests: int = 1) -> int:
    """Bytes of KV cache ``node`` holds for ``max_context`` tokens of each of ``requests``."""
    r = node.blocks
    if r is None:
        return 0
    return requests * doc.model.max_context * sum(b.kv_bytes for b in doc.model.blocks[r[0] : r[1]])


def node_memory(doc: PlanDoc, node: Node, placed: bool | None = None) -> int:
    """What ``node`` needs of its device's memory: weights, KV cache and the device's runtime reserve (``placed``:
    as ``node_weights`` takes it)."""
    device = doc.cluster.device(node.device)
    return node_weights(doc, node, placed) + node_kv(doc, node, doc.placement.objective.requests) + device.reserve


def check_colocated(doc: PlanDoc, path: list[str], source: str) -> None:
    """Nodes sharing a device are co-located stages, one process: consecutive on the loop, and none of them fans
    out to expert nodes (whose answers the group's one loop does not wait for)."""
    nodes = {n.label: n for n in doc.placement.nodes}
    index = {n.label: i for i, n in enumerate(doc.placement.nodes)}
    device_of = [nodes[name].device for name in path]
    times = Counter(device_of)
    fans = {e.src for e in doc.placement.edges if e.kind == "experts"}
    seen: set[str] = set()  # the devices of the loop's nodes so far
    for k, name in enumerate(path):
        dev = device_of[k]
        earlier = dev in seen
        seen.add(dev)
        if times[dev] < 2:
            continue
        at = f"{source}: $.placement.nodes[{index[name]}]"
        if k > 0 and device_of[k - 1] != dev and earlier:
            raise PlanError(
                f"{at}.device: device {dev!r} runs nodes that are not consecutive on the loop {chain_text(path)} — "
                "stages on one device are co-located in one process and must follow each other; give node "
                f"{name!r} another device or reorder the loop"
            )
        if name in fans:
            raise PlanError(
                f"{at}: node {name!r} fans out to expert nodes and shares device {dev!r} with other stages — "
                "co-located stages hold their experts; give it a device of its own"
            )


def check_memory(doc: PlanDoc, source: str) -> None:
    placed = places_experts(doc)
    # co-located stages share their device: each is checked with what the nodes before it on the device hold
    held: dict[str, int] = {}
    for i, node in enumerate(doc.placement.nodes):
        device = doc.cluster.device(node.device)
        before = held.get(node.device, 0)
        need = node_memory(doc, node, placed) + before
        held[node.device] = need - device.reserve
        if need > device.memory:
            what = "experts" if node.expert_only else "blocks or experts" if node.experts else "blocks"
            kv = node_kv(doc, node, doc.placement.objective.requests)
            beside = f", and {gib(before)} of the stages beside it" if before else ""
            raise PlanError(
                f"{source}: $.placement.nodes[{i}]: node {node.label!r} needs {gib(need)} (weights "
                f"{gib(node_weights(doc, node, placed))}, KV cache {gib(kv)}"
                f" for {doc.model.max_context} tokens, runtime {gib(device.reserve)}{beside}) but device {device.id!r} "
                f"has "
                f"{gib(device.memory)} — {gib(need - device.memory)} short; move {what} to another node or use a "
                "larger device"
            )
