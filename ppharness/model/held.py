"""What the node runtime holds of a model's weights, tensor by tensor, in bytes: the planner's count of a block's,
the embedding's and the head's weights (``ppharness.plan.graph``) and a synthetic model's memory
(``ppharness.model.synthetic.spec.memory_needed``), read from a file's tensor types (``file_tensors``) or from a
synthetic spec's without writing it (``ppharness.model.synthetic.spec.stored_tensors``: ``tensor_type``, the writer's
rule).

A stage (``ppharness.model.engine.slicing.ModelSlice``, weights ``packed``, the default) holds:

- a matrix (a 2-D ``.weight``: the token embedding, the head, a block's projections) or a block's stack of routed
  experts (``ffn_{gate,up,down}_exps``, 3-D, held by an ``ExpertBank`` block by block) that the file stores in a type
  held packed (``ppharness.model.formats.codecs.packs``: BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) as the file packs
  it: its stored bytes (a stack's divide by its experts: each expert's rows alike);
- what its architecture computes with in float32 (``Architecture.keeps_f32``: a MoE block's router and the norm
  before it) and a router's selection bias (``Architecture.router_bias``, read apart, on the device for the routing):
  4 bytes an element;
- everything else as float16, 2 bytes an element: F16 and F32 matrices and expert stacks, norms and biases,
  deepseek2's per-head ``attn_k_b`` / ``attn_v_b`` (3-D, read whole by the block, not by a projection); a type the
  engine does not compute with counts as float16 too (a stage refuses it at load).

A tied head on a stage without the embedding holds the embedding's matrix again, as the embedding holds it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ppharness.model.formats.codecs import packs
from ppharness.model.formats.table import FORMATS
from ppharness.model.gguf.names import BLOCK_TENSOR, STAGE_TENSORS

if TYPE_CHECKING:
    from ppharness.model.arch.base import Architecture

FLOAT16 = 2  # bytes an element of what a stage holds as float16
FLOAT32 = 4  # bytes an element of what a stage holds as float32


@dataclass(frozen=True)
class Stored:
    """A tensor as its file stores it: its dimensions (either order) and its ggml type id."""

    dims: tuple[int, ...]
    ggml_type: int

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        """Its bytes in the file: whole blocks of its type (``ppharness.model.formats.table``), as the file places
        them."""
        f = FORMATS[self.ggml_type]
        return self.elements // f.block * f.bytes


def held_bytes(arch: Architecture, moe: frozenset[int], tensors: Mapping[str, Stored]) -> dict[str, int]:
    """Each tensor of ``tensors`` -> the bytes a stage holding it holds (the module's docstring); a routed expert
    stack's are the whole stack's (all the block's experts). ``moe``: the mixture-of-experts blocks."""
    out: dict[str, int] = {}
    for name, t in tensors.items():
        m = BLOCK_TENSOR.match(name)
        part = m.group(2) if m else ""
        if m and int(m.group(1)) in moe and part in arch.f32_tensors:  # Architecture.keeps_f32
            out[name] = t.elements * FLOAT32
        elif part and part == arch.router_bias:
            out[name] = t.elements * FLOAT32
        elif packs(t.ggml_type) and (part.endswith("_exps.weight") or (name.endswith(".weight") and len(t.dims) == 2)):
            out[name] = t.nbytes
        else:
            out[name] = t.elements * FLOAT16
    return out


def model_bytes(arch: Architecture, moe: frozenset[int], tensors: Mapping[str, Stored]) -> int:
    """What one stage holding the whole model holds of its weights (``held_bytes`` of every tensor a stage loads:
    the blocks' tensors, the embedding, the final norm and the head)."""
    held = held_bytes(arch, moe, tensors)
    return sum(b for name, b in held.items() if BLOCK_TENSOR.match(name) or name in STAGE_TENSORS)
