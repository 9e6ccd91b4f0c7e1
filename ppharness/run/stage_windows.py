"""A stage's part in speculative decoding (``ppharness.run.speculation`` says how a trip goes): stage 0 takes the
committed tokens and drafts the next windows; a later stage takes a window's rows as one model call; the last stage
verifies a window and commits what it accepts."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ppharness.model.hidden import Hidden
from ppharness.run.speculation import Window, accepted, current, next_windows, rows_ok, runs
from ppharness.run.stage_requests import Request, StageState, Work
from ppharness.wire.messages import ActivationRows, NextToken

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from ppharness.run.stage_admission import Admission
    from ppharness.run.stage_outbound import Outbound
    from ppharness.seams.transport import Received


class Windows:
    """Speculative windows on one stage (module docstring)."""

    def __init__(self, state: StageState, out: Outbound, admission: Admission):
        self.state, self.out, self.admission = state, out, admission
        # the last stage's count: windows verified, dropped as void (sent in flight behind one not accepted whole),
        # tokens drafted, drafts accepted and tokens committed
        self.trips = self.void = self.drafted = self.accepted = self.committed = 0

    # --- stage 0 ------------------------------------------------------------------------------------------------------

    def take_tokens(self, req: Request, rows: list[NextToken], rx: Received | None) -> None:
        """Stage 0: the tokens the last stage committed for ``req`` (one trip's, in position order), taken; then the
        request advances (``advance``)."""
        s = self.state
        first = rows[0].position
        if first < req.next_position:
            return  # a copy of tokens taken before (its sender resent them)
        if first != req.next_position or any(r.position != first + i for i, r in enumerate(rows)):
            s.drop(
                f"stage 0: dropped tokens of {req.request_id} at positions {[r.position for r in rows][:8]}, "
                f"expected {req.next_position} onwards",
                "a position out of turn",
                s.exit_addr,
            )
            return
        if s.reliable:  # the token at q came round: every hop took each position before q
            self.out.outbox.settle_through("activation", req.request_id, first)
        req.context.extend(r.token_id for r in rows)
        req.tokens.extend(r.token_id for r in rows)
        req.next_position += len(rows)
        if any(r.done for r in rows):
            self.admission.close_down(req)
            return
        self.advance(req, first - 1, rx)

    def committed_here(self, req: Request, answered: int) -> None:
        """N = 1: the stage verified the window at ``answered`` (or ran the prefill) and emitted what it committed
        into ``req.tokens``; the draft's context takes them, and the request advances."""
        req.context.extend(req.tokens[len(req.context) - req.prompt_tokens :])
        self.advance(req, answered)

    def advance(self, req: Request, answered: int, rx: Received | None = None) -> None:
        """Stage 0, once a trip's tokens are committed: the window that answered (first position ``answered``) leaves
        the flight, and the windows behind it too where they do not continue what was committed (void: the last stage
        drops them); then new windows are drafted (``start``)."""
        if req.flight and req.flight[0].start == answered:
            req.flight.popleft()
        if req.flight and not current(req.flight[0].start, req.flight[0].tokens[0], req.tokens, req.prompt_tokens):
            req.flight.clear()
        self.start(req, rx)

    def start(self, req: Request, rx: Received | None = None) -> None:
        """Stage 0: draft and queue the windows that keep the request's flight full."""
        s = self.state
        spec = s.speculation
        assert spec is not None
        if not req.context:
            return
        if not req.speculate:  # greedy within a speculating run: one row per trip
            spec = dataclasses.replace(spec, windows=1, spec=dataclasses.replace(spec.spec, k=0))
        for start, tokens in next_windows(
            spec, req.context, req.flight, req.prompt_tokens, req.max_tokens, s.model.max_context, req.slot
        ):
            req.trip += 1
            req.flight.append(Window(req.trip, start, tokens))
            step = start - req.prompt_tokens + 1
            req.work.append(Work(req, start, list(tokens), False, step, rx, tokens=list(tokens), trip=req.trip))
            rx = None  # the receipt belongs to the first window's trace

    # --- later stages -------------------------------------------------------------------------------------------------

    def take_rows(self, msg: ActivationRows, rows: NDArray[np.float16], rx: Received | None) -> None:
        """A later stage: each request's rows of ``msg`` are its window, one model call; a copy of a window taken
        before (its trip) is skipped, a window that would skip positions this stage has not computed is dropped."""
        s = self.state
        why = rows_ok(msg.request_ids, msg.positions, msg.tokens, msg.trips)
        if why:
            s.drop(f"stage {s.index}: dropped ActivationRows: {why}", "rows not the plan's", s.prev_addr or "")
            return
        for a, b in runs(msg.request_ids):
            rid, start, trip = msg.request_ids[a], msg.positions[a], msg.trips[a]
            req = s.reqs.get(rid)
            if s.reliable and (rid in s.finished or (req is not None and trip <= req.trip)):
                continue  # a copy of a window this stage took
            if rid in s.finished:
                continue  # a window in flight when the request ended: nothing to do
            if req is None or msg.plan_id != s.plan_id:
                s.drop(
                    f"stage {s.index}: dropped the window of unknown request {rid[:64]!r} (plan {msg.plan_id[:64]})",
                    "an unknown request",
                    s.prev_addr or "",
                )
                continue
            end = start + b - a
            if end > s.model.max_context and s.out_of_turn(req, end - 1, "a window", s.prev_addr or "", ahead=False):
                continue
            if trip <= req.trip or not 1 <= start <= req.next_position:
                s.drop(
                    f"stage {s.index}: dropped the window of {rid} (trip {trip}) at positions {start}..{end - 1}: "
                    f"this stage took trip {req.trip} and computed up to {req.next_position - 1}",
                    "a position out of turn",
                    s.prev_addr or "",
                )
                continue
            req.trip, req.next_position = trip, end
            if s.reliable:  # the chain's progress, as a row at ``start`` stands for (``Inbound._on_activation``)
                if s.last:
                    self.out.outbox.settle_through("token", rid, start + 1)
                else:
                    self.out.outbox.settle_through("activation", rid, start)
            if s.tracer:
                s.tracer.begin(rid)
            step = start - req.prompt_tokens + 1
            tokens = list(msg.tokens[a:b])
            req.work.append(Work(req, start, Hidden(rows[a:b]), False, step, rx, tokens=tokens, trip=trip))

    # --- the last stage -----------------------------------------------------------------------------------------------

    def verify(self, work: Work, greedy: list[int]) -> list[int]:
        """The last stage: what a window commits (``accepted``), or nothing for a void window (one that does not
        continue what is committed: sent in flight behind a window not accepted whole)."""
        req = work.request
        assert work.tokens is not None
        if not current(work.position, work.tokens[0], req.tokens, req.prompt_tokens):
            self.void += 1
            return []
        out = accepted(work.tokens, greedy)
        self.trips += 1
        self.drafted += len(work.tokens) - 1
        self.accepted += len(out) - 1
        self.committed += len(out)
        for i, n in enumerate((1, len(work.tokens) - 1, len(out) - 1, int(len(out) < len(work.tokens)))):
            req.verified[i] += n
        req.window_drafts.append(len(work.tokens) - 1)
        req.window_accepted.append(len(out) - 1)
        return out
