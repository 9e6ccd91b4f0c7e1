"""The iroh transport beyond the shared contract: invited peers only, dropped peers, loopback-only binding, the wire
protocol's defences, and the version-guarded fixes to the iroh binding (bulk copy, direct calls).

Every test uses real iroh endpoints on loopback with relays disabled; none reaches beyond this machine.
"""

from __future__ import annotations

import ipaddress
import struct
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppharness.errors import CodecError, ConnectFailed, PeerClosed, TransportError, TransportTimeout
from ppharness.wire import codec
from ppharness.wire.messages import NextToken, Shutdown
from transports.iroh import fastcopy as _iroh_fastcopy
from transports.iroh import sync as _iroh_sync
from transports.iroh.transport import IrohTransport, load_iroh, parse_address

iroh = load_iroh()
ffi = iroh.iroh_ffi
WAIT = 10.0


def _until(check: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    """Poll ``check`` until it returns something truthy (bounded); fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.02)
    pytest.fail(f"waited {timeout} s for {what}")


@pytest.fixture
def run_endpoints() -> Iterator[Callable[[int], list[IrohTransport]]]:
    """``make(n)``: n started transports of one planned run (one allow-list); all closed at teardown."""
    made: list[IrohTransport] = []

    def make(count: int) -> list[IrohTransport]:
        batch = [IrohTransport(**o) for o in IrohTransport.plan_endpoints(count, {})]
        made.extend(batch)
        for t in batch:
            t.start()
        return batch

    yield make
    for t in made:
        t.close()


# --- plan and identity ----------------------------------------------------------------------------------------------


def test_plan_gives_each_endpoint_its_own_key_and_everyone_the_same_allow_list() -> None:
    opts = IrohTransport.plan_endpoints(4, {"relay": "default"})
    keys = {o["secret_key"] for o in opts}
    assert len(keys) == 4 and all(len(bytes.fromhex(k)) == 32 for k in keys)
    assert all(o["allowed"] == opts[0]["allowed"] and len(set(o["allowed"])) == 4 for o in opts)
    assert {o["relay"] for o in opts} == {"default"}
    assert IrohTransport.plan_endpoints(1, {"relay": None})[0]["relay"] == "disabled"


@pytest.mark.parametrize("settings", [{"relay": "everywhere"}, {"relays": "default"}])
def test_plan_rejects_unknown_settings(settings: dict[str, Any]) -> None:
    with pytest.raises(TransportError, match="relay"):
        IrohTransport.plan_endpoints(2, settings)


def test_endpoint_ids_are_the_planned_ones(run_endpoints: Callable[..., list[IrohTransport]]) -> None:
    a, b = run_endpoints(2)
    assert a.endpoint_id != b.endpoint_id
    assert str(parse_address(iroh, a.address).id()) == a.endpoint_id
    assert a._allowed == {a.endpoint_id, b.endpoint_id}


def test_relay_disabled_binds_and_advertises_loopback_only(run_endpoints: Callable[..., list[IrohTransport]]) -> None:
    (t,) = run_endpoints(1)
    addr = parse_address(iroh, t.address)
    assert addr.relay_url() is None
    sockets = t._session.endpoint.bound_sockets() + addr.direct_addresses()
    assert sockets and all(ipaddress.ip_address(s.rsplit(":", 1)[0].strip("[]")).is_loopback for s in sockets), sockets


def test_advertise_host_replaces_the_direct_addresses_in_the_ticket() -> None:
    with IrohTransport(host="0.0.0.0", advertise_host="127.0.0.1") as receiver, IrohTransport() as sender:
        direct = parse_address(iroh, receiver.address).direct_addresses()
        assert len(direct) == 1 and direct[0].startswith("127.0.0.1:"), direct
        sender.send(receiver.address, Shutdown("via the advertised address"))
        assert receiver.recv(timeout=WAIT) == (sender.address, Shutdown("via the advertised address"))


def test_without_direct_calls_everything_goes_through_the_loop_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import transports.iroh.transport as iroh_transport

    monkeypatch.setattr(iroh_transport, "_direct_calls", False)
    with IrohTransport() as a, IrohTransport() as b:
        assert not a._direct
        big = NextToken("r" * 100_000, 1, 0, False, "p")
        a.send(b.address, big)
        b.send(a.address, Shutdown("back"))
        assert b.recv(timeout=WAIT) == (a.address, big)
        assert a.recv(timeout=WAIT) == (b.address, Shutdown("back"))


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5555", "iroh://not-a-ticket", "endpointabc"])
def test_send_to_an_address_that_is_not_a_ticket_raises_connect_failed(
    run_endpoints: Callable[..., list[IrohTransport]], address: str
) -> None:
    (t,) = run_endpoints(1)
    with pytest.raises(ConnectFailed, match="not an iroh endpoint ticket") as info:
        t.send(address, Shutdown())
    assert address in str(info.value) and info.value.__cause__ is not None


# --- only invited peers ---------------------------------------------------------------------------------------------


def test_a_stranger_is_refused_and_logged_and_invited_peers_keep_working(
    run_endpoints: Callable[..., list[IrohTransport]], capfd: pytest.CaptureFixture[str]
) -> None:
    receiver, invited = run_endpoints(2)
    with IrohTransport() as stranger:
        assert stranger.endpoint_id not in receiver._allowed
        try:
            stranger.send(receiver.address, Shutdown("let me in"))
        except TransportError as exc:
            assert "not invited" in str(exc)  # the refusal reached the stranger during its handshake
        _until(lambda: receiver.refused, "the receiver to refuse the stranger")
        invited.send(receiver.address, Shutdown("invited"))
        assert receiver.recv(timeout=WAIT) == (invited.address, Shutdown("invited"))
        with pytest.raises(TransportTimeout):
            receiver.recv(timeout=0.5)

        def send_again() -> bool:
            stranger.send(receiver.address, Shutdown("again"))
            return False  # the send went out before the refusal reached the stranger: send again

        with pytest.raises(TransportError, match="not invited"):
            _until(send_again, "the stranger to see the refusal")
        assert set(receiver.refused) == {stranger.endpoint_id}
    err = capfd.readouterr().err
    refusals = [line for line in err.splitlines() if "refused a connection" in line]
    assert refusals and all(stranger.endpoint_id in line for line in refusals), err


def test_a_peer_outside_the_allow_list_is_not_dialled(run_endpoints: Callable[..., list[IrohTransport]]) -> None:
    (t,) = run_endpoints(1)
    with IrohTransport() as outsider, pytest.raises(ConnectFailed, match="allow-list"):
        t.send(outsider.address, Shutdown())


def _raw_stream_to(receiver: IrohTransport) -> tuple[Any, Any, str]:
    """A plain iroh endpoint (no ppharness) with a uni stream open to ``receiver``, and its own address."""
    call = _iroh_sync.call
    endpoint = call(
        iroh.Endpoint.bind(
            iroh.EndpointOptions(
                preset=iroh.preset_minimal(), bind_addr="127.0.0.1:0", relay_mode=iroh.RelayMode.disabled()
            )
        )
    )
    conn = call(endpoint.connect(parse_address(iroh, receiver.address), b"ppharness/1"))
    own = "iroh://" + str(iroh.EndpointTicket.from_addr(endpoint.addr()))
    return endpoint, call(conn.open_uni()), own


def _record(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


@pytest.mark.parametrize("case", ["spoofed-hello", "oversized-record"])
def test_a_stream_breaking_the_protocol_is_dropped_and_logged(case: str, capfd: pytest.CaptureFixture[str]) -> None:
    receiver, invited = IrohTransport(), IrohTransport()
    receiver.start(), invited.start()
    endpoint, stream, own = _raw_stream_to(receiver)
    try:
        hello = invited.address if case == "spoofed-hello" else own
        body = struct.pack(">I", codec.HEADER.size + codec.MAX_FRAME_BYTES + 1) + b"\x80" * 64
        _iroh_sync.call(stream.write_all(_record(hello.encode()) + body + _record(codec.encode(Shutdown("x")))))
        logged: list[str] = []
        _until(
            lambda: logged.append(capfd.readouterr().err) or "stopped reading a stream" in "".join(logged),
            "the receiver to log the bad stream",
        )
        expected = "claims the address of endpoint" if case == "spoofed-hello" else "exceeds the"
        assert expected in "".join(logged)
        with pytest.raises(TransportTimeout):
            receiver.recv(timeout=0.5)
        invited.send(receiver.address, Shutdown("still serving"))
        assert receiver.recv(timeout=WAIT) == (invited.address, Shutdown("still serving"))
    finally:
        _iroh_sync.call(endpoint.close())
        receiver.close(), invited.close()


# --- peers that go away ---------------------------------------------------------------------------------------------


def test_a_dropped_peer_surfaces_as_peer_closed_naming_it(run_endpoints: Callable[..., list[IrohTransport]]) -> None:
    a, b = run_endpoints(2)
    a.send(b.address, NextToken("r", 1, 0, False, "p"))
    assert b.recv(timeout=WAIT)[1] == NextToken("r", 1, 0, False, "p")
    b.close()
    with pytest.raises(PeerClosed) as info:
        _until(lambda: a.send(b.address, Shutdown("anyone?")), "the sender to notice the closed peer")
    assert b.address in str(info.value) and b.endpoint_id in str(info.value)
    with pytest.raises(PeerClosed):
        a.send(b.address, Shutdown("still closed"))


def test_both_directions_share_one_connection(run_endpoints: Callable[..., list[IrohTransport]]) -> None:
    a, b = run_endpoints(2)
    a.send(b.address, Shutdown("there"))
    assert b.recv(timeout=WAIT)[0] == a.address
    b.send(a.address, Shutdown("back"))
    assert a.recv(timeout=WAIT) == (b.address, Shutdown("back"))
    assert len(a._session.conns) == len(b._session.conns) == 1


def test_a_process_that_exits_without_closing_its_transports_exits_cleanly() -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "from transports.iroh.transport import IrohTransport\n"
        "from ppharness.wire.messages import Shutdown\n"
        "a, b = IrohTransport(), IrohTransport()\n"
        "a.start(), b.start()\n"
        "for _ in range(50): a.send(b.address, Shutdown('x'))\n"
        "b.recv(10)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def test_send_to_self_arrives(run_endpoints: Callable[..., list[IrohTransport]]) -> None:
    (a,) = run_endpoints(1)
    a.send(a.address, Shutdown("me"))
    assert a.recv(timeout=WAIT) == (a.address, Shutdown("me"))


def test_a_frame_over_the_limit_is_not_sent(
    run_endpoints: Callable[..., list[IrohTransport]], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = run_endpoints(2)
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", 64)
    with pytest.raises(CodecError, match="not sent"):
        a.send_frame(b.address, codec.HEADER.pack(b"PP", 1, 100) + bytes(100))
    with pytest.raises(TransportTimeout):
        b.recv(timeout=0.3)


# --- the bulk-copy fix ----------------------------------------------------------------------------------------------


def stock_then_patched(lower: Callable[[], bytes]) -> tuple[bytes, bytes]:
    """``lower()`` with the binding as shipped, then with the fix (which is back in place afterwards)."""
    _iroh_fastcopy.revert()
    try:
        stock = lower()
    finally:
        assert _iroh_fastcopy.apply(ffi)
    return stock, lower()


@given(payload=st.binary(max_size=20_000), kind=st.sampled_from(["bytes", "bytearray", "memoryview"]))
def test_bulk_copy_lowers_the_same_bytes_as_the_binding(payload: bytes, kind: str) -> None:
    value = {"bytes": payload, "bytearray": bytearray(payload), "memoryview": memoryview(payload)}[kind]
    stock, patched = stock_then_patched(lambda: _iroh_fastcopy.lower_bytes(ffi, value))
    assert patched == stock and stock[4 : len(payload) + 4] == payload


INTS = [
    ("write_i8", -128, 127),
    ("write_u8", 0, 255),
    ("write_i16", -(2**15), 2**15 - 1),
    ("write_u16", 0, 2**16 - 1),
    ("write_i32", -(2**31), 2**31 - 1),
    ("write_u32", 0, 2**32 - 1),
    ("write_i64", -(2**63), 2**63 - 1),
    ("write_u64", 0, 2**64 - 1),
]


@given(data=st.data())
def test_bulk_copy_packs_integers_and_floats_the_same(data: st.DataObject) -> None:
    values = [(name, data.draw(st.integers(lo, hi))) for name, lo, hi in INTS]
    values += [
        ("write_double", data.draw(st.floats(allow_nan=False))),
        ("write_float", data.draw(st.floats(width=32, allow_nan=False))),
    ]

    def lower() -> bytes:
        builder = ffi._UniffiRustBufferBuilder()
        for name, v in values:
            getattr(builder, name)(v)
        rbuf = builder.finalize()
        try:
            return bytes(rbuf.data[0 : rbuf.len])
        finally:
            rbuf.free()

    stock, patched = stock_then_patched(lower)
    assert patched == stock


def test_bulk_copy_is_applied_for_the_pinned_release() -> None:
    assert _iroh_fastcopy.installed_version() == "1.2.0"
    assert _iroh_fastcopy.applied() and _iroh_fastcopy.status() == "applied (iroh 1.2.0)"
    assert ffi._UniffiRustBufferBuilder.write.__doc__.endswith("(ppharness bulk-copy patch).")


def test_bulk_copy_guard_refuses_an_unknown_version(capfd: pytest.CaptureFixture[str]) -> None:
    _iroh_fastcopy.revert()
    try:
        assert _iroh_fastcopy.apply(ffi, version="1.3.0") is False
        assert not _iroh_fastcopy.applied() and "1.3.0" in _iroh_fastcopy.status()
        assert "bulk-copy patch not applied" in capfd.readouterr().err
        assert "bulk-copy patch" not in (ffi._UniffiRustBufferBuilder.write.__doc__ or "")
    finally:
        assert _iroh_fastcopy.apply(ffi)


def test_bulk_copy_guard_refuses_changed_source() -> None:
    class Builder:
        def write(self, value: bytes) -> None:
            pass

        _pack_into = write

    fake = SimpleNamespace(_UniffiRustBufferBuilder=Builder, _UniffiRustBufferStream=Builder)
    assert "is not the one" in (_iroh_fastcopy.refusal(fake, "1.2.0") or "")  # type: ignore[arg-type]
    assert "is not the one" in (_iroh_fastcopy.refusal(ffi, "1.2.0") or "")  # patched: no longer the shipped source
    _iroh_fastcopy.revert()
    try:
        assert _iroh_fastcopy.refusal(ffi, "1.2.0") is None
    finally:
        assert _iroh_fastcopy.apply(ffi)


# --- direct calls ---------------------------------------------------------------------------------------------------


def test_direct_calls_are_guarded_by_version_and_source() -> None:
    assert _iroh_sync.refusal(ffi, "1.2.0") is None
    assert "0.9" in (_iroh_sync.refusal(ffi, "0.9") or "")
    assert "cannot inspect" in (_iroh_sync.refusal(SimpleNamespace(), "1.2.0") or "")  # type: ignore[arg-type]


def test_direct_call_refuses_a_thread_that_runs_a_loop() -> None:
    import asyncio

    async def inside() -> None:
        coro = iroh.Endpoint.bind(iroh.EndpointOptions(preset=iroh.preset_minimal()))
        with pytest.raises(RuntimeError, match="asyncio loop"):
            _iroh_sync.call(coro)

    asyncio.run(inside())
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(_iroh_sync.can_call()))
    worker.start(), worker.join()
    assert result == [True]


# --- the transport benchmark ----------------------------------------------------------------------------------------


def test_bench_transport_reports_every_path_with_ratios(tmp_path: Any) -> None:
    import io
    import json

    from ppharness.benchmarks.transport import run_transport_bench

    out = io.StringIO()
    rows = run_transport_bench([64, 4096], 2, ["zmq", "iroh"], str(tmp_path / "bench.json"), out=out)
    paths = ["raw zmq", "raw iroh, bulk copy", "raw iroh, stock binding", "ppharness zmq", "ppharness iroh"]
    assert [(r.size, r.path) for r in rows] == [(size, p) for size in (64, 4096) for p in paths]
    ratios = {r.path: r.baseline for r in rows if r.ratio is not None and r.ratio > 0}
    assert ratios == {
        "raw iroh, stock binding": "raw iroh, bulk copy",
        "ppharness zmq": "raw zmq",
        "ppharness iroh": "raw iroh, bulk copy",
    }
    text = out.getvalue()
    assert all(p in text for p in paths) and "target: ppharness iroh 4 KiB p50" in text, text
    written = json.loads((tmp_path / "bench.json").read_text())
    assert len(written["rows"]) == len(rows) and written["provenance"]["engine"].startswith("ppharness ")
