"""Model inputs within bounds: a model URL is downloaded within its expected size, a cap, a stall timeout and the
caller's deadline (against a real HTTP server on loopback serving an endless body, a trickle, a stall and a lying
size), and a synthetic model within absolute maxima and this machine's memory, refused at ``scenario check`` with its
``$.path`` and fix."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from ppharness.cli import main as cli
from ppharness.errors import ModelError, ScenarioError
from ppharness.model.sources.download import DEFAULT_MAX_BYTES, DownloadLimits, parse_size
from ppharness.model.sources.files import resolve_model
from ppharness.model.synthetic import spec as spec_module
from ppharness.model.synthetic.spec import ModelSpec, file_bytes, memory_needed, parse_synthetic, preset_spec
from ppharness.model.synthetic.writer import make_synthetic
from ppharness.scenario.schema import load_scenario
from tests.model_server import model_files


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("PPHARNESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PPHARNESS_DOWNLOAD_MAX", raising=False)
    monkeypatch.delenv("PPHARNESS_DOWNLOAD_STALL_S", raising=False)
    with model_files() as url:
        yield url


def within(seconds: float, fn: Callable[[], object]) -> BaseException | None:
    """Run ``fn`` in a thread; the exception it ended with (None: it returned). Fails the test if it is still running
    after ``seconds`` (a download that would go on for ever)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:  # handed to the test
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s"
    return outcome[0]


def refused_download(seconds: float, fn: Callable[[], object]) -> str:
    exc = within(seconds, fn)
    assert isinstance(exc, ModelError), f"expected ModelError, got {exc!r}"
    return str(exc)


def no_partial_files(tmp_path: Path) -> bool:
    downloads = tmp_path / "cache" / "downloads"
    return not downloads.exists() or not any(downloads.iterdir())


# --- downloads --------------------------------------------------------------------------------------------------------


def test_an_endless_body_stops_at_the_cap(server, tmp_path, monkeypatch):
    monkeypatch.setenv("PPHARNESS_DOWNLOAD_MAX", "1MiB")
    message = refused_download(10, lambda: resolve_model(f"{server}/endless"))
    assert "more than the download cap of 1,048,576 bytes with no size announced" in message
    assert "model.size" in message and "PPHARNESS_DOWNLOAD_MAX" in message  # the fixes
    assert no_partial_files(tmp_path)


def test_an_endless_body_stops_at_the_scenarios_size(server, tmp_path):
    message = refused_download(10, lambda: resolve_model(f"{server}/endless", size=100_000))
    assert "sent more than the 100,000 bytes it announced (or the scenario's model.size)" in message
    assert no_partial_files(tmp_path)


def test_a_trickle_ends_by_the_callers_deadline(server, tmp_path):
    t0 = time.monotonic()
    message = refused_download(10, lambda: resolve_model(f"{server}/trickle", deadline_s=1.5))
    assert time.monotonic() - t0 < 4.0, "a download went on well past the caller's deadline of 1.5 s"
    assert "the time allowed ran out" in message and "budget.total_s" in message
    assert no_partial_files(tmp_path)


def test_a_stalled_server_is_given_up_on(server, tmp_path, monkeypatch):
    monkeypatch.setenv("PPHARNESS_DOWNLOAD_STALL_S", "0.5")
    t0 = time.monotonic()
    message = refused_download(10, lambda: resolve_model(f"{server}/stall"))
    assert time.monotonic() - t0 < 3.0
    assert "no data for 0.5 s after 10 bytes" in message and "PPHARNESS_DOWNLOAD_STALL_S" in message
    assert no_partial_files(tmp_path)


def test_an_announced_size_above_the_cap_is_refused_before_any_byte(server, tmp_path):
    message = refused_download(10, lambda: resolve_model(f"{server}/huge"))
    assert f"1,099,511,627,776 bytes is above the download cap of {DEFAULT_MAX_BYTES:,} bytes" in message
    assert no_partial_files(tmp_path)


def test_an_announced_size_other_than_the_scenarios_is_refused(server, tmp_path):
    message = refused_download(10, lambda: resolve_model(f"{server}/small", size=999))
    assert "the server sends 1,000 bytes but the scenario's model.size is 999" in message
    assert no_partial_files(tmp_path)
    assert within(10, lambda: resolve_model(f"{server}/small", size=1000)) is None
    assert resolve_model(f"{server}/small").stat().st_size == 1000


