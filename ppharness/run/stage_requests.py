"""What a Stage records, and its requests' lifecycle: the model it computes with, where its neighbours are, the
requests in flight (each in a request slot) with each one's model calls that are ready to run, and how a request is
admitted, opened and closed. What happens to a token on its way through lives in ``ppharness.run.stage``.

Requests in flight: a stage serves up to ``slots`` requests at once, each in a request slot of its model (a KV cache of
its own), and takes their messages in whatever order they come; every message names its request. Stage 0 admits a
request when a slot is free, keeps up to ``queue`` more waiting (acknowledged, in order of arrival) and refuses the rest
with a busy Error that says so. When stage 0 learns a request is over (the last stage's ``done`` token) it frees the
slot and sends ``RequestClose`` down the chain, on the same ordered channel as the activations, so every middle stage
frees its slot before the next request's ``RequestOpen`` can arrive; the last stage frees its own when it answers.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgspec

from ppharness.errors import HarnessError, StageError
from ppharness.model.hidden import Hidden
from ppharness.plan.stages import ENTRY, EXIT, stage_name
from ppharness.run.reliable import EVERY_POSITION, Key, Outbox, RetryPolicy
from ppharness.seams.transport import Received, Transport
from ppharness.trace.tracer import Tracer, now_ns
from ppharness.wire.messages import (
    Error,
    InferenceRequest,
    Message,
    NextToken,
    RequestClose,
    RequestOpen,
    StageActivation,
)

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from ppharness.model.config import ModelConfig
    from ppharness.model.tokenizer import Tokenizer

FINISHED_KEPT = 64  # request ids a stage remembers as finished, to acknowledge late duplicates
QUEUE = 64  # stage 0's default: requests kept waiting for a free slot before more are refused


class StageModel(Protocol):
    """What a Stage computes with: a ``ppharness.model.slicing.ModelSlice``, or one with an injected fault
    (``ppharness.run.faults.FaultyModel``). ``prefill`` and ``decode`` take token ids (first stage) or an fp16
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

    @property
    def batched(self) -> bool:
        """Whether ``decode_rows`` runs several requests' positions in one call (``ppharness.model.batch``)."""
        ...

    def decode_rows(
        self, xs: Sequence[list[int] | npt.NDArray[np.float16]], positions: Sequence[int], slots: Sequence[int]
    ) -> list[npt.NDArray[np.float16] | int]: ...


@dataclass
class Request:
    """A request in flight on this stage, in its request slot."""

    request_id: str
    reply_to: str
    max_tokens: int
    prompt_tokens: int
    slot: int = 0  # the model's request slot (KV cache) this request computes in
    stream: bool = False  # last stage: send each token to reply_to as it is sampled
    next_position: int = 0  # the position this stage expects next (taken at receipt, computed or not)
    tokens: list[int] = field(default_factory=list)  # last stage: generated so far
    token_times: list[float] = field(default_factory=list)
    t0: float = 0.0
    rows: int = 1  # rows of a batch the request fills (one sequence): its hidden states are (rows, positions, width)
    work: deque[Work] = field(default_factory=deque)  # its model calls taken and not yet run, in position order
    # policy failover: what this stage sent down the chain for the request, for a replay to a replacement
    opened: RequestOpen | None = None
    sent: list[StageActivation] = field(default_factory=list)


@dataclass
class Work:
    """One model call of one request, ready to run: an item of the batch ``Stage.step`` runs. ``input``: token ids
    (the first stage) or the previous stage's hidden state, at ``position`` (0 with ``is_prefill``) in the request's
    slot. ``live``: the output goes on down the chain (False: only recorded, a replay rebuilding the cache;
    ``cascade``: and then the whole replay goes on);
    ``note``: logged once it ran, with the seconds since ``since`` (the end of a replay or a resume)."""

    request: Request
    position: int
    input: list[int] | Hidden
    is_prefill: bool
    step: int  # the trace's step: 0 the prefill, k the k-th decode
    rx: Received | None = None
    live: bool = True
    note: str = ""
    since: float = 0.0
    cascade: bool = False  # the last call of a replay this stage took: the whole replay goes on (``_cascade``)

    @property
    def slot(self) -> int:
        return self.request.slot


