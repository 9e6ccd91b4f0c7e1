"""Rules of greedy decoding that the oracle and the stages share: which tokens end generation, when generation stops,
what the user sees, and compiling the decode step before the first request."""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING, Any

from ppharness.model.batch import widths

if TYPE_CHECKING:
    from ppharness.model.slicing import ModelSlice

# vocabulary entries that end generation whatever their token type, as llama.cpp takes them
EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)
# the fill-in-the-middle tokens that end generation too: each one's metadata key, and the entries that name it when the
# key is absent (the first of them in vocabulary order)
EOG_FIM = (
    ("tokenizer.ggml.fim_pad_token_id", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    ("tokenizer.ggml.fim_rep_token_id", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    ("tokenizer.ggml.fim_sep_token_id", ("<|file_sep|>",)),
)
EOG_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")  # besides the EOS id, which every file has


def end_of_generation(kv: dict[str, Any]) -> frozenset[int]:
    """The ids of the tokens that end generation (EOG), as llama.cpp reads them from a GGUF's metadata: the EOS, EOT
    and EOM ids, the fill-in-the-middle pad, repo and separator tokens, and every vocabulary entry of ``EOG_TEXTS``
    whether or not the file marks it a control token. Two exceptions, as there: ``<|end|>`` does not end generation in
    a vocabulary that also has ``<|return|>`` or ``<|flush|>`` beside ``<|call|>`` or ``<|calls|>`` (it ends a
    message, not the answer), nor ``</s>`` in one with ``<|tool_response>``. KeyError naming a key the file lacks."""
    tokens: list[str] = list(kv["tokenizer.ggml.tokens"])
    eos = int(kv["tokenizer.ggml.eos_token_id"])

    def by_key(key: str) -> int | None:
        value = kv.get(key)
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    ids = {i for i, text in enumerate(tokens) if text in EOG_TEXTS}
    for key, names in EOG_FIM:
        fim = by_key(key)
        if fim is None:
            fim = next((i for i, text in enumerate(tokens) if text in names), None)
        if fim is not None:
            ids.add(fim)
    ids |= {i for key in EOG_KEYS if (i := by_key(key)) is not None}
    ids.add(eos)
    texts = {tokens[i]: i for i in ids if 0 <= i < len(tokens)}
    if (
        "<|end|>" in texts
        and ({"<|call|>", "<|calls|>"} & texts.keys())
        and ({"<|return|>", "<|flush|>"} & texts.keys())
    ):
        ids.discard(texts["<|end|>"])
    if "</s>" in texts and "<|tool_response>" in texts:
        ids.discard(texts["</s>"])
    return frozenset(ids)


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
    """Compile a batched slice's speculative window steps (``ppharness.run.speculation``) before the first request:
    one per power of two that holds up to ``rows``, each run enough times for the JIT to capture it, in slot 0 (whose
    cache the next request's prefill overwrites)."""
    import numpy as np

    x = [0] if model.first else np.zeros((1, 1, model.config.dim), dtype=np.float16)
    width = 1
    while width // 2 < rows and width + 1 < model.max_context:
        for _ in range(3):
            model.decode_window([x] * width, 1, 0, stand_in=model.config.moe)
        width *= 2
