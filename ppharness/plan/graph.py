"""The plan's ``model`` part, read from a GGUF file: what each block weighs and costs per token.

Weights count as the node runtime holds them (float16, two bytes per parameter, whatever the file's quantisation);
a block's FLOPs per token are two per weight (one multiply-add) plus attention over half the context; its KV cache per
token is keys and values for every KV head.

A mixture-of-experts block (one with a router, ``blk.N.ffn_gate_inp.weight``) weighs all its tensors, its routed
experts' banks (``ffn_{gate,up,down}_exps``) included, but a token goes through ``experts_used`` of its routed
experts only: its FLOPs per token are two per dense weight (attention, router, the shared expert of the qwen2moe
variant) and two per weight of ``experts_used`` experts (3 x dim x expert_ffn each), plus attention. Its ``experts``
say how many routed experts it has, how many a token uses, whether it has a shared expert (``*_shexp`` tensors) and
what one routed expert weighs (its gate, up and down matrices in float16).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

from ppharness.plan.doc import Block, Experts, ModelGraph

WIRE_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
RUNTIME_BYTES = 2  # float16 weights and KV cache in the node runtime
TOKEN_MESSAGE_BYTES = 64  # a NextToken message on the wire (ids, position, request id, header)
_BLK = re.compile(r"^blk\.(\d+)\.")


@functools.cache
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    from ppharness.model.files import sha256_file

    return sha256_file(Path(path))


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file (``ppharness.model.files.sha256_file``), computed once per (path, size, mtime) in this
    process."""
    st = Path(path).stat()
    return _sha256(str(path), st.st_size, st.st_mtime_ns)


def model_graph(
    path: str | os.PathLike[str], source: str, max_context: int, wire_dtype: str = "f16", digest: bool = True
) -> ModelGraph:
    """The ``model`` part of a plan for the GGUF file at ``path`` (``source``: how a run finds it again). Without
    ``digest`` the file's sha256 is left empty (a plan made for one run, not saved)."""
    from ppharness.model.slicing import GGUFFile

    f = GGUFFile(path)
    cfg = f.config
    params = {t.name: int(t.n_elements) for t in f._reader.tensors}
    per_block = [0] * cfg.blocks
    for name, n in params.items():
        if m := _BLK.match(name):
            per_block[int(m[1])] += n
    kv = 2 * cfg.kv_heads * cfg.head_dim * RUNTIME_BYTES
    attention_flops = 2 * 2 * cfg.heads * cfg.head_dim * (max_context // 2)  # q.k and p.v over half the context
    per_expert = 3 * cfg.dim * cfg.expert_ffn  # one routed expert's parameters: gate, up, down
    blocks = []
    for i, n in enumerate(per_block):
        if i not in cfg.moe_blocks:
            blocks.append(Block(weight_bytes=n * RUNTIME_BYTES, flops=2 * n + attention_flops, kv_bytes=kv))
            continue
        dense = n - cfg.experts * per_expert
        shared = int(f"blk.{i}.ffn_gate_inp_shexp.weight" in params or f"blk.{i}.ffn_gate_shexp.weight" in params)
        experts = Experts(
            count=cfg.experts, active=cfg.experts_used, shared=shared, bytes_per_expert=per_expert * RUNTIME_BYTES
        )
        flops = 2 * dense + 2 * cfg.experts_used * per_expert + attention_flops
        blocks.append(Block(weight_bytes=n * RUNTIME_BYTES, flops=flops, kv_bytes=kv, experts=experts))
    embed = params.get("token_embd.weight", cfg.vocab * cfg.dim)
    out = params.get("output.weight", embed)
    return ModelGraph(
        source=source,
        sha256=file_sha256(path) if digest else "",
        arch=cfg.arch,
        dim=cfg.dim,
        vocab=cfg.vocab,
        max_context=max_context,
        embed_bytes=embed * RUNTIME_BYTES,
        head_bytes=(out + params.get("output_norm.weight", cfg.dim)) * RUNTIME_BYTES,
        head_flops=2 * out,
        activation_bytes=cfg.dim * WIRE_BYTES[wire_dtype],
        token_bytes=TOKEN_MESSAGE_BYTES,
        blocks=tuple(blocks),
    )
