"""Synthetic models: what one is (``ModelSpec``: architecture, dimensions, seed, weight type), the presets, and the
``synthetic:`` source strings that name them.

A spec's architecture (``ppharness.model.arch``) checks the fields that are its own and lists its tensors; the
synthetic writer (``ppharness.model.synthetic.writer``) turns a spec into a GGUF file, the same spec into the same
bytes.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ppharness.errors import ModelError
from ppharness.model.arch import architecture
from ppharness.model.formats.table import named
from ppharness.model.gguf.metadata import (
    MAX_BLOCKS,
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_FFN,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_VOCAB,
    MAX_WIDTH,
)
from ppharness.model.gguf.names import moe_blocks
from ppharness.model.held import Stored, model_bytes
from ppharness.model.synthetic.vocab import DEFAULT_TOKENIZER, special_tokens
from ppharness.model.text.tokenizer import pre_tokenizer

# weight type -> (the GGML type of the 2-D weights, the file's general.file_type); ``tensor_type`` says which tensors
# are stored otherwise (the K-quant mixes, the fallbacks for rows the type's blocks do not divide)
WEIGHT_TYPES: dict[str, tuple[str, str]] = {
    "f16": ("F16", "MOSTLY_F16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "f32": ("F32", "ALL_F32"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q4_k": ("Q4_K", "MOSTLY_Q4_K_M"),
    "q5_k": ("Q5_K", "MOSTLY_Q5_K_M"),
    "q6_k": ("Q6_K", "MOSTLY_Q6_K"),
}
# elements per block along a row of the 32-element formats (Q8_0, Q4_0, Q4_1): a quantised spec's widths divide by it
QUANT_BLOCK = named("Q8_0").block
# where a tensor's rows do not fit its type's blocks (a K-quant's 256, a quantised type's 32), the types it falls back
# to, in order: as llama.cpp's quantizer falls back, but to Q8_0 for every K-quant, then to F16
FALLBACKS = ("Q8_0", "F16")


@dataclass(frozen=True)
class ModelSpec:
    """A synthetic model: its architecture, dimensions, vocabulary size, the seed of its weights and how they are
    stored."""

    blocks: int = 8
    dim: int = 64
    ffn: int = 192
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    context: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied_embeddings: bool = False
    seed: int = 0
    type: str = "f16"
    # the architecture (``ppharness.model.arch``): llama, the dense qwen2 (q/k/v biases) and qwen3 (per-head q/k
    # norms), or a mixture of experts
    # mixture of experts (``arch`` qwen3moe or qwen2moe): routed experts per block, how many each token uses, one
    # expert's FFN width, and the shared expert's width (qwen2moe; 0 for none); every block is a MoE block
    arch: str = "llama"
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    head_dim: int = 0  # 0: dim // heads
    # deepseek2 (DeepSeek V3, Kimi K2): leading dense blocks (the rest are MoE blocks), MLA attention (queries through
    # a rank-``q_lora_rank`` bottleneck, 0 for none; keys and values compressed to ``kv_lora_rank`` plus a shared
    # ``rope_dim`` rotary part; ``head_dim`` = each head's no-rope + rope key width, ``v_head_dim`` its value width),
    # ``shared_experts`` ungated shared experts of width ``expert_ffn``, sigmoid (or softmax) ``gating`` with a
    # selection bias, grouped top-k (``expert_groups``, ``groups_used``), the routed weights' ``routed_scale``, and
    # YaRN rope scaling (``yarn_factor`` 0: none) as the model's config states it
    dense_blocks: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0
    shared_experts: int = 0
    expert_groups: int = 0
    groups_used: int = 0
    routed_scale: float = 0.0
    gating: str = ""
    yarn_factor: float = 0.0
    yarn_original_context: int = 0
    yarn_log_mul: float = 0.0
    yarn_beta_fast: float = 0.0
    yarn_beta_slow: float = 0.0
    # llama: Llama-3's rotary frequency factors (``rope_freqs.weight``): "llama3" writes them as llama.cpp's converter
    # does for Llama 3.1/3.2 (low-frequency factor 1, high-frequency factor 4), with ``rope_scaling_factor`` (0: 32,
    # Llama-3.2's) and ``rope_original_context`` (0: 8192); "" writes none
    rope_scaling: str = ""
    rope_scaling_factor: float = 0.0
    rope_original_context: int = 0
    # the tokenizer's type (tokenizer.ggml.pre: ppharness.model.text.tokenizer.PRE_TOKENIZERS): the vocabulary is
    # learned for its pre-tokenizer and ends with its models' special tokens (ppharness.model.synthetic.vocab)
    tokenizer: str = DEFAULT_TOKENIZER

    def __post_init__(self) -> None:
        _check_bounds(self)
        architecture(self.arch).check(self)
        wtype = str(self.type).lower()
        if wtype not in WEIGHT_TYPES:
            raise ModelError(f"unknown weight type {self.type!r}: expected one of {', '.join(WEIGHT_TYPES)}")
        object.__setattr__(self, "type", wtype)
        widths = (self.dim, self.ffn, self.expert_ffn, self.shared_ffn)
        block = named(WEIGHT_TYPES[wtype][0]).block
        if block > 1 and any(w % QUANT_BLOCK for w in widths):
            stores = (
                f"{wtype} stores rows in blocks of {QUANT_BLOCK}"
                if block == QUANT_BLOCK
                else f"{wtype} stores rows in blocks of {block}, and a row of another length in Q8_0's blocks of "
                f"{QUANT_BLOCK}"
            )
            raise ModelError(
                f"{stores}: dim {self.dim}, ffn {self.ffn}, expert_ffn {self.expert_ffn} and shared_ffn "
                f"{self.shared_ffn} must be multiples of {QUANT_BLOCK} (or use type=f16, bf16 or f32)"
            )
        pre_tokenizer(self.tokenizer)  # a known type
        n_special = len(special_tokens(self.tokenizer))
        if self.vocab < 256 + n_special:
            raise ModelError(
                f"vocab {self.vocab} is too small: a byte-level BPE vocabulary needs at least {256 + n_special}"
            )
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ModelError(
                f"dim {self.dim}, heads {self.heads}, kv_heads {self.kv_heads}: dim must divide by heads "
                "and heads by kv_heads"
            )
        if self.hd % 2:
            raise ModelError(f"head dim {self.hd} must be even for rotary embeddings")
        if self.blocks < 1:
            raise ModelError(f"blocks {self.blocks} must be at least 1")

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.heads

    @property
    def gating_func(self) -> str:
        return self.gating or architecture(self.arch).gating

    @property
    def moe(self) -> bool:
        return architecture(self.arch).moe

    def tensors(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the model, name -> shape in tinygrad's (out, in) order, as the writer stores them."""
        return architecture(self.arch).tensors(self)

    @property
    def n_params(self) -> int:
        return sum(math.prod(shape) for shape in self.tensors().values())

    def slug(self) -> str:
        """The cache file's name: dimensions, seed, weight type (when not f16) and a digest of every field (fields
        added after the first files were built count only when set)."""
        fields = asdict(self)
        if self.type == "f16":  # f16 files keep the names they had before weight types existed
            del fields["type"]
        for key, default in _LATER_FIELDS.items():
            if fields[key] == default:
                del fields[key]
        digest = hashlib.sha256(repr(sorted(fields.items())).encode()).hexdigest()[:12]
        wtype = "" if self.type == "f16" else f"-{self.type}"
        experts = f"-{self.arch}-e{self.experts}k{self.experts_used}" if self.moe else ""
        return f"synthetic-{self.blocks}x{self.dim}{experts}-v{self.vocab}-s{self.seed}{wtype}-{digest}"


