"""The vast.ai provider end to end (marker ``vastai``): against the emulator by default, vast.ai with --vastai-real.

The chain runs real pp-node processes started by the emulator's instances with the environment the client sent, and
must equal the oracle token for token. Every provider-side failure mode of docs/vastai.md fails the run (exit 1 or a
HarnessError) and leaves no live instance and no pp-node process behind.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from backends.local import labelled_pids
from ppharness.benchmarks.watched import WatchedRun
from ppharness.errors import HarnessError, NotReady, ProvisionFailed
from ppharness.run.seed.orchestrator import Progress, run_scenario
from ppharness.scenario.schema import load_scenario, scenario_from_args

pytestmark = pytest.mark.vastai
ROOT = Path(__file__).resolve().parent.parent
ACCEPTANCE = ROOT / "scenarios" / "acceptance-5stage-vastai.yaml"
NODE_ENV = ("STAGE", "NUM_STAGES", "SEED_ADDR", "MODEL", "PLAN", "TRANSPORT", "PP_RUN_LABEL")


def _label() -> str:
    return f"pp-vt-{uuid.uuid4().hex[:8]}"


def vastai_scenario(
    target, num_stages: int | None = None, transport: str | None = "zmq", relay: str | None = None, **vastai: object
):
    """The acceptance scenario; against the emulator over ``transport`` (no relay is reachable from CI) with a quick
    poll. Against vast.ai itself it is used as shipped (iroh through the relays)."""
    sc = load_scenario(ACCEPTANCE)
    if target.emulator is None:
        return scenario_from_args(base=sc, num_stages=num_stages)
    sc = scenario_from_args(base=sc, num_stages=num_stages, transport=transport)
    if relay is not None:
        sc = msgspec.structs.replace(sc, transport=msgspec.structs.replace(sc.transport, relay=relay))
    settings = msgspec.structs.replace(sc.provider.vastai, poll_s=0.1, **vastai)
    return msgspec.structs.replace(sc, provider=msgspec.structs.replace(sc.provider, vastai=settings))


def write_scenario(sc, path: Path) -> str:
    path.write_bytes(msgspec.yaml.encode(msgspec.to_builtins(sc)))
    return str(path)


def needs_emulator(target) -> None:
    if target.emulator is None:
        pytest.skip(
            "vastai: this failure mode is injected through the emulator's fault switches (not with --vastai-real)"
        )


def live_instances(target, label: str) -> list[dict]:
    if target.emulator is not None:
        return target.emulator.live_instances()
    from backends.vastai.provider import client_from_env, is_gone

    with client_from_env() as client:
        return [r for r in client.list_instances({"label": {"eq": label}}) if not is_gone(r)]


def assert_nothing_left(target, label: str) -> None:
    left = live_instances(target, label)
    assert not left, f"live instances after the run: {[(i['id'], i['label'], i['actual_status']) for i in left]}"
    deadline = time.monotonic() + 5
    while labelled_pids(label) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not labelled_pids(label), "pp-node processes outlived the run"


def smoke(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """pp-smoke-run --vastai ... in a subprocess; stdout and stderr together."""
    return subprocess.run(
        [sys.executable, "-m", "ppharness.cli.smoke", "--vastai", *args],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
        env=env if env is not None else dict(os.environ),
    )


def _run_fails(sc, label: str, error: type[BaseException] = HarnessError) -> str:
    with pytest.raises(error) as info:
        run_scenario(sc, progress=Progress(quiet=True), run_label=label)
    return str(info.value)


# --- the chain ----------------------------------------------------------------------------------------------------


def test_chain_matches_oracle(vastai_api, num_stages, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    label = _label()
    result = run_scenario(vastai_scenario(vastai_api, num_stages), progress=Progress(), run_label=label)
    assert result.response.token_ids, "the chain produced no tokens"
    assert result.matches_oracle, f"chain {result.response.token_ids} != oracle {result.oracle.token_ids}"
    assert len(result.plan.ranges) == num_stages
    assert_nothing_left(vastai_api, label)
    out = capsys.readouterr()
    assert "vast.ai plan for run" in out.err and "total $" in out.err
    assert vastai_api.key not in out.out + out.err + caplog.text
    emu = vastai_api.emulator
    if emu is not None:
        made = [i for i in emu.history.values() if i.label == label]
        assert len(made) == num_stages
        for inst in made:
            assert vastai_api.key not in json.dumps(inst.body), "the API key reached an instance's create body"
            assert all(inst.env.get(k) or any(n.startswith(f"{k}__") for n in inst.env) for k in NODE_ENV), inst.env
        assert {i.env["STAGE"] for i in made} == {str(i) for i in range(num_stages)}
        for inst in made:  # each node joined through the public port the instance's own port was mapped to
            port = inst.env["PP_PORT"]
            log = emu.node_log(inst.id)
            m = re.search(rf"binds {re.escape(inst.address)} port {port} and advertises 127\.0\.0\.1 port (\d+)", log)
            assert m is not None and m[1] != port, log[-2000:]


test_chain_matches_oracle.default_num_stages = (5,)  # type: ignore[attr-defined]


@pytest.mark.slow  # three instances over iroh
def test_acceptance_scenario_over_iroh_without_relay(vastai_api):
    needs_emulator(vastai_api)
    pytest.importorskip("iroh", reason="the iroh Python bindings are not installed")
    label = _label()
    sc = vastai_scenario(vastai_api, 3, transport="iroh", relay="disabled")
    result = run_scenario(sc, progress=Progress(quiet=True), run_label=label)
    assert result.matches_oracle, f"chain {result.response.token_ids} != oracle {result.oracle.token_ids}"
    assert_nothing_left(vastai_api, label)


@pytest.mark.docker
@pytest.mark.slow  # builds and starts the node image for every stage
def test_chain_in_node_image_containers(vastai_api, monkeypatch, tmp_path):
    """Instances as containers of the node image (docker/Dockerfile), started with the create body's entrypoint,
    arguments and environment exactly, as vast.ai starts them."""
    needs_emulator(vastai_api)
    import docker

    from backends.docker.image import ensure_node_image
    from backends.vastai.emulator.server import ApiTarget, Emulator

    daemon = docker.from_env()
    try:
        image = ensure_node_image(daemon)
        with Emulator.for_ci(tmp_path / "emulator", docker_image=image) as emu:
            for name, value in ApiTarget.of(emu).env().items():
                monkeypatch.setenv(name, value)
            label = _label()
            result = run_scenario(vastai_scenario(ApiTarget.of(emu), 2), progress=Progress(quiet=True), run_label=label)
            assert result.matches_oracle, f"chain {result.response.token_ids} != oracle {result.oracle.token_ids}"
            assert emu.live_instances() == []
            assert "exec pp-node" in json.dumps([i.body for i in emu.history.values()])
        left = daemon.containers.list(all=True, filters={"label": f"ppharness.vastai-emulator={emu.id}"})
        assert not left, f"containers outlived the run: {[c.name for c in left]}"
    finally:
        daemon.close()


@pytest.mark.slow  # 20-40 s; the default run keeps to its 12-minute budget, .ci/run runs it with -m slow
def test_api_key_never_reaches_output_arguments_or_nodes(vastai_api, tmp_path):
    """--api-key on the command line: the key is in no line of output and in no node's arguments or environment."""
    needs_emulator(vastai_api)
    label = _label()
    env = {k: v for k, v in os.environ.items() if k != "VAST_API_KEY"}
    path = write_scenario(vastai_scenario(vastai_api, 2), tmp_path / "leak.yaml")
    seen, lines = 0, []
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ppharness.cli.smoke",
            "--vastai",
            "--api-key",
            vastai_api.key,
            "--vastai-url",
            vastai_api.url,
            "--scenario",
            path,
            "--run-label",
            label,
        ],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            for pid in labelled_pids(label):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                    environ = Path(f"/proc/{pid}/environ").read_bytes()
                except OSError:
                    continue
                seen += 1
                assert vastai_api.key.encode() not in cmdline + environ, f"the key reached pp-node process {pid}"
        rc = proc.wait(60)
    output = "".join(lines)
    assert rc == 0, output
    assert seen, "never saw a pp-node process to check"
    assert vastai_api.key not in output
    assert "MATCH" in output
    assert_nothing_left(vastai_api, label)


