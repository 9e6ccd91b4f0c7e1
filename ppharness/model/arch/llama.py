"""``llama``: the dense architecture. Every block is attention (``attn_q``, ``attn_k``, ``attn_v``, ``attn_output``)
and a SwiGLU feed-forward part (``ffn_gate``, ``ffn_up``, ``ffn_down``), each after its RMS norm; the block on
tinygrad is tinygrad's own llama block with an fp16 output buffer (the block boundary of
``ppharness.model.engine.slicing``).

llama.cpp's converter stores a llama file's query and key rows interleaved for its rotary embedding; tinygrad's block
rotates the two halves, so the rows are reordered on reading (``file_tensor``), as tinygrad's
``Transformer.from_gguf`` does.

Llama 3.1/3.2 files carry ``rope_freqs.weight``, one factor per rotary pair, by which llama.cpp divides each pair's
frequency; a block of such a file rotates with them (``rope_table``), and the synthetic writer writes them for a spec
with ``rope_scaling="llama3"`` (``llama3_rope_factors``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ppharness.errors import ModelError
from ppharness.model.arch.base import Architecture, Shape, SyntheticSpec, TensorSink, check_no_mla
from ppharness.model.gguf.names import BLOCK_TENSOR, ROPE_FACTORS
from ppharness.model.layers.block import dense_block

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from ppharness.model.gguf.config import ModelConfig


LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR = 1.0, 4.0  # every Llama 3.1/3.2 config's
LLAMA3_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 32.0, 8192  # Llama-3.2's


def llama3_rope_factors(spec: SyntheticSpec) -> NDArray[np.float32]:
    """``rope_freqs.weight`` of ``spec`` as llama.cpp's converter computes it from a Llama 3.1/3.2 config's
    ``rope_scaling``: each rotary pair's wavelength ``2 pi / freq``; factor 1 below ``original / high``, ``factor``
    above ``original / low``, and between them ``1 / ((1 - s) / factor + s)`` with ``s = (original / wavelength - low)
    / (high - low)``."""
    factor = spec.rope_scaling_factor or LLAMA3_FACTOR
    original = spec.rope_original_context or LLAMA3_ORIGINAL_CONTEXT
    low, high = LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR
    freqs = 1.0 / (spec.rope_theta ** (np.arange(0, spec.hd, 2, dtype=np.float32) / spec.hd))
    out = []
    for freq in freqs:
        wavelength = 2 * math.pi / float(freq)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            s = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def attention_tensors(spec: SyntheticSpec, i: int) -> dict[str, Shape]:
    """Block ``i``'s attention norm and projections."""
    d, h, hd, b = spec.dim, spec.heads, spec.hd, f"blk.{i}."
    return {
        b + "attn_norm.weight": (d,),
        b + "attn_q.weight": (h * hd, d),
        b + "attn_k.weight": (spec.kv_heads * hd, d),
        b + "attn_v.weight": (spec.kv_heads * hd, d),
        b + "attn_output.weight": (d, h * hd),
    }


def write_attention(spec: SyntheticSpec, i: int, out: TensorSink) -> None:
    """``attention_tensors``' weights: the norm F32, each projection scaled 1/sqrt(dim)."""
    hd, lin = spec.hd, 1.0 / np.sqrt(spec.dim)
    out.add(f"blk.{i}.attn_norm.weight", out.norm(spec.dim))
    out.matrix(f"blk.{i}.attn_q.weight", out.rand(spec.heads * hd, spec.dim, std=lin))
    out.matrix(f"blk.{i}.attn_k.weight", out.rand(spec.kv_heads * hd, spec.dim, std=lin))
    out.matrix(f"blk.{i}.attn_v.weight", out.rand(spec.kv_heads * hd, spec.dim, std=lin))
    out.matrix(f"blk.{i}.attn_output.weight", out.rand(spec.dim, spec.heads * hd, std=lin))


def ffn_tensors(spec: SyntheticSpec, i: int) -> dict[str, Shape]:
    """Block ``i``'s feed-forward norm and SwiGLU projections."""
    d, b = spec.dim, f"blk.{i}."
    return {
        b + "ffn_norm.weight": (d,),
        b + "ffn_gate.weight": (spec.ffn, d),
        b + "ffn_up.weight": (spec.ffn, d),
        b + "ffn_down.weight": (d, spec.ffn),
    }


