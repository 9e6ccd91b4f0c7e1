"""The float formats: F32 and F16, held as float16 on the device (F32 cast where it is read), and BF16, held packed
and widened to float32 inside the kernel (its 16 bits are a float32's top half)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ppharness.model.formats.bits import _u16
from ppharness.model.formats.codec import Codec, gguf_quantise
from ppharness.model.formats.table import named

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor


def _bf16(b: Tensor) -> Tensor:
    from tinygrad.dtype import dtypes

    out: Tensor = (_u16(b, 0).cast(dtypes.uint32) * 65536).bitcast(dtypes.float32).unsqueeze(-1)
    return out


CODECS = (
    Codec(named("F32"), gguf_quantise(named("F32"))),
    Codec(named("F16"), gguf_quantise(named("F16"))),
    Codec(named("BF16"), gguf_quantise(named("BF16")), unpack=_bf16),
)
