"""A stage's part in speculative decoding (``ppharness.run.stage.speculation`` says how a trip goes): stage 0 drafts the
windows that keep a request's flight full, once a trip's tokens are committed; the last stage verifies a window and
commits what it accepts. It reads and writes the stage's record only: the windows and tokens that arrive are taken by
the inbound side (``ppharness.run.stage.inbound``), what is committed is sent by the outbound side
(``ppharness.run.stage.outbound``), which holds the stage's ``Windows``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ppharness.run.stage.requests import Request, StageState, Work
from ppharness.run.stage.speculation import Window, accepted, current, next_windows

if TYPE_CHECKING:
    from ppharness.seams.transport import Received


class Windows:
    """Speculative windows on one stage (module docstring)."""

    def __init__(self, state: StageState):
        self.state = state
        # the last stage's count: windows verified, dropped as void (sent in flight behind one not accepted whole),
        # tokens drafted, drafts accepted and tokens committed
        self.trips = self.void = self.drafted = self.accepted = self.committed = 0

    # --- stage 0 ------------------------------------------------------------------------------------------------------

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
