"""The chain on real pp-node processes over ZeroMQ and iroh (marker ``local``): token equality, failures, and no
leftovers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from backends.local import labelled_pids
from ppharness.benchmarks.watched import WatchedRun
from ppharness.run.seed.orchestrator import Progress, run_scenario
from ppharness.scenario.schema import load_scenario, scenario_from_args

pytestmark = pytest.mark.local
ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = sorted((ROOT / "scenarios").glob("*-local*.yaml"))


def _label() -> str:
    return f"pp-test-{uuid.uuid4().hex[:8]}"


def _assert_chain_ok(result, n: int) -> None:
    assert len(result.plan.ranges) == n
    assert result.response.token_ids, "the chain produced no tokens"
    assert result.matches_oracle, f"chain {result.response.token_ids} != oracle {result.oracle.token_ids}"
    assert sum(s.params for s in result.stages) == result.oracle.n_params
    assert all(s.peak_rss_bytes > 0 for s in result.stages)
    assert not labelled_pids(result.run_label), "pp-node processes outlived the run"


# iroh's default-run chain is its SIGKILL test below (and tests/test_iroh.py); this one runs with the slow tests
@pytest.mark.parametrize("transport", ["zmq", pytest.param("iroh", marks=pytest.mark.slow)])
def test_chain_matches_oracle(num_stages, transport):
    scenario = scenario_from_args(num_stages=num_stages, max_tokens=12, transport=transport)
    result = run_scenario(scenario, progress=Progress(quiet=True), run_label=_label())
    _assert_chain_ok(result, num_stages)


@pytest.mark.parametrize(
    "path",
    # 5-stage chains (the WAN ones included) are slow tests (the pytest plugin): pytest -m slow (and .ci/run) runs them
    # the 2-stage file is the N2 zmq chain above with the file's own settings: with the 5-stage ones, in the slow run
    [pytest.param(p, marks=[pytest.mark.slow]) for p in SCENARIOS],
    ids=[p.stem for p in SCENARIOS],
)
def test_shipped_scenario_runs(path):
    scenario = load_scenario(path)
    result = run_scenario(scenario, progress=Progress(quiet=True), run_label=_label())
    _assert_chain_ok(result, scenario.stages.count)


def test_scenario_option(scenario_option):
    if not scenario_option:
        pytest.skip("no --scenario FILE given")
    scenario = load_scenario(scenario_option)
    result = run_scenario(scenario, progress=Progress(quiet=True), run_label=_label())
    _assert_chain_ok(result, scenario.stages.count)


@pytest.mark.parametrize("transport", ["zmq", "iroh"])
def test_sigkill_of_a_stage_fails_the_run_and_leaves_nothing(transport):
    label = _label()
    cmd = [
        sys.executable,
        "-m",
        "ppharness.cli.smoke",
        "--num-stages",
        "3",
        "--transport",
        transport,
        "--max-tokens",
        "200",
        "--run-label",
        label,
    ]
    with WatchedRun(cmd, cwd=ROOT) as run:
        run.until("request:")  # every stage is ready and decoding has begun
        time.sleep(0.3)
        victims = labelled_pids(label)
        assert len(victims) >= 3, f"expected 3 pp-node processes, found {victims}"
        os.kill(victims[1], signal.SIGKILL)
        killed_at = time.monotonic()
        output = run.finish(timeout=60)
        elapsed = time.monotonic() - killed_at
    assert run.returncode == 1, output
    assert elapsed < 30, f"took {elapsed:.1f} s to notice the dead stage"
    assert "FAILED" in output and "exited with code -9" in output, output
    assert not labelled_pids(label), "pp-node processes outlived the failed run"


def test_typo_in_scenario_is_rejected_before_anything_starts(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text((ROOT / "scenarios" / "smoke-2stage-local.yaml").read_text().replace("max_tokens:", "max_tokns:"))
    r = subprocess.run(
        [sys.executable, "-m", "ppharness.cli.smoke", "--scenario", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 1
    assert str(bad) in out and "max_tokns" in out and "$.request" in out, out
    assert "starting" not in out


def test_unreadable_model_fails_the_run_before_any_node_starts(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    scenario = load_scenario(ROOT / "scenarios" / "smoke-2stage-local.yaml")
    import msgspec

    scenario = msgspec.structs.replace(
        scenario, model=msgspec.structs.replace(scenario.model, synthetic=None, gguf=str(broken))
    )
    label = _label()
    with pytest.raises(Exception) as info:
        run_scenario(scenario, progress=Progress(quiet=True), run_label=label)
    assert "broken.gguf" in str(info.value)
    assert not labelled_pids(label)


@pytest.mark.slow
def test_requests_in_flight_on_pp_node_processes(tiny_model_path, tiny_gguf):
    """Real processes over ZeroMQ, 3 slots and a queue of 1: of five requests sent at once, three are served at once,
    one waits and is served after, one is refused as busy; every answer equals the unsplit model's to that prompt
    alone, streamed token by token, and the chain serves a plain request after."""
    import msgspec

    from ppharness.model.decode.oracle import oracle_decode
    from ppharness.run.inprocess import load_slices
    from ppharness.run.seed.client import Job
    from ppharness.run.seed.orchestrator import Chain

    base = scenario_from_args(num_stages=2, max_tokens=12)
    scenario = msgspec.structs.replace(base, serving=msgspec.structs.replace(base.serving, slots=3, queue=1))
    prompts = ["The quick brown fox", "héllo wörld", "a b c", "Pipeline parallel", "over the wide area network"]
    whole = load_slices(tiny_gguf, [(0, 8)], scenario.model.max_context, cache={})[0]
    want = {
        p: oracle_decode(tiny_model_path, p, 12, scenario.model.max_context, model=whole).token_ids for p in prompts
    }
    with Chain(scenario, progress=Progress(quiet=True), run_label=_label()) as chain:
        served = chain.serve([Job(p, 12) for p in prompts])
        refused = [s for s in served if s.refused]
        assert len(refused) == 1 and "3 request(s) in flight (its 3 slot(s)) and 1 waiting" in refused[0].refused
        for s in served:
            if not s.refused:
                assert s.response is not None and s.response.token_ids == want[s.job.prompt], s.job.prompt
                n = len(s.response.token_ids)  # a closing EOS streams too, and is not in the answer
                assert len(s.token_at) in (n, n + 1), "every token was streamed as it was sampled"
                assert s.ttft_s > 0 and all(g >= 0 for g in s.itl_s)
        response, _ = chain.request(prompts[0], 12)
        assert response.token_ids == want[prompts[0]]
        label = chain.run_label
    assert not labelled_pids(label), "pp-node processes outlived the run"


@pytest.mark.slow
def test_a_batched_chain_of_pp_node_processes_answers_each_request_as_alone(tiny_model_path, tiny_gguf):
    """Real processes over ZeroMQ, batched (serving.batched, 4 slots): four requests sent at once travel as batches of
    rows (ActivationRows, TokenRows) and every answer equals the batched unsplit model's answer to that prompt alone;
    a plain request after them too."""
    import msgspec

    from ppharness.model.decode.oracle import oracle_decode
    from ppharness.run.inprocess import load_slices
    from ppharness.run.seed.client import Job
    from ppharness.run.seed.orchestrator import Chain

    base = scenario_from_args(num_stages=3, max_tokens=12)
    serving = msgspec.structs.replace(base.serving, slots=4, batched=True)
    scenario = msgspec.structs.replace(base, serving=serving)
    prompts = ["The quick brown fox", "héllo wörld", "a b c", "Pipeline parallel"]
    ctx = scenario.model.max_context
    whole = load_slices(tiny_gguf, [(0, 8)], ctx, cache={}, slots=4, batched=True)[0]
    want = {p: oracle_decode(tiny_model_path, p, 12, ctx, model=whole).token_ids for p in prompts}
    with Chain(scenario, progress=Progress(quiet=True), run_label=_label()) as chain:
        served = chain.serve([Job(p, 12) for p in prompts])
        for s in served:
            assert s.response is not None and s.response.token_ids == want[s.job.prompt], s.job.prompt
        response, _ = chain.request(prompts[0], 12)
        assert response.token_ids == want[prompts[0]]
        label = chain.run_label
    assert not labelled_pids(label), "pp-node processes outlived the run"
