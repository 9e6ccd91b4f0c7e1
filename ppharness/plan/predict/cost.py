"""The cost model: what one token costs on a node and on an edge, in milliseconds.

A node's time per token is its device's fixed cost per token plus, for each block, the larger of its FLOPs over the
device's speed and its weight bytes over the device's memory bandwidth (decode reads every weight once per token),
plus the head on the exit. An edge's time is the link's one-way latency, the bytes over its bandwidth, and the
cluster's fixed cost per hop (what the trace measures for the transport).

A mixture-of-experts block (``experts.count`` above 0) is two parts: its dense part (attention, router, any shared
expert: the block's FLOPs less ``active`` routed experts', its weights less all ``count`` routed experts') and the
``active`` routed experts a token is sent to, each reading its ``bytes_per_expert`` and doing its ``expert_flops``
(as many as its bytes for float16 experts, two of each per parameter; experts held packed, as a quantised file
stores them, read fewer bytes for the same FLOPs). Each part is the larger of FLOPs over speed and bytes over
bandwidth, and a block whose experts stay with it costs the sum (``routed``). Where a plan places the experts on
nodes of their own, the block's owner computes the dense part and the experts' time is the fan-out's
(``ppharness.plan.predict.fanout``): one message per expert node chosen (``request_bytes`` out, ``reply_bytes`` back,
``remote_experts_ms`` for the round trip).

A device with a CPU quota (docker's ``cpus``, below 1) runs at full speed while its share lasts, so one token still
takes ``node_ms`` there, but the node cannot be busy more than ``cpus`` of the time: it is busy ``node_ms / cpus`` per
token (``busy_ms``), and no loop turns faster than its busiest resource (``loop_ms``).

The planner and the simulator both use these functions, and both add a loop up with ``loop_parts`` and
``loop_time``, so that what is searched is what is predicted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

from ppharness.plan.lang.document import Block, Cluster, Device, ModelGraph

EXPERT_HEADER_BYTES = 64  # one fan-out message's header (request id, position, layer), either way
EXPERT_ID_BYTES = 8  # one chosen expert in a request: its id and its gate weight


def _seconds(flops: float, nbytes: float, device: Device) -> float:
    """The larger of ``flops`` over the device's speed and ``nbytes`` over its memory bandwidth."""
    t = flops / (device.gflops * 1e9)
    if device.bandwidth_gbs is not None:
        t = max(t, nbytes / (device.bandwidth_gbs * 1e9))
    return t


def dense_part(block: Block) -> tuple[int, int]:
    """(FLOPs per token, weight bytes) of a block without its routed experts (the whole block when it is dense)."""
    x = block.experts
    return block.flops - x.active * x.expert_flops, block.weight_bytes - x.count * x.bytes_per_expert


def block_seconds(block: Block, device: Device, routed: bool = True, rows: int = 1, context: int = 0) -> float:
    """Decode time of one block on ``device`` in seconds: its dense part, plus its ``active`` routed experts when
    ``routed`` (left out where the plan places the block's experts). A batched step of ``rows`` requests
    (``ppharness.model.layers.rows``) reads the weights once and each request's KV cache of ``context`` positions, and
    does every row's FLOPs; its routed experts read the weights of the distinct experts the rows choose (expected, for
    uniform routing)."""
    kv = rows * block.kv_bytes * context
    if block.experts.count == 0:
        return _seconds(rows * block.flops, block.weight_bytes + kv, device)
    flops, nbytes = dense_part(block)
    t = _seconds(rows * flops, nbytes + kv, device)
    if not routed:
        return t
    x = block.experts
    distinct = x.count * (1 - (1 - x.active / x.count) ** rows) if rows > 1 else x.active
    return t + _seconds(rows * x.active * x.expert_flops, distinct * x.bytes_per_expert, device)


def blocks_ms(
    model: ModelGraph, device: Device, lo: int, hi: int, routed: bool = True, rows: int = 1, context: int = 0
) -> float:
    """Decode time of blocks [lo, hi) on ``device`` (without the fixed cost per token); ``routed``: with the routed
    experts of mixture-of-experts blocks; ``rows``, ``context``: a batched step's (``block_seconds``)."""
    total = 0.0
    for b in model.blocks[lo:hi]:
        total += block_seconds(b, device, routed, rows, context)
    return total * 1e3