def test_the_cap_and_the_stall_timeout_are_read_from_the_environment(monkeypatch):
    assert DownloadLimits.from_env() == DownloadLimits(max_bytes=64 << 30, stall_s=60.0)
    monkeypatch.setenv("PPHARNESS_DOWNLOAD_MAX", "200GiB")
    monkeypatch.setenv("PPHARNESS_DOWNLOAD_STALL_S", "5")
    assert DownloadLimits.from_env(size=7) == DownloadLimits(size=7, max_bytes=200 << 30, stall_s=5.0)
    assert (parse_size("500M", "x"), parse_size("1048576", "x"), parse_size("1.5k", "x")) == (500 << 20, 1 << 20, 1536)
    monkeypatch.setenv("PPHARNESS_DOWNLOAD_MAX", "lots")
    with pytest.raises(ModelError, match=r"\$PPHARNESS_DOWNLOAD_MAX: 'lots' is not a size — write bytes"):
        DownloadLimits.from_env()
    monkeypatch.setenv("PPHARNESS_DOWNLOAD_MAX", "1G")
    monkeypatch.setenv("PPHARNESS_DOWNLOAD_STALL_S", "-1")
    with pytest.raises(ModelError, match=r"\$PPHARNESS_DOWNLOAD_STALL_S: '-1' is not a number of seconds"):
        DownloadLimits.from_env()


def test_a_local_file_of_another_size_than_model_size_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"x" * 10)
    with pytest.raises(ModelError, match="is 10 bytes, not the 11 of model.size"):
        resolve_model(str(path), size=11)
    assert resolve_model(str(path), size=10) == path


# --- the scenario's model.size ----------------------------------------------------------------------------------------


def _scenario(tmp_path: Path, model: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(f"version: 1\nmodel:\n{model}\n", encoding="utf-8")
    return path


def scenario_error(path: Path) -> str:
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    return str(info.value)


def test_model_size_is_checked_against_a_local_file_and_applies_to_gguf_only(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 10)
    message = scenario_error(_scenario(tmp_path, f"  gguf: {model}\n  size: 11"))
    assert "$.model.size: " in message and "is 10 bytes, not 11 — fix model.size" in message
    message = scenario_error(_scenario(tmp_path, "  synthetic: {preset: tiny}\n  size: 10"))
    assert "$.model.size: size applies only to a gguf file — remove it or set gguf" in message
    url = load_scenario(_scenario(tmp_path, "  gguf: https://example.com/m.gguf\n  size: 123"))
    assert url.model.size == 123


# --- synthetic models -------------------------------------------------------------------------------------------------


def test_a_synthetic_model_beyond_the_maxima_is_refused_at_scenario_check(tmp_path):
    message = scenario_error(_scenario(tmp_path, "  synthetic: {blocks: 100000000, dim: 100000000}"))
    assert "$.model.synthetic.blocks: 100,000,000 is above the most a model file holds, 4,096 — lower it" in message
    message = scenario_error(_scenario(tmp_path, "  synthetic: {dim: 100000000}"))
    assert "$.model.synthetic.dim: 100,000,000 is above the most a model file holds, 262,144 — lower it" in message


def test_a_synthetic_model_beyond_this_machines_memory_is_refused_at_scenario_check(tmp_path, monkeypatch):
    t0 = time.monotonic()
    message = scenario_error(_scenario(tmp_path, "  synthetic: {blocks: 4000, dim: 65536}"))
    assert time.monotonic() - t0 < 5
    assert "$.model.synthetic.blocks: a synthetic model of 51,691,193,958,400 parameters" in message
    assert "GiB of memory and this machine has" in message and "lower blocks or dim, or use a smaller preset" in message
    monkeypatch.setattr(spec_module, "machine_memory", lambda: 1 << 30)  # a machine of 1 GiB
    message = scenario_error(_scenario(tmp_path, "  synthetic: {preset: llama-3.2-1b}"))
    assert "$.model.synthetic.preset: a synthetic model of 1,235,814,400 parameters" in message
    assert "this machine has 1.0 GiB" in message
    assert load_scenario(_scenario(tmp_path, "  synthetic: {preset: tiny}")).model.synthetic is not None


def test_a_simulation_only_preset_is_refused_at_scenario_check(tmp_path):
    message = scenario_error(_scenario(tmp_path, "  synthetic: {preset: kimi-k2}"))
    assert "$.model.synthetic.preset: kimi-k2 is for the simulator only" in message


def test_scenario_check_refuses_a_huge_synthetic_model_in_words(tmp_path):
    path = _scenario(tmp_path, "  synthetic: {blocks: 100000000, dim: 100000000}")
    result = CliRunner().invoke(cli, ["scenario", "check", str(path)])
    assert result.exit_code == 1
    assert "$.model.synthetic.blocks" in result.output and "lower it" in result.output


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("synthetic:tiny,blocks=100000000", "blocks = 100,000,000 is outside 1..4,096"),
        ("synthetic:tiny,dim=100000000", "dim = 100,000,000 is outside 1..262,144"),
        ("synthetic:tiny,heads=0", "heads = 0 is outside 1..4,096"),
        ("synthetic:tiny,vocab=2000000", "vocab = 2,000,000 is outside 1..1,048,576"),
        ("synthetic:tiny,context=0", "context = 0 is outside 1..16,777,216"),
        ("synthetic:tiny,norm_eps=0", "norm_eps = 0.0 must be above 0"),
        ("synthetic:tiny,rope_theta=inf", "rope_theta = inf is not a finite number"),
        ("synthetic:tiny,blocks=abc", "blocks='abc' is not an integer"),
    ],
)
def test_a_synthetic_source_beyond_the_maxima_is_refused(source, expected):
    with pytest.raises(ModelError) as info:
        parse_synthetic(source)
    assert expected in str(info.value)


