"""The ``ppharness`` pytest plugin from a directory of one's own: its markers, ``--num-stages``, ``--scenario PATH``
(a file outside the rootdir, in the space form) and fixtures reach a user's tests; ``-m local`` leaves the slow tests
out unless it names slow; this repository's suite refuses ``-p no:ppharness`` with the reason."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIO = """\
version: 1
name: my3
model:
  synthetic:
    preset: tiny
stages:
  count: 3
transport:
  kind: zmq
provider:
  kind: local
"""


def readme_example() -> str:
    """The example test file of tests/README.md's "Your own tests"."""
    section = (ROOT / "tests" / "README.md").read_text().split("## Your own tests", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found, "tests/README.md: no ```python example under 'Your own tests'"
    return found.group(1)


def pytest_in(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m pytest ARGS`` in ``cwd`` with this environment's ppharness, as a user runs it (no PYTEST_* of ours,
    plugins autoloaded)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def users_suite(tmp_path: Path) -> Path:
    """A user's directory of its own (the README's example as test_my_chain.py) beside a scenarios/my3.yaml."""
    suite = tmp_path / "my-suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers\n")
    (suite / "test_my_chain.py").write_text(readme_example())
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "scenarios" / "my3.yaml").write_text(SCENARIO)
    return suite


def test_a_users_suite_gets_the_markers_options_and_fixtures_and_minus_m_local_leaves_slow_tests_out(tmp_path):
    suite = users_suite(tmp_path)
    run = pytest_in(suite, "-m", "local", "--num-stages", "5", "--scenario", "../scenarios/my3.yaml")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "test_my_chain.py::test_my_chain[N5] PASSED" in out, "the options' values reach the fixtures"
    assert "1 passed, 1 deselected" in out and "test_my_long_chain" not in out, "-m local leaves the slow test out"
    assert out.count("slow tests left out: add -m 'local and slow'") == 1, "the header says so, once"


def test_a_marker_expression_naming_slow_runs_the_slow_tests(tmp_path):
    suite = users_suite(tmp_path)
    run = pytest_in(suite, "-m", "local and slow", "--num-stages", "5", "--scenario=../scenarios/my3.yaml")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "test_my_chain.py::test_my_long_chain[N5] PASSED" in out and "1 passed, 1 deselected" in out
    assert "slow tests left out" not in out
    run = pytest_in(suite, "-m", "local", "--slow", "--num-stages", "5", "--scenario", "../scenarios/my3.yaml")
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout + run.stderr


def test_without_scenario_a_test_taking_it_is_skipped_with_the_reason(tmp_path):
    suite = users_suite(tmp_path)
    run = pytest_in(suite, "-m", "local", "--num-stages", "5", "-rs")
    assert run.returncode == 0 and "no --scenario given" in run.stdout, run.stdout + run.stderr


def test_this_suite_refuses_to_run_without_the_plugin():
    run = pytest_in(ROOT, "-p", "no:ppharness", "--collect-only", "-q", "tests/test_plugin.py")
    assert run.returncode != 0
    assert "this repository's tests need the ppharness pytest plugin" in run.stderr, run.stdout + run.stderr
