"""The one GGUF reader: every path that opens a GGUF file (``GGUFFile`` for computing and planning, ``read_header``
for checking a scenario) reads it here, without the ``gguf`` package.

``read_gguf(path)`` walks a GGUF (version 2 or 3, little-endian) through a memory map: its key-value section, then
its tensor infos. Every length, count and offset is checked against the file's size and against the maxima below
before anything is allocated for it, every tensor's bytes must lie inside the file, and the metadata the engine reads
is checked for its type and range (``ppharness.model.gguf.metadata``). A truncated, corrupt or hostile file fails with
``ModelError`` naming the file, what is wrong and the fix; nothing else escapes.

``read_header(path)`` is the same walk with arrays stepped over instead of decoded: a 128k-token vocabulary costs a
fraction of a second, for the few facts a scenario check needs.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppharness.errors import ModelError
from ppharness.model.formats.table import FORMATS
from ppharness.model.gguf.metadata import MAX_VOCAB, SkippedArray, check_metadata

# The maxima: far above any real model's, far below what would exhaust a machine.
MAX_KV = 1 << 16  # key-value pairs (a real file has tens)
MAX_TENSORS = 1 << 20  # tensor infos (Kimi K2 has about 1,100; per-expert files tens of thousands)
MAX_KEY_BYTES = 1 << 16  # one key (GGUF's own limit: 65,535)
MAX_STRING_BYTES = 1 << 24  # one string value (a chat template is tens of KB)
MAX_ARRAY = 1 << 24  # entries of one array (vocabulary-sized arrays are checked against MAX_VOCAB)
MAX_ARRAY_DEPTH = 4  # arrays of arrays
MAX_NAME_BYTES = 1 << 10  # one tensor name (ggml's is 64)
MAX_DIMS = 4  # a tensor's dimensions (ggml's GGML_MAX_DIMS)
MAX_ALIGNMENT = 1 << 16

_MAGIC = b"GGUF"
# value type -> struct format of one scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_TOKENS = "tokenizer.ggml.tokens"
_FIX = "the file is truncated or corrupt: download or convert it again"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file describes it: its dimensions innermost first (GGUF's ``ne``), its ggml type, and where
    its bytes lie in the file."""

    name: str
    dims: tuple[int, ...]
    type: int
    offset: int  # from the start of the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFContents:
    """A GGUF file's metadata and tensor infos, checked. ``kv`` holds every value (arrays as lists; with arrays
    skipped, a ``SkippedArray`` for each)."""

    path: str
    size: int
    kv: dict[str, Any]
    tensors: list[TensorInfo] = field(default_factory=list)


@dataclass(frozen=True)
class GGUFHeader:
    arch: str
    blocks: int
    context: int
    bos: bool  # a BOS token precedes the prompt (as ppharness.model.gguf.config.ModelConfig decides it)
    longest_token: int | None  # bytes of the longest entry of tokenizer.ggml.tokens


