"""The synthetic models' vocabulary: byte-level BPE as tinygrad's ``SimpleTokenizer`` reads it, 256 byte tokens, merges
learned from a built-in corpus and then extended by seeded concatenations, then llama-3 special tokens."""

from __future__ import annotations

import collections
import re

import numpy as np

# GPT-2 byte <-> unicode mapping, as tinygrad's SimpleTokenizer reads it: printable bytes map to themselves, the rest to
# code points from 256 upwards.
_BS = [*range(33, 127), *range(161, 173), *range(174, 256)]
BYTE_TO_CHAR = {b: chr(b) for b in _BS} | {b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in _BS)}

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

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


def _encode_bytes(b: bytes) -> str:
    return "".join(BYTE_TO_CHAR[x] for x in b)


def build_vocab(n_merges: int, seed: int) -> tuple[list[str], list[str]]:
    """(tokens, merges): 256 byte tokens then ``n_merges`` merged tokens, in rank order.

    Merges are learned by BPE from the built-in corpus first (so real text compresses); when the corpus has no pair
    left to merge, further merges concatenate two existing tokens chosen by a seeded generator.
    """
    tokens = [BYTE_TO_CHAR[b] for b in range(256)]
    merges: list[str] = []
    known = set(tokens)
    words = collections.Counter(re.findall(r" ?[^\s]+|\s+", _CORPUS))
    seqs = {w: [_encode_bytes(bytes([c])) for c in w.encode()] for w in words}
    while len(merges) < n_merges:
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for w, n in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merged = a + b
        merges.append(f"{a} {b}")
        if merged not in known:
            tokens.append(merged)
            known.add(merged)
        for w in words:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    rng = np.random.default_rng(seed + 0x5EED)
    while len(tokens) < 256 + n_merges:
        a, b = tokens[rng.integers(len(tokens))], tokens[rng.integers(len(tokens))]
        if a + b in known or len(a + b) > 16:
            continue
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        known.add(a + b)
    return tokens, merges
