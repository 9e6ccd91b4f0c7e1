"""The placement's text form (``ppharness.plan.lang.text_form``): random placements round-trip exactly through render
and parse, hand-written texts read as written, and every mistake is refused naming the line, the column and the fix."""

from __future__ import annotations

import re
import time

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppharness.errors import PlanError
from ppharness.plan.build import chain
from ppharness.plan.lang.check import check_plan
from ppharness.plan.lang.document import (
    Block,
    Blocks,
    Cluster,
    Device,
    Edge,
    Embed,
    Head,
    ModelGraph,
    Node,
    Objective,
    Op,
    Placement,
)
from ppharness.plan.lang.parse import MAX_LINE_CHARS, MAX_TEXT_BYTES, parse, parse_document
from ppharness.plan.lang.text_form import render, render_plan

CHEAP_EXAMPLES = 8 * settings.default.max_examples  # examples here take microseconds: explore more

# --- strategies -------------------------------------------------------------------------------------------------

# words the text form gives a meaning to, used as device ids and names on purpose
TRICKY = [
    "spares",
    "objective",
    "policy",
    "model",
    "cluster",
    "embed",
    "head",
    "blk",
    "latency",
    "x4",
    "0",
    "a-",
    "a_b",
]
ids = st.one_of(st.sampled_from(TRICKY), st.from_regex(r"[a-z0-9][a-z0-9_-]{0,62}", fullmatch=True))
objectives = st.builds(
    Objective, kind=st.sampled_from(["latency", "throughput", "cost"]), requests=st.integers(1, 4096)
)
policies = st.one_of(st.just(""), st.sampled_from(["optimal", "even", "memory"]), ids)


@st.composite
def chains(draw: st.DrawFn) -> Placement:
    """A pipeline as ``build.chain`` makes one: 1 to 8 nodes over random devices (some named, a name possibly the
    same as the device), random cut points of a model of random size, the loop in a random order of the nodes,
    spares, objective and policy."""
    n = draw(st.integers(1, 8))
    blocks = draw(st.integers(n, 64))
    cuts = sorted(draw(st.sets(st.integers(1, blocks - 1), min_size=n - 1, max_size=n - 1))) if n > 1 else []
    spare_count = draw(st.integers(0, 3))
    words = draw(st.lists(ids, min_size=2 * n + spare_count, max_size=2 * n + spare_count, unique=True))
    devices, others, spares = words[:n], words[n : 2 * n], words[2 * n :]
    names = [draw(st.sampled_from(["", other, device])) for device, other in zip(devices, others)]
    bounds = [0, *cuts, blocks]
    nodes = []
    for i, (device, name) in enumerate(zip(devices, names)):
        ops: list[Op] = [Embed()] if i == 0 else []
        ops.append(Blocks(lo=bounds[i], hi=bounds[i + 1]))
        if i == n - 1:
            ops.append(Head())
        nodes.append(Node(device=device, ops=tuple(ops), name=name))
    # the loop visits the nodes in order; the placement lists them in any order, its edges grouped by source
    listed = draw(st.permutations(nodes))
    succ = {a.label: b.label for a, b in zip(nodes, nodes[1:])}
    succ[nodes[-1].label] = nodes[0].label
    edges = [Edge(src=x.label, dst=succ[x.label], kind="token" if x.heads else "activation") for x in listed]
    return Placement(
        nodes=tuple(listed),
        edges=tuple(edges),
        spares=tuple(spares),
        objective=draw(objectives),
        policy=draw(policies),
    )


@st.composite
def graphs(draw: st.DrawFn) -> Placement:
    """Any graph the text form can carry, valid plan or not: any ops in any order, 0 to 3 successors per node (itself
    and repeats included); an edge's kind is the one its source implies."""
    words = draw(st.lists(ids, min_size=1, max_size=8, unique=True))
    op = st.one_of(
        st.just(Embed()),
        st.just(Head()),
        st.tuples(st.integers(0, 10**6), st.integers(1, 10**6)).map(lambda t: Blocks(lo=t[0], hi=t[0] + t[1])),
    )
    nodes = [Node(device=w, ops=tuple(draw(st.lists(op, min_size=1, max_size=5)))) for w in words]
    labels = [x.label for x in nodes]
    edges = [
        Edge(src=x.label, dst=dst, kind="token" if x.heads else "activation")
        for x in nodes
        for dst in draw(st.lists(st.sampled_from(labels), max_size=3))
    ]
    return Placement(nodes=tuple(nodes), edges=tuple(edges), objective=draw(objectives), policy=draw(policies))


