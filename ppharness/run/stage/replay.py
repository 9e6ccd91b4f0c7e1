"""Policy ``failover`` on a stage: rebuilding a replacement's KV cache by replaying what went through it.

Each stage keeps what it sent down the chain for the requests in progress. When a spare replaces the next stage (a
newer directory: ``rejoin``), the stage replays that to the spare (a ``Replay``), which takes it as its requests' next
model calls, the very calls that built the lost cache (one prefill, then one decode per position: a single longer
prefill is not bit-identical in fp16). It passes the whole replay on (the last output included), since its own next
stage may have been replaced at the same time and hold nothing; a next stage that holds the request takes only the
last position. A replacement of stage 0 is resumed by the orchestrator (a ``Resume``, the prompt and the streamed
tokens), which stage 0 replays through its blocks the same way.

The sending half is the outbound side's (``ppharness.run.stage.outbound``: ``rejoin``, the replay to the next stage,
the cascade of a replay taken); this module is the taking half, on the inbound side: a Replay or a Resume becomes the
request's next model calls.
"""

from __future__ import annotations

import time

from ppharness.run.stage.admission import Admission
from ppharness.run.stage.outbound import Outbound, replay_position
from ppharness.run.stage.requests import Request, StageState, Work
from ppharness.wire.messages import Replay, Resume


class ReplayIntake:
    """The replays a stage takes as a replacement (module docstring): ``on_replay`` from the previous stage,
    ``on_resume`` (stage 0) from the orchestrator."""

    def __init__(self, state: StageState, out: Outbound, admission: Admission):
        self.state, self.out, self.admission = state, out, admission

    def on_replay(self, msg: Replay) -> None:
        """A replacement of this stage's range: take what the previous stage sent for the request as the request's
        next model calls. The last position's output goes on: as an activation from the last stage's replacement (its
        token), else as the whole replay (the outbound side's cascade). A stage that has the request takes only the
        positions it has not seen (none, for a resent replay)."""
        s, admission = self.state, self.admission
        opened = msg.open
        self.out.ack(s.prev_addr, "replay", opened.request_id, replay_position(msg))
        if opened.request_id in s.finished:
            return
        taken = s.reqs.get(opened.request_id)
        if taken is not None and taken.next_position > 0:
            self._catch_up(msg, taken)
            return
        t0 = time.monotonic()
        req = admission.take_open(opened)
        if req is None:
            return
        last: Work | None = None
        for k, act in enumerate(msg.activations):
            last = s.accept_activation(act, req, None, live=k == len(msg.activations) - 1 and s.last)
            if last is None:
                s.log(f"stage {s.index}: replay of {opened.request_id} stopped at activation {k}")
                return
        note = f"stage {s.index}: replayed {len(msg.activations)} activation(s) of request {opened.request_id}"
        if last is None:
            s.log(f"{note} in {time.monotonic() - t0:.2f} s")
        else:
            last.note, last.since, last.cascade = note, t0, not s.last

    def _catch_up(self, msg: Replay, req: Request) -> None:
        """A replay of a request this stage has: the activations past the ones it took go on as live ones."""
        s = self.state
        new = [a for a in msg.activations if a.position >= req.next_position and not a.is_prefill]
        for k, act in enumerate(new):
            if s.accept_activation(act, req, None, live=k == len(new) - 1) is None:
                s.log(f"stage {s.index}: replay of {req.request_id} stopped at position {act.position}")
                return

    def on_resume(self, msg: Resume) -> None:
        """A replacement of stage 0: the prompt and the tokens so far become the request's next model calls through
        this stage's blocks; the last one's output goes on as if its token had just come back from the last stage."""
        s, admission = self.state, self.admission
        req_msg = msg.request
        if s.known(req_msg.request_id):
            self.out.ack(req_msg.reply_to, "resume", req_msg.request_id, -1)
            return
        if s.free_slot() is None or not admission.reply_to_ok(req_msg.reply_to, "Resume"):
            s.drop(
                f"stage 0: dropped Resume of {req_msg.request_id}: no free request slot", "no free slot", s.seed or ""
            )
            return
        self.out.ack(req_msg.reply_to, "resume", req_msg.request_id, -1)
        ids = admission.tokenize(req_msg.prompt, req_msg.request_id)
        req = admission.open(req_msg.request_id, req_msg, ids)
        t0 = time.monotonic()
        # N = 1: the tokens are generated again (the client drops those it has)
        tokens = [] if s.last else msg.tokens
        work = Work(req, 0, ids, is_prefill=True, step=0, live=not tokens and s.last)
        req.work.append(work)
        for k, token in enumerate(tokens):
            work = Work(req, req.next_position, [token], False, k + 1, live=k == len(tokens) - 1 and s.last)
            req.work.append(work)
            req.next_position += 1
        work.cascade = not s.last  # the whole resumed request goes on: stage 1 may be a replacement too
        if not s.last:
            work.note = f"stage 0: resumed request {req.request_id}: replayed the prompt and {len(tokens)} token(s)"
            work.since = t0
