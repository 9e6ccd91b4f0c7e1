"""Attention on tinygrad for the llama-family blocks, in every shape a step asks for: tinygrad's own for one position,
a batch of decode rows each at its own position (``attention_rows``), a speculative window's rows in one slot
(``window_attention``) and a prefill chunk at a bound position (``attention_chunk``); the rotary tables they share.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ppharness.model.layers.rows import Rows, place, rope_rows, slot_view, table_rows

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp


@functools.cache
def rope_table(head_dim: int, end: int, theta: float, factors: tuple[float, ...]) -> Tensor:
    """(end, head_dim) cos | sin of every position's rotary angles, as tinygrad's ``precompute_freqs_cis``, each
    pair's frequency divided by its factor (ggml's ``rope`` with ``freq_factors``)."""
    from tinygrad.tensor import Tensor

    freqs = 1.0 / (theta ** (Tensor.arange(0, head_dim, 2)[: head_dim // 2] / head_dim))
    freqs = freqs / Tensor(list(factors), dtype="float32")
    angles = Tensor.arange(end).unsqueeze(dim=1) * freqs.unsqueeze(dim=0)
    table: Tensor = angles.cos().cat(angles.sin(), dim=-1).contiguous()
    return table


def rotary_table(block: Any) -> Tensor:
    """The block's rotary table (context, head dim), as its own attention computes it: tinygrad's, or with Llama-3
    factors ``rope_table``'s."""
    from tinygrad.apps.llm import precompute_freqs_cis

    factors = getattr(block, "rope_factors", ())
    if factors:
        return rope_table(block.head_dim, block.max_context, block.rope_theta, factors)
    table: Tensor = precompute_freqs_cis(block.head_dim, block.max_context, block.rope_theta)
    return table