# --- provider-side failure modes ------------------------------------------------------------------------------------


def test_too_few_offers_exits_1_before_renting(vastai_api, tmp_path):
    label = _label()
    if vastai_api.emulator is not None:
        vastai_api.emulator.faults.offers_cap = 2
        sc = vastai_scenario(vastai_api, 3)
    else:
        sc = vastai_scenario(vastai_api, 3)
        sc = msgspec.structs.replace(
            sc,
            provider=msgspec.structs.replace(
                sc.provider, vastai=msgspec.structs.replace(sc.provider.vastai, gpu_name="NO SUCH GPU")
            ),
        )
    r = smoke("--scenario", write_scenario(sc, tmp_path / "few.yaml"), "--run-label", label)
    assert r.returncode == 1, r.stdout
    assert "offer(s) match" in r.stdout and "nothing was rented" in r.stdout, r.stdout
    if vastai_api.emulator is not None:
        assert vastai_api.emulator.creates == 0
    assert_nothing_left(vastai_api, label)


def test_plan_over_the_total_cap_is_refused_before_renting(vastai_api):
    label = _label()
    message = _run_fails(vastai_scenario(vastai_api, 3, max_total_dph=0.01, max_dph=0.6), label, ProvisionFailed)
    assert "max_total_dph" in message and "nothing was rented" in message
    assert_nothing_left(vastai_api, label)


