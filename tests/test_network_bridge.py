"""The packet layer's bridge (``ppharness.network.bridge``) and its calibration (``ppharness bench wan``).

Most tests put two or three bridges in this network namespace, each node with ports of its own from ``plan_ports``
and the Unix sockets in a temporary folder: an endpoint socket bound on a node's quic port sends to
127.0.0.1:<a peer's virtual port> (its own bridge, standing for the peer), and the peer's endpoint socket, bound on
the peer's quic port, receives. The last test puts one node in a network namespace of its own, as a run does. Timing
is asserted strictly from below (nothing arrives before its delay, no cap is beaten) and generously from above, so
that a busy machine slows the tests without failing them.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ppharness.benchmarks.wan import calibrate, quick_cases, table, write_json
from ppharness.network.bridge import NAME_BYTES, Bridge, socket_path
from ppharness.network.clock import EventClock
from ppharness.network.datagram import enable_timestamps, recv_stamped
from ppharness.network.packet import PortTable, encode_ports, plan_ports
from ppharness.network.spec import Event, Impairment, Link, Network

A, B, C = "stage-0", "stage-1", "stage-2"
HOST = "127.0.0.1"
HEADER = struct.Struct("!Id")  # sequence number, send time (time.monotonic())
WAIT = 5.0  # the most any test waits for a datagram that should come


@pytest.fixture
def ports() -> PortTable:
    return plan_ports([A, B])


@pytest.fixture
def sockdir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="pp-bridge-")  # short: a Unix socket's path has at most 107 bytes
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _bridges(
    network: Network,
    ports: PortTable,
    directory: str,
    nodes: tuple[str, ...] = (A, B),
    clock: EventClock | None = None,
    hosts: dict[str, str] | None = None,
    **kw: int,
) -> Iterator[dict[str, Bridge]]:
    """Started bridges for ``nodes``, on ``hosts[node]`` (default 127.0.0.1), closed at the end."""
    hosts = hosts or {}
    with contextlib.ExitStack() as stack:
        yield {
            node: stack.enter_context(Bridge(network, node, ports, directory, clock, host=hosts.get(node, HOST), **kw))
            for node in nodes
        }


@contextlib.contextmanager
def _endpoints(
    ports: PortTable, nodes: tuple[str, ...] = (A, B), hosts: dict[str, str] | None = None
) -> Iterator[dict[str, socket.socket]]:
    """A socket per node, bound on its quic port, stamping what it receives."""
    hosts = hosts or {}
    with contextlib.ExitStack() as stack:
        out = {}
        for node in nodes:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2**20)
            sock.bind((hosts.get(node, HOST), ports[node][0]))
            enable_timestamps(sock)
            out[node] = sock
        yield out


def _virtual(ports: PortTable, node: str) -> tuple[str, int]:
    return HOST, ports[node][1]


def _send(sock: socket.socket, to: tuple[str, int], seqs: range, size: int = 64) -> None:
    for seq in seqs:
        sock.sendto(HEADER.pack(seq, time.monotonic()).ljust(size, b"."), to)


def _receive(
    sock: socket.socket, count: int | None = None, within: float = WAIT
) -> list[tuple[int, float, float, tuple[str, int]]]:
    """(sequence number, send time, arrival time, source) of what arrives, times on ``time.monotonic()``'s clock:
    until ``count`` came or ``within`` s passed (when ``count`` is None, for all of ``within``)."""
    got: list[tuple[int, float, float, tuple[str, int]]] = []
    deadline = time.monotonic() + within
    while (count is None or len(got) < count) and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data, source, arrived = recv_stamped(sock)
        except TimeoutError:
            break
        seq, sent = HEADER.unpack_from(data)
        got.append((seq, sent, arrived, (str(source[0]), int(source[1]))))
    return got


def _until(condition: Callable[[], bool], what: str, within: float = WAIT) -> None:
    """Wait until ``condition()`` holds (the bridges count a datagram just after handling it)."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"waited {within} s for {what}"
        time.sleep(0.01)


