"""``llama``: the dense architecture. Every block is attention (``attn_q``, ``attn_k``, ``attn_v``, ``attn_output``)
and a SwiGLU feed-forward part (``ffn_gate``, ``ffn_up``, ``ffn_down``), each after its RMS norm; the block on
tinygrad is tinygrad's own llama block with an fp16 output buffer (the block boundary of
``ppharness.model.slicing``).

llama.cpp's converter stores a llama file's query and key rows interleaved for its rotary embedding; tinygrad's block
rotates the two halves, so the rows are reordered on reading (``file_tensor``), as tinygrad's
``Transformer.from_gguf`` does.

Llama 3.1/3.2 files carry ``rope_freqs.weight``, one factor per rotary pair, by which llama.cpp divides each pair's
frequency; a block of such a file rotates with them (``rope_table``), and the synthetic writer writes them for a spec
with ``rope_scaling="llama3"`` (``llama3_rope_factors``).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ppharness.errors import ModelError
from ppharness.model.arch.base import BLOCK_TENSOR, Architecture, Shape, check_no_mla
from ppharness.model.batch import Rows, place, rope_rows, slot_view
from ppharness.model.chunks import Chunk, attention_chunk
from ppharness.model.direct import DecodeLinear

if TYPE_CHECKING:
    from numpy.typing import NDArray
    from tinygrad.apps.llm import TransformerBlock
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp

    from ppharness.model.config import ModelConfig
    from ppharness.model.spec import ModelSpec
    from ppharness.model.synthetic import TensorWriter


LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR = 1.0, 4.0  # every Llama 3.1/3.2 config's
LLAMA3_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 32.0, 8192  # Llama-3.2's


def llama3_rope_factors(spec: ModelSpec) -> NDArray[np.float32]:
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


@functools.cache
def block_class() -> type[TransformerBlock]:
    """tinygrad's llama block whose output is an fp16 buffer: the block boundary of ``ppharness.model.slicing``. Its
    projections are ``DecodeLinear``s; with ``rope_factors`` its rotary frequencies are divided by them."""
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


def rotary_table(block: Any) -> Tensor:
    """The block's rotary table (context, head dim), as its own attention computes it: tinygrad's, or with Llama-3
    factors ``ppharness.model.arch.llama.rope_table``'s."""
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
    rows: ``x`` (W,1,D), row r in slot r at ``rows.pos[r]`` (``ppharness.model.batch``: why each row's bytes are
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


def ffn_tensors(spec: ModelSpec, i: int) -> dict[str, Shape]:
    """Block ``i``'s feed-forward norm and SwiGLU projections."""
    d, b = spec.dim, f"blk.{i}."
    return {
        b + "ffn_norm.weight": (d,),
        b + "ffn_gate.weight": (spec.ffn, d),
        b + "ffn_up.weight": (spec.ffn, d),
        b + "ffn_down.weight": (d, spec.ffn),
    }


def write_ffn(spec: ModelSpec, i: int, out: TensorWriter) -> None:
    """``ffn_tensors``' weights: the norm F32, gate and up scaled 1/sqrt(dim), down 1/sqrt(ffn)."""
    lin = 1.0 / np.sqrt(spec.dim)
    out.add(f"blk.{i}.ffn_norm.weight", out.norm(spec.dim))
    out.matrix(f"blk.{i}.ffn_gate.weight", out.rand(spec.ffn, spec.dim, std=lin))
    out.matrix(f"blk.{i}.ffn_up.weight", out.rand(spec.ffn, spec.dim, std=lin))
    out.matrix(f"blk.{i}.ffn_down.weight", out.rand(spec.dim, spec.ffn, std=1.0 / np.sqrt(spec.ffn)))


def write_rope_keys(spec: ModelSpec, w: Any) -> None:
    """The rotary width (a whole head) and, where the spec sets a head width, the key and value widths."""
    w.add_rope_dimension_count(spec.hd)
    if spec.head_dim:
        w.add_key_length(spec.hd)
        w.add_value_length(spec.hd)


ATTENTION_PARTS = frozenset(f"{p}.weight" for p in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output"))
FFN_PARTS = frozenset(f"{p}.weight" for p in ("ffn_norm", "ffn_gate", "ffn_up", "ffn_down"))
ROPE_FACTORS = "rope_freqs.weight"  # Llama-3's rotary frequency factors, one per pair of a head


class Llama(Architecture):
    global_tensors = Architecture.global_tensors | {ROPE_FACTORS}
    block_parts = ATTENTION_PARTS | FFN_PARTS

    def __init__(self, name: str, interleaved: bool) -> None:
        self.name = name
        self.interleaved = interleaved  # query and key rows stored interleaved for the rotary embedding

    def check(self, spec: ModelSpec) -> None:
        if spec.experts or spec.experts_used or spec.shared_ffn:
            raise ModelError(
                "experts need a mixture-of-experts architecture: arch=qwen3moe, arch=qwen2moe or arch=deepseek2"
            )
        check_no_mla(spec)
        if spec.rope_scaling not in ("", "llama3"):
            raise ModelError(f"rope_scaling {spec.rope_scaling!r}: expected llama3 or nothing")
        if not spec.rope_scaling and (spec.rope_scaling_factor or spec.rope_original_context):
            raise ModelError("rope_scaling_factor and rope_original_context need rope_scaling=llama3")

    def tensors(self, spec: ModelSpec) -> dict[str, Shape]:
        out = super().tensors(spec)
        if spec.rope_scaling:  # before the blocks, where llama.cpp's converter writes it
            out = {"token_embd.weight": out.pop("token_embd.weight"), ROPE_FACTORS: (spec.hd // 2,)} | out
        return out

    def block_tensors(self, spec: ModelSpec, i: int) -> dict[str, Shape]:
        return attention_tensors(spec, i) | ffn_tensors(spec, i)

    def write_keys(self, spec: ModelSpec, w: Any) -> None:
        write_rope_keys(spec, w)

    def write_block(self, spec: ModelSpec, i: int, out: TensorWriter) -> None:
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
