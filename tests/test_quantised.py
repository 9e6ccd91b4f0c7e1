"""Quantised synthetic models (Q8_0, Q4_0): the file really holds those formats, each block is what the format says,
the weights stay close to the f16 model of the same seed, and splits of the quantised model equal its unsplit model
bit for bit: tokens and every stage-boundary hidden state (in one process, and on real pp-node processes over ZeroMQ
with marker ``local``). The other weight types (bf16, f32, q4_1 and the K-quants q4_k, q5_k, q6_k) in the file: each
matrix in its type, the Q4_K_M / Q5_K_M mix or the documented fallback, close to the f16 model, and the K-quant
quantisers of ``ppharness.model.formats.kquants`` read back by ``gguf``'s own dequantiser."""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ppharness.errors import ModelError
from ppharness.model.formats.kquants import quantize_k
from ppharness.model.sources.files import synthetic_path
from ppharness.model.synthetic.spec import PRESETS, ModelSpec, file_bytes, parse_synthetic
from ppharness.model.synthetic.writer import make_synthetic

ROOT = Path(__file__).resolve().parent.parent
SMALL = ModelSpec(blocks=2, dim=64, ffn=96, heads=4, kv_heads=2, vocab=300, seed=3)
QUANTISED = ("q8_0", "q4_0")
# per-element error bound in units of the block's max |x|, and the bound on ||deq - x|| / ||x|| over a tensor:
# Q8_0 rounds to 1/127 of the block's max (half a step, plus the f16 rounding of the scale);
# Q4_0 to 1/8 of it (one step at worst: the +8 end of the range is clipped to +7)
BOUNDS = {"q8_0": (0.57 / 127, 0.01), "q4_0": (1.01 / 8, 0.12)}


def _tensors(path: Path) -> dict:
    import gguf

    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


@pytest.fixture(scope="module")
def small_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantised")
    return {t: make_synthetic(replace(SMALL, type=t), root / f"{t}.gguf") for t in ("f16", *QUANTISED)}


def _rows(t) -> np.ndarray:
    """A tensor's values as float32 rows (out, in), dequantised when quantised."""
    import gguf

    arr = np.asarray(t.data)
    if t.tensor_type not in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32):
        arr = gguf.quants.dequantize(arr, t.tensor_type)
    return np.asarray(arr, dtype=np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))


@pytest.mark.parametrize("wtype", QUANTISED)
def test_matrices_are_quantised_and_norms_stay_f32(small_files, wtype):
    import gguf

    reader = gguf.GGUFReader(str(small_files[wtype]))
    qtype = gguf.GGMLQuantizationType[wtype.upper()]
    file_type = reader.fields["general.file_type"].contents()
    assert file_type == gguf.LlamaFileType[f"MOSTLY_{wtype.upper()}"]
    f16 = _tensors(small_files["f16"])
    assert [t.name for t in reader.tensors] == list(f16), "same tensors, same order as the f16 file"
    for t in reader.tensors:
        if len(t.shape) == 2:
            assert t.tensor_type == qtype, t.name
            assert [int(d) for d in t.shape] == [int(d) for d in f16[t.name].shape], t.name
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
            assert np.array_equal(np.asarray(t.data), np.asarray(f16[t.name].data)), t.name


@pytest.mark.parametrize("wtype", QUANTISED)
def test_dequantised_weights_are_close_to_the_f16_model(small_files, wtype):
    per_element, relative = BOUNDS[wtype]
    f16 = _tensors(small_files["f16"])
    for name, t in _tensors(small_files[wtype]).items():
        if len(t.shape) != 2:
            continue
        got, want = _rows(t), _rows(f16[name])
        blocks_want = want.reshape(-1, 32)
        err = np.abs(got.reshape(-1, 32) - blocks_want)
        amax = np.abs(blocks_want).max(axis=1, keepdims=True)
        assert (err <= per_element * amax + 1e-7).all(), f"{name}: max error {float((err / amax).max()):.4f} x amax"
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert 0 < rel < relative, f"{name}: relative error {rel:.4f}"


