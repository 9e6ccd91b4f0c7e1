"""A plan counts a stage's weights as the engine holds them (``ppharness.model.held``): a quantised file's matrices and
routed expert stacks at their bytes in the file, F16 and F32 matrices and the norms as float16, a MoE block's router
and the norm before it in float32. So what the plan counts for any stage of a Q4_K, Q8_0 or mixture-of-experts model
is what ``ModelSlice.weight_bytes`` reports when that stage is loaded, byte for byte; a synthetic spec's graph counts
the same without its file; a plan made from the file runs, and one made with ``--weights`` (the simulator's
override) is refused by a run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ppharness.errors import PlanError
from ppharness.model.engine.expert_bank import ExpertBank
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.synthetic.spec import PRESETS, ModelSpec
from ppharness.model.synthetic.writer import make_synthetic
from ppharness.plan.compile import check_model, compile_plan, scenario_plan
from ppharness.plan.graph import file_sha256, model_graph, spec_graph
from ppharness.plan.lang.check import node_weights
from ppharness.plan.lang.document import loop

# widths that are multiples of 256, so that the K-quant types are really K-quants (not their Q8_0 fallback)
DENSE = ModelSpec(blocks=3, dim=256, ffn=512, heads=4, kv_heads=2, vocab=320)
MOE = replace(DENSE, arch="qwen3moe", experts=4, experts_used=2, expert_ffn=256)
SPECS = {
    "q4_k": replace(DENSE, type="q4_k"),  # a Q4_K_M mix: Q6_K head, attn_v and ffn_down of block 2
    "q8_0": replace(DENSE, type="q8_0"),
    "qwen3moe-q8_0": replace(MOE, type="q8_0"),
    "qwen2moe-q8_0": replace(PRESETS["tiny-moe-shared"], blocks=3, type="q8_0"),
    "deepseek2-q8_0": replace(PRESETS["tiny-deepseek"], blocks=3, type="q8_0"),
    "qwen3moe-q4_k": replace(MOE, type="q4_k"),  # ffn_down_exps Q4_K in blocks 0 and 1, Q6_K in block 2
    "qwen2-q4_k": replace(DENSE, arch="qwen2", type="q4_k"),  # q/k/v biases: F32 in the file, float16 held
    "qwen3-q4_k": replace(DENSE, arch="qwen3", head_dim=128, type="q4_k"),  # per-head norms; heads wider than 64
}
SPLITS = ([], [1], [2], [1, 2])  # every way to cut 3 blocks into stages
CONTEXT = 64


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("held")
    return {name: make_synthetic(spec, root / f"{name}.gguf") for name, spec in SPECS.items()}


def router_bias_bytes(spec: ModelSpec, lo: int, hi: int) -> int:
    """deepseek2's router selection bias of blocks [lo, hi): float32 on the device, read apart from the slice's
    weights (the plan counts it, ``weight_bytes`` does not report it); 0 for other architectures."""
    if spec.arch != "deepseek2":
        return 0
    return 4 * spec.experts * sum(1 for b in range(lo, hi) if b >= spec.dense_blocks)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_stage_of_a_plan_counts_the_weight_bytes_the_engine_holds(files, name):
    """Each node's weights in the plan (``node_weights``: its blocks, the embedding on the entry, the final norm and
    the head on the exit) equal ``weight_bytes`` of the slice that node loads, for every split. No tolerance is
    needed: the norms, F32 in the file, are counted as the float16 the engine holds them in, and nothing else
    differs (but deepseek2's router bias, ``router_bias_bytes``)."""
    spec, f = SPECS[name], GGUFFile(files[name])
    graph = model_graph(files[name], name, CONTEXT, digest=False)
    assert graph.weights == "", "a plan made from the file counts the file's own types"
    for cuts in SPLITS:
        doc = scenario_plan(graph, None, cuts, "local") if cuts else scenario_plan(graph, 1, None, "local")
        compile_plan(doc)  # a plan that runs
        for node in loop(doc):
            lo, hi = node.blocks or (0, 0)
            stage = ModelSlice(f, lo, hi, node.embeds, hi == spec.blocks, max_context=CONTEXT)
            held = stage.weight_bytes + router_bias_bytes(spec, lo, hi)
            assert node_weights(doc, node) == held, (
                f"{name}, blocks [{lo}, {hi}): the plan counts {node_weights(doc, node):,} bytes of weights, the "
                f"engine holds {held:,}"
            )


def test_a_quantised_graph_holds_the_files_bytes_not_the_float16_expansion(files):
    """A Q4_K_M model's plan counts about 4.8 bits per weight (Q4_K's 4.5 and the Q6_K head's 6.6), not 16."""
    g = model_graph(files["q4_k"], "q4_k", CONTEXT, digest=False)
    counted = g.embed_bytes + g.head_bytes + sum(b.weight_bytes for b in g.blocks)
    params = SPECS["q4_k"].n_params
    assert 4.5 / 8 * params < counted < 5.5 / 8 * params, f"{counted:,} bytes for {params:,} parameters"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_synthetic_specs_graph_counts_its_types_without_the_file(files, name):
    """``spec_graph`` reads the types the writer would store (``tensor_type``), so it is the written file's graph."""
    assert spec_graph(SPECS[name], name, CONTEXT) == model_graph(files[name], name, CONTEXT, digest=False)


def test_bytes_per_expert_is_one_routed_expert_as_its_bank_holds_it(files):
    """A routed expert of a Q8_0 model weighs its gate, up and down matrices' bytes in the file (34 bytes per 32
    weights), as an expert node's bank holds them, whichever experts and blocks the bank gets; its FLOPs stay two per
    parameter."""
    spec, f = SPECS["qwen3moe-q8_0"], GGUFFile(files["qwen3moe-q8_0"])
    g = model_graph(files["qwen3moe-q8_0"], "qwen3moe-q8_0", CONTEXT, digest=False)
    per_expert = 3 * spec.dim * spec.expert_ffn
    for b in g.blocks:
        assert b.experts.bytes_per_expert == per_expert // 32 * 34
        assert b.experts.expert_flops == 2 * per_expert, "a packed expert's FLOPs are its parameters', not its bytes"
    for held in ({0: [1, 3]}, {1: [0], 2: [0, 1, 2, 3]}):
        bank = ExpertBank(f, held)
        want = sum(len(ids) * g.blocks[layer].experts.bytes_per_expert for layer, ids in held.items())
        assert bank.weight_bytes == want, (
            f"a bank of {held} holds {bank.weight_bytes:,} bytes; the plan counts {want:,}"
        )


def test_a_routed_expert_counts_its_own_blocks_types(files):
    """A Q4_K_M's ffn_down_exps is Q6_K in some blocks and Q4_K in others; each block's experts count their own
    block's bytes, as a bank holds each block's stacks apart, whichever blocks it gets."""
    spec, f = SPECS["qwen3moe-q4_k"], GGUFFile(files["qwen3moe-q4_k"])
    g = model_graph(files["qwen3moe-q4_k"], "qwen3moe-q4_k", CONTEXT, digest=False)
    d, x = spec.dim, spec.expert_ffn
    gate_up = 2 * x * d // 256 * 144  # Q4_K in every block
    down = {0: d * x // 256 * 144, 1: d * x // 256 * 144, 2: d * x // 256 * 210}  # Q6_K in block 2
    assert [b.experts.bytes_per_expert for b in g.blocks] == [gate_up + down[i] for i in range(spec.blocks)]
    bank = ExpertBank(f, {1: [0, 2], 2: [1, 2, 3]})
    want = 2 * g.blocks[1].experts.bytes_per_expert + 3 * g.blocks[2].experts.bytes_per_expert
    assert bank.weight_bytes == want, (
        f"a bank of blocks 1 and 2 holds {bank.weight_bytes:,} bytes; the plan counts {want:,}"
    )


def test_a_plan_from_the_file_runs_and_one_with_an_override_is_for_the_simulator(files):
    """Without ``--weights`` the plan passes the run's model check; with it (here q4_k on a Q8_0 file) the plan counts
    another model's bytes, and a run refuses it saying so."""
    path = files["q8_0"]
    runs = scenario_plan(model_graph(path, str(path), CONTEXT), 2, None, "local")
    check_model(runs, file_sha256(path), str(path))
    override = model_graph(path, str(path), CONTEXT, weights="q4_k")
    assert override.weights == "q4_k"
    assert sum(b.weight_bytes for b in override.blocks) < sum(b.weight_bytes for b in runs.model.blocks)
    with pytest.raises(PlanError, match=r"counts weights as q4_k, for the simulator only — an override \(--weights\) "):
        compile_plan(scenario_plan(override, 2, None, "local"))