def _bridge_threads(node: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"bridge-{node}" and t.is_alive()]


def test_a_delayed_datagram_never_arrives_before_its_delay(ports: PortTable, sockdir: str) -> None:
    delay_ms = 30.0
    with _endpoints(ports) as ep, _bridges(Network(default=Impairment(delay_ms=delay_ms)), ports, sockdir):
        for seq in range(20):
            _send(ep[A], _virtual(ports, B), range(seq, seq + 1), size=100 + 50 * seq)
            time.sleep(0.002)
        got = _receive(ep[B], 20)
    assert len(got) == 20, f"{len(got)} of 20 delayed datagrams arrived"
    delays = {seq: arrived - sent for seq, sent, arrived, _ in got}
    early = {seq: round(d * 1000, 3) for seq, d in delays.items() if d < delay_ms / 1000}
    assert not early, f"datagrams arrived before the configured {delay_ms} ms (seq: ms): {early}"
    assert max(delays.values()) < delay_ms / 1000 + 2.0, "a datagram took seconds beyond its delay"
    sources = {source for _, _, _, source in got}
    assert sources == {_virtual(ports, A)}, f"B's endpoint should see A at A's virtual port, saw {sources}"


def test_total_loss_delivers_nothing(ports: PortTable, sockdir: str) -> None:
    with _endpoints(ports) as ep, _bridges(Network(default=Impairment(loss=1.0)), ports, sockdir) as br:
        _send(ep[A], _virtual(ports, B), range(50))
        got = _receive(ep[B], within=0.5)
        _until(lambda: br[A].stats()[(A, B)].sent == 50, "A's bridge to take 50 datagrams")
        stats = br[A].stats()[(A, B)]
    assert got == [], f"{len(got)} datagrams crossed a link that loses every one"
    assert (stats.sent, stats.lost, stats.delivered) == (50, 50, 0), f"the link's counters are off: {stats}"


def test_a_partition_drops_traffic_and_traffic_resumes_after_it_heals(ports: PortTable, sockdir: str) -> None:
    heal_s = 1.0
    network = Network(events=(Event(at_s=0.0, kind="partition", nodes=(B,), for_s=heal_s),))
    clock = EventClock()
    clock.start(time.time_ns())
    with _endpoints(ports) as ep, _bridges(network, ports, sockdir, clock=clock) as br:
        _send(ep[A], _virtual(ports, B), range(10))
        during = _receive(ep[B], within=0.3)
        elapsed = clock.elapsed()
        assert elapsed is not None and elapsed < heal_s, "the machine was too slow to send within the partition"
        time.sleep(heal_s - elapsed + 0.1)
        _send(ep[A], _virtual(ports, B), range(10, 20))
        after = _receive(ep[B], 10)
        stats = br[A].stats()[(A, B)]
    assert during == [], f"{len(during)} datagrams crossed a partition"
    assert stats.cut == 10, f"the partition should have cut 10 datagrams, the counters say {stats}"
    assert sorted(seq for seq, _, _, _ in after) == list(range(10, 20)), (
        "traffic did not resume after the partition healed"
    )


def test_duplication_delivers_every_datagram_twice(ports: PortTable, sockdir: str) -> None:
    with _endpoints(ports) as ep, _bridges(Network(default=Impairment(duplicate=1.0)), ports, sockdir):
        _send(ep[A], _virtual(ports, B), range(10))
        got = _receive(ep[B], 20)
        extra = _receive(ep[B], within=0.2)
    seqs = sorted(seq for seq, _, _, _ in got + extra)
    assert seqs == sorted(list(range(10)) * 2), f"with duplicate=1 each datagram comes twice, not {seqs}"


