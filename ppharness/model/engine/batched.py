"""A batched slice's decode (``ModelSlice(..., batched=True)``): the next position of several requests in one call,
each row its own request slot at its own position (``ppharness.model.layers.rows`` says why each row's bytes are those
of its request alone). ``BatchedRows`` is ``ModelSlice``'s part that runs rows: dense slices through one compiled step
per batch width, MoE slices block by block with the batch's rows in one expert call per block."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
from numpy.typing import NDArray

from ppharness.errors import ModelError
from ppharness.model.layers import moe
from ppharness.model.layers.linear import invariant
from ppharness.model.layers.moe import ExpertCall, Routing, combine_rows
from ppharness.model.layers.rows import Rows, store_prefill, width_for

if TYPE_CHECKING:
    from collections.abc import Generator, Sequence

    from tinygrad.device import Buffer
    from tinygrad.engine.jit import TinyJit
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp

    from ppharness.model.gguf.config import ModelConfig


R = TypeVar("R")


class BatchedRows:
    """The rows of a batched ``ModelSlice`` (whose constructor sets every attribute declared here)."""

    config: ModelConfig
    first: bool
    last: bool
    batched: bool
    slots: int
    max_context: int
    lo: int
    taps: bool
    blk: list[Any]
    _length: UOp
    _row_jits: dict[int, TinyJit[Any]]
    _row_steps: dict[int, list[TinyJit[Any]]]
    _row_heads: dict[int, TinyJit[Any]]
    _row_in: dict[tuple[int, int], tuple[Tensor, Tensor]]
    _tapped: list[Tensor]
    _tapped_np: dict[int, NDArray[np.float16]]
    _window_jits: dict[int, TinyJit[Any]]  # a window's compiled step per width (made on first use)
    _window_steps: dict[int, list[TinyJit[Any]]]
    _window_heads: dict[int, TinyJit[Any]]
    _window_slot: UOp

    if TYPE_CHECKING:  # ModelSlice's

        def answer(self, call: ExpertCall, stand_in: bool = False) -> NDArray[np.float16]: ...

        def step(
            self, x: list[int] | NDArray[np.float16], position: int, slot: int = 0
        ) -> Generator[ExpertCall, NDArray[np.float16], NDArray[np.float16] | int]: ...

        def _answered(self, gen: Generator[ExpertCall, NDArray[np.float16], R], stand_in: bool = False) -> R: ...

        def _forward(self, x: Tensor, start_pos: Rows) -> Tensor | tuple[Tensor, ...]: ...

        def _segment(self, i: int, x: Tensor, start_pos: Rows) -> tuple[Tensor, ...]: ...

        def _head(self, x: Tensor) -> Tensor: ...

    def _store(self, slot: int) -> None:
        """A prefill computed in the scratch slot: its KV cache into slot ``slot``'s region of the slot caches."""
        for block in self.blk:
            store_prefill(block, self.slots, slot, cast("Tensor", block.cache_kv))

    def _rows_input(self, key: tuple[int, int], x: NDArray[Any], pos: NDArray[np.int32]) -> tuple[Tensor, Tensor]:
        """The persistent (rows, positions) inputs of step ``key`` (width, block or -1), overwritten with ``x`` and
        ``pos``."""
        from tinygrad.tensor import Tensor

        pair = self._row_in.get(key)
        if pair is None:
            pair = self._row_in[key] = (Tensor(x).realize(), Tensor(pos).realize())
        else:
            for t, arr in zip(pair, (x, pos), strict=True):
                cast("Buffer", t.uop.base.realized).copyin(np.ascontiguousarray(arr).data.cast("B"))
        return pair

    def decode_rows(
        self,
        xs: Sequence[list[int] | NDArray[np.float16]],
        positions: Sequence[int],
        slots: Sequence[int],
        stand_in: bool = False,
    ) -> list[NDArray[np.float16] | int]:
        """One decode position of several requests in one call (a batched slice): row ``i`` is request slot
        ``slots[i]`` at ``positions[i]`` with input ``xs[i]`` (a token id list or a (1,1,D) hidden state). Each
        output is what ``decode`` returns for that request alone, to the byte (``ppharness.model.layers.rows``).
        A MoE slice answers its expert calls from the experts it holds (``stand_in``: as ``answer``'s, for compiling
        the step before a request)."""
        return self._answered(self.rows_step(xs, positions, slots), stand_in)

    def rows_step(
        self,
        xs: Sequence[list[int] | NDArray[np.float16]],
        positions: Sequence[int],
        slots: Sequence[int],
    ) -> Generator[ExpertCall, NDArray[np.float16], list[NDArray[np.float16] | int]]:
        """``decode_rows`` as a generator: a MoE slice yields one ``ExpertCall`` per MoE block for the batch's rows
        (in the order of ``slots``' sorted values) and takes back their experts' outputs, as ``step`` does."""
        if not self.batched:
            raise ModelError("decoding rows needs a batched slice (ModelSlice(..., batched=True))")
        if not len(xs) == len(positions) == len(slots) or not slots:
            raise ModelError("decoding rows needs one input, position and slot per row, and at least one row")
        if len(set(slots)) != len(slots) or not all(0 <= s < self.slots for s in slots):
            raise ModelError(f"request slots {list(slots)}: each row needs its own slot of this slice's {self.slots}")
        if not all(1 <= p < self.max_context for p in positions):
            raise ModelError(f"positions {list(positions)}: each must be inside [1, {self.max_context})")
        w = width_for(self.slots, max(slots))
        pos = np.full(w, -1, dtype=np.int32)
        if self.first:
            x = np.zeros((w, 1), dtype=np.int32)
        else:
            x = np.zeros((w, 1, self.config.dim), dtype=np.float16)
        for xi, p, s in zip(xs, positions, slots, strict=True):
            x[s] = np.asarray(xi, dtype=x.dtype).reshape(x.shape[1:])
            pos[s] = p
        length = self._length.bind(max(positions) + 1)
        if self.config.moe:
            rows = yield from self.step_rows(x, pos, length)
        else:
            x_in, pos_in = self._rows_input((w, 0), x, pos)
            with invariant(x_in.device):
                out = self._row_jits[w](x_in, pos_in, length)
            if isinstance(out, tuple):  # with taps: each block's rows (``tapped``), not a prefill's left over
                out, *self._tapped = out
                self._tapped_np = {}
            rows = out.numpy()
        if self.last:
            return [int(rows.reshape(-1)[s]) for s in slots]
        return [rows[s : s + 1].copy() for s in slots]

    def decode_window(
        self, xs: Sequence[list[int] | NDArray[np.float16]], start: int, slot: int, stand_in: bool = False
    ) -> list[NDArray[np.float16] | int]:
        """A speculative window of one request (a batched slice): rows ``xs`` at positions ``start``,
        ``start + 1``, ... of request slot ``slot`` in one call, each row attending to the rows before it. Each
        output is what ``decode`` returns for that position alone, the rows before it decoded one at a time first, to
        the byte (``ppharness.run.stage.speculation``)."""
        return self._answered(self.window_step(xs, start, slot), stand_in)

    def window_step(
        self, xs: Sequence[list[int] | NDArray[np.float16]], start: int, slot: int
    ) -> Generator[ExpertCall, NDArray[np.float16], list[NDArray[np.float16] | int]]:
        """``decode_window`` as a generator: a MoE slice yields one ``ExpertCall`` per MoE block for the window's
        rows, in row order, and takes back their experts' outputs, as ``rows_step`` does."""
        from tinygrad.engine.jit import TinyJit
        from tinygrad.uop.ops import UOp

        if not self.batched:
            raise ModelError("a speculative window needs a batched slice (ModelSlice(..., batched=True))")
        t = len(xs)
        if not 0 <= slot < self.slots:
            raise ModelError(f"request slot {slot} is outside this slice's {self.slots} slot(s)")
        if t < 1 or not 1 <= start or start + t > self.max_context:
            raise ModelError(f"a window of {t} row(s) at position {start} must fit inside [1, {self.max_context})")
        if not hasattr(self, "_window_jits"):
            self._window_jits, self._window_steps, self._window_heads = {}, {}, {}
            self._window_slot = UOp.variable("slot", 0, max(self.slots - 1, 1))
        w = 1 << (t - 1).bit_length()  # the narrowest power of two that holds the rows: a handful of steps in all
        pos = np.full(w, -1, dtype=np.int32)
        pos[:t] = np.arange(start, start + t, dtype=np.int32)
        x = np.zeros((w, 1), dtype=np.int32) if self.first else np.zeros((w, 1, self.config.dim), dtype=np.float16)
        for r, xi in enumerate(xs):
            x[r] = np.asarray(xi, dtype=x.dtype).reshape(x.shape[1:])
        length, bound = self._length.bind(start + t), self._window_slot.bind(slot)
        if self.config.moe:
            steps = self._window_steps.get(w)
            if steps is None:
                steps = self._window_steps[w] = [
                    TinyJit(functools.partial(self._segment_window, i)) for i in range(len(self.blk))
                ]
                self._window_heads[w] = TinyJit(self._head)
            out = yield from self._blocks_rows(x, pos, length, steps, self._window_heads[w], bound)
        else:
            jit = self._window_jits.get(w)
            if jit is None:
                jit = self._window_jits[w] = TinyJit(self._forward_window)
            x_in, pos_in = self._rows_input((w, 0), x, pos)
            with invariant(x_in.device):
                got = jit(x_in, pos_in, length, bound)
            if isinstance(got, tuple):
                got, *self._tapped = got
                self._tapped_np = {}
            out = got.numpy()
        if self.last:
            return [int(v) for v in out.reshape(-1)[:t]]
        return [out[r : r + 1].copy() for r in range(t)]

    def _forward_window(self, x: Tensor, pos: Tensor, length: UOp, slot: UOp) -> Tensor | tuple[Tensor, ...]:
        return self._forward(x, Rows(pos, length, slot))

    def _segment_window(self, i: int, x: Tensor, pos: Tensor, length: UOp, slot: UOp) -> tuple[Tensor, ...]:
        return self._segment(i, x, Rows(pos, length, slot))

    def prefill_step(
        self, x: list[int] | NDArray[np.float16], slot: int
    ) -> Generator[ExpertCall, NDArray[np.float16], NDArray[np.float16] | int]:
        """A MoE slice's prefill of request slot ``slot`` as a generator (``step`` at position 0); a batched slice
        computes it in the scratch slot and copies its cache into the slot's region."""
        out = yield from self.step(x, 0, self.slots if self.batched else slot)
        if self.batched:
            self._store(slot)
        return out

    def step_rows(
        self, x: NDArray[Any], pos: NDArray[np.int32], length: UOp
    ) -> Generator[ExpertCall, NDArray[np.float16], NDArray[Any]]:
        """A MoE slice's batched decode step (``decode_rows``' rows, laid out by slot: ``x`` (W,1) or (W,1,D),
        ``pos`` (W,), -1 for an idle row): yields one ``ExpertCall`` per MoE block for the active rows, in slot
        order, and takes back their experts' outputs; returns the (W,1,D) hidden rows or the (W,) token ids."""
        w = int(pos.shape[0])
        return (yield from self._blocks_rows(x, pos, length, self._row_steps[w], self._row_heads[w]))

    def _blocks_rows(
        self,
        x: NDArray[Any],
        pos: NDArray[np.int32],
        length: UOp,
        steps: list[TinyJit[Any]],
        head: TinyJit[Any],
        slot: UOp | None = None,
    ) -> Generator[ExpertCall, NDArray[np.float16], NDArray[Any]]:
        """``step_rows`` through ``steps`` (one compiled step per block) and ``head``; with ``slot``, the rows are a
        window of that request slot (``decode_window``)."""
        cfg, w = self.config, int(pos.shape[0])
        extra = () if slot is None else (slot,)
        active = [int(r) for r in np.flatnonzero(pos >= 0)]
        h: NDArray[Any] = x
        for i, block in enumerate(self.blk):
            x_in, pos_in = self._rows_input((w, i), np.ascontiguousarray(h), pos)
            with invariant(x_in.device):
                outs = steps[i](x_in, pos_in, length, *extra)
            outs_np = [t.numpy() for t in outs]
            if getattr(block, "routed", False):
                residual, normed, logits, chosen, weights, *shared = (o.reshape(w, -1)[active] for o in outs_np)
                t, k = len(active), cfg.experts_used
                routing = moe.routed(
                    self.lo + i,
                    logits.reshape(t, cfg.experts),
                    Routing(ids=chosen.reshape(t, k).astype(np.int64), weights=weights.reshape(t, k)),
                )
                got = yield ExpertCall(layer=self.lo + i, hidden=normed.reshape(t, cfg.dim), routing=routing)
                gated = shared[0] if shared else None
                h = np.zeros((w, 1, cfg.dim), dtype=np.float16)
                h[active] = combine_rows(residual, got, routing.weights, gated).reshape(t, 1, cfg.dim)
            else:
                h = outs_np[0]
            if self.taps:
                self._tapped_np[self.lo + i] = h
        if self.last:
            x_in, _ = self._rows_input((w, -1), np.ascontiguousarray(h), pos)
            with invariant(x_in.device):
                ids: NDArray[Any] = head(x_in).numpy()
                return ids
        return h
