"""Prefill in chunks of one size: a prompt of any length runs as consecutive steps of ``CHUNK`` positions, each one
replay of a step compiled once, before the first request (``ppharness.model.decoding.warm_up``). A warm stage's time
to first token is then the chunks' compute alone, whatever the prompt's length.

A chunk starts at position ``at`` (a bound variable of the step). Its rows attend over the block's whole cache with
every position after a row's own masked: a static shape, so one compiled step serves every ``at``. The last chunk
of a prompt is padded at its end (ids 0 on the first stage, zero rows after it); a padded row comes after every real
one, so causal attention keeps it out of every real row's sums, and its key and value land in cache positions that the
next decode step overwrites before it reads them. The last stage's head reads the last real row (``last``, a second
bound variable). What a real row computes is therefore the same bits whatever pads its chunk, which is why a split
model equals the unsplit one: each stage runs the same chunks, row for row.

Mixture-of-experts slices prefill as before (their prefill runs in pieces, uncompiled).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ppharness.errors import ModelError
from ppharness.model.batch import table_rows

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp

CHUNK_ENV = "PPHARNESS_PREFILL_CHUNK"
DEFAULT_CHUNK = 32


def chunk_size() -> int:
    """Positions per prefill chunk: $PPHARNESS_PREFILL_CHUNK, else 32. Every process of a run must use the same
    size (the chunks decide the kernels, and so the bits)."""
    raw = os.environ.get(CHUNK_ENV, "")
    if not raw:
        return DEFAULT_CHUNK
    try:
        size = int(raw)
    except ValueError:
        size = 0
    if not 1 <= size <= 4096:
        raise ModelError(f"{CHUNK_ENV}={raw!r}: expected a whole number of positions from 1 to 4096")
    return size


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

    from ppharness.model.arch.llama import heads_qkv, rotary_table  # the arch package imports this module's Chunk

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


class Prefill:
    """A dense slice's compiled prefill chunk (``ModelSlice.prefill``): ``run`` the positions of a prompt (ids on the
    first stage, a (1,T,D) hidden state after it) chunk by chunk in the slice's current request slot."""

    def __init__(self, model: Any) -> None:
        from tinygrad.engine.jit import TinyJit
        from tinygrad.uop.ops import UOp

        self.model = model
        self.size = min(chunk_size(), model.max_context)
        self.at = UOp.variable("chunk_at", 0, model.max_context - self.size)
        self.last = UOp.variable("chunk_last", 0, self.size - 1)
        self.jit = TinyJit(self._step)

    def _step(self, x: Tensor, at: UOp, last: UOp) -> Tensor | tuple[Tensor, ...]:
        m, taps = self.model, []
        if m.first:
            x = m.token_embd(x).cast("float16").contiguous()  # (1,C) ids -> (1,C,D)
        for block in m.blk:
            x = block(x, Chunk(at))
            taps.append(x)
        out = m.output(m.output_norm(x[:, last : last + 1, :]))[:, -1, :].argmax(-1) if m.last else x
        return (out, *taps) if m.taps else out

    @property
    def compiled(self) -> bool:
        return self.jit.captured is not None

    def warm(self) -> None:
        """Compile and capture the chunk step (in the slice's current slot: the caller picks the scratch slot)."""
        from tinygrad.device import Device

        while self.jit.cnt < 3:  # the JIT runs its first call as it comes, captures on the second, replays after
            out, _ = self._call(self._pad([0] * self.size if self.model.first else None), 0, 0)
        cast(
            Any, Device[out.device]
        ).synchronize()  # done when it returns: a request that comes next does not wait for it

    def _pad(self, x: Any) -> Any:
        import numpy as np

        m, size = self.model, self.size
        if x is None:
            return np.zeros((1, size, m.config.dim), np.float16)
        if m.first:
            return list(x) + [0] * (size - len(x))
        return np.concatenate([x, np.zeros((1, size - x.shape[1], x.shape[2]), np.float16)], axis=1)

    def _call(self, x: Any, at: int, last: int) -> Any:
        m = self.model
        out = self.jit(m._input(x), self.at.bind(at), self.last.bind(last))
        if isinstance(out, tuple):  # with taps: the step's output, then every block's
            out, *taps = out
            return out, [t.numpy() for t in taps]
        return out, []

    def run(self, x: Any) -> tuple[Any, list[Any]]:
        """The prompt's output (the last stage: its next token id; else (1,T,D) fp16) and, with taps, every block's
        output (1,T,D) over the whole prompt."""
        import numpy as np

        m = self.model
        length = len(x) if m.first else int(x.shape[1])
        if not 0 < length < m.max_context:
            raise ModelError(f"a prompt of {length} positions does not fit the context of {m.max_context}")
        outs: list[Any] = []
        taps: list[list[Any]] = []
        done = 0
        out: Any = None
        while done < length:
            # the chunk's start: the next position, moved back where a whole chunk would pass the cache's end (its
            # first rows then compute again what is already cached)
            start = min(done, m.max_context - self.size)
            end = min(start + self.size, length)
            part = x[start:end] if m.first else x[:, start:end]
            out, tapped = self._call(self._pad(part), start, end - 1 - start)
            new = slice(done - start, end - start)
            if not m.last:
                outs.append(out.numpy()[:, new])
            if tapped:
                taps.append([t[:, new] for t in tapped])
            done = end
        result = int(out.item()) if m.last else np.concatenate(outs, axis=1)
        return result, [np.concatenate(parts, axis=1) for parts in zip(*taps)] if taps else []
