"""The oracle: the unsplit model's greedy decode in one process, through the same ModelSlice code as the stages."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ppharness.stage import finish_reason, visible


@dataclass(frozen=True)
class OracleResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    load_s: float
    ttft_s: float  # prefill: prompt in, first token out
    decode_tok_s: float  # tokens per second after the first token
    n_params: int


def oracle_decode(model_path: str | os.PathLike[str], prompt: str, max_tokens: int, max_context: int = 256,
                  model: object | None = None) -> OracleResult:
    """Greedy decode of ``prompt`` with the whole model in this process. ``model`` reuses an already loaded one
    (its file and tokenizer too)."""
    from ppharness.node import warm_up
    from ppharness.slicing import GGUFFile, ModelSlice

    t0 = time.monotonic()
    if model is None:
        f = GGUFFile(Path(model_path))
        model = ModelSlice(f, 0, f.config.blocks, True, True, max_context)
        warm_up(model)
    f = model.file  # type: ignore[attr-defined]
    tok = f.tokenizer
    load_s = time.monotonic() - t0
    cfg = f.config
    ids = ([cfg.bos_id] if cfg.bos_id is not None else []) + tok.encode(prompt)
    t1 = time.monotonic()
    tokens = [model.prefill(ids)]  # type: ignore[attr-defined]
    t2 = time.monotonic()
    while (reason := finish_reason(tokens, cfg.eos_id, max_tokens)) is None:
        tokens.append(model.decode([tokens[-1]], len(ids) + len(tokens) - 1))  # type: ignore[attr-defined]
    t3 = time.monotonic()
    out = visible(tokens, cfg.eos_id)
    return OracleResult(token_ids=out, text=tok.decode(out), finish_reason=reason, prompt_tokens=len(ids),
                        load_s=load_s, ttft_s=t2 - t1, decode_tok_s=(len(tokens) - 1) / (t3 - t2) if t3 > t2 else 0.0,
                        n_params=model.n_params)  # type: ignore[attr-defined]
