"""The deepseek2 architecture (DeepSeek V3, Kimi K2): each piece against a numpy reference written from the
architecture's definition (HF transformers' DeepSeek-V3 modelling and llama.cpp's ``build_deepseek2``), not from
ppharness's code — YaRN's frequencies, the pairwise rotary embedding, MLA attention over the compressed cache,
sigmoid routing with its selection bias, grouped top-k and routed scale, the ungated shared expert, the leading dense
block — and the whole model split against the unsplit one, byte for byte.

Two presets: ``tiny-deepseek`` (no query bottleneck, 16 experts in 4 groups of which 2 are used, no rope scaling)
and ``kimi-tiny`` cut to 3 blocks (Kimi K2's query bottleneck, 384 experts, 8 used, YaRN).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from ppharness.errors import ModelError
from ppharness.model.arch.deepseek2 import attention_scale, rope_angles
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.engine.expert_bank import ExpertBank
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.layers.moe import ExpertCall, combine, route
from ppharness.model.sources.files import resolve_model, synthetic_path
from ppharness.model.synthetic.spec import PRESETS, parse_synthetic
from tests.test_moe import drive

if TYPE_CHECKING:
    from numpy.typing import NDArray

MAX_CONTEXT = 128
PROMPT = "Kimi K2 routes every token to eight of its 384 experts, and one shared expert. Héllo wörld."
TOKENS = 10
# |ppharness - reference| <= ATOL + RTOL |reference|: ppharness keeps weights and block boundaries in fp16 (see
# tests/test_moe.py); the mistakes these tests must catch move outputs by far more
ATOL, RTOL = 1e-2, 1e-2
F32 = np.float32


@pytest.fixture(scope="module")
def ds_file() -> GGUFFile:
    return GGUFFile(synthetic_path(PRESETS["tiny-deepseek"]))


@pytest.fixture(scope="module")
def kimi_file() -> GGUFFile:
    return GGUFFile(synthetic_path(parse_synthetic("synthetic:kimi-tiny,blocks=3")))


def excess(ours: NDArray[Any], reference: NDArray[Any]) -> float:
    """How far ``ours`` is outside the tolerance: <= 1 agrees."""
    return float((np.abs(ours.astype(F32) - reference) / (ATOL + RTOL * np.abs(reference))).max())


# --- the reference, from the definition ---------------------------------------------------------------------------


def stored(f: GGUFFile, name: str) -> NDArray[np.float32]:
    """A tensor as the file stores it, float32, numpy (out, in) layout."""
    t = next(t for t in f._reader.tensors if t.name == name)
    return np.asarray(t.data, dtype=F32).reshape([int(d) for d in reversed(t.shape)])


def kv(f: GGUFFile, key: str, default: Any = None) -> Any:
    """The file's own metadata (not ppharness's reading of it)."""
    return f.kv.get(f"deepseek2.{key}", default)


def rmsnorm(x: NDArray[np.float32], w: NDArray[np.float32], eps: float) -> NDArray[np.float32]:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + F32(eps)) * w


def silu(x: NDArray[np.float32]) -> NDArray[np.float32]:
    return x / (F32(1) + np.exp(-x))


def reference_inv_freq(f: GGUFFile) -> NDArray[np.float64]:
    """HF's DeepseekV3YarnRotaryEmbedding: ``inv_freq`` blended between interpolation and extrapolation by a linear
    ramp over the correction range (plain ``base^(-2i/d)`` without rope scaling)."""
    dim, base = int(kv(f, "rope.dimension_count")), float(kv(f, "rope.freq_base"))
    freq_extra = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if str(kv(f, "rope.scaling.type", "none")) != "yarn":
        return freq_extra
    factor, orig = float(kv(f, "rope.scaling.factor")), int(kv(f, "rope.scaling.original_context_length"))
    beta_fast, beta_slow = (
        float(kv(f, "rope.scaling.yarn_beta_fast", 32)),
        float(kv(f, "rope.scaling.yarn_beta_slow", 1)),
    )

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1.0 - ramp
    return freq_extra / factor * (1 - extrapolate) + freq_extra * extrapolate


def reference_softmax_scale(f: GGUFFile) -> float:
    """HF: ``q_head_dim^-0.5``, times ``(0.1 mscale_all_dim ln(factor) + 1)^2`` with YaRN."""
    head = int(kv(f, "attention.key_length_mla"))
    scale = head**-0.5
    if str(kv(f, "rope.scaling.type", "none")) == "yarn":
        m = float(kv(f, "rope.scaling.yarn_log_multiplier")) * math.log(float(kv(f, "rope.scaling.factor"))) + 1
        scale *= m * m
    return scale


def rotate_pairs(x: NDArray[np.float32], angles: NDArray[np.float64]) -> NDArray[np.float32]:
    """Rotary embedding on consecutive pairs: (x[2i] + j x[2i+1]) e^(j angle_i) — as complex numbers."""
    z = x[..., 0::2].astype(np.float64) + 1j * x[..., 1::2].astype(np.float64)
    z = z * np.exp(1j * angles)
    out = np.empty(x.shape, dtype=np.float64)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out.astype(F32)


def reference_attention(f: GGUFFile, layer: int, x: NDArray[np.float32], rope: bool = True) -> NDArray[np.float32]:
    """Block ``layer``'s residual after attention for positions 0..T-1 of ``x`` (T, D), MLA as defined: the
    compressed KV expanded per head (k_nope = c W_kb[h], v = W_vb[h] c), keys = [k_nope, rope(k_pe)], causal.
    ``rope=False`` leaves the rotary embedding out (a mistake the tests must be able to tell)."""
    w = lambda n: stored(f, f"blk.{layer}.{n}")  # noqa: E731
    eps = float(kv(f, "attention.layer_norm_rms_epsilon"))
    heads, head = int(kv(f, "attention.head_count")), int(kv(f, "attention.key_length_mla"))
    width, rank = int(kv(f, "rope.dimension_count")), int(kv(f, "attention.kv_lora_rank"))
    nope, t = head - width, x.shape[0]
    xn = rmsnorm(x, w("attn_norm.weight"), eps)
    if kv(f, "attention.q_lora_rank"):
        q = rmsnorm(xn @ w("attn_q_a.weight").T, w("attn_q_a_norm.weight"), eps) @ w("attn_q_b.weight").T
    else:
        q = xn @ w("attn_q.weight").T
    q = q.reshape(t, heads, head)
    compressed = xn @ w("attn_kv_a_mqa.weight").T
    c = rmsnorm(compressed[:, :rank], w("attn_kv_a_norm.weight"), eps)  # (T, rank)
    angles = np.arange(t)[:, None] * reference_inv_freq(f)[None, :] * rope  # (T, rope/2)
    q_pe = rotate_pairs(q[:, :, nope:], angles[:, None, :])
    k_pe = rotate_pairs(compressed[:, rank:], angles)  # (T, rope), one for every head
    k_nope = np.einsum("sc,hcn->shn", c, w("attn_k_b.weight"))  # (S, H, nope)
    v = np.einsum("hvc,sc->shv", w("attn_v_b.weight"), c)  # (S, H, v)
    k = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None, :], (t, heads, width))], axis=-1)
    qf = np.concatenate([q[:, :, :nope], q_pe], axis=-1)
    scores = np.einsum("thd,shd->hts", qf, k) * F32(reference_softmax_scale(f))
    scores = np.where(np.tril(np.ones((t, t), dtype=bool))[None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("hts,shv->thv", p, v).reshape(t, -1)
    return (x + o @ w("attn_output.weight").T).astype(F32)


def reference_routing(
    f: GGUFFile, logits: NDArray[np.float32], bias: NDArray[np.float32] | None
) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
    """HF's DeepSeek-V3 ``MoEGate`` (noaux_tc): sigmoid scores, the bias added for the choice only, groups scored by
    their two best, the best groups' experts kept, top-k, the scores (not the biased ones) as weights, normalised,
    times the routed scaling factor. Ids per row sorted ascending (the order of a set)."""
    k, groups = int(kv(f, "expert_used_count")), int(kv(f, "expert_group_count", 1)) or 1
    used = int(kv(f, "expert_group_used_count", 1)) or 1
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    choice = scores + (0 if bias is None else bias)
    t, n = scores.shape
    group_scores = np.sort(choice.reshape(t, groups, n // groups), axis=-1)[:, :, -2:].sum(-1)
    ids, weights = [], []
    for row in range(t):
        best_groups = np.argsort(-group_scores[row], kind="stable")[:used]
        allowed = np.isin(np.arange(n) // (n // groups), best_groups)
        masked = np.where(allowed, choice[row], -np.inf)
        top = np.sort(np.argsort(-masked, kind="stable")[:k])
        wt = scores[row, top]
        if kv(f, "expert_weights_norm", False):
            wt = wt / wt.sum()
        ids.append(top)
        weights.append(wt * float(kv(f, "expert_weights_scale", 1.0)))
    return np.array(ids), np.array(weights, dtype=F32)


def reference_moe(f: GGUFFile, layer: int, h: NDArray[np.float32], shared: bool = True) -> NDArray[np.float32]:
    """A MoE block's output from its residual ``h`` after attention: routed experts weighted as routed, plus the
    shared experts, ungated."""
    w = lambda n: stored(f, f"blk.{layer}.{n}")  # noqa: E731
    x = rmsnorm(h, w("ffn_norm.weight"), float(kv(f, "attention.layer_norm_rms_epsilon")))
    ids, weights = reference_routing(f, x @ w("ffn_gate_inp.weight").T, w("exp_probs_b.bias"))
    gate, up, down = (w(f"ffn_{kind}_exps.weight") for kind in ("gate", "up", "down"))
    out = h.astype(F32).copy()
    for t in range(h.shape[0]):
        for j, e in enumerate(ids[t]):
            out[t] += weights[t, j] * (down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])))
    if shared:
        y = silu(x @ w("ffn_gate_shexp.weight").T) * (x @ w("ffn_up_shexp.weight").T)
        out += y @ w("ffn_down_shexp.weight").T
    return out


def reference_dense(f: GGUFFile, layer: int, h: NDArray[np.float32]) -> NDArray[np.float32]:
    w = lambda n: stored(f, f"blk.{layer}.{n}")  # noqa: E731
    x = rmsnorm(h, w("ffn_norm.weight"), float(kv(f, "attention.layer_norm_rms_epsilon")))
    return h + (silu(x @ w("ffn_gate.weight").T) * (x @ w("ffn_up.weight").T)) @ w("ffn_down.weight").T


# --- the pieces ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny-deepseek", "kimi-tiny"])
def test_rope_frequencies_and_softmax_scale_equal_the_reference(which, ds_file, kimi_file):
    f = ds_file if which == "tiny-deepseek" else kimi_file
    cfg = f.config
    angles = rope_angles(cfg, 40)
    np.testing.assert_allclose(angles, np.arange(40)[:, None] * reference_inv_freq(f)[None, :], rtol=1e-12)
    assert attention_scale(cfg) == pytest.approx(reference_softmax_scale(f), rel=1e-12)
    if which == "kimi-tiny":  # YaRN moves some frequencies and keeps others: a blend, not a plain rescale
        plain = cfg.rope_theta ** (-2.0 * np.arange(cfg.rope_dim // 2) / cfg.rope_dim)
        ratio = reference_inv_freq(f) / plain
        assert ratio.max() == pytest.approx(1.0) and ratio.min() == pytest.approx(1 / 32)


def test_kimi_k2s_own_rope_settings_give_the_reference_scale():
    """Kimi K2's real head width and YaRN settings (config.json): softmax scale (1 + 0.1 ln 32)^2 / sqrt(192)."""
    spec = PRESETS["kimi-k2"]
    cfg = dataclasses.replace(
        GGUFFile(synthetic_path(parse_synthetic("synthetic:kimi-tiny,blocks=2"))).config,
        head_dim=spec.head_dim,
        rope_dim=spec.rope_dim,
    )
    expected = (1 + 0.1 * math.log(32)) ** 2 / math.sqrt(192)
    assert attention_scale(cfg) == pytest.approx(expected, rel=1e-7)  # the file stores 0.1 as float32


