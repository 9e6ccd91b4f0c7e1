"""The chain in Docker containers (marker ``docker``), against a real dockerd: one container per stage from the node
image, each with its own address on the run's bridge network. Token equality with the oracle for N in (3,) or
``--num-stages N``, every shipped docker scenario, a container that dies during start-up, Ctrl-C of ``pp-smoke-run``,
and reaping; every test checks that no container or network carrying its run label is left.

The first test on a machine builds the node image (the Debian base by debootstrap, then docker/Dockerfile: minutes,
once per machine; later runs find both by their content tags), hence the long per-test timeout.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from ppharness.errors import HarnessError
from ppharness.run.seed.orchestrator import Chain, Progress, run_scenario
from ppharness.scenario.schema import load_scenario, scenario_from_args

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]
ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((ROOT / "scenarios").glob("*-docker*.yaml"))


def _label() -> str:
    return f"pp-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def docker_client() -> Any:
    from backends.docker.network import client

    c = client()
    yield c
    c.close()


@pytest.fixture(scope="module")
def node_image(docker_client: Any) -> str:
    """The node image of this working tree (built on first use, found by its content tag afterwards)."""
    from backends.docker.image import ensure_node_image

    return ensure_node_image(docker_client)


def _leftovers(client: Any, label: str) -> list[str]:
    """Containers and networks that still carry ``label``."""
    wanted = {"label": f"ppharness.run={label}"}
    return [f"container {c['Names']}" for c in client.api.containers(all=True, filters=wanted)] + [
        f"network {n['Name']}" for n in client.api.networks(filters=wanted)
    ]


def _assert_nothing_left(client: Any, label: str) -> None:
    from backends.docker.provider import DockerProvider

    assert not _leftovers(client, label), f"left behind by run {label}: {_leftovers(client, label)}"
    assert DockerProvider.reap(label) == [], "reap found something of a finished run"


def _assert_chain_ok(result: Any, n: int) -> None:
    assert len(result.plan.ranges) == n
    assert result.response.token_ids, "the chain produced no tokens"
    assert result.matches_oracle, f"chain {result.response.token_ids} != oracle {result.oracle.token_ids}"
    assert sum(s.params for s in result.stages) == result.oracle.n_params


def test_chain_matches_oracle(num_stages, node_image, docker_client):
    from ppharness.model.decode.oracle import oracle_decode

    label = _label()
    scenario = scenario_from_args(num_stages=num_stages, provider="docker", max_tokens=12)
    with Chain(scenario, Progress(quiet=True), run_label=label) as chain:
        provider = chain._provider
        assert len(_leftovers(docker_client, label)) == num_stages + 1  # the containers and the network
        joined = {j.stage: j.address for j in chain.directory.joins.values()}
        response, _ = chain.request(scenario.request.prompt, scenario.request.max_tokens)
    oracle = oracle_decode(
        chain.model_path, scenario.request.prompt, scenario.request.max_tokens, scenario.model.max_context
    )
    assert response.token_ids and response.token_ids == oracle.token_ids
    assert chain.seed.startswith(f"tcp://{provider.gateway}:"), chain.seed
    hosts = [joined[i].rsplit(":", 1)[0].removeprefix("tcp://") for i in range(num_stages)]
    assert hosts == [provider.address_of(i) for i in range(num_stages)], "each stage advertises its own address"
    assert len(set(hosts)) == num_stages
    _assert_nothing_left(docker_client, label)


test_chain_matches_oracle.default_num_stages = (3,)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "path",
    # 5-stage chains (the WAN ones included) are slow tests (the pytest plugin): pytest -m slow (and .ci/run) runs them
    [pytest.param(p, marks=[pytest.mark.slow] if load_scenario(p).stages.count >= 5 else []) for p in SCENARIOS],
    ids=[p.stem for p in SCENARIOS],
)
def test_shipped_scenario_runs(path, node_image, docker_client):
    scenario = load_scenario(path)
    # five containers per run and two runs at once on a 2-core CI machine starve the heartbeat threads for seconds
    # (the decode step's compile alone takes ~30 s there); failure detection is tested in test_failure_modes.py
    scenario = msgspec.structs.replace(scenario, cluster=msgspec.structs.replace(scenario.cluster, dead_after_s=30.0))
    label = _label()
    result = run_scenario(scenario, progress=Progress(quiet=True), run_label=label)
    _assert_chain_ok(result, scenario.stages.num_stages)
    _assert_nothing_left(docker_client, label)


def test_scenario_option(scenario_option, node_image, docker_client):
    if not scenario_option:
        pytest.skip("no --scenario FILE given")
    scenario = load_scenario(scenario_option)
    if scenario.provider.kind != "docker":
        pytest.skip(f"--scenario {scenario_option} runs on provider {scenario.provider.kind!r}, not docker")
    label = _label()
    result = run_scenario(scenario, progress=Progress(quiet=True), run_label=label)
    _assert_chain_ok(result, scenario.stages.num_stages)
    _assert_nothing_left(docker_client, label)


def test_container_exiting_during_startup_fails_the_run_with_its_last_lines(monkeypatch, node_image, docker_client):
    from backends.docker.provider import DockerProvider

    spec = DockerProvider.spec

    def bad_plan_for_stage_1(self: Any, name: str, env: dict[str, str], **settings: object) -> Any:
        return spec(self, name, {**env, "PLAN": "{not json"} if name == "pp-stage-1" else env, **settings)

    monkeypatch.setattr(DockerProvider, "spec", bad_plan_for_stage_1)
    label = _label()
    with pytest.raises(HarnessError) as info:
        run_scenario(
            scenario_from_args(num_stages=3, provider="docker"), progress=Progress(quiet=True), run_label=label
        )
    message, notes = str(info.value), "\n".join(getattr(info.value, "__notes__", []))
    assert "pp-stage-1" in message and "exited with code 1" in message and "timed out" not in message, message
    assert "last lines of pp-stage-1" in notes and "PLAN is not a valid stage plan" in notes, notes
    _assert_nothing_left(docker_client, label)


def test_sigint_of_smoke_run_removes_every_container_and_the_network(node_image, docker_client):
    label = _label()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ppharness.cli.smoke",
            "--num-stages",
            "2",
            "--provider",
            "docker",
            "--run-label",
            label,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "joined" in line:
                break
        assert _leftovers(docker_client, label), "no container was running when the run was interrupted"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(lines) + out
    assert proc.returncode == 128 + signal.SIGINT, output
    assert "RuntimeWarning" not in output, output
    assert "interrupted" in output, output
    _assert_nothing_left(docker_client, label)


def test_reap_removes_a_crashed_runs_containers_and_network(node_image, docker_client):
    from backends.docker.provider import DockerProvider

    label = _label()
    provider = DockerProvider(label)
    provider.provision([provider.spec("pp-stage-0", {}), provider.spec("pp-stage-1", {})])  # exit at once: no env
    assert len(_leftovers(docker_client, label)) == 3
    reaped = DockerProvider.reap(label)
    assert sorted(x.what.split()[0] for x in reaped) == ["container", "container", "network"], reaped
    assert {x.run_label for x in reaped} == {label}
    _assert_nothing_left(docker_client, label)
    assert provider.destroy_all() == [], "destroying what reap already removed is not an error"
