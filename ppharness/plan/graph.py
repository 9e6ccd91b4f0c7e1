"""The plan's ``model`` part: what each block weighs and costs per token, read from a GGUF file (``model_graph``) or
derived from a synthetic model's spec without writing it (``spec_graph``).

Weights count as the node runtime holds them (float16, two bytes per parameter, whatever the file's quantisation),
unless ``weights`` names a quantised weight type (``WEIGHT_BITS``): every weight matrix (the router's excepted, which
llama.cpp's quantiser keeps in float) then counts at that type's bits per weight, the vectors (norms, biases) at two
bytes. Such a graph is for the simulator: the node runtime dequantises every tensor to float16 on load, so a plan
made with it cannot run (``ppharness.plan.compile.check_model`` refuses it). A block's FLOPs per token are two per
weight (one multiply-add) plus attention over half the context; its KV cache per token is keys and values for every
KV head.

Multi-head latent attention (``deepseek2``: a ``kv_lora_rank``) caches one compressed vector of ``kv_lora_rank``
values and the shared rotary key of ``rope_dim`` values per token per block, in float16, whatever the head count; a
decoding token attends in that compressed space (the key and value up-projections absorbed into the query and the
output), which costs 2 x heads x (kv_lora_rank + rope_dim) FLOPs per context position for the scores and 2 x heads x
kv_lora_rank for the weighted sum, over half the context as above.

A mixture-of-experts block (one with a router, ``blk.N.ffn_gate_inp.weight``) weighs all its tensors, its routed
experts' banks (``ffn_{gate,up,down}_exps``) included, but a token goes through ``experts_used`` of its routed
experts only: its FLOPs per token are two per dense weight (attention, router, any shared expert) and two per weight
of ``experts_used`` experts (3 x dim x expert_ffn each), plus attention. Its ``experts`` say how many routed experts
it has, how many a token uses, how many shared experts it has (``*_shexp`` tensors: one for qwen2moe, the shared
width over the expert width for deepseek2) and what one routed expert weighs (its gate, up and down matrices) and
costs per token.

``spec_tensors`` lists a synthetic model's tensors as ``ppharness.model.files`` writes them (llama, qwen3moe,
qwen2moe, deepseek2), so the graph of a model too large to write here (``SIMULATION_ONLY``, e.g. ``kimi-k2``) is the
graph its file would give; such a graph has no sha256 and its plans are for simulation only.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ppharness.errors import PlanError
from ppharness.plan.doc import Block, Experts, ModelGraph

if TYPE_CHECKING:
    from ppharness.model.files import ModelSpec

WIRE_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
RUNTIME_BYTES = 2  # float16 weights and KV cache in the node runtime
TOKEN_MESSAGE_BYTES = 64  # a NextToken message on the wire (ids, position, request id, header)
# bits per weight of a weight matrix stored in a GGUF type: ggml's block layouts (Q8_0: 32 int8 + one fp16 scale per
# 32 weights; Q4_0: 32 nibbles + one fp16 scale; Q4_K: super-blocks of 256 weights in 144 bytes — two fp16 scales,
# 12 bytes of 6-bit sub-block scales and mins, 128 bytes of nibbles)
WEIGHT_BITS = {"f16": 16.0, "q8_0": 8.5, "q4_k": 4.5, "q4_0": 4.5}
_BLK = re.compile(r"^blk\.(\d+)\.")
_ROUTER = re.compile(r"\.ffn_gate_inp(_shexp)?\.weight$")


@functools.cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    from ppharness.model.files import sha256_file

    return sha256_file(Path(path))


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file (``ppharness.model.files.sha256_file``), computed once per (path, size, mtime) in this
    process."""
    st = Path(path).stat()
    return _sha256(str(path), st.st_size, st.st_mtime_ns)


def weight_bits(weights: str) -> float:
    """Bits per weight of a weight matrix for ``weights``: a GGUF type of ``WEIGHT_BITS`` (``f16``, ``q8_0``,
    ``q4_k``, ``q4_0``) or a number of bits (``4.5``, from 1 to 32). PlanError naming the choices otherwise."""
    key = weights.strip().lower()
    if key in WEIGHT_BITS:
        return WEIGHT_BITS[key]
    try:
        bits = float(key.removesuffix("bpw"))
    except ValueError:
        bits = math.nan
    if not 1 <= bits <= 32:
        raise PlanError(
            f"--weights {weights}: not a weight type — use one of {', '.join(WEIGHT_BITS)} or bits per weight from 1 "
            "to 32 (e.g. 4.5)"
        )
    return bits


@dataclass(frozen=True)
class _Shape:
    """What the graph needs of a model besides its tensors."""

    arch: str
    blocks: int
    dim: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_ffn: int
    moe_blocks: frozenset[int]
    kv_lora_rank: int = 0  # MLA (deepseek2): the compressed KV width, 0 for ordinary attention
    rope_dim: int = 0  # MLA: the shared rotary key's width


