"""One Stage class for any N >= 1; its role (first / middle / last) follows from the index alone. A Stage is a thin
facade over three parts that share one record of its state; this docstring is a token's way through them, file by
file.

The token's way::

    InferenceRequest -> stage 0 (tokenize, embed, blocks) -RequestOpen, StageActivation-> ... -> stage N-1 (blocks,
    norm, head, argmax) -NextToken-> stage 0 -> ... until EOS or max_tokens; stage N-1 -InferenceResponse-> reply_to.

Through a stage, file by file:

1. ``stage_requests.py``: what a stage records (``StageState``: the requests in flight, each in a request slot, with
   its model calls ready to run as ``Work`` items; the neighbours' addresses, the epoch, the digests, the policy).
   Every part holds the one ``StageState``.
2. ``stage_inbound.py``: receipt. ``handle(sender, msg, rx)`` checks the sender's role and the epoch and records: it
   acknowledges, refuses and drops duplicates at once, and an accepted activation or NextToken becomes a ``Work``
   item. ``stage_admission.py`` admits, opens and closes requests and checks an activation against its request (its
   hidden state handed over in the process as ``rx.tensor``, else unpacked from the message); ``stage_replay.py``
   takes a Replay or a Resume as a replacement.
3. ``stage_schedule.py``: a step. ``ready()`` takes the calls that are ready, at most one per request (its next
   position, so a request's calls run in order), and ``run(batch)``, the batch seam, runs the model once for all of
   them.
4. ``stage_outbound.py``: the one send path. Each output is handed on (a hidden state down the chain, beside a header
   built by ``codec.header``; a token back to stage 0 and to the client; the response), through the outbox when every
   message must be acknowledged; acks, and the replays to a replacement of the next stage.

Messages that do not fit a stage's state (a stale plan, an unknown request, a duplicate position) are logged and
dropped, never fatal; a failure of the model itself raises ``StageError``.

Fault tolerance, by the run's policy:

- ``none``: each message is sent once; a lost one ends the run (the orchestrator's budget runs out).
- ``retry``: every hop is idempotent (``ppharness.run.reliable``): the receiver acknowledges each copy of a message and
  acts on the first; the sender resends until acknowledged. The last stage also streams each token to the client.
- ``failover``: besides, each stage keeps what it sent down the chain for the requests in progress, and replays it to
  a spare that replaces the next stage (``ppharness.run.stage_replay``). Messages from an older epoch (a replaced node
  that came back) are refused.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ppharness.run.reliable import Outbox, RetryPolicy
from ppharness.run.speculation import Speculation
from ppharness.run.stage_inbound import Inbound
from ppharness.run.stage_outbound import Outbound
from ppharness.run.stage_requests import QUEUE, Request, StageModel, StageState
from ppharness.run.stage_schedule import Scheduler
from ppharness.seams.transport import Received, Transport
from ppharness.trace.tracer import Tracer
from ppharness.wire.messages import InferenceRequest, Message

if TYPE_CHECKING:
    from ppharness.model.tokenizer import Tokenizer


class Stage:
    """Stage ``index`` of ``num_stages``, computing with ``model`` (a ModelSlice) and talking over ``transport``.

    Receipt records, a step computes: ``handle`` (the inbound side) only checks and records, ``step()`` runs the
    ready model calls as one batch (the scheduler) and hands every output on (the outbound side). A loop
    (``ppharness.run.loop``) holds a stage as a worker (``step``) and a timer (``due_in``/``tick``: the outbox's
    resends); whoever drives a stage by hand calls ``deliver``, which is ``handle`` and then every step.

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
        speculation: Speculation | None = None,
    ):
        """``route``: the names the activations come from and go to, as the compiled plan gives them (empty: the
        default pp-stage-{index -/+ 1}). ``policy``: none, retry or failover (module docstring); ``retry`` its
        timings; ``epoch`` the directory's epoch ``names`` belongs to. ``queue``: on stage 0, how many requests may
        wait for a free slot (the model's ``slots`` say how many are served at once). ``keep_digests``: keep the
        digest of every hidden state sent, for a DigestRequest (``ppharness.model.exactness``). ``max_batch``: the
        most requests one step runs (0: every ready one); the rest run in the next step, so that several batches
        travel the chain at once and its stages compute at the same time. ``speculation``: the run's speculative
        decoding (``ppharness.run.speculation``; its draft on stage 0), on a batched model."""
        self.state = StageState(
            index, num_stages, model, transport, names, plan_id, wire_dtype, tokenizer, log, tracer, seed, route,
            policy, epoch, queue, keep_digests, max_batch, speculation,
        )  # fmt: skip
        self.out = Outbound(self.state, retry or RetryPolicy())
        self.inbound = Inbound(self.state, self.out)
        self.schedule = Scheduler(self.state)

    # --- the stage's work ---------------------------------------------------------------------------------------------

    def handle(self, sender: str, msg: Message, rx: Received | None = None) -> None:
        """Check and record one message; nothing is computed here (``step``). Protocol violations are dropped with a
        log line.

        ``rx``: the transport's receipt of the message (arrival and decoding times, size), for the trace.
        """
        self.inbound.handle(sender, msg, rx)

    def deliver(self, sender: str, msg: Message, rx: Received | None = None) -> None:
        """``handle`` a message, then run every step it made ready (for a driver without a loop)."""
        self.handle(sender, msg, rx)
        while self.step():
            pass

    def step(self) -> bool:
        """Run the ready model calls (one per request) as one batch and hand each output on; False when none was
        ready. With N = 1 the stage is the whole chain: it generates here, one batch per position, until its
        requests are answered."""
        s = self.state
        batch = self.schedule.ready()
        if not batch:
            return False
        while batch:
            self.out.hand_on(batch, self.schedule.run(batch))
            batch = self.schedule.ready() if s.first and s.last else []
        if s.first and s.waiting:
            self.inbound.admission.admit_waiting()
        return True

    def due_in(self) -> float | None:
        """Seconds until a message awaiting its acknowledgement is due to be sent again (None: nothing waits)."""
        return self.out.due_in()

    def tick(self) -> None:
        """Send again what is due; a message unacknowledged past the retry budget raises StageError."""
        self.out.tick()

    def rejoin(self, names: dict[str, str], epoch: int) -> None:
        """Take a newer directory (a spare replaced a stage): resolve the neighbours again; if the next stage is a
        replacement, replay the request in progress to it (policy failover)."""
        self.out.rejoin(names, epoch)

    # --- what it records (``StageState``'s) ---------------------------------------------------------------------------

    @property
    def index(self) -> int:
        return self.state.index

    @property
    def num_stages(self) -> int:
        return self.state.num_stages

    @property
    def first(self) -> bool:
        return self.state.first

    @property
    def last(self) -> bool:
        return self.state.last

    @property
    def model(self) -> StageModel:
        return self.state.model

    @property
    def transport(self) -> Transport:
        return self.state.transport

    @property
    def plan_id(self) -> str:
        return self.state.plan_id

    @property
    def wire_dtype(self) -> str:
        return self.state.wire_dtype

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.state.tokenizer

    @property
    def log(self) -> Callable[[str], None]:
        return self.state.log

    @property
    def tracer(self) -> Tracer | None:
        return self.state.tracer

    @property
    def seed(self) -> str | None:
        return self.state.seed

    @property
    def policy(self) -> str:
        return self.state.policy

    @property
    def reliable(self) -> bool:
        return self.state.reliable

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def next_addr(self) -> str | None:
        return self.state.next_addr

    @property
    def prev_addr(self) -> str | None:
        return self.state.prev_addr

    @property
    def slots(self) -> int:
        return self.state.slots

    @property
    def max_batch(self) -> int:
        return self.state.max_batch

    @property
    def reqs(self) -> dict[str, Request]:
        return self.state.reqs

    @property
    def waiting(self) -> deque[tuple[InferenceRequest, list[int], Received | None]]:
        return self.state.waiting

    @property
    def finished(self) -> OrderedDict[str, None]:
        return self.state.finished

    @property
    def served(self) -> int:
        return self.state.served

    @property
    def batches(self) -> deque[int]:
        return self.state.batches

    @property
    def digests(self) -> OrderedDict[str, list[bytes]]:
        return self.state.digests

    @property
    def outbox(self) -> Outbox:
        return self.out.outbox
