"""Where a node's transport binds and what it advertises, from the node's environment: ``PP_PORT``, and on vast.ai
``PUBLIC_IPADDR`` with ``VAST_TCP_PORT_<P>`` / ``VAST_UDP_PORT_<P>`` (``ppharness.run.node.address``)."""

from __future__ import annotations

import json
import socket

import pytest

from backends.vastai.emulator.network import TcpForwarder
from ppharness.errors import HarnessError
from ppharness.run.node.address import published
from ppharness.run.node.env import make_transport
from ppharness.wire.messages import Shutdown
from transports.iroh.transport import IrohTransport
from transports.memory import MemoryTransport
from transports.zmq import ZmqTransport, split_address

WAIT = 10.0


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


def test_without_port_variables_a_node_binds_and_advertises_as_before(capsys):
    assert published(ZmqTransport, {}) == ({}, {})
    transport = make_transport("zmq", {"STAGE": "2"})
    try:
        assert split_address(transport.start())[0].startswith("tcp://127.0.0.1:")
    finally:
        transport.close()
    assert "[pp-node stage 2] zmq transport: binds and advertises as it does by default" in capsys.readouterr().err


def test_a_node_on_vastai_binds_pp_port_and_advertises_the_public_port(capsys):
    """The node's environment as vast.ai gives it, with a forwarder standing in for vast.ai's port mapping: members
    reach the node at PUBLIC_IPADDR:VAST_TCP_PORT_<PP_PORT>, and the log line says so, naming no key."""
    node_opts, member_opts = ZmqTransport.plan_endpoints(2, {})
    bound = _free_port()
    forwarder = TcpForwarder(("127.0.0.1", bound))
    env = {
        "STAGE": "1",
        "PP_TRANSPORT_OPTS": json.dumps(node_opts),
        "PP_BIND_HOST": "0.0.0.0",
        "PP_PORT": str(bound),
        "PUBLIC_IPADDR": "127.0.0.1 \n",
        f"VAST_TCP_PORT_{bound}": str(forwarder.port),
        "VAST_TCP_PORT_22": "40022",
    }
    node = make_transport("zmq", env)
    member = ZmqTransport(**member_opts)
    try:
        address, _ = node.start(), member.start()
        assert split_address(address) == (f"tcp://127.0.0.1:{forwarder.port}", node.public_key)
        member.send(address, Shutdown("through vast.ai's port"))
        assert node.recv(timeout=WAIT) == (member.address, Shutdown("through vast.ai's port"))
        assert forwarder.connections == 1
    finally:
        member.close()
        node.close()
        forwarder.close()
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if "zmq transport binds" in ln]
    assert f"binds 0.0.0.0 port {bound} and advertises 127.0.0.1 port {forwarder.port}" in line
    assert f"VAST_TCP_PORT_{bound}" in line and "PUBLIC_IPADDR" in line and "PP_PORT" in line
    assert node_opts["secret_key"] not in err and node.public_key not in line


def test_the_public_address_is_stripped_and_pp_advertise_host_wins_over_it():
    env = {"PP_PORT": "7100", "VAST_TCP_PORT_7100": "41234", "PUBLIC_IPADDR": " 203.0.113.7 \n"}
    options, why = published(ZmqTransport, env)
    assert options == {"port": 7100, "advertise_port": 41234, "advertise_host": "203.0.113.7"}
    assert "VAST_TCP_PORT_7100" in why["advertise_port"] and "PUBLIC_IPADDR" in why["advertise_host"]
    options, _ = published(ZmqTransport, env | {"PP_ADVERTISE_HOST": "10.0.0.5"})
    assert options["advertise_host"] == "10.0.0.5" and options["advertise_port"] == 41234


def test_only_the_mapping_of_the_nodes_own_port_and_protocol_is_advertised():
    base = {"PP_PORT": "7100", "PUBLIC_IPADDR": "203.0.113.7"}
    options, _ = published(ZmqTransport, base | {"VAST_TCP_PORT_22": "40022"})
    assert options == {"port": 7100}
    options, why = published(ZmqTransport, base | {"VAST_UDP_PORT_7100": "41000"})
    assert options == {"port": 7100} and "VAST_UDP_PORT_7100 maps the other protocol" in why["advertise_port"]


def test_iroh_advertises_the_udp_port_vastai_maps():
    env = {"PP_PORT": "7100", "VAST_UDP_PORT_7100": "41000", "VAST_TCP_PORT_7100": "42000", "PUBLIC_IPADDR": "1.2.3.4"}
    options, why = published(IrohTransport, env)
    assert options == {"port": 7100, "advertise_port": 41000, "advertise_host": "1.2.3.4"}
    assert "container port 7100/udp" in why["advertise_port"]


def test_a_transport_that_binds_no_socket_takes_no_socket_options():
    assert published(MemoryTransport, {"PP_PORT": "7100", "PP_BIND_HOST": "0.0.0.0"}) == ({}, {})


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"PP_PORT": "seventy"}, "PP_PORT='seventy' is not a port number"),
        ({"PP_PORT": "70000"}, "PP_PORT='70000' is not a port number"),
        ({"PP_PORT": "-1"}, "PP_PORT='-1' is not a port number"),
        (
            {"PP_PORT": "7100", "VAST_TCP_PORT_7100": "0x10", "PUBLIC_IPADDR": "1.2.3.4"},
            "VAST_TCP_PORT_7100='0x10' is not a port number",
        ),
        ({"PP_PORT": "7100", "VAST_TCP_PORT_7100": "41234"}, "VAST_TCP_PORT_7100 is set but PUBLIC_IPADDR is not"),
        (
            {"PP_PORT": "7100", "VAST_TCP_PORT_7100": "41234", "PUBLIC_IPADDR": "my-host "},
            "PUBLIC_IPADDR='my-host ' is not an IP address",
        ),
    ],
)
def test_a_malformed_port_variable_is_a_clear_error_naming_it(env, named):
    with pytest.raises(HarnessError, match=named):
        published(ZmqTransport, env)
    with pytest.raises(HarnessError, match=named):
        make_transport("zmq", env)
