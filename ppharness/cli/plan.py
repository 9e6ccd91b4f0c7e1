"""``ppharness plan``: write, check, look at, cost, search and measure plans (``ppharness.plan``)."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import msgspec

from ppharness.benchmarks.plan import calibrated
from ppharness.benchmarks.probe import (
    ROUTING_PROMPTS,
    block_counts,
    first_timed_block,
    probe_fit,
    probe_hop,
    probe_record,
    probe_routing,
    routing_report,
)
from ppharness.cli.common import exit_1_on_failure, fail
from ppharness.document.reader import read_text_file
from ppharness.errors import HarnessError, PlanError
from ppharness.model.sources.files import download_deadline, resolve_model
from ppharness.model.synthetic.spec import PRESETS, parse_synthetic, preset_spec, short_source, synthetic_source
from ppharness.plan import show
from ppharness.plan.experts.place import ExpertReport, baseline_experts, place_experts
from ppharness.plan.experts.problem import without_routed_experts
from ppharness.plan.experts.routing import load_routing, with_frequencies
from ppharness.plan.graph import model_graph, simulation_only, spec_graph
from ppharness.plan.lang.check import check_plan
from ppharness.plan.lang.document import (
    Cluster,
    ModelGraph,
    Objective,
    PlanDoc,
    decode_text,
    plan_schema,
    pretty,
    with_id,
)
from ppharness.plan.lang.limits import MAX_CONTEXT
from ppharness.plan.lang.text_form import render
from ppharness.plan.predict.simulate import simulate
from ppharness.plan.provenance import stale_warnings
from ppharness.plan.reader import file_kind, load_cluster, load_plan
from ppharness.plan.search.budget import DEFAULT_SECONDS, MAX_SECONDS, Budget
from ppharness.plan.search.planner import policy_plan
from ppharness.plan.speculation_gain import parse_alpha_k, plan_with_speculation
from ppharness.run.loop import ticking

MODEL_HELP = (
    "The model: a synthetic preset (tiny, small, ...), a synthetic: spec, a GGUF path or an http(s) URL "
    "(built or downloaded once into the cache)."
)


def model_for(model: str, max_context: int, weights: str = "") -> ModelGraph:
    """The plan's model part for ``model`` (a preset name, a synthetic: spec, a path or a URL), its weights counted
    as the node runtime holds the file's own types, or with the simulator's override ``weights``
    (``ppharness.plan.graph``). A synthetic model this machine does not write (``kimi-k2``) is
    derived from its spec, for the simulator only."""
    if model in PRESETS and simulation_only(f"synthetic:{model}"):
        source = f"synthetic:{model}"
    elif model in PRESETS:
        source = synthetic_source(preset_spec(model))
    elif model.startswith("synthetic:") or "://" in model:
        source = model
    else:
        path = Path(model).expanduser()
        if not path.is_file():
            fail(f"--model {model}: no such file, and not a preset ({', '.join(PRESETS)}) or a URL")
        source = str(path.resolve())
    if simulation_only(source):
        return spec_graph(parse_synthetic(source), source, max_context, weights=weights)
    return model_graph(resolve_model(source), source, max_context, weights=weights)


def expert_device_names(experts_on: str, devices: list[str]) -> list[str]:
    """The devices ``--experts-on`` names, in the cluster's order: comma-separated ids, each of which may be a
    shell-style pattern (``us-east-4090-[1-3]?``) standing for every device it matches; a name that is neither a
    device nor matches one stays as given (the expert planner then says it is unknown)."""
    out: list[str] = []
    for item in (d.strip() for d in experts_on.split(",")):
        if not item:
            continue
        if not any(ch in item for ch in "*?["):
            out.append(item)
            continue
        matched = [d for d in devices if fnmatch.fnmatchcase(d, item)]
        out += [name for name in matched if name not in out] if matched else [item]
    return out


def _load(plan_file: str, model: str | None = None, cluster: str | None = None) -> PlanDoc:
    try:
        return load_plan(plan_file, model=model, cluster=cluster)
    except HarnessError as exc:
        fail(str(exc))


DOWNLOAD_SECONDS = 1800.0  # a model URL's download: a 40 GB file at about 180 Mbit/s, the 64 GiB cap at 300


def _download_limit(f: Callable[..., None]) -> Callable[..., None]:
    """``--download-time-limit``: the seconds each download of a model URL may take (``download_deadline``)."""

    @functools.wraps(f)
    def bounded(*args: Any, download_time_limit: float, **kwargs: Any) -> None:
        fix = f"raise --download-time-limit (now {download_time_limit:g} s), or download it and give the path instead"
        with download_deadline(download_time_limit, fix):
            f(*args, **kwargs)

    return click.option(
        "--download-time-limit",
        type=click.FloatRange(0, MAX_SECONDS, min_open=True),
        default=DOWNLOAD_SECONDS,
        show_default=True,
        help="Seconds each download of a model URL may take: when they run out, exit 1 naming the URL.",
    )(bounded)


TEXT_MODEL_HELP = (
    "A plan in the text form: its model (a preset, a synthetic: spec, a GGUF path or a URL), over its `model:` line."
)
TEXT_CLUSTER_HELP = "A plan in the text form: its cluster file (or `local`), over its `cluster:` line."


def _text_options(f: Callable[..., None]) -> Callable[..., None]:
    """``--model`` and ``--cluster``: a text plan's model and devices (``ppharness.plan.reader``)."""
    f = click.option("--cluster", "cluster", help=TEXT_CLUSTER_HELP)(f)
    return click.option("--model", "model", help=TEXT_MODEL_HELP)(f)


