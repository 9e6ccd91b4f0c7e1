"""Clusters of consumer GPUs on vast.ai, in one region, over one continent, over two continents or eight to a host:
the cluster files ``scenarios/clusters/consumer-*.yaml`` are ``consumer_cluster``'s output
(``python -m ppharness.plan.consumer scenarios/clusters`` writes them again; a test checks they are current), and
``python -m ppharness.plan.consumer --sensitivity`` prints how the best plan for Kimi K2 on them moves with the
assumptions below.

A card's published figures (``CARDS``; docs/kimi.md cites them): 24 GiB of memory, the memory bandwidth, the dense
fp16 tensor throughput with fp32 accumulation (decode is bound by the bandwidth long before it) and a typical vast.ai
price. What the engine costs on a card is derived from one measurement (``Basis``; ``H200``: docs/gpu-bench.md,
2026-12-03, tinygrad 0.12 CUDA on the lent H200) by the **bandwidth ratio**, the assumption every figure here rests
on: the engine's time on a card is its time on the H200 times the H200's fp16 GEMV bandwidth in the same run (2035
GB/s) over the card's bandwidth (its published figure times ``share``, 1 by default; real kernels reach 70-90 % of
it). It assumes a decode's kernels, the small ones of the fixed cost included, are bound by memory bandwidth and
latency; if the fixed cost is bound by the host instead, a card pays about the H200's.

- A card's fixed cost per token (``overhead_ms``): a stage's step (0.158 ms: the fitted intercept over slices of 1, 2
  and 4 blocks of the 1B shape, tuned kernels) plus ``MOE_BLOCKS_PER_CARD`` MoE blocks at Kimi's expert counts
  (kimi-tiny: 384 experts, top 8, at width 64, so its 0.2 MiB of weights per block leave all of its 0.7585 ms a fixed
  cost: launches and the MoE step's host round trips), scaled by the ratio. A qwen3-30b-a3b MoE block at its real
  width measured 1.627 ms, 1.56 ms beyond its bytes at the dense block's rate, about twice kimi-tiny's; the
  sensitivity table's fixed cost x2 covers that case (and the 2026-12-02 figure of 1.36 ms per kimi-tiny block,
  from one unsplit process).
- A card's bandwidth (``bandwidth_gbs``, the rate the cost model reads weights at): the engine's dense block reads
  116 MiB in 0.0738 ms on the H200, 1648 GB/s, 0.81 of the H200's GEMV bandwidth; a card gets the same fraction of
  its own.
- The transport's cost per hop (``hop_ms``): ZeroMQ's in a running chain, the median of the same run's five hops
  (0.385 to 0.528 ms, each from a stage's send to the next stage's receipt, five stage processes sharing the GPU),
  not a loopback round trip. Over the WAN the runs use iroh, which measured 0.69 to 0.71 ms per hop in a chain
  on the H200 (2026-11-29): the hop cost x2 rows.

Every device's ``measured`` names that measurement and says its figures are derived from it by the bandwidth ratio.
``basis_from_probes`` builds a ``Basis`` from ``ppharness plan probe --json`` files instead (a dense probe, a MoE
probe, a probe with ``--hop``): ``python -m ppharness.plan.consumer --basis dense.json --basis moe.json ...``.

Links: one region is one city's hosts (``REGION_MS`` one-way, ``RATE_MBIT`` each way); ``continent`` spreads the
cards evenly over three regions 12 to 30 ms apart (North America); ``two-continents`` over two North American and
two European regions, 10 to 30 ms apart within a continent and 75 to 150 ms across the Atlantic. ``hosts8`` rents
vast.ai's 8-GPU offers: each host's eight cards are devices of one ``source.host`` (``gpu`` 0 to 7, one offer of 8
cards), a hop between two cards of one host is costed by the cluster's ``host_link``: no network latency, and PCIe
4.0 x16's ``HOST_MBIT`` (the assumption: the engine hands a hidden state over through host memory and a socket, so it
crosses the PCIe link; at 14 KiB per token the rate hardly matters). Hosts in one region are joined by the region's
links (a region per host). Every hop pays the transport's ``hop_ms``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from ppharness.model.synthetic.spec import parse_synthetic
from ppharness.plan.graph import spec_graph
from ppharness.plan.lang.document import Cluster, Device, Impaired, Link, Measured, ModelGraph, Objective, Source
from ppharness.plan.predict.simulate import simulate
from ppharness.plan.search.planner import policy_plan

Layout = Literal["region", "continent", "two-continents", "hosts8"]
LAYOUTS: tuple[Layout, ...] = ("region", "continent", "two-continents")
GIB = 1 << 30
MIB = 1 << 20
RESERVE = 1 * GIB  # CUDA context, the runtime's buffers and activations
MOE_BLOCKS_PER_CARD = 2  # a 24 GiB card holds two of Kimi K2's 4-bit MoE blocks (8.95 GiB each)
REGION_MS = 1.0  # one-way latency between two hosts of one region
RATE_MBIT = 1000  # each host's link
HOST_CARDS = 8  # cards per host in the hosts8 layout
HOST_MBIT = 200_000  # PCIe 4.0 x16, about 25 GB/s: a hidden state between two cards of one host


@dataclass(frozen=True)
class Basis:
    """The measurement a consumer card's engine figures derive from (module docstring)."""

    name: str  # the measured GPU, short: "H200"
    hardware: str
    engine: str  # what computed: the engine's id, or the commit and settings before ids existed
    date: str
    source: str  # where the figures are written down
    gemv_gbs: float  # the bandwidth the measured GPU reached on decode's matrix-vector products: the ratio's top
    step_ms: float  # a stage's fixed cost per decode step
    dense_block_ms: float  # one dense block ...
    dense_block_bytes: float  # ... reading this many weight bytes
    moe_block_ms: float  # a MoE block's cost beyond its bytes at the dense block's rate (at Kimi's expert counts)
    hop_ms: float  # the transport's cost per hop in a running chain

    @property
    def engine_gbs(self) -> float:
        """The rate the engine read a dense block's weights at on the measured GPU."""
        return self.dense_block_bytes / (self.dense_block_ms / 1e3) / 1e9


