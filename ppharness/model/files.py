"""Models without a hub: a deterministic synthetic GGUF writer, and fetching real GGUF files.

``make_synthetic(spec, path)`` writes a llama-architecture GGUF that tinygrad 0.12 reads like any llama file: random
fp16 weights from a seeded generator and a byte-level BPE vocabulary (256 byte tokens, merges learned from a built-in
corpus and then extended by seeded concatenations, then llama-3 special tokens). The same spec gives the same bytes.
``spec.type`` picks how the 2-D weight matrices are stored: ``f16`` (default), or quantised by the ``gguf`` package's
own quantisers to ``q8_0`` (the format ``ollama pull llama3.2:1b`` serves) or ``q4_0``; the quantised model is the f16
model of the same seed, quantised. 1-D weights (the norms) stay F32, as llama.cpp keeps them.

``resolve_model(source)`` turns a scenario's model (synthetic spec, local path or URL) into a local GGUF path, building
or downloading it once into the cache directory.
"""

from __future__ import annotations

import collections
import hashlib
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ppharness.errors import ModelError

# GPT-2 byte <-> unicode mapping, as tinygrad's SimpleTokenizer reads it: printable bytes map to themselves, the rest to
# code points from 256 upwards.
_BS = [*range(33, 127), *range(161, 173), *range(174, 256)]
BYTE_TO_CHAR = {b: chr(b) for b in _BS} | {b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in _BS)}

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

_CORPUS = """\
Pipeline parallel inference splits a model's transformer blocks into contiguous ranges, one range per stage.
The first stage tokenizes the prompt and embeds it; the last stage applies the final norm, the output head and
argmax, and sends the token back to the first stage for the next step. Each stage keeps the key and value cache
of its own layers. The quick brown fox jumps over the lazy dog. A stage that dies mid-run must never leave a
process, a container or a rented machine behind. Large mixture of experts models run on consumer graphics cards
over the wide area network, where every hop costs milliseconds and every byte counts. Héllo wörld, naïve café,
señor, Grüße aus Köln; 1234567890. The test harness runs the same scenario on local processes, in containers and
on rented machines, and checks that a split never changes the answer: token for token equal to the unsplit model.
"""


