"""``llama``: the dense architecture. Every block is attention (``attn_q``, ``attn_k``, ``attn_v``, ``attn_output``)
and a SwiGLU feed-forward part (``ffn_gate``, ``ffn_up``, ``ffn_down``), each after its RMS norm; the block on
tinygrad is tinygrad's own llama block with an fp16 output buffer (the block boundary of
``ppharness.model.slicing``).

llama.cpp's converter stores a llama file's query and key rows interleaved for its rotary embedding; tinygrad's block
rotates the two halves, so the rows are reordered on reading (``file_tensor``), as tinygrad's
``Transformer.from_gguf`` does. A dense model of an architecture not registered here (``DENSE``) computes with the
same block, its rows as the file stores them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from ppharness.errors import ModelError
from ppharness.model.arch.base import BLOCK_TENSOR, Architecture, Shape, check_no_mla
from ppharness.model.direct import DecodeLinear

if TYPE_CHECKING:
    from numpy.typing import NDArray
    from tinygrad.apps.llm import TransformerBlock
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp

    from ppharness.model.config import ModelConfig
    from ppharness.model.spec import ModelSpec
    from ppharness.model.synthetic import TensorWriter


@functools.cache
def block_class() -> type[TransformerBlock]:
    """tinygrad's llama block whose output is an fp16 buffer: the block boundary of ``ppharness.model.slicing``. Its
    projections are ``DecodeLinear``s."""
    from tinygrad.apps.llm import TransformerBlock

    class Block(TransformerBlock):
        def __init__(self, *args: Any):
            super().__init__(*args)
            for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
                setattr(self, name, DecodeLinear(getattr(self, name)))

        def __call__(self, x: Tensor, start_pos: int | UOp) -> Tensor:
            return self._feed_forward(self._attention(x, start_pos)).cast("float16").contiguous()

    return Block


def dense_block(cfg: ModelConfig, max_context: int) -> Any:
    """A llama block of ``cfg``'s dimensions."""
    return block_class()(
        cfg.dim, cfg.ffn, cfg.heads, cfg.kv_heads, cfg.norm_eps, cfg.head_dim, cfg.rope_theta, max_context
    )


def attention_tensors(spec: ModelSpec, i: int) -> dict[str, Shape]:
    """Block ``i``'s attention norm and projections."""
    d, h, hd, b = spec.dim, spec.heads, spec.hd, f"blk.{i}."
    return {
        b + "attn_norm.weight": (d,),
        b + "attn_q.weight": (h * hd, d),
        b + "attn_k.weight": (spec.kv_heads * hd, d),
        b + "attn_v.weight": (spec.kv_heads * hd, d),
        b + "attn_output.weight": (d, h * hd),
    }


def write_attention(spec: ModelSpec, i: int, out: TensorWriter) -> None:
    """``attention_tensors``' weights: the norm F32, each projection scaled 1/sqrt(dim)."""
    hd, lin = spec.hd, 1.0 / np.sqrt(spec.dim)
    out.add(f"blk.{i}.attn_norm.weight", out.norm(spec.dim))
    out.matrix(f"blk.{i}.attn_q.weight", out.rand(spec.heads * hd, spec.dim, std=lin))
    out.matrix(f"blk.{i}.attn_k.weight", out.rand(spec.kv_heads * hd, spec.dim, std=lin))
    out.matrix(f"blk.{i}.attn_v.weight", out.rand(spec.kv_heads * hd, spec.dim, std=lin))
    out.matrix(f"blk.{i}.attn_output.weight", out.rand(spec.dim, spec.heads * hd, std=lin))


def write_rope_keys(spec: ModelSpec, w: Any) -> None:
    """The rotary width (a whole head) and, where the spec sets a head width, the key and value widths."""
    w.add_rope_dimension_count(spec.hd)
    if spec.head_dim:
        w.add_key_length(spec.hd)
        w.add_value_length(spec.hd)


class Llama(Architecture):
    def __init__(self, name: str, interleaved: bool) -> None:
        self.name = name
        self.interleaved = interleaved  # query and key rows stored interleaved for the rotary embedding

    def check(self, spec: ModelSpec) -> None:
        if spec.experts or spec.experts_used or spec.shared_ffn:
            raise ModelError(
                "experts need a mixture-of-experts architecture: arch=qwen3moe, arch=qwen2moe or arch=deepseek2"
            )
        check_no_mla(spec)

    def block_tensors(self, spec: ModelSpec, i: int) -> dict[str, Shape]:
        d, b = spec.dim, f"blk.{i}."
        out = attention_tensors(spec, i)
        out[b + "ffn_norm.weight"] = (d,)
        out[b + "ffn_gate.weight"] = (spec.ffn, d)
        out[b + "ffn_up.weight"] = (spec.ffn, d)
        out[b + "ffn_down.weight"] = (d, spec.ffn)
        return out

    def write_keys(self, spec: ModelSpec, w: Any) -> None:
        write_rope_keys(spec, w)

    def write_block(self, spec: ModelSpec, i: int, out: TensorWriter) -> None:
        lin = 1.0 / np.sqrt(spec.dim)
        write_attention(spec, i, out)
        out.add(f"blk.{i}.ffn_norm.weight", out.norm(spec.dim))
        out.matrix(f"blk.{i}.ffn_gate.weight", out.rand(spec.ffn, spec.dim, std=lin))
        out.matrix(f"blk.{i}.ffn_up.weight", out.rand(spec.ffn, spec.dim, std=lin))
        out.matrix(f"blk.{i}.ffn_down.weight", out.rand(spec.dim, spec.ffn, std=1.0 / np.sqrt(spec.ffn)))

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
DENSE = Llama("", interleaved=False)  # a dense llama-family model of an architecture not registered
