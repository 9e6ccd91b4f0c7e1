"""A GGUF file read for computing: its metadata as a ``ModelConfig``, its tensors on demand as the blocks need them,
and its tokenizer."""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from ppharness.errors import ModelError
from ppharness.model.arch import of_config, read_config
from ppharness.model.formats.codecs import check_format, packs
from ppharness.model.formats.packed import Packed
from ppharness.model.formats.table import FORMATS
from ppharness.model.gguf.config import ModelConfig
from ppharness.model.gguf.header import GGUFContents, read_gguf
from ppharness.model.gguf.names import ROPE_FACTORS
from ppharness.model.held import Stored
from ppharness.model.support import check_file
from ppharness.model.text.tokenizer import Tokenizer


class GGUFFile:
    """A GGUF file opened memory-mapped: metadata now, tensors on demand (as float16 numpy arrays; float32 for the
    few a block computes with in float32)."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._reader = _Tensors(read_gguf(self.path))
        self.kv: dict[str, Any] = self._reader.contents.kv
        self._tensors = {t.name: t for t in self._reader.tensors}
        try:
            config = read_config(self.kv, set(self._tensors))
            architecture = of_config(config)
            check_file(self.path, architecture, self.kv, set(self._tensors))
        except ModelError as exc:
            raise ModelError(str(exc) if str(exc).startswith(str(self.path)) else f"{self.path}: {exc}") from None
        except (ArithmeticError, LookupError, TypeError, ValueError) as exc:  # what the metadata checks do not foresee
            raise ModelError(
                f"{self.path}: the GGUF metadata does not describe a model this engine computes "
                f"({type(exc).__name__}: {exc}) — download or convert the model again"
            ) from None
        self._check_shapes(config)
        if ROPE_FACTORS in self._tensors:
            factors = self.vector(ROPE_FACTORS)
            if factors.shape != (config.head_dim // 2,):
                raise ModelError(
                    f"{self.path}: {ROPE_FACTORS} holds {factors.size} factors; a head of {config.head_dim} "
                    f"rotates {config.head_dim // 2} pairs"
                )
            config = dataclasses.replace(config, rope_factors=tuple(float(f) for f in factors))
        self.config = config
        self.architecture = architecture  # its layout of the tensors (``Architecture.file_tensor``)

    def _check_shapes(self, config: ModelConfig) -> None:
        """The embedding and the output head are (vocabulary, dim) as the metadata says (GGUF stores (dim, vocab))."""
        for name in ("token_embd.weight", "output.weight"):
            t = self._tensors.get(name)
            if t is not None and tuple(int(d) for d in t.shape) != (config.dim, config.vocab):
                raise ModelError(
                    f"{self.path}: tensor {name} has dimensions {[int(d) for d in t.shape]}, but the metadata says "
                    f"[{config.dim}, {config.vocab}] (embedding_length, tokens) — download or convert the model again"
                )

    def tensor(self, name: str, rows: list[int] | None = None) -> NDArray[np.float16]:
        """One tensor as float16 in tinygrad's (out, in) layout, as the architecture's blocks compute with it
        (``Architecture.file_tensor``: llama's Q/K rows reordered for half-split RoPE). ``rows`` picks entries of the
        outermost dimension (experts of a stacked expert tensor) before anything is converted, so a node reads only
        the experts it holds."""
        arr = self._values(name, rows).astype(np.float16)
        try:
            return np.ascontiguousarray(self.architecture.file_tensor(self.config, name, arr))
        except ValueError:  # a shape the architecture's reordering cannot take
            raise ModelError(
                f"{self.path}: tensor {name} of shape {list(arr.shape)} does not fit the model the metadata describes "
                "— download or convert the model again"
            ) from None

    def packed(self, name: str, rows: list[int] | None = None) -> Packed | None:
        """A matrix kept as the file packs it, on tinygrad's default device (``ppharness.model.formats.packed``), in the
        blocks' (out, in) layout (``Architecture.file_tensor``'s row order); ``rows`` as ``tensor``'s. None for a
        tensor whose type is held as float16 (F16, F32) or that is not a matrix."""
        t = self._tensor(name)
        check_format(int(t.tensor_type), name)
        if not packs(int(t.tensor_type)) or len(t.shape) < 2:
            return None
        shape = tuple(int(d) for d in reversed(t.shape))
        data = np.asarray(t.data)
        if rows is not None:
            self._check_rows(name, shape, rows)
            data = data.reshape(shape[0], *data.shape[-(len(shape) - 1) :])[rows]
            shape = (len(rows), *shape[1:])
        try:  # the architecture's row order: rows hold whole blocks, so reordering rows of bytes reorders the matrix
            data = self.architecture.file_tensor(self.config, name, data)
        except ValueError:
            raise ModelError(
                f"{self.path}: tensor {name} of shape {list(shape)} does not fit the model the metadata describes "
                "— download or convert the model again"
            ) from None
        return Packed.of(data, int(t.tensor_type), shape)

    def tensor_f32(self, name: str) -> NDArray[np.float32]:
        """One tensor as float32 in tinygrad's (out, in) layout, its values as the file stores them (an F32 tensor
        exactly), for what a block computes in float32 (``Architecture.f32_tensors``: a router and the norm before
        it). The architecture's reordering (``file_tensor``) is not applied: no such tensor needs it."""
        return self._values(name, None).astype(np.float32)  # a copy: F32 data is a view of the read-only mapping

    def _values(self, name: str, rows: list[int] | None) -> NDArray[np.float16] | NDArray[np.float32]:
        """A tensor's values in tinygrad's (out, in) layout: F16 and F32 as stored, any other type dequantised to
        float32; ``rows`` as ``tensor``'s."""
        import gguf

        t = self._tensor(name)
        shape = tuple(int(d) for d in reversed(t.shape))
        data = np.asarray(t.data)  # the element shape (quantised: the last dimension in bytes)
        if rows is not None:
            self._check_rows(name, shape, rows)
            data = data.reshape(shape[0], *data.shape[-(len(shape) - 1) :])[rows]
            shape = (len(rows), *shape[1:])
        if t.tensor_type not in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32):
            data = gguf.quants.dequantize(data, t.tensor_type)
        out: NDArray[np.float16] | NDArray[np.float32] = data.reshape(shape)
        return out

    def _tensor(self, name: str) -> FileTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise ModelError(f"{self.path}: tensor {name!r} is missing") from None

    def _check_rows(self, name: str, shape: tuple[int, ...], rows: list[int]) -> None:
        if any(not 0 <= r < shape[0] for r in rows):
            raise ModelError(f"{self.path}: tensor {name!r} has {shape[0]} rows; asked for rows {rows}")

    def tensor_type(self, name: str) -> int:
        """The ggml type id a tensor is stored in."""
        return int(self._tensor(name).tensor_type)

    def vector(self, name: str) -> NDArray[np.float32]:
        """A 1-D F32 or F16 tensor as float32 (what a router's selection bias needs: not rounded to float16)."""
        try:
            t = self._tensors[name]
        except KeyError:
            raise ModelError(f"{self.path}: tensor {name!r} is missing") from None
        return np.asarray(t.data, dtype=np.float32).reshape(-1).copy()

    def names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape as the file stores it (innermost dimension first)."""
        return {t.name: tuple(int(d) for d in t.shape) for t in self._reader.tensors}

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The file's tokenizer, built once (a 128k-token vocabulary in about a third of a second); ``ModelError``
        naming the file for one it cannot build (an unknown ``tokenizer.ggml.pre``)."""
        try:
            return tokenizer_from(self.kv)
        except ModelError as exc:
            raise ModelError(f"{self.path}: {exc}") from None
        except Exception as exc:  # the tokenizers library refuses a vocabulary or merges it cannot build
            raise ModelError(
                f"{self.path}: the vocabulary and merges do not make a tokenizer ({type(exc).__name__}: {exc}) — "
                "download or convert the model again"
            ) from None


