"""Searched kernels, pinned: every process of a run compiles each kernel with the same optimisations.

tinygrad's BEAM search picks a kernel's optimisations (upcasts, locals, groups, tensor cores) by timing candidates, so
two processes may pick differently and compute the same block with different code, which breaks split == unsplit. Here
the search runs once per model and device (``ppharness tune``) and its choices go into a kernel table, a JSON file keyed
by each kernel's structure. Every process that reads the table (``PPHARNESS_KERNELS=FILE``: stages, the oracle, the
benchmarks) compiles a kernel in the table with its recorded optimisations and any other kernel with tinygrad's own
deterministic heuristic — never a search of its own — so all of them run the same code for the same kernel.

A kernel's key is the hash of its AST with the lengths of its buffers and the bounds of its variables left out: an
expert bank of 32 experts and one of 64 run the same loops over buffers of different length, and get the same choices.
Kernels whose optimisations the model code fixes itself (``DecodeLinear`` on the CPU) keep them; tinygrad applies
those before any search.

What a table can change: tinygrad refuses an optimisation that does not fit the kernel (an upcast that does not divide
its axis, a group on the CPU), and the kernel then compiles with the heuristic. Every other one splits, reorders or
spreads the kernel's loops over the same iterations, so it changes at most the order of a floating-point sum (its
rounding), alike in every process that reads the table; a tensor-core row (TC) may also pad a matrix product's axes to
the tensor core's shape, where a weight read in the padding is 0. PADTO, which pads any loop, is refused when a table
is read: tinygrad 0.12 pads a sum unless it holds an operation it knows to be unsafe at 0, so a table that pads
``sum(x + 1)`` over 100 values makes it 177.5, not 149.5 (``ppharness tune`` does not search it). A process that
compiled a kernel otherwise than the others computes other bits, which the exactness check finds; its mismatch names
the table.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import msgspec

from ppharness.document.reader import LIMITS, read_text_file
from ppharness.errors import ModelError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from tinygrad.codegen.opt import Opt
    from tinygrad.codegen.opt.postrange import Scheduler
    from tinygrad.engine.jit import TinyJit
    from tinygrad.engine.realize import ExecItem
    from tinygrad.uop.ops import UOp

log = logging.getLogger(__name__)

ENV = "PPHARNESS_KERNELS"  # the table's path, set by the user for a run (and seen by local nodes)
TABLE_ENV = "PP_KERNEL_TABLE"  # the table itself, as a run hands it to every node (docker and vast.ai included)
MAX_ENV_BYTES = 96 << 10  # under Linux's 128 KiB limit on one environment string
FORMAT = "ppharness-kernels/1"
MAX_FILE_BYTES = LIMITS["kernel table"].file_bytes  # 32 MiB; the largest model's table is well under 1 MiB
MAX_KERNELS = 200_000
MAX_OPTS = 32  # optimisations per kernel; BEAM applies a handful
MAX_ARG = 1 << 16

# one optimisation: [op name, axis or null, argument: an int, a list of ints (tensor cores) or null]
OptRow = tuple[str, int | None, int | list[int] | None]


class KernelTable(msgspec.Struct, forbid_unknown_fields=True):
    """A kernel table as stored: which device and tinygrad it was searched on, and each kernel's optimisations."""

    format: str
    device: str  # tinygrad's device family: CPU, CUDA, ...
    renderer: str  # the renderer's class (CUDA and PTX render different code for one device)
    tinygrad: str
    beam: int  # the search's beam width
    kernels: dict[str, list[OptRow]] = msgspec.field(default_factory=dict)


def tinygrad_version() -> str:
    return importlib.metadata.version("tinygrad")


