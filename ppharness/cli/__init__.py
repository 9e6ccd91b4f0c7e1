"""Command line: ``pp-smoke-run`` (``ppharness.cli.smoke``) and ``ppharness {run, scenario, plan, model, split-check,
oracle, bench, reap, vastai-emulator}``, one module per group of commands.

Every command exits 0 on success and 1 with a one-line reason on any failure, after destroying whatever it started.
"""

from __future__ import annotations

import click

from ppharness.cli.bench import bench
from ppharness.cli.common import load_scenario_or_fail, run_and_report
from ppharness.cli.model import model, oracle, split_check
from ppharness.cli.ops import reap, vastai_emulator
from ppharness.cli.plan import plan
from ppharness.cli.scenario import scenario

__all__ = ["main"]


@click.group()
def main() -> None:
    """ppharness: pipeline-parallel inference harness."""


@click.command()
@click.argument("scenario_file", type=click.Path(dir_okay=False))
@click.option("--num-stages", "-n", type=int, help="Override the scenario's stage count.")
@click.option("--quiet", "-q", is_flag=True)
def run(scenario_file: str, num_stages: int | None, quiet: bool) -> None:
    """Run a scenario file."""
    run_and_report(load_scenario_or_fail(scenario_file, num_stages=num_stages), quiet=quiet)


for command in (run, scenario, plan, model, split_check, oracle, bench, vastai_emulator, reap):
    main.add_command(command)
