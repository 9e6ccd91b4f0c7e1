"""The weight formats the engine computes with, by ggml type id (``CODECS``), gathered from their families; and the
decisions every reader shares: is a format held packed, may a matrix be stored in it at all.
"""

from __future__ import annotations

from typing import Any

from numpy.typing import NDArray

from ppharness.errors import ModelError
from ppharness.model.formats import blocks32, floats, kquants
from ppharness.model.formats.codec import Codec
from ppharness.model.formats.table import named, type_name

CODECS: dict[int, Codec] = {
    c.format.id: c for c in sorted((*floats.CODECS, *blocks32.CODECS, *kquants.CODECS), key=lambda c: c.format.id)
}


def packs(ggml_type: int) -> bool:
    """Whether a matrix of ``ggml_type`` is held packed (every supported type but the float ones held as they are)."""
    codec = CODECS.get(ggml_type)
    return codec is not None and codec.packs


def check_format(ggml_type: int, name: str) -> None:
    """ModelError unless a matrix of ``ggml_type`` is one this engine computes with."""
    if ggml_type not in CODECS:
        raise ModelError(
            f"tensor {name!r} is stored as {type_name(ggml_type)}, which this engine does not compute with "
            f"(it reads {known()}) — quantise the model to one of those (llama-quantize Q4_K_M, Q5_K_M, Q6_K, Q8_0)"
        )


def known() -> str:
    """The formats the engine computes with, named, in type id order."""
    return ", ".join(c.format.name for c in CODECS.values())


def quantize(arr: NDArray[Any], name: str) -> NDArray[Any]:
    """``arr`` stored as the ggml type called ``name``: float32 for F32, float16 for F16, otherwise the uint8 bytes of
    its blocks (rows along the last axis)."""
    return CODECS[named(name).id].quantise(arr)
