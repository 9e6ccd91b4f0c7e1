"""Putting the packet layer in place: every endpoint of a run (the seed and each stage) in a network namespace of its
own, binding its QUIC socket on one port and advertising another, its ``virtual`` port, behind which the other
endpoints' bridges stand (``ppharness.network.bridge``).

The orchestrator picks both ports for every endpoint before anything starts (``plan_ports``) and hands the table and
the folder of the bridges' Unix sockets to every node (``PP_NETWORK_PORTS``, ``PP_NETWORK_DIR``). ``start_bridge``
starts one endpoint's bridge and returns the transport options that make the endpoint bind its own port and advertise
its virtual one (iroh: ``port`` and ``advertise_port``). The seed stays in the orchestrator's namespace: the nodes,
each in a namespace of their own, cannot reach its socket but through the bridges either.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from collections.abc import Mapping

import msgspec

from ppharness.errors import HarnessError
from ppharness.network.bridge import Bridge
from ppharness.network.clock import EventClock
from ppharness.network.spec import Network

PortTable = dict[str, tuple[int, int]]  # node -> (its QUIC socket's port, its virtual port)
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def plan_ports(nodes: list[str], host: str = "127.0.0.1") -> PortTable:
    """Two free UDP ports per node, all different: held open together while they are chosen, so none repeats."""
    held: list[socket.socket] = []
    try:
        for _ in range(2 * len(nodes)):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            held.append(s)
            s.bind((host, 0))
        ports = [s.getsockname()[1] for s in held]
    except OSError as exc:
        raise HarnessError(f"no free UDP ports on {host} for the packet-level network emulation: {exc}") from exc
    finally:
        for s in held:
            s.close()
    return {node: (ports[2 * k], ports[2 * k + 1]) for k, node in enumerate(nodes)}


def encode_ports(table: PortTable) -> str:
    return msgspec.json.encode(table).decode()


def decode_ports(text: str) -> PortTable:
    try:
        return msgspec.json.decode(text, type=dict[str, tuple[int, int]])
    except msgspec.DecodeError as exc:
        raise HarnessError(f"PP_NETWORK_PORTS is not a port table: {exc}") from exc


def loopback_up() -> None:
    """Bring this network namespace's loopback up (a new namespace starts with it down). A no-op where it is up."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh", fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sh", b"lo", 0)))[1]
        if flags & _IFF_UP:
            return
        try:
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | _IFF_UP))
        except OSError as exc:
            raise HarnessError(f"cannot bring this network namespace's loopback up: {exc}") from exc


def start_bridge(
    network: Network, node: str, table: Mapping[str, tuple[int, int]], directory: str, clock: EventClock
) -> tuple[Bridge, dict[str, int]]:
    """Start ``node``'s bridge; return it and the options that make its transport bind and advertise accordingly."""
    if node not in table:
        raise HarnessError(f"the packet-level emulation has no ports for {node}")
    bridge = Bridge(network, node, table, directory, clock)
    try:
        bridge.start()
    except OSError as exc:
        raise HarnessError(f"the packet-level bridge of {node} cannot start: {exc}") from exc
    quic_port, virtual_port = table[node]
    return bridge, {"port": quic_port, "advertise_port": virtual_port}
