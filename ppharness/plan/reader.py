"""The one reader of every plan file (``load_plan``) and cluster file (``load_cluster``), and the plans a person
writes by hand.

A plan file is one of two things, told apart by its content, not its name (``file_kind``):

- the **text form** (``ppharness.plan.lang.text_form``), one line per node, with header lines saying where the model and
  the devices come from::

      model: small                            # a preset, a synthetic: spec, a GGUF path or a URL
      cluster: ../clusters/strong-cluster.yaml   # a cluster file, or `local`
      dev-a: embed, blk[0:4]
      dev-c: blk[4:8]
      dev-d: blk[8:12], head

  Paths are relative to the plan file. ``cluster: local`` makes every device the plan names a local process with
  this machine's memory. The model's graph and sha256 are read from the model file (a synthetic model is built once
  into the cache, as runs do); ``--model`` and ``--cluster`` on the command line give them instead of (or over) the
  header lines;
- the **document** (YAML or JSON, ``ppharness.plan.lang.document``) with ``version``, ``model``, ``cluster`` and
  ``placement``.

A cluster file (``devices`` and no ``placement``) is neither, and is refused as a plan naming what to do with it.

Either way, a placement that states no loop edges (no ``->`` in the text form, no ``activation`` or ``token`` edge in
the document) gets them from the order of its nodes (``with_edges``): an activation edge from each node on the loop
to the next, and the token edge from the last back to the first.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

import msgspec

from ppharness.document.reader import read_text_file
from ppharness.errors import HarnessError, PlanError
from ppharness.model.sources.files import resolve_model
from ppharness.model.synthetic.spec import PRESETS, parse_synthetic, preset_spec, synthetic_source
from ppharness.plan.graph import model_graph, simulation_only, spec_graph
from ppharness.plan.lang.check import check_cluster, check_plan
from ppharness.plan.lang.document import (
    Cluster,
    Device,
    Edge,
    ModelGraph,
    Placement,
    PlanDoc,
    Source,
    decode_text,
    plan_id,
    with_id,
)
from ppharness.plan.lang.parse import parse_document

MAX_CONTEXT = 256  # the KV cache every node of a hand-written plan holds (as `ppharness plan make`'s default)
Kind = Literal["text", "plan", "cluster"]
# a line of the text form: a node label at the start of the line, a colon, then an op
_NODE_LINE = re.compile(
    r"^@?[a-z0-9][a-z0-9_@-]*[ \t]*:[ \t]*(?:embed|head|blk[ \t]*\[|experts[ \t]*\[|[0-9]+[ \t]*\.\.)", re.M
)
_PLAN_KEY = re.compile(r'^(?:"?(?:version|placement)"?[ \t]*:|[ \t{]*"(?:version|placement)"[ \t]*:)', re.M)
_CLUSTER_KEY = re.compile(r'^[ \t{-]*"?devices"?[ \t]*:', re.M)
# an op with square brackets (matched where the word starts, so that the scan stays linear)
_BRACKET_OP = re.compile(r"blk[ \t]*\[[^\]\n]*\]|experts[ \t]*\[[^\]\n]*\][ \t]*\[[^\]\n]*\]")
_OP_WORD = re.compile(r"\b(?:blk|experts)[ \t]*\[")
_FIX_TEXT = "a preset (small, tiny, ...), a synthetic: spec, a GGUF path or an http(s) URL"


def file_kind(text: str) -> Kind:
    """What a plan or cluster file holds, by its content: ``text`` (node lines of the text form), ``plan`` (a
    document with ``version`` or ``placement``) or ``cluster`` (``devices`` and no placement)."""
    if _NODE_LINE.search(text):
        return "text"
    if _PLAN_KEY.search(text):
        return "plan"
    return "cluster" if _CLUSTER_KEY.search(text) else "plan"


def with_edges(placement: Placement) -> Placement:
    """``placement`` with its loop edges inferred from the order of its nodes when it states none (activation edges
    node to next along the nodes that are not expert nodes, the token edge from the last back to the first); any
    experts edges stay, after them. A placement that states a loop edge is returned as it is."""
    if any(e.kind != "experts" for e in placement.edges):
        return placement
    labels = [n.label for n in placement.nodes if not n.expert_only]
    if not labels:
        return placement
    edges = [Edge(src=a, dst=b, kind="activation") for a, b in zip(labels, labels[1:])]
    edges.append(Edge(src=labels[-1], dst=labels[0], kind="token"))
    return msgspec.structs.replace(placement, edges=tuple(edges) + placement.edges)


def load_plan(path: str | Path, check: bool = True, model: str | None = None, cluster: str | None = None) -> PlanDoc:
    """The plan in the file at ``path``, in the text form or as a document (``file_kind``), with its id. A document's
    id, when it has one, must be the hash of what it says; with ``check`` every invariant (``check_plan``) must hold.
    ``model`` and ``cluster`` (paths relative to the working directory) give a text plan's model and devices over
    its header lines; a document has its own and refuses them."""
    path = Path(path)
    text = read_text_file(path, "plan", "*.json", PlanError)
    kind = file_kind(text)
    if kind == "cluster":
        raise PlanError(
            f"{path}: $: this is a cluster file (it has devices and no placement), not a plan — make a plan from it "
            f"with `ppharness plan make --model M --cluster {path}`, or check it with `ppharness plan check {path}`"
        )
    if kind == "text":
        doc = text_plan(text, path, model, cluster)
    else:
        if model is not None or cluster is not None:
            raise PlanError(
                f"{path}: a plan document carries its own model and cluster — leave out --model and --cluster (they "
                "are for a plan in the text form)"
            )
        doc = _document(text, str(path))
        if doc.id and doc.id != plan_id(doc):
            raise PlanError(
                f"{path}: $.id: the plan says id {doc.id!r} but its content hashes to {plan_id(doc)!r} — it was "
                "edited after it was made; remove the id line (or run `ppharness plan fmt`) to take the edit"
            )
        doc = msgspec.structs.replace(doc, placement=with_edges(doc.placement))
    if check:
        check_plan(doc, str(path))
    return with_id(doc)


def load_cluster(path: str | Path) -> Cluster:
    """The cluster in the file at ``path`` (YAML or JSON), its devices and links checked (``check_cluster``); one
    that has no name takes the file's stem."""
    path = Path(path)
    cluster: Cluster = decode_text(read_text_file(path, "cluster", "*cluster*.yaml", PlanError), str(path), Cluster)
    check_cluster(cluster, str(path), "$")
    if not cluster.name:
        cluster = msgspec.structs.replace(cluster, name=path.stem)
    return cluster