# each integer field's range: what the GGUF reader (``ppharness.model.gguf.metadata``) accepts, so that every spec
# written can be read back
FIELD_RANGES: dict[str, tuple[int, int]] = {
    "blocks": (1, MAX_BLOCKS),
    "dim": (1, MAX_WIDTH),
    "ffn": (1, MAX_FFN),
    "heads": (1, MAX_HEADS),
    "kv_heads": (1, MAX_HEADS),
    "vocab": (1, MAX_VOCAB),
    "context": (1, MAX_CONTEXT),
    "seed": (0, (1 << 63) - 1),
    "experts": (0, MAX_EXPERTS),
    "experts_used": (0, MAX_EXPERTS),
    "expert_ffn": (0, MAX_FFN),
    "shared_ffn": (0, MAX_FFN),
    "head_dim": (0, MAX_HEAD_DIM),
    "dense_blocks": (0, MAX_BLOCKS),
    "q_lora_rank": (0, MAX_WIDTH),
    "kv_lora_rank": (0, MAX_WIDTH),
    "rope_dim": (0, MAX_HEAD_DIM),
    "v_head_dim": (0, MAX_HEAD_DIM),
    "shared_experts": (0, MAX_EXPERTS),
    "expert_groups": (0, MAX_EXPERTS),
    "groups_used": (0, MAX_EXPERTS),
    "yarn_original_context": (0, MAX_CONTEXT),
    "rope_original_context": (0, MAX_CONTEXT),
}


