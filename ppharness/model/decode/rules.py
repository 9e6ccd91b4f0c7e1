"""Rules of greedy decoding that the oracle and the stages share: when generation stops (at the tokens
``ppharness.model.text.eog`` names), what the user sees, and compiling the decode step before the first request."""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING

from ppharness.model.layers.rows import widths

if TYPE_CHECKING:
    from ppharness.model.engine.slicing import ModelSlice


def finish_reason(tokens: list[int], eog_ids: Container[int], max_tokens: int) -> str | None:
    """Why generation stops after ``tokens``, or None to go on: ``"eos"`` at an end-of-generation token (any of
    ``eog_ids``), ``"length"`` at ``max_tokens``. The one rule the oracle and the last stage share."""
    if tokens and tokens[-1] in eog_ids:
        return "eos"
    if len(tokens) >= max_tokens:
        return "length"
    return None


def stop_token(tokens: list[int], eog_ids: Container[int]) -> int | None:
    """The end-of-generation token that closes ``tokens``; None when they end otherwise."""
    return tokens[-1] if tokens and tokens[-1] in eog_ids else None


def visible(tokens: list[int], eog_ids: Container[int]) -> list[int]:
    """The generated ids a user sees: without the closing end-of-generation token."""
    return tokens[:-1] if stop_token(tokens, eog_ids) is not None else tokens


def warm_up(model: ModelSlice) -> None:
    """Compile the decode step before the first request: one prefill position, then enough decode steps for the JIT
    to capture and replay. The KV cache entries it writes are overwritten by the next request's prefill, and the
    captured decode step (symbolic in the position) serves every later request."""
    import numpy as np

    x = [0] if model.first else np.zeros((1, 1, model.config.dim), dtype=np.float16)
    if getattr(model, "batched", False):  # one step per batch width: a row in the width's last slot compiles it
        for width in widths(model.slots):
            for pos in (0, 1, 2, 3):
                model.warm(x, pos, width - 1)
        model.use(0)
        model.warm_prefill(1)
        return
    for slot in range(model.slots):  # each request slot has its own compiled step (the same kernels)
        for pos in (0, 1, 2, 3):
            model.warm(x, pos, slot)
    model.use(0)
    model.warm_prefill(1)  # the prefill's chunk step, captured: a prompt of any length replays it


def warm_windows(model: ModelSlice, rows: int) -> None:
    """Compile a batched slice's speculative window steps (``ppharness.run.stage.speculation``) before the first
    request: one per power of two that holds up to ``rows``, each run enough times for the JIT to capture it, in slot 0
    (whose cache the next request's prefill overwrites)."""
    import numpy as np

    x = [0] if model.first else np.zeros((1, 1, model.config.dim), dtype=np.float16)
    width = 1
    while width // 2 < rows and width + 1 < model.max_context:
        for _ in range(3):
            model.decode_window([x] * width, 1, 0, stand_in=model.config.moe)
        width *= 2
