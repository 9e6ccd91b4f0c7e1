"""Command line: ``pp-smoke-run`` and ``ppharness {run, scenario schema, model make|info, oracle, reap}``.

Every command exits 0 on success and 1 with a one-line reason on any failure, after destroying whatever it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import click

from ppharness.errors import HarnessError
from ppharness.run.locks import RunLabelInUse
from ppharness.seams.provider import Reaped

SCENARIO_HELP = "Scenario YAML file (see scenarios/); flags given here override its values."


def _fail(reason: str, exc: BaseException | None = None) -> NoReturn:
    click.echo(f"FAILED: {reason}", err=True)
    for note in getattr(exc, "__notes__", []) or []:
        click.echo(note, err=True)
    sys.exit(1)


@contextlib.contextmanager
def _exit_1_on_failure(before_exit: Callable[[], object] = lambda: None) -> Iterator[None]:
    """Around long work: SIGTERM behaves like Ctrl-C, and a HarnessError or an interrupt ends the command with exit 1
    and one line, after ``before_exit`` (e.g. the run's last sweep)."""
    _sigterm_as_interrupt()
    try:
        yield
    except RunLabelInUse as exc:  # nothing was created, and what the label names is another run's
        _fail(str(exc), exc)
    except HarnessError as exc:
        before_exit()
        _fail(str(exc), exc)
    except KeyboardInterrupt:
        before_exit()
        _fail("interrupted; every node was stopped")


def _sigterm_as_interrupt() -> None:
    """SIGTERM and SIGHUP (a closed terminal, a dropped SSH session) take the same clean path as Ctrl-C: unwind,
    destroy every node, exit 1. After a hang-up the terminal is gone, so output goes to /dev/null from then on (a
    write to a hung-up terminal fails, and must not break the clean-up)."""

    def handler(signum: int, frame: Any) -> NoReturn:
        raise KeyboardInterrupt

    def hangup(signum: int, frame: Any) -> NoReturn:
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(null, fd)
        os.close(null)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, hangup)


def _kinds(csv: str) -> list[str]:
    """``"zmq, iroh"`` -> ``["zmq", "iroh"]``."""
    return [t.strip() for t in csv.split(",") if t.strip()]