def tokenizer_from(kv: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_kv(kv)


# the ggml types numpy holds element by element; any other is held as its bytes, a row's blocks in the last dimension
_NUMPY_TYPES: dict[int, type[np.generic]] = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


@dataclasses.dataclass(frozen=True)
class FileTensor:
    """A tensor of a file: its name, its ggml type (``gguf.GGMLQuantizationType``), its dimensions innermost first
    (GGUF's ``ne``) and its data, a read-only view of the mapping in numpy's order."""

    name: str
    tensor_type: Any
    shape: NDArray[np.uint64]
    data: NDArray[Any]


class _Tensors:
    """The tensors of a checked file (``read_gguf``) as views of one read-only mapping."""

    def __init__(self, contents: GGUFContents) -> None:
        import gguf

        self.contents = contents
        self.tensors: list[FileTensor] = []
        if not contents.tensors:
            return
        mapped = np.memmap(contents.path, dtype=np.uint8, mode="r")
        if mapped.size != contents.size:
            raise ModelError(f"{contents.path}: the file changed while it was read — read it again when it is written")
        for t in contents.tensors:
            shape = tuple(reversed(t.dims))
            raw = mapped[t.offset : t.offset + t.n_bytes]
            if t.type in _NUMPY_TYPES:
                data = raw.view(_NUMPY_TYPES[t.type]).reshape(shape)
            else:
                block, block_bytes = FORMATS[t.type].block, FORMATS[t.type].bytes
                data = raw.reshape(*shape[:-1], shape[-1] // block * block_bytes)
            ggml_type = gguf.GGMLQuantizationType(t.type)
            self.tensors.append(FileTensor(t.name, ggml_type, np.array(t.dims, dtype=np.uint64), data))


def file_tensors(f: GGUFFile) -> dict[str, Stored]:
    """Every tensor of the file ``f``: its dimensions (innermost first) and the type it is stored in."""
    return {name: Stored(dims, f.tensor_type(name)) for name, dims in f.shapes().items()}
