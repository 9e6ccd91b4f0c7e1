"""Mixture-of-experts blocks: the architectures' arithmetic against a numpy reference, the router, split exactness
with the experts on other banks, the GGUF metadata as real tools read it, and the errors of a missing expert.

The reference is written from the architectures' definitions (llama.cpp's ``build_moe_ffn``, HF transformers'
Qwen3Moe and Qwen2Moe sparse MoE blocks), in float32, from the weights stored in the file: RMSNorm with
``ffn_norm.weight`` and the file's eps; router logits; softmax over every expert; the top k; qwen3moe renormalises the
k weights to sum 1, qwen2moe does not; each expert ``down(silu(gate x) * up x)``; qwen2moe adds
``sigmoid(w_shexp_gate . x) * shared(x)``; the output is ``h + sum``.

One model is loaded per module and reused by every test (loading and compiling dominate on two CPU cores).
"""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ppharness.errors import ModelError
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.engine.expert_bank import ExpertBank
from ppharness.model.engine.hidden import digest
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.layers.moe import ExpertCall, combine, combine_rows, route, route_on_device, routing_entropy
from ppharness.model.sources.files import synthetic_path
from ppharness.model.synthetic.spec import parse_synthetic, preset_spec

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from numpy.typing import NDArray

MAX_CONTEXT = 256
BLOCKS, EXPERTS, K = 4, 8, 2  # the tiny-moe presets
# one prompt for every generation here (a new prompt length compiles new prefill kernels): long enough for the routing
# counts to mean something, with non-ASCII text
PROMPT = (
    "Pipeline parallel inference splits a model's transformer blocks into contiguous ranges, one range per stage; "
    "a mixture of experts model also sends each token's rows to the nodes that hold its experts. Héllo wörld, "
    "naïve café: the answer must not change, token for token, whichever node computes an expert."
)
TOKENS = 12
# |ppharness - reference| <= ATOL + RTOL * |reference|, element-wise. ppharness keeps the weights in fp16 (the router
# and the norm before it in fp32), rounds the normed input of the experts to fp16, computes each expert in fp16 and
# rounds the block's output to fp16: half an fp16 ulp is already 2e-3 at |x| in [4, 8), and the errors seen are below
# 2.5e-3. The mistakes the test must catch (weights not renormalised, the shared expert left out) move outputs by 0.5
# and more.
ATOL, RTOL = 1e-2, 1e-2


# --- the models, loaded once --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_file() -> GGUFFile:
    return GGUFFile(synthetic_path(preset_spec("tiny-moe")))


@pytest.fixture(scope="module")
def shared_file() -> GGUFFile:
    return GGUFFile(synthetic_path(preset_spec("tiny-moe-shared")))


_whole: dict[str, ModelSlice] = {}


def whole_model(f: GGUFFile) -> ModelSlice:
    """The unsplit model (every expert in its own bank), with boundary taps; one per file per module."""
    key = str(f.path)
    if key not in _whole:
        _whole[key] = ModelSlice(f, 0, f.config.blocks, True, True, MAX_CONTEXT, taps=True)
    return _whole[key]


# --- the reference ----------------------------------------------------------------------------------------------------


def stored(f: GGUFFile, name: str) -> NDArray[np.float32]:
    """A weight as the file stores it, in float32: an F32 tensor (the norms, the router) exactly as stored, any other
    (fp16, or dequantised) as GGUFFile reads it, in numpy's (out, in) layout."""
    import gguf

    t = next(t for t in f._reader.tensors if t.name == name)
    if t.tensor_type == gguf.GGMLQuantizationType.F32:
        return np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
    return f.tensor(name).astype(np.float32)


def silu(x: NDArray[np.float32]) -> NDArray[np.float32]:
    return x / (np.float32(1) + np.exp(-x))


def sigmoid(x: NDArray[np.float32]) -> NDArray[np.float32]:
    return np.float32(1) / (np.float32(1) + np.exp(-x))