def _grouped(p: Placement) -> Placement:
    """``p`` with its edges grouped by source in node order (the order the text form writes them)."""
    order = {x.label: i for i, x in enumerate(p.nodes)}
    return msgspec.structs.replace(p, edges=tuple(sorted(p.edges, key=lambda e: order[e.src])))


# --- round trips ------------------------------------------------------------------------------------------------


@settings(max_examples=CHEAP_EXAMPLES)
@given(chains())
def test_chains_round_trip(p: Placement) -> None:
    text = render(p)
    assert parse(text) == p
    assert render(parse(text)) == text


@settings(max_examples=CHEAP_EXAMPLES)
@given(graphs())
def test_any_graph_round_trips(p: Placement) -> None:
    text = render(p)
    assert parse(text) == p
    assert render(parse(text)) == text


@settings(max_examples=CHEAP_EXAMPLES)
@given(chains(), st.randoms(use_true_random=False))
def test_edges_in_another_order_read_back_grouped(p: Placement, rnd) -> None:
    edges = list(p.edges)
    rnd.shuffle(edges)
    shuffled = msgspec.structs.replace(p, edges=tuple(edges))
    assert render(shuffled) == render(p)
    assert parse(render(shuffled)) == _grouped(shuffled)


@settings(max_examples=CHEAP_EXAMPLES)
@given(chains())
def test_comments_blank_lines_and_spacing_are_dropped(p: Placement) -> None:
    lines = render(p).splitlines()
    spaced = [x.replace(", ", " ,  ").replace(": ", " :\t").replace(" -> ", "->") for x in lines]
    noisy = "# a plan\n\n" + "\n".join(f"  {x}   # note" for x in spaced)
    assert parse(noisy + "\r\n\n") == p


HAND_WRITTEN = [
    "gpu-a: embed, blk[0:6] -> gpu-b\ngpu-b: blk[6:16], head -> gpu-a\n",
    "solo: embed, blk[0:8], head -> solo\n",
    "entry@gpu-a: embed, blk[0:2] -> mid\nmid@cpu-1: blk[2:5] -> exit\nexit@gpu-b: blk[5:8], head -> entry\n"
    "spares: cpu-2, cpu-3\nobjective: throughput x4\npolicy: optimal\n",
    "b: blk[4:8], head -> a\na: embed, blk[0:4] -> b\nobjective: cost\n",
    "@policy: embed, blk[0:1] -> spares\n@spares: blk[1:2], head -> policy\nspares: objective\npolicy: even\n",
    "a@a: embed, blk[0:3] -> b\nb: blk[3:4], head -> a\nobjective: latency x2\n",
    "lonely: blk[0:1]\n",
]


@pytest.mark.parametrize("text", HAND_WRITTEN)
def test_hand_written_texts_round_trip_exactly(text: str) -> None:
    assert render(parse(text)) == text


def test_what_a_text_says() -> None:
    p = parse(HAND_WRITTEN[2])
    assert [(x.name, x.device) for x in p.nodes] == [("entry", "gpu-a"), ("mid", "cpu-1"), ("exit", "gpu-b")]
    assert p.nodes[1].ops == (Blocks(lo=2, hi=5),)
    assert p.edges == (
        Edge(src="entry", dst="mid"),
        Edge(src="mid", dst="exit"),
        Edge(src="exit", dst="entry", kind="token"),
    )
    assert p.spares == ("cpu-2", "cpu-3")
    assert p.objective == Objective(kind="throughput", requests=4)
    assert p.policy == "optimal"
    # a node on a device named like an extra line, and that line itself
    q = parse(HAND_WRITTEN[4])
    assert [x.device for x in q.nodes] == ["policy", "spares"] and q.spares == ("objective",)
    assert q.policy == "even" and q.edges[1] == Edge(src="spares", dst="policy", kind="token")


