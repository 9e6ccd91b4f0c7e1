"""A GGUF file read for computing: its metadata as a ``ModelConfig``, its tensors on demand as the blocks need them,
and its tokenizer."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from ppharness.errors import ModelError
from ppharness.model.config import ModelConfig

if TYPE_CHECKING:  # gguf and tinygrad are imported when a file is opened or tokenizes, not with this module
    from tinygrad.apps.llm import SimpleTokenizer


class GGUFFile:
    """A GGUF file opened memory-mapped: metadata now, tensors on demand (as float16 numpy arrays)."""

    def __init__(self, path: str | os.PathLike[str]):
        import gguf

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except (OSError, ValueError) as exc:
            raise ModelError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        self.kv: dict[str, Any] = {k: f.contents() for k, f in self._reader.fields.items() if not k.startswith("GGUF.")}
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.config = ModelConfig.from_kv(self.kv, set(self._tensors))

    def tensor(self, name: str, rows: list[int] | None = None) -> NDArray[np.float16]:
        """One tensor as float16 in tinygrad's (out, in) layout, as the architecture's blocks compute with it
        (``Architecture.file_tensor``: llama's Q/K rows reordered for half-split RoPE). ``rows`` picks entries of the
        outermost dimension (experts of a stacked expert tensor) before anything is converted, so a node reads only
        the experts it holds."""
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
        if t.tensor_type in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32):
            arr = data
        else:
            arr = gguf.quants.dequantize(data, t.tensor_type)
        arr = arr.reshape(shape).astype(np.float16)
        return np.ascontiguousarray(self.config.architecture.file_tensor(self.config, name, arr))

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
    def tokenizer(self) -> SimpleTokenizer:
        """The file's tokenizer, built once (building one compiles a large regex: most of a second)."""
        return tokenizer_from(self.kv)


def tokenizer_from(kv: dict[str, Any]) -> SimpleTokenizer:
    from tinygrad.apps.llm import SimpleTokenizer

    tokenizer: SimpleTokenizer = SimpleTokenizer.from_gguf_kv(kv)  # tinygrad leaves its return type unannotated
    return tokenizer
