"""``ppharness reap`` (leftovers of crashed runs) and ``ppharness vastai-emulator``."""

from __future__ import annotations

import os

import click

from ppharness.cli.common import fail
from ppharness.errors import HarnessError
from ppharness.registry import PROVIDERS, provider_class, tool
from ppharness.run.seed.locks import forget, run_state


@click.command("vastai-emulator")
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
    try:
        d = tuple(float(x) for x in delays.split(","))
        if len(d) != 3:
            raise ValueError
    except ValueError:
        fail(f"--delays {delays!r}: expected three numbers, e.g. 1,2,5")
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
        fail(str(exc))


@click.command()
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
    if label is not None:
        info = run_state(label)
        if info.state == "live":
            fail(f"run {label} is live (orchestrator pid {info.pid}); it is not reaped")
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
            else:  # one listing per provider (and one message from it, e.g. a missing key), then the dead runs' go
                listed = cls.reap(dry_run=True)
                dead = [what for what in listed if state(what.run_label) == "dead"]
                if dead and not dry_run:
                    dead = cls.reap(select=lambda r: state(r) == "dead")
                found += [f"{kind}: {what}" for what in dead]
                kept += [
                    f"{kind}: {what}: {state(what.run_label)} run, kept"
                    for what in listed
                    if state(what.run_label) != "dead"
                ]
        except HarnessError as exc:
            fail(str(exc))
    verb = "would destroy" if dry_run else "destroyed"
    click.echo("\n".join(f"{verb} {f}" for f in found) if found else "nothing to reap")
    for k in kept:
        click.echo(k)
    if not dry_run:
        for run in {label} if label else {r for r, st in states.items() if st == "dead"}:
            forget(run)
    if strict and (found or [k for k in kept if ": live run" not in k]):
        fail(f"{len(found) + len(kept)} leftover resource(s) carried a ppharness run label")
