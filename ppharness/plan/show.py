"""A plan for people: a text table, a Mermaid flowchart, a Graphviz graph and a PNG drawing.

Each shows every node (its device, its ops, what it needs of its device's memory and its predicted time per token)
and every edge (what it carries and its predicted time per token; the token edge dashed, experts edges dotted). The
times are the cost model's (``ppharness.plan.predict.cost``); the per-token total is ``simulate``'s, the CPU-quota wait
included, so that ``plan show``, ``plan make`` and ``plan simulate`` give one figure for one plan. Where the plan
places the experts of a mixture-of-experts model, a stage's time leaves out its blocks' routed experts, an expert
node's time is the expert work it is expected to do per token, an experts edge shows one request for one expert, and
the table lists each block's predicted fan-out time (``ppharness.plan.predict.fanout``), which the per-token total
includes.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from ppharness.plan.lang.check import gib, node_kv, node_memory, node_weights
from ppharness.plan.lang.document import Edge, ExpertGroup, Node, PlanDoc, loop, plan_id
from ppharness.plan.lang.text_form import op_text
from ppharness.plan.predict import cost
from ppharness.plan.predict.fanout import LayerTime, layer_times
from ppharness.plan.predict.simulate import simulate

SPELLED_GROUPS = 4  # a node with more expert groups than this shows them as a count (its text form has them all)
BOX_CHARS, BOX_LINES = 22, 3  # what a node box of the PNG holds per line, and lines of ops at most


def _boxed(text: str) -> str:
    """``text`` as it fits a node's box: wrapped at ``BOX_CHARS`` characters, at most ``BOX_LINES`` lines, the rest
    cut with an ellipsis (``plan text`` prints it whole)."""
    lines = textwrap.wrap(text, BOX_CHARS, break_long_words=True) or [""]
    if len(lines) > BOX_LINES:
        lines = [*lines[: BOX_LINES - 1], lines[BOX_LINES - 1][: BOX_CHARS - 1] + "…"]
    return "\n".join(lines)


def ops_text(node: Node) -> str:
    """``embed, blk[0:6]``, ``blk[6:8], head``, ``experts[2][0-3,5]``; a node with many expert groups:
    ``blk[0:24], experts of 24 blocks (106 ids)``."""
    groups = [op for op in node.ops if isinstance(op, ExpertGroup)]
    if len(groups) <= SPELLED_GROUPS:
        return ", ".join(op_text(op) for op in node.ops)
    rest = [op_text(op) for op in node.ops if not isinstance(op, ExpertGroup)]
    return ", ".join([*rest, f"experts of {len(groups)} blocks ({sum(len(g.ids) for g in groups):,} ids)"])


def _ordered(doc: PlanDoc) -> list[Node]:
    """The nodes along the loop, entry first; any node off the loop after them, in the file's order."""
    try:
        order = loop(doc)
    except StopIteration:  # no entry
        order = []
    seen = {n.label for n in order}
    return order + [n for n in doc.placement.nodes if n.label not in seen]


def _node_ms(doc: PlanDoc, node: Node, layers: list[LayerTime]) -> float:
    """A stage's time per token (without its routed experts where the plan places them); an expert node's expected
    expert work per token."""
    if node.expert_only:
        return sum(t.busy.get(node.label, 0.0) for t in layers)
    lo, hi = node.blocks or (0, 0)
    return cost.node_ms(doc.model, doc.cluster.device(node.device), lo, hi, node.heads, routed=not layers)


def _edge_bytes(doc: PlanDoc, edge: Edge) -> int:
    if edge.kind == "experts":
        return cost.request_bytes(doc.model, 1)
    return doc.model.token_bytes if edge.kind == "token" else doc.model.activation_bytes


def _edge_ms(doc: PlanDoc, edge: Edge) -> float:
    devices = {n.label: n.device for n in doc.placement.nodes}
    return cost.edge_ms(doc.cluster, devices[edge.src], devices[edge.dst], _edge_bytes(doc, edge))


def _nbytes(n: int) -> str:
    return f"{n} B" if n < 1 << 10 else f"{n / (1 << 10):.1f} KiB" if n < 1 << 20 else gib(n)


def _layers(doc: PlanDoc) -> list[LayerTime]:
    """The fan-out times of a plan that places experts (none otherwise, or for a plan without an entry)."""
    try:
        return layer_times(doc)
    except StopIteration:
        return []


