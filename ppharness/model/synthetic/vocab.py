"""The synthetic models' vocabulary: byte-level BPE as llama.cpp reads it, 256 byte tokens, merges learned from a
built-in corpus and then extended by seeded concatenations, then special tokens.

The default tokenizer type (``llama-bpe``) learns from an English corpus cut at spaces and takes any concatenation,
with llama-3's special tokens. Every other type learns from that corpus and a multilingual one, both cut by the type's
own pre-tokenizer, keeps a token only where tiktoken's byte-pair merge builds it in two parts and records those two
parts as its merge (as llama.cpp's converter derives a tiktoken vocabulary's merges), so the file's merge list and a
tiktoken encoding ranked by token id tokenize alike; its special tokens are its models' own.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator

import numpy as np

from ppharness.errors import ModelError
from ppharness.model.text.tokenizer import BYTE_TO_CHAR, pre_tokenize, pre_tokenizer

__all__ = ["BYTE_TO_CHAR", "DEFAULT_TOKENIZER", "SPECIAL_TOKENS", "build_vocab", "special_tokens"]

DEFAULT_TOKENIZER = "llama-bpe"
SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
_DEEPSEEK_SPECIAL = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>")
# tokenizer type -> its models' special tokens, the BOS first and the EOS second (any other type: llama-3's)
_OWN_SPECIAL_TOKENS = {
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), ("<|endoftext|>", "<|im_end|>", "<|im_start|>")),
    **dict.fromkeys(("deepseek-llm", "deepseek-coder", "deepseek-v3"), _DEEPSEEK_SPECIAL),
    "kimi-k2": ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"),
}

_CORPUS = """\
Pipeline parallel inference splits a model's transformer blocks into contiguous ranges, one range per stage.
The first stage tokenizes the prompt and embeds it; the last stage applies the final norm, the output head and
argmax, and sends the token back to the first stage for the next step. Each stage keeps the key and value cache
of its own layers. The quick brown fox jumps over the lazy dog. A stage that dies mid-run must never leave a
process, a container or a rented machine behind. Large mixture of experts models run on consumer graphics cards
over the wide area network, where every hop costs milliseconds and every byte counts. Héllo wörld, naïve café,
señor, Grüße aus Köln; 1234567890. The test harness runs the same scenario on local processes, in containers and
on rented machines, and checks that a split never changes the answer: token for token equal to the unsplit model.
"""
# learned from as well by every tokenizer type but the default: the scripts, digits and spacing pre-tokenizers treat
# apart
_MULTILINGUAL = """\
流水线并行推理把模型的变换器块分成连续的区间，每个阶段一个区间。第一个阶段对提示进行分词并嵌入，最后一个阶段输出下一个词。
パイプライン並列推論では、モデルのブロックを連続した範囲に分けます。ひらがなとカタカナと漢字を使います。
파이프라인 병렬 추론은 모델의 블록을 연속된 범위로 나눕니다. 각 단계는 자신의 캐시를 유지합니다.
Конвейерный параллельный вывод делит блоки модели на непрерывные диапазоны. Ελληνικά: κάθε στάδιο κρατά την κρυφή μνήμη.
It's the model's answer; they'll say we've done it, I'm sure you'd agree. DON'T STOP!!! Really?? (yes) -- "quoted" {x}
Numbers: 3.14159, 2025-01-31, 1,000,000 and 0x1F600; version 12.3.4 costs $99.99 or €42 — 100% of 7 days.
Emoji: 🙂🚀✨ 👍🏽 ❤️ 🇯🇵 👨‍👩‍👧 😀😀😀
\ttabs\tand   spaces,    indented
line breaks\r\n\r\nand blank lines.

