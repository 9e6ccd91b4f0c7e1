"""Only a run's members talk to it: forged messages from a process on the same machine, against a live ZeroMQ run.

Each forged message below once killed, stopped, exhausted, hijacked or failed a run. A stranger now holds no key of the
run, so its connection is refused at the CURVE handshake and logged by the receiver; the run goes on and its answer
stays bit-exact.
"""

from __future__ import annotations

import contextlib
import time
import uuid

import pytest
import zmq
from zmq_peers import raw_push

from ppharness.errors import ConnectFailed
from ppharness.model.decode.oracle import oracle_decode
from ppharness.run.seed.orchestrator import Chain
from ppharness.scenario.schema import scenario_from_args
from ppharness.wire.messages import ClockProbe, Error, RequestOpen, Shutdown, StageActivation
from transports.zmq import ZmqTransport

pytestmark = pytest.mark.local


def _forgeries(chain: Chain) -> list[tuple[str, str, object]]:
    """(what, target address, message) for every forged message of the report."""
    stage0, stage1 = chain.directory.joins[0].address, chain.directory.joins[1].address
    plan = chain.plan.plan_id
    return [
        ("a ClockProbe from an invalid sender", stage1, ClockProbe(t_seed_ns=1)),
        ("a Shutdown", stage1, Shutdown(reason="forged")),
        (
            "a RequestOpen with the run's plan id",
            stage1,
            RequestOpen(request_id="hijack", reply_to="tcp://127.0.0.1:1", max_tokens=4, prompt_tokens=2, plan_id=plan),
        ),
        (
            "an activation with the run's plan id",
            stage1,
            StageActivation(
                request_id="hijack",
                position=0,
                hidden=b"\0" * 256,
                seq_len=2,
                is_prefill=True,
                shape=(1, 2, 64),
                dtype="f16",
                plan_id=plan,
            ),
        ),
        ("a ClockProbe to stage 0", stage0, ClockProbe(t_seed_ns=2)),
        ("an Error to the orchestrator", chain.seed, Error(stage=1, reason="forged failure")),
    ]


def test_strangers_cannot_kill_steer_hang_or_fail_a_zmq_run(tiny_model_path):
    scenario = scenario_from_args(num_stages=2, transport="zmq", max_tokens=12, prompt="forged")
    with Chain(scenario, progress=lambda _: None, run_label=f"pp-test-{uuid.uuid4().hex[:8]}") as chain:
        targets = {addr for _, addr, _ in _forgeries(chain)}
        with ZmqTransport(send_timeout=2.0) as stranger:
            for _what, address, msg in _forgeries(chain):
                # a member refuses the stranger's handshake: its frames may find no connection to queue on
                with contextlib.suppress(ConnectFailed):
                    stranger.send(address, msg)
            time.sleep(1.0)
        # a flood of strangers, each with its own key (it once exhausted a stage's file descriptors)
        ctx = zmq.Context()
        try:
            socks = []
            for _ in range(300):
                push = raw_push(ctx, chain.directory.joins[1].address, zmq.curve_keypair()[1])
                push.send_multipart([b"x", b"y"], zmq.NOBLOCK)
                socks.append(push)
            time.sleep(1.0)
            for s in socks:
                s.close()
        finally:
            ctx.term()
        response, _ = chain.request("forged", 12)
        oracle = oracle_decode(tiny_model_path, "forged", 12, scenario.model.max_context, boundaries=True)
        verdict = chain.verdict(response, oracle)
        assert verdict.exact, verdict.describe(response.token_ids, oracle.token_ids)
        logs = {i: chain._provider.logs(inst, 400) for i, inst in enumerate(chain._provider.instances)}
    assert len(targets) == 3
    for i in (0, 1):
        assert "refused a connection" in logs[i] and "not a member of this run" in logs[i], logs[i]
    assert all(s.peak_rss_bytes > 0 for s in chain.reports), "a stage did not stop cleanly"
