"""``qwen2`` and ``qwen3``: the dense Qwen architectures, llama's block with Qwen's attention.

- ``qwen2`` (Qwen2, Qwen2.5): biases on the query, key and value projections (``attn_q.bias``, ``attn_k.bias``,
  ``attn_v.bias``), none on the output projection.
- ``qwen3``: an RMS norm over each head's queries and keys (``attn_q_norm``, ``attn_k_norm``, one weight of the head's
  width shared by every head, the file's epsilon) after the projections and before the rotation; no biases. Its head
  width is the file's ``attention.key_length``, which need not be ``embedding_length / head_count`` (Qwen3-0.6B: 16
  heads of 128 in a width of 1024), so the query projection and the output projection are ``heads * key_length``
  wide.

Everything else is llama's: RMS norms before attention and the SwiGLU feed-forward part, grouped-query attention
scaled by ``1/sqrt(head_dim)``, the final norm and the head (``token_embd`` where the file ties them). Both rotate as
llama.cpp's ``LLAMA_ROPE_TYPE_NEOX``, the pair ``(x[i], x[i + head_dim/2])``, HF's ``rotate_half``: llama.cpp's
converter stores Qwen's query and key rows as HF has them (unlike llama's, not permuted), and tinygrad's block rotates
the two halves, so the rows are used as the file stores them. Neither graph reads ``rope_freqs.weight``; a file with
one is refused (``ppharness.model.support``). The block is llama's (``ppharness.model.layers.block.dense_block``), with
the norms and biases the file has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppharness.errors import ModelError
from ppharness.model.arch.base import (
    Architecture,
    Shape,
    SyntheticSpec,
    TensorSink,
    check_no_mla,
    check_no_rope_factors,
    check_no_shared_ffn,
)
from ppharness.model.arch.llama import (
    ATTENTION_PARTS,
    FFN_PARTS,
    attention_tensors,
    ffn_tensors,
    write_attention,
    write_ffn,
    write_rope_keys,
)
from ppharness.model.layers.block import dense_block

if TYPE_CHECKING:
    from ppharness.model.gguf.config import ModelConfig

QK_NORM_PARTS = frozenset({"attn_q_norm.weight", "attn_k_norm.weight"})
QKV_BIAS_PARTS = frozenset({"attn_q.bias", "attn_k.bias", "attn_v.bias"})
# the spread of a dense qwen2 file's q/k/v biases: half that of the projections' outputs (about 1), so that a model
# computed without them answers differently (``tests/test_reference_model.py`` checks that it is caught)
QKV_BIAS_STD = 0.5


def qwen_attention_tensors(spec: SyntheticSpec, i: int, qk_norm: bool, qkv_bias: bool) -> dict[str, Shape]:
    """Block ``i``'s attention norm and projections, with the per-head query and key norms and the q/k/v biases."""
    hd, b = spec.hd, f"blk.{i}."
    out = attention_tensors(spec, i)
    if qk_norm:
        out[b + "attn_q_norm.weight"] = (hd,)
        out[b + "attn_k_norm.weight"] = (hd,)
    if qkv_bias:
        out[b + "attn_q.bias"] = (spec.heads * hd,)
        out[b + "attn_k.bias"] = (spec.kv_heads * hd,)
        out[b + "attn_v.bias"] = (spec.kv_heads * hd,)
    return out


def write_qwen_attention(
    spec: SyntheticSpec, i: int, out: TensorSink, qk_norm: bool, qkv_bias: bool, bias_std: float
) -> None:
    """``qwen_attention_tensors``' weights: llama's, then the norms (about 1, F32) and the biases (F32, normal of
    spread ``bias_std``)."""
    write_attention(spec, i, out)
    if qk_norm:
        out.add(f"blk.{i}.attn_q_norm.weight", out.norm(spec.hd))
        out.add(f"blk.{i}.attn_k_norm.weight", out.norm(spec.hd))
    if qkv_bias:
        for name, n in (("q", spec.heads), ("k", spec.kv_heads), ("v", spec.kv_heads)):
            out.add(f"blk.{i}.attn_{name}.bias", out.vector(n * spec.hd, bias_std))


class DenseQwen(Architecture):
    def __init__(self, name: str, qk_norm: bool, qkv_bias: bool) -> None:
        self.name, self.qk_norm, self.qkv_bias = name, qk_norm, qkv_bias
        # llama.cpp's graphs: qwen3 requires its norms and takes q/k/v biases where the file has them; qwen2 has no
        # norms
        self.block_parts = ATTENTION_PARTS | FFN_PARTS | QKV_BIAS_PARTS | (QK_NORM_PARTS if qk_norm else frozenset())

    def check(self, spec: SyntheticSpec) -> None:
        if spec.experts or spec.experts_used:
            moe = "qwen3moe" if self.qk_norm else "qwen2moe"
            raise ModelError(f"{self.name} is dense: experts need arch={moe}")
        check_no_mla(spec)
        check_no_rope_factors(spec)
        check_no_shared_ffn(spec)

    def block_tensors(self, spec: SyntheticSpec, i: int) -> dict[str, Shape]:
        return qwen_attention_tensors(spec, i, self.qk_norm, self.qkv_bias) | ffn_tensors(spec, i)

    def write_keys(self, spec: SyntheticSpec, w: Any) -> None:
        write_rope_keys(spec, w)

    def write_block(self, spec: SyntheticSpec, i: int, out: TensorSink) -> None:
        write_qwen_attention(spec, i, out, self.qk_norm, self.qkv_bias, QKV_BIAS_STD)
        write_ffn(spec, i, out)

    def block(self, cfg: ModelConfig, max_context: int, layer: int) -> Any:
        return dense_block(cfg, max_context)


QWEN2 = DenseQwen("qwen2", qk_norm=False, qkv_bias=True)
QWEN3 = DenseQwen("qwen3", qk_norm=True, qkv_bias=False)
