"""What a plan (or cluster) may hold: every size, count and number of its fields has a stated maximum, refused with
the file, the ``$.path`` and the fix before anything is computed from it.

The maxima are far above any real model or cluster (kimi-k2: 61 blocks of 384 experts, a few TiB of weights) and
low enough that every figure stays finite as a float and each size fits a 64-bit integer (the planner refuses a
model whose sums pass 2^62 bytes, ``ppharness.plan.search.instance``).
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

MAX_BYTES = 1 << 50  # 1 PiB: one size (a device's memory, a block's weights)
MAX_FLOPS = 10**18  # FLOPs per token of one block or head
MAX_BLOCKS = 1 << 16  # blocks in a model (the largest models have about 130)
MAX_EXPERTS = 1 << 16  # routed experts in one block
MAX_DEVICES = 1 << 16  # devices in a cluster, nodes in a placement
MAX_EDGES = 1 << 20  # edges of a placement (experts edges: one per pair of a stage and an expert node)
MAX_LINKS = 1 << 18  # links given pair by pair (or region by region)
MAX_DIM = 1 << 20
MAX_VOCAB = 1 << 24
MAX_CONTEXT = 1 << 24  # tokens of context each node holds KV cache for
MAX_OPS = MAX_BLOCKS + 3  # a node's ops: embed, a block range, head and an experts op per block


def _within(limit: int, what: str) -> str:
    return f"{what}, at most {limit:,}"


Bytes = Annotated[
    int,
    Meta(ge=0, le=MAX_BYTES, description="bytes, 0 to 1 PiB (a YAML file may write 512m, 2g, 24GiB, 1p)"),
]
Flops = Annotated[int, Meta(ge=0, le=MAX_FLOPS, description=_within(MAX_FLOPS, "FLOPs per token"))]
BlockIndex = Annotated[int, Meta(ge=0, le=MAX_BLOCKS, description=_within(MAX_BLOCKS, "a block index"))]
ExpertCount = Annotated[int, Meta(ge=0, le=MAX_EXPERTS, description=_within(MAX_EXPERTS, "experts"))]
ExpertId = Annotated[int, Meta(ge=0, lt=MAX_EXPERTS, description=_within(MAX_EXPERTS - 1, "an expert id"))]
Dim = Annotated[int, Meta(ge=1, le=MAX_DIM, description=_within(MAX_DIM, "the hidden size"))]
Vocab = Annotated[int, Meta(ge=1, le=MAX_VOCAB, description=_within(MAX_VOCAB, "tokens in the vocabulary"))]
Context = Annotated[int, Meta(ge=1, le=MAX_CONTEXT, description=_within(MAX_CONTEXT, "tokens of context"))]


def at_most(limit: int, what: str, least: int = 0) -> Meta:
    """A list's length bound, said in the error: ``what`` (``devices``) and its maximum."""
    return Meta(min_length=least, max_length=limit, description=f"{least:,} to {limit:,} {what}")