def table(doc: PlanDoc) -> str:
    """Nodes (along the loop) with device, ops, weights, KV cache, memory need / available and predicted ms per token;
    then the edges with their bytes and predicted ms; then the per-token total."""
    requests = doc.placement.objective.requests
    layers = _layers(doc)
    header = (
        f"{'node':<16} {'device':<16} {'ops':<24} {'weights':>11} {'KV':>11} {'memory need/available':>25} "
        f"{'ms/token':>9}"
    )
    lines = [f"plan {doc.id or plan_id(doc)}", header]
    for node in _ordered(doc):
        device = doc.cluster.device(node.device)
        need = node_memory(doc, node)
        memory = f"{gib(need)} / {gib(device.memory)}" + (" !" if need > device.memory else "")
        lines.append(
            f"{node.label:<16} {device.id:<16} {ops_text(node):<24} {gib(node_weights(doc, node)):>11} "
            f"{gib(node_kv(doc, node, requests)):>11} {memory:>25} {_node_ms(doc, node, layers):>9.3f}"
        )
    lines.append(f"{'edge':<34} {'kind':<12} {'bytes':>10} {'ms/token':>9}")
    for edge in doc.placement.edges:
        lines.append(
            f"{edge.src + ' -> ' + edge.dst:<34} {edge.kind:<12} {_nbytes(_edge_bytes(doc, edge)):>10} "
            f"{_edge_ms(doc, edge):>9.3f}"
        )
    if layers:
        lines.append(f"{'experts of block':<17} {'owner':<16} {'expert nodes':<33} {'ms/token':>9}")
        for t in layers:
            lines.append(f"{t.layer:<17} {t.owner:<16} {', '.join(t.remote) or '(all its own)':<33} {t.ms:>9.3f}")
    prediction = simulate(doc)
    if prediction.quota_wait_ms:
        lines.append(
            f"cpu quota wait {prediction.quota_wait_ms:.3f} ms per token: {prediction.bottleneck} keeps its device's "
            f"CPU share busy {prediction.bottleneck_ms:.3f} ms per token"
        )
    lines.append(f"per token {prediction.per_token_ms:.3f} ms ({prediction.tok_s:.1f} tok/s, one request)")
    return "\n".join(lines)


def mermaid(doc: PlanDoc) -> str:
    """A Mermaid flowchart: a box per node (name, device, ops, ms per token), an arrow per edge (bytes, ms), the token
    edge dashed, experts edges thick."""
    ids = {n.label: f"n{i}" for i, n in enumerate(_ordered(doc))}
    layers = _layers(doc)
    lines = ["flowchart LR"]
    for node in _ordered(doc):
        label = f"{node.label}<br/>device {node.device}<br/>{ops_text(node)}<br/>{_node_ms(doc, node, layers):.3f} ms"
        lines.append(f'    {ids[node.label]}["{label}"]')
    for edge in doc.placement.edges:
        label = f"{edge.kind} {_nbytes(_edge_bytes(doc, edge))}, {_edge_ms(doc, edge):.3f} ms"
        arrow = {"token": "-.->", "experts": "==>"}.get(edge.kind, "-->")
        lines.append(f'    {ids[edge.src]} {arrow}|"{label}"| {ids[edge.dst]}')
    return "\n".join(lines) + "\n"


