"""What a weight format the engine computes with provides (``Codec``): how its blocks unpack into values inside a
kernel, how values are quantised into its blocks, and, where the format has one, a product of its own that beats
multiplying the unpacked matrix. One family of formats a file: ``floats``, ``blocks32``, ``kquants``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from ppharness.model.formats.table import Format

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor

# (..., n_blocks, block bytes) uint8 -> (..., n_blocks, block elements) float32, an expression the reading kernel runs
Unpack = Callable[["Tensor"], "Tensor"]
# (the matrix's raw bytes (out, row bytes), x (..., in), the matrix's shape) -> x times the matrix's transpose, float32
Product = Callable[["Tensor", "Tensor", tuple[int, ...]], "Tensor"]
Quantise = Callable[[NDArray[Any]], NDArray[Any]]


@dataclass(frozen=True)
class Codec:
    """A format the engine computes with. ``unpack`` None: held as float16, not packed (F16, F32)."""

    format: Format
    quantise: Quantise
    unpack: Unpack | None = None
    product: Product | None = None

    @property
    def packs(self) -> bool:
        """Whether a matrix of this format is held on the device as the file packs it."""
        return self.unpack is not None


def _gguf_quantise(name: str, arr: NDArray[Any]) -> NDArray[Any]:
    import gguf  # loads with the writer only

    out: NDArray[Any] = gguf.quants.quantize(np.asarray(arr), gguf.GGMLQuantizationType[name])
    return out


def gguf_quantise(f: Format) -> Quantise:
    """The ``gguf`` package's own quantiser of ``f``: float32 for F32, float16 for F16, otherwise the uint8 bytes of
    its blocks (rows along the last axis)."""
    return functools.partial(_gguf_quantise, f.name)