def _human_bytes(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def print_summary(result: Any) -> None:
    """The run's answer and figures on stdout."""
    r = result.response
    click.echo(f"\ntext: {r.text!r}")
    click.echo(f"tokens ({len(r.token_ids)}, {r.finish_reason}): {r.token_ids}")
    click.echo(
        f"chain: {len(result.plan.ranges)} stages, time to first token {result.ttft_s * 1000:.0f} ms, "
        f"decode {result.decode_tok_s:.1f} tok/s"
    )
    if result.oracle is not None:
        o = result.oracle
        click.echo(
            f"oracle (unsplit, one process): first token {o.ttft_s * 1000:.0f} ms, decode {o.decode_tok_s:.1f} "
            f"tok/s; chain/single decode ratio {result.decode_tok_s / o.decode_tok_s:.2f}"
            if o.decode_tok_s
            else ""
        )
    click.echo(f"\n{'stage':>5} {'blocks':>9} {'params':>12} {'tied':>10} {'load+compile':>13} {'peak RSS':>9}")
    for s in result.stages:
        click.echo(
            f"{s.index:>5} {f'[{s.lo},{s.hi})':>9} {s.params:>12,} {s.tied_params:>10,} {s.load_s:>12.1f}s "
            f"{_human_bytes(s.peak_rss_bytes):>9}"
        )
    total = sum(s.params for s in result.stages)
    model = f"   (model: {result.oracle.n_params:,})" if result.oracle else ""
    click.echo(f"{'sum':>5} {'':>9} {total:>12,}{model}")
    if result.matches_oracle is True:
        click.echo(
            f"\nMATCH: the {len(result.plan.ranges)}-stage chain's {len(r.token_ids)} tokens equal the unsplit "
            f"model's, token for token, and all {result.verdict.boundaries_compared} stage-boundary hidden "
            "states byte for byte"
        )


def _reap_own(kind: str, run_label: str) -> list[Reaped]:
    """The last sweep of every run: destroy whatever still carries its label; say what that was."""
    from ppharness.registry import provider_class

    try:
        found = provider_class(kind).reap(run_label)
    except HarnessError as exc:
        click.echo(f"warning: reaping run {run_label} failed: {exc}", err=True)
        return []
    for what in found:
        click.echo(f"warning: reaped leftover of run {run_label}: {what}", err=True)
    return found


def run_and_report(
    scenario: Any,
    quiet: bool = False,
    run_label: str | None = None,
    trace_path: str | None = None,
    trace: bool | None = None,
) -> None:
    """Run ``scenario``; print the summary; exit 1 on failure or mismatch."""
    import uuid

    from ppharness.run.orchestrator import Progress, run_scenario

    run_label = run_label or f"pp-{uuid.uuid4().hex[:8]}"
    trace_path = trace_path or scenario.trace.path
    trace_on = bool(trace_path) or (scenario.trace.enabled if trace is None else trace)
    with _exit_1_on_failure(lambda: _reap_own(scenario.provider.kind, run_label)):
        result = run_scenario(scenario, progress=Progress(quiet=quiet), run_label=run_label, trace=trace_on)
    if _reap_own(scenario.provider.kind, run_label):
        _fail(f"resources of run {run_label} outlived it and were reaped")
    print_summary(result)
    if result.trace is not None:
        click.echo("\n" + result.trace.summary())
        if trace_path:
            written = ", ".join(result.trace.write(trace_path))
            click.echo(f"trace written: {written} (open the .json in ui.perfetto.dev)")
    if result.matches_oracle is False:
        o, c = result.oracle.token_ids, result.response.token_ids
        _fail(f"MISMATCH: {result.verdict.describe(c, o)}; chain {c}, oracle {o}")


def _load(scenario_file: str | None, **overrides: Any) -> Any:
    from ppharness.scenario.schema import load_scenario, scenario_from_args

    try:
        base = load_scenario(scenario_file) if scenario_file else None
        return scenario_from_args(base=base, **overrides)
    except HarnessError as exc:
        _fail(str(exc))


# --- pp-smoke-run ---------------------------------------------------------------------------------------------------


@click.command(name="pp-smoke-run")
@click.option("--num-stages", "-n", type=int, help="Number of pipeline stages (default: the scenario's, else 2).")
@click.option("--scenario", "scenario_file", type=click.Path(dir_okay=False), help=SCENARIO_HELP)
@click.option("--transport", help="Transport kind between processes: zmq or iroh.")
@click.option("--provider", help="Provider kind (local, ...).")
@click.option("--prompt", help="Prompt text.")
@click.option("--max-tokens", type=int, help="Tokens to generate.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
@click.option(
    "--run-label",
    help="Label every node of this run carries (default: a fresh pp-xxxxxxxx); "
    "`ppharness reap --label L` destroys leftovers.",
)
@click.option(
    "--trace",
    "trace_path",
    type=click.Path(dir_okay=False),
    help="Write the per-token trace: FILE (Perfetto/Chrome JSON) and FILE's .jsonl (one line per token).",
)
@click.option("--no-trace", is_flag=True, help="Record no timings (no per-token summary).")
@click.option(
    "--vastai",
    is_flag=True,
    help="Rent one vast.ai instance per stage (default scenario: the SPEC's "
    "request, scenarios/templates/acceptance-5stage-vastai-llama3.2-1b.yaml; its CI variant on the tiny "
    "model is scenarios/acceptance-5stage-vastai.yaml); prints the plan and its cost first.",
)
@click.option("--api-key", help="vast.ai API key (default: $VAST_API_KEY, which keeps it out of the process list).")
@click.option(
    "--vastai-url",
    help="vast.ai API base URL (default: $VAST_URL, else https://console.vast.ai), e.g. a `ppharness vastai-emulator`.",
)
def smoke_run(
    num_stages: int | None,
    scenario_file: str | None,
    transport: str | None,
    provider: str | None,
    prompt: str | None,
    max_tokens: int | None,
    quiet: bool,
    run_label: str | None,
    trace_path: str | None,
    no_trace: bool,
    vastai: bool,
    api_key: str | None,
    vastai_url: str | None,
) -> None:
    """Run the N-stage chain once, print its text, and check it against the unsplit model."""
    if vastai:
        provider, scenario_file = _use_vastai(provider, scenario_file, api_key, vastai_url)
    elif api_key or vastai_url:
        _fail("--api-key and --vastai-url apply only with --vastai")
    run_and_report(
        _load(
            scenario_file,
            num_stages=num_stages,
            transport=transport,
            provider=provider,
            prompt=prompt,
            max_tokens=max_tokens,
        ),
        quiet=quiet,
        run_label=run_label,
        trace_path=trace_path,
        trace=False if no_trace else None,
    )


# the SPEC's rung-1 request on vast.ai (llama3.2:1b, "Say hello", 64 tokens): what --vastai runs by default
VASTAI_ACCEPTANCE = "acceptance-5stage-vastai-llama3.2-1b.yaml"


def _use_vastai(
    provider: str | None, scenario_file: str | None, api_key: str | None, vastai_url: str | None
) -> tuple[str, str]:
    """``--vastai``: the provider and scenario it implies; the key and URL go where the provider (and the reaper)
    read them, the environment of this process only (never an argument of any process it starts)."""
    import os

    if provider not in (None, "vastai"):
        _fail(f"--vastai and --provider {provider} contradict each other")
    if api_key is not None:
        os.environ["VAST_API_KEY"] = api_key
    if vastai_url is not None:
        os.environ["VAST_URL"] = vastai_url
    if not os.environ.get("VAST_API_KEY", "").strip():
        _fail("--vastai needs a vast.ai API key: --api-key KEY or VAST_API_KEY")
    default = Path(__file__).resolve().parent.parent / "scenarios" / "templates" / VASTAI_ACCEPTANCE
    return "vastai", scenario_file or str(default)


# --- ppharness ------------------------------------------------------------------------------------------------------


@click.group()
def main() -> None:
    """ppharness: pipeline-parallel inference harness."""


@main.command()
@click.argument("scenario_file", type=click.Path(dir_okay=False))
@click.option("--num-stages", "-n", type=int, help="Override the scenario's stage count.")
@click.option("--quiet", "-q", is_flag=True)
def run(scenario_file: str, num_stages: int | None, quiet: bool) -> None:
    """Run a scenario file."""
    run_and_report(_load(scenario_file, num_stages=num_stages), quiet=quiet)


@main.group()
def scenario() -> None:
    """Scenario files."""


@scenario.command("schema")
def scenario_schema_cmd() -> None:
    """Print the scenario JSON Schema (for editors: yaml-language-server's $schema)."""
    from ppharness.scenario.schema import scenario_schema

    click.echo(json.dumps(scenario_schema(), indent=2))


@scenario.command("check")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
def scenario_check(files: tuple[str, ...]) -> None:
    """Validate scenario files without running them: every file is checked and every bad one reported; exit 1 if
    any is bad."""
    from ppharness.scenario.schema import load_scenario

    bad = 0
    for f in files:
        try:
            load_scenario(f)
        except HarnessError as exc:
            bad += 1
            click.echo(f"FAILED: {exc}", err=True)
            continue
        click.echo(f"ok: {f}")
    if bad:
        if len(files) > 1:
            click.echo(f"FAILED: {bad} of {len(files)} scenario files", err=True)
        sys.exit(1)


@main.group()
def model() -> None:
    """Model files."""


@model.command("make")
@click.option("--preset", default="tiny", show_default=True, help="Dimensions preset (tiny, small, llama-3.2-1b).")
@click.option("--blocks", type=int)
@click.option("--dim", type=int)
@click.option("--ffn", type=int)
@click.option("--heads", type=int)
@click.option("--kv-heads", type=int)
@click.option("--vocab", type=int)
@click.option("--context", type=int)
@click.option("--tied/--untied", "tied_embeddings", default=None, help="Tie the output head to the embedding.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--type",
    "type",
    default="f16",
    show_default=True,
    help="How the weight matrices are stored: f16, or quantised q8_0 or q4_0 (norms stay f32).",
)
@click.option("--output", "-o", type=click.Path(dir_okay=False), required=True)
def model_make(preset: str, output: str, **overrides: Any) -> None:
    """Write a deterministic synthetic llama GGUF (same arguments, same bytes)."""
    from ppharness.model.files import make_synthetic, preset_spec, sha256_file

    try:
        spec = preset_spec(preset, **overrides)
        click.echo(
            f"writing {spec.n_params:,} parameters ({spec.blocks} blocks, dim {spec.dim}, {spec.type}) to {output}",
            err=True,
        )
        path = make_synthetic(spec, output)
    except HarnessError as exc:
        _fail(str(exc))
    click.echo(f"{path}  sha256 {sha256_file(path)}")


@model.command("info")
@click.argument("source")
def model_info(source: str) -> None:
    """Show a GGUF's (path, URL or synthetic:...) dimensions and parameter count."""
    from ppharness.model.files import resolve_model
    from ppharness.model.slicing import GGUFFile

    try:
        f = GGUFFile(resolve_model(source))
    except HarnessError as exc:
        _fail(str(exc))
    for k, v in vars(f.config).items():
        click.echo(f"{k:>12}: {v}")
    click.echo(f"{'path':>12}: {f.path}")


@main.command("split-check")
@click.option(
    "--model", "source", default="synthetic:tiny", show_default=True, help="A GGUF path, URL or synthetic: spec."
)
@click.option(
    "--stages",
    default="2,3,5",
    show_default=True,
    help="Even splits to check, comma-separated stage counts; or explicit cut points: 1/3/6 (several "
    "splits separated by commas: 1/3/6,4).",
)
@click.option("--prompt", default="The quick brown fox", show_default=True)
@click.option("--max-tokens", type=int, default=200, show_default=True)
@click.option("--max-context", type=int, default=256, show_default=True)
def split_check(source: str, stages: str, prompt: str, max_tokens: int, max_context: int) -> None:
    """Check, in one process on this machine's device (DEV=CUDA for a GPU), that splits equal the unsplit model bit
    for bit: tokens, every stage-boundary hidden state, and the compiled kernels. Exits 1 on any difference."""
    from ppharness.model.exactness import check_splits
    from ppharness.model.files import resolve_model
    from ppharness.model.slicing import GGUFFile
    from ppharness.plan.stages import make_plan

    with _exit_1_on_failure():
        path = str(resolve_model(source))
        blocks = GGUFFile(path).config.blocks
        splits = []
        for item in _kinds(stages):
            try:  # a stage count ("3") or cut points ("1/3/6")
                plan = (
                    make_plan(blocks, num_stages=int(item))
                    if item.isdigit()
                    else make_plan(blocks, splits=[int(c) for c in item.split("/")])
                )
            except ValueError:
                _fail(f"--stages: {item!r} is neither a stage count nor cut points like 1/3/6")
            splits.append(list(plan.ranges))
        if max_tokens >= max_context:
            _fail(f"--max-tokens {max_tokens} does not fit --max-context {max_context}")
        oracle_result, checks = check_splits(path, prompt, max_tokens, splits, max_context)
    click.echo(
        f"unsplit model: {len(oracle_result.token_ids)} tokens ({oracle_result.finish_reason}), "
        f"decode {oracle_result.decode_tok_s:.1f} tok/s"
    )
    for c in checks:
        spans = ", ".join(f"[{lo},{hi})" for lo, hi in c.ranges)
        kernels = "same kernels" if c.same_kernels else "OTHER KERNELS than the unsplit model"
        click.echo(
            f"{'MATCH' if c.exact else 'MISMATCH'} {spans}: {len(c.token_ids)} tokens; "
            f"{c.verdict.describe(c.token_ids, oracle_result.token_ids)}; {kernels}"
        )
    if not all(c.exact for c in checks):
        _fail("a split differs from the unsplit model")


@main.command()
@click.option("--scenario", "scenario_file", type=click.Path(dir_okay=False), help=SCENARIO_HELP)
@click.option("--prompt")
@click.option("--max-tokens", type=int)
def oracle(scenario_file: str | None, prompt: str | None, max_tokens: int | None) -> None:
    """Greedy decode with the unsplit model in this process: the reference every split must equal."""
    from ppharness.model.files import resolve_model
    from ppharness.model.oracle import oracle_decode
    from ppharness.run.orchestrator import model_source

    sc = _load(scenario_file, prompt=prompt, max_tokens=max_tokens)
    try:
        path = resolve_model(*model_source(sc))
        res = oracle_decode(path, sc.request.prompt, sc.request.max_tokens, sc.model.max_context)
    except HarnessError as exc:
        _fail(str(exc))
    click.echo(
        f"text: {res.text!r}\ntokens: {res.token_ids}\nloaded and compiled in {res.load_s:.1f} s, first token "
        f"{res.ttft_s * 1000:.0f} ms, decode {res.decode_tok_s:.1f} tok/s, {res.n_params:,} parameters"
    )


@main.group(invoke_without_command=True)
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
    from ppharness.benchmarks.chain import report, run_chain_bench
    from ppharness.run.orchestrator import Progress

    with _exit_1_on_failure():
        res = run_chain_bench(preset, num_stages, _kinds(transports), tokens, repeats, out_dir, sweep, Progress())
    click.echo(report(res))
    click.echo(f"\nwritten: {out_dir}/bench.json, {out_dir}/bench.png")
    if any(res.mismatch.values()):
        _fail("a chain's answer differs from the unsplit model's (MISMATCH above)")


@bench.command("transport")
@click.option("--sizes", default="64,4096,131072", show_default=True, help="Payload sizes in bytes, comma-separated.")
@click.option("--repeats", type=int, default=200, show_default=True, help="Round trips per size and transport.")
@click.option("--transports", "kinds", default="zmq,iroh", show_default=True, help="ppharness transports to measure.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the results as JSON here.")
def bench_transport(sizes: str, repeats: int, kinds: str, json_out: str | None) -> None:
    """Round-trip latency p50/p99 per payload size: raw libraries vs ppharness transports, with ratios."""
    from ppharness.benchmarks.transport import run_transport_bench

    with _exit_1_on_failure():
        run_transport_bench([int(x) for x in sizes.split(",")], repeats, _kinds(kinds), json_out)


@main.command("vastai-emulator")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8765, show_default=True, type=int)
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the offer catalog.")
@click.option("--offers", default=64, show_default=True, type=int, help="Offers in the catalog.")
@click.option(
    "--delays",
    default="1,2,5",
    show_default=True,
    help="Seconds an instance spends scheduling, created and loading before it runs.",
)
@click.option(
    "--rate-scale",
    default=1.0,
    show_default=True,
    type=float,
    help="Scale of the per-endpoint minimum intervals (1: vast.ai's documented ones).",
)
@click.option(
    "--fault",
    "faults",
    multiple=True,
    help="A fault switch, repeatable (K: the K-th create): offers-cap=N, "
    "reject-create=K, vanish-offer=K, stuck-loading=K, fail-as=K:exited|unknown|offline, oci-error=K, "
    "outbid=K, null-ssh-port=K, leave-stopped=K, exit-after=K:SECONDS, storm-429=N, server-errors=502,503, "
    "resets=N, search-quota, destroy-fail=N (-1: always), gone-404.",
)
@click.option(
    "--docker-image",
    help="Run instances as containers of this local image (e.g. the node image) on the "
    "host network, instead of local pp-node processes.",
)
def vastai_emulator(
    host: str,
    port: int,
    seed: int,
    offers: int,
    delays: str,
    rate_scale: float,
    faults: tuple[str, ...],
    docker_image: str | None,
) -> None:
    """Serve an API-compatible vast.ai emulator whose instances run local pp-node processes, until Ctrl-C.

    It accepts the key in VAST_API_KEY, or generates one and prints it."""
    import os

    from ppharness.registry import tool

    try:
        d = tuple(float(x) for x in delays.split(","))
        if len(d) != 3:
            raise ValueError
    except ValueError:
        _fail(f"--delays {delays!r}: expected three numbers, e.g. 1,2,5")
    try:
        tool("vastai-emulator")(
            host=host,
            port=port,
            seed=seed,
            offers=offers,
            delays=d,
            rate_scale=rate_scale,
            key=os.environ.get("VAST_API_KEY") or None,
            fault_specs=list(faults),
            docker_image=docker_image,
        )
    except HarnessError as exc:
        _fail(str(exc))


@bench.command("gpu")
@click.option("--device", default="cuda", show_default=True, help="tinygrad device for every process (cuda, nv, cpu).")
@click.option("--preset", default="llama-3.2-1b", show_default=True)
@click.option("--stages", default="2,5", show_default=True, help="Chain sizes, comma-separated.")
@click.option("--transport", "transports", default="zmq,iroh", show_default=True)
@click.option("--tokens", type=int, default=128, show_default=True)
@click.option("--prompt-tokens", type=int, default=32, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--hf/--no-hf", default=True, show_default=True, help="Also run HF transformers where installed.")
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
    out_dir: str,
) -> None:
    """The chain on an accelerator vs single-process tinygrad and HF transformers (docs/gpu-bench.md)."""
    from ppharness.benchmarks.gpu import report, run_gpu_bench
    from ppharness.run.orchestrator import Progress

    with _exit_1_on_failure():
        res = run_gpu_bench(
            device,
            preset,
            [int(x) for x in stages.split(",")],
            _kinds(transports),
            tokens,
            prompt_tokens,
            repeats,
            out_dir,
            hf,
            Progress(),
        )
    click.echo(report(res))
    click.echo(f"\nwritten: {out_dir}/gpu-bench.json, {out_dir}/gpu-bench.png")
    if any(c.tokens_match_oracle is False for c in res.contenders):
        _fail("a chain's answer differs from the single-process oracle's (MISMATCH above)")


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
    from ppharness.benchmarks.failover import report, run_failover_bench
    from ppharness.run.orchestrator import Progress

    with _exit_1_on_failure():
        results = run_failover_bench(num_stages, runs, sig, engine, Progress())
    click.echo(report(results, num_stages, sig, engine))


@main.command()
@click.option("--label", help="Only this run's label, whether or not this machine knows the run (never a live one).")
@click.option("--provider", "providers", multiple=True, help="Provider kind(s) to reap (default: all).")
@click.option("--dry-run", is_flag=True, help="Only list what would be destroyed, and what is kept and why.")
@click.option(
    "--strict", is_flag=True, help="Exit 1 when anything was found, reaped or not (CI: nothing may outlive the tests)."
)
def reap(label: str | None, providers: tuple[str, ...], dry_run: bool, strict: bool) -> None:
    """Destroy leftovers of crashed runs.

    Without --label: only the resources of runs this user started on this machine whose orchestrator is gone. A live
    run is never touched; resources of runs this machine does not know (another user's, another machine's) are
    listed and kept: name one with --label to reap it.
    """
    from ppharness.registry import PROVIDERS, provider_class
    from ppharness.run.locks import forget, run_state

    if label is not None:
        info = run_state(label)
        if info.state == "live":
            _fail(f"run {label} is live (orchestrator pid {info.pid}); it is not reaped")
    states: dict[str, str] = {}

    def state(run: str) -> str:
        if run not in states:
            states[run] = run_state(run).state
        return states[run]

    found, kept = [], []
    for kind in providers or tuple(PROVIDERS):
        cls = provider_class(kind)
        try:
            if label is not None:
                found += [f"{kind}: {what}" for what in cls.reap(label, dry_run=dry_run)]
            else:
                found += [f"{kind}: {what}" for what in cls.reap(select=lambda r: state(r) == "dead", dry_run=dry_run)]
                kept += [
                    f"{kind}: {what}: {state(what.run_label)} run, kept"
                    for what in cls.reap(select=lambda r: state(r) != "dead", dry_run=True)
                ]
        except HarnessError as exc:
            _fail(str(exc))
    verb = "would destroy" if dry_run else "destroyed"
    click.echo("\n".join(f"{verb} {f}" for f in found) if found else "nothing to reap")
    for k in kept:
        click.echo(k)
    if not dry_run:
        for run in {label} if label else {r for r, st in states.items() if st == "dead"}:
            forget(run)
    if strict and (found or [k for k in kept if ": live run" not in k]):
        _fail(f"{len(found) + len(kept)} leftover resource(s) carried a ppharness run label")


if __name__ == "__main__":
    main()
