"""Weights as the file packs them (``ppharness.model.formats.packed``): every supported ggml type is unpacked inside the
kernel exactly as the ``gguf`` package's own numpy dequantiser reads it; a slice holds its matrices as the file's
bytes (its device memory is its packed weights, not their float16 expansion); a packed model gives the tokens of the
same model dequantised to float16 at load; and splits of a packed model equal its unsplit model bit for bit at every
block boundary, for the K-quant mixes too."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ppharness.errors import ModelError
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.formats.codecs import CODECS
from ppharness.model.formats.packed import Packed
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.synthetic.spec import PRESETS, ModelSpec
from ppharness.model.synthetic.writer import make_synthetic

# widths that are multiples of 256, so that the K-quant types are really K-quants (not their Q8_0 fallback)
K_SPEC = ModelSpec(blocks=3, dim=256, ffn=512, heads=4, kv_heads=2, vocab=320, seed=5)
MOE_SPEC = replace(PRESETS["tiny"], arch="qwen3moe", experts=8, experts_used=2, expert_ffn=64, blocks=2)
SCALE_BYTES = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def _random_blocks(ggml_type: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of ``rows`` rows of ``ggml_type``, each block's fp16 scales finite and of a sane size."""
    f = CODECS[ggml_type].format
    name, block, size = f.name, f.block, f.bytes
    if name == "BF16":
        values = rng.standard_normal(rows * cols).astype(np.float32)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in SCALE_BYTES[name]:
        scales = (rng.standard_normal((rows, cols // block)) * 0.1).astype(np.float16)
        data[..., at : at + 2] = scales.view(np.uint8).reshape(rows, cols // block, 2)
    return data.reshape(rows, -1)


@pytest.mark.parametrize(
    "ggml_type", sorted(t for t, c in CODECS.items() if c.packs), ids=lambda t: CODECS[t].format.name
)
def test_each_type_unpacks_as_the_gguf_package_reads_it(ggml_type):
    import gguf

    rows, cols = 5, 512
    data = _random_blocks(ggml_type, rows, cols, np.random.default_rng(ggml_type))
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(ggml_type)).astype(np.float32)
    got = Packed.of(data, ggml_type, (rows, cols)).values().numpy()
    assert got.shape == (rows, cols)
    assert np.array_equal(got.view(np.uint32), want.reshape(rows, cols).view(np.uint32)), (
        f"{CODECS[ggml_type].format.name}: the unpacked values differ from ggml's definition"
    )


def test_gathered_rows_are_the_rows_of_the_matrix():
    from tinygrad.tensor import Tensor

    data = _random_blocks(12, 7, 256, np.random.default_rng(1))
    packed = Packed.of(data, 12, (7, 256))
    rows = packed.rows(Tensor([[6, 0, 3]], dtype="int32")).numpy()
    assert np.array_equal(rows[0], packed.values().numpy()[[6, 0, 3]])


def test_a_row_of_the_wrong_length_is_refused():
    with pytest.raises(ModelError, match="rows of 17 bytes, not 18"):
        Packed.of(np.zeros((2, 17), np.uint8), 2, (2, 32))


@pytest.fixture(scope="module")
def k_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    return {t: make_synthetic(replace(K_SPEC, type=t), root / f"{t}.gguf") for t in ("f16", "q4_k", "q6_k", "q4_1")}


def _decode(model: ModelSlice, prompt: list[int], n: int) -> list[int]:
    tok = model.prefill(prompt)
    out = [tok]
    for pos in range(len(prompt), len(prompt) + n - 1):
        tok = model.decode([tok], pos)
        out.append(tok)
    return out


@pytest.mark.parametrize("wtype", ["q4_k", "q4_1"])
def test_a_slice_holds_the_files_bytes_not_their_float16_expansion(k_files, wtype):
    f = GGUFFile(k_files[wtype])
    packed = ModelSlice(f, 0, K_SPEC.blocks, True, True, max_context=64)
    expanded = ModelSlice(f, 0, K_SPEC.blocks, True, True, max_context=64, weights="f16")
    matrices = sum(int(t.n_bytes) for t in f._reader.contents.tensors)  # the file's tensor bytes
    assert packed.n_params == expanded.n_params
    assert packed.weight_bytes <= 1.02 * matrices, "a packed slice holds about the file's bytes"
    assert expanded.weight_bytes > 2.5 * packed.weight_bytes, "float16 would hold far more"


# q6_k's packed product runs its own unpacking: with the slow tests (q4_k and q4_1 in the default run)
@pytest.mark.parametrize("wtype", ["q4_k", pytest.param("q6_k", marks=pytest.mark.slow), "q4_1"])
def test_a_packed_model_gives_the_tokens_of_the_model_dequantised_to_float16(k_files, wtype):
    f = GGUFFile(k_files[wtype])
    packed = _decode(ModelSlice(f, 0, K_SPEC.blocks, True, True, max_context=64), [1, 5, 9, 2], 12)
    expanded = _decode(ModelSlice(f, 0, K_SPEC.blocks, True, True, max_context=64, weights="f16"), [1, 5, 9, 2], 12)
    # the two compute with the same values (float16 rounds the weights of one), so they agree until a near-tie;
    # on these files they agree on all 12
    assert packed == expanded


def test_splits_of_a_packed_model_equal_the_unsplit_model_at_every_boundary(k_files):
    f = GGUFFile(k_files["q4_k"])
    prompt, n = [3, 1, 4, 1, 5], 6
    whole = ModelSlice(f, 0, K_SPEC.blocks, True, True, max_context=64, taps=True)
    want_tokens, want_taps = [], []
    tok = whole.prefill(prompt)
    for pos in range(len(prompt), len(prompt) + n):
        want_tokens.append(tok)
        tok = whole.decode([tok], pos)
        want_taps.append(whole.tapped())
    for cut in range(1, K_SPEC.blocks):
        a = ModelSlice(f, 0, cut, True, False, max_context=64)
        b = ModelSlice(f, cut, K_SPEC.blocks, False, True, max_context=64)
        tok = b.prefill(a.prefill(prompt))
        for step, pos in enumerate(range(len(prompt), len(prompt) + n)):
            assert tok == want_tokens[step], f"split at {cut}: token {step} differs"
            hidden = a.decode([tok], pos)
            assert np.array_equal(hidden.view(np.uint16), want_taps[step][cut - 1].view(np.uint16)), (
                f"split at {cut}: the boundary's hidden state at position {pos} differs from the unsplit model's"
            )
            tok = b.decode(hidden, pos)


def test_packed_experts_compute_the_block_of_float16_experts(tmp_path):
    """A MoE block whose experts are held packed gives the hidden state of the same block with its experts
    dequantised to float16, within the float16 rounding of the weights (the routing may differ only at a near-tie;
    these rows have none)."""
    path = make_synthetic(replace(MOE_SPEC, type="q4_1"), tmp_path / "moe.gguf")
    f = GGUFFile(path)
    packed = ModelSlice(f, 0, 1, True, False, max_context=64)
    expanded = ModelSlice(f, 0, 1, True, False, max_context=64, weights="f16")
    assert packed.bank.weight_bytes * 3 < expanded.bank.weight_bytes, "the experts are held packed"
    a = packed.prefill([1, 2, 3, 4]).astype(np.float32)
    b = expanded.prefill([1, 2, 3, 4]).astype(np.float32)
    assert np.abs(a - b).max() <= 1e-2 * np.abs(b).max(), "packed experts compute another block"