BRIEF_CHARS = 200


def _brief(text: str) -> str:
    """A plan's text form for a summary: each line cut at BRIEF_CHARS (a node of a large mixture-of-experts model
    lists thousands of experts), saying how much is left out and where to read it whole."""
    lines = []
    for line in text.rstrip("\n").splitlines():
        if len(line) > BRIEF_CHARS + 40:
            left = len(line) - BRIEF_CHARS
            line = f"{line[:BRIEF_CHARS]}… ({left:,} more characters: `ppharness plan text` prints it)"
        lines.append(line)
    return "\n".join(lines)


def _write(text: str, out: str | None) -> None:
    if out is None or out == "-":
        click.echo(text, nl=False)
    else:
        Path(out).write_text(text)
        click.echo(f"written: {out}", err=True)


PROBE_TOKENS = 8  # decode steps per slice when `--probe` re-measures this machine


def _warn_measured(cluster: Cluster) -> None:
    """Tell where the cluster's device speeds come from when they are not this engine's measurements."""
    for line in stale_warnings(cluster):
        click.echo(f"warning: {line}", err=True)


def _probed(cluster: Cluster, graph: ModelGraph) -> Cluster:
    """``cluster`` with its local and docker devices re-measured on this machine: one probe of the plan's model, its
    figures in every such device (each keeps its CPU quota, which the cost model applies), as ``ppharness bench
    plan`` calibrates them, and their ``measured`` stamped. vast.ai devices stay as they are."""
    here = tuple(d for d in cluster.devices if d.source.kind in ("local", "docker"))
    away = len(cluster.devices) - len(here)
    if away:
        click.echo(f"--probe: {away} vast.ai device(s) left as they are (measure a card on it: `plan probe`)", err=True)
    if not here:
        return cluster
    if simulation_only(graph.source):
        fail(
            f"--probe times the plan's model here, and {graph.source} is for the simulator only: probe a model this "
            "machine can run (`ppharness plan probe --model M`) and put its device entry in the cluster file"
        )
    path = str(resolve_model(graph.source))
    ks = block_counts(len(graph.blocks), first_timed_block(path))
    how = (
        f"ppharness plan --probe: {PROBE_TOKENS} decode steps per slice of {', '.join(map(str, ks))} block(s) of "
        f"{graph.source[:160]}"
    )
    fit = probe_fit(path, "probe", ks, PROBE_TOKENS, source=graph.source, progress=_say, how=how)
    click.echo(fit.probe_report, err=True)
    same = calibrated(msgspec.structs.replace(cluster, devices=here), fit.device, cluster.hop_ms).devices
    new = {d.id: msgspec.structs.replace(d, measured=fit.device.measured) for d in same}
    click.echo(f"--probe: re-measured {', '.join(new)} (hop_ms kept at {cluster.hop_ms:g} ms)", err=True)
    return msgspec.structs.replace(cluster, devices=tuple(new.get(d.id, d) for d in cluster.devices))


