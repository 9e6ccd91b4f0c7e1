"""Weights as the file packs them: a GGUF matrix kept on the device in its own type, dequantised inside the kernel that
reads it.

``Packed`` holds a matrix's raw bytes as one uint8 buffer, rows of ggml blocks, and ``Packed.values()`` is the tinygrad
expression that turns them into the matrix's values. That expression is never realised: a projection that multiplies
with it (``ppharness.model.direct.DecodeLinear``) compiles the unpacking into its own matrix-vector or matrix-matrix
kernel, so the device holds the file's bytes (4.5 bits a weight for Q4_0 / Q4_K, 8.5 for Q8_0) and reads only those.

Each format's unpacking is written from ggml's definition (``ggml-common.h``, ``dequantize_row_*`` in
``ggml-quants.c``) and checked element for element against the ``gguf`` package's numpy dequantiser
(``tests/test_packed.py``). Every value is computed in float32 from the block's fp16 scales, exactly the value ggml
defines (no rounding to float16), and a packed projection multiplies in float32 and rounds its output to the fp16 block
boundary (``DecodeLinear``): the matrix the engine computes with is the file's, not a float16 rounding of it.

F16 and F32 matrices need no unpacking and are held as such (F32 cast to float16 where it is read); the supported
types are ``TYPES``; any other quantised type is refused with its name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from ppharness.errors import ModelError

if TYPE_CHECKING:
    from collections.abc import Callable

    from tinygrad.tensor import Tensor

# ggml type id -> (name, elements per block, bytes per block)
TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
F32, F16, BF16 = 0, 1, 30


def type_name(ggml_type: int) -> str:
    return TYPES[ggml_type][0] if ggml_type in TYPES else f"type {ggml_type}"


def packs(ggml_type: int) -> bool:
    """Whether a matrix of ``ggml_type`` is held packed (every supported type but the float ones held as they are)."""
    return ggml_type in TYPES and ggml_type not in (F32, F16)


def row_bytes(ggml_type: int, columns: int) -> int:
    """The bytes of one row of ``columns`` values in ``ggml_type``."""
    _, block, size = TYPES[ggml_type]
    return columns // block * size


# --- unpacking: (..., n_blocks, block bytes) uint8 -> (..., n_blocks, block elements) float32 ------------------------


def _u16(b: Tensor, i: int) -> Tensor:
    from tinygrad.dtype import dtypes

    out: Tensor = b[..., i].cast(dtypes.uint16) + b[..., i + 1].cast(dtypes.uint16) * 256
    return out


def _half(b: Tensor, i: int) -> Tensor:
    """The little-endian fp16 at byte ``i`` of each block, as float32 (..., n_blocks, 1)."""
    from tinygrad.dtype import dtypes

    return _u16(b, i).bitcast(dtypes.float16).cast(dtypes.float32).unsqueeze(-1)


def _nibbles(qs: Tensor) -> Tensor:
    """(..., n) bytes -> (..., 2n) their low nibbles, then their high nibbles, as float32."""
    from tinygrad.dtype import dtypes

    q = qs.cast(dtypes.uint32)
    out: Tensor = (q & 15).cat(q.rshift(4), dim=-1).cast(dtypes.float32)
    return out


def _q8_0(b: Tensor) -> Tensor:
    from tinygrad.dtype import dtypes

    out: Tensor = _half(b, 0) * b[..., 2:34].bitcast(dtypes.int8).cast(dtypes.float32)
    return out


def _q4_0(b: Tensor) -> Tensor:
    out: Tensor = _half(b, 0) * (_nibbles(b[..., 2:18]) - 8.0)
    return out


def _q4_1(b: Tensor) -> Tensor:
    out: Tensor = _half(b, 0) * _nibbles(b[..., 4:20]) + _half(b, 2)
    return out


def _k_scales(s: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K's 12 scale bytes -> the 8 sub-blocks' 6-bit scales and mins (ggml's ``get_scale_min_k4``), int32."""
    from tinygrad.dtype import dtypes

    s = s.cast(dtypes.uint32)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = (lo & 63).cat((hi & 15) | (lo.rshift(6) * 16), dim=-1)
    mn = (mid & 63).cat(hi.rshift(4) | (mid.rshift(6) * 16), dim=-1)
    return sc, mn