@pytest.mark.parametrize("which", ["tiny-deepseek", "kimi-tiny"])
def test_mla_attention_equals_the_reference_at_prefill_and_every_decode_step(which, ds_file, kimi_file):
    """The residual after attention: a prefill of 6 positions, then 4 decode steps reading the compressed cache,
    against the reference computed over all 10 positions at once (causal)."""
    from tinygrad.tensor import Tensor

    f = ds_file if which == "tiny-deepseek" else kimi_file
    rng = np.random.default_rng(3)
    x = rng.standard_normal((10, f.config.dim)).astype(np.float16)
    for layer in (0, 1):  # the dense block and a MoE block
        model = ModelSlice(f, layer, layer + 1, False, False, MAX_CONTEXT)
        block = model.blk[0]
        ref = reference_attention(f, layer, x.astype(F32))
        got = [block._attention(Tensor(x[None, :6]), 0).numpy()[0]]
        got += [block._attention(Tensor(x[None, p : p + 1]), model._pos.bind(p)).numpy()[0] for p in range(6, 10)]
        ours = np.concatenate(got)
        assert excess(ours, ref) <= 1, f"{which} block {layer}: MLA attention is off by {excess(ours, ref):.1f}x"
        # the same without the rotary part of the keys misses: the test can tell
        assert excess(ours, reference_attention(f, layer, x.astype(F32), rope=False)) > 1


