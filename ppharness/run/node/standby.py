"""Warm standbys: a spare that already holds the stages it may take over, compiled for the prompts in flight.

A failover's time is detection, then the spare's loading, then its replay. Loading a stage's blocks and compiling its
decode step costs a second or more, and the replay's first model call, the prompt's prefill, costs as much again:
a prefill's step is built and compiled for each prompt length (``ModelSlice.prefill``). So once the run is ready the
seed sends each standby a ``Warm`` with the programs of the stages its device can hold, and, with every request, the
request's prompt length. The standby loads those slices, compiles their decode step and each length's prefill (twice:
tinygrad's JIT captures on its second call), and keeps them. When an Assign names a stage it holds, the node serves
that slice as it is: no loading, and the replay's prefill runs a step already captured.

The prefill a spare compiles here is the one the stage it replaces ran (same shapes, same kernels), so its replay
writes the same cache bytes: warming changes when kernels are compiled, never which.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ppharness.errors import HarnessError
from ppharness.model.decode.rules import warm_up
from ppharness.model.engine.slicing import ModelSlice
from ppharness.plan.stages import StagePlan, decode_program
from ppharness.wire.messages import Assign, Shutdown, Warm

if TYPE_CHECKING:
    from ppharness.model.gguf_file import GGUFFile
    from ppharness.run.loop import Loop

MAX_HELD_LENGTHS = 8  # prompt lengths kept compiled per slice (ModelSlice keeps as many prefill steps)
MAX_WARM_PROGRAMS = 64  # stages one standby is asked to hold


def assignment_waits(loop: Loop) -> bool:
    """Whether an Assign or a Shutdown is waiting in ``loop`` (everything waiting stays there, in order)."""
    waiting = []
    while (item := loop.next(0)) is not None:
        waiting.append(item)
    for item in waiting:
        loop.push(*item)
    return any(isinstance(msg, Assign | Shutdown) for _, msg, _ in waiting)


def stage_slice(gguf_file: GGUFFile, plan: StagePlan) -> ModelSlice:
    """The slice a stage's program computes with (not yet warmed up): its blocks, with the embedding on the first
    stage and the head on the last, for its context, experts, request slots and batching."""
    return ModelSlice(
        gguf_file,
        plan.lo,
        plan.hi,
        plan.first,
        plan.last,
        plan.max_context,
        experts=plan.experts,
        slots=plan.slots,
        batched=plan.batched,
    )


def slice_key(plan: StagePlan) -> tuple[object, ...]:
    """What makes two stages' slices the same: every argument ``stage_slice`` builds a ModelSlice with."""
    experts = tuple(sorted((k, tuple(v)) for k, v in (plan.experts or {}).items())) if plan.experts else None
    return (plan.lo, plan.hi, plan.first, plan.last, plan.max_context, experts, plan.slots, plan.batched)


class Held:
    """The slices a standby holds, by ``slice_key``, and the prompt lengths each has its prefill compiled for."""

    def __init__(self, gguf_file: GGUFFile | None, log: Callable[[str], None]):
        self.gguf_file, self.log = gguf_file, log
        self.slices: dict[tuple[object, ...], ModelSlice] = {}
        self.plans: dict[tuple[object, ...], StagePlan] = {}
        self.lengths: dict[tuple[object, ...], list[int]] = {}

    def take(self, plan: StagePlan) -> ModelSlice | None:
        """The slice held for ``plan``'s stage, given up to it (None: not held)."""
        key = slice_key(plan)
        self.plans.pop(key, None)
        self.lengths.pop(key, None)
        return self.slices.pop(key, None)

    def warm(self, msg: Warm, interrupted: Callable[[], bool] = lambda: False) -> None:
        """Load what ``msg`` names that is not held yet, then compile every held slice's prefill for its lengths. A
        slice that fails to load is logged and left out: the Assign that names its stage loads it as a cold spare
        would. ``interrupted()`` is asked between slices and lengths: True (an Assign came) ends the warming there,
        so that a stage that died meanwhile is not kept waiting for it."""
        if self.gguf_file is None:
            return
        t0 = time.monotonic()
        for text in msg.programs[:MAX_WARM_PROGRAMS]:
            if interrupted():
                self.log("warm standby: interrupted while loading")
                return
            try:
                plan = decode_program(text)
            except HarnessError as exc:
                self.log(f"warm standby: ignored a program: {exc}")
                continue
            key = slice_key(plan)
            if key in self.slices or plan.role != "stage" or plan.experts is not None:
                continue  # an expert-parallel stage computes with its expert nodes: held cold
            try:
                model = stage_slice(self.gguf_file, plan)
                warm_up(model)
            except Exception as exc:  # noqa: BLE001 - the Assign loads it again and reports what fails then
                self.log(f"warm standby: could not hold blocks [{plan.lo}, {plan.hi}): {type(exc).__name__}: {exc}")
                continue
            self.slices[key], self.plans[key], self.lengths[key] = model, plan, []
        for key, model in self.slices.items():
            for length in msg.lengths[:MAX_HELD_LENGTHS]:
                if interrupted():
                    self.log("warm standby: interrupted while compiling")
                    return
                self._compile_prefill(key, model, length)
        held = ", ".join(f"[{p.lo}, {p.hi})" for p in self.plans.values())
        self.log(f"warm standby: holding blocks {held or 'none'} in {time.monotonic() - t0:.2f} s")

    def _compile_prefill(self, key: tuple[object, ...], model: ModelSlice, length: int) -> None:
        lengths = self.lengths[key]
        if length in lengths or not model.warm_prefill(length):
            return
        lengths.append(length)
        if len(lengths) > MAX_HELD_LENGTHS:
            lengths.pop(0)
