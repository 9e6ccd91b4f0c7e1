"""Roles bound to keys: a member holding a real key of the run speaks only for its own role.

Every forgery below is sent with a member's real key (stage 2's ZeroMQ endpoint, built with the run's
``plan_endpoints`` like every endpoint of a run): the transport lets it through, as it must; the orchestrator and the
nodes drop it because the role it claims is held by another address. The seed's side runs on a real ``Chain`` whose
session is wired to these endpoints instead of provisioned nodes; the node's side on its own loop. And a local node
inherits no secret of the orchestrator's environment.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from backends import local
from backends.local import LocalProvider, node_environment
from backends.vastai.rentals import node_env as rented_node_env
from ppharness.errors import ClusterError, StageError, WaitTimedOut
from ppharness.model.decode.oracle import oracle_decode
from ppharness.network.clock import EventClock
from ppharness.plan.stages import ENTRY, EXIT, StagePlan, stage_name
from ppharness.run.loop import Loop
from ppharness.run.membership import HeartbeatDetector
from ppharness.run.node.members import needed_names, resolve_members
from ppharness.run.node.node import Node, Standing
from ppharness.run.seed.directory import Directory
from ppharness.run.seed.orchestrator import Chain
from ppharness.run.seed.roles import Identities, Roles, member_role, spare_role
from ppharness.run.seed.session import Standby
from ppharness.scenario.schema import scenario_from_args
from ppharness.seams.provider import NodeSpec
from ppharness.trace.drops import MAX_DROP_LINES, fingerprinted
from ppharness.wire.messages import (
    ClockReply,
    DigestReport,
    DigestRequest,
    Error,
    Heartbeat,
    InferenceResponse,
    Join,
    Members,
    Ready,
    StageActivation,
    Stopped,
    StreamedToken,
    TraceReport,
)
from transports.zmq import ZmqTransport

N = 5  # stages of the run under test; stage 2 holds the forger's key, stage 4 is the exit
SPARE = "local-4"  # the standby spare's device
WAIT = 5.0


def _join(i: int, t: ZmqTransport, n: int = N) -> Join:
    names = [stage_name(i)] + ([ENTRY] if i == 0 else []) + ([EXIT] if i == n - 1 else [])
    return Join(stage=i, num_stages=n, address=t.address, names=names, run_label="pp-test", pid=1)


class Run:
    """A seed and its stages' endpoints (one run's keys from ``plan_endpoints``), the seed's session wired to them as
    after every stage joined; ``lines`` are the run's progress lines."""

    def __init__(self) -> None:
        opts = ZmqTransport.plan_endpoints(N + 2, {})  # the seed, N stages, a spare
        self.seed = ZmqTransport(**opts[0])
        self.stages = [ZmqTransport(**o) for o in opts[1 : N + 1]]
        self.spare = ZmqTransport(**opts[N + 1])
        for t in (self.seed, *self.stages, self.spare):
            t.start()
        self.lines: list[str] = []
        scenario = scenario_from_args(num_stages=N, transport="zmq")
        self.chain = Chain(scenario, progress=self.lines.append, run_label=f"pp-test-{uuid.uuid4().hex[:8]}")
        s = self.session = self.chain.session
        s.transport, s.seed, s.loop = self.seed, self.seed.address, Loop(self.seed, self.lines.append)
        s.provider = SimpleNamespace()  # no nodes: the stages are this test's endpoints
        s.plan = SimpleNamespace(num_stages=N, plan_id="plan-roles")
        s.directory = Directory(N)
        for i, t in enumerate(self.stages):
            s.directory.add(_join(i, t))
        s.identities = Identities(ZmqTransport.identity, ZmqTransport.identity_of)  # as ``Session.open`` binds them
        for i, o in enumerate(opts[1 : N + 1]):
            s.identities.give(member_role(i), o)
        s.identities.give(spare_role(SPARE), opts[N + 1])
        s.standbys = {SPARE: Standby(SimpleNamespace(id="spare-instance", name="pp-spare-0"))}

    @property
    def forger(self) -> ZmqTransport:
        return self.stages[2]

    def dropped(self, kind: str) -> list[str]:
        return [ln for ln in self.lines if f"dropped {kind} from {fingerprinted(self.forger.address)}" in ln]

    def pump(self, until, timeout: float = WAIT, seen: list | None = None) -> None:
        """Turn the session's loop (its real handler) until ``until()``; what reaches the wait's own handler is
        appended to ``seen``."""

        def on_message(sender, msg) -> bool:
            if seen is not None:
                seen.append((sender, msg))
            return False

        try:
            self.session.wait(on_message, timeout, "the test's messages", "testing", done=until)
        except WaitTimedOut:
            pass

    def close(self) -> None:
        for t in (self.seed, *self.stages, self.spare):
            t.close()


