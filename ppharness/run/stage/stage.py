"""One Stage class for any N >= 1; its role (first / middle / last) follows from the index alone. A Stage is a thin
core over parts that share one record of its state (``stage.state``, read there directly); this docstring is a
token's way through them, file by file.

The token's way::

    InferenceRequest -> stage 0 (tokenize, embed, blocks) -RequestOpen, StageActivation-> ... -> stage N-1 (blocks,
    norm, head, argmax) -NextToken-> stage 0 -> ... until EOS or max_tokens; stage N-1 -InferenceResponse-> reply_to.

Through a stage, file by file (``ppharness/run/stage/``):

1. ``requests.py``: what a stage records (``StageState``: the requests in flight, each in a request slot, with its
   model calls ready to run as ``Work`` items; the neighbours' addresses, the epoch, the digests, the policy), and
   the checks of what arrives against that record: an activation is taken as its request's next model call there
   (``accept_activation``: its hidden state handed over in the process as ``rx.tensor``, else unpacked from the
   message). Every part holds the one ``StageState``.
2. ``inbound.py``: receipt. ``handle(sender, msg, rx)`` checks the sender's role and the epoch and records: it
   acknowledges, refuses and drops duplicates at once, and an accepted activation or NextToken becomes a ``Work``
   item. ``admission.py`` admits, opens and closes requests; ``replay.py`` takes a Replay or a Resume as a
   replacement.
3. ``schedule.py``: a step. ``ready()`` takes the calls that are ready, at most one per request (its next position,
   so a request's calls run in order), and ``execute(batch)``, the batch seam, plans the batch's model calls as data
   (a decode, a batched model's rows, a speculative window) and runs each in one trace and error frame.
4. ``outbound.py``: the one send path. Each output is handed on (a hidden state down the chain, beside a header built
   by ``codec.header``; a token back to stage 0 and to the client; the response), through the outbox when every
   message must be acknowledged; acks, and the replays to a replacement of the next stage. ``windows.py``: what
   stage 0 drafts and the last stage verifies under speculation (``speculation.py``).

Messages that do not fit a stage's state (a stale plan, an unknown request, a duplicate position) are logged and
dropped, never fatal; a failure of the model itself raises ``StageError``.

Fault tolerance, by the run's policy:

- ``none``: each message is sent once; a lost one ends the run (the orchestrator's budget runs out). Nothing waits
  for an acknowledgement, so the stage's loop holds it as a worker only.
- ``retry``: every hop is idempotent (``ppharness.run.reliable``): the receiver acknowledges each copy of a message and
  acts on the first; the sender resends until acknowledged (the loop holds the stage as a timer too: ``due_in`` and
  ``tick``). The last stage also streams each token to the client.
- ``failover``: besides, each stage keeps what it sent down the chain for the requests in progress, and replays it to
  a spare that replaces the next stage (``ppharness.run.stage.replay``). Messages from an older epoch (a replaced node
  that came back) are refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ppharness.run.loop import Loop
from ppharness.run.reliable import RetryPolicy
from ppharness.run.stage.inbound import Inbound
from ppharness.run.stage.outbound import Outbound
from ppharness.run.stage.requests import QUEUE, StageModel, StageState
from ppharness.run.stage.schedule import Scheduler
from ppharness.run.stage.speculation import Speculation
from ppharness.seams.transport import Received, Transport
from ppharness.trace.tracer import Tracer
from ppharness.wire.messages import Message

if TYPE_CHECKING:
    from ppharness.model.text.tokenizer import Tokenizer


class Stage:
    """Stage ``index`` of ``num_stages``, computing with ``model`` (a ModelSlice) and talking over ``transport``.

    Receipt records, a step computes: ``handle`` (the inbound side) only checks and records, ``step()`` runs the
    ready model calls as one batch (the scheduler) and hands every output on (the outbound side). A loop
    (``ppharness.run.loop``) holds a stage as a worker (``step``) and, under a policy that resends
    (``state.reliable``), as a timer (``due_in``/``tick``: the outbox's resends), as ``serve_on`` registers it;
    whoever drives a stage by hand calls ``deliver``, which is ``handle`` and then every step. What it records is
    ``state`` (``StageState``, which says what its arguments mean).
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
        digest of every hidden state sent, for a DigestRequest (``ppharness.model.decode.exactness``).
        ``max_batch``: the most requests one step runs (0: every ready one); the rest run in the next step, so that
        several batches travel the chain at once and its stages compute at the same time. ``speculation``: the run's
        speculative decoding (``ppharness.run.stage.speculation``; its draft on stage 0), on a batched model."""
        self.state = StageState(
            index, num_stages, model, transport, names, plan_id, wire_dtype, tokenizer, log, tracer, seed, route,
            policy, epoch, queue, keep_digests, max_batch, speculation,
        )  # fmt: skip
        self.out = Outbound(self.state, retry or RetryPolicy())
        self.inbound = Inbound(self.state, self.out)
        self.scheduler = Scheduler(self.state)

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
        batch = self.scheduler.ready()
        if not batch:
            return False
        while batch:
            self.out.hand_on(batch, self.scheduler.execute(batch))
            batch = self.scheduler.ready() if s.first and s.last else []
        if s.first and s.waiting:
            self.inbound.admission.admit_waiting()
        return True

    def serve_on(self, loop: Loop) -> None:
        """Turn on ``loop``: as its worker (``step``) and, under a policy that resends (``state.reliable``), as its
        timer (the outbox's resends; under policy none nothing waits for an acknowledgement)."""
        if self.state.reliable:
            loop.add_timer(self)
        loop.add_worker(self)

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
