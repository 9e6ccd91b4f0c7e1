"""The outbound side of a stage: everything it sends goes by one path here. A step's outputs are handed on (a hidden
state down the chain, a token back to stage 0 and to the client, the response when a request is done), a message that
must arrive goes through the outbox (``ppharness.run.reliable``: resent until acknowledged) unless the policy is none,
the copies received are acknowledged, and under policy failover what was sent down the chain is replayed to a spare
that replaced the next stage (``ppharness.run.stage.replay`` says how a replay goes).

An activation's header is built here (``codec.header``) and its hidden state travels beside it (``tensor=``), packed
only where it leaves the process (``ppharness.seams.transport``); the outbox keeps it packed, since what it resends may
go to a spare in another process.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import cast

import msgspec
import numpy as np

from ppharness.errors import HarnessError, StageError
from ppharness.model.decode.rules import finish_reason, stop_token, visible
from ppharness.model.engine.hidden import Hidden, digest
from ppharness.run.reliable import Key, Outbox, RetryPolicy, ack_of
from ppharness.run.stage.requests import Request, StageState, Work
from ppharness.run.stage.windows import Windows
from ppharness.trace.tracer import KEEP_REQUESTS, now_ns
from ppharness.wire import codec
from ppharness.wire.messages import (
    ActivationRows,
    InferenceResponse,
    Message,
    NextToken,
    Replay,
    RequestClose,
    RequestOpen,
    StageActivation,
    StreamedToken,
    TokenRows,
)


def rows_key(msg: ActivationRows | TokenRows) -> Key:
    """The outbox's key of a batched step's message (policies retry and failover): its first row's request and
    position, and how many rows; acknowledged as one."""
    kind = "rows" if isinstance(msg, ActivationRows) else "token-rows"
    return kind, f"{msg.request_ids[0]}@{msg.positions[0]}", len(msg.request_ids)


class Outbound:
    """What a stage sends, and how: ``send`` (the one path, through the outbox under a reliable policy), ``tell``
    (once, never resent: refusals), ``ack``; ``hand_on`` a step's outputs; ``rejoin`` a newer directory (and replay to
    a replacement of the next stage). ``due_in``/``tick`` are the outbox's timer."""

    def __init__(self, state: StageState, retry: RetryPolicy):
        self.state = state
        self.outbox = Outbox(state.transport.send, self.address_of, retry, stamp=self.stamp)
        self.windows = Windows(state)  # the speculative windows: stage 0 drafts them, the last stage verifies them

    # --- the directory and the loop's timer ---------------------------------------------------------------------------

    def address_of(self, role: str) -> str | None:
        """A target role's address now: ``next`` (the next stage), ``entry`` (stage 0) or ``client:<address>`` (the
        orchestrator that asked); resolved at each send, so that what waits for a replaced node goes to its
        replacement."""
        match role:
            case "next":
                return self.state.next_addr
            case "entry":
                return self.state.entry_addr
        return role.removeprefix("client:")

    def stamp(self, msg: Message) -> Message:
        """A message about to be sent again carries the stage's epoch now (the directory may have moved on)."""
        if isinstance(msg, StageActivation | NextToken | RequestOpen | RequestClose | ActivationRows | TokenRows):
            return msgspec.structs.replace(msg, epoch=self.state.epoch)
        return msg

    def stamp_open(self, opened: RequestOpen) -> RequestOpen:
        return msgspec.structs.replace(opened, epoch=self.state.epoch)

    def due_in(self) -> float | None:
        """Seconds until a message awaiting its acknowledgement is due to be sent again (None: nothing waits)."""
        return self.outbox.due_in()

    def tick(self) -> None:
        """Send again what is due; a message unacknowledged past the retry budget raises StageError."""
        try:
            self.outbox.tick()
        except HarnessError as exc:
            raise StageError(f"stage {self.state.index}: {exc}") from exc

    def rejoin(self, names: dict[str, str], epoch: int) -> None:
        """Take a newer directory (a spare replaced a stage): resolve the neighbours again; if the next stage is a
        replacement, replay the request in progress to it."""
        s = self.state
        if epoch <= s.epoch:
            s.drop(
                f"stage {s.index}: ignored a directory of epoch {epoch}, this stage is at epoch {s.epoch}",
                "an old directory",
                s.seed or "",
            )
            return
        old_next = s.next_addr
        s.epoch = epoch
        s.resolve(names)
        s.log(f"stage {s.index}: directory of epoch {epoch}")
        if s.keeps_history and s.next_addr is not None and s.next_addr != old_next:
            self._replay_to_next()
        self.outbox.redirect()  # what waits for the replaced node goes to its replacement now, not after a backoff

    # --- the sends ----------------------------------------------------------------------------------------------------

    def send(
        self, key: Key, role: str, msg: Message, step: int | None = None, t0: int = 0, tensor: Hidden | None = None
    ) -> None:
        """Send a message that must arrive: through the outbox (resent until ``key`` is acknowledged, so kept packed)
        unless the policy is none; ``tensor``: the hidden state beside an activation's header, packed only where it
        leaves the process (``ppharness.seams.transport``). With a trace ``step``, record its serialisation (from
        ``t0``: packing the hidden state counts) and the send call."""
        s = self.state
        if s.reliable:
            sent = self.outbox.put(key, role, msg if tensor is None else codec.attach(msg, tensor))
        else:
            address = self.address_of(role)
            assert address is not None
            sent = s.transport.send(address, msg, tensor)
        if s.tracer and step is not None and sent is not None:
            s.tracer.add(step, "serialize", t0, sent.encode_end_ns)
            s.tracer.add(step, "send", sent.encode_end_ns, sent.sent_ns, sent.nbytes)

    def send_rows(
        self, msg: ActivationRows | TokenRows, role: str, works: list[Work], t0: int, tensor: Hidden | None = None
    ) -> None:
        """Send a batched step's message (``tensor``: the rows' hidden states beside it): once, or under policies
        retry and failover through the outbox, as one message acknowledged as one (``rows_key``); each row's trace
        holds its serialisation and send."""
        s = self.state
        if s.reliable:
            sent = self.outbox.put(rows_key(msg), role, msg if tensor is None else codec.attach(msg, tensor))
        else:
            address = self.address_of(role)
            assert address is not None
            sent = s.transport.send(address, msg, tensor)
        if s.tracer and sent is not None:
            for work in works:
                s.tracer.begin(work.request.request_id)
                s.tracer.add(work.step, "serialize", t0, sent.encode_end_ns)
                s.tracer.add(work.step, "send", sent.encode_end_ns, sent.sent_ns, sent.nbytes)

    def tell(self, address: str, msg: Message) -> None:
        """Send ``msg`` once, never resent (a refusal: its sender asks again if it wants to)."""
        self.state.transport.send(address, msg)

    def ack(self, to: str | None, kind: str, request_id: str, position: int) -> None:
        """Acknowledge a copy of a message (policies retry and failover): its sender stops resending it."""
        s = self.state
        if s.reliable and to is not None:
            try:
                s.transport.send(to, ack_of(kind, request_id, position, s.plan_id))
            except HarnessError as exc:  # the sender resends; its next copy is acknowledged again
                s.log(f"stage {s.index}: acknowledging {kind} {position} failed: {exc}")

    # --- a step's outputs ---------------------------------------------------------------------------------------------

    def hand_on(self, batch: list[Work], outs: list[Hidden | int | list[int]]) -> None:
        """Hand a step's outputs on: a batched model's decode rows in one message (under every policy) unless the stage
        is the whole chain; else one by one."""
        s = self.state
        if s.model.batched and not (s.first and s.last):
            self._settle_rows(batch, outs)
        else:
            for work, out in zip(batch, outs, strict=True):
                self._settle(work, out)

    def _settle(self, work: Work, out: Hidden | int | list[int]) -> None:
        """Hand one output on: the last stage emits its token (N = 1: the token is the request's next input), the
        others send the hidden state down the chain; a replayed position's output is only recorded."""
        s, req = self.state, work.request
        if isinstance(out, list):  # N = 1: a window verified here, and the next ones drafted here
            self._commit(work, out)
            if req.request_id in s.reqs:
                self.windows.committed_here(req, work.position)
            return
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
            if s.first and req.request_id in s.reqs:
                if s.speculation is not None:
                    self.windows.committed_here(req, work.position)
                else:
                    req.work.append(Work(req, position, [out], is_prefill=False, step=len(req.tokens)))
        if work.note:
            s.log(f"{work.note} in {time.monotonic() - work.since:.2f} s")

    def _settle_rows(self, batch: list[Work], outs: list[Hidden | int | list[int]]) -> None:
        """A batched step's outputs: the live decode rows go on in one message (ActivationRows down the chain, or
        from the last stage TokenRows to stage 0); the rest as ``_settle`` hands them on. A speculative window's rows
        go as consecutive rows of the message; on the last stage, what it commits
        (``ppharness.run.stage.speculation``)."""
        s = self.state
        rows = [(w, o) for w, o in zip(batch, outs, strict=True) if w.live and not w.is_prefill]
        for work, out in zip(batch, outs, strict=True):
            if not (work.live and not work.is_prefill):
                self._settle(work, out)
        if not rows:
            return
        t0 = now_ns() if s.tracer else 0
        if s.last:
            tokens: list[NextToken] = []
            for work, out in rows:
                if isinstance(out, list):
                    self._commit(work, out, tokens)
                else:
                    self._emit(work.request, int(cast(int, out)), work.position + 1, work.step, tokens)
            if tokens:
                token_rows = TokenRows(
                    request_ids=[t.request_id for t in tokens],
                    token_ids=[t.token_id for t in tokens],
                    positions=[t.position for t in tokens],
                    done=[t.done for t in tokens],
                    plan_id=s.plan_id,
                    epoch=s.epoch,
                )
                self.send_rows(token_rows, "entry", [w for w, _ in rows], t0)
            return
        hidden = [cast(Hidden, o) for _, o in rows]
        for (work, _), h in zip(rows, hidden, strict=True):
            req = work.request
            if s.keeps_digests and req.digests and work.tokens is not None:  # a window: from its first row's step on
                for r in range(h.shape[0]):
                    record_digest(s.digests, req.request_id, Hidden(h.host()[r : r + 1]), KEEP_REQUESTS, work.step + r)
            elif s.keeps_digests and req.digests:
                record_digest(s.digests, req.request_id, h, KEEP_REQUESTS)
            if s.keeps_history:  # a replay to a spare sends each request's own activations, packed
                one = codec.header(
                    h,
                    s.wire_dtype,
                    request_id=req.request_id,
                    position=work.position,
                    is_prefill=False,
                    plan_id=s.plan_id,
                    epoch=s.epoch,
                )
                req.sent.append(cast(StageActivation, codec.attach(one, h)))
        stacked = Hidden(np.concatenate([h.host() for h in hidden]))
        spans = [(w, h.shape[0]) for (w, _), h in zip(rows, hidden, strict=True)]  # a window's rows, else one
        windows = s.speculation is not None
        msg = ActivationRows(
            request_ids=[w.request.request_id for w, n in spans for _ in range(n)],
            positions=[w.position + r for w, n in spans for r in range(n)],
            hidden=b"",  # packed where it leaves the process
            shape=stacked.shape,
            dtype=s.wire_dtype,
            plan_id=s.plan_id,
            epoch=s.epoch,
            tokens=[t for w, _ in spans for t in (w.tokens or [])] if windows else [],
            trips=[w.trip for w, n in spans for _ in range(n)] if windows else [],
        )
        self.send_rows(msg, "next", [w for w, _ in rows], t0, stacked)

    def _commit(self, work: Work, greedy: list[int], rows: list[NextToken] | None = None) -> None:
        """The last stage: emit what a window commits (``Windows.verify``), up to the end of the answer."""
        req = work.request
        position = work.position + 1
        for token in self.windows.verify(work, greedy):
            self._emit(req, token, position, work.step, rows)
            if req.request_id not in self.state.reqs:
                return  # answered: a stop token, or max_tokens
            position += 1

    def _send_activation(
        self, req: Request, hidden: Hidden, position: int, is_prefill: bool, step: int, live: bool = True
    ) -> None:
        """Send the hidden state on (``live``), or only record it as sent (a replay: it went round already)."""
        s = self.state
        t0 = now_ns() if s.tracer else 0
        if s.keeps_digests and req.digests:  # a digest reads the value on the host: only where it is asked for
            record_digest(s.digests, req.request_id, hidden, KEEP_REQUESTS)
        msg = codec.header(
            hidden,
            s.wire_dtype,
            request_id=req.request_id,
            position=position,
            is_prefill=is_prefill,
            plan_id=s.plan_id,
            epoch=s.epoch,
        )
        if s.keeps_history:  # kept packed: a replay may go to a spare in another process
            req.sent.append(cast(StageActivation, codec.attach(msg, hidden)))
        if live:
            self.send(("activation", req.request_id, position), "next", msg, step, t0, hidden)

    def _emit(self, req: Request, token: int, position: int, step: int, rows: list[NextToken] | None = None) -> None:
        """Record a sampled token; tell stage 0 (``rows``: kept there for one TokenRows instead) and the client
        (and, when done, send the response)."""
        s = self.state
        req.tokens.append(token)
        req.token_times.append(time.monotonic() - req.t0)
        reason = finish_reason(req.tokens, s.model.config.eog_ids, req.max_tokens)
        done = reason is not None
        if not s.first:
            msg = NextToken(
                request_id=req.request_id,
                token_id=token,
                position=position,
                done=done,
                plan_id=s.plan_id,
                epoch=s.epoch,
            )
            if rows is not None:
                rows.append(msg)
            else:
                self.send(("token", req.request_id, position), "entry", msg, step, now_ns())
        if s.reliable or req.stream:
            streamed = StreamedToken(
                request_id=req.request_id,
                token_id=token,
                position=position,
                done=done,
                plan_id=s.plan_id,
                first=req.prompt_tokens,
            )
            self.send(("stream", req.request_id, position), "client:" + req.reply_to, streamed)
        if reason is not None:
            self._respond(req, reason)

    def _respond(self, req: Request, reason: str) -> None:
        s = self.state
        eog_ids = s.model.config.eog_ids
        ids, stop = visible(req.tokens, eog_ids), stop_token(req.tokens, eog_ids)
        assert s.tokenizer is not None  # the constructor insists on it for the last stage
        response = InferenceResponse(
            request_id=req.request_id,
            text=s.tokenizer.decode(ids),
            token_ids=ids,
            prompt_tokens=req.prompt_tokens,
            token_times=req.token_times,
            finish_reason=reason,
            stop_token_id=stop,
            stop_token=s.tokenizer.decode([stop]) if stop is not None else "",
            trips=req.verified[0],
            drafted=req.verified[1],
            accepted=req.verified[2],
            rejected=req.verified[3],
            window_drafts=req.window_drafts,
            window_accepted=req.window_accepted,
        )
        self.send(("response", req.request_id, -1), "client:" + req.reply_to, response)
        s.finish(req.request_id)
        w = self.windows
        if s.speculation is not None and w.trips:
            s.log(
                f"stage {s.index}: speculation so far: {w.trips} trip(s) committed {w.committed} token(s), "
                f"{w.committed / w.trips:.2f} per trip; {w.accepted} of {w.drafted} drafted token(s) accepted; "
                f"{w.void} void window(s)"
            )

    # --- replays sent (policy failover: ppharness.run.stage.replay) -------------------------------------------------

    def _cascade(self, req: Request) -> None:
        """A replacement that replayed a request sends everything it computed for it on, as a replay: its next
        stage may have been replaced too (two neighbours lost at once) and hold nothing of the request; one that
        holds it takes only the positions it has not seen."""
        if req.opened is None or not req.sent:
            return
        replay = self._replay_of(req, req.opened)
        self.send(("replay", req.request_id, replay_position(replay)), "next", replay)

    def _replay_to_next(self) -> None:
        """Send each request in progress, as this stage sent it, to the stage that replaced the next one."""
        s = self.state
        replayed = {r.request_id for r in s.reqs.values() if r.opened is not None and r.request_id not in s.finished}
        # the replays carry them, and every batched step's rows (each request's own activations are in its replay)
        self.outbox.drop(lambda key, role: not (role == "next" and (key[1] in replayed or key[0] == "rows")))
        for req in list(s.reqs.values()):
            if req.request_id not in replayed or req.opened is None:
                continue
            rid = req.request_id
            replay = self._replay_of(req, req.opened)
            s.log(f"stage {s.index}: replaying request {rid} ({len(req.sent)} activation(s)) to the next stage")
            self.send(("replay", rid, replay_position(replay)), "next", replay)

    def _replay_of(self, req: Request, opened: RequestOpen) -> Replay:
        """What this stage sent down the chain for ``req``, stamped with its epoch now."""
        epoch = self.state.epoch
        return Replay(
            open=self.stamp_open(opened),
            activations=[msgspec.structs.replace(a, epoch=epoch) for a in req.sent],
            epoch=epoch,
        )


def replay_position(msg: Replay) -> int:
    """A replay's key position: its last activation's (-1 when it holds none)."""
    return msg.activations[-1].position if msg.activations else -1


def record_digest(
    digests: OrderedDict[str, list[bytes]], request_id: str, hidden: Hidden, keep: int, at: int | None = None
) -> None:
    """A stage that answers DigestRequests keeps the digest of each hidden state it sends, per request in step order;
    only the last ``keep`` requests' lists stay. ``at``: the step it is for, replacing that step's digest and every
    later one (a speculative window computes again the positions whose drafts were rejected)."""
    kept = digests.setdefault(request_id, [])
    if at is not None:
        del kept[at:]
    kept.append(digest(hidden.host()))
    while len(digests) > keep:
        digests.popitem(last=False)