def _graph(
    shape: _Shape,
    tensors: Mapping[str, tuple[int, ...]],
    source: str,
    sha256: str,
    max_context: int,
    wire_dtype: str,
    weights: str,
) -> ModelGraph:
    bits = weight_bits(weights)
    quantised = bits != WEIGHT_BITS["f16"]

    def nbytes(name: str, dims: tuple[int, ...]) -> int:
        n = math.prod(dims)
        if quantised and len(dims) >= 2 and not _ROUTER.search(name):
            return math.ceil(n * bits / 8)
        return n * RUNTIME_BYTES

    per_expert = 3 * shape.dim * shape.expert_ffn  # one routed expert's parameters: gate, up, down
    expert_bytes = math.ceil(per_expert * bits / 8) if quantised else per_expert * RUNTIME_BYTES
    params = [0] * shape.blocks
    dense_bytes = [0] * shape.blocks
    shexp = [0] * shape.blocks
    for name, dims in tensors.items():
        m = _BLK.match(name)
        if m is None:
            continue
        i = int(m[1])
        params[i] += math.prod(dims)
        if not name.endswith("_exps.weight"):
            dense_bytes[i] += nbytes(name, dims)
        if name.endswith(".ffn_gate_shexp.weight"):
            shexp[i] = math.prod(dims) // shape.dim
    ctx = max_context // 2  # decode attends over half the context on average
    if shape.kv_lora_rank:
        kv = (shape.kv_lora_rank + shape.rope_dim) * RUNTIME_BYTES
        per_position = 2 * shape.heads * (shape.kv_lora_rank + shape.rope_dim) + 2 * shape.heads * shape.kv_lora_rank
        attention_flops = per_position * ctx
    else:
        kv = 2 * shape.kv_heads * shape.head_dim * RUNTIME_BYTES
        attention_flops = 2 * 2 * shape.heads * shape.head_dim * ctx  # q.k and p.v
    blocks = []
    for i, n in enumerate(params):
        if i not in shape.moe_blocks:
            blocks.append(Block(weight_bytes=dense_bytes[i], flops=2 * n + attention_flops, kv_bytes=kv))
            continue
        dense = n - shape.experts * per_expert
        shared = 0
        if shexp[i]:
            shared = max(1, shexp[i] // shape.expert_ffn) if shape.arch == "deepseek2" else 1
        experts = Experts(
            count=shape.experts,
            active=shape.experts_used,
            shared=shared,
            bytes_per_expert=expert_bytes,
            flops_per_expert=2 * per_expert if quantised else 0,
        )
        flops = 2 * dense + 2 * shape.experts_used * per_expert + attention_flops
        blocks.append(
            Block(
                weight_bytes=dense_bytes[i] + shape.experts * expert_bytes,
                flops=flops,
                kv_bytes=kv,
                experts=experts,
            )
        )
    embed_dims = tensors.get("token_embd.weight", (shape.vocab, shape.dim))
    out_dims = tensors.get("output.weight", embed_dims)
    norm_dims = tensors.get("output_norm.weight", (shape.dim,))
    return ModelGraph(
        source=source,
        sha256=sha256,
        arch=shape.arch,
        dim=shape.dim,
        vocab=shape.vocab,
        max_context=max_context,
        embed_bytes=nbytes("token_embd.weight", embed_dims),
        head_bytes=nbytes("output.weight", out_dims) + nbytes("output_norm.weight", norm_dims),
        head_flops=2 * math.prod(out_dims),
        activation_bytes=shape.dim * WIRE_BYTES[wire_dtype],
        token_bytes=TOKEN_MESSAGE_BYTES,
        blocks=tuple(blocks),
        weights="" if not quantised else weights.strip().lower(),
    )


def model_graph(
    path: str | os.PathLike[str],
    source: str,
    max_context: int,
    wire_dtype: str = "f16",
    digest: bool = True,
    weights: str = "f16",
) -> ModelGraph:
    """The ``model`` part of a plan for the GGUF file at ``path`` (``source``: how a run finds it again). Without
    ``digest`` the file's sha256 is left empty (a plan made for one run, not saved); ``weights``: how weight bytes
    count (the module's docstring)."""
    from ppharness.model.slicing import GGUFFile

    f = GGUFFile(path)
    cfg = f.config
    tensors = {t.name: tuple(int(d) for d in t.shape) for t in f._reader.tensors}
    shape = _Shape(
        arch=cfg.arch,
        blocks=cfg.blocks,
        dim=cfg.dim,
        vocab=cfg.vocab,
        heads=cfg.heads,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        experts=cfg.experts,
        experts_used=cfg.experts_used,
        expert_ffn=cfg.expert_ffn,
        moe_blocks=frozenset(cfg.moe_blocks),
        kv_lora_rank=int(getattr(cfg, "kv_lora_rank", 0)),
        rope_dim=int(getattr(cfg, "rope_dim", 0)),
    )
    sha = file_sha256(path) if digest else ""
    return _graph(shape, tensors, source, sha, max_context, wire_dtype, weights)


def spec_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of the synthetic model ``spec`` (name -> shape, out before in), as ``ppharness.model.files``
    writes it: llama's attention and FFN; qwen3moe's query and key norms and routed experts; qwen2moe's attention
    biases, routed experts and gated shared expert; deepseek2's MLA attention, leading dense blocks, router with its
    selection bias, routed experts and ungated shared experts."""
    d, h, hd, e, f, v = spec.dim, spec.heads, spec.hd, spec.experts, spec.expert_ffn, spec.vocab
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, d)}
    deepseek = spec.arch == "deepseek2"
    for i in range(spec.blocks):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = (d,)
        if deepseek:
            c, r, q = spec.kv_lora_rank, spec.rope_dim, spec.q_lora_rank
            if q:
                out[b + "attn_q_a.weight"] = (q, d)
                out[b + "attn_q_a_norm.weight"] = (q,)
                out[b + "attn_q_b.weight"] = (h * hd, q)
            else:
                out[b + "attn_q.weight"] = (h * hd, d)
            out[b + "attn_kv_a_mqa.weight"] = (c + r, d)
            out[b + "attn_kv_a_norm.weight"] = (c,)
            out[b + "attn_k_b.weight"] = (h, c, hd - r)
            out[b + "attn_v_b.weight"] = (h, spec.v_head_dim, c)
            out[b + "attn_output.weight"] = (d, h * spec.v_head_dim)
        else:
            out[b + "attn_q.weight"] = (h * hd, d)
            out[b + "attn_k.weight"] = (spec.kv_heads * hd, d)
            out[b + "attn_v.weight"] = (spec.kv_heads * hd, d)
            out[b + "attn_output.weight"] = (d, h * hd)
            if spec.arch == "qwen3moe":
                out[b + "attn_q_norm.weight"] = (hd,)
                out[b + "attn_k_norm.weight"] = (hd,)
            if spec.arch == "qwen2moe":
                out[b + "attn_q.bias"] = (h * hd,)
                out[b + "attn_k.bias"] = (spec.kv_heads * hd,)
                out[b + "attn_v.bias"] = (spec.kv_heads * hd,)
        out[b + "ffn_norm.weight"] = (d,)
        if spec.arch == "llama" or (deepseek and i < spec.dense_blocks):
            out[b + "ffn_gate.weight"] = (spec.ffn, d)
            out[b + "ffn_up.weight"] = (spec.ffn, d)
            out[b + "ffn_down.weight"] = (d, spec.ffn)
            continue
        out[b + "ffn_gate_inp.weight"] = (e, d)
        if deepseek:
            out[b + "exp_probs_b.bias"] = (e,)
        out[b + "ffn_gate_exps.weight"] = (e, f, d)
        out[b + "ffn_up_exps.weight"] = (e, f, d)
        out[b + "ffn_down_exps.weight"] = (e, d, f)
        s = spec.shared_ffn if spec.arch == "qwen2moe" else f * spec.shared_experts if deepseek else 0
        if s:
            if spec.arch == "qwen2moe":
                out[b + "ffn_gate_inp_shexp.weight"] = (d,)
            out[b + "ffn_gate_shexp.weight"] = (s, d)
            out[b + "ffn_up_shexp.weight"] = (s, d)
            out[b + "ffn_down_shexp.weight"] = (d, s)
    out["output_norm.weight"] = (d,)
    if not spec.tied_embeddings:
        out["output.weight"] = (v, d)
    return out


def spec_graph(
    spec: ModelSpec, source: str, max_context: int, wire_dtype: str = "f16", weights: str = "f16"
) -> ModelGraph:
    """The ``model`` part of a plan for the synthetic model ``spec``, derived from its tensors (``spec_tensors``)
    without writing it: what ``model_graph`` gives for its file, but with no sha256 (a plan made with it is for the
    simulator; a run resolves the model and checks nothing against it)."""
    moe_blocks = (
        frozenset(range(spec.dense_blocks if spec.arch == "deepseek2" else 0, spec.blocks)) if spec.moe else frozenset()
    )
    shape = _Shape(
        arch=spec.arch,
        blocks=spec.blocks,
        dim=spec.dim,
        vocab=spec.vocab,
        heads=spec.heads,
        kv_heads=1 if spec.arch == "deepseek2" else spec.kv_heads,
        head_dim=spec.hd,
        experts=spec.experts,
        experts_used=spec.experts_used,
        expert_ffn=spec.expert_ffn,
        moe_blocks=moe_blocks,
        kv_lora_rank=spec.kv_lora_rank if spec.arch == "deepseek2" else 0,
        rope_dim=spec.rope_dim if spec.arch == "deepseek2" else 0,
    )
    return _graph(shape, spec_tensors(spec), source, "", max_context, wire_dtype, weights)


def simulation_only(source: str) -> bool:
    """Whether the synthetic model ``source`` names is one this machine does not write (``SIMULATION_ONLY`` in
    ``ppharness.model.files``): its plans come from ``spec_graph`` and are for the simulator only."""
    from ppharness.model import files

    if not source.startswith("synthetic:"):
        return False
    preset = source.removeprefix("synthetic:").split(",")[0]
    return preset in getattr(files, "SIMULATION_ONLY", frozenset())
