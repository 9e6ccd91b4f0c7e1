"""A JSON document (what ``plan make`` and ``plan fmt`` write) read without the YAML machinery: decoded by the
standard library's JSON parser and walked once for the screen's limits (``ppharness.document.yaml_limits``) and the
document's keys (``ppharness.document.keys``). Anything the screen would say something about (a limit broken, an
unknown key, a key twice, a number too long, text that is not plain JSON) gives None, and the caller reads the text
the YAML way, whose screen says what and where. A large plan reads in a fraction of the time."""

from __future__ import annotations

import json

from ppharness.document.keys import Keys
from ppharness.document.yaml_limits import MAX_DEPTH, MAX_NUMBER_CHARS, MAX_SCALAR_BYTES, Limits


class _Refused(Exception):
    """The JSON way does not take this document: the YAML way reads it (and says what is wrong)."""


def _pairs(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Refused
    return out


def _number(text: str) -> object:
    if len(text) > MAX_NUMBER_CHARS:
        raise _Refused
    return float(text) if any(c in text for c in ".eE") else int(text)


def _constant(text: str) -> object:
    raise _Refused  # NaN, Infinity: not JSON


def read_json(text: str, limits: Limits, keys: Keys | None) -> object | None:
    """``text`` decoded when it is a JSON object within ``limits`` and ``keys``; None otherwise (read it as YAML)."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        data: object = json.loads(
            text, object_pairs_hook=_pairs, parse_int=_number, parse_float=_number, parse_constant=_constant
        )
        _Walk(limits).walk(data, keys, 0)
    except (_Refused, ValueError, RecursionError):
        return None
    return data


class _Walk:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.nodes = 0

    def walk(self, value: object, keys: Keys | None, depth: int) -> None:
        self.nodes += 1
        if self.nodes > self.limits.nodes:
            raise _Refused
        if isinstance(value, str):
            if len(value) * 4 > MAX_SCALAR_BYTES and len(value.encode("utf-8", "surrogatepass")) > MAX_SCALAR_BYTES:
                raise _Refused
            return
        if not isinstance(value, (dict, list)):
            return
        if depth >= MAX_DEPTH:
            raise _Refused
        if isinstance(value, dict):
            for key, item in value.items():
                self.walk(key, None, depth + 1)
                if keys is not None and keys.fields is not None and key not in keys.fields:
                    raise _Refused
                self.walk(item, keys.value_of(key) if keys is not None else None, depth + 1)
            return
        if keys is not None and keys.max_items is not None and len(value) > keys.max_items:
            raise _Refused
        for item in value:
            self.walk(item, keys.items if keys is not None else None, depth + 1)