class _Reader:
    def __init__(self, buf: mmap.mmap, path: str, arrays: bool) -> None:
        self.buf, self.pos, self.path, self.arrays = buf, 0, path, arrays
        self.end = len(buf)

    def fail(self, what: str, fix: str = _FIX) -> ModelError:
        return ModelError(f"{self.path}: {what} (at byte {self.pos:,} of {self.end:,}) — {fix}")

    def take(self, n: int, what: str) -> int:
        """Advance past ``n`` bytes of ``what``; return where they start."""
        start = self.pos
        if n < 0 or start + n > self.end:
            raise self.fail(f"{what} ({n:,} bytes) runs past the end of the file")
        self.pos = start + n
        return start

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack_from("<" + fmt, self.buf, self.take(size, what))[0]

    def count(self, what: str, limit: int, unit: int) -> int:
        """A u64 count of ``what``, each at least ``unit`` bytes: within ``limit`` and what the rest of the file can
        hold."""
        n: int = self.unpack("Q", f"the count of {what}")
        if n > limit:
            raise self.fail(f"{n:,} {what} is above the limit of {limit:,}")
        if n * unit > self.end - self.pos:
            raise self.fail(f"{n:,} {what} cannot fit in the {self.end - self.pos:,} bytes left")
        return n

    def string(self, what: str, limit: int) -> str:
        n: int = self.unpack("Q", f"the length of {what}")
        if n > limit:
            raise self.fail(f"{what} is {n:,} bytes, above the limit of {limit:,}")
        start = self.take(n, what)
        try:
            return self.buf[start : start + n].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text") from None

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], f"the value of {key}")
        if vtype == _STRING:
            return self.string(f"the value of {key}", MAX_STRING_BYTES)
        if vtype != _ARRAY:
            raise self.fail(f"{key} has an unknown GGUF value type {vtype}")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"{key} nests arrays deeper than {MAX_ARRAY_DEPTH}")
        itype: int = self.unpack("I", f"the element type of {key}")
        unit = struct.calcsize("<" + _SCALARS[itype]) if itype in _SCALARS else 8 if itype == _STRING else 12
        limit = MAX_VOCAB if key == _TOKENS else MAX_ARRAY
        n = self.count(f"entries of {key}", limit, unit)
        if itype in _SCALARS:
            start = self.take(unit * n, f"the entries of {key}")
            if not self.arrays:
                return SkippedArray(itype, n)
            return list(struct.unpack_from(f"<{n}{_SCALARS[itype]}", self.buf, start))
        if itype == _STRING:
            return self.strings(key, n)
        if itype == _ARRAY:
            items = [self.value(_ARRAY, key, depth + 1) for _ in range(n)]
            return items if self.arrays else SkippedArray(itype, n)
        raise self.fail(f"{key} is an array of unknown GGUF value type {itype}")

    def strings(self, key: str, count: int) -> list[str] | SkippedArray:
        """``count`` strings: decoded, or (arrays skipped) stepped over, keeping the longest one's byte length."""
        buf, pos, end, longest = self.buf, self.pos, self.end, 0
        unpack = struct.Struct("<Q").unpack_from
        out: list[str] = []
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                raise self.fail(f"entry {i:,} of {key} runs past the end of the file")
            n = unpack(buf, pos)[0]
            if n > MAX_STRING_BYTES or pos + 8 + n > end:
                self.pos = pos
                raise self.fail(f"entry {i:,} of {key} ({n:,} bytes) runs past the end of the file")
            if self.arrays:
                try:
                    out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8"))
                except UnicodeDecodeError:
                    self.pos = pos
                    raise self.fail(f"entry {i:,} of {key} is not UTF-8 text") from None
            pos += 8 + n
            longest = max(longest, n)
        self.pos = pos
        return out if self.arrays else SkippedArray(_STRING, count, longest)


