"""``deepseek2`` (DeepSeek V2/V3, Kimi K2): multi-head latent attention (MLA), leading dense blocks, and MoE blocks
with sigmoid (or softmax) routing, a selection bias, grouped top-k, a routed scale and ungated shared experts.

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

The metadata and tensors are llama.cpp's for MLA computed in the compressed space: the key and value
up-projections split per head (``attn_k_b``, ``attn_v_b``), one compressed KV "head" in the file's head counts.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import NDArray

from ppharness.errors import ModelError
from ppharness.model.arch.base import (
    Architecture,
    AttentionShape,
    Shape,
    SyntheticSpec,
    TensorSink,
    check_experts,
    check_no_rope_factors,
    check_no_shared_ffn,
    write_expert_keys,
)
from ppharness.model.layers.rows import Rows, per_row, place, slot_view

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp

    from ppharness.model.gguf.config import ModelConfig


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
    block's part before its routed experts (``pre``, as the MoE blocks of ``ppharness.model.arch.qwen_moe``)."""
    from tinygrad import nn
    from tinygrad.tensor import Tensor

    class Weight:
        def __init__(self, *shape: int):
            self.weight = Tensor.zeros(*shape)

    class DeepseekBlock:
        slot_cache: (
            Tensor  # a batched slice's latent cache of every request slot (ppharness.model.layers.rows.slot_cache)
        )

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

        def _attention(self, x: Tensor, start_pos: int | UOp | Rows) -> Tensor:
            """The residual after attention (float32), from the block's fp16 input ``x`` (B, T, D)."""
            if isinstance(start_pos, Rows):
                return self._attention_rows(x, start_pos)
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

        def _attention_rows(self, x: Tensor, rows: Rows) -> Tensor:
            """``_attention`` for a batch of decode rows (``ppharness.model.layers.rows``): row r in slot r at its own
            position, its latent written there in the slots' cache, attending over [0, L) with the positions after
            its own masked."""
            cfg = self.cfg
            w = int(x.shape[0])
            h, c, r, n = cfg.heads, cfg.kv_lora_rank, cfg.rope_dim, cfg.head_dim - cfg.rope_dim
            xn = self.attn_norm(x)
            q = self.attn_q_b(self.attn_q_a_norm(self.attn_q_a(xn))) if cfg.q_lora_rank else self.attn_q(xn)
            q = q.reshape(w, 1, h, cfg.head_dim).transpose(1, 2).float()  # (W,H,1,n+r)
            kv = self.attn_kv_a_mqa(xn)  # (W,1,c+r)
            c_kv = self.attn_kv_a_norm(kv[:, :, :c]).float()
            table = _rope_table(cfg, self.max_context)
            cs = rows.at_positions(table.reshape(self.max_context, -1)).reshape(w, 2, r // 2).contiguous()
            cos, sin = cs[:, 0, :], cs[:, 1, :]  # (W, r/2)
            q_pe = _rope_pairs(q[:, :, :, n:], cos.reshape(w, 1, 1, -1), sin.reshape(w, 1, 1, -1))
            k_pe = _rope_pairs(kv[:, :, c:].float(), cos.reshape(w, 1, -1), sin.reshape(w, 1, -1))
            cache = self.slot_cache  # (slots, context, c+r), made at the first prefill
            view = slot_view(cache, rows, 0)  # a window's rows all in its one slot
            new = c_kv.cat(k_pe, dim=-1).cast("float16").contiguous()  # (W,1,c+r)
            here = Tensor.arange(self.max_context).reshape(1, -1, 1) == rows.pos.reshape(w, 1, 1)
            view.assign(place(rows, view, new, here, 0)).realize()
            length = cast(int, rows.length)
            cached = per_row(slot_view(cache, rows, 0)[:, 0:length, :], rows, 0).unsqueeze(1).float()  # (W,1,L,c+r)
            c_all, pe_all = cached[:, :, :, :c], cached[:, :, :, c:]
            q_lat = q[:, :, :, :n] @ self.attn_k_b.weight.float().transpose(-1, -2)  # (W,H,1,c)
            scores = (q_lat @ c_all.transpose(-1, -2) + q_pe @ pe_all.transpose(-1, -2)) * attention_scale(cfg)
            scores = scores + rows.seen().reshape(w, 1, 1, -1).where(0.0, float("-inf"))
            o_lat = scores.softmax(-1) @ c_all  # (W,H,1,c)
            o = o_lat @ self.attn_v_b.weight.float().transpose(-1, -2)  # (W,H,1,v)
            o = o.transpose(1, 2).reshape(w, 1, h * cfg.v_head_dim).cast("float16")
            return cast("Tensor", x.float() + self.attn_output(o).float())

        def __call__(self, x: Tensor, start_pos: int | UOp | Rows) -> Tensor:
            """A dense block: attention and the FFN, its output the fp16 block boundary."""
            hres = self._attention(x, start_pos)
            hn = self.ffn_norm(hres).cast("float16")
            act = cast(Any, self.ffn_gate(hn)).silu().contiguous()  # silu is unannotated
            return cast("Tensor", (hres + self.ffn_down(act * self.ffn_up(hn)).float()).cast("float16").contiguous())

        def pre(self, x: Tensor, start_pos: int | UOp | Rows) -> tuple[Tensor, ...]:
            """A MoE block before its routed experts: the residual (fp32), the experts' normed input (fp16), the
            router's logits (fp32) and the shared experts' output (fp32). The norm and the router compute in fp32
            from their fp32 weights (``Deepseek2.f32_tensors``), as llama.cpp does; the experts read the normed
            input rounded to fp16."""
            hres = self._attention(x, start_pos)
            normed = self.ffn_norm(hres).contiguous()  # (B,T,D) fp32
            half = normed.cast("float16").contiguous()
            out = [hres.contiguous(), half, self.ffn_gate_inp(normed).contiguous()]
            if self.shared:
                act = cast(Any, self.ffn_gate_shexp(half)).silu().contiguous()
                out.append(self.ffn_down_shexp(act * self.ffn_up_shexp(half)).float().contiguous())
            return tuple(out)

    return DeepseekBlock


class Deepseek2(Architecture):
    name = "deepseek2"
    moe = True
    gating = "sigmoid"
    router_bias = "exp_probs_b.bias"
    block_parts = frozenset(
        {f"{p}.weight" for p in ("attn_norm", "attn_q", "attn_q_a", "attn_q_a_norm", "attn_q_b", "attn_output")}
        | {f"{p}.weight" for p in ("attn_kv_a_mqa", "attn_kv_a_norm", "attn_k_b", "attn_v_b", "ffn_norm")}
        | {f"ffn_{p}{kind}.weight" for p in ("gate", "up", "down") for kind in ("", "_exps", "_shexp")}
        | {"ffn_gate_inp.weight", "exp_probs_b.bias"}
    )
    keys = frozenset(
        {"rope.scaling.type", "rope.scaling.factor", "expert_weights_scale", "expert_gating_func"}
        | {"expert_group_count", "leading_dense_block_count"}
    )
    f32_tensors = ("ffn_norm.weight", "ffn_gate_inp.weight")

    def check(self, spec: SyntheticSpec) -> None:
        check_experts(spec)
        if not (spec.kv_lora_rank >= 1 and spec.rope_dim >= 2 and spec.rope_dim % 2 == 0 and spec.v_head_dim >= 1):
            raise ModelError(
                f"deepseek2 needs kv_lora_rank >= 1, an even rope_dim >= 2 and v_head_dim >= 1 (got kv_lora_rank "
                f"{spec.kv_lora_rank}, rope_dim {spec.rope_dim}, v_head_dim {spec.v_head_dim})"
            )
        if spec.hd <= spec.rope_dim:
            raise ModelError(f"deepseek2: head_dim {spec.hd} must be more than rope_dim {spec.rope_dim}")
        if not 0 <= spec.dense_blocks < spec.blocks:
            raise ModelError(f"deepseek2: dense_blocks {spec.dense_blocks} must be in [0, blocks {spec.blocks})")
        if spec.gating not in ("", "softmax", "sigmoid"):
            raise ModelError(f"deepseek2: gating {spec.gating!r} must be softmax or sigmoid")
        if spec.expert_groups and (
            spec.experts % spec.expert_groups or not 1 <= spec.groups_used <= spec.expert_groups
        ):
            raise ModelError(
                f"deepseek2: {spec.experts} experts must divide into expert_groups {spec.expert_groups}, and "
                f"1 <= groups_used {spec.groups_used} <= expert_groups"
            )
        check_no_shared_ffn(spec)
        check_no_rope_factors(spec)

    def block_tensors(self, spec: SyntheticSpec, i: int) -> dict[str, Shape]:
        """llama.cpp's names, with MLA's key and value up-projections split per head (``attn_k_b``, ``attn_v_b``) as
        its converter writes them since it computes MLA in the compressed space."""
        d, h, hd, r, c, v = spec.dim, spec.heads, spec.hd, spec.rope_dim, spec.kv_lora_rank, spec.v_head_dim
        nope, e, f, q, b = hd - r, spec.experts, spec.expert_ffn, spec.q_lora_rank, f"blk.{i}."
        out: dict[str, Shape] = {b + "attn_norm.weight": (d,)}
        if q:
            out |= {b + "attn_q_a.weight": (q, d), b + "attn_q_a_norm.weight": (q,), b + "attn_q_b.weight": (h * hd, q)}
        else:
            out[b + "attn_q.weight"] = (h * hd, d)
        out |= {
            b + "attn_kv_a_mqa.weight": (c + r, d),
            b + "attn_kv_a_norm.weight": (c,),
            b + "attn_k_b.weight": (h, c, nope),
            b + "attn_v_b.weight": (h, v, c),
            b + "attn_output.weight": (d, h * v),
            b + "ffn_norm.weight": (d,),
        }
        if i < spec.dense_blocks:
            out |= {b + "ffn_gate.weight": (spec.ffn, d), b + "ffn_up.weight": (spec.ffn, d)}
            out[b + "ffn_down.weight"] = (d, spec.ffn)
            return out
        out |= {b + "ffn_gate_inp.weight": (e, d), b + "exp_probs_b.bias": (e,)}
        out |= {b + "ffn_gate_exps.weight": (e, f, d), b + "ffn_up_exps.weight": (e, f, d)}
        out[b + "ffn_down_exps.weight"] = (e, d, f)
        if spec.shared_experts:
            s = f * spec.shared_experts
            out |= {b + "ffn_gate_shexp.weight": (s, d), b + "ffn_up_shexp.weight": (s, d)}
            out[b + "ffn_down_shexp.weight"] = (d, s)
        return out

    def cache_heads(self, spec: SyntheticSpec) -> int:
        return 1  # MLA: one compressed KV "head"

    def write_keys(self, spec: SyntheticSpec, w: Any) -> None:
        """deepseek2's metadata as llama.cpp's converter writes it for MLA: the cache's key and value widths
        (``key_length`` = kv_lora_rank + rope_dim, ``value_length`` = kv_lora_rank, one KV head) and each head's
        (``key_length_mla``, ``value_length_mla``)."""
        import gguf  # the writer's own enums; gguf loads with the writer only

        w.add_rope_dimension_count(spec.rope_dim)
        w.add_key_length(spec.kv_lora_rank + spec.rope_dim)
        w.add_value_length(spec.kv_lora_rank)
        w.add_key_length_mla(spec.hd)
        w.add_value_length_mla(spec.v_head_dim)
        w.add_leading_dense_block_count(spec.dense_blocks)
        if spec.q_lora_rank:
            w.add_q_lora_rank(spec.q_lora_rank)
        w.add_kv_lora_rank(spec.kv_lora_rank)
        w.add_expert_shared_count(spec.shared_experts)
        w.add_expert_weights_scale(spec.routed_scale or 1.0)
        w.add_expert_weights_norm(True)
        sigmoid = (spec.gating or self.gating) == "sigmoid"
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
        if spec.expert_groups:
            w.add_expert_group_count(spec.expert_groups)
            w.add_expert_group_used_count(spec.groups_used)
        if spec.yarn_factor:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(spec.yarn_factor)
            w.add_rope_scaling_orig_ctx_len(spec.yarn_original_context)
            w.add_rope_scaling_yarn_log_mul(spec.yarn_log_mul)
            if spec.yarn_beta_fast:
                w.add_rope_scaling_yarn_beta_fast(spec.yarn_beta_fast)
            if spec.yarn_beta_slow:
                w.add_rope_scaling_yarn_beta_slow(spec.yarn_beta_slow)
        write_expert_keys(spec, w)

    def write_block(self, spec: SyntheticSpec, i: int, out: TensorSink) -> None:
        """Block ``i``'s tensors in ``block_tensors``' order: norms F32, the router F32 (rows scaled log-normally as
        the qwen writer's) with its F32 selection bias, every other matrix in the spec's weight type; each matrix's
        scale 1/sqrt(its input width)."""
        rng = out.rng
        for name, shape in self.block_tensors(spec, i).items():
            if name.endswith("norm.weight"):
                out.add(name, out.norm(shape[0]))
            elif name.endswith("exp_probs_b.bias"):
                out.add(name, out.vector(shape[0], 0.05))
            elif name.endswith("ffn_gate_inp.weight"):
                hot = np.exp(rng.standard_normal((shape[0], 1), dtype=np.float32) * 0.5)
                router = rng.standard_normal(shape, dtype=np.float32) * hot / np.sqrt(shape[1])
                out.add(name, router.astype(np.float32))
            elif name.endswith("attn_k_b.weight"):  # (heads, kv_lora_rank, nope): multiplies queries into the cache
                out.matrix(name, out.rand(*shape, std=1.0 / np.sqrt(shape[2])))
            else:
                out.matrix(name, out.rand(*shape, std=1.0 / np.sqrt(shape[-1])))

    def read(self, kv: dict[str, Any], tensor_names: set[str], common: dict[str, Any]) -> dict[str, Any]:
        """deepseek2's keys, as llama.cpp's loader reads them; ``head_dim`` becomes a head's key width. A file from
        before llama.cpp computed MLA in the compressed space (one ``attn_kv_b`` per block instead of ``attn_k_b``
        and ``attn_v_b``) is refused with what to do."""
        a = self.name
        if any(n.endswith(".attn_kv_b.weight") for n in tensor_names):
            raise ModelError(
                "this deepseek2 GGUF stores MLA's key/value up-projection as one attn_kv_b per block (llama.cpp's "
                "layout before April 2025); convert the model again with a current llama.cpp convert_hf_to_gguf.py, "
                "which writes attn_k_b and attn_v_b"
            )
        gating = int(kv.get(f"{a}.expert_gating_func", 0))
        n_shared = int(kv.get(f"{a}.expert_shared_count", 0))
        fields: dict[str, Any] = dict(
            gating="sigmoid" if gating == 2 else "softmax",  # 0 (not set): softmax, as llama.cpp for DeepSeek V2
            expert_groups=int(kv.get(f"{a}.expert_group_count", 0)),
            groups_used=int(kv.get(f"{a}.expert_group_used_count", 0)),
            routed_scale=float(kv.get(f"{a}.expert_weights_scale", 1.0)),
            shared_gate=False,
            shared_ffn=common["expert_ffn"] * n_shared if common["experts"] else 0,
            q_lora_rank=int(kv.get(f"{a}.attention.q_lora_rank", 0)),
            kv_lora_rank=int(kv[f"{a}.attention.kv_lora_rank"]),
            rope_dim=int(kv[f"{a}.rope.dimension_count"]),
            v_head_dim=int(kv.get(f"{a}.attention.value_length_mla", kv.get(f"{a}.attention.value_length", 0))),
        )
        if str(kv.get(f"{a}.rope.scaling.type", "none")) == "yarn":
            fields.update(
                yarn_factor=float(kv[f"{a}.rope.scaling.factor"]),
                yarn_original_context=int(kv[f"{a}.rope.scaling.original_context_length"]),
                yarn_log_mul=float(kv.get(f"{a}.rope.scaling.yarn_log_multiplier", 0.0)),
                yarn_beta_fast=float(kv.get(f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
                yarn_beta_slow=float(kv.get(f"{a}.rope.scaling.yarn_beta_slow", 1.0)),
            )
        fields["head_dim"] = int(kv.get(f"{a}.attention.key_length_mla", kv[f"{a}.attention.key_length"]))
        return fields

    def unsupported(self, kv: dict[str, Any]) -> str:
        """A rope scaling other than YaRN (its rotary width is its own: ``rope_dim``)."""
        scaling = str(kv.get(f"{self.name}.rope.scaling.type", "none")).lower()
        return "" if scaling in ("none", "yarn") else f"rope scaling {scaling!r} is not YaRN, the one deepseek2 has"

    def block(self, cfg: ModelConfig, max_context: int, layer: int) -> Any:
        return deepseek2_block_class()(cfg, max_context, layer in cfg.moe_blocks)

    def attention_cost(self, shape: AttentionShape) -> tuple[int, int]:
        """One compressed vector of ``kv_lora_rank`` values and the shared rotary key of ``rope_dim`` values cached
        per token, whatever the head count; a decoding token attends in that compressed space (the key and value
        up-projections absorbed into the query and the output): 2 x heads x (kv_lora_rank + rope_dim) FLOPs per
        position for the scores and 2 x heads x kv_lora_rank for the weighted sum."""
        c, r, h = shape.kv_lora_rank, shape.rope_dim, shape.heads
        return c + r, 2 * h * (c + r) + 2 * h * c

    def shared_experts(self, width: int, expert_ffn: int) -> int:
        return max(1, width // expert_ffn)  # each shared expert as wide as a routed one


DEEPSEEK2 = Deepseek2()