def _say(text: str) -> None:
    click.echo(text, err=True)


@click.group()
def plan() -> None:
    """Plans: what runs where (model graph, cluster, placement)."""


@plan.command("schema")
def plan_schema_cmd() -> None:
    """Print the plan's JSON Schema."""
    click.echo(json.dumps(plan_schema(), indent=2))


@plan.command("check")
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--model", "model", help=TEXT_MODEL_HELP)
@click.option(
    "--cluster",
    "cluster",
    help="A cluster file: checked as one whatever it holds, and the devices of the text plans among FILES (over "
    "their `cluster:` lines; `local`: every device a local process).",
)
@_download_limit
def plan_check(files: tuple[str, ...], model: str | None, cluster: str | None) -> None:
    """Check plan files (documents or the text form) and cluster files without running them, each told apart by its
    content; exit 1 if any is bad."""
    if not files and cluster is None:
        raise click.UsageError("name the plan or cluster files to check (or a cluster file with --cluster)")
    bad = 0
    forced = [cluster] if cluster is not None and cluster != "local" else []
    for f, is_cluster in [(c, True) for c in forced] + [(f, False) for f in files]:
        try:
            kind = "cluster" if is_cluster else file_kind(read_text_file(Path(f), "plan", "*.yaml", PlanError))
            if kind == "cluster":
                c = load_cluster(f)
                click.echo(f"ok: {f} (cluster {c.name}: {len(c.devices)} devices)")
            elif kind == "text":
                doc = load_plan(f, model=model, cluster=cluster)
                click.echo(f"ok: {f} (plan {doc.id}: {len(doc.placement.nodes)} nodes)")
            else:  # a plan document has its own model and cluster
                doc = load_plan(f)
                click.echo(f"ok: {f} (plan {doc.id}: {len(doc.placement.nodes)} nodes)")
        except HarnessError as exc:
            bad += 1
            click.echo(f"FAILED: {exc}", err=True)
    if bad:
        raise SystemExit(1)


@plan.command("fmt")
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("-o", "--out", help="Write here instead of standard output.")
def plan_fmt(plan_file: str, out: str | None) -> None:
    """Print a plan in its canonical form (sorted keys, with its id), e.g. after editing it by hand."""
    try:
        doc = decode_text(read_text_file(Path(plan_file), "plan", "*.json", PlanError), plan_file)
        check_plan(doc, plan_file)
    except HarnessError as exc:
        fail(str(exc))
    _write(pretty(doc), out)


@plan.command("text")
@click.argument("plan_file", type=click.Path(dir_okay=False))
@_text_options
@_download_limit
def plan_text(plan_file: str, model: str | None, cluster: str | None) -> None:
    """Print a plan's placement in the compact text form (one line per node)."""
    click.echo(render(_load(plan_file, model, cluster).placement).rstrip("\n"))


