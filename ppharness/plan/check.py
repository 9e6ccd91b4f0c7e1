"""A plan's invariants, each refused with the file, the ``$.path`` and the fix (the scenario's style).

- The cluster: device ids unique; every link names known devices (``region_links``: known regions), never itself.
- The placement: node names unique; every node on a known device, one node per device, spares unused by nodes.
- Ops: ``embed`` first if present, one block range, ``head`` last if present; one entry (embed), one exit (head).
- Edges join placed nodes; the activation edges form one path from the entry through every node to the exit, and one
  token edge goes from the exit back to the entry.
- Every block is placed exactly once along that loop, in order: no gap, no overlap.
- Every device's weights, KV cache for ``max_context`` and runtime reserve fit its memory.
"""

from __future__ import annotations

from collections import Counter

from ppharness.errors import PlanError
from ppharness.plan.doc import Blocks, Cluster, Embed, Head, Node, PlanDoc


def gib(n: float) -> str:
    """Bytes for people: ``1.50 GiB``, ``312.0 MiB``."""
    return f"{n / (1 << 30):.2f} GiB" if abs(n) >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def node_weights(doc: PlanDoc, node: Node) -> int:
    """Bytes of weights ``node`` loads: its blocks, plus the embedding on the entry and the head on the exit."""
    model, total = doc.model, 0
    for op in node.ops:
        if isinstance(op, Embed):
            total += model.embed_bytes
        elif isinstance(op, Head):
            total += model.head_bytes
        else:
            total += sum(b.weight_bytes for b in model.blocks[op.lo : op.hi])
    return total


def node_kv(doc: PlanDoc, node: Node, requests: int = 1) -> int:
    """Bytes of KV cache ``node`` holds for ``max_context`` tokens of each of ``requests``."""
    r = node.blocks
    if r is None:
        return 0
    return requests * doc.model.max_context * sum(b.kv_bytes for b in doc.model.blocks[r[0] : r[1]])


def node_memory(doc: PlanDoc, node: Node) -> int:
    """What ``node`` needs of its device's memory: weights, KV cache and the device's runtime reserve."""
    device = doc.cluster.device(node.device)
    return node_weights(doc, node) + node_kv(doc, node, doc.placement.objective.requests) + device.reserve


def check_cluster(cluster: Cluster, source: str, at: str = "$.cluster") -> None:
    ids = [d.id for d in cluster.devices]
    for device_id, count in Counter(ids).items():
        if count > 1:
            where = ids.index(device_id, ids.index(device_id) + 1)
            raise PlanError(
                f"{source}: {at}.devices[{where}].id: the device id {device_id!r} is used {count} times — give each "
                "device an id of its own"
            )
    known = set(ids)
    regions = {d.region for d in cluster.devices if d.region is not None}
    for field, names, what in (("links", known, "device"), ("region_links", regions, "region")):
        seen: set[tuple[str, str]] = set()
        for i, link in enumerate(getattr(cluster, field)):
            for end, name in (("from", link.src), ("to", link.dst)):
                if name not in names:
                    listed = ", ".join(sorted(names)) or "none"
                    raise PlanError(
                        f"{source}: {at}.{field}[{i}].{end}: unknown {what} {name!r} — the cluster's {what}s are: "
                        f"{listed}"
                    )
            if link.src == link.dst:
                raise PlanError(
                    f"{source}: {at}.{field}[{i}]: a link from {link.src!r} to itself — a link joins two different "
                    f"{what}s"
                )
            if (link.src, link.dst) in seen:
                raise PlanError(
                    f"{source}: {at}.{field}[{i}]: the link {link.src} -> {link.dst} is given twice — keep one"
                )
            seen.add((link.src, link.dst))
    for i, d in enumerate(cluster.devices):
        if d.source.kind != "docker" and (d.source.cpus is not None or d.source.memory_limit is not None):
            raise PlanError(
                f"{source}: {at}.devices[{i}].source: cpus and memory_limit are docker's container limits, but this "
                f"device's source is {d.source.kind} — set kind: docker or drop them"
            )
        if d.source.kind == "vastai" and not d.source.offer:
            raise PlanError(
                f"{source}: {at}.devices[{i}].source.offer: a vast.ai device needs an offer filter, e.g. "
                "{gpu_name: RTX_4090, num_gpus: '1'}"
            )