@pytest.fixture
def run():
    r = Run()
    yield r
    r.close()


def _response(text: str) -> InferenceResponse:
    return InferenceResponse(
        request_id="r1", text=text, token_ids=[1, 2], prompt_tokens=3, token_times=[0.0, 0.1], finish_reason="length"
    )


def test_a_response_counts_only_from_the_exit_stage(run):
    run.forger.send(run.seed.address, _response("FORGED BY STAGE 2"))
    run.pump(lambda: run.dropped("InferenceResponse") or "r1" in run.chain.client.responses)
    run.stages[4].send(run.seed.address, _response("the exit's answer"))
    run.pump(lambda: "r1" in run.chain.client.responses)
    assert run.chain.client.responses["r1"].text == "the exit's answer", "a stage that is not the exit answered"
    assert any("only the exit stage (pp-exit) sends it" in ln for ln in run.dropped("InferenceResponse")), run.lines


def test_a_streamed_token_counts_only_from_the_exit_stage(run):
    forged = StreamedToken(request_id="r1", token_id=666, position=3, done=False, plan_id="plan-roles")
    run.forger.send(run.seed.address, forged)
    run.pump(lambda: run.dropped("StreamedToken") or "r1" in run.chain.client.streams)
    assert "r1" not in run.chain.client.streams, "a token streamed by a stage that is not the exit was taken"
    run.stages[4].send(run.seed.address, StreamedToken(request_id="r1", token_id=7, position=3, done=False, plan_id=""))
    run.pump(lambda: "r1" in run.chain.client.streams)
    assert run.chain.client.streams["r1"][3][0] == 7


def test_an_error_blaming_another_stage_is_dropped_and_its_own_fails_the_run(run):
    run.forger.send(run.seed.address, Error(stage=4, reason="forged failure"))
    run.pump(lambda: bool(run.dropped("Error")))  # today's code raised StageError("stage 4: forged failure") here
    assert any("only stage 4 sends it" in ln for ln in run.dropped("Error")), run.lines
    run.stages[4].send(run.seed.address, Error(stage=4, reason="out of memory"))
    with pytest.raises(StageError, match="stage 4: out of memory"):
        run.pump(lambda: False)
    run.forger.send(run.seed.address, Error(stage=2, reason="its own failure"))  # stage 2 speaks for itself
    with pytest.raises(StageError, match="stage 2: its own failure"):
        run.pump(lambda: False)


def test_a_busy_refusal_counts_only_from_stage_0(run):
    client = run.chain.client
    client.active = SimpleNamespace(request_id="r1")
    run.forger.send(run.seed.address, Error(stage=0, reason="busy", request_id="r1", busy=True))
    run.pump(lambda: bool(run.dropped("Error")) or client.active is None)
    assert client.active is not None and "r1" not in client._refused, "stage 2 refused stage 0's request"
    run.stages[0].send(run.seed.address, Error(stage=0, reason="busy", request_id="r1", busy=True))
    run.pump(lambda: client.active is None)
    assert "r1" in client._refused, "stage 0's own refusal was not taken"