def test_routing_equals_the_reference_with_bias_groups_and_scale(ds_file):
    """Sigmoid scores, the selection bias, 2 of 4 groups, top 4, normalised and scaled by 2.5, on 64 random rows."""
    f = ds_file
    cfg = f.config
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, cfg.experts)).astype(F32)
    bias = (rng.standard_normal(cfg.experts) * 0.2).astype(F32)
    got = route(logits, cfg.experts_used, cfg.norm_topk, cfg.gating, bias, cfg.expert_groups, cfg.groups_used,
                cfg.routed_scale)  # fmt: skip
    ids, weights = reference_routing(f, logits, bias)
    order = np.argsort(got.ids, axis=-1)
    assert (np.take_along_axis(got.ids, order, -1) == ids).all()
    np.testing.assert_allclose(np.take_along_axis(got.weights, order, -1), weights, rtol=1e-5)
    assert np.allclose(got.weights.sum(-1), cfg.routed_scale, rtol=1e-5), "normalised, then scaled"
    groups = np.asarray(got.ids) // (cfg.experts // cfg.expert_groups)
    assert all(len(set(row)) <= cfg.groups_used for row in groups.tolist()), "experts from more groups than used"
    # each piece matters: without the bias, the groups or the scale the answer differs
    unbiased = route(logits, cfg.experts_used, True, "sigmoid", None, 4, 2, 2.5)
    ungrouped = route(logits, cfg.experts_used, True, "sigmoid", bias, 0, 0, 2.5)
    assert (np.sort(unbiased.ids) != ids).any() and (np.sort(ungrouped.ids) != ids).any()


