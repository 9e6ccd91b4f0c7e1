"""One Stage class for any N >= 1; its role (first / middle / last) follows from the index alone.

The token's way, as DESIGN.md draws it::

    InferenceRequest -> stage 0 (tokenize, embed, blocks) -RequestOpen, StageActivation-> ... -> stage N-1 (blocks,
    norm, head, argmax) -NextToken-> stage 0 -> ... until EOS or max_tokens; stage N-1 -InferenceResponse-> reply_to.

A stage serves one request at a time (batch 1). Messages that do not fit its state (a stale plan, an unknown request, a
duplicate position) are logged and dropped, never fatal; a failure of the model itself raises ``StageError``.

Fault tolerance, by the run's policy:

- ``none``: each message is sent once; a lost one ends the run (the orchestrator's budget runs out).
- ``retry``: every hop is idempotent (``ppharness.run.reliable``): the receiver acknowledges each copy of a message and
  acts on the first; the sender resends until acknowledged. The last stage also streams each token to the client.
- ``failover``: besides, each stage keeps what it sent down the chain for the request in progress. When a spare
  replaces the next stage (a newer directory names another address for it), the stage replays that to the spare, which
  rebuilds its KV cache by the very calls that built the lost one (one prefill, then one decode per position: a
  single longer prefill is not bit-identical in fp16) and passes only the last output on. A replacement of stage 0 is
  resumed by the orchestrator, which holds the prompt and the streamed tokens. Messages from an older epoch (a
  replaced node that came back) are refused.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
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

    def prefill(self, x: list[int] | npt.NDArray[np.float16]) -> npt.NDArray[np.float16] | int: ...

    def decode(self, x: list[int] | npt.NDArray[np.float16], position: int) -> npt.NDArray[np.float16] | int: ...


@dataclass
class _Request:
    request_id: str
    reply_to: str
    max_tokens: int
    prompt_tokens: int
    next_position: int = 0  # the position this stage expects next
    tokens: list[int] = field(default_factory=list)  # last stage: generated so far
    token_times: list[float] = field(default_factory=list)
    t0: float = 0.0
    # policy failover: what this stage sent down the chain for the request, for a replay to a replacement
    opened: RequestOpen | None = None
    sent: list[StageActivation] = field(default_factory=list)


FINISHED_KEPT = 64  # request ids a stage remembers as finished, to acknowledge late duplicates


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
    ):
        """``route``: the names the activations come from and go to, as the compiled plan gives them (empty: the
        SPEC's pp-stage-{index -/+ 1}). ``policy``: none, retry or failover (module docstring); ``retry`` its
        timings; ``epoch`` the directory's epoch ``names`` belongs to."""
        self.index, self.num_stages = index, num_stages
        self.first, self.last = index == 0, index == num_stages - 1
        self.model, self.transport, self.plan_id = model, transport, plan_id
        self.wire_dtype, self.tokenizer, self.log = wire_dtype, tokenizer, log
        prev, nxt = route
        self._route = (prev or stage_name(index - 1), nxt or stage_name(index + 1))
        self.epoch = epoch
        self._resolve_names(names)
        self.seed = seed
        self.req: _Request | None = None
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
        if self.reliable and msg.request_id and (self._is_current(request_id) or request_id in self.finished):
            self._ack(msg.reply_to, "request", request_id, -1)  # a resent request this stage already took
            return
        if self.req is not None:
            self.transport.send(
                msg.reply_to,
                Error(
                    stage=self.index,
                    request_id=request_id,
                    reason=f"stage 0 is busy with request {self.req.request_id}",
                    busy=True,
                ),
            )
            return
        if self.tracer:
            self.tracer.begin(request_id)
            self._trace_rx(0, rx)
        ids = self._tokenize(msg.prompt)
        room = self.model.max_context - len(ids)
        if msg.max_tokens < 1 or msg.max_tokens > room:
            self.transport.send(
                msg.reply_to,
                Error(
                    stage=self.index,
                    request_id=request_id,
                    reason=(
                        f"max_tokens {msg.max_tokens} must be in 1..{room}: the prompt is {len(ids)} tokens of a "
                        f"{self.model.max_context}-token context"
                    ),
                ),
            )
            return
        self._ack(msg.reply_to, "request", request_id, -1)
        self._open(request_id, msg, ids)
        out = self._compute(0, lambda: self.model.prefill(ids))
        if self.last:  # N = 1: this stage is the whole chain
            self._decode_alone(out)
        else:
            assert not isinstance(out, int)  # a stage before the last returns a hidden state
            self._send_activation(out, position=0, is_prefill=True, step=0)

    def _tokenize(self, prompt: str) -> list[int]:
        cfg = self.model.config
        assert self.tokenizer is not None  # the constructor insists on it for the first stage
        t0 = now_ns() if self.tracer else 0
        ids = ([cfg.bos_id] if cfg.bos_id is not None else []) + self.tokenizer.encode(prompt)
        if self.tracer:
            self.tracer.add(0, "tokenize", t0, now_ns())
        return ids

    def _open(self, request_id: str, msg: InferenceRequest, ids: list[int]) -> None:
        """Stage 0 takes a request: its state, and the RequestOpen down the chain."""
        self.req = _Request(
            request_id, msg.reply_to, msg.max_tokens, len(ids), next_position=len(ids), t0=time.monotonic()
        )
        if self.next_addr is not None:  # not the last stage
            opened = RequestOpen(
                request_id=request_id,
                reply_to=msg.reply_to,
                max_tokens=msg.max_tokens,
                prompt_tokens=len(ids),
                plan_id=self.plan_id,
                epoch=self.epoch,
            )
            if self.keeps_history:
                self.req.opened = opened
            self._post("open", request_id, -1, "next", opened)

    def _on_resume(self, msg: Resume) -> None:
        """A replacement of stage 0: replay the prompt and the tokens so far through this stage's blocks, then go on
        from the last token as if it had just come back from the last stage."""
        req_msg = msg.request
        if self._is_current(req_msg.request_id) or req_msg.request_id in self.finished:
            self._ack(req_msg.reply_to, "resume", req_msg.request_id, -1)
            return
        if self.req is not None or not self._reply_to_ok(req_msg.reply_to, "Resume"):
            self.log(f"stage 0: dropped Resume of {req_msg.request_id}: busy with another request")
            return
        self._ack(req_msg.reply_to, "resume", req_msg.request_id, -1)
        ids = self._tokenize(req_msg.prompt)
        self._open(req_msg.request_id, req_msg, ids)
        req = self.req
        assert req is not None
        t0 = time.monotonic()
        out = self._compute(0, lambda: self.model.prefill(ids))
        if self.last:  # N = 1: the tokens are generated again (the client drops those it has), then on alone
            self._decode_alone(out)
            return
        position, is_prefill = 0, True  # where ``out`` belongs
        for k, token in enumerate(msg.tokens):
            assert not isinstance(out, int)  # a stage before the last returns a hidden state
            self._send_activation(out, position, is_prefill, step=k, live=False)  # it went round already
            position, is_prefill = req.next_position, False

            def decode(token: int = token, position: int = position) -> npt.NDArray[np.float16] | int:
                return self.model.decode([token], position)

            out = self._compute(k + 1, decode)
            req.next_position += 1
        assert not isinstance(out, int)
        self.log(
            f"stage 0: resumed request {req.request_id}: replayed the prompt and {len(msg.tokens)} token(s) in "
            f"{time.monotonic() - t0:.2f} s"
        )
        self._send_activation(out, position, is_prefill, step=len(msg.tokens))

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
        self._trace_rx(step, rx)
        if msg.done:
            self._finish(req.request_id)
            return
        req.next_position += 1
        out = self._compute(step, lambda: self.model.decode([msg.token_id], msg.position))
        assert not isinstance(out, int)  # a stage before the last returns a hidden state
        self._send_activation(out, position=msg.position, is_prefill=False, step=step)

    # --- later stages -----------------------------------------------------------------------------------------------

    def _on_open(self, msg: RequestOpen) -> None:
        if not self._reply_to_ok(msg.reply_to, "RequestOpen"):
            return
        if msg.plan_id != self.plan_id:
            self.log(f"stage {self.index}: dropped RequestOpen of plan {msg.plan_id}, this stage serves {self.plan_id}")
            return
        if self.reliable and (self._is_current(msg.request_id) or msg.request_id in self.finished):
            self._ack(self.prev_addr, "open", msg.request_id, -1)  # a resent RequestOpen this stage already took
            return
        self._ack(self.prev_addr, "open", msg.request_id, -1)
        self._take_open(msg)

    def _take_open(self, msg: RequestOpen) -> None:
        if self.req is not None and self.req.request_id != msg.request_id:
            self._finish(self.req.request_id, served=False)
        self.req = _Request(msg.request_id, msg.reply_to, msg.max_tokens, msg.prompt_tokens, t0=time.monotonic())
        if self.tracer:
            self.tracer.begin(msg.request_id)
        if self.next_addr is not None:  # not the last stage
            opened = msgspec.structs.replace(msg, epoch=self.epoch)
            if self.keeps_history:
                self.req.opened = opened
            self._post("open", msg.request_id, -1, "next", opened)

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
            out = self._compute(step, lambda: self.model.prefill(hidden))
        else:
            out = self._compute(step, lambda: self.model.decode(hidden, msg.position))
        if self.last:
            if live:
                self._emit(int(out), position=req.next_position, step=step)
            else:
                req.tokens.append(int(out))
                req.token_times.append(time.monotonic() - req.t0)
        else:
            assert not isinstance(out, int)  # a stage before the last returns a hidden state
            self._send_activation(out, position=msg.position, is_prefill=msg.is_prefill, step=step, live=live)

    def _on_replay(self, msg: Replay) -> None:
        """A replacement of this stage's range: rebuild the KV cache from what the previous stage sent for the
        request, then pass on the output of the last position only (everything before it went round already)."""
        opened = msg.open
        self._ack(self.prev_addr, "replay", opened.request_id, self._replay_position(msg))
        if self._is_current(opened.request_id) and self.req is not None and self.req.next_position > 0:
            return  # a resent replay this stage already took
        t0 = time.monotonic()
        self._take_open(opened)
        req = self.req
        assert req is not None
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
        """Send the request in progress, as this stage sent it, to the stage that replaced the next one."""
        req = self.req
        if req is None or req.opened is None or req.request_id in self.finished:
            return
        rid = req.request_id
        self.outbox.drop(lambda key, role: not (key[1] == rid and role == "next"))  # the replay carries them
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

    def _emit(self, token: int, position: int, step: int) -> None:
        """Record a sampled token; tell stage 0 and the client (and, when done, send the response)."""
        req = self.req
        assert req is not None
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
        if self.reliable:
            streamed = StreamedToken(
                request_id=req.request_id, token_id=token, position=position, done=done, plan_id=self.plan_id
            )
            self.outbox.put(("stream", req.request_id, position), "client:" + req.reply_to, streamed)
        if reason is not None:
            self._respond(reason)

    def _decode_alone(self, token: npt.NDArray[np.float16] | int) -> None:
        req = self.req
        assert req is not None
        position = req.prompt_tokens
        self._emit(int(token), position, step=0)
        while self.req is not None:

            def next_token(position: int = position) -> npt.NDArray[np.float16] | int:
                return self.model.decode([req.tokens[-1]], position)

            token = self._compute(len(req.tokens), next_token)
            position += 1
            self._emit(int(token), position, step=len(req.tokens))

    def _respond(self, reason: str) -> None:
        req = self.req
        assert req is not None
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
        """The request is over here: forget its state, remember its id (late duplicates are acknowledged)."""
        if self.req is not None and self.req.request_id == request_id:
            self.req = None
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
            case RequestOpen() | StageActivation() | Replay() if self.prev_addr is not None:
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

    def _is_current(self, request_id: str) -> bool:
        return self.req is not None and self.req.request_id == request_id

    def _current(self, request_id: str, plan_id: str, what: str) -> _Request | None:
        if plan_id != self.plan_id:
            self.log(f"stage {self.index}: dropped {what} of plan {plan_id}, this stage serves {self.plan_id}")
            return None
        if self.req is None or self.req.request_id != request_id:
            self.log(f"stage {self.index}: dropped {what} for unknown request {request_id!r}")
            return None
        return self.req

    def _trace_rx(self, step: int, rx: Received | None) -> None:
        if self.tracer and rx is not None:
            self.tracer.add(step, "recv", rx.arrived_ns, rx.arrived_ns, rx.nbytes)
            self.tracer.add(step, "deserialize", rx.arrived_ns, rx.decoded_ns)

    def _compute(self, step: int, fn: Callable[[], _T]) -> _T:
        t0 = now_ns() if self.tracer else 0
        begin = getattr(self.model, "begin_step", None)  # a model that fans out to expert nodes keys its messages
        if begin is not None and self.req is not None:
            begin(self.req.request_id, step)
        try:
            out = fn()
            if self.tracer:
                self.tracer.add(step, "compute", t0, now_ns())
            return out
        except HarnessError as exc:
            raise StageError(f"stage {self.index}: {exc}") from exc
        except Exception as exc:  # tinygrad raises plain exceptions; name the stage and the request
            rid = self.req.request_id if self.req else "?"
            raise StageError(
                f"stage {self.index}: compute failed for request {rid}: {type(exc).__name__}: {exc}"
            ) from exc

    def _send_activation(
        self, hidden: npt.NDArray[np.float16], position: int, is_prefill: bool, step: int, live: bool = True
    ) -> None:
        """Send the hidden state on (``live``), or only record it as sent (a replay: it went round already)."""
        req = self.req
        assert req is not None and self.next_addr is not None
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
        if isinstance(msg, StageActivation | NextToken | RequestOpen):
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
