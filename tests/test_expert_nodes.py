"""Expert nodes in one process, over the in-memory transport: a stage fans its MoE blocks' tokens out to expert nodes
and gathers, token-exact against the unsplit model; an expert node answers only the block's stage, only for experts
it holds, and answers a copy of a request with the same bytes without computing again."""

from __future__ import annotations

import numpy as np
import pytest

from ppharness.model.engine.expert_bank import ExpertBank
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.synthetic.spec import preset_spec
from ppharness.model.synthetic.writer import make_synthetic
from ppharness.plan.stages import expert_name, expert_node_name, stage_name
from ppharness.run.node.experts import ExpertParallel, ExpertServer, holders_of
from ppharness.wire import codec
from ppharness.wire.messages import ExpertRequest, ExpertResult
from transports.memory import MemoryHub, MemoryTransport

MAX_CONTEXT = 64
PLAN = "p-experts"


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory) -> GGUFFile:
    return GGUFFile(make_synthetic(preset_spec("tiny-moe"), tmp_path_factory.mktemp("moe") / "tiny-moe.gguf"))


class Pumped:
    """The stage's transport, which, before each wait for a message, lets every expert node answer what it has
    received: the whole run in one thread (tinygrad is not made for several)."""

    def __init__(self, transport: MemoryTransport, nodes: list[tuple[ExpertServer, MemoryTransport]]):
        self.transport, self.nodes = transport, nodes

    def send(self, address: str, msg):  # noqa: ANN201
        return self.transport.send(address, msg)

    def receive(self, timeout: float):  # noqa: ANN201
        from ppharness.errors import TransportTimeout

        for server, t in self.nodes:
            while True:
                try:
                    rx = t.receive(0.0)
                except TransportTimeout:
                    break
                server.handle(rx.sender, rx.message, rx)
        return self.transport.receive(min(timeout, 0.01))


def test_holders_are_read_from_the_directory_first_replica_first():
    names = {
        expert_name(2, 5, 1): "b",
        expert_name(2, 5): "a",
        expert_name(3, 0): "c",
        stage_name(0): "s",
        "moe-expert-x-1": "junk",
    }
    assert holders_of(names) == {(2, 5): ["a", "b"], (3, 0): ["c"]}


def test_a_stage_with_its_experts_on_expert_nodes_gives_the_unsplit_models_tokens(moe_gguf):
    """Stage holds no routed experts; three expert nodes hold a partition of them, one expert of each block twice.
    Every decode step's output equals the unsplit model's byte for byte."""
    cfg = moe_gguf.config
    whole = ModelSlice(moe_gguf, 0, cfg.blocks, True, True, MAX_CONTEXT, taps=True)
    hub = MemoryHub()
    stage_t = MemoryTransport(hub, "stage")
    stage_addr = stage_t.start()
    names = {stage_name(0): stage_addr}
    nodes, log = [], []
    held: list[dict[int, list[int]]] = [{}, {}, {}]
    for layer in range(cfg.blocks):
        for e in range(cfg.experts):
            held[e % 3].setdefault(layer, []).append(e)
        held[(layer + 1) % 3][layer].append(layer % cfg.experts)  # a replica
    for j, h in enumerate(held):
        t = MemoryTransport(hub, f"experts-{j}")
        addr = t.start()
        names[expert_node_name(j)] = addr
        replica = {(layer, e): sum(1 for k in range(j) if e in held[k].get(layer, ())) for layer in h for e in h[layer]}
        names.update({expert_name(layer, e, replica[(layer, e)]): addr for (layer, e) in replica})
        bank = ExpertBank(moe_gguf, h)
        server = ExpertServer(bank, t, {}, {layer: stage_name(0) for layer in h}, PLAN, log=log.append)
        nodes.append((server, t))
    for server, _ in nodes:
        server.rejoin(names, 0)
    split = ModelSlice(moe_gguf, 0, cfg.blocks, True, True, MAX_CONTEXT, taps=True, experts={})
    model = ExpertParallel(split, Pumped(stage_t, nodes), names, PLAN, log=log.append)  # type: ignore[arg-type]
    ids = [cfg.bos_id or 0, 72, 101, 108, 108, 111]
    model.begin_step("r1", 0)
    a, b = whole.prefill(ids), model.prefill(ids)
    assert a == b
    assert all(np.array_equal(whole.tapped()[k], split.tapped()[k]) for k in whole.tapped())
    token_a, token_b = a, b
    for pos in range(len(ids), len(ids) + 10):
        model.begin_step("r1", pos)
        token_a, token_b = whole.decode([token_a], pos), model.decode([token_b], pos)
        assert token_a == token_b, f"position {pos}: the split chose {token_b}, the unsplit model {token_a}"
        for k, hidden in whole.tapped().items():
            assert np.array_equal(hidden, split.tapped()[k]), f"block {k}'s output differs at position {pos}"
    assert sum(s.computed for s, _ in nodes) > 0
    assert all(s.computed > 0 for s, _ in nodes), "some expert node was never asked"


