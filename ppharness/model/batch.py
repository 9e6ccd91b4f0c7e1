"""Batched decode: one model call runs the next position of several requests, each row of the batch its own request
slot at its own position, and every row's bytes are those of that request run alone.

Two things make a row independent of the batch it runs in.

**Batch-invariant kernels.** tinygrad picks a kernel's optimisations from its shapes: a one-row matrix-vector product
gets its reduction split across threads (``GROUP``), a 32-row one tensor cores, a small reduction gets unrolled — and
each changes the order in which a row's sum is added up, so a row's bits would depend on how many rows ran beside it.
While a batched slice compiles (``invariant()``), every kernel that reduces is optimised by ``invariant_opts``
instead: its reduction is split by a rule that reads the reduction's own length only (a fixed ``GROUP`` on a GPU,
none on the CPU, never an unroll or a tensor core), and only the axes that are not reduced — rows, output features, the
batch — are upcast and spread over threads, which changes where a sum is computed but never its order. Kernels that do
not reduce keep tinygrad's heuristic: they cannot reorder a sum. The mode travels in tinygrad's ``BEAM`` setting
(``INVARIANT``), part of tinygrad's compiled-kernel cache key, so a kernel compiled for a batched slice is never
reused by a free-order one in the same process, nor the other way round.

**Attention over each request's own length.** ``Rows`` carries the batch's positions, one per row (-1: a row of a
slot that has nothing to compute this step), and the batch's length ``L``: the longest row's position + 1, a bound
variable of the compiled step. Each row attends over ``[0, L)`` with every position after its own masked to -inf. A
reduction over a symbolic length is never split or unrolled, so it runs in position order, and what the longer rows add
for a shorter one is exact zeros at the end of its sums (``exp(-inf) = 0``): a row's attention has the same bits at
any ``L``. Its new key and value are written at its own position only.

The price: the kernels are not the fastest tinygrad would pick for each shape (``docs/benchmarks.md`` measures it), and
a row reads ``L`` positions of its cache rather than its own length.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from tinygrad.codegen.opt.postrange import Scheduler
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp

INVARIANT = 4093  # tinygrad's BEAM value while a batched slice compiles: no search has this width
GROUP = 8  # threads a reduction of at least GROUP_MIN values is split over on a device with threads
GROUP_MIN = 256
MAX_UPCAST = 32  # accumulators per thread the non-reduced axes may be upcast to


def widths(slots: int) -> list[int]:
    """The batch widths a slice of ``slots`` request slots compiles: powers of two, then ``slots`` itself."""
    out = [1]
    while out[-1] * 2 < slots:
        out.append(out[-1] * 2)
    if out[-1] != slots:
        out.append(slots)
    return out


def width_for(slots: int, highest: int) -> int:
    """The narrowest compiled width whose rows reach slot ``highest`` (rows are slots: row r computes slot r)."""
    return next(w for w in widths(slots) if w > highest)


@contextlib.contextmanager
def invariant(device: str | tuple[str, ...]) -> Iterator[None]:
    """Compile (and run) a batched step on ``device`` inside this to get batch-invariant kernels (module docstring),
    with the decode step's compile settings (``ppharness.model.direct.decode_context``)."""
    from tinygrad.helpers import Context

    from ppharness.model.direct import decode_context
    from ppharness.model.kernels import route_choices

    route_choices()
    with cast(Any, Context)(BEAM=INVARIANT), decode_context(device):  # Context is unannotated
        yield


def compiling_invariant() -> bool:
    from tinygrad.helpers import BEAM

    return bool(BEAM.value == INVARIANT)


