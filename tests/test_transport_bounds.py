"""What a stranger (or a member) can make a transport spend is bounded: log lines, remembered refusals, connections,
file descriptors, cached sockets and streams."""

from __future__ import annotations

import contextlib
import json
import resource
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq_peers import raw_push, run_members

from ppharness.errors import TransportError, TransportTimeout
from ppharness.wire.messages import Shutdown
from transports import bounds
from transports import zmq as zmq_transport
from transports.bounds import RefusalLog, raise_open_file_limit
from transports.zmq import ZmqTransport, split_address

ROOT = Path(__file__).resolve().parent.parent
WAIT = 10.0


def _until(check: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.02)
    pytest.fail(f"waited {timeout} s for {what}")


# --- the refusal log ------------------------------------------------------------------------------------------------


def test_the_refusal_log_writes_a_bounded_number_of_lines_and_counts_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(bounds.time, "monotonic", lambda: clock[0])
    lines: list[str] = []
    refusals = RefusalLog(lines.append, lambda: "here")
    refusals.refuse("", "a handshake failed")
    for n in range(1000):
        refusals.refuse(f"key{n}", f"refused key{n}")
    assert len(lines) == bounds.MAX_REFUSAL_LOGS + 1
    assert sum("no longer logging each one" in line for line in lines) == 1
    clock[0] += bounds.REFUSAL_COUNT_EVERY_S
    for n in range(100):
        refusals.refuse(f"late{n}", "unseen")
    assert lines[-1] == f"here: refused {1000 - bounds.MAX_REFUSAL_LOGS + 1 + 1} more connections (1002 in all)"
    refusals.flush()
    assert lines[-1] == "here: refused 99 more connections (1101 in all)"
    assert len(lines) == bounds.MAX_REFUSAL_LOGS + 3
    assert len(refusals.recent) == bounds.RECENT_REFUSALS and refusals.recent[-1] == "late99"
    assert refusals.total == 1101


# --- zmq ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def zmq_run() -> Iterator[list[ZmqTransport]]:
    with run_members(3) as members:
        yield members


def test_1000_stranger_keys_after_a_failed_handshake_give_a_bounded_log(
    zmq_run: list[ZmqTransport], capfd: pytest.CaptureFixture[str]
) -> None:
    receiver, member, _ = zmq_run
    host, port = split_address(receiver.address)[0].removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as junk:
        junk.sendall(b"\xff" + bytes(8) + b"\x7f" + b"not zmtp at all" * 8)
        _until(lambda: "" in receiver.refused, "the failed handshake to be refused")
    ctx = zmq.Context()
    ctx.setsockopt(zmq.RECONNECT_IVL, 60_000)  # one handshake per stranger: no retry within the test
    try:
        for _ in range(10):
            pairs = [zmq.curve_keypair() for _ in range(100)]
            batch = [raw_push(ctx, receiver.address, secret) for _, secret in pairs]
            keys = {zmq_transport._z85_to_hex(public) for public, _ in pairs}
            _until(lambda: keys <= set(receiver.refused), "a batch of 100 strangers to be refused")  # noqa: B023
            for push in batch:
                push.close()
    finally:
        ctx.term()
    member.send(receiver.address, Shutdown("still serving"))
    assert receiver.recv(timeout=WAIT) == (member.address, Shutdown("still serving"))
    receiver.close()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[ppharness zmq]")]
    refusals = [line for line in lines if "refused a connection" in line]
    assert len(refusals) <= bounds.MAX_REFUSAL_LOGS, len(refusals)
    assert sum("no longer logging each one" in line for line in lines) == 1, lines[-5:]
    assert len(lines) <= bounds.MAX_REFUSAL_LOGS + 3, len(lines)
    counts = [line for line in lines if "more connections" in line]
    assert counts and counts[-1].endswith(f"({receiver.refused_total} in all)"), lines[-5:]
    assert receiver.refused_total >= 1001 and len(receiver.refused) == bounds.RECENT_REFUSALS


def test_a_connection_that_never_starts_the_handshake_is_closed_within_the_handshake_interval(
    zmq_run: list[ZmqTransport],
) -> None:
    host, port = split_address(zmq_run[0].address)[0].removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as idle:
        idle.settimeout(10.0)
        started = time.monotonic()
        try:
            while idle.recv(4096):
                pass  # the server's greeting; the connection is closed once the handshake interval passes
        except ConnectionResetError:
            pass
        assert time.monotonic() - started < 3.0  # within the ~2 s handshake interval, not libzmq's default 30 s


