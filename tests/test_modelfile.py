from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppharness.errors import ModelError
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import resolve_model, sha256_file
from ppharness.model.synthetic.spec import PRESETS, WEIGHT_TYPES, ModelSpec, parse_synthetic, synthetic_source
from ppharness.model.synthetic.vocab import SPECIAL_TOKENS, build_vocab
from ppharness.model.synthetic.writer import make_synthetic


def test_same_spec_same_bytes(tmp_path):
    spec = ModelSpec(blocks=2, dim=16, ffn=32, heads=2, kv_heads=1, vocab=300, seed=7)
    a, b = make_synthetic(spec, tmp_path / "a.gguf"), make_synthetic(spec, tmp_path / "b.gguf")
    assert sha256_file(a) == sha256_file(b)
    c = make_synthetic(ModelSpec(blocks=2, dim=16, ffn=32, heads=2, kv_heads=1, vocab=300, seed=8), tmp_path / "c.gguf")
    assert sha256_file(c) != sha256_file(a)


def test_written_model_reads_back(tmp_path):
    spec = ModelSpec(blocks=3, dim=16, ffn=40, heads=4, kv_heads=2, vocab=320, context=128, tied_embeddings=True)
    f = GGUFFile(make_synthetic(spec, tmp_path / "m.gguf"))
    cfg = f.config
    assert (cfg.arch, cfg.blocks, cfg.dim, cfg.ffn, cfg.heads, cfg.kv_heads, cfg.vocab, cfg.context) == (
        "llama",
        3,
        16,
        40,
        4,
        2,
        320,
        128,
    )
    assert cfg.tied and "output.weight" not in f.names()
    assert f.kv["tokenizer.ggml.tokens"][cfg.bos_id] == "<|begin_of_text|>"
    assert f.kv["tokenizer.ggml.tokens"][cfg.eos_id] == "<|end_of_text|>"
    total = sum(f.tensor(n).size for n in f.names())
    assert total == spec.n_params


def test_vocab_has_bytes_then_real_merges():
    tokens, merges = build_vocab(200, seed=0)
    assert len(tokens) == 456 and len(merges) == 200
    assert len(set(tokens)) == len(tokens)
    for rank, merge in enumerate(merges):  # each merge joins two earlier tokens into the token of its rank
        a, b = merge.split(" ")
        assert tokens.index(a) < 256 + rank and tokens.index(b) < 256 + rank
        assert tokens[256 + rank] == a + b


@settings(max_examples=50)
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40))
def test_tokenizer_round_trips_any_text(tiny_gguf, text):
    tok = tiny_gguf.tokenizer
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tiny_gguf.config.vocab for i in ids)


def test_corpus_text_compresses(tiny_gguf):
    tok = tiny_gguf.tokenizer
    text = "the pipeline stage sends the token"
    assert len(tok.encode(text)) < len(text.encode()) / 2


def test_special_tokens_are_control(tiny_gguf):
    kv = tiny_gguf.kv
    types = kv["tokenizer.ggml.token_type"]
    for name in SPECIAL_TOKENS:
        assert types[kv["tokenizer.ggml.tokens"].index(name)] == 3


def test_llama_1b_preset_has_llama_dimensions():
    spec = PRESETS["llama-3.2-1b"]
    assert (spec.blocks, spec.dim, spec.ffn, spec.heads, spec.kv_heads, spec.vocab) == (16, 2048, 8192, 32, 8, 128256)
    # llama-3.2-1B's published size: embedding 128256 x 2048 (tied head), 16 blocks of 60,821,504, a final norm
    assert spec.n_params == 128256 * 2048 + 16 * 60_821_504 + 2048 == 1_235_814_400


def test_synthetic_source_round_trip():
    spec = ModelSpec(blocks=3, seed=4, tied_embeddings=True)
    assert parse_synthetic(synthetic_source(spec)) == spec
    assert parse_synthetic("synthetic:tiny,blocks=4").blocks == 4
    quantised = replace(spec, type="q8_0")
    assert parse_synthetic(synthetic_source(quantised)) == quantised
    assert parse_synthetic("synthetic:tiny,type=Q4_0").type == "q4_0"


@pytest.mark.parametrize("wtype", ["q8_0", "q4_0"])
def test_same_spec_same_bytes_per_weight_type(tmp_path, wtype):
    spec = ModelSpec(blocks=2, dim=32, ffn=64, heads=2, kv_heads=1, vocab=300, seed=7, type=wtype)
    a, b = make_synthetic(spec, tmp_path / "a.gguf"), make_synthetic(spec, tmp_path / "b.gguf")
    assert sha256_file(a) == sha256_file(b)
    others = {t: sha256_file(make_synthetic(replace(spec, type=t), tmp_path / f"{t}.gguf")) for t in WEIGHT_TYPES}
    assert len(set(others.values())) == len(WEIGHT_TYPES) and others[wtype] == sha256_file(a)


