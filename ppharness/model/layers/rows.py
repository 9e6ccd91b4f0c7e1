"""Batched decode: one model call runs the next position of several requests, each row of the batch its own request
slot at its own position, and every row's bytes are those of that request run alone.

Two things make a row independent of the batch it runs in.

**Batch-invariant kernels.** tinygrad picks a kernel's optimisations from its shapes: a one-row matrix-vector product
gets its reduction split across threads (``GROUP``), a 32-row one tensor cores, a small reduction gets unrolled — and
each changes the order in which a row's sum is added up, so a row's bits would depend on how many rows ran beside it.
While a batched slice compiles (``ppharness.model.layers.linear.invariant``), every kernel that reduces is optimised by
``ppharness.model.layers.kernels.invariant_opts`` instead: its reduction is split by a rule that reads the reduction's
own length only (a fixed ``GROUP`` on a GPU, none on the CPU, never an unroll or a tensor core), and only the axes that
are not reduced — rows, output features, the batch — are upcast and spread over threads, which changes where a sum is
computed but never its order. Kernels that do not reduce keep tinygrad's heuristic: they cannot reorder a sum. The mode
travels in tinygrad's ``BEAM`` setting (``INVARIANT``), part of tinygrad's compiled-kernel cache key, so a kernel
compiled for a batched slice is never reused by a free-order one in the same process, nor the other way round.

**Attention over each request's own length.** ``Rows`` carries the batch's positions, one per row (-1: a row of a slot
that has nothing to compute this step), and the batch's length ``L``: the longest row's position + 1, a bound variable
of the compiled step. Each row attends over ``[0, L)`` with every position after its own masked to -inf. A reduction
over a symbolic length is never split or unrolled, so it runs in position order, and what the longer rows add for a
shorter one is exact zeros at the end of its sums (``exp(-inf) = 0``): a row's attention has the same bits at any ``L``.
Its new key and value are written at its own position only.

The price: the kernels are not the fastest tinygrad would pick for each shape (``docs/batched-decode.md`` measures it),
and a row reads ``L`` positions of its cache rather than its own length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp


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


@dataclass(frozen=True)
class Rows:
    """What a block needs to run a batch of decode rows: each row's position (``pos``, (W,) int32, -1 for an idle
    row) and the batch's length ``length`` (a bound variable: the longest row's position + 1).

    ``slot`` (a bound variable) makes the rows a *window*: every row is of that one request slot, at consecutive
    positions (a speculative window, ``ppharness.run.stage.speculation``), instead of row r in slot r. A window's rows
    write their keys and values in row order before any row attends, and each row attends over its own positions only,
    so row r reads exactly what one-at-a-time decoding would have written there."""

    pos: Tensor
    length: UOp
    slot: UOp | None = None

    @property
    def width(self) -> int:
        return int(self.pos.shape[0])

    def at_positions(self, table: Tensor) -> Tensor:
        """``table``'s row at each row's position: (W, table columns); an idle row gets zeros."""
        return table_rows(table, self.pos)

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


def slot_view(cache: Tensor, rows: Rows, axis: int) -> Tensor:
    """The part of a slot cache (its request slots along ``axis``) that ``rows`` write: slots 0..W-1 (row r in slot
    r), or the window's one slot."""
    lo, hi = (0, rows.width) if rows.slot is None else (rows.slot, rows.slot + 1)
    index = (slice(None),) * axis + (slice(lo, hi),)
    return cache[index]


def place(rows: Rows, view: Tensor, new: Tensor, here: Tensor, axis: int) -> Tensor:
    """``view`` (``slot_view``'s) with each row's ``new`` entry where its ``here`` mask is True (both with the rows
    along ``axis``). Row r in slot r: one select; a window: one select per row, in row order, so that every position
    keeps exactly one row's bits (a sum over the rows would turn a -0.0 into +0.0)."""
    if rows.slot is None:
        out: Tensor = here.where(new, view)
        return out
    out = view
    for r in range(rows.width):
        index = (slice(None),) * axis + (slice(r, r + 1),)
        out = here[index].where(new[index], out)
    return out


def per_row(cached: Tensor, rows: Rows, axis: int) -> Tensor:
    """What ``slot_view`` read, one copy per row along ``axis``: a window's one slot broadcast to its rows."""
    if rows.slot is None:
        return cached
    shape = list(cached.shape)
    shape[axis] = rows.width
    return cached.expand(*shape)


def table_rows(table: Tensor, positions: Any) -> Tensor:
    """``table``'s row at each of ``positions`` ((N,) int tensor, or anything that broadcasts as one: a bound
    variable added to an arange), gathered by a one-hot sum (one term: the table's bits) rather than indexed, so that
    no kernel's shape depends on a position: (N, table columns); a position outside the table gets zeros."""
    from tinygrad.tensor import Tensor

    n = int(table.shape[0])
    hit = Tensor.arange(n).reshape(1, n) == positions.reshape(-1, 1)  # (N, n): one True per row inside the table
    out: Tensor = hit.unsqueeze(-1).where(table.unsqueeze(0), 0.0).sum(1)
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
