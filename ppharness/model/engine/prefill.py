"""Prefill in chunks of one size: a prompt of any length runs as consecutive steps of ``CHUNK`` positions, each one
replay of a step compiled once, before the first request (``ppharness.model.decode.rules.warm_up``). A warm stage's time
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

import os
from typing import TYPE_CHECKING, Any, cast

from ppharness.errors import ModelError
from ppharness.model.layers.attention import Chunk

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
