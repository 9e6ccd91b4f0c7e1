"""Implementations of the seams, looked up by kind string.

The core never imports ``transports`` or ``backends`` by name; a scenario says ``transport: {kind: zmq}`` and the
registry turns that into a class. A new implementation is one line here.
"""

from __future__ import annotations

import importlib
from typing import Any

from ppharness.errors import HarnessError

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


def _load(table: dict[str, str], kind: str, what: str) -> Any:
    try:
        target = table[kind]
    except KeyError:
        raise HarnessError(f"unknown {what} kind {kind!r}: expected one of {', '.join(sorted(table))}") from None
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def transport_class(kind: str) -> Any:
    return _load(TRANSPORTS, kind, "transport")


def provider_class(kind: str) -> Any:
    return _load(PROVIDERS, kind, "provider")