@plan.command("make")
@click.option("--model", "model", required=True, help=MODEL_HELP)
@click.option("--cluster", "cluster_file", required=True, type=click.Path(dir_okay=False), help="Cluster file.")
@click.option(
    "--objective",
    type=click.Choice(["latency", "throughput", "cost"]),
    default="latency",
    show_default=True,
    help="Per-token latency of one request, throughput with --requests in flight, or $ per token.",
)
@click.option("--requests", type=click.IntRange(1, 4096), default=1, show_default=True, help="Requests in flight.")
@click.option(
    "--policy",
    type=click.Choice(["optimal", "even", "memory"]),
    default="optimal",
    show_default=True,
    help="optimal: the planner's search; even: the blocks split as evenly as they go (the first devices take one more) "
    "over every device in the file's order; memory: "
    "blocks in proportion to device memory (exo's split).",
)
@click.option(
    "--max-context",
    type=click.IntRange(1, MAX_CONTEXT),
    default=256,
    show_default=True,
    help="KV cache length every node holds.",
)
@click.option(
    "--experts-on",
    "experts_on",
    help="Comma-separated devices for the routed experts of a mixture-of-experts model (each may be a shell-style "
    "pattern, e.g. 'us-east-4090-[1-3]?'): the stages are placed on the other devices (as their blocks' dense parts), "
    "then the experts on these and in the stages' spare memory.",
)
@click.option(
    "--expert-policy",
    type=click.Choice(["optimal", "round-robin", "uniform"]),
    default="optimal",
    show_default=True,
    help="optimal: the expert planner (ppharness.plan.experts.place); round-robin, uniform: baselines over the "
    "--experts-on devices that ignore frequencies and links.",
)
@click.option("--replicas/--no-replicas", default=True, show_default=True, help="Let the planner copy hot experts.")
@click.option(
    "--expert-time-limit",
    type=click.FloatRange(0, MAX_SECONDS, min_open=True),
    default=10.0,
    show_default=True,
    help="Seconds for the expert planner (within --time-limit).",
)
@click.option(
    "--time-limit",
    type=click.FloatRange(0, MAX_SECONDS, min_open=True),
    default=DEFAULT_SECONDS,
    show_default=True,
    help="Seconds for the whole search: when they run out, the best plan found so far (and what was cut short).",
)
@click.option(
    "--routing",
    "routing_file",
    type=click.Path(dir_okay=False),
    help='Expert frequencies: JSON {"layers": {"<block>": [share of tokens choosing each routed expert, ...]}}.',
)
@click.option(
    "--weights",
    default="",
    help="Count weight bytes with an override instead of the file's own types (by default each tensor counts as the "
    "node runtime holds it: packed types at their bytes in the file, F16/F32 as float16), for the simulator only "
    "(a run refuses the plan): f16, q8_0 (8.5 bits per weight), q4_k (4.5), q4_0 (4.5), or bits per weight "
    "(e.g. 4.85).",
)
@click.option(
    "--probe",
    "reprobe",
    is_flag=True,
    help="Re-measure the cluster's local and docker devices on this machine first (one probe of the model).",
)
@click.option("-o", "--out", help="Plan file to write (JSON); default: standard output.")
@_download_limit
def plan_make(
    model: str,
    cluster_file: str,
    objective: str,
    requests: int,
    policy: str,
    max_context: int,
    experts_on: str | None,
    expert_policy: str,
    replicas: bool,
    expert_time_limit: float,
    time_limit: float,
    routing_file: str | None,
    weights: str,
    reprobe: bool,
    out: str | None,
) -> None:
    """Make a plan for MODEL on a cluster: which devices, in which order, which blocks each (and, with --experts-on,
    which node computes each routed expert)."""
    report: ExpertReport | None = None
    with exit_1_on_failure():
        cluster: Cluster = load_cluster(cluster_file)
        graph = model_for(model, max_context, weights)
        if reprobe:
            cluster = _probed(cluster, graph)
        _warn_measured(cluster)
        goal = Objective(kind=objective, requests=requests)  # type: ignore[arg-type]
        say = functools.partial(click.echo, err=True)
        budget = Budget(time_limit)
        if experts_on is None:
            say(f"planning {len(graph.blocks)} blocks over {len(cluster.devices)} devices ({policy})")
            with ticking("planning", say):
                doc = policy_plan(policy, graph, cluster, goal, budget=budget)
        else:
            names = expert_device_names(experts_on, [d.id for d in cluster.devices])
            stage_devices = tuple(d for d in cluster.devices if d.id not in names)
            if not names or not stage_devices:
                fail(
                    f"--experts-on {experts_on}: name some of the cluster's devices for the experts and leave at "
                    "least one for the stages"
                )
            say(f"planning the stages over {len(stage_devices)} devices ({policy})")
            with ticking("planning the stages", say):
                stages = policy_plan(
                    policy,
                    without_routed_experts(graph),
                    msgspec.structs.replace(cluster, devices=stage_devices),
                    goal,
                    budget=budget,
                )
            doc = with_id(msgspec.structs.replace(stages, model=graph, cluster=cluster))
        if budget.ran_out is not None:
            say(
                f"time limit of {time_limit:g} s reached during {budget.ran_out} (after {budget.elapsed():.1f} s): "
                "the plan below is the best found so far, not searched to the end — raise --time-limit to search on"
            )
        if routing_file is not None:
            doc = with_frequencies(doc, load_routing(routing_file), routing_file)
        if experts_on is not None:
            if expert_policy == "optimal":
                # what is left of --time-limit, with a second at least: the stages are placed, the experts must be
                seconds = max(1.0, min(expert_time_limit, budget.left() or 0.0))
                say(f"placing the experts on {len(names)} devices (time limit {seconds:g} s)")
                with ticking("placing the experts", say):
                    doc, report = place_experts(doc, names, replicas=replicas, time_limit_s=seconds)
            else:
                doc, report = baseline_experts(doc, names, expert_policy)  # type: ignore[arg-type]
        check_plan(doc, out or "<plan>")
    _write(pretty(doc), out)
    prediction = simulate(doc, requests=requests)
    click.echo(_brief(render(doc.placement)), err=True)
    if report is not None:
        click.echo(report.summary(), err=True)
    click.echo(prediction.header(), err=True)