def kernel_key(ast: UOp, renderer: str) -> str:
    """The hash of ``ast``'s structure on ``renderer``, without buffer lengths or variable bounds (module docstring)."""
    from tinygrad.uop import Ops

    memo: dict[int, bytes] = {}
    for u in ast.toposort():
        dtype, arg = str(u.dtype), u.arg
        if u.op is Ops.DEFINE_GLOBAL:
            dtype = f"{u.dtype.base}*"
        elif u.op is Ops.DEFINE_VAR:
            arg = arg[0]
        head = str((u.op, dtype, arg)).encode()
        memo[id(u)] = hashlib.sha256(head + b"".join(memo[id(s)] for s in u.src)).digest()
    return hashlib.sha256(renderer.encode() + memo[id(ast)]).hexdigest()


def _opt_row(opt: Opt) -> OptRow:
    arg = list(opt.arg) if isinstance(opt.arg, tuple) else opt.arg
    return (opt.op.name, opt.axis, arg)


def _opt(row: OptRow, where: str) -> Opt:
    from tinygrad.codegen.opt import Opt, OptOps

    name, axis, arg = row
    if name not in OptOps.__members__:
        raise ModelError(f"{where}: unknown optimisation {name!r} (tinygrad's are {', '.join(OptOps.__members__)})")
    if name == OptOps.PADTO.name:
        raise ModelError(
            f"{where}: optimisation {list(row)} pads a loop, which a kernel table does not: tinygrad also pads a sum "
            f"whose terms are not 0 in the padding, and adds those terms; make the table again with `ppharness tune`, "
            f"or unset {ENV}"
        )
    ints = arg if isinstance(arg, list) else [] if arg is None else [arg]
    if (axis is not None and not 0 <= axis < 64) or len(ints) > 8 or any(not -1 <= a <= MAX_ARG for a in ints):
        raise ModelError(f"{where}: optimisation {list(row)} is out of range")
    return Opt(OptOps[name], axis, tuple(arg) if isinstance(arg, list) else arg)


def load_table(path: str | Path) -> KernelTable:
    """Read and check a kernel table; a bad file is refused naming the file, the place and the fix."""
    text = read_text_file(Path(path), "kernel table", "*.json", ModelError)  # within MAX_FILE_BYTES
    return decode_table(text.encode(), str(path))


def decode_table(data: bytes, where: str) -> KernelTable:
    """Check a kernel table's bytes (from a file or a node's environment); errors name ``where``, the place, the fix."""
    fix = "make it again with `ppharness tune`"
    if len(data) > MAX_FILE_BYTES:
        raise ModelError(f"{where}: a kernel table of {len(data):,} bytes is over the limit of {MAX_FILE_BYTES:,}")
    try:
        table = msgspec.json.decode(data, type=KernelTable)
    except msgspec.ValidationError as e:
        raise ModelError(f"{where}: not a kernel table: {e}; {fix}") from None
    except msgspec.DecodeError as e:
        raise ModelError(f"{where}: not JSON ({e}); {fix}") from None
    if table.format != FORMAT:
        raise ModelError(f"{where}: $.format is {table.format!r}, this ppharness reads {FORMAT!r}; {fix}")
    if not 1 <= table.beam <= 32:
        raise ModelError(f"{where}: $.beam is {table.beam}, a beam width is 1 to 32; {fix}")
    if len(table.kernels) > MAX_KERNELS:
        raise ModelError(f"{where}: $.kernels has {len(table.kernels):,} entries, over the limit of {MAX_KERNELS:,}")
    for key, rows in table.kernels.items():
        if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
            raise ModelError(f"{where}: $.kernels: {key[:80]!r} is not a kernel key (64 hex digits); {fix}")
        if len(rows) > MAX_OPTS:
            raise ModelError(f"{where}: $.kernels.{key}: {len(rows)} optimisations, over the limit of {MAX_OPTS}")
        for i, row in enumerate(rows):
            _opt(row, f"{where}: $.kernels.{key}[{i}]")
    return table