def reference_moe(
    f: GGUFFile, layer: int, h: NDArray[np.float32], renormalise: bool | None = None, shared: bool = True
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """Block ``layer``'s feed-forward part on the residual ``h`` (T, D) after attention: (the chosen experts (T, k),
    best first; the block's output (T, D)). ``renormalise`` defaults to the architecture's rule."""
    arch = f.kv["general.architecture"]  # the file's own metadata, not ppharness's reading of it
    eps, k = np.float32(f.kv[f"{arch}.attention.layer_norm_rms_epsilon"]), int(f.kv[f"{arch}.expert_used_count"])
    w = block_weights(f, layer)
    x = h / np.sqrt((h * h).mean(-1, keepdims=True) + eps) * w("ffn_norm.weight")
    logits = x @ w("ffn_gate_inp.weight").T  # (T, E)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(p, ids, axis=-1)
    if (arch == "qwen3moe") if renormalise is None else renormalise:
        weights = weights / weights.sum(-1, keepdims=True)
    # (E, F, D), (E, F, D), (E, D, F)
    gate, up, down = (w(f"ffn_{kind}_exps.weight") for kind in ("gate", "up", "down"))
    out = h.astype(np.float32).copy()
    for t in range(h.shape[0]):
        for j, e in enumerate(ids[t]):
            out[t] += weights[t, j] * (down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])))
    if arch == "qwen2moe" and shared:
        g = sigmoid(x @ w("ffn_gate_inp_shexp.weight"))  # (T,)
        y = (silu(x @ w("ffn_gate_shexp.weight").T) * (x @ w("ffn_up_shexp.weight").T)) @ w("ffn_down_shexp.weight").T
        out += g[:, None] * y
    return ids.astype(np.int64), out


_weights: dict[tuple[str, str], NDArray[np.float32]] = {}


def block_weights(f: GGUFFile, layer: int) -> Callable[[str], NDArray[np.float32]]:
    """name -> block ``layer``'s weight of that name, as ``stored`` reads it (once per module)."""

    def w(name: str) -> NDArray[np.float32]:
        full = f"blk.{layer}.{name}"
        key = (str(f.path), full)
        if key not in _weights:
            _weights[key] = stored(f, full)
        return _weights[key]

    return w


