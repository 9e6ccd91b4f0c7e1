"""A plan's invariants, each refused with the file, the ``$.path`` and the fix (the scenario's style).

- The cluster: device ids unique; every link names known devices (``region_links``: known regions), never itself.
- The model: a mixture-of-experts block routes each token to 1 to ``count`` experts; its ``frequencies``, when
  given, are one per routed expert and add up to ``active``.
- The placement: node names unique; every node on a known device, spares unused by nodes. Nodes sharing a device
  are co-located stages (one process): consecutive on the loop, none an expert node or fanning out to one, and
  their memory adds up on the device.
- Ops: ``embed`` first if present, one block range, ``head`` last if present; one entry (embed), one exit (head).
  An expert node (ops all ``experts``) has no block range. An ``experts`` op names a mixture-of-experts block and
  expert ids below its count; a node lists a block's experts in one op; a node on the loop computes experts of its
  own blocks only (expert nodes serve the others).
- Edges join placed nodes; the activation edges form one path from the entry through every node but the expert
  nodes to the exit, and one token edge goes from the exit back to the entry. Expert nodes have experts edges only,
  at least one coming in. An experts edge goes from a node on the loop to a node computing experts of one of its
  blocks.
- Every block is placed exactly once along that loop, in order: no gap, no overlap.
- A plan with any ``experts`` op places the experts: every routed expert of every mixture-of-experts block is
  computed by at least one node, and the block's owner reaches each node computing its experts (itself, or along an
  experts edge).
- Every device's weights, KV cache for ``max_context`` and runtime reserve fit its memory. Where the plan places the
  experts, a node's weights are its blocks without their routed experts, and ``bytes_per_expert`` for each expert it
  computes; an expert node holds no KV cache.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from ppharness.document.explain import FieldError
from ppharness.errors import ModelError, PlanError
from ppharness.model.verdict import judge_file
from ppharness.plan.lang.devices import (
    chain_text,
    check_colocated,
    check_memory,
    gib,
    node_kv,
    node_memory,
    node_weights,
    places_experts,
    routed_bytes,
    some,
)
from ppharness.plan.lang.document import (
    Blocks,
    Cluster,
    Embed,
    ExpertGroup,
    Head,
    ModelGraph,
    Node,
    PlanDoc,
    expert_holders,
    expert_nodes,
    loop,
)
from ppharness.registry import provider_settings_type

__all__ = ["gib", "node_kv", "node_memory", "node_weights", "places_experts", "routed_bytes"]  # shared from here too

MAX_HOST_GPUS = 64  # GPUs of one machine (``document.Source.gpu``: 0 to 63)
FREQUENCY_TOLERANCE = 1e-3  # how far (relative to ``active``) a block's frequencies may add up from ``active``


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
                "{gpu_name: RTX 4090, num_gpus: '1'}"
            )
        if d.source.offer is not None:
            _check_offer(d.source.kind, d.source.offer, source, f"{at}.devices[{i}].source.offer")
        if d.source.gpu is not None and d.source.host is None:
            raise PlanError(
                f"{source}: {at}.devices[{i}].source.gpu: a GPU index names a GPU of a host — set source.host (the "
                "same for every GPU of that machine) or drop gpu"
            )
    _check_hosts(cluster, source, at)


def _check_offer(kind: str, offer: dict[str, str], source: str, at: str) -> None:
    settings = provider_settings_type(kind)
    if settings is None or not settings.device_fields:
        raise PlanError(f"{source}: {at}: an offer filter is for vast.ai devices, this one is {kind} — drop it")
    try:
        settings().for_device(offer)
    except FieldError as exc:
        raise PlanError(f"{source}: {at}.{exc.field}: {exc}") from None
    gpus = offer.get("num_gpus", "1").strip()
    if gpus.isdigit() and (len(gpus) > 4 or int(gpus) > MAX_HOST_GPUS):
        raise PlanError(
            f"{source}: {at}.num_gpus: {gpus[:20]!r} GPUs in one machine — an offer has 1 to {MAX_HOST_GPUS} GPUs "
            "(a device's source.gpu is 0 to 63); ask for fewer"
        )


def _check_hosts(cluster: Cluster, source: str, at: str) -> None:
    """GPUs of one host: one kind and one offer, a GPU index each, no more of them than the offer's GPUs."""
    hosts: dict[str, list[int]] = {}
    for i, d in enumerate(cluster.devices):
        if d.source.host is not None:
            hosts.setdefault(d.source.host, []).append(i)
    for host, members in hosts.items():
        first = cluster.devices[members[0]].source
        gpus: dict[int, int] = {}
        for i in members:
            s = cluster.devices[i].source
            where = f"{source}: {at}.devices[{i}].source"
            if (s.kind, s.offer) != (first.kind, first.offer):
                raise PlanError(
                    f"{where}: the GPUs of host {host!r} come from one machine — give each the same kind and offer "
                    f"as devices[{members[0]}] ({first.kind}, offer {first.offer})"
                )
            if s.gpu is None:
                raise PlanError(f"{where}.gpu: a GPU of host {host!r} needs its index there (0, 1, ...)")
            if s.gpu in gpus:
                raise PlanError(
                    f"{where}.gpu: GPU {s.gpu} of host {host!r} is already devices[{gpus[s.gpu]}] — give each GPU of "
                    "a host its own index"
                )
            gpus[s.gpu] = i
        if first.kind == "vastai" and first.offer is not None:
            offered = int(first.offer.get("num_gpus", "1"))
            if max(gpus) >= offered:
                raise PlanError(
                    f"{source}: {at}.devices[{gpus[max(gpus)]}].source.gpu: host {host!r} is rented as one offer of "
                    f"{offered} GPU(s) (offer num_gpus), so its GPUs are 0 to {offered - 1} — raise num_gpus or "
                    "renumber"
                )


