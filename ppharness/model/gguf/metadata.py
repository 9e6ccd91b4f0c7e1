"""The metadata of a GGUF file the engine reads, checked for type and range before anything computes with it.

``check_metadata(path, kv)`` runs on every file ``ppharness.model.gguf.header.read_gguf`` reads: the hyper-parameters
(``{arch}.block_count``, ``embedding_length``, ``attention.head_count``, ...) must be integers or floats within sane
bounds, the vocabulary an array of at most ``MAX_VOCAB`` strings with its token types and scores as long, the special
token ids integers (BOS and EOS inside the vocabulary). A value of the wrong type or out of range is refused with
``ModelError`` naming the file, the key, the value, the range and the fix, instead of a ``ZeroDivisionError`` or a
``ValueError`` from deep inside the engine, or a nonsense size printed as valid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ppharness.errors import ModelError

MAX_VOCAB = 1 << 20  # tokens (the largest real vocabularies are about 260k)
MAX_BLOCKS = 1 << 12
MAX_CONTEXT = 1 << 24
MAX_WIDTH = 1 << 18  # embedding_length
MAX_FFN = 1 << 20
MAX_HEADS = 1 << 12
MAX_HEAD_DIM = 1 << 16
MAX_EXPERTS = 1 << 16

_FIX = "the file is corrupt or not a model this engine reads: download or convert it again"
_STRING, _FLOAT_TYPES, _INT_TYPES = 8, (6, 12), (0, 1, 2, 3, 4, 5, 10, 11)


@dataclass(frozen=True)
class SkippedArray:
    """An array read past without decoding it: its element type, its length and (strings) its longest entry's
    byte length."""

    itype: int
    count: int
    longest: int = 0


# keys after "{arch}." that hold an integer, with its range
ARCH_INTS: dict[str, tuple[int, int]] = {
    "block_count": (1, MAX_BLOCKS),
    "context_length": (1, MAX_CONTEXT),
    "embedding_length": (1, MAX_WIDTH),
    "feed_forward_length": (1, MAX_FFN),
    "attention.head_count": (1, MAX_HEADS),
    "attention.head_count_kv": (1, MAX_HEADS),
    "attention.key_length": (1, MAX_HEAD_DIM),
    "attention.value_length": (1, MAX_HEAD_DIM),
    "attention.key_length_mla": (1, MAX_HEAD_DIM),
    "attention.value_length_mla": (1, MAX_HEAD_DIM),
    "attention.q_lora_rank": (0, MAX_WIDTH),
    "attention.kv_lora_rank": (0, MAX_WIDTH),
    "rope.dimension_count": (0, MAX_HEAD_DIM),
    "rope.scaling.original_context_length": (0, MAX_CONTEXT),
    "expert_count": (0, MAX_EXPERTS),
    "expert_used_count": (0, MAX_EXPERTS),
    "expert_feed_forward_length": (0, MAX_FFN),
    "expert_shared_feed_forward_length": (0, MAX_FFN),
    "expert_shared_count": (0, MAX_EXPERTS),
    "expert_group_count": (0, MAX_EXPERTS),
    "expert_group_used_count": (0, MAX_EXPERTS),
    "expert_gating_func": (0, 255),
    "leading_dense_block_count": (0, MAX_BLOCKS),
    "vocab_size": (1, MAX_VOCAB),
}
# keys after "{arch}." that hold a finite float, with its open lower bound and closed upper bound (None: none)
ARCH_FLOATS: dict[str, tuple[float | None, float | None]] = {
    "rope.freq_base": (0.0, None),
    "attention.layer_norm_rms_epsilon": (0.0, 1.0),
    "rope.scaling.factor": (None, None),
    "rope.scaling.attn_factor": (None, None),
    "rope.scaling.yarn_log_multiplier": (None, None),
    "rope.scaling.yarn_beta_fast": (None, None),
    "rope.scaling.yarn_beta_slow": (None, None),
    "expert_weights_scale": (None, None),
}
_TOKENIZER_STRINGS = ("tokenizer.ggml.model", "tokenizer.ggml.pre")
_TOKENIZER_BOOLS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")
_IN_VOCAB = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")  # the engine indexes the vocabulary


def check_metadata(path: str, kv: dict[str, Any]) -> None:
    """``ModelError`` for the first value the engine reads that has the wrong type or lies out of range."""
    arch = kv.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelError(f"{path}: GGUF metadata lacks 'general.architecture' (a text) — {_FIX}")
    for suffix, (lo, hi) in ARCH_INTS.items():
        _int(path, kv, f"{arch}.{suffix}", lo, hi)
    for suffix, (above, upto) in ARCH_FLOATS.items():
        key = f"{arch}.{suffix}"
        if key in kv:
            value = kv[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise _bad(path, key, value, "not a finite number")
            if (above is not None and value <= above) or (upto is not None and value > upto):
                bounds = f"above {above:g}" + (f" and at most {upto:g}" if upto is not None else "")
                raise _bad(path, key, value, f"out of range (it must be {bounds})")
    _relations(path, kv, arch)
    vocab = _vocabulary(path, kv)
    for key in _TOKENIZER_STRINGS:
        if key in kv and not isinstance(kv[key], str):
            raise _bad(path, key, kv[key], "not a text")
    for key in _TOKENIZER_BOOLS:
        if key in kv and not isinstance(kv[key], bool):
            raise _bad(path, key, kv[key], "not true or false")
    for key in kv:
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            _int(path, kv, key, 0, vocab - 1 if vocab is not None and key in _IN_VOCAB else None)


def _relations(path: str, kv: dict[str, Any], arch: str) -> None:
    """What one hyper-parameter asks of another: whole key/value head groups, a head width from the embedding, no
    more experts used (or groups) than there are, no more leading dense blocks than blocks."""
    get: dict[str, int | None] = {suffix: kv.get(f"{arch}.{suffix}") for suffix in ARCH_INTS}
    heads, kv_heads, dim = get["attention.head_count"], get["attention.head_count_kv"], get["embedding_length"]
    if heads is not None and kv_heads is not None and heads % kv_heads:
        raise _bad(path, f"{arch}.attention.head_count_kv", kv_heads, f"not a divisor of head_count {heads}")
    if heads is not None and dim is not None and get["attention.key_length"] is None and dim % heads:
        raise _bad(path, f"{arch}.embedding_length", dim, f"not a multiple of head_count {heads}")
    for used, total in (("expert_used_count", "expert_count"), ("expert_group_used_count", "expert_group_count")):
        n, most = get[used], get[total] or 0
        if n is not None and n > most:
            raise _bad(path, f"{arch}.{used}", n, f"more than {total} {most}")
    if get["expert_count"] and not get["expert_used_count"]:
        raise _bad(path, f"{arch}.expert_used_count", get["expert_used_count"], "missing or 0 in a model with experts")
    dense, blocks = get["leading_dense_block_count"], get["block_count"]
    if dense is not None and blocks is not None and dense > blocks:
        raise _bad(path, f"{arch}.leading_dense_block_count", dense, f"more than block_count {blocks}")


def _vocabulary(path: str, kv: dict[str, Any]) -> int | None:
    """The vocabulary's size (None when the file has none); its token types and scores as long as it."""
    tokens = kv.get("tokenizer.ggml.tokens")
    if tokens is None:
        return None
    n = _array(path, "tokenizer.ggml.tokens", tokens, "texts", (_STRING,))
    if not 1 <= n <= MAX_VOCAB:
        raise _bad(path, "tokenizer.ggml.tokens", f"{n:,} tokens", f"out of range (1 to {MAX_VOCAB:,} tokens)")
    for key, kind, types in (
        ("tokenizer.ggml.token_type", "integers", _INT_TYPES),
        ("tokenizer.ggml.scores", "numbers", (*_FLOAT_TYPES, *_INT_TYPES)),
    ):
        if key in kv and _array(path, key, kv[key], kind, types) != n:
            raise _bad(path, key, f"{len(kv[key]) if isinstance(kv[key], list) else kv[key].count:,} entries",
                       f"not one per token ({n:,} tokens)")  # fmt: skip
    if "tokenizer.ggml.merges" in kv:
        _array(path, "tokenizer.ggml.merges", kv["tokenizer.ggml.merges"], "texts", (_STRING,))
    return n


