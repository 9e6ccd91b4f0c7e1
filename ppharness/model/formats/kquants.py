"""The ggml K-quant formats Q4_K, Q5_K and Q6_K: super-blocks of 256 elements in sub-blocks with their own scales.
Unpacked inside the kernel as ggml's ``dequantize_row_*`` defines them; quantised here, since the ``gguf`` package
(0.19) can dequantise them but not quantise.

Each is the exact block layout of ggml (``block_q4_K``, ``block_q5_K``, ``block_q6_K`` in ``ggml-common.h``;
``dequantize_row_*`` in ``ggml-quants.c``), so that ``gguf.quants.dequantize`` and llama.cpp read back the values
chosen here. The rows are super-blocks of 256 elements; a row of another length is refused (the synthetic writer
stores such a tensor in a fallback type, ``ppharness.model.synthetic.spec.tensor_type``). The choice of the scales is
simple, not llama.cpp's iterative search, and covers every value without clipping, so each element is within half its
sub-block's step of the input:

- Q4_K (144 bytes: f16 ``d``, f16 ``dmin``, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles) and Q5_K (176:
  the same with 32 bytes ``qh`` of fifth bits before the nibbles): value = ``d * sc * q - dmin * m`` over 8 sub-blocks
  of 32. A sub-block's offset is ``-min(0, its min)``; ``dmin`` is the largest offset / 63 rounded up to f16 and ``m``
  the offset / ``dmin`` rounded up, so the grid starts at or below the sub-block's min; the step the sub-block needs
  is (its max + ``dmin * m``) / 15 (31 for Q5_K), ``d`` the largest step / 63 rounded up to f16, ``sc`` the step /
  ``d`` rounded up, so the grid's top is at or above the max; ``q`` = round((x + dmin * m) / (d * sc)).
- Q6_K (210 bytes: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 ``d`` last): value =
  ``d * sc * (q - 32)`` over 16 sub-blocks of 16; a sub-block's step is its max |x| / 31, ``d`` the largest step / 127
  rounded up to f16, ``sc`` the step / ``d`` rounded up (1..127), ``q - 32`` = round(x / (d * sc)) in -31..31.

The work is whole-array numpy over every block at once (in chunks of rows, to bound the memory), no loop per block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from ppharness.model.formats.bits import _bits, _half
from ppharness.model.formats.codec import Codec
from ppharness.model.formats.table import named

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor

Q4_K, Q5_K, Q6_K = named("Q4_K"), named("Q5_K"), named("Q6_K")
QK_K = Q4_K.block  # elements per K-quant super-block, along a row
K_SCALE_SIZE = 12  # bytes of Q4_K's and Q5_K's packed 6-bit scales and mins
_CHUNK = 1 << 14  # super-blocks quantised at a time (4 Mi elements: some 100 MiB of float32 temporaries)

F32 = NDArray[np.float32]
_FOUR, _LOW = np.uint8(4), np.uint8(0x0F)  # uint8 operands keep the packing in uint8
U8 = NDArray[np.uint8]


def _f16_up(x: F32) -> NDArray[np.float16]:
    """The least float16 at or above each ``x`` (finite, >= 0)."""
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


def _ceil_ratio(num: F32, den: F32, top: int) -> F32:
    """ceil(num / den) clipped to 0..top, 0 where den is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(den > 0, np.ceil(num / den), 0)
    return np.clip(r, 0, top).astype(np.float32)


def _affine(x: F32, levels: int) -> tuple[U8, U8, U8, U8, U8]:
    """Q4_K / Q5_K's scales for ``x`` (blocks, 8, 32): (d, dmin as f16 bytes (blocks, 2) each, sc, m (blocks, 8), q
    (blocks, 8, 32) in 0..levels)."""
    offset = -np.minimum(x.min(axis=-1), 0)  # (blocks, 8), >= 0
    dmin = _f16_up(offset.max(axis=-1) / np.float32(63))
    m = _ceil_ratio(offset, dmin.astype(np.float32)[:, None], 63)
    low = dmin.astype(np.float32)[:, None] * m  # the grid's bottom is -low <= the sub-block's min
    need = (x.max(axis=-1) + low) / np.float32(levels)  # >= 0
    d = _f16_up(need.max(axis=-1) / np.float32(63))
    sc = _ceil_ratio(need, d.astype(np.float32)[:, None], 63)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint((x + low[..., None]) / step), 0)
    q8 = np.clip(q, 0, levels).astype(np.uint8)
    return (
        d.view(np.uint8).reshape(-1, 2),
        dmin.view(np.uint8).reshape(-1, 2),
        sc.astype(np.uint8),
        m.astype(np.uint8),
        q8,
    )