H200 = Basis(
    name="H200",
    hardware="NVIDIA H200",
    engine="ppharness as of 36dfdfe, tinygrad 0.12.0 CUDA, kernel table h200-cuda-tinygrad-0.12.0-beam2 (dense "
    "figures)",
    date="2026-12-03",
    source="docs/gpu-bench.md: bench gpu and bench block, 2026-12-03",
    gemv_gbs=2035.0,
    step_ms=0.1580,
    dense_block_ms=0.0738,
    dense_block_bytes=116.0 * MIB,
    moe_block_ms=0.7585,
    hop_ms=0.487,
)


@dataclass(frozen=True)
class Card:
    """One consumer GPU model's published figures and a typical vast.ai price."""

    name: str  # as the cluster's device ids spell it
    offer: str  # vast.ai's gpu_name, as the API spells it
    memory_gib: int
    bandwidth_gbs: float
    tensor_tflops: float  # dense fp16 with fp32 accumulation
    usd_per_hour: float


CARDS = {
    "4090": Card("4090", "RTX 4090", 24, 1008.0, 82.6, 0.40),
    "3090": Card("3090", "RTX 3090", 24, 936.2, 71.0, 0.22),
}


@dataclass(frozen=True)
class Assumptions:
    """What the sensitivity table varies: the share of the published bandwidth a card reaches, and factors on the
    derived fixed cost per card and on the transport's cost per hop."""

    share: float = 1.0
    fixed: float = 1.0
    hop: float = 1.0


