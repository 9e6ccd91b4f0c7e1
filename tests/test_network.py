"""WAN emulation at the message level: the fault vocabulary, one link's seeded model, the transport wrapper over the
memory transport, the scenario's ``network:`` section, and (``-m local``) chains of pp-node processes whose links
are delayed, partitioned, paused or killed."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from backends.local import labelled_pids
from ppharness.errors import ScenarioError, TransportTimeout
from ppharness.network.clock import EventClock
from ppharness.network.shaper import LinkShaper, link_rng
from ppharness.network.spec import Bursty, Event, Impairment, Link, Network
from ppharness.scenario.schema import load_scenario, scenario_from_args
from ppharness.wire.messages import Join, Members, Shutdown
from transports.faults import ImpairedTransport
from transports.memory import MemoryHub, MemoryTransport

ROOT = Path(__file__).resolve().parent.parent
WAIT = 5.0


def _fates(spec: Impairment, n: int, seed: int = 7, size: int = 300, gap_s: float = 0.01) -> list[list[float]]:
    shaper = LinkShaper(spec, link_rng(seed, "stage-0", "stage-1"))
    return [shaper.fate(size, k * gap_s) for k in range(n)]


# --- one link's model ----------------------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_fates_and_another_seed_others() -> None:
    spec = Impairment(delay_ms=10, jitter_ms=3, loss=0.2, duplicate=0.1, reorder=0.1)
    assert _fates(spec, 500, seed=1) == _fates(spec, 500, seed=1)
    lost = [k for k, f in enumerate(_fates(spec, 500, seed=1)) if not f]
    assert lost != [k for k, f in enumerate(_fates(spec, 500, seed=2)) if not f]


def test_which_messages_are_lost_does_not_depend_on_timing() -> None:
    spec = Impairment(delay_ms=10, jitter_ms=3, loss=0.3)
    fast = [not f for f in _fates(spec, 300, gap_s=0.0001)]
    slow = [not f for f in _fates(spec, 300, gap_s=1.0)]
    assert fast == slow


def test_a_message_never_arrives_before_its_delay_and_keeps_its_order() -> None:
    fates = _fates(Impairment(delay_ms=25, jitter_ms=10, jitter="normal"), 400)
    arrivals = [f[0] for f in fates]
    for k, at in enumerate(arrivals):
        assert at >= k * 0.01, "a message arrived before it was sent"
    assert arrivals == sorted(arrivals), "a link without reorder delivered out of order"
    mean_delay = sum(at - k * 0.01 for k, at in enumerate(arrivals)) / len(arrivals)
    assert 0.024 <= mean_delay <= 0.032, f"mean one-way delay {mean_delay * 1000:.1f} ms for 25 ms configured"


@pytest.mark.parametrize("jitter", ["uniform", "pareto"])
def test_other_jitter_distributions_stay_around_the_delay(jitter: str) -> None:
    arrivals = [
        f[0] - k * 0.05
        for k, f in enumerate(_fates(Impairment(delay_ms=20, jitter_ms=4, jitter=jitter), 400, gap_s=0.05))
    ]
    assert min(arrivals) >= (0.016 if jitter == "uniform" else 0.020) - 1e-9
    assert 0.019 <= sum(arrivals) / len(arrivals) <= 0.026


def test_random_loss_loses_about_its_share() -> None:
    lost = sum(not f for f in _fates(Impairment(loss=0.05), 20_000))
    assert 0.045 <= lost / 20_000 <= 0.055, f"{lost / 200:.2f} % lost for 5 % configured"


def test_bursty_loss_comes_in_bursts_at_its_steady_rate() -> None:
    spec = Impairment(bursty=Bursty(p=0.01, r=0.2))
    lost = [not f for f in _fates(spec, 40_000)]
    rate = sum(lost) / len(lost)
    assert abs(rate - spec.bursty.steady_loss()) <= 0.01, f"{rate:.4f} lost for {spec.bursty.steady_loss():.4f}"
    runs = [k for k in range(1, len(lost)) if lost[k] and lost[k - 1]]
    assert len(runs) > sum(lost) / 2, "Gilbert-Elliott loss should mostly come in runs"


def test_the_rate_cap_spaces_messages_by_their_size() -> None:
    # 1 Mbit/s: 1250 bytes take 10 ms on the wire; 20 at once leave 10 ms apart
    shaper = LinkShaper(Impairment(rate_mbit=1.0), link_rng(0, "a", "b"))
    arrivals = [shaper.fate(1250, 0.0)[0] for _ in range(20)]
    assert arrivals == pytest.approx([0.01 * (k + 1) for k in range(20)])


def test_a_full_queue_drops_what_does_not_fit() -> None:
    shaper = LinkShaper(Impairment(rate_mbit=1.0, queue_kb=5.0), link_rng(0, "a", "b"))
    fates = [shaper.fate(1250, 0.0) for _ in range(20)]
    assert sum(1 for f in fates if f) <= 6 and shaper.dropped_by_queue >= 14


def test_duplicates_and_held_back_messages() -> None:
    dup = _fates(Impairment(duplicate=1.0), 10)
    assert all(len(f) == 2 for f in dup), "duplicate: 1.0 must deliver every message twice"
    held = _fates(Impairment(delay_ms=1, reorder=1.0, reorder_ms=50), 3, gap_s=0.001)
    assert all(f[0] >= k * 0.001 + 0.051 - 1e-9 for k, f in enumerate(held))


# --- the vocabulary ------------------------------------------------------------------------------------------------


def test_links_override_the_default_and_the_seed_is_not_impaired_unless_named() -> None:
    net = Network(
        default=Impairment(delay_ms=25),
        links=(Link(src="stage-0", dst="stage-1", delay_ms=50), Link(src="stage-2", dst="seed", loss=1.0)),
    )
    assert net.impairment("stage-0", "stage-1").delay_ms == 50
    assert net.impairment("stage-1", "stage-0").delay_ms == 25
    assert net.impairment("seed", "stage-0").perfect
    assert net.impairment("stage-2", "seed").loss == 1.0


def test_a_partition_cuts_both_ways_for_its_interval_only() -> None:
    net = Network(events=(Event(at_s=1.0, kind="partition", nodes=("stage-1",), for_s=2.0),))
    assert not net.cut("stage-0", "stage-1", 0.5)
    assert net.cut("stage-0", "stage-1", 1.0) and net.cut("stage-1", "seed", 2.9)
    assert not net.cut("stage-0", "stage-2", 2.0), "nodes on the same side still talk"
    assert not net.cut("stage-1", "stage-0", 3.0), "the partition heals at at_s + for_s"


@pytest.mark.parametrize(
    "network, needle",
    [
        ("{default: {loss: 1.5}}", "$.network.default.loss"),
        ("{default: {loss: 0.1, bursty: {p: 0.1, r: 0.5}}}", "either loss (random) or bursty"),
        ("{links: [{from: stage-0, to: stage-0}]}", "a link from stage-0 to itself"),
        ("{links: [{from: stage-0, to: stage-1}, {from: stage-0, to: stage-1}]}", "given twice"),
        ("{links: [{from: stage-0, to: stage-9}]}", "stage-9 does not exist in a 3-stage run"),
        ("{links: [{from: node-0, to: stage-1}]}", "$.network.links[0].from"),
        ("{events: [{at_s: 1, kind: kill, nodes: [stage-1], for_s: 2}]}", "a kill is for good"),
        ("{events: [{at_s: 1, kind: pause, nodes: [stage-1]}]}", "a pause needs for_s"),
        ("{events: [{at_s: 1, kind: partition, nodes: [seed], for_s: 1}]}", "the seed (the orchestrator) is never"),
        ("{layer: packet}", "the packet layer impairs iroh's QUIC packets"),
        ("{default: {delay: 5}}", "unknown field 'delay'"),
    ],
)
def test_a_bad_network_section_names_the_path_and_the_fix(tmp_path: Path, network: str, needle: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"version: 1\nstages: {{count: 3}}\nnetwork: {network}\n")
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    assert str(path) in str(err.value) and needle in str(err.value), str(err.value)


def test_pause_and_kill_need_a_provider_that_can(tmp_path: Path) -> None:
    path = tmp_path / "vast.yaml"
    path.write_text(
        "version: 1\nprovider: {kind: vastai}\nnetwork: {events: [{at_s: 1, kind: kill, nodes: [stage-1]}]}\n"
    )
    with pytest.raises(ScenarioError, match=r"network.events\[0\].kind: the vastai provider cannot pause or kill"):
        load_scenario(path)


# --- the transport wrapper -----------------------------------------------------------------------------------------


class _Pair:
    """Two memory endpoints, ``a`` (stage-0) impaired by ``network`` towards ``b`` (stage-1)."""

    def __init__(self, network: Network, clock: EventClock | None = None) -> None:
        hub = MemoryHub()
        self.b = MemoryTransport(hub, "b")
        self.a = ImpairedTransport(MemoryTransport(hub, "a"), network, "stage-0", clock)
        self.a.start()
        self.b.start()
        self.a.learn(self.b.address, "stage-1")

    def close(self) -> None:
        self.a.close()
        self.b.close()


def test_a_delayed_message_arrives_no_earlier_than_its_delay() -> None:
    pair = _Pair(Network(default=Impairment(delay_ms=80)))
    try:
        t0 = time.monotonic()
        pair.a.send(pair.b.address, Shutdown("late"))
        with pytest.raises(TransportTimeout):
            pair.b.recv(0.05)
        assert pair.b.recv(WAIT) == (pair.a.address, Shutdown("late"))
        assert time.monotonic() - t0 >= 0.08
    finally:
        pair.close()


def test_order_is_kept_under_jitter() -> None:
    pair = _Pair(Network(default=Impairment(delay_ms=5, jitter_ms=5)))
    try:
        for k in range(50):
            pair.a.send(pair.b.address, Shutdown(str(k)))
        assert [pair.b.recv(WAIT)[1] for _ in range(50)] == [Shutdown(str(k)) for k in range(50)]
    finally:
        pair.close()


def test_total_loss_delivers_nothing_and_counts_it() -> None:
    pair = _Pair(Network(default=Impairment(loss=1.0)))
    try:
        for _ in range(5):
            pair.a.send(pair.b.address, Shutdown("gone"))
        with pytest.raises(TransportTimeout):
            pair.b.recv(0.2)
        assert pair.a.counters["stage-1"].sent == 5 and pair.a.counters["stage-1"].lost == 5
    finally:
        pair.close()


def test_a_duplicated_message_arrives_twice() -> None:
    pair = _Pair(Network(default=Impairment(duplicate=1.0)))
    try:
        pair.a.send(pair.b.address, Shutdown("twice"))
        assert [pair.b.recv(WAIT)[1] for _ in range(2)] == [Shutdown("twice")] * 2
    finally:
        pair.close()


def test_a_partition_stops_traffic_and_healing_resumes_it() -> None:
    clock = EventClock()
    pair = _Pair(Network(events=(Event(at_s=0.0, kind="partition", nodes=("stage-1",), for_s=0.5),)), clock)
    try:
        pair.a.send(pair.b.address, Shutdown("before the start: no event holds"))
        assert pair.b.recv(WAIT)[1] == Shutdown("before the start: no event holds")
        clock.start(time.time_ns())
        pair.a.send(pair.b.address, Shutdown("cut"))
        with pytest.raises(TransportTimeout):
            pair.b.recv(0.2)
        time.sleep(0.5)
        pair.a.send(pair.b.address, Shutdown("healed"))
        assert pair.b.recv(WAIT)[1] == Shutdown("healed")
        assert pair.a.counters["stage-1"].cut == 1
    finally:
        pair.close()


def test_addresses_of_no_node_are_not_impaired_and_membership_messages_teach_the_rest() -> None:
    hub = MemoryHub()
    net = Network(default=Impairment(loss=1.0))
    with MemoryTransport(hub, "client") as client, MemoryTransport(hub, "s1") as s1:
        seed = ImpairedTransport(MemoryTransport(hub, "seed"), net, "seed")
        node = ImpairedTransport(MemoryTransport(hub, "s0"), net, "stage-0")
        try:
            seed.start()
            node.start()
            node.send(client.address, Shutdown("to a client"))  # not a node: delivered
            assert client.recv(WAIT)[1] == Shutdown("to a client")
            s1.send(
                seed.address,
                Join(stage=1, num_stages=2, address=s1.address, names=["pp-stage-1"], run_label="r", pid=1),
            )
            seed.recv(WAIT)
            seed.send(s1.address, Shutdown("seed -> stage-1: not impaired by default"))
            assert s1.recv(WAIT)[1] == Shutdown("seed -> stage-1: not impaired by default")
            assert seed.counters["stage-1"].sent == 1, "the seed learnt stage-1's address from its Join"
            s1.send(node.address, Members(names={"pp-stage-1": s1.address, "pp-exit": s1.address}))
            node.recv(WAIT)
            node.send(s1.address, Shutdown("stage-0 -> stage-1 loses everything"))
            with pytest.raises(TransportTimeout):
                s1.recv(0.2)
        finally:
            seed.close()
            node.close()


# --- chains of pp-node processes -----------------------------------------------------------------------------------


def _scenario(
    tmp_path: Path, network: Network, n: int = 3, max_tokens: int = 24, transport: str = "zmq", **budget: float
) -> Path:
    sc = scenario_from_args(num_stages=n, max_tokens=max_tokens, transport=transport)
    sc = msgspec.structs.replace(
        sc,
        network=network,
        budget=msgspec.structs.replace(sc.budget, **budget),
        cluster=msgspec.structs.replace(sc.cluster, engine="heartbeat", heartbeat_s=0.5, dead_after_s=3.0),
    )
    path = tmp_path / "wan.yaml"
    path.write_bytes(msgspec.yaml.encode(sc))
    return path


def _smoke(scenario: Path, *extra: str, timeout: float = 300) -> tuple[int, str, float, str]:
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "ppharness.cli.smoke", "--scenario", str(scenario), "--run-label", label, *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert labelled_pids(label) == [], "a node outlived the run"
    return r.returncode, r.stdout + r.stderr, time.monotonic() - t0, label


@pytest.mark.local
@pytest.mark.slow  # 20-40 s; the default run keeps to its 12-minute budget, .ci/run runs it with -m slow
def test_a_delayed_chain_gives_the_oracles_tokens_and_its_hops_take_the_delay(tmp_path: Path) -> None:
    net = Network(seed=3, default=Impairment(delay_ms=20, jitter_ms=2))
    trace = tmp_path / "trace.json"
    rc, out, _, _ = _smoke(_scenario(tmp_path, net), "--trace", str(trace))
    assert rc == 0 and "MATCH" in out, out
    records = [msgspec.json.decode(line) for line in trace.with_suffix(".jsonl").read_bytes().splitlines()]
    hops = sorted(r["parts_ms"]["hop 0->1"] for r in records if r["step"] > 0)
    assert hops[len(hops) // 2] >= 19.0, f"hop 0->1 p50 {hops[len(hops) // 2]:.1f} ms under a 20 ms link"


@pytest.mark.local
@pytest.mark.slow  # two runs, one waiting for a kill to be noticed: .ci/run runs it with -m slow
def test_a_short_pause_is_survived_and_a_kill_ends_the_run_cleanly(tmp_path: Path) -> None:
    # both faults start with the request: a chain that decodes 48 tokens in 0.2 s still meets them
    pause = Network(events=(Event(at_s=0.0, kind="pause", nodes=("stage-1",), for_s=1.0),))
    rc, out, _, _ = _smoke(_scenario(tmp_path, pause, max_tokens=48), "--no-trace")
    assert rc == 0 and "MATCH" in out, out
    assert "network event at" in out and "pause stage-1" in out and "resume stage-1" in out, out
    kill = Network(events=(Event(at_s=0.0, kind="kill", nodes=("stage-2",)),))
    rc, out, _, _ = _smoke(_scenario(tmp_path, kill, max_tokens=200), "--no-trace")
    assert rc == 1 and "kill stage-2" in out, out
    assert "FAILED: pp-stage-2 (local" in out and "exited with code -9" in out, out


@pytest.mark.local
@pytest.mark.slow  # a run that waits for membership to give up on a stage: .ci/run runs it with -m slow
def test_a_partitioned_stage_is_declared_dead_by_membership_within_its_timeout(tmp_path: Path) -> None:
    net = Network(events=(Event(at_s=0.2, kind="partition", nodes=("stage-1",), for_s=60.0),))
    rc, out, took, _ = _smoke(_scenario(tmp_path, net, max_tokens=200, total_s=200.0), "--no-trace")
    assert rc == 1 and "FAILED: pp-stage-1 died while decoding" in out, out
    assert took < 150, f"the partition was noticed only after {took:.0f} s"


@pytest.mark.local
@pytest.mark.slow  # a run that waits out its budget: .ci/run runs it with -m slow
def test_a_lost_message_without_retries_ends_the_run_with_a_reason_not_a_hang(tmp_path: Path) -> None:
    net = Network(links=(Link(src="stage-1", dst="stage-2", loss=1.0),))
    rc, out, took, _ = _smoke(_scenario(tmp_path, net, total_s=45.0), "--no-trace", timeout=200)
    assert rc == 1 and "FAILED: " in out, out
    assert "does not retry them" in out, out
    assert took < 120


@pytest.mark.local
@pytest.mark.slow  # a chain through the packet layer's bridges under loss
def test_iroh_under_packet_loss_gives_the_oracles_tokens_and_no_path_goes_around_the_emulation(tmp_path: Path) -> None:
    """The packet layer: 5 % of QUIC datagrams lost on every stage link, 10 ms each way. QUIC recovers what is lost;
    every hop takes at least the link's delay (a hop faster than that went around the bridges)."""
    net = Network(seed=5, layer="packet", default=Impairment(delay_ms=10, loss=0.05))
    trace = tmp_path / "trace.json"
    rc, out, _, _ = _smoke(_scenario(tmp_path, net, transport="iroh"), "--trace", str(trace))
    assert rc == 0 and "MATCH" in out, out
    records = [msgspec.json.decode(line) for line in trace.with_suffix(".jsonl").read_bytes().splitlines()]
    for hop in ("hop 0->1", "hop 1->2", "hop 2->0"):
        # the last token's way back to stage 0 may still be crossing its link when the trace is collected
        times = [r["parts_ms"][hop] for r in records if r["step"] > 0 and hop in r["parts_ms"]]
        assert len(times) >= len(records) - 2, f"{hop} is missing from the trace of most tokens"
        assert min(times) >= 9.5, f"{hop} took {min(times):.2f} ms under a 10 ms link: a path bypassed the emulation"


def test_a_partition_cuts_off_the_nodes_it_began_on_not_a_spare_that_took_one_s_place():
    from ppharness.network.spec import Event, Network

    net = Network(events=(Event(at_s=1.0, kind="partition", nodes=("stage-0",), for_s=3.0),))
    assert net.cut("stage-0", "stage-1", 2.0), "the partitioned node is not cut off"
    assert not net.cut("stage-0", "stage-1", 2.0, src_since=1.5), "a spare that became stage-0 later is cut off"
    assert not net.cut("stage-1", "stage-0", 2.0, dst_since=1.5), "messages to the spare are cut off"
    assert net.cut("stage-1", "stage-0", 2.0, dst_since=0.5), "a node that was stage-0 before the partition escapes it"
