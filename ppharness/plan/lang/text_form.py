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
    header      := ("model:" | "cluster:") value                (a plan file's, ``ppharness.plan.reader``)

- A node's label is its device id, or ``name@device`` when the node has a name, even one equal to its device id (the
  name is then what edges and successors use). A node without a name on a device called ``spares``, ``objective``
  or ``policy`` (or ``model``, ``cluster``: a hand-written plan's header lines) is written ``@device``, so that it is
  not read as one of those lines.
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
  ``ppharness.plan.experts.place`` make them), and ``render(parse(t)) == t`` for any text ``render`` wrote.
- Input sugar: a whole loop on one line, ``a: embed, blk[0:6] -> b: blk[6:16], head -> a``. Each ``->`` that is
  followed by ``label: ops`` defines the next node and makes it the previous node's one successor; a last segment
  without a colon lists the last node's successors. A line has at most one ``=>``, at its end: its targets belong to
  the last node the line defines. Expert ids may also be written in any runs on input (``0,1,2`` for ``0-2``).

``parse`` (``ppharness.plan.lang.parse``) reads the text form: every problem is a ``PlanError`` naming the source, the
line and column, what is wrong and the fix, and the text is bounded (``MAX_TEXT_BYTES`` in all, ``MAX_LINE_CHARS`` per
line).
"""

from __future__ import annotations

from typing import Literal

from ppharness.document.yaml_limits import short
from ppharness.errors import PlanError
from ppharness.plan.lang.document import (
    ID_NAME,
    Blocks,
    Embed,
    ExpertGroup,
    Head,
    Node,
    Objective,
    Op,
    Placement,
    PlanDoc,
)

MAX_INDEX_DIGITS = 9
MAX_EXPERT_IDS = 1 << 16  # experts in one experts op, at most
MAX_REQUESTS = 4096
KEYWORDS = ("spares", "objective", "policy", "fault_tolerance")
# a hand-written plan's header lines (``ppharness.plan.reader``): where its model and its devices come from
HEADERS = ("model", "cluster")
Kind = Literal["latency", "throughput", "cost"]
OBJECTIVES: tuple[Kind, ...] = ("latency", "throughput", "cost")
DEFAULT_OBJECTIVE = Objective()


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
    if objective != DEFAULT_OBJECTIVE:
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
    return f"@{node.device}" if node.device in KEYWORDS + HEADERS else node.device


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
