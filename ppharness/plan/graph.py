"""The plan's ``model`` part: what each block weighs and costs per token, read from a GGUF file (``model_graph``) or
derived from a synthetic model's spec without writing it (``spec_graph``).

Weights count as the node runtime holds them (``ppharness.model.held``): each matrix the file stores in a packed type
(BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) at its bytes in the file, F16 and F32 matrices, norms and biases as
float16 (two bytes an element), what the architecture keeps in float32 (a MoE block's router and the norm before it)
at four bytes an element, and a routed expert's gate, up and down matrices at their block's stacks' bytes over its
experts (packed or float16 as the stacks are stored). A plan made so is a plan whose memory check is the run's.

``weights`` overrides that count, for the simulator only: a quantised weight type (``WEIGHT_BITS``) or bits per
weight at which every weight matrix (the router's excepted, which llama.cpp's quantiser keeps in float) counts, the
vectors (norms, biases) at two bytes, whatever types the file stores (e.g. Kimi K2 at 4.5 bits per weight from its
unwritten spec). The graph records the override (``ModelGraph.weights``), and a run refuses a plan made with it
(``ppharness.plan.compile.check_model``): the runtime holds the file's own types. A block's FLOPs per token are two
per weight (one multiply-add) plus attention over half the context; its KV cache per token is keys and values for
every KV head, float16.

What a block caches per token and what attending to one cached position costs is the architecture's
(``Architecture.attention_cost`` in ``ppharness.model.arch``): keys and values of every KV head for llama's attention;
for multi-head latent attention (``deepseek2``) one compressed vector and the shared rotary key, whatever the head
count, attended to in that compressed space.

A mixture-of-experts block (one with a router, ``blk.N.ffn_gate_inp.weight``) weighs all its tensors, its routed
experts' banks (``ffn_{gate,up,down}_exps``) included, but a token goes through ``experts_used`` of its routed
experts only: its FLOPs per token are two per dense weight (attention, router, any shared expert) and two per weight
of ``experts_used`` experts (3 x dim x expert_ffn each), plus attention. Its ``experts`` say how many routed experts
it has, how many a token uses, how many shared experts it has (``*_shexp`` tensors: as the architecture counts
them, ``Architecture.shared_experts``) and what one routed expert weighs (its gate, up and down matrices, as held)
and costs per token (``flops_per_expert`` given wherever that differs from its bytes).

A synthetic model's graph comes from its tensors and their types as its architecture and the writer list them
(``ModelSpec.tensors``, ``ppharness.model.synthetic.spec.tensor_type``: what ``ppharness.model.synthetic.writer``
writes), so the graph of a model too large to write here (``SIMULATION_ONLY``, e.g. ``kimi-k2``) is the graph its file
would give; such a graph has no sha256 and its plans are for simulation only.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ppharness.errors import PlanError
from ppharness.model.arch import architecture
from ppharness.model.arch.base import Architecture
from ppharness.model.formats.table import F16
from ppharness.model.gguf.names import moe_blocks
from ppharness.model.gguf_file import GGUFFile, file_tensors
from ppharness.model.held import FLOAT16, Stored, held_bytes
from ppharness.model.sources.files import sha256_file
from ppharness.model.synthetic.spec import SIMULATION_ONLY, ModelSpec, stored_tensors
from ppharness.plan.lang.document import Block, Experts, ModelGraph

WIRE_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
KV_BYTES = 2  # the node runtime's KV cache is float16
TOKEN_MESSAGE_BYTES = 64  # a NextToken message on the wire (ids, position, request id, header)
# the simulator's override (``--weights``): bits per weight of a weight matrix stored in a GGUF type, ggml's block
# layouts (Q8_0: 32 int8 + one fp16 scale per 32 weights; Q4_0: 32 nibbles + one fp16 scale; Q4_K: super-blocks of
# 256 weights in 144 bytes — two fp16 scales, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of nibbles)
WEIGHT_BITS = {"f16": 16.0, "q8_0": 8.5, "q4_k": 4.5, "q4_0": 4.5}
_BLK = re.compile(r"^blk\.(\d+)\.")
_ROUTER = re.compile(r"\.ffn_gate_inp(_shexp)?\.weight$")


@functools.cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(Path(path))


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file (``sha256_file``), computed once per (path, size, mtime) in this process."""
    st = Path(path).stat()
    return _sha256(str(path), st.st_size, st.st_mtime_ns)


