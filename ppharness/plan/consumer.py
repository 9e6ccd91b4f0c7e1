"""Clusters of consumer GPUs rented one card at a time, in one region, over one continent or over two continents:
the cluster files ``scenarios/clusters/consumer-*.yaml`` are ``consumer_cluster``'s output
(``python -m ppharness.plan.consumer scenarios/clusters`` writes them again; a test checks they are current).

A card's figures are the vendor's published ones (``CARDS``; docs/kimi.md cites them): 24 GiB of memory, the memory
bandwidth, the dense fp16 tensor throughput with fp32 accumulation (what a decode's matrix-vector products can use at
best; decode is bound by the bandwidth long before it), and a typical vast.ai on-demand price for one card. A node's
fixed cost per token (``OVERHEAD_MS``) and the runtime's reserve (``RESERVE``) stand for a CUDA runtime with its
kernels captured in a graph; the transport's cost per hop (``HOP_MS``) is iroh's with a bulk copy, as measured here.

Links: one region is one city's hosts (``REGION_MS`` one-way, ``RATE_MBIT`` each way); ``continent`` spreads the
cards evenly over three regions 12 to 30 ms apart (North America); ``two-continents`` over two North American and
two European regions, 10 to 30 ms apart within a continent and 75 to 150 ms across the Atlantic; ``hosts8`` puts
the cards eight to a host (vast.ai's 8-GPU offers) in one region: a message between two cards of one host goes
through that host's memory (``HOST_MS``, ZeroMQ's loopback cost as measured here, over PCIe's ``HOST_MBIT``), one
between hosts pays the region's latency and the transport's cost per hop. The cluster's ``hop_ms`` is then 0 and
each link's delay includes the transport's cost (a region of its own per host: ``region_links`` are the hosts'
links).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ppharness.plan.doc import Cluster, Device, Impaired, Link, Source

Layout = Literal["region", "continent", "two-continents", "hosts8"]
LAYOUTS: tuple[Layout, ...] = ("region", "continent", "two-continents")
GIB = 1 << 30
RESERVE = 1 * GIB  # CUDA context, the runtime's buffers and activations
# A card's fixed cost per token (what it spends beyond reading weights), measured on an H200 with tinygrad 0.12 CUDA
# and a tuned kernel table (`ppharness bench block`, 2026-12-03; docs/kimi.md): a stage's step 0.16 ms (the 1B shape)
# plus 0.76 ms per MoE block at Kimi's counts (kimi-tiny, whose 0.2 MiB of weights per block make all of it fixed
# cost: launches and the MoE step's host round trips for routing and combine). A card holds two MoE blocks.
H200_FIXED_MS = 0.16 + 2 * 0.76
H200_GEMV_GBS = 2035.0  # the H200's fp16 GEMV bandwidth measured in the same run (PyTorch, CUDA graph)


HOP_MS = 0.6  # the transport's cost per message hop (iroh with a bulk copy, measured on loopback)
REGION_MS = 1.0  # one-way latency between two hosts of one region
RATE_MBIT = 1000  # each host's link
HOST_CARDS = 8  # cards per host in the hosts8 layout
HOST_MS = 0.15  # one message between two cards of one host, the transport's cost included
HOST_MBIT = 200_000  # PCIe 4.0 x16, about 25 GB/s


@dataclass(frozen=True)
class Card:
    """One consumer GPU model's published figures and a typical vast.ai price."""

    name: str  # as the cluster's device ids spell it
    offer: str  # vast.ai's gpu_name
    memory_gib: int
    bandwidth_gbs: float
    tensor_tflops: float  # dense fp16 with fp32 accumulation
    usd_per_hour: float


CARDS = {
    "4090": Card("4090", "RTX_4090", 24, 1008.0, 82.6, 0.40),
    "3090": Card("3090", "RTX_3090", 24, 936.2, 71.0, 0.22),
}


def overhead_ms(c: Card) -> float:
    """The H200's measured fixed cost per card scaled to ``c`` by the bandwidth ratio (assumed: the fixed cost's
    small kernels are bound by memory latency and bandwidth as the GEMVs are, not by the host)."""
    return round(H200_FIXED_MS * H200_GEMV_GBS / c.bandwidth_gbs, 2)


# region -> one-way latency to each other region (ms); symmetric
REGIONS: dict[str, tuple[str, ...]] = {
    "region": ("us-east",),
    "continent": ("us-east", "us-central", "us-west"),
    "two-continents": ("us-east", "us-west", "eu-west", "eu-central"),
}
REGION_LATENCY: dict[tuple[str, str], float] = {
    ("us-east", "us-central"): 12.0,
    ("us-central", "us-west"): 18.0,
    ("us-east", "us-west"): 30.0,
    ("eu-west", "eu-central"): 10.0,
    ("us-east", "eu-west"): 75.0,
    ("us-east", "eu-central"): 85.0,
    ("us-west", "eu-west"): 140.0,
    ("us-west", "eu-central"): 150.0,
}


