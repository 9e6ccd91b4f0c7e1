"""The scheduler of a stage: which model calls run next, and the model call itself.

Each request in flight keeps its model calls that are ready (``Work`` items, in position order); a step takes the next
one of each request that has one, oldest request first, at most ``max_batch`` of them (0: every ready one), so that a
request's calls run in order and several batches can travel the chain at once. The batch seam is ``run(batch)``: a
list of ``Work`` items, each (request, slot, position, input), and one output per item. A model that is not batched
runs them one after the other (``model.prefill``/``decode`` in the item's slot); a batched model
(``ppharness.model.batch``) runs the prefills so and every decode item in one call over the stacked rows, each row in
its own slot at its own position. The trace of a call (its receipt, deserialisation and compute) is recorded here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ppharness.errors import HarnessError, StageError
from ppharness.model.hidden import Hidden
from ppharness.run.stage_requests import StageState, Work
from ppharness.trace.tracer import now_ns

if TYPE_CHECKING:
    from numpy.typing import NDArray
    from tinygrad.tensor import Tensor


class Scheduler:
    """Picks a stage's next batch (``ready``) and runs the model for it (``run``): outputs are ``Hidden`` handles
    (``ppharness.model.hidden``), or on the last stage token ids."""

    def __init__(self, state: StageState):
        self.state = state

    def ready(self) -> list[Work]:
        """The next batch: each request's next model call, for the requests that have one, oldest request first (at
        most ``max_batch`` of them)."""
        s = self.state
        reqs = [req for req in s.reqs.values() if req.work]
        return [req.work.popleft() for req in (reqs[: s.max_batch] if s.max_batch else reqs)]

    def run(self, batch: list[Work]) -> list[Hidden | int | list[int]]:
        """The model for ``batch`` (the module docstring's seam): one output per item, a hidden state or, on the last
        stage, the next token id. A batched model (``ppharness.model.batch``) runs every decode item in one call;
        prefills, and every item of a model that is not batched, run one at a time. A speculative window
        (``ppharness.run.speculation``) is one call of its own: its rows' hidden states, or on the last stage each
        row's greedy token."""
        if not self.state.model.batched:
            return [self.compute(work) for work in batch]
        rows = [w for w in batch if not w.is_prefill and w.tokens is None]
        out: dict[int, Hidden | int | list[int]] = {id(w): self.compute(w) for w in batch if w.is_prefill}
        out.update((id(w), self.compute_window(w)) for w in batch if w.tokens is not None)
        if rows:
            out.update(zip((id(w) for w in rows), self.compute_rows(rows), strict=True))
        return [out[id(w)] for w in batch]

    def compute_rows(self, rows: list[Work]) -> list[Hidden | int]:
        """Decode items of several requests in one model call, each row in its request's slot at its position."""
        s = self.state
        if s.tracer:
            for work in rows:
                s.tracer.begin(work.request.request_id)
                s.trace_rx(work.step, work.rx)
            s.tracer.begin(rows[0].request.request_id)
        t0 = now_ns()
        begin = getattr(s.model, "begin_step", None)  # the expert fan-out is keyed by the batch's first row
        if begin is not None:
            begin(rows[0].request.request_id, rows[0].step)
        xs = [w.input if isinstance(w.input, list) else w.input.host() for w in rows]
        try:
            outs = s.model.decode_rows(xs, [w.position for w in rows], [w.slot for w in rows])
        except HarnessError as exc:
            raise StageError(f"stage {s.index}: {exc}") from exc
        except Exception as exc:  # tinygrad raises plain exceptions; name the stage and the requests
            ids = ", ".join(w.request.request_id for w in rows)
            what = f"{type(exc).__name__}: {exc}"
            raise StageError(f"stage {s.index}: compute failed for requests {ids}: {what}") from exc
        t1 = now_ns()
        s.batches.append(len(rows))
        if s.tracer:
            for work in rows:  # each request's trace holds the batch's call
                s.tracer.begin(work.request.request_id)
                s.tracer.add(work.step, "compute", t0, t1)
        if s.last:
            return [int(cast(int, o)) for o in outs]
        return [Hidden(cast("NDArray[Any]", o)) for o in outs]

    def compute_window(self, work: Work) -> Hidden | list[int]:
        """A speculative window of one request in one call: stage 0 embeds its tokens, a later stage takes the rows
        the stage before sent."""
        s, req = self.state, work.request
        assert work.tokens is not None
        if s.tracer:
            s.tracer.begin(req.request_id)
            s.trace_rx(work.step, work.rx)
        t0 = now_ns()
        begin = getattr(s.model, "begin_step", None)
        if begin is not None:
            begin(req.request_id, work.step)
        given = work.input
        xs: list[list[int] | NDArray[np.float16]]
        if isinstance(given, list):
            xs = [[t] for t in given]
        else:
            rows = given.host()
            xs = [rows[r : r + 1] for r in range(rows.shape[0])]
        try:
            outs = s.model.decode_window(xs, work.position, work.slot)
        except HarnessError as exc:
            raise StageError(f"stage {s.index}: {exc}") from exc
        except Exception as exc:  # tinygrad raises plain exceptions; name the stage and the request
            what = f"{type(exc).__name__}: {exc}"
            raise StageError(f"stage {s.index}: compute failed for the window of {req.request_id}: {what}") from exc
        s.batches.append(len(xs))
        if s.tracer:
            s.tracer.add(work.step, "compute", t0, now_ns())
        if s.last:
            return [int(cast(int, o)) for o in outs]
        return Hidden(np.concatenate([cast("NDArray[Any]", o) for o in outs]))

    def compute(self, work: Work) -> Hidden | int:
        """One item alone: its prefill or its decode, in its request's slot."""
        s, req = self.state, work.request
        if s.tracer:
            s.tracer.begin(req.request_id)
            s.trace_rx(work.step, work.rx)
        t0 = now_ns() if s.tracer else 0
        begin = getattr(s.model, "begin_step", None)  # a model that fans out to expert nodes keys its messages
        if begin is not None:
            begin(req.request_id, work.step)
        given = work.input
        out: NDArray[np.float16] | Tensor | int
        try:
            if work.is_prefill:
                out = s.model.prefill(given if isinstance(given, list) else given.host(), work.slot)
            else:  # a hidden state the stage before left on the device goes in as it is (model.handoff)
                x = given if isinstance(given, list) else given.value if given.on_device else given.host()
                out = s.model.decode(x, work.position, work.slot)
        except HarnessError as exc:
            raise StageError(f"stage {s.index}: {exc}") from exc
        except Exception as exc:  # tinygrad raises plain exceptions; name the stage and the request
            raise StageError(
                f"stage {s.index}: compute failed for request {req.request_id}: {type(exc).__name__}: {exc}"
            ) from exc
        if s.tracer:
            s.tracer.add(work.step, "compute", t0, now_ns())
        if s.last:
            return int(cast(int, out))
        assert not isinstance(out, int)  # a stage before the last returns a hidden state
        return Hidden(out)