def check_plan(doc: PlanDoc, source: str = "<plan>") -> None:
    """Raise PlanError for the first invariant ``doc`` breaks (see the module's docstring)."""
    check_cluster(doc.cluster, source)
    _check_model(doc.model, source)
    _check_model_file(doc.model, source)
    _check_nodes(doc, source)
    _check_edges(doc, source)
    _check_blocks(doc, source)
    _check_experts(doc, source)
    check_memory(doc, source)


def _check_model(model: ModelGraph, source: str) -> None:
    for i, block in enumerate(model.blocks):
        x = block.experts
        at = f"{source}: $.model.blocks[{i}].experts"
        if x.count and not 1 <= x.active <= x.count:
            raise PlanError(
                f"{at}.active: block {i} routes each token to {x.active} of its {x.count} experts — a "
                f"mixture-of-experts block routes a token to 1 to {x.count} experts"
            )
        if not x.frequencies:
            continue
        if len(x.frequencies) != x.count:
            raise PlanError(
                f"{at}.frequencies: {len(x.frequencies)} frequencies for block {i}'s {x.count} routed experts — give "
                "one per expert (or none: uniform)"
            )
        total = math.fsum(x.frequencies)
        if abs(total - x.active) > FREQUENCY_TOLERANCE * x.active:
            raise PlanError(
                f"{at}.frequencies: they add up to {total:.6g} but each token chooses {x.active} experts — an expert's "
                f"frequency is the share of tokens that choose it, so they add up to {x.active}; scale them"
            )


def _check_model_file(model: ModelGraph, source: str) -> None:
    """A plan's local model file is there and loads here (``ppharness.model.verdict``); a synthetic model always
    loads, and a URL is judged once the run has downloaded it."""
    if model.source.startswith("synthetic:") or "://" in model.source:
        return
    path = Path(model.source).expanduser()
    if not path.is_file():
        raise PlanError(
            f"{source}: $.model.source: {model.source}: no such file ({path.resolve()}) — a plan runs on the model "
            "it was made for: put that file there, or make the plan again for a file that is here"
        )
    try:
        judge_file(path).refuse()
    except ModelError as exc:
        raise PlanError(f"{source}: $.model.source: {exc}") from None


def _check_nodes(doc: PlanDoc, source: str) -> None:
    devices = {d.id for d in doc.cluster.devices}
    nodes = doc.placement.nodes
    labels = [n.label for n in nodes]
    times = Counter(labels)
    used: dict[str, int] = {}
    for i, node in enumerate(nodes):
        at = f"{source}: $.placement.nodes[{i}]"
        if node.device not in devices:
            raise PlanError(f"{at}.device: unknown device {node.device!r} — the cluster's devices are: {some(devices)}")
        if times[node.label] > 1:
            raise PlanError(f"{at}: the node name {node.label!r} is used twice — give the node a name of its own")
        if node.device in used and (node.expert_only or nodes[used[node.device]].expert_only):
            raise PlanError(
                f"{at}.device: device {node.device!r} already runs node {labels[used[node.device]]!r} — an expert "
                "node has a device of its own; put its experts on the node beside it, or move it"
            )
        used.setdefault(node.device, i)
        _check_ops(node, at, doc.model)
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