def test_both_directions_cross_each_impaired_by_its_senders_link(ports: PortTable, sockdir: str) -> None:
    there_ms, back_ms = 20.0, 30.0
    network = Network(
        links=(
            Link(src=A, dst=B, delay_ms=there_ms),
            Link(src=B, dst=A, delay_ms=back_ms, duplicate=1.0),
        )
    )
    with _endpoints(ports) as ep, _bridges(network, ports, sockdir) as br:
        _send(ep[A], _virtual(ports, B), range(5))
        there = _receive(ep[B], 5)
        there += _receive(ep[B], within=0.2)
        _send(ep[B], _virtual(ports, A), range(100, 105))
        back = _receive(ep[A], 10)
        back += _receive(ep[A], within=0.2)
        _until(lambda: br[B].stats()[(B, A)].delivered == 10, "B's bridge to pass 10 copies on")
        a_stats, b_stats = br[A].stats(), br[B].stats()
    assert sorted(seq for seq, _, _, _ in there) == list(range(5)), "A -> B: 5 datagrams, each once"
    assert sorted(seq for seq, _, _, _ in back) == sorted(list(range(100, 105)) * 2), "B -> A: 5 datagrams, twice"
    assert min(t - s for _, s, t, _ in there) >= there_ms / 1000, "A -> B beat its link's delay"
    assert min(t - s for _, s, t, _ in back) >= back_ms / 1000, "B -> A beat its link's delay"
    assert {src for _, _, _, src in there} == {_virtual(ports, A)}, "B saw A elsewhere than at A's virtual port"
    assert {src for _, _, _, src in back} == {_virtual(ports, B)}, "A saw B elsewhere than at B's virtual port"
    assert set(a_stats) == {(A, B)} and set(b_stats) == {(B, A)}, "a bridge counts the links of its own node"
    assert (a_stats[(A, B)].sent, a_stats[(A, B)].delivered, a_stats[(A, B)].duplicated) == (5, 5, 0), a_stats
    assert (b_stats[(B, A)].sent, b_stats[(B, A)].delivered, b_stats[(B, A)].duplicated) == (5, 10, 5), b_stats


def test_three_nodes_each_reach_the_others_through_their_own_bridge(sockdir: str) -> None:
    # every bridge binds the virtual ports of all the others: in one namespace, each node needs an address of its own
    nodes = (A, B, C)
    ports = plan_ports(list(nodes))
    hosts = {node: f"127.0.0.{k + 1}" for k, node in enumerate(nodes)}
    with (
        _endpoints(ports, nodes, hosts) as ep,
        _bridges(Network(), ports, sockdir, nodes, hosts=hosts) as br,
    ):
        for k, src in enumerate(nodes):
            for dst in nodes:
                if dst != src:
                    _send(ep[src], (hosts[src], ports[dst][1]), range(10 * k, 10 * k + 1))
        got = {node: _receive(ep[node], 2) for node in nodes}
        links = {key for bridge in br.values() for key in bridge.stats()}
    for node in nodes:
        seen = {(seq, source) for seq, _, _, source in got[node]}
        want = {(10 * j, (hosts[node], ports[src][1])) for j, src in enumerate(nodes) if src != node}
        assert seen == want, f"{node} got {seen}, not one datagram from each other node at its virtual port"
    assert links == {(s, d) for s in nodes for d in nodes if s != d}, f"links counted: {sorted(links)}"


def _lost_seqs(seed: int, ports: PortTable, directory: str, n: int = 300) -> set[int]:
    with _endpoints(ports) as ep, _bridges(Network(seed=seed, default=Impairment(loss=0.3)), ports, directory) as br:
        _send(ep[A], _virtual(ports, B), range(n))
        _until(lambda: br[A].stats()[(A, B)].sent == n, f"A's bridge to take {n} datagrams")
        lost = br[A].stats()[(A, B)].lost
        arrived = {seq for seq, _, _, _ in _receive(ep[B], n - lost)}
    return set(range(n)) - arrived


def test_the_same_seed_loses_the_same_sequence_numbers(ports: PortTable, sockdir: str) -> None:
    first = _lost_seqs(7, ports, sockdir)
    second = _lost_seqs(7, ports, sockdir)
    other = _lost_seqs(8, ports, sockdir)
    assert 40 < len(first) < 150, f"30 % loss of 300 datagrams lost {len(first)}"
    assert first == second, f"seed 7 lost different datagrams in two runs: {sorted(first ^ second)}"
    assert first != other, "seeds 7 and 8 lost the very same datagrams"


