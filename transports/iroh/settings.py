"""What the iroh transport adds to a scenario's ``transport`` section: the relay mode. Light to import: no binding."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from ppharness.seams.settings import TransportSettings

RELAY_MODES = ("disabled", "default")
RELAY_HELP = (
    "iroh only: 'disabled' (default; loopback/LAN, no relay, no discovery: no traffic leaves the machine) "
    "or 'default' (WAN through the n0 public relays; direct addresses whenever they work)"
)


class IrohSettings(TransportSettings, frozen=True):
    """The iroh transport's fields of a scenario's ``transport`` section."""

    relay: Annotated[Literal["disabled", "default"], Meta(description=RELAY_HELP)] | None = None