@plan.command("show")
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("--png", "png", type=click.Path(dir_okay=False), help="Also draw the graph into this PNG file.")
@click.option("--mermaid", "mermaid_file", type=click.Path(dir_okay=False), help="Also write a Mermaid flowchart.")
@click.option("--dot", "dot_file", type=click.Path(dir_okay=False), help="Also write a Graphviz DOT file.")
@_text_options
@_download_limit
def plan_show(
    plan_file: str,
    png: str | None,
    mermaid_file: str | None,
    dot_file: str | None,
    model: str | None,
    cluster: str | None,
) -> None:
    """A table of the plan's nodes (device, ops, weights, KV cache, predicted ms) and its text form."""
    doc = _load(plan_file, model, cluster)
    click.echo(f"plan {doc.id} ({doc.placement.policy or 'hand-written'}), model {short_source(doc.model.source)}")
    click.echo(show.table(doc))
    click.echo("")
    click.echo(_brief(render(doc.placement)))
    if png:
        show.draw_png(doc, png)
        click.echo(f"written: {png}", err=True)
    if mermaid_file:
        Path(mermaid_file).write_text(show.mermaid(doc))
        click.echo(f"written: {mermaid_file}", err=True)
    if dot_file:
        Path(dot_file).write_text(show.dot(doc))
        click.echo(f"written: {dot_file}", err=True)


@plan.command("simulate")
@click.argument("plan_file", type=click.Path(dir_okay=False))
@click.option("--json", "json_out", is_flag=True, help="The prediction as JSON (keys: docs/plans.md).")
@click.option("--requests", type=int, help="Requests in flight (default: the plan's objective's).")
@click.option("--prompt-tokens", type=int, default=8, show_default=True, help="Prompt length for the first token.")
@click.option(
    "--batch",
    type=int,
    default=1,
    show_default=True,
    help="Batched serving (serving.batched): up to this many requests per step, weights read once for all of them.",
)
@click.option(
    "--probe",
    "reprobe",
    is_flag=True,
    help="Re-measure the plan's local and docker devices on this machine first (one probe of the model).",
)
@click.option(
    "--speculate",
    metavar="ALPHA:K",
    help="Also predict speculative decoding: K drafted tokens per window, each accepted with probability ALPHA "
    "(docs/speculative-decoding.md).",
)
@click.option("--draft-ms", type=float, default=0.0, show_default=True, help="The draft's time per window on stage 0.")
@_text_options
@_download_limit
def plan_simulate(
    plan_file: str,
    requests: int | None,
    prompt_tokens: int,
    batch: int,
    reprobe: bool,
    speculate: str | None,
    draft_ms: float,
    model: str | None,
    cluster: str | None,
    json_out: bool,
) -> None:
    """Predict time to first token, per-token latency (its parts, as the trace lists them) and throughput."""
    alpha_k = None
    if speculate is not None:
        try:
            alpha_k = parse_alpha_k(speculate)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--speculate") from None
    doc = _load(plan_file, model, cluster)
    if reprobe:
        with exit_1_on_failure():
            doc = with_id(msgspec.structs.replace(doc, cluster=_probed(doc.cluster, doc.model)))
    _warn_measured(doc.cluster)
    if batch < 1:
        raise click.BadParameter(f"--batch must be at least 1, got {batch}")
    prediction = simulate(doc, prompt_tokens=prompt_tokens, requests=requests, batch=batch)
    spec = plan_with_speculation(doc, *alpha_k, draft_ms=draft_ms) if alpha_k is not None else None
    if json_out:
        extra = {"speculation": dataclasses.asdict(spec)} if spec is not None else {}
        click.echo(json.dumps(prediction.as_json() | extra, indent=1))
    else:
        click.echo(prediction.summary() + (f"\n{spec.summary()}" if spec is not None else ""))