def test_a_rate_cap_makes_n_bytes_take_at_least_n_over_the_rate(ports: PortTable, sockdir: str) -> None:
    rate_mbit, size, count = 1.0, 1000, 25
    with _endpoints(ports) as ep, _bridges(Network(default=Impairment(rate_mbit=rate_mbit)), ports, sockdir):
        _send(ep[A], _virtual(ports, B), range(count), size=size)
        got = _receive(ep[B], count)
    assert len(got) == count, f"{len(got)} of {count} datagrams came through the rate cap"
    floor = count * size * 8 / (rate_mbit * 1e6)
    took = max(arrived for _, _, arrived, _ in got) - min(sent for _, sent, _, _ in got)
    assert took >= floor, f"{count * size} bytes crossed a {rate_mbit} Mbit/s cap in {took:.4f} s, under {floor} s"
    assert took < floor + 2.0, f"{count * size} bytes took {took:.1f} s through a {rate_mbit} Mbit/s cap"


def test_a_burst_beyond_the_unix_sockets_queue_waits_and_arrives_whole(ports: PortTable, sockdir: str) -> None:
    count = 500  # far beyond net.unix.max_dgram_qlen (10 by default): the peer's bridge cannot keep up
    with _endpoints(ports) as ep, _bridges(Network(), ports, sockdir) as br:
        _send(ep[A], _virtual(ports, B), range(count), size=200)
        got = _receive(ep[B], count)
        stats = br[A].stats()[(A, B)]
    assert sorted(seq for seq, _, _, _ in got) == list(range(count)), f"{len(got)} of a burst of {count} arrived"
    assert [seq for seq, _, _, _ in got] == list(range(count)), "the burst arrived out of order"
    assert stats.send_errors == 0, f"the bridge lost datagrams it could have held back: {stats}"


def test_a_peer_whose_bridge_is_not_there_yet_loses_datagrams_until_it_starts(ports: PortTable, sockdir: str) -> None:
    network = Network()
    with _endpoints(ports) as ep, Bridge(network, A, ports, sockdir) as bridge_a:
        _send(ep[A], _virtual(ports, B), range(5))
        _until(lambda: bridge_a.stats()[(A, B)].send_errors == 5, "5 datagrams counted lost")
        with Bridge(network, B, ports, sockdir):
            _send(ep[A], _virtual(ports, B), range(5, 10))
            got = _receive(ep[B], 5)
        stats = bridge_a.stats()[(A, B)]
    assert sorted(seq for seq, _, _, _ in got) == list(range(5, 10)), "traffic did not flow once B's bridge was up"
    assert (stats.sent, stats.delivered, stats.send_errors) == (10, 5, 5), f"counters: {stats}"


def test_a_datagram_from_any_port_but_the_endpoints_own_is_dropped_and_counted(ports: PortTable, sockdir: str) -> None:
    with (
        _endpoints(ports) as ep,
        _bridges(Network(), ports, sockdir) as br,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger,
    ):
        stranger.bind((HOST, 0))
        _send(stranger, _virtual(ports, B), range(3))
        _until(lambda: br[A].foreign == 3, "A's bridge to count 3 foreign datagrams")
        _send(ep[A], _virtual(ports, B), range(3, 4))
        got = _receive(ep[B], 1)
        got += _receive(ep[B], within=0.2)
        stats = br[A].stats()[(A, B)]
    assert [seq for seq, _, _, _ in got] == [3], f"only the endpoint's own datagram should cross, got {got}"
    assert stats.sent == 1, f"a foreign datagram reached the link: {stats}"


