"""The ``deepseek2`` architecture's block (DeepSeek V2/V3, Kimi K2) on tinygrad: multi-head latent attention (MLA),
leading dense blocks, and MoE blocks whose shared experts are ungated.

MLA, per block, with ``c`` = kv_lora_rank, ``r`` = rope_dim, ``n`` = head_dim - r (the no-rope part of a head's key),
``v`` = v_head_dim, as llama.cpp's ``build_deepseek2`` computes it with ``attn_k_b``/``attn_v_b``:

- queries: ``q = W_qb · norm(W_qa · x)`` (or ``W_q · x`` without a query bottleneck), per head split into
  ``q_nope`` (n) and ``q_pe`` (r);
- the cache: ``[norm(kv[:c]), rope(kv[c:])]`` with ``kv = W_kva · x``: ``c + r`` fp16 values per token, shared by
  every head (that is MLA's point: the cache of a 64-head model is 576 values per token, not 64 × 2 × 128);
- scores in the compressed space: ``(q_nope · W_kb[h]ᵀ) · c_s + q_pe · pe_s`` for each cached position ``s``, times
  ``mscale² / sqrt(n + r)``; softmax; the head's output ``W_vb[h] · Σ_s p_s c_s``; then ``W_o`` over the heads.

Rotary embedding is llama.cpp's "normal" kind for this architecture: consecutive pairs ``(x[2i], x[2i+1])`` rotate
by ``pos · θ_i``. With YaRN (Kimi K2: factor 32 over an original context of 4096) the angles are llama.cpp's
``rope_yarn``: each pair's frequency blends the interpolated ``θ_i / factor`` and the original ``θ_i`` by a ramp
between the correction dimensions of ``beta_fast`` and ``beta_slow``; the rotation itself is unscaled, and the
attention scale carries ``mscale = 1 + yarn_log_mul · ln(factor)`` squared. The angle tables are computed here in
numpy float64 once per model, so that the definition is written once and read by the numpy reference of the tests.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp

    from ppharness.model.slicing import ModelConfig


def yarn_corr_dims(cfg: ModelConfig) -> tuple[float, float]:
    """llama.cpp's ``ggml_rope_yarn_corr_dims``: the pair indices where the ramp from extrapolated to interpolated
    frequencies starts and ends."""
    n, base, orig = cfg.rope_dim, cfg.rope_theta, cfg.yarn_original_context

    def corr(beta: float) -> float:
        return n * math.log(orig / (beta * 2 * math.pi)) / (2 * math.log(base))

    start, end = math.floor(corr(cfg.yarn_beta_fast)), math.ceil(corr(cfg.yarn_beta_slow))
    return max(0.0, float(start)), min(float(n - 1), float(end))


def rope_angles(cfg: ModelConfig, positions: int) -> NDArray[np.float64]:
    """(positions, rope_dim / 2) rotation angles: ``pos · θ_i`` with ``θ_i = base^(-2i / rope_dim)``, through
    llama.cpp's YaRN blend when the model has rope scaling."""
    half = cfg.rope_dim // 2
    i = np.arange(half, dtype=np.float64)
    theta = cfg.rope_theta ** (-2.0 * i / cfg.rope_dim)
    if cfg.yarn_factor:
        low, high = yarn_corr_dims(cfg)
        ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)  # 1: keep the original frequency
        theta = theta / cfg.yarn_factor * (1.0 - ramp) + theta * ramp
    return np.arange(positions, dtype=np.float64)[:, None] * theta[None, :]


def attention_scale(cfg: ModelConfig) -> float:
    """The softmax scale: ``mscale² / sqrt(head_dim)``, ``mscale = 1 + yarn_log_mul · ln(factor)`` (1 without
    YaRN)."""
    mscale = 1.0 + cfg.yarn_log_mul * math.log(cfg.yarn_factor) if cfg.yarn_factor else 1.0
    return mscale * mscale / math.sqrt(cfg.head_dim)


@functools.cache
def _rope_table(cfg: ModelConfig, positions: int) -> Tensor:
    """cos and sin of ``rope_angles`` stacked: (positions, 2, rope_dim / 2) float32 on the default device."""
    from tinygrad.tensor import Tensor

    a = rope_angles(cfg, positions)
    return Tensor(np.stack([np.cos(a), np.sin(a)], axis=1).astype(np.float32)).realize()


def _rope_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate consecutive pairs of ``x``'s last dimension (float32) by the angles whose cos/sin are given."""
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return cast("Tensor", (x0 * cos - x1 * sin).stack(x0 * sin + x1 * cos, dim=-1).reshape(x.shape))