"""
MAX_TOKEN_CHARS = 16  # a seeded concatenation is at most this many bytes


def _encode_bytes(b: bytes) -> str:
    return "".join(BYTE_TO_CHAR[x] for x in b)


def rank_split(piece: str, ranks: dict[str, int], max_rank: int | None = None) -> list[str]:
    """tiktoken's byte-pair merge of ``piece`` (byte-level characters): merge the adjacent pair whose join has the
    lowest rank, leftmost first, until no join of rank below ``max_rank`` (None: any) is left; the parts it stops at.
    A token of rank ``r`` whose parts at ``max_rank=r`` are two is built by the merge of those two."""
    parts = list(piece)
    limit = 1 << 62 if max_rank is None else max_rank
    while len(parts) > 1:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def special_tokens(tokenizer: str = DEFAULT_TOKENIZER) -> tuple[str, ...]:
    """The special tokens a synthetic vocabulary of tokenizer type ``tokenizer`` ends with: the BOS, the EOS, more."""
    return _OWN_SPECIAL_TOKENS.get(tokenizer, SPECIAL_TOKENS)


def _trained_pairs(seqs: dict[str, list[str]], counts: collections.Counter[str]) -> Iterator[tuple[str, str]]:
    """BPE training on words spelled as ``seqs`` (each word's symbols), ``counts`` times each: the next pair to
    merge, the most frequent first (ties: the smaller pair), merged in every word before the next is chosen."""
    live = [w for w in counts if len(seqs[w]) > 1]  # the words with a pair left
    while True:
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for w in live:
            s, n = seqs[w], counts[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += n
        if not pairs:
            return
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        yield a, b
        merged = a + b
        for w in live:
            s, out, i = seqs[w], [], 0
            if a not in s:
                continue
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
        live = [w for w in live if len(seqs[w]) > 1]


def build_vocab(n_merges: int, seed: int, tokenizer: str = DEFAULT_TOKENIZER) -> tuple[list[str], list[str]]:
    """(tokens, merges): 256 byte tokens then ``n_merges`` merged tokens, in rank order, for tokenizer type
    ``tokenizer`` (``ppharness.model.text.tokenizer.PRE_TOKENIZERS``).

    Merges are learned by BPE from the built-in corpus first (so real text compresses); when the corpus has no pair
    left to merge, further merges concatenate two existing tokens chosen by a seeded generator.
    """
    if not pre_tokenizer(tokenizer).byte_level:
        raise ModelError(
            f"tokenizer type {tokenizer!r} reads the text's own characters, not GPT-2's byte alphabet, and a "
            "synthetic vocabulary is byte-level BPE: pick a byte-level type (docs/models.md#tokenizers)"
        )
    if tokenizer != DEFAULT_TOKENIZER:
        return _build_ranked(n_merges, seed, tokenizer)
    tokens = [BYTE_TO_CHAR[b] for b in range(256)]
    merges: list[str] = []
    known = set(tokens)
    words = collections.Counter(re.findall(r" ?[^\s]+|\s+", _CORPUS))
    seqs = {w: [_encode_bytes(bytes([c])) for c in w.encode()] for w in words}
    for a, b in _trained_pairs(seqs, words):
        if len(merges) >= n_merges:
            break
        merged = a + b
        merges.append(f"{a} {b}")
        if merged not in known:
            tokens.append(merged)
            known.add(merged)
    rng = np.random.default_rng(seed + 0x5EED)
    while len(tokens) < 256 + n_merges:
        a, b = tokens[rng.integers(len(tokens))], tokens[rng.integers(len(tokens))]
        if a + b in known or len(a + b) > MAX_TOKEN_CHARS:
            continue
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        known.add(a + b)
    return tokens, merges


def _build_ranked(n_merges: int, seed: int, tokenizer: str) -> tuple[list[str], list[str]]:
    """``build_vocab`` for a type other than the default: every token one that tiktoken's merge builds in two parts
    from the tokens before it, those parts its merge."""
    tokens = [BYTE_TO_CHAR[b] for b in range(256)]
    ranks = {t: i for i, t in enumerate(tokens)}
    merges: list[str] = []

    def add(token: str) -> None:
        if token not in ranks and len(parts := rank_split(token, ranks)) == 2:
            merges.append(" ".join(parts))
            ranks[token] = len(tokens)
            tokens.append(token)

    words = collections.Counter(pre_tokenize(tokenizer, _CORPUS + _MULTILINGUAL))
    for a, b in _trained_pairs({w: list(w) for w in words}, words):
        if len(tokens) >= 256 + n_merges:
            break
        add(a + b)
    rng = np.random.default_rng(seed + 0x5EED)
    while len(tokens) < 256 + n_merges:
        a, b = tokens[rng.integers(len(tokens))], tokens[rng.integers(len(tokens))]
        if len(a + b) <= MAX_TOKEN_CHARS:
            add(a + b)
    return tokens, merges