class StageState(ABC):
    """A stage's state and its requests' lifecycle; ``ppharness.run.stage.Stage`` acts on it (its docstring says how)
    and provides what is on a token's way: the sends and the checks of an activation (the abstract methods below).

    ``names`` is the directory (name -> address) from the cluster; next and previous stages are computed locally.
    ``seed`` is the orchestrator's address: the only member that may send requests, and the only one answered.
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
        tokenizer: Tokenizer | None = None,
        log: Callable[[str], None] = print,
        tracer: Tracer | None = None,
        seed: str | None = None,
        route: tuple[str, str] = ("", ""),
        policy: str = "none",
        retry: RetryPolicy | None = None,
        epoch: int = 0,
        queue: int = QUEUE,
        keep_digests: bool = True,
        max_batch: int = 0,
    ):
        """``route``: the names the activations come from and go to, as the compiled plan gives them (empty: the
        default pp-stage-{index -/+ 1}). ``policy``: none, retry or failover (``ppharness.run.stage``); ``retry`` its
        timings; ``epoch`` the directory's epoch ``names`` belongs to. ``queue``: on stage 0, how many requests may
        wait for a free slot (the model's ``slots`` say how many are served at once). ``keep_digests``: keep the
        digest of every hidden state sent, for a DigestRequest (``ppharness.model.exactness``). ``max_batch``: the
        most requests one step runs (0: every ready one); the rest run in the next step, so that several batches
        travel the chain at once and its stages compute at the same time."""
        self.index, self.num_stages = index, num_stages
        self.first, self.last = index == 0, index == num_stages - 1
        self.next_is_middle = index + 1 < num_stages - 1  # a stage that frees its slot on RequestClose
        self.model, self.transport, self.plan_id = model, transport, plan_id
        self.wire_dtype, self.tokenizer, self.log = wire_dtype, tokenizer, log
        prev, nxt = route
        self.route = (prev or stage_name(index - 1), nxt or stage_name(index + 1))
        self.epoch = epoch  # the directory's epoch this stage is at
        self.next_addr: str | None = None
        self.prev_addr: str | None = None
        self.entry_addr = self.exit_addr = ""
        self._resolve(names)
        self.outbox = Outbox(self.transport.send, self._address_of, retry or RetryPolicy(), stamp=self._stamp)
        self.seed = seed
        self.slots = getattr(model, "slots", 1)
        self.reqs: dict[str, Request] = {}  # the requests in flight here, by id, each in its own slot
        self.batches: deque[int] = deque(maxlen=4096)  # a batched model's calls: the rows of each, most recent last
        self.queue_limit = queue
        self.max_batch = max_batch
        self.waiting: deque[tuple[InferenceRequest, list[int], Received | None]] = deque()  # stage 0: admitted next
        self.served = 0
        self.tracer = tracer
        # digests of the hidden states sent, per request (the last few), for ppharness.model.exactness
        self.keeps_digests = keep_digests
        self.digests: OrderedDict[str, list[bytes]] = OrderedDict()
        self.policy = policy
        self.reliable, self.keeps_history = policy != "none", policy == "failover"
        self.finished: OrderedDict[str, None] = OrderedDict()
        if (self.first or self.last) and tokenizer is None:
            raise StageError(f"stage {index}: the first and last stages need the tokenizer")

    # --- what Stage provides: the sends and an activation's checks --------------------------------------------------

    @abstractmethod
    def _address_of(self, role: str) -> str | None: ...

    @abstractmethod
    def _send(
        self, key: Key, role: str, msg: Message, step: int | None = None, t0: int = 0, tensor: Hidden | None = None
    ) -> None: ...

    @abstractmethod
    def _ack(self, to: str | None, kind: str, request_id: str, position: int) -> None: ...

    @abstractmethod
    def _check_activation(self, msg: StageActivation, req: Request, rx: Received | None = None) -> Hidden | None: ...

    @abstractmethod
    def _take_activation(
        self, msg: StageActivation, hidden: Hidden, req: Request, rx: Received | None, live: bool
    ) -> Work: ...

    # --- the directory and the loop's timer ---------------------------------------------------------------------------

    def _resolve(self, names: dict[str, str]) -> None:
        """Read the neighbours' addresses from a directory."""
        prev, nxt = self.route
        self.next_addr = None if self.last else names[nxt]
        self.prev_addr = None if self.first else names[prev]
        self.entry_addr = names[ENTRY]
        self.exit_addr = names[EXIT]

    def _stamp(self, msg: Message) -> Message:
        """A message about to be sent again carries the stage's epoch now (the directory may have moved on)."""
        if isinstance(msg, StageActivation | NextToken | RequestOpen | RequestClose):
            return msgspec.structs.replace(msg, epoch=self.epoch)
        return msg

    def due_in(self) -> float | None:
        """Seconds until a message awaiting its acknowledgement is due to be sent again (None: nothing waits)."""
        return self.outbox.due_in()

    def tick(self) -> None:
        """Send again what is due; a message unacknowledged past the retry budget raises StageError."""
        try:
            self.outbox.tick()
        except HarnessError as exc:
            raise StageError(f"stage {self.index}: {exc}") from exc

    # --- stage 0: admission -------------------------------------------------------------------------------------------

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

    def _admit_waiting(self) -> None:
        """Stage 0: start the waiting requests, oldest first, while a slot is free."""
        while self.waiting and self._free_slot() is not None:
            msg, ids, rx = self.waiting.popleft()
            req = self._open(msg.request_id, msg, ids)  # the RequestOpen goes down the chain now
            req.work.append(Work(req, 0, ids, is_prefill=True, step=0, rx=rx))

    def _tokenize(self, prompt: str, request_id: str) -> list[int]:
        cfg = self.model.config
        assert self.tokenizer is not None  # the constructor insists on it for the first stage
        t0 = now_ns() if self.tracer else 0
        ids = ([cfg.bos_id] if cfg.bos_id is not None else []) + self.tokenizer.encode(prompt)
        if self.tracer:
            self.tracer.begin(request_id)
            self.tracer.add(0, "tokenize", t0, now_ns())
        return ids

    def _open(self, request_id: str, msg: InferenceRequest, ids: list[int]) -> Request:
        """Stage 0 takes a request into a free slot: its state, and the RequestOpen down the chain."""
        slot = self._free_slot()
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
        )
        self.reqs[request_id] = req
        if not self.last:
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
            self._send(("open", request_id, -1), "next", opened)
        return req

    # --- later stages: open and close ---------------------------------------------------------------------------------

    def _on_open(self, msg: RequestOpen) -> None:
        if not self._reply_to_ok(msg.reply_to, "RequestOpen"):
            return
        if msg.plan_id != self.plan_id:
            self.log(f"stage {self.index}: dropped RequestOpen of plan {msg.plan_id}, this stage serves {self.plan_id}")
            return
        if self.reliable and self._known(msg.request_id):
            self._ack(self.prev_addr, "open", msg.request_id, -1)  # a resent RequestOpen already taken
            return
        if self._take_open(msg) is not None:  # unacknowledged when refused: a resent copy may find a slot free
            self._ack(self.prev_addr, "open", msg.request_id, -1)

    def _take_open(self, msg: RequestOpen) -> Request | None:
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
        req = Request(
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
        if not self.last:
            opened = self._stamp_open(msg)
            if self.keeps_history:
                req.opened = opened
            self._send(("open", msg.request_id, -1), "next", opened)
        return req

    def _stamp_open(self, opened: RequestOpen) -> RequestOpen:
        return msgspec.structs.replace(opened, epoch=self.epoch)

    def _on_close(self, msg: RequestClose) -> None:
        """Stage 0 says a request is over: free its slot, and tell the next stage unless that is the last (which
        freed its own when it answered)."""
        if msg.plan_id != self.plan_id:
            self.log(
                f"stage {self.index}: dropped RequestClose of plan {msg.plan_id}, this stage serves {self.plan_id}"
            )
            return
        self._ack(self.prev_addr, "close", msg.request_id, -1)
        if self.reliable:  # stage 0 had the last token: every hop took every position
            self.outbox.settle_through("activation", msg.request_id, EVERY_POSITION)
        if msg.request_id not in self.reqs:
            return  # a copy of one already taken, or of a request this stage never saw (its open was refused)
        self._finish(msg.request_id)
        if self.next_is_middle:
            self._send(("close", msg.request_id, -1), "next", msgspec.structs.replace(msg, epoch=self.epoch))

    # --- every stage --------------------------------------------------------------------------------------------------

    def _finish(self, request_id: str, served: bool = True) -> None:
        """The request is over here: free its slot, forget its state, remember its id (late duplicates are
        acknowledged)."""
        self.reqs.pop(request_id, None)
        self.finished[request_id] = None
        while len(self.finished) > FINISHED_KEPT:
            self.finished.popitem(last=False)
        if served:
            self.served += 1

    def _free_slot(self) -> int | None:
        used = {r.slot for r in self.reqs.values()}
        return next((k for k in range(self.slots) if k not in used), None)

    def _known(self, request_id: str) -> bool:
        """Whether this stage took ``request_id`` already: in flight, waiting for a slot, or finished."""
        return (
            request_id in self.reqs
            or request_id in self.finished
            or any(w[0].request_id == request_id for w in self.waiting)
        )

    def _reply_to_ok(self, reply_to: str, what: str) -> bool:
        """Answers go to the orchestrator that asked, never to another address a frame names."""
        if self.seed is None or reply_to == self.seed:
            return True
        self.log(f"stage {self.index}: dropped {what} whose reply_to {reply_to[:120]!r} is not the orchestrator")
        return False
