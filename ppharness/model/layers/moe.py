"""Mixture-of-experts blocks: the router, the combine, and a bank of expert FFNs that any node can hold.

A MoE block's feed-forward part is computed in three steps, all on the device, so that its experts can live on
other nodes:

1. on the block's owner: attention, the residual ``h``, the normed ``h_norm`` (fp16: what goes to the experts), the
   router's logits (fp32), the routing (``route_on_device``: the ``k`` best experts, ties to the lower index, and
   their weights) and, for an architecture with one, the shared expert's gated output;
2. each chosen expert's FFN ``down(silu(gate(x)) * up(x))`` of its row (``expert_ffn``), computed by whichever node
   holds that expert (an ``ExpertBank``) as an fp16 vector;
3. ``combine_on_device``: ``h + sum_j w_j * y_j (+ shared)`` in float32, in the routing's order, rounded to the fp16
   block boundary.

A slice holding every expert of its blocks runs the three in one compiled step (``ModelSlice._moe_block``); a stage
with expert nodes runs them in pieces with the same kernels, handing the device's routing to the nodes.
``route`` and ``combine`` are the same definitions in numpy, on the host: the tests hold the device's against them.

What each architecture computes, as llama.cpp's ``build_moe_ffn`` and HF transformers do:

- ``qwen3moe``: softmax over all experts, top-k, weights renormalised (``norm_topk_prob``); no shared expert.
- ``qwen2moe``: softmax, top-k, weights *not* renormalised; plus the shared expert, ``sigmoid(w_g . x) *
  down(silu(gate(x)) * up(x))`` with its own width.
- ``deepseek2`` (DeepSeek V3, Kimi K2): sigmoid scores, a selection bias, grouped top-k where the file says so,
  weights renormalised and multiplied by the routed scaling factor (``route``); plus ungated shared experts.

Split == unsplit, bit for bit, by the same construction as the block boundary (``ppharness.model.engine.slicing``): an
expert's output is its own fp16 buffer computed by one compiled kernel sequence whatever node runs it, and the
routing and the combine reduce only by maxima and add their terms in a fixed order, so a row's bits do not depend on
the kernels that compute them (``route_on_device``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import NDArray

from ppharness.errors import ModelError
from ppharness.model.formats.packed import Packed

if TYPE_CHECKING:
    from tinygrad.tensor import Tensor


F16 = np.float16
F32 = np.float32


@dataclass(frozen=True)
class Routing:
    """Each row's chosen experts (``ids``: (T, k), best first) and their weights ((T, k) float32)."""

    ids: NDArray[np.int64]
    weights: NDArray[np.float32]


# llama.cpp's floor under the sum of the chosen weights before it divides by it (build_moe_ffn, 2**-14)
WEIGHTS_SUM_FLOOR = F32(6.103515625e-5)


