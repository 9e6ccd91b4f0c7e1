"""Reading a placement's text form (``ppharness.plan.lang.text_form`` has the grammar): ``parse``. Every problem is a
``PlanError`` naming the source, the line and column, what is wrong and the fix. The text is bounded: at most
``MAX_TEXT_BYTES`` in all and ``MAX_LINE_CHARS`` per line.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Literal

from ppharness.document.yaml_limits import short
from ppharness.errors import PlanError
from ppharness.plan.lang.document import ID_NAME, Blocks, Edge, Embed, ExpertGroup, Head, Node, Objective, Op, Placement
from ppharness.plan.lang.text_form import (
    DEFAULT_OBJECTIVE,
    HEADERS,
    KEYWORDS,
    MAX_EXPERT_IDS,
    MAX_INDEX_DIGITS,
    MAX_REQUESTS,
    OBJECTIVES,
)

MAX_TEXT_BYTES = 1 << 20  # 1 MiB
MAX_LINE_CHARS = 4096
FAULT_POLICIES: tuple[Literal["none", "retry", "failover"], ...] = ("none", "retry", "failover")
_OPS = ("embed", "head", "blk[a:b]", "experts[block][ids]")
_BLK = re.compile(r"blk[ \t]*\[[ \t]*([0-9]+)[ \t]*:[ \t]*([0-9]+)[ \t]*\]")
_EXPERTS = re.compile(r"experts[ \t]*\[[ \t]*([0-9]+)[ \t]*\][ \t]*\[(.*)\]")
_ID = re.compile(r"([0-9]+)(?:[ \t]*-[ \t]*([0-9]+))?")
_DOTS = re.compile(r"([0-9]+)[ \t]*\.\.[ \t]*([0-9]+)")
_LABEL = re.compile(r"[^\s:,\[\]#]*")
_OBJECTIVE = re.compile(r"([a-z]+)(?:[ \t]+x([0-9]+))?")
_SPACE = " \t"


@dataclass
class _Node:
    """A node line as read: the node, where its label is, and its successors with their columns."""

    node: Node
    line: int
    column: int
    successors: list[tuple[str, int]] = field(default_factory=list)
    targets: list[tuple[str, int]] = field(default_factory=list)  # after "=>": its experts edges


@dataclass
class _Reader:
    source: str
    nodes: list[_Node] = field(default_factory=list)
    labels: dict[str, _Node] = field(default_factory=dict)
    extras: dict[str, int] = field(default_factory=dict)  # keyword -> the line that gave it
    spares: tuple[str, ...] = ()
    objective: Objective = DEFAULT_OBJECTIVE
    policy: str = ""
    fault_tolerance: Literal["", "none", "retry", "failover"] = ""
    headers: dict[str, tuple[str, int]] = field(default_factory=dict)  # model/cluster -> (value, line)


class _Line:
    """One line being read: its text (comment removed), its number, and the source for errors."""

    def __init__(self, reader: _Reader, text: str, number: int) -> None:
        self.reader = reader
        self.text = text
        self.number = number

    def error(self, column: int, problem: str, fix: str) -> PlanError:
        """``column`` is 0-based here and 1-based in the message."""
        return PlanError(f"{self.reader.source}: line {self.number}, column {column + 1}: {problem} — {fix}")

    def word(self, start: int, end: int) -> tuple[str, int]:
        """The text between ``start`` and ``end`` with spaces trimmed, and the column it starts at."""
        raw = self.text[start:end]
        stripped = raw.strip(_SPACE)
        return stripped, start + (len(raw) - len(raw.lstrip(_SPACE)))

    def items(self, start: int, end: int) -> list[tuple[str, int]]:
        """The comma-separated items between ``start`` and ``end``, trimmed, each with its column (a comma inside
        square brackets, as in ``experts[2][0,5]``, does not separate)."""
        out, at, depth = [], start, 0
        for i in range(start, end):
            c = self.text[i]
            if c == "[":
                depth += 1
            elif c == "]":
                depth = max(0, depth - 1)
            elif c == "," and depth == 0:
                out.append(self.word(at, i))
                at = i + 1
        out.append(self.word(at, end))
        return out


def parse(text: str, source: str = "<text>") -> Placement:
    """The placement that ``text`` (the text form, ``ppharness.plan.lang.text_form``) describes. Every problem is a
    PlanError naming ``source``, the line and column, what is wrong and the fix. Header lines (``model:``,
    ``cluster:``) are read and dropped: ``parse_document`` returns them."""
    return parse_document(text, source)[0]


def parse_document(text: str, source: str = "<text>") -> tuple[Placement, dict[str, tuple[str, int]]]:
    """``parse``, and the text's header lines: ``{"model": (value, line), "cluster": (value, line)}`` for those it
    has (``ppharness.plan.reader`` resolves them)."""
    _bounded(text, source)
    reader = _Reader(source)
    for number, raw in enumerate(text.split("\n"), start=1):
        if len(raw) > MAX_LINE_CHARS:
            raise PlanError(
                f"{source}: line {number}, column {MAX_LINE_CHARS + 1}: the line has {len(raw):,} characters, over "
                f"the limit of {MAX_LINE_CHARS:,} per line — write one node per line"
            )
        hash_at = raw.find("#")
        body = (raw if hash_at < 0 else raw[:hash_at]).rstrip(" \t\r")
        if body.strip(_SPACE):
            _read_line(_Line(reader, body, number))
    if not reader.nodes:
        raise PlanError(
            f"{source}: no node lines — a placement has at least one, e.g. `gpu-a: embed, blk[0:8], head -> gpu-a`"
        )
    edges = []
    for entry in reader.nodes:
        kind: Literal["activation", "token"] = "token" if entry.node.heads else "activation"
        lists: tuple[tuple[list[tuple[str, int]], str, Literal["activation", "token", "experts"]], ...] = (
            (entry.successors, "successor", kind),
            (entry.targets, "node after '=>'", "experts"),
        )
        for names, what, edge_kind in lists:
            for name, column in names:
                if name not in reader.labels:
                    labels = list(reader.labels)
                    known = ", ".join(labels[:10]) + (f" and {len(labels) - 10} more" if len(labels) > 10 else "")
                    raise _Line(reader, "", entry.line).error(
                        column,
                        f"unknown node {short(name, 40)}{_suggest(name, labels)}",
                        f"a {what} is a node of this placement ({known}); define it on a line of its own",
                    )
                edges.append(Edge(src=entry.node.label, dst=name, kind=edge_kind))
    placement = Placement(
        nodes=tuple(entry.node for entry in reader.nodes),
        edges=tuple(edges),
        spares=reader.spares,
        objective=reader.objective,
        policy=reader.policy,
        fault_tolerance=reader.fault_tolerance,
    )
    return placement, reader.headers


def _bounded(text: str, source: str) -> None:
    size = len(text) if len(text) * 4 <= MAX_TEXT_BYTES else len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_TEXT_BYTES:
        raise PlanError(
            f"{source}: the text is {size:,} bytes, over the limit of {MAX_TEXT_BYTES:,} (1 MiB) — a placement is a "
            "few lines, one per node"
        )


def _read_line(line: _Line) -> None:
    text = line.text
    fan = text.find("=>")
    limit = len(text) if fan < 0 else fan
    segments, at = [], 0
    while True:
        arrow = text.find("->", at, limit)
        segments.append((at, limit if arrow < 0 else arrow))
        if arrow < 0:
            break
        at = arrow + 2
    start, end = segments[0]
    label, column, colon = _head(line, start, end)
    if label in HEADERS:
        _read_header(line, label, column, colon + 1)
        return
    if label in KEYWORDS:
        if len(segments) > 1 or fan >= 0:
            arrow_at = segments[1][0] - 2 if len(segments) > 1 else fan
            raise line.error(
                arrow_at,
                f"{text[arrow_at : arrow_at + 2]!r} on the {label}: line",
                f"edges belong on node lines; a node on a device called {label} is written @{label}",
            )
        _read_extra(line, label, column, colon + 1, end)
        return
    _read_segments(line, _define(line, label, column, colon + 1, end), segments)
    if fan >= 0:  # the targets after "=>" belong to the last node the line defines
        _read_targets(line, fan)


def _read_targets(line: _Line, fan: int) -> None:
    """The experts edges after the line's ``=>`` (at column ``fan``), for the last node defined."""
    text = line.text
    for mark in ("=>", "->"):
        again = text.find(mark, fan + 2)
        if again >= 0:
            raise line.error(
                again,
                f"{mark!r} after '=>'",
                "write a node's successors (-> ...) first and the nodes computing its experts (=> ...) last, once",
            )
    if not text[fan + 2 :].strip(_SPACE):
        raise line.error(fan, "nothing after '=>'", "name the node(s) that compute this node's experts")
    line.reader.nodes[-1].targets.extend(_successors(line, fan + 2, len(text), "node after '=>'"))