def ratio(c: Card, basis: Basis = H200, a: Assumptions = Assumptions()) -> float:
    """How much longer the engine's bandwidth-bound work takes on ``c`` than on the measured GPU."""
    return basis.gemv_gbs / (a.share * c.bandwidth_gbs)


def overhead_ms(c: Card, basis: Basis = H200, a: Assumptions = Assumptions()) -> float:
    """A card's fixed cost per token: the measured step and ``MOE_BLOCKS_PER_CARD`` MoE blocks' fixed cost, scaled
    by the bandwidth ratio (and the ``fixed`` factor)."""
    return round((basis.step_ms + MOE_BLOCKS_PER_CARD * basis.moe_block_ms) * ratio(c, basis, a) * a.fixed, 4)


def card_gbs(c: Card, basis: Basis = H200, a: Assumptions = Assumptions()) -> float:
    """The rate the engine reads weights at on ``c``: its reachable bandwidth times the engine's fraction of the
    measured GPU's GEMV bandwidth."""
    return round(a.share * c.bandwidth_gbs * basis.engine_gbs / basis.gemv_gbs, 1)


def hop_ms(basis: Basis = H200, a: Assumptions = Assumptions()) -> float:
    return round(basis.hop_ms * a.hop, 4)


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


def consumer_cluster(
    card: str, count: int, layout: Layout, basis: Basis = H200, a: Assumptions = Assumptions()
) -> Cluster:
    """``count`` cards of ``card`` (``CARDS``) spread evenly over the layout's regions (the first ``count // r`` in
    the first region, ...), each a vast.ai offer of one card; or, for ``hosts8``, eight to a host."""
    c = CARDS[card]
    if layout == "hosts8":
        return _hosts(c, count, basis, a)
    regions = REGIONS[layout]
    devices = tuple(
        _card(c, f"{regions[i * len(regions) // count]}-{c.name}-{i:02d}", regions[i * len(regions) // count], basis, a)
        for i in range(count)
    )
    region_links = tuple(
        Link(src=x, dst=y, delay_ms=REGION_LATENCY[(x, y)], rate_mbit=RATE_MBIT)
        for x, y in REGION_LATENCY
        if x in regions and y in regions
    )
    return Cluster(
        devices=devices,
        default=Impaired(delay_ms=REGION_MS, rate_mbit=RATE_MBIT),
        region_links=region_links,
        hop_ms=hop_ms(basis, a),
        name=cluster_name(card, count, layout),
    )


def measured_by(c: Card, basis: Basis = H200, a: Assumptions = Assumptions()) -> Measured:
    """A card's ``measured``: the basis's engine, hardware and day, and how the card's figures follow from it."""
    how = (
        f"derived from {basis.name} measurement by bandwidth ratio ({basis.source}): fixed cost (step "
        f"{basis.step_ms:g} + {MOE_BLOCKS_PER_CARD} x MoE block {basis.moe_block_ms:g} ms) x {basis.gemv_gbs:g} / "
        f"{a.share * c.bandwidth_gbs:g} GB/s; weights at {basis.engine_gbs / basis.gemv_gbs:.3f} of "
        f"{a.share * c.bandwidth_gbs:g} GB/s; hop {basis.hop_ms:g} ms in a running ZeroMQ chain"
    )
    return Measured(engine=basis.engine, hardware=basis.hardware, date=basis.date, how=how[:400])


def _card(c: Card, device_id: str, region: str, basis: Basis, a: Assumptions, host: int | None = None) -> Device:
    """One card of kind ``c``: a vast.ai offer of one card, or (``host``) GPU ``host`` of an 8-card offer."""
    offer = {"gpu_name": c.offer, "num_gpus": "1" if host is None else str(HOST_CARDS)}
    return Device(
        id=device_id,
        memory=c.memory_gib * GIB,
        gflops=c.tensor_tflops * 1e3,
        bandwidth_gbs=card_gbs(c, basis, a),
        overhead_ms=overhead_ms(c, basis, a),
        reserve=RESERVE,
        usd_per_hour=c.usd_per_hour,
        region=region,
        source=Source(kind="vastai", offer=offer, host=None if host is None else region, gpu=host),
        measured=measured_by(c, basis, a),
    )


def _hosts(c: Card, count: int, basis: Basis, a: Assumptions) -> Cluster:
    if count % HOST_CARDS:
        raise ValueError(f"the hosts8 layout takes a multiple of {HOST_CARDS} cards, not {count}")
    hosts = [f"us-east-h{h}" for h in range(count // HOST_CARDS)]
    devices = tuple(
        _card(
            c, f"{hosts[i // HOST_CARDS]}-{c.name}-{i % HOST_CARDS}", hosts[i // HOST_CARDS], basis, a, i % HOST_CARDS
        )
        for i in range(count)
    )
    links = tuple(
        Link(src=x, dst=y, delay_ms=REGION_MS, rate_mbit=RATE_MBIT) for i, x in enumerate(hosts) for y in hosts[i + 1 :]
    )
    return Cluster(
        devices=devices,
        default=Impaired(delay_ms=REGION_MS, rate_mbit=RATE_MBIT),
        region_links=links,
        hop_ms=hop_ms(basis, a),
        name=cluster_name(c.name, count, "hosts8"),
        host_link=Impaired(rate_mbit=HOST_MBIT),
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


def cluster_yaml(cluster: Cluster, card: str, count: int, layout: Layout, basis: Basis = H200) -> str:
    """The cluster as a file people read: a header saying where its figures come from, then one device per line (the
    offer and ``measured`` written once, as YAML anchors, and referred to after)."""
    c = CARDS[card]
    d0 = cluster.devices[0]
    where = (
        f"{count // HOST_CARDS} hosts of {HOST_CARDS} cards in one region (a region per host; cards of one host "
        f"share source.host, hops between them cost host_link: PCIe 4.0 x16, {HOST_MBIT // 8000} GB/s, through the "
        "host's memory)"
        if layout == "hosts8"
        else f"regions {', '.join(REGIONS[layout])}"
    )
    head = [
        f"# {count} x RTX {card} ({c.memory_gib} GiB, {c.bandwidth_gbs:g} GB/s, {c.tensor_tflops:g} fp16 tensor "
        f"TFLOPS, ${c.usd_per_hour}/h each), layout {layout}: {where}.",
        f"# Assumption: the engine's figures are the {basis.name}'s measured ones ({basis.source}) scaled by the "
        f"bandwidth ratio {basis.gemv_gbs:g} / {c.bandwidth_gbs:g} GB/s:",
        f"#   fixed cost per card {d0.overhead_ms} ms (step {basis.step_ms:g} + {MOE_BLOCKS_PER_CARD} MoE blocks x "
        f"{basis.moe_block_ms:g} ms, on the {basis.name}), weights read at {d0.bandwidth_gbs:g} GB/s "
        f"({basis.engine_gbs / basis.gemv_gbs:.2f} of the published bandwidth: the engine's share of the "
        f"{basis.name}'s GEMV bandwidth); hop {cluster.hop_ms} ms",
        f"#   (ZeroMQ in a running chain on the {basis.name}). Published bandwidth reached in full: real kernels reach "
        "70-90 % of it (`python -m ppharness.plan.consumer --sensitivity`).",
        "# Written by `python -m ppharness.plan.consumer scenarios/clusters`; docs/kimi.md says more.",
        f"name: {cluster.name}",
        f"hop_ms: {cluster.hop_ms}",
        f"default: {{delay_ms: {cluster.default.delay_ms}, rate_mbit: {cluster.default.rate_mbit}}}",
    ]
    if layout == "hosts8":
        head.append(f"host_link: {{rate_mbit: {cluster.host_link.rate_mbit}}}")
    if cluster.region_links:
        head.append("region_links:")
        head += [
            f"  - {{from: {x.src}, to: {x.dst}, delay_ms: {x.delay_ms}, rate_mbit: {x.rate_mbit}}}"
            for x in cluster.region_links
        ]
    head.append("devices:")
    m = d0.measured
    assert m is not None and d0.source.offer is not None
    offer = f"{{gpu_name: {json.dumps(c.offer)}, num_gpus: {json.dumps(d0.source.offer['num_gpus'])}}}"
    stamp = ", ".join(f"{k}: {json.dumps(getattr(m, k))}" for k in ("engine", "hardware", "date", "how"))
    for i, d in enumerate(cluster.devices):
        host = f"host: {d.source.host}, gpu: {d.source.gpu}, " if d.source.host is not None else ""
        head.append(
            f"  - {{id: {d.id}, region: {d.region}, memory: {d.memory // GIB}g, reserve: {d.reserve // GIB}g, "
            f"gflops: {d.gflops:g}, bandwidth_gbs: {d.bandwidth_gbs:g}, overhead_ms: {d.overhead_ms}, "
            f"usd_per_hour: {d.usd_per_hour}, source: {{kind: vastai, {host}offer: "
            + (f"&offer {offer}}}, measured: &measured {{{stamp}}}}}" if i == 0 else "*offer}, measured: *measured}")
        )
    return "\n".join(head) + "\n"


def write_all(folder: Path, basis: Basis = H200) -> list[Path]:
    """Write every shipped cluster file into ``folder``; returns their paths."""
    out = []
    for card, count, layout in SHIPPED:
        path = folder / f"{cluster_name(card, count, layout)}.yaml"
        path.write_text(cluster_yaml(consumer_cluster(card, count, layout, basis), card, count, layout, basis))
        out.append(path)
    return out


# --- measured inputs from `ppharness plan probe --json` -----------------------------------------------------------


def basis_from_probes(records: list[dict[str, Any]], gemv_gbs: float | None = None) -> Basis:
    """A Basis from ``ppharness plan probe --json`` records (``ppharness.benchmarks.probe.probe_record``): a dense probe
    gives the step and the dense block, a MoE probe the MoE block (its time beyond its bytes at the dense block's
    rate), a probe with ``--hop`` the hop; what none gives stays the H200's. ``gemv_gbs``: the bandwidth the probed
    machine reaches (default: the dense block's own rate, so the engine counts as reaching a card's bandwidth)."""
    dense = next((r for r in records if "block_ms" in r and not r.get("moe")), None)
    moe = next((r for r in records if "block_ms" in r and r.get("moe")), None)
    hop = next((r["hop"] for r in records if "hop" in r), None)
    first = dense or moe or (records[0] if records else {})
    stamp = (first.get("device") or {}).get("measured") or {}
    b = replace(
        H200,
        name=str(stamp.get("hardware") or "probed machine").split(" (")[0].split(",")[0][:60],
        hardware=str(stamp.get("hardware", "")),
        engine=str(stamp.get("engine", "")),
        date=str(stamp.get("date", "")),
        source="ppharness plan probe --json",
    )
    if dense is not None:
        b = replace(
            b,
            step_ms=max(float(dense["fixed_ms"]), 0.0),
            dense_block_ms=float(dense["block_ms"]),
            dense_block_bytes=float(dense["block_read_bytes"]),
        )
    b = replace(b, gemv_gbs=gemv_gbs or b.engine_gbs)
    if moe is not None:
        beyond = float(moe["block_ms"]) - float(moe["block_read_bytes"]) / (b.engine_gbs * 1e9) * 1e3
        b = replace(b, moe_block_ms=max(beyond, 0.0))
    if hop is not None:
        b = replace(b, hop_ms=float(hop["hop_ms"]))
    return b


# --- sensitivity --------------------------------------------------------------------------------------------------

KIMI = "synthetic:kimi-k2"
KIMI_CONTEXT = 4096
SHARES = (1.0, 0.8, 0.7)
FACTORS = (1.0, 2.0)


@dataclass(frozen=True)
class SensitivityRow:
    """The best plan's prediction for one set of assumptions."""

    assumptions: Assumptions
    card_fixed_ms: float
    card_gbs: float
    hop_ms: float
    cards: int  # devices the plan uses
    per_token_ms: float
    tok_s: float


def kimi_graph(context: int = KIMI_CONTEXT) -> ModelGraph:
    """Kimi K2 at 4-bit (Q4_K) weights, from its spec (for the simulator only)."""
    return spec_graph(parse_synthetic(KIMI), KIMI, context, weights="q4_k")


def sensitivity(
    graph: ModelGraph,
    card: str = "4090",
    count: int = 32,
    layout: Layout = "hosts8",
    basis: Basis = H200,
    shares: tuple[float, ...] = SHARES,
    fixed: tuple[float, ...] = FACTORS,
    hops: tuple[float, ...] = FACTORS,
) -> list[SensitivityRow]:
    """Per set of assumptions (each share of the published bandwidth, each factor on the fixed cost and on the hop
    cost), the planner's best plan (latency, one request) on the cluster and its predicted time per token."""
    rows = []
    for share in shares:
        for f in fixed:
            for h in hops:
                a = Assumptions(share, f, h)
                cluster = consumer_cluster(card, count, layout, basis, a)
                doc = policy_plan("optimal", graph, cluster, Objective())
                p = simulate(doc)
                d = cluster.devices[0]
                assert d.bandwidth_gbs is not None
                rows.append(
                    SensitivityRow(
                        a,
                        d.overhead_ms,
                        d.bandwidth_gbs,
                        cluster.hop_ms,
                        len(doc.placement.nodes),
                        p.per_token_ms,
                        p.tok_s,
                    )
                )
    return rows


def sensitivity_table(rows: list[SensitivityRow], title: str) -> str:
    """The rows as a Markdown table."""
    out = [
        title,
        "",
        "| bandwidth (of published) | fixed cost | hop cost | card fixed ms | card GB/s | hop ms | cards | ms/token "
        "| tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a = r.assumptions
        out.append(
            f"| {a.share:.0%} | x{a.fixed:g} | x{a.hop:g} | {r.card_fixed_ms:.2f} | {r.card_gbs:g} | {r.hop_ms:.3f} | "
            f"{r.cards} | {r.per_token_ms:.1f} | {r.tok_s:.1f} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ppharness.plan.consumer", description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default="scenarios/clusters", help="where to write the cluster files")
    parser.add_argument("--sensitivity", action="store_true", help="print the sensitivity table instead (Markdown)")
    parser.add_argument("--cluster", default="consumer-4090x32-hosts8", help="--sensitivity: the cluster")
    parser.add_argument(
        "--basis", action="append", default=[], help="a `ppharness plan probe --json` file to derive from (repeatable)"
    )
    parser.add_argument("--gemv-gbs", type=float, help="--basis: the bandwidth the probed machine reaches, GB/s")
    args = parser.parse_args(argv)
    basis = (
        basis_from_probes([json.loads(Path(p).read_text()) for p in args.basis], args.gemv_gbs) if args.basis else H200
    )
    if not args.sensitivity:
        for p in write_all(Path(args.folder), basis):
            print(p)
        return
    found = [(card, n, layout) for card, n, layout in SHIPPED if cluster_name(card, n, layout) == args.cluster]
    if not found:
        sys.exit(f"--cluster {args.cluster}: not one of {', '.join(cluster_name(*s) for s in SHIPPED)}")
    card, count, layout = found[0]
    rows = sensitivity(kimi_graph(), card, count, layout, basis)
    print(sensitivity_table(rows, f"Kimi K2 (Q4_K, context {KIMI_CONTEXT}) on {args.cluster}, best plan, one request"))


if __name__ == "__main__":
    main()