def save_table(table: KernelTable, path: str | Path) -> None:
    """Write ``table`` to ``path`` atomically (a reader never sees half a table), keys sorted."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    doc = msgspec.to_builtins(table)
    doc["kernels"] = dict(sorted(doc["kernels"].items()))
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(p)


@dataclass
class Pinning:
    """The kernel table this process compiles with, and what it found: ``tuning`` searches and records."""

    table: KernelTable
    path: str
    tuning: bool = False
    hits: int = 0
    misses: int = 0
    rejected: int = 0  # recorded optimisations that do not apply to the kernel (fell back to the heuristic)
    searched: int = 0
    differ: int = 0  # searched kernels whose choice is not tinygrad's heuristic (what tuning changed)
    on_search: Callable[[int, float], None] | None = None  # (kernels searched so far, seconds the last one took)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def choose(self, s: Scheduler, rawbufs: list[Any], amt: int, allow_test_size: bool = True) -> Scheduler:
        """Stands in for tinygrad's ``beam_search``: the table's choice, a search (when tuning), or the heuristic."""
        from tinygrad.codegen.opt import KernelOptError

        renderer = type(s.ren).__name__
        family = s.ren.device.split(":")[0]
        if family != self.table.device or renderer != self.table.renderer:
            raise ModelError(
                f"{self.path}: the kernel table is for {self.table.device} ({self.table.renderer}); this process "
                f"compiles for {family} ({renderer}): tune on this device with `ppharness tune`, or unset {ENV}"
            )
        key = kernel_key(s.ast, renderer)
        with self.lock:
            rows = self.table.kernels.get(key)
            if self.tuning and rows is None:
                t0 = time.monotonic()
                found = _ORIGINAL_SEARCH(s, rawbufs, self.table.beam, allow_test_size)
                rows = [_opt_row(o) for o in found.applied_opts[len(s.applied_opts) :]]
                self.table.kernels[key] = rows
                self.searched += 1
                self.differ += list(found.applied_opts) != list(heuristic(cast("Any", s).copy()).applied_opts)
                if self.on_search is not None:
                    self.on_search(self.searched, time.monotonic() - t0)
        if rows is None:
            self.misses += 1
            return heuristic(s)
        out: Scheduler = cast("Any", s).copy()  # Scheduler.copy is unannotated
        try:
            for i, row in enumerate(rows):
                out.apply_opt(_opt(row, f"{self.path}: $.kernels.{key}[{i}]"))
        except KernelOptError:
            self.rejected += 1
            return heuristic(s)
        self.hits += 1
        return out

    def summary(self) -> str:
        n = len(self.table.kernels)
        done = f"{self.searched} searched ({self.differ} other than the heuristic), " if self.tuning else ""
        return (
            f"kernel table {self.path}: {n} kernels ({self.table.device}, beam {self.table.beam}); "
            f"{done}{self.hits} compiled from the table, {self.misses} not in it (tinygrad's heuristic)"
            + (f", {self.rejected} whose recorded optimisations did not apply (heuristic)" if self.rejected else "")
        )


def heuristic(s: Scheduler) -> Scheduler:
    """What tinygrad compiles without BEAM: its hand-coded optimisations (none for multi-block kernels)."""
    from tinygrad.codegen.opt.heuristic import hand_coded_optimizations
    from tinygrad.helpers import NOOPT
    from tinygrad.uop import Ops

    ast = s.ast
    if NOOPT or (ast.arg is not None and ast.arg.applied_opts != ()):
        return s
    if any(u.op is Ops.BUFFERIZE for u in ast.backward_slice):
        return s
    return hand_coded_optimizations(s)


# --- batch-invariant kernels (ppharness.model.layers.rows)
# -----------------------------------------------------------------

INVARIANT = 4093  # tinygrad's BEAM value while a batched slice compiles: no search has this width
GROUP = 8  # threads a reduction of at least GROUP_MIN values is split over on a device with threads
GROUP_MIN = 256
MAX_UPCAST = 32  # accumulators per thread the non-reduced axes may be upcast to


def compiling_invariant() -> bool:
    from tinygrad.helpers import BEAM

    return bool(BEAM.value == INVARIANT)


def invariant_opts(s: Scheduler) -> Scheduler:
    """A kernel's optimisations where no row's reduction order may depend on the other axes (why:
    ``ppharness.model.layers.rows``)."""
    from tinygrad.codegen.opt import KernelOptError, Opt, OptOps
    from tinygrad.uop import Ops
    from tinygrad.uop.ops import AxisType

    k: Any = cast(Any, s).copy()  # Scheduler.copy is unannotated
    if not k.axes_of(AxisType.REDUCE) or any(u.op is Ops.BUFFERIZE for u in k.ast.backward_slice):
        return heuristic(s)  # nothing is summed here: no optimisation can change a value
    first = k.full_shape[k.axes_of(AxisType.REDUCE)[0]]
    if k.ren.has_local and k.ren.has_shared and isinstance(first, int) and first >= GROUP_MIN and first % GROUP == 0:
        with contextlib.suppress(KernelOptError):  # whether it applies depends on the reduction alone
            k.apply_opt(Opt(OptOps.GROUP, 0, GROUP))
    # the axes not reduced: first those the largest buffer is broadcast along (a batch's rows over one weight matrix:
    # upcast them and each weight is read once for all of them), then the widest other one
    upcast = 1
    big = max(k.bufs, key=lambda b: int(getattr(b.src[0].dtype, "size", 0) or 0))  # the weight of a product
    for axis in list(k.upcastable_dims):
        rng = k.rngs[axis]
        size = k.full_shape[axis]
        if rng in big.src[1].get_idx().backward_slice or not isinstance(size, int):
            continue
        amt = next((n for n in (8, 4, 2) if size % n == 0 and upcast * n <= MAX_UPCAST), 0)
        if amt:
            with contextlib.suppress(KernelOptError):
                k.apply_opt(Opt(OptOps.UPCAST, axis, amt))
                upcast *= amt
    rest = [a for a in k.upcastable_dims if isinstance(k.full_shape[a], int) and k.full_shape[a] > 1]
    if rest:
        axis = max(rest, key=lambda a: k.full_shape[a])
        size = k.full_shape[axis]
        if k.ren.has_local:
            with contextlib.suppress(KernelOptError):
                if size % 4 == 0:
                    k.apply_opt(Opt(OptOps.LOCAL, axis, 4))
                    size //= 4
        # on a GPU few outputs per thread keep enough workgroups for a one-row product (tinygrad's matvec shape)
        amts = (4, 2) if k.ren.has_local else (16, 8, 4, 2)
        amt = next((n for n in amts if size % n == 0 and upcast * n <= MAX_UPCAST), 0)
        if amt:
            with contextlib.suppress(KernelOptError):
                k.apply_opt(Opt(OptOps.UPCAST, axis, amt))
    return cast("Scheduler", k)


_ORIGINAL_SEARCH: Any = None
_active: Pinning | None = None


def pin(table: KernelTable, path: str, tuning: bool = False) -> Pinning:
    """Compile every later kernel of this process through ``table`` (module docstring). Kernels already compiled
    keep their code: pin before the first slice is built."""
    global _active
    from tinygrad.helpers import BEAM

    if table.tinygrad != tinygrad_version():
        raise ModelError(
            f"{path}: the kernel table was searched with tinygrad {table.tinygrad}, this process runs "
            f"{tinygrad_version()} (optimisations mean other code there): tune again with `ppharness tune`"
        )

    route_choices()
    _active = Pinning(table, path, tuning)
    BEAM.value = max(1, table.beam)  # routes every kernel without fixed options through the choice above
    return _active


def route_choices() -> None:
    """Send tinygrad's search for every kernel through ``_choose`` (once per process): tinygrad's ``apply_opts``
    imports ``beam_search`` from its module at each kernel."""
    global _ORIGINAL_SEARCH
    import tinygrad.codegen.opt.search as search

    if _ORIGINAL_SEARCH is None:
        _ORIGINAL_SEARCH = search.beam_search
        search.beam_search = cast("Any", _choose)
        _no_contraction()


def _no_contraction() -> None:
    """A batch-invariant kernel on the CPU is compiled with no fused multiply-adds the C compiler chooses
    (``#pragma clang fp contract(off)`` heads its source): clang fuses ``a * b + c`` only where both sit in one
    expression, and how tinygrad's C inlines a value depends on the kernel's upcasts, so one row's product came out
    other bits at 1 row than at 2 (a Q4_1 projection). The pragma is part of the source, so of its compiled-kernel
    cache key."""
    from tinygrad.renderer.cstyle import ClangRenderer

    render = ClangRenderer.render

    def rendered(self: Any, uops: Any) -> str:
        src = render(self, uops)
        return f"#pragma clang fp contract(off)\n{src}" if compiling_invariant() else src

    ClangRenderer.render = rendered  # type: ignore[method-assign]


def _choose(s: Scheduler, rawbufs: list[Any], amt: int, allow_test_size: bool = True) -> Scheduler:
    """A kernel's optimisations: batch-invariant ones while a batched slice compiles (``ppharness.model.layers.rows``),
    else the pinned table's (or, tuning, a search), else tinygrad's own search."""
    if compiling_invariant():
        return invariant_opts(s)
    if _active is not None:
        return _active.choose(s, rawbufs, amt, allow_test_size)
    return cast("Scheduler", _ORIGINAL_SEARCH(s, rawbufs, amt, allow_test_size))


def active() -> Pinning | None:
    return _active


def pin_from_env() -> Pinning | None:
    """Pin the table named by ``PPHARNESS_KERNELS`` or handed over in ``PP_KERNEL_TABLE``, once per process; None
    when neither is set."""
    if _active is not None:  # pinned already (or tuning): one table per process
        return _active
    path, text = os.environ.get(ENV, ""), os.environ.get(TABLE_ENV, "")
    if path:
        table = load_table(path)
    elif text:
        path = f"{TABLE_ENV} (sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]})"
        table = decode_table(text.encode(), path)
    else:
        return None
    pinning = pin(table, path)
    log.info("compiling with the kernel table %s (%d kernels)", path, len(pinning.table.kernels))
    return pinning


def table_for_nodes() -> str:
    """The table named by ``PPHARNESS_KERNELS`` as a run hands it to its nodes in ``PP_KERNEL_TABLE`` (compact
    JSON), checked; "" when unset."""
    path = os.environ.get(ENV, "")
    if not path:
        return ""
    text = msgspec.json.encode(load_table(path)).decode()
    if len(text) > MAX_ENV_BYTES:
        raise ModelError(
            f"{path}: the kernel table is {len(text):,} bytes, over the {MAX_ENV_BYTES:,} a node's environment "
            f"carries: tune this model into a table of its own (--out)"
        )
    return text


def new_table(device: str, renderer: str, beam: int) -> KernelTable:
    return KernelTable(FORMAT, device, renderer, tinygrad_version(), beam)


def kernel_sources(jits: Sequence[TinyJit[Any]]) -> list[str]:
    """The source of every kernel ``jits`` captured, in order. Kernel names are left out (they number identical
    kernels apart within one process), and so are the buffer lengths that the renderer writes into parameter names
    (``data1_196608``): a bank of 64 experts and one of 32 run the same code over buffers of different length."""
    out: list[str] = []

    def walk(items: list[ExecItem]) -> None:
        for item in items:
            prg = item.prg
            if prg is not None and hasattr(prg, "jit_cache"):  # a device graph (CUDA graph, ...) batching kernels
                walk(prg.jit_cache)
                continue
            program = getattr(prg, "p", None)  # a compiled kernel's ProgramSpec
            src = getattr(program, "src", None)
            if program is None or not src:
                out.append(type(prg).__name__)
                continue
            src = re.sub(rf"\b{re.escape(program.function_name)}\b", "kernel", src)
            out.append(re.sub(r"\b(data\d+)_\d+\b", r"\1", src))

    for jit in jits:
        captured = jit.captured
        walk(captured.jit_cache if captured is not None else [])
    return out