@pytest.mark.parametrize("wtype", QUANTISED)
def test_slicing_reads_quantised_weights_as_the_f16_models_within_bounds(small_files, wtype):
    from ppharness.model.gguf_file import GGUFFile

    q, f = GGUFFile(small_files[wtype]), GGUFFile(small_files["f16"])
    assert q.config == f.config
    for name in ("token_embd.weight", "blk.1.attn_q.weight", "blk.0.ffn_down.weight", "output.weight"):
        got, want = q.tensor(name).astype(np.float32), f.tensor(name).astype(np.float32)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert float(np.linalg.norm(got - want) / np.linalg.norm(want)) < BOUNDS[wtype][1], name


def _round_half_away(v: np.ndarray) -> np.ndarray:
    return np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))


def q8_0_reference(rows: np.ndarray) -> bytes:
    """GGML's Q8_0, written out: blocks of 32, scale d = max|x| / 127 stored as f16, q = round(x / d) as int8
    (ggml multiplies by 1/d in f32 and rounds half away from zero)."""
    blocks = rows.astype(np.float32).reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    q = _round_half_away(blocks * inv).astype(np.int8)
    return b"".join(d[i].astype(np.float16).tobytes() + q[i].tobytes() for i in range(len(blocks)))


def q4_0_reference(rows: np.ndarray) -> bytes:
    """GGML's Q4_0: blocks of 32, d = (the element of largest |x|) / -8 as f16, q = min(15, trunc(x / d + 8.5)),
    element j in the low nibble of byte j and element j + 16 in its high nibble."""
    blocks = rows.astype(np.float32).reshape(-1, 32)
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
    d = extreme / np.float32(-8)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    q = np.clip(np.trunc(blocks * inv + np.float32(8.5)), 0, 15).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    return b"".join(d[i].astype(np.float16).tobytes() + packed[i].tobytes() for i in range(len(blocks)))


@pytest.mark.parametrize("wtype, reference", [("q8_0", q8_0_reference), ("q4_0", q4_0_reference)])
@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.attn_k.weight", "blk.1.ffn_down.weight"])
def test_blocks_equal_a_numpy_reference_of_the_format(small_files, wtype, reference, name):
    f16 = _tensors(small_files["f16"])[name]
    quant = _tensors(small_files[wtype])[name]
    want_rows = _rows(f16)
    raw = np.asarray(quant.data)
    for r in (0, 1, want_rows.shape[0] - 1):
        assert reference(want_rows[r]) == raw[r].tobytes(), f"{name} row {r}"


def test_q8_0_reference_on_hand_made_blocks():
    """The reference itself, on values whose Q8_0 encoding is known: a zero block, exact multiples of the scale."""
    x = np.zeros(64, dtype=np.float32)
    x[32:] = np.arange(-16, 16, dtype=np.float32) * 0.5  # max |x| = 8, d = 8/127, q = round(x * 127/8)
    out = q8_0_reference(x)
    assert len(out) == 2 * 34 and out[:34] == b"\0" * 34
    d = np.frombuffer(out[34:36], dtype=np.float16)[0]
    q = np.frombuffer(out[36:], dtype=np.int8)
    assert abs(float(d) - 8 / 127) < 1e-4
    assert q[0] == -127 and q[-1] == round(7.5 * 127 / 8)


# --- the other weight types: bf16, f32, q4_1 and the K-quants, in the file ------------------------------------------