def consumer_cluster(card: str, count: int, layout: Layout) -> Cluster:
    """``count`` cards of ``card`` (``CARDS``) spread evenly over the layout's regions (the first ``count // r`` in
    the first region, ...), each a vast.ai offer of one card."""
    c = CARDS[card]
    if layout == "hosts8":
        return _hosts(c, count)
    regions = REGIONS[layout]
    devices = []
    for i in range(count):
        region = regions[i * len(regions) // count]
        devices.append(_card(c, f"{region}-{c.name}-{i:02d}", region, 1))
    region_links = tuple(
        Link(src=a, dst=b, delay_ms=REGION_LATENCY[(a, b)], rate_mbit=RATE_MBIT)
        for a, b in REGION_LATENCY
        if a in regions and b in regions
    )
    return Cluster(
        devices=tuple(devices),
        default=Impaired(delay_ms=REGION_MS, rate_mbit=RATE_MBIT),
        region_links=region_links,
        hop_ms=HOP_MS,
        name=cluster_name(card, count, layout),
    )


def _card(c: Card, device_id: str, region: str, gpus_per_offer: int) -> Device:
    """One card of kind ``c`` as a device: a vast.ai offer of ``gpus_per_offer`` such cards."""
    return Device(
        id=device_id,
        memory=c.memory_gib * GIB,
        gflops=c.tensor_tflops * 1e3,
        bandwidth_gbs=c.bandwidth_gbs,
        overhead_ms=overhead_ms(c),
        reserve=RESERVE,
        usd_per_hour=c.usd_per_hour,
        region=region,
        source=Source(kind="vastai", offer={"gpu_name": c.offer, "num_gpus": str(gpus_per_offer)}),
    )


def _hosts(c: Card, count: int) -> Cluster:
    if count % HOST_CARDS:
        raise ValueError(f"the hosts8 layout takes a multiple of {HOST_CARDS} cards, not {count}")
    hosts = [f"us-east-h{h}" for h in range(count // HOST_CARDS)]
    devices = tuple(
        _card(c, f"{hosts[i // HOST_CARDS]}-{c.name}-{i % HOST_CARDS}", hosts[i // HOST_CARDS], HOST_CARDS)
        for i in range(count)
    )
    links = tuple(
        Link(src=a, dst=b, delay_ms=REGION_MS + HOP_MS, rate_mbit=RATE_MBIT)
        for i, a in enumerate(hosts)
        for b in hosts[i + 1 :]
    )
    return Cluster(
        devices=devices,
        default=Impaired(delay_ms=HOST_MS, rate_mbit=HOST_MBIT),
        region_links=links,
        hop_ms=0.0,
        name=cluster_name(c.name, count, "hosts8"),
    )


def cluster_name(card: str, count: int, layout: Layout) -> str:
    return f"consumer-{card}x{count}-{layout}"


# the shipped files: (card, count, layout)
SHIPPED: tuple[tuple[str, int, Layout], ...] = (
    *(("4090", n, layout) for n in (24, 32, 48) for layout in LAYOUTS),
    ("4090", 32, "hosts8"),
    ("4090", 48, "hosts8"),
    ("3090", 32, "region"),
    ("3090", 32, "hosts8"),
)


def cluster_yaml(cluster: Cluster, card: str, count: int, layout: Layout) -> str:
    """The cluster as a file people read: a header saying where it comes from, then one device per line."""
    c = CARDS[card]
    where = (
        f"{count // HOST_CARDS} hosts of {HOST_CARDS} cards in one region (a region per host)"
        if layout == "hosts8"
        else f"regions {', '.join(REGIONS[layout])}"
    )
    head = [
        f"# {count} x RTX {card} ({c.memory_gib} GiB, {c.bandwidth_gbs:g} GB/s, {c.tensor_tflops:g} fp16 tensor "
        f"TFLOPS, ${c.usd_per_hour}/h each), layout {layout}: {where}.",
        "# Written by `python -m ppharness.plan.consumer scenarios/clusters`; docs/kimi.md says where the figures "
        "come from.",
        f"name: {cluster.name}",
        f"hop_ms: {cluster.hop_ms}",
        f"default: {{delay_ms: {cluster.default.delay_ms}, rate_mbit: {cluster.default.rate_mbit}}}",
    ]
    if cluster.region_links:
        head.append("region_links:")
        head += [
            f"  - {{from: {x.src}, to: {x.dst}, delay_ms: {x.delay_ms}, rate_mbit: {x.rate_mbit}}}"
            for x in cluster.region_links
        ]
    head.append("devices:")
    gpus = HOST_CARDS if layout == "hosts8" else 1
    for d in cluster.devices:
        head.append(
            f"  - {{id: {d.id}, region: {d.region}, memory: {d.memory // GIB}g, reserve: {d.reserve // GIB}g, "
            f"gflops: {d.gflops:g}, bandwidth_gbs: {d.bandwidth_gbs:g}, overhead_ms: {d.overhead_ms}, "
            f"usd_per_hour: {d.usd_per_hour}, "
            f"source: {{kind: vastai, offer: {{gpu_name: {c.offer}, num_gpus: '{gpus}'}}}}}}"
        )
    return "\n".join(head) + "\n"


def write_all(folder: Path) -> list[Path]:
    """Write every shipped cluster file into ``folder``; returns their paths."""
    out = []
    for card, count, layout in SHIPPED:
        path = folder / f"{cluster_name(card, count, layout)}.yaml"
        path.write_text(cluster_yaml(consumer_cluster(card, count, layout), card, count, layout))
        out.append(path)
    return out


if __name__ == "__main__":
    for p in write_all(Path(sys.argv[1] if len(sys.argv) > 1 else "scenarios/clusters")):
        print(p)
