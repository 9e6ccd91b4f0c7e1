"""``pp-smoke-run``: the N-stage chain once, checked against the unsplit model. ``python -m ppharness.cli.smoke`` is the
same command (for environments where the console script is not on PATH)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click
import msgspec

from ppharness.cli.common import SCENARIO_HELP, fail, load_scenario_or_fail, run_and_report, version_option
from ppharness.errors import HarnessError
from ppharness.model.gguf.header import read_gguf
from ppharness.model.sources.files import cache_dir, resolve_model
from ppharness.model.text.chat import chat_prompt
from ppharness.model.verdict import refuse_unloadable
from ppharness.plan.predict.simulate import compare, simulate
from ppharness.plan.reader import load_plan
from ppharness.plan.validation import jsonl_path, read_trace
from ppharness.run.seed.realise import model_source as source_of
from ppharness.scenario.schema import Scenario, scenario_from_args


@click.command(name="pp-smoke-run")
@version_option("pp-smoke-run")
@click.option("--num-stages", "-n", type=int, help="Number of pipeline stages (default: the scenario's, else 2).")
@click.option("--scenario", "scenario_file", type=click.Path(dir_okay=False), help=SCENARIO_HELP)
@click.option(
    "--plan",
    "plan_file",
    type=click.Path(dir_okay=False),
    help="Run a plan file (JSON or YAML, e.g. from `ppharness plan make`): the model, devices and placement "
    "come from it.",
)
@click.option(
    "--model",
    "model_source",
    metavar="SOURCE",
    help="The model to run: a GGUF path, an http(s) URL, or synthetic:PRESET[,blocks=N,...] (in place of the "
    "scenario's model section).",
)
@click.option("--chat", is_flag=True, help="Put the prompt in the model file's own chat template (a user turn).")
@click.option("--no-oracle", is_flag=True, help="Do not run the unsplit model to compare the answer with.")
@click.option(
    "--max-context",
    type=click.IntRange(16),
    help="KV cache positions every stage allocates (default: the scenario's, else 256; with --model, enough for "
    "the prompt and --max-tokens).",
)
@click.option(
    "--colocated",
    is_flag=True,
    help="Every stage on one device, driven by one process: the hidden state is handed over in the process "
    "(stages.placement: colocated).",
)
@click.option(
    "--speculate",
    metavar="DRAFT[:K]",
    help="Decode by speculative windows the chain verifies, several tokens per trip, every answer still the greedy "
    "one: ngram[:K] (prompt lookup), layers:N[:K] (the model's first N blocks on stage 0) or model:SOURCE[:K] (a "
    "small GGUF with the same vocabulary); K drafted tokens per window (serving.speculate; batched with it).",
)
@click.option(
    "--windows",
    type=click.IntRange(1, 8),
    help="Speculative windows a request keeps in flight (serving.windows, default 1).",
)
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
    help="Write the per-token trace: FILE (Perfetto/Chrome JSON) and FILE's .jsonl (one line per token). With "
    "--plan the default is traces/<plan>-<time>.json under the cache directory ($PPHARNESS_CACHE, else "
    "~/.cache/ppharness).",
)
@click.option("--no-trace", is_flag=True, help="Record no timings (no per-token summary).")
@click.option(
    "--json",
    "json_out",
    is_flag=True,
    help="Print the run as one JSON document on stdout (keys: docs/scenarios.md, Machine-readable output); the "
    "human summary goes to stderr.",
)
@click.option(
    "--vastai",
    is_flag=True,
    help="Rent one vast.ai instance per stage (default scenario: the acceptance "
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
    plan_file: str | None,
    model_source: str | None,
    chat: bool,
    no_oracle: bool,
    max_context: int | None,
    colocated: bool,
    speculate: str | None,
    windows: int | None,
    transport: str | None,
    provider: str | None,
    prompt: str | None,
    max_tokens: int | None,
    quiet: bool,
    run_label: str | None,
    trace_path: str | None,
    no_trace: bool,
    json_out: bool,
    vastai: bool,
    api_key: str | None,
    vastai_url: str | None,
) -> None:
    """Run the N-stage chain once, print its text, and check it against the unsplit model."""
    if vastai:
        provider, scenario_file = _use_vastai(provider, scenario_file, api_key, vastai_url)
    elif api_key or vastai_url:
        fail("--api-key and --vastai-url apply only with --vastai")
    if plan_file is not None and trace_path is None and not no_trace:
        trace_path = str(_default_trace(plan_file))
    if model_source is not None and plan_file is not None:
        fail("--model and --plan both name the model — the plan's is the one it was made for; leave out --model")
    if model_source is not None:
        try:
            refuse_unloadable(model_source)  # a path with no file, or a file this engine cannot run: nothing starts
        except HarnessError as exc:
            fail(f"--model: {exc}")
    scenario = load_scenario_or_fail(
        scenario_file,
        num_stages=num_stages,
        transport=transport,
        provider=provider,
        prompt=prompt,
        max_tokens=max_tokens,
        plan=plan_file,
        model=model_source,
        max_context=max_context,
        match_oracle=False if no_oracle else None,
        colocated=True if colocated else None,
        speculate=speculate,
        windows=windows,
    )
    if chat:
        scenario = chat_or_fail(scenario)
    if model_source is not None and max_context is None:
        scenario = _room_for_answer(scenario)
    started = time.time()
    run_and_report(
        scenario,
        quiet=quiet,
        run_label=run_label,
        trace_path=trace_path,
        trace=False if no_trace else None,
        json_out=json_out,
    )
    if scenario.plan is not None:
        print_prediction(scenario.plan, trace_path or scenario.trace.path, started, err=json_out)


# ``ppharness run FILE`` is ``pp-smoke-run --scenario FILE``: the same command, every option of it
run = click.Command(
    "run",
    params=[
        click.Argument(["scenario_file"], type=click.Path(dir_okay=False)),
        *(p for p in smoke_run.params if p.name not in ("scenario_file", "version")),
    ],
    callback=smoke_run.callback,
    help="Run a scenario file: pp-smoke-run --scenario FILE, with every option of pp-smoke-run.",
)


def print_prediction(plan_file: str, trace_path: str | None, started: float, err: bool = False) -> None:
    """A plan run's prediction (``ppharness plan simulate``'s rows) beside what this run's trace measured, row for
    row, with the error; said plainly when the run left no trace to hold it against."""
    jsonl = jsonl_path(trace_path) if trace_path else None
    if jsonl is None or not jsonl.is_file() or jsonl.stat().st_mtime < started:
        click.echo(
            "\nthe plan's prediction is not compared with this run: it wrote no trace file (--no-trace, a scenario "
            "tracing without a path, or a stage replaced mid-run)",
            err=err,
        )
        return
    prediction = simulate(load_plan(plan_file))
    click.echo("\npredicted (ppharness plan simulate) against measured (this run's trace):", err=err)
    click.echo(compare(prediction, read_trace(jsonl, "of this run"), first_token=False), err=err)


def _default_trace(plan_file: str) -> Path:
    """Where a plan run's trace goes unless --trace says: the cache directory's traces/, named after the plan and
    the time (a plan run always leaves its per-token trace behind, outside the working tree)."""
    return cache_dir() / "traces" / f"{Path(plan_file).stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def chat_or_fail(scenario: Scenario) -> Scenario:
    """``scenario`` with its prompt as a user turn in the chat template of the model it runs (``--chat``)."""
    try:
        where, sha256 = source_of(scenario)
        path = resolve_model(where, sha256, size=scenario.model.size, deadline_s=scenario.budget.total_s)
        text = chat_prompt(read_gguf(path).kv, scenario.request.prompt, source=str(path))
        return scenario_from_args(base=scenario, prompt=text)
    except HarnessError as exc:
        fail(f"--chat: {exc}")


def _room_for_answer(scenario: Scenario) -> Scenario:
    """``scenario`` with a KV cache long enough for its prompt and answer: a prompt has at most one token per byte,
    and a BOS (``--model`` without ``--max-context``)."""
    needed = len(scenario.request.prompt.encode()) + scenario.request.max_tokens + 2
    if needed <= scenario.model.max_context:
        return scenario
    section = msgspec.structs.replace(scenario.model, max_context=-(-needed // 64) * 64)
    return msgspec.structs.replace(scenario, model=section)


# the acceptance request on vast.ai (llama3.2:1b, "Say hello", 64 tokens): what --vastai runs by default


VASTAI_ACCEPTANCE = "acceptance-5stage-vastai-llama3.2-1b.yaml"


def _use_vastai(
    provider: str | None, scenario_file: str | None, api_key: str | None, vastai_url: str | None
) -> tuple[str, str]:
    """``--vastai``: the provider and scenario it implies; the key and URL go where the provider (and the reaper)
    read them, the environment of this process only (never an argument of any process it starts)."""

    if provider not in (None, "vastai"):
        fail(f"--vastai and --provider {provider} contradict each other")
    if api_key is not None:
        os.environ["VAST_API_KEY"] = api_key
    if vastai_url is not None:
        os.environ["VAST_URL"] = vastai_url
    if not os.environ.get("VAST_API_KEY", "").strip():
        fail("--vastai needs a vast.ai API key: --api-key KEY or VAST_API_KEY")
    default = Path(__file__).resolve().parents[2] / "scenarios" / "templates" / VASTAI_ACCEPTANCE
    return "vastai", scenario_file or str(default)


if __name__ == "__main__":
    smoke_run()
