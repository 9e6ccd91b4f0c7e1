"""``ppharness bench``: the chain, one hop, the GPU, failover, chaos and the WAN emulator, measured."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from ppharness.benchmarks import chain as chain_bench
from ppharness.benchmarks import chaos_report
from ppharness.benchmarks import failover as failover_bench
from ppharness.benchmarks import floor as floor_bench
from ppharness.benchmarks import gpu as gpu_bench
from ppharness.benchmarks import load as load_bench
from ppharness.benchmarks import moe as moe_bench
from ppharness.benchmarks import plan as plan_bench
from ppharness.benchmarks import planner as planner_bench
from ppharness.benchmarks import transport as transport_bench
from ppharness.benchmarks import wan as wan_bench
from ppharness.benchmarks import wan_chain as wan_chain_bench
from ppharness.cli.bench_spec import bench_spec
from ppharness.cli.common import exit_1_on_failure, fail, split_csv
from ppharness.model.sources.files import resolve_model
from ppharness.run.seed.orchestrator import Progress
from ppharness.scenario.schema import load_scenario


@click.group(invoke_without_command=True)
@click.option("--num-stages", "-n", type=int, default=5, show_default=True)
@click.option(
    "--transport",
    "transports",
    default="zmq",
    show_default=True,
    help="Transports to run the chain over, comma-separated (e.g. zmq,iroh).",
)
@click.option("--tokens", type=int, default=32, show_default=True, help="Tokens generated per request.")
@click.option("--repeats", type=int, default=5, show_default=True, help="Interleaved repeats of every contender.")
@click.option("--preset", default="small", show_default=True, help="Synthetic model preset (at least 8 blocks).")
@click.option(
    "--out",
    "out_dir",
    default="bench-results",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where bench.json and bench.png go.",
)
@click.option("--sweep/--no-sweep", default=True, show_default=True, help="Also measure tokens/s for N = 1..5.")
@click.pass_context
def bench(
    ctx: click.Context,
    num_stages: int,
    transports: str,
    tokens: int,
    repeats: int,
    preset: str,
    out_dir: str,
    sweep: bool,
) -> None:
    """Benchmarks: medians and ratios against a baseline measured in the same run.

    Without a subcommand: the N-stage chain against single-process decode and the raw transport, interleaved.
    """
    if ctx.invoked_subcommand is not None:
        return

    with exit_1_on_failure():
        res = chain_bench.run_chain_bench(
            preset, num_stages, split_csv(transports), tokens, repeats, out_dir, sweep, Progress()
        )
    click.echo(chain_bench.report(res))
    click.echo(f"\nwritten: {out_dir}/bench.json, {out_dir}/bench.png")
    if any(res.mismatch.values()):
        fail("a chain's answer differs from the unsplit model's (MISMATCH above)")


@bench.command("transport")
@click.option("--sizes", default="64,4096,131072", show_default=True, help="Payload sizes in bytes, comma-separated.")
@click.option("--repeats", type=int, default=200, show_default=True, help="Round trips per size and transport.")
@click.option("--transports", "kinds", default="zmq,iroh", show_default=True, help="ppharness transports to measure.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the results as JSON here.")
def bench_transport(sizes: str, repeats: int, kinds: str, json_out: str | None) -> None:
    """Round-trip latency p50/p99 per payload size: raw libraries vs ppharness transports, with ratios."""
    with exit_1_on_failure():
        transport_bench.run_transport_bench([int(x) for x in sizes.split(",")], repeats, split_csv(kinds), json_out)


@bench.command("gpu")
@click.option("--device", default="cuda", show_default=True, help="tinygrad device for every process (cuda, nv, cpu).")
@click.option("--preset", default="llama-3.2-1b", show_default=True)
@click.option("--stages", default="2,5", show_default=True, help="Chain sizes, comma-separated.")
@click.option("--transport", "transports", default="zmq,iroh", show_default=True)
@click.option("--tokens", type=int, default=128, show_default=True)
@click.option("--prompt-tokens", type=int, default=32, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--hf/--no-hf", default=True, show_default=True, help="Also run HF transformers where installed.")
@click.option("--in-flight", type=int, default=1, show_default=True, help="Also serve this many requests at once.")
@click.option(
    "--block/--no-block", default=True, show_default=True, help="Also one decode block vs the floor (bench block)."
)
@click.option(
    "--batched/--one-per-call",
    default=False,
    show_default=True,
    help="The chains run batched (serving.batched) and are held to the batched single process, bit for bit.",
)
@click.option(
    "--max-batch", type=int, default=0, show_default=True, help="serving.max_batch of the chains (0: every ready one)."
)
@click.option(
    "--packed-floor/--no-packed-floor",
    default=True,
    show_default=True,
    help="Also the packed-weights floor: the file's bytes one token reads over the measured device copy bandwidth.",
)
@click.option(
    "--llamacpp",
    "llamacpp",
    default=None,
    metavar="DIR",
    help="A llama.cpp build directory (with llama-bench): also llama-bench on the same GGUF file.",
)
@click.option(
    "--llamacpp-types",
    default="f16",
    show_default=True,
    help="llama-quantize types for llama-bench, comma-separated (e.g. f16,q8_0,q4_k_m): the file's own type is the "
    "file as it is, another is quantised once.",
)
@click.option(
    "--llamacpp-files",
    default="",
    metavar="DIR",
    help="Where the quantised files go (made once, reused)  [default: the --out directory]",
)
@click.option("--out", "out_dir", default="bench-results", show_default=True, type=click.Path(file_okay=False))
def bench_gpu(
    device: str,
    preset: str,
    stages: str,
    transports: str,
    tokens: int,
    prompt_tokens: int,
    repeats: int,
    hf: bool,
    in_flight: int,
    block: bool,
    batched: bool,
    max_batch: int,
    packed_floor: bool,
    llamacpp: str | None,
    llamacpp_types: str,
    llamacpp_files: str,
    out_dir: str,
) -> None:
    """The chain on an accelerator vs single-process tinygrad, HF transformers and llama.cpp (docs/gpu-bench.md)."""
    if not llamacpp and (llamacpp_types.strip().lower() != "f16" or llamacpp_files):
        raise click.UsageError("--llamacpp-types and --llamacpp-files need --llamacpp DIR (a llama.cpp build)")
    with exit_1_on_failure():
        res = gpu_bench.run_gpu_bench(
            device,
            preset,
            [int(x) for x in stages.split(",")],
            split_csv(transports),
            tokens,
            prompt_tokens,
            repeats,
            out_dir,
            hf,
            Progress(),
            in_flight,
            block,
            batched,
            max_batch,
            llamacpp=llamacpp,
            llamacpp_types=llamacpp_types,
            llamacpp_files=llamacpp_files,
            packed=packed_floor,
        )
    click.echo(gpu_bench.report(res))
    click.echo(f"\nwritten: {out_dir}/gpu-bench.json, {out_dir}/gpu-bench.png")
    if any(c.tokens_match_oracle is False for c in res.contenders):
        fail("a chain's answer differs from the single-process oracle's (MISMATCH above)")


@bench.command("block")
@click.option(
    "--model",
    "sources",
    multiple=True,
    default=["synthetic:llama-3.2-1b,blocks=4"],
    show_default=True,
    help="A GGUF path, URL or synthetic: spec (repeat for several).",
)
@click.option("--device", default="", help="tinygrad device (cuda, nv, cpu); default: tinygrad's (DEV).")
@click.option("--tokens", type=int, default=32, show_default=True, help="Decode steps timed per slice.")
@click.option("--floor/--no-floor", default=True, show_default=True, help="Also the PyTorch fp16 GEMV floor.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the figures here.")
def bench_block(sources: tuple[str, ...], device: str, tokens: int, floor: bool, json_out: str | None) -> None:
    """One decode block (and a stage's fixed cost per token) vs the PyTorch fp16 GEMV floor of the same shapes
    (docs/gpu-bench.md). PPHARNESS_KERNELS=FILE times the kernels of a table made by `ppharness tune`."""
    if device:
        os.environ["DEV"] = device.upper()
    progress = Progress()
    costs = []
    with exit_1_on_failure():
        for source in sources:
            costs.append(floor_bench.block_cost(source, str(resolve_model(source)), tokens, floor, progress))
    click.echo(floor_bench.report(costs))
    if json_out:
        Path(json_out).write_text(json.dumps(floor_bench.as_json(costs), indent=2))
        click.echo(f"\nwritten: {json_out}")


@bench.command("failover")
@click.option("--num-stages", "-n", type=int, default=5, show_default=True)
@click.option("--runs", type=int, default=5, show_default=True)
@click.option(
    "--signal",
    "sig",
    type=click.Choice(["KILL", "STOP"]),
    default="KILL",
    show_default=True,
    help="KILL: the process is gone; STOP: it stays but goes silent (only membership can notice).",
)
@click.option("--engine", type=click.Choice(["auto", "kinship", "heartbeat"]), default="auto", show_default=True)
def bench_failover(num_stages: int, runs: int, sig: str, engine: str) -> None:
    """Time from a stage's death mid-decode to pp-smoke-run's exit 1 (median over runs)."""
    with exit_1_on_failure():
        results = failover_bench.run_failover_bench(num_stages, runs, sig, engine, Progress())
    click.echo(failover_bench.report(results, num_stages, sig, engine))


@bench.command("chaos")
@click.option("--trials", type=int, default=5, show_default=True, help="Requests, each under its own fault schedule.")
@click.option("--seed", type=int, default=0, show_default=True, help="Trial k draws its faults from seed + k.")
@click.option("--stages", "num_stages", type=int, default=3, show_default=True)
@click.option("--tokens", type=int, default=200, show_default=True, help="Tokens generated per request.")
@click.option(
    "--overhead-requests",
    type=int,
    default=20,
    show_default=True,
    help="Fault-free requests per policy (none, failover) for the slowdown; 0 leaves it out.",
)
@click.option(
    "--in-flight", type=click.IntRange(1, 4), default=1, show_default=True, help="Requests served at once per trial."
)
@click.option("--no-spares", is_flag=True, help="Run without spares: a dead stage is re-placed on a surviving device.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write every raw figure here.")
def bench_chaos(
    trials: int,
    seed: int,
    num_stages: int,
    tokens: int,
    overhead_requests: int,
    in_flight: int,
    no_spares: bool,
    json_out: str | None,
) -> None:
    """Random kills, pauses, partitions and loss bursts mid-request under policy failover: answers against the
    oracle, time from each fault to the next token, the parts of each failover, and the policy's fault-free cost."""
    if trials < 1 or num_stages < 2 or tokens < 1 or overhead_requests < 0:
        raise click.BadParameter("--trials and --tokens must be at least 1, --stages at least 2")
    with exit_1_on_failure():
        res = chaos_report.run_chaos_bench(
            trials, seed, num_stages, tokens, overhead_requests, Progress(), in_flight=in_flight, spares=not no_spares
        )
    click.echo(chaos_report.report(res))
    if json_out:
        chaos_report.write_json(res, json_out)
        click.echo(f"\nwritten: {json_out}")
    if res.diverged:
        fail(f"{res.diverged} answer(s) differ from the unsplit model's (DIVERGED above)")


@bench.command("wan")
@click.option(
    "--calibrate",
    is_flag=True,
    help="Measure the WAN emulator itself on loopback: configured against measured delay, loss and bandwidth.",
)
@click.option("--presets", default="tiny,small", show_default=True, help="Synthetic model presets, comma-separated.")
@click.option(
    "--transports",
    default="zmq,iroh",
    show_default=True,
    help="zmq (impaired at the message layer) and/or iroh (at the packet layer), comma-separated.",
)
@click.option(
    "--delays",
    default="0,5,25,50",
    show_default=True,
    help="One-way delay in ms on every stage->stage link (links to the seed stay perfect), comma-separated.",
)
@click.option(
    "--loss",
    "losses",
    default="1,5",
    show_default=True,
    help="Packet loss in percent, iroh only, each run at 25 ms delay, comma-separated (empty: none).",
)
@click.option("--tokens", type=int, default=16, show_default=True, help="Tokens generated per request.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Requests per case (medians).")
@click.option("--num-stages", "-n", type=int, default=5, show_default=True)
@click.option(
    "--out",
    "out_dir",
    default="bench-results",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where bench-wan.json and bench-wan.png go.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="The emulated network's seed.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="With --calibrate: write the results here.")
def bench_wan(
    calibrate: bool,
    presets: str,
    transports: str,
    delays: str,
    losses: str,
    tokens: int,
    repeats: int,
    num_stages: int,
    out_dir: str,
    seed: int,
    json_out: str | None,
) -> None:
    """The chain over emulated WAN links: decode tokens/s against the bound the network and the compute set.

    With --calibrate: how faithfully the emulator applies delay, loss and rate caps (about a minute).
    """
    if calibrate:
        with exit_1_on_failure():
            wan_bench.run_calibration(json_out, seed)
        return

    try:
        delay_ms = [float(x) for x in split_csv(delays)]
        loss_pct = [float(x) for x in split_csv(losses)]
    except ValueError as exc:
        raise click.BadParameter(f"not a number: {exc}") from None
    with exit_1_on_failure():
        res = wan_chain_bench.run_wan_bench(
            split_csv(presets),
            split_csv(transports),
            delay_ms,
            loss_pct,
            tokens,
            repeats,
            num_stages,
            out_dir,
            seed,
            Progress(),
        )
    click.echo(wan_chain_bench.report(res))
    png = Path(out_dir) / "bench-wan.png"
    if wan_chain_bench.plot(res, png):
        click.echo(f"\nwritten: {out_dir}/bench-wan.json, {png}")
    else:
        click.echo(f"\nwritten: {out_dir}/bench-wan.json (no PNG: matplotlib is not installed)")


@bench.command("plan")
@click.option(
    "--cluster",
    "cluster_files",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Cluster file (repeatable; default: the three in scenarios/clusters/).",
)
@click.option("--preset", default="small", show_default=True, help="Synthetic model preset.")
@click.option("--tokens", type=int, default=24, show_default=True, help="Tokens generated per request.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Requests per plan (median).")
@click.option(
    "--provider",
    type=click.Choice(["docker", "local"]),
    default="docker",
    show_default=True,
    help="docker: containers with the cluster file's CPU quotas and memory limits; local: processes, no limits.",
)
@click.option(
    "--out",
    "out_dir",
    default="bench-results",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where bench-plan.json, bench-plan.png and the plans go.",
)
def bench_plan(
    cluster_files: tuple[str, ...], preset: str, tokens: int, repeats: int, provider: str, out_dir: str
) -> None:
    """The planner's plan against the even and the memory-proportional split: predicted and measured per-token time
    on each cluster."""

    files = list(cluster_files) or [str(p) for p in plan_bench.shipped_clusters()]
    with exit_1_on_failure():
        res = plan_bench.run_plan_bench(files, preset, tokens, repeats, provider, out_dir, Progress())
    click.echo(plan_bench.report(res))
    for case in res.cases:
        click.echo(f"\n{case.cluster} / {case.policy}:\n{case.rows}")
    drawn = plan_bench.plot(res, Path(out_dir) / "bench-plan.png")
    click.echo(f"\nwritten: {out_dir}/bench-plan.json" + (f", {out_dir}/bench-plan.png" if drawn else ""))


@bench.command("moe")
@click.option("--preset", default="tiny-moe", show_default=True, help="Mixture-of-experts model preset.")
@click.option("--tokens", type=int, default=24, show_default=True, help="Tokens generated per request.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Requests per case (median).")
@click.option("--expert-nodes", type=int, default=2, show_default=True, help="Expert nodes beside the two stages.")
@click.option("--delays", default="0,10", show_default=True, help="One-way link delays in ms, comma-separated.")
@click.option(
    "--in-flight",
    type=int,
    default=1,
    show_default=True,
    help="Also run the delay-0 plan batched with this many requests at once (against one alone, same chain).",
)
@click.option(
    "--out",
    "out_dir",
    default="bench-results",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where bench-moe.json and the plans go.",
)
def bench_moe(
    preset: str, tokens: int, repeats: int, expert_nodes: int, delays: str, in_flight: int, out_dir: str
) -> None:
    """A mixture-of-experts model in one process against its experts on expert nodes: tok/s, the per-token
    breakdown, and the simulator's prediction at each link delay."""
    with exit_1_on_failure():
        values = [float(d) for d in delays.split(",") if d.strip()]
        res = moe_bench.run_moe_bench(preset, tokens, repeats, expert_nodes, values, out_dir, Progress(), in_flight)
    click.echo(moe_bench.report(res))
    for case in res.cases:
        click.echo(f"\ndelay {case.delay_ms:g} ms:\n{case.rows}")
    click.echo(f"\nwritten: {out_dir}/bench-moe.json")


@bench.command("planner")
@click.option("--sizes", default="4,8,12,16", show_default=True, help="Cluster sizes (devices), comma-separated.")
@click.option("--blocks", type=int, default=128, show_default=True, help="Blocks of the random model.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Random instances per size (median, max).")
@click.option("--gap-instances", type=int, default=10, show_default=True, help="Instances for the heuristic's gap.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the figures here.")
def bench_planner(sizes: str, blocks: int, repeats: int, gap_instances: int, json_out: str | None) -> None:
    """The planner's own speed (seconds per plan by cluster size and objective) and the heuristic's gap to the exact
    search, on seeded random clusters."""

    try:
        counts = tuple(int(x) for x in split_csv(sizes))
    except ValueError as exc:
        raise click.BadParameter(f"not a number: {exc}") from None
    res = planner_bench.planner_timings(counts, blocks, repeats, gap_instances)
    seconds, worst = res["seconds"], res["seconds_max"]
    assert isinstance(seconds, dict) and isinstance(worst, dict)
    click.echo(f"{'objective':<11}" + "".join(f"{f'{n} devices':>18}" for n in counts) + "   (seconds: median, max)")
    for kind, by_size in seconds.items():
        cells = "".join(f"{f'{by_size[n]:.3f} ({worst[kind][n]:.3f})':>18}" for n in counts)
        click.echo(f"{kind:<11}{cells}")
    gap = res["gap"]
    assert isinstance(gap, dict)
    click.echo(
        f"heuristic against the exact search on {gap_instances} random 8-device instances (pool of 4): "
        + "; ".join(f"{k} max {100 * g['max']:.2f} %, median {100 * g['median']:.2f} %" for k, g in gap.items())
    )
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=1) + "\n")