def read_gguf(path: str | os.PathLike[str], arrays: bool = True) -> GGUFContents:
    """A GGUF file's metadata and tensor infos, every part checked (arrays decoded, or with ``arrays=False`` stepped
    over); ``ModelError`` for a file that is not a readable, sane GGUF."""
    path = str(Path(path))
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Reader(buf, path, arrays))
    except (OSError, ValueError) as exc:  # a missing file; an empty file cannot be mapped
        raise ModelError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _parse(r: _Reader) -> GGUFContents:
    if r.end < 24 or bytes(r.buf[:4]) != _MAGIC:
        raise ModelError(f"{r.path}: not a GGUF file (it does not start with 'GGUF' and a header) — point at a .gguf")
    r.take(4, "the magic")
    version = r.unpack("I", "the version")
    if version not in (2, 3):
        raise r.fail(f"GGUF version {version} is not supported", "use a GGUF of version 2 or 3, little-endian")
    n_tensors = r.unpack("Q", "the tensor count")
    if n_tensors > MAX_TENSORS:
        raise r.fail(f"{n_tensors:,} tensors is above the limit of {MAX_TENSORS:,}")
    n_kv = r.count("key-value pairs", MAX_KV, 12)
    kv: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string("a metadata key", MAX_KEY_BYTES)
        if key in kv:
            raise r.fail(f"metadata key {key!r} appears twice")
        vtype = r.unpack("I", f"the value type of {key}")
        kv[key] = r.value(vtype, key)
    check_metadata(r.path, kv)
    if n_tensors * 24 > r.end - r.pos:
        raise r.fail(f"{n_tensors:,} tensors cannot fit in the {r.end - r.pos:,} bytes left")
    infos = [_tensor_info(r) for _ in range(n_tensors)]
    alignment = kv.get("general.alignment", 32)
    if not isinstance(alignment, int) or not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
        raise r.fail(f"general.alignment {alignment!r} is not a power of two up to {MAX_ALIGNMENT:,}")
    data_start = -(-r.pos // alignment) * alignment
    return GGUFContents(r.path, r.end, kv, _place(r, infos, data_start, alignment))


def _tensor_info(r: _Reader) -> tuple[str, tuple[int, ...], int, int]:
    name = r.string("a tensor name", MAX_NAME_BYTES)
    n_dims = r.unpack("I", f"the dimension count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise r.fail(f"tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
    dims = tuple(r.unpack("Q", f"a dimension of tensor {name!r}") for _ in range(n_dims))
    ggml_type = r.unpack("I", f"the type of tensor {name!r}")
    offset = r.unpack("Q", f"the offset of tensor {name!r}")
    return name, dims, ggml_type, offset


def _place(r: _Reader, infos: list[tuple[str, tuple[int, ...], int, int]], start: int, align: int) -> list[TensorInfo]:
    """The tensor infos with their bytes located: every type known, every size whole blocks, every tensor aligned and
    inside the file, no name twice."""
    out: list[TensorInfo] = []
    seen: set[str] = set()
    for name, dims, ggml_type, offset in infos:
        where = f"{r.path}: tensor {name!r}"
        if name in seen:
            raise ModelError(f"{where} appears twice — {_FIX}")
        seen.add(name)
        if ggml_type not in FORMATS:
            raise ModelError(f"{where} has unknown ggml type {ggml_type} — {_FIX}, or with a type ggml defines")
        block, block_bytes = FORMATS[ggml_type].block, FORMATS[ggml_type].bytes
        elements = 1
        for d in dims:
            elements *= d
        if not all(dims) or elements > 8 * r.end or dims[0] % block:  # at least 1/8 byte an element
            raise ModelError(
                f"{where} has dimensions {list(dims)}, which do not fit its type's blocks of {block} or the file's "
                f"{r.end:,} bytes — {_FIX}"
            )
        n_bytes = elements // block * block_bytes
        if offset % align or start + offset + n_bytes > r.end:
            raise ModelError(
                f"{where}'s {n_bytes:,} bytes at offset {offset:,} lie outside the file's {r.end:,} bytes (or off "
                f"its {align}-byte alignment) — {_FIX}"
            )
        out.append(TensorInfo(name, dims, ggml_type, start + offset, n_bytes))
    return out


def read_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The header's facts a scenario check needs; ``ModelError`` if the file is not a readable, sane GGUF file."""
    return header_facts(read_gguf(path, arrays=False))


def header_facts(contents: GGUFContents) -> GGUFHeader:
    """``read_header``'s facts of a file read with its arrays stepped over (``read_gguf(path, arrays=False)``)."""
    kv, where = contents.kv, contents.path
    arch = kv.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"{where}: GGUF metadata lacks 'general.architecture' — {_FIX}")
    facts = []
    for key in (f"{arch}.block_count", f"{arch}.context_length"):
        value = kv.get(key)
        if not isinstance(value, int):
            raise ModelError(f"{where}: GGUF metadata lacks {key!r} — {_FIX}")
        facts.append(value)
    bos = bool(kv.get("tokenizer.ggml.add_bos_token", True)) and "tokenizer.ggml.bos_token_id" in kv
    tokens = kv.get(_TOKENS)
    longest = tokens.longest if isinstance(tokens, SkippedArray) and tokens.longest else None
    return GGUFHeader(arch=arch, blocks=facts[0], context=facts[1], bos=bos, longest_token=longest)