def _check_ops(node: Node, at: str, model: ModelGraph) -> None:
    ops, num_blocks = node.ops, len(model.blocks)
    if not ops:
        raise PlanError(f"{at}.ops: node {node.label!r} has no ops — give it a block range, e.g. ops: [embed, 0..6]")
    ranges = [i for i, op in enumerate(ops) if isinstance(op, Blocks)]
    if len(ranges) != 1 and not node.expert_only:
        raise PlanError(
            f"{at}.ops: node {node.label!r} has {len(ranges)} block ranges — every node runs one range of blocks, "
            "e.g. ops: [embed, 0..6] (a node whose ops are all experts is an expert node, with no range)"
        )
    layers: dict[int, int] = {}
    for i, op in enumerate(ops):
        if isinstance(op, ExpertGroup):
            _check_group(op, f"{at}.ops[{i}]", model)
            if op.layer in layers:
                raise PlanError(
                    f"{at}.ops[{i}]: node {node.label!r} lists block {op.layer}'s experts in ops[{layers[op.layer]}] "
                    f"already — a node lists a block's experts in one op; merge the two"
                )
            layers[op.layer] = i
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


def _check_group(op: ExpertGroup, at: str, model: ModelGraph) -> None:
    num_blocks = len(model.blocks)
    if op.layer >= num_blocks:
        raise PlanError(
            f"{at}.layer: block {op.layer} is past the model's {num_blocks} blocks — the last block is {num_blocks - 1}"
        )
    x = model.blocks[op.layer].experts
    if x.count == 0:
        moe = [i for i, b in enumerate(model.blocks) if b.experts.count]
        which = f"its mixture-of-experts blocks are {_ranges(moe)}" if moe else "the model has none"
        raise PlanError(
            f"{at}.layer: block {op.layer} is dense, it has no experts to place — an experts op names a "
            f"mixture-of-experts block; {which}"
        )
    if not op.ids:
        raise PlanError(f"{at}.ids: no experts listed — list the ids of block {op.layer}'s experts this node computes")
    if op.ids[-1] >= x.count:
        raise PlanError(
            f"{at}.ids: expert {op.ids[-1]} of block {op.layer}, which has {x.count} routed experts — ids run from 0 "
            f"to {x.count - 1}"
        )


def _ranges(values: list[int]) -> str:
    """``0 to 3, 5, 7 to 8`` for [0, 1, 2, 3, 5, 7, 8] (the first few runs)."""
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and runs[-1][1] == v - 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    shown = [f"{a}" if a == b else f"{a} to {b}" for a, b in runs[:8]]
    return ", ".join(shown) + (f" and {len(runs) - 8} more" if len(runs) > 8 else "")


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
                raise PlanError(f"{at}.{end}: {name!r} is not a node of the placement — nodes: {some(nodes, False)}")
        if e.kind == "experts":
            continue
        for end, name in (("from", e.src), ("to", e.dst)):
            if nodes[name].expert_only:
                raise PlanError(
                    f"{at}.{end}: {name!r} is an expert node (its ops are all experts), off the loop — it has experts "
                    f"edges only; make this an experts edge from the node running the block, or give {name!r} blocks"
                )
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
        raise PlanError(_broken_chain(path, exit_, nodes, source))
    on_loop = set(path)
    missed = [name for name, n in nodes.items() if name not in on_loop and not n.expert_only]
    if missed:
        raise PlanError(
            f"{source}: $.placement.edges: node(s) {some(missed, False)} are not on the loop {chain_text(path)} — "
            "link them in with activation edges or remove them"
        )
    check_colocated(doc, path, source)


def _broken_chain(path: list[str], exit_: str, nodes: dict[str, Node], source: str) -> str:
    """The message for activation edges that do not lead from the entry to the exit: where the chain stops (or the
    circle it goes round) and the edge to add."""
    at = f"{source}: $.placement.edges"
    fix = "or state no loop edges at all (no -> in the text form) to have them follow the order of the nodes"
    if path[-1] in path[:-1]:
        circle = chain_text(path[path.index(path[-1]) :])
        return (
            f"{at}: the activation edges go round in a circle ({circle}) and never reach the exit {exit_!r} — "
            f"point the last of them at the node that runs the next blocks, {fix}"
        )
    stop = path[-1]
    on_loop = set(path)
    after = next((name for name, n in nodes.items() if name not in on_loop and not n.expert_only), exit_)
    chain = f" (from the entry: {chain_text(path)})" if len(path) > 1 else " (the entry)"
    return (
        f"{at}: the activations stop at node {stop!r}{chain}: no activation edge leaves it, so they never reach the "
        f"exit {exit_!r} — add an activation edge from {stop!r} to the node that runs the next blocks, e.g. "
        f"{{from: {stop}, to: {after}}} (in the text form `{stop}: ... -> {after}`), {fix}"
    )


