"""The whole N-stage chain in one process over the in-memory transport, pumped by one thread.

The same Stage objects and wire format as the multi-process chain, without processes or sockets: what the property
tests use to try many splits quickly. Slices can be passed in (and kept between calls) since loading dominates.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ppharness.errors import StageError, TransportTimeout
from ppharness.plan.stages import ENTRY, names_of
from ppharness.registry import transport_class
from ppharness.run.stage import QUEUE, Stage, StageModel
from ppharness.wire.messages import Error, InferenceRequest, InferenceResponse, Message

if TYPE_CHECKING:
    from ppharness.model.slicing import GGUFFile, ModelSlice
    from ppharness.seams.transport import Transport

MAX_STEPS = 1_000_000


def load_slices(
    gguf_file: GGUFFile,
    ranges: list[tuple[int, int]],
    max_context: int = 256,
    cache: dict[tuple[int, ...], ModelSlice] | None = None,
    taps: bool = False,
    slots: int = 1,
) -> list[ModelSlice]:
    """One ModelSlice per range (from ``cache`` when it holds the same range and role; ``taps`` and ``slots`` as
    ModelSlice's)."""
    from ppharness.model.decoding import warm_up
    from ppharness.model.slicing import ModelSlice

    out = []
    n = len(ranges)
    for i, (lo, hi) in enumerate(ranges):
        key = (lo, hi, i == 0, i == n - 1, taps) + ((slots,) if slots != 1 else ())
        if cache is None or key not in cache:
            s = ModelSlice(gguf_file, lo, hi, i == 0, i == n - 1, max_context, taps=taps, slots=slots)
            warm_up(s)
            if cache is not None:
                cache[key] = s
        out.append(cache[key] if cache is not None else s)
    return out


def _endpoints(count: int) -> list[Transport]:
    memory = transport_class("memory")
    return [memory() for _ in range(count)]


def _stages(
    gguf_file: GGUFFile,
    slices: Sequence[StageModel],
    transports: list[Transport],
    plan_id: str,
    wire_dtype: str = "f16",
    queue: int = QUEUE,
) -> tuple[list[Stage], dict[str, str]]:
    """One Stage per slice on ``transports[:n]`` (started here), the last transport the client's; and the names."""
    n = len(slices)
    addrs = [t.start() for t in transports]
    names = {name: addrs[i] for i in range(n) for name in names_of(i, n)}
    tok = gguf_file.tokenizer
    stages = [
        Stage(
            i,
            n,
            slices[i],
            transports[i],
            names,
            plan_id,
            wire_dtype,
            tok if i in (0, n - 1) else None,
            log=lambda _: None,
            seed=transports[n].address,
            queue=queue,
        )
        for i in range(n)
    ]
    return stages, names


def run_inprocess(
    gguf_file: GGUFFile,
    slices: Sequence[StageModel],
    prompt: str,
    max_tokens: int,
    wire_dtype: str = "f16",
    plan_id: str = "inprocess",
    digests: dict[int, list[bytes]] | None = None,
    on_message: Callable[[int, Message], None] | None = None,
) -> InferenceResponse:
    """Serve one request through ``slices`` (stage order) and return the last stage's response.

    ``digests``, when given, receives each stage's digests of the hidden states it sent (ppharness.model.exactness);
    ``on_message(stage, message)`` sees every message a stage receives, as decoded from the wire."""
    n = len(slices)
    transports = _endpoints(n + 1)
    try:
        client = transports[n]
        stages, names = _stages(gguf_file, slices, transports, plan_id, wire_dtype=wire_dtype)
        client.send(
            names[ENTRY],
            InferenceRequest(reply_to=client.address, prompt=prompt, max_tokens=max_tokens, request_id="r0"),
        )
        for _ in range(MAX_STEPS):
            idle = True
            for stage, t in zip(stages, transports):
                try:
                    sender, msg = t.recv(0)
                except TransportTimeout:
                    continue
                idle = False
                if on_message is not None:
                    on_message(stage.index, msg)
                stage.handle(sender, msg)
            try:
                _, reply = client.recv(0)
            except TransportTimeout:
                if idle:
                    raise StageError(
                        "the in-process chain stalled: no stage has a message and no response came"
                    ) from None
                continue
            if isinstance(reply, Error):
                raise StageError(f"stage {reply.stage}: {reply.reason}")
            assert isinstance(reply, InferenceResponse)
            if digests is not None:
                digests.update({s.index: s.digests.get("r0", []) for s in stages})
            return reply
        raise StageError(f"the in-process chain did not finish in {MAX_STEPS} steps")
    finally:
        for t in transports:
            t.close()


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
) -> list[InferenceResponse | Error]:
    """Serve several requests at once through ``slices`` (built with as many slots as the stages should serve) and
    return, per arrival, its response or stage 0's refusal.

    One thread delivers one message at a time to a stage chosen at random (``seed``) among those with mail, so the
    requests interleave differently from seed to seed; each stage still reads its mail in the order it was sent, as a
    transport's ordered channel delivers it. ``observe(stages)`` runs after each delivery."""
    n = len(slices)
    rng = random.Random(seed)
    transports = _endpoints(n + 1)
    try:
        client = transports[n]
        stages, names = _stages(gguf_file, slices, transports, plan_id, queue=queue)
        answers: dict[str, InferenceResponse | Error] = {}
        order = sorted(range(len(arrivals)), key=lambda k: arrivals[k].after)
        delivered = 0
        for _ in range(MAX_STEPS):
            while order and arrivals[order[0]].after <= delivered:
                k = order.pop(0)
                a = arrivals[k]
                client.send(
                    names[ENTRY],
                    InferenceRequest(
                        reply_to=client.address, prompt=a.prompt, max_tokens=a.max_tokens, request_id=f"r{k}"
                    ),
                )
            moved = False
            for i in rng.sample(range(n), n):  # the first stage with mail, in a random order of the stages
                try:
                    sender, msg = transports[i].recv(0)
                except TransportTimeout:
                    continue
                stages[i].handle(sender, msg)
                delivered, moved = delivered + 1, True
                if observe is not None:
                    observe(stages)
                break
            while True:
                try:
                    _, reply = client.recv(0)
                except TransportTimeout:
                    break
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
    finally:
        for t in transports:
            t.close()