# weight type -> (the GGML type of every 2-D weight, the file's general.file_type)
WEIGHT_TYPES: dict[str, tuple[str, str]] = {
    "f16": ("F16", "MOSTLY_F16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}
QUANT_BLOCK = 32  # elements per Q8_0 / Q4_0 block, along a row


@dataclass(frozen=True)
class ModelSpec:
    """A synthetic llama model: dimensions, vocabulary size, the seed of its weights and how they are stored."""

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

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ModelError(f"unknown architecture {self.arch!r}: expected one of {', '.join(ARCHS)}")
        moe = self.arch != "llama"
        if moe and not (1 <= self.experts_used <= self.experts and self.expert_ffn >= 1):
            raise ModelError(
                f"{self.arch} needs experts >= experts_used >= 1 and expert_ffn >= 1 (got experts {self.experts}, "
                f"experts_used {self.experts_used}, expert_ffn {self.expert_ffn})"
            )
        if not moe and (self.experts or self.experts_used or self.shared_ffn):
            raise ModelError(
                "experts need a mixture-of-experts architecture: arch=qwen3moe, arch=qwen2moe or arch=deepseek2"
            )
        mla = (self.q_lora_rank, self.kv_lora_rank, self.rope_dim, self.v_head_dim, self.dense_blocks)
        if self.arch != "deepseek2" and (any(mla) or self.shared_experts or self.expert_groups or self.yarn_factor):
            raise ModelError(
                "MLA attention, leading dense blocks, shared_experts, expert groups and YaRN belong to arch=deepseek2"
            )
        if self.arch == "deepseek2":
            self._check_deepseek2()
        if self.shared_ffn and self.arch != "qwen2moe":
            raise ModelError(f"a shared expert belongs to qwen2moe, not {self.arch}")
        wtype = str(self.type).lower()
        if wtype not in WEIGHT_TYPES:
            raise ModelError(f"unknown weight type {self.type!r}: expected one of {', '.join(WEIGHT_TYPES)}")
        object.__setattr__(self, "type", wtype)
        widths = (self.dim, self.ffn, self.expert_ffn, self.shared_ffn)
        if wtype != "f16" and any(w % QUANT_BLOCK for w in widths):
            raise ModelError(
                f"{wtype} stores rows in blocks of {QUANT_BLOCK}: dim {self.dim}, ffn {self.ffn}, expert_ffn "
                f"{self.expert_ffn} and shared_ffn {self.shared_ffn} must be multiples of {QUANT_BLOCK}"
            )
        n_special = len(SPECIAL_TOKENS)
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

    def _check_deepseek2(self) -> None:
        if not (self.kv_lora_rank >= 1 and self.rope_dim >= 2 and self.rope_dim % 2 == 0 and self.v_head_dim >= 1):
            raise ModelError(
                f"deepseek2 needs kv_lora_rank >= 1, an even rope_dim >= 2 and v_head_dim >= 1 (got kv_lora_rank "
                f"{self.kv_lora_rank}, rope_dim {self.rope_dim}, v_head_dim {self.v_head_dim})"
            )
        if self.hd <= self.rope_dim:
            raise ModelError(f"deepseek2: head_dim {self.hd} must be more than rope_dim {self.rope_dim}")
        if not 0 <= self.dense_blocks < self.blocks:
            raise ModelError(f"deepseek2: dense_blocks {self.dense_blocks} must be in [0, blocks {self.blocks})")
        if self.gating not in ("", "softmax", "sigmoid"):
            raise ModelError(f"deepseek2: gating {self.gating!r} must be softmax or sigmoid")
        if self.expert_groups and (
            self.experts % self.expert_groups or not 1 <= self.groups_used <= self.expert_groups
        ):
            raise ModelError(
                f"deepseek2: {self.experts} experts must divide into expert_groups {self.expert_groups}, and "
                f"1 <= groups_used {self.groups_used} <= expert_groups"
            )

    @property
    def hd(self) -> int:
        return self.head_dim or self.dim // self.heads

    @property
    def nope_dim(self) -> int:
        """deepseek2: the part of each head's key without rotary embedding."""
        return self.hd - self.rope_dim

    @property
    def gating_func(self) -> str:
        return self.gating or ("sigmoid" if self.arch == "deepseek2" else "softmax")

    @property
    def moe(self) -> bool:
        return self.arch != "llama"

    @property
    def n_params(self) -> int:
        if self.arch == "deepseek2":
            return sum(math.prod(shape) for shape in deepseek2_shapes(self).values())
        hd = self.hd
        per_block = 2 * self.dim + self.dim * hd * (self.heads * 2 + self.kv_heads * 2)
        if self.moe:
            per_block += self.experts * (self.dim + 3 * self.dim * self.expert_ffn)
            per_block += 3 * self.dim * self.shared_ffn + (self.dim if self.shared_ffn else 0)
            per_block += 2 * hd if self.arch == "qwen3moe" else hd * (self.heads + 2 * self.kv_heads)
        else:
            per_block += 3 * self.dim * self.ffn
        head = 0 if self.tied_embeddings else self.vocab * self.dim
        return self.vocab * self.dim + self.blocks * per_block + self.dim + head

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


ARCHS = ("llama", "qwen3moe", "qwen2moe", "deepseek2")
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
}


def deepseek2_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of a deepseek2 model as the writer stores it, name -> shape in tinygrad's (out, in) order:
    llama.cpp's names, with MLA's key and value up-projections split per head (``attn_k_b``, ``attn_v_b``) as its
    converter writes them since it computes MLA in the compressed space."""
    d, h, hd, r, c, v = spec.dim, spec.heads, spec.hd, spec.rope_dim, spec.kv_lora_rank, spec.v_head_dim
    nope, e, f, q = hd - r, spec.experts, spec.expert_ffn, spec.q_lora_rank
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (spec.vocab, d)}
    for i in range(spec.blocks):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = (d,)
        if q:
            out |= {b + "attn_q_a.weight": (q, d), b + "attn_q_a_norm.weight": (q,), b + "attn_q_b.weight": (h * hd, q)}
        else:
            out[b + "attn_q.weight"] = (h * hd, d)
        out |= {
            b + "attn_kv_a_mqa.weight": (c + r, d),
            b + "attn_kv_a_norm.weight": (c,),
            b + "attn_k_b.weight": (h, c, nope),
            b + "attn_v_b.weight": (h, v, c),
            b + "attn_output.weight": (d, h * v),
            b + "ffn_norm.weight": (d,),
        }
        if i < spec.dense_blocks:
            out |= {b + "ffn_gate.weight": (spec.ffn, d), b + "ffn_up.weight": (spec.ffn, d)}
            out[b + "ffn_down.weight"] = (d, spec.ffn)
            continue
        out |= {b + "ffn_gate_inp.weight": (e, d), b + "exp_probs_b.bias": (e,)}
        out |= {b + "ffn_gate_exps.weight": (e, f, d), b + "ffn_up_exps.weight": (e, f, d)}
        out[b + "ffn_down_exps.weight"] = (e, d, f)
        if spec.shared_experts:
            s = f * spec.shared_experts
            out |= {b + "ffn_gate_shexp.weight": (s, d), b + "ffn_up_shexp.weight": (s, d)}
            out[b + "ffn_down_shexp.weight"] = (d, s)
    out["output_norm.weight"] = (d,)
    if not spec.tied_embeddings:
        out["output.weight"] = (spec.vocab, d)
    return out


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


def preset_blocks(preset: str, blocks_override: int | None = None) -> int:
    return blocks_override if blocks_override is not None else preset_spec(preset).blocks


# --- vocabulary -----------------------------------------------------------------------------------------------------


def _encode_bytes(b: bytes) -> str:
    return "".join(BYTE_TO_CHAR[x] for x in b)


def build_vocab(n_merges: int, seed: int) -> tuple[list[str], list[str]]:
    """(tokens, merges): 256 byte tokens then ``n_merges`` merged tokens, in rank order.

    Merges are learned by BPE from the built-in corpus first (so real text compresses); when the corpus has no pair
    left to merge, further merges concatenate two existing tokens chosen by a seeded generator.
    """
    tokens = [BYTE_TO_CHAR[b] for b in range(256)]
    merges: list[str] = []
    known = set(tokens)
    words = collections.Counter(re.findall(r" ?[^\s]+|\s+", _CORPUS))
    seqs = {w: [_encode_bytes(bytes([c])) for c in w.encode()] for w in words}
    while len(merges) < n_merges:
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for w, n in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        merged = a + b
        merges.append(f"{a} {b}")
        if merged not in known:
            tokens.append(merged)
            known.add(merged)
        for w in words:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    rng = np.random.default_rng(seed + 0x5EED)
    while len(tokens) < 256 + n_merges:
        a, b = tokens[rng.integers(len(tokens))], tokens[rng.integers(len(tokens))]
        if a + b in known or len(a + b) > 16:
            continue
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        known.add(a + b)
    return tokens, merges


# --- writer ---------------------------------------------------------------------------------------------------------


def make_synthetic(spec: ModelSpec, path: str | os.PathLike[str]) -> Path:
    """Write ``spec`` as a GGUF file at ``path`` (atomically) and return the path. Deterministic in ``spec``.

    Every 2-D weight (embedding, attention and FFN matrices, the untied head) is stored in ``spec.type``, quantised
    with ``gguf.quants.quantize`` for q8_0 and q4_0, as llama.cpp's converter writes ``--outtype q8_0``; the 1-D norm
    weights are F32. (llama.cpp's ``llama-quantize`` to Q4_0 would also store the output head as Q6_K, which the
    ``gguf`` package cannot quantise; here the head is Q4_0 like every other matrix.)
    """
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n_special = len(SPECIAL_TOKENS)
    tokens, merges = build_vocab(spec.vocab - 256 - n_special, spec.seed)
    tokens = tokens + list(SPECIAL_TOKENS)
    token_types = [1] * (len(tokens) - n_special) + [3] * n_special
    bos, eos = tokens.index("<|begin_of_text|>"), tokens.index("<|end_of_text|>")

    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")  # processes building the same model do not collide
    w = gguf.GGUFWriter(str(tmp), spec.arch)
    w.add_name(spec.slug())
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.dim)
    w.add_block_count(spec.blocks)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(1 if spec.arch == "deepseek2" else spec.kv_heads)  # MLA: one compressed KV "head"
    w.add_layer_norm_rms_eps(spec.norm_eps)
    w.add_rope_freq_base(spec.rope_theta)
    if spec.arch == "deepseek2":
        _deepseek2_keys(spec, w)
    else:
        w.add_rope_dimension_count(spec.hd)
    if spec.head_dim and spec.arch != "deepseek2":
        w.add_key_length(spec.hd)
        w.add_value_length(spec.hd)
    if spec.moe:
        w.add_expert_count(spec.experts)
        w.add_expert_used_count(spec.experts_used)
        w.add_expert_feed_forward_length(spec.expert_ffn)
        if spec.shared_ffn:
            w.add_expert_shared_feed_forward_length(spec.shared_ffn)
    w.add_vocab_size(spec.vocab)
    ggml_type, file_type = WEIGHT_TYPES[spec.type]
    qtype = gguf.GGMLQuantizationType[ggml_type]
    w.add_file_type(gguf.LlamaFileType[file_type])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_add_bos_token(True)

    rng = np.random.default_rng(spec.seed)
    hd = spec.hd

    def rand(*shape: int, std: float) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16)

    def norm_weight(n: int = spec.dim) -> np.ndarray:
        return (1.0 + rng.standard_normal(n, dtype=np.float32) * 0.1).astype(np.float32)

    def vector(n: int, std: float) -> np.ndarray:
        return (rng.standard_normal(n, dtype=np.float32) * std).astype(np.float32)

    def matrix(name: str, arr: np.ndarray) -> None:
        if qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, arr)
        else:  # (rows, bytes) of blocks; the writer records the element shape
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    # Shapes are tinygrad's (out, in); GGUF stores dimensions reversed and tinygrad reverses them back.
    matrix("token_embd.weight", rand(spec.vocab, spec.dim, std=1.0))
    lin = 1.0 / np.sqrt(spec.dim)
    if spec.arch == "deepseek2":
        _write_deepseek2(spec, rng, rand, norm_weight, vector, matrix, w.add_tensor)
    for i in range(spec.blocks if spec.arch != "deepseek2" else 0):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm_weight())
        matrix(f"blk.{i}.attn_q.weight", rand(spec.heads * hd, spec.dim, std=lin))
        matrix(f"blk.{i}.attn_k.weight", rand(spec.kv_heads * hd, spec.dim, std=lin))
        matrix(f"blk.{i}.attn_v.weight", rand(spec.kv_heads * hd, spec.dim, std=lin))
        matrix(f"blk.{i}.attn_output.weight", rand(spec.dim, spec.heads * hd, std=lin))
        if spec.arch == "qwen3moe":
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", norm_weight(hd))
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", norm_weight(hd))
        if spec.arch == "qwen2moe":
            for name, n in (("q", spec.heads), ("k", spec.kv_heads), ("v", spec.kv_heads)):
                w.add_tensor(f"blk.{i}.attn_{name}.bias", vector(n * hd, 0.02))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm_weight())
        if spec.moe:
            _write_experts(spec, i, rng, rand, vector, matrix, w.add_tensor)
        else:
            matrix(f"blk.{i}.ffn_gate.weight", rand(spec.ffn, spec.dim, std=lin))
            matrix(f"blk.{i}.ffn_up.weight", rand(spec.ffn, spec.dim, std=lin))
            matrix(f"blk.{i}.ffn_down.weight", rand(spec.dim, spec.ffn, std=1.0 / np.sqrt(spec.ffn)))
    if spec.arch != "deepseek2":
        w.add_tensor("output_norm.weight", norm_weight())
        if not spec.tied_embeddings:
            matrix("output.weight", rand(spec.vocab, spec.dim, std=lin))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    os.replace(tmp, path)
    return path


def _write_experts(spec: ModelSpec, i: int, rng: Any, rand: Any, vector: Any, matrix: Any, add: Any) -> None:
    """Block ``i``'s router and experts, as llama.cpp names them: the router ``ffn_gate_inp`` (F32, as llama.cpp's
    converter keeps it), the stacked routed experts ``ffn_{gate,up,down}_exps`` and, for qwen2moe, the shared
    expert ``ffn_*_shexp`` with its gate. Router rows are scaled by a seeded log-normal factor so that some experts
    are chosen more often than others, as in trained models."""
    lin, e, d, f = 1.0 / np.sqrt(spec.dim), spec.experts, spec.dim, spec.expert_ffn
    hot = np.exp(rng.standard_normal((e, 1), dtype=np.float32) * 0.5)
    add(f"blk.{i}.ffn_gate_inp.weight", (rng.standard_normal((e, d), dtype=np.float32) * lin * hot).astype(np.float32))
    matrix(f"blk.{i}.ffn_gate_exps.weight", rand(e, f, d, std=lin))
    matrix(f"blk.{i}.ffn_up_exps.weight", rand(e, f, d, std=lin))
    matrix(f"blk.{i}.ffn_down_exps.weight", rand(e, d, f, std=1.0 / np.sqrt(f)))
    if spec.shared_ffn:
        s = spec.shared_ffn
        add(f"blk.{i}.ffn_gate_inp_shexp.weight", vector(d, lin))
        matrix(f"blk.{i}.ffn_gate_shexp.weight", rand(s, d, std=lin))
        matrix(f"blk.{i}.ffn_up_shexp.weight", rand(s, d, std=lin))
        matrix(f"blk.{i}.ffn_down_shexp.weight", rand(d, s, std=1.0 / np.sqrt(s)))


def _deepseek2_keys(spec: ModelSpec, w: Any) -> None:
    """deepseek2's metadata as llama.cpp's converter writes it for MLA: the cache's key and value widths
    (``key_length`` = kv_lora_rank + rope_dim, ``value_length`` = kv_lora_rank, one KV head) and each head's
    (``key_length_mla``, ``value_length_mla``)."""
    import gguf

    w.add_rope_dimension_count(spec.rope_dim)
    w.add_key_length(spec.kv_lora_rank + spec.rope_dim)
    w.add_value_length(spec.kv_lora_rank)
    w.add_key_length_mla(spec.hd)
    w.add_value_length_mla(spec.v_head_dim)
    w.add_leading_dense_block_count(spec.dense_blocks)
    if spec.q_lora_rank:
        w.add_q_lora_rank(spec.q_lora_rank)
    w.add_kv_lora_rank(spec.kv_lora_rank)
    w.add_expert_shared_count(spec.shared_experts)
    w.add_expert_weights_scale(spec.routed_scale or 1.0)
    w.add_expert_weights_norm(True)
    gating = gguf.ExpertGatingFuncType.SIGMOID if spec.gating_func == "sigmoid" else gguf.ExpertGatingFuncType.SOFTMAX
    w.add_expert_gating_func(gating)
    if spec.expert_groups:
        w.add_expert_group_count(spec.expert_groups)
        w.add_expert_group_used_count(spec.groups_used)
    if spec.yarn_factor:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(spec.yarn_original_context)
        w.add_rope_scaling_yarn_log_mul(spec.yarn_log_mul)
        if spec.yarn_beta_fast:
            w.add_rope_scaling_yarn_beta_fast(spec.yarn_beta_fast)
        if spec.yarn_beta_slow:
            w.add_rope_scaling_yarn_beta_slow(spec.yarn_beta_slow)


def _write_deepseek2(
    spec: ModelSpec, rng: Any, rand: Any, norm_weight: Any, vector: Any, matrix: Any, add: Any
) -> None:
    """Every deepseek2 tensor but the embedding, in ``deepseek2_shapes``' order: norms F32, the router F32 (rows
    scaled log-normally as in ``_write_experts``) with its F32 selection bias, every other matrix in the spec's
    weight type; each matrix's scale 1/sqrt(its input width)."""
    for name, shape in deepseek2_shapes(spec).items():
        if name == "token_embd.weight":
            continue
        if name.endswith("norm.weight"):
            add(name, norm_weight(shape[0]))
        elif name.endswith("exp_probs_b.bias"):
            add(name, vector(shape[0], 0.05))
        elif name.endswith("ffn_gate_inp.weight"):
            hot = np.exp(rng.standard_normal((shape[0], 1), dtype=np.float32) * 0.5)
            add(name, (rng.standard_normal(shape, dtype=np.float32) * hot / np.sqrt(shape[1])).astype(np.float32))
        elif name.endswith("attn_k_b.weight"):  # (heads, kv_lora_rank, nope): multiplies queries into the cache
            matrix(name, rand(*shape, std=1.0 / np.sqrt(shape[2])))
        else:
            matrix(name, rand(*shape, std=1.0 / np.sqrt(shape[-1])))


