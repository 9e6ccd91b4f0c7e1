"""``ppharness scenario``: the scenario schema, and checking files without running them."""

from __future__ import annotations

import json
import sys

import click

from ppharness.errors import HarnessError
from ppharness.scenario.schema import load_scenario, scenario_schema, scenario_warnings


@click.group()
def scenario() -> None:
    """Scenario files."""


@scenario.command("schema")
def scenario_schema_cmd() -> None:
    """Print the scenario JSON Schema (for editors: yaml-language-server's $schema)."""
    click.echo(json.dumps(scenario_schema(), indent=2))


@scenario.command("check")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
def scenario_check(files: tuple[str, ...]) -> None:
    """Validate scenario files without running them: every file is checked and every bad one reported; exit 1 if
    any is bad. A file that is valid but likely not meant (a lossy network without retries) is ok, with a warning."""
    bad = 0
    for f in files:
        try:
            checked = load_scenario(f)
        except HarnessError as exc:
            bad += 1
            click.echo(f"FAILED: {exc}", err=True)
            continue
        for warning in scenario_warnings(checked):
            click.echo(f"warning: {f}: {warning}", err=True)
        click.echo(f"ok: {f}")
    if bad:
        if len(files) > 1:
            click.echo(f"FAILED: {bad} of {len(files)} scenario files", err=True)
        sys.exit(1)
