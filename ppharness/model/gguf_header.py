"""The few facts of a GGUF file's header that checking a scenario needs, read without the ``gguf`` package.

``read_header(path)`` walks the key-value section of a GGUF (version 2 or 3, little-endian) through a memory map and
keeps the architecture, block count, context length, BOS settings and the byte length of the vocabulary's longest
token; every other value is skipped by its length, so a 128k-token vocabulary costs a fraction of a second and no
tensor is touched. Every length is checked against the file, so a truncated or hostile file fails with
``ModelError`` instead of reading past its end.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ppharness.errors import ModelError

_MAGIC = b"GGUF"
# value type -> struct format of one scalar (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_TOKENS = "tokenizer.ggml.tokens"


@dataclass(frozen=True)
class _Longest:
    """An array of strings, by the byte length of its longest entry."""

    bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    arch: str
    blocks: int
    context: int
    bos: bool  # a BOS token precedes the prompt (as ppharness.model.config.ModelConfig decides it)
    longest_token: int | None  # bytes of the longest entry of tokenizer.ggml.tokens


class _Reader:
    def __init__(self, buf: mmap.mmap, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> int:
        """Advance past ``n`` bytes; return where they start."""
        start = self.pos
        if n < 0 or start + n > len(self.buf):
            raise ModelError(f"{self.path}: the GGUF header runs past the end of the file")
        self.pos = start + n
        return start

    def unpack(self, fmt: str) -> object:
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.buf, self.take(size))[0]

    def string(self) -> bytes:
        n = self.unpack("<Q")
        assert isinstance(n, int)
        start = self.take(n)
        return self.buf[start : start + n]

    def skip_strings(self, count: int) -> int:
        """Step over ``count`` strings; the longest one's byte length (0 for none)."""
        buf, pos, end, longest = self.buf, self.pos, len(self.buf), 0
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                raise ModelError(f"{self.path}: the GGUF header runs past the end of the file")
            n = unpack(buf, pos)[0]
            pos += 8 + n
            if pos > end:
                raise ModelError(f"{self.path}: the GGUF header runs past the end of the file")
            if n > longest:
                longest = n
        self.pos = pos
        return longest

    def value(self, vtype: int, keep: bool) -> object:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            if keep:
                return self.string().decode("utf-8", "replace")
            n = self.unpack("<Q")
            assert isinstance(n, int)
            self.take(n)
            return None
        if vtype == _ARRAY:
            itype, count = self.unpack("<I"), self.unpack("<Q")
            assert isinstance(itype, int) and isinstance(count, int)
            if itype in _SCALARS:
                self.take(struct.calcsize(_SCALARS[itype]) * count)
                return None
            if itype == _STRING:
                return _Longest(self.skip_strings(count))
            if itype == _ARRAY:
                for _ in range(count):
                    self.value(_ARRAY, False)
                return None
        raise ModelError(f"{self.path}: unknown GGUF value type {vtype}")


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The header's facts; ``ModelError`` if the file is not a readable llama-family GGUF file."""
    path = str(Path(path))
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Reader(buf, path))
    except (OSError, ValueError) as exc:  # an empty file cannot be mapped
        raise ModelError(f"{path}: not a readable GGUF file ({type(exc).__name__})") from None
    except struct.error:
        raise ModelError(f"{path}: the GGUF header runs past the end of the file") from None


def _parse(r: _Reader) -> GGUFHeader:
    if bytes(r.buf[:4]) != _MAGIC:
        raise ModelError(f"{r.path}: not a GGUF file (it does not start with 'GGUF')")
    r.take(4)
    version = r.unpack("<I")
    if version not in (2, 3):
        raise ModelError(f"{r.path}: GGUF version {version} is not supported (2 or 3, little-endian)")
    r.unpack("<Q")  # tensor count
    kv_count = r.unpack("<Q")
    assert isinstance(kv_count, int)
    kv: dict[str, object] = {}
    for _ in range(kv_count):
        key = r.string().decode("utf-8", "replace")
        vtype = r.unpack("<I")
        assert isinstance(vtype, int)
        wanted = key == "general.architecture"
        value = r.value(vtype, keep=wanted)
        if (
            wanted
            or key == _TOKENS
            or key.startswith("tokenizer.ggml.")
            or key.endswith((".block_count", ".context_length"))
        ):
            kv[key] = value
    try:
        arch = str(kv["general.architecture"])
        blocks = _int(kv[f"{arch}.block_count"])
        context = _int(kv[f"{arch}.context_length"])
    except KeyError as exc:
        raise ModelError(f"GGUF metadata lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError):
        raise ModelError(f"{r.path}: the GGUF block count or context length is not a number") from None
    bos = bool(kv.get("tokenizer.ggml.add_bos_token", True)) and "tokenizer.ggml.bos_token_id" in kv
    tokens = kv.get(_TOKENS)
    return GGUFHeader(
        arch=arch,
        blocks=blocks,
        context=context,
        bos=bos,
        longest_token=tokens.bytes if isinstance(tokens, _Longest) and tokens.bytes else None,
    )


def _int(value: object) -> int:
    """``int(value)`` for a number (or a text) read from the header; TypeError for anything else."""
    if isinstance(value, (int, float, str)):
        return int(value)
    raise TypeError(f"{type(value).__name__} is not a number")
