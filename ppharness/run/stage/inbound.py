"""The inbound side of a stage: what arrives is checked and recorded, nothing is computed here.

Every message is taken only from the member whose role sends it (requests from the seed, RequestOpen and activations
from the previous stage, NextToken from the last), by the sender address the transport authenticated, and only at the
stage's epoch; anything else is dropped with a log line, so no member can steer a stage it does not feed. An accepted
request, activation, NextToken or replay becomes a ``Work`` item, its request's next model call (the scheduler,
``ppharness.run.stage.schedule``, runs it); acknowledgements, refusals and duplicate drops happen here, at receipt.
A request's admission, open and close are ``ppharness.run.stage.admission``; the check of an activation against its
request is the record's (``StageState.accept_activation``); replays taken as a replacement,
``ppharness.run.stage.replay``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ppharness.errors import CodecError
from ppharness.model.engine.hidden import Hidden
from ppharness.run.stage.admission import Admission
from ppharness.run.stage.outbound import Outbound, rows_key
from ppharness.run.stage.replay import ReplayIntake
from ppharness.run.stage.requests import Request, StageState, Work
from ppharness.run.stage.speculation import rows_ok, runs
from ppharness.seams.transport import Received
from ppharness.trace.drops import fingerprinted
from ppharness.wire import codec
from ppharness.wire.messages import (
    Ack,
    ActivationRows,
    InferenceRequest,
    Message,
    NextToken,
    Replay,
    RequestClose,
    RequestOpen,
    Resume,
    StageActivation,
    TokenRows,
)

if TYPE_CHECKING:
    from numpy.typing import NDArray


class Inbound:
    """Receipt on a stage (module docstring): ``handle(sender, msg, rx)`` checks a message and records it."""

    def __init__(self, state: StageState, out: Outbound):
        self.state, self.out = state, out
        self.admission = Admission(state, out)
        self.replays = ReplayIntake(state, out, self.admission)
        self.windows = out.windows  # speculation: stage 0 drafts a trip's windows once its tokens are taken

    def handle(self, sender: str, msg: Message, rx: Received | None = None) -> None:
        """Check and record one message; protocol violations are dropped with a log line. ``rx``: the transport's
        receipt of the message (arrival and decoding times, size, a hidden state handed over in the process)."""
        s = self.state
        role = self._sender_role(msg)
        if role is not None and sender != role[1]:
            s.drop(
                f"stage {s.index}: dropped {type(msg).__name__} from {fingerprinted(sender)}: only {role[0]} sends it",
                f"{type(msg).__name__} not its role's",
                sender,
            )
            return
        if not self._epoch_ok(msg, sender):
            return
        match msg:
            case Ack():
                self.out.outbox.ack(sender, msg)
            case InferenceRequest() if s.first:
                self.admission.on_request(msg, rx)
            case RequestOpen() if not s.first:
                self.admission.on_open(msg)
            case RequestClose() if not s.first:
                self.admission.on_close(msg)
            case StageActivation() if not s.first:
                self._on_activation(msg, rx)
            case NextToken() if s.first and not s.last:
                self._on_next_token(msg, rx)
            case ActivationRows() if not s.first:
                self._on_activation_rows(msg, rx)
            case TokenRows() if s.first and not s.last:
                self._on_token_rows(msg, rx)
            case Replay() if not s.first and s.keeps_history:
                self.replays.on_replay(msg)
            case Resume() if s.first and s.keeps_history:
                self.replays.on_resume(msg)
            case _:
                s.drop(
                    f"stage {s.index}: dropped unexpected {type(msg).__name__} from {fingerprinted(sender)}",
                    f"unexpected {type(msg).__name__}",
                    sender,
                )
        if s.first and s.waiting:
            self.admission.admit_waiting()

    def _sender_role(self, msg: Message) -> tuple[str, str] | None:
        """(role, address) of the only member this stage takes ``msg`` from; None when any member may send it."""
        s = self.state
        match msg:
            case InferenceRequest() | Resume() if s.seed is not None:
                return "the orchestrator", s.seed
            case RequestOpen() | RequestClose() | StageActivation() | ActivationRows() | Replay() if (
                s.prev_addr is not None
            ):
                return f"stage {s.index - 1}", s.prev_addr
            case NextToken() | TokenRows():
                return f"stage {s.num_stages - 1}", s.exit_addr
        return None

    def _epoch_ok(self, msg: Message, sender: str) -> bool:
        """A message stamped with an older epoch comes from a node a spare replaced: refused. One from a newer
        epoch arrived before this stage's directory did: dropped unacknowledged, so it is sent again."""
        s = self.state
        epoch = getattr(msg, "epoch", None)
        if epoch is None or epoch == s.epoch:
            return True
        if epoch < s.epoch:
            s.drop(
                f"stage {s.index}: fenced off {type(msg).__name__} of epoch {epoch}, older than this stage's "
                f"{s.epoch} (a replaced node's, or sent before its sender learnt of the new epoch: it is resent)",
                "an old epoch",
                sender,
            )
        else:
            s.drop(
                f"stage {s.index}: held off {type(msg).__name__} of epoch {epoch} until its directory comes",
                "a newer epoch",
                sender,
            )
        return False

    def _on_activation(self, msg: StageActivation, rx: Received | None) -> None:
        s, out = self.state, self.out
        if s.reliable and msg.request_id in s.finished:
            out.ack(s.prev_addr, "activation", msg.request_id, msg.position)
            return
        req = self._current(msg.request_id, msg.plan_id, "StageActivation", s.prev_addr or "")
        if req is None:
            return
        if msg.position < req.next_position:
            out.ack(s.prev_addr, "activation", msg.request_id, msg.position)
            if not s.conflicting(req, msg.position, msg.hidden, "an activation", s.prev_addr or ""):
                line = f"stage {s.index}: dropped duplicate activation at position {msg.position}"
                s.drop(line, "a duplicate", s.prev_addr or "")
            return
        if s.tracer:
            s.tracer.begin(req.request_id)
        if s.accept_activation(msg, req, rx) is None:  # its request's next model call, when it fits
            return
        s.conflicting(req, msg.position, msg.hidden, "an activation", s.prev_addr or "")  # recorded: the first
        if msg.is_prefill:  # chunks of a prompt follow each other without a turn round the chain: acknowledged
            out.ack(s.prev_addr, "activation", msg.request_id, msg.position)
        elif s.reliable:  # a decode step at q: stage 0 took the token at q, every hop each position before q
            if s.last:
                out.outbox.settle_through("token", msg.request_id, msg.position + 1)
            else:
                out.outbox.settle_through("activation", msg.request_id, msg.position)

    def _on_next_token(self, msg: NextToken, rx: Received | None) -> None:
        s, out = self.state, self.out
        if s.reliable and msg.request_id in s.finished:
            out.ack(s.exit_addr, "token", msg.request_id, msg.position)
            return
        req = self._current(msg.request_id, msg.plan_id, "NextToken", s.exit_addr)
        if req is None:
            return
        step = msg.position - req.prompt_tokens + 1
        if msg.position < req.next_position:
            out.ack(s.exit_addr, "token", msg.request_id, msg.position)
            s.drop(f"stage 0: dropped duplicate NextToken at position {msg.position}", "a duplicate", s.exit_addr)
            return
        if s.out_of_turn(req, msg.position, "a token", s.exit_addr):
            return
        if s.speculation is not None:  # the prefill's token: the first window goes out
            if msg.done:
                out.ack(s.exit_addr, "token", msg.request_id, msg.position)
            self._take_tokens(req, [msg], rx)
            return
        if s.reliable:  # the token at q came round: every hop took each position before q
            out.outbox.settle_through("activation", msg.request_id, msg.position)
        if msg.done:  # no later activation will stand for this Ack at the last stage
            out.ack(s.exit_addr, "token", msg.request_id, msg.position)
            if s.tracer:
                s.tracer.begin(req.request_id)
                s.trace_rx(step, rx)
            self.admission.close_down(req)
            return
        req.next_position += 1
        req.work.append(Work(req, msg.position, [msg.token_id], is_prefill=False, step=step, rx=rx))

    def _on_activation_rows(self, msg: ActivationRows, rx: Received | None) -> None:
        """A batched step's activations: each row becomes its request's next model call, as a StageActivation at that
        position would (a row that does not fit its request is dropped with a log line, the others are taken)."""
        s = self.state
        n, dim = len(msg.request_ids), s.model.config.dim
        most = s.slots * (s.speculation.rows if s.speculation is not None else 1)
        if not 0 < n <= most or len(msg.positions) != n or tuple(msg.shape) != (n, 1, dim):
            s.drop(
                f"stage {s.index}: dropped ActivationRows of {n} row(s), {len(msg.positions)} position(s) and "
                f"shape {tuple(msg.shape)[:4]}: the plan expects at most {most} rows of (1, {dim})",
                "rows not the plan's",
                s.prev_addr or "",
            )
            return
        if (s.speculation is not None) != bool(msg.tokens):
            has, runs_ = ("with", "does not speculate") if msg.tokens else ("without", "speculates")
            s.drop(
                f"stage {s.index}: dropped ActivationRows {has} speculative windows: this run {runs_}",
                "rows not the plan's",
                s.prev_addr or "",
            )
            return
        try:
            rows = self._rows_of(msg, rx)
        except CodecError as exc:
            s.drop(f"stage {s.index}: dropped ActivationRows: {exc}", "a bad tensor", s.prev_addr or "")
            return
        if s.reliable:  # one Ack for the message: its rows are taken, or copies of rows taken before
            self.out.ack(s.prev_addr, *rows_key(msg))
        if s.speculation is not None:
            self._take_windows(msg, rows, rx)
            return
        width = len(msg.hidden) // n  # each row's bytes (none: handed over in the process)
        for r, (request_id, position) in enumerate(zip(msg.request_ids, msg.positions, strict=True)):
            taken = s.reqs.get(request_id)
            row = msg.hidden[r * width : (r + 1) * width]
            if taken is not None and 0 < position < taken.next_position:
                if s.conflicting(taken, position, row, "a row", s.prev_addr or ""):
                    continue
            if s.reliable and (request_id in s.finished or (taken is not None and 0 < position < taken.next_position)):
                continue  # a copy of a row this stage took (its sender resent the message)
            req = self._current(request_id, msg.plan_id, "a row of ActivationRows", s.prev_addr or "")
            if req is None:
                continue
            if s.out_of_turn(req, position, "a row", s.prev_addr or ""):
                continue
            if position != req.next_position or position < 1:
                s.drop(
                    f"stage {s.index}: dropped the row of {request_id} at position {position}, expected "
                    f"{req.next_position}",
                    "a position out of turn",
                    s.prev_addr or "",
                )
                continue
            if s.tracer:
                s.tracer.begin(request_id)
            s.conflicting(req, position, row, "a row", s.prev_addr or "")  # recorded: the first
            step = position - req.prompt_tokens + 1
            req.next_position = position + 1
            if (
                s.reliable
            ):  # the chain's progress, as a StageActivation at that position stands for (``_on_activation``)
                if s.last:
                    self.out.outbox.settle_through("token", request_id, position + 1)
                else:
                    self.out.outbox.settle_through("activation", request_id, position)
            req.work.append(Work(req, position, Hidden(rows[r : r + 1]), False, step, rx, True))

    @staticmethod
    def _rows_of(msg: ActivationRows, rx: Received | None) -> NDArray[Any]:
        """The rows' hidden states: handed over in the process (``rx.tensor``), else unpacked from the message."""
        if rx is not None and rx.tensor is not None:
            if rx.tensor.shape != tuple(msg.shape):
                raise CodecError(f"rows of shape {rx.tensor.shape} under a header of {tuple(msg.shape)}")
            return rx.tensor.host()
        return codec.unpack_tensor(msg.hidden, tuple(msg.shape), msg.dtype, "ActivationRows")

    def _on_token_rows(self, msg: TokenRows, rx: Received | None) -> None:
        """A batched step's tokens: each row is the NextToken of its request."""
        s = self.state
        n = len(msg.request_ids)
        most = s.slots * (s.speculation.rows if s.speculation is not None else 1)
        if not 0 < n <= most or not n == len(msg.token_ids) == len(msg.positions) == len(msg.done):
            s.drop(
                f"stage 0: dropped TokenRows of {n} row(s) with lists of other lengths (or over {most} rows)",
                "rows not the plan's",
                s.exit_addr,
            )
            return
        if s.reliable:  # one Ack for the message; each row is then taken as its NextToken (copies too)
            self.out.ack(s.exit_addr, *rows_key(msg))
        ones = [
            NextToken(request_id=r, token_id=t, position=p, done=d, plan_id=msg.plan_id, epoch=msg.epoch)
            for r, t, p, d in zip(msg.request_ids, msg.token_ids, msg.positions, msg.done, strict=True)
        ]
        if s.speculation is None:
            for one in ones:
                self._on_next_token(one, rx)
            return
        for a, b in runs(msg.request_ids):  # a request's tokens of one trip: taken together
            rid = msg.request_ids[a]
            if rid in s.finished:
                continue
            req = self._current(rid, msg.plan_id, "TokenRows", s.exit_addr)
            if req is not None:
                self._take_tokens(req, ones[a:b], rx)

    # --- speculative windows (``ppharness.run.stage.windows``) ------------------------------------------------------

    def _take_tokens(self, req: Request, rows: list[NextToken], rx: Received | None) -> None:
        """Stage 0: the tokens the last stage committed for ``req`` (one trip's, in position order), taken; then the
        request advances (``Windows.advance``)."""
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
        self.windows.advance(req, first - 1, rx)

    def _take_windows(self, msg: ActivationRows, rows: NDArray[Any], rx: Received | None) -> None:
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
            if s.reliable:  # the chain's progress, as a row at ``start`` stands for (``_on_activation``)
                if s.last:
                    self.out.outbox.settle_through("token", rid, start + 1)
                else:
                    self.out.outbox.settle_through("activation", rid, start)
            if s.tracer:
                s.tracer.begin(rid)
            step = start - req.prompt_tokens + 1
            tokens = list(msg.tokens[a:b])
            req.work.append(Work(req, start, Hidden(rows[a:b]), False, step, rx, tokens=tokens, trip=trip))

    def _current(self, request_id: str, plan_id: str, what: str, sender: str) -> Request | None:
        """The request in flight that a message is for; None (logged) for another plan's or an unknown request."""
        s = self.state
        if plan_id != s.plan_id:
            s.drop(
                f"stage {s.index}: dropped {what} of plan {plan_id[:64]}, this stage serves {s.plan_id}",
                "another plan",
                sender,
            )
            return None
        req = s.reqs.get(request_id)
        if req is None:
            s.drop(
                f"stage {s.index}: dropped {what} for unknown request {request_id[:64]!r}", "an unknown request", sender
            )
        return req
