"""One decode hop through a middle stage, counted: the project files its calls enter, from the moment the stage
handles the activation until it sends its own on.

A real 3-stage chain runs in this process over the in-memory transport (``ppharness.run.inprocess``) on the tiny
synthetic model. The middle stage's third decode activation is handed to it as its node does (``Stage.handle``, then
its loop's turn: the timers, the actors' work), under ``sys.setprofile``; a *file entry* is a call whose callee is a
file of ``ppharness/``, ``transports/`` or ``backends/`` and whose caller is another file. The bounds hold the hop to
what it enters today: the stage's record, receipt, scheduler and send path, its loop, the model's decode step and
the digest of what it sends, the codec, the transport seam and the memory transport."""

from __future__ import annotations

import sys
from pathlib import Path
from types import FrameType
from typing import Any

from ppharness.model.gguf_file import GGUFFile
from ppharness.run.inprocess import InProcessChain, load_slices
from ppharness.run.loop import Loop
from ppharness.run.stage.stage import Stage
from ppharness.seams.transport import Received
from ppharness.wire.messages import InferenceRequest, Message, StageActivation

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tuple(f"{ROOT / folder}/" for folder in ("ppharness", "transports", "backends"))
# a middle stage's decode hop (docs/architecture.md, "A decode token's way through the files"): 6 files of
# ppharness/run/ (the stage, its receipt, its record, its scheduler, its send path, its loop) and 6 it cannot do
# without (the model's decode step in 3: the slice, its lean CPU call, the Hidden handle with its digest; the codec,
# the transport seam, the memory transport)
MAX_FILES = 12
MAX_ENTRIES = 28


def _profile_hop(stage: Stage, loop: Loop, got: tuple[str, Message, Received | None]) -> list[tuple[str, str]]:
    """(file, function) of each file entry while ``stage`` handles ``got`` and its loop takes one turn (the one that
    sends the hop's activation on)."""
    entries: list[tuple[str, str]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = frame.f_code.co_filename
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if callee.startswith(PROJECT) and callee != caller:
            entries.append((str(Path(callee).relative_to(ROOT)), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        stage.handle(*got)  # as the node's handler hands it on
        loop.tick()  # then the loop's turn: its timers, the actors' work
        loop.work()
    finally:
        sys.setprofile(None)
    return entries


def test_a_middle_stage_decode_hop_enters_few_files(tiny_gguf: GGUFFile) -> None:
    blocks = tiny_gguf.config.blocks
    slices = load_slices(tiny_gguf, [(0, 3), (3, 6), (6, blocks)])
    entries: list[tuple[str, str]] | None = None
    with InProcessChain(tiny_gguf, slices) as chain:
        chain.ask(InferenceRequest(reply_to=chain.client.address, prompt="the quick brown fox", max_tokens=8))
        middle, loop = chain.stages[1], chain.loops[1]
        decodes = 0
        for _ in range(10_000):
            chain.turn(0)
            chain.turn(2)
            got = loop.next(0.0)
            if got is not None:
                if isinstance(got[1], StageActivation) and not got[1].is_prefill:
                    decodes += 1
                if decodes == 3 and entries is None:  # warm: the decode step compiled, the request well under way
                    entries = _profile_hop(middle, loop, got)
                else:
                    middle.handle(*got)
                while loop.work():
                    pass
            if chain.reply() is not None:
                break
    assert entries is not None, "the middle stage saw no third decode activation"
    files = list(dict.fromkeys(f for f, _ in entries))
    shown = "\n".join(f"  {f}" for f in files) + "\n\n" + "\n".join(f"  {f}:{fn}" for f, fn in entries)
    print(f"a middle stage's decode hop: {len(files)} files, {len(entries)} file entries\n{shown}")
    assert any(fn == "send_frame" for _, fn in entries), f"the hop sent nothing on:\n{shown}"
    assert len(files) <= MAX_FILES, f"the hop entered {len(files)} files (at most {MAX_FILES}):\n{shown}"
    assert len(entries) <= MAX_ENTRIES, f"the hop made {len(entries)} file entries (at most {MAX_ENTRIES}):\n{shown}"
