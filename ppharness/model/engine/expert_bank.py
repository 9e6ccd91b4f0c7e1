"""A bank of routed expert FFNs read from a GGUF file (``ExpertBank``): the experts a node or a slice holds, each
block's stacked on one device, computed by ``ppharness.model.layers.moe.expert_ffn``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
from numpy.typing import NDArray

from ppharness.errors import ModelError
from ppharness.model.formats.packed import Packed
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.layers.kernels import pin_from_env
from ppharness.model.layers.moe import F16, expert_ffn

if TYPE_CHECKING:
    from tinygrad.device import Buffer
    from tinygrad.tensor import Tensor


class ExpertBank:
    """Routed expert FFNs of some (layer, expert) pairs, each block's held experts stacked on one tinygrad device (as
    the file packs them, or float16).

    One compiled step per block computes one row through ``width`` of its experts at once (the architecture's experts
    per token), their slots an input of the step read on the device (``expert_ffn``: the chosen experts' weights
    read by id); fewer experts pad with the first. Every bank of a model runs that same step, and each expert's output
    is computed by the same kernel code at any position of the step, so which node computes an expert, and beside
    which others, never changes its bytes. A slice holding every expert of a block runs the step inside its own
    decode step (``ModelSlice._moe_block``), with the slots the device routed to."""

    def __init__(self, gguf_file: GGUFFile, held: Mapping[int, Iterable[int]], weights: str = "packed"):
        from tinygrad.engine.jit import TinyJit

        pin_from_env()  # an expert node compiles its bank with the run's kernel table too
        cfg = gguf_file.config
        self.dim, self.ffn, self.width = cfg.dim, cfg.expert_ffn, max(1, cfg.experts_used)
        self.slots: dict[tuple[int, int], int] = {}  # (layer, expert) -> its index in the block's stack
        self._stacks: dict[int, tuple[Tensor | Packed, Tensor | Packed, Tensor | Packed]] = {}
        for layer in sorted(held):
            ids = sorted({int(e) for e in held[layer]})
            if not ids:
                continue
            if layer not in cfg.moe_blocks:
                raise ModelError(f"{gguf_file.path}: block {layer} has no experts")
            if ids[-1] >= cfg.experts or ids[0] < 0:
                raise ModelError(f"{gguf_file.path}: block {layer} has experts 0..{cfg.experts - 1}, not {ids}")
            names = [f"blk.{layer}.ffn_{k}_exps.weight" for k in ("gate", "up", "down")]
            gate, up, down = (_expert_stack(gguf_file, name, ids, weights) for name in names)
            self._stacks[layer] = (gate, up, down)
            for j, e in enumerate(ids):
                self.slots[(layer, e)] = j
        self.n = len(self.slots)
        self.n_params = self.n * 3 * self.dim * self.ffn
        self.weight_bytes = sum(_nbytes(t) for stack in self._stacks.values() for t in stack)
        self._jits = {layer: TinyJit(functools.partial(self.rows, layer)) for layer in self._stacks}
        self._in: Tensor | None = None
        self._slots_in: Tensor | None = None

    def rows(self, layer: int, x: Tensor, slots: Tensor) -> Tensor:
        """One row ``x`` (1, D) float16 through block ``layer``'s held experts at ``slots`` ((width,) int32):
        (width, D) float16."""
        return expert_ffn(*self._stacks[layer], x, slots)

    def whole(self, layer: int, experts: int) -> bool:
        """Whether the bank holds all ``experts`` of block ``layer``, expert e at slot e (what a fused step needs)."""
        return all(self.slots.get((layer, e)) == e for e in range(experts))

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

    def _row(self, layer: int, row: NDArray[np.float16], slots: list[int]) -> NDArray[np.float16]:
        """One row through up to ``width`` held experts of block ``layer`` (slots): (len(slots), D) fp16."""
        from tinygrad.tensor import Tensor

        arr = np.ascontiguousarray(row, dtype=F16).reshape(1, self.dim)
        padded = np.array(slots + [slots[0]] * (self.width - len(slots)), dtype=np.int32)
        if self._in is None or self._slots_in is None:
            self._in, self._slots_in = Tensor(arr).realize(), Tensor(padded).realize()
        else:
            cast("Buffer", self._in.uop.base.realized).copyin(arr.data.cast("B"))
            cast("Buffer", self._slots_in.uop.base.realized).copyin(padded.data.cast("B"))
        out = self._jits[layer](self._in, self._slots_in).numpy()
        return cast("NDArray[np.float16]", out[: len(slots)].copy())

    def run(self, layer: int, expert: int, row: NDArray[np.float16]) -> NDArray[np.float16]:
        """Expert ``expert`` of block ``layer`` on one row (D,) fp16 -> (D,) fp16."""
        out: NDArray[np.float16] = self._row(layer, row, [self._slot(layer, expert)])[0]
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
                out[chunk] = self._row(layer, hidden[row], [self._slot(layer, pairs[i][1]) for i in chunk])
        return out

    def answer(self, layer: int, hidden: NDArray[np.float16], experts: NDArray[np.int64]) -> NDArray[np.float16]:
        """Rows ``hidden`` (T, D) through each row's ``experts`` (T, j) -> (T, j, D) fp16."""
        t, j = experts.shape
        pairs = [(r, int(experts[r, c])) for r in range(t) for c in range(j)]
        return self.run_pairs(layer, hidden, pairs).reshape(t, j, self.dim)


def _expert_stack(gguf_file: GGUFFile, name: str, ids: list[int], weights: str) -> Tensor | Packed:
    """Experts ``ids`` of the stacked tensor ``name``: as the file packs them (``weights="packed"``, a packed type),
    else float16."""
    from tinygrad.tensor import Tensor

    packed = gguf_file.packed(name, rows=ids) if weights == "packed" else None
    return packed if packed is not None else Tensor(gguf_file.tensor(name, rows=ids)).contiguous().realize()


def _nbytes(t: Tensor | Packed) -> int:
    return t.nbytes if isinstance(t, Packed) else int(t.nbytes())


def all_experts(gguf_file: GGUFFile, lo: int, hi: int) -> dict[int, list[int]]:
    """Every routed expert of the MoE blocks in [lo, hi)."""
    cfg = gguf_file.config
    return {b: list(range(cfg.experts)) for b in range(lo, hi) if b in cfg.moe_blocks}
