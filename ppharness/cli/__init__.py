"""Command line: ``pp-smoke-run`` (``ppharness.cli.smoke``) and ``ppharness {run, scenario, plan, model, split-check,
oracle, bench, reap, vastai-emulator}``, one module per group of commands.

Every command exits 0 on success and 1 with a one-line reason on any failure, after destroying whatever it started;
an interrupt exits 128 + the signal (130 for Ctrl-C). ``ppharness --version`` and ``pp-smoke-run --version`` print the
package's version, tinygrad's and, from a git checkout, the commit.
"""

from __future__ import annotations

import importlib

import click

from ppharness.cli.common import version_option
from ppharness.cli.fetch import model_fetch
from ppharness.cli.model import model, oracle, split_check, tune
from ppharness.cli.ops import reap, vastai_emulator
from ppharness.cli.plan import plan
from ppharness.cli.scenario import scenario

__all__ = ["main"]


class LazyGroup(click.Group):
    """A command group whose heavier subcommands (``lazy``: name -> "module:attribute") are imported only when they
    are run or listed, so that every other command starts without them."""

    def __init__(self, *args: object, lazy: dict[str, str], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lazy = lazy

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy:
            module, attribute = self.lazy[name].split(":")
            command: click.Command = getattr(importlib.import_module(module), attribute)
            return command
        return super().get_command(ctx, name)


# ppharness bench imports every benchmark (the chain, the orchestrator, the transports' raw libraries); ppharness run is
# pp-smoke-run's command, taken from its module when asked (imported here, `python -m ppharness.cli.smoke` would warn)
@click.group(cls=LazyGroup, lazy={"bench": "ppharness.cli.bench:bench", "run": "ppharness.cli.smoke:run"})
@version_option("ppharness")
def main() -> None:
    """ppharness: pipeline-parallel inference harness."""


for command in (scenario, plan, model, split_check, tune, oracle, vastai_emulator, reap):
    main.add_command(command)
model.add_command(model_fetch)