def ppharness_moe(
    model: ModelSlice, layer: int, h: NDArray[np.float16], renormalise: bool | None = None, shared: bool = True
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """ppharness's path: the block's ``moe_inputs`` and ``route_on_device`` (tinygrad) -> the bank's ``answer`` ->
    ``combine_rows`` (the device's combine)."""
    from tinygrad.tensor import Tensor

    cfg = model.config
    t = h.shape[0]
    residual, normed, logits, *gated = model.blk[layer].moe_inputs(Tensor(h[None]))
    ids, weights = route_on_device(
        logits.reshape(t, cfg.experts), cfg.experts_used, cfg.norm_topk if renormalise is None else renormalise
    )
    chosen = ids.numpy().astype(np.int64)
    outputs = model.bank.answer(layer, normed.numpy().reshape(t, cfg.dim), chosen)
    extra = gated[0].numpy().reshape(t, cfg.dim) if gated and shared else None
    out = combine_rows(residual.numpy().reshape(t, cfg.dim), outputs, weights.numpy(), extra)
    return chosen, out.astype(np.float32)


def excess(ours: NDArray[np.float32], reference: NDArray[np.float32]) -> float:
    """How far ``ours`` is outside the tolerance: max |ours - ref| / (ATOL + RTOL |ref|); <= 1 agrees."""
    return float((np.abs(ours - reference) / (ATOL + RTOL * np.abs(reference))).max())


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-moe-shared"])
def test_moe_block_equals_the_reference(preset, moe_file, shared_file):
    """The same experts, and the same output within the fp16 tolerance, on random residuals of every MoE block."""
    f = moe_file if preset == "tiny-moe" else shared_file
    model = whole_model(f)
    cfg = f.config
    assert cfg.arch == {"tiny-moe": "qwen3moe", "tiny-moe-shared": "qwen2moe"}[preset]
    assert cfg.norm_topk == (cfg.arch == "qwen3moe") and bool(cfg.shared_ffn) == (cfg.arch == "qwen2moe")
    rng = np.random.default_rng(7)
    for layer in range(cfg.blocks):
        h = rng.standard_normal((6, cfg.dim)).astype(np.float16)
        ref_ids, ref_out = reference_moe(f, layer, h.astype(np.float32))
        ids, out = ppharness_moe(model, layer, h)
        assert np.array_equal(ids, ref_ids), (
            f"block {layer}: experts {ids.tolist()}, the reference's {ref_ids.tolist()}"
        )
        assert excess(out, ref_out) <= 1, (
            f"block {layer}: max |ppharness - reference| {np.abs(out - ref_out).max():.4g} is outside "
            f"{ATOL} + {RTOL} |reference|"
        )
        # the test can fail: each architecture's own mistake is far outside the tolerance
        if cfg.arch == "qwen3moe":  # top-k probabilities used as they are, as tinygrad 0.12's apps/llm.py does
            _, wrong = ppharness_moe(model, layer, h, renormalise=False)
            assert excess(wrong, ref_out) > 10, f"block {layer}: not renormalising went unnoticed"
            _, wrong_ref = reference_moe(f, layer, h.astype(np.float32), renormalise=False)
            assert excess(wrong, wrong_ref) <= 1  # ... and it is exactly the un-renormalised arithmetic
        else:  # the shared expert left out
            _, wrong = ppharness_moe(model, layer, h, shared=False)
            assert excess(wrong, ref_out) > 10, f"block {layer}: leaving the shared expert out went unnoticed"
            _, wrong_ref = reference_moe(f, layer, h.astype(np.float32), shared=False)
            assert excess(wrong, wrong_ref) <= 1
            # renormalising, which qwen2moe does not do, is caught too
            _, renormalised = ppharness_moe(model, layer, h, renormalise=True)
            assert excess(renormalised, ref_out) > 10


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-moe-shared"])
def test_a_stages_step_equals_the_reference(preset, moe_file, shared_file):
    """The wiring of ``ModelSlice.step`` itself (``pre``, the ExpertCall, the answer, the combine): a one-block stage
    in the middle of the model, on a random hidden state, gives the reference's experts and output."""
    from tinygrad.tensor import Tensor

    f = moe_file if preset == "tiny-moe" else shared_file
    cfg, layer = f.config, 2
    stage = ModelSlice(f, layer, layer + 1, False, False, MAX_CONTEXT)
    x = np.random.default_rng(11).standard_normal((1, 6, cfg.dim)).astype(np.float16)
    h = stage.blk[0]._attention(Tensor(x), 0).float().numpy()[0]  # the residual after attention, as step computes it
    ref_ids, ref_out = reference_moe(f, layer, h)
    gen = stage.step(x, 0)
    call = next(gen)
    assert call.layer == layer and call.hidden.shape == (6, cfg.dim) and call.hidden.dtype == np.float16
    assert np.array_equal(call.routing.ids, ref_ids)
    with pytest.raises(StopIteration) as stop:
        gen.send(stage.answer(call))
    out = stop.value.value
    assert out.shape == (1, 6, cfg.dim) and out.dtype == np.float16
    assert excess(out[0].astype(np.float32), ref_out) <= 1, np.abs(out[0] - ref_out).max()


def test_tinygrads_own_moe_block_is_not_qwen3moe(moe_file):
    """tinygrad 0.12's TransformerBlock (apps/llm.py) weights the top-k experts by their softmax probabilities without
    renormalising them: on qwen3moe it is outside the tolerance, which is why ppharness routes on the host."""
    from tinygrad.apps.llm import TransformerBlock
    from tinygrad.tensor import Tensor

    f, cfg, layer = moe_file, moe_file.config, 1
    block = TransformerBlock(
        cfg.dim, cfg.expert_ffn, cfg.heads, cfg.kv_heads, cfg.norm_eps, cfg.head_dim, cfg.rope_theta, 8,
        qk_norm=cfg.qk_norm, num_experts=cfg.experts, num_experts_per_tok=cfg.experts_used,
    )  # fmt: skip
    w = block_weights(f, layer)
    block.ffn_norm.weight = Tensor(w("ffn_norm.weight"))
    block.ffn_gate_inp.weight = Tensor(w("ffn_gate_inp.weight"))
    for kind in ("gate", "up", "down"):
        getattr(block, f"ffn_{kind}_exps").weight = Tensor(w(f"ffn_{kind}_exps.weight"))
    h = np.random.default_rng(3).standard_normal((6, cfg.dim)).astype(np.float32)
    theirs = block._feed_forward(Tensor(h[None])).numpy()[0]
    _, ref_out = reference_moe(f, layer, h)
    _, unnormalised = reference_moe(f, layer, h, renormalise=False)
    assert excess(theirs, unnormalised) <= 1
    assert excess(theirs, ref_out) > 10


# --- the router ---------------------------------------------------------------------------------------------------


def test_route_renormalised_weights_sum_to_one():
    logits = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32) * 3
    r = route(logits, 3, renormalise=True)
    np.testing.assert_allclose(r.weights.sum(-1), 1.0, rtol=1e-6)
    assert r.ids.shape == r.weights.shape == (16, 3) and r.weights.dtype == np.float32
    assert (np.diff(r.weights, axis=-1) <= 0).all(), "best first"
    plain = route(logits, 3, renormalise=False)
    assert np.array_equal(plain.ids, r.ids)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(plain.weights, np.take_along_axis(probs, r.ids, -1), rtol=1e-6)
    assert (plain.weights.sum(-1) < 1).all()
    np.testing.assert_allclose(r.weights, plain.weights / plain.weights.sum(-1, keepdims=True), rtol=1e-6)


