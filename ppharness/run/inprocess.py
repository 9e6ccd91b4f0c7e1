"""The whole N-stage chain in one process over the in-memory transport, on one thread.

The same Stage objects and wire format as the multi-process chain, without processes or sockets: what the split check
(``check_splits`` below, ``ppharness split-check``) and the property tests use to try many splits quickly. Each stage
turns on a loop of its own (``ppharness.run.loop``) over its endpoint; the driver hands one stage one message at a time,
and the stage runs what that made ready before the next. Slices can be passed in (and kept between calls) since loading
dominates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

from ppharness.errors import StageError, TransportTimeout
from ppharness.model.decode.exactness import SplitVerdict, compare
from ppharness.model.decode.oracle import OracleResult, oracle_decode
from ppharness.model.decode.rules import warm_up
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.plan.stages import ENTRY, names_of
from ppharness.registry import transport_class
from ppharness.run.loop import Loop
from ppharness.run.stage.requests import QUEUE, StageModel
from ppharness.run.stage.speculation import Speculation
from ppharness.run.stage.stage import Stage
from ppharness.wire.messages import Error, InferenceRequest, InferenceResponse, Message

MAX_STEPS = 1_000_000


def load_slices(
    gguf_file: GGUFFile,
    ranges: list[tuple[int, int]],
    max_context: int = 256,
    cache: dict[tuple[int, ...], ModelSlice] | None = None,
    taps: bool = False,
    slots: int = 1,
    batched: bool = False,
) -> list[ModelSlice]:
    """One ModelSlice per range (from ``cache`` when it holds the same range and role; ``taps``, ``slots`` and
    ``batched`` as ModelSlice's)."""
    out = []
    n = len(ranges)
    for i, (lo, hi) in enumerate(ranges):
        key = (lo, hi, i == 0, i == n - 1, taps) + ((slots,) if slots != 1 else ()) + ((1,) if batched else ())
        if cache is None or key not in cache:
            s = ModelSlice(gguf_file, lo, hi, i == 0, i == n - 1, max_context, taps=taps, slots=slots, batched=batched)
            warm_up(s)
            if cache is not None:
                cache[key] = s
        out.append(cache[key] if cache is not None else s)
    return out


class InProcessChain:
    """``slices`` (stage order) as Stages on memory endpoints, each on its own loop, and a client endpoint (the
    stages' seed); started here, closed on leaving the ``with``. ``keep_digests``, ``policy`` and ``speculation``: as
    Stage's."""

    def __init__(
        self,
        gguf_file: GGUFFile,
        slices: Sequence[StageModel],
        plan_id: str = "inprocess",
        wire_dtype: str = "f16",
        queue: int = QUEUE,
        keep_digests: bool = True,
        policy: str = "none",
        speculation: Speculation | None = None,
    ):
        memory = transport_class("memory")
        n = len(slices)
        self.transports = [memory() for _ in range(n + 1)]
        addrs = [t.start() for t in self.transports]
        self.client = self.transports[n]
        self.names = {name: addrs[i] for i in range(n) for name in names_of(i, n)}
        tok = gguf_file.tokenizer
        self.stages = [
            Stage(
                i,
                n,
                slices[i],
                self.transports[i],
                self.names,
                plan_id,
                wire_dtype,
                tok if i in (0, n - 1) else None,
                log=lambda _: None,
                seed=self.client.address,
                queue=queue,
                keep_digests=keep_digests,
                policy=policy,
                speculation=speculation,
            )
            for i in range(n)
        ]
        self.loops = [Loop(t, lambda _: None) for t in self.transports[:n]]
        for stage, loop in zip(self.stages, self.loops, strict=True):
            stage.serve_on(loop)

    def ask(self, request: InferenceRequest) -> None:
        """The client sends ``request`` to stage 0."""
        self.client.send(self.names[ENTRY], request)

    def turn(self, i: int, on_message: Callable[[int, Message], None] | None = None, drain: bool = False) -> bool:
        """Hand stage ``i`` its next message, if one waits (``drain``: and every message waiting behind it, as a
        node's loop does), and run what that made ready; whether one was there. ``on_message(stage, message)`` sees
        each first, as decoded from the wire."""
        loop = self.loops[i]
        got = loop.next(0.0)
        if got is None:
            return False
        while got is not None:
            if on_message is not None:
                on_message(i, got[1])
            self.stages[i].handle(*got)
            got = loop.next(0.0) if drain else None
        loop.tick()
        while loop.work():
            pass
        return True

    def reply(self) -> Message | None:
        """The next message the client received, None when none waits."""
        try:
            return self.client.recv(0)[1]
        except TransportTimeout:
            return None

    def close(self) -> None:
        for t in self.transports:
            t.close()

    def __enter__(self) -> InProcessChain:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def run_inprocess(
    gguf_file: GGUFFile,
    slices: Sequence[StageModel],
    prompt: str,
    max_tokens: int,
    wire_dtype: str = "f16",
    plan_id: str = "inprocess",
    digests: dict[int, list[bytes]] | None = None,
    on_message: Callable[[int, Message], None] | None = None,
    speculation: Speculation | None = None,
) -> InferenceResponse:
    """Serve one request through ``slices`` (stage order) and return the last stage's response.

    ``digests``, when given, receives each stage's digests of the hidden states it sent
    (ppharness.model.decode.exactness);
    ``on_message(stage, message)`` sees every message a stage receives, as decoded from the wire."""
    keep = digests is not None
    with InProcessChain(gguf_file, slices, plan_id, wire_dtype, keep_digests=keep, speculation=speculation) as chain:
        chain.ask(
            InferenceRequest(reply_to=chain.client.address, prompt=prompt, max_tokens=max_tokens, request_id="r0")
        )
        for _ in range(MAX_STEPS):
            idle = not any([chain.turn(i, on_message) for i in range(len(slices))])
            reply = chain.reply()
            if reply is None:
                if idle:
                    raise StageError("the in-process chain stalled: no stage has a message and no response came")
                continue
            if isinstance(reply, Error):
                raise StageError(f"stage {reply.stage}: {reply.reason}")
            assert isinstance(reply, InferenceResponse)
            if digests is not None:
                digests.update({s.state.index: s.state.digests.get("r0", []) for s in chain.stages})
            return reply
        raise StageError(f"the in-process chain did not finish in {MAX_STEPS} steps")


def judge(
    chain: InferenceResponse,
    oracle: OracleResult,
    ranges: Sequence[tuple[int, int]],
    digests: dict[int, list[bytes]],
    speculative: bool = False,
) -> SplitVerdict:
    """A chain's answer (tokens, stop token, each stage's boundary digests) against the unsplit model's
    (``speculative``: as ``compare``'s)."""
    return compare(
        chain.token_ids,
        oracle.token_ids,
        list(ranges),
        digests,
        oracle.boundary_digests,
        oracle.prompt_tokens,
        chain_stop=chain.stop_token_id,
        oracle_stop=oracle.stop_token_id,
        speculative=speculative,
    )


@dataclass(frozen=True)
class SplitCheck:
    """One split checked in process against the unsplit model."""

    ranges: list[tuple[int, int]]
    verdict: SplitVerdict
    token_ids: list[int]
    same_kernels: bool  # the stages' decode steps run exactly the whole model's kernels, their expert banks its bank's

    @property
    def exact(self) -> bool:
        return self.verdict.exact and self.same_kernels


def check_splits(
    model_path: str, prompt: str, max_tokens: int, splits: list[list[tuple[int, int]]], max_context: int = 256
) -> tuple[OracleResult, list[SplitCheck]]:
    """Run the unsplit model (tapped) once and every split in one process over the memory transport, on whatever
    device tinygrad uses (``DEV``); compare tokens, every stage-boundary hidden state and the compiled kernels."""
    gguf = GGUFFile(model_path)
    whole = load_slices(gguf, [(0, gguf.config.blocks)], max_context, taps=True)[0]
    oracle = oracle_decode(model_path, prompt, max_tokens, max_context, model=whole, boundaries=True)
    kernels, bank = whole.decode_kernels(), whole.bank_kernels()
    out = []
    for ranges in splits:
        slices = load_slices(gguf, ranges, max_context)
        digests: dict[int, list[bytes]] = {}
        chain = run_inprocess(gguf, slices, prompt, max_tokens, digests=digests)
        verdict = judge(chain, oracle, ranges, digests)
        same = [k for s in slices for k in s.decode_kernels()] == kernels and all(
            s.bank_kernels() == bank for s in slices if s.bank.n
        )
        out.append(SplitCheck(ranges, verdict, chain.token_ids, same))
        del slices
    return oracle, out
