"""What a GGUF file's metadata says about its model (``ModelConfig``): the keys every architecture shares, read here,
and each architecture's own, read by its module (``ppharness.model.arch``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ppharness.errors import ModelError
from ppharness.model.arch import of_file
from ppharness.model.arch.base import BLOCK_TENSOR, Architecture
from ppharness.model.decoding import end_of_generation


@dataclass(frozen=True)
class ModelConfig:
    """What a GGUF's metadata says about the model, in tinygrad's terms."""

    arch: str
    blocks: int
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rope_theta: float
    norm_eps: float
    bos_id: int | None
    eos_id: int
    eog_ids: frozenset[int]  # the tokens that end generation: the EOS and others (``decoding.end_of_generation``)
    tied: bool
    # mixture of experts (ppharness.model.moe): routed experts per MoE block, how many each token uses, one expert's
    # FFN width, the shared expert's width (0: none), whether the top-k weights are renormalised, and which blocks
    # are MoE blocks (those with a router); all empty for a dense model
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    norm_topk: bool = False
    moe_blocks: frozenset[int] = frozenset()
    qk_norm: int = 0  # RMS norm of each head's queries and keys (qwen3): the head dim, 0 for none
    qkv_bias: bool = False  # biases on the query, key and value projections (qwen2)
    # deepseek2 (ppharness.model.arch.deepseek2): the router's scoring, groups and scale, whether the shared experts
    # are gated (qwen2moe) or not, MLA's ranks and widths (``head_dim`` is then a head's key width, no-rope + rope),
    # and YaRN
    gating: str = "softmax"
    expert_groups: int = 0
    groups_used: int = 0
    routed_scale: float = 1.0
    shared_gate: bool = True
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0
    yarn_factor: float = 0.0
    yarn_original_context: int = 0
    yarn_log_mul: float = 0.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    # llama: each rotary pair's frequency factor (``rope_freqs.weight``, Llama 3.1/3.2), () for none; read with the
    # tensors (``GGUFFile``), not the metadata
    rope_factors: tuple[float, ...] = ()

    @property
    def moe(self) -> bool:
        return bool(self.moe_blocks)

    @property
    def architecture(self) -> Architecture:
        """The architecture the model computes as (``ppharness.model.arch``)."""
        return of_file(self.arch, self.experts)

    @staticmethod
    def from_kv(kv: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        """The shared keys, then the architecture's own (``Architecture.read``); ModelError naming a key the file
        lacks, or for experts in an architecture that does not route them."""
        try:
            arch = kv["general.architecture"]
            dim, heads = int(kv[f"{arch}.embedding_length"]), int(kv[f"{arch}.attention.head_count"])
            experts = int(kv.get(f"{arch}.expert_count", 0))
            moe_blocks = frozenset(
                int(m.group(1))
                for n in tensor_names
                if (m := BLOCK_TENSOR.match(n)) and m.group(2) == "ffn_gate_inp.weight"
            )
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
                moe_blocks=moe_blocks if experts else frozenset(),
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
