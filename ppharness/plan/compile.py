"""From a plan to what a run needs: one small program per node, the run's network, and the implicit plan of a
scenario that names no plan file.

A node's program (a ``StagePlan``, handed to the node as its ``PLAN``) says what to load (its block range, and the
embedding or head where it is the entry or exit), which names to register (``pp-stage-{i}`` by its place on the loop,
``pp-entry`` on the entry, ``pp-exit`` on the exit) and where each message goes next (the names its activations come
from and go to; tokens go to ``pp-entry``).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from ppharness.errors import PlanError
from ppharness.network.spec import Impairment, Link, Network, stage_node
from ppharness.plan.build import chain
from ppharness.plan.lang.document import (
    Cluster,
    Device,
    ModelGraph,
    Node,
    Objective,
    PlanDoc,
    Source,
    expert_holders,
    expert_nodes,
    loop,
)
from ppharness.plan.reader import load_plan
from ppharness.plan.stages import (
    Plan,
    StagePlan,
    StageSettings,
    expert_node_name,
    make_plan,
    names_of,
    stage_name,
)


@dataclass(frozen=True)
class Compiled:
    """A plan made ready to run: each node's program in loop order, the devices they run on, and the block ranges
    (``ranges``/``runtime``: the view the orchestrator, the trace and the exactness check read)."""

    doc: PlanDoc
    devices: tuple[Device, ...]
    runtime: Plan
    expert_nodes: tuple[Node, ...] = ()  # off the loop; members num_stages, num_stages + 1, ...
    expert_devices: tuple[Device, ...] = ()

    @property
    def num_stages(self) -> int:
        return self.runtime.num_stages

    @property
    def members(self) -> int:
        """Every node of the run: the loop's stages, then the expert nodes."""
        return self.runtime.num_stages + len(self.expert_nodes)

    @property
    def all_devices(self) -> tuple[Device, ...]:
        return self.devices + self.expert_devices

    @property
    def provider_kind(self) -> str:
        return self.devices[0].source.kind


