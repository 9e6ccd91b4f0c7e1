"""``ppharness bench spec``: greedy against speculative decoding on one chain (``ppharness.benchmarks.spec``)."""

from __future__ import annotations

import click

from ppharness.benchmarks import spec as spec_bench
from ppharness.cli.common import exit_1_on_failure
from ppharness.model.sources.known import KNOWN, fetch_known


@click.command("spec")
@click.option(
    "--model",
    "source",
    default="smollm2-135m-instruct",
    show_default=True,
    help="A GGUF path, URL, synthetic:PRESET, or a known model's name (`ppharness model fetch`).",
)
@click.option("--num-stages", "-n", type=int, default=5, show_default=True)
@click.option("--delay-ms", type=float, default=25.0, show_default=True, help="One-way delay of every stage link.")
@click.option("--draft", default="ngram:8", show_default=True, help="The draft, DRAFT[:K] (pp-smoke-run --speculate).")
@click.option("--windows", type=click.IntRange(1, 8), default=1, show_default=True, help="Windows in flight.")
@click.option("--prompt", default=spec_bench.PROMPT, show_default=True)
@click.option("--tokens", type=int, default=96, show_default=True, help="Tokens generated per request.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Greedy and speculative requests each.")
@click.option("--transport", default="zmq", show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the figures here.")
def bench_spec(
    source: str,
    num_stages: int,
    delay_ms: float,
    draft: str,
    windows: int,
    prompt: str,
    tokens: int,
    repeats: int,
    transport: str,
    json_out: str | None,
) -> None:
    """Greedy against speculative decoding on one chain over emulated WAN links: the speed-up, tokens per trip,
    the efficiency, and the prediction beside the measurement (docs/speculative-decoding.md)."""
    with exit_1_on_failure():
        if source in KNOWN:  # a known model's name: fetched once into the model cache
            source = str(fetch_known(source))
        res = spec_bench.run_spec_bench(
            source, num_stages, delay_ms, draft, prompt, tokens, repeats, windows, transport,
            progress=lambda line: click.echo(line, err=True),
        )  # fmt: skip
        click.echo(spec_bench.report(res))
        if json_out:
            spec_bench.write_json(res, json_out)