def _check_bounds(spec: ModelSpec) -> None:
    """ModelError for a field of the wrong type, out of its range (``FIELD_RANGES``), or a float not finite (the
    rope base and the norm's epsilon above 0)."""
    for f in fields(spec):
        value = getattr(spec, f.name)
        if f.name in FIELD_RANGES:
            lo, hi = FIELD_RANGES[f.name]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelError(f"synthetic model field {f.name} = {value!r} is not an integer")
            if not lo <= value <= hi:
                raise ModelError(f"synthetic model field {f.name} = {value:,} is outside {lo:,}..{hi:,}")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ModelError(f"synthetic model field {f.name} = {value!r} is not a finite number")
    for name in ("rope_theta", "norm_eps"):
        if not getattr(spec, name) > 0:
            raise ModelError(f"synthetic model field {name} = {getattr(spec, name)!r} must be above 0")


# each weight type's bytes per weight in its own GGML type (a file's mix and fallbacks: ``tensor_type``)
_BYTES_PER_WEIGHT = {t: named(g).bytes / named(g).block for t, (g, _) in WEIGHT_TYPES.items()}


def _more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the blocks and every third one between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def tensor_type(spec: ModelSpec, name: str, shape: tuple[int, ...]) -> str:
    """The GGML type the synthetic writer stores tensor ``name`` of ``shape`` (tinygrad's order, the row last) in.

    Vectors and the MoE routers (``ffn_gate_inp.weight``) are F32. Every other matrix is in the spec's type, except:
    q4_k and q5_k are llama.cpp's Q4_K_M and Q5_K_M mixes, loosely: the output head (the token embedding when it is
    tied) Q6_K, and ``attn_v`` and every ``ffn_down*`` Q6_K in the blocks llama.cpp's ``use_more_bits`` picks (the
    first and last eighth, every third between); not llama.cpp's rules for 8-expert models. A row its type's blocks do
    not divide falls back to Q8_0 (a K-quant's row not a multiple of 256; llama.cpp would take Q5_0 / Q5_1 for Q4_K /
    Q5_K), then to F16 (a row not a multiple of 32, as llama.cpp does)."""
    if len(shape) < 2 or name.endswith("ffn_gate_inp.weight"):
        return "F32"
    want = WEIGHT_TYPES[spec.type][0]
    if spec.type in ("q4_k", "q5_k"):
        head = name == "output.weight" or (spec.tied_embeddings and name == "token_embd.weight")
        part = name.split(".")
        mixed = len(part) > 2 and part[0] == "blk" and (part[2] == "attn_v" or part[2].startswith("ffn_down"))
        if head or (mixed and _more_bits(int(part[1]), spec.blocks)):
            want = "Q6_K"
    return next(t for t in (want, *FALLBACKS) if shape[-1] % named(t).block == 0)


