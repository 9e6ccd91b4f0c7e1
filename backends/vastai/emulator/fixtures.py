"""The ``vastai_api`` fixture of the ``ppharness`` pytest plugin (``ppharness/testing/plugin.py`` loads this module
by name through ``pytest_plugins``: the core names no implementation in an import)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.vastai.emulator.server import ApiTarget, Emulator

VASTAI_URL = "https://console.vast.ai"


@pytest.fixture
def vastai_api(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[ApiTarget]:
    """The vast.ai API a ``vastai`` test talks to, exported as VAST_URL, VAST_API_KEY and PPHARNESS_VASTAI_PACE: a
    fresh emulator (quick timeline, scaled rate limits; stopped afterwards, destroying what it holds) by default,
    the real service with --vastai-real (skipped, with the reason, without VAST_API_KEY)."""
    if request.config.getoption("--vastai-real"):
        key = os.environ.get("VAST_API_KEY", "").strip()
        if not key:
            pytest.skip("vastai: --vastai-real needs a vast.ai API key in VAST_API_KEY")
        yield ApiTarget(os.environ.get("VAST_URL") or VASTAI_URL, key)
        return
    with Emulator.for_ci(tmp_path / "vastai-emulator") as emu:
        target = ApiTarget.of(emu)
        for name, value in target.env().items():
            monkeypatch.setenv(name, value)
        yield target