NEW_TYPES = ("bf16", "f32", "q4_1", "q4_k", "q5_k", "q6_k")
FILE_TYPES = {
    "bf16": "MOSTLY_BF16",
    "f32": "ALL_F32",
    "q4_1": "MOSTLY_Q4_1",
    "q4_k": "MOSTLY_Q4_K_M",
    "q5_k": "MOSTLY_Q5_K_M",
    "q6_k": "MOSTLY_Q6_K",
}
# rows of 256 (the embedding, the head, attn_q/k/v, ffn_gate/up) and 512 (ffn_down) hold K-quant super-blocks; the
# attention output's rows of 4 x 36 = 144 are not a multiple of 32, so every quantised type stores it as F16; 2 blocks:
# llama.cpp's use_more_bits picks block 1, not block 0
K_SPEC = ModelSpec(blocks=2, dim=256, ffn=512, heads=4, kv_heads=2, head_dim=36, vocab=300, seed=3)
# ggml type -> (elements whose max |x| bounds an element's error, that error in units of the max, the bound on
# ||deq - x|| / ||x|| over a tensor). Q4_1: half a step of (max - min) / 15, plus the f16 rounding of scale and min.
# The K-quants cover each sub-block without clipping, so an element is within half its sub-block's step; with A the
# super-block's max |x|: Q4_K's step is at most (2A + dmin) / 15 rounded up to a multiple of d, dmin <= A / 63 and
# d <= the largest step / 63 (each rounded up to f16): half a step <= A (2 + 1/63) / 15 * (64/63) / 2 = 0.0683 A;
# Q5_K the same over 31 levels: 0.0331 A; Q6_K's step is at most A / 31 rounded up to a multiple of d <= A / (31 * 127):
# half of it <= A / 62 * 128/127 = 0.0163 A. BF16 rounds each element to 8 significant bits (half an ulp: 2^-8 of it).
TYPE_BOUNDS = {
    "F32": (1, 0.0, 0.0),
    "F16": (1, 0.0, 0.0),
    "BF16": (1, 2.0**-8, 0.004),
    "Q8_0": (32, *BOUNDS["q8_0"]),
    "Q4_1": (32, 1.05 / 15, 0.1),
    "Q4_K": (256, 0.0683, 0.1),
    "Q5_K": (256, 0.0331, 0.06),
    "Q6_K": (256, 0.0163, 0.03),
}