def invariant_opts(s: Scheduler) -> Scheduler:
    """A kernel's optimisations where no row's reduction order may depend on the other axes (module docstring)."""
    from tinygrad.codegen.opt import KernelOptError, Opt, OptOps
    from tinygrad.uop import Ops
    from tinygrad.uop.ops import AxisType

    from ppharness.model.kernels import heuristic

    k: Any = cast(Any, s).copy()  # Scheduler.copy is unannotated
    if not k.axes_of(AxisType.REDUCE) or any(u.op is Ops.BUFFERIZE for u in k.ast.backward_slice):
        return heuristic(s)  # nothing is summed here: no optimisation can change a value
    first = k.full_shape[k.axes_of(AxisType.REDUCE)[0]]
    if k.ren.has_local and k.ren.has_shared and isinstance(first, int) and first >= GROUP_MIN and first % GROUP == 0:
        with contextlib.suppress(KernelOptError):  # whether it applies depends on the reduction alone
            k.apply_opt(Opt(OptOps.GROUP, 0, GROUP))
    # the axes not reduced: first those the largest buffer is broadcast along (a batch's rows over one weight matrix:
    # upcast them and each weight is read once for all of them), then the widest other one
    upcast = 1
    big = max(k.bufs, key=lambda b: int(getattr(b.src[0].dtype, "size", 0) or 0))  # the weight of a product
    for axis in list(k.upcastable_dims):
        rng = k.rngs[axis]
        size = k.full_shape[axis]
        if rng in big.src[1].get_idx().backward_slice or not isinstance(size, int):
            continue
        amt = next((n for n in (8, 4, 2) if size % n == 0 and upcast * n <= MAX_UPCAST), 0)
        if amt:
            with contextlib.suppress(KernelOptError):
                k.apply_opt(Opt(OptOps.UPCAST, axis, amt))
                upcast *= amt
    rest = [a for a in k.upcastable_dims if isinstance(k.full_shape[a], int) and k.full_shape[a] > 1]
    if rest:
        axis = max(rest, key=lambda a: k.full_shape[a])
        size = k.full_shape[axis]
        if k.ren.has_local:
            with contextlib.suppress(KernelOptError):
                if size % 4 == 0:
                    k.apply_opt(Opt(OptOps.LOCAL, axis, 4))
                    size //= 4
        # on a GPU few outputs per thread keep enough workgroups for a one-row product (tinygrad's matvec shape)
        amts = (4, 2) if k.ren.has_local else (16, 8, 4, 2)
        amt = next((n for n in amts if size % n == 0 and upcast * n <= MAX_UPCAST), 0)
        if amt:
            with contextlib.suppress(KernelOptError):
                k.apply_opt(Opt(OptOps.UPCAST, axis, amt))
    return cast("Scheduler", k)


@dataclass(frozen=True)
class Rows:
    """What a block needs to run a batch of decode rows: each row's position (``pos``, (W,) int32, -1 for an idle
    row) and the batch's length ``length`` (a bound variable: the longest row's position + 1)."""

    pos: Tensor
    length: UOp

    @property
    def width(self) -> int:
        return int(self.pos.shape[0])

    def at_positions(self, table: Tensor) -> Tensor:
        """``table``'s row at each row's position: (W, table columns); an idle row gets zeros."""
        from tinygrad.tensor import Tensor

        n = int(table.shape[0])
        hit = Tensor.arange(n).reshape(1, n) == self.pos.reshape(-1, 1)  # (W, n): one True per active row
        out: Tensor = hit.unsqueeze(-1).where(table.unsqueeze(0), 0.0).sum(1)  # one term: the table's bits
        return out

    def seen(self) -> Tensor:
        """(W, L) True where a row may attend: the positions up to its own."""
        from tinygrad.tensor import Tensor

        span = Tensor.arange(cast(int, self.length))  # symbolic length: positions 0 .. L-1
        out: Tensor = span.reshape(1, -1) <= self.pos.reshape(-1, 1)
        return out

    def written(self) -> Tensor:
        """(W, L) True at each row's own position: where its new key and value go."""
        from tinygrad.tensor import Tensor

        span = Tensor.arange(cast(int, self.length))
        out: Tensor = span.reshape(1, -1) == self.pos.reshape(-1, 1)
        return out


def rope_rows(x: Tensor, cos_sin: Tensor) -> Tensor:
    """tinygrad's ``apply_rope`` with each row's own angles: ``x`` (W,H,1,Hd), ``cos_sin`` (W, Hd) (cos | sin)."""
    cos, sin = cos_sin.reshape(x.shape[0], 1, 1, -1).chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    out: Tensor = (x1 * cos - x2 * sin).cat(x2 * cos + x1 * sin, dim=-1)
    return out


def slot_cache(block: Any, slots: int, like: Tensor) -> Tensor:
    """The block's KV cache of every request slot, made like ``like`` (a prefill's cache of one request) on first use,
    with ``slots`` where ``like`` has its batch of one: (2, slots, KV heads, context, head dim) for tinygrad's
    attention, in which a batch's rows and KV heads form one axis; (slots, context, latent) for MLA's."""
    from tinygrad.tensor import Tensor

    cache = getattr(block, "slot_cache", None)
    if cache is None:
        axis = _batch_axis(like)
        shape = (*like.shape[:axis], slots, *like.shape[axis + 1 :])
        cache = Tensor.zeros(*shape, dtype=like.dtype, device=like.device).contiguous().realize()
        block.slot_cache = cache
    return cast("Tensor", cache)


def _batch_axis(cache: Tensor) -> int:
    """Where a block's cache has its batch: after the key/value axis in tinygrad's layout, first in MLA's."""
    return 1 if len(cache.shape) == 5 else 0