def test_the_bias_chooses_but_does_not_weigh():
    logits = np.zeros((3, 8), dtype=F32)
    logits[:, 5] = 2.0
    bias = np.zeros(8, dtype=F32)
    bias[2] = 10.0  # expert 2 wins the choice by its bias alone
    r = route(logits, 2, False, "sigmoid", bias)
    assert (r.ids[:, 0] == 2).all() and (r.ids[:, 1] == 5).all()
    np.testing.assert_allclose(r.weights[:, 0], 0.5, rtol=1e-6)  # sigmoid(0): the score, not score + bias
    np.testing.assert_allclose(r.weights[:, 1], 1 / (1 + math.exp(-2.0)), rtol=1e-6)


@pytest.mark.parametrize("which", ["tiny-deepseek", "kimi-tiny"])
def test_moe_and_dense_blocks_equal_the_reference(which, ds_file, kimi_file):
    """Block 0 (dense) whole, and block 1's feed-forward part through ppharness's path (the block's ``pre`` in
    tinygrad, ``route``, the bank, ``combine``) against the reference; leaving out the shared expert misses."""
    from tinygrad.tensor import Tensor

    f = ds_file if which == "tiny-deepseek" else kimi_file
    cfg = f.config
    rng = np.random.default_rng(1)
    x = rng.standard_normal((7, cfg.dim)).astype(np.float16)
    dense = ModelSlice(f, 0, 1, False, False, MAX_CONTEXT).blk[0]
    ours = dense(Tensor(x[None]), 0).numpy()[0]
    ref = reference_dense(f, 0, reference_attention(f, 0, x.astype(F32)))
    assert excess(ours, ref) <= 1, f"the dense block is off by {excess(ours, ref):.1f}x"

    model = ModelSlice(f, 1, 2, False, False, MAX_CONTEXT)
    residual, normed, logits, shared = (o.numpy()[0] for o in model.blk[0].pre(Tensor(x[None]), 0))
    routing = route(logits, cfg.experts_used, cfg.norm_topk, cfg.gating, model._bias[1], cfg.expert_groups,
                    cfg.groups_used, cfg.routed_scale)  # fmt: skip
    outputs = model.bank.answer(1, normed, routing.ids)
    ours = combine(residual, outputs, routing.weights, shared)
    ref = reference_moe(f, 1, reference_attention(f, 1, x.astype(F32)))
    assert excess(ours, ref) <= 1, f"the MoE block is off by {excess(ours, ref):.1f}x"
    no_shared = reference_moe(f, 1, reference_attention(f, 1, x.astype(F32)), shared=False)
    assert excess(ours, no_shared) > 1, "the shared expert makes no difference: the test could not tell"


