"""What a GGUF file's metadata says about its model (``ModelConfig``), as plain data: the keys every architecture
shares and each architecture's own, read by ``ppharness.model.arch.read_config``."""

from __future__ import annotations

from dataclasses import dataclass


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
    eog_ids: frozenset[int]  # the tokens that end generation: the EOS and others (``ppharness.model.text.eog``)
    tied: bool
    # mixture of experts (ppharness.model.layers.moe): routed experts per MoE block, how many each token uses, one
    # expert's FFN width, the shared expert's width (0: none), whether the top-k weights are renormalised, and which
    # blocks are MoE blocks (those with a router); all empty for a dense model
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