def test_building_a_synthetic_model_beyond_this_machines_memory_is_refused_before_any_byte(tmp_path, monkeypatch):
    spec = preset_spec("small")
    monkeypatch.setattr(spec_module, "machine_memory", lambda: memory_needed(spec) - 1)
    with pytest.raises(ModelError, match=r"needs about [0-9.]+ GiB of memory and this machine has"):
        make_synthetic(spec, tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())
    result = CliRunner().invoke(cli, ["model", "make", "--blocks", "100000000", "-o", str(tmp_path / "m.gguf")])
    assert result.exit_code == 1 and "blocks = 100,000,000 is outside 1..4,096" in result.output


def test_memory_needed_is_the_weights_as_the_stages_hold_them_or_the_file_whichever_is_more():
    """Stages hold a packed file's matrices as it stores them, so its file is what a machine needs, not the float16
    expansion; a quantised deepseek2's attn_v_b, read whole by its block, is held as float16, more than the file."""
    f16, q4 = ModelSpec(), ModelSpec(type="q4_0", dim=64, ffn=192)
    assert memory_needed(f16) == file_bytes(f16) >= 2 * f16.n_params
    assert memory_needed(q4) == file_bytes(q4) < 2 * q4.n_params, "a q4_0 model needs its file, not float16"
    mla = replace(preset_spec("tiny-deepseek"), type="q8_0")
    # each of 4 blocks' attn_v_b (4 heads x 16 x 32): Q8_0 in the file, float16 on a stage; the norms, F32 in the
    # file, float16 there (each block's attention and KV norms, block 0's FFN norm, the final norm)
    v_b = 4 * (4 * 16 * 32 * 2 - 4 * 16 * 32 // 32 * 34)
    norms = 2 * (4 * (64 + 32) + 64 + 64)
    assert memory_needed(mla) == file_bytes(mla) + v_b - norms


def test_the_oracle_downloads_within_the_scenarios_size_and_budget(server, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(f"version: 1\nmodel:\n  gguf: {server}/trickle\nbudget:\n  total_s: 1.5\n", encoding="utf-8")
    t0 = time.monotonic()
    result = CliRunner().invoke(cli, ["oracle", "--scenario", str(path)])
    assert time.monotonic() - t0 < 5.0
    assert result.exit_code == 1 and "the time allowed ran out" in result.output
    path.write_text(f"version: 1\nmodel:\n  gguf: {server}/endless\n  size: 100000\n", encoding="utf-8")
    result = CliRunner().invoke(cli, ["oracle", "--scenario", str(path)])
    assert result.exit_code == 1 and "more than the 100,000 bytes it announced" in result.output