# --- resolving a scenario's model to a local file ------------------------------------------------------------------


def cache_dir() -> Path:
    """Where built and downloaded models live: $PPHARNESS_CACHE, else ~/.cache/ppharness."""
    return Path(os.environ.get("PPHARNESS_CACHE") or Path.home() / ".cache" / "ppharness")


def synthetic_path(spec: ModelSpec) -> Path:
    """The cached GGUF for ``spec``, built on first use."""
    path = cache_dir() / "models" / f"{spec.slug()}.gguf"
    if not path.exists():
        make_synthetic(spec, path)
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


_BLOB_DIGEST = re.compile(r"/blobs/sha256:([0-9a-fA-F]{64})$")


def download(url: str, sha256: str | None = None, progress: bool = True) -> Path:
    """Download ``url`` once into the cache (resumable by re-running), check its sha256, return the path.

    A registry blob URL (``.../blobs/sha256:<digest>``, e.g. ollama's) names its own sha256, which is checked when
    ``sha256`` is not given. A download that nothing pins prints its sha256 (on stderr) so that it can be pinned.
    """
    import httpx
    from tqdm import tqdm

    if sha256 is None and (m := _BLOB_DIGEST.search(url.split("?", 1)[0])):
        sha256 = m.group(1)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", url.rsplit("/", 1)[-1]) or "model.gguf"
    path = cache_dir() / "downloads" / f"{hashlib.sha256(url.encode()).hexdigest()[:12]}-{name}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.part")  # nodes sharing a cache download side by side
        try:
            with httpx.stream("GET", url, follow_redirects=True, timeout=httpx.Timeout(30.0, read=300.0)) as r:
                r.raise_for_status()
                total = int(r.headers.get("content-length", 0)) or None
                with (
                    open(tmp, "wb") as f,
                    tqdm(total=total, unit="B", unit_scale=True, desc=name, disable=not progress) as bar,
                ):
                    for chunk in r.iter_bytes(1 << 20):
                        f.write(chunk)
                        bar.update(len(chunk))
        except httpx.HTTPError as exc:
            tmp.unlink(missing_ok=True)
            raise ModelError(f"downloading {url} failed: {exc}") from exc
        os.replace(tmp, path)
        if not sha256:
            print(
                f"downloaded {url} to {path}: {path.stat().st_size:,} bytes, sha256 {sha256_file(path)} "
                "(pin it with the scenario's model.sha256)",
                file=sys.stderr,
                flush=True,
            )
    if sha256:
        actual = sha256_file(path)
        if actual != sha256.lower():
            path.unlink()
            raise ModelError(f"{url}: sha256 {actual} does not match the expected {sha256}; the download was removed")
    return path