def _pack_scales(sc: U8, m: U8) -> U8:
    """8 six-bit scales and mins as ggml packs them (``get_scale_min_k4``): bytes 0-3 hold scales 0-3 and the top two
    bits of scales 4-7, bytes 4-7 mins 0-3 and the top bits of mins 4-7, bytes 8-11 the low nibbles of scales 4-7
    (low) and mins 4-7 (high)."""
    out = np.empty((sc.shape[0], K_SCALE_SIZE), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> _FOUR) << np.uint8(6))
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> _FOUR) << np.uint8(6))
    out[:, 8:12] = (sc[:, 4:] & _LOW) | ((m[:, 4:] & _LOW) << _FOUR)
    return out


def _nibbles(q: U8) -> U8:
    """(blocks, 8, 32) values of 0..15 -> (blocks, 128): chunk j's byte l holds sub-block 2j's element l in its low
    nibble and sub-block 2j+1's in its high nibble."""
    pairs = q.reshape(q.shape[0], 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << _FOUR)).reshape(q.shape[0], 128)


def _q4_k_blocks(x: F32) -> U8:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 8, 32), 15)
    return np.concatenate([d, dmin, _pack_scales(sc, m), _nibbles(q)], axis=1)


def _q5_k_blocks(x: F32) -> U8:
    d, dmin, sc, m, q = _affine(x.reshape(-1, 8, 32), 31)
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # sub-block k's fifth bits are bit k of qh
    qh = np.bitwise_or.reduce((q >> _FOUR) << shifts, axis=1)  # (blocks, 32)
    return np.concatenate([d, dmin, _pack_scales(sc, m), qh, _nibbles(q & _LOW)], axis=1)


def _q6_k_blocks(x: F32) -> U8:
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    need = np.abs(sub).max(axis=-1) / np.float32(31)  # (n, 16)
    d = _f16_up(need.max(axis=-1) / np.float32(127))
    sc = _ceil_ratio(need, d.astype(np.float32)[:, None], 127)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.rint(sub / step), 0)
    lv = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # half h, quarter k: element 128h+32k+l
    ql = ((lv[:, :, 0:2] & _LOW) | ((lv[:, :, 2:4] & _LOW) << _FOUR)).reshape(n, 128)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = np.bitwise_or.reduce((lv >> _FOUR) << shifts, axis=2).reshape(n, 64)
    scales = sc.astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh, scales, d.view(np.uint8).reshape(n, 2)], axis=1)


_BLOCKS: dict[str, Callable[[F32], U8]] = {"Q4_K": _q4_k_blocks, "Q5_K": _q5_k_blocks, "Q6_K": _q6_k_blocks}


def quantize_k(arr: NDArray[Any], ggml_type: str) -> U8:
    """``arr`` (any float dtype, rows along its last axis) in the K-quant ``ggml_type`` (``Q4_K``, ``Q5_K``, ``Q6_K``):
    uint8 of shape (..., row // 256 * block bytes), as ``gguf.quants.quantize`` returns its types. ValueError for a
    row whose length is not a multiple of 256."""
    encode, size = _BLOCKS[ggml_type], named(ggml_type).bytes
    x = np.asarray(arr, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % QK_K:
        raise ValueError(f"{ggml_type} stores rows in blocks of {QK_K}: a row of {x.shape[-1] if x.ndim else 0}")
    blocks = x.reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], size), dtype=np.uint8)
    for start in range(0, blocks.shape[0], _CHUNK):
        out[start : start + _CHUNK] = encode(blocks[start : start + _CHUNK])
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK_K * size)


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


CODECS = (
    Codec(Q4_K, functools.partial(quantize_k, ggml_type="Q4_K"), unpack=_q4_k),
    Codec(Q5_K, functools.partial(quantize_k, ggml_type="Q5_K"), unpack=_q5_k),
    Codec(Q6_K, functools.partial(quantize_k, ggml_type="Q6_K"), unpack=_q6_k),
)