def test_a_frame_naming_no_peer_is_dropped_and_counted(ports: PortTable, sockdir: str) -> None:
    payload = HEADER.pack(1, time.monotonic())
    frames = [
        b"stage-9".ljust(NAME_BYTES, b"\0") + payload,  # no such node
        B.encode().ljust(NAME_BYTES, b"\0") + payload,  # the receiving node itself is not its own peer
        A.encode().ljust(NAME_BYTES, b"\0"),  # a name and no datagram
        b"x",
    ]
    with (
        _endpoints(ports) as ep,
        _bridges(Network(), ports, sockdir) as br,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stranger,
    ):
        for frame in frames:
            stranger.sendto(frame, socket_path(sockdir, B))
        _until(lambda: br[B].foreign == len(frames), f"B's bridge to count {len(frames)} foreign frames")
        stranger.sendto(A.encode().ljust(NAME_BYTES, b"\0") + HEADER.pack(2, time.monotonic()), socket_path(sockdir, B))
        got = _receive(ep[B], 1)
        got += _receive(ep[B], within=0.2)
    assert [(seq, source) for seq, _, _, source in got] == [(2, _virtual(ports, A))], (
        f"only the frame naming a peer should reach the endpoint, from that peer's virtual port: {got}"
    )


def test_close_is_idempotent_leaves_no_thread_and_removes_its_socket(ports: PortTable, sockdir: str) -> None:
    with _endpoints(ports) as ep:
        bridge = Bridge(Network(default=Impairment(delay_ms=50)), A, ports, sockdir)
        bridge.start()
        path = Path(socket_path(sockdir, A))
        assert path.exists() and _bridge_threads(A), "a started bridge has its socket and its thread"
        _send(ep[A], _virtual(ports, B), range(5))  # still waiting in the heap when the bridge closes
        _until(lambda: bridge.stats()[(A, B)].sent == 5, "the bridge to take 5 datagrams")
        bridge.close()
        bridge.close()
    assert not _bridge_threads(A), "close() left the bridge's thread running"
    assert not path.exists(), "close() left the bridge's Unix socket file"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rebound:
        rebound.bind(_virtual(ports, B))  # the socket standing for the peer is really closed
    never_started = Bridge(Network(), A, ports, sockdir)
    never_started.close()
    never_started.close()


def test_the_queue_is_bounded_and_overflow_is_counted(ports: PortTable, sockdir: str) -> None:
    network = Network(default=Impairment(delay_ms=200))
    with _endpoints(ports) as ep, _bridges(network, ports, sockdir, max_queued=4) as br:
        _send(ep[A], _virtual(ports, B), range(6))
        _until(lambda: br[A].stats()[(A, B)].sent == 6, "A's bridge to take 6 datagrams")
        got = _receive(ep[B], 4)
        got += _receive(ep[B], within=0.3)
        stats = br[A].stats()[(A, B)]
    assert (stats.sent, stats.overflow, stats.delivered) == (6, 2, 4), f"a queue of 4 takes 4 of 6 datagrams: {stats}"
    assert sorted(seq for seq, _, _, _ in got) == list(range(4)), f"the first 4 should arrive, got {got}"


def test_a_small_calibration_reports_configured_against_measured(tmp_path: Path) -> None:
    cases = quick_cases()
    cal = calibrate(cases, seed=3)
    assert [r.case for r in cal.cases] == [c.name for c in cases], "a case is missing from the calibration"
    by_kind = {r.kind: r for r in cal.cases}
    assert set(by_kind) == {"delay", "loss", "bandwidth"}, f"kinds measured: {sorted(by_kind)}"
    for r in cal.cases:
        assert r.checks and r.sent > 0 and r.received > 0, f"{r.case} has no targets or nothing crossed"
        assert r.link["sent"] == r.sent, f"{r.case}: the bridge took {r.link['sent']} of {r.sent} datagrams"
    delay = by_kind["delay"]
    assert [c.metric for c in delay.checks] == ["delay p50", "delay p99"], "the delay case checks p50 and p99"
    assert all(c.configured == 5.0 and c.measured >= 5.0 for c in delay.checks), f"delay figures: {delay.checks}"
    (loss,) = by_kind["loss"].checks
    assert loss.configured == 5.0 and 0.0 < loss.measured < 20.0, f"loss figures: {loss}"
    (rate,) = by_kind["bandwidth"].checks
    assert rate.configured == 10.0 and 0.0 < rate.measured < 10.0 * 1.5, f"throughput beat the cap: {rate}"
    text = table(cal)
    assert text.count("MET") + text.count("MISSED") >= len(cal.checks), "the table lacks a verdict per target"
    write_json(cal, str(tmp_path / "wan.json"))
    doc = json.loads((tmp_path / "wan.json").read_text())
    assert len(doc["cases"]) == len(cases) and "checks" in doc["cases"][0], "the JSON lacks the cases"


