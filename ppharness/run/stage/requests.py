"""What a Stage records: the model it computes with, where its neighbours are, the requests in flight (each in a
request slot) with each one's model calls that are ready to run, and the run's policy; and what arrives checked
against that record (a position out of turn, a conflicting copy, an activation taken as its request's next model
call: ``accept_activation``). One ``StageState`` is held by each of the stage's parts and read directly by whoever
holds the stage (``stage.state``; ``ppharness.run.stage.stage`` says which part does what); it sends nothing but the
one Error that names a misbehaving member to the seed, and computes nothing.

Requests in flight: a stage serves up to ``slots`` requests at once, each in a request slot of its model (a KV cache of
its own), and takes their messages in whatever order they come; every message names its request. Stage 0 admits a
request when a slot is free, keeps up to ``queue`` more waiting (acknowledged, in order of arrival) and refuses the rest
with a busy Error that says so. When stage 0 learns a request is over (the last stage's ``done`` token) it frees the
slot and sends ``RequestClose`` down the chain, on the same ordered channel as the activations, so every middle stage
frees its slot before the next request's ``RequestOpen`` can arrive; the last stage frees its own when it answers
(``ppharness.run.stage.admission``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ppharness.errors import CodecError, HarnessError, StageError
from ppharness.model.engine.hidden import Hidden
from ppharness.plan.stages import ENTRY, EXIT, stage_name
from ppharness.run.stage.speculation import Speculation, Window
from ppharness.seams.transport import Received, Transport
from ppharness.trace.drops import DropLog, fingerprinted
from ppharness.trace.tracer import Tracer, now_ns
from ppharness.wire import codec
from ppharness.wire.messages import Error, InferenceRequest, RequestOpen, StageActivation

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from tinygrad.tensor import Tensor

    from ppharness.model.gguf.config import ModelConfig
    from ppharness.model.text.tokenizer import Tokenizer

FINISHED_KEPT = 64  # request ids a stage remembers as finished, to acknowledge late duplicates
QUEUE = 64  # stage 0's default: requests kept waiting for a free slot before more are refused


class StageModel(Protocol):
    """What a Stage computes with: a ``ppharness.model.engine.slicing.ModelSlice``, or one with an injected fault
    (``ppharness.run.node.faults.FaultyModel``). ``prefill`` and ``decode`` take token ids (first stage) or an fp16
    hidden state (1, T, D), and return a hidden state, or on the last stage the next token id."""

    @property
    def config(self) -> ModelConfig: ...

    @property
    def max_context(self) -> int: ...

    @property
    def slots(self) -> int: ...

    def prefill(self, x: list[int] | npt.NDArray[np.float16], slot: int = 0) -> npt.NDArray[np.float16] | int: ...

    def decode(
        self, x: list[int] | npt.NDArray[np.float16] | Tensor, position: int, slot: int = 0
    ) -> npt.NDArray[np.float16] | Tensor | int:
        """One position; ``x`` may be a co-located stage's output left on the device, and the output may stay there
        (``ppharness.model.engine.hidden``)."""
        ...

    @property
    def batched(self) -> bool:
        """Whether ``decode_rows`` runs several requests' positions in one call (``ppharness.model.layers.rows``)."""
        ...

    def decode_rows(
        self, xs: Sequence[list[int] | npt.NDArray[np.float16]], positions: Sequence[int], slots: Sequence[int]
    ) -> list[npt.NDArray[np.float16] | int]: ...

    def decode_window(
        self, xs: Sequence[list[int] | npt.NDArray[np.float16]], start: int, slot: int
    ) -> list[npt.NDArray[np.float16] | int]:
        """A speculative window: rows of one request slot at positions ``start``, ``start + 1``, ...
        (``ppharness.run.stage.speculation``)."""
        ...


