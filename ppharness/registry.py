"""Implementations of the seams, looked up by kind string.

The core never imports ``transports`` or ``backends`` by name; a scenario says ``transport: {kind: zmq}`` and the
registry turns that into a class. A new implementation is one line here: where its class is and, when the kind has
scenario settings, where they are. Settings live in a module light to import (the class's module may load an SDK or
a binding), because the scenario's sections are built from them whenever a scenario is read; what a kind can do is
said by its class (``Transport.one_process``, ``Provider.signals_nodes``, ...), imported only when asked.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ppharness.errors import HarnessError
from ppharness.seams import Provider, ProviderSettings, Transport, TransportSettings

if TYPE_CHECKING:
    from ppharness.network.clock import EventClock
    from ppharness.network.spec import Network


class Implementation(NamedTuple):
    """One kind: its class (``module:Class``) and its scenario settings' type (``module:Class``), if any."""

    target: str
    settings: str | None = None


TRANSPORTS: dict[str, Implementation] = {
    "memory": Implementation("transports.memory:MemoryTransport"),
    "zmq": Implementation("transports.zmq:ZmqTransport"),
    "iroh": Implementation("transports.iroh.transport:IrohTransport", "transports.iroh.settings:IrohSettings"),
}

PROVIDERS: dict[str, Implementation] = {
    "local": Implementation("backends.local:LocalProvider", "backends.local:LocalSettings"),
    "docker": Implementation("backends.docker.provider:DockerProvider", "backends.docker.settings:DockerSettings"),
    "vastai": Implementation("backends.vastai.provider:VastaiProvider", "backends.vastai.settings:VastaiSettings"),
}


# wrappers that apply a run-wide concern to any transport
WRAPPERS: dict[str, str] = {
    "network": "transports.faults:ImpairedTransport",  # message-level WAN emulation
}

TOOLS: dict[str, str] = {
    # ``ppharness vastai-emulator``: serve the API-compatible vast.ai emulator until interrupted
    "vastai-emulator": "backends.vastai.emulator.server:serve_forever",
}


# pytest fixtures an implementation offers to the pytest plugin (``ppharness.testing.plugin``), as pytest plugin modules
TEST_FIXTURES: dict[str, str] = {
    "vastai": "backends.vastai.emulator.fixtures",  # ``vastai_api``: the emulator, or vast.ai with --vastai-real
}


_V = TypeVar("_V")


def _entry(table: dict[str, _V], kind: str, what: str) -> _V:
    try:
        return table[kind]
    except KeyError:
        raise HarnessError(f"unknown {what} kind {kind!r}: expected one of {', '.join(sorted(table))}") from None


def _import(target: str) -> object:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _load(table: dict[str, str], kind: str, what: str) -> object:
    return _import(_entry(table, kind, what))


def transport_class(kind: str) -> type[Transport]:
    impl = _entry(TRANSPORTS, kind, "transport")
    cls = _import(impl.target)
    assert isinstance(cls, type) and issubclass(cls, Transport), f"{kind}: {cls!r} is not a Transport"
    return cls


def provider_class(kind: str) -> type[Provider[Any]]:  # Any: each kind reads its own settings section
    impl = _entry(PROVIDERS, kind, "provider")
    cls = _import(impl.target)
    assert isinstance(cls, type) and issubclass(cls, Provider), f"{kind}: {cls!r} is not a Provider"
    return cls


def transport_settings_type(kind: str) -> type[TransportSettings] | None:
    """The fields transport ``kind`` adds to a scenario's ``transport`` section, or None (without loading the
    transport itself)."""
    impl = _entry(TRANSPORTS, kind, "transport")
    if impl.settings is None:
        return None
    cls = _import(impl.settings)
    assert isinstance(cls, type) and issubclass(cls, TransportSettings), f"{kind}: {cls!r} is not TransportSettings"
    return cls


def provider_settings_type(kind: str) -> type[ProviderSettings] | None:
    """The type of provider ``kind``'s scenario section (``provider.<kind>``), or None (without loading the provider
    itself)."""
    impl = _entry(PROVIDERS, kind, "provider")
    if impl.settings is None:
        return None
    cls = _import(impl.settings)
    assert isinstance(cls, type) and issubclass(cls, ProviderSettings), f"{kind}: {cls!r} is not ProviderSettings"
    return cls


def transports_where(test: Callable[[type[Transport]], bool]) -> list[str]:
    """The transport kinds whose class passes ``test`` (each class is loaded to be asked), in registry order."""
    return [kind for kind in TRANSPORTS if test(transport_class(kind))]


def providers_where(test: Callable[[type[Provider[Any]]], bool]) -> list[str]:
    """The provider kinds whose class passes ``test`` (each class is loaded to be asked), in registry order."""
    return [kind for kind in PROVIDERS if test(provider_class(kind))]


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