def _k_values(b: Tensor, q: Tensor) -> Tensor:
    """``d * sc * q - dmin * m`` over the 8 sub-blocks of 32 of a Q4_K / Q5_K block; ``q`` (..., 8, 32) float32."""
    from tinygrad.dtype import dtypes

    sc, mn = _k_scales(b[..., 4:16])
    d, dmin = _half(b, 0), _half(b, 2)  # (..., 1)
    scale = (d * sc.cast(dtypes.float32)).unsqueeze(-1)
    low = (dmin * mn.cast(dtypes.float32)).unsqueeze(-1)
    out: Tensor = (scale * q - low).flatten(-2)
    return out


def _q4_k(b: Tensor) -> Tensor:
    from tinygrad.dtype import dtypes

    qs = b[..., 16:144].cast(dtypes.uint32).reshape(*b.shape[:-1], 4, 32)  # chunk j: sub-blocks 2j (low), 2j+1 (high)
    q = (qs & 15).unsqueeze(-2).cat(qs.rshift(4).unsqueeze(-2), dim=-2)  # (..., 4, 2, 32)
    return _k_values(b, q.reshape(*b.shape[:-1], 8, 32).cast(dtypes.float32))


def _q5_k(b: Tensor) -> Tensor:
    from tinygrad.dtype import dtypes

    lead = b.shape[:-1]
    qh = b[..., 16:48].cast(dtypes.uint32).reshape(*lead, 1, 32)
    qs = b[..., 48:176].cast(dtypes.uint32).reshape(*lead, 4, 32)
    high = _bits(qh, 8, 1) * 16  # sub-block i's fifth bit is bit i of qh
    q = (qs & 15).unsqueeze(-2).cat(qs.rshift(4).unsqueeze(-2), dim=-2).reshape(*lead, 8, 32)
    return _k_values(b, (q + high).cast(dtypes.float32))


def _q6_k(b: Tensor) -> Tensor:
    from tinygrad.dtype import dtypes

    lead = b.shape[:-1]
    ql = b[..., 0:128].cast(dtypes.uint32).reshape(*lead, 2, 2, 32)  # (half n, quarter pair, l)
    qh = b[..., 128:192].cast(dtypes.uint32).reshape(*lead, 2, 1, 32)
    low = (ql & 15).unsqueeze(-3).cat(ql.rshift(4).unsqueeze(-3), dim=-3)  # (..., 2, 2[nibble], 2[+32], 32)
    low = low.reshape(*lead, 2, 4, 32)  # quarter k = nibble*2 + (l >= 32): elements 128n + 32k + l
    high = _bits(qh, 4, 2) * 16  # quarter k's two high bits: (qh >> 2k) & 3
    q = ((low + high).cast(dtypes.float32) - 32.0).reshape(*lead, 16, 16)  # 16 sub-blocks of 16
    scales = b[..., 192:208].bitcast(dtypes.int8).cast(dtypes.float32).unsqueeze(-1)  # (..., 16, 1)
    d = _half(b, 208).unsqueeze(-1)
    out: Tensor = (d * scales * q).flatten(-2)
    return out


def _bits(q: Tensor, n: int, width: int) -> Tensor:
    """(..., 1, m) uint32 -> (..., n, m): bit group i of each value, ``(q >> width*i) & (2**width - 1)``."""
    mask = (1 << width) - 1
    out: Tensor = q.cat(*[q.rshift(width * i) for i in range(1, n)], dim=-2) & mask
    return out


def _bf16(b: Tensor) -> Tensor:
    from tinygrad.dtype import dtypes

    out: Tensor = (_u16(b, 0).cast(dtypes.uint32) * 65536).bitcast(dtypes.float32).unsqueeze(-1)
    return out


