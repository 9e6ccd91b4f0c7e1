"""Reading the bytes of ggml blocks on tinygrad: little-endian integers and fp16 scales, nibbles and bit groups, as
float32 expressions that the kernel reading a packed matrix computes."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor


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


def _bits(q: Tensor, n: int, width: int) -> Tensor:
    """(..., 1, m) uint32 -> (..., n, m): bit group i of each value, ``(q >> width*i) & (2**width - 1)``."""
    mask = (1 << width) - 1
    out: Tensor = q.cat(*[q.rshift(width * i) for i in range(1, n)], dim=-2) & mask
    return out