def rotary_table(block: Any) -> Tensor:
    """The block's rotary table (context, head dim), as its own attention computes it: tinygrad's, or with Llama-3
    factors ``ppharness.model.arch.llama.rope_table``'s."""
    from tinygrad.apps.llm import precompute_freqs_cis

    from ppharness.model.arch.llama import rope_table

    factors = getattr(block, "rope_factors", ())
    if factors:
        return rope_table(block.head_dim, block.max_context, block.rope_theta, factors)
    table: Tensor = precompute_freqs_cis(block.head_dim, block.max_context, block.rope_theta)
    return table


def attention_rows(block: Any, x: Tensor, rows: Rows) -> Tensor:
    """A llama-family block's attention (tinygrad's ``TransformerBlock._attention``: norm, projections, optional
    q/k norms, rotary embedding, cache, grouped-query attention, output projection, residual) for a batch of decode
    rows: ``x`` (W,1,D), row r in slot r at ``rows.pos[r]``."""
    from tinygrad.dtype import dtypes
    from tinygrad.tensor import Tensor

    w, h, kvh, hd = int(x.shape[0]), block.n_heads, block.n_kv_heads, block.head_dim
    x_norm = block.attn_norm(x)
    q, k, v = block.attn_q(x_norm), block.attn_k(x_norm), block.attn_v(x_norm)
    if block.qk_norm and block.qk_norm != hd:
        q, k = block.attn_q_norm(q), block.attn_k_norm(k)
    q = q.reshape(w, 1, h, hd).transpose(1, 2)  # (W,H,1,Hd)
    k = k.reshape(w, 1, kvh, hd).transpose(1, 2)  # (W,KvH,1,Hd)
    v = v.reshape(w, 1, kvh, hd).transpose(1, 2)
    if block.qk_norm == hd:
        q, k = block.attn_q_norm(q), block.attn_k_norm(k)
    cos_sin = rows.at_positions(rotary_table(block)).contiguous()  # once, not inside every kernel that reads it
    q, k = rope_rows(q, cos_sin), rope_rows(k, cos_sin)
    cache = cast("Tensor", block.slot_cache)  # (2, slots, KvH, context, Hd)
    ctx, g = int(cache.shape[3]), h // kvh
    # the new key and value at each row's own position, the rest of the batch's slots rewritten unchanged (a static
    # shape: every axis but the context merges into one)
    view = cache[:, 0:w]
    new = Tensor.stack(k, v).cast(cache.dtype).contiguous()  # (2,W,KvH,1,Hd)
    here = Tensor.arange(ctx).reshape(1, 1, 1, ctx, 1) == rows.pos.reshape(1, w, 1, 1, 1)
    view.assign(here.where(new, view)).realize()
    # each row over [0, L), the positions after its own masked: rows and KV heads one axis, a KV head's queries the next
    length = cast(int, rows.length)
    keys = cache[0, 0:w, :, 0:length, :].reshape(w * kvh, -1, hd)  # (W*KvH, L, Hd)
    values = cache[1, 0:w, :, 0:length, :].reshape(w * kvh, -1, hd)
    qg = q.reshape(w * kvh, g, hd)  # query head j of KV head i is head i*G + j (tinygrad's repeat_interleave)
    scores = qg.matmul(keys.transpose(-2, -1), dtype=dtypes.float32) / math.sqrt(hd)  # (W*KvH, G, L)
    seen = rows.seen().reshape(w, 1, 1, -1).expand(w, kvh, g, -1).reshape(w * kvh, g, -1)
    scores = scores + seen.where(0.0, -math.inf)
    attn = scores.cast(q.dtype).softmax(-1) @ values  # (W*KvH, G, Hd), as scaled_dot_product_attention computes it
    out: Tensor = x + block.attn_output(attn.reshape(w, 1, h * hd))
    return out


def store_prefill(block: Any, slots: int, slot: int, scratch: Tensor) -> None:
    """Copy a prefill's cache (``scratch``, one request's) into slot ``slot`` of the block's slot cache: each of its
    parts before the batch axis (keys and values; MLA's latent is one) is one contiguous region."""
    from tinygrad.device import Buffer

    cache = slot_cache(block, slots, scratch)
    dst = cast(Buffer, cache.uop.base.realized)
    src = cast(Buffer, scratch.uop.base.realized).as_buffer()
    parts = 2 if _batch_axis(scratch) == 1 else 1
    size = len(src) // parts
    for part in range(parts):
        region = dst.view(size // scratch.dtype.itemsize, scratch.dtype, (part * slots + slot) * size)
        region.ensure_allocated().copyin(src[part * size : (part + 1) * size])