# --- a node in a network namespace of its own -------------------------------------------------------------------

UNSHARE = ["unshare", "--user", "--map-root-user", "--net"]

# The child: stage-1 in a new network namespace. It brings its loopback up, starts its bridge, binds its quic port,
# says "ready" with its namespace, echoes every datagram to its source until its stdin closes, then prints what it got.
_CHILD = """
import json, os, select, socket, sys
from ppharness.network.bridge import Bridge
from ppharness.network.packet import decode_ports, loopback_up
from ppharness.network.spec import Network
table, directory = decode_ports(sys.argv[1]), sys.argv[2]
loopback_up()
got = []
with Bridge(Network(), "stage-1", table, directory), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
    sock.bind(("127.0.0.1", table["stage-1"][0]))
    print("ready", os.readlink("/proc/self/ns/net"), flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin, sock], [], [], 30.0)
        if not ready or sys.stdin in ready:
            break
        data, source = sock.recvfrom(65535)
        got.append(data.decode())
        sock.sendto(data, source)
print(json.dumps(got), flush=True)
"""


def _namespaces_work() -> str | None:
    """Why a user and network namespace cannot be made here, or None when it can."""
    if shutil.which("unshare") is None:
        return "no unshare command on this machine"
    try:
        done = subprocess.run([*UNSHARE, "true"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare does not run: {exc}"
    if done.returncode != 0:
        return f"unshare --user --map-root-user --net fails here: {done.stderr.strip() or done.returncode}"
    return None


def _line(proc: subprocess.Popen[str], within: float = 20.0) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], within)
    assert ready, f"the child in its namespace said nothing for {within} s"
    return proc.stdout.readline().strip()


def test_a_node_in_a_namespace_of_its_own_is_reached_through_the_bridges_alone(ports: PortTable, sockdir: str) -> None:
    reason = _namespaces_work()
    if reason is not None:
        pytest.skip(reason)
    table = ports
    child_quic, b_virtual = ports[B][0], _virtual(ports, B)
    proc = subprocess.Popen(
        [*UNSHARE, "--", sys.executable, "-c", _CHILD, encode_ports(table), sockdir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with (
            Bridge(Network(), A, table, sockdir),
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as endpoint,
        ):
            endpoint.bind((HOST, ports[A][0]))
            word, child_ns = (_line(proc).split() + ["", ""])[:2]
            assert word == "ready", f"the child did not start: {word} {child_ns}"
            assert child_ns != os.readlink("/proc/self/ns/net"), "the child shares this network namespace"
            endpoint.settimeout(WAIT)
            endpoint.sendto(b"through", b_virtual)
            data, source = endpoint.recvfrom(2048)
            assert (data, source) == (b"through", b_virtual), f"the echo came as {data!r} from {source}"
            endpoint.sendto(b"direct", (HOST, child_quic))  # nothing listens there in this namespace
            endpoint.settimeout(0.5)
            try:
                data, source = endpoint.recvfrom(2048)
            except TimeoutError:
                pass
            else:
                pytest.fail(f"{data!r} came back from {source}: the child was reached around the bridges")
        assert proc.stdin is not None
        proc.stdin.close()
        got = json.loads(_line(proc))
        assert got == ["through"], f"the child received {got}: only what crossed the bridges should reach it"
    finally:
        if proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