def test_route_ties_go_to_the_lower_index():
    logits = np.array([[0, 0, 0, 0], [1, 5, 5, 5], [2, 7, 2, 7], [-1, -1, 3, -1]], dtype=np.float32)
    r = route(logits, 2, renormalise=True)
    assert r.ids.tolist() == [[0, 1], [1, 2], [1, 3], [2, 0]]
    np.testing.assert_allclose(r.weights[:3], 0.5)


@pytest.mark.parametrize("renormalise", [True, False])
def test_route_k_equal_to_the_expert_count(renormalise):
    logits = np.array([[0.5, -2.0, 3.0, 0.5, 1.0], [0, 0, 0, 0, 0]], dtype=np.float32)
    r = route(logits, 5, renormalise)
    assert r.ids.tolist() == [[2, 4, 0, 3, 1], [0, 1, 2, 3, 4]]
    np.testing.assert_allclose(r.weights.sum(-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(r.weights[1], 0.2, rtol=1e-6)


def test_combine_is_the_residual_plus_the_weighted_sum():
    rng = np.random.default_rng(1)
    h = rng.standard_normal((3, 4)).astype(np.float32)
    outs = rng.standard_normal((3, 2, 4)).astype(np.float16)
    w = np.array([[0.75, 0.25], [0.5, 0.5], [1.0, 0.0]], dtype=np.float32)
    shared = rng.standard_normal((3, 4)).astype(np.float32)
    got = combine(h, outs, w, shared)
    assert got.dtype == np.float16
    expect = h + (w[..., None] * outs.astype(np.float32)).sum(1) + shared
    np.testing.assert_allclose(got.astype(np.float32), expect, atol=4e-3)


# --- split exactness, any placement of the experts -----------------------------------------------------------------

_split_slices: dict[int, tuple[ModelSlice, ModelSlice]] = {}
_oracle: list[Any] = []


def split_slices(f: GGUFFile, cut: int) -> tuple[ModelSlice, ModelSlice]:
    """Stages [0, cut) and [cut, 4) holding none of their experts, with taps; cached per cut."""
    if cut not in _split_slices:
        _split_slices[cut] = (
            ModelSlice(f, 0, cut, True, False, MAX_CONTEXT, taps=True, experts={}),
            ModelSlice(f, cut, BLOCKS, False, True, MAX_CONTEXT, taps=True, experts={}),
        )
    return _split_slices[cut]


def oracle(f: GGUFFile) -> Any:
    """The unsplit model's answer to PROMPT, with the digest of every block's output at every step."""
    if not _oracle:
        _oracle.append(oracle_decode(f.path, PROMPT, TOKENS, MAX_CONTEXT, model=whole_model(f), boundaries=True))
    return _oracle[0]


def drive(
    f: GGUFFile,
    stages: Sequence[ModelSlice],
    answer: Callable[[ExpertCall], NDArray[np.float16]],
    prompt: str,
    max_tokens: int,
) -> tuple[list[int], dict[int, list[bytes]]]:
    """Greedy decode through ``stages`` by their ``step`` generators, every ExpertCall answered by ``answer``: (the
    generated tokens without a closing end-of-generation token, block -> digest of its output at each step)."""
    cfg = f.config
    ids = ([cfg.bos_id] if cfg.bos_id is not None else []) + f.tokenizer.encode(prompt)
    tokens: list[int] = []
    digests: dict[int, list[bytes]] = collections.defaultdict(list)
    while not tokens or (tokens[-1] not in cfg.eog_ids and len(tokens) < max_tokens):
        position = 0 if not tokens else len(ids) + len(tokens) - 1
        x: Any = ids if not tokens else [tokens[-1]]
        for stage in stages:
            gen = stage.step(x, position)
            try:
                call = next(gen)
                while True:
                    call = gen.send(answer(call))
            except StopIteration as stop:
                x = stop.value
            for block, hidden in stage.tapped().items():
                digests[block].append(digest(hidden))
        assert isinstance(x, int)
        tokens.append(x)
    return (tokens[:-1] if tokens[-1] in cfg.eog_ids else tokens), dict(digests)


PAIRS = [(layer, e) for layer in range(BLOCKS) for e in range(EXPERTS)]


@st.composite
def placements(draw: Any) -> tuple[int, list[list[int]], int]:
    """(number of banks, for each (layer, expert) of PAIRS the banks holding it (a partition with random replicas),
    the seed that picks which holder answers each row)."""
    n = draw(st.integers(2, 4))
    holders = []
    for _ in PAIRS:
        owner = draw(st.integers(0, n - 1))
        replicas = draw(st.sets(st.integers(0, n - 1), max_size=n - 1))
        holders.append(sorted({owner, *replicas}))
    return n, holders, draw(st.integers(0, 2**32 - 1))


ROUND_ROBIN = (3, [[i % 3] for i in range(len(PAIRS))], 0)  # every expert on exactly one of 3 banks
EVERYWHERE = (2, [[0, 1] for _ in PAIRS], 5)  # every expert on both banks, each row's holder picked at random


@pytest.mark.slow  # 35 s; deepseek2's twin (tests/test_deepseek2.py) runs by default
@settings(max_examples=3)
@given(cut=st.integers(1, BLOCKS - 1), placement=placements())
@example(cut=2, placement=ROUND_ROBIN)
@example(cut=1, placement=EVERYWHERE)
def test_split_with_experts_on_other_banks_equals_the_unsplit_model(moe_file, cut, placement):
    """Tokens and every block's output at every step, byte for byte: the unsplit model (its own experts) against a
    2-stage split holding no experts, whose calls are split row by row over banks holding a random partition of the
    (layer, expert) pairs with random replicas."""
    f = moe_file
    n, holders, seed = placement
    held: list[dict[int, list[int]]] = [{} for _ in range(n)]
    for (layer, e), owners in zip(PAIRS, holders):
        for b in owners:
            held[b].setdefault(layer, []).append(e)
    banks = [ExpertBank(f, h) for h in held]
    holder_of = {pair: hs for pair, hs in zip(PAIRS, holders)}
    pick = np.random.default_rng(seed)
    calls = spread = 0

    def answer(call: ExpertCall) -> NDArray[np.float16]:
        nonlocal calls, spread
        t, k = call.routing.ids.shape
        out = np.full((t, k, f.config.dim), np.nan, dtype=np.float16)
        rows: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
        for i in range(t):
            for j in range(k):
                hs = holder_of[(call.layer, int(call.routing.ids[i, j]))]
                rows[hs[int(pick.integers(len(hs)))]].append((i, j))
        for b, cells in rows.items():
            ti, tj = np.array(cells).T
            got = banks[b].answer(call.layer, call.hidden[ti], call.routing.ids[ti, tj][:, None])
            out[ti, tj] = got[:, 0]
        calls, spread = calls + 1, spread + (len(rows) > 1)
        assert not np.isnan(out).any()
        return out

    stages = split_slices(f, cut)
    assert all(s.bank.n == 0 for s in stages)
    tokens, digests = drive(f, stages, answer, PROMPT, TOKENS)
    expected = oracle(f)
    assert tokens == expected.token_ids
    assert sorted(digests) == list(range(BLOCKS))
    for block in range(BLOCKS):
        differ = [s for s, (a, b) in enumerate(zip(digests[block], expected.boundary_digests[block])) if a != b]
        assert len(digests[block]) == len(expected.boundary_digests[block])
        assert not differ, (
            f"cut {cut}, {n} banks: block {block}'s output differs from the unsplit model's at step {differ[0]}"
        )
    assert calls == BLOCKS * len(expected.boundary_digests[0])
    if placement in (ROUND_ROBIN, EVERYWHERE):
        assert spread, "no call was split across banks"


# --- the file as real tools read it -----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-moe-shared"])
def test_gguf_metadata_as_gguf_reader_reads_it(preset):
    import gguf

    spec = preset_spec(preset)
    reader = gguf.GGUFReader(str(synthetic_path(spec)))
    arch = reader.fields["general.architecture"].contents()
    assert arch == {"tiny-moe": "qwen3moe", "tiny-moe-shared": "qwen2moe"}[preset]

    def kv(key: str) -> Any:
        return reader.fields[f"{arch}.{key}"].contents()

    assert (kv("expert_count"), kv("expert_used_count"), kv("expert_feed_forward_length")) == (8, 2, 96)
    assert kv("block_count") == BLOCKS and kv("embedding_length") == spec.dim
    if arch == "qwen2moe":
        assert kv("expert_shared_feed_forward_length") == 128
    else:
        assert f"{arch}.expert_shared_feed_forward_length" not in reader.fields
    tensors = {t.name: t for t in reader.tensors}
    d, ffn, e = spec.dim, spec.expert_ffn, spec.experts
    for i in range(BLOCKS):
        # ne, GGUF's dimension order: the fastest-varying first
        assert tensors[f"blk.{i}.ffn_gate_exps.weight"].shape.tolist() == [d, ffn, e]
        assert tensors[f"blk.{i}.ffn_up_exps.weight"].shape.tolist() == [d, ffn, e]
        assert tensors[f"blk.{i}.ffn_down_exps.weight"].shape.tolist() == [ffn, d, e]
        assert tensors[f"blk.{i}.ffn_gate_inp.weight"].shape.tolist() == [d, e]
        assert tensors[f"blk.{i}.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        assert f"blk.{i}.ffn_gate.weight" not in tensors
        if arch == "qwen3moe":
            assert tensors[f"blk.{i}.attn_q_norm.weight"].shape.tolist() == [spec.hd]
            assert f"blk.{i}.attn_q.bias" not in tensors
        else:
            assert tensors[f"blk.{i}.attn_q.bias"].shape.tolist() == [spec.heads * spec.hd]
            assert tensors[f"blk.{i}.ffn_gate_inp_shexp.weight"].shape.tolist() == [d]
            assert tensors[f"blk.{i}.ffn_gate_shexp.weight"].shape.tolist() == [d, 128]
            assert tensors[f"blk.{i}.ffn_down_shexp.weight"].shape.tolist() == [128, d]


@pytest.mark.slow  # builds and compiles a second model
def test_q8_0_moe_model_loads_and_decodes(moe_file):
    import gguf

    spec = parse_synthetic("synthetic:tiny-moe,type=q8_0")
    assert (spec.arch, spec.type, spec.experts) == ("qwen3moe", "q8_0", 8)
    q = GGUFFile(synthetic_path(spec))
    assert q.config == moe_file.config
    t = next(t for t in q._reader.tensors if t.name == "blk.2.ffn_down_exps.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0 and t.shape.tolist() == [96, 64, 8]
    # a bank's rows of a quantised stacked tensor are those experts of the whole tensor, close to the f16 model's
    whole = q.tensor("blk.2.ffn_down_exps.weight")
    np.testing.assert_array_equal(q.tensor("blk.2.ffn_down_exps.weight", rows=[5, 1]), whole[[5, 1]])
    f16 = moe_file.tensor("blk.2.ffn_down_exps.weight").astype(np.float32)
    assert np.abs(whole.astype(np.float32) - f16).max() <= np.abs(f16).max() / 127
    got = oracle_decode(q.path, PROMPT, 4, MAX_CONTEXT)
    assert len(got.token_ids) == 4 or got.finish_reason == "eos"
    assert all(0 <= t < spec.vocab for t in got.token_ids)


# --- missing experts -----------------------------------------------------------------------------------------------


def test_a_bank_refuses_experts_it_does_not_hold(moe_file):
    bank = ExpertBank(moe_file, {1: [0, 3], 2: [7]})
    assert bank.held() == {1: [0, 3], 2: [7]} and bank.n == 3
    assert bank.holds(1, 3) and not bank.holds(1, 1) and not bank.holds(2, 0)
    row = np.zeros(moe_file.config.dim, dtype=np.float16)
    assert bank.run(1, 3, row).shape == (moe_file.config.dim,)
    with pytest.raises(ModelError, match=r"expert 5 of block 1 is not held here"):
        bank.run(1, 5, row)
    with pytest.raises(ModelError, match=r"expert 0 of block 3 is not held here"):
        bank.answer(3, np.zeros((1, moe_file.config.dim), dtype=np.float16), np.array([[0]]))
    with pytest.raises(ModelError, match=r"block 2 has experts 0\.\.7"):
        ExpertBank(moe_file, {2: [8]})


def test_a_slice_without_its_experts_fails_decode_clearly(moe_file):
    stage, _ = split_slices(moe_file, 2)
    with pytest.raises(ModelError, match=r"block 0 routed a token to expert\(s\) \[\d.*which this slice does not hold"):
        stage.decode([moe_file.config.bos_id], 1)
    partial = ModelSlice(moe_file, 3, 4, False, True, MAX_CONTEXT, experts={3: [0]})
    with pytest.raises(ModelError, match=r"block 3 routed a token to expert\(s\) \[[1-7]"):
        partial.prefill(np.random.default_rng(0).standard_normal((1, 3, moe_file.config.dim)).astype(np.float16))


# --- routing skew ----------------------------------------------------------------------------------------------------


def test_routing_is_skewed(moe_file):
    """Some experts are chosen clearly more often than others over a generation, as in trained models: the planner
    places hot experts by frequency."""
    model = whole_model(moe_file)
    counts = np.zeros((BLOCKS, EXPERTS), dtype=np.int64)

    def answer(call: ExpertCall) -> NDArray[np.float16]:
        np.add.at(counts[call.layer], call.routing.ids.reshape(-1), 1)
        return model.answer(call)

    drive(moe_file, [model], answer, PROMPT, TOKENS)
    total = counts.sum(-1)
    assert (total == total[0]).all() and total[0] >= 100 * K
    # chi-square against a uniform router (7 degrees of freedom a layer): the model as a whole rejects it far beyond
    # the 0.1 % level (28 degrees of freedom: 56.89), and so do at least half its layers on their own (24.32); the
    # synthetic router's log-normal row scales leave some layers nearly even, as trained models have some
    expected = total[0] / EXPERTS
    chi2 = ((counts - expected) ** 2 / expected).sum(-1)
    seen = f"expert choice counts per layer: {counts.tolist()} (chi-square {chi2.round(1).tolist()})"
    assert chi2.sum() > 56.89, seen
    assert (chi2 > 24.32).sum() >= BLOCKS / 2, seen
    # clearly: in at least half the layers the hottest expert is chosen four times as often as the coldest (a uniform
    # router over this many choices stays below 2), and the choices' entropy is below a uniform router's 3 bits
    assert (counts.max(-1) >= 4 * counts.min(-1)).sum() >= BLOCKS / 2, seen
    entropies = [routing_entropy([float(c) for c in row]) for row in counts]
    assert sum(entropies) / BLOCKS < math.log2(EXPERTS) - 0.1, f"entropies {entropies}; {seen}"


@pytest.mark.parametrize(
    "preset", ["tiny-moe", pytest.param("tiny-moe-shared", marks=pytest.mark.slow), "tiny-deepseek"]
)
def test_one_device_step_equals_the_step_in_pieces(preset):
    """A slice holding all its experts decodes each MoE block in one device step (routing, the chosen experts read
    by id, the combine): every block's output at every step equals, byte for byte, the generator step that hands
    the device's routing to an expert bank and combines what comes back — the way a stage with expert nodes runs."""
    from ppharness.model.gguf_file import GGUFFile
    from ppharness.model.sources.files import synthetic_path
    from ppharness.model.synthetic.spec import parse_synthetic

    f = GGUFFile(synthetic_path(parse_synthetic(f"synthetic:{preset}")))
    blocks = f.config.blocks
    fused = ModelSlice(f, 0, blocks, True, True, max_context=64, taps=True)
    pieces = ModelSlice(f, 0, blocks, True, True, max_context=64, taps=True, fused=False)
    assert fused.fused and not pieces.fused
    prompt = [1, 7, 3, 9]
    a, b = fused.prefill(prompt), pieces.prefill(prompt)
    for pos in range(len(prompt), len(prompt) + 16):
        assert a == b, f"{preset}: the tokens differ before position {pos}"
        a, b = fused.decode([a], pos), pieces.decode([b], pos)
        ta, tb = fused.tapped(), pieces.tapped()
        assert sorted(ta) == sorted(tb) == list(range(blocks))
        for block in range(blocks):
            assert np.array_equal(np.asarray(ta[block]).view(np.uint16), np.asarray(tb[block]).view(np.uint16)), (
                f"{preset}: block {block}'s output at position {pos} differs between one device step and pieces"
            )