def _request(layer: int, pairs: list[tuple[int, int]], rows: int = 1, dim: int = 64) -> ExpertRequest:
    data, shape = codec.pack_hidden(np.ones((rows, dim), dtype=np.float16), "f16")
    return ExpertRequest(
        request_id="r", position=3, layer=layer, pairs=pairs, hidden=data, shape=shape, dtype="f16", plan_id=PLAN
    )


def _server(moe_gguf: GGUFFile, log: list[str]) -> tuple[ExpertServer, MemoryTransport, MemoryTransport, str]:
    hub = MemoryHub()
    node, owner, stranger = MemoryTransport(hub, "node"), MemoryTransport(hub, "owner"), MemoryTransport(hub, "x")
    node.start(), stranger.start()
    owner_addr = owner.start()
    server = ExpertServer(
        ExpertBank(moe_gguf, {1: [2, 5]}), node, {stage_name(0): owner_addr}, {1: stage_name(0)}, PLAN
    )
    server.log = log.append
    return server, owner, stranger, owner_addr


def test_an_expert_node_answers_only_the_stage_that_runs_the_block(moe_gguf):
    log: list[str] = []
    server, owner, stranger, owner_addr = _server(moe_gguf, log)
    server.handle(stranger.address, _request(1, [(0, 2)]))
    assert server.computed == 0 and "only that block's stage sends it" in log[-1]
    server.handle(owner_addr, _request(1, [(0, 2), (0, 5)]))
    got = owner.receive(2.0)
    assert isinstance(got.message, ExpertResult) and got.message.shape == (2, 64)


def test_an_expert_node_refuses_experts_it_does_not_hold_and_bad_rows(moe_gguf):
    log: list[str] = []
    server, _, _, owner_addr = _server(moe_gguf, log)
    server.handle(owner_addr, _request(1, [(0, 3)]))
    assert server.computed == 0 and "refused" in log[-1] and "not held here" in log[-1]
    server.handle(owner_addr, _request(1, [(4, 2)]))
    assert server.computed == 0 and "names row 4 of 1" in log[-1]
    server.handle(owner_addr, _request(0, [(0, 2)]))  # block 0's owner is nobody this node knows
    assert server.computed == 0 and "only that block's stage sends it" in log[-1]


def test_a_copy_of_a_request_is_answered_with_the_same_bytes_without_computing_again(moe_gguf):
    log: list[str] = []
    server, owner, _, owner_addr = _server(moe_gguf, log)
    server.handle(owner_addr, _request(1, [(0, 2)]))
    server.handle(owner_addr, _request(1, [(0, 2)]))
    first, second = owner.receive(2.0).message, owner.receive(2.0).message
    assert server.computed == 1 and server.served == 2
    assert isinstance(first, ExpertResult) and isinstance(second, ExpertResult)
    assert first.outputs == second.outputs
