"""What an implementation's scenario settings are made of.

A provider kind reads a section of its own (``provider.<kind>``: a ``ProviderSettings``); a transport kind may add
fields to the ``transport`` section (a ``TransportSettings``), which apply to that kind only. Each implementation
declares its settings in a module light to import (no SDK, no binding) and names it in ``ppharness.registry``; the
scenario's sections are built from there.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec
from msgspec import Meta

MAX_SECONDS = 86_400.0  # a day: the longest any budget, timeout or interval may be

PositiveInt = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(gt=0, le=MAX_SECONDS, description="seconds, more than 0 and at most 86400 (a day)")]
Minutes = Annotated[float, Meta(gt=0, le=MAX_SECONDS / 60, description="minutes, more than 0 and at most 1440")]


# ``frozen`` is inherited at run time; every section repeats ``frozen=True`` because a type checker reads a Struct as a
# dataclass (PEP 681), and takes a subclass that does not say frozen as not frozen
class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A section of a scenario: frozen, unknown keys refused (a typo is an error, not a silent default)."""


class ProviderSettings(Settings, frozen=True):
    """A provider kind's section of a scenario (``provider.<kind>``)."""

    # a run of this kind always has the section: at its defaults when the scenario leaves it out
    always: ClassVar[bool] = False


class TransportSettings(Settings, frozen=True):
    """The fields a transport kind adds to a scenario's ``transport`` section. Each is optional (default ``None``)
    and applies to that kind only."""
