"""``ppharness model``, ``split-check`` and ``oracle``: synthetic models, their facts, and the unsplit model's
answer."""

from __future__ import annotations

import json
from typing import Any

import click

from ppharness.cli.common import SCENARIO_HELP, ending, exit_1_on_failure, fail, load_scenario_or_fail, split_csv
from ppharness.errors import HarnessError
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.decode.tuning import tune as tune_model
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.layers.kernels import ENV
from ppharness.model.sources.files import resolve_model, sha256_file
from ppharness.model.synthetic.spec import preset_spec
from ppharness.model.synthetic.writer import make_synthetic
from ppharness.model.verdict import LoadVerdict, judge_file, refuse_unloadable
from ppharness.plan.stages import make_plan
from ppharness.run.inprocess import check_splits
from ppharness.run.seed.realise import model_source


@click.group()
def model() -> None:
    """Model files."""


@model.command("make")
@click.option(
    "--preset",
    default="tiny",
    show_default=True,
    help="Dimensions preset (tiny, tiny-llama3, small, llama-3.2-1b, ...).",
)
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
    "--rope-scaling",
    type=click.Choice(["llama3"]),
    help="Write Llama-3's rope frequency factors (rope_freqs.weight), as llama.cpp's converter does for Llama 3.x.",
)
@click.option("--rope-scaling-factor", type=float, help="With --rope-scaling: the low frequencies' factor [32].")
@click.option("--rope-original-context", type=int, help="With --rope-scaling: the original context length [8192].")
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
    try:
        spec = preset_spec(preset, **overrides)
        click.echo(
            f"writing {spec.n_params:,} parameters ({spec.blocks} blocks, dim {spec.dim}, {spec.type}) to {output}",
            err=True,
        )
        path = make_synthetic(spec, output)
    except HarnessError as exc:
        fail(str(exc))
    click.echo(f"{path}  sha256 {sha256_file(path)}")


@model.command("info")
@click.argument("source")
@click.option(
    "--json", "json_out", is_flag=True, help="The same facts as one JSON document (format ppharness-model/2)."
)
def model_info(source: str, json_out: bool) -> None:
    """Show what a GGUF (path, URL or synthetic:...) is and whether it loads here, from its header alone: its
    architecture, parameter count and dimensions, tensor types, tokenizer, vocabulary and chat template.

    Exit status: 0 when the file loads here; 1 when it does not (after its facts, with the reasons) and when SOURCE
    is not a readable GGUF file."""
    try:
        verdict = judge_file(resolve_model(source))
    except HarnessError as exc:
        fail(str(exc))
    if json_out:
        click.echo(json.dumps(info_json(verdict), indent=1))
    else:
        rows = info_rows(verdict)
        width = max(map(len, rows))
        for k, text in rows.items():
            click.echo(f"{k:>{width}}: {text}")
    if not verdict.loads:
        fail(verdict.refusal())


MODEL_FORMAT = "ppharness-model/2"
# how ``model info`` names a dimension where its key would not read as words
LABELS = {"tied": "tied embeddings", "norm_eps": "norm epsilon", "moe_blocks": "moe blocks"}


def info_json(v: LoadVerdict) -> dict[str, Any]:
    """``model info --json``: stable keys, documented in docs/models.md ("Will my file load?")."""
    return {
        "format": MODEL_FORMAT,
        "path": v.path,
        "file_bytes": v.file_bytes,
        "arch": v.arch,
        "parameters": v.parameters,
        **v.fields,
        "tensor_types": v.tensor_types,
        "tokenizer": v.tokenizer,
        "tokenizer_pre": v.tokenizer_pre,
        "chat_template": v.chat_template,
        "loads": v.loads,
        "reasons": v.reasons,
    }


def info_rows(v: LoadVerdict) -> dict[str, str]:
    """``model info``'s lines: what each is called -> its value in words."""
    size = f"{v.file_bytes / 2**30:.2f} GiB" if v.file_bytes >= 2**30 else f"{v.file_bytes / 2**20:.1f} MiB"
    rows = {"file": f"{v.path} ({size}, {v.file_bytes:,} bytes)", "architecture": v.arch}
    rows["parameters"] = f"{v.parameters:,}"
    for key, value in v.fields.items():
        if key != "vocab":  # shown with the tokenizer
            rows[LABELS.get(key, key.replace("_", " "))] = spans(value) if key == "moe_blocks" else shown(value)
    rows["tensor types"] = ", ".join(f"{name} × {n:,}" for name, n in v.tensor_types.items()) or "none"
    pre = f", pre-type {v.tokenizer_pre}" if v.tokenizer_pre else ""
    rows["tokenizer"] = f"{v.tokenizer}{pre}" if v.tokenizer else "none"
    rows["vocabulary"] = f"{v.vocab:,} tokens" if v.vocab is not None else "none"
    rows["chat template"] = shown(v.chat_template)
    rows["loads here"] = "yes" if v.loads else f"no ({'; '.join(v.reasons)})"
    return rows


def spans(values: list[int]) -> str:
    """Block numbers as runs: ``0-3, 5``."""
    runs: list[list[int]] = []
    for n in values:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{lo}-{hi}" if hi > lo else str(lo) for lo, hi in runs) or "none"