def _range(text: str, what: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(",")
        r = (int(lo), int(hi or lo))
    except ValueError:
        raise click.BadParameter(f"{what}: expected LO,HI (two whole numbers), not {text!r}") from None
    if not 1 <= r[0] <= r[1]:
        raise click.BadParameter(f"{what}: expected 1 <= LO <= HI, not {text!r}")
    return r


@bench.command("load")
@click.option("--rate", type=float, default=0.0, show_default=True, help="Arrivals per second (0: all at once).")
@click.option("--requests", type=int, default=8, show_default=True, help="Requests sent.")
@click.option(
    "--network",
    "network_file",
    type=click.Path(dir_okay=False, exists=True),
    help="A scenario file whose network section the chain runs under (default: none).",
)
@click.option(
    "--delay-ms",
    type=float,
    default=0.0,
    show_default=True,
    help="Without --network: one-way delay on every stage->stage link.",
)
@click.option("--num-stages", "-n", type=int, default=5, show_default=True)
@click.option("--transport", default="zmq", show_default=True)
@click.option("--preset", default="small", show_default=True, help="Synthetic model preset.")
@click.option("--slots", type=int, help="Requests each stage serves at once (default: --requests, at most 16).")
@click.option("--queue", type=int, default=64, show_default=True, help="Requests stage 0 keeps waiting for a slot.")
@click.option(
    "--batched/--one-per-call",
    default=True,
    show_default=True,
    help="Each stage runs all its ready requests in one model call (serving.batched), or one call per request.",
)
@click.option(
    "--max-batch",
    type=int,
    default=0,
    show_default=True,
    help="The most requests one step runs (serving.max_batch; 0: every ready one).",
)
@click.option("--prompt-words", default="2,12", show_default=True, help="Prompt length in words: LO,HI (uniform).")
@click.option("--max-tokens", default="16,32", show_default=True, help="Answer length in tokens: LO,HI (uniform).")
@click.option("--seed", type=int, default=0, show_default=True, help="Arrivals and lengths are drawn from it.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the results as JSON here.")
def bench_load(
    rate: float,
    requests: int,
    network_file: str | None,
    delay_ms: float,
    num_stages: int,
    transport: str,
    preset: str,
    slots: int | None,
    queue: int,
    batched: bool,
    max_batch: int,
    prompt_words: str,
    max_tokens: str,
    seed: int,
    json_out: str | None,
) -> None:
    """An open-loop client: REQUESTS arriving at RATE per second, many in flight at once; aggregate tok/s against one
    request alone, time to first token and inter-token latency p50/p99. Every answer is checked."""
    if requests < 1 or rate < 0:
        raise click.BadParameter("--requests must be at least 1 and --rate at least 0")
    spec = load_bench.LoadSpec(
        requests, rate, _range(prompt_words, "--prompt-words"), _range(max_tokens, "--max-tokens"), seed
    )
    with exit_1_on_failure():
        if network_file is not None:
            network = load_scenario(network_file).network
            if network is None:
                fail(f"{network_file}: the scenario has no network section to run the load under")
            name = Path(network_file).stem
        else:
            network, name = (
                load_bench.delay_network(delay_ms, seed),
                (f"{delay_ms:g} ms per hop" if delay_ms > 0 else "none"),
            )
        res = load_bench.run_load_bench(
            preset,
            num_stages,
            transport,
            spec,
            slots or min(requests, 16),
            queue,
            network,
            name,
            Progress(),
            json_out,
            batched,
            max_batch,
        )
    click.echo(load_bench.report(res))
    if not res.exact:
        fail("an answer differs from the unsplit model's")


bench.add_command(bench_spec)  # ``ppharness bench spec``, in a module of its own
