"""pytest hooks and fixtures for ppharness: markers, --num-stages, --scenario, hypothesis profiles, skip-with-reason.

Decisions (which backends can run here) live in ``tests/availability.py``; this file only acts on them.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import tinygrad  # noqa: F401  (raises the recursion limit on import: do it before hypothesis watches it)
from hypothesis import HealthCheck, settings

from tests.availability import must_fail, unavailable_reason, vastai_reason

MARKERS = {
    "local": "chain on local pp-node processes over real sockets: pytest -m local --num-stages 5",
    "docker": "needs a Docker daemon (one container per stage): pytest -m docker --num-stages 5",
    "vastai": "vast.ai provider (emulator by default, real cloud with --vastai-real): pytest -m vastai --num-stages 5",
    "gpu": "needs a GPU that tinygrad can use: pytest -m gpu",
    "slow": "left out of the default run (5-stage chains, benchmarks, runs that wait out a failure): pytest -m slow; "
    ".ci/run runs them",
}
ROOT = Path(__file__).resolve().parent
SLOW_STAGES = 5  # chain tests with this many stages or more are marked slow unless --num-stages asks for them
MAX_WORKERS = 4  # pytest -n auto: one worker per core, at most this many (each runs multi-process chains)

# Property-test budgets; pick one with HYPOTHESIS_PROFILE (CI defaults to "ci"). tests/README.md lists them.
settings.register_profile("dev", max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ppharness")
    group.addoption(
        "--num-stages",
        type=int,
        default=None,
        help="stage count for chain tests (default: each chain test's own choices, e.g. 2 and 5)",
    )
    group.addoption("--scenario", default=None, help="also run this scenario file in tests that take one")
    group.addoption(
        "--vastai-real",
        action="store_true",
        default=False,
        help="run the vastai tests against the real vast.ai (needs VAST_API_KEY; rents GPUs and costs "
        "money) instead of the local emulator",
    )


@pytest.hookimpl(tryfirst=True)  # before hypothesis' own pytest_configure reads its --hypothesis-seed option
def pytest_configure(config: pytest.Config) -> None:
    if PROPERTY_SEED is not None and config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(PROPERTY_SEED[0])
    for name, usage in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {usage}")
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


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "num_stages" in metafunc.fixturenames:
        chosen = metafunc.config.getoption("--num-stages")
        default = getattr(metafunc.function, "default_num_stages", (2, 5))
        values = [chosen] if chosen else list(default)
        metafunc.parametrize(
            "num_stages",
            [
                pytest.param(n, id=f"N{n}", marks=[pytest.mark.slow] if n >= SLOW_STAGES and not chosen else [])
                for n in values
            ],
        )


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


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """The synthetic tiny model (8 blocks), built once into the ppharness cache."""
    from ppharness.model.files import synthetic_path
    from ppharness.model.spec import PRESETS

    return str(synthetic_path(PRESETS["tiny"]))


@pytest.fixture(scope="session")
def tiny_gguf(tiny_model_path: str):
    from ppharness.model.gguf_file import GGUFFile

    return GGUFFile(tiny_model_path)


@pytest.fixture
def vastai_api(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path):
    """The vast.ai API a ``vastai`` test talks to, exported as VAST_URL, VAST_API_KEY and PPHARNESS_VASTAI_PACE: a
    fresh emulator (quick timeline, scaled rate limits; stopped afterwards, destroying what it holds) by default,
    the real service with --vastai-real (skipped, with the reason, without VAST_API_KEY)."""
    import os

    from backends.vastai.emulator.server import ApiTarget, Emulator

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
