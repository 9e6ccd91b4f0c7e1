"""The cost model: what one token costs on a node and on an edge, in milliseconds.

A node's time per token is its device's fixed cost per token plus, for each block, the larger of its FLOPs over the
device's speed and its weight bytes over the device's memory bandwidth (decode reads every weight once per token),
plus the head on the exit. An edge's time is the link's one-way latency, the bytes over its bandwidth, and the
cluster's fixed cost per hop (what the trace measures for the transport).

A device with a CPU quota (docker's ``cpus``, below 1) runs at full speed while its share lasts, so one token still
takes ``node_ms`` there, but the node cannot be busy more than ``cpus`` of the time: it is busy ``node_ms / cpus`` per
token (``busy_ms``), and no loop turns faster than its busiest resource (``loop_ms``).

The planner and the simulator both use these functions, so that what is searched is what is predicted.
"""

from __future__ import annotations

from ppharness.plan.doc import Cluster, Device, ModelGraph


def blocks_ms(model: ModelGraph, device: Device, lo: int, hi: int) -> float:
    """Decode time of blocks [lo, hi) on ``device`` (without the fixed cost per token)."""
    total = 0.0
    for b in model.blocks[lo:hi]:
        t = b.flops / (device.gflops * 1e9)
        if device.bandwidth_gbs is not None:
            t = max(t, b.weight_bytes / (device.bandwidth_gbs * 1e9))
        total += t
    return total * 1e3


def head_ms(model: ModelGraph, device: Device) -> float:
    """The final norm, output matrix and argmax on ``device``."""
    t = model.head_flops / (device.gflops * 1e9)
    if device.bandwidth_gbs is not None:
        t = max(t, model.head_bytes / (device.bandwidth_gbs * 1e9))
    return t * 1e3


def node_ms(model: ModelGraph, device: Device, lo: int, hi: int, head: bool) -> float:
    """One token through a node on ``device`` running blocks [lo, hi) (and the head when ``head``)."""
    return device.overhead_ms + blocks_ms(model, device, lo, hi) + (head_ms(model, device) if head else 0.0)


def edge_ms(cluster: Cluster, src: str, dst: str, nbytes: int) -> float:
    """One message of ``nbytes`` from device ``src`` to device ``dst``; nothing when they are one device."""
    if src == dst:
        return 0.0
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


def prefill_ms(model: ModelGraph, device: Device, lo: int, hi: int, head: bool, prompt_tokens: int) -> float:
    """A prompt of ``prompt_tokens`` through a node on ``device`` (blocks [lo, hi), the head when ``head``): its fixed
    costs (per step, per prefill, per block) and, per block, the larger of its FLOPs for every prompt token at the
    device's batched speed and its weights read once; the head once (only the last position's token is wanted)."""
    speed = (device.prefill_gflops or device.gflops) * 1e9
    total = 0.0
    for b in model.blocks[lo:hi]:
        t = b.flops * prompt_tokens / speed
        if device.bandwidth_gbs is not None:
            t = max(t, b.weight_bytes / (device.bandwidth_gbs * 1e9))
        total += t
    return (
        device.overhead_ms
        + device.prefill_ms
        + (hi - lo) * device.prefill_block_ms
        + total * 1e3
        + (head_ms(model, device) if head else 0.0)
    )