REPORTS = {
    "Ready": lambda k: Ready(stage=k, params=1, tied_params=0, load_s=0.1, rss_bytes=1),
    "DigestReport": lambda k: DigestReport(stage=k, request_id="r1", digests=[b"d"]),
    "ClockReply": lambda k: ClockReply(stage=k, t_seed_ns=1, t_node_ns=2),
    "TraceReport": lambda k: TraceReport(stage=k, request_id="r1", spans=[]),
    "Heartbeat": lambda k: Heartbeat(stage=k, seq=1),
    "Stopped": lambda k: Stopped(stage=k, served=1, peak_rss_bytes=1),
}


@pytest.mark.parametrize("kind", sorted(REPORTS))
def test_a_report_counts_only_from_the_stage_it_names(run, kind):
    seen: list = []
    run.forger.send(run.seed.address, REPORTS[kind](4))
    run.pump(lambda: bool(run.dropped(kind) or seen), seen=seen)
    assert not seen, f"a {kind} of stage 4 sent by stage 2 was taken"
    assert run.dropped(kind), f"the forged {kind} was not logged"
    run.stages[4].send(run.seed.address, REPORTS[kind](4))
    run.pump(lambda: bool(seen), seen=seen)
    assert seen == [(run.stages[4].address, REPORTS[kind](4))]


def test_forged_heartbeats_keep_no_dead_stage_alive(run):
    now = [0.0]
    detector = run.session.detector = HeartbeatDetector(N, 0.1, 2, 0.5, clock=lambda: now[0])
    detector.watch(list(range(N)))
    detector.loading.clear()  # every stage reported Ready
    now[0] = 1.0
    run.forger.send(run.seed.address, Heartbeat(stage=4, seq=9))
    run.forger.send(run.seed.address, Heartbeat(stage=2, seq=9))
    run.pump(lambda: detector.last_seen[2] == 1.0)
    assert [s for s, _ in detector.dead()] == [0, 1, 3, 4], "stage 2's beats kept stage 4 alive"


def test_a_forged_digest_report_is_not_in_the_verdicts_digests(run):
    """The observer asks every stage; stage 2 answers for stage 4 at once, stage 4 itself a little later."""

    def stages() -> None:
        for i, t in enumerate(run.stages):
            _, msg = t.recv(WAIT)
            assert isinstance(msg, DigestRequest)
            if i == 2:
                t.send(run.seed.address, DigestReport(stage=4, request_id="r1", digests=[b"forged"]))
            if i != 4:
                t.send(run.seed.address, DigestReport(stage=i, request_id="r1", digests=[b"real"]))
        time.sleep(0.5)
        run.stages[4].send(run.seed.address, DigestReport(stage=4, request_id="r1", digests=[b"real"]))

    helper = threading.Thread(target=stages)
    helper.start()
    try:
        digests = run.chain.observer.collect_digests("r1")
    finally:
        helper.join()
    assert digests == {i: [b"real"] for i in range(N)}


def test_after_a_failover_the_spare_holds_the_stage(run):
    old = run.stages[3]
    run.session.directory.replace(
        Join(stage=3, num_stages=N, address=run.spare.address, names=["pp-stage-3"], run_label="pp-test", pid=2)
    )
    seen: list = []
    old.send(run.seed.address, Ready(stage=3, params=1, tied_params=0, load_s=0.1, rss_bytes=1))
    run.pump(lambda: bool(seen or [ln for ln in run.lines if "dropped Ready" in ln]), seen=seen)
    assert not seen, "the replaced node still speaks for stage 3"
    run.spare.send(run.seed.address, Ready(stage=3, params=1, tied_params=0, load_s=0.1, rss_bytes=1))
    run.pump(lambda: bool(seen), seen=seen)
    assert [sender for sender, _ in seen] == [run.spare.address]


