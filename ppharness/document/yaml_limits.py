"""Limits a scenario's YAML must keep before it is decoded: one pass over the parser's events, in bounded time and
memory.

A scenario is a few dozen values; a file that is not is refused here, before ``msgspec.yaml.decode`` builds anything:

- ``MAX_FILE_BYTES``: the whole file (checked by the caller before reading it);
- ``MAX_DEPTH``: nested mappings and lists, an alias counting as the node it stands for;
- ``MAX_SCALAR_BYTES``: one value in UTF-8 (a long prompt fits);
- ``MAX_NODES`` and ``MAX_EXPANDED_BYTES``: the document with every alias expanded, so a file of nested aliases
  ("billion laughs") fails here in microseconds instead of being expanded by the decoder;
- one document per file, only the tags the safe loader reads, no alias to an undefined anchor or to a node that
  contains it, and no key twice in a mapping (YAML itself would keep the last one silently).

A plan (or cluster) file is screened the same way within ``PLAN_LIMITS``: a program writes it, and a large
mixture-of-experts model's placement names tens of thousands of experts.

Given the keys its document's type allows (``ppharness.document.keys``, as plans and clusters are read), the screen
also refuses an unknown key without walking far into its value, and a list as soon as it grows past its field's
maximum length.

Aliases are never expanded: each anchor's expanded size and height are added up as its node closes, and an alias adds
them. ``screen`` raises ``YamlLimit`` naming the ``$.path``, the line and the fix.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Protocol

import yaml

from ppharness.document.keys import Keys

MAX_FILE_BYTES = 1 << 20  # 1 MiB
MAX_DEPTH = 32
MAX_SCALAR_BYTES = 256 << 10  # 256 KiB
MAX_NODES = 10_000
MAX_EXPANDED_BYTES = MAX_FILE_BYTES
MAX_NUMBER_CHARS = 64
UNKNOWN_EVENTS = 1_000  # parser events read after an unknown key before it is refused


@dataclass(frozen=True)
class Limits:
    """The size limits of one kind of document: the file's bytes (also the text with every alias expanded), its
    values, and what such a document usually holds (said in the error)."""

    file_bytes: int = MAX_FILE_BYTES
    nodes: int = MAX_NODES
    usual: str = "a scenario has a few dozen"


SCENARIO_LIMITS = Limits()
# a plan is written by a program, and a mixture-of-experts placement names every routed expert it places (kimi-k2:
# 60 blocks of 384 experts, with replicas and routing frequencies): larger bounds, the same screening
PLAN_LIMITS = Limits(file_bytes=32 << 20, nodes=2_000_000, usual="a plan has about one per placed expert")


class _Resolver(Protocol):
    """``yaml.resolver.Resolver.resolve``, which the PyYAML stubs leave unannotated: the tag of a plain scalar."""

    def resolve(self, kind: type[yaml.Node], value: str, implicit: tuple[bool, bool]) -> str: ...


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_RESOLVER: _Resolver = yaml.resolver.Resolver()
_YAML_TAG = "tag:yaml.org,2002:"
_TAGS = frozenset(tag for tag in yaml.SafeLoader.yaml_constructors if tag)  # null, bool, int, ..., binary, set
_STR = "tag:yaml.org,2002:str"
_MERGE = "tag:yaml.org,2002:merge"
_NUMBERS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


class YamlLimit(ValueError):
    """The document breaks a limit: ``path`` is where (``$.request.prompt``), the message says what and the fix."""

    def __init__(self, path: str, message: str, located: bool = False) -> None:
        super().__init__(message)
        self.path = path
        self.located = located  # the message names the path itself


def short(text: str, limit: int = 60) -> str:
    """``repr`` of ``text``, cut to ``limit`` characters with its full length said when longer."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text):,} characters)"


def _name(anchor: str) -> str:
    return anchor if len(anchor) <= 40 else f"{anchor[:40]}…"


def _segment(key: str) -> str:
    return f".{key}" if key.isidentifier() and len(key) <= 64 else f"[{short(key, 40)}]"


@dataclass
class _Size:
    nodes: int = 1
    text: int = 0  # bytes of scalar text
    height: int = 0  # collection levels below and including this node


@dataclass
class _Frame:
    mapping: bool
    anchor: str | None
    size: _Size = field(default_factory=_Size)
    key: str | None = None  # mapping: the current key's path segment
    want_key: bool = True  # mapping: the next node is a key
    index: int = 0  # sequence: the next item's index
    keys: dict[tuple[str, str], int] = field(default_factory=dict)  # mapping: (tag, value) -> 1-based line
    allowed: Keys | None = None  # its keys and list length, when the document's type says them
    value: Keys | None = None  # mapping: what the current key's value may be