def check_plan(doc: PlanDoc, source: str = "<plan>") -> None:
    """Raise PlanError for the first invariant ``doc`` breaks (see the module's docstring)."""
    check_cluster(doc.cluster, source)
    _check_nodes(doc, source)
    _check_edges(doc, source)
    _check_blocks(doc, source)
    _check_memory(doc, source)


def _check_nodes(doc: PlanDoc, source: str) -> None:
    devices = {d.id for d in doc.cluster.devices}
    nodes = doc.placement.nodes
    labels = [n.label for n in nodes]
    used: dict[str, int] = {}
    for i, node in enumerate(nodes):
        at = f"{source}: $.placement.nodes[{i}]"
        if node.device not in devices:
            raise PlanError(
                f"{at}.device: unknown device {node.device!r} — the cluster's devices are: {', '.join(sorted(devices))}"
            )
        if labels.count(node.label) > 1:
            raise PlanError(f"{at}: the node name {node.label!r} is used twice — give the node a name of its own")
        if node.device in used:
            raise PlanError(
                f"{at}.device: device {node.device!r} already runs node {labels[used[node.device]]!r} — one node "
                "per device; put both nodes' ops on one node"
            )
        used[node.device] = i
        _check_ops(node, at, len(doc.model.blocks))
    for i, spare in enumerate(doc.placement.spares):
        if spare not in devices:
            raise PlanError(f"{source}: $.placement.spares[{i}]: unknown device {spare!r}")
        if spare in used:
            raise PlanError(
                f"{source}: $.placement.spares[{i}]: device {spare!r} runs node {labels[used[spare]]!r}; a spare "
                "is a device no node uses"
            )
    entries = [n.label for n in nodes if n.embeds]
    exits = [n.label for n in nodes if n.heads]
    for what, found, op in (("entry", entries, "embed"), ("exit", exits, "head")):
        if len(found) != 1:
            has = f"nodes {', '.join(found)} have it" if found else "no node has it"
            raise PlanError(
                f"{source}: $.placement.nodes: a plan has one {what} (the node whose ops include {op}); {has} — "
                f"put {op} on exactly one node"
            )


def _check_ops(node: Node, at: str, num_blocks: int) -> None:
    ops = node.ops
    ranges = [i for i, op in enumerate(ops) if isinstance(op, Blocks)]
    if len(ranges) != 1:
        raise PlanError(
            f"{at}.ops: node {node.label!r} has {len(ranges)} block ranges — every node runs one range of blocks, "
            "e.g. ops: [embed, 0..6]"
        )
    for i, op in enumerate(ops):
        if isinstance(op, Embed) and i != 0:
            raise PlanError(f"{at}.ops[{i}]: embed comes first, before the node's blocks")
        if isinstance(op, Head) and i != len(ops) - 1:
            raise PlanError(f"{at}.ops[{i}]: head comes last, after the node's blocks")
        if isinstance(op, Blocks) and op.hi > num_blocks:
            raise PlanError(
                f"{at}.ops[{i}]: blocks {op.lo}..{op.hi} go past the model's {num_blocks} blocks — the last block is "
                f"{num_blocks - 1}, so a range ends at {num_blocks} at most"
            )
    if Counter(type(op) for op in ops)[Embed] > 1 or Counter(type(op) for op in ops)[Head] > 1:
        raise PlanError(f"{at}.ops: embed and head appear at most once each")


