"""The house in floors: every import of ``ppharness/`` (at module level, inside a function, or for the type checker)
runs down, never up, and no modules import each other in a circle. ``docs/architecture.md`` draws the floors these
tests hold."""

from __future__ import annotations

from pathlib import Path

import pytest

from ppharness.testing.imports import Arrow, circles, graph

ROOT = Path(__file__).resolve().parent.parent

# The rooms of ppharness/, lowest first: a room imports only rooms on its own floor or below.
FLOORS: list[tuple[str, ...]] = [
    ("errors", "version"),
    ("document",),
    ("model",),
    ("wire",),
    ("trace",),
    ("seams",),
    ("network",),
    ("registry",),
    ("plan",),
    ("scenario",),
    ("run",),
    ("benchmarks",),
    ("cli",),
    ("testing",),
]

# The floors inside ppharness/model/, lowest first.
MODEL_FLOORS: list[tuple[str, ...]] = [
    ("formats",),  # the ggml weight formats: one table, unpack, quantise, product
    ("gguf",),  # the file format: header, metadata, tensor names, ModelConfig as data
    ("text",),  # tokenizers, pre-tokenizers, chat templates, end-of-generation tokens
    ("layers",),  # what blocks are built of on tinygrad
    ("arch",),  # one module per architecture, and the registry
    ("held", "support"),  # what a stage holds of a file, what a file may ask of the engine
    ("synthetic",),  # what a synthetic model is, its vocabulary, its writer
    ("sources",),  # where a model file comes from
    ("gguf_file", "verdict"),  # a file read for computing; will a file load
    ("engine",),  # a stage's slice, batched rows, prefill, the device step
    ("decode",),  # greedy rules, the oracle, drafts, exactness, tuning
]

# The floors inside ppharness/plan/, lowest first.
PLAN_FLOORS: list[tuple[str, ...]] = [
    ("lang",),  # the plan language: the typed document, its bounds, its text form, its invariants
    ("graph", "stages", "build", "provenance"),  # a model's graph, stage ranges and names, chains, measured-with
    ("reader",),  # the one reader of every plan and cluster file: JSON, YAML, the text form
    ("compile", "predict"),  # a plan made ready to run; the cost model, the fan-out, the simulator
    ("search", "experts"),  # the planner; the expert planner
    ("show", "validation", "consumer"),  # a plan for people; predictions against measurements; consumer clusters
    ("speculation_gain",),  # what speculation buys, predicted
]

# The floors inside ppharness/run/, lowest first.
RUN_FLOORS: list[tuple[str, ...]] = [
    ("loop", "reliable", "membership"),  # the one message loop, the outbox that resends, failure detection
    ("stage",),  # the stage: receipt, admission, the scheduler, the send path, replays, speculative windows
    ("node", "inprocess"),  # what drives stages: the process a provider starts (pp-node, pp-host); a chain in one
    ("seed",),  # the orchestrator: session, client, failover, replan, the plan realised as node specs
]

# What a transport may import of the core: the seams and what they speak in.
TRANSPORT_MAY_IMPORT = ("errors", "seams", "wire", "trace", "document", "network")


def _graph() -> tuple[set[str], list[Arrow]]:
    return graph(ROOT, ["ppharness"])


def _floor(module: str, prefix: str, floors: list[tuple[str, ...]]) -> int | None:
    rest = module.removeprefix(prefix)
    if rest == module or not rest:
        return None
    room = rest.split(".")[0]
    return next((i for i, names in enumerate(floors) if room in names), None)


def _shown(arrow: Arrow) -> str:
    return f"{arrow.source} -> {arrow.target} (line {arrow.line}, {arrow.kind} import)"


def test_no_modules_of_the_core_import_each_other_in_a_circle() -> None:
    modules, arrows = _graph()
    found = circles(modules, arrows)
    assert not found, "modules that import each other in a circle:\n" + "\n".join(", ".join(c) for c in found)


@pytest.mark.parametrize(
    ("prefix", "floors"),
    [
        ("ppharness.", FLOORS),
        ("ppharness.model.", MODEL_FLOORS),
        ("ppharness.plan.", PLAN_FLOORS),
        ("ppharness.run.", RUN_FLOORS),
    ],
    ids=["core", "model", "plan", "run"],
)
def test_every_import_runs_down_the_floors(prefix: str, floors: list[tuple[str, ...]]) -> None:
    modules, arrows = _graph()
    unplaced = sorted(
        {m.removeprefix(prefix).split(".")[0] for m in modules if m.startswith(prefix)}
        - {room for names in floors for room in names}
    )
    assert not unplaced, f"rooms under {prefix} that no floor names: {unplaced} (add them to this test's floors)"
    upward = [
        _shown(arrow)
        for arrow in arrows
        if (low := _floor(arrow.source, prefix, floors)) is not None
        and (high := _floor(arrow.target, prefix, floors)) is not None
        and high > low
    ]
    assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


def test_transports_import_only_the_seams_and_what_they_speak_in() -> None:
    _, arrows = graph(ROOT, ["ppharness", "transports"])
    offenders = [
        _shown(arrow)
        for arrow in arrows
        if arrow.source.startswith("transports")
        and arrow.target.startswith("ppharness.")
        and arrow.target.split(".")[1] not in TRANSPORT_MAY_IMPORT
    ]
    assert not offenders, "a transport reaching past the seams:\n" + "\n".join(offenders)
