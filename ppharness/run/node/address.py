"""Where a node's transport binds and which address it advertises, read from the node's environment.

Providers set, for transports that bind a socket (whose constructor takes ``host``, ``port``, ``advertise_host``,
``advertise_port``):

- ``PP_BIND_HOST``: the host to bind (``0.0.0.0`` in a container); ``PP_ADVERTISE_HOST``: the host peers dial;
- ``PP_PORT``: the port to bind, the container port a platform publishes (1-65535).

Inside a vast.ai instance the platform sets ``PUBLIC_IPADDR`` (the instance's public IP, padded with whitespace) and
``VAST_TCP_PORT_<P>`` / ``VAST_UDP_PORT_<P>`` (the public port it maps container port P to). When ``PP_PORT`` is P
and the variable of the transport's protocol is set (its ``ip_protocol``: ``tcp`` for zmq, ``udp`` for iroh), the
node advertises that public port on ``PUBLIC_IPADDR`` (stripped), or on ``PP_ADVERTISE_HOST`` when that is also given.

Guarantees: without these variables the options are empty and the transport binds and advertises as it always did;
a malformed value (a port that is not a whole number in 1-65535, a public address that is not an IP, a mapped port
without ``PUBLIC_IPADDR``) raises ``HarnessError`` naming the variable; ``describe`` says in one line what the node
binds and advertises and which variables decided it, naming hosts, ports and variable names only, never a key.
"""

from __future__ import annotations

import inspect
import ipaddress
from collections.abc import Mapping

from ppharness.errors import HarnessError
from ppharness.seams.transport import JsonObject

BIND_HOST_VAR, ADVERTISE_HOST_VAR, PORT_VAR = "PP_BIND_HOST", "PP_ADVERTISE_HOST", "PP_PORT"
PUBLIC_HOST_VAR = "PUBLIC_IPADDR"
SOCKET_OPTIONS = ("host", "port", "advertise_host", "advertise_port")


def mapped_port_var(protocol: str, port: int) -> str:
    """The variable vast.ai sets to the public port of container port ``port`` (``VAST_TCP_PORT_7100``)."""
    return f"VAST_{protocol.upper()}_PORT_{port}"


def _port(env: Mapping[str, str], name: str) -> int:
    text = env[name].strip()
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
        raise HarnessError(f"{name}={env[name]!r} is not a port number (a whole number 1-65535)")
    return int(text)


def _public_host(env: Mapping[str, str], mapped: str) -> str:
    host = env.get(PUBLIC_HOST_VAR, "").strip()
    if not host:
        raise HarnessError(
            f"{mapped} is set but {PUBLIC_HOST_VAR} is not: the node cannot advertise its public port without the "
            "instance's public address"
        )
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise HarnessError(f"{PUBLIC_HOST_VAR}={env[PUBLIC_HOST_VAR]!r} is not an IP address") from None
    return host


def published(transport: type, env: Mapping[str, str]) -> tuple[JsonObject, dict[str, str]]:
    """(the socket options ``env`` gives a ``transport`` class, why each one: option -> its variables)."""
    takes = set(inspect.signature(transport).parameters)
    options: JsonObject = {}
    why: dict[str, str] = {}
    if env.get(BIND_HOST_VAR) and "host" in takes:
        options["host"], why["host"] = env[BIND_HOST_VAR], BIND_HOST_VAR
    if env.get(ADVERTISE_HOST_VAR) and "advertise_host" in takes:
        options["advertise_host"], why["advertise_host"] = env[ADVERTISE_HOST_VAR], ADVERTISE_HOST_VAR
    if not env.get(PORT_VAR) or "port" not in takes:
        return options, why
    port = options["port"] = _port(env, PORT_VAR)
    why["port"] = PORT_VAR
    protocol = str(getattr(transport, "ip_protocol", "tcp"))
    mapped = mapped_port_var(protocol, port)
    if env.get(mapped) and "advertise_port" in takes:
        options["advertise_port"] = _port(env, mapped)
        why["advertise_port"] = f"{mapped}: vast.ai publishes container port {port}/{protocol} there"
        if "advertise_host" not in options:
            options["advertise_host"] = _public_host(env, mapped)
            why["advertise_host"] = f"{PUBLIC_HOST_VAR}: the instance's public address"
    else:
        other = mapped_port_var("udp" if protocol == "tcp" else "tcp", port)
        why["advertise_port"] = f"no {mapped}" + (f" ({other} maps the other protocol)" if env.get(other) else "")
    return options, why


def describe(kind: str, options: Mapping[str, object], why: Mapping[str, str]) -> str:
    """One line: what a ``kind`` transport made with ``options`` binds and advertises, and why (``why``)."""
    if not any(name in options for name in SOCKET_OPTIONS) and not why:
        return f"{kind} transport: binds and advertises as it does by default (no {BIND_HOST_VAR}, {PORT_VAR})"
    host = options.get("host") or "its default host"
    port = options.get("port") or "a port the OS picks"
    shown_host = options.get("advertise_host") or host
    shown_port = options.get("advertise_port") or "the bound port"
    reasons = "; ".join(f"{name}: {text}" for name, text in why.items())
    return (
        f"{kind} transport binds {host} port {port} and advertises {shown_host} port {shown_port} "
        f"({reasons or 'transport defaults'})"
    )