def test_input_sugar() -> None:
    two = parse(HAND_WRITTEN[0])
    assert parse("gpu-a: embed, blk[0:6] -> gpu-b: blk[6:16], head -> gpu-a") == two
    assert parse("gpu-a: embed, 0..6 -> gpu-b\ngpu-b: 6 .. 16, head -> gpu-a") == two
    assert parse("@gpu-a: embed, blk[ 0 : 6 ] -> gpu-b\ngpu-b: blk[6:16],head->gpu-a") == two
    assert parse("gpu-a: embed, blk[0:6] -> gpu-b\ngpu-b: blk[6:16], head -> gpu-a\nobjective: latency x1") == two
    # a loop on one line whose last node has no successor
    p = parse("a: embed, blk[0:1] -> b: blk[1:2] -> c: blk[2:3], head")
    assert p.edges == (Edge(src="a", dst="b"), Edge(src="b", dst="c"))


def test_a_chain_plan_reads_back_and_still_checks() -> None:
    model = ModelGraph(
        source="synthetic:tiny",
        sha256="0" * 64,
        arch="llama",
        dim=64,
        vocab=256,
        max_context=256,
        embed_bytes=1 << 15,
        head_bytes=1 << 15,
        head_flops=1 << 15,
        activation_bytes=128,
        token_bytes=64,
        blocks=tuple(Block(weight_bytes=1 << 20, flops=2 << 20, kv_bytes=512) for _ in range(8)),
    )
    cluster = Cluster(devices=tuple(Device(id=d, memory=2 << 30, gflops=5.0) for d in ("gpu-a", "gpu-b", "cpu-1", "x")))
    doc = chain(model, cluster, ["gpu-a", "cpu-1", "gpu-b"], [3, 5], Objective("throughput", 2), "memory", ["x"])
    text = render_plan(doc)
    assert text.startswith(f"# plan {doc.id}: llama, 8 blocks\n")
    assert text.splitlines()[1:] == [
        "gpu-a: embed, blk[0:3] -> cpu-1",
        "cpu-1: blk[3:5] -> gpu-b",
        "gpu-b: blk[5:8], head -> gpu-a",
        "spares: x",
        "objective: throughput x2",
        "policy: memory",
    ]
    assert parse(text) == doc.placement
    check_plan(msgspec.structs.replace(doc, placement=parse(text)))


# --- what render refuses ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("placement", "needle"),
    [
        (Placement(nodes=(Node(device="a", ops=(Head(),)),), edges=(Edge(src="a", dst="a"),)), "edges[0].kind"),
        (Placement(nodes=(Node(device="a", ops=(Embed(),)),), edges=(Edge(src="a", dst="b"),)), "edges[0].to"),
        (Placement(nodes=(Node(device="a", ops=(Embed(),)),), edges=(Edge(src="z", dst="a"),)), "edges[0].from"),
        (Placement(nodes=(Node(device="a", ops=()),)), "nodes[0].ops"),
        (Placement(nodes=(Node(device="A b", ops=(Embed(),)),)), "nodes[0].device"),
        (Placement(nodes=(Node(device="a\n", ops=(Embed(),)),)), "nodes[0].device"),
        (Placement(nodes=(Node(device="a", ops=(Embed(),)), Node(device="b", ops=(Head(),), name="a"))), "nodes[1]"),
        (Placement(nodes=(Node(device="a", ops=(Embed(),)),), spares=("B",)), "spares[0]"),
        (Placement(nodes=(Node(device="a", ops=(Embed(),)),), policy="my policy"), "policy"),
        (Placement(nodes=(Node(device="a", ops=(Embed(),)),), objective=Objective(requests=0)), "objective"),
        (Placement(nodes=(Node(device="a", ops=(Blocks(lo=0, hi=10**9),)),)), "nodes[0].ops[0]"),
    ],
)
def test_render_refuses_what_it_cannot_read_back(placement: Placement, needle: str) -> None:
    with pytest.raises(PlanError, match=r"^\$\.placement\.") as info:
        render(placement)
    assert needle in str(info.value) and " — " in str(info.value)


# --- what parse refuses -----------------------------------------------------------------------------------------

