"""One Stage class for any N >= 1; its role (first / middle / last) follows from the index alone.

The token's way, as DESIGN.md draws it::

    InferenceRequest -> stage 0 (tokenize, embed, blocks) -RequestOpen, StageActivation-> ... -> stage N-1 (blocks,
    norm, head, argmax) -NextToken-> stage 0 -> ... until EOS or max_tokens; stage N-1 -InferenceResponse-> reply_to.

A stage serves one request at a time (batch 1). Messages that do not fit its state (a stale plan, an unknown request, a
duplicate position) are logged and dropped, never fatal; a failure of the model itself raises ``StageError``.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from ppharness.errors import CodecError, HarnessError, StageError
from ppharness.model.decoding import finish_reason, visible
from ppharness.model.exactness import digest
from ppharness.plan.stages import ENTRY, EXIT, stage_name
from ppharness.seams.transport import Received, Transport
from ppharness.trace.tracer import KEEP_REQUESTS, Tracer, now_ns
from ppharness.wire import codec
from ppharness.wire.messages import (
    Error,
    InferenceRequest,
    InferenceResponse,
    Message,
    NextToken,
    RequestOpen,
    StageActivation,
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
    ):
        """``route``: the names the activations come from and go to, as the compiled plan gives them (empty: the
        SPEC's pp-stage-{index -/+ 1})."""
        self.index, self.num_stages = index, num_stages
        self.first, self.last = index == 0, index == num_stages - 1
        self.model, self.transport, self.plan_id = model, transport, plan_id
        self.wire_dtype, self.tokenizer, self.log = wire_dtype, tokenizer, log
        prev, nxt = route
        self.next_addr = None if self.last else names[nxt or stage_name(index + 1)]
        self.prev_addr = None if self.first else names[prev or stage_name(index - 1)]
        self.entry_addr = names[ENTRY]
        self.exit_addr = names[EXIT]
        self.seed = seed
        self.req: _Request | None = None
        self.served = 0
        self.tracer = tracer
        # digests of the hidden states sent, per request (the last few), for ppharness.model.exactness
        self.digests: OrderedDict[str, list[bytes]] = OrderedDict()
        if (self.first or self.last) and tokenizer is None:
            raise StageError(f"stage {index}: the first and last stages need the tokenizer")

    # --- dispatch ---------------------------------------------------------------------------------------------------

    def handle(self, sender: str, msg: Message, rx: Received | None = None) -> None:
        """Act on one message. Protocol violations are dropped with a log line; model failures raise StageError.

        ``rx``: the transport's receipt of the message (arrival and decoding times, size), for the trace.
        """
        role = self._sender_role(msg)
        if role is not None and sender != role[1]:
            self.log(f"stage {self.index}: dropped {type(msg).__name__} from {sender}: only {role[0]} sends it")
            return
        match msg:
            case InferenceRequest() if self.first:
                self._on_request(msg, rx)
            case RequestOpen() if not self.first:
                self._on_open(msg)
            case StageActivation() if not self.first:
                self._on_activation(msg, rx)
            case NextToken() if self.first and not self.last:
                self._on_next_token(msg, rx)
            case _:
                self.log(f"stage {self.index}: dropped unexpected {type(msg).__name__} from {sender}")

    # --- first stage ------------------------------------------------------------------------------------------------

    def _on_request(self, msg: InferenceRequest, rx: Received | None) -> None:
        if not self._reply_to_ok(msg.reply_to, "InferenceRequest"):
            return
        request_id = msg.request_id or uuid.uuid4().hex[:12]
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
        cfg = self.model.config
        assert self.tokenizer is not None  # the constructor insists on it for the first stage
        if self.tracer:
            self.tracer.begin(request_id)
            self._trace_rx(0, rx)
            t0 = now_ns()
        ids = ([cfg.bos_id] if cfg.bos_id is not None else []) + self.tokenizer.encode(msg.prompt)
        if self.tracer:
            self.tracer.add(0, "tokenize", t0, now_ns())
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
        self.req = _Request(
            request_id, msg.reply_to, msg.max_tokens, len(ids), next_position=len(ids), t0=time.monotonic()
        )
        if self.next_addr is not None:  # not the last stage
            self.transport.send(
                self.next_addr,
                RequestOpen(
                    request_id=request_id,
                    reply_to=msg.reply_to,
                    max_tokens=msg.max_tokens,
                    prompt_tokens=len(ids),
                    plan_id=self.plan_id,
                ),
            )
        out = self._compute(0, lambda: self.model.prefill(ids))
        if self.last:  # N = 1: this stage is the whole chain
            self._decode_alone(out)
        else:
            assert not isinstance(out, int)  # a stage before the last returns a hidden state
            self._send_activation(out, position=0, is_prefill=True, step=0)

    def _on_next_token(self, msg: NextToken, rx: Received | None) -> None:
        req = self._current(msg.request_id, msg.plan_id, "NextToken")
        if req is None:
            return
        step = msg.position - req.prompt_tokens + 1
        self._trace_rx(step, rx)
        if msg.done:
            self.req = None
            self.served += 1
            return
        if msg.position != req.next_position:
            self.log(f"stage 0: dropped NextToken at position {msg.position}, expected {req.next_position}")
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
        self.req = _Request(msg.request_id, msg.reply_to, msg.max_tokens, msg.prompt_tokens, t0=time.monotonic())
        if self.tracer:
            self.tracer.begin(msg.request_id)
        if self.next_addr is not None:  # not the last stage
            self.transport.send(self.next_addr, msg)

    def _on_activation(self, msg: StageActivation, rx: Received | None) -> None:
        req = self._current(msg.request_id, msg.plan_id, "StageActivation")
        if req is None:
            return
        if msg.position < req.next_position:
            self.log(f"stage {self.index}: dropped duplicate activation at position {msg.position}")
            return
        if msg.position != req.next_position or msg.is_prefill != (msg.position == 0):
            self.log(
                f"stage {self.index}: dropped activation at position {msg.position} (prefill={msg.is_prefill}), "
                f"expected position {req.next_position}"
            )
            return
        want = req.prompt_tokens if msg.is_prefill else 1
        if msg.seq_len != want or tuple(msg.shape) != (1, want, self.model.config.dim):
            self.log(
                f"stage {self.index}: dropped activation of shape {tuple(msg.shape)} (seq_len {msg.seq_len}) at "
                f"position {msg.position}: the plan expects (1, {want}, {self.model.config.dim})"
            )
            return
        step = 0 if msg.is_prefill else msg.position - req.prompt_tokens + 1
        self._trace_rx(step, rx)
        t0 = now_ns() if self.tracer else 0
        try:
            hidden = codec.unpack_hidden(msg)
            if self.tracer:
                self.tracer.add(step, "deserialize", t0, now_ns())
        except CodecError as exc:
            self.log(f"stage {self.index}: dropped activation: {exc}")
            return
        if hidden.shape != (1, want, self.model.config.dim):
            self.log(
                f"stage {self.index}: dropped activation of shape {hidden.shape}, expected (1, {msg.seq_len}, "
                f"{self.model.config.dim})"
            )
            return
        req.next_position = msg.position + msg.seq_len
        if msg.is_prefill:
            out = self._compute(step, lambda: self.model.prefill(hidden))
        else:
            out = self._compute(step, lambda: self.model.decode(hidden, msg.position))
        if self.last:
            self._emit(int(out), position=req.next_position, step=step)
        else:
            assert not isinstance(out, int)  # a stage before the last returns a hidden state
            self._send_activation(out, position=msg.position, is_prefill=msg.is_prefill, step=step)

    # --- last stage ---------------------------------------------------------------------------------------------------

    def _emit(self, token: int, position: int, step: int) -> None:
        """Record a sampled token; tell stage 0 (and, when done, ``reply_to``)."""
        req = self.req
        assert req is not None
        req.tokens.append(token)
        req.token_times.append(time.monotonic() - req.t0)
        reason = finish_reason(req.tokens, self.model.config.eos_id, req.max_tokens)
        if not self.first:
            self._send(
                self.entry_addr,
                NextToken(
                    request_id=req.request_id,
                    token_id=token,
                    position=position,
                    done=reason is not None,
                    plan_id=self.plan_id,
                ),
                step,
                now_ns(),
            )
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
        self.transport.send(
            req.reply_to,
            InferenceResponse(
                request_id=req.request_id,
                text=self.tokenizer.decode(ids),
                token_ids=ids,
                prompt_tokens=req.prompt_tokens,
                token_times=req.token_times,
                finish_reason=reason,
            ),
        )
        self.req = None
        self.served += 1

    # --- helpers ------------------------------------------------------------------------------------------------------

    def _sender_role(self, msg: Message) -> tuple[str, str] | None:
        """(role, address) of the only member this stage takes ``msg`` from; None when any member may send it."""
        match msg:
            case InferenceRequest() if self.seed is not None:
                return "the orchestrator", self.seed
            case RequestOpen() | StageActivation() if self.prev_addr is not None:
                return f"stage {self.index - 1}", self.prev_addr
            case NextToken():
                return f"stage {self.num_stages - 1}", self.exit_addr
        return None

    def _reply_to_ok(self, reply_to: str, what: str) -> bool:
        """Answers go to the orchestrator that asked, never to another address a frame names."""
        if self.seed is None or reply_to == self.seed:
            return True
        self.log(f"stage {self.index}: dropped {what} whose reply_to {reply_to[:120]!r} is not the orchestrator")
        return False

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

    def _send_activation(self, hidden: npt.NDArray[np.float16], position: int, is_prefill: bool, step: int) -> None:
        assert self.req is not None and self.next_addr is not None
        t0 = now_ns() if self.tracer else 0
        sent = self.digests.setdefault(self.req.request_id, [])
        sent.append(digest(hidden))
        while len(self.digests) > KEEP_REQUESTS:
            self.digests.popitem(last=False)
        data, shape = codec.pack_hidden(hidden, self.wire_dtype)
        self._send(
            self.next_addr,
            StageActivation(
                request_id=self.req.request_id,
                position=position,
                hidden=data,
                seq_len=shape[1],
                is_prefill=is_prefill,
                shape=shape,
                dtype=self.wire_dtype,
                plan_id=self.plan_id,
            ),
            step,
            t0,
        )

    def _send(self, address: str, msg: Message, step: int, t0: int) -> None:
        """Send ``msg``; when tracing, record its serialisation (from ``t0``: packing the hidden state counts) and the
        send call."""
        sent = self.transport.send(address, msg)
        if self.tracer:
            self.tracer.add(step, "serialize", t0, sent.encode_end_ns)
            self.tracer.add(step, "send", sent.encode_end_ns, sent.sent_ns, sent.nbytes)
