"""Several requests through one in-process chain at once, their messages interleaved by a seeded scheduler: what the
requests-in-flight property tests drive (``ppharness.run.inprocess`` builds the chain)."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ppharness.errors import StageError
from ppharness.model.gguf_file import GGUFFile
from ppharness.run.inprocess import MAX_STEPS, InProcessChain
from ppharness.run.stage.requests import StageModel
from ppharness.run.stage.stage import Stage
from ppharness.wire.messages import Error, InferenceRequest, InferenceResponse


@dataclass(frozen=True)
class Arrival:
    """A request of ``run_interleaved``: sent after the chain has delivered ``after`` messages."""

    prompt: str
    max_tokens: int
    after: int = 0


def run_interleaved(
    gguf_file: GGUFFile,
    slices: Sequence[StageModel],
    arrivals: Sequence[Arrival],
    seed: int,
    queue: int = 64,
    plan_id: str = "inprocess",
    observe: Callable[[list[Stage]], None] | None = None,
    drain: bool = False,
) -> list[InferenceResponse | Error]:
    """Serve several requests at once through ``slices`` (built with as many slots as the stages should serve) and
    return, per arrival, its response or stage 0's refusal.

    One thread delivers one message at a time to a stage chosen at random (``seed``) among those with mail, so
    the requests interleave differently from seed to seed; each stage still reads its mail in the order it was sent,
    as a transport's ordered channel delivers it. ``observe(stages)`` runs after each delivery. ``drain``: a stage
    chosen gets every message waiting for it before it steps, as a node's loop hands them (a batched stage then runs
    them together).
    """
    n = len(slices)
    rng = random.Random(seed)
    with InProcessChain(gguf_file, slices, plan_id, queue=queue) as chain:
        answers: dict[str, InferenceResponse | Error] = {}
        order = sorted(range(len(arrivals)), key=lambda k: arrivals[k].after)
        delivered = 0
        for _ in range(MAX_STEPS):
            while order and arrivals[order[0]].after <= delivered:
                k = order.pop(0)
                a = arrivals[k]
                chain.ask(
                    InferenceRequest(
                        reply_to=chain.client.address, prompt=a.prompt, max_tokens=a.max_tokens, request_id=f"r{k}"
                    )
                )
            moved = False
            for i in rng.sample(range(n), n):  # the first stage with mail, in a random order of the stages
                if not chain.turn(i, drain=drain):
                    continue
                delivered, moved = delivered + 1, True
                if observe is not None:
                    observe(chain.stages)
                break
            while (reply := chain.reply()) is not None:
                if isinstance(reply, InferenceResponse | Error):
                    answers[reply.request_id] = reply
            if len(answers) == len(arrivals):
                return [answers[f"r{k}"] for k in range(len(arrivals))]
            if not moved and not order:
                raise StageError(
                    f"the in-process chain stalled with {len(arrivals) - len(answers)} request(s) unanswered"
                )
            if not moved:
                delivered = arrivals[order[0]].after  # nothing moves until the next arrival: it comes now
        raise StageError(f"the in-process chain did not finish in {MAX_STEPS} steps")
