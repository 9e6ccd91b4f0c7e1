"""The oracle: the unsplit model's greedy decode in one process, through the same ModelSlice code as the stages."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ppharness.model.decode.rules import finish_reason, stop_token, visible, warm_up
from ppharness.model.engine.hidden import digest
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray
    from tinygrad.tensor import Tensor


@dataclass(frozen=True)
class OracleResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "eos" (an end-of-generation token) | "length"
    stop_token_id: int | None  # the end-of-generation token that ended the answer; None at max_tokens
    stop_token: str  # its text ("<|eot_id|>"); "" at max_tokens
    prompt_tokens: int
    load_s: float
    ttft_s: float  # prefill: prompt in, first token out
    decode_tok_s: float  # tokens per second after the first token
    n_params: int
    # with boundaries=True: block index -> digest of that block's output at each step (ppharness.model.decode.exactness)
    boundary_digests: dict[int, list[bytes]] = field(default_factory=dict)


def oracle_decode(
    model_path: str | os.PathLike[str],
    prompt: str,
    max_tokens: int,
    max_context: int = 256,
    model: ModelSlice | None = None,
    boundaries: bool = False,
    batched: bool = False,
) -> OracleResult:
    """Greedy decode of ``prompt`` with the whole model in this process. ``model`` reuses an already loaded one
    (its file and tokenizer too). ``boundaries`` also digests every block's output at every step (a model passed in
    must then have been built with ``taps=True``). ``batched``: built as a batched slice (its decode is a batch of one
    row, with the kernels a batched chain runs)."""
    t0 = time.monotonic()
    if model is None:
        f = GGUFFile(Path(model_path))
        model = ModelSlice(f, 0, f.config.blocks, True, True, max_context, taps=boundaries, batched=batched)
        warm_up(model)
    if boundaries and not model.taps:
        raise ValueError("oracle_decode(boundaries=True) needs a model built with taps=True")
    digests: dict[int, list[bytes]] = {}
    recording_s = 0.0  # time spent reading the taps, left out of the decode speed

    def record() -> None:
        nonlocal recording_s
        if boundaries:
            r0 = time.monotonic()
            for block, hidden in model.tapped().items():
                digests.setdefault(block, []).append(digest(hidden))
            recording_s += time.monotonic() - r0

    f = model.file
    tok = f.tokenizer
    load_s = time.monotonic() - t0
    cfg = f.config
    ids = ([cfg.bos_id] if cfg.bos_id is not None else []) + tok.encode(prompt)
    t1 = time.monotonic()
    tokens = [_token_id(model.prefill(ids))]
    t2 = time.monotonic()
    record()
    while (reason := finish_reason(tokens, cfg.eog_ids, max_tokens)) is None:
        tokens.append(_token_id(model.decode([tokens[-1]], len(ids) + len(tokens) - 1)))
        record()
    t3 = time.monotonic() - recording_s
    out, stop = visible(tokens, cfg.eog_ids), stop_token(tokens, cfg.eog_ids)
    return OracleResult(
        token_ids=out,
        text=tok.decode(out),
        finish_reason=reason,
        stop_token_id=stop,
        stop_token=tok.decode([stop]) if stop is not None else "",
        prompt_tokens=len(ids),
        load_s=load_s,
        ttft_s=t2 - t1,
        decode_tok_s=(len(tokens) - 1) / (t3 - t2) if t3 > t2 else 0.0,
        n_params=model.n_params,
        boundary_digests=digests,
    )


def _token_id(out: NDArray[np.float16] | Tensor | int) -> int:
    assert isinstance(out, int), "the unsplit model ends with the output head: every step gives a token id"
    return out
