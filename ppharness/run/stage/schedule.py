"""The scheduler of a stage: which model calls run next, and the model call itself.

Each request in flight keeps its model calls that are ready (``Work`` items, in position order); a step takes the next
one of each request that has one, oldest request first, at most ``max_batch`` of them (0: every ready one), so that a
request's calls run in order and several batches can travel the chain at once (``ready``).

The batch seam is ``execute(batch)``: a list of ``Work`` items, each (request, slot, position, input), and one output
per item. It plans the batch's model calls as data first (``calls``: a ``ModelCall`` each), then runs each in one
frame that records its trace (receipt, deserialisation, compute) and names the stage and the requests when the model
fails. A model that is not batched runs every item alone (``model.prefill``/``decode`` in the item's slot); a batched
model (``ppharness.model.layers.rows``) runs the prefills so, each speculative window in one call of its own
(``ppharness.run.stage.speculation``), and every other decode item in one call over the stacked rows, each row in its
own slot at its own position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from ppharness.errors import HarnessError, StageError
from ppharness.model.engine.hidden import Hidden
from ppharness.run.stage.requests import StageState, Work
from ppharness.trace.tracer import now_ns

if TYPE_CHECKING:
    from numpy.typing import NDArray
    from tinygrad.tensor import Tensor

Output = Hidden | int | list[int]  # a hidden state; on the last stage a token id, or a window's greedy tokens
Kind = Literal["prefill", "decode", "rows", "window"]


@dataclass(frozen=True)
class ModelCall:
    """One call of the stage's model, as data: ``kind`` says which (``prefill`` or ``decode`` of one item, ``rows``
    of several items' decodes, ``window``: a speculative window of one item), ``works`` the items it computes, and
    ``xs``, ``positions``, ``slots`` its arguments (one of each per item; a window's ``xs`` are its rows, at
    ``positions[0]`` onwards)."""

    kind: Kind
    works: list[Work]
    xs: list[Any]  # token ids or hidden states: a host array, or a device tensor a co-located stage left
    positions: list[int]
    slots: list[int]

    def subject(self) -> str:
        """What the call computes, as an error names it."""
        ids = [w.request.request_id for w in self.works]
        if self.kind == "rows":
            return f"requests {', '.join(ids)}"
        return f"the window of {ids[0]}" if self.kind == "window" else f"request {ids[0]}"


class Scheduler:
    """Picks a stage's next batch (``ready``) and runs the model for it (``execute``): outputs are ``Hidden`` handles
    (``ppharness.model.engine.hidden``), or on the last stage token ids."""

    def __init__(self, state: StageState):
        self.state = state

    def ready(self) -> list[Work]:
        """The next batch: each request's next model call, for the requests that have one, oldest request first (at
        most ``max_batch`` of them)."""
        s = self.state
        reqs = [req for req in s.reqs.values() if req.work]
        return [req.work.popleft() for req in (reqs[: s.max_batch] if s.max_batch else reqs)]

    def execute(self, batch: list[Work]) -> list[Output]:
        """The model for ``batch`` (the module docstring's seam): one output per item, in the batch's order."""
        out: dict[int, Output] = {}
        for call in self.calls(batch):
            out.update(zip((id(w) for w in call.works), self._run(call), strict=True))
        return [out[id(w)] for w in batch]

    def calls(self, batch: list[Work]) -> list[ModelCall]:
        """The model calls that compute ``batch``, in the order they run: every item alone on a model that is not
        batched; else the prefills, then each window, then every other decode item in one call of rows."""
        if not self.state.model.batched:
            return [self._alone(w) for w in batch]
        calls = [self._alone(w) for w in batch if w.is_prefill]
        calls += [self._window(w) for w in batch if w.tokens is not None]
        rows = [w for w in batch if not w.is_prefill and w.tokens is None]
        if rows:
            xs = [w.input if isinstance(w.input, list) else w.input.host() for w in rows]
            calls.append(ModelCall("rows", rows, xs, [w.position for w in rows], [w.request.slot for w in rows]))
        return calls

    @staticmethod
    def _alone(work: Work) -> ModelCall:
        """One item's prefill or decode. A decode's hidden state goes in as it is: a host array, or the device tensor a
        co-located stage left (``ppharness.model.engine.hidden``)."""
        given, slot = work.input, work.request.slot
        if work.is_prefill:
            return ModelCall("prefill", [work], [given if isinstance(given, list) else given.host()], [0], [slot])
        return ModelCall("decode", [work], [given if isinstance(given, list) else given.value], [work.position], [slot])

    @staticmethod
    def _window(work: Work) -> ModelCall:
        """A speculative window of one request: stage 0 embeds its tokens, a later stage takes the rows the stage
        before sent."""
        given = work.input
        if isinstance(given, list):
            xs: list[Any] = [[t] for t in given]
        else:
            rows = given.host()
            xs = [rows[r : r + 1] for r in range(rows.shape[0])]
        return ModelCall("window", [work], xs, [work.position], [work.request.slot])

    def _run(self, call: ModelCall) -> list[Output]:
        """Run one model call in the one frame every call has: its items' receipts traced, the expert fan-out keyed by
        its first item, a failure raised as the stage's StageError, the compute traced for each item."""
        s, works = self.state, call.works
        if s.tracer:
            for work in works:
                s.tracer.begin(work.request.request_id)
                s.trace_rx(work.step, work.rx)
            s.tracer.begin(works[0].request.request_id)
        t0 = now_ns() if s.tracer else 0
        begin = getattr(s.model, "begin_step", None)  # a model that fans out to expert nodes keys its messages
        if begin is not None:
            begin(works[0].request.request_id, works[0].step)
        try:
            outs = self._invoke(call)
        except HarnessError as exc:
            raise StageError(f"stage {s.index}: {exc}") from exc
        except Exception as exc:  # tinygrad raises plain exceptions; name the stage and the requests
            raise StageError(
                f"stage {s.index}: compute failed for {call.subject()}: {type(exc).__name__}: {exc}"
            ) from exc
        if call.kind in ("rows", "window"):
            s.batches.append(len(call.xs))
        if s.tracer:
            t1 = now_ns()
            for work in works:  # each request's trace holds the call
                s.tracer.begin(work.request.request_id)
                s.tracer.add(work.step, "compute", t0, t1)
        return self._outputs(call, outs)

    def _invoke(self, call: ModelCall) -> Sequence[NDArray[np.float16] | Tensor | int]:
        model = self.state.model
        if call.kind == "prefill":
            return [model.prefill(call.xs[0], call.slots[0])]
        if call.kind == "decode":
            return [model.decode(call.xs[0], call.positions[0], call.slots[0])]
        if call.kind == "rows":
            return model.decode_rows(call.xs, call.positions, call.slots)
        return model.decode_window(call.xs, call.positions[0], call.slots[0])

    def _outputs(self, call: ModelCall, outs: Sequence[NDArray[np.float16] | Tensor | int]) -> list[Output]:
        """The model's outputs as the stage hands them on: token ids on the last stage (a window's as one list), else
        ``Hidden`` handles (a window's rows as one)."""
        if call.kind == "window":
            if self.state.last:
                return [[int(cast(int, o)) for o in outs]]
            return [Hidden(np.concatenate([cast("NDArray[Any]", o) for o in outs]))]
        if self.state.last:
            return [int(cast(int, o)) for o in outs]
        return [Hidden(cast("NDArray[Any] | Tensor", o)) for o in outs]