def _read_segments(line: _Line, previous: _Node, segments: list[tuple[int, int]]) -> None:
    """The segments after a node line's first ``->`` (successors, or the next nodes of a loop on one line)."""
    for k, (start, end) in enumerate(segments[1:], start=1):
        arrow = start - 2
        if not line.text[start:end].strip(_SPACE):
            raise line.error(arrow, "nothing after '->'", "name the node(s) that receive this node's output")
        if ":" not in line.text[start:end]:
            previous.successors.extend(_successors(line, start, end, "successor"))
            if k != len(segments) - 1:
                raise line.error(
                    segments[k + 1][0] - 2,
                    "'->' after a list of successors",
                    "write the next node as `label: ops` after the arrow, or put it on a line of its own",
                )
            return
        label, column, colon = _head(line, start, end)
        if label in KEYWORDS + HEADERS:
            raise line.error(
                column, f"{label}: after '->'", f"write {label}: on a line of its own (a node on that device: @{label})"
            )
        entry = _define(line, label, column, colon + 1, end)
        previous.successors.append((entry.node.label, column))
        previous = entry


def _head(line: _Line, start: int, end: int) -> tuple[str, int, int]:
    """A node line's (or segment's) label, its column, and the column of the colon after it."""
    text = line.text
    column = start
    while column < end and text[column] in _SPACE:
        column += 1
    match = _LABEL.match(text, column, end)
    assert match is not None  # the pattern matches the empty string
    label = match[0]
    colon = match.end()
    while colon < end and text[colon] in _SPACE:
        colon += 1
    if not label:
        raise line.error(
            column, "a line starts without a node label", "write `device: ops`, e.g. `gpu-a: embed, blk[0:6]`"
        )
    if colon >= end or text[colon] != ":":
        shown = short(label, 40)
        raise line.error(
            colon,
            f"missing ':' after the node label {shown}",
            f"write the label, a colon, then the ops: `{label[:40]}: embed, blk[0:6] -> next`",
        )
    return label, column, colon


