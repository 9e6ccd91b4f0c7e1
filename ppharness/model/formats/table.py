"""Every ggml weight format, one line each: its type id (``ggml.h``'s ``ggml_type``), its name, the elements of a
block along a row and the bytes of a block, as ggml defines them (``ggml.c``'s ``type_traits``). The one table of
these facts: the file reader places tensors by it, the planner counts bytes by it, the synthetic writer picks types
by it, and ``ppharness.model.formats.codecs`` says which of them the engine computes with.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    """One ggml type: ``block`` elements along a row stored in ``bytes`` bytes."""

    id: int
    name: str
    block: int
    bytes: int

    def row_bytes(self, columns: int) -> int:
        """The bytes of one row of ``columns`` values."""
        return columns // self.block * self.bytes


FORMATS: dict[int, Format] = {f.id: f for f in (
    Format(0, "F32", 1, 4),
    Format(1, "F16", 1, 2),
    Format(2, "Q4_0", 32, 18),
    Format(3, "Q4_1", 32, 20),
    Format(6, "Q5_0", 32, 22),
    Format(7, "Q5_1", 32, 24),
    Format(8, "Q8_0", 32, 34),
    Format(9, "Q8_1", 32, 40),
    Format(10, "Q2_K", 256, 84),
    Format(11, "Q3_K", 256, 110),
    Format(12, "Q4_K", 256, 144),
    Format(13, "Q5_K", 256, 176),
    Format(14, "Q6_K", 256, 210),
    Format(15, "Q8_K", 256, 292),
    Format(16, "IQ2_XXS", 256, 66),
    Format(17, "IQ2_XS", 256, 74),
    Format(18, "IQ3_XXS", 256, 98),
    Format(19, "IQ1_S", 256, 50),
    Format(20, "IQ4_NL", 32, 18),
    Format(21, "IQ3_S", 256, 110),
    Format(22, "IQ2_S", 256, 82),
    Format(23, "IQ4_XS", 256, 136),
    Format(24, "I8", 1, 1),
    Format(25, "I16", 1, 2),
    Format(26, "I32", 1, 4),
    Format(27, "I64", 1, 8),
    Format(28, "F64", 1, 8),
    Format(29, "IQ1_M", 256, 56),
    Format(30, "BF16", 1, 2),
    Format(34, "TQ1_0", 256, 54),
    Format(35, "TQ2_0", 256, 66),
    Format(39, "MXFP4", 32, 17),
)}  # fmt: skip
BY_NAME: dict[str, Format] = {f.name: f for f in FORMATS.values()}
F32, F16, BF16 = BY_NAME["F32"].id, BY_NAME["F16"].id, BY_NAME["BF16"].id


def type_name(ggml_type: int) -> str:
    """The name of ggml type ``ggml_type``, or ``type N`` for an id ggml does not define."""
    f = FORMATS.get(ggml_type)
    return f.name if f is not None else f"type {ggml_type}"


def named(name: str) -> Format:
    """The ggml type called ``name`` (``Q4_K``)."""
    return BY_NAME[name]
