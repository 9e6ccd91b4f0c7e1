"""A request's record on a stage, on the inbound side: how it is admitted (stage 0), opened (later stages) and
closed. How each activation that arrives for it is checked against that record and taken as its next model call is
the record's own (``StageState.accept_activation``).

Stage 0 admits a request when a slot is free, keeps up to ``queue`` more waiting (acknowledged, in order of arrival)
and refuses the rest with a busy Error; it opens each admitted request down the chain with a ``RequestOpen``, and once
the last stage's ``done`` token came back, closes it with a ``RequestClose`` (``ppharness.run.stage.requests`` says
why on the same channel as the activations). What is sent goes by the outbound side (``ppharness.run.stage.outbound``).
"""

from __future__ import annotations

import time
import uuid

import msgspec

from ppharness.run.reliable import EVERY_POSITION
from ppharness.run.stage.outbound import Outbound
from ppharness.run.stage.requests import Request, StageState, Work
from ppharness.seams.transport import Received
from ppharness.trace.tracer import now_ns
from ppharness.wire.messages import Error, InferenceRequest, RequestClose, RequestOpen


class Admission:
    """Requests in and out of a stage's slots (``on_request``, ``on_open``, ``on_close``; ``open``, ``take_open``
    for a resume or a replay)."""

    def __init__(self, state: StageState, out: Outbound):
        self.state, self.out = state, out

    # --- stage 0: admission -------------------------------------------------------------------------------------------

    def on_request(self, msg: InferenceRequest, rx: Received | None) -> None:
        s = self.state
        if not self.reply_to_ok(msg.reply_to, "InferenceRequest"):
            return
        request_id = msg.request_id or uuid.uuid4().hex[:12]
        if s.reliable and msg.request_id and s.known(request_id):
            self.out.ack(msg.reply_to, "request", request_id, -1)  # a resent request this stage already took
            return
        if request_id in s.reqs or any(w[0].request_id == request_id for w in s.waiting):
            self._refuse(msg.reply_to, request_id, f"request {request_id} is already in flight", busy=False)
            return
        ids = self.tokenize(msg.prompt, request_id)
        room = s.model.max_context - len(ids)
        if msg.max_tokens < 1 or msg.max_tokens > room:
            self._refuse(
                msg.reply_to,
                request_id,
                f"max_tokens {msg.max_tokens} must be in 1..{room}: the prompt is {len(ids)} tokens of a "
                f"{s.model.max_context}-token context",
                busy=False,
            )
            return
        if s.free_slot() is None and len(s.waiting) >= s.queue_limit:
            self._refuse(
                msg.reply_to,
                request_id,
                f"stage 0 is full: {len(s.reqs)} request(s) in flight (its {s.slots} slot(s)) and "
                f"{len(s.waiting)} waiting (its queue of {s.queue_limit}); send it again later",
                busy=True,
            )
            return
        self.out.ack(msg.reply_to, "request", request_id, -1)
        s.waiting.append((msgspec.structs.replace(msg, request_id=request_id), ids, rx))

    def _refuse(self, reply_to: str, request_id: str, reason: str, busy: bool) -> None:
        s = self.state
        s.log(f"stage 0: refused request {request_id}: {reason}")
        self.out.tell(reply_to, Error(stage=s.index, request_id=request_id, reason=reason, busy=busy))

    def admit_waiting(self) -> None:
        """Stage 0: start the waiting requests, oldest first, while a slot is free."""
        s = self.state
        while s.waiting and s.free_slot() is not None:
            msg, ids, rx = s.waiting.popleft()
            req = self.open(msg.request_id, msg, ids)  # the RequestOpen goes down the chain now
            req.work.append(Work(req, 0, ids, is_prefill=True, step=0, rx=rx))

    def tokenize(self, prompt: str, request_id: str) -> list[int]:
        s = self.state
        cfg = s.model.config
        assert s.tokenizer is not None  # the constructor insists on it for the first stage
        t0 = now_ns() if s.tracer else 0
        ids = ([cfg.bos_id] if cfg.bos_id is not None else []) + s.tokenizer.encode(prompt)
        if s.tracer:
            s.tracer.begin(request_id)
            s.tracer.add(0, "tokenize", t0, now_ns())
        return ids

    def open(self, request_id: str, msg: InferenceRequest, ids: list[int]) -> Request:
        """Stage 0 takes a request into a free slot: its state, and the RequestOpen down the chain."""
        s = self.state
        slot = s.free_slot()
        assert slot is not None  # admitted only while a slot is free
        req = Request(
            request_id,
            msg.reply_to,
            msg.max_tokens,
            len(ids),
            slot=slot,
            stream=msg.stream,
            next_position=len(ids),
            t0=time.monotonic(),
            digests=msg.digests,
        )
        if s.speculation is not None:  # the draft reads the prompt and the answer so far
            req.context, req.speculate = list(ids), msg.speculate
        s.reqs[request_id] = req
        if not s.last:
            opened = RequestOpen(
                request_id=request_id,
                reply_to=msg.reply_to,
                max_tokens=msg.max_tokens,
                prompt_tokens=len(ids),
                plan_id=s.plan_id,
                epoch=s.epoch,
                stream=msg.stream,
                digests=msg.digests,
            )
            if s.keeps_history:
                req.opened = opened
            self.out.send(("open", request_id, -1), "next", opened)
        return req

    # --- later stages: open and close ---------------------------------------------------------------------------------

    def on_open(self, msg: RequestOpen) -> None:
        s = self.state
        if not self.reply_to_ok(msg.reply_to, "RequestOpen"):
            return
        if msg.plan_id != s.plan_id:
            s.drop(
                f"stage {s.index}: dropped RequestOpen of plan {msg.plan_id}, this stage serves {s.plan_id}",
                "another plan",
                s.prev_addr or "",
            )
            return
        if s.reliable and s.known(msg.request_id):
            self.out.ack(s.prev_addr, "open", msg.request_id, -1)  # a resent RequestOpen already taken
            return
        if self.take_open(msg) is not None:  # unacknowledged when refused: a resent copy may find a slot free
            self.out.ack(s.prev_addr, "open", msg.request_id, -1)

    def take_open(self, msg: RequestOpen) -> Request | None:
        """A request opens here: a slot for it (the one it has, when opened again by a replay), and the
        RequestOpen on down the chain. None, logged, when every slot is taken."""
        s = self.state
        old = s.reqs.get(msg.request_id)
        slot = old.slot if old is not None else s.free_slot()
        if slot is None:
            s.drop(
                f"stage {s.index}: dropped RequestOpen of {msg.request_id}: all {s.slots} request slot(s) are "
                f"taken by {sorted(s.reqs)[:8]} (the RequestClose of one of them should have come first)",
                "no free slot",
                s.prev_addr or "",
            )
            return None
        req = Request(
            msg.request_id,
            msg.reply_to,
            msg.max_tokens,
            msg.prompt_tokens,
            slot=slot,
            stream=msg.stream,
            t0=time.monotonic(),
            digests=msg.digests,
        )
        s.reqs[msg.request_id] = req
        if s.tracer:
            s.tracer.begin(msg.request_id)
        if not s.last:
            opened = self.out.stamp_open(msg)
            if s.keeps_history:
                req.opened = opened
            self.out.send(("open", msg.request_id, -1), "next", opened)
        return req

    def on_close(self, msg: RequestClose) -> None:
        """Stage 0 says a request is over: free its slot, and tell the next stage unless that is the last (which
        freed its own when it answered)."""
        s = self.state
        if msg.plan_id != s.plan_id:
            s.drop(
                f"stage {s.index}: dropped RequestClose of plan {msg.plan_id}, this stage serves {s.plan_id}",
                "another plan",
                s.prev_addr or "",
            )
            return
        self.out.ack(s.prev_addr, "close", msg.request_id, -1)
        if s.reliable:  # stage 0 had the last token: every hop took every position
            self.out.outbox.settle_through("activation", msg.request_id, EVERY_POSITION)
        if msg.request_id not in s.reqs:
            return  # a copy of one already taken, or of a request this stage never saw (its open was refused)
        s.finish(msg.request_id)
        if s.next_is_middle:
            self.out.send(("close", msg.request_id, -1), "next", msgspec.structs.replace(msg, epoch=s.epoch))

    def close_down(self, req: Request) -> None:
        """Stage 0: a request is over (its last token came back): free its slot, and the middle stages' with a
        RequestClose."""
        s = self.state
        s.finish(req.request_id)
        if s.next_is_middle:  # the middle stages free the request's slot too
            close = RequestClose(request_id=req.request_id, plan_id=s.plan_id, epoch=s.epoch)
            self.out.send(("close", req.request_id, -1), "next", close)

    def reply_to_ok(self, reply_to: str, what: str) -> bool:
        """Answers go to the orchestrator that asked, never to another address a frame names."""
        s = self.state
        if s.seed is None or reply_to == s.seed:
            return True
        s.drop(
            f"stage {s.index}: dropped {what} whose reply_to {reply_to[:120]!r} is not the orchestrator",
            "a reply_to not the orchestrator's",
            s.prev_addr or "",
        )
        return False
