"""Every benchmark's JSON says what it was measured with: a ``provenance`` object (``ppharness.plan.provenance.
provenance``: versions, the engine id, the commit, the host, the time and the device) beside the figures."""

from __future__ import annotations

from typing import Any

from ppharness.plan.provenance import provenance

KEY = "provenance"


def stamped(doc: dict[str, Any], device: str | None = None) -> dict[str, Any]:
    """``doc`` with its ``provenance`` (``device``: tinygrad's device the figures were measured on, default this
    process's)."""
    if device is None:
        from tinygrad.device import Device  # tinygrad's device only when a benchmark writes its figures

        device = str(Device.DEFAULT)
    return {KEY: provenance(device), **doc}