@plan.command("probe")
@click.option("--model", "model", default="small", show_default=True, help=MODEL_HELP)
@click.option("--id", "device_id", default="this", show_default=True, help="The device entry's id.")
@click.option("-o", "--out", help="Write the device entry (YAML) here; default: standard output.")
@click.option(
    "--routing",
    is_flag=True,
    help="Measure a mixture-of-experts model's routing instead: how often each expert of each block is chosen "
    "(JSON for `plan make --routing`).",
)
@click.option(
    "--tokens",
    type=int,
    default=32,
    show_default=True,
    help="Decode steps timed per slice (and through the chain, --hop); --routing: tokens generated per prompt.",
)
@click.option("--prompt", "prompts", multiple=True, help="--routing: a prompt (repeatable; default: three built in).")
@click.option(
    "--hop",
    "hop_too",
    is_flag=True,
    help="Also measure the transport's cost per hop: the model in a running chain of two stages in this process over "
    "ZeroMQ, the median from one stage's send of a hidden state to the next stage's receipt (a cluster's hop_ms).",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False),
    help="Also write what was measured as JSON (the device entry with its `measured`, the fit, the hop), as "
    "`python -m ppharness.plan.consumer --basis FILE` reads it.",
)
@_download_limit
def plan_probe(
    model: str,
    device_id: str,
    out: str | None,
    routing: bool,
    tokens: int,
    prompts: tuple[str, ...],
    hop_too: bool,
    json_out: str | None,
) -> None:
    """Time per-block decode on this machine (tinygrad's default device) and print the device entry for a
    cluster file: speed, memory bandwidth, fixed cost per token, memory, and what it was measured with. A
    mixture-of-experts model's slices start at its first MoE block. With --routing, measure which experts a
    mixture-of-experts model's tokens choose instead."""
    if routing:
        with exit_1_on_failure():
            graph = model_for(model, 256)
            freqs, routed = probe_routing(str(resolve_model(graph.source)), prompts or ROUTING_PROMPTS, tokens)
        click.echo(routing_report(freqs, routed), err=True)
        body = {"layers": {str(b): [round(x, 6) for x in f] for b, f in freqs.items()}}
        _write(msgspec.json.encode(body).decode() + "\n", out)
        return
    with exit_1_on_failure():
        graph = model_for(model, 256)
        path = str(resolve_model(graph.source))
        ks = block_counts(len(graph.blocks), first_timed_block(path))
        fit = probe_fit(path, device_id, ks, tokens, source=graph.source, progress=_say)
        hop = probe_hop(path, tokens, source=graph.source, progress=_say) if hop_too else None
    click.echo(fit.probe_report, err=True)
    if hop is not None:
        click.echo(f"{hop.report}; a cluster's hop_ms: {hop.hop_ms:.3f}, handoff_ms: {hop.handoff_ms:.3f}", err=True)
    if json_out:
        Path(json_out).write_text(json.dumps(probe_record(fit, hop), indent=1) + "\n")
        click.echo(f"written: {json_out}", err=True)
    _write(msgspec.yaml.encode([msgspec.to_builtins(fit.device)]).decode(), out)