BAD = [
    # (text, line, column, what is wrong, the fix)
    ("a: embed, blk[0:4], hed -> a", 1, 21, "unknown op 'hed' (did you mean 'head'?)", "the ops are embed, head"),
    ("a: embed, blk[6:2], head -> a", 1, 11, "the block range blk[6:2] is empty", "e.g. blk[2:6]"),
    ("a: embed, blk[3:3], head -> a", 1, 11, "blk[3:3] is empty", "e.g. blk[3:4]"),
    ("a: embed, blk[0-6], head -> a", 1, 11, "'blk[0-6]' is not a block range", "write blk[a:b]"),
    ("a: embed, blk[0:1234567890]", 1, 11, "more than 9 digits", "block numbers"),
    ("a embed, blk[0:8], head -> a", 1, 3, "missing ':' after the node label 'a'", "write the label, a colon"),
    (
        "a: embed, blk[0:4] -> b\n\nb: blk[4:8]\n# x\na: head -> a",
        5,
        1,
        "node 'a' is defined twice (first at line 1)",
        "one line per node",
    ),
    ("a: embed, blk[0:8], head -> b", 1, 29, "unknown node 'b'", "define it on a line of its own"),
    ("a: embed, blk[0:8], head -> aa", 1, 29, "unknown node 'aa' (did you mean 'a'?)", "a successor is a node"),
    ("a: embed, , head", 1, 11, "an op is missing", "separated by commas"),
    ("a:", 1, 3, "an op is missing", "separated by commas"),
    ("a: embed, blk[0:8], head ->", 1, 26, "nothing after '->'", "name the node"),
    ("a: embed, blk[0:8], head -> a,", 1, 31, "a successor is missing", "separated by commas"),
    ("a: embed, blk[0:8], head -> x@a", 1, 29, "names a device as well", "a successor is a node's label"),
    ("a: blk[0:1] -> a -> a", 1, 18, "'->' after a list of successors", "write the next node as"),
    ("GPU-A: embed", 1, 1, "'GPU-A' is not a device id", "lower-case letters"),
    ("Big@gpu-a: embed", 1, 1, "'Big' is not a node name", "lower-case letters"),
    ("big@Gpu: embed", 1, 5, "'Gpu' is not a device id", "lower-case letters"),
    ("a@b@c: embed", 1, 1, "more than one '@'", "name@device"),
    (": embed", 1, 1, "a line starts without a node label", "write `device: ops`"),
    ("a: embed\nspares: b,", 2, 11, "a spare device is missing", "list device ids"),
    ("a: embed\nspares: b -> a", 2, 11, "'->' on the spares: line", "written @spares"),
    ("a: embed\npolicy: even\npolicy: memory", 3, 1, "a second policy: line (the first is line 2)", "keep one"),
    ("a: embed\npolicy:", 2, 8, "policy: says nothing", "name the policy"),
    ("a: embed\npolicy: Not One", 2, 9, "is not a policy", "lower-case letters"),
    ("a: embed\nobjective: fastest", 2, 12, "'fastest' is not an objective", "latency, throughput, cost"),
    ("a: embed\nobjective: throughput x0", 2, 23, "0 requests in flight", "1 to 4096"),
    ("a: embed\nobjective: throughput x99999", 2, 23, "99999 requests in flight", "1 to 4096"),
    ("a: embed -> policy: head", 1, 13, "policy: after '->'", "on a line of its own"),
    ("# nothing\n\n", 1, None, "no node lines", "gpu-a: embed, blk[0:8], head -> gpu-a"),
]


@pytest.mark.parametrize(("text", "line", "column", "problem", "fix"), BAD, ids=[b[2] for b in BAD])
def test_parse_errors_name_line_column_and_fix(
    text: str, line: int, column: int | None, problem: str, fix: str
) -> None:
    with pytest.raises(PlanError) as info:
        parse(text, "plans/two.txt")
    message = str(info.value)
    where = "plans/two.txt: " if column is None else f"plans/two.txt: line {line}, column {column}: "
    assert message.startswith(where), message
    problem_part, _, fix_part = message.partition(" — ")
    assert problem in problem_part, message
    assert fix in fix_part, message


