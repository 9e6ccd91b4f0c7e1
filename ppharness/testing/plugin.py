"""The ``ppharness`` pytest plugin: markers, options and fixtures for tests of pipeline-parallel chains.

Installed as the ``pytest11`` entry point ``ppharness``, so pytest loads it in any directory where ppharness is
installed, before it parses the command line (``--scenario PATH`` works with a path outside the rootdir in both
forms; ``-p no:ppharness`` turns it off). It gives

- the markers ``local``, ``docker``, ``vastai``, ``gpu`` and ``slow``;
- ``--num-stages N`` (a test taking ``num_stages`` runs with N stages; without it, with the test's own
  ``default_num_stages``, 2 and 5 by default, a count of 5 or more marked ``slow``), ``--scenario PATH`` (the
  ``scenario_option`` and ``scenario`` fixtures), ``--vastai-real`` (the ``vastai_api`` fixture talks to the real
  vast.ai instead of a fresh emulator) and ``--slow``;
- slow tests left out unless the ``-m`` expression names ``slow`` (``-m 'local and slow'``, ``-m slow``) or ``--slow``
  is given; the header says so;
- ``tiny_model_path`` and ``tiny_gguf``: the synthetic tiny model, built once into the ppharness cache;
- ``vastai_api``: the vast.ai API a test talks to (``backends/vastai/emulator/fixtures.py``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

from ppharness.registry import TEST_FIXTURES

if TYPE_CHECKING:
    from ppharness.model.gguf_file import GGUFFile
    from ppharness.scenario.schema import Scenario

MARKERS = {
    "local": "chain on local pp-node processes over real sockets: pytest -m local --num-stages 5",
    "docker": "needs a Docker daemon (one container per stage): pytest -m docker --num-stages 5",
    "vastai": "vast.ai provider (emulator by default, real cloud with --vastai-real): pytest -m vastai --num-stages 5",
    "gpu": "needs a GPU that tinygrad can use: pytest -m gpu",
    "slow": "left out unless -m names slow (pytest -m slow, pytest -m 'local and slow') or --slow is given "
    "(5-stage chains, benchmarks, runs that wait out a failure)",
}
SLOW_STAGES = 5  # chain tests with this many stages or more are marked slow unless --num-stages asks for them
DEFAULT_NUM_STAGES = (2, 5)  # a test's num_stages without --num-stages (a test's default_num_stages overrides it)
# fixtures that live with an implementation (the vastai_api fixture with the emulator), found through the registry
pytest_plugins = list(TEST_FIXTURES.values())


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ppharness")
    group.addoption(
        "--num-stages",
        type=int,
        default=None,
        help="stage count for chain tests (default: each chain test's own choices, e.g. 2 and 5)",
    )
    group.addoption(
        "--scenario", default=None, metavar="PATH", help="also run this scenario file in tests that take one"
    )
    group.addoption(
        "--vastai-real",
        action="store_true",
        default=False,
        help="run the vastai tests against the real vast.ai (needs VAST_API_KEY; rents GPUs and costs "
        "money) instead of the local emulator",
    )
    group.addoption(
        "--slow",
        action="store_true",
        default=False,
        help="also run the tests marked slow, whatever -m says (without it they run only when -m names slow)",
    )


def pytest_configure(config: pytest.Config) -> None:
    for name, usage in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {usage}")


def slow_left_out(config: pytest.Config) -> bool:
    """Whether the plugin deselects the slow tests: unless --slow is given or the -m expression names slow."""
    expr = str(config.getoption("markexpr", "") or "")
    return not config.getoption("--slow") and re.search(r"\bslow\b", expr) is None


def how_to_add_slow(config: pytest.Config) -> str:
    """The -m that also selects the slow tests the current one leaves out."""
    expr = str(config.getoption("markexpr", "") or "").strip()
    if not expr:
        return "-m slow"
    if re.fullmatch(r"[\w.]+", expr) is None:
        expr = f"({expr})"
    return f"-m '{expr} and slow'"


def pytest_report_header(config: pytest.Config) -> str | None:
    if slow_left_out(config):
        return f"slow tests left out: add {how_to_add_slow(config)}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the slow tests unless -m names slow or --slow is given (so that -m local keeps them out)."""
    if not slow_left_out(config):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
        config.hook.pytest_deselected(items=slow)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking ``num_stages`` runs once per count: --num-stages N, else its ``default_num_stages``."""
    if "num_stages" in metafunc.fixturenames:
        chosen = metafunc.config.getoption("--num-stages")
        default = getattr(metafunc.function, "default_num_stages", DEFAULT_NUM_STAGES)
        values = [chosen] if chosen else list(default)
        metafunc.parametrize(
            "num_stages",
            [
                pytest.param(n, id=f"N{n}", marks=[pytest.mark.slow] if n >= SLOW_STAGES and not chosen else [])
                for n in values
            ],
        )


@pytest.fixture
def scenario_option(request: pytest.FixtureRequest) -> str | None:
    """The --scenario path as given, or None."""
    path: str | None = request.config.getoption("--scenario")
    return path


@pytest.fixture
def scenario(scenario_option: str | None) -> Scenario:
    """The --scenario file, loaded and validated (a test taking it is skipped without --scenario)."""
    # imported when used: the plugin loads in every pytest run, and the scenario schema takes most of a second
    from ppharness.scenario.schema import load_scenario

    if not scenario_option:
        pytest.skip("no --scenario given")
    return load_scenario(scenario_option)


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The synthetic tiny model (8 blocks), built once into the ppharness cache."""
    # imported when used: the plugin loads in every pytest run; the model modules are slow to import
    from ppharness.model.sources.files import synthetic_path
    from ppharness.model.synthetic.spec import PRESETS

    return str(synthetic_path(PRESETS["tiny"]))


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model_path: str) -> GGUFFile:
    """The synthetic tiny model, opened."""
    # imported when used: the plugin loads in every pytest run; the model modules are slow to import
    from ppharness.model.gguf_file import GGUFFile

    return GGUFFile(tiny_model_path)