def tensor_types(spec: ModelSpec) -> dict[str, str]:
    """Every tensor of ``spec``'s file, name -> the GGML type it is stored in (``tensor_type``)."""
    return {name: tensor_type(spec, name, shape) for name, shape in spec.tensors().items()}


def stored_tensors(spec: ModelSpec) -> dict[str, Stored]:
    """Every tensor of ``spec``'s file as the writer stores it, without writing it: its shape (tinygrad's order) and
    its ggml type (``tensor_type``)."""
    return {name: Stored(shape, named(tensor_type(spec, name, shape)).id) for name, shape in spec.tensors().items()}


def file_bytes(spec: ModelSpec) -> int:
    """About the bytes of ``spec``'s GGUF file (its tensors' data; the metadata is small): each tensor in its own
    type (``tensor_type``)."""
    total = 0
    for name, shape in spec.tensors().items():
        total += named(tensor_type(spec, name, shape)).row_bytes(math.prod(shape))
    return total


def memory_needed(spec: ModelSpec) -> int:
    """About the bytes a machine needs to build and run ``spec``: the whole file, held while it is written, or its
    weights as the stages hold them (``ppharness.model.held``), whichever is more. The stages hold a packed type as
    the file stores it (F16 matrices too; F32 ones and the norms in half), so that is mostly the file; a quantised
    deepseek2's per-head ``attn_k_b`` / ``attn_v_b`` are held as float16, more than their bytes in the file."""
    tensors = stored_tensors(spec)
    return max(file_bytes(spec), model_bytes(architecture(spec.arch), moe_blocks(tensors), tensors))


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where it cannot be told)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError, AttributeError):
        return None


def check_fits(spec: ModelSpec) -> None:
    """ModelError when ``spec`` needs more memory than this machine has (``memory_needed``), naming both."""
    need, have = memory_needed(spec), machine_memory()
    if have is not None and need > have:
        raise ModelError(
            f"a synthetic model of {spec.n_params:,} parameters ({spec.blocks} blocks, dim {spec.dim}, {spec.type}) "
            f"needs about {need / 2**30:,.1f} GiB of memory and this machine has {have / 2**30:,.1f} GiB"
        )


_LATER_FIELDS: dict[str, object] = {
    "arch": "llama",
    "experts": 0,
    "experts_used": 0,
    "expert_ffn": 0,
    "shared_ffn": 0,
    "head_dim": 0,
    "dense_blocks": 0,
    "q_lora_rank": 0,
    "kv_lora_rank": 0,
    "rope_dim": 0,
    "v_head_dim": 0,
    "shared_experts": 0,
    "expert_groups": 0,
    "groups_used": 0,
    "routed_scale": 0.0,
    "gating": "",
    "yarn_factor": 0.0,
    "yarn_original_context": 0,
    "yarn_log_mul": 0.0,
    "yarn_beta_fast": 0.0,
    "yarn_beta_slow": 0.0,
    "rope_scaling": "",
    "rope_scaling_factor": 0.0,
    "rope_original_context": 0,
    "tokenizer": DEFAULT_TOKENIZER,
}

# Kimi K2 (moonshotai/Kimi-K2-Instruct's config.json), about 1.03 T parameters: for the simulator only, never
# written to disk (SIMULATION_ONLY)
KIMI_K2 = ModelSpec(
    blocks=61,
    dim=7168,
    ffn=18432,
    heads=64,
    kv_heads=64,
    head_dim=192,
    vocab=163840,
    context=131072,
    rope_theta=50000.0,
    norm_eps=1e-6,
    arch="deepseek2",
    experts=384,
    experts_used=8,
    expert_ffn=2048,
    dense_blocks=1,
    q_lora_rank=1536,
    kv_lora_rank=512,
    rope_dim=64,
    v_head_dim=128,
    shared_experts=1,
    routed_scale=2.827,
    yarn_factor=32.0,
    yarn_original_context=4096,
    yarn_log_mul=0.1,
    yarn_beta_fast=1.0,
    yarn_beta_slow=1.0,
)


