"""pytest hooks and fixtures for ppharness: markers, --num-stages, --scenario, hypothesis profiles, skip-with-reason.

Decisions (which backends can run here) live in ``ppharness.availability``; this file only acts on them.
"""

from __future__ import annotations

import os

import pytest
import tinygrad  # noqa: F401  (raises the recursion limit on import: do it before hypothesis watches it)
from hypothesis import HealthCheck, settings

MARKERS = {
    "local": "chain on local pp-node processes over real sockets: pytest -m local --num-stages 5",
    "docker": "needs a Docker daemon (one container per stage): pytest -m docker --num-stages 5",
    "vastai": "vast.ai provider (emulator by default, real cloud with --vastai-real): pytest -m vastai --num-stages 5",
    "gpu": "needs a GPU that tinygrad can use: pytest -m gpu",
    "slow": "takes minutes; run deliberately: pytest -m slow",
}

# Property-test budgets; pick one with HYPOTHESIS_PROFILE (CI defaults to "ci"). tests/README.md lists them.
settings.register_profile("dev", max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=True, print_blob=True)
settings.register_profile("thorough", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ppharness")
    group.addoption("--num-stages", type=int, default=None,
                    help="stage count for chain tests (default: each chain test's own choices, e.g. 2 and 5)")
    group.addoption("--scenario", default=None, help="also run this scenario file in tests that take one")
    group.addoption("--vastai-real", action="store_true", default=False,
                    help="run the vastai tests against the real vast.ai (needs VAST_API_KEY; rents GPUs and costs "
                         "money) instead of the local emulator")


def pytest_configure(config: pytest.Config) -> None:
    for name, usage in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {usage}")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "num_stages" in metafunc.fixturenames:
        chosen = metafunc.config.getoption("--num-stages")
        default = getattr(metafunc.function, "default_num_stages", (2, 5))
        values = [chosen] if chosen else list(default)
        metafunc.parametrize("num_stages", values, ids=[f"N{n}" for n in values])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    from ppharness.availability import must_fail, unavailable_reason

    for marker in ("docker", "vastai", "gpu"):
        if item.get_closest_marker(marker):
            reason = unavailable_reason(marker)
            if reason and must_fail(marker):
                pytest.fail(f"{marker}: {reason} (CI=true: in CI a missing {marker} backend fails)", pytrace=False)
            if reason:
                pytest.skip(f"{marker}: {reason}")


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The synthetic tiny model (8 blocks), built once into the ppharness cache."""
    from ppharness.modelfile import PRESETS, synthetic_path

    return str(synthetic_path(PRESETS["tiny"]))


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model_path: str):
    from ppharness.slicing import GGUFFile

    return GGUFFile(tiny_model_path)


@pytest.fixture
def vastai_api(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path):
    """The vast.ai API a ``vastai`` test talks to, exported as VAST_URL, VAST_API_KEY and PPHARNESS_VASTAI_PACE: a
    fresh emulator (quick timeline, scaled rate limits; stopped afterwards, destroying what it holds) by default,
    the real service with --vastai-real (skipped, with the reason, without VAST_API_KEY)."""
    import os

    from backends.vastai_emulator import ApiTarget, Emulator
    from ppharness.availability import vastai_reason

    if request.config.getoption("--vastai-real"):
        reason = vastai_reason(real=True)
        if reason:
            pytest.skip(f"vastai: {reason}")
        yield ApiTarget(os.environ.get("VAST_URL") or "https://console.vast.ai", os.environ["VAST_API_KEY"])
        return
    with Emulator.for_ci(tmp_path / "vastai-emulator") as emu:
        target = ApiTarget.of(emu)
        for name, value in target.env().items():
            monkeypatch.setenv(name, value)
        yield target


@pytest.fixture
def scenario_option(request: pytest.FixtureRequest) -> str | None:
    return request.config.getoption("--scenario")