def weight_bits(weights: str) -> float:
    """Bits per weight of a weight matrix for the override ``weights`` (``--weights``): a GGUF type of
    ``WEIGHT_BITS`` (``f16``, ``q8_0``, ``q4_k``, ``q4_0``) or a number of bits (``4.5``, from 1 to 32). PlanError
    naming the choices otherwise."""
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

    architecture: Architecture
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
    tensors: Mapping[str, Stored],
    source: str,
    sha256: str,
    max_context: int,
    wire_dtype: str,
    weights: str,
) -> ModelGraph:
    override = weights.strip().lower()
    bits = weight_bits(override) if override else None
    held = held_bytes(shape.architecture, shape.moe_blocks, tensors) if bits is None else {}

    def nbytes(name: str, dims: tuple[int, ...]) -> int:
        """Tensor ``name``'s bytes (``dims``: a float16 stand-in's, where the model lacks it)."""
        t = tensors.get(name, Stored(dims, F16))
        if bits is None:
            return held.get(name, t.elements * FLOAT16)
        if len(t.dims) >= 2 and not _ROUTER.search(name):
            return math.ceil(t.elements * bits / 8)
        return t.elements * FLOAT16

    per_expert = 3 * shape.dim * shape.expert_ffn  # one routed expert's parameters: gate, up, down
    params = [0] * shape.blocks
    dense_bytes = [0] * shape.blocks
    routed_bytes = [0] * shape.blocks  # each block's routed experts, all of them, as held
    shexp = [0] * shape.blocks
    for name, t in tensors.items():
        m = _BLK.match(name)
        if m is None:
            continue
        i = int(m[1])
        params[i] += t.elements
        if name.endswith("_exps.weight"):
            routed_bytes[i] += nbytes(name, t.dims)
        else:
            dense_bytes[i] += nbytes(name, t.dims)
        if name.endswith(".ffn_gate_shexp.weight"):
            shexp[i] = t.elements // shape.dim
    ctx = max_context // 2  # decode attends over half the context on average
    cached, per_position = shape.architecture.attention_cost(shape)
    kv = cached * KV_BYTES
    attention_flops = per_position * ctx
    blocks = []
    for i, n in enumerate(params):
        if i not in shape.moe_blocks:
            blocks.append(Block(weight_bytes=dense_bytes[i], flops=2 * n + attention_flops, kv_bytes=kv))
            continue
        if bits is not None:
            expert_bytes = math.ceil(per_expert * bits / 8)
        else:  # a stack holds every expert alike: its bytes divide by the experts
            expert_bytes = routed_bytes[i] // shape.experts if routed_bytes[i] else per_expert * FLOAT16
        dense = n - shape.experts * per_expert
        shared = shape.architecture.shared_experts(shexp[i], shape.expert_ffn) if shexp[i] else 0
        experts = Experts(
            count=shape.experts,
            active=shape.experts_used,
            shared=shared,
            bytes_per_expert=expert_bytes,
            # 0: as many as its bytes, which only a float16 expert's are
            flops_per_expert=2 * per_expert if expert_bytes != per_expert * FLOAT16 else 0,
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
    embed = tensors.get("token_embd.weight", Stored((shape.vocab, shape.dim), F16))
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"  # tied: the embedding again
    out_dims = tensors[head].dims if head in tensors else embed.dims
    return ModelGraph(
        source=source,
        sha256=sha256,
        arch=shape.arch,
        dim=shape.dim,
        vocab=shape.vocab,
        max_context=max_context,
        embed_bytes=nbytes("token_embd.weight", embed.dims),
        head_bytes=nbytes(head, out_dims) + nbytes("output_norm.weight", (shape.dim,)),
        head_flops=2 * math.prod(out_dims),
        activation_bytes=shape.dim * WIRE_BYTES[wire_dtype],
        token_bytes=TOKEN_MESSAGE_BYTES,
        blocks=tuple(blocks),
        weights=override,
    )


def model_graph(
    path: str | os.PathLike[str],
    source: str,
    max_context: int,
    wire_dtype: str = "f16",
    digest: bool = True,
    weights: str = "",
) -> ModelGraph:
    """The ``model`` part of a plan for the GGUF file at ``path`` (``source``: how a run finds it again). Without
    ``digest`` the file's sha256 is left empty (a plan made for one run, not saved). Weights count as the runtime
    holds the file's tensors, in their own types; ``weights`` (``--weights``): the simulator's override (the
    module's docstring)."""
    f = GGUFFile(path)
    cfg = f.config
    shape = _Shape(
        architecture=f.architecture,
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
        kv_lora_rank=cfg.kv_lora_rank,
        rope_dim=cfg.rope_dim,
    )
    sha = file_sha256(path) if digest else ""
    return _graph(shape, file_tensors(f), source, sha, max_context, wire_dtype, weights)


def spec_graph(
    spec: ModelSpec, source: str, max_context: int, wire_dtype: str = "f16", weights: str = ""
) -> ModelGraph:
    """The ``model`` part of a plan for the synthetic model ``spec``, derived from its tensors and the types the
    writer stores them in (``ModelSpec.tensors``, ``tensor_type``) without writing it: what ``model_graph`` gives for
    its file, but with no sha256 (a plan made with it is for the simulator; a run resolves the model and checks
    nothing against it)."""
    arch = architecture(spec.arch)
    tensors = stored_tensors(spec)
    shape = _Shape(
        architecture=arch,
        arch=spec.arch,
        blocks=spec.blocks,
        dim=spec.dim,
        vocab=spec.vocab,
        heads=spec.heads,
        kv_heads=arch.cache_heads(spec),
        head_dim=spec.hd,
        experts=spec.experts,
        experts_used=spec.experts_used,
        expert_ffn=spec.expert_ffn,
        moe_blocks=moe_blocks(tensors),
        kv_lora_rank=spec.kv_lora_rank,
        rope_dim=spec.rope_dim,
    )
    return _graph(shape, tensors, source, "", max_context, wire_dtype, weights)


def simulation_only(source: str) -> bool:
    """Whether the synthetic model ``source`` names is one this machine does not write (``SIMULATION_ONLY`` in
    ``ppharness.model.synthetic.spec``): its plans come from ``spec_graph`` and are for the simulator only."""
    if not source.startswith("synthetic:"):
        return False
    return source.removeprefix("synthetic:").split(",")[0] in SIMULATION_ONLY
