"""The names of a GGUF file's tensors that every architecture shares: a block's tensors (``blk.{layer}.{part}``),
those outside the blocks, and the mixture-of-experts blocks the names reveal."""

from __future__ import annotations

import re
from collections.abc import Iterable

BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")  # a block's tensor: blk.{layer}.{part}
STAGE_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight")  # a stage's tensors outside the blocks
ROPE_FACTORS = "rope_freqs.weight"  # Llama-3's rotary frequency factors, one per pair of a head
ROUTER = "ffn_gate_inp.weight"  # a mixture-of-experts block's router


def moe_blocks(names: Iterable[str]) -> frozenset[int]:
    """The blocks with a router (``blk.N.ffn_gate_inp.weight``): a model's mixture-of-experts blocks."""
    return frozenset(int(m.group(1)) for n in names if (m := BLOCK_TENSOR.match(n)) and m.group(2) == ROUTER)