def heads_qkv(block: Any, x: Tensor, own: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """A llama-family block's queries, keys and values of ``x`` (B,T,D), split into heads as tinygrad's
    ``TransformerBlock._attention`` splits them: (B,H,T,Hd), (B,KvH,T,Hd), (B,KvH,T,Hd), the optional q/k norms
    applied where it applies them (over the projection's width, or over each head's). ``own``: the norm's output
    in a buffer of its own (``feed_forward_rows`` says why)."""
    b, t, h, kvh, hd = int(x.shape[0]), int(x.shape[1]), block.n_heads, block.n_kv_heads, block.head_dim
    x_norm = block.attn_norm(x).contiguous() if own else block.attn_norm(x)
    q, k, v = block.attn_q(x_norm), block.attn_k(x_norm), block.attn_v(x_norm)
    if block.qk_norm and block.qk_norm != hd:
        q, k = block.attn_q_norm(q), block.attn_k_norm(k)
    q = q.reshape(b, t, h, hd).transpose(1, 2)
    k = k.reshape(b, t, kvh, hd).transpose(1, 2)
    v = v.reshape(b, t, kvh, hd).transpose(1, 2)
    if block.qk_norm == hd:
        q, k = block.attn_q_norm(q), block.attn_k_norm(k)
    return q, k, v


def attention_rows(block: Any, x: Tensor, rows: Rows) -> Tensor:
    """A llama-family block's attention (tinygrad's ``TransformerBlock._attention``: norm, projections, optional
    q/k norms, rotary embedding, cache, grouped-query attention, output projection, residual) for a batch of decode
    rows: ``x`` (W,1,D), row r in slot r at ``rows.pos[r]`` (``ppharness.model.layers.rows``: why each row's bytes are
    its request's alone)."""
    from tinygrad.dtype import dtypes
    from tinygrad.tensor import Tensor

    w, h, kvh, hd = int(x.shape[0]), block.n_heads, block.n_kv_heads, block.head_dim
    q, k, v = heads_qkv(block, x, own=True)  # (W,H,1,Hd), (W,KvH,1,Hd) twice
    # buffers of their own: left lazy, the per-head q/k norms (qwen3) fused into the rotary kernel at some widths and
    # not others, and a row's queries came out other bits at 8 rows than at 4
    q, k = q.contiguous(), k.contiguous()
    cos_sin = rows.at_positions(rotary_table(block)).contiguous()  # once, not inside every kernel that reads it
    q, k = rope_rows(q, cos_sin).contiguous(), rope_rows(k, cos_sin).contiguous()
    cache = cast("Tensor", block.slot_cache)  # (2, slots, KvH, context, Hd)
    ctx, g = int(cache.shape[3]), h // kvh
    # the new key and value at each row's own position, the rest of the batch's slots rewritten unchanged (a static
    # shape: every axis but the context merges into one); a window's rows all in its one slot
    view = slot_view(cache, rows, 1)
    new = Tensor.stack(k, v).cast(cache.dtype).contiguous()  # (2,W,KvH,1,Hd)
    here = Tensor.arange(ctx).reshape(1, 1, 1, ctx, 1) == rows.pos.reshape(1, w, 1, 1, 1)
    view.assign(place(rows, view, new, here, 1)).realize()
    length = cast(int, rows.length)
    if rows.slot is not None:
        attn = window_attention(rows, q, cache, kvh, g, hd)
    else:
        # each row over [0, L), the positions after its own masked: rows and KV heads one axis, a KV head's queries
        # the next
        cached = slot_view(cache, rows, 1)[:, :, :, 0:length, :]  # (2,W,KvH,L,Hd)
        keys = cached[0].reshape(w * kvh, -1, hd)  # (W*KvH, L, Hd)
        values = cached[1].reshape(w * kvh, -1, hd)
        qg = q.reshape(w * kvh, g, hd)  # query head j of KV head i is head i*G + j (tinygrad's repeat_interleave)
        scores = qg.matmul(keys.transpose(-2, -1), dtype=dtypes.float32) / math.sqrt(hd)  # (W*KvH, G, L)
        seen = rows.seen().reshape(w, 1, 1, -1).expand(w, kvh, g, -1).reshape(w * kvh, g, -1)
        scores = scores + seen.where(0.0, -math.inf)
        # as scaled_dot_product_attention computes it; the weights in a buffer of their own (``feed_forward_rows``:
        # fused into the product, they came out other bits in a window)
        attn = (scores.cast(q.dtype).softmax(-1).contiguous() @ values).reshape(w, 1, h * hd)  # (W*KvH, G, Hd)
    out: Tensor = x + block.attn_output(attn)
    return out


def window_attention(rows: Rows, q: Tensor, cache: Tensor, kvh: int, g: int, hd: int) -> Tensor:
    """A speculative window's attention (its rows all in one slot): per KV head, the window's rows and that head's
    queries one axis, over the slot's keys and values [0, L), each row's positions after its own masked. Three axes
    in every kernel, as in a row's (a symbolic length among four is more than CUDA's grid takes), and each sum in the
    same order as a row's alone: the (W, L) (1, L) products differ only in which outputs they hold. (W,1,H*Hd)."""
    from tinygrad.dtype import dtypes
    from tinygrad.tensor import Tensor

    w = rows.width
    cached = slot_view(cache, rows, 1)[:, :, :, 0 : cast(int, rows.length), :].reshape(2, kvh, -1, hd)  # (2,KvH,L,Hd)
    # the queries and each query's row position laid out per KV head in buffers of their own (no kernel that reads
    # the symbolic length splits the rows from the heads again)
    qg = q.reshape(w, kvh, g, hd).permute(1, 0, 2, 3).reshape(kvh, w * g, hd).contiguous()  # (KvH, W*G, Hd)
    at = rows.pos.reshape(w, 1).expand(w, g).reshape(w * g).contiguous()  # (W*G,) each query's row's position
    scores = qg.matmul(cached[0].transpose(-2, -1), dtype=dtypes.float32) / math.sqrt(hd)  # (KvH, W*G, L)
    seen = Tensor.arange(cast(int, rows.length)).reshape(1, 1, -1) <= at.reshape(1, -1, 1)  # (1, W*G, L)
    scores = scores + seen.where(0.0, -math.inf)
    attn = scores.cast(q.dtype).softmax(-1).contiguous() @ cached[1]  # (KvH, W*G, Hd)
    out: Tensor = attn.reshape(kvh, w, g, hd).permute(1, 0, 2, 3).reshape(w, 1, kvh * g * hd)
    return out


@dataclass(frozen=True)
class Chunk:
    """A block's start position for one prefill chunk: its first position ``at``, a bound variable."""

    at: UOp


def causal(at: UOp, rows: int, context: int, heads: int = 1) -> Tensor:
    """(heads * rows, context) bool: row r (row r % rows of a chunk starting at ``at``, for each of ``heads`` query
    heads in turn) sees cache position j when j <= at + r % rows."""
    from tinygrad.tensor import Tensor

    j = Tensor.arange(context).reshape(1, context)
    i = (Tensor.arange(heads * rows) % rows).reshape(heads * rows, 1)
    seen: Tensor = j <= i + cast(Any, at)  # a bound variable adds to a tensor like a number
    return seen


def attention_chunk(block: Any, x: Tensor, chunk: Chunk) -> Tensor:
    """A llama-family block's attention (tinygrad's ``TransformerBlock._attention``: norm, projections, optional q/k
    norms, rotary embedding, cache, grouped-query attention, output projection, residual) for one prefill chunk:
    ``x`` (1,C,D) at positions [at, at + C), attending over the whole cache with later positions masked."""
    from tinygrad.apps.llm import apply_rope
    from tinygrad.tensor import Tensor

    b, t = int(x.shape[0]), int(x.shape[1])
    h, kvh, hd = block.n_heads, block.n_kv_heads, block.head_dim
    q, k, v = heads_qkv(block, x)  # (B,H,C,Hd), (B,KvH,C,Hd) twice
    # the chunk's rows of the rotary table gathered: sliced at a bound position, the table's own kernel would be
    # symbolic in its length
    freqs_cis = table_rows(rotary_table(block), Tensor.arange(t) + cast(Any, chunk.at))  # (C, Hd): cos | sin
    q, k = apply_rope(q, freqs_cis), apply_rope(k, freqs_cis)
    if not hasattr(block, "cache_kv"):
        shape = (2, b, kvh, block.max_context, hd)
        block.cache_kv = Tensor.zeros(*shape, dtype=k.dtype, device=k.device).contiguous().realize()
    # the chunk's keys and values written at [at, at + C) of a static view of the whole cache: each position takes
    # its row by a one-hot product (one nonzero term: the value itself) where it is in the chunk, else keeps its own
    ctx = int(block.cache_kv.shape[3])
    pos = Tensor.arange(ctx).reshape(ctx, 1)
    onehot = pos == Tensor.arange(t).reshape(1, t) + cast(Any, chunk.at)  # (context, C)
    placed = onehot.cast(k.dtype).matmul(Tensor.stack(k, v))  # (2,B,KvH,context,Hd)
    inside = onehot.max(-1).reshape(1, 1, 1, ctx, 1)
    block.cache_kv.assign(inside.where(placed, block.cache_kv)).realize()
    span = chunk.at + t  # the positions up to the chunk's last: a symbolic length
    # batch and KV heads one axis, a KV head's queries for every row the next: three axes, one of them symbolic
    keys = block.cache_kv[0, :, :, 0:span, :].reshape(b * kvh, -1, hd)  # (B*KvH, S, Hd)
    values = block.cache_kv[1, :, :, 0:span, :].reshape(b * kvh, -1, hd)
    g = h // kvh
    qg = q.reshape(b * kvh, g * t, hd)  # query head j of KV head i is head i*G + j (tinygrad's repeat_interleave)
    scores = qg.matmul(keys.transpose(-2, -1)) / math.sqrt(hd)  # (B*KvH, G*C, S)
    seen = causal(chunk.at, t, ctx, g).reshape(1, g * t, ctx)[:, :, 0:span]
    # masked with where, not added: a masked position's cache holds whatever an earlier request left there
    attn = seen.where(scores, -math.inf).softmax(-1) @ values  # (B*KvH, G*C, Hd)
    attn = attn.reshape(b, h, t, hd).transpose(1, 2).reshape(b, t, h * hd)
    out: Tensor = x + block.attn_output(attn)
    return out
