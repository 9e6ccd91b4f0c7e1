"""``qwen3moe`` and ``qwen2moe``: llama's attention and a mixture-of-experts feed-forward part in every block.

- ``qwen3moe``: an RMS norm of each head's queries and keys (``attn_q_norm``, ``attn_k_norm``); softmax routing over
  the experts, top-k weights renormalised; no shared expert.
- ``qwen2moe``: biases on the query, key and value projections; softmax routing, top-k weights *not* renormalised;
  a shared expert of its own width (``ffn_*_shexp``) gated by ``sigmoid(ffn_gate_inp_shexp . x)``.

A block's router is ``ffn_gate_inp`` and its routed experts are stacked in ``ffn_{gate,up,down}_exps``, as llama.cpp
names them; the block on tinygrad (``moe_block_class``) computes attention and what precedes the routed experts
(``pre``), which ``ppharness.model.layers.moe`` routes and combines on the host.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ppharness.model.arch.base import (
    Architecture,
    Shape,
    SyntheticSpec,
    TensorSink,
    check_experts,
    check_no_mla,
    check_no_rope_factors,
    check_no_shared_ffn,
    write_expert_keys,
)
from ppharness.model.arch.llama import ATTENTION_PARTS, FFN_PARTS, write_rope_keys
from ppharness.model.arch.qwen import qwen_attention_tensors, write_qwen_attention
from ppharness.model.layers.attention import attention_rows
from ppharness.model.layers.block import block_args, dense_block
from ppharness.model.layers.rows import Rows

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp

    from ppharness.model.gguf.config import ModelConfig


MOE_BIAS_STD = 0.02  # the spread of a qwen2moe file's q/k/v biases


@functools.cache
def moe_block_class() -> Any:
    """A block of a mixture-of-experts architecture (qwen3moe, qwen2moe): tinygrad's attention (with per-head q/k norm
    or q/k/v biases where the architecture has them); a MoE block computes only its part before the routed experts
    (``pre``), a dense block the whole block with the fp16 boundary."""
    from tinygrad import nn
    from tinygrad.apps.llm import TransformerBlock
    from tinygrad.tensor import Tensor

    class Vector:
        def __init__(self, n: int):
            self.weight = Tensor.zeros(n)

    class MoEBlock(TransformerBlock):
        def __init__(self, cfg: ModelConfig, max_context: int, routed: bool):
            super().__init__(*block_args(cfg, max_context), qk_norm=cfg.qk_norm)
            self.routed = routed
            if cfg.qkv_bias:
                self.attn_q = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=True)
                self.attn_k = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=True)
                self.attn_v = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=True)
            if routed:
                del self.ffn_gate, self.ffn_up, self.ffn_down
                self.ffn_gate_inp = nn.Linear(cfg.dim, cfg.experts, bias=False)
                self.shared = bool(cfg.shared_ffn)
                if self.shared:
                    self.ffn_gate_inp_shexp = Vector(cfg.dim)
                    self.ffn_gate_shexp = nn.Linear(cfg.dim, cfg.shared_ffn, bias=False)
                    self.ffn_up_shexp = nn.Linear(cfg.dim, cfg.shared_ffn, bias=False)
                    self.ffn_down_shexp = nn.Linear(cfg.shared_ffn, cfg.dim, bias=False)

        def __call__(self, x: Tensor, start_pos: int | UOp | Rows) -> Tensor:
            return self._feed_forward(self._attention(x, start_pos)).cast("float16").contiguous()

        def _attention(self, x: Tensor, start_pos: int | UOp | Rows) -> Tensor:
            if isinstance(start_pos, Rows):  # a batch of decode rows, each at its own position
                return attention_rows(self, x, start_pos)
            out: Tensor = super()._attention(x, start_pos)
            return out

        def pre(self, x: Tensor, start_pos: int | UOp | Rows) -> tuple[Tensor, ...]:
            """Attention and what precedes the routed experts: the residual (fp32), the normed input of the experts
            (fp16), the router's logits (fp32), and with a shared expert its gated output (fp32)."""
            return self.moe_inputs(self._attention(x, start_pos))

        def moe_inputs(self, h: Tensor) -> tuple[Tensor, ...]:
            """From the residual ``h`` after attention: ``pre``'s outputs. The norm, the router and the shared
            expert's gate compute in fp32 from their fp32 weights (``QwenMoE.f32_tensors``), as llama.cpp does; the
            experts read the normed input rounded to fp16, as llama.cpp's fp16 matmuls round it."""
            normed = self.ffn_norm(h.float()).contiguous()  # (B,T,D) fp32
            half = normed.cast("float16").contiguous()
            out = [h.float().contiguous(), half, self.ffn_gate_inp(normed).contiguous()]
            if self.shared:
                gate = (normed * self.ffn_gate_inp_shexp.weight).sum(-1, keepdim=True).sigmoid()  # (B,T,1) fp32
                act = cast(Any, self.ffn_gate_shexp(half)).silu().contiguous()  # silu is unannotated
                y = self.ffn_down_shexp(act * self.ffn_up_shexp(half))
                out.append((y.float() * gate).contiguous())
            return tuple(out)

    return MoEBlock


