"""Model architectures, one module each, looked up by the name a GGUF file's ``general.architecture`` gives.

An architecture (``base.Architecture``) owns what one family of models does not share with the others: its metadata
beyond the common keys, its tinygrad blocks, its tensor names, its part of the synthetic writer and what the plan
graph needs to cost it. ``ModelConfig``, ``GGUFFile``, ``ModelSlice``, the synthetic writer and
``ppharness.plan.graph`` look the architecture up here instead of branching on its name; a new architecture is one
module and one line in ``ARCHITECTURES``. The modules import tinygrad only when a block is built.
"""

from __future__ import annotations

from ppharness.errors import ModelError
from ppharness.model.arch.base import Architecture
from ppharness.model.arch.deepseek2 import DEEPSEEK2
from ppharness.model.arch.llama import LLAMA
from ppharness.model.arch.qwen import QWEN2, QWEN3
from ppharness.model.arch.qwen_moe import QWEN2MOE, QWEN3MOE

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA, QWEN2, QWEN3, QWEN3MOE, QWEN2MOE, DEEPSEEK2)}


def architecture(name: str) -> Architecture:
    """The registered architecture ``name`` (a synthetic model's ``arch``); ModelError naming the known ones."""
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ModelError(f"unknown architecture {name!r}: expected one of {', '.join(ARCHITECTURES)}") from None


def of_file(name: str, experts: int = 0) -> Architecture:
    """The architecture of a GGUF file whose metadata names ``name`` and ``experts`` routed experts; ModelError for
    an architecture not registered here (its blocks would be computed as another's) and for experts in one that does
    not route them."""
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise ModelError(
            f"architecture {name!r} is not one this engine computes: expected one of {', '.join(ARCHITECTURES)}"
        )
    if experts and not arch.moe:
        moe = ", ".join(n for n, a in ARCHITECTURES.items() if a.moe)
        raise ModelError(
            f"architecture {name!r} with experts is not supported; mixture-of-experts models load as {moe}"
        )
    return arch
