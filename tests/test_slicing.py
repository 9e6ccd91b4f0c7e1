"""A stage loads only what it owns, names it as tinygrad expects, and the oracle equals tinygrad's own decode."""

from __future__ import annotations

import pytest

from ppharness.errors import ModelError
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.engine.slicing import ModelSlice, _local_name, owned_tensors
from ppharness.model.gguf_file import GGUFFile, tokenizer_from
from ppharness.model.sources.files import resolve_model
from ppharness.model.synthetic.spec import ModelSpec
from ppharness.model.synthetic.writer import make_synthetic
from ppharness.model.text.eog import end_of_generation
from ppharness.run.inprocess import check_splits, load_slices, run_inprocess

SMALL = ModelSpec(blocks=4, dim=8, ffn=16, heads=2, kv_heads=1, vocab=300, context=64)


@pytest.fixture(scope="module")
def four_blocks(tmp_path_factory):
    return GGUFFile(make_synthetic(SMALL, tmp_path_factory.mktemp("m") / "four.gguf"))


def test_local_names_restart_at_zero():
    assert _local_name("blk.5.attn_q.weight", 4) == "blk.1.attn_q.weight"
    assert _local_name("token_embd.weight", 4) == "token_embd.weight"


def test_owned_tensors_by_role(four_blocks):
    names = four_blocks.names()
    first = owned_tensors(names, 0, 2, True, False, tied=False)
    assert "token_embd.weight" in first and "output.weight" not in first
    assert {k.split(".")[1] for k in first if k.startswith("blk.")} == {"0", "1"}
    middle = owned_tensors(names, 1, 3, False, False, tied=False)
    assert middle["blk.0.ffn_up.weight"] == "blk.1.ffn_up.weight"
    assert not any(k.startswith(("token_embd", "output")) for k in middle)
    last = owned_tensors(names, 3, 4, False, True, tied=True)
    assert last["output.weight"] == "token_embd.weight"


@pytest.mark.parametrize("cuts", [[0, 4], [0, 1, 4], [0, 2, 3, 4], [0, 1, 2, 3, 4]])
def test_stage_parameters_add_up_to_the_model(four_blocks, cuts):
    ranges = list(zip(cuts, cuts[1:]))
    slices = [ModelSlice(four_blocks, lo, hi, i == 0, i == len(ranges) - 1) for i, (lo, hi) in enumerate(ranges)]
    assert sum(s.n_params for s in slices) == SMALL.n_params
    assert all(s.tied_params == 0 for s in slices)


def test_tied_head_is_counted_once(tmp_path):
    spec = ModelSpec(blocks=2, dim=8, ffn=16, heads=2, kv_heads=1, vocab=300, context=64, tied_embeddings=True)
    f = GGUFFile(make_synthetic(spec, tmp_path / "tied.gguf"))
    a, b = ModelSlice(f, 0, 1, True, False), ModelSlice(f, 1, 2, False, True)
    assert a.n_params + b.n_params == spec.n_params
    assert b.tied_params == spec.vocab * spec.dim
    whole = ModelSlice(f, 0, 2, True, True)
    assert whole.n_params == spec.n_params and whole.tied_params == 0
    # the tied split still equals the unsplit model
    path = str(f.path)
    got = run_inprocess(f, load_slices(f, [(0, 1), (1, 2)]), "tied weights", 5)
    assert got.token_ids == oracle_decode(path, "tied weights", 5, 64).token_ids


def test_bad_range_is_rejected(four_blocks):
    with pytest.raises(ModelError, match="not inside"):
        ModelSlice(four_blocks, 2, 6, False, True)


def test_a_file_without_a_block_fails_with_its_name(tmp_path):
    import gguf

    src = GGUFFile(make_synthetic(SMALL, tmp_path / "full.gguf"))
    fields = gguf.GGUFReader(str(src.path)).fields  # each value's GGUF type, as the gguf package reads it
    w = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "llama")
    for key, value in src.kv.items():
        if key not in ("general.architecture",):
            field = fields[key]
            vtype = field.types[0]
            if vtype == gguf.GGUFValueType.ARRAY:
                w.add_array(key, value)
            else:
                w.add_key_value(key, value, vtype)
    for name in src.names():
        if name != "blk.2.ffn_up.weight":
            w.add_tensor(name, src._reader.tensors[src.names().index(name)].data)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    cut = GGUFFile(tmp_path / "cut.gguf")
    ModelSlice(cut, 0, 2, True, False)  # blocks 0-1 are whole
    with pytest.raises(ModelError, match="blk.2.ffn_up.weight"):
        ModelSlice(cut, 2, 4, False, True)