@pytest.fixture(scope="module")
def typed_files(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """(spec, weight type) -> file, for SMALL (rows of 64 and 96) and K_SPEC in f16 and every new type."""
    root = tmp_path_factory.mktemp("types")
    return {
        (label, t): make_synthetic(replace(spec, type=t), root / f"{label}-{t}.gguf")
        for label, spec in (("small", SMALL), ("k", K_SPEC))
        for t in ("f16", *NEW_TYPES)
    }


def _expected_type(wtype: str, label: str, name: str) -> str:
    """The type the synthetic writer's docstring promises for matrix ``name`` of SMALL or K_SPEC."""
    main = {"bf16": "BF16", "f32": "F32", "q4_1": "Q4_1", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}[wtype]
    if wtype in ("bf16", "f32"):
        return main
    if label == "small":  # rows of 64 and 96: multiples of 32 but not of 256
        return "Q4_1" if wtype == "q4_1" else "Q8_0"
    if name.endswith("attn_output.weight"):  # rows of 144
        return "F16"
    mixed = name in ("output.weight", "blk.1.attn_v.weight", "blk.1.ffn_down.weight")
    return "Q6_K" if wtype in ("q4_k", "q5_k") and mixed else main


@pytest.mark.parametrize("label", ["small", "k"])
@pytest.mark.parametrize("wtype", NEW_TYPES)
def test_each_matrix_is_in_its_type_the_k_quant_mix_or_the_fallback(typed_files, wtype, label):
    """The file states its llama.cpp file type; every matrix is in the weight type, except as documented: q4_k and
    q5_k store the head and block 1's attn_v and ffn_down as Q6_K (Q4_K_M, Q5_K_M), a K-quant row not a multiple of
    256 is Q8_0, a quantised row not a multiple of 32 is F16; norms stay F32, as in the f16 file; ``file_bytes`` is
    the tensors' bytes."""
    import gguf

    path = typed_files[(label, wtype)]
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType[FILE_TYPES[wtype]]
    f16 = _tensors(typed_files[(label, "f16")])
    assert [t.name for t in reader.tensors] == list(f16), "same tensors, same order as the f16 file"
    for t in reader.tensors:
        assert [int(d) for d in t.shape] == [int(d) for d in f16[t.name].shape], t.name
        if len(t.shape) == 2:
            assert t.tensor_type.name == _expected_type(wtype, label, t.name), t.name
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32, t.name
            assert np.array_equal(np.asarray(t.data), np.asarray(f16[t.name].data)), t.name
    spec = replace(SMALL if label == "small" else K_SPEC, type=wtype)
    assert file_bytes(spec) == sum(int(t.n_bytes) for t in reader.tensors)


@pytest.mark.parametrize("label", ["small", "k"])
@pytest.mark.parametrize("wtype", NEW_TYPES)
def test_new_types_dequantise_close_to_the_f16_model(typed_files, wtype, label):
    """Each matrix, read back through ``gguf``'s dequantiser, is the f16 model's within its type's bounds
    (TYPE_BOUNDS): per element, in units of its block's max |x|, and over the tensor."""
    f16 = _tensors(typed_files[(label, "f16")])
    for name, t in _tensors(typed_files[(label, wtype)]).items():
        if len(t.shape) != 2:
            continue
        block, per_element, relative = TYPE_BOUNDS[t.tensor_type.name]
        got, want = _rows(t), _rows(f16[name])
        blocks_want = want.reshape(-1, block)
        err = np.abs(got.reshape(-1, block) - blocks_want)
        amax = np.abs(blocks_want).max(axis=1, keepdims=True)
        assert (err <= per_element * amax + 1e-7).all(), f"{name}: max error {float((err / amax).max()):.4f} x amax"
        rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert rel <= relative, f"{name} ({t.tensor_type.name}): relative error {rel:.4f}"
        assert (rel > 0) == (relative > 0), f"{name} ({t.tensor_type.name}): relative error {rel:.4f}"


def _hard_rows() -> np.ndarray:
    """Rows of 1024 as the writer hands them over (float16 values): normal weights, and super-blocks that test the
    edges: all zero, all one negative value, all one positive value, one outlier among small values, all positive,
    and values too small for a normal float16 scale."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((12, 1024), dtype=np.float32) * 0.05
    x[0, :256] = 0
    x[1, :256] = -0.37
    x[2, :256] = 0.81
    x[3, 256:512] *= 0.01
    x[3, 300] = 20.0
    x[4, :256] = np.abs(x[4, :256]) + 0.5
    x[5, 512:768] *= 1e-4
    return x.astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("ggml_type", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quantisers_round_trip_through_ggufs_dequantiser(ggml_type):
    """``quantize_k`` writes ggml's blocks: ``gguf.quants.dequantize`` (the format's authority in Python) reads back
    every element within half its sub-block's step (TYPE_BOUNDS, per 256-element super-block); a zero super-block
    reads back as zeros; the bytes are deterministic and shaped as ``gguf.quants.quantize`` shapes its types; a row
    that is not a multiple of 256 is refused."""
    import gguf

    qtype = gguf.GGMLQuantizationType[ggml_type]
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    x = _hard_rows()
    raw = quantize_k(x, ggml_type)
    assert raw.dtype == np.uint8 and raw.shape == (12, 1024 // block_elements * block_bytes)
    assert np.array_equal(raw, quantize_k(x.astype(np.float16), ggml_type)), "deterministic, any float dtype"
    got = gguf.quants.dequantize(raw, qtype).reshape(x.shape)
    _, per_element, relative = TYPE_BOUNDS[ggml_type]
    err = np.abs(got - x).reshape(-1, 256)
    amax = np.abs(x).reshape(-1, 256).max(axis=1, keepdims=True)
    assert (err <= per_element * amax + 1e-9).all(), f"max error {float((err / amax).max()):.4f} x amax"
    assert not got[0, :256].any(), "a zero super-block reads back as zeros"
    assert float(np.linalg.norm(got - x) / np.linalg.norm(x)) < relative
    # 3-D (experts) as 2-D: the blocks run along the last axis
    assert np.array_equal(quantize_k(x.reshape(3, 4, 1024), ggml_type).reshape(raw.shape), raw)
    with pytest.raises(ValueError, match="blocks of 256"):
        quantize_k(x[:, :288], ggml_type)


def test_k_quant_types_are_specs_everywhere_and_keep_a_32_block_width():
    """``type=q4_k`` and the rest parse in a ``synthetic:`` source; a quantised spec still needs widths that divide by
    32 (the Q8_0 fallback's blocks), which the refusal says with the fix."""
    assert parse_synthetic("synthetic:tiny,type=Q4_K").type == "q4_k"
    assert parse_synthetic("synthetic:small,type=q6_k").type == "q6_k"
    assert ModelSpec(dim=48, heads=4, kv_heads=2, type="bf16").type == "bf16"
    with pytest.raises(ModelError, match="q5_k stores rows in blocks of 256, and a row of another length in Q8_0's"):
        ModelSpec(dim=48, heads=4, kv_heads=2, type="q5_k")
    with pytest.raises(ModelError, match=r"must be multiples of 32 \(or use type=f16, bf16 or f32\)"):
        ModelSpec(dim=48, heads=4, kv_heads=2, type="q4_1")


# --- the chain on the quantised tiny model -------------------------------------------------------------------------

PROMPT = "The quick brown fox"
_loaded: dict = {}


def _tiny(wtype: str):
    """(path, GGUFFile, slice cache, the whole model with boundary taps) of the quantised tiny model, loaded once."""
    from ppharness.model.gguf_file import GGUFFile
    from ppharness.run.inprocess import load_slices

    if wtype not in _loaded:
        path = synthetic_path(replace(PRESETS["tiny"], type=wtype))
        f = GGUFFile(path)
        _loaded[wtype] = (str(path), f, {}, load_slices(f, [(0, f.config.blocks)], cache={}, taps=True)[0])
    return _loaded[wtype]


# q4_0 with the slow tests: q8_0 here, and 4-bit blocks (q4_k, q4_1) in tests/test_packed.py
@pytest.mark.parametrize("wtype", [QUANTISED[0], pytest.param(QUANTISED[1], marks=pytest.mark.slow)])
@pytest.mark.parametrize("ranges", [[(0, 4), (4, 8)], [(0, 3), (3, 5), (5, 8)]], ids=["N2", "N3"])
def test_quantised_chain_equals_its_unsplit_model(wtype, ranges):
    """Tokens, and every hidden state a stage sends, byte for byte (ppharness.model.decode.exactness), over 32
    tokens."""
    from ppharness.model.decode.exactness import compare
    from ppharness.model.decode.oracle import oracle_decode
    from ppharness.run.inprocess import load_slices, run_inprocess

    path, f, cache, whole = _tiny(wtype)
    slices = load_slices(f, ranges, cache=cache)
    digests: dict[int, list[bytes]] = {}
    chain = run_inprocess(f, slices, PROMPT, 32, digests=digests)
    oracle = oracle_decode(path, PROMPT, 32, model=whole, boundaries=True)
    assert len(oracle.token_ids) == 32 or oracle.finish_reason == "eos"
    verdict = compare(chain.token_ids, oracle.token_ids, ranges, digests, oracle.boundary_digests, oracle.prompt_tokens)
    assert verdict.exact, f"split {ranges} of the {wtype} model: {verdict.describe(chain.token_ids, oracle.token_ids)}"
    assert verdict.boundaries_compared == (len(ranges) - 1) * len(oracle.token_ids)
    assert chain.text == oracle.text


def test_quantised_model_is_not_the_f16_model():
    """Quantisation changes the numbers: the Q4_0 tiny model's answer differs from the f16 one's somewhere in 32
    tokens (so the chain tests above exercise the quantised weights, not a copy of the f16 ones)."""
    from ppharness.model.decode.oracle import oracle_decode

    path_f16 = synthetic_path(PRESETS["tiny"])
    path, _, _, whole = _tiny("q4_0")
    assert oracle_decode(path, PROMPT, 32, model=whole).token_ids != oracle_decode(path_f16, PROMPT, 32).token_ids


@pytest.mark.local
@pytest.mark.slow  # a chain of real processes; the splits above check the same in one process
def test_q8_0_chain_on_pp_node_processes_over_zmq(tmp_path):
    import msgspec

    from backends.local import labelled_pids
    from ppharness.scenario.schema import load_scenario, scenario_from_args

    path = synthetic_path(replace(PRESETS["tiny"], type="q8_0"))
    sc = scenario_from_args(num_stages=3, max_tokens=32, transport="zmq", prompt=PROMPT)
    sc = msgspec.structs.replace(sc, model=msgspec.structs.replace(sc.model, synthetic=None, gguf=str(path)))
    file = tmp_path / "q8_0.yaml"
    file.write_bytes(msgspec.yaml.encode(sc))
    assert load_scenario(file).model.gguf == str(path)
    label = f"pp-test-{uuid.uuid4().hex[:8]}"
    r = subprocess.run(
        [sys.executable, "-m", "ppharness.cli.smoke", "--scenario", str(file), "--run-label", label, "--no-trace"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "MATCH: the 3-stage chain's 32 tokens equal the unsplit model's, token for token" in out, out
    assert not labelled_pids(label), "pp-node processes outlived the run"
