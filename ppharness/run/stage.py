"""One Stage class for any N >= 1; its role (first / middle / last) follows from the index alone.

The token's way, as DESIGN.md draws it::

    InferenceRequest -> stage 0 (tokenize, embed, blocks) -RequestOpen, StageActivation-> ... -> stage N-1 (blocks,
    norm, head, argmax) -NextToken-> stage 0 -> ... until EOS or max_tokens; stage N-1 -InferenceResponse-> reply_to.

Requests in flight: a stage serves up to ``slots`` requests at once, each in a request slot of its model (a KV cache of
its own), and takes their messages in whatever order they come; every message names its request. Stage 0 admits a
request when a slot is free, keeps up to ``queue`` more waiting (acknowledged, in order of arrival) and refuses the rest
with a busy Error that says so. When stage 0 learns a request is over (the last stage's ``done`` token) it frees the
slot and sends ``RequestClose`` down the chain, on the same ordered channel as the activations, so every middle stage
frees its slot before the next request's ``RequestOpen`` can arrive; the last stage frees its own when it answers.

Messages that do not fit a stage's state (a stale plan, an unknown request, a duplicate position) are logged and
dropped, never fatal; a failure of the model itself raises ``StageError``.

Fault tolerance, by the run's policy:

- ``none``: each message is sent once; a lost one ends the run (the orchestrator's budget runs out).
- ``retry``: every hop is idempotent (``ppharness.run.reliable``): the receiver acknowledges each copy of a message and
  acts on the first; the sender resends until acknowledged. The last stage also streams each token to the client.
- ``failover``: besides, each stage keeps what it sent down the chain for the requests in progress. When a spare
  replaces the next stage (a newer directory names another address for it), the stage replays that to the spare, which
  rebuilds its KV cache by the very calls that built the lost one (one prefill, then one decode per position: a
  single longer prefill is not bit-identical in fp16) and passes only the last output on. A replacement of stage 0 is
  resumed by the orchestrator, which holds the prompt and the streamed tokens. Messages from an older epoch (a
  replaced node that came back) are refused.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

import msgspec

from ppharness.errors import CodecError, HarnessError, StageError
from ppharness.model.decoding import finish_reason, visible
from ppharness.model.exactness import digest
from ppharness.plan.stages import ENTRY, EXIT, stage_name
from ppharness.run.reliable import Key, Outbox, RetryPolicy, ack_of
from ppharness.seams.transport import Received, Sent, Transport
from ppharness.trace.tracer import KEEP_REQUESTS, Tracer, now_ns
from ppharness.wire import codec
from ppharness.wire.messages import (
    Ack,
    Error,
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
)

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from tinygrad.apps.llm import SimpleTokenizer

    from ppharness.model.slicing import ModelConfig

_T = TypeVar("_T")


class StageModel(Protocol):
    """What a Stage computes with: a ``ppharness.model.slicing.ModelSlice``, or one with an injected fault
    (``ppharness.testing.faults.FaultyModel``). ``prefill`` and ``decode`` take token ids (first stage) or an fp16
    hidden state (1, T, D), and return a hidden state, or on the last stage the next token id."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def max_context(self) -> int: ...

    @property
    def slots(self) -> int: ...

    def prefill(self, x: list[int] | npt.NDArray[np.float16], slot: int = 0) -> npt.NDArray[np.float16] | int: ...

    def decode(
        self, x: list[int] | npt.NDArray[np.float16], position: int, slot: int = 0
    ) -> npt.NDArray[np.float16] | int: ...


@dataclass
class _Request:
    request_id: str
    reply_to: str
    max_tokens: int
    prompt_tokens: int
    slot: int = 0  # the model's request slot (KV cache) this request computes in
    stream: bool = False  # last stage: send each token to reply_to as it is sampled
    next_position: int = 0  # the position this stage expects next
    tokens: list[int] = field(default_factory=list)  # last stage: generated so far
    token_times: list[float] = field(default_factory=list)
    t0: float = 0.0
    # policy failover: what this stage sent down the chain for the request, for a replay to a replacement
    opened: RequestOpen | None = None
    sent: list[StageActivation] = field(default_factory=list)