def _check_blocks(doc: PlanDoc, source: str) -> None:
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


def _check_experts(doc: PlanDoc, source: str) -> None:
    nodes = doc.placement.nodes
    index = {n.label: i for i, n in enumerate(nodes)}
    owner = {layer: n for n in loop(doc) if n.blocks for layer in range(*n.blocks)}
    moe = [layer for layer, b in enumerate(doc.model.blocks) if b.experts.count]
    for i, node in enumerate(nodes):
        if node.expert_only or node.blocks is None:
            continue
        lo, hi = node.blocks
        for j, op in enumerate(node.ops):
            if isinstance(op, ExpertGroup) and not lo <= op.layer < hi:
                raise PlanError(
                    f"{source}: $.placement.nodes[{i}].ops[{j}]: node {node.label!r} runs blocks {lo}..{hi} and "
                    f"computes the experts of those only, not block {op.layer}'s — put them on an expert node (or on "
                    f"{owner[op.layer].label!r}, which runs the block)"
                )
    fans: dict[tuple[str, str], int] = {}
    for i, e in enumerate(doc.placement.edges):
        if e.kind != "experts":
            continue
        at = f"{source}: $.placement.edges[{i}]"
        src, dst = nodes[index[e.src]], nodes[index[e.dst]]
        if src.expert_only:
            raise PlanError(
                f"{at}.from: {e.src!r} is an expert node — an experts edge leaves the node on the loop that runs a "
                "mixture-of-experts block, towards a node computing some of its experts"
            )
        lo, hi = src.blocks or (0, 0)
        own = [layer for layer in moe if lo <= layer < hi]
        if not own:
            raise PlanError(
                f"{at}.from: node {e.src!r} runs no mixture-of-experts block (blocks {lo}..{hi}) — an experts edge "
                "leaves the node running the block whose experts it fans out to"
            )
        if e.src == e.dst:
            raise PlanError(f"{at}: an experts edge from {e.src!r} to itself — a node computes its own experts")
        if not any(layer in dst.experts for layer in own):
            raise PlanError(
                f"{at}.to: node {e.dst!r} computes none of the experts of {e.src!r}'s blocks ({_ranges(own)}) — "
                f"give {e.dst!r} an experts op for one of them, or remove the edge"
            )
        if (e.src, e.dst) in fans:
            raise PlanError(
                f"{at}: the experts edge {e.src} -> {e.dst} is edges[{fans[e.src, e.dst]}] already — keep one"
            )
        fans[e.src, e.dst] = i
    fed = {dst for _, dst in fans}
    for node in expert_nodes(doc):
        if node.label not in fed:
            raise PlanError(
                f"{source}: $.placement.nodes[{index[node.label]}]: expert node {node.label!r} has no experts edge "
                "coming in, so no block uses it — add an experts edge from the node running its blocks, or remove it"
            )
    if not places_experts(doc):
        return
    holders = expert_holders(doc)
    for layer in moe:
        block_owner = owner[layer].label
        missing = [e for e in range(doc.model.blocks[layer].experts.count) if (layer, e) not in holders]
        if missing:
            raise PlanError(
                f"{source}: $.placement.nodes: the plan places experts, but expert(s) {_ranges(missing)} of block "
                f"{layer} are computed by no node — list them in an experts op (e.g. on {block_owner!r}, which runs "
                f"the block: {{op: experts, layer: {layer}, ids: [{', '.join(map(str, missing[:4]))}]}})"
            )
        for holder in sorted({h for e in range(doc.model.blocks[layer].experts.count) for h in holders[layer, e]}):
            if holder != block_owner and (block_owner, holder) not in fans:
                raise PlanError(
                    f"{source}: $.placement.edges: node {holder!r} computes experts of block {layer}, which "
                    f"{block_owner!r} runs, but no experts edge goes from {block_owner!r} to {holder!r} — add "
                    f"{{from: {block_owner}, to: {holder}, kind: experts}}"
                )