def head_ms(model: ModelGraph, device: Device, rows: int = 1) -> float:
    """The final norm, output matrix and argmax on ``device`` (for ``rows`` requests: the matrix read once)."""
    return _seconds(rows * model.head_flops, model.head_bytes, device) * 1e3


def node_ms(
    model: ModelGraph,
    device: Device,
    lo: int,
    hi: int,
    head: bool,
    routed: bool = True,
    rows: int = 1,
    context: int = 0,
) -> float:
    """One token through a node on ``device`` running blocks [lo, hi) (and the head when ``head``); ``routed``: with
    the routed experts of its mixture-of-experts blocks; ``rows``: one batched step of that many requests (the fixed
    cost once, ``block_seconds``)."""
    blocks = blocks_ms(model, device, lo, hi, routed, rows, context)
    return device.overhead_ms + blocks + (head_ms(model, device, rows) if head else 0.0)


def _expert_seconds(device: Device, block: Block, k: float) -> float:
    x = block.experts
    return _seconds(k * x.expert_flops, k * x.bytes_per_expert, device)


def expert_ms(device: Device, block: Block, k: float) -> float:
    """``k`` routed experts of ``block`` for one token on ``device`` (no fixed cost): each reads its weights and does
    its FLOPs."""
    return _expert_seconds(device, block, k) * 1e3


def request_bytes(model: ModelGraph, k: int, tokens: int = 1) -> int:
    """A fan-out request of ``tokens`` hidden states for ``k`` (token, expert) pairs: the hidden states, each pair's
    expert id and gate weight, a header."""
    return tokens * model.activation_bytes + EXPERT_ID_BYTES * k + EXPERT_HEADER_BYTES


def reply_bytes(model: ModelGraph, k: int) -> int:
    """A fan-out reply: one hidden state per (token, expert) pair computed, and a header."""
    return k * model.activation_bytes + EXPERT_HEADER_BYTES


def remote_experts_ms(model: ModelGraph, cluster: Cluster, owner: str, device: Device, block: Block, k: int) -> float:
    """The round trip of one fan-out message from the block's owner (device ``owner``) to an expert node on
    ``device`` computing ``k`` of a token's experts: the request, the node's fixed cost, the experts, the reply.
    Nothing when ``k`` is 0 (no message is sent)."""
    if k == 0:
        return 0.0
    return (
        edge_ms(cluster, owner, device.id, request_bytes(model, k))
        + device.overhead_ms
        + expert_ms(device, block, k)
        + edge_ms(cluster, device.id, owner, reply_bytes(model, k))
    )


def expert_prefill_ms(device: Device, block: Block, evaluations: float, distinct: float) -> float:
    """A prompt's routed-expert work on ``device``: ``evaluations`` (token, expert) pairs at the device's batched
    speed, or the weights of the ``distinct`` experts they touch read once, whichever is longer."""
    x = block.experts
    speed = (device.prefill_gflops or device.gflops) * 1e9
    t = evaluations * x.expert_flops / speed
    if device.bandwidth_gbs is not None:
        t = max(t, distinct * x.bytes_per_expert / (device.bandwidth_gbs * 1e9))
    return t * 1e3


def touched(block: Block, prompt_tokens: int, ids: range | tuple[int, ...] | None = None) -> float:
    """The expected number of routed experts (of ``ids``, default all) that at least one of ``prompt_tokens`` tokens
    is sent to, each token choosing expert e with probability ``frequency(e)``."""
    x = block.experts
    chosen = range(x.count) if ids is None else ids
    return sum(1.0 - (1.0 - min(1.0, x.frequency(e))) ** prompt_tokens for e in chosen)


def edge_ms(cluster: Cluster, src: str, dst: str, nbytes: int) -> float:
    """One message of ``nbytes`` from device ``src`` to device ``dst``; when they are one device (co-located stages,
    one process), the hand-over's fixed cost."""
    if src == dst:
        return cluster.handoff_ms
    link = cluster.link(src, dst)
    wire = nbytes * 8 / (link.rate_mbit * 1e6) * 1e3 if link.rate_mbit is not None else 0.0
    return link.delay_ms + wire + cluster.hop_ms


def serialization_ms(cluster: Cluster, src: str, dst: str, nbytes: int) -> float:
    """How long ``nbytes`` occupy the link from ``src`` to ``dst`` (what limits throughput on it)."""
    if src == dst:
        return 0.0
    link = cluster.link(src, dst)
    return nbytes * 8 / (link.rate_mbit * 1e6) * 1e3 if link.rate_mbit is not None else 0.0


