"""Co-located stages: a plan may put consecutive stages on one device, one process drives them, and the hidden state
is handed over in the process. The split stays bit-exact in every placement (co-located, separate, mixed); what a
plan may co-locate is checked before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import msgspec
import numpy as np
import pytest

from backends.local import labelled_pids
from ppharness.errors import PlanError, TransportTimeout
from ppharness.model.engine.hidden import Hidden
from ppharness.model.synthetic.spec import PRESETS, synthetic_source
from ppharness.plan.build import chain
from ppharness.plan.compile import compile_plan, implicit_cluster
from ppharness.plan.graph import model_graph
from ppharness.plan.lang.check import check_plan
from ppharness.plan.lang.document import pretty
from ppharness.run.node.colocated import GroupInbox, LocalEndpoint, Mail
from ppharness.run.seed.realise import GROUP_ENV, Endpoints, realise, realise_plan
from ppharness.scenario.schema import scenario_from_args
from ppharness.wire import codec
from ppharness.wire.messages import NextToken, StageActivation
from transports.memory import MemoryHub, MemoryTransport

ROOT = Path(__file__).resolve().parent.parent
MAX_CONTEXT = 64


@pytest.fixture(scope="module")
def tiny_graph(tiny_model_path):
    return model_graph(tiny_model_path, synthetic_source(PRESETS["tiny"]), MAX_CONTEXT)


# --- the hand-over ----------------------------------------------------------------------------------------------------


def _group(n: int = 2) -> tuple[Mail, list[LocalEndpoint], MemoryTransport]:
    hub, mail = MemoryHub(), Mail()
    endpoints = [LocalEndpoint(MemoryTransport(hub), mail) for _ in range(n)]
    for e in endpoints:
        e.start()
    outside = MemoryTransport(hub)
    outside.start()
    return mail, endpoints, outside


def _header(hidden: Hidden, wire: str) -> StageActivation:
    return codec.header(hidden, wire, request_id="r", position=3, is_prefill=False, plan_id="p", epoch=0)


def test_a_member_hands_the_hidden_state_to_another_as_the_handle_itself_without_bytes():
    mail, (a, b), _ = _group()
    hidden = Hidden(np.arange(8, dtype=np.float16).reshape(1, 1, 8))
    sent = a.send(b.address, _header(hidden, "f16"), hidden)
    inbox = GroupInbox(mail, [a, b])
    rx = inbox.receive(0)
    assert inbox.member == 1, "the activation did not reach the member it was sent to"
    assert rx.sender == a.address and rx.tensor is hidden, "the handle was not handed over as it is"
    assert rx.message.hidden == b"" and sent.nbytes == 0, "a hand-over in the process packed the hidden state"


@pytest.mark.parametrize("wire", ["bf16", "f32"])
def test_a_hand_over_in_another_wire_dtype_gives_the_bits_a_separate_process_would(wire):
    mail, (a, b), _ = _group()
    values = np.random.default_rng(0).standard_normal((1, 1, 64)).astype(np.float16)
    hidden = Hidden(values)
    a.send(b.address, _header(hidden, wire), hidden)
    rx = GroupInbox(mail, [a, b]).receive(0)
    assert rx.tensor is None, f"a {wire} hop handed the fp16 handle over unrounded"
    assert isinstance(rx.message, StageActivation)
    across = codec.unpack_hidden(codec.decode(codec.encode(codec.pack_activation(
        hidden, wire, request_id="r", position=3, is_prefill=False, plan_id="p", epoch=0
    ))))  # fmt: skip
    assert codec.unpack_hidden(rx.message).tobytes() == across.tobytes(), "the hop's bits differ from a socket's"


def test_a_message_to_anyone_outside_the_group_leaves_packed_by_the_members_own_transport():
    _, (a, _b), outside = _group()
    hidden = Hidden(np.ones((1, 1, 4), dtype=np.float16))
    sent = a.send(outside.address, _header(hidden, "f16"), hidden)
    got = outside.receive(1.0)
    assert sent.nbytes > 0 and got.tensor is None, "a message leaving the process was not encoded"
    assert codec.unpack_hidden(got.message).tobytes() == hidden.host().tobytes()


def test_the_group_inbox_takes_its_own_mail_first_then_every_members_transport():
    mail, (a, b), outside = _group()
    outside.send(b.address, NextToken(request_id="r", token_id=1, position=1, done=False, plan_id="p"))
    a.send(b.address, NextToken(request_id="r", token_id=2, position=2, done=False, plan_id="p"))
    inbox = GroupInbox(mail, [a, b])
    first = inbox.receive(0.5)
    second = inbox.receive(0.5)
    assert [first.message.token_id, second.message.token_id] == [2, 1]
    assert second.arrived_ns >= first.arrived_ns
    with pytest.raises(TransportTimeout):
        inbox.receive(0.01)


# --- what a plan may co-locate ------------------------------------------------------------------------------------


def test_consecutive_stages_on_one_device_make_a_plan_that_checks_and_counts_their_memory_together(tiny_graph):
    cluster = implicit_cluster("local", 2)
    doc = chain(tiny_graph, cluster, ["local-0", "local-0", "local-1"], [3, 6])
    check_plan(doc, "colocated.json")
    assert [n.label for n in doc.placement.nodes] == ["stage-0", "stage-1", "stage-2"]
    small = msgspec.structs.replace(
        cluster,
        devices=(msgspec.structs.replace(cluster.devices[0], memory=700_000, reserve=0), cluster.devices[1]),
    )
    with pytest.raises(PlanError, match=r"nodes\[1\].*of the stages beside it"):
        check_plan(chain(tiny_graph, small, ["local-0", "local-0", "local-1"], [3, 6]), "colocated.json")


def test_stages_sharing_a_device_that_are_not_consecutive_on_the_loop_are_refused_with_the_fix(tiny_graph):
    doc = chain(tiny_graph, implicit_cluster("local", 2), ["local-0", "local-1", "local-0"], [3, 6])
    with pytest.raises(PlanError, match=r"colocated\.json: \$\.placement\.nodes\[2\]\.device: .*not consecutive"):
        check_plan(doc, "colocated.json")


def test_a_co_located_plan_under_failover_is_refused_before_anything_starts(tiny_model_path):
    sc = scenario_from_args(num_stages=3, colocated=True)
    sc = msgspec.structs.replace(sc, fault_tolerance=msgspec.structs.replace(sc.fault_tolerance, policy="failover"))
    with pytest.raises(PlanError, match="failover replaces one stage's process"):
        realise_plan(sc, synthetic_source(PRESETS["tiny"]), tiny_model_path)


def test_consecutive_stages_on_one_device_are_one_node_that_serves_them_all(tiny_graph):
    doc = chain(tiny_graph, implicit_cluster("local", 2), ["local-0", "local-0", "local-1"], [3, 6])
    compiled = compile_plan(doc)
    at = Endpoints(seed="tcp://127.0.0.1:1", node_model="m.gguf", transport_opts=[{"k": i} for i in range(3)])
    nodes = realise(scenario_from_args(num_stages=3), compiled, at, trace=False)
    assert [n.name for n in nodes] == ["pp-stage-0-1", "pp-stage-2"]
    assert nodes[0].stages == (0, 1) and nodes[1].stages == ()
    members = json.loads(nodes[0].env[GROUP_ENV])
    assert [m["STAGE"] for m in members] == ["0", "1"]
    assert [json.loads(m["PP_TRANSPORT_OPTS"]) for m in members] == [{"k": 0}, {"k": 1}], "a member lost its keys"
    assert "PLAN" not in nodes[0].env and "PP_TRANSPORT_OPTS" not in nodes[0].env


# --- runs -------------------------------------------------------------------------------------------------------------


def _smoke(*args: str) -> tuple[int, str, str]:
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    r = subprocess.run(
        [sys.executable, "-m", "ppharness.cli.smoke", "--run-label", label, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert labelled_pids(label) == [], "a node outlived the run"
    return r.returncode, r.stdout + r.stderr, label


@pytest.mark.local
def test_three_stages_in_one_process_give_the_unsplit_models_answer_bit_for_bit(tmp_path):
    trace = tmp_path / "trace.json"
    rc, out, _ = _smoke("--num-stages", "3", "--colocated", "--max-tokens", "32", "--trace", str(trace))
    assert rc == 0 and "MATCH" in out, out
    assert "pp-stage-0-2 serving stages 0-2 in one process" in out, out
    records = [msgspec.json.decode(line) for line in trace.with_suffix(".jsonl").read_bytes().splitlines()]
    decode = [r for r in records if r["step"] > 0]
    assert decode and all("hop 0->1" in r["parts_ms"] and "hop 1->2" in r["parts_ms"] for r in decode), (
        "a co-located hop is missing from the trace"
    )


@pytest.mark.local
@pytest.mark.slow  # a second run of processes; the default run keeps to its 12-minute budget
def test_a_plan_mixing_co_located_and_separate_stages_matches_through_pp_smoke_run(tiny_graph, tmp_path):
    doc = chain(tiny_graph, implicit_cluster("local", 2), ["local-0", "local-0", "local-1", "local-1"], [2, 4, 6])
    plan = tmp_path / "mixed.json"
    plan.write_text(pretty(doc))
    rc, out, _ = _smoke("--plan", str(plan), "--max-tokens", "24", "--no-trace")
    assert rc == 0 and "MATCH" in out, out
    assert "serving stages 0-1 in one process" in out and "serving stages 2-3 in one process" in out, out


def test_the_simulator_counts_a_co_located_hand_over_at_its_own_cost_not_a_hops(tiny_graph):
    from ppharness.plan.predict.simulate import simulate

    cluster = msgspec.structs.replace(implicit_cluster("local", 2), hop_ms=0.3, handoff_ms=0.05)
    parts = simulate(chain(tiny_graph, cluster, ["local-0", "local-0", "local-1"], [3, 6])).parts()
    assert parts["hop 0->1"] == 0.05, "the hand-over in one process was priced as a hop between processes"
    assert parts["hop 1->2"] == parts["hop 2->0"] == 0.3


def test_a_decode_given_the_stage_befores_tensor_gives_the_bits_it_gives_for_the_host_array(tiny_gguf):
    """The co-located way in: a hidden state left on the device goes into the step as it is (copied device to device
    into its input buffer; here, on the CPU, through the host) and the step computes the same bytes."""
    from tinygrad.tensor import Tensor

    from ppharness.run.inprocess import load_slices

    first, middle, _ = load_slices(tiny_gguf, [(0, 3), (3, 6), (6, 8)], MAX_CONTEXT)
    ids = [1, 72, 101, 108]
    middle.prefill(first.prefill(ids))
    h = first.decode([33], len(ids))
    as_host = middle.decode(h, len(ids))
    middle.decode(np.zeros_like(h), len(ids))  # the step's input buffer and this position's cache hold other bytes now
    as_tensor = middle.decode(Tensor(np.ascontiguousarray(h)).realize(), len(ids))
    assert isinstance(as_host, np.ndarray) and isinstance(as_tensor, np.ndarray)
    assert as_tensor.tobytes() == as_host.tobytes(), "the device way in changed the step's bytes"


def test_a_request_that_asks_for_no_digests_leaves_none_on_any_stage_and_one_that_does_leaves_them(tiny_gguf):
    """A digest reads the hidden state on the host, which a hand-over left on the device would otherwise never do:
    a request says whether its stages keep them (the first request of a benchmark does, its timed repeats do not)."""
    from ppharness.run.inprocess import InProcessChain, load_slices
    from ppharness.wire.messages import InferenceRequest, InferenceResponse

    slices = load_slices(tiny_gguf, [(0, 4), (4, 8)], MAX_CONTEXT)
    with InProcessChain(tiny_gguf, slices) as chain:
        for rid, digests in (("kept", True), ("none", False)):
            chain.ask(InferenceRequest(chain.client.address, "digests", 4, request_id=rid, digests=digests))
            reply = None
            for _ in range(1000):
                chain.turn(0)
                chain.turn(1)
                reply = chain.reply()
                if reply is not None:
                    break
            assert isinstance(reply, InferenceResponse) and len(reply.token_ids) == 4
        assert len(chain.stages[0].state.digests.get("kept", [])) == 4, "the request that asked kept no digests"
        assert "none" not in chain.stages[0].state.digests, "a request that asked for none left digests"
