"""Mixture-of-experts blocks: the router, the combine, and a bank of expert FFNs that any node can hold.

A MoE block's feed-forward part is computed in three steps, so that its experts can live on other nodes:

1. on the block's owner, in tinygrad: attention, the residual ``h``, the normed ``h_norm`` (fp16: what goes to the
   experts), the router's logits (fp32) and, for an architecture with one, the shared expert's gated output;
2. on the host: the routing (``route``): softmax over every expert, the ``k`` largest (ties to the lower index),
   their weights renormalised to sum 1 where the architecture says so; then each chosen expert's FFN
   ``down(silu(gate(x)) * up(x))`` of its row, computed by whichever node holds that expert (an ``ExpertBank``) as
   an fp16 vector;
3. on the host again: ``combine``: ``h + sum_j w_j * y_j (+ shared)`` in float32, in the routing's order, rounded to
   the fp16 block boundary.

What each architecture computes, as llama.cpp's ``build_moe_ffn`` and HF transformers do:

- ``qwen3moe``: softmax over all experts, top-k, weights renormalised (``norm_topk_prob``); no shared expert.
- ``qwen2moe``: softmax, top-k, weights *not* renormalised; plus the shared expert, ``sigmoid(w_g . x) *
  down(silu(gate(x)) * up(x))`` with its own width.
- ``deepseek2`` (DeepSeek V3, Kimi K2): sigmoid scores, a selection bias, grouped top-k where the file says so,
  weights renormalised and multiplied by the routed scaling factor (``route``); plus ungated shared experts.

Split == unsplit, bit for bit, by the same construction as the block boundary (``ppharness.model.slicing``): an
expert's output is its own fp16 buffer computed by one compiled kernel sequence whatever node runs it, and the
routing and the combine are numpy float32 element-wise arithmetic in a fixed order, which every machine rounds alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import NDArray

from ppharness.errors import ModelError
from ppharness.model.kernels import pin_from_env
from ppharness.model.packed import Packed

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from tinygrad.device import Buffer
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp

    from ppharness.model.gguf_file import GGUFFile

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


class ExpertBank:
    """Routed expert FFNs of some (layer, expert) pairs, stacked on one tinygrad device.

    One compiled step computes one row through ``width`` experts at once (the architecture's experts per token),
    each expert a bound variable of the step; fewer experts pad with the first. Every bank of a model, whatever it
    holds, runs that same step, and each expert's output is computed by the same kernel code at any position of the
    step, so which node computes an expert, and beside which others, never changes its bytes."""

    def __init__(self, gguf_file: GGUFFile, held: Mapping[int, Iterable[int]], weights: str = "packed"):
        from tinygrad.engine.jit import TinyJit
        from tinygrad.uop.ops import UOp

        pin_from_env()  # an expert node compiles its bank with the run's kernel table too
        cfg = gguf_file.config
        self.dim, self.ffn, self.width = cfg.dim, cfg.expert_ffn, max(1, cfg.experts_used)
        self.slots: dict[tuple[int, int], int] = {}
        parts: dict[str, list[Any]] = {"gate": [], "up": [], "down": []}
        for layer in sorted(held):
            ids = sorted({int(e) for e in held[layer]})
            if not ids:
                continue
            if layer not in cfg.moe_blocks:
                raise ModelError(f"{gguf_file.path}: block {layer} has no experts")
            if ids[-1] >= cfg.experts or ids[0] < 0:
                raise ModelError(f"{gguf_file.path}: block {layer} has experts 0..{cfg.experts - 1}, not {ids}")
            for kind, out in parts.items():
                name = f"blk.{layer}.ffn_{kind}_exps.weight"
                packed = gguf_file.packed(name, rows=ids) if weights == "packed" else None
                out.append(packed if packed is not None else gguf_file.tensor(name, rows=ids))
            for e in ids:
                self.slots[(layer, e)] = len(self.slots)
        self.n = len(self.slots)
        self.n_params = self.n * 3 * self.dim * self.ffn
        self.weight_bytes = 0
        if not self.n:
            return
        # each stack (n, F, D) / (n, D, F): float16, or as the file packs it where every block's stack is packed
        self._gate, self._up, self._down = (_stack(parts[k]) for k in ("gate", "up", "down"))
        self.weight_bytes = sum(_nbytes(t) for t in (self._gate, self._up, self._down))
        top = max(self.n - 1, 1)
        self._vars = [UOp.variable(f"expert_slot_{i}", 0, top) for i in range(self.width)]
        self._jit = TinyJit(self._ffn)
        self._in: Tensor | None = None

    def _ffn(self, x: Tensor, *slots: UOp) -> Tensor:
        """One row ``x`` (1, D) through the experts in ``slots``: (width, D) fp16."""
        from tinygrad.tensor import Tensor

        def product(t: Tensor | Packed, col: Tensor) -> Tensor:
            """The chosen experts' matrices (w, rows, cols) times ``col`` (cols, 1) fp16 -> (w, rows, 1) fp16; a
            packed stack unpacked inside the product, which multiplies in float32."""
            if isinstance(t, Packed):
                picked = Tensor.cat(*[t.raw.shrink(((s, s + 1), None, None)) for s in slots])
                return (t.values(picked) @ col.float()).cast(col.dtype)
            return Tensor.cat(*[t.shrink(((s, s + 1), None, None)) for s in slots]) @ col

        col = x.reshape(self.dim, 1)
        gated = product(self._gate, col).reshape(self.width, self.ffn)
        act: Tensor = cast("Any", gated).silu().contiguous()  # silu: unannotated
        y = act * product(self._up, col).reshape(self.width, self.ffn)
        out: Tensor = product(self._down, y.reshape(self.width, self.ffn, 1)).reshape(self.width, self.dim)
        return out.cast("float16").contiguous()

    def holds(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self.slots

    def held(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for layer, e in self.slots:
            out.setdefault(layer, []).append(e)
        return out

    def _slot(self, layer: int, expert: int) -> int:
        try:
            return self.slots[(layer, expert)]
        except KeyError:
            raise ModelError(f"expert {expert} of block {layer} is not held here") from None

    def _row(self, row: NDArray[np.float16], slots: list[int]) -> NDArray[np.float16]:
        """One row through up to ``width`` held experts (slots): (len(slots), D) fp16."""
        from tinygrad.tensor import Tensor

        arr = np.ascontiguousarray(row, dtype=F16).reshape(1, self.dim)
        if self._in is None:
            self._in = Tensor(arr).realize()
        else:
            cast("Buffer", self._in.uop.base.realized).copyin(arr.data.cast("B"))
        padded = slots + [slots[0]] * (self.width - len(slots))
        out = self._jit(self._in, *[v.bind(s) for v, s in zip(self._vars, padded)]).numpy()
        return cast("NDArray[np.float16]", out[: len(slots)].copy())

    def run(self, layer: int, expert: int, row: NDArray[np.float16]) -> NDArray[np.float16]:
        """Expert ``expert`` of block ``layer`` on one row (D,) fp16 -> (D,) fp16."""
        out: NDArray[np.float16] = self._row(row, [self._slot(layer, expert)])[0]
        return out

    def run_pairs(
        self, layer: int, hidden: NDArray[np.float16], pairs: Sequence[tuple[int, int]]
    ) -> NDArray[np.float16]:
        """(row of ``hidden``, expert) ``pairs`` of block ``layer`` -> (len(pairs), D) fp16: each row's experts
        ``width`` at a time."""
        out = np.empty((len(pairs), self.dim), dtype=F16)
        by_row: dict[int, list[int]] = {}
        for i, (row, _) in enumerate(pairs):
            by_row.setdefault(row, []).append(i)
        for row, idx in by_row.items():
            for lo in range(0, len(idx), self.width):
                chunk = idx[lo : lo + self.width]
                out[chunk] = self._row(hidden[row], [self._slot(layer, pairs[i][1]) for i in chunk])
        return out

    def answer(self, layer: int, hidden: NDArray[np.float16], experts: NDArray[np.int64]) -> NDArray[np.float16]:
        """Rows ``hidden`` (T, D) through each row's ``experts`` (T, j) -> (T, j, D) fp16."""
        t, j = experts.shape
        pairs = [(r, int(experts[r, c])) for r in range(t) for c in range(j)]
        return self.run_pairs(layer, hidden, pairs).reshape(t, j, self.dim)


def _stack(parts: list[Any]) -> Tensor | Packed:
    """Blocks' expert stacks as one: packed where every one is packed in one type, else float16."""
    from tinygrad.tensor import Tensor

    if all(isinstance(p, Packed) for p in parts) and len({p.ggml_type for p in parts}) == 1:
        raw = parts[0].raw if len(parts) == 1 else parts[0].raw.cat(*[p.raw for p in parts[1:]]).contiguous().realize()
        return Packed(raw, parts[0].ggml_type, (int(raw.shape[0]), *parts[0].shape[1:]))
    arrays = [p.values().cast("float16").numpy() if isinstance(p, Packed) else p for p in parts]
    return Tensor(np.concatenate(arrays)).contiguous().realize()


def _nbytes(t: Tensor | Packed) -> int:
    return t.nbytes if isinstance(t, Packed) else int(t.nbytes())


def all_experts(gguf_file: GGUFFile, lo: int, hi: int) -> dict[int, list[int]]:
    """Every routed expert of the MoE blocks in [lo, hi)."""
    cfg = gguf_file.config
    return {b: list(range(cfg.experts)) for b in range(lo, hi) if b in cfg.moe_blocks}


def routing_entropy(frequencies: list[float]) -> float:
    """How evenly a layer's tokens spread over its experts: the entropy of the normalised frequencies, in bits."""
    total = sum(frequencies)
    return -sum(f / total * math.log2(f / total) for f in frequencies if f > 0) if total else 0.0
