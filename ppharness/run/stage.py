"""One Stage class for any N >= 1; its role (first / middle / last) follows from the index alone. This module is a
token's way through a stage, in the order it goes: receipt, the model call, the send.

The token's way::

    InferenceRequest -> stage 0 (tokenize, embed, blocks) -RequestOpen, StageActivation-> ... -> stage N-1 (blocks,
    norm, head, argmax) -NextToken-> stage 0 -> ... until EOS or max_tokens; stage N-1 -InferenceResponse-> reply_to.

A stage serves several requests at once, each in a request slot; how a request is admitted, opened and closed, and
what a stage records, is ``ppharness.run.stage_requests``. Messages that do not fit a stage's state (a stale plan, an
unknown request, a duplicate position) are logged and dropped, never fatal; a failure of the model itself raises
``StageError``.

Fault tolerance, by the run's policy:

- ``none``: each message is sent once; a lost one ends the run (the orchestrator's budget runs out).
- ``retry``: every hop is idempotent (``ppharness.run.reliable``): the receiver acknowledges each copy of a message and
  acts on the first; the sender resends until acknowledged. The last stage also streams each token to the client.
- ``failover``: besides, each stage keeps what it sent down the chain for the requests in progress, and replays it to
  a spare that replaces the next stage (``ppharness.run.stage_replay``). Messages from an older epoch (a replaced node
  that came back) are refused.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ppharness.errors import CodecError, HarnessError, StageError
from ppharness.model.decoding import finish_reason, stop_token, visible
from ppharness.model.exactness import record_digest
from ppharness.model.hidden import Hidden
from ppharness.run.reliable import Key, ack_of
from ppharness.run.stage_replay import ReplayingStage
from ppharness.run.stage_requests import Request, Work
from ppharness.seams.transport import Received
from ppharness.trace.tracer import KEEP_REQUESTS, now_ns
from ppharness.wire import codec
from ppharness.wire.messages import (
    Ack,
    ActivationRows,
    InferenceRequest,
    InferenceResponse,
    Message,
    NextToken,
    Replay,
    RequestClose,
    RequestOpen,
    Resume,
    StageActivation,
    StreamedToken,
    TokenRows,
)

if TYPE_CHECKING:
    from numpy.typing import NDArray


class Stage(ReplayingStage):
    """Stage ``index`` of ``num_stages``, computing with ``model`` (a ModelSlice) and talking over ``transport``
    (the constructor's arguments: ``ppharness.run.stage_requests.StageState``).

    Receipt records, a step computes. ``handle(sender, msg, rx)`` only checks and records: it acknowledges, refuses
    and drops duplicates at once, and an accepted request, activation, NextToken or replay becomes a ``Work`` item,
    its request's next model call. ``step()`` then takes the calls that are ready, at most one per request (its next
    position, so a request's calls run in order), runs the model once for all of them and hands every output on.
    A loop (``ppharness.run.loop``) holds a stage as a worker (``step``) and a timer (``due_in``/``tick``: the
    outbox's resends); whoever drives a stage by hand calls ``deliver``, which is ``handle`` and then every step.

    The batch seam is ``_run(batch)``: a list of ``Work`` items, each (request, slot, position, input), and one output
    per item. A model that is not batched runs them one after the other (``model.prefill``/``decode`` in the item's
    slot); a batched model (``ppharness.model.batch``) runs the prefills so and every decode item in one call over the
    stacked rows, each row in its own slot at its own position, and ``_settle_rows`` sends the rows on in one
    ActivationRows (the last stage: one TokenRows) unless every message must be acknowledged on its own (policies
    retry and failover). Outputs are ``Hidden`` handles (``ppharness.model.hidden``): the codec packs them, the
    exactness digest is taken only when the stage keeps digests.

    Every message is taken only from the member whose role sends it (requests from the seed, RequestOpen and
    activations from the previous stage, NextToken from the last), by the sender address the transport authenticated;
    anything else is dropped with a log line, so no member can steer a stage it does not feed.
    """

    # --- receipt ----------------------------------------------------------------------------------------------------

    def handle(self, sender: str, msg: Message, rx: Received | None = None) -> None:
        """Check and record one message; nothing is computed here (``step``). Protocol violations are dropped with a
        log line.

        ``rx``: the transport's receipt of the message (arrival and decoding times, size), for the trace.
        """
        role = self._sender_role(msg)
        if role is not None and sender != role[1]:
            self.log(f"stage {self.index}: dropped {type(msg).__name__} from {sender}: only {role[0]} sends it")
            return
        if not self._epoch_ok(msg):
            return
        match msg:
            case Ack():
                self.outbox.ack(sender, msg)
            case InferenceRequest() if self.first:
                self._on_request(msg, rx)
            case RequestOpen() if not self.first:
                self._on_open(msg)
            case RequestClose() if not self.first:
                self._on_close(msg)
            case StageActivation() if not self.first:
                self._on_activation(msg, rx)
            case NextToken() if self.first and not self.last:
                self._on_next_token(msg, rx)
            case ActivationRows() if not self.first and not self.reliable:
                self._on_activation_rows(msg, rx)
            case TokenRows() if self.first and not self.last and not self.reliable:
                self._on_token_rows(msg, rx)
            case Replay() if not self.first and self.keeps_history:
                self._on_replay(msg)
            case Resume() if self.first and self.keeps_history:
                self._on_resume(msg)
            case _:
                self.log(f"stage {self.index}: dropped unexpected {type(msg).__name__} from {sender}")
        if self.first and self.waiting:
            self._admit_waiting()

    def deliver(self, sender: str, msg: Message, rx: Received | None = None) -> None:
        """``handle`` a message, then run every step it made ready (for a driver without a loop)."""
        self.handle(sender, msg, rx)
        while self.step():
            pass

    def _sender_role(self, msg: Message) -> tuple[str, str] | None:
        """(role, address) of the only member this stage takes ``msg`` from; None when any member may send it."""
        match msg:
            case InferenceRequest() | Resume() if self.seed is not None:
                return "the orchestrator", self.seed
            case RequestOpen() | RequestClose() | StageActivation() | ActivationRows() | Replay() if (
                self.prev_addr is not None
            ):
                return f"stage {self.index - 1}", self.prev_addr
            case NextToken() | TokenRows():
                return f"stage {self.num_stages - 1}", self.exit_addr
        return None

    def _epoch_ok(self, msg: Message) -> bool:
        """A message stamped with an older epoch comes from a node a spare replaced: refused. One from a newer
        epoch arrived before this stage's directory did: dropped unacknowledged, so it is sent again."""
        epoch = getattr(msg, "epoch", None)
        if epoch is None or epoch == self.epoch:
            return True
        if epoch < self.epoch:
            self.log(
                f"stage {self.index}: fenced off {type(msg).__name__} of epoch {epoch}, older than this stage's "
                f"{self.epoch} (a replaced node's, or sent before its sender learnt of the new epoch: it is resent)"
            )
        else:
            self.log(f"stage {self.index}: held off {type(msg).__name__} of epoch {epoch} until its directory comes")
        return False

    def _on_activation(self, msg: StageActivation, rx: Received | None) -> None:
        if self.reliable and msg.request_id in self.finished:
            self._ack(self.prev_addr, "activation", msg.request_id, msg.position)
            return
        req = self._current(msg.request_id, msg.plan_id, "StageActivation")
        if req is None:
            return
        if msg.position < req.next_position:
            self._ack(self.prev_addr, "activation", msg.request_id, msg.position)
            self.log(f"stage {self.index}: dropped duplicate activation at position {msg.position}")
            return
        if self.tracer:
            self.tracer.begin(req.request_id)
        hidden = self._check_activation(msg, req, rx)
        if hidden is None:
            return
        if msg.is_prefill:  # chunks of a prompt follow each other without a turn round the chain: acknowledged
            self._ack(self.prev_addr, "activation", msg.request_id, msg.position)
        elif self.reliable:  # a decode step at q: stage 0 took the token at q, every hop each position before q
            if self.last:
                self.outbox.settle_through("token", msg.request_id, msg.position + 1)
            else:
                self.outbox.settle_through("activation", msg.request_id, msg.position)
        self._take_activation(msg, hidden, req, rx, live=True)

    def _on_next_token(self, msg: NextToken, rx: Received | None) -> None:
        if self.reliable and msg.request_id in self.finished:
            self._ack(self.exit_addr, "token", msg.request_id, msg.position)
            return
        req = self._current(msg.request_id, msg.plan_id, "NextToken")
        if req is None:
            return
        step = msg.position - req.prompt_tokens + 1
        if msg.position < req.next_position:
            self._ack(self.exit_addr, "token", msg.request_id, msg.position)
            self.log(f"stage 0: dropped duplicate NextToken at position {msg.position}")
            return
        if msg.position != req.next_position:
            self.log(f"stage 0: dropped NextToken at position {msg.position}, expected {req.next_position}")
            return
        if self.reliable:  # the token at q came round: every hop took each position before q
            self.outbox.settle_through("activation", msg.request_id, msg.position)
        if msg.done:  # no later activation will stand for this Ack at the last stage
            self._ack(self.exit_addr, "token", msg.request_id, msg.position)
            if self.tracer:
                self.tracer.begin(req.request_id)
                self._trace_rx(step, rx)
            self._finish(req.request_id)
            if self.next_is_middle:  # the middle stages free the request's slot too
                close = RequestClose(request_id=req.request_id, plan_id=self.plan_id, epoch=self.epoch)
                self._send(("close", req.request_id, -1), "next", close)
            return
        req.next_position += 1
        req.work.append(Work(req, msg.position, [msg.token_id], is_prefill=False, step=step, rx=rx))

    def _on_activation_rows(self, msg: ActivationRows, rx: Received | None) -> None:
        """A batched step's activations: each row becomes its request's next model call, as a StageActivation at that
        position would (a row that does not fit its request is dropped with a log line, the others are taken)."""
        n, dim = len(msg.request_ids), self.model.config.dim
        if not 0 < n <= self.slots or len(msg.positions) != n or tuple(msg.shape) != (n, 1, dim):
            self.log(
                f"stage {self.index}: dropped ActivationRows of {n} request(s), {len(msg.positions)} position(s) and "
                f"shape {tuple(msg.shape)}: the plan expects at most {self.slots} rows of (1, {dim})"
            )
            return
        try:
            rows = self._rows_of(msg, rx)
        except CodecError as exc:
            self.log(f"stage {self.index}: dropped ActivationRows: {exc}")
            return
        for r, (request_id, position) in enumerate(zip(msg.request_ids, msg.positions, strict=True)):
            req = self._current(request_id, msg.plan_id, "a row of ActivationRows")
            if req is None:
                continue
            if position != req.next_position or position < 1:
                self.log(
                    f"stage {self.index}: dropped the row of {request_id} at position {position}, expected "
                    f"{req.next_position}"
                )
                continue
            if self.tracer:
                self.tracer.begin(request_id)
            step = position - req.prompt_tokens + 1
            req.next_position = position + 1
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
        n = len(msg.request_ids)
        if not 0 < n <= self.slots or not n == len(msg.token_ids) == len(msg.positions) == len(msg.done):
            self.log(f"stage 0: dropped TokenRows of {n} request(s) with lists of other lengths (or over the slots)")
            return
        for request_id, token, position, done in zip(msg.request_ids, msg.token_ids, msg.positions, msg.done):
            one = NextToken(
                request_id=request_id,
                token_id=token,
                position=position,
                done=done,
                plan_id=msg.plan_id,
                epoch=msg.epoch,
            )
            self._on_next_token(one, rx)

    def _current(self, request_id: str, plan_id: str, what: str) -> Request | None:
        if plan_id != self.plan_id:
            self.log(f"stage {self.index}: dropped {what} of plan {plan_id}, this stage serves {self.plan_id}")
            return None
        req = self.reqs.get(request_id)
        if req is None:
            self.log(f"stage {self.index}: dropped {what} for unknown request {request_id!r}")
        return req

    def _check_activation(self, msg: StageActivation, req: Request, rx: Received | None = None) -> Hidden | None:
        """The activation's hidden state (handed over in the process: ``rx.tensor``; else unpacked from the message),
        when it is the one this stage expects next and holds the request's rows for its positions; else None
        (logged)."""
        if msg.position != req.next_position or msg.is_prefill != (msg.position == 0):
            self.log(
                f"stage {self.index}: dropped activation at position {msg.position} (prefill={msg.is_prefill}), "
                f"expected position {req.next_position}"
            )
            return None
        want = (req.rows, req.prompt_tokens if msg.is_prefill else 1, self.model.config.dim)
        if msg.seq_len != want[1] or tuple(msg.shape) != want:
            self.log(
                f"stage {self.index}: dropped activation of shape {tuple(msg.shape)} (seq_len {msg.seq_len}) at "
                f"position {msg.position}: the plan expects {want}"
            )
            return None
        t0 = now_ns() if self.tracer else 0
        try:
            hidden = rx.tensor if rx is not None and rx.tensor is not None else Hidden(codec.unpack_hidden(msg))
        except CodecError as exc:
            self.log(f"stage {self.index}: dropped activation: {exc}")
            return None
        if self.tracer:
            self.tracer.add(self._step(msg, req), "deserialize", t0, now_ns())
        if hidden.shape != want:
            self.log(f"stage {self.index}: dropped activation of shape {hidden.shape}, expected {want}")
            return None
        return hidden

    @staticmethod
    def _step(msg: StageActivation, req: Request) -> int:
        return 0 if msg.is_prefill else msg.position - req.prompt_tokens + 1

    def _take_activation(
        self, msg: StageActivation, hidden: Hidden, req: Request, rx: Received | None, live: bool
    ) -> Work:
        """An accepted activation becomes its request's next model call; the position after it is expected next."""
        req.next_position = msg.position + msg.seq_len
        work = Work(req, msg.position, hidden, msg.is_prefill, self._step(msg, req), rx, live)
        req.work.append(work)
        return work

    # --- schedule and run -------------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Run the ready model calls (one per request) as one batch and hand each output on; False when none was
        ready. With N = 1 the stage is the whole chain: it generates here, one batch per position, until its
        requests are answered."""
        batch = self._ready()
        if not batch:
            return False
        while batch:
            outs = self._run(batch)
            if self.model.batched and not self.reliable and not (self.first and self.last):
                self._settle_rows(batch, outs)
            else:
                for work, out in zip(batch, outs, strict=True):
                    self._settle(work, out)
            batch = self._ready() if self.first and self.last else []
        if self.first and self.waiting:
            self._admit_waiting()
        return True

    def _ready(self) -> list[Work]:
        """The next batch: each request's next model call, for the requests that have one, oldest request first (at
        most ``max_batch`` of them)."""
        reqs = [req for req in self.reqs.values() if req.work]
        return [req.work.popleft() for req in (reqs[: self.max_batch] if self.max_batch else reqs)]

    def _run(self, batch: list[Work]) -> list[Hidden | int]:
        """The model for ``batch`` (the class docstring's seam): one output per item, a hidden state or, on the last
        stage, the next token id. A batched model (``ppharness.model.batch``) runs every decode item in one call;
        prefills, and every item of a model that is not batched, run one at a time."""
        if not self.model.batched:
            return [self._compute(work) for work in batch]
        rows = [w for w in batch if not w.is_prefill]
        out: dict[int, Hidden | int] = {id(w): self._compute(w) for w in batch if w.is_prefill}
        if rows:
            out.update(zip((id(w) for w in rows), self._compute_rows(rows), strict=True))
        return [out[id(w)] for w in batch]

    def _compute_rows(self, rows: list[Work]) -> list[Hidden | int]:
        """Decode items of several requests in one model call, each row in its request's slot at its position."""
        if self.tracer:
            for work in rows:
                self.tracer.begin(work.request.request_id)
                self._trace_rx(work.step, work.rx)
            self.tracer.begin(rows[0].request.request_id)
        t0 = now_ns()
        begin = getattr(self.model, "begin_step", None)  # the expert fan-out is keyed by the batch's first row
        if begin is not None:
            begin(rows[0].request.request_id, rows[0].step)
        xs = [w.input if isinstance(w.input, list) else w.input.host() for w in rows]
        try:
            outs = self.model.decode_rows(xs, [w.position for w in rows], [w.slot for w in rows])
        except HarnessError as exc:
            raise StageError(f"stage {self.index}: {exc}") from exc
        except Exception as exc:  # tinygrad raises plain exceptions; name the stage and the requests
            ids = ", ".join(w.request.request_id for w in rows)
            what = f"{type(exc).__name__}: {exc}"
            raise StageError(f"stage {self.index}: compute failed for requests {ids}: {what}") from exc
        t1 = now_ns()
        self.batches.append(len(rows))
        if self.tracer:
            for work in rows:  # each request's trace holds the batch's call
                self.tracer.begin(work.request.request_id)
                self.tracer.add(work.step, "compute", t0, t1)
        if self.last:
            return [int(cast(int, o)) for o in outs]
        return [Hidden(cast("NDArray[Any]", o)) for o in outs]

    def _compute(self, work: Work) -> Hidden | int:
        req = work.request
        if self.tracer:
            self.tracer.begin(req.request_id)
            self._trace_rx(work.step, work.rx)
        t0 = now_ns() if self.tracer else 0
        begin = getattr(self.model, "begin_step", None)  # a model that fans out to expert nodes keys its messages
        if begin is not None:
            begin(req.request_id, work.step)
        x = work.input if isinstance(work.input, list) else work.input.host()
        try:
            if work.is_prefill:
                out = self.model.prefill(x, work.slot)
            else:
                out = self.model.decode(x, work.position, work.slot)
        except HarnessError as exc:
            raise StageError(f"stage {self.index}: {exc}") from exc
        except Exception as exc:  # tinygrad raises plain exceptions; name the stage and the request
            raise StageError(
                f"stage {self.index}: compute failed for request {req.request_id}: {type(exc).__name__}: {exc}"
            ) from exc
        if self.tracer:
            self.tracer.add(work.step, "compute", t0, now_ns())
        if self.last:
            return int(out)
        assert not isinstance(out, int)  # a stage before the last returns a hidden state
        return Hidden(out)

    def _trace_rx(self, step: int, rx: Received | None) -> None:
        if self.tracer and rx is not None:
            self.tracer.add(step, "recv", rx.arrived_ns, rx.arrived_ns, rx.nbytes)
            self.tracer.add(step, "deserialize", rx.arrived_ns, rx.decoded_ns)

    def _settle(self, work: Work, out: Hidden | int) -> None:
        """Hand one output on: the last stage emits its token (N = 1: the token is the request's next input), the
        others send the hidden state down the chain; a replayed position's output is only recorded."""
        req = work.request
        if isinstance(out, Hidden):
            self._send_activation(req, out, work.position, work.is_prefill, work.step, work.live)
            if work.cascade:
                self._cascade(req)
        else:
            position = req.prompt_tokens if work.is_prefill else work.position + 1  # where the token goes
            if work.live:
                self._emit(req, out, position, work.step)
            else:
                req.tokens.append(out)
                req.token_times.append(time.monotonic() - req.t0)
            if self.first and req.request_id in self.reqs:
                req.work.append(Work(req, position, [out], is_prefill=False, step=len(req.tokens)))
        if work.note:
            self.log(f"{work.note} in {time.monotonic() - work.since:.2f} s")

    def _settle_rows(self, batch: list[Work], outs: list[Hidden | int]) -> None:
        """A batched step's outputs: the live decode rows go on in one message (ActivationRows down the chain, or
        from the last stage TokenRows to stage 0); the rest as ``_settle`` hands them on."""
        rows = [(w, o) for w, o in zip(batch, outs, strict=True) if w.live and not w.is_prefill]
        for work, out in zip(batch, outs, strict=True):
            if not (work.live and not work.is_prefill):
                self._settle(work, out)
        if not rows:
            return
        t0 = now_ns() if self.tracer else 0
        if self.last:
            tokens: list[NextToken] = []
            for work, out in rows:
                self._emit(work.request, int(cast(int, out)), work.position + 1, work.step, tokens)
            if tokens:
                msg: Message = TokenRows(
                    request_ids=[t.request_id for t in tokens],
                    token_ids=[t.token_id for t in tokens],
                    positions=[t.position for t in tokens],
                    done=[t.done for t in tokens],
                    plan_id=self.plan_id,
                    epoch=self.epoch,
                )
                self._send_rows(msg, "entry", [w for w, _ in rows], t0)
            return
        hidden = [cast(Hidden, o) for _, o in rows]
        if self.keeps_digests:
            for (work, _), h in zip(rows, hidden, strict=True):
                record_digest(self.digests, work.request.request_id, h, KEEP_REQUESTS)
        stacked = Hidden(np.concatenate([h.host() for h in hidden]))
        msg = ActivationRows(
            request_ids=[w.request.request_id for w, _ in rows],
            positions=[w.position for w, _ in rows],
            hidden=b"",  # packed where it leaves the process
            shape=stacked.shape,
            dtype=self.wire_dtype,
            plan_id=self.plan_id,
            epoch=self.epoch,
        )
        self._send_rows(msg, "next", [w for w, _ in rows], t0, stacked)

    def _send_rows(self, msg: Message, role: str, works: list[Work], t0: int, tensor: Hidden | None = None) -> None:
        """Send a batched step's message (policy none: once; ``tensor``: the rows' hidden states beside it); each
        row's trace holds its serialisation and send."""
        address = self._address_of(role)
        assert address is not None
        sent = self.transport.send(address, msg, tensor)
        if self.tracer and sent is not None:
            for work in works:
                self.tracer.begin(work.request.request_id)
                self.tracer.add(work.step, "serialize", t0, sent.encode_end_ns)
                self.tracer.add(work.step, "send", sent.encode_end_ns, sent.sent_ns, sent.nbytes)

    # --- what goes on -----------------------------------------------------------------------------------------------

    def _send_activation(
        self, req: Request, hidden: Hidden, position: int, is_prefill: bool, step: int, live: bool = True
    ) -> None:
        """Send the hidden state on (``live``), or only record it as sent (a replay: it went round already)."""
        t0 = now_ns() if self.tracer else 0
        if self.keeps_digests:
            record_digest(self.digests, req.request_id, hidden, KEEP_REQUESTS)
        msg = codec.header(
            hidden,
            self.wire_dtype,
            request_id=req.request_id,
            position=position,
            is_prefill=is_prefill,
            plan_id=self.plan_id,
            epoch=self.epoch,
        )
        if self.keeps_history:  # kept packed: a replay may go to a spare in another process
            req.sent.append(cast(StageActivation, codec.attach(msg, hidden)))
        if live:
            self._send(("activation", req.request_id, position), "next", msg, step, t0, hidden)

    def _emit(self, req: Request, token: int, position: int, step: int, rows: list[NextToken] | None = None) -> None:
        """Record a sampled token; tell stage 0 (``rows``: kept there for one TokenRows instead) and the client
        (and, when done, send the response)."""
        req.tokens.append(token)
        req.token_times.append(time.monotonic() - req.t0)
        reason = finish_reason(req.tokens, self.model.config.eog_ids, req.max_tokens)
        done = reason is not None
        if not self.first:
            msg = NextToken(
                request_id=req.request_id,
                token_id=token,
                position=position,
                done=done,
                plan_id=self.plan_id,
                epoch=self.epoch,
            )
            if rows is not None:
                rows.append(msg)
            else:
                self._send(("token", req.request_id, position), "entry", msg, step, now_ns())
        if self.reliable or req.stream:
            streamed = StreamedToken(
                request_id=req.request_id,
                token_id=token,
                position=position,
                done=done,
                plan_id=self.plan_id,
                first=req.prompt_tokens,
            )
            self._send(("stream", req.request_id, position), "client:" + req.reply_to, streamed)
        if reason is not None:
            self._respond(req, reason)

    def _respond(self, req: Request, reason: str) -> None:
        eog_ids = self.model.config.eog_ids
        ids, stop = visible(req.tokens, eog_ids), stop_token(req.tokens, eog_ids)
        assert self.tokenizer is not None  # the constructor insists on it for the last stage
        response = InferenceResponse(
            request_id=req.request_id,
            text=self.tokenizer.decode(ids),
            token_ids=ids,
            prompt_tokens=req.prompt_tokens,
            token_times=req.token_times,
            finish_reason=reason,
            stop_token_id=stop,
            stop_token=self.tokenizer.decode([stop]) if stop is not None else "",
        )
        self._send(("response", req.request_id, -1), "client:" + req.reply_to, response)
        self._finish(req.request_id)

    # --- the sends --------------------------------------------------------------------------------------------------

    def _address_of(self, role: str) -> str | None:
        """A target role's address now: ``next`` (the next stage), ``entry`` (stage 0) or ``client:<address>`` (the
        orchestrator that asked); resolved at each send, so that what waits for a replaced node goes to its
        replacement."""
        match role:
            case "next":
                return self.next_addr
            case "entry":
                return self.entry_addr
        return role.removeprefix("client:")

    def _send(
        self, key: Key, role: str, msg: Message, step: int | None = None, t0: int = 0, tensor: Hidden | None = None
    ) -> None:
        """Send a message that must arrive: through the outbox (resent until ``key`` is acknowledged, so kept packed)
        unless the policy is none; ``tensor``: the hidden state beside an activation's header, packed only where it
        leaves the process (``ppharness.seams.transport``). With a trace ``step``, record its serialisation (from
        ``t0``: packing the hidden state counts) and the send call."""
        if self.reliable:
            sent = self.outbox.put(key, role, msg if tensor is None else codec.attach(msg, tensor))
        else:
            address = self._address_of(role)
            assert address is not None
            sent = self.transport.send(address, msg, tensor)
        if self.tracer and step is not None and sent is not None:
            self.tracer.add(step, "serialize", t0, sent.encode_end_ns)
            self.tracer.add(step, "send", sent.encode_end_ns, sent.sent_ns, sent.nbytes)

    def _ack(self, to: str | None, kind: str, request_id: str, position: int) -> None:
        """Acknowledge a copy of a message (policies retry and failover): its sender stops resending it."""
        if self.reliable and to is not None:
            try:
                self.transport.send(to, ack_of(kind, request_id, position, self.plan_id))
            except HarnessError as exc:  # the sender resends; its next copy is acknowledged again
                self.log(f"stage {self.index}: acknowledging {kind} {position} failed: {exc}")
