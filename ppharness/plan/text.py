"""The compact text form of a placement: one line per node.

::

    # a comment; blank lines and comments are dropped
    gpu-a: embed, blk[0:6] -> gpu-b
    gpu-b: blk[6:16], experts[8][0-5,9], head -> gpu-a => x1
    x1: experts[8][6-8,10]
    spares: cpu-1, cpu-2
    objective: throughput x4
    policy: memory
    fault_tolerance: failover

Grammar (one line each; spaces and tabs between tokens are free; ``#`` starts a comment to the end of the line)::

    node line   := label ":" op ("," op)* ["->" succ ("," succ)*] ["=>" target ("," target)*]
    label       := device | name "@" device | "@" device
    op          := "embed" | "blk[" lo ":" hi "]" | "head"      (also "lo..hi" on input)
                 | "experts[" block "][" ids "]"
    ids         := id-or-run ("," id-or-run)*                   (increasing, each expert once)
    id-or-run   := id | first "-" last                          (first to last, both included)
    succ        := a node's label: its name, or its device when it has none
    target      := a node's label
    spares line := "spares:" device ("," device)*
    objective   := "objective:" ("latency" | "throughput" | "cost") ["x" requests]
    policy line := "policy:" word
    fault line  := "fault_tolerance:" ("none" | "retry" | "failover")

- A node's label is its device id, or ``name@device`` when the node has a name, even one equal to its device id (the
  name is then what edges and successors use). A node without a name on a device called ``spares``, ``objective``
  or ``policy`` is written ``@device``, so that it is not read as one of those lines.
- ``blk[a:b]`` runs blocks ``a`` to ``b - 1``; ``b`` is more than ``a``, and each has at most 9 digits.
- ``experts[b][ids]`` computes the routed experts ``ids`` of the mixture-of-experts block ``b`` (an ``experts`` op);
  ``render`` writes a run of three or more consecutive ids as ``first-last``. A node whose ops are all experts ops is
  an expert node.
- The successors of a node (after ``->``) are the destinations of its outgoing loop edges, in the order of
  ``placement.edges``: an edge out of a node whose ops include ``head`` is a ``token`` edge, every other one an
  ``activation`` edge. Its targets (after ``=>``) are the destinations of its ``experts`` edges (the fan-out from the
  node running a mixture-of-experts block to the nodes computing its experts), in the same order.
- ``render`` writes the nodes in their order, each with its edges (so the edges come out grouped by source node, in
  node order, a node's loop edges before its experts edges), then ``spares:`` (only when there are spares),
  ``objective:`` (only when it is not the default, latency with one request; ``xN`` only when N requests are more
  than one), ``policy:`` and ``fault_tolerance:`` (only when set), each line ending in a newline. ``parse`` reads
  the extra lines anywhere, at most once each, and makes the edges in the same grouped order. So
  ``parse(render(p)) == p`` for a placement whose edges are grouped that way (as ``ppharness.plan.build.chain`` and
  ``ppharness.plan.experts`` make them), and ``render(parse(t)) == t`` for any text ``render`` wrote.
- Input sugar: a whole loop on one line, ``a: embed, blk[0:6] -> b: blk[6:16], head -> a``. Each ``->`` that is
  followed by ``label: ops`` defines the next node and makes it the previous node's one successor; a last segment
  without a colon lists the last node's successors. A line has at most one ``=>``, at its end: its targets belong to
  the last node the line defines. Expert ids may also be written in any runs on input (``0,1,2`` for ``0-2``).

Every problem is a ``PlanError`` naming the source, the line and column, what is wrong and the fix. The text is
bounded: at most ``MAX_TEXT_BYTES`` in all and ``MAX_LINE_CHARS`` per line.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Literal

from ppharness.errors import PlanError
from ppharness.plan.doc import (
    ID_NAME,
    Blocks,
    Edge,
    Embed,
    ExpertGroup,
    Head,
    Node,
    Objective,
    Op,
    Placement,
    PlanDoc,
)
from ppharness.scenario.yaml_limits import short

MAX_TEXT_BYTES = 1 << 20  # 1 MiB
MAX_LINE_CHARS = 4096
MAX_INDEX_DIGITS = 9
MAX_EXPERT_IDS = 1 << 16  # experts in one experts op, at most
MAX_REQUESTS = 4096
KEYWORDS = ("spares", "objective", "policy", "fault_tolerance")
FAULT_POLICIES: tuple[Literal["none", "retry", "failover"], ...] = ("none", "retry", "failover")
Kind = Literal["latency", "throughput", "cost"]
OBJECTIVES: tuple[Kind, ...] = ("latency", "throughput", "cost")
_OPS = ("embed", "head", "blk[a:b]", "experts[block][ids]")
_BLK = re.compile(r"blk[ \t]*\[[ \t]*([0-9]+)[ \t]*:[ \t]*([0-9]+)[ \t]*\]")
_EXPERTS = re.compile(r"experts[ \t]*\[[ \t]*([0-9]+)[ \t]*\][ \t]*\[(.*)\]")
_ID = re.compile(r"([0-9]+)(?:[ \t]*-[ \t]*([0-9]+))?")
_DOTS = re.compile(r"([0-9]+)[ \t]*\.\.[ \t]*([0-9]+)")
_LABEL = re.compile(r"[^\s:,\[\]#]*")
_OBJECTIVE = re.compile(r"([a-z]+)(?:[ \t]+x([0-9]+))?")
_DEFAULT_OBJECTIVE = Objective()
_SPACE = " \t"


# --- writing ----------------------------------------------------------------------------------------------------


def render(placement: Placement) -> str:
    """The text form of ``placement`` (see the module's docstring); PlanError naming the ``$.placement`` path if
    something in it cannot be written so that ``parse`` reads it back."""
    _writable(placement)
    lines = []
    for node in placement.nodes:
        line = f"{_label(node)}: {', '.join(op_text(op) for op in node.ops)}"
        successors = [e.dst for e in placement.edges if e.src == node.label and e.kind != "experts"]
        if successors:
            line += f" -> {', '.join(successors)}"
        targets = [e.dst for e in placement.edges if e.src == node.label and e.kind == "experts"]
        if targets:
            line += f" => {', '.join(targets)}"
        lines.append(line)
    if placement.spares:
        lines.append(f"spares: {', '.join(placement.spares)}")
    objective = placement.objective
    if objective != _DEFAULT_OBJECTIVE:
        lines.append(f"objective: {objective.kind}" + (f" x{objective.requests}" if objective.requests > 1 else ""))
    if placement.policy:
        lines.append(f"policy: {placement.policy}")
    if placement.fault_tolerance:
        lines.append(f"fault_tolerance: {placement.fault_tolerance}")
    return "".join(line + "\n" for line in lines)


def render_plan(doc: PlanDoc) -> str:
    """The text form of a plan's placement, under a comment naming the plan (``parse`` drops the comment)."""
    model = doc.model
    head = f"# plan {doc.id or '(no id)'}: {model.arch}, {len(model.blocks)} blocks"
    if doc.cluster.name:
        head += f", cluster {doc.cluster.name}"
    return f"{head}\n{render(doc.placement)}"


def _label(node: Node) -> str:
    if node.name:
        return f"{node.name}@{node.device}"
    return f"@{node.device}" if node.device in KEYWORDS else node.device


def op_text(op: Op) -> str:
    """One op as the text form writes it: ``embed``, ``blk[0:6]``, ``head``, ``experts[2][0-3,5]``."""
    if isinstance(op, Embed):
        return "embed"
    if isinstance(op, Head):
        return "head"
    if isinstance(op, ExpertGroup):
        return f"experts[{op.layer}][{ids_text(op.ids)}]"
    return f"blk[{op.lo}:{op.hi}]"


def ids_text(ids: tuple[int, ...]) -> str:
    """``0-3,5,7,8`` for (0, 1, 2, 3, 5, 7, 8): runs of three or more as first-last."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


def _writable(placement: Placement) -> None:
    """Refuse what the text form cannot carry: a bad name, a node without ops, a label used twice, an edge that is
    not on a node's line or whose kind is not the one its source implies, a bad spare, objective or policy."""
    fix = "the text form writes only what it reads back; fix the placement (ppharness plan check says how)"
    if not placement.nodes:
        raise PlanError(f"$.placement.nodes: a placement has at least one node — {fix}")
    heads: dict[str, bool] = {}
    for i, node in enumerate(placement.nodes):
        at = f"$.placement.nodes[{i}]"
        for key, value in (("device", node.device), ("name", node.name)):
            if (key == "device" or value) and not ID_NAME.fullmatch(value):
                raise PlanError(
                    f"{at}.{key}: {short(value, 40)} is not a {key} the text form can write — use lower-case letters, "
                    "digits, - and _ (1 to 63)"
                )
        if node.label in heads:
            raise PlanError(f"{at}: the node label {node.label!r} is used twice — {fix}")
        if not node.ops:
            raise PlanError(f"{at}.ops: node {node.label!r} has no ops — {fix}")
        for j, op in enumerate(node.ops):
            if isinstance(op, Blocks) and (op.lo < 0 or len(str(op.hi)) > MAX_INDEX_DIGITS):
                raise PlanError(
                    f"{at}.ops[{j}]: blocks {op.lo}..{op.hi} are out of range — a block index is a whole number of "
                    f"at most {MAX_INDEX_DIGITS} digits"
                )
            if isinstance(op, ExpertGroup):
                _writable_group(op, f"{at}.ops[{j}]", fix)
        heads[node.label] = node.heads
    for i, edge in enumerate(placement.edges):
        at = f"$.placement.edges[{i}]"
        for end, name in (("from", edge.src), ("to", edge.dst)):
            if name not in heads:
                raise PlanError(f"{at}.{end}: {short(name, 40)} is not a node of the placement — {fix}")
        kind = "token" if heads[edge.src] else "activation"
        if edge.kind not in (kind, "experts"):
            raise PlanError(
                f"{at}.kind: an edge out of {edge.src!r} is a {kind} or an experts edge in the text form (token "
                f"edges leave the node that runs head), not {short(str(edge.kind), 20)} — {fix}"
            )
    for i, spare in enumerate(placement.spares):
        if not ID_NAME.fullmatch(spare):
            raise PlanError(f"$.placement.spares[{i}]: {short(spare, 40)} is not a device id — {fix}")
    objective = placement.objective
    if objective.kind not in OBJECTIVES or not 1 <= objective.requests <= MAX_REQUESTS:
        raise PlanError(
            f"$.placement.objective: {short(str(objective.kind), 20)} with {objective.requests} requests — the "
            f"objective is one of {', '.join(OBJECTIVES)} with 1 to {MAX_REQUESTS} requests"
        )
    if placement.policy and not ID_NAME.fullmatch(placement.policy):
        raise PlanError(
            f"$.placement.policy: {short(placement.policy, 40)} is not a word the text form can write — use "
            "lower-case letters, digits, - and _"
        )


def _writable_group(op: ExpertGroup, at: str, fix: str) -> None:
    def index(value: object) -> bool:
        return isinstance(value, int) and 0 <= value and len(str(value)) <= MAX_INDEX_DIGITS

    if not index(op.layer):
        raise PlanError(
            f"{at}.layer: {short(str(op.layer), 20)} is not a block — a block index is a whole number of at most "
            f"{MAX_INDEX_DIGITS} digits; {fix}"
        )
    if not op.ids or len(op.ids) > MAX_EXPERT_IDS or not all(index(i) for i in op.ids):
        raise PlanError(
            f"{at}.ids: {len(op.ids)} expert ids — an experts op lists 1 to {MAX_EXPERT_IDS:,} ids, each a whole "
            f"number of at most {MAX_INDEX_DIGITS} digits; {fix}"
        )
    if any(a >= b for a, b in zip(op.ids, op.ids[1:])):
        raise PlanError(f"{at}.ids: the ids are not increasing — list each expert once, in order; {fix}")


# --- reading ----------------------------------------------------------------------------------------------------


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
    objective: Objective = _DEFAULT_OBJECTIVE
    policy: str = ""
    fault_tolerance: Literal["", "none", "retry", "failover"] = ""


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
    """The placement that ``text`` (the text form, see the module's docstring) describes. Every problem is a
    PlanError naming ``source``, the line and column, what is wrong and the fix."""
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
    return Placement(
        nodes=tuple(entry.node for entry in reader.nodes),
        edges=tuple(edges),
        spares=reader.spares,
        objective=reader.objective,
        policy=reader.policy,
        fault_tolerance=reader.fault_tolerance,
    )


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
        if label in KEYWORDS:
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
