"""The formats of 32-element blocks with one fp16 scale (ggml's ``block_q8_0``, ``block_q4_0``, ``block_q4_1`` in
``ggml-common.h``): Q8_0 (int8 values), Q4_0 (nibbles less 8) and Q4_1 (nibbles and an fp16 minimum). Their values
are unpacked as ggml's ``dequantize_row_*`` defines them; Q4_0 and Q4_1 also multiply half-block by half-block
(``half_product``). Quantised by the ``gguf`` package's own quantisers."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from ppharness.model.formats.bits import _half, _nibbles
from ppharness.model.formats.codec import Codec, gguf_quantise
from ppharness.model.formats.table import Format, named

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor

Q4_0, Q4_1, Q8_0 = named("Q4_0"), named("Q4_1"), named("Q8_0")


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


def half_product(f: Format, raw: Tensor, x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``x`` (..., in) times the transpose of a matrix of ``f`` (Q4_0 or Q4_1), (..., out) float32: each block
    unpacked as its two halves (low nibbles: its first 16 values, high: its last 16), each half summed against its half
    of ``x`` and the two sums added. The same values as unpacking whole rows, without interleaving the halves into one
    row (which tinygrad compiles to a select per value: about twice the time on the CPU)."""
    from tinygrad.dtype import dtypes

    rows, cols = shape
    nb, size = cols // f.block, f.bytes
    b = raw.reshape(rows, nb, size)
    q = b[..., size - 16 : size].cast(dtypes.uint32)
    d, low, high = _half(b, 0), (q & 15).cast(dtypes.float32), q.rshift(4).cast(dtypes.float32)
    if f is Q4_0:  # d * (q - 8)
        low, high = d * (low - 8.0), d * (high - 8.0)
    else:  # Q4_1: d * q + m
        m = _half(b, 2)
        low, high = d * low + m, d * high + m
    xb = x.float().reshape(*x.shape[:-1], 1, nb, f.block)
    out: Tensor = (low * xb[..., :16]).sum((-1, -2)) + (high * xb[..., 16:]).sum((-1, -2))
    return out


CODECS = (
    Codec(Q4_0, gguf_quantise(Q4_0), unpack=_q4_0, product=functools.partial(half_product, Q4_0)),
    Codec(Q4_1, gguf_quantise(Q4_1), unpack=_q4_1, product=functools.partial(half_product, Q4_1)),
    Codec(Q8_0, gguf_quantise(Q8_0), unpack=_q8_0),
)