def load_compiled(path: str) -> tuple[PlanDoc, Compiled]:
    """The plan file at ``path``, read, checked and compiled once per process while the file is unchanged: the
    scenario that runs it (``ppharness.scenario.schema.with_plan``) and the run itself share one compiled plan."""
    try:
        st = os.stat(path)
    except OSError:
        doc = load_plan(path)  # refuses the missing or unreadable file in the plan reader's words
        return doc, compile_plan(doc)
    return _compiled(os.path.realpath(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _compiled(path: str, mtime_ns: int, size: int) -> tuple[PlanDoc, Compiled]:
    doc = load_plan(path)
    return doc, compile_plan(doc)


def compile_plan(doc: PlanDoc) -> Compiled:
    """The run's view of a checked plan: nodes in loop order, their devices and block ranges. Refuses a plan whose
    devices come from more than one provider (a run has one), or one whose weights are counted with the simulator's
    override (``check_model``)."""
    if doc.model.weights:
        check_model(doc, doc.model.sha256, doc.model.source)
    order = loop(doc)
    devices = tuple(doc.cluster.device(n.device) for n in order)
    experts = tuple(expert_nodes(doc))
    expert_devices = tuple(doc.cluster.device(n.device) for n in experts)
    kinds = sorted({d.source.kind for d in devices + expert_devices})
    if len(kinds) > 1:
        by_kind = "; ".join(
            f"{k}: {', '.join(d.id for d in devices + expert_devices if d.source.kind == k)}" for k in kinds
        )
        raise PlanError(
            f"plan {doc.id}: its nodes run on devices from {len(kinds)} providers ({by_kind}) — one run uses one "
            "provider; give every placed device the same source kind"
        )
    ranges = []
    for n in order:
        r = n.blocks
        assert r is not None  # check_plan: every node runs one range
        ranges.append(r)
    return Compiled(
        doc=doc,
        devices=devices,
        runtime=Plan(plan_id=doc.id, ranges=tuple(ranges)),
        expert_nodes=experts,
        expert_devices=expert_devices,
    )


def programs(compiled: Compiled, settings: StageSettings) -> list[StagePlan]:
    """Every node's program: the loop's stages in order, then the expert nodes'.

    When the plan places experts, a stage computes only the experts its own ops name, and each expert node registers
    ``pp-experts-{j}`` and ``moe-expert-{layer}-{e}`` (``.r{k}`` for the k-th replica among expert nodes) for what it
    computes (``ppharness.run.node.experts``)."""
    doc = compiled.doc
    order = loop(doc)
    n = len(order)
    placed = bool(expert_holders(doc))
    out = []
    for i, node in enumerate(order):
        lo, hi = compiled.runtime.ranges[i]
        out.append(
            StagePlan(
                plan_id=compiled.doc.id,
                stage=i,
                num_stages=n,
                lo=lo,
                hi=hi,
                node=node.label,
                device=node.device,
                names=tuple(names_of(i, n)),
                prev=stage_name(i - 1) if i > 0 else "",
                next=stage_name(i + 1) if i < n - 1 else "",
                experts=node.experts if placed else None,
                **settings,
            )
        )
    owner = {b: stage_name(i) for i, (lo, hi) in enumerate(compiled.runtime.ranges) for b in range(lo, hi)}
    replicas: dict[tuple[int, int], int] = {}
    for j, node in enumerate(compiled.expert_nodes):
        copies: dict[int, dict[int, int]] = {}
        for layer, ids in sorted(node.experts.items()):
            for e in ids:
                k = replicas[(layer, e)] = replicas.get((layer, e), -1) + 1
                if k:
                    copies.setdefault(layer, {})[e] = k
        out.append(
            StagePlan(
                plan_id=doc.id,
                stage=n + j,
                num_stages=n,
                lo=0,
                hi=0,
                node=node.label,
                device=node.device,
                names=(expert_node_name(j),),  # and one name per expert it holds (StagePlan.registers)
                role="experts",
                experts=node.experts,
                replicas=copies,
                owners={layer: owner[layer] for layer in node.experts},
                **settings,
            )
        )
    return out


def plan_network(compiled: Compiled, base: Network | None) -> Network | None:
    """The run's network: the cluster's links between the nodes' devices as per-link impairments between stages
    (the scenario's own ``network.links`` win for a pair both name; its default, layer, seed and events stay)."""
    cluster, devices = compiled.doc.cluster, compiled.all_devices
    links = []
    given = {(link.src, link.dst) for link in base.links} if base is not None else set()
    for i, a in enumerate(devices):
        for j, b in enumerate(devices):
            if i == j or (stage_node(i), stage_node(j)) in given:
                continue
            imp = cluster.link(a.id, b.id)
            if imp != Impairment():
                links.append(msgspec.convert(_fields(imp) | {"from": stage_node(i), "to": stage_node(j)}, Link))
    if not links:
        return base
    if base is None:
        return Network(links=tuple(links))
    return msgspec.structs.replace(base, links=base.links + tuple(links))


def _fields(imp: Impairment) -> dict[str, object]:
    return msgspec.to_builtins(imp)  # type: ignore[no-any-return]


def implicit_cluster(kind: str, n: int) -> Cluster:
    """A scenario without a plan file runs on ``n`` devices of its provider with no limits of their own."""
    memory = _machine_memory()
    return Cluster(
        devices=tuple(
            Device(id=f"{kind}-{i}", memory=memory, gflops=1.0, reserve=0, source=Source(kind=_source_kind(kind)))
            for i in range(n)
        ),
        name=f"{n} {kind} node(s)",
    )


def _source_kind(provider: str) -> Literal["local", "docker", "vastai"]:
    if provider == "docker":
        return "docker"
    return "vastai" if provider == "vastai" else "local"


def scenario_plan(
    model: ModelGraph,
    num_stages: int | None,
    splits: Sequence[int] | None,
    kind: str,
    spares: int = 0,
    requests: int = 1,
    colocated: bool = False,
) -> PlanDoc:
    """The plan of ``--num-stages N`` / ``stages.splits``: a chain over N devices of the scenario's provider (with
    ``colocated``, every stage on the first one, in one process), cut at the split points (or evenly), with
    ``spares`` more devices standing by; its memory check counts the KV cache of ``requests`` in flight."""
    # the stage count and split points are checked where the split is defined (``make_plan``)
    ranges = make_plan(len(model.blocks), num_stages, list(splits) if splits is not None else None).ranges
    cuts = [hi for _, hi in ranges[:-1]]
    n = len(cuts) + 1
    used = 1 if colocated else n
    cluster = implicit_cluster(kind, used + spares)
    policy = "even" if splits is None else "splits"
    ids = [d.id for d in cluster.devices]
    objective = Objective(kind="throughput", requests=requests) if requests > 1 else Objective()
    devices = [ids[0]] * n if colocated else ids[:n]
    return chain(model, cluster, devices, cuts, objective, policy, spares=ids[used:])


def check_model(doc: PlanDoc, sha256: str, path: str, source: str = "") -> None:
    """Refuse a plan made for another model than the file the run resolved, or made for the simulator only (its
    weights counted with an override, ``--weights``, instead of the file's own types, which the node runtime
    holds)."""
    if doc.model.weights:
        raise PlanError(
            f"{source or 'the plan'}: $.model.weights: the plan counts weights as {doc.model.weights}, for the "
            "simulator only — an override (--weights) instead of the file's own types, which are what the node "
            "runtime holds; make the plan again without --weights to run it"
        )
    if doc.model.sha256 and doc.model.sha256 != sha256:
        raise PlanError(
            f"{source or 'the plan'}: $.model.sha256: the plan was made for a model with sha256 "
            f"{doc.model.sha256[:16]}… but {path} has {sha256[:16]}… — make the plan again for this model "
            "(`ppharness plan make --model ...`)"
        )


def _machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 40
