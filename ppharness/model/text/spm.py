"""SentencePiece as llama.cpp runs it (``tokenizer.ggml.model = "llama"``; ``llm_tokenizer_spm_session`` in its
src/llama-vocab.cpp): the text's characters are the first symbols; the adjacent pair whose join is a token of the
highest score merges (ties: the leftmost), again and again until no join is a token; a symbol left that is not a token
is written as its bytes' ``<0xXX>`` tokens. The caller escapes spaces to U+2581 and adds the space prefix.

A priority queue of candidate pairs keeps it O(n log n): a pair whose symbols changed since it was queued is dropped
when it comes up, as llama.cpp drops it (by the merged length, which only grows).
"""

from __future__ import annotations

import heapq

from ppharness.errors import ModelError

SPACE = "\u2581"  # SentencePiece's space


def byte_token(byte: int) -> str:
    """The text of a byte's token in a SentencePiece vocabulary."""
    return f"<0x{byte:02X}>"


def spm_encode(text: str, ids: dict[str, int], scores: list[float]) -> list[int]:
    """``text`` (spaces already escaped) as token ids: ``ids`` maps each token's text to its id, ``scores`` holds
    each id's score. ``ModelError`` for a character that is no token where the vocabulary lacks its byte tokens
    (llama.cpp stops there too)."""
    n = len(text)
    if n == 0:
        return []
    # symbol i: text[start[i] : start[i] + size[i]]; size 0 once merged into the symbol on its left
    start = list(range(n))
    size = [1] * n
    prev = list(range(-1, n - 1))
    nxt = [*range(1, n), -1]
    queue: list[tuple[float, int, int, int]] = []  # (-score, left, right, merged length): best score, then leftmost

    def add(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        length = size[left] + size[right]
        token = ids.get(text[start[left] : start[left] + length])
        if token is not None:
            heapq.heappush(queue, (-scores[token], left, right, length))

    for i in range(n - 1):
        add(i, i + 1)
    while queue:
        _, left, right, length = heapq.heappop(queue)
        if size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
            continue  # one of its symbols has merged since
        size[left] = length
        size[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        add(prev[left], left)
        add(left, nxt[left])

    out: list[int] = []
    i = 0
    while i != -1:
        piece = text[start[i] : start[i] + size[i]]
        token = ids.get(piece)
        if token is not None:
            out.append(token)
        else:  # a character no token holds: its bytes
            out += [_byte_id(b, ids) for b in piece.encode()]
        i = nxt[i]
    return out


def _byte_id(byte: int, ids: dict[str, int]) -> int:
    """llama.cpp's ``byte_to_token``: the ``<0xXX>`` token, else a token that is the byte itself."""
    token = ids.get(byte_token(byte))
    if token is None and byte < 0x80:
        token = ids.get(chr(byte))
    if token is None:
        raise ModelError(f"tokenizer: the vocabulary has no byte token {byte_token(byte)} for a character it lacks")
    return token