def test_second_create_rejected_destroys_the_first(vastai_api):
    needs_emulator(vastai_api)
    emu, label = vastai_api.emulator, _label()
    emu.faults.reject_create[2] = (400, "invalid_args", "error 400/3010: the host rejected this instance")
    message = _run_fails(vastai_scenario(vastai_api, 3), label, ProvisionFailed)
    assert "creating instance 2/3" in message and "invalid_args" in message, message
    assert emu.creates == 2 and len(emu.destroyed) == 1
    assert_nothing_left(vastai_api, label)


def test_create_that_fails_but_leaves_an_instance_destroys_it(vastai_api):
    needs_emulator(vastai_api)
    emu, label = vastai_api.emulator, _label()
    emu.faults.leave_stopped.add(2)
    message = _run_fails(vastai_scenario(vastai_api, 2), label, ProvisionFailed)
    assert "creating instance 2/2" in message and "invalid_price" in message, message
    assert len(emu.destroyed) == 2
    assert_nothing_left(vastai_api, label)


@pytest.mark.parametrize("fault", ["stuck_loading", "exited", "unknown", "offline", "oci_error", "outbid"])
def test_instance_that_never_runs_fails_the_run(vastai_api, fault):
    needs_emulator(vastai_api)
    emu, label = vastai_api.emulator, _label()
    if fault in ("exited", "unknown", "offline"):
        emu.faults.fail_as[2] = fault
    else:
        getattr(emu.faults, fault).add(2)
    message = _run_fails(vastai_scenario(vastai_api, 2), label, NotReady)
    expected = {"stuck_loading": "not running after 60 polls", "oci_error": "OCI runtime", "outbid": "stopped"}
    assert expected.get(fault, f"'{fault}'") in message, message
    assert_nothing_left(vastai_api, label)


def test_instance_that_exits_after_start_fails_the_run(vastai_api):
    needs_emulator(vastai_api)
    emu, label = vastai_api.emulator, _label()
    emu.faults.exit_after_s[2] = 0.5
    message = _run_fails(vastai_scenario(vastai_api, 2), label)
    assert "pp-stage-1" in message and "exited" in message, message
    assert_nothing_left(vastai_api, label)