def write_experts(spec: SyntheticSpec, i: int, out: TensorSink) -> None:
    """Block ``i``'s router and experts, as llama.cpp names them: the router ``ffn_gate_inp`` (F32, as llama.cpp's
    converter keeps it), the stacked routed experts ``ffn_{gate,up,down}_exps`` and, for qwen2moe, the shared
    expert ``ffn_*_shexp`` with its gate. Router rows are scaled by a seeded log-normal factor so that some experts
    are chosen more often than others, as in trained models."""
    lin, e, d, f, rng = 1.0 / np.sqrt(spec.dim), spec.experts, spec.dim, spec.expert_ffn, out.rng
    hot = np.exp(rng.standard_normal((e, 1), dtype=np.float32) * 0.5)
    router = (rng.standard_normal((e, d), dtype=np.float32) * lin * hot).astype(np.float32)
    out.add(f"blk.{i}.ffn_gate_inp.weight", router)
    out.matrix(f"blk.{i}.ffn_gate_exps.weight", out.rand(e, f, d, std=lin))
    out.matrix(f"blk.{i}.ffn_up_exps.weight", out.rand(e, f, d, std=lin))
    out.matrix(f"blk.{i}.ffn_down_exps.weight", out.rand(e, d, f, std=1.0 / np.sqrt(f)))
    if spec.shared_ffn:
        s = spec.shared_ffn
        out.add(f"blk.{i}.ffn_gate_inp_shexp.weight", out.vector(d, lin))
        out.matrix(f"blk.{i}.ffn_gate_shexp.weight", out.rand(s, d, std=lin))
        out.matrix(f"blk.{i}.ffn_up_shexp.weight", out.rand(s, d, std=lin))
        out.matrix(f"blk.{i}.ffn_down_shexp.weight", out.rand(d, s, std=1.0 / np.sqrt(s)))


class QwenMoE(Architecture):
    moe = True
    f32_tensors = ("ffn_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
    # both blocks read query/key norms, q/k/v biases and a gated shared expert where the file has them
    block_parts = (
        ATTENTION_PARTS
        | FFN_PARTS
        | {"attn_q_norm.weight", "attn_k_norm.weight", "attn_q.bias", "attn_k.bias", "attn_v.bias"}
        | {f"ffn_{p}_exps.weight" for p in ("gate", "up", "down")}
        | {f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")}
        | {"ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"}
    )

    def __init__(self, name: str, renormalise: bool, qk_norm: bool, qkv_bias: bool, shared: bool) -> None:
        self.name, self.renormalise = name, renormalise
        self.qk_norm, self.qkv_bias, self.shared = qk_norm, qkv_bias, shared

    def check(self, spec: SyntheticSpec) -> None:
        check_experts(spec)
        check_no_mla(spec)
        check_no_rope_factors(spec)
        if not self.shared:
            check_no_shared_ffn(spec)

    def block_tensors(self, spec: SyntheticSpec, i: int) -> dict[str, Shape]:
        d, e, f, b = spec.dim, spec.experts, spec.expert_ffn, f"blk.{i}."
        out = qwen_attention_tensors(spec, i, self.qk_norm, self.qkv_bias)
        out[b + "ffn_norm.weight"] = (d,)
        out[b + "ffn_gate_inp.weight"] = (e, d)
        out[b + "ffn_gate_exps.weight"] = (e, f, d)
        out[b + "ffn_up_exps.weight"] = (e, f, d)
        out[b + "ffn_down_exps.weight"] = (e, d, f)
        if s := spec.shared_ffn:
            out[b + "ffn_gate_inp_shexp.weight"] = (d,)
            out[b + "ffn_gate_shexp.weight"] = (s, d)
            out[b + "ffn_up_shexp.weight"] = (s, d)
            out[b + "ffn_down_shexp.weight"] = (d, s)
        return out

    def write_keys(self, spec: SyntheticSpec, w: Any) -> None:
        write_rope_keys(spec, w)
        write_expert_keys(spec, w)

    def write_block(self, spec: SyntheticSpec, i: int, out: TensorSink) -> None:
        write_qwen_attention(spec, i, out, self.qk_norm, self.qkv_bias, MOE_BIAS_STD)
        out.add(f"blk.{i}.ffn_norm.weight", out.norm(spec.dim))
        write_experts(spec, i, out)

    def block(self, cfg: ModelConfig, max_context: int, layer: int) -> Any:
        if not cfg.moe:
            return dense_block(cfg, max_context)
        return moe_block_class()(cfg, max_context, layer in cfg.moe_blocks)


QWEN3MOE = QwenMoE("qwen3moe", renormalise=True, qk_norm=True, qkv_bias=False, shared=False)
QWEN2MOE = QwenMoE("qwen2moe", renormalise=False, qk_norm=False, qkv_bias=True, shared=True)