def _document(text: str, source: str) -> PlanDoc:
    try:
        doc: PlanDoc = decode_text(text, source)
    except PlanError as exc:
        hint = flow_op_hint(text, source) if "not valid YAML" in str(exc) else None
        if hint is not None:
            raise PlanError(hint) from None
        raise
    return doc


def flow_op_hint(text: str, source: str) -> str | None:
    """The fix for an op such as ``blk[0:5]`` written unquoted in a YAML flow sequence (``ops: [embed, blk[0:5]]``),
    which YAML reads as a nested list: the message naming ``source``, the line and the column; None if there is no
    such op."""
    for number, line in enumerate(text.split("\n"), start=1):
        for word in _OP_WORD.finditer(line):
            before = line[: word.start()]
            match = _BRACKET_OP.match(line, word.start())
            if match is None or "[" not in before or any(c in before for c in "#\"'"):
                continue
            op = match[0]
            return (
                f"{source}: line {number}, column {match.start() + 1}: {op} is not quoted inside a YAML flow "
                f"sequence ([...]) — a YAML flow sequence takes [ as a list; write '- \"{op}\"' (one op per line "
                f'under ops:) or quote it in the brackets: [embed, "{op}"]'
            )
    return None


def text_plan(text: str, path: Path, model: str | None = None, cluster: str | None = None) -> PlanDoc:
    """The plan that a text-form file at ``path`` describes: its placement (edges inferred when it states none),
    its model graph and sha256 read from the model file, its devices from the cluster file (or ``local``), each
    from ``model`` and ``cluster`` when given (relative to the working directory), else from the header lines
    (relative to the file). Not checked (``load_plan`` checks it)."""
    placement, headers = parse_document(text, str(path))
    placement = with_edges(placement)
    here = Path.cwd()
    if model is None and "model" not in headers:
        raise PlanError(
            f"{path}: no model — add a header line such as `model: small` (the model: {_FIX_TEXT}; a path is "
            "relative to this file), or pass --model"
        )
    if cluster is None and "cluster" not in headers:
        raise PlanError(
            f"{path}: no cluster — add a header line `cluster: FILE` (a cluster file, relative to this file) or "
            "`cluster: local` (every device a local process), or pass --cluster FILE"
        )
    if model is not None:
        graph = graph_for(model, here, "--model")
    else:
        value, line = headers["model"]
        graph = graph_for(value, path.parent, f"{path}: line {line}: model: {value[:80]}")
    if cluster is not None:
        devices = cluster_for(cluster, here, placement, "--cluster")
    else:
        value, line = headers["cluster"]
        devices = cluster_for(value, path.parent, placement, f"{path}: line {line}: cluster: {value[:80]}")
    return PlanDoc(version=1, model=graph, cluster=devices, placement=placement)


def model_source(value: str, base: Path, where: str) -> str:
    """What ``resolve_model`` takes for ``value``: a preset's synthetic: spec, a synthetic: spec or URL as given, or
    a GGUF path (relative to ``base``) made absolute. PlanError naming ``where`` when it is none of those."""
    if value in PRESETS:
        return f"synthetic:{value}" if simulation_only(f"synthetic:{value}") else synthetic_source(preset_spec(value))
    if value.startswith("synthetic:") or "://" in value:
        return value
    path = (base / Path(value).expanduser()).resolve()
    if not path.is_file():
        raise PlanError(f"{where}: no such file ({path}) — name {_FIX_TEXT} ({', '.join(PRESETS)})")
    return str(path)


def graph_for(value: str, base: Path, where: str, max_context: int = MAX_CONTEXT) -> ModelGraph:
    """The plan's model part for ``value`` (``model_source``): read from the file, with its sha256 (a synthetic model
    is built once into the cache); derived from the spec for a model this machine does not write."""
    source = model_source(value, base, where)
    try:
        if simulation_only(source):
            return spec_graph(parse_synthetic(source), source, max_context)
        return model_graph(resolve_model(source), source, max_context)
    except HarnessError as exc:
        raise PlanError(f"{where}: {exc}") from None


def cluster_for(value: str, base: Path, placement: Placement, where: str) -> Cluster:
    """The devices of a text plan: the cluster file ``value`` (relative to ``base``), or with ``local`` every device
    the placement names (its nodes' and spares) as a local process with this machine's memory."""
    if value == "local":
        ids = list(dict.fromkeys([n.device for n in placement.nodes] + list(placement.spares)))
        memory = _machine_memory()
        return Cluster(
            devices=tuple(Device(id=d, memory=memory, gflops=1.0, reserve=0, source=Source()) for d in ids),
            name="local",
        )
    path = base / Path(value).expanduser()
    if not path.is_file():
        raise PlanError(
            f"{where}: no such cluster file ({path}) — name a cluster file relative to the plan (or, with --cluster, "
            "to the working directory), or write `cluster: local`"
        )
    return load_cluster(path)


def _machine_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 40
