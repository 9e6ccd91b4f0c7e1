"""Faults a node injects into itself when its environment asks (``PP_FAULT``, set by a scenario's ``faults``): how the
failure-mode tests provoke a model that answers EOS at once or a worker that dies mid-decode."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np
    import numpy.typing as npt
    from tinygrad.tensor import Tensor

    from ppharness.model.engine.slicing import ModelSlice


class FaultyModel:
    """A model slice with an injected fault: ``eos-first`` answers EOS at once; ``exit-mid-decode`` dies (exit 3)
    at its third decode step, the way a crashed or OOM-killed worker would."""

    def __init__(self, model: ModelSlice, fault: str):
        self._model, self._fault, self._decodes = model, fault, 0

    def __getattr__(self, name: str) -> Any:  # everything else is the wrapped slice's, whatever its type
        return getattr(self._model, name)

    def prefill(self, x: list[int] | npt.NDArray[np.float16], slot: int = 0) -> npt.NDArray[np.float16] | int:
        out = self._model.prefill(x, slot)
        return self._model.config.eos_id if self._fault == "eos-first" and self._model.last else out

    def decode(
        self, x: list[int] | npt.NDArray[np.float16] | Tensor, position: int, slot: int = 0
    ) -> npt.NDArray[np.float16] | Tensor | int:
        self._decodes += 1
        if self._fault == "exit-mid-decode" and self._decodes == 3:
            print(f"[pp-node] fault exit-mid-decode: exiting at position {position}", file=sys.stderr, flush=True)
            os._exit(3)
        return self._model.decode(x, position, slot)

    @property
    def batched(self) -> bool:
        return self._model.batched

    def decode_rows(
        self, xs: Sequence[list[int] | npt.NDArray[np.float16]], positions: Sequence[int], slots: Sequence[int]
    ) -> list[npt.NDArray[np.float16] | int]:
        self._decodes += 1
        if self._fault == "exit-mid-decode" and self._decodes == 3:
            print(
                f"[pp-node] fault exit-mid-decode: exiting at positions {list(positions)}", file=sys.stderr, flush=True
            )
            os._exit(3)
        return self._model.decode_rows(xs, positions, slots)

    def decode_window(
        self, xs: Sequence[list[int] | npt.NDArray[np.float16]], start: int, slot: int
    ) -> list[npt.NDArray[np.float16] | int]:
        self._decodes += 1
        return self._model.decode_window(xs, start, slot)


def with_fault(model: ModelSlice, fault: str) -> ModelSlice | FaultyModel:
    """``model``, or ``model`` with the model-level fault ``fault`` (a node's ``PP_FAULT``) injected."""
    return FaultyModel(model, fault) if fault in ("eos-first", "exit-mid-decode") else model