def _define(line: _Line, label: str, column: int, start: int, end: int) -> _Node:
    """The node ``label: ops`` (ops between ``start`` and ``end``), added to the reader."""
    name, device = "", label
    if "@" in label:
        name, _, device = label.partition("@")
        if "@" in device:
            raise line.error(column, f"{short(label, 40)} has more than one '@'", "write name@device")
    if name:
        _name(line, name, column, "node name")
    _name(line, device, column + len(name) + (1 if "@" in label else 0), "device id")
    ops = tuple(_read_op(line, word, at) for word, at in line.items(start, end))
    node = Node(device=device, ops=ops, name=name)
    reader = line.reader
    first = reader.labels.get(node.label)
    if first is not None:
        raise line.error(
            column,
            f"node {node.label!r} is defined twice (first at line {first.line})",
            "one line per node: merge the two lines, or give one a name of its own (name@device)",
        )
    entry = _Node(node, line.number, column)
    reader.nodes.append(entry)
    reader.labels[node.label] = entry
    return entry


def _name(line: _Line, value: str, column: int, what: str) -> None:
    if not ID_NAME.fullmatch(value):
        raise line.error(
            column, f"{short(value, 40)} is not a {what}", "use lower-case letters, digits, - and _ (1 to 63)"
        )


def _read_op(line: _Line, word: str, column: int) -> Op:
    if word == "embed":
        return Embed()
    if word == "head":
        return Head()
    if not word:
        raise line.error(column, "an op is missing", f"list the node's ops separated by commas: {', '.join(_OPS)}")
    if word.startswith("experts"):
        return _read_experts(line, word, column)
    match = _BLK.fullmatch(word) or _DOTS.fullmatch(word)
    if match is None:
        if word.startswith("blk") or word[:1].isdigit():
            raise line.error(
                column,
                f"{short(word, 40)} is not a block range",
                "write blk[a:b] for blocks a to b - 1, e.g. blk[0:6]",
            )
        raise line.error(
            column,
            f"unknown op {short(word, 40)}{_suggest(word, ['embed', 'head', 'blk', 'experts'])}",
            f"the ops are {', '.join(_OPS)}",
        )
    lo_text, hi_text = match[1], match[2]
    if max(len(lo_text), len(hi_text)) > MAX_INDEX_DIGITS:
        raise line.error(
            column,
            f"{short(word, 40)} has a block index of more than {MAX_INDEX_DIGITS} digits",
            "use the model's block numbers",
        )
    lo, hi = int(lo_text), int(hi_text)
    if hi <= lo:
        problem = f"the block range {word} is empty" + (f": it ends at {hi}, before its start {lo}" if hi < lo else "")
        example = f"blk[{hi}:{lo}]" if hi < lo else f"blk[{lo}:{lo + 1}]"
        raise line.error(column, problem, f"blk[a:b] runs blocks a to b - 1, so b is more than a: e.g. {example}")
    return Blocks(lo=lo, hi=hi)