FINISHED_KEPT = 64  # request ids a stage remembers as finished, to acknowledge late duplicates
QUEUE = 64  # stage 0's default: requests kept waiting for a free slot before more are refused


class Stage:
    """Stage ``index`` of ``num_stages``, computing with ``model`` (a ModelSlice) and talking over ``transport``.

    ``names`` is the directory (name -> address) from the cluster; next and previous stages are computed locally.
    ``seed`` is the orchestrator's address: the only member that may send requests, and the only one answered.

    Every message is taken only from the member whose role sends it (requests from the seed, RequestOpen and
    activations from the previous stage, NextToken from the last), by the sender address the transport authenticated;
    anything else is dropped with a log line, so no member can steer a stage it does not feed.
    """

    def __init__(
        self,
        index: int,
        num_stages: int,
        model: StageModel,
        transport: Transport,
        names: dict[str, str],
        plan_id: str,
        wire_dtype: str = "f16",
        tokenizer: SimpleTokenizer | None = None,
        log: Callable[[str], None] = print,
        tracer: Tracer | None = None,
        seed: str | None = None,
        route: tuple[str, str] = ("", ""),
        policy: str = "none",
        retry: RetryPolicy | None = None,
        epoch: int = 0,
        queue: int = QUEUE,
    ):
        """``route``: the names the activations come from and go to, as the compiled plan gives them (empty: the
        SPEC's pp-stage-{index -/+ 1}). ``policy``: none, retry or failover (module docstring); ``retry`` its
        timings; ``epoch`` the directory's epoch ``names`` belongs to. ``queue``: on stage 0, how many requests may
        wait for a free slot (the model's ``slots`` say how many are served at once)."""
        self.index, self.num_stages = index, num_stages
        self.first, self.last = index == 0, index == num_stages - 1
        self.next_is_middle = index + 1 < num_stages - 1  # a stage that frees its slot on RequestClose
        self.model, self.transport, self.plan_id = model, transport, plan_id
        self.wire_dtype, self.tokenizer, self.log = wire_dtype, tokenizer, log
        prev, nxt = route
        self._route = (prev or stage_name(index - 1), nxt or stage_name(index + 1))
        self.epoch = epoch
        self._resolve_names(names)
        self.seed = seed
        self.slots = getattr(model, "slots", 1)
        self.reqs: dict[str, _Request] = {}  # the requests in flight here, by id, each in its own slot
        self.queue_limit = queue
        self.waiting: deque[tuple[InferenceRequest, list[int], Received | None]] = deque()  # stage 0: admitted next
        self.served = 0
        self.tracer = tracer
        # digests of the hidden states sent, per request (the last few), for ppharness.model.exactness
        self.digests: OrderedDict[str, list[bytes]] = OrderedDict()
        self.policy = policy
        self.reliable, self.keeps_history = policy != "none", policy == "failover"
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.outbox = Outbox(self._send_plain, self._address_of, retry or RetryPolicy(), stamp=self._stamp)
        if (self.first or self.last) and tokenizer is None:
            raise StageError(f"stage {index}: the first and last stages need the tokenizer")

    def _resolve_names(self, names: dict[str, str]) -> None:
        prev, nxt = self._route
        self.next_addr = None if self.last else names[nxt]
        self.prev_addr = None if self.first else names[prev]
        self.entry_addr = names[ENTRY]
        self.exit_addr = names[EXIT]

    # --- dispatch ---------------------------------------------------------------------------------------------------

    def handle(self, sender: str, msg: Message, rx: Received | None = None) -> None:
        """Act on one message. Protocol violations are dropped with a log line; model failures raise StageError.

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
            case Replay() if not self.first and self.keeps_history:
                self._on_replay(msg)
            case Resume() if self.first and self.keeps_history:
                self._on_resume(msg)
            case _:
                self.log(f"stage {self.index}: dropped unexpected {type(msg).__name__} from {sender}")
        if self.first:
            self._admit_waiting()

    def due_in(self) -> float | None:
        """Seconds until a message awaiting its acknowledgement is due to be sent again (None: nothing waits)."""
        return self.outbox.due_in()

    def tick(self) -> None:
        """Send again what is due; a message unacknowledged past the retry budget raises StageError."""
        try:
            self.outbox.tick()
        except HarnessError as exc:
            raise StageError(f"stage {self.index}: {exc}") from exc

    def rejoin(self, names: dict[str, str], epoch: int) -> None:
        """Take a newer directory (a spare replaced a stage): resolve the neighbours again; if the next stage is a
        replacement, replay the request in progress to it."""
        if epoch <= self.epoch:
            self.log(f"stage {self.index}: ignored a directory of epoch {epoch}, this stage is at epoch {self.epoch}")
            return
        old_next = self.next_addr
        self.epoch = epoch
        self._resolve_names(names)
        self.log(f"stage {self.index}: directory of epoch {epoch}")
        if self.keeps_history and self.next_addr is not None and self.next_addr != old_next:
            self._replay_to_next()
        self.outbox.redirect()  # what waits for the replaced node goes to its replacement now, not after a backoff

    # --- first stage ------------------------------------------------------------------------------------------------

    def _on_request(self, msg: InferenceRequest, rx: Received | None) -> None:
        if not self._reply_to_ok(msg.reply_to, "InferenceRequest"):
            return
        request_id = msg.request_id or uuid.uuid4().hex[:12]
        if self.reliable and msg.request_id and self._known(request_id):
            self._ack(msg.reply_to, "request", request_id, -1)  # a resent request this stage already took
            return
        if request_id in self.reqs or any(w[0].request_id == request_id for w in self.waiting):
            self._refuse(msg.reply_to, request_id, f"request {request_id} is already in flight", busy=False)
            return
        ids = self._tokenize(msg.prompt, request_id)
        room = self.model.max_context - len(ids)
        if msg.max_tokens < 1 or msg.max_tokens > room:
            self._refuse(
                msg.reply_to,
                request_id,
                f"max_tokens {msg.max_tokens} must be in 1..{room}: the prompt is {len(ids)} tokens of a "
                f"{self.model.max_context}-token context",
                busy=False,
            )
            return
        if self._free_slot() is None and len(self.waiting) >= self.queue_limit:
            self._refuse(
                msg.reply_to,
                request_id,
                f"stage 0 is full: {len(self.reqs)} request(s) in flight (its {self.slots} slot(s)) and "
                f"{len(self.waiting)} waiting (its queue of {self.queue_limit}); send it again later",
                busy=True,
            )
            return
        self._ack(msg.reply_to, "request", request_id, -1)
        self.waiting.append((msgspec.structs.replace(msg, request_id=request_id), ids, rx))

    def _refuse(self, reply_to: str, request_id: str, reason: str, busy: bool) -> None:
        self.log(f"stage 0: refused request {request_id}: {reason}")
        self.transport.send(reply_to, Error(stage=self.index, request_id=request_id, reason=reason, busy=busy))

    def _free_slot(self) -> int | None:
        used = {r.slot for r in self.reqs.values()}
        return next((k for k in range(self.slots) if k not in used), None)

    def _admit_waiting(self) -> None:
        """Stage 0: start the waiting requests, oldest first, while a slot is free."""
        while self.waiting and self._free_slot() is not None:
            msg, ids, rx = self.waiting.popleft()
            self._admit(msg, ids, rx)

    def _admit(self, msg: InferenceRequest, ids: list[int], rx: Received | None) -> None:
        """Stage 0 starts a request in a free slot: opens it down the chain and sends its prefill."""
        req = self._open(msg.request_id, msg, ids)
        if self.tracer:
            self._trace_rx(0, rx)
        out = self._compute(req, 0, lambda: self.model.prefill(ids, req.slot))
        if self.last:  # N = 1: this stage is the whole chain
            self._decode_alone(req, out)
        else:
            assert not isinstance(out, int)  # a stage before the last returns a hidden state
            self._send_activation(req, out, position=0, is_prefill=True, step=0)

    def _tokenize(self, prompt: str, request_id: str) -> list[int]:
        cfg = self.model.config
        assert self.tokenizer is not None  # the constructor insists on it for the first stage
        t0 = now_ns() if self.tracer else 0
        ids = ([cfg.bos_id] if cfg.bos_id is not None else []) + self.tokenizer.encode(prompt)
        if self.tracer:
            self.tracer.begin(request_id)
            self.tracer.add(0, "tokenize", t0, now_ns())
        return ids

    def _open(self, request_id: str, msg: InferenceRequest, ids: list[int]) -> _Request:
        """Stage 0 takes a request into a free slot: its state, and the RequestOpen down the chain."""
        slot = self._free_slot()
        assert slot is not None  # admitted only while a slot is free
        req = _Request(
            request_id,
            msg.reply_to,
            msg.max_tokens,
            len(ids),
            slot=slot,
            stream=msg.stream,
            next_position=len(ids),
            t0=time.monotonic(),
        )
        self.reqs[request_id] = req
        if self.next_addr is not None:  # not the last stage
            opened = RequestOpen(
                request_id=request_id,
                reply_to=msg.reply_to,
                max_tokens=msg.max_tokens,
                prompt_tokens=len(ids),
                plan_id=self.plan_id,
                epoch=self.epoch,
                stream=msg.stream,
            )
            if self.keeps_history:
                req.opened = opened
            self._post("open", request_id, -1, "next", opened)
        return req

    def _on_resume(self, msg: Resume) -> None:
        """A replacement of stage 0: replay the prompt and the tokens so far through this stage's blocks, then go on
        from the last token as if it had just come back from the last stage."""
        req_msg = msg.request
        if self._known(req_msg.request_id):
            self._ack(req_msg.reply_to, "resume", req_msg.request_id, -1)
            return
        if self._free_slot() is None or not self._reply_to_ok(req_msg.reply_to, "Resume"):
            self.log(f"stage 0: dropped Resume of {req_msg.request_id}: no free request slot")
            return
        self._ack(req_msg.reply_to, "resume", req_msg.request_id, -1)
        ids = self._tokenize(req_msg.prompt, req_msg.request_id)
        req = self._open(req_msg.request_id, req_msg, ids)
        t0 = time.monotonic()
        out = self._compute(req, 0, lambda: self.model.prefill(ids, req.slot))
        if self.last:  # N = 1: the tokens are generated again (the client drops those it has), then on alone
            self._decode_alone(req, out)
            return
        position, is_prefill = 0, True  # where ``out`` belongs
        for k, token in enumerate(msg.tokens):
            assert not isinstance(out, int)  # a stage before the last returns a hidden state
            self._send_activation(req, out, position, is_prefill, step=k, live=False)  # it went round already
            position, is_prefill = req.next_position, False

            def decode(token: int = token, position: int = position) -> npt.NDArray[np.float16] | int:
                return self.model.decode([token], position, req.slot)

            out = self._compute(req, k + 1, decode)
            req.next_position += 1
        assert not isinstance(out, int)
        self.log(
            f"stage 0: resumed request {req.request_id}: replayed the prompt and {len(msg.tokens)} token(s) in "
            f"{time.monotonic() - t0:.2f} s"
        )
        self._send_activation(req, out, position, is_prefill, step=len(msg.tokens))

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
        self._ack(self.exit_addr, "token", msg.request_id, msg.position)
        if self.tracer:
            self.tracer.begin(req.request_id)
            self._trace_rx(step, rx)
        if msg.done:
            self._finish(req.request_id)
            if self.next_is_middle:  # the middle stages free the request's slot too
                close = RequestClose(request_id=req.request_id, plan_id=self.plan_id, epoch=self.epoch)
                self._post("close", req.request_id, -1, "next", close)
            return
        req.next_position += 1
        out = self._compute(req, step, lambda: self.model.decode([msg.token_id], msg.position, req.slot))
        assert not isinstance(out, int)  # a stage before the last returns a hidden state
        self._send_activation(req, out, position=msg.position, is_prefill=False, step=step)

    # --- later stages -----------------------------------------------------------------------------------------------

    def _on_open(self, msg: RequestOpen) -> None:
        if not self._reply_to_ok(msg.reply_to, "RequestOpen"):
            return
        if msg.plan_id != self.plan_id:
            self.log(f"stage {self.index}: dropped RequestOpen of plan {msg.plan_id}, this stage serves {self.plan_id}")
            return
        if self.reliable and self._known(msg.request_id):
            self._ack(self.prev_addr, "open", msg.request_id, -1)  # a resent RequestOpen this stage already took
            return
        if self._take_open(msg) is not None:  # unacknowledged when refused: a resent copy may find a slot free
            self._ack(self.prev_addr, "open", msg.request_id, -1)

    def _take_open(self, msg: RequestOpen) -> _Request | None:
        """A request opens here: a slot for it (the one it has, when opened again by a replay), and the
        RequestOpen on down the chain. None, logged, when every slot is taken."""
        old = self.reqs.get(msg.request_id)
        slot = old.slot if old is not None else self._free_slot()
        if slot is None:
            self.log(
                f"stage {self.index}: dropped RequestOpen of {msg.request_id}: all {self.slots} request slot(s) are "
                f"taken by {sorted(self.reqs)} (the RequestClose of one of them should have come first)"
            )
            return None
        req = _Request(
            msg.request_id,
            msg.reply_to,
            msg.max_tokens,
            msg.prompt_tokens,
            slot=slot,
            stream=msg.stream,
            t0=time.monotonic(),
        )
        self.reqs[msg.request_id] = req
        if self.tracer:
            self.tracer.begin(msg.request_id)
        if self.next_addr is not None:  # not the last stage
            opened = msgspec.structs.replace(msg, epoch=self.epoch)
            if self.keeps_history:
                req.opened = opened
            self._post("open", msg.request_id, -1, "next", opened)
        return req

    def _on_close(self, msg: RequestClose) -> None:
        """Stage 0 says a request is over: free its slot, and tell the next stage unless that is the last (which
        freed its own when it answered)."""
        if msg.plan_id != self.plan_id:
            self.log(
                f"stage {self.index}: dropped RequestClose of plan {msg.plan_id}, this stage serves {self.plan_id}"
            )
            return
        self._ack(self.prev_addr, "close", msg.request_id, -1)
        if msg.request_id not in self.reqs:
            return  # a copy of one already taken, or of a request this stage never saw (its open was refused)
        self._finish(msg.request_id)
        if self.next_is_middle:
            self._post("close", msg.request_id, -1, "next", msgspec.structs.replace(msg, epoch=self.epoch))

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
        hidden = self._check_activation(msg, req)
        if hidden is None:
            return
        self._ack(self.prev_addr, "activation", msg.request_id, msg.position)
        if self.tracer:
            self.tracer.begin(req.request_id)
        self._take_activation(msg, hidden, req, rx, live=True)

    def _check_activation(self, msg: StageActivation, req: _Request) -> npt.NDArray[np.float16] | None:
        """The activation's hidden state, when it is the one this stage expects next; else None (logged)."""
        if msg.position != req.next_position or msg.is_prefill != (msg.position == 0):
            self.log(
                f"stage {self.index}: dropped activation at position {msg.position} (prefill={msg.is_prefill}), "
                f"expected position {req.next_position}"
            )
            return None
        want = req.prompt_tokens if msg.is_prefill else 1
        if msg.seq_len != want or tuple(msg.shape) != (1, want, self.model.config.dim):
            self.log(
                f"stage {self.index}: dropped activation of shape {tuple(msg.shape)} (seq_len {msg.seq_len}) at "
                f"position {msg.position}: the plan expects (1, {want}, {self.model.config.dim})"
            )
            return None
        t0 = now_ns() if self.tracer else 0
        try:
            hidden = codec.unpack_hidden(msg)
        except CodecError as exc:
            self.log(f"stage {self.index}: dropped activation: {exc}")
            return None
        if self.tracer:
            self.tracer.add(self._step(msg, req), "deserialize", t0, now_ns())
        if hidden.shape != (1, want, self.model.config.dim):
            self.log(
                f"stage {self.index}: dropped activation of shape {hidden.shape}, expected (1, {msg.seq_len}, "
                f"{self.model.config.dim})"
            )
            return None
        return hidden

    @staticmethod
    def _step(msg: StageActivation, req: _Request) -> int:
        return 0 if msg.is_prefill else msg.position - req.prompt_tokens + 1

    def _take_activation(
        self,
        msg: StageActivation,
        hidden: npt.NDArray[np.float16],
        req: _Request,
        rx: Received | None,
        live: bool,
    ) -> None:
        """Compute on an accepted activation and pass the result on (``live``), or only record it (a replay)."""
        step = self._step(msg, req)
        self._trace_rx(step, rx)
        req.next_position = msg.position + msg.seq_len
        if msg.is_prefill:
            out = self._compute(req, step, lambda: self.model.prefill(hidden, req.slot))
        else:
            out = self._compute(req, step, lambda: self.model.decode(hidden, msg.position, req.slot))
        if self.last:
            if live:
                self._emit(req, int(out), position=req.next_position, step=step)
            else:
                req.tokens.append(int(out))
                req.token_times.append(time.monotonic() - req.t0)
        else:
            assert not isinstance(out, int)  # a stage before the last returns a hidden state
            self._send_activation(req, out, position=msg.position, is_prefill=msg.is_prefill, step=step, live=live)

    def _on_replay(self, msg: Replay) -> None:
        """A replacement of this stage's range: rebuild the KV cache from what the previous stage sent for the
        request, then pass on the output of the last position only (everything before it went round already)."""
        opened = msg.open
        self._ack(self.prev_addr, "replay", opened.request_id, self._replay_position(msg))
        taken = self.reqs.get(opened.request_id)
        if (taken is not None and taken.next_position > 0) or opened.request_id in self.finished:
            return  # a resent replay this stage already took
        t0 = time.monotonic()
        req = self._take_open(opened)
        if req is None:
            return
        for k, act in enumerate(msg.activations):
            hidden = self._check_activation(act, req)
            if hidden is None:
                self.log(f"stage {self.index}: replay of {opened.request_id} stopped at activation {k}")
                return
            self._take_activation(act, hidden, req, None, live=k == len(msg.activations) - 1)
        self.log(
            f"stage {self.index}: replayed {len(msg.activations)} activation(s) of request {opened.request_id} in "
            f"{time.monotonic() - t0:.2f} s"
        )

    @staticmethod
    def _replay_position(msg: Replay) -> int:
        return msg.activations[-1].position if msg.activations else -1

    def _replay_to_next(self) -> None:
        """Send each request in progress, as this stage sent it, to the stage that replaced the next one."""
        replayed = {
            r.request_id for r in self.reqs.values() if r.opened is not None and r.request_id not in self.finished
        }
        self.outbox.drop(lambda key, role: not (key[1] in replayed and role == "next"))  # the replays carry them
        for req in list(self.reqs.values()):
            if req.request_id not in replayed or req.opened is None:
                continue
            rid = req.request_id
            replay = Replay(
                open=self._stamp_open(req.opened),
                activations=[msgspec.structs.replace(a, epoch=self.epoch) for a in req.sent],
                epoch=self.epoch,
            )
            self.log(f"stage {self.index}: replaying request {rid} ({len(req.sent)} activation(s)) to the next stage")
            self._post("replay", rid, self._replay_position(replay), "next", replay)

    def _stamp_open(self, opened: RequestOpen) -> RequestOpen:
        return msgspec.structs.replace(opened, epoch=self.epoch)

    # --- last stage ---------------------------------------------------------------------------------------------------

    def _emit(self, req: _Request, token: int, position: int, step: int) -> None:
        """Record a sampled token; tell stage 0 and the client (and, when done, send the response)."""
        req.tokens.append(token)
        req.token_times.append(time.monotonic() - req.t0)
        reason = finish_reason(req.tokens, self.model.config.eos_id, req.max_tokens)
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
            self._send_traced(("token", req.request_id, position), "entry", msg, step, now_ns())
        if self.reliable or req.stream:
            streamed = StreamedToken(
                request_id=req.request_id, token_id=token, position=position, done=done, plan_id=self.plan_id
            )
            self._post("stream", req.request_id, position, "client:" + req.reply_to, streamed)
        if reason is not None:
            self._respond(req, reason)

    def _decode_alone(self, req: _Request, token: npt.NDArray[np.float16] | int) -> None:
        """N = 1: generate the whole answer here (the chain has no other stage to overlap with)."""
        position = req.prompt_tokens
        self._emit(req, int(token), position, step=0)
        while req.request_id in self.reqs:

            def next_token(position: int = position) -> npt.NDArray[np.float16] | int:
                return self.model.decode([req.tokens[-1]], position, req.slot)

            token = self._compute(req, len(req.tokens), next_token)
            position += 1
            self._emit(req, int(token), position, step=len(req.tokens))

    def _respond(self, req: _Request, reason: str) -> None:
        ids = visible(req.tokens, self.model.config.eos_id)
        assert self.tokenizer is not None  # the constructor insists on it for the last stage
        response = InferenceResponse(
            request_id=req.request_id,
            text=self.tokenizer.decode(ids),
            token_ids=ids,
            prompt_tokens=req.prompt_tokens,
            token_times=req.token_times,
            finish_reason=reason,
        )
        self._post("response", req.request_id, -1, "client:" + req.reply_to, response)
        self._finish(req.request_id)

    def _finish(self, request_id: str, served: bool = True) -> None:
        """The request is over here: free its slot, forget its state, remember its id (late duplicates are
        acknowledged)."""
        self.reqs.pop(request_id, None)
        self.finished[request_id] = None
        while len(self.finished) > FINISHED_KEPT:
            self.finished.popitem(last=False)
        if served:
            self.served += 1

    # --- helpers ------------------------------------------------------------------------------------------------------

    def _sender_role(self, msg: Message) -> tuple[str, str] | None:
        """(role, address) of the only member this stage takes ``msg`` from; None when any member may send it."""
        match msg:
            case InferenceRequest() | Resume() if self.seed is not None:
                return "the orchestrator", self.seed
            case RequestOpen() | RequestClose() | StageActivation() | Replay() if self.prev_addr is not None:
                return f"stage {self.index - 1}", self.prev_addr
            case NextToken():
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

    def _reply_to_ok(self, reply_to: str, what: str) -> bool:
        """Answers go to the orchestrator that asked, never to another address a frame names."""
        if self.seed is None or reply_to == self.seed:
            return True
        self.log(f"stage {self.index}: dropped {what} whose reply_to {reply_to[:120]!r} is not the orchestrator")
        return False

    def _known(self, request_id: str) -> bool:
        """Whether this stage took ``request_id`` already: in flight, waiting for a slot, or finished."""
        return (
            request_id in self.reqs
            or request_id in self.finished
            or any(w[0].request_id == request_id for w in self.waiting)
        )

    def _current(self, request_id: str, plan_id: str, what: str) -> _Request | None:
        if plan_id != self.plan_id:
            self.log(f"stage {self.index}: dropped {what} of plan {plan_id}, this stage serves {self.plan_id}")
            return None
        req = self.reqs.get(request_id)
        if req is None:
            self.log(f"stage {self.index}: dropped {what} for unknown request {request_id!r}")
        return req

    def _trace_rx(self, step: int, rx: Received | None) -> None:
        if self.tracer and rx is not None:
            self.tracer.add(step, "recv", rx.arrived_ns, rx.arrived_ns, rx.nbytes)
            self.tracer.add(step, "deserialize", rx.arrived_ns, rx.decoded_ns)

    def _compute(self, req: _Request, step: int, fn: Callable[[], _T]) -> _T:
        t0 = now_ns() if self.tracer else 0
        begin = getattr(self.model, "begin_step", None)  # a model that fans out to expert nodes keys its messages
        if begin is not None:
            begin(req.request_id, step)
        try:
            out = fn()
            if self.tracer:
                self.tracer.add(step, "compute", t0, now_ns())
            return out
        except HarnessError as exc:
            raise StageError(f"stage {self.index}: {exc}") from exc
        except Exception as exc:  # tinygrad raises plain exceptions; name the stage and the request
            raise StageError(
                f"stage {self.index}: compute failed for request {req.request_id}: {type(exc).__name__}: {exc}"
            ) from exc

    def _send_activation(
        self,
        req: _Request,
        hidden: npt.NDArray[np.float16],
        position: int,
        is_prefill: bool,
        step: int,
        live: bool = True,
    ) -> None:
        """Send the hidden state on (``live``), or only record it as sent (a replay: it went round already)."""
        assert self.next_addr is not None
        t0 = now_ns() if self.tracer else 0
        sent = self.digests.setdefault(req.request_id, [])
        sent.append(digest(hidden))
        while len(self.digests) > KEEP_REQUESTS:
            self.digests.popitem(last=False)
        data, shape = codec.pack_hidden(hidden, self.wire_dtype)
        msg = StageActivation(
            request_id=req.request_id,
            position=position,
            hidden=data,
            seq_len=shape[1],
            is_prefill=is_prefill,
            shape=shape,
            dtype=self.wire_dtype,
            plan_id=self.plan_id,
            epoch=self.epoch,
        )
        if self.keeps_history:
            req.sent.append(msg)
        if live:
            self._send_traced(("activation", req.request_id, position), "next", msg, step, t0)

    def _post(self, kind: str, request_id: str, position: int, role: str, msg: Message) -> None:
        """Send a message that must arrive: through the outbox (resent until acknowledged) unless the policy is
        none."""
        if self.reliable:
            self.outbox.put((kind, request_id, position), role, msg)
            return
        address = self._address_of(role)
        assert address is not None
        self.transport.send(address, msg)

    def _ack(self, to: str | None, kind: str, request_id: str, position: int) -> None:
        if self.reliable and to is not None:
            try:
                self.transport.send(to, ack_of(kind, request_id, position, self.plan_id))
            except HarnessError as exc:  # the sender resends; its next copy is acknowledged again
                self.log(f"stage {self.index}: acknowledging {kind} {position} failed: {exc}")

    def _address_of(self, role: str) -> str | None:
        match role:
            case "next":
                return self.next_addr
            case "entry":
                return self.entry_addr
        return role.removeprefix("client:")

    def _send_plain(self, address: str, msg: Message) -> Sent:
        return self.transport.send(address, msg)

    def _stamp(self, msg: Message) -> Message:
        """A message about to be sent again carries the stage's epoch now (the directory may have moved on)."""
        if isinstance(msg, StageActivation | NextToken | RequestOpen | RequestClose):
            return msgspec.structs.replace(msg, epoch=self.epoch)
        return msg

    def _send_traced(self, key: Key, role: str, msg: Message, step: int, t0: int) -> None:
        """Send a message on the token's way (through the outbox unless the policy is none); when tracing, record
        its serialisation (from ``t0``: packing the hidden state counts) and the send call."""
        if self.reliable:
            sent = self.outbox.put(key, role, msg)
        else:
            address = self._address_of(role)
            assert address is not None
            sent = self.transport.send(address, msg)
        if self.tracer and sent is not None:
            self.tracer.add(step, "serialize", t0, sent.encode_end_ns)
            self.tracer.add(step, "send", sent.encode_end_ns, sent.sent_ns, sent.nbytes)
