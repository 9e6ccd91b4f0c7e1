"""Rules of greedy decoding that the oracle and the stages share: when generation stops, what the user sees, and
compiling the decode step before the first request."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ppharness.model.slicing import ModelSlice


def finish_reason(tokens: list[int], eos_id: int, max_tokens: int) -> str | None:
    """Why generation stops after ``tokens``, or None to go on. The one rule the oracle and the last stage share."""
    if tokens and tokens[-1] == eos_id:
        return "eos"
    if len(tokens) >= max_tokens:
        return "length"
    return None


def visible(tokens: list[int], eos_id: int) -> list[int]:
    """The generated ids a user sees: without the closing EOS."""
    return tokens[:-1] if tokens and tokens[-1] == eos_id else tokens


def warm_up(model: ModelSlice) -> None:
    """Compile the decode step before the first request: one prefill position, then enough decode steps for the JIT
    to capture and replay. The KV cache entries it writes are overwritten by the next request's prefill, and the
    captured decode step (symbolic in the position) serves every later request."""
    import numpy as np

    x = [0] if model.first else np.zeros((1, 1, model.config.dim), dtype=np.float16)
    for slot in range(model.slots):  # each request slot has its own compiled step (the same kernels)
        for pos in (0, 1, 2, 3):
            model.warm(x, pos, slot)
    model.use(0)