def test_oracle_equals_tinygrads_own_generate(tiny_model_path):
    """Our unsplit model is tinygrad's Transformer.from_gguf + generate with an fp16 residual at block boundaries."""
    from pathlib import Path

    from tinygrad import Tensor
    from tinygrad.apps.llm import Transformer

    from ppharness.model.layers.block import block_class

    model, kv = Transformer.from_gguf(Tensor(Path(tiny_model_path)), 256)
    for block in model.blk:
        block.__class__ = block_class()
    tok = tokenizer_from(kv)
    prompt = "The quick brown fox"
    ids = [kv["tokenizer.ggml.bos_token_id"], *tok.encode(prompt)]
    gen = model.generate(list(ids))
    reference = [next(gen) for _ in range(10)]
    ours = oracle_decode(tiny_model_path, prompt, 10)
    eog = end_of_generation(kv)
    stop = next((i for i, t in enumerate(reference) if t in eog), len(reference))
    assert ours.token_ids == reference[:stop]


@pytest.mark.parametrize(
    "ranges",
    [
        [(0, 4), (4, 8)],
        [(0, 3), (3, 5), (5, 8)],
        pytest.param([(i, i + 1) for i in range(8)], marks=pytest.mark.slow),
    ],
    ids=["2-stage", "3-stage", "8-stage"],
)
def test_a_split_compiles_the_same_kernels_as_the_whole_model(tiny_gguf, ranges):
    """Bit-exactness by construction: the stages' compiled decode steps, one after another, run exactly the kernels of
    the unsplit model's step, so no split can compute a boundary differently."""
    whole = load_slices(tiny_gguf, [(0, 8)])[0].decode_kernels()
    split = [k for s in load_slices(tiny_gguf, ranges) for k in s.decode_kernels()]
    assert whole, "the decode step compiled no kernels"
    assert len(split) == len(whole)
    differ = [i for i, (a, b) in enumerate(zip(whole, split)) if a != b]
    assert not differ, f"split {ranges} runs other kernels than the whole model from kernel {differ[0]} on"


def test_boundary_taps_do_not_change_the_kernels(tiny_gguf):
    plain = load_slices(tiny_gguf, [(0, 8)])[0].decode_kernels()
    tapped = load_slices(tiny_gguf, [(0, 8)], taps=True)[0].decode_kernels()
    assert plain == tapped


@pytest.mark.slow  # the factors are held to the reference by tests/test_reference_model.py (tiny-llama3) by default
def test_llama3_rope_factors_keep_every_split_exact():
    """A file with Llama-3's rope_freqs: every split gives the unsplit model's tokens and hidden states, byte for
    byte, through the same compiled kernels (the factors are the same in every stage's table)."""
    path = str(resolve_model("synthetic:tiny-llama3"))
    splits = [[(0, 4), (4, 8)], [(0, 1), (1, 6), (6, 8)]]
    oracle, checks = check_splits(path, "Héllo rotary factors 1234", 40, splits)
    assert len(oracle.token_ids) >= 8, "the answer is too short to test the factors at later positions"
    for check in checks:
        assert check.verdict.exact, check.verdict.describe(check.token_ids, oracle.token_ids)
        assert check.same_kernels, f"split {check.ranges} compiles other kernels than the whole model"


@pytest.mark.parametrize(
    "model",
    # deepseek2's splits also run in tests/test_deepseek2.py; its kernel check here runs with the slow tests
    # with the slow tests; MoE splits are held to the unsplit model by default in tests/test_expert_nodes.py and
    # tests/test_deepseek2.py
    [
        pytest.param(m, marks=pytest.mark.slow)
        for m in ("synthetic:tiny-moe", "synthetic:tiny-deepseek,tokenizer=deepseek-v3")
    ],
)
def test_moe_splits_run_the_unsplit_models_kernels(model):
    """A mixture-of-experts model, split: tokens and hidden states equal the unsplit model's, the stages' steps run
    its kernels in order, and each stage's expert bank (fewer experts) runs the same code as the whole model's bank."""
    path = str(resolve_model(model))
    oracle, checks = check_splits(path, "Héllo experts, 1234 naïve", 12, [[(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]])
    for check in checks:
        assert check.verdict.exact, check.verdict.describe(check.token_ids, oracle.token_ids)
        assert check.same_kernels, f"split {check.ranges} compiles other kernels than the whole model"


@pytest.mark.parametrize("preset", [pytest.param("tiny-qwen2", marks=pytest.mark.slow), "tiny-qwen3"])
def test_dense_qwen_splits_run_the_unsplit_models_kernels(preset):
    """qwen2 (q/k/v biases) and qwen3 (per-head q/k norms, heads wider than dim / heads), split: tokens and every
    stage-boundary hidden state equal the unsplit model's, byte for byte, through the same compiled kernels."""
    path = str(resolve_model(f"synthetic:{preset}"))
    oracle, checks = check_splits(path, "Héllo qwen, 1234 naïve café", 24, [[(0, 1), (1, 6), (6, 8)]])
    assert len(oracle.token_ids) >= 8, "the answer is too short to compare many decode steps"
    for check in checks:
        assert check.verdict.exact, check.verdict.describe(check.token_ids, oracle.token_ids)
        assert check.same_kernels, f"split {check.ranges} compiles other kernels than the whole model"