def _closed(conn: socket.socket) -> bool:
    """Whether the server ended ``conn`` (its greeting, if any, is read and dropped); does not wait."""
    conn.setblocking(False)
    try:
        while conn.recv(4096):
            pass
        return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_connections_over_the_per_host_cap_are_shut_down_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zmq_transport, "MAX_CONNECTIONS_PER_HOST", 4, raising=False)
    with ZmqTransport() as node:
        host, port = split_address(node.address)[0].removeprefix("tcp://").rsplit(":", 1)
        conns = [socket.create_connection((host, int(port))) for _ in range(10)]
        try:
            started = time.monotonic()
            _until(lambda: sum(_closed(c) for c in conns) >= 6, "6 connections over the cap to be closed", 1.5)
            assert sum(_closed(c) for c in conns) == 6
            assert time.monotonic() - started < 1.9  # within the handshake interval: only the caps closed them
            assert node.shed == 6
        finally:
            for c in conns:
                c.close()


def test_push_sockets_are_kept_for_a_bounded_number_of_destinations(
    zmq_run: list[ZmqTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zmq_transport, "MAX_PUSH_SOCKETS", 2, raising=False)
    sender, *receivers = zmq_run
    for n, to in enumerate([*receivers, sender, receivers[0]]):
        sender.send(to.address, Shutdown(f"m{n}"))
        assert to.recv(timeout=WAIT) == (sender.address, Shutdown(f"m{n}"))
        assert len(sender._pushes) <= 2
    assert list(sender._pushes) == [sender.address, receivers[0].address]  # the least recently used was closed


FLOOD_NODE = """
import json, os, resource, sys, threading, time
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
from transports.zmq import ZmqTransport
node = ZmqTransport(**json.loads(sys.stdin.readline()))
print(node.start(), flush=True)
held = [open(os.devnull) for _ in range(200)]  # what a node holds of its own (model files, devices)
failed, stop = [], threading.Event()
def load_files():
    while not stop.is_set():
        try:
            for f in [open(os.devnull) for _ in range(20)]:
                f.close()
        except OSError as exc:
            failed.append(str(exc))
        time.sleep(0.001)
loader = threading.Thread(target=load_files)
loader.start()
got = []
deadline = time.monotonic() + 20
while len(got) < int(sys.argv[1]) and time.monotonic() < deadline:
    try:
        got.append(node.recv(timeout=0.5)[1].reason)
    except Exception:
        pass
stop.set()
loader.join()
print(json.dumps({"got": sorted(got), "failed": failed[:3], "failures": len(failed)}), flush=True)
node.close()
"""


def _connected(socks: list[socket.socket], within: float) -> None:
    """Wait until every one of ``socks`` (connecting without blocking) is connected, or ``within`` s passed."""
    poller = select.poll()
    for s in socks:
        poller.register(s, select.POLLOUT)
    pending, deadline = len(socks), time.monotonic() + within
    while pending and time.monotonic() < deadline:
        for fd, _ in poller.poll(100):
            poller.unregister(fd)
            pending -= 1


def test_a_flood_of_1000_raw_connections_under_a_1024_file_limit_leaves_the_node_working() -> None:
    """The node (a subprocess under soft = hard = 1024 open files, holding 200 files of its own and opening 20 at a
    time throughout) never fails to open a file, and both a member connected before the flood and one connecting
    during it are delivered."""
    opts = ZmqTransport.plan_endpoints(3, {})
    node = subprocess.Popen(
        [sys.executable, "-c", FLOOD_NODE, "4"],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    flood: list[socket.socket] = []
    try:
        assert node.stdin is not None and node.stdout is not None
        node.stdin.write(json.dumps(opts[0]) + "\n")
        node.stdin.flush()
        address = node.stdout.readline().strip()
        host, port = split_address(address)[0].removeprefix("tcp://").rsplit(":", 1)
        with ZmqTransport(**opts[1]) as early, ZmqTransport(**opts[2]) as late:
            early.send(address, Shutdown("early before"))
            time.sleep(0.3)
            for _ in range(1000):
                s = socket.socket()
                s.setblocking(False)
                try:
                    s.connect((host, int(port)))
                except BlockingIOError:
                    pass
                flood.append(s)
            _connected(flood, within=3.0)
            early.send(address, Shutdown("early during"))
            late.send(address, Shutdown("late during"))
            time.sleep(1.5)  # the flood is all accepted (or shed) by now
            late.send(address, Shutdown("late after"))
            report = json.loads(node.stdout.readline())
    finally:
        for s in flood:
            s.close()
        node.kill()
        node.communicate()
    assert report["failures"] == 0, report
    assert report["got"] == ["early before", "early during", "late after", "late during"], report


def test_the_open_file_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard limit here is {hard}: nothing to raise to")
    code = (
        "import resource; from transports.bounds import raise_open_file_limit as r; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, (1024, {hard})); "
        "print(r(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    want = bounds.FILE_LIMIT_CEILING if hard == resource.RLIM_INFINITY else hard
    assert out.split() == [str(want), str(want)]
    assert raise_open_file_limit() >= soft  # never lowers


# --- iroh -----------------------------------------------------------------------------------------------------------


@pytest.fixture
def iroh_endpoints() -> Iterator[Callable[..., Any]]:
    """``make(**options)``: a started iroh transport, closed at teardown."""
    from transports.iroh.transport import IrohTransport  # the binding loads only for the iroh tests

    made: list[Any] = []

    def make(**options: Any) -> Any:
        t = IrohTransport(**options)
        made.append(t)
        t.start()
        return t

    yield make
    for t in made:
        t.close()


def test_iroh_refusals_are_remembered_and_logged_within_bounds(
    iroh_endpoints: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bounds, "MAX_REFUSAL_LOGS", 3)
    monkeypatch.setattr(bounds, "RECENT_REFUSALS", 8)
    from transports.iroh.transport import IrohTransport  # the binding loads only for the iroh tests

    (opts,) = IrohTransport.plan_endpoints(1, {})
    receiver = iroh_endpoints(**opts)
    strangers = [iroh_endpoints() for _ in range(12)]
    for stranger in strangers:
        with contextlib.suppress(TransportError):
            stranger.send(receiver.address, Shutdown("let me in"))
    _until(lambda: receiver.refused_total >= 12, "12 strangers to be refused")
    assert len(receiver.refused) == 8 and set(receiver.refused) <= {s.endpoint_id for s in strangers}
    receiver.close()
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("[ppharness iroh]")]
    assert sum("refused a connection from endpoint" in line for line in lines) == 3, lines
    assert sum("no longer logging each one" in line for line in lines) == 1, lines
    assert lines[-1].endswith(f"more connections ({receiver.refused_total} in all)"), lines


def test_iroh_connections_over_the_total_cap_are_refused_and_counted(
    iroh_endpoints: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import transports.iroh.session as iroh_session  # the binding loads only for the iroh tests

    monkeypatch.setattr(iroh_session, "MAX_CONNECTIONS", 2, raising=False)
    receiver = iroh_endpoints()
    first, second, third = (iroh_endpoints() for _ in range(3))
    for n, peer in enumerate([first, second]):
        peer.send(receiver.address, Shutdown(f"peer {n}"))
        assert receiver.recv(timeout=WAIT) == (peer.address, Shutdown(f"peer {n}"))
    with contextlib.suppress(TransportError):
        third.send(receiver.address, Shutdown("one too many"))
    _until(lambda: third.endpoint_id in receiver.refused, "the third connection to be refused")
    with pytest.raises(TransportTimeout):
        receiver.recv(timeout=0.5)
    first.send(receiver.address, Shutdown("still served"))
    assert receiver.recv(timeout=WAIT) == (first.address, Shutdown("still served"))


def test_iroh_a_second_address_of_a_connected_endpoint_reuses_its_connection(
    iroh_endpoints: Callable[..., Any],
) -> None:
    from transports.iroh.session import SCHEME
    from transports.iroh.transport import load_iroh, parse_address  # the binding loads only for the iroh tests

    iroh = load_iroh()
    sender, receiver = iroh_endpoints(), iroh_endpoints()
    sender.send(receiver.address, Shutdown("first"))
    assert receiver.recv(timeout=WAIT) == (sender.address, Shutdown("first"))
    target = parse_address(iroh, receiver.address)
    also = iroh.EndpointAddr(target.id(), None, [*target.direct_addresses(), "192.0.2.1:9"])  # a documentation IP
    other = SCHEME + str(iroh.EndpointTicket.from_addr(also))
    assert other != receiver.address
    sender.send(other, Shutdown("second"))
    assert receiver.recv(timeout=WAIT) == (sender.address, Shutdown("second"))
    assert len(sender._session.conns) == len(receiver._session.conns) == 1


def test_iroh_connections_over_the_per_peer_cap_are_refused_and_counted(
    iroh_endpoints: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import transports.iroh.session as iroh_session  # the binding loads only for the iroh tests
    from transports.iroh import sync
    from transports.iroh.transport import load_iroh, parse_address

    monkeypatch.setattr(iroh_session, "MAX_CONNECTIONS_PER_PEER", 2, raising=False)
    iroh = load_iroh()
    receiver = iroh_endpoints()
    options = iroh.EndpointOptions(
        preset=iroh.preset_minimal(), bind_addr="127.0.0.1:0", relay_mode=iroh.RelayMode.disabled()
    )
    raw = sync.call(iroh.Endpoint.bind(options))
    try:
        held = [sync.call(raw.connect(parse_address(iroh, receiver.address), iroh_session.ALPN)) for _ in range(4)]
        _until(lambda: receiver.refused_total >= 2, "the connections over the cap to be refused")
        assert receiver.refused == [str(raw.id())] * 2 and receiver._session.caps.shed == 2
        assert len(receiver._session.conns) == 2 and len(held) == 4
    finally:
        sync.call(raw.close())