def _read_experts(line: _Line, word: str, column: int) -> ExpertGroup:
    """``experts[b][ids]``: the experts ``ids`` of block ``b`` (ids: ``5``, ``0-3``, separated by commas)."""
    example = "e.g. experts[2][0-3,5] for experts 0, 1, 2, 3 and 5 of block 2"
    match = _EXPERTS.fullmatch(word)
    if match is None:
        raise line.error(column, f"{short(word, 40)} is not an experts op", f"write experts[block][ids], {example}")
    if len(match[1]) > MAX_INDEX_DIGITS:
        raise line.error(
            column + match.start(1),
            f"the block {short(match[1], 20)} has more than {MAX_INDEX_DIGITS} digits",
            "use the model's block numbers",
        )
    inside, at = match[2], column + match.start(2)
    ids: list[int] = []
    for piece in inside.split(","):
        item = piece.strip(_SPACE)
        where = at + len(piece) - len(piece.lstrip(_SPACE))
        at += len(piece) + 1
        if not item:
            raise line.error(where, "an expert id is missing", f"list the ids separated by commas, {example}")
        run = _ID.fullmatch(item)
        if run is None:
            raise line.error(
                where, f"{short(item, 40)} is not an expert id or run of ids", f"write 5 or 0-3, {example}"
            )
        if max(len(run[1]), len(run[2] or "")) > MAX_INDEX_DIGITS:
            raise line.error(where, f"{short(item, 40)} has an id of more than {MAX_INDEX_DIGITS} digits", example)
        first = int(run[1])
        last = int(run[2]) if run[2] is not None else first
        if last < first:
            raise line.error(where, f"the run {item} goes backwards", f"write first-last, here {last}-{first}")
        if ids and first <= ids[-1]:
            raise line.error(
                where,
                f"expert {first} comes after expert {ids[-1]}",
                "list each expert once, in increasing order",
            )
        if len(ids) + last - first + 1 > MAX_EXPERT_IDS:
            raise line.error(
                where,
                f"more than {MAX_EXPERT_IDS:,} experts in one op",
                "a block has fewer experts; list the ids of this node's",
            )
        ids.extend(range(first, last + 1))
    return ExpertGroup(layer=int(match[1]), ids=tuple(ids))