class _Screen:
    def __init__(self, limits: Limits, keys: Keys | None = None) -> None:
        self.limits = limits
        self.root = keys
        self.stack: list[_Frame] = []
        self.anchors: dict[str, _Size | None] = {}  # None while the anchored node is still open
        self.nodes = 0
        self.text = 0
        self.documents = 0
        self.line = 0
        self.events = 0
        # the first unknown key: its error and the events read before it; raised at the document's end, or once
        # UNKNOWN_EVENTS more have been read (a problem in a short document is said first, a long one not walked)
        self.unknown: tuple[YamlLimit, int] | None = None

    def path(self) -> str:
        """Where the parser is: ``$.request.prompt``, ``$.faults[1]``."""
        parts = ["$"]
        for frame in self.stack:
            if frame.mapping:
                if frame.key is not None and not frame.want_key:
                    parts.append(frame.key)
            else:
                parts.append(f"[{frame.index}]")
        return "".join(parts)

    def feed(self, event: yaml.Event) -> None:
        line = self.line = event.start_mark.line + 1 if event.start_mark is not None else 0
        self.events += 1
        if self.unknown is not None and self.events - self.unknown[1] > UNKNOWN_EVENTS:
            raise self.unknown[0]
        if isinstance(event, yaml.DocumentStartEvent):
            self.documents += 1
            if self.documents > 1:
                raise YamlLimit(
                    "$",
                    f"a second YAML document starts at line {line} — a scenario file is one "
                    "document: remove the `---` and what follows, or split it into two files",
                )
        elif isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            self._node(event, line, _Size())
            if len(self.stack) >= MAX_DEPTH:
                raise YamlLimit(
                    self.path(),
                    f"nested more than {MAX_DEPTH} levels deep at line {line} — "
                    f"a scenario needs a few levels; at most {MAX_DEPTH} are read",
                )
            frame = _Frame(isinstance(event, yaml.MappingStartEvent), event.anchor, allowed=self._allowed())
            if event.anchor is not None:
                self.anchors[event.anchor] = None
            self.stack.append(frame)
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            frame = self.stack.pop()
            frame.size.height += 1
            if frame.anchor is not None:
                self.anchors[frame.anchor] = frame.size
            self._done(frame.size)
        elif isinstance(event, yaml.ScalarEvent):
            self._scalar(event, line)
        elif isinstance(event, yaml.AliasEvent):
            anchor = event.anchor
            assert anchor is not None  # the parser names the anchor of every alias
            if anchor not in self.anchors:
                raise YamlLimit(
                    self.path(),
                    f"alias *{_name(anchor)} at line {line} names no anchor "
                    "defined before it — define `&name` first or write the value out",
                )
            size = self.anchors[anchor]
            if size is None:
                raise YamlLimit(
                    self.path(),
                    f"alias *{_name(anchor)} at line {line} refers to a "
                    "node that contains it — a scenario cannot be recursive",
                )
            self._node(event, line, size)
            if len(self.stack) + size.height > MAX_DEPTH:
                raise YamlLimit(
                    self.path(),
                    f"alias *{_name(anchor)} at line {line} nests the "
                    f"document more than {MAX_DEPTH} levels deep — write the value out",
                )
            self._done(size)

    def _scalar(self, event: yaml.ScalarEvent, line: int) -> None:
        value = event.value
        n = len(value) if len(value) * 4 <= MAX_SCALAR_BYTES else len(value.encode("utf-8", "surrogatepass"))
        parent = self.stack[-1] if self.stack else None
        is_key = parent is not None and parent.mapping and parent.want_key
        where = self.path()
        if n > MAX_SCALAR_BYTES:
            what = "key" if is_key else "value"
            raise YamlLimit(
                where,
                f"a {what} of {n:,} bytes at line {line} is over the limit of "
                f"{MAX_SCALAR_BYTES:,} bytes (256 KiB) per value — shorten it",
            )
        tag = self._tag(event)
        if tag in _NUMBERS and len(value) > MAX_NUMBER_CHARS:
            raise YamlLimit(
                where,
                f"a number of {len(value):,} characters at line {line} — numbers in a scenario "
                f"have at most {MAX_NUMBER_CHARS}; quote it if it is text",
            )
        size = _Size(text=n)
        self._node(event, line, size)
        if is_key:
            assert parent is not None
            if tag != _MERGE:
                first = parent.keys.get((tag, value))
                if first is not None:
                    lines = f"line {line}" if first == line else f"lines {first} and {line}"
                    raise YamlLimit(
                        where,
                        f"key {short(value, 40)} appears twice, at {lines} — keep one "
                        "(YAML would silently use the last)",
                    )
                parent.keys[(tag, value)] = line
            parent.key = _segment(value)
            self._key(parent, tag, value, line)
        self._done(size)

    def _tag(self, event: yaml.ScalarEvent) -> str:
        if event.tag not in (None, "!"):
            return event.tag
        if event.implicit[0]:
            return _RESOLVER.resolve(yaml.ScalarNode, event.value, (True, False))
        return _STR

    def _node(self, event: yaml.NodeEvent, line: int, size: _Size) -> None:
        """Count a node (an alias counts as its anchor's whole expansion) against the document limits."""
        tag = getattr(event, "tag", None)
        if tag not in (None, "!") and tag not in _TAGS:
            shown = "!!" + tag[len(_YAML_TAG) :] if tag.startswith(_YAML_TAG) else tag
            raise YamlLimit(
                self.path(),
                f"tag {short(shown, 40)} at line {line} is not one the safe loader reads — "
                "remove it and write the value plainly",
            )
        parent = self.stack[-1] if self.stack else None
        if parent is not None and parent.mapping and parent.want_key and not isinstance(event, yaml.ScalarEvent):
            parent.key = "[?]"  # a list, a mapping or an alias used as a key: no field name
            parent.value = None
        self.nodes += size.nodes
        self.text += size.text
        if self.nodes > self.limits.nodes:
            raise YamlLimit(
                self.path(),
                f"the document grows past {self.limits.nodes:,} values at line {line}"
                f"{' (aliases expanded)' if self.anchors else ''} — {self.limits.usual}; remove the repeated "
                "aliases or the surplus entries",
            )
        if self.text > self.limits.file_bytes:
            raise YamlLimit(
                self.path(),
                f"aliases expand the document's text past {self.limits.file_bytes:,} bytes "
                f"({self.limits.file_bytes >> 20} MiB) at line {line} — write each value once",
            )
        anchor = getattr(event, "anchor", None)
        if isinstance(event, yaml.ScalarEvent) and anchor is not None:
            self.anchors[anchor] = size

    def _done(self, size: _Size) -> None:
        """A node is complete: add it to its parent and move the parent to its next key, value or item."""
        if not self.stack:
            return
        parent = self.stack[-1]
        parent.size.nodes += size.nodes
        parent.size.text += size.text
        parent.size.height = max(parent.size.height, size.height)
        if parent.mapping:
            if parent.want_key:
                parent.want_key = False
            else:
                parent.want_key = True
        else:
            parent.index += 1
            most = parent.allowed.max_items if parent.allowed is not None else None
            if most is not None and parent.index > most:
                raise YamlLimit(
                    self.path(),
                    f"the list grows past its {most:,} items at line {self.line} — this field holds at most {most:,}; "
                    "remove the surplus items",
                )

    def _allowed(self) -> Keys | None:
        """What the collection starting now may hold (None: not checked)."""
        if not self.stack:
            return self.root
        parent = self.stack[-1]
        if parent.allowed is None:
            return None
        if parent.mapping:
            return None if parent.want_key else parent.value
        return parent.allowed.items

    def _key(self, parent: _Frame, tag: str, value: str, line: int) -> None:
        """Refuse a key the document's type does not have, before its value is read; note what its value may be."""
        allowed = parent.allowed
        if allowed is None or tag == _MERGE:
            parent.value = None
            return
        parent.value = allowed.value_of(value)
        if allowed.fields is not None and value not in allowed.fields and self.unknown is None:
            known = list(allowed.fields)
            close = difflib.get_close_matches(value, known, n=1) if len(value) <= 64 else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            where = self.path()
            message = f"unknown field {short(value, 40)} at {where} — expected one of: {', '.join(known)}{hint}"
            self.unknown = (YamlLimit(where, message, located=True), self.events)


def screen(text: str, limits: Limits = SCENARIO_LIMITS, keys: Keys | None = None) -> None:
    """Raise ``YamlLimit`` if ``text`` breaks a limit or is not YAML (then naming the line, column and problem);
    ``keys``: the keys and list lengths the document's type allows, refused as the parser reaches them."""
    s = _Screen(limits, keys)
    loader = _Loader(text)
    try:
        while loader.check_event():
            s.feed(loader.get_event())
        if s.unknown is not None:
            raise s.unknown[0]
    except yaml.YAMLError as exc:
        raise YamlLimit(s.path(), not_yaml(exc)) from None
    finally:
        loader.dispose()


def not_yaml(exc: yaml.YAMLError) -> str:
    """One line for a YAML error, without the library's quoted snippets: where and what."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or "not understood"
    problem = str(problem)[:200]
    if mark is not None:
        return f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem} — fix the syntax there"
    position = getattr(exc, "position", None)
    where = f" at character {position + 1}" if isinstance(position, int) else ""
    return f"not valid YAML{where}: {problem} — fix the syntax there"
