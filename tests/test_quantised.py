"""Quantised synthetic models (Q8_0, Q4_0): the file really holds those formats, each block is what the format says,
the weights stay close to the f16 model of the same seed, and splits of the quantised model equal its unsplit model
bit for bit: tokens and every stage-boundary hidden state (in one process, and on real pp-node processes over ZeroMQ
with marker ``local``)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ppharness.model.files import synthetic_path
from ppharness.model.spec import PRESETS, ModelSpec
from ppharness.model.synthetic import make_synthetic

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


@pytest.mark.parametrize("wtype", QUANTISED)
@pytest.mark.parametrize("ranges", [[(0, 4), (4, 8)], [(0, 3), (3, 5), (5, 8)]], ids=["N2", "N3"])
def test_quantised_chain_equals_its_unsplit_model(wtype, ranges):
    """Tokens, and every hidden state a stage sends, byte for byte (ppharness.model.exactness), over 32 tokens."""
    from ppharness.model.exactness import compare
    from ppharness.model.oracle import oracle_decode
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
    from ppharness.model.oracle import oracle_decode

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