UNPACK: dict[int, Callable[[Tensor], Tensor]] = {
    2: _q4_0,
    3: _q4_1,
    8: _q8_0,
    12: _q4_k,
    13: _q5_k,
    14: _q6_k,
    30: _bf16,
}


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
        _, block, _ = TYPES[ggml_type]
        if shape[-1] % block or data.shape[-1] != row_bytes(ggml_type, shape[-1]):
            raise ModelError(
                f"a {type_name(ggml_type)} matrix of {shape[-1]} columns has rows of {data.shape[-1]} bytes, "
                f"not {row_bytes(ggml_type, shape[-1])}"
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
        _, _, size = TYPES[self.ggml_type]
        lead = r.shape[:-1]
        blocks = r.reshape(*lead, int(r.shape[-1]) // size, size)
        out: Tensor = UNPACK[self.ggml_type](blocks).reshape(*lead, self.shape[-1])
        return out

    def product(self, x: Tensor) -> Tensor:
        """``x`` (..., in) times the matrix's transpose: (..., out) float32. Several positions on the CPU multiply the
        matrix unpacked into a buffer of its own. Else Q4_0 and Q4_1 are unpacked as the two
        halves of each block (low nibbles: its first 16 values, high: its last 16), each half summed against its
        half of ``x`` and the two sums added: the same values as ``values()``, without interleaving the halves into
        one row (which tinygrad compiles to a select per value: about twice the time on the CPU). Other types multiply
        ``values()``."""
        from tinygrad.dtype import dtypes

        device = self.raw.device
        if len(self.shape) == 2 and x.shape[-2] != 1 and isinstance(device, str) and device.split(":")[0] == "CPU":
            # several positions on the CPU (a prefill chunk): unpacked once into a float32 matrix of its own, then a
            # plain product; unpacking inside the product would unpack each weight again for every tile of rows
            out_rows: Tensor = x.float().matmul(self.values().contiguous().transpose())
            return out_rows
        if self.ggml_type not in (2, 3) or len(self.shape) != 2:
            out: Tensor = x.float().matmul(self.values().transpose())
            return out
        rows, cols = self.shape
        nb, size = cols // 32, TYPES[self.ggml_type][2]
        b = self.raw.reshape(rows, nb, size)
        q = b[..., size - 16 : size].cast(dtypes.uint32)
        d, low, high = _half(b, 0), (q & 15).cast(dtypes.float32), q.rshift(4).cast(dtypes.float32)
        if self.ggml_type == 2:
            low, high = d * (low - 8.0), d * (high - 8.0)
        else:
            m = _half(b, 2)
            low, high = d * low + m, d * high + m
        xb = x.float().reshape(*x.shape[:-1], 1, nb, 32)
        out = (low * xb[..., :16]).sum((-1, -2)) + (high * xb[..., 16:]).sum((-1, -2))
        return out

    def rows(self, idx: Tensor) -> Tensor:
        """The rows ``idx`` (int32, any shape) of a matrix (out, in), as float32 (``idx``'s shape, in): the bytes of
        each chosen row gathered (one nonzero term per sum, so exactly the row's bytes), then unpacked."""
        from tinygrad.dtype import dtypes
        from tinygrad.tensor import Tensor

        n, width = int(self.raw.shape[0]), int(self.raw.shape[1])
        hit = Tensor.arange(n, device=self.raw.device).reshape(n, 1) == idx.reshape(*idx.shape, 1, 1)
        picked = hit.where(self.raw.cast(dtypes.int32), 0).sum(-2).cast(dtypes.uint8)  # (..., width)
        return self.values(picked.reshape(*idx.shape, width))


def held_type(ggml_type: int, name: str) -> None:
    """ModelError unless a matrix of ``ggml_type`` is one this engine computes with."""
    if ggml_type not in TYPES:
        known = ", ".join(n for n, _, _ in TYPES.values())
        raise ModelError(
            f"tensor {name!r} is stored as {type_name(ggml_type)}, which this engine does not compute with "
            f"(it reads {known}) — quantise the model to one of those (llama-quantize Q4_K_M, Q5_K_M, Q6_K, Q8_0)"
        )


class PackedEmbedding:
    """A token embedding (vocabulary, dim) kept packed: each id's row of bytes is gathered and unpacked, and the row
    rounded to the fp16 block boundary, as ``nn.Embedding``'s fp16 rows are."""

    def __init__(self, weight: Packed) -> None:
        self.weight = weight

    def __call__(self, idx: Tensor) -> Tensor:
        out: Tensor = self.weight.rows(idx).cast("float16")
        return out