def dot(doc: PlanDoc) -> str:
    """The same graph in Graphviz's language (``dot -Tpng``)."""
    lines = [
        f'digraph "plan {doc.id or plan_id(doc)}" {{',
        "    rankdir=LR;",
        '    node [shape=box, fontname="monospace"];',
    ]
    layers = _layers(doc)
    for node in _ordered(doc):
        label = f"{node.label}\\ndevice {node.device}\\n{ops_text(node)}\\n{_node_ms(doc, node, layers):.3f} ms"
        lines.append(f'    "{node.label}" [label="{label}"];')
    for edge in doc.placement.edges:
        label = f"{edge.kind} {_nbytes(_edge_bytes(doc, edge))}\\n{_edge_ms(doc, edge):.3f} ms"
        style = {"token": ", style=dashed", "experts": ", style=dotted"}.get(edge.kind, "")
        lines.append(f'    "{edge.src}" -> "{edge.dst}" [label="{label}"{style}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def draw_png(doc: PlanDoc, path: str | Path) -> Path:
    """Draw the plan into a PNG at ``path``: the nodes around a circle in loop order (entry at the top, clockwise),
    each a box with its device, ops and ms per token; an arrow per edge with its ms (the token edge dashed, experts
    edges dotted); the plan id and predicted tokens per second in the title."""
    # matplotlib is an optional extra (ppharness[bench]): loaded only to draw
    from matplotlib.artist import Artist
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyBboxPatch, Patch

    nodes = _ordered(doc)
    layers = _layers(doc)
    n = len(nodes)
    box_w, box_h = 1.0, 0.5
    radius = 0.0 if n == 1 else max(1.2, n * box_w * 1.8 / (2 * math.pi))
    centres = {
        node.label: (
            radius * math.cos(math.pi / 2 - 2 * math.pi * i / n),
            radius * math.sin(math.pi / 2 - 2 * math.pi * i / n),
        )
        for i, node in enumerate(nodes)
    }
    extent = max(radius + 0.75 * box_w, 1.5)
    side = 4.1 * extent  # inches: the boxes keep one size on paper, so their text fits whatever n
    fig = Figure(figsize=(side, side))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xlim(-extent, extent)
    ax.set_ylim(-extent, extent)
    ax.set_aspect("equal")
    ax.axis("off")
    for node in nodes:
        x, y = centres[node.label]
        ax.add_patch(
            FancyBboxPatch(
                (x - box_w / 2, y - box_h / 2),
                box_w,
                box_h,
                boxstyle="round,pad=0.02",
                facecolor="#e8f0fe" if not (node.embeds or node.heads) else "#fde8d8",
                edgecolor="#335",
            )
        )
        who = node.device if node.label == node.device else f"{node.label} on {node.device}"
        text = f"{_boxed(who)}\n{_boxed(ops_text(node))}\n{_node_ms(doc, node, layers):.3f} ms"
        ax.text(x, y, text, ha="center", va="center", fontsize=8, family="monospace")
    for edge in doc.placement.edges:
        a, b = centres[edge.src], centres[edge.dst]
        label = f"{_edge_ms(doc, edge):.3f} ms"
        line = {"token": "--", "experts": ":"}.get(edge.kind, "-")
        style = {"arrowstyle": "-|>", "color": "#335", "linestyle": line, "lw": 1.2}
        if edge.src == edge.dst:  # one node: the token comes back to itself
            x, y = a
            start, end = (x + box_w / 2, y), (x, y + box_h / 2)
            ax.annotate("", xy=end, xytext=start, arrowprops=style | {"connectionstyle": "arc3,rad=1.2"})
            ax.text(x + box_w / 2, y + box_h / 2 + 0.15, label, fontsize=7, ha="left")
            continue
        start, end = _boundary(a, b, box_w, box_h), _boundary(b, a, box_w, box_h)
        ax.annotate("", xy=end, xytext=start, arrowprops=style | {"connectionstyle": "arc3,rad=0.15"})
        mx, my = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2
        ax.text(mx, my, label, fontsize=7, ha="center", va="center", backgroundcolor="white")
    kinds = {e.kind for e in doc.placement.edges}
    handles: list[Artist] = [
        Line2D([], [], color="#335", linestyle="-", label="activation (hidden state) to the next node"),
        Line2D([], [], color="#335", linestyle="--", label="token back to the entry"),
    ]
    if "experts" in kinds:
        handles.append(Line2D([], [], color="#335", linestyle=":", label="experts: fan-out and gather"))
    handles += [
        Patch(facecolor="#fde8d8", edgecolor="#335", label="entry or exit (embed, head)"),
        Patch(facecolor="#e8f0fe", edgecolor="#335", label="other nodes; each box: device, ops, ms per token"),
    ]
    ax.legend(handles=handles, loc="lower left", fontsize=7, frameon=False)
    prediction = simulate(doc)
    fig.suptitle(
        f"plan {doc.id or plan_id(doc)}: {prediction.tok_s:.1f} tok/s predicted ({prediction.per_token_ms:.3f} ms per "
        "token)",
        fontsize=11,
    )
    out = Path(path)
    fig.savefig(out, format="png", dpi=100)
    return out


def _boundary(a: tuple[float, float], b: tuple[float, float], w: float, h: float) -> tuple[float, float]:
    """Where the line from box centre ``a`` towards ``b`` leaves the box (width ``w``, height ``h``) around ``a``."""
    dx, dy = b[0] - a[0], b[1] - a[1]
    t = min(w / 2 / abs(dx) if dx else math.inf, h / 2 / abs(dy) if dy else math.inf, 1.0)
    return a[0] + t * dx * 1.05, a[1] + t * dy * 1.05