def test_cache_name_differs_per_weight_type():
    tiny = PRESETS["tiny"]
    slugs = {t: replace(tiny, type=t).slug() for t in WEIGHT_TYPES}
    assert len(set(slugs.values())) == len(WEIGHT_TYPES)
    assert slugs["f16"] == "synthetic-8x64-v512-s0-fc6c96297ee1"  # f16 files keep their names (and bytes)
    assert slugs["q8_0"].startswith("synthetic-8x64-v512-s0-q8_0-")


def test_weight_type_is_checked():
    with pytest.raises(ModelError, match="unknown weight type 'q3_k': expected one of f16, q8_0, q4_0"):
        ModelSpec(type="q3_k")
    with pytest.raises(ModelError, match="blocks of 32"):
        ModelSpec(dim=48, heads=4, kv_heads=2, type="q8_0")
    assert ModelSpec(dim=48, heads=4, kv_heads=2).type == "f16"


def test_model_make_type_option(tmp_path):
    from click.testing import CliRunner

    from ppharness.cli import main

    out = tmp_path / "q.gguf"
    r = CliRunner().invoke(
        main, ["model", "make", "--preset", "tiny", "--blocks", "2", "--type", "q8_0", "-o", str(out)]
    )
    assert r.exit_code == 0, r.output
    expected = make_synthetic(replace(PRESETS["tiny"], blocks=2, type="q8_0"), tmp_path / "expected.gguf")
    assert sha256_file(out) == sha256_file(expected)
    r = CliRunner().invoke(main, ["model", "make", "--type", "q3", "-o", str(tmp_path / "x.gguf")])
    assert r.exit_code == 1 and "expected one of f16, q8_0, q4_0" in r.output, r.output


@pytest.mark.parametrize(
    "source, needle",
    [
        ("synthetic:huge", "unknown model preset"),
        ("synthetic:tiny,colour=3", "unknown synthetic model field"),
        ("synthetic:tiny,type=q2_k", "unknown weight type"),
        ("/nonexistent/model.gguf", "does not exist"),
    ],
)
def test_bad_sources(source, needle):
    with pytest.raises(ModelError, match=needle):
        resolve_model(source)


def test_sha256_mismatch_is_an_error(tiny_model_path):
    with pytest.raises(ModelError, match="sha256"):
        resolve_model(tiny_model_path, sha256="0" * 64)
    assert resolve_model(tiny_model_path, sha256=sha256_file(resolve_model(tiny_model_path)))


def test_bad_spec_is_explained():
    with pytest.raises(ModelError, match="divide"):
        ModelSpec(dim=30, heads=4)
    with pytest.raises(ModelError, match="too small"):
        ModelSpec(vocab=100)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3"])
def test_dense_qwen_files_are_written_as_llama_cpps_converter_writes_them(preset):
    """Every tensor of a dense Qwen file is one that gguf-py (llama.cpp's converter) names for its architecture, with
    the shapes llama.cpp's loader asks for: qwen2's q/k/v biases; qwen3's per-head q/k norms and its head width in
    ``attention.key_length``, wider than dim / heads. The engine reads them back as such."""
    import re

    import gguf

    spec = PRESETS[preset]
    path = resolve_model(f"synthetic:{preset}")
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    assert arch == spec.arch
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[model_arch]}
    tensors = {t.name: t.shape.tolist() for t in reader.tensors}  # ne: the fastest-varying dimension first
    for name in tensors:
        base, _, kind = name.rpartition(".")
        assert re.sub(r"^blk\.\d+\.", "blk.{bid}.", base) in known and kind in ("weight", "bias"), name
    d, hd, q, kv = spec.dim, spec.hd, spec.heads * spec.hd, spec.kv_heads * spec.hd
    biases = {n for n in tensors if n.endswith(".bias")}
    norms = {n for n in tensors if n.endswith(("attn_q_norm.weight", "attn_k_norm.weight"))}
    assert tensors["blk.0.attn_q.weight"] == [d, q] and tensors["blk.0.attn_k.weight"] == [d, kv]
    assert tensors["blk.0.attn_output.weight"] == [q, d]
    cfg = GGUFFile(path).config
    key_length = gguf.Keys.Attention.KEY_LENGTH.format(arch=arch)
    if arch == "qwen2":
        assert biases == {f"blk.{i}.attn_{p}.bias" for i in range(spec.blocks) for p in "qkv"} and not norms
        assert (tensors["blk.0.attn_q.bias"], tensors["blk.0.attn_k.bias"], tensors["blk.0.attn_v.bias"]) == (
            [q],
            [kv],
            [kv],
        )
        assert key_length not in reader.fields and q == d
        assert (cfg.qkv_bias, cfg.qk_norm, cfg.head_dim) == (True, 0, d // spec.heads)
    else:
        assert not biases and norms == {f"blk.{i}.attn_{p}_norm.weight" for i in range(spec.blocks) for p in "qk"}
        assert tensors["blk.0.attn_q_norm.weight"] == [hd] and tensors["blk.0.attn_k_norm.weight"] == [hd]
        assert reader.fields[key_length].contents() == hd and q != d
        assert (cfg.qkv_bias, cfg.qk_norm, cfg.head_dim) == (False, hd, hd)
    assert reader.fields["tokenizer.ggml.pre"].contents() == "qwen2"