def test_a_join_naming_another_address_registers_nothing(run):
    del run.session.directory.joins[3]
    del run.session.directory.names["pp-stage-3"]
    run.forger.send(run.seed.address, _join(3, run.stages[3]))  # stage 2 joins stage 3's address under its name
    with pytest.raises(ClusterError, match="never resolved"):
        run.session.resolve("pp-stage-3", 1.0)
    run.stages[3].send(run.seed.address, _join(3, run.stages[3]))
    assert run.session.resolve("pp-stage-3", WAIT) == run.stages[3].address


def test_a_member_cannot_take_a_standby_spares_place(run):
    """Stage 2's key announces itself as the spare before the spare does: refused, so the seed's Warm and Assign for
    that spare can only go to the key the run made for it, whose Join is then taken."""
    impostor = Join(stage=-1, num_stages=0, address=run.forger.address, names=[f"spare:{SPARE}"], run_label="x", pid=9)
    run.forger.send(run.seed.address, impostor)
    run.pump(lambda: any("ignored a Join as standby spare:" in ln for ln in run.lines))
    assert run.session.standbys[SPARE].address == "", "a member's key stands by as the spare"
    refused = [ln for ln in run.lines if "ignored a Join as standby spare:" in ln]
    assert refused and fingerprinted(run.forger.address) in refused[0] and "another key" in refused[0], run.lines
    real = Join(stage=-1, num_stages=0, address=run.spare.address, names=[f"spare:{SPARE}"], run_label="x", pid=10)
    run.spare.send(run.seed.address, real)
    run.pump(lambda: run.session.standbys[SPARE].address != "")
    assert run.session.standbys[SPARE].address == run.spare.address
    assert sum(f"spare {SPARE} standing by" in ln for ln in run.lines) == 1


def test_a_member_cannot_join_as_another_stage_an_expert_node_or_a_spare_it_is_not(run):
    s = run.session
    assert s.join_ok(run.stages[3].address, _join(3, run.stages[3]))
    assert not s.join_ok(run.forger.address, _join(3, run.forger)), "stage 2's key joined as stage 3"
    assert not s.join_ok(run.forger.address, _join(N, run.forger, n=N)), "stage 2's key joined as an expert node"
    other_spare = Join(
        stage=-1, num_stages=0, address=run.spare.address, names=["spare:elsewhere"], run_label="x", pid=1
    )
    assert not s.join_ok(run.spare.address, other_spare), "the spare's key joined as another spare"
    lines = [ln for ln in run.lines if "ignored a Join" in ln]
    assert "as stage 3" in lines[0] and "the run made another key for it" in lines[0], lines
    assert f"as stage {N}" in lines[1] and "the run made no member for it" in lines[1], lines
    assert "standby spare:elsewhere" in lines[2] and "made no member for it" in lines[2], lines


def test_one_address_joins_as_one_stage():
    directory = Directory(3)
    directory.add(Join(stage=1, num_stages=3, address="tcp://a?curve=1", names=["pp-stage-1"], run_label="r", pid=1))
    with pytest.raises(ClusterError, match="stage 2 joined from tcp://a.curve=1, the address stage 1 joined from"):
        directory.add(
            Join(stage=2, num_stages=3, address="tcp://a?curve=1", names=["pp-stage-2"], run_label="r", pid=1)
        )
    assert "pp-stage-2" not in directory.names
    directory.add(Join(stage=2, num_stages=3, address="tcp://b?curve=2", names=["pp-stage-2"], run_label="r", pid=1))
    with pytest.raises(ClusterError, match="stage 2 joined from tcp://a.curve=1, the address stage 1 joined from"):
        directory.replace(  # stage 1 posing as the spare that replaces stage 2
            Join(stage=2, num_stages=3, address="tcp://a?curve=1", names=["pp-stage-2"], run_label="r", pid=1)
        )
    assert directory.names["pp-stage-2"] == "tcp://b?curve=2"


