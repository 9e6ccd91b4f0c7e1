"""Model architectures, one module each, looked up by the name a GGUF file's ``general.architecture`` gives.

An architecture (``base.Architecture``) owns what one family of models does not share with the others: its metadata
beyond the common keys, its tinygrad blocks, its tensor names, its part of the synthetic writer and what the plan
graph needs to cost it. ``read_config``, ``GGUFFile``, ``ModelSlice``, the synthetic writer and
``ppharness.plan.graph`` look the architecture up here instead of branching on its name; a new architecture is one
module and one line in ``ARCHITECTURES``. The modules import tinygrad only when a block is built.
"""

from __future__ import annotations

from typing import Any

from ppharness.errors import ModelError
from ppharness.model.arch.base import Architecture
from ppharness.model.arch.deepseek2 import DEEPSEEK2
from ppharness.model.arch.llama import LLAMA
from ppharness.model.arch.qwen import QWEN2, QWEN3
from ppharness.model.arch.qwen_moe import QWEN2MOE, QWEN3MOE
from ppharness.model.gguf.config import ModelConfig
from ppharness.model.gguf.names import moe_blocks as blocks_with_router
from ppharness.model.text.eog import end_of_generation

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


def of_config(cfg: ModelConfig) -> Architecture:
    """The architecture a file's ``cfg`` computes as."""
    return of_file(cfg.arch, cfg.experts)


def read_config(kv: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """A GGUF file's ``ModelConfig``: the shared keys, then the architecture's own (``Architecture.read``); ModelError
    naming a key the file lacks, or for experts in an architecture that does not route them."""
    try:
        arch = kv["general.architecture"]
        dim, heads = int(kv[f"{arch}.embedding_length"]), int(kv[f"{arch}.attention.head_count"])
        experts = int(kv.get(f"{arch}.expert_count", 0))
        routed = blocks_with_router(tensor_names)
        architecture = of_file(arch, experts)
        fields: dict[str, Any] = dict(
            experts=experts,
            experts_used=int(kv[f"{arch}.expert_used_count"]) if experts else 0,
            expert_ffn=int(kv.get(f"{arch}.expert_feed_forward_length", kv[f"{arch}.feed_forward_length"]))
            if experts
            else 0,
            shared_ffn=int(kv.get(f"{arch}.expert_shared_feed_forward_length", 0))
            if any(n.endswith(".ffn_gate_shexp.weight") for n in tensor_names)
            else 0,
            norm_topk=bool(kv.get(f"{arch}.expert_weights_norm", architecture.renormalise)),
            moe_blocks=routed if experts else frozenset(),
            head_dim=int(kv.get(f"{arch}.attention.key_length", dim // heads)),
        )
        q_norm = next((n for n in sorted(tensor_names) if n.endswith(".attn_q_norm.weight")), None)
        fields |= architecture.read(kv, tensor_names, fields)
        return ModelConfig(
            arch=arch,
            blocks=int(kv[f"{arch}.block_count"]),
            dim=dim,
            ffn=int(kv[f"{arch}.feed_forward_length"]),
            heads=heads,
            kv_heads=int(kv.get(f"{arch}.attention.head_count_kv", heads)),
            vocab=len(kv["tokenizer.ggml.tokens"]),
            context=int(kv[f"{arch}.context_length"]),
            rope_theta=float(kv.get(f"{arch}.rope.freq_base", 10000.0)),
            norm_eps=float(kv[f"{arch}.attention.layer_norm_rms_epsilon"]),
            bos_id=int(kv["tokenizer.ggml.bos_token_id"])
            if kv.get("tokenizer.ggml.add_bos_token", True) and "tokenizer.ggml.bos_token_id" in kv
            else None,
            eos_id=int(kv["tokenizer.ggml.eos_token_id"]),
            eog_ids=end_of_generation(kv),
            tied="output.weight" not in tensor_names,
            qk_norm=int(kv.get(f"{arch}.attention.key_length", dim // heads)) if q_norm else 0,
            qkv_bias=any(n.endswith(".attn_q.bias") for n in tensor_names),
            **fields,
        )
    except KeyError as exc:
        raise ModelError(f"GGUF metadata lacks {exc.args[0]!r}") from None