def _successors(line: _Line, start: int, end: int, what: str) -> list[tuple[str, int]]:
    out = []
    arrow = "->" if what == "successor" else "=>"
    for word, column in line.items(start, end):
        if not word:
            raise line.error(column, f"a {what} is missing", f"list the nodes separated by commas: `{arrow} gpu-b`")
        if "@" in word:
            raise line.error(
                column,
                f"{short(word, 40)} names a device as well",
                f"a {what} is a node's label: its name, or its device when it has no name",
            )
        _name(line, word, column, "node label")
        out.append((word, column))
    return out


def _read_header(line: _Line, keyword: str, column: int, start: int) -> None:
    """``model: VALUE`` or ``cluster: VALUE``: the rest of the line, once per text."""
    reader = line.reader
    first = reader.headers.get(keyword)
    if first is not None:
        raise line.error(column, f"a second {keyword}: line (the first is line {first[1]})", "keep one")
    value, at = line.word(start, len(line.text))
    if not value:
        example = "model: small" if keyword == "model" else "cluster: clusters/mine.yaml"
        fix = f"name it, e.g. `{example}` (a node on a device called {keyword} is written @{keyword})"
        raise line.error(at, f"{keyword}: says nothing", fix)
    reader.headers[keyword] = (value, line.number)


def _read_extra(line: _Line, keyword: str, column: int, start: int, end: int) -> None:
    reader = line.reader
    first = reader.extras.get(keyword)
    if first is not None:
        raise line.error(column, f"a second {keyword}: line (the first is line {first})", "keep one")
    reader.extras[keyword] = line.number
    if keyword == "spares":
        spares = []
        for word, at in line.items(start, end):
            if not word:
                raise line.error(
                    at, "a spare device is missing", "list device ids separated by commas: `spares: cpu-1`"
                )
            _name(line, word, at, "device id")
            spares.append(word)
        reader.spares = tuple(spares)
        return
    word, at = line.word(start, end)
    if keyword == "policy":
        if not word:
            raise line.error(at, "policy: says nothing", "name the policy, e.g. `policy: optimal`, or remove the line")
        _name(line, word, at, "policy")
        reader.policy = word
        return
    if keyword == "fault_tolerance":
        policy = next((p for p in FAULT_POLICIES if p == word), None)
        if policy is None:
            raise line.error(
                at,
                f"{short(word, 40) or 'nothing'} is not a fault-tolerance policy",
                f"write one of {', '.join(FAULT_POLICIES)}: `fault_tolerance: failover`",
            )
        reader.fault_tolerance = policy
        return
    match = _OBJECTIVE.fullmatch(word)
    if match is None or match[1] not in OBJECTIVES:
        raise line.error(
            at,
            f"{short(word, 40)} is not an objective",
            f"write one of {', '.join(OBJECTIVES)}, with xN for N requests in flight: `objective: throughput x4`",
        )
    requests = match[2] or "1"
    if len(requests) > 4 or not 1 <= int(requests) <= MAX_REQUESTS:
        raise line.error(
            at + match.start(2) - 1,
            f"{requests[:10]}{'…' if len(requests) > 10 else ''} requests in flight",
            f"requests in flight are 1 to {MAX_REQUESTS}: x1 to x{MAX_REQUESTS}",
        )
    kind = next(k for k in OBJECTIVES if k == match[1])
    reader.objective = Objective(kind=kind, requests=int(requests))


def _suggest(word: str, choices: list[str]) -> str:
    """`` (did you mean 'x'?)`` when ``word`` is close to one of ``choices``."""
    close = difflib.get_close_matches(word[:64], choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