def cpu_share(device: Device) -> float:
    """The share of a CPU the device's node may use: its docker quota when below one CPU, else 1."""
    cpus = device.source.cpus
    return min(cpus, 1.0) if cpus is not None else 1.0


def busy_ms(node_time_ms: float, device: Device) -> float:
    """How long one token occupies ``device``'s CPU share: the node's time over the share."""
    return node_time_ms / cpu_share(device)


def loop_ms(parts_ms: float, busiest_ms: float) -> float:
    """Per-token time of one request: the sum of the loop's parts, or the busiest resource's time per token when
    that is longer (a quota-bound node)."""
    return max(parts_ms, busiest_ms)


class LoopNode(NamedTuple):
    """A node on the loop as the cost model sees it: its device, its blocks [lo, hi), whether it applies the head."""

    device: Device
    lo: int
    hi: int
    head: bool
    serving_ms: float = 0.0  # the expert work it serves per token: busy time, not part of the token's way


class Part(NamedTuple):
    """One part of a decode token's way around the loop: a node's compute or one message between two nodes."""

    ms: float  # the token's time there
    busy_ms: float  # how long it occupies the resource: the node's CPU share, or the link (serialisation)


def loop_parts(
    model: ModelGraph,
    cluster: Cluster,
    nodes: Sequence[LoopNode],
    routed: bool = True,
    rows: int = 1,
    context: int = 0,
) -> tuple[list[Part], list[Part]]:
    """One decode token around the loop over ``nodes`` (loop order, entry first): each node's compute (``node_ms``,
    busy ``busy_ms`` of it and the expert work the node serves), then each edge's message (``edge_ms``, busy
    ``serialization_ms``): the activations along the chain, then the token from the exit back to the entry. A loop of
    one node has no edge: the token stays on its device. ``routed``: as for ``node_ms``; ``rows``: a batched step of
    that many requests (``node_ms``; each message carries every row)."""
    compute = []
    for node in nodes:
        ms = node_ms(model, node.device, node.lo, node.hi, node.head, routed, rows, context)
        compute.append(Part(ms, busy_ms(ms + rows * node.serving_ms, node.device)))
    edges = []
    if len(nodes) > 1:
        for i, src in enumerate(nodes):
            dst = nodes[(i + 1) % len(nodes)]
            nbytes = rows * (model.activation_bytes if i < len(nodes) - 1 else model.token_bytes)
            a, b = src.device.id, dst.device.id
            edges.append(Part(edge_ms(cluster, a, b, nbytes), serialization_ms(cluster, a, b, nbytes)))
    return compute, edges


def loop_time(parts: Iterable[Part]) -> tuple[float, float]:
    """(L, b): one token's time around the loop (the parts' times added up, in order) and the busiest resource's
    time per token."""
    total, busiest = 0.0, 0.0
    for part in parts:
        total += part.ms
        busiest = max(busiest, part.busy_ms)
    return total, busiest


def prefill_ms(
    model: ModelGraph, device: Device, lo: int, hi: int, head: bool, prompt_tokens: int, routed: bool = True
) -> float:
    """A prompt of ``prompt_tokens`` through a node on ``device`` (blocks [lo, hi), the head when ``head``): its fixed
    costs (per step, per prefill, per block) and, per block, the larger of its FLOPs for every prompt token at the
    device's batched speed and its weights read once; the head once (only the last position's token is wanted). A
    mixture-of-experts block's routed experts (when ``routed``) add ``expert_prefill_ms`` of ``active`` experts per
    token and the experts the prompt touches (``touched``)."""
    speed = (device.prefill_gflops or device.gflops) * 1e9
    total = 0.0
    for b in model.blocks[lo:hi]:
        flops, nbytes = dense_part(b)
        t = flops * prompt_tokens / speed
        if device.bandwidth_gbs is not None:
            t = max(t, nbytes / (device.bandwidth_gbs * 1e9))
        if routed and b.experts.count:
            evaluations = prompt_tokens * b.experts.active
            t += expert_prefill_ms(device, b, evaluations, touched(b, prompt_tokens)) / 1e3
        total += t
    return (
        device.overhead_ms
        + device.prefill_ms
        + (hi - lo) * device.prefill_block_ms
        + total * 1e3
        + (head_ms(model, device) if head else 0.0)
    )