PRESETS: dict[str, ModelSpec] = {
    # CI: fast to compile and run on two CPU cores, still 8 blocks so any N up to 8 is possible.
    "tiny": ModelSpec(),
    # tiny with Llama-3's rope frequency factors; an original context of 32 makes every factor but the first two
    # matter within a short answer
    "tiny-llama3": ModelSpec(rope_scaling="llama3", rope_original_context=32),
    # A little more work per token, for CPU benchmarks.
    "small": ModelSpec(blocks=12, dim=256, ffn=768, heads=8, kv_heads=4, vocab=2048),
    # llama-3.2-1B dimensions, for GPU work (about 1.24 B parameters, 2.5 GB in fp16).
    "llama-3.2-1b": ModelSpec(
        blocks=16,
        dim=2048,
        ffn=8192,
        heads=32,
        kv_heads=8,
        vocab=128256,
        context=8192,
        rope_theta=500000.0,
        tied_embeddings=True,
    ),
    # the dense Qwen architectures for CI, tiny's dimensions with Qwen's rope base, epsilon and tokenizer type: qwen2
    # (q/k/v biases), and qwen3 (per-head q/k norms) with heads of 32, wider than dim / heads as in Qwen3's models
    "tiny-qwen2": ModelSpec(arch="qwen2", rope_theta=1000000.0, norm_eps=1e-6, tokenizer="qwen2"),
    "tiny-qwen3": ModelSpec(arch="qwen3", head_dim=32, rope_theta=1000000.0, norm_eps=1e-6, tokenizer="qwen2"),
    # Qwen2.5-0.5B's shape (its config.json): 24 blocks, 14/2 heads of 64, tied embeddings; about 0.49 B parameters
    "qwen2.5-0.5b": ModelSpec(
        blocks=24,
        dim=896,
        ffn=4864,
        heads=14,
        kv_heads=2,
        vocab=151936,
        context=32768,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        tied_embeddings=True,
        arch="qwen2",
        tokenizer="qwen2",
    ),
    # Qwen3-0.6B's shape (its config.json): 28 blocks, 16/8 heads of 128 in a width of 1024, tied embeddings; about
    # 0.6 B parameters
    "qwen3-0.6b": ModelSpec(
        blocks=28,
        dim=1024,
        ffn=3072,
        heads=16,
        kv_heads=8,
        head_dim=128,
        vocab=151936,
        context=40960,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        tied_embeddings=True,
        arch="qwen3",
        tokenizer="qwen2",
    ),
    # mixture of experts for CI: qwen3moe with 4 blocks of 8 experts, 2 per token
    "tiny-moe": ModelSpec(blocks=4, arch="qwen3moe", experts=8, experts_used=2, expert_ffn=96),
    # the shared-expert variant (qwen2moe: q/k/v biases, no top-k renormalisation, a sigmoid-gated shared expert)
    "tiny-moe-shared": ModelSpec(blocks=4, arch="qwen2moe", experts=8, experts_used=2, expert_ffn=96, shared_ffn=128),
    # more work per token, for CPU benchmarks: 8 blocks of 16 experts, 4 per token
    "small-moe": ModelSpec(
        blocks=8,
        dim=256,
        ffn=768,
        heads=8,
        kv_heads=4,
        vocab=2048,
        arch="qwen3moe",
        experts=16,
        experts_used=4,
        expert_ffn=256,
    ),
    # Qwen3-30B-A3B's shape (48 blocks there; override blocks= to fit a disk): 128 experts of width 768, 8 per token
    "qwen3-30b-a3b": ModelSpec(
        blocks=48,
        dim=2048,
        ffn=6144,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        context=40960,
        rope_theta=1000000.0,
        norm_eps=1e-6,
        arch="qwen3moe",
        experts=128,
        experts_used=8,
        expert_ffn=768,
    ),
    # deepseek2 for CI: 4 blocks (the first dense), 16 experts in 4 groups (2 used), top 4, one shared expert; MLA
    # without a query bottleneck (as DeepSeek-V2-Lite), no rope scaling
    "tiny-deepseek": ModelSpec(
        blocks=4,
        heads=4,
        kv_heads=4,
        head_dim=32,
        arch="deepseek2",
        experts=16,
        experts_used=4,
        expert_ffn=32,
        dense_blocks=1,
        kv_lora_rank=32,
        rope_dim=16,
        v_head_dim=16,
        shared_experts=1,
        expert_groups=4,
        groups_used=2,
        routed_scale=2.5,
    ),
    # Kimi K2's counts at width 64: 61 blocks (the first dense), 384 experts, 8 per token plus one shared, MLA with
    # a query bottleneck, sigmoid routing with a selection bias, the routed scale and Kimi's YaRN rope settings
    "kimi-tiny": replace(
        KIMI_K2,
        dim=64,
        ffn=192,
        heads=4,
        kv_heads=4,
        head_dim=32,
        vocab=512,
        expert_ffn=32,
        q_lora_rank=48,
        kv_lora_rank=32,
        rope_dim=16,
        v_head_dim=16,
    ),
    "kimi-k2": KIMI_K2,
}
# presets too large to write here: the simulator and the planner take them (ppharness.plan.graph), resolve_model
# refuses them
SIMULATION_ONLY = frozenset({"kimi-k2"})