def test_an_expert_node_speaks_for_itself_only():
    directory = Directory(2, expert_nodes=1)
    for i in range(3):
        directory.add(Join(stage=i, num_stages=2, address=f"addr-{i}", names=[f"n{i}"], run_label="r", pid=1))
    lines: list[str] = []
    roles = Roles(lambda: directory, lines.append)
    assert roles.admits("addr-2", Ready(stage=2, params=1, tied_params=0, load_s=0.1, rss_bytes=1))
    assert not roles.admits("addr-1", Ready(stage=2, params=1, tied_params=0, load_s=0.1, rss_bytes=1))
    assert "only expert node 0 sends it" in lines[-1]


def test_forgeries_are_logged_a_bounded_number_of_times():
    directory = Directory(2)
    for i in range(2):
        directory.add(Join(stage=i, num_stages=2, address=f"addr-{i}", names=[f"n{i}"], run_label="r", pid=1))
    lines: list[str] = []
    roles = Roles(lambda: directory, lines.append)
    for k in range(5000):
        assert not roles.admits("addr-0", Heartbeat(stage=1, seq=k))
    assert roles.drop.dropped == 5000
    assert len(lines) == MAX_DROP_LINES + 2, lines[MAX_DROP_LINES - 1 :]  # then a count at 100 and 1000
    assert lines[-1].startswith("1000 messages dropped so far")


# --- the node's side: the directory only from the seed --------------------------------------------------------------


@pytest.fixture
def node_side():
    opts = ZmqTransport.plan_endpoints(N + 1, {})
    ts = [ZmqTransport(**o) for o in opts]
    for t in ts:
        t.start()
    yield ts[0], ts[1:]
    for t in ts:
        t.close()


def _names(stages: list[ZmqTransport]) -> dict[str, str]:
    names = {stage_name(i): t.address for i, t in enumerate(stages)}
    return names | {ENTRY: stages[0].address, EXIT: stages[-1].address}


def test_a_node_takes_the_directory_only_from_the_seed(node_side):
    seed, stages = node_side
    node, forger = stages[3], stages[2]
    plan = StagePlan(plan_id="p", stage=3, num_stages=N, lo=3, hi=4)
    forger.send(node.address, Members(names=dict.fromkeys(_names(stages), forger.address)))  # everything to stage 2
    forger.send(node.address, Members(names={}))
    seed.send(node.address, Members(names={ENTRY: stages[0].address}))  # the seed's, but lacking what stage 3 needs
    sender = threading.Timer(0.5, lambda: seed.send(node.address, Members(names=_names(stages))))
    sender.start()
    lines: list[str] = []
    try:
        found = resolve_members(Loop(node, lines.append), WAIT, seed.address, needed_names(plan), lines.append)
    finally:
        sender.join()
    assert found == _names(stages), "the node took a directory the seed did not send"
    assert sum(f"dropped Members from {forger.address}" in ln and "only the seed" in ln for ln in lines) == 2, lines
    assert any("names no address for" in ln and "pp-stage-2" in ln and "pp-stage-4" in ln for ln in lines), lines


def test_a_node_refuses_a_later_directory_lacking_its_neighbours(node_side):
    seed, stages = node_side
    node = stages[4]
    plan = StagePlan(plan_id="p", stage=4, num_stages=N, lo=4, hi=5, epoch=0)
    taken: list[tuple[dict[str, str], int]] = []
    lines: list[str] = []
    n = Node(plan, {"SEED_ADDR": seed.address}, Standing(node, node.address, EventClock(), None), lines.append)
    n.served = SimpleNamespace(rejoin=lambda names, epoch: taken.append((names, epoch)))
    lacking = {k: v for k, v in _names(stages).items() if k != "pp-stage-3"}
    n._on_message(seed.address, Members(names=lacking, epoch=1), None)  # today's code: KeyError 'pp-stage-3'
    n._on_message(stages[2].address, Members(names=_names(stages), epoch=1), None)
    assert taken == [], "a directory without the previous stage, or not from the seed, was taken"
    assert any("names no address for pp-stage-3" in ln for ln in lines), lines
    assert any("dropped Members" in ln for ln in lines), lines
    n._on_message(seed.address, Members(names=_names(stages), epoch=1), None)
    assert taken == [(_names(stages), 1)]


