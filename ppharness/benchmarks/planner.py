"""The planner's own figures: wall time of ``plan_optimal`` by cluster size, and the heuristic's gap to the exact
search.

Instances are random but seeded (``random_instance``): a 128-block model of about 12 GiB of weights (and 8 KiB of KV
cache per block and token, 2048 tokens of context) whose blocks differ by up to ±20 % in weights and FLOPs, on devices
spread over three regions (one-way delays of 5 to 40 ms and 100 to 10 000 Mbit/s between regions, 0.2 ms inside one),
each with its own speed, memory bandwidth, fixed cost per token and price, and holding 15 to 60 % of the model with
the KV cache of 8 requests (scaled up so that together they hold at least 1.3 times it). The same clusters serve the
three objectives: latency of one request, throughput and cost with 8 requests in flight. Times are medians over
``repeats`` instances, run one after another in this process; up to 8 devices the search is exact, beyond it is the
heuristic (``ppharness.plan.search.planner``). The gap is the heuristic's value over the exact one, minus 1, on 8-device
instances where the heuristic's exact seed covers a pool of 4 of the 8 devices (the ratio it has with 16 devices and
the default pool of 8).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import Literal

from ppharness.plan.lang.document import Block, Cluster, Device, Impaired, Link, ModelGraph, Objective
from ppharness.plan.search.planner import measure_gap, plan_optimal

Kind = Literal["latency", "throughput", "cost"]
KINDS: tuple[Kind, ...] = ("latency", "throughput", "cost")
REGIONS = ("eu", "us", "asia")


def random_instance(seed: int, devices: int, blocks: int = 128, requests: int = 8) -> tuple[ModelGraph, Cluster]:
    """A seeded random model of ``blocks`` blocks and cluster of ``devices`` devices (see the module's docstring),
    memory sized for ``requests`` in flight."""
    rng = random.Random(seed)
    block_list = tuple(
        Block(
            weight_bytes=int(100e6 * rng.uniform(0.8, 1.2)),
            flops=int(2e8 * rng.uniform(0.8, 1.2)),
            kv_bytes=8192,
        )
        for _ in range(blocks)
    )
    model = ModelGraph(
        source=f"synthetic:planner-bench-{seed}",
        sha256="0" * 64,
        arch="llama",
        dim=4096,
        vocab=32000,
        max_context=2048,
        embed_bytes=250_000_000,
        head_bytes=250_000_000,
        head_flops=500_000_000,
        activation_bytes=8192,
        token_bytes=64,
        blocks=block_list,
    )
    total = sum(b.weight_bytes + b.kv_bytes * model.max_context * requests for b in block_list) + 500_000_000
    shares = [rng.uniform(0.15, 0.6) for _ in range(devices)]
    scale = max(1.0, 1.3 / sum(shares))  # the devices hold at least 1.3 times the model together
    device_list = tuple(
        Device(
            id=f"dev{i}",
            memory=int(total * shares[i] * scale) + (512 << 20),
            gflops=10 ** rng.uniform(2, 3.7),
            bandwidth_gbs=10 ** rng.uniform(1.7, 3.3),
            overhead_ms=rng.uniform(0.1, 2.0),
            usd_per_hour=round(rng.uniform(0.1, 3.0), 2),
            region=rng.choice(REGIONS),
        )
        for i in range(devices)
    )
    used = sorted({d.region for d in device_list if d.region is not None})
    region_links = tuple(
        Link(src=a, dst=b, delay_ms=rng.uniform(5, 40), rate_mbit=10 ** rng.uniform(2, 4))
        for a in used
        for b in used
        if a != b
    )
    cluster = Cluster(
        devices=device_list,
        default=Impaired(delay_ms=0.2, rate_mbit=10_000.0),
        region_links=region_links,
        hop_ms=0.05,
        name=f"random-{devices}-{seed}",
    )
    return model, cluster


def _timed(model: ModelGraph, cluster: Cluster, objective: Objective) -> float:
    start = time.perf_counter()
    plan_optimal(model, cluster, objective)
    return time.perf_counter() - start


def planner_timings(
    sizes: tuple[int, ...] = (4, 8, 12, 16),
    blocks: int = 128,
    repeats: int = 3,
    gap_instances: int = 10,
    gap_devices: int = 8,
    gap_pool: int = 4,
    requests: int = 8,
) -> dict[str, object]:
    """Wall time of ``plan_optimal`` (median and max of ``repeats`` instances, seconds) per objective and cluster size,
    and the heuristic's gap to the exact search (max and median over ``gap_instances`` instances, per objective).
    Throughput and cost are planned for ``requests`` in flight."""
    times: dict[str, dict[int, float]] = {}
    worst: dict[str, dict[int, float]] = {}
    for kind in KINDS:
        objective = Objective(kind=kind, requests=1 if kind == "latency" else requests)
        times[kind], worst[kind] = {}, {}
        for n in sizes:
            runs = [_timed(*random_instance(1000 * n + r, n, blocks, requests), objective) for r in range(repeats)]
            times[kind][n], worst[kind][n] = statistics.median(runs), max(runs)
    gaps: dict[str, dict[str, float]] = {}
    for kind in KINDS:
        objective = Objective(kind=kind, requests=1 if kind == "latency" else requests)
        values = [
            measure_gap(*random_instance(7000 + i, gap_devices, blocks, requests), objective, gap_pool)["gap"]
            for i in range(gap_instances)
        ]
        gaps[kind] = {"max": max(values), "median": statistics.median(values)}
    return {
        "blocks": blocks,
        "requests": requests,
        "seconds": times,
        "seconds_max": worst,
        "gap": gaps,
        "gap_setup": {"instances": gap_instances, "devices": gap_devices, "pool": gap_pool},
    }


if __name__ == "__main__":
    print(json.dumps(planner_timings(), indent=1))