def route(
    logits: NDArray[np.float32],
    k: int,
    renormalise: bool,
    gating: str = "softmax",
    bias: NDArray[np.float32] | None = None,
    groups: int = 0,
    groups_used: int = 0,
    scale: float = 1.0,
) -> Routing:
    """The router, on each row of ``logits`` (T, E), as llama.cpp's ``build_moe_ffn`` computes it:

    1. scores: softmax over every expert, or (``gating="sigmoid"``, DeepSeek V3 / Kimi K2) each expert's sigmoid;
    2. the selection scores: the scores plus the selection ``bias`` where the model has one (it picks experts but is
       not part of their weights);
    3. with ``groups``: the experts split into that many equal groups, each group scored by the sum of its two best
       selection scores, and only the ``groups_used`` best groups' experts stay candidates;
    4. the ``k`` best candidates by selection score (ties to the lower expert index), their *scores* as weights,
       renormalised to sum 1 when ``renormalise`` (the sum floored at 2**-14), then multiplied by ``scale``."""
    x = logits.astype(F32)
    if gating == "sigmoid":
        scores = (F32(1) / (F32(1) + np.exp(-x, dtype=F32))).astype(F32)
    elif gating == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True), dtype=F32)
        scores = (e / e.sum(axis=-1, keepdims=True, dtype=F32)).astype(F32)
    else:
        raise ModelError(f"unknown expert gating {gating!r}: expected softmax or sigmoid")
    select = scores if bias is None else (scores + bias.astype(F32)).astype(F32)
    if groups > 1:
        t, n = select.shape
        grouped = select.reshape(t, groups, n // groups)
        best2 = -np.sort(-grouped, axis=-1)[:, :, :2].sum(axis=-1, dtype=F32)  # (T, groups)
        kept = np.argsort(-best2, axis=-1, kind="stable")[:, :groups_used]
        mask = np.zeros((t, groups), dtype=bool)
        np.put_along_axis(mask, kept, True, axis=-1)
        select = np.where(np.repeat(mask, n // groups, axis=-1), select, F32(-np.inf)).astype(F32)
    ids = np.argsort(-select, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, ids, axis=-1).astype(F32)
    if renormalise:
        total = np.maximum(weights.sum(axis=-1, keepdims=True, dtype=F32), WEIGHTS_SUM_FLOOR)
        weights = (weights / total).astype(F32)
    if scale != 1.0:
        weights = (weights * F32(scale)).astype(F32)
    return Routing(ids=ids.astype(np.int64), weights=weights)


def combine(
    h: NDArray[np.float32],
    outputs: NDArray[np.float16],
    weights: NDArray[np.float32],
    shared: NDArray[np.float32] | None = None,
) -> NDArray[np.float16]:
    """The block's output (T, D) fp16: the residual ``h`` (T, D) plus the experts' ``outputs`` (T, k, D) weighted by
    ``weights`` (T, k), summed in routing order, plus the gated shared expert's output when there is one."""
    moe = np.zeros(h.shape, dtype=F32)
    for j in range(outputs.shape[1]):
        moe += weights[:, j : j + 1] * outputs[:, j, :].astype(F32)
    if shared is not None:
        moe += shared
    return (h.astype(F32) + moe).astype(F16)


def routed(layer: int, logits: NDArray[np.float32], routing: Routing) -> Routing:
    """Where a generator step (``ModelSlice.step``, ``BatchedRows.step_rows``) hands on the routing of block ``layer``
    that the device computed from ``logits``: the routing itself (a seam that the tests watch)."""
    return routing


def route_on_device(
    logits: Tensor,
    k: int,
    renormalise: bool,
    gating: str = "softmax",
    bias: Tensor | None = None,
    groups: int = 0,
    groups_used: int = 0,
    scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """``route`` on the device: ``logits`` (T, E) float32 -> the chosen experts (T, k) int32, best first (ties to the
    lower index), and their weights (T, k) float32; no host round trip.

    Its only reductions over the experts are maxima, which are exact in any order, and its sums are written out term
    by term (the k chosen scores; with softmax and no renormalisation, every expert's): so a row's routing has the
    same bits whatever kernels compute it: one row or a batch, free-order or batch-invariant
    (``ppharness.model.layers.rows``).
    Softmax picks by logit (the order its probabilities have) and weighs each pick ``exp(l - max)`` over the sum of
    those of the picks (renormalised) or of every expert: ``route``'s weights up to float32 rounding."""
    from tinygrad.dtype import dtypes
    from tinygrad.tensor import Tensor

    x = logits.float()
    t, n = int(x.shape[0]), int(x.shape[1])
    if gating == "sigmoid":
        scores = cast("Any", x).sigmoid()  # sigmoid is unannotated
        select = scores if bias is None else scores + bias.reshape(1, n)
    elif gating == "softmax":
        scores = (x - x.max(-1, keepdim=True)).exp()
        select = x if bias is None else scores + bias.reshape(1, n)
    else:
        raise ModelError(f"unknown expert gating {gating!r}: expected softmax or sigmoid")
    # buffers of their own: the maxima below then only compare loaded values (exp computed inside a reduction would
    # be vectorised differently for different row counts, and a lane's exp can differ in its last bit)
    scores, select = scores.contiguous(), select.contiguous()
    if groups > 1:
        size = n // groups
        grouped = select.reshape(t, groups, size)
        best = grouped.max(-1)
        first = Tensor.arange(size).reshape(1, 1, size) == grouped.argmax(-1).unsqueeze(-1)
        score = best + first.where(-math.inf, grouped).max(-1)  # (T, groups): the sum of each group's best two
        keep = Tensor.zeros(t, groups, dtype=dtypes.bool).contiguous()
        for _ in range(groups_used):
            hit = Tensor.arange(groups).reshape(1, groups) == score.argmax(-1).unsqueeze(-1)
            keep, score = keep | hit, hit.where(-math.inf, score)
        select = keep.unsqueeze(-1).expand(t, groups, size).reshape(t, n).where(select, -math.inf)
    ids, picked = [], []
    for _ in range(k):
        i = select.argmax(-1).unsqueeze(-1)  # (T, 1): the first of the largest
        hit = Tensor.arange(n).reshape(1, n) == i
        ids.append(i)
        picked.append(hit.where(scores, -math.inf).max(-1, keepdim=True))  # the one score, exactly
        select = hit.where(-math.inf, select)
    # the chosen scores a buffer of their own, then elementwise arithmetic only (fused into the reductions above, the
    # sum and the division were compiled differently for different row counts in batch-invariant mode)
    weights = Tensor.cat(*picked, dim=-1).contiguous()
    terms = [weights[:, j : j + 1] for j in range(k)]
    if renormalise:
        weights = weights / _sum_terms(terms).maximum(float(WEIGHTS_SUM_FLOOR)).contiguous()
    elif gating == "softmax":  # each pick's probability: over the sum of every expert's exp(l - max)
        weights = weights / _sum_terms([scores[:, e : e + 1] for e in range(n)]).contiguous()
    if scale != 1.0:
        weights = weights * scale
    return Tensor.cat(*ids, dim=-1).cast(dtypes.int32).contiguous(), weights.contiguous()


def _sum_terms(terms: list[Tensor]) -> Tensor:
    """``terms[0] + terms[1] + ...``, added in that order (elementwise: no reduction whose order a kernel picks)."""
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def combine_on_device(residual: Tensor, outputs: Tensor, weights: Tensor, shared: Tensor | None = None) -> Tensor:
    """``combine`` on the device: ``residual`` (T, D) float32, the experts' ``outputs`` (T, k, D) float16 weighted by
    ``weights`` (T, k) float32 and summed in routing order, plus the shared experts' output (T, D) float32 -> the
    block's output (T, D) float16. Elementwise only, so its bits do not depend on how many rows run."""
    k = int(outputs.shape[1])
    terms = [weights[:, j : j + 1] * outputs[:, j, :].float() for j in range(k)]
    moe = _sum_terms(terms + ([shared] if shared is not None else []))
    out: Tensor = (residual.float() + moe).cast("float16").contiguous()
    return out


def combine_rows(
    residual: NDArray[np.float32],
    outputs: NDArray[np.float16],
    weights: NDArray[np.float32],
    shared: NDArray[np.float32] | None = None,
) -> NDArray[np.float16]:
    """``combine_on_device`` of a generator step's (T, ...) rows, its inputs copied to the device: the kernel a
    fused step runs, so the same bits."""
    from tinygrad.tensor import Tensor

    gated = None if shared is None else Tensor(np.ascontiguousarray(shared))
    out = combine_on_device(
        Tensor(np.ascontiguousarray(residual)), Tensor(np.ascontiguousarray(outputs)), Tensor(weights), gated
    )
    return cast("NDArray[np.float16]", out.numpy())


def expert_ffn(gate: Tensor | Packed, up: Tensor | Packed, down: Tensor | Packed, x: Tensor, slots: Tensor) -> Tensor:
    """One row ``x`` (1, D) float16 through the experts at ``slots`` (w,) int32 of the stacks ``gate``, ``up`` (n, F,
    D) and ``down`` (n, D, F): (w, D) float16, each expert ``down(silu(gate x) * up x)``. The chosen experts' weights
    are read by id (tinygrad turns the gather into direct loads: only the chosen experts' bytes are read); a packed
    stack is unpacked inside the product, which multiplies in float32."""
    w = int(slots.shape[0])

    def product(t: Tensor | Packed, col: Tensor) -> Tensor:
        if isinstance(t, Packed):
            return (t.values(t.raw[slots]) @ col.float()).cast(col.dtype)
        return t[slots] @ col

    col = x.reshape(-1, 1)
    rows, width = int(col.shape[0]), (up.shape[1] if isinstance(up, Packed) else int(up.shape[1]))
    act: Tensor = cast("Any", product(gate, col).reshape(w, width)).silu().contiguous()  # silu: unannotated
    y = act * product(up, col).reshape(w, width)
    out: Tensor = product(down, y.reshape(w, width, 1)).reshape(w, rows)
    return out.cast("float16").contiguous()


@dataclass(frozen=True)
class ExpertCall:
    """A MoE block's request for its routed experts: ``hidden`` (T, D) fp16 rows (the normed input of the block's
    feed-forward part) and each row's ``routing``. Answered with the chosen experts' outputs, (T, k, D) fp16 in the
    routing's order."""

    layer: int
    hidden: NDArray[np.float16]
    routing: Routing

    def wanted(self) -> set[int]:
        return {int(e) for e in np.unique(self.routing.ids)}


def routing_entropy(frequencies: list[float]) -> float:
    """How evenly a layer's tokens spread over its experts: the entropy of the normalised frequencies, in bits."""
    total = sum(frequencies)
    return -sum(f / total * math.log2(f / total) for f in frequencies if f > 0) if total else 0.0
