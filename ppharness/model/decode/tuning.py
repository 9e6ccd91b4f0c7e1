"""``ppharness tune``: search a model's kernels on this machine's device once and write them to a kernel table
(``ppharness.model.layers.kernels`` says what a table is and how every process of a run uses it)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ppharness.errors import ModelError
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.decode.rules import warm_up
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.layers.kernels import ENV, Pinning, active, load_table, new_table, pin, save_table

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence


def tune(
    model_path: str,
    out: str | Path,
    beam: int = 2,
    prompts: Sequence[str] = ("The quick brown fox",),
    max_tokens: int = 4,
    max_context: int = 256,
    on_search: Callable[[int, float], None] | None = None,
) -> Pinning:
    """Search the kernels of ``model_path``'s unsplit model on this process's device (tinygrad's default) and write
    their choices to ``out``, adding to a table already there. The decode step, the head and the expert bank are the
    same kernels in any split, so one unsplit run covers every split; prefill kernels depend on the prompt's length:
    ``prompts`` tunes those lengths, others compile with the heuristic (in every process alike).

    Interrupted (Ctrl-C), it writes the kernels searched so far: a table that lacks some kernels is a good table,
    and tuning again into the same file searches only the ones missing."""
    from tinygrad.codegen.opt import OptOps
    from tinygrad.codegen.opt.search import actions
    from tinygrad.device import Device

    current = active()
    if current is not None:
        raise ModelError(f"this process already compiles with the kernel table {current.path}: unset {ENV} to tune")
    if not 1 <= beam <= 32:
        raise ModelError(f"--beam {beam}: the beam width is 1 to 32")
    if any(a.op is OptOps.PADTO for a in actions):
        raise ModelError("BEAM_PADTO is set: the search would pad loops, which a kernel table does not hold: unset it")
    family, renderer = Device.DEFAULT.split(":")[0], type(Device[Device.DEFAULT].renderer).__name__
    table = new_table(family, renderer, beam)
    if Path(out).exists():
        old = load_table(out)
        mine = (old.device, old.renderer, old.tinygrad, old.beam)
        if mine != (table.device, table.renderer, table.tinygrad, table.beam):
            raise ModelError(
                f"{out}: the table holds kernels for {old.device} ({old.renderer}, tinygrad {old.tinygrad}, beam "
                f"{old.beam}), not {family} ({renderer}, tinygrad {table.tinygrad}, beam {beam}): give another --out"
            )
        table = old
    pinning = pin(table, str(out), tuning=True)
    pinning.on_search = on_search
    try:
        f = GGUFFile(model_path)
        whole = ModelSlice(f, 0, f.config.blocks, True, True, max_context)
        warm_up(whole)
        for prompt in prompts:
            oracle_decode(model_path, prompt, max_tokens, max_context, model=whole)
    finally:
        with pinning.lock:  # not while a search records its choice
            save_table(table, out)
    return pinning
