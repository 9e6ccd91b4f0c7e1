"""The llama-family block on tinygrad: tinygrad's ``TransformerBlock`` whose projections are ``Linear``s over the
file's weight formats and whose output is an fp16 buffer (the block boundary of ``ppharness.model.engine.slicing``),
its attention in every shape a step asks for (``ppharness.model.layers.attention``) and its feed-forward part.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ppharness.model.layers.attention import Chunk, attention_chunk, attention_rows, rope_table
from ppharness.model.layers.linear import DecodeLinear
from ppharness.model.layers.rows import Rows

if TYPE_CHECKING:
    from tinygrad.apps.llm import TransformerBlock
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp

    from ppharness.model.gguf.config import ModelConfig


@functools.cache
def block_class() -> type[TransformerBlock]:
    """tinygrad's llama block whose output is an fp16 buffer: the block boundary of ``ppharness.model.engine.slicing``.
    Its projections are ``DecodeLinear``s; with ``rope_factors`` its rotary frequencies are divided by them."""
    from tinygrad.apps.llm import TransformerBlock, apply_rope

    class Block(TransformerBlock):
        rope_factors: tuple[float, ...] = ()

        def __init__(self, *args: Any, rope_factors: tuple[float, ...] = ()):
            super().__init__(*args)
            self.rope_factors = rope_factors
            for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
                setattr(self, name, DecodeLinear(getattr(self, name)))

        def __call__(self, x: Tensor, start_pos: int | UOp | Rows | Chunk) -> Tensor:
            if isinstance(start_pos, Rows):  # a batch of decode rows: every intermediate in a buffer of its own
                return feed_forward_rows(self, attention_rows(self, x, start_pos)).cast("float16").contiguous()
            return self._feed_forward(self._attention(x, start_pos)).cast("float16").contiguous()

        def _attention(self, x: Tensor, start_pos: int | UOp | Rows | Chunk) -> Tensor:
            if isinstance(start_pos, Rows):  # a batch of decode rows, each at its own position
                return attention_rows(self, x, start_pos)
            if isinstance(start_pos, Chunk):  # a prefill chunk at a bound position
                return attention_chunk(self, x, start_pos)
            if not self.rope_factors:
                return super()._attention(x, start_pos)
            return self._attention_with(x, start_pos)

        def _attention_with(self, x: Tensor, start_pos: int | UOp) -> Tensor:
            """tinygrad's attention with this block's rotary table (``rope_table``)."""
            from tinygrad.tensor import Tensor

            normed = self.attn_norm(x)
            q, k, v = self.attn_q(normed), self.attn_k(normed), self.attn_v(normed)
            b, t, _ = x.shape
            q = q.reshape(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B,H,T,Hd)
            k = k.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B,KvH,T,Hd)
            v = v.reshape(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
            table = rope_table(self.head_dim, self.max_context, self.rope_theta, self.rope_factors)
            freqs_cis = table[start_pos : start_pos + t]  # a UOp position slices too
            q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
            if not hasattr(self, "cache_kv"):
                shape = (2, b, self.n_kv_heads, self.max_context, self.head_dim)
                self.cache_kv = Tensor.zeros(*shape, dtype=k.dtype, device=k.device).contiguous().realize()
            self.cache_kv[:, :, :, start_pos : start_pos + t, :].assign(Tensor.stack(k, v)).realize()
            k = self.cache_kv[0, :, :, 0 : start_pos + t, :]
            v = self.cache_kv[1, :, :, 0 : start_pos + t, :]
            mask = (
                Tensor.full((1, 1, t, start_pos + t), float("-inf"), dtype=x.dtype, device=x.device).triu(start_pos + 1)
                if t > 1
                else None
            )
            attn = q.scaled_dot_product_attention(k, v, attn_mask=mask, enable_gqa=True)  # (B,H,T,Hd)
            out: Tensor = x + self.attn_output(attn.transpose(1, 2).reshape(b, t, -1))
            return out

    return Block


def feed_forward_rows(block: Any, h: Tensor) -> Tensor:
    """tinygrad's ``TransformerBlock._feed_forward`` for a batch of decode rows, the norm's output in a buffer of its
    own. Left lazy, a norm is fused into the products that read it at some batch widths and not at others (tinygrad
    schedules by shape), and a fused one is not rounded where a stored one is: a row's bits then depended on how many
    rows ran beside it (a Q4_1 projection: 1 row against 2)."""
    h_norm = block.ffn_norm(h).contiguous()
    gated = block.ffn_gate(h_norm).silu().contiguous() * block.ffn_up(h_norm)
    out: Tensor = h + block.ffn_down(gated)
    return out


def block_args(cfg: ModelConfig, max_context: int) -> tuple[int, int, int, int, float, int, float, int]:
    """tinygrad's ``TransformerBlock`` arguments for ``cfg``'s dimensions, in its order."""
    return (cfg.dim, cfg.ffn, cfg.heads, cfg.kv_heads, cfg.norm_eps, cfg.head_dim, cfg.rope_theta, max_context)


def dense_block(cfg: ModelConfig, max_context: int) -> Any:
    """A llama block of ``cfg``'s dimensions, with what the file has of Llama-3 rope factors, a per-head RMS norm of
    the queries and keys (qwen3) and biases on the query, key and value projections (qwen2)."""
    from tinygrad import nn

    block_type: Any = block_class()  # with factors, its constructor takes them beside tinygrad's arguments
    factors = {"rope_factors": cfg.rope_factors} if cfg.rope_factors else {}
    block = block_type(*block_args(cfg, max_context), cfg.qk_norm, **factors)
    if cfg.qkv_bias:
        q_rows, kv_rows = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        for name, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
            setattr(block, name, DecodeLinear(nn.Linear(cfg.dim, rows, bias=True)))
    return block