def test_parse_errors_are_the_projects_words() -> None:
    """No library's text: no Python repr of a struct, no msgspec or re message."""
    for text, *_ in BAD:
        with pytest.raises(PlanError) as info:
            parse(text)
        message = str(info.value)
        assert not re.search(r"Node\(|Blocks\(|Expected `|Traceback|invalid literal", message), message


def test_oversized_text_is_refused_quickly_and_briefly() -> None:
    cases = {
        "a: embed\n" * (MAX_TEXT_BYTES // 9 + 1): "over the limit of 1,048,576 (1 MiB)",
        "é" * (MAX_TEXT_BYTES // 2 + 1): "over the limit of 1,048,576 (1 MiB)",
        "a: embed\n" + "x" * (MAX_LINE_CHARS + 1): "line 2, column 4097: the line has 4,097 characters",
        "a: " + "b" * MAX_LINE_CHARS: "line 1, column 4097",
        "# " + "c" * 100_000: "line 1, column 4097",
        "a: embed -> " + "q" * 4000: "(4,000 characters) is not a node label",
        "a: " + "blk[" * 1000: "is not a block range",
        "a: " + "9" * 4000 + "..1": "more than 9 digits",
        "a: embed\nobjective: cost x" + "9" * 4000: "requests in flight",
    }
    for text, needle in cases.items():
        start = time.perf_counter()
        with pytest.raises(PlanError) as info:
            parse(text, "big.txt")
        assert time.perf_counter() - start < 0.5
        message = str(info.value)
        assert needle in message and len(message) < 400, message[:500]


TOKENS = [*"ab@:,->[]019.#x \t\n\r", "embed", "head", "blk[", "spares:", "objective:", "policy:", "->", "\n"]


@settings(max_examples=CHEAP_EXAMPLES)
@given(st.lists(st.sampled_from(TOKENS), max_size=40).map("".join))
def test_any_text_reads_or_is_refused_with_a_line(text: str) -> None:
    try:
        p = parse(text, "fuzz.txt")
    except PlanError as exc:
        assert re.match(r"^fuzz\.txt: (line \d+, column \d+: |no node lines)", str(exc)), str(exc)
        assert " — " in str(exc)
    else:
        assert parse(render(p)) == _grouped(p)


@settings(max_examples=CHEAP_EXAMPLES)
@given(chains(), st.data())
def test_a_damaged_render_reads_or_is_refused(p: Placement, data: st.DataObject) -> None:
    text = render(p)
    at = data.draw(st.integers(0, len(text)))
    junk = data.draw(st.sampled_from(["", ":", ",", "->", "@", "[", "]", "#", "\n", "Z", " x2", "é", "\x00"]))
    cut = data.draw(st.integers(0, 3))
    damaged = text[:at] + junk + text[at + cut :]
    try:
        q = parse(damaged, "damaged.txt")
    except PlanError as exc:
        assert str(exc).startswith("damaged.txt: ") and " — " in str(exc)
    else:
        assert parse(render(q)) == _grouped(q)


def test_header_lines_say_where_the_model_and_cluster_come_from_and_do_not_change_the_placement():
    body = "a: embed, blk[0:2] -> b\nb: blk[2:4], head -> a\n"
    placement, headers = parse_document(
        "# hand-written\nmodel: small\ncluster: clusters/c.yaml  # two regions\n" + body
    )
    assert headers == {"model": ("small", 2), "cluster": ("clusters/c.yaml", 3)}
    assert placement == parse(body)


@pytest.mark.parametrize(
    ("text", "where", "words"),
    [
        ("model: small\nmodel: tiny\n", "line 2, column 1", ["a second model: line (the first is line 1)", "keep one"]),
        ("cluster:   \n", "line 1, column 9", ["cluster: says nothing", "@cluster"]),
        ("a: embed -> model: blk[0:2]\n", "line 1, column 13", ["model: after '->'", "@model"]),
    ],
)
def test_bad_header_lines_name_the_line_and_the_fix(text, where, words):
    with pytest.raises(PlanError) as info:
        parse_document(text, "hand.txt")
    message = str(info.value)
    assert message.startswith(f"hand.txt: {where}:"), message
    for word in words:
        assert word in message, message
