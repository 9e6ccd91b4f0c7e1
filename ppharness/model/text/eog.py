"""Which tokens end generation (EOG), read from a GGUF file's tokenizer metadata as llama.cpp reads them."""

from __future__ import annotations

from typing import Any

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
