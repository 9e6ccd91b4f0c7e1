"""What an implementation's scenario settings are made of.

A provider kind reads a section of its own (``provider.<kind>``: a ``ProviderSettings``); a transport kind may add
fields to the ``transport`` section (a ``TransportSettings``), which apply to that kind only. Each implementation
declares its settings in a module light to import (no SDK, no binding) and names it in ``ppharness.registry``; the
scenario's sections are built from there.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Self

import msgspec
from msgspec import Meta

from ppharness.document.explain import FieldError, explain

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
    # the fields a plan device's ``source.offer`` may set for its own node (vast.ai: its offer search); none by default
    device_fields: ClassVar[tuple[str, ...]] = ()

    def for_device(self, offer: dict[str, str]) -> Self:
        """These settings with a plan device's ``source.offer`` applied: its values (strings, as a plan writes them)
        converted to the fields' types. Raises FieldError for a key not in ``device_fields`` or a bad value."""
        unknown = sorted(k for k in offer if k not in self.device_fields)
        if unknown:
            allowed = ", ".join(self.device_fields) or "none"
            raise FieldError(unknown[0], f"unknown offer field {unknown[0]!r} — a device's offer may set: {allowed}")
        fields = msgspec.structs.asdict(self) | {k: _typed(v) for k, v in offer.items()}
        try:
            return msgspec.convert(fields, type=type(self), strict=False)
        except msgspec.ValidationError as exc:
            text = explain(exc, fields, type(self), 1)  # "$.num_gpus: expected ..., got ..."
            path, _, why = text.partition(": ")
            raise FieldError(path.removeprefix("$."), why) from None


class TransportSettings(Settings, frozen=True):
    """The fields a transport kind adds to a scenario's ``transport`` section. Each is optional (default ``None``)
    and applies to that kind only."""


def _typed(value: str) -> Any:
    """A plan's offer value as the field reads it: a JSON list for several (``["RTX 3090", "RTX 4090"]``), else the
    text (msgspec's lax conversion turns "8" into 8 and "0.5" into 0.5)."""
    if value.startswith("["):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value
