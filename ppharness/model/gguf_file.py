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
from ppharness.model.arch.llama import ROPE_FACTORS
from ppharness.model.config import ModelConfig
from ppharness.model.support import check_file
from ppharness.model.tokenizer import Tokenizer


class GGUFFile:
    """A GGUF file opened memory-mapped: metadata now, tensors on demand (as float16 numpy arrays; float32 for the
    few a block computes with in float32)."""

    def __init__(self, path: str | os.PathLike[str]):
        import gguf

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except (OSError, ValueError) as exc:
            raise ModelError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        self.kv: dict[str, Any] = {k: f.contents() for k, f in self._reader.fields.items() if not k.startswith("GGUF.")}
        self._tensors = {t.name: t for t in self._reader.tensors}
        config = ModelConfig.from_kv(self.kv, set(self._tensors))
        check_file(self.path, config.architecture, self.kv, set(self._tensors))
        if ROPE_FACTORS in self._tensors:
            factors = self.vector(ROPE_FACTORS)
            if factors.shape != (config.head_dim // 2,):
                raise ModelError(
                    f"{self.path}: {ROPE_FACTORS} holds {factors.size} factors; a head of {config.head_dim} "
                    f"rotates {config.head_dim // 2} pairs"
                )
            config = dataclasses.replace(config, rope_factors=tuple(float(f) for f in factors))
        self.config = config

    def tensor(self, name: str, rows: list[int] | None = None) -> NDArray[np.float16]:
        """One tensor as float16 in tinygrad's (out, in) layout, as the architecture's blocks compute with it
        (``Architecture.file_tensor``: llama's Q/K rows reordered for half-split RoPE). ``rows`` picks entries of the
        outermost dimension (experts of a stacked expert tensor) before anything is converted, so a node reads only
        the experts it holds."""
        arr = self._values(name, rows).astype(np.float16)
        return np.ascontiguousarray(self.config.architecture.file_tensor(self.config, name, arr))

    def tensor_f32(self, name: str) -> NDArray[np.float32]:
        """One tensor as float32 in tinygrad's (out, in) layout, its values as the file stores them (an F32 tensor
        exactly), for what a block computes in float32 (``Architecture.f32_tensors``: a router and the norm before
        it). The architecture's reordering (``file_tensor``) is not applied: no such tensor needs it."""
        return self._values(name, None).astype(np.float32)  # a copy: F32 data is a view of the read-only mapping

    def _values(self, name: str, rows: list[int] | None) -> NDArray[np.float16] | NDArray[np.float32]:
        """A tensor's values in tinygrad's (out, in) layout: F16 and F32 as stored, any other type dequantised to
        float32; ``rows`` as ``tensor``'s."""
        import gguf

        try:
            t = self._tensors[name]
        except KeyError:
            raise ModelError(f"{self.path}: tensor {name!r} is missing") from None
        shape = tuple(int(d) for d in reversed(t.shape))
        data = np.asarray(t.data)  # the element shape (quantised: the last dimension in bytes)
        if rows is not None:
            data = data.reshape(shape[0], *data.shape[-(len(shape) - 1) :])[rows]
            shape = (len(rows), *shape[1:])
        if t.tensor_type not in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32):
            data = gguf.quants.dequantize(data, t.tensor_type)
        out: NDArray[np.float16] | NDArray[np.float32] = data.reshape(shape)
        return out

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


def tokenizer_from(kv: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_kv(kv)
