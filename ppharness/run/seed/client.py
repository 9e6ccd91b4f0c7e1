"""The client side of a run: requests sent to pp-entry, tokens streamed back, responses.

The orchestrator is the request's ``reply_to``; it is not on the token path. A request goes through the session's
outbox when the run's policy resends (stage 0 acknowledges it), else straight to stage 0. A request stage 0 refuses as
busy (it still serves another) is sent again, as a new request, after a growing delay: a timer on the session's loop,
beside the outbox's resends. One request at a time (``request``) or an open-loop load (``serve``), whose refusals end
the request refused.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ppharness.errors import HarnessError, WaitTimedOut
from ppharness.plan.stages import ENTRY
from ppharness.run.reliable import StreamAcks, ack_of
from ppharness.wire.messages import (
    Error,
    InferenceRequest,
    InferenceResponse,
    Message,
    NetworkStart,
    Resume,
    StreamedToken,
)

if TYPE_CHECKING:
    from ppharness.run.seed.session import Session

STREAM_PROGRESS_S = 2.0  # at most one progress line per this many seconds about the tokens streamed
BUSY_RETRY_S = 0.1  # the first wait before a request stage 0 refused as busy is sent again (then longer, up to 1 s)


@dataclass(frozen=True)
class Job:
    """One request of an open-loop load: sent ``at_s`` seconds after the load starts, whatever is in flight."""

    prompt: str
    max_tokens: int
    at_s: float = 0.0


@dataclass
class Served:
    """What became of one ``Job`` (``Chain.serve``), on the orchestrator's monotonic clock: when it was sent, when
    each token streamed in, the response, or stage 0's refusal."""

    job: Job
    request_id: str
    sent_at: float = 0.0
    token_at: list[float] = field(default_factory=list)
    response: InferenceResponse | None = None
    refused: str = ""

    @property
    def done(self) -> bool:
        return self.response is not None or bool(self.refused)

    @property
    def ttft_s(self) -> float:
        """Time to first token: sent -> the first token streamed in."""
        return self.token_at[0] - self.sent_at

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive streamed tokens."""
        return [b - a for a, b in zip(self.token_at, self.token_at[1:])]


class _Arrivals:
    """Sends a load's jobs when they are due (``Client.serve``): a timer on the session's loop."""

    def __init__(self, due: list[Served], send: Callable[[Served], None]):
        self.pending, self.send = sorted(due, key=lambda s: s.job.at_s), send
        self.t0 = time.monotonic()

    def due_in(self) -> float | None:
        return max(0.0, self.t0 + self.pending[0].job.at_s - time.monotonic()) if self.pending else None

    def tick(self) -> None:
        while self.pending and self.t0 + self.pending[0].job.at_s <= time.monotonic():
            self.send(self.pending.pop(0))


class _Again:
    """The request stage 0 refused as busy, sent again when it is due: a timer on the session's loop."""

    def __init__(self) -> None:
        self.at: float | None = None
        self.refusals = 0  # how many times stage 0 refused the request so far
        self.send: Callable[[], None] = lambda: None

    def due_in(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def tick(self) -> None:
        if self.at is not None and self.at <= time.monotonic():
            self.at = None
            self.send()


class Client:
    """Requests and their answers: what each request streamed (``streams``), the responses not yet handed out, the
    open-loop load in progress (``loads``) and the request in progress (``active``). ``refusal`` is one of the
    session's screens, ``take`` one of its keepers; ``on_token`` is told of every new token."""

    def __init__(self, session: Session):
        self.session = session
        self.streams: dict[str, dict[int, tuple[int, float]]] = {}  # request -> position -> (token, arrival)
        self.responses: dict[str, InferenceResponse] = {}
        self.loads: dict[str, Served] = {}  # the requests of ``serve`` in progress
        self._sent: dict[str, InferenceRequest] = {}  # those of them sent so far, as sent
        self.active: InferenceRequest | None = None
        self.request_started = 0.0  # when the request in progress was sent, on the orchestrator's clock
        self.on_token: Callable[[], None] = lambda: None
        # told of every new token of a request that streams to the user: (request, its first position, what came)
        self.on_stream: Callable[[str, int, dict[int, tuple[int, float]]], None] | None = None
        # told of the prompts of a request (or of a load) before the first of them goes
        self.on_prompts: Callable[[list[str]], None] = lambda prompts: None
        self._again = _Again()
        self._refused: set[str] = set()  # ids of requests stage 0 refused as busy (each sent again under a new id)
        self._streamed_said = time.monotonic()
        self._stream_acks = StreamAcks()

    def request(
        self, prompt: str, max_tokens: int, stream: bool = False, digests: bool = True, speculate: bool = True
    ) -> tuple[InferenceResponse, float]:
        """Send one request to pp-entry; return the response and its round trip in seconds on our clock
        (``digests``: every stage keeps its hidden states' digests, for ``Chain.verdict``; ``speculate``: in a run
        that speculates, drafted windows for it, else one row per trip).

        A request sent right after another may find stage 0 still waiting for that one's last token (over a slow
        link it arrives after the response reached us): stage 0 refuses it as busy, and it is sent again, within the
        run's budget."""
        s = self.session
        assert s.loop is not None, "the chain is not started"
        sent: list[tuple[InferenceRequest, float]] = []  # each send: the request and when it went

        def send() -> None:
            sent.append(self._send_new(prompt, max_tokens, stream, digests, speculate))

        def answered() -> bool:
            return sent[-1][0].request_id in self.responses

        self._again.send, self._again.refusals = send, 0
        s.loop.add_timer(self._again)
        try:
            send()
            s.wait(
                lambda sender, msg: answered(),
                s.scenario.budget.total_s,
                "the InferenceResponse from the last stage",
                "decoding",
                done=answered,
            )
        except WaitTimedOut as exc:
            network = s.network
            if s.policy == "none" and network is not None and (network.loses or network.events):
                exc.add_note(
                    "the scenario's network loses or cuts off messages, and this run does not retry them: "
                    "one lost activation or token ends the run — fault_tolerance: {policy: retry} resends them"
                )
            raise
        finally:
            s.loop.remove_timer(self._again)
            self._again.at, self._again.send = None, lambda: None
            self.active = None
            if s.outbox is not None:
                ids = {r.request_id for r, _ in sent}
                s.outbox.drop(lambda key, role: key[1] not in ids)
        request, t0 = sent[-1]
        return self.responses.pop(request.request_id), time.monotonic() - t0

    def _send_new(
        self, prompt: str, max_tokens: int, stream: bool = False, digests: bool = True, speculate: bool = True
    ) -> tuple[InferenceRequest, float]:
        """Send the request in progress, under a new id (``stream``: its tokens come back as they are sampled);
        returns it and when it went."""
        s = self.session
        assert s.transport is not None, "the chain is not started"
        self.on_prompts([prompt])
        self._start_network()
        t0 = time.monotonic()
        request_id = uuid.uuid4().hex[:12]
        request = InferenceRequest(
            reply_to=s.seed,
            prompt=prompt,
            max_tokens=max_tokens,
            request_id=request_id,
            stream=stream,
            digests=digests,
            speculate=speculate,
        )
        self.active = request
        self._send(request)
        return request, t0

    def _start_network(self) -> None:
        """The network's timed events count from now, in every process of the run (``request_started``, on this
        process's monotonic clock)."""
        s = self.session
        assert s.transport is not None, "the chain is not started"
        self.request_started = time.monotonic()
        if s.nemesis is not None:
            t0_unix_ns = time.time_ns()
            s.clock.start(t0_unix_ns)
            for j in s.directory.joins.values():
                s.transport.send(j.address, NetworkStart(t0_unix_ns=t0_unix_ns))

    def _send(self, request: InferenceRequest) -> None:
        """To stage 0: through the outbox, resent until stage 0 acknowledges it, when the policy resends."""
        s = self.session
        assert s.transport is not None, "the chain is not started"
        if s.outbox is not None:
            s.outbox.put(("request", request.request_id, -1), "entry", request)
        else:
            s.transport.send(s.directory.resolve(ENTRY), request)

    def serve(self, jobs: list[Job]) -> list[Served]:
        """Send every job at its time, whatever is in flight (an open loop: arrivals do not wait for answers), and
        wait for every answer or refusal. Tokens stream back as they are sampled; the results are in job order."""
        s = self.session
        assert s.loop is not None, "the chain is not started"
        served = [Served(job, uuid.uuid4().hex[:12]) for job in jobs]
        self.on_prompts([job.prompt for job in jobs])
        self.loads = {x.request_id: x for x in served}
        self._start_network()

        def send(x: Served) -> None:
            x.sent_at = time.monotonic()
            request = InferenceRequest(
                reply_to=s.seed,
                prompt=x.job.prompt,
                max_tokens=x.job.max_tokens,
                request_id=x.request_id,
                stream=True,
            )
            self._sent[request.request_id] = request
            self._send(request)

        def settled() -> bool:
            for x in served:
                if x.response is None and x.request_id in self.responses:
                    x.response = self.responses.pop(x.request_id)
                    x.token_at = [t for _, (_, t) in sorted(self.streams.get(x.request_id, {}).items())]
            return all(x.done for x in served)

        arrivals = _Arrivals(served, send)
        s.loop.add_timer(arrivals)
        try:
            s.wait(
                lambda sender, msg: settled(),
                s.scenario.budget.total_s,
                f"the answers to {len(jobs)} request(s)",
                "serving",
                done=settled,
            )
        finally:
            s.loop.remove_timer(arrivals)
            for x in served:
                self.streams.pop(x.request_id, None)
            self.loads, self._sent = {}, {}
            if s.outbox is not None:
                ids = {x.request_id for x in served}
                s.outbox.drop(lambda key, role: key[1] not in ids)
        return served

    def refusal(self, sender: str, msg: Message) -> bool:
        """Stage 0's busy refusal of a request of ours (True: taken out), from the address pp-entry holds (anyone
        else's is left to the session's check of roles, which drops it). A load's request ends refused; the request
        in progress is sent again after a growing delay, within the run's budget."""
        if not isinstance(msg, Error) or not msg.busy or sender != self.session.directory.names.get(ENTRY):
            return False
        if msg.request_id in self.loads:
            self.loads[msg.request_id].refused = msg.reason  # a refusal ends that request, not the run
            return True
        if msg.request_id in self._refused:  # a copy of a send already refused, and sent again since
            return True
        active = self.active
        if active is None or msg.request_id != active.request_id:
            return False
        s, again = self.session, self._again
        delay = s.left(min(BUSY_RETRY_S * (again.refusals + 1), 1.0), "stage 0 was free for the request")
        again.refusals += 1
        again.at = time.monotonic() + delay
        self._refused.add(active.request_id)
        self.active = None
        if s.outbox is not None:  # stage 0 did not take it: the outbox would resend it on its own schedule
            s.outbox.drop(lambda key, role: key[1] != active.request_id)
        return True

    def take(self, sender: str, msg: Message) -> None:
        """What the client keeps whatever the session waits for: streamed tokens and responses, acknowledged."""
        match msg:
            case StreamedToken():
                got = self.streams.setdefault(msg.request_id, {})
                fresh = msg.position not in got
                if fresh:
                    got[msg.position] = (msg.token_id, time.monotonic())
                through = self._stream_acks.take(
                    msg.request_id, msg.first, msg.position, msg.done, fresh, got.__contains__
                )
                if through is not None:
                    self._ack(sender, "stream", msg.request_id, through)
                if fresh:
                    if self.on_stream is not None:  # the user sees the tokens themselves: no count of them
                        self.on_stream(msg.request_id, msg.first, got)
                    elif time.monotonic() - self._streamed_said >= STREAM_PROGRESS_S:
                        self._streamed_said = time.monotonic()
                        self.session.progress(f"decoding: {len(got)} token(s) streamed so far")
                    self.on_token()
            case InferenceResponse():
                self._ack(sender, "response", msg.request_id, -1)
                self._stream_acks.end(msg.request_id)
                self.responses.setdefault(msg.request_id, msg)

    def _ack(self, to: str, kind: str, request_id: str, position: int) -> None:
        s = self.session
        if s.policy != "none" and s.transport is not None:
            try:
                s.transport.send(to, ack_of(kind, request_id, position, s.plan.plan_id))
            except HarnessError as exc:  # the stage sends it again; that copy is acknowledged again
                s.progress(f"warning: acknowledging {kind} {position} to {to[:60]} failed: {exc}")

    def resume(self, epoch: int) -> None:
        """A spare took over stage 0: hand it every request in progress (the one ``request`` waits for and those of
        ``serve`` that were sent), each with the tokens streamed so far."""
        s = self.session
        assert s.outbox is not None  # failover is a reliable policy
        in_flight = [self.active] if self.active is not None else []
        in_flight += [r for rid, r in self._sent.items() if rid in self.loads and not self.loads[rid].done]
        for request in in_flight:
            if request.request_id in self.responses:
                continue
            got = self.streams.get(request.request_id, {})
            tokens = [got[p][0] for p in self._stream_acks.unbroken(request.request_id)]  # no token after a gap
            resume = Resume(request=request, tokens=tokens, plan_id=s.plan.plan_id, epoch=epoch)
            s.outbox.put(("resume", request.request_id, -1), "entry", resume)