def shown(value: object) -> str:
    """A configuration value in words, not as a Python repr: a set or sequence as its items (``none`` when empty, its
    length when long), a flag as yes/no, a float in its shortest form."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (set, frozenset, tuple, list)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else list(value)
        if not items:
            return "none"
        if len(items) > 16:
            return f"{len(items)} values: {', '.join(shown(v) for v in items[:4])}, ..."
        return ", ".join(shown(v) for v in items)
    return str(value)


def loadable(source: str) -> str:
    """``source`` as a local path, refused (``ModelError``) before anything is built or compiled when the file does
    not load here: a local file before it is used, a download once it is in the cache; a synthetic model always
    loads."""
    refuse_unloadable(source)
    path = resolve_model(source)
    if "://" in source:
        judge_file(path).refuse()
    return str(path)


@click.command("split-check")
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
    with exit_1_on_failure():
        path = loadable(source)
        blocks = GGUFFile(path).config.blocks
        splits = []
        for item in split_csv(stages):
            try:  # a stage count ("3") or cut points ("1/3/6")
                plan = (
                    make_plan(blocks, num_stages=int(item))
                    if item.isdigit()
                    else make_plan(blocks, splits=[int(c) for c in item.split("/")])
                )
            except ValueError:
                fail(f"--stages: {item!r} is neither a stage count nor cut points like 1/3/6")
            splits.append(list(plan.ranges))
        if max_tokens >= max_context:
            fail(f"--max-tokens {max_tokens} does not fit --max-context {max_context}")
        oracle_result, checks = check_splits(path, prompt, max_tokens, splits, max_context)
    click.echo(
        f"unsplit model: {len(oracle_result.token_ids)} tokens "
        f"({ending(oracle_result.finish_reason, oracle_result.stop_token_id, oracle_result.stop_token)}), "
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
        fail("a split differs from the unsplit model")


@click.command()
@click.option(
    "--model", "source", default="synthetic:tiny", show_default=True, help="A GGUF path, URL or synthetic: spec."
)
@click.option(
    "--out",
    default="kernels.json",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="The kernel table to write (kernels of other models already in it are kept).",
)
@click.option("--beam", type=click.IntRange(1, 32), default=2, show_default=True, help="The search's beam width.")
@click.option(
    "--prompt",
    "prompts",
    multiple=True,
    default=["The quick brown fox"],
    show_default=True,
    help="Prompts whose lengths' prefill kernels are searched too (repeat for several).",
)
@click.option("--max-context", type=int, default=256, show_default=True)
def tune(source: str, out: str, beam: int, prompts: tuple[str, ...], max_context: int) -> None:
    """Search the kernels of a model on this machine's device (DEV=CUDA for a GPU) once and write the choices to a
    kernel table. Every process started with PPHARNESS_KERNELS=FILE (stages, the oracle, benchmarks) then compiles the
    same kernels, so splits stay exact with searched kernels. Prefill kernels of prompt lengths not tuned, and any
    kernel missing from the table, compile with tinygrad's heuristic in every process alike."""
    import time

    t0 = time.monotonic()

    def progress(n: int, seconds: float) -> None:
        click.echo(f"[{time.monotonic() - t0:7.1f}s] searched {n} kernel(s), the last in {seconds:.1f} s", err=True)

    with exit_1_on_failure(interrupted=f"interrupted; the kernels searched so far are in {out}"):
        path = loadable(source)
        pinning = tune_model(path, out, beam, prompts, max_context=max_context, on_search=progress)
    click.echo(f"{pinning.summary()} in {time.monotonic() - t0:.1f} s")
    click.echo(f"use it: {ENV}={out} pp-smoke-run ... (every process of a run must read the same table)")


@click.command()
@click.option("--scenario", "scenario_file", type=click.Path(dir_okay=False), help=SCENARIO_HELP)
@click.option(
    "--model", "source", metavar="SOURCE", help="A GGUF path, URL or synthetic: spec (in place of the scenario's)."
)
@click.option("--prompt")
@click.option("--max-tokens", type=int)
def oracle(scenario_file: str | None, source: str | None, prompt: str | None, max_tokens: int | None) -> None:
    """Greedy decode with the unsplit model in this process: the reference every split must equal."""
    try:
        if source is not None:
            refuse_unloadable(source)
    except HarnessError as exc:
        fail(str(exc))
    sc = load_scenario_or_fail(scenario_file, prompt=prompt, max_tokens=max_tokens, model=source)
    try:
        where, sha256 = model_source(sc)  # a download bounded by the scenario's model.size and its budget
        path = resolve_model(where, sha256, size=sc.model.size, deadline_s=sc.budget.total_s)
        judge_file(path).refuse()
        res = oracle_decode(path, sc.request.prompt, sc.request.max_tokens, sc.model.max_context)
    except HarnessError as exc:
        fail(str(exc))
    click.echo(
        f"text: {res.text!r}\ntokens ({ending(res.finish_reason, res.stop_token_id, res.stop_token)}): "
        f"{res.token_ids}\nloaded and compiled in {res.load_s:.1f} s, first token "
        f"{res.ttft_s * 1000:.0f} ms, decode {res.decode_tok_s:.1f} tok/s, {res.n_params:,} parameters"
    )
