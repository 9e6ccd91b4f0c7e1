"""Policy ``failover`` on a stage: rebuilding a replacement's KV cache by replaying what went through it.

Each stage keeps what it sent down the chain for the requests in progress. When a spare replaces the next stage (a
newer directory: ``rejoin``), the stage replays that to the spare (a ``Replay``), which takes it as its requests' next
model calls, the very calls that built the lost cache (one prefill, then one decode per position: a single longer
prefill is not bit-identical in fp16). It passes the whole replay on (the last output included), since its own next
stage may have been replaced at the same time and hold nothing; a next stage that holds the request takes only the
last position. A replacement of stage 0 is resumed by the orchestrator (a ``Resume``, the prompt and the streamed
tokens), which stage 0 replays through its blocks the same way.
"""

from __future__ import annotations

import time

import msgspec

from ppharness.run.stage_requests import Request, StageState, Work
from ppharness.wire.messages import Replay, Resume


class ReplayingStage(StageState):
    """The replays of a stage (module docstring): sent to a replacement of the next stage, taken as a replacement."""

    def rejoin(self, names: dict[str, str], epoch: int) -> None:
        """Take a newer directory (a spare replaced a stage): resolve the neighbours again; if the next stage is a
        replacement, replay the request in progress to it."""
        if epoch <= self.epoch:
            self.log(f"stage {self.index}: ignored a directory of epoch {epoch}, this stage is at epoch {self.epoch}")
            return
        old_next = self.next_addr
        self.epoch = epoch
        self._resolve(names)
        self.log(f"stage {self.index}: directory of epoch {epoch}")
        if self.keeps_history and self.next_addr is not None and self.next_addr != old_next:
            self._replay_to_next()
        self.outbox.redirect()  # what waits for the replaced node goes to its replacement now, not after a backoff

    def _on_replay(self, msg: Replay) -> None:
        """A replacement of this stage's range: take what the previous stage sent for the request as the request's
        next model calls. The last position's output goes on: as an activation from the last stage's replacement (its
        token), else as the whole replay (``_cascade``). A stage that has the request takes only the positions it
        has not seen (none, for a resent replay)."""
        opened = msg.open
        self._ack(self.prev_addr, "replay", opened.request_id, self._replay_position(msg))
        if opened.request_id in self.finished:
            return
        taken = self.reqs.get(opened.request_id)
        if taken is not None and taken.next_position > 0:
            self._catch_up(msg, taken)
            return
        t0 = time.monotonic()
        req = self._take_open(opened)
        if req is None:
            return
        last: Work | None = None
        for k, act in enumerate(msg.activations):
            hidden = self._check_activation(act, req)
            if hidden is None:
                self.log(f"stage {self.index}: replay of {opened.request_id} stopped at activation {k}")
                return
            final = k == len(msg.activations) - 1
            last = self._take_activation(act, hidden, req, None, live=final and self.last)
        note = f"stage {self.index}: replayed {len(msg.activations)} activation(s) of request {opened.request_id}"
        if last is None:
            self.log(f"{note} in {time.monotonic() - t0:.2f} s")
        else:
            last.note, last.since, last.cascade = note, t0, not self.last

    def _catch_up(self, msg: Replay, req: Request) -> None:
        """A replay of a request this stage has: the activations past the ones it took go on as live ones."""
        new = [a for a in msg.activations if a.position >= req.next_position and not a.is_prefill]
        for k, act in enumerate(new):
            hidden = self._check_activation(act, req)
            if hidden is None:
                self.log(f"stage {self.index}: replay of {req.request_id} stopped at position {act.position}")
                return
            self._take_activation(act, hidden, req, None, live=k == len(new) - 1)

    def _cascade(self, req: Request) -> None:
        """A replacement that replayed a request sends everything it computed for it on, as a replay: its next
        stage may have been replaced too (two neighbours lost at once) and hold nothing of the request; one that
        holds it takes only the positions it has not seen."""
        if req.opened is None or not req.sent:
            return
        replay = Replay(
            open=self._stamp_open(req.opened),
            activations=[msgspec.structs.replace(a, epoch=self.epoch) for a in req.sent],
            epoch=self.epoch,
        )
        self._send(("replay", req.request_id, self._replay_position(replay)), "next", replay)

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
            self._send(("replay", rid, self._replay_position(replay)), "next", replay)

    def _on_resume(self, msg: Resume) -> None:
        """A replacement of stage 0: the prompt and the tokens so far become the request's next model calls through
        this stage's blocks; the last one's output goes on as if its token had just come back from the last stage."""
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
        # N = 1: the tokens are generated again (the client drops those it has)
        tokens = [] if self.last else msg.tokens
        work = Work(req, 0, ids, is_prefill=True, step=0, live=not tokens and self.last)
        req.work.append(work)
        for k, token in enumerate(tokens):
            work = Work(req, req.next_position, [token], False, k + 1, live=k == len(tokens) - 1 and self.last)
            req.work.append(work)
            req.next_position += 1
        work.cascade = not self.last  # the whole resumed request goes on: stage 1 may be a replacement too
        if not self.last:
            work.note = f"stage 0: resumed request {req.request_id}: replayed the prompt and {len(tokens)} token(s)"
            work.since = t0