def resolve_model(source: str, sha256: str | None = None) -> Path:
    """A model source -> a local GGUF path.

    ``source`` is ``synthetic:<preset>[,key=value...]`` (e.g. ``synthetic:tiny,blocks=4,seed=3``), a local path, or an
    http(s) URL (downloaded once with a progress bar, checked against ``sha256`` when given).
    """
    if source.startswith("synthetic:"):
        preset = source.removeprefix("synthetic:").split(",")[0]
        if preset in SIMULATION_ONLY:
            raise ModelError(
                f"{source!r} is for the simulator only ({parse_synthetic(source).n_params / 1e9:.0f} B parameters): "
                "`ppharness plan simulate` and `plan make` take it; to run, use a preset that fits this machine"
            )
        return synthetic_path(parse_synthetic(source))
    if source.startswith(("http://", "https://")):
        return download(source, sha256)
    path = Path(source).expanduser()
    if not path.is_file():
        raise ModelError(f"model file {path} does not exist")
    if sha256 and sha256_file(path) != sha256.lower():
        raise ModelError(f"model file {path}: sha256 does not match the expected {sha256}")
    return path


def parse_synthetic(source: str) -> ModelSpec:
    """``synthetic:tiny,blocks=4,seed=3`` -> ModelSpec."""
    preset, *pairs = source.removeprefix("synthetic:").split(",")
    fields = {f: type(v) for f, v in asdict(PRESETS["tiny"]).items()}
    overrides: dict[str, object] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in fields:
            raise ModelError(f"{source!r}: unknown synthetic model field {key!r}; expected one of {', '.join(fields)}")
        typ = fields[key]
        overrides[key] = value.lower() in ("1", "true", "yes") if typ is bool else typ(value)
    return preset_spec(preset or "tiny", **overrides)


def synthetic_source(spec: ModelSpec) -> str:
    """The inverse of ``parse_synthetic``: a spec as a ``synthetic:`` source string (every field explicit)."""
    return "synthetic:tiny," + ",".join(f"{k}={v}" for k, v in asdict(spec).items())