@functools.cache
def deepseek2_block_class() -> Any:
    """A deepseek2 block: MLA attention, then a dense FFN (``routed`` False: the leading dense blocks) or a MoE
    block's part before its routed experts (``pre``, as ``ppharness.model.slicing``'s MoE blocks)."""
    from tinygrad import nn
    from tinygrad.tensor import Tensor

    class Weight:
        def __init__(self, *shape: int):
            self.weight = Tensor.zeros(*shape)

    class DeepseekBlock:
        def __init__(self, cfg: ModelConfig, max_context: int, routed: bool):
            d, h, c, r = cfg.dim, cfg.heads, cfg.kv_lora_rank, cfg.rope_dim
            self.cfg, self.max_context, self.routed = cfg, max_context, routed
            self.attn_norm = nn.RMSNorm(d, cfg.norm_eps)
            if cfg.q_lora_rank:
                self.attn_q_a = nn.Linear(d, cfg.q_lora_rank, bias=False)
                self.attn_q_a_norm = nn.RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
                self.attn_q_b = nn.Linear(cfg.q_lora_rank, h * cfg.head_dim, bias=False)
            else:
                self.attn_q = nn.Linear(d, h * cfg.head_dim, bias=False)
            self.attn_kv_a_mqa = nn.Linear(d, c + r, bias=False)
            self.attn_kv_a_norm = nn.RMSNorm(c, cfg.norm_eps)
            self.attn_k_b = Weight(h, c, cfg.head_dim - r)
            self.attn_v_b = Weight(h, cfg.v_head_dim, c)
            self.attn_output = nn.Linear(h * cfg.v_head_dim, d, bias=False)
            self.ffn_norm = nn.RMSNorm(d, cfg.norm_eps)
            if routed:
                self.ffn_gate_inp = nn.Linear(d, cfg.experts, bias=False)
                self.shared = bool(cfg.shared_ffn)
                if self.shared:
                    self.ffn_gate_shexp = nn.Linear(d, cfg.shared_ffn, bias=False)
                    self.ffn_up_shexp = nn.Linear(d, cfg.shared_ffn, bias=False)
                    self.ffn_down_shexp = nn.Linear(cfg.shared_ffn, d, bias=False)
            else:
                self.ffn_gate = nn.Linear(d, cfg.ffn, bias=False)
                self.ffn_up = nn.Linear(d, cfg.ffn, bias=False)
                self.ffn_down = nn.Linear(cfg.ffn, d, bias=False)

        def _attention(self, x: Tensor, start_pos: int | UOp) -> Tensor:
            """The residual after attention (float32), from the block's fp16 input ``x`` (B, T, D)."""
            cfg = self.cfg
            b, t, _ = x.shape
            h, c, r, n = cfg.heads, cfg.kv_lora_rank, cfg.rope_dim, cfg.head_dim - cfg.rope_dim
            xn = self.attn_norm(x)
            q = self.attn_q_b(self.attn_q_a_norm(self.attn_q_a(xn))) if cfg.q_lora_rank else self.attn_q(xn)
            q = q.reshape(b, t, h, cfg.head_dim).transpose(1, 2).float()  # (B,H,T,n+r)
            kv = self.attn_kv_a_mqa(xn)  # (B,T,c+r)
            c_kv = self.attn_kv_a_norm(kv[:, :, :c]).float()
            table = _rope_table(cfg, self.max_context)[start_pos : start_pos + t]
            cos, sin = table[:, 0, :], table[:, 1, :]  # (T, r/2)
            q_pe = _rope_pairs(q[:, :, :, n:], cos, sin)
            k_pe = _rope_pairs(kv[:, :, c:].float(), cos, sin)
            if not hasattr(self, "cache_kv"):
                self.cache_kv = Tensor.zeros(b, self.max_context, c + r, dtype="float16").contiguous().realize()
            self.cache_kv[:, start_pos : start_pos + t, :].assign(c_kv.cat(k_pe, dim=-1).cast("float16")).realize()
            cached = self.cache_kv[:, 0 : start_pos + t, :].unsqueeze(1).float()  # (B,1,S,c+r)
            c_all, pe_all = cached[:, :, :, :c], cached[:, :, :, c:]
            q_lat = q[:, :, :, :n] @ self.attn_k_b.weight.float().transpose(-1, -2)  # (B,H,T,c)
            scores = (q_lat @ c_all.transpose(-1, -2) + q_pe @ pe_all.transpose(-1, -2)) * attention_scale(cfg)
            if t > 1:  # causal, lower right: position start_pos + i sees [0, start_pos + i]
                mask = Tensor.full((1, 1, t, start_pos + t), float("-inf")).triu(cast(int, start_pos) + 1)
                scores = scores + mask
            o_lat = scores.softmax(-1) @ c_all  # (B,H,T,c)
            o = o_lat @ self.attn_v_b.weight.float().transpose(-1, -2)  # (B,H,T,v)
            o = o.transpose(1, 2).reshape(b, t, h * cfg.v_head_dim).cast("float16")
            return cast("Tensor", x.float() + self.attn_output(o).float())

        def __call__(self, x: Tensor, start_pos: int | UOp) -> Tensor:
            """A dense block: attention and the FFN, its output the fp16 block boundary."""
            hres = self._attention(x, start_pos)
            hn = self.ffn_norm(hres).cast("float16")
            act = cast(Any, self.ffn_gate(hn)).silu().contiguous()  # silu is unannotated
            return cast("Tensor", (hres + self.ffn_down(act * self.ffn_up(hn)).float()).cast("float16").contiguous())

        def pre(self, x: Tensor, start_pos: int | UOp) -> tuple[Tensor, ...]:
            """A MoE block before its routed experts: the residual (fp32), the experts' normed input (fp16), the
            router's logits (fp32) and the shared experts' output (fp32)."""
            hres = self._attention(x, start_pos)
            normed = self.ffn_norm(hres).cast("float16").contiguous()
            out = [hres.contiguous(), normed, self.ffn_gate_inp(normed).float().contiguous()]
            if self.shared:
                act = cast(Any, self.ffn_gate_shexp(normed)).silu().contiguous()
                out.append(self.ffn_down_shexp(act * self.ffn_up_shexp(normed)).float().contiguous())
            return tuple(out)

    return DeepseekBlock