# --- the whole model ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cuts", "max_tokens"),
    [
        pytest.param((2,), TOKENS, id="cut-2"),
        # every cut and a long generation: pytest -m slow
        pytest.param((1, 2, 3), 48, id="every-cut-48-tokens", marks=pytest.mark.slow),
    ],
)
def test_split_with_experts_on_banks_equals_the_unsplit_model(ds_file, cuts, max_tokens):
    """tiny-deepseek cut between blocks, the stages holding none of their experts, every call answered by three
    banks holding the routed experts round robin: tokens and every block's output at every step, byte for byte."""
    f = ds_file
    cfg = f.config
    expected = oracle_decode(f.path, PROMPT, max_tokens, MAX_CONTEXT, boundaries=True)
    pairs = [(layer, e) for layer in sorted(cfg.moe_blocks) for e in range(cfg.experts)]
    held: list[dict[int, list[int]]] = [{}, {}, {}]
    for n, (layer, e) in enumerate(pairs):
        held[n % 3].setdefault(layer, []).append(e)
    banks = [ExpertBank(f, h) for h in held]

    def answer(call: ExpertCall) -> NDArray[np.float16]:
        out = np.zeros((*call.routing.ids.shape, cfg.dim), dtype=np.float16)
        for t, row in enumerate(call.routing.ids):
            for j, e in enumerate(row):
                bank = banks[pairs.index((call.layer, int(e))) % 3]
                out[t, j] = bank.answer(call.layer, call.hidden[t : t + 1], row[j : j + 1][None])[0, 0]
        return out

    for cut in cuts:
        stages = [
            ModelSlice(f, 0, cut, True, False, MAX_CONTEXT, taps=True, experts={}),
            ModelSlice(f, cut, cfg.blocks, False, True, MAX_CONTEXT, taps=True, experts={}),
        ]
        got, digests = drive(f, stages, answer, PROMPT, max_tokens)  # tests/test_moe.py's greedy loop
        assert got[: len(expected.token_ids)] == expected.token_ids, f"cut {cut}: the tokens differ"
        for block in range(cfg.blocks):
            n = len(expected.boundary_digests[block])
            assert digests[block][:n] == expected.boundary_digests[block], f"cut {cut}: block {block} differs"


def test_kimi_tiny_has_kimi_k2s_counts_and_decodes():
    spec, real = PRESETS["kimi-tiny"], PRESETS["kimi-k2"]
    for field in ("blocks", "experts", "experts_used", "shared_experts", "dense_blocks", "yarn_factor", "rope_theta"):
        assert getattr(spec, field) == getattr(real, field), field
    assert real.n_params == pytest.approx(1.03e12, rel=0.01)  # Kimi K2: "1 T total parameters"
    f = GGUFFile(synthetic_path(parse_synthetic("synthetic:kimi-tiny,blocks=3")))
    cfg = f.config
    assert (cfg.arch, cfg.gating, cfg.moe_blocks, cfg.experts_used) == ("deepseek2", "sigmoid", {1, 2}, 8)
    assert cfg.shared_ffn == cfg.expert_ffn and not cfg.shared_gate and cfg.q_lora_rank == 48
    result = oracle_decode(f.path, PROMPT, 6, MAX_CONTEXT)
    assert len(result.token_ids) >= 1


def test_kimi_k2_is_for_the_simulator_only():
    with pytest.raises(ModelError, match="simulator only"):
        resolve_model("synthetic:kimi-k2")


def test_gguf_metadata_is_what_llama_cpp_reads(ds_file, kimi_file):
    """The keys and tensor names llama.cpp's deepseek2 loader reads, straight from the file."""
    for f in (ds_file, kimi_file):
        assert f.kv["general.architecture"] == "deepseek2"
        for key in ("leading_dense_block_count", "attention.kv_lora_rank", "attention.key_length_mla",
                    "attention.value_length_mla", "expert_shared_count", "expert_weights_scale",
                    "expert_weights_norm", "expert_gating_func", "rope.dimension_count"):  # fmt: skip
            assert f"deepseek2.{key}" in f.kv, key
        names = set(f.names())
        assert {"blk.0.ffn_gate.weight", "blk.1.ffn_gate_inp.weight", "blk.1.exp_probs_b.bias"} <= names
        assert {"blk.1.attn_k_b.weight", "blk.1.attn_v_b.weight", "blk.1.ffn_up_shexp.weight"} <= names
        assert "blk.0.ffn_gate_inp.weight" not in names  # the leading dense block has no router
    assert "deepseek2.attention.q_lora_rank" in kimi_file.kv and "blk.0.attn_q_a.weight" in kimi_file.names()
    assert kimi_file.kv["deepseek2.rope.scaling.type"] == "yarn"
    assert ds_file.kv["deepseek2.expert_group_count"] == 4
