"""Implementations of the seams, looked up by kind string.

The core never imports ``transports`` or ``backends`` by name; a scenario says ``transport: {kind: zmq}`` and the
registry turns that into a class. A new implementation is one line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ppharness.errors import HarnessError
from ppharness.seams import Provider, Transport

if TYPE_CHECKING:
    from ppharness.network.clock import EventClock
    from ppharness.network.spec import Network

TRANSPORTS: dict[str, str] = {
    "memory": "transports.memory:MemoryTransport",
    "zmq": "transports.zmq:ZmqTransport",
    "iroh": "transports.iroh.transport:IrohTransport",
}

PROVIDERS: dict[str, str] = {
    "local": "backends.local:LocalProvider",
    "docker": "backends.docker.provider:DockerProvider",
    "vastai": "backends.vastai.provider:VastaiProvider",
}


# wrappers that apply a run-wide concern to any transport
WRAPPERS: dict[str, str] = {
    "network": "transports.faults:ImpairedTransport",  # message-level WAN emulation
}

TOOLS: dict[str, str] = {
    # ``ppharness vastai-emulator``: serve the API-compatible vast.ai emulator until interrupted
    "vastai-emulator": "backends.vastai.emulator.server:serve_forever",
}


def _load(table: dict[str, str], kind: str, what: str) -> object:
    try:
        target = table[kind]
    except KeyError:
        raise HarnessError(f"unknown {what} kind {kind!r}: expected one of {', '.join(sorted(table))}") from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def transport_class(kind: str) -> type[Transport]:
    cls = _load(TRANSPORTS, kind, "transport")
    assert isinstance(cls, type) and issubclass(cls, Transport), f"{kind}: {cls!r} is not a Transport"
    return cls


def provider_class(kind: str) -> type[Provider[Any]]:  # Any: each kind reads its own settings section
    cls = _load(PROVIDERS, kind, "provider")
    assert isinstance(cls, type) and issubclass(cls, Provider), f"{kind}: {cls!r} is not a Provider"
    return cls


def tool(name: str) -> Callable[..., object]:
    """A command an implementation offers beside its seam (e.g. the vast.ai emulator's server)."""
    fn = _load(TOOLS, name, "tool")
    assert callable(fn), f"{name}: {fn!r} is not callable"
    return fn


def impaired_transport(
    inner: Transport, network: Network, node: str, clock: EventClock, known: dict[str, str] | None = None
) -> Transport:
    """``inner`` with the network's impairments applied to what ``node`` sends (message-level WAN emulation);
    ``known``: addresses whose node is known up front (address -> ``seed`` or ``stage-<i>``)."""
    cls = _load(WRAPPERS, "network", "wrapper")
    assert isinstance(cls, type) and issubclass(cls, Transport), f"network: {cls!r} is not a Transport"
    wrapped = cls(inner, network, node, clock, known)  # type: ignore[call-arg]  # a wrapper's constructor, not a seam's
    return wrapped
