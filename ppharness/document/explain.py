"""Turning msgspec's validation and YAML errors on a document (a scenario, a plan) into one line: the ``$.path``, what
was wrong, and the fix. Kept apart from the documents' structs; ``explain`` walks whatever root struct type it is
given. A value is shown through ``show``, which never builds the ``repr`` of a long text or of a list or mapping."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterator
from typing import Any

import msgspec
from msgspec import inspect as mi


class FieldError(ValueError):
    """A check in ``__post_init__`` failed; ``field`` is the path below the struct (``count``, ``splits[2]`` or "")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `(?P<path>\$[^`]*)`)?$", re.S)
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
MISSING = object()
_YAML_WORDS = {"object": "a mapping", "array": "a list", "null": "null", "bytes": "binary data (!!binary)"}
MAX_SHOWN = 60  # characters of a text value quoted in a message
MAX_LIBRARY_TEXT = 200  # characters of a library's message passed on


def show(value: object, limit: int = MAX_SHOWN) -> str:
    """A value as a message quotes it: texts cut to ``limit`` characters (with their length), lists and mappings by
    their size, numbers and the like by ``repr``; bounded whatever the value's size."""
    if isinstance(value, str):
        return repr(value) if len(value) <= limit else f"{value[:limit]!r}… ({len(value):,} characters)"
    if isinstance(value, dict):
        return f"a mapping of {len(value):,} keys"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value):,} items"
    if isinstance(value, (bool, int, float)) or value is None:
        text = repr(value)
        return text if len(text) <= limit else f"a number of {len(text):,} digits"
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value):,} bytes of binary data"
    return f"a {type(value).__name__}"


def _cut(text: str, limit: int = MAX_LIBRARY_TEXT) -> str:
    return text if len(text) <= limit else f"{text[:limit]}…"


def explain(exc: msgspec.ValidationError, raw: object, root: type, version: int) -> str:
    """One line for a validation error: the ``$.path``, what was wrong, and what is expected."""
    m = _AT.match(str(exc))
    assert m is not None
    msg, path = m["msg"], m["path"] or "$"
    cause = exc.__cause__
    if isinstance(cause, FieldError):
        sub = cause.field
        full = path if not sub else f"{path}{'' if sub.startswith('[') else '.'}{sub}"
        return f"{full}: {cause}"
    got = _raw_at(raw, path)
    shown = "" if got is MISSING else f" {show(got)}"
    if mm := re.fullmatch(r"Object contains unknown field `(.+)`", msg):
        field, valid = mm[1], _field_names(root, path)
        close = difflib.get_close_matches(field, valid, n=1) if len(field) <= MAX_SHOWN else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown field {show(field)} at {path} — expected one of: {', '.join(valid)}{hint}"
    if mm := re.fullmatch(r"Object missing required field `(.+)`", msg):
        example = f"{mm[1]}: {version}" if mm[1] == "version" else f"{mm[1]}: ..."
        return f"{path}: missing required field {mm[1]!r} — add `{example}`"
    if re.fullmatch(r"Invalid enum value .+", msg):
        if path == "$.version":
            return (
                f"{path}: unsupported scenario version{shown} — this ppharness reads version {version}; "
                f"set `version: {version}`"
            )
        allowed = ", ".join(str(v) for v in _literal_values(root, path))
        return f"{path}:{shown or ' this value'} is not allowed — expected one of: {allowed}"
    if mm := re.fullmatch(r"Expected `(.+?)`, got `(.+?)`", msg):
        if path == "$" and got is None:
            return "$: the file is empty — a scenario needs at least `version: 1`"
        expected, actual = (_YAML_WORDS.get(w, w) for w in (mm[1], mm[2]))
        return f"{path}: expected {expected}, got {actual}{shown if actual not in _YAML_WORDS.values() else ''}"
    if msg.startswith("Expected "):
        note = _description_at(root, path)
        return (
            f"{path}: expected {_cut(msg[len('Expected ') :].replace('`', ''))}, got{shown or ' something else'}"
            f"{f' — {note}' if note else ''}"
        )
    return f"{path}: {_cut(msg)}"


def explain_yaml(exc: msgspec.DecodeError) -> str:
    cause = exc.__cause__ or exc.__context__
    mark = getattr(cause, "problem_mark", None) or getattr(cause, "context_mark", None)
    problem = _cut(getattr(cause, "problem", None) or str(exc)[:MAX_LIBRARY_TEXT].splitlines()[0])
    if mark is not None:
        return f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    m = re.search(r"line (\d+), column (\d+)", str(exc)[-MAX_LIBRARY_TEXT:])
    where = f" at line {m[1]}, column {m[2]}" if m else ""
    return f"not valid YAML{where}: {problem}"


def _segments(path: str) -> Iterator[str | int]:
    for m in _SEGMENT.finditer(path[1:]):
        yield m[1] if m[1] is not None else int(m[2])


def _flat(t: mi.Type) -> Iterator[mi.Type]:
    if isinstance(t, mi.Metadata):
        yield from _flat(t.type)
    elif isinstance(t, mi.UnionType):
        for u in t.types:
            yield from _flat(u)
    else:
        yield t


def _type_at(root: type, path: str) -> list[mi.Type]:
    """The possible types of the value at ``path`` (a union flattened), walking from ``root``."""
    types: list[mi.Type] = list(_flat(mi.type_info(root)))
    for seg in _segments(path):
        nxt: list[mi.Type] = []
        for t in types:
            if isinstance(seg, str) and isinstance(t, mi.StructType):
                nxt += [u for f in t.fields if f.encode_name == seg for u in _flat(f.type)]
            elif isinstance(seg, int) and isinstance(t, (mi.ListType, mi.VarTupleType)):
                nxt += list(_flat(t.item_type))
        types = nxt
    return types


def _description_at(root: type, path: str) -> str | None:
    """The ``Meta(description=...)`` of the field at ``path``, when it has one."""
    segments = list(_segments(path))
    last = segments[-1] if segments else None
    if not isinstance(last, str):
        return None
    parent = segments[:-1]
    parent_path = "$" + "".join(f".{p}" if isinstance(p, str) else f"[{p}]" for p in parent)
    for t in _type_at(root, parent_path):
        if isinstance(t, mi.StructType):
            for f in t.fields:
                if f.encode_name == last:
                    for m in _metadata(f.type):
                        description = (m.extra_json_schema or {}).get("description")
                        if description:
                            return str(description)
    return None


def _metadata(t: mi.Type) -> Iterator[mi.Metadata]:
    if isinstance(t, mi.Metadata):
        yield t
        yield from _metadata(t.type)
    elif isinstance(t, mi.UnionType):
        for u in t.types:
            yield from _metadata(u)


def _field_names(root: type, path: str) -> list[str]:
    return [f.encode_name for t in _type_at(root, path) if isinstance(t, mi.StructType) for f in t.fields]


def _literal_values(root: type, path: str) -> list[object]:
    return [v for t in _type_at(root, path) if isinstance(t, mi.LiteralType) for v in t.values]


def untyped(text: str) -> object:
    """``text`` decoded as plain YAML (mappings, lists, scalars), or ``MISSING`` when it is not YAML."""
    try:
        return msgspec.yaml.decode(text)
    except msgspec.DecodeError:
        return MISSING


def _raw_at(raw: object, path: str) -> object:
    node: Any = raw  # plain YAML data: indexed as it comes, a wrong kind of node is a TypeError
    for seg in _segments(path):
        try:
            node = node[seg]
        except (KeyError, IndexError, TypeError):
            return MISSING
    return node