def _array(path: str, key: str, value: Any, kind: str, itypes: tuple[int, ...]) -> int:
    """The length of the array ``value`` whose entries must be ``kind`` (GGUF value types ``itypes``)."""
    if isinstance(value, SkippedArray):
        if value.itype in itypes:
            return value.count
    elif isinstance(value, list):
        strings = itypes == (_STRING,)
        if all(isinstance(v, str) if strings else isinstance(v, (int, float)) for v in value):
            return len(value)
    raise _bad(path, key, _shown(value), f"not an array of {kind}")


def _int(path: str, kv: dict[str, Any], key: str, lo: int, hi: int | None) -> None:
    if key not in kv:
        return
    value = kv[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(path, key, _shown(value), "not an integer")
    if value < lo or (hi is not None and value > hi):
        raise _bad(path, key, value, f"out of range ({lo:,} to {hi:,})" if hi is not None else f"below {lo}")


def _shown(value: Any) -> Any:
    if isinstance(value, SkippedArray):
        return f"an array of {value.count:,}"
    if isinstance(value, list):
        return f"an array of {len(value):,}"
    if isinstance(value, str) and len(value) > 40:
        return value[:40] + "..."
    return value


def _bad(path: str, key: str, value: Any, problem: str) -> ModelError:
    return ModelError(f"{path}: metadata {key} = {value!r} is {problem} — {_FIX}")