@dataclass
class Request:
    """A request in flight on this stage, in its request slot."""

    request_id: str
    reply_to: str
    max_tokens: int
    prompt_tokens: int
    slot: int = 0  # the model's request slot (KV cache) this request computes in
    stream: bool = False  # last stage: send each token to reply_to as it is sampled
    digests: bool = True  # keep the digest of each hidden state sent for it (when the stage keeps digests)
    next_position: int = 0  # the position this stage expects next (taken at receipt, computed or not)
    tokens: list[int] = field(default_factory=list)  # last stage: generated so far
    token_times: list[float] = field(default_factory=list)
    t0: float = 0.0
    rows: int = 1  # rows of a batch the request fills (one sequence): its hidden states are (rows, positions, width)
    work: deque[Work] = field(default_factory=deque)  # its model calls taken and not yet run, in position order
    # policy failover: what this stage sent down the chain for the request, for a replay to a replacement
    opened: RequestOpen | None = None
    sent: list[StageActivation] = field(default_factory=list)
    # speculation (ppharness.run.stage.speculation): the last window's trip this stage took (stage 0: sent); stage 0's
    # prompt and committed answer, and its windows in flight
    trip: int = 0
    context: list[int] = field(default_factory=list)
    flight: deque[Window] = field(default_factory=deque)
    speculate: bool = True  # stage 0: draft for it (False: windows of one row)
    verified: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # last stage: trips, drafted, accepted, rejected
    window_drafts: list[int] = field(default_factory=list)  # last stage: each verified window's drafted tokens
    window_accepted: list[int] = field(default_factory=list)  # and the drafts it accepted
    received: dict[int, bytes] = field(default_factory=dict)  # digests of the activations taken, by position


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
    cascade: bool = False  # the last call of a replay this stage took: the whole replay goes on (``cascade``)
    tokens: list[int] | None = None  # a speculative window's rows' tokens on stage 0 (None: one decode position)
    trip: int = 0  # the window's trip number


