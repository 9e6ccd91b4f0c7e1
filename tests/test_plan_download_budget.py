"""A model URL in a plan is downloaded within ``--download-time-limit``: every ``ppharness plan`` command that may
fetch the model ends, against a real HTTP server on loopback that trickles a byte every 0.2 s (under the stall
timeout), with exit 1 and one line naming the URL, the bytes that arrived and the flag."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ppharness.cli import main as cli
from ppharness.cli.plan import DOWNLOAD_SECONDS, plan
from tests.model_server import model_files

BOUND_S = 15.0


@pytest.fixture
def url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("PPHARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PPHARNESS_DOWNLOAD_STALL_S", raising=False)
    with model_files() as base:
        yield f"{base}/trickle"


@pytest.mark.timeout(BOUND_S)
@pytest.mark.parametrize(
    "command",
    [
        "check {plan}",
        "show {plan}",
        "simulate {plan}",
        "text {plan}",
        "check --model {url} {small}",
        "make --model {url} --cluster {cluster}",
        "probe --model {url}",
    ],
)
def test_a_trickled_model_url_ends_by_the_download_time_limit(url: str, tmp_path: Path, command: str) -> None:
    nodes = "cluster: local\ncpu-a: embed, blk[0:2]\ncpu-b: blk[2:4], head\n"
    (tmp_path / "url.txt").write_text(f"model: {url}\n{nodes}")
    (tmp_path / "small.txt").write_text(f"model: small\n{nodes}")
    (tmp_path / "c.yaml").write_text("devices:\n  - {id: a, memory: 8GiB, gflops: 1}\n")
    where = {"plan": tmp_path / "url.txt", "small": tmp_path / "small.txt", "cluster": tmp_path / "c.yaml", "url": url}
    args = ["plan", *command.format(**where).split(), "--download-time-limit", "1"]
    t0 = time.monotonic()
    result = CliRunner().invoke(cli, args)
    assert time.monotonic() - t0 < 5.0, "a download went on well past --download-time-limit 1"
    failed = [line for line in result.stderr.splitlines() if line.startswith("FAILED")]
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert len(failed) == 1 and "Traceback" not in result.output, result.stderr
    assert f"downloading {url}: the time allowed ran out after " in failed[0]
    assert "raise --download-time-limit (now 1 s)" in failed[0] and "budget.total_s" not in failed[0]
    assert not any((tmp_path / "cache" / "downloads").glob("*.part"))


def test_every_plan_command_that_may_download_has_a_finite_default_limit() -> None:
    assert 0 < DOWNLOAD_SECONDS < float("inf")
    for name in ("check", "show", "simulate", "text", "make", "probe"):
        option = next(p for p in plan.commands[name].params if p.name == "download_time_limit")
        assert isinstance(option, click.Option) and option.default == DOWNLOAD_SECONDS, name
