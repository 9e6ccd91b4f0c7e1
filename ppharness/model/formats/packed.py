"""Weights as the file packs them: a GGUF matrix kept on the device in its own type, dequantised inside the kernel that
reads it.

``Packed`` holds a matrix's raw bytes as one uint8 buffer, rows of ggml blocks, and ``Packed.values()`` is the tinygrad
expression that turns them into the matrix's values. That expression is never realised: a projection that multiplies
with it (``ppharness.model.layers.linear.DecodeLinear``) compiles the unpacking into its own matrix-vector or
matrix-matrix kernel, so the device holds the file's bytes (4.5 bits a weight for Q4_0 / Q4_K, 8.5 for Q8_0) and reads
only those.

Each format's unpacking is written from ggml's definition (``ggml-common.h``, ``dequantize_row_*`` in
``ggml-quants.c``) and checked element for element against the ``gguf`` package's numpy dequantiser
(``tests/test_packed.py``). Every value is computed in float32 from the block's fp16 scales, exactly the value ggml
defines (no rounding to float16), and a packed projection multiplies in float32 and rounds its output to the fp16 block
boundary (``DecodeLinear``): the matrix the engine computes with is the file's, not a float16 rounding of it.

F16 and F32 matrices need no unpacking and are held as such (F32 cast to float16 where it is read); the supported
types are ``ppharness.model.formats.codecs.CODECS``; any other quantised type is refused with its name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import NDArray

from ppharness.errors import ModelError
from ppharness.model.formats.codecs import CODECS, packs
from ppharness.model.formats.table import FORMATS, type_name

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor

    from ppharness.model.formats.codec import Unpack


# --- unpacking: (..., n_blocks, block bytes) uint8 -> (..., n_blocks, block elements) float32 ------------------------


@dataclass(eq=False, slots=True)  # no __dict__: tinygrad's state-dict walk leaves the bytes alone
class Packed:
    """A matrix (out, in), or a stack of them (experts, out, in), as its GGUF file packs it: ``raw`` is a uint8 tensor
    (..., out, bytes of a row) on the device; ``values()`` is the float32 matrix, computed where it is read."""

    raw: Tensor
    ggml_type: int
    shape: tuple[int, ...]

    @staticmethod
    def of(data: NDArray[Any], ggml_type: int, shape: tuple[int, ...], device: str | None = None) -> Packed:
        """A packed matrix from its bytes ``data`` (..., out, row bytes): the bytes copied to ``device``."""
        from tinygrad.tensor import Tensor

        if not packs(ggml_type):
            raise ModelError(f"{type_name(ggml_type)} matrices are not held packed")
        f = FORMATS[ggml_type]
        if shape[-1] % f.block or data.shape[-1] != f.row_bytes(shape[-1]):
            raise ModelError(
                f"a {f.name} matrix of {shape[-1]} columns has rows of {data.shape[-1]} bytes, "
                f"not {f.row_bytes(shape[-1])}"
            )
        raw = Tensor(np.require(data, np.uint8, ["C", "W"]), device=device).realize()  # a copy of a read-only mapping
        return Packed(raw, ggml_type, tuple(int(d) for d in shape))

    @property
    def nbytes(self) -> int:
        return math.prod(int(d) for d in self.raw.shape)

    @property
    def device(self) -> str | tuple[str, ...]:
        return self.raw.device

    def values(self, raw: Tensor | None = None) -> Tensor:
        """The matrix as float32, (..., out, in): an expression over ``raw`` (default: all of it; a shrunk view of it
        picks experts) that the kernel reading it computes."""
        r = self.raw if raw is None else raw
        codec = CODECS[self.ggml_type]
        size = codec.format.bytes
        lead = r.shape[:-1]
        blocks = r.reshape(*lead, int(r.shape[-1]) // size, size)
        out: Tensor = cast("Unpack", codec.unpack)(blocks).reshape(*lead, self.shape[-1])
        return out

    def product(self, x: Tensor) -> Tensor:
        """``x`` (..., in) times the matrix's transpose: (..., out) float32. Several positions on the CPU multiply the
        matrix unpacked into a buffer of its own. Else a format with a product of its own (``Codec.product``: Q4_0
        and Q4_1's half-block product) runs it; other formats multiply ``values()``."""
        device = self.raw.device
        if len(self.shape) == 2 and x.shape[-2] != 1 and isinstance(device, str) and device.split(":")[0] == "CPU":
            # several positions on the CPU (a prefill chunk): unpacked once into a float32 matrix of its own, then a
            # plain product; unpacking inside the product would unpack each weight again for every tile of rows
            out_rows: Tensor = x.float().matmul(self.values().contiguous().transpose())
            return out_rows
        special = CODECS[self.ggml_type].product
        if special is None or len(self.shape) != 2:
            out: Tensor = x.float().matmul(self.values().transpose())
            return out
        return special(self.raw, x, self.shape)

    def rows(self, idx: Tensor) -> Tensor:
        """The rows ``idx`` (int32, any shape) of a matrix (out, in), as float32 (``idx``'s shape, in): the bytes of
        each chosen row gathered (one nonzero term per sum, so exactly the row's bytes), then unpacked."""
        from tinygrad.dtype import dtypes
        from tinygrad.tensor import Tensor

        n, width = int(self.raw.shape[0]), int(self.raw.shape[1])
        hit = Tensor.arange(n, device=self.raw.device).reshape(n, 1) == idx.reshape(*idx.shape, 1, 1)
        picked = hit.where(self.raw.cast(dtypes.int32), 0).sum(-2).cast(dtypes.uint8)  # (..., width)
        return self.values(picked.reshape(*idx.shape, width))


class PackedEmbedding:
    """A token embedding (vocabulary, dim) kept packed: each id's row of bytes is gathered and unpacked, and the row
    rounded to the fp16 block boundary, as ``nn.Embedding``'s fp16 rows are."""

    def __init__(self, weight: Packed) -> None:
        self.weight = weight

    def __call__(self, idx: Tensor) -> Tensor:
        out: Tensor = self.weight.rows(idx).cast("float16")
        return out