class StageState:
    """What a stage records, shared by its parts: who it is, what it computes with, its neighbours' addresses (from
    the directory of ``epoch``), the requests in flight and waiting, the digests of what it sent, and the run's policy.

    ``names`` is the directory (name -> address) from the cluster; next and previous stages are computed locally.
    ``seed`` is the orchestrator's address: the only member that may send requests, and the only one answered.
    The other arguments are ``ppharness.run.stage.stage.Stage``'s.
    """

    def __init__(
        self,
        index: int,
        num_stages: int,
        model: StageModel,
        transport: Transport,
        names: dict[str, str],
        plan_id: str,
        wire_dtype: str,
        tokenizer: Tokenizer | None,
        log: Callable[[str], None],
        tracer: Tracer | None,
        seed: str | None,
        route: tuple[str, str],
        policy: str,
        epoch: int,
        queue: int,
        keep_digests: bool,
        max_batch: int,
        speculation: Speculation | None = None,
    ):
        self.index, self.num_stages = index, num_stages
        self.first, self.last = index == 0, index == num_stages - 1
        self.next_is_middle = index + 1 < num_stages - 1  # a stage that frees its slot on RequestClose
        self.model, self.transport, self.plan_id = model, transport, plan_id
        self.wire_dtype, self.tokenizer, self.log = wire_dtype, tokenizer, log
        # the process's bounded log of dropped messages (``ppharness.trace.drops``), through the stage's log of the time
        self.drop = DropLog(lambda line: self.log(line))
        self.blamed = False  # the seed was told of a member that sent positions out of turn (``out_of_turn``)
        prev, nxt = route
        self.route = (prev or stage_name(index - 1), nxt or stage_name(index + 1))
        self.epoch = epoch  # the directory's epoch this stage is at
        self.next_addr: str | None = None
        self.prev_addr: str | None = None
        self.entry_addr = self.exit_addr = ""
        self.resolve(names)
        self.seed = seed
        self.slots: int = getattr(model, "slots", 1)
        self.reqs: dict[str, Request] = {}  # the requests in flight here, by id, each in its own slot
        self.batches: deque[int] = deque(maxlen=4096)  # a batched model's calls: the rows of each, most recent last
        self.queue_limit = queue
        self.max_batch = max_batch
        self.waiting: deque[tuple[InferenceRequest, list[int], Received | None]] = deque()  # stage 0: admitted next
        self.served = 0
        self.tracer = tracer
        # digests of the hidden states sent, per request (the last few), for ppharness.model.decode.exactness
        self.keeps_digests = keep_digests
        self.digests: OrderedDict[str, list[bytes]] = OrderedDict()
        self.policy = policy
        self.reliable, self.keeps_history = policy != "none", policy == "failover"
        self.finished: OrderedDict[str, None] = OrderedDict()
        self.speculation = speculation  # every stage's: windows come down the chain (stage 0 also drafts them)
        if speculation is not None and not getattr(model, "batched", False):
            raise StageError(f"stage {index}: speculation needs a batched model (its windows are rows of one step)")
        if (self.first or self.last) and tokenizer is None:
            raise StageError(f"stage {index}: the first and last stages need the tokenizer")

    def resolve(self, names: dict[str, str]) -> None:
        """Read the neighbours' addresses from a directory."""
        prev, nxt = self.route
        self.next_addr = None if self.last else names[nxt]
        self.prev_addr = None if self.first else names[prev]
        self.entry_addr = names[ENTRY]
        self.exit_addr = names[EXIT]

    def end_of(self, req: Request) -> int:
        """The first position ``req`` never computes: the end of the context, or of its answer."""
        return min(self.model.max_context, req.prompt_tokens + req.max_tokens)

    def out_of_turn(self, req: Request, position: int, what: str, sender: str, ahead: bool = True) -> bool:
        """Whether ``position`` of ``req`` is one no member sends in its role: past the request's context or answer
        (``end_of``), or (``ahead``) skipping positions this stage has not computed. Then it is refused, and the
        seed told (once) which member sent it, so the run ends naming that member instead of answering wrongly."""
        end = self.end_of(req)
        if position < end and not (ahead and position > req.next_position):
            return False
        why = (
            f"position {position} is past the request's end ({end}: context {self.model.max_context}, "
            f"{req.prompt_tokens}-token prompt, {req.max_tokens} new tokens)"
            if position >= end
            else f"position {position} skips ahead of {req.next_position}, the next this stage computes"
        )
        self.blame(req, what, sender, why, "a position out of turn")
        return True

    def accept_activation(
        self, msg: StageActivation, req: Request, rx: Received | None, live: bool = True
    ) -> Work | None:
        """Take an activation as ``req``'s next model call, when it is the one this stage expects next and holds the
        request's rows for its positions; the position after it is expected next. Its hidden state is the one handed
        over in the process (``rx.tensor``), else unpacked from the message. None (logged) when it does not fit."""
        if self.out_of_turn(req, msg.position, "an activation", self.prev_addr or ""):
            return None
        if msg.position != req.next_position or msg.is_prefill != (msg.position == 0):
            self.drop(
                f"stage {self.index}: dropped activation at position {msg.position} (prefill={msg.is_prefill}), "
                f"expected position {req.next_position}",
                "a position out of turn",
                self.prev_addr or "",
            )
            return None
        want = (req.rows, req.prompt_tokens if msg.is_prefill else 1, self.model.config.dim)
        if msg.seq_len != want[1] or tuple(msg.shape) != want:
            self.drop(
                f"stage {self.index}: dropped activation of shape {tuple(msg.shape)[:4]} (seq_len {msg.seq_len}) at "
                f"position {msg.position}: the plan expects {want}",
                "a shape not the plan's",
                self.prev_addr or "",
            )
            return None
        step = 0 if msg.is_prefill else msg.position - req.prompt_tokens + 1  # the trace's: 0 the prefill, k the k-th
        t0 = now_ns() if self.tracer else 0
        try:
            hidden = rx.tensor if rx is not None and rx.tensor is not None else Hidden(codec.unpack_hidden(msg))
        except CodecError as exc:
            self.drop(f"stage {self.index}: dropped activation: {exc}", "a bad tensor", self.prev_addr or "")
            return None
        if self.tracer:
            self.tracer.add(step, "deserialize", t0, now_ns())
        if hidden.shape != want:
            self.drop(
                f"stage {self.index}: dropped activation of shape {hidden.shape}, expected {want}",
                "a shape not the plan's",
                self.prev_addr or "",
            )
            return None
        req.next_position = msg.position + msg.seq_len
        work = Work(req, msg.position, hidden, msg.is_prefill, step, rx, live)
        req.work.append(work)
        return work

    def conflicting(self, req: Request, position: int, data: bytes, what: str, sender: str) -> bool:
        """Whether ``data``, what arrived for ``position`` of ``req``, differs from what this stage took for it
        before: a copy is resent byte for byte and a replay recomputes the same bits, so two different ones mean a
        member lies. The first is recorded (its 8-byte digest); a second that differs is refused and blamed as
        ``out_of_turn`` blames. Empty ``data`` (a tensor handed over in the process) is not checked."""
        if not data or position >= self.end_of(req):
            return False
        got = hashlib.blake2b(data, digest_size=8).digest()
        taken = req.received.setdefault(position, got)
        if taken == got:
            return False
        self.blame(req, what, sender, f"it differs from the one taken for position {position}", "a conflicting copy")
        return True

    def blame(self, req: Request, what: str, sender: str, why: str, reason: str) -> None:
        """Refuse what ``sender`` sent, in the drop log, and tell the seed (once) which member sent it, so the run
        ends naming that member."""
        sent_by = f"{self.sender_name(sender)} ({fingerprinted(sender)})"
        self.drop(f"stage {self.index}: refused {what} of {req.request_id} from {sent_by}: {why}", reason, sender)
        if not self.blamed and self.seed is not None:
            self.blamed = True
            said = f"refused {what} of request {req.request_id} from {sent_by}: {why} — that member is misbehaving"
            try:
                self.transport.send(self.seed, Error(stage=self.index, reason=said, request_id=req.request_id))
            except HarnessError as exc:
                self.log(f"stage {self.index}: could not tell the orchestrator: {exc}")

    def sender_name(self, address: str) -> str:
        """The member at ``address`` as its role names it: the previous stage, the last stage, or the orchestrator."""
        if address == self.seed:
            return "the orchestrator"
        if address and address == self.prev_addr:
            return self.route[0]
        if address and address == self.exit_addr:
            return EXIT
        return "an unknown member"

    def finish(self, request_id: str, served: bool = True) -> None:
        """The request is over here: free its slot, forget its state, remember its id (late duplicates are
        acknowledged)."""
        self.reqs.pop(request_id, None)
        self.finished[request_id] = None
        while len(self.finished) > FINISHED_KEPT:
            self.finished.popitem(last=False)
        if served:
            self.served += 1

    def free_slot(self) -> int | None:
        used = {r.slot for r in self.reqs.values()}
        return next((k for k in range(self.slots) if k not in used), None)

    def known(self, request_id: str) -> bool:
        """Whether this stage took ``request_id`` already: in flight, waiting for a slot, or finished."""
        return (
            request_id in self.reqs
            or request_id in self.finished
            or any(w[0].request_id == request_id for w in self.waiting)
        )

    def trace_rx(self, step: int, rx: Received | None) -> None:
        """Trace a model call's receipt: its message's arrival and decoding."""
        if self.tracer and rx is not None:
            self.tracer.add(step, "recv", rx.arrived_ns, rx.arrived_ns, rx.nbytes)
            self.tracer.add(step, "deserialize", rx.arrived_ns, rx.decoded_ns)