@pytest.mark.slow  # 25 s of backoff; the client's retries on 429 are unit-tested in tests/test_vastai_client.py
def test_429_storm_is_recovered(vastai_api):
    needs_emulator(vastai_api)
    emu, label = vastai_api.emulator, _label()
    emu.faults.storm_429 = 5
    result = run_scenario(vastai_scenario(vastai_api, 2), progress=Progress(quiet=True), run_label=label)
    assert result.matches_oracle
    assert sum(1 for _, _, status in emu.requests if status == 429) >= 5
    assert_nothing_left(vastai_api, label)


def test_429_storm_past_the_retries_fails_and_destroys(vastai_api):
    needs_emulator(vastai_api)
    emu, label = vastai_api.emulator, _label()
    emu.faults.storm_429, emu.faults.storm_endpoints, emu.faults.storm_after_creates = 100, frozenset({"create"}), 1
    message = _run_fails(vastai_scenario(vastai_api, 3), label, ProvisionFailed)
    assert "creating instance 2/3" in message and "HTTP 429" in message, message
    assert len(emu.destroyed) == 1
    assert_nothing_left(vastai_api, label)


def test_transient_destroy_failures_are_retried(vastai_api):
    needs_emulator(vastai_api)
    emu, label = vastai_api.emulator, _label()
    emu.faults.destroy_fail, emu.faults.reject_create[3] = 2, (403, "forbidden", "restricted offer")
    _run_fails(vastai_scenario(vastai_api, 3), label, ProvisionFailed)
    assert len(emu.destroyed) == 2
    assert_nothing_left(vastai_api, label)


def test_destroy_failure_exits_1_and_reap_removes_the_leftover(vastai_api, tmp_path):
    needs_emulator(vastai_api)
    emu, label = vastai_api.emulator, _label()
    emu.faults.destroy_fail, emu.faults.reject_create[2] = -1, (400, "invalid_args", "error 400/3010: rejected")
    r = smoke("--scenario", write_scenario(vastai_scenario(vastai_api, 2), tmp_path / "d.yaml"), "--run-label", label)
    assert r.returncode == 1, r.stdout
    assert "ppharness reap --provider vastai --label" in r.stdout, r.stdout
    assert len(emu.live_instances()) == 1, "the instance whose destroy failed should still be there"
    emu.faults.destroy_fail = 0
    reap = subprocess.run(
        [sys.executable, "-m", "ppharness.cli", "reap", "--provider", "vastai", "--label", label],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert reap.returncode == 0, reap.stdout + reap.stderr
    assert "vastai: instance" in reap.stdout, reap.stdout
    assert_nothing_left(vastai_api, label)
    assert vastai_api.key not in r.stdout + reap.stdout + reap.stderr


def test_leftovers_of_a_killed_run_are_reaped_by_label(vastai_api, tmp_path):
    needs_emulator(vastai_api)
    emu, label = vastai_api.emulator, _label()
    path = write_scenario(vastai_scenario(vastai_api, 2), tmp_path / "crash.yaml")
    with WatchedRun(
        [sys.executable, "-m", "ppharness.cli.smoke", "--vastai", "--scenario", path, "--run-label", label], cwd=ROOT
    ) as run:
        run.until("joined")
        run.proc.kill()  # SIGKILL: no clean-up runs in pp-smoke-run
        run.proc.wait(30)
    assert len([i for i in emu.live_instances() if i["label"] == label]) == 2, "".join(run.lines)
    reap = subprocess.run(
        [sys.executable, "-m", "ppharness.cli", "reap", "--provider", "vastai", "--label", label],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert reap.returncode == 0 and reap.stdout.count("vastai: instance") == 2, reap.stdout + reap.stderr
    assert_nothing_left(vastai_api, label)
