"""Only a run's members talk over ZeroMQ: CURVE keys per run, strangers refused and logged, no posing as another."""

from __future__ import annotations

import socket
import time

import pytest
import zmq
from zmq_peers import raw_push, run_members

from backends.vastai.emulator.network import TcpForwarder
from ppharness.errors import TransportError, TransportTimeout
from ppharness.wire import codec
from ppharness.wire.messages import Shutdown
from transports.zmq import ZmqTransport, split_address

WAIT = 10.0


def _until(check, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def run():
    """Three members of one run (plan_endpoints), started; closed afterwards."""
    with run_members(3) as members:
        yield members


def test_every_address_carries_its_public_key(run):
    for m in run:
        endpoint, key = split_address(m.address)
        assert endpoint.startswith("tcp://127.0.0.1:") and key == m.public_key and len(key) == 64
    assert len({m.public_key for m in run}) == 3


def test_a_stranger_is_refused_and_logged_and_members_keep_working(run, capfd):
    receiver, member, _ = run
    with ZmqTransport() as stranger:  # a valid key pair, not on the run's list
        stranger.send(receiver.address, Shutdown("let me in"))
        _until(lambda: stranger.public_key in receiver.refused, "the receiver to refuse the stranger")
        member.send(receiver.address, Shutdown("member"))
        assert receiver.recv(timeout=WAIT) == (member.address, Shutdown("member"))
        with pytest.raises(TransportTimeout):
            receiver.recv(timeout=0.5)  # nothing of the stranger's was delivered
    err = capfd.readouterr().err
    refusals = [ln for ln in err.splitlines() if "refused a connection" in ln]
    assert refusals and all(stranger.public_key in ln and "not a member of this run" in ln for ln in refusals), err


def test_a_socket_without_curve_is_refused(run, capfd):
    receiver, member, _ = run
    ctx = zmq.Context()
    try:
        push = raw_push(ctx, receiver.address, None)
        push.send_multipart([member.address.encode(), codec.encode(Shutdown("plain"))])
        _until(lambda: len(receiver.refused) > 0, "the receiver to refuse a NULL-security socket")
        with pytest.raises(TransportTimeout):
            receiver.recv(timeout=0.5)
        push.close()
    finally:
        ctx.term()
    assert "the security handshake failed" in capfd.readouterr().err


def test_a_member_cannot_pose_as_another(run, capfd):
    receiver, member, impostor = run
    ctx = zmq.Context()
    try:
        push = raw_push(ctx, receiver.address, impostor._secret)
        push.send_multipart([member.address.encode(), codec.encode(Shutdown("I am the seed"))])
        with pytest.raises(TransportTimeout):
            receiver.recv(timeout=1.0)
        assert receiver.forged == 1
        push.send_multipart([impostor.address.encode(), codec.encode(Shutdown("as myself"))])
        assert receiver.recv(timeout=WAIT) == (impostor.address, Shutdown("as myself"))
        push.close()
    finally:
        ctx.term()
    assert "naming another sender" in capfd.readouterr().err


def test_many_strangers_are_logged_a_bounded_number_of_times(run, capfd):
    receiver = run[0]
    ctx = zmq.Context()
    try:
        pushes = []
        for _ in range(40):
            _, secret = zmq.curve_keypair()
            pushes.append(raw_push(ctx, receiver.address, secret))
            pushes[-1].send_multipart([b"x", b"y"])
        _until(lambda: len(set(receiver.refused)) >= 40, "40 refusals")
        for p in pushes:
            p.close()
    finally:
        ctx.term()
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "[ppharness zmq]" in ln]
    assert len(lines) <= 33


def test_plan_endpoints_refuses_settings():
    with pytest.raises(TransportError, match="unknown setting"):
        ZmqTransport.plan_endpoints(2, {"relay": "default"})


def test_a_bad_secret_key_is_refused():
    with pytest.raises(TransportError, match="not a z85 CURVE secret key"):
        ZmqTransport(secret_key="not a key")


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


def test_a_member_advertising_a_published_port_is_reached_through_that_port():
    """As on vast.ai: the endpoint binds one port, a forwarder publishes it at another, and members dial the other."""
    receiver_opts, sender_opts = ZmqTransport.plan_endpoints(2, {})
    bound = _free_port()
    forwarder = TcpForwarder(("127.0.0.1", bound))
    receiver = ZmqTransport(port=bound, advertise_port=forwarder.port, **receiver_opts)
    sender = ZmqTransport(**sender_opts)
    try:
        address, _ = receiver.start(), sender.start()
        assert forwarder.port != bound
        assert split_address(address) == (f"tcp://127.0.0.1:{forwarder.port}", receiver.public_key)
        sender.send(address, Shutdown("through the published port"))
        assert receiver.recv(timeout=WAIT) == (sender.address, Shutdown("through the published port"))
        assert forwarder.connections == 1  # the member's one connection went through the forwarder
    finally:
        sender.close()
        receiver.close()
        forwarder.close()
    assert not forwarder.alive


@pytest.mark.parametrize("port", [0, 65536, -1, True, "7100"])
def test_an_advertise_port_that_is_not_a_tcp_port_is_refused(port):
    with pytest.raises(TransportError, match="advertise_port .* is not a TCP port"):
        ZmqTransport(advertise_port=port)


def test_without_advertise_port_the_address_names_the_bound_port():
    bound = _free_port()
    with ZmqTransport(port=bound) as t:
        assert split_address(t.address)[0] == f"tcp://127.0.0.1:{bound}"