def _check_edges(doc: PlanDoc, source: str) -> None:
    nodes = {n.label: n for n in doc.placement.nodes}
    entry = next(n.label for n in nodes.values() if n.embeds)
    exit_ = next(n.label for n in nodes.values() if n.heads)
    out: dict[str, int] = {}
    into: dict[str, int] = {}
    tokens = []
    for i, e in enumerate(doc.placement.edges):
        at = f"{source}: $.placement.edges[{i}]"
        for end, name in (("from", e.src), ("to", e.dst)):
            if name not in nodes:
                raise PlanError(f"{at}.{end}: {name!r} is not a node of the placement — nodes: {', '.join(nodes)}")
        if e.kind == "token":
            tokens.append(i)
            if (e.src, e.dst) != (exit_, entry):
                raise PlanError(
                    f"{at}: a token edge goes from the exit ({exit_}) to the entry ({entry}), not {e.src} -> {e.dst}"
                )
            continue
        if e.src == e.dst:
            raise PlanError(f"{at}: an activation edge from {e.src!r} to itself — join two different nodes")
        if e.src in out:
            raise PlanError(
                f"{at}: node {e.src!r} already sends its activations along edges[{out[e.src]}] — a pipeline node has "
                "one next node (fan-out is for expert groups)"
            )
        if e.dst in into:
            raise PlanError(f"{at}: node {e.dst!r} already receives activations along edges[{into[e.dst]}]")
        if e.src == exit_:
            raise PlanError(f"{at}: the exit {exit_!r} sends tokens, not activations — make this a token edge")
        out[e.src], into[e.dst] = i, i
    if len(tokens) != 1:
        raise PlanError(
            f"{source}: $.placement.edges: a plan has one token edge, from the exit ({exit_}) to the entry ({entry}); "
            f"found {len(tokens)} — add {{from: {exit_}, to: {entry}, kind: token}}"
        )
    succ = {doc.placement.edges[i].src: doc.placement.edges[i].dst for i in out.values()}
    path, at_node = [entry], entry
    while at_node in succ and len(path) <= len(nodes):
        at_node = succ[at_node]
        path.append(at_node)
    if path[-1] != exit_:
        raise PlanError(
            f"{source}: $.placement.edges: the activations from the entry go {' -> '.join(path)} and never reach the "
            f"exit {exit_!r} — add an activation edge from {path[-1]!r}"
        )
    missed = [name for name in nodes if name not in path]
    if missed:
        raise PlanError(
            f"{source}: $.placement.edges: node(s) {', '.join(missed)} are not on the loop {' -> '.join(path)} — "
            "link them in with activation edges or remove them"
        )


def _check_blocks(doc: PlanDoc, source: str) -> None:
    from ppharness.plan.doc import loop

    index = {n.label: i for i, n in enumerate(doc.placement.nodes)}
    expected, num_blocks = 0, len(doc.model.blocks)
    for node in loop(doc):
        r = node.blocks
        assert r is not None  # _check_ops: every node has one range
        at = f"{source}: $.placement.nodes[{index[node.label]}].ops"
        if r[0] > expected:
            raise PlanError(
                f"{at}: node {node.label!r} starts at block {r[0]} but the nodes before it on the loop end at "
                f"{expected} — blocks {expected}..{r[0]} are placed nowhere; start this range at {expected}"
            )
        if r[0] < expected:
            raise PlanError(
                f"{at}: node {node.label!r} starts at block {r[0]} but blocks up to {expected - 1} already run earlier "
                f"on the loop — blocks {r[0]}..{expected} are placed twice; start this range at {expected}"
            )
        expected = r[1]
    if expected != num_blocks:
        raise PlanError(
            f"{source}: $.placement: the loop's blocks end at {expected} but the model has {num_blocks} — blocks "
            f"{expected}..{num_blocks} are placed nowhere; extend the exit's range"
        )


def _check_memory(doc: PlanDoc, source: str) -> None:
    for i, node in enumerate(doc.placement.nodes):
        device = doc.cluster.device(node.device)
        need = node_memory(doc, node)
        if need > device.memory:
            raise PlanError(
                f"{source}: $.placement.nodes[{i}]: node {node.label!r} needs {gib(need)} (weights "
                f"{gib(node_weights(doc, node))}, KV cache {gib(node_kv(doc, node, doc.placement.objective.requests))}"
                f" for {doc.model.max_context} tokens, runtime {gib(device.reserve)}) but device {device.id!r} has "
                f"{gib(device.memory)} — {gib(need - device.memory)} short; move blocks to another node or use a "
                "larger device"
            )