def test_an_expert_node_needs_the_stages_it_answers_for():
    plan = StagePlan(plan_id="p", stage=3, num_stages=2, lo=0, hi=0, role="experts", owners={1: "pp-stage-1"})
    assert needed_names(plan) == ["pp-stage-1"]
    first = StagePlan(plan_id="p", stage=0, num_stages=2, lo=0, hi=1, next="pp-stage-1")
    assert sorted(needed_names(first)) == sorted([ENTRY, EXIT, "pp-stage-1"])


# --- secrets --------------------------------------------------------------------------------------------------------

SECRETS = {
    "VAST_API_KEY": "vast-secret",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
    "GITHUB_TOKEN": "gh-secret",
    "HF_TOKEN": "hf-secret",
    "DATABASE_PASSWORD": "db-secret",
    "OPENAI_API_KEY": "oa-secret",
}


def test_a_node_inherits_only_what_it_reads(monkeypatch):
    monkeypatch.setattr(local, "device_env", dict)  # no device probe
    parent = {
        **SECRETS,
        "PATH": "/usr/bin",
        "LC_ALL": "C",
        "CACHEDB": "/c.db",
        "CUDA_VISIBLE_DEVICES": "1",
        "BEAM": "2",
    }
    parent |= {"PPHARNESS_KERNELS": "/k.json", "PYTHONPATH": "/p", "EDITOR": "vi"}
    env = node_environment({"STAGE": "0", "PP_GOSSIP_KEY": "the run's"}, parent)
    assert not set(SECRETS) & set(env), "a secret of the orchestrator's environment reached a node"
    assert "EDITOR" not in env
    for name in ("PATH", "LC_ALL", "CACHEDB", "CUDA_VISIBLE_DEVICES", "BEAM", "PPHARNESS_KERNELS", "PYTHONPATH"):
        assert env[name] == parent[name], f"{name} did not reach the node"
    assert env["STAGE"] == "0" and env["PP_GOSSIP_KEY"] == "the run's"


def test_a_local_nodes_process_holds_no_secret_of_the_orchestrators(monkeypatch, tmp_path: Path):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(local, "device_env", dict)  # no device probe
    env = {"PP_STANDBY": "spare-x", "SEED_ADDR": "tcp://127.0.0.1:9", "MODEL": "/nonexistent.gguf", "TRANSPORT": "zmq"}
    with LocalProvider(f"pp-test-{uuid.uuid4().hex[:8]}", log_dir=tmp_path) as provider:
        (inst,) = provider.provision([provider.spec("pp-spare-0", env)])
        deadline, names = time.monotonic() + 10, set()
        while "PP_STANDBY" not in names and time.monotonic() < deadline:  # read once the node's program runs
            environ = Path(f"/proc/{inst.id}/environ").read_bytes().split(b"\0")
            names = {entry.split(b"=", 1)[0].decode() for entry in environ if entry}
            if not names:
                time.sleep(0.01)
    assert "PP_STANDBY" in names and "PATH" in names, names
    assert not set(SECRETS) & names, f"the node's environment holds {sorted(set(SECRETS) & names)}"


