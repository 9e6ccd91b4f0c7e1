"""The packet-level WAN emulator (``ppharness.network.udp``) and its calibration (``ppharness bench wan``).

Every test runs on loopback: a client socket (node ``stage-0``) sends through a ``UdpImpairer`` to a target socket
(node ``stage-1``). Timing is asserted strictly from below (nothing arrives before its delay, no cap is beaten) and
generously from above, so that a busy machine slows the tests without failing them.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from ppharness.benchmarks.wan import calibrate, quick_cases, table, write_json
from ppharness.cli import main
from ppharness.network.clock import EventClock
from ppharness.network.spec import Event, Impairment, Link, Network
from ppharness.network.udp import UdpImpairer, enable_timestamps, recv_stamped

CLIENT, NODE = "stage-0", "stage-1"
HEADER = struct.Struct("!Id")  # sequence number, send time (time.monotonic())
WAIT = 5.0  # the most any test waits for a datagram that should come


@pytest.fixture
def client() -> Iterator[socket.socket]:
    sock = _udp()
    yield sock
    sock.close()


@pytest.fixture
def target() -> Iterator[socket.socket]:
    sock = _udp()
    enable_timestamps(sock)
    yield sock
    sock.close()


def _udp() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2**20)
    sock.bind(("127.0.0.1", 0))
    return sock


def _impairer(
    network: Network, client: socket.socket, target: socket.socket, clock: EventClock | None = None, **kw: int
) -> UdpImpairer:
    return UdpImpairer(network, NODE, target.getsockname(), {client.getsockname()[1]: CLIENT}, clock=clock, **kw)


def _send(client: socket.socket, to: tuple[str, int], seqs: range, size: int = 64) -> None:
    for seq in seqs:
        client.sendto(HEADER.pack(seq, time.monotonic()).ljust(size, b"."), to)


def _receive(sock: socket.socket, count: int | None = None, within: float = WAIT) -> list[tuple[int, float, float]]:
    """(sequence number, send time, arrival time) of what arrives, both on ``time.monotonic()``'s clock: until
    ``count`` came or ``within`` s passed (when ``count`` is None, for all of ``within``)."""
    got: list[tuple[int, float, float]] = []
    deadline = time.monotonic() + within
    while (count is None or len(got) < count) and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data, _, arrived = recv_stamped(sock)
        except TimeoutError:
            break
        seq, sent = HEADER.unpack_from(data)
        got.append((seq, sent, arrived))
    return got


def _impairer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("udp-impairer-")]


def test_a_delayed_datagram_never_arrives_before_its_delay(client: socket.socket, target: socket.socket) -> None:
    delay_ms = 30.0
    with _impairer(Network(default=Impairment(delay_ms=delay_ms)), client, target) as proxy:
        for seq in range(20):
            _send(client, proxy.address, range(seq, seq + 1), size=100 + 50 * seq)
            time.sleep(0.002)
        got = _receive(target, 20)
    assert len(got) == 20, f"{len(got)} of 20 delayed datagrams arrived"
    delays = {seq: arrived - sent for seq, sent, arrived in got}
    early = {seq: round(d * 1000, 3) for seq, d in delays.items() if d < delay_ms / 1000}
    assert not early, f"datagrams arrived before the configured {delay_ms} ms (seq: ms): {early}"
    assert max(delays.values()) < delay_ms / 1000 + 2.0, "a datagram took seconds beyond its delay"


def test_total_loss_delivers_nothing(client: socket.socket, target: socket.socket) -> None:
    with _impairer(Network(default=Impairment(loss=1.0)), client, target) as proxy:
        _send(client, proxy.address, range(50))
        got = _receive(target, within=0.5)
        stats = proxy.stats()[(CLIENT, NODE)]
    assert got == [], f"{len(got)} datagrams crossed a link that loses every one"
    assert (stats.sent, stats.lost, stats.delivered) == (50, 50, 0), f"the link's counters are off: {stats}"


def test_a_partition_drops_traffic_and_traffic_resumes_after_it_heals(
    client: socket.socket, target: socket.socket
) -> None:
    heal_s = 1.0
    network = Network(events=(Event(at_s=0.0, kind="partition", nodes=(NODE,), for_s=heal_s),))
    clock = EventClock()
    clock.start(time.time_ns())
    with _impairer(network, client, target, clock) as proxy:
        _send(client, proxy.address, range(10))
        during = _receive(target, within=0.3)
        elapsed = clock.elapsed()
        assert elapsed is not None and elapsed < heal_s, "the machine was too slow to send within the partition"
        time.sleep(heal_s - elapsed + 0.1)
        _send(client, proxy.address, range(10, 20))
        after = _receive(target, 10)
        stats = proxy.stats()[(CLIENT, NODE)]
    assert during == [], f"{len(during)} datagrams crossed a partition"
    assert stats.cut == 10, f"the partition should have cut 10 datagrams, the counters say {stats}"
    assert sorted(seq for seq, _, _ in after) == list(range(10, 20)), (
        "traffic did not resume after the partition healed"
    )


def test_duplication_delivers_every_datagram_twice(client: socket.socket, target: socket.socket) -> None:
    with _impairer(Network(default=Impairment(duplicate=1.0)), client, target) as proxy:
        _send(client, proxy.address, range(10))
        got = _receive(target, 20)
        extra = _receive(target, within=0.2)
    seqs = sorted(seq for seq, _, _ in got + extra)
    assert seqs == sorted(list(range(10)) * 2), f"with duplicate=1 each datagram comes twice, not {seqs}"


def test_replies_from_the_target_come_back_to_the_client_impaired_both_ways(
    client: socket.socket, target: socket.socket
) -> None:
    there_ms, back_ms = 20.0, 30.0
    network = Network(
        links=(Link(src=CLIENT, dst=NODE, delay_ms=there_ms), Link(src=NODE, dst=CLIENT, delay_ms=back_ms))
    )
    sources: list[tuple[str, int]] = []

    def echo() -> None:
        target.settimeout(WAIT)
        for _ in range(5):
            try:
                data, source = target.recvfrom(2048)
            except TimeoutError:
                return
            sources.append(source)
            target.sendto(data, source)

    echoer = threading.Thread(target=echo, daemon=True)
    echoer.start()
    with _impairer(network, client, target) as proxy:
        rtts = []
        client.settimeout(WAIT)
        for seq in range(5):
            sent = time.monotonic()
            client.sendto(HEADER.pack(seq, sent), proxy.address)
            data, source = client.recvfrom(2048)
            rtts.append(time.monotonic() - sent)
            assert HEADER.unpack(data)[0] == seq, "the reply is not the datagram the client sent"
            assert source == proxy.address, f"the reply came from {source}, not from the proxy {proxy.address}"
        deadline = time.monotonic() + WAIT  # the proxy counts a send just after making it
        while (stats := proxy.stats())[(NODE, CLIENT)].delivered < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    echoer.join(WAIT)
    assert min(rtts) >= (there_ms + back_ms) / 1000, f"a round trip beat both links' delays: {min(rtts) * 1000} ms"
    assert max(rtts) < 2.0, "a round trip took seconds"
    assert all(s != client.getsockname() for s in sources), "the target saw the client itself, not the proxy"
    assert stats[(CLIENT, NODE)].delivered == 5 and stats[(NODE, CLIENT)].delivered == 5, f"counters: {stats}"


def _lost_seqs(seed: int, client: socket.socket, target: socket.socket, n: int = 300) -> set[int]:
    with _impairer(Network(seed=seed, default=Impairment(loss=0.3)), client, target) as proxy:
        _send(client, proxy.address, range(n))
        deadline = time.monotonic() + WAIT
        while (link := proxy.stats().get((CLIENT, NODE))) is None or link.sent < n:
            assert time.monotonic() < deadline, "the proxy did not read every datagram"
            time.sleep(0.01)
        arrived = {seq for seq, _, _ in _receive(target, n - link.lost)}
    return set(range(n)) - arrived


def test_the_same_seed_loses_the_same_sequence_numbers(client: socket.socket, target: socket.socket) -> None:
    first = _lost_seqs(7, client, target)
    second = _lost_seqs(7, client, target)
    other = _lost_seqs(8, client, target)
    assert 40 < len(first) < 150, f"30 % loss of 300 datagrams lost {len(first)}"
    assert first == second, f"seed 7 lost different datagrams in two runs: {sorted(first ^ second)}"
    assert first != other, "seeds 7 and 8 lost the very same datagrams"


def test_a_rate_cap_makes_n_bytes_take_at_least_n_over_the_rate(client: socket.socket, target: socket.socket) -> None:
    rate_mbit, size, count = 1.0, 1000, 25
    with _impairer(Network(default=Impairment(rate_mbit=rate_mbit)), client, target) as proxy:
        _send(client, proxy.address, range(count), size=size)
        got = _receive(target, count)
    assert len(got) == count, f"{len(got)} of {count} datagrams came through the rate cap"
    floor = count * size * 8 / (rate_mbit * 1e6)
    took = max(arrived for _, _, arrived in got) - min(sent for _, sent, _ in got)
    assert took >= floor, f"{count * size} bytes crossed a {rate_mbit} Mbit/s cap in {took:.4f} s, under {floor} s"
    assert took < floor + 2.0, f"{count * size} bytes took {took:.1f} s through a {rate_mbit} Mbit/s cap"


def test_close_is_idempotent_and_leaves_no_thread(client: socket.socket, target: socket.socket) -> None:
    proxy = _impairer(Network(default=Impairment(delay_ms=50)), client, target)
    address = proxy.start()
    assert proxy.start() == address, "a second start() should give the same address"
    _send(client, address, range(5))  # still waiting in the heap when the proxy closes
    proxy.close()
    proxy.close()
    assert not _impairer_threads(), "close() left the proxy's thread running"
    with pytest.raises(RuntimeError, match="closed"):
        proxy.start()
    rebound = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rebound.bind(address)  # the listen socket is really closed
    finally:
        rebound.close()


def test_clients_beyond_the_cap_and_datagrams_beyond_the_queue_are_dropped_and_counted(target: socket.socket) -> None:
    clients = [_udp() for _ in range(3)]
    network = Network(default=Impairment(delay_ms=200))
    proxy = UdpImpairer(network, NODE, target.getsockname(), {}, max_clients=2, max_queued=4)
    try:
        address = proxy.start()
        for c in clients:
            _send(c, address, range(3))
        deadline = time.monotonic() + WAIT
        while proxy.proxy_stats().refused < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        link = proxy.stats()[("unknown", NODE)]
        totals = proxy.proxy_stats()
    finally:
        proxy.close()
        for c in clients:
            c.close()
    assert (totals.clients, totals.refused) == (2, 3), f"2 clients served, the third's 3 datagrams refused: {totals}"
    assert (link.sent, link.overflow) == (6, 2), f"a queue of 4 takes 4 of 6 datagrams: {link}"


def test_a_small_calibration_reports_configured_against_measured(tmp_path: Path) -> None:
    cases = quick_cases()
    cal = calibrate(cases, seed=3)
    assert [r.case for r in cal.cases] == [c.name for c in cases], "a case is missing from the calibration"
    by_kind = {r.kind: r for r in cal.cases}
    assert set(by_kind) == {"delay", "loss", "bandwidth"}, f"kinds measured: {sorted(by_kind)}"
    for r in cal.cases:
        assert r.checks and r.sent > 0, f"{r.case} has no targets or sent nothing"
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


def test_bench_wan_without_calibrate_says_the_chain_benchmark_is_not_built() -> None:
    result = CliRunner().invoke(main, ["bench", "wan"])
    assert result.exit_code == 1, result.output
    assert "not built yet" in result.output, result.output
