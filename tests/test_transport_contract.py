"""The Transport contract, run against every transport kind.

A new transport joins by adding one ``pytest.param`` to ``KINDS`` (its class comes from ``ppharness.registry``).
Kind-specific behaviour (the memory hub, raw zmq multipart messages) is tested at the end of the file.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import numpy as np
import pytest
from zmq_peers import raw_push

from ppharness.errors import CodecError, ConnectFailed, TransportClosed, TransportError, TransportTimeout
from ppharness.registry import transport_class
from ppharness.seams.transport import Transport
from ppharness.wire import codec
from ppharness.wire.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Ack,
    ActivationRows,
    Assign,
    ClockProbe,
    ClockReply,
    DigestReport,
    DigestRequest,
    Error,
    ExpertRequest,
    ExpertResult,
    Heartbeat,
    InferenceRequest,
    InferenceResponse,
    Join,
    Members,
    Message,
    NetworkStart,
    NextToken,
    Ready,
    Replay,
    RequestClose,
    RequestOpen,
    Resume,
    Shutdown,
    Span,
    StageActivation,
    Stopped,
    StreamedToken,
    TokenRows,
    TraceReport,
    TraceRequest,
    Warm,
)
from transports.iroh import session as iroh_session

KINDS = [
    pytest.param("memory", id="memory"),
    pytest.param("zmq", id="zmq"),
    pytest.param("iroh", id="iroh"),
]

WAIT = 10.0  # generous bound for a frame that was sent to arrive

MakeTransport = Callable[[], Transport]


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_transport(kind: str) -> Iterator[MakeTransport]:
    """A factory of unstarted transports of ``kind``; every one it made is closed at teardown."""
    made: list[Transport] = []

    def make() -> Transport:
        transport = transport_class(kind)()
        made.append(transport)
        return transport

    yield make
    for transport in made:
        transport.close()


@pytest.fixture
def transport_pair(make_transport: MakeTransport) -> tuple[Transport, Transport]:
    """(receiver, sender), both started."""
    receiver, sender = make_transport(), make_transport()
    receiver.start()
    sender.start()
    return receiver, sender


def activation(shape: tuple[int, ...], wire_dtype: str = "f16", seed: int = 0) -> StageActivation:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float16)
    hidden, shape = codec.pack_hidden(x, wire_dtype)
    return StageActivation(
        request_id="req-0001",
        position=0,
        hidden=hidden,
        seq_len=shape[1],
        is_prefill=True,
        shape=shape,
        dtype=wire_dtype,
        plan_id="plan-2stage-a1b2",
    )


def realistic_messages() -> list[Message]:
    """One realistic instance of every message type."""
    return [
        InferenceRequest(
            reply_to="tcp://10.0.0.7:5555", prompt="The capital of France is", max_tokens=32, request_id="req-0001"
        ),
        activation((1, 6, 64)),
        NextToken(request_id="req-0001", token_id=12366, position=6, done=False, plan_id="plan-2stage-a1b2"),
        ActivationRows(
            request_ids=["req-0001", "req-0002", "req-0003"],
            positions=[7, 12, 9],
            hidden=np.arange(3 * 64, dtype="<f2").tobytes(),
            shape=(3, 1, 64),
            dtype="f16",
            plan_id="plan-2stage-a1b2",
        ),
        TokenRows(
            request_ids=["req-0001", "req-0002"],
            token_ids=[12366, 13],
            positions=[8, 13],
            done=[False, True],
            plan_id="plan-2stage-a1b2",
        ),
        InferenceResponse(
            request_id="req-0001",
            text=" Paris. It is known for the Eiffel Tower.",
            token_ids=[12366, 13, 1102, 374, 3967, 369, 279, 469],
            prompt_tokens=6,
            token_times=[0.051, 0.073, 0.094, 0.116, 0.137, 0.159, 0.18, 0.202],
            finish_reason="length",
        ),
        RequestOpen(
            request_id="req-0001",
            reply_to="tcp://10.0.0.7:5555",
            max_tokens=32,
            prompt_tokens=6,
            plan_id="plan-2stage-a1b2",
        ),
        RequestClose(request_id="req-0001", plan_id="plan-2stage-a1b2", epoch=1),
        Join(
            stage=1,
            num_stages=2,
            address="tcp://10.0.0.8:41235",
            names=["stage-1", "node-b"],
            run_label="smoke-2x",
            pid=4242,
        ),
        Members(names={"stage-0": "tcp://10.0.0.7:41234", "stage-1": "tcp://10.0.0.8:41235"}),
        Ready(stage=1, params=62_914_560, tied_params=0, load_s=1.84, rss_bytes=734_003_200),
        Heartbeat(stage=1, seq=42),
        Shutdown(reason="run finished"),
        Stopped(stage=1, served=3, peak_rss_bytes=812_646_400),
        TraceRequest(request_id="req-0001"),
        TraceReport(
            stage=1,
            request_id="req-0001",
            spans=[Span(0, "compute", 10_000, 35_000, 0), Span(0, "send", 35_500, 36_000, 4_104)],
        ),
        DigestRequest(request_id="req-0001"),
        DigestReport(stage=1, request_id="req-0001", digests=[bytes(range(8)), b"\xff" * 8]),
        ClockProbe(t_seed_ns=123_456_789),
        ClockReply(stage=1, t_seed_ns=123_456_789, t_node_ns=987_654_321),
        NetworkStart(t0_unix_ns=1_764_554_400_000_000_000),
        Error(stage=1, reason="activation for req-0001 has unknown wire dtype 'f8'", request_id="req-0001"),
        Ack(kind="activation", request_id="req-0001", position=6, plan_id="plan-2stage-a1b2"),
        StreamedToken(request_id="req-0001", token_id=12366, position=6, done=False, plan_id="plan-2stage-a1b2"),
        Replay(
            open=RequestOpen(
                request_id="req-0001",
                reply_to="tcp://10.0.0.7:5555",
                max_tokens=32,
                prompt_tokens=6,
                plan_id="plan-2stage-a1b2",
                epoch=1,
            ),
            activations=[activation((1, 6, 64))],
            epoch=1,
        ),
        Resume(
            request=InferenceRequest(
                reply_to="tcp://10.0.0.7:5555", prompt="The capital of France is", max_tokens=32, request_id="req-0001"
            ),
            tokens=[12366, 13, 1102],
            plan_id="plan-2stage-a1b2",
            epoch=1,
        ),
        Assign(
            program='{"plan_id":"plan-2stage-a1b2","stage":1,"num_stages":2,"lo":4,"hi":8}', gossip_name="pp-stage-1.1"
        ),
        Warm(programs=['{"plan_id":"plan-2stage-a1b2","stage":1,"num_stages":2,"lo":4,"hi":8}'], lengths=[6, 9]),
        ExpertRequest(
            request_id="req-0001",
            position=7,
            layer=2,
            pairs=[(0, 5), (0, 17)],
            hidden=np.arange(64, dtype="<f2").tobytes(),
            shape=(1, 64),
            dtype="f16",
            plan_id="plan-2stage-a1b2",
        ),
        ExpertResult(
            request_id="req-0001",
            position=7,
            layer=2,
            outputs=np.arange(128, dtype="<f2").tobytes(),
            shape=(2, 64),
            dtype="f16",
            plan_id="plan-2stage-a1b2",
            compute_ns=180_000,
        ),
    ]


def test_realistic_messages_cover_every_type() -> None:
    assert {type(m) for m in realistic_messages()} == set(MESSAGE_TYPES)


# --- the contract ---------------------------------------------------------------------------------------------------


def test_start_returns_the_address(make_transport: MakeTransport, kind: str) -> None:
    transport = make_transport()
    address = transport.start()
    assert isinstance(address, str)
    assert address.startswith(f"{'tcp' if kind == 'zmq' else kind}://")
    assert transport.address == address
    assert transport.start() == address


def test_use_before_start_raises_transport_error(make_transport: MakeTransport) -> None:
    transport, peer = make_transport(), make_transport()
    peer_address = peer.start()
    with pytest.raises(TransportError, match="start"):
        transport.recv(timeout=0)
    with pytest.raises(TransportError, match="start"):
        transport.send(peer_address, Shutdown())


@pytest.mark.parametrize("msg", realistic_messages(), ids=lambda m: type(m).__name__)
def test_round_trip_of_every_message_type(transport_pair: tuple[Transport, Transport], msg: Message) -> None:
    receiver, sender = transport_pair
    sender.send(receiver.address, msg)
    got_from, got = receiver.recv(timeout=WAIT)
    assert got_from == sender.address
    assert type(got) is type(msg)
    assert got == msg


def test_order_is_kept_for_one_sender(transport_pair: tuple[Transport, Transport]) -> None:
    receiver, sender = transport_pair
    for position in range(200):
        sender.send(receiver.address, NextToken("req-0001", 1000 + position, position, position == 199, "plan"))
    got = [receiver.recv(timeout=WAIT)[1] for _ in range(200)]
    assert [m.position for m in got] == list(range(200))  # type: ignore[union-attr]
    assert got[-1].done  # type: ignore[union-attr]


def test_two_senders_to_one_receiver(make_transport: MakeTransport) -> None:
    receiver, first, second = make_transport(), make_transport(), make_transport()
    for transport in (receiver, first, second):
        transport.start()
    for position in range(50):
        first.send(receiver.address, NextToken("req-a", position, position, False, "plan"))
        second.send(receiver.address, NextToken("req-b", position, position, False, "plan"))
    seen: dict[str, list[tuple[str, int]]] = {first.address: [], second.address: []}
    for _ in range(100):
        sender, msg = receiver.recv(timeout=WAIT)
        assert isinstance(msg, NextToken)
        seen[sender].append((msg.request_id, msg.position))
    assert seen[first.address] == [("req-a", p) for p in range(50)]
    assert seen[second.address] == [("req-b", p) for p in range(50)]


def test_large_activation_arrives_intact(transport_pair: tuple[Transport, Transport]) -> None:
    receiver, sender = transport_pair
    msg = activation((1, 512, 4096), seed=7)
    assert len(msg.hidden) == 4 * 1024 * 1024
    sender.send(receiver.address, msg)
    _, got = receiver.recv(timeout=WAIT)
    assert got == msg
    assert isinstance(got, StageActivation)
    np.testing.assert_array_equal(codec.unpack_hidden(got), codec.unpack_hidden(msg))


@pytest.mark.parametrize("timeout", [0, 0.2])
def test_recv_timeout_raises(transport_pair: tuple[Transport, Transport], timeout: float) -> None:
    receiver, _ = transport_pair
    with pytest.raises(TransportTimeout):
        receiver.recv(timeout=timeout)


def test_use_after_close_raises_transport_closed(transport_pair: tuple[Transport, Transport]) -> None:
    receiver, sender = transport_pair
    sender.close()
    with pytest.raises(TransportClosed):
        sender.send(receiver.address, Shutdown())
    with pytest.raises(TransportClosed):
        sender.send_frame(receiver.address, b"raw")
    with pytest.raises(TransportClosed):
        sender.recv(timeout=0)
    with pytest.raises(TransportClosed):
        sender.recv_frame(timeout=None)
    with pytest.raises(TransportClosed):
        sender.start()


def test_close_is_idempotent(make_transport: MakeTransport) -> None:
    started, never_started = make_transport(), make_transport()
    started.start()
    for transport in (started, never_started):
        transport.close()
        transport.close()
    with pytest.raises(TransportClosed):
        never_started.start()


def test_close_wakes_a_blocked_receiver(transport_pair: tuple[Transport, Transport]) -> None:
    receiver, _ = transport_pair
    raised: list[BaseException] = []
    entered = threading.Event()

    def wait_forever() -> None:
        entered.set()
        try:
            receiver.recv(timeout=None)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=wait_forever, daemon=True)
    thread.start()
    entered.wait(WAIT)
    receiver.close()
    thread.join(WAIT)
    assert not thread.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], TransportClosed)


def _with_version(frame: bytes, version: int) -> bytes:
    magic, _, body_len = codec.HEADER.unpack_from(frame)
    return codec.HEADER.pack(magic, version, body_len) + frame[codec.HEADER.size :]


MALFORMED = [
    pytest.param(b"", id="empty"),
    pytest.param(b"\x00\xffnot a ppharness frame at all\x13\x37", id="garbage"),
    pytest.param(b"PP\x00", id="truncated-header"),
    pytest.param(_with_version(codec.encode(Shutdown("bye")), PROTOCOL_VERSION + 1), id="wrong-version"),
    pytest.param(codec.HEADER.pack(b"PP", PROTOCOL_VERSION, codec.MAX_FRAME_BYTES + 1) + b"\x80", id="oversized"),
    pytest.param(codec.encode(Shutdown("bye"))[:-2], id="truncated-body"),
    pytest.param(codec.HEADER.pack(b"PP", PROTOCOL_VERSION, 4) + b"\xc1\xc1\xc1\xc1", id="garbage-msgpack"),
    pytest.param(codec.HEADER.pack(b"PP", PROTOCOL_VERSION, 1) + b"\x07", id="not-a-message"),
]


@pytest.mark.parametrize("bad", MALFORMED)
def test_malformed_frame_raises_codec_error_and_receiver_survives(
    transport_pair: tuple[Transport, Transport], bad: bytes
) -> None:
    receiver, sender = transport_pair
    good = NextToken("req-0001", 42, 3, False, "plan")
    sender.send_frame(receiver.address, bad)
    sender.send(receiver.address, good)
    with pytest.raises(CodecError):
        receiver.recv(timeout=WAIT)
    assert receiver.recv(timeout=WAIT) == (sender.address, good)


# --- memory only ----------------------------------------------------------------------------------------------------


def test_memory_send_to_unknown_or_closed_address_raises_connect_failed() -> None:
    from transports.memory import MemoryHub, MemoryTransport

    hub = MemoryHub()
    with MemoryTransport(hub, "a") as a, MemoryTransport(hub, "b") as b:
        with pytest.raises(ConnectFailed, match="memory://nobody"):
            a.send("memory://nobody", Shutdown())
        b.close()
        with pytest.raises(ConnectFailed, match="memory://b"):
            a.send(b.address, Shutdown())
        assert hub.addresses() == ["memory://a"]
    assert hub.addresses() == []


def test_memory_hubs_are_independent_and_names_are_exclusive() -> None:
    from transports.memory import MemoryHub, MemoryTransport

    hub_one, hub_two = MemoryHub(), MemoryHub()
    with MemoryTransport(hub_one, "stage-0") as one, MemoryTransport(hub_two, "stage-0") as two:
        assert one.address == two.address == "memory://stage-0"
        twin = MemoryTransport(hub_one, "stage-0")
        with pytest.raises(ConnectFailed, match="memory://stage-0"):
            twin.start()
        twin.close()
        one.send(one.address, Shutdown("self"))
        assert one.recv(timeout=WAIT) == ("memory://stage-0", Shutdown("self"))
        with pytest.raises(TransportTimeout):
            two.recv(timeout=0)


def test_memory_auto_names_are_unique() -> None:
    from transports.memory import MemoryTransport

    transports = [MemoryTransport() for _ in range(5)]
    try:
        assert len({t.start() for t in transports}) == 5
    finally:
        for t in transports:
            t.close()


# --- zmq only -------------------------------------------------------------------------------------------------------


ZMQ_RUN = 3  # receiver, sender, and a third member whose key a raw socket uses


@pytest.fixture
def zmq_run() -> list[dict]:
    return transport_class("zmq").plan_endpoints(ZMQ_RUN, {})


@pytest.fixture
def zmq_pair(zmq_run: list[dict]) -> Iterator[tuple[Transport, Transport]]:
    cls = transport_class("zmq")
    receiver, sender = cls(**zmq_run[0]), cls(**zmq_run[1])
    receiver.start()
    sender.start()
    yield receiver, sender
    receiver.close()
    sender.close()


@pytest.mark.parametrize(
    "parts",
    [
        pytest.param([b"tcp://127.0.0.1:1"], id="1-part"),
        pytest.param([b"tcp://127.0.0.1:1", codec.encode(Shutdown()), b"extra"], id="3-part"),
        pytest.param([b"\xff\xfe not utf-8", codec.encode(Shutdown())], id="non-utf8-sender"),
    ],
)
def test_zmq_raw_multipart_of_wrong_shape_is_rejected(
    zmq_pair: tuple[Transport, Transport], zmq_run: list[dict], parts: list[bytes]
) -> None:
    import zmq

    receiver, sender = zmq_pair
    ctx = zmq.Context()
    push = raw_push(ctx, receiver.address, zmq_run[2]["secret_key"].encode())
    try:
        push.send_multipart(parts)
        with pytest.raises(CodecError):
            receiver.recv(timeout=WAIT)
        sender.send(receiver.address, Shutdown("still serving"))
        assert receiver.recv(timeout=WAIT) == (sender.address, Shutdown("still serving"))
    finally:
        push.close(linger=0)
        ctx.term()


@pytest.mark.parametrize(
    "address",
    ["memory://stage-1", "tcp://no-port", "not an address", "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555?curve=abc"],
)
def test_zmq_send_to_an_address_without_a_key_raises_connect_failed(
    zmq_pair: tuple[Transport, Transport], address: str
) -> None:
    _, sender = zmq_pair
    with pytest.raises(ConnectFailed, match="not a ppharness zmq address") as info:
        sender.send(address, Shutdown())
    assert address in str(info.value)


@pytest.mark.parametrize("endpoint", ["tcp://no-port", "tcp://127.0.0.1:x", "udp://127.0.0.1:1"])
def test_zmq_send_to_an_undiallable_address_raises_connect_failed(
    zmq_pair: tuple[Transport, Transport], endpoint: str
) -> None:
    _, sender = zmq_pair
    address = f"{endpoint}?curve={'ab' * 32}"
    with pytest.raises(ConnectFailed, match="connect to") as info:
        sender.send(address, Shutdown())
    assert address in str(info.value)
    assert info.value.__cause__ is not None


def test_zmq_wildcard_bind_needs_an_advertised_host() -> None:
    cls = transport_class("zmq")
    with pytest.raises(TransportError, match="advertise_host"):
        cls(host="0.0.0.0")
    with cls(host="0.0.0.0", advertise_host="127.0.0.1") as receiver, cls() as sender:
        assert receiver.address.startswith("tcp://127.0.0.1:")
        sender.send(receiver.address, Shutdown("via wildcard bind"))
        assert receiver.recv(timeout=WAIT)[1] == Shutdown("via wildcard bind")


def test_zmq_transports_in_one_process_are_independent(
    zmq_pair: tuple[Transport, Transport], zmq_run: list[dict]
) -> None:
    receiver, sender = zmq_pair
    cls = transport_class("zmq")
    with cls(**zmq_run[2]) as other:
        other.send(receiver.address, Shutdown("from other"))
    sender.send(receiver.address, Shutdown("from sender"))
    got = {receiver.recv(timeout=WAIT)[1] for _ in range(2)}
    assert got == {Shutdown("from other"), Shutdown("from sender")}
    receiver.send(sender.address, Shutdown("back"))
    assert sender.recv(timeout=WAIT) == (receiver.address, Shutdown("back"))


def test_iroh_logs_a_connections_path_once_when_it_is_established(capfd: pytest.CaptureFixture[str]) -> None:
    cls = transport_class("iroh")
    with cls() as receiver, cls() as sender:
        sender.send(receiver.address, Shutdown("hello"))
        assert receiver.recv(timeout=WAIT)[1] == Shutdown("hello")
        logged: list[str] = []
        deadline = time.monotonic() + WAIT
        while sum("<-> endpoint" in ln for ln in logged) < 2 and time.monotonic() < deadline:
            logged += capfd.readouterr().err.splitlines()
            time.sleep(0.05)
        time.sleep(1.5)  # past the next looks at the path, which is unchanged
        logged += capfd.readouterr().err.splitlines()
    ours, theirs = sender.endpoint_id, receiver.endpoint_id
    paths = sorted(ln for ln in logged if "<-> endpoint" in ln)
    assert len(paths) == 2, paths
    assert any(f"endpoint {ours} <-> endpoint {theirs}: path direct to 127.0.0.1:" in ln for ln in paths), paths
    assert any(f"endpoint {theirs} <-> endpoint {ours}: path direct to 127.0.0.1:" in ln for ln in paths), paths


def test_iroh_logs_when_a_connections_path_changes(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The session's path watch over a scripted connection: direct, then through a relay (twice, logged once), then
    direct again, then gone."""

    def path(is_relay: bool, addr: str) -> SimpleNamespace:
        return SimpleNamespace(is_selected=True, is_relay=is_relay, remote_addr=addr, rtt_ms=7)

    snapshots = [
        [],
        [path(False, "203.0.113.5:41234")],
        [path(True, "https://relay.example./")],
        [path(True, "https://relay.example./")],
        [path(False, "203.0.113.5:41234")],
    ]
    session = iroh_session.Session(
        SimpleNamespace(IrohError=RuntimeError), SimpleNamespace(id=lambda: "ab" * 32), "iroh://x", None, None, None
    )

    class Scripted:
        def stable_id(self) -> int:
            return 1

        def paths(self) -> list[SimpleNamespace]:
            if len(snapshots) == 1:
                session.conns.pop(1)
            return snapshots.pop(0)

    session.conns[1] = Scripted()
    monkeypatch.setattr(iroh_session, "PATH_POLL_S", 0)
    asyncio.run(session._watch_path(Scripted(), "cd" * 32))
    lines = [ln.split(": ", 1)[1] for ln in capfd.readouterr().err.splitlines() if "<-> endpoint" in ln]
    assert lines == [
        "path direct to 203.0.113.5:41234 (rtt 7 ms)",
        "path changed: now through the relay https://relay.example./, was direct to 203.0.113.5:41234 (rtt 7 ms)",
        "path changed: now direct to 203.0.113.5:41234, was through the relay https://relay.example./ (rtt 7 ms)",
    ]