def test_a_rented_node_gets_only_its_specs_environment(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    env = rented_node_env(NodeSpec(name="pp-stage-0", env={"STAGE": "0"}), 7000)
    assert not set(SECRETS) & set(env), "a secret of the orchestrator's environment went into a rental's"


# --- a live run: a member's key, read from its node's environment ---------------------------------------------------


def _member_key(chain: Chain, stage: int) -> dict:
    """The transport options (its real key) of ``stage``'s node, read from the node's environment as an adversary
    on its machine would."""
    environ = Path(f"/proc/{chain.stage_instances[stage].id}/environ").read_bytes().split(b"\0")
    opts = dict(e.decode().split("=", 1) for e in environ if e.startswith(b"PP_TRANSPORT_OPTS="))
    return json.loads(opts["PP_TRANSPORT_OPTS"])


@pytest.mark.slow
@pytest.mark.local
def test_stage_2s_key_forges_nothing_in_a_live_five_stage_run(tiny_model_path):
    """The probe: an adversary holding stage 2's real key (its node's PP_TRANSPORT_OPTS) sends the orchestrator a
    forged answer and an Error blaming stage 4 while a request runs, and the nodes directories naming it for every
    name; the run answers exactly as the unsplit model does."""
    scenario = scenario_from_args(num_stages=N, transport="zmq", max_tokens=12, prompt="forged")
    lines: list[str] = []
    with Chain(scenario, progress=lines.append, run_label=f"pp-test-{uuid.uuid4().hex[:8]}") as chain:
        forger = ZmqTransport(**_member_key(chain, 2))
        forger.start()
        stop = threading.Event()

        def forge() -> None:
            while not stop.is_set() and chain.client.active is None:
                time.sleep(0.005)
            active = chain.client.active
            if active is not None:
                forged = _response("FORGED BY STAGE 2")
                forger.send(chain.seed, msgspec.structs.replace(forged, request_id=active.request_id))
                forger.send(chain.seed, Error(stage=4, reason="forged failure"))
            everything = dict.fromkeys(chain.directory.names, forger.address)
            for j in chain.directory.joins.values():
                forger.send(j.address, Members(names=everything, epoch=1))
                forger.send(j.address, Members(names={}, epoch=1))

        helper = threading.Thread(target=forge)
        helper.start()
        try:
            response, _ = chain.request("forged", 12)
        finally:
            stop.set()
            helper.join()
            forger.close()
        oracle = oracle_decode(tiny_model_path, "forged", 12, scenario.model.max_context, boundaries=True)
        verdict = chain.verdict(response, oracle)
        assert verdict.exact, verdict.describe(response.token_ids, oracle.token_ids)
    assert any(f"dropped InferenceResponse from {fingerprinted(forger.address)}" in ln for ln in lines), lines
    assert any(f"dropped Error from {fingerprinted(forger.address)}" in ln for ln in lines), lines


@pytest.mark.slow
@pytest.mark.local
def test_stage_1s_key_pushing_positions_past_the_context_ends_the_run_naming_it(tiny_model_path):
    """Within its role: an adversary holding stage 1's key and speaking as stage 1 (its address) sends stage 2 an
    activation of the live request past the request's end. Stage 2 refuses it and the run ends naming pp-stage-1,
    instead of an answer nobody blames."""
    scenario = scenario_from_args(num_stages=N, transport="zmq", max_tokens=200, prompt="pushed")
    lines: list[str] = []
    with Chain(scenario, progress=lines.append, run_label=f"pp-test-{uuid.uuid4().hex[:8]}") as chain:
        stage_1 = chain.directory.joins[1].address
        port = int(stage_1.split("?")[0].rsplit(":", 1)[1])
        forger = ZmqTransport(**_member_key(chain, 1), advertise_port=port)
        forger.start()
        assert forger.address == stage_1, "the adversary does not speak as stage 1"
        stop = threading.Event()

        def push() -> None:
            while not stop.is_set() and chain.client.active is None:
                time.sleep(0.005)
            active = chain.client.active
            if active is not None:
                time.sleep(0.3)  # the request is open on every stage
                far = scenario.model.max_context + 5
                pushed = StageActivation(
                    request_id=active.request_id,
                    position=far,
                    hidden=bytes(16),
                    seq_len=1,
                    is_prefill=False,
                    shape=(1, 1, 8),
                    dtype="f16",
                    plan_id=chain.plan.plan_id,
                )
                forger.send(chain.directory.joins[2].address, pushed)

        helper = threading.Thread(target=push)
        helper.start()
        try:
            with pytest.raises(StageError) as failed:
                chain.request("pushed", 200)
        finally:
            stop.set()
            helper.join()
            forger.close()
    said = str(failed.value)
    assert said.startswith("stage 2: refused an activation") and "from pp-stage-1" in said, said
    assert "past the request's end" in said, said