def preset_spec(preset: str, **overrides: object) -> ModelSpec:
    """A preset's spec with the non-None overrides applied."""
    try:
        spec = PRESETS[preset]
    except KeyError:
        raise ModelError(f"unknown model preset {preset!r}: expected one of {', '.join(PRESETS)}") from None
    # field name -> value: of the field's type, which differs from field to field
    changes: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    return replace(spec, **changes)


def parse_synthetic(source: str) -> ModelSpec:
    """``synthetic:tiny,blocks=4,seed=3`` -> ModelSpec."""
    preset, *pairs = source.removeprefix("synthetic:").split(",")
    types = {f: type(v) for f, v in asdict(PRESETS["tiny"]).items()}
    overrides: dict[str, object] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in types:
            raise ModelError(f"{source!r}: unknown synthetic model field {key!r}; expected one of {', '.join(types)}")
        typ = types[key]
        try:
            overrides[key] = value.lower() in ("1", "true", "yes") if typ is bool else typ(value)
        except ValueError:
            raise ModelError(
                f"{source!r}: {key}={value!r} is not {'an integer' if typ is int else 'a number'}"
            ) from None
    return preset_spec(preset or "tiny", **overrides)


def synthetic_source(spec: ModelSpec) -> str:
    """The inverse of ``parse_synthetic``: a spec as a ``synthetic:`` source string (every field explicit)."""
    return "synthetic:tiny," + ",".join(f"{k}={v}" for k, v in asdict(spec).items())


def short_source(source: str) -> str:
    """A ``synthetic:`` source as people name it: the preset it is closest to and only the fields that differ from
    that preset (``synthetic:small``, ``synthetic:small,blocks=4``); any other source, or one that does not parse,
    unchanged. For what is printed; plans and caches keep the full string."""
    if not source.startswith("synthetic:"):
        return source
    try:
        spec = parse_synthetic(source)
    except (ModelError, ValueError):
        return source
    fields = asdict(spec)
    named = source.removeprefix("synthetic:").split(",")[0]

    def differing(preset: str) -> list[str]:
        base = asdict(PRESETS[preset])
        return [f"{k}={v}" for k, v in fields.items() if base[k] != v]

    # the fewest overrides; on a tie the preset the source names (every full-form source names "tiny")
    best = min(PRESETS, key=lambda p: (len(differing(p)), p != named))
    return ",".join([f"synthetic:{best}", *differing(best)])