def write_ffn(spec: SyntheticSpec, i: int, out: TensorSink) -> None:
    """``ffn_tensors``' weights: the norm F32, gate and up scaled 1/sqrt(dim), down 1/sqrt(ffn)."""
    lin = 1.0 / np.sqrt(spec.dim)
    out.add(f"blk.{i}.ffn_norm.weight", out.norm(spec.dim))
    out.matrix(f"blk.{i}.ffn_gate.weight", out.rand(spec.ffn, spec.dim, std=lin))
    out.matrix(f"blk.{i}.ffn_up.weight", out.rand(spec.ffn, spec.dim, std=lin))
    out.matrix(f"blk.{i}.ffn_down.weight", out.rand(spec.dim, spec.ffn, std=1.0 / np.sqrt(spec.ffn)))


def write_rope_keys(spec: SyntheticSpec, w: Any) -> None:
    """The rotary width (a whole head) and, where the spec sets a head width, the key and value widths."""
    w.add_rope_dimension_count(spec.hd)
    if spec.head_dim:
        w.add_key_length(spec.hd)
        w.add_value_length(spec.hd)


ATTENTION_PARTS = frozenset(f"{p}.weight" for p in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output"))
FFN_PARTS = frozenset(f"{p}.weight" for p in ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down"))


class Llama(Architecture):
    global_tensors = Architecture.global_tensors | {ROPE_FACTORS}
    block_parts = ATTENTION_PARTS | FFN_PARTS

    def __init__(self, name: str, interleaved: bool) -> None:
        self.name = name
        self.interleaved = interleaved  # query and key rows stored interleaved for the rotary embedding

    def check(self, spec: SyntheticSpec) -> None:
        if spec.experts or spec.experts_used or spec.shared_ffn:
            raise ModelError(
                "experts need a mixture-of-experts architecture: arch=qwen3moe, arch=qwen2moe or arch=deepseek2"
            )
        check_no_mla(spec)
        if spec.rope_scaling not in ("", "llama3"):
            raise ModelError(f"rope_scaling {spec.rope_scaling!r}: expected llama3 or nothing")
        if not spec.rope_scaling and (spec.rope_scaling_factor or spec.rope_original_context):
            raise ModelError("rope_scaling_factor and rope_original_context need rope_scaling=llama3")

    def tensors(self, spec: SyntheticSpec) -> dict[str, Shape]:
        out = super().tensors(spec)
        if spec.rope_scaling:  # before the blocks, where llama.cpp's converter writes it
            out = {"token_embd.weight": out.pop("token_embd.weight"), ROPE_FACTORS: (spec.hd // 2,)} | out
        return out

    def block_tensors(self, spec: SyntheticSpec, i: int) -> dict[str, Shape]:
        return attention_tensors(spec, i) | ffn_tensors(spec, i)

    def write_keys(self, spec: SyntheticSpec, w: Any) -> None:
        write_rope_keys(spec, w)

    def write_block(self, spec: SyntheticSpec, i: int, out: TensorSink) -> None:
        if i == 0 and spec.rope_scaling:
            out.add(ROPE_FACTORS, llama3_rope_factors(spec))
        write_attention(spec, i, out)
        write_ffn(spec, i, out)

    def file_tensor(self, cfg: ModelConfig, name: str, arr: NDArray[np.float16]) -> NDArray[np.float16]:
        m = BLOCK_TENSOR.match(name)
        if not self.interleaved or m is None or m.group(2) not in ("attn_q.weight", "attn_k.weight"):
            return arr
        # interleaved -> half-split rotary layout, as tinygrad's Transformer.from_gguf does: (n h two) d -> (n two h) d
        n = cfg.heads if m.group(2) == "attn_q.weight" else cfg.kv_heads
        d = arr.shape[-1]
        return arr.reshape(n, -1, 2, d).transpose(0, 2, 1, 3).reshape(-1, d)

    def block(self, cfg: ModelConfig, max_context: int, layer: int) -> Any:
        return dense_block(cfg, max_context)


LLAMA = Llama("llama", interleaved=True)
