"""What a device's speeds were measured with, and whether that is the engine running now.

``engine_id()`` names the running engine in one short string: ppharness's version, tinygrad's, and the first 12 hex
digits of a sha256 over the code that computes a token: every Python file under ``ppharness/model/`` (its path and
its bytes, in path order) and the kernel table this process compiles with, if any (``kernels.active()``, else the
file ``PPHARNESS_KERNELS`` names, else the table a run hands its nodes in ``PP_KERNEL_TABLE``; its decoded form, so a
table read from a file and the same table handed over compactly give one digest). Two processes with the same string
compute with the same code; a change to the model code, to tinygrad or to the kernel table changes it.

A plan's device carries ``measured`` (``ppharness.plan.lang.document.Measured``): the engine, hardware, date and command
its speeds come from. ``stale_warnings`` says, one line per distinct engine and date, which devices were measured with
another engine than this one, and how many devices carry no measurement at all (their speeds are assumptions).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
from datetime import UTC, date, datetime
from pathlib import Path

import msgspec

from ppharness.errors import ModelError
from ppharness.model.layers import kernels
from ppharness.plan.lang.document import Cluster, Measured
from ppharness.version import checkout_commit, installed

# the code that computes a token: the model runtime (architectures, slicing, experts, decoding, kernel choices)
CODE: tuple[Path, ...] = (Path(__file__).resolve().parents[1] / "model",)
DIGEST_HEX = 12
NAMES_SHOWN = 6  # devices named in one warning line before "and N more"
_canonical = msgspec.json.Encoder(order="sorted")


def engine_id() -> str:
    """The running engine: ``ppharness <version>/tinygrad <version>/<digest>`` (module docstring)."""
    code = code_digest(CODE)
    table = table_digest()
    digest = hashlib.sha256(f"{code}\n{table}".encode()).hexdigest()[:DIGEST_HEX]
    return f"ppharness {installed('ppharness')}/tinygrad {installed('tinygrad')}/{digest}"


def code_digest(roots: tuple[Path, ...]) -> str:
    """sha256 over every ``*.py`` file under ``roots`` (relative path and bytes, in path order). The files are
    listed and their sizes and times read on every call; their bytes are hashed again only when those changed."""
    files = sorted((f"{root.name}/{p.relative_to(root).as_posix()}", p) for root in roots for p in root.rglob("*.py"))
    stamps = []
    for name, p in files:
        st = p.stat()
        stamps.append((name, str(p), st.st_size, st.st_mtime_ns))
    return _files_digest(tuple(stamps))


@functools.lru_cache(maxsize=8)
def _files_digest(stamps: tuple[tuple[str, str, int, int], ...]) -> str:
    h = hashlib.sha256()
    for name, path, _, _ in stamps:
        data = Path(path).read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def table_digest() -> str:
    """sha256 of the kernel table in use (module docstring); "" when there is none."""
    pinned = kernels.active()
    if pinned is not None:
        return _table_digest_of(_canonical.encode(pinned.table))
    path, text = os.environ.get(kernels.ENV, ""), os.environ.get(kernels.TABLE_ENV, "")
    if path:
        try:
            st = Path(path).stat()
        except OSError:
            return hashlib.sha256(f"unreadable {path}".encode()).hexdigest()
        return _file_table_digest(path, st.st_size, st.st_mtime_ns)
    if text:
        return _text_table_digest(text)
    return ""


@functools.lru_cache(maxsize=8)
def _file_table_digest(path: str, size: int, mtime_ns: int) -> str:
    try:
        return _table_digest_of(_canonical.encode(kernels.load_table(path)))
    except ModelError:  # not a table: its bytes (a run with it fails at load, naming the file)
        return _table_digest_of(Path(path).read_bytes())


@functools.lru_cache(maxsize=8)
def _text_table_digest(text: str) -> str:
    try:
        return _table_digest_of(_canonical.encode(kernels.decode_table(text.encode(), kernels.TABLE_ENV)))
    except ModelError:
        return _table_digest_of(text.encode())


def _table_digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@functools.cache
def hardware(backend: str) -> str:
    """This machine as a device's ``measured.hardware``: tinygrad's backend and the processor (a GPU's name from
    ``nvidia-smi`` when the backend is CUDA or NV and it answers)."""
    cpu = _cpu_name()
    if backend.upper() in ("CUDA", "NV", "PTX"):
        gpu = _nvidia_name()
        if gpu:
            return f"{gpu} (tinygrad {backend}), host {cpu}"
    return f"{cpu}, {os.cpu_count() or 0} cores (tinygrad {backend})"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return os.uname().machine


def _nvidia_name() -> str:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    names = [n.strip() for n in done.stdout.splitlines() if n.strip()] if done.returncode == 0 else []
    return names[0] if names else ""


def measured_here(backend: str, how: str) -> Measured:
    """A ``measured`` stamp for speeds measured now on this machine by this engine with ``how`` (the command)."""
    return Measured(engine=engine_id(), hardware=hardware(backend)[:200], date=date.today().isoformat(), how=how[:400])


def stale_warnings(cluster: Cluster, engine: str | None = None) -> list[str]:
    """What to tell a user about where ``cluster``'s device speeds come from: one line per distinct (engine, date)
    of the devices measured with another engine than ``engine`` (default: this one), and one line when devices carry
    no measurement. Empty when every device was measured with this engine."""
    now = engine_id() if engine is None else engine
    stale: dict[tuple[str, str], list[str]] = {}
    bare = []
    for d in cluster.devices:
        if d.measured is None:
            bare.append(d.id)
        elif d.measured.engine != now:
            stale.setdefault((d.measured.engine, d.measured.date), []).append(d.id)
    lines = [
        f"device speeds of {_names(ids)} were measured with engine {engine_name or '(not named)'} on "
        f"{day or '(no date)'}; this engine is {now} — re-measure with `--probe` (local and docker devices) or "
        "`ppharness plan probe` on the device"
        for (engine_name, day), ids in stale.items()
    ]
    if bare:
        lines.append(
            f"{len(bare)} of {len(cluster.devices)} devices carry no `measured` ({_names(bare)}): their speeds are "
            "assumptions"
        )
    return lines


def _names(ids: list[str]) -> str:
    shown = ", ".join(ids[:NAMES_SHOWN])
    return shown if len(ids) <= NAMES_SHOWN else f"{shown} and {len(ids) - NAMES_SHOWN} more"


def provenance(backend: str) -> dict[str, str]:
    """What a benchmark's JSON says it was measured with: versions, the engine, the commit, this host, the time (UTC)
    and the device (``backend``: tinygrad's, e.g. CPU or CUDA)."""
    return {
        "ppharness": installed("ppharness"),
        "tinygrad": installed("tinygrad"),
        "engine": engine_id(),
        "commit": checkout_commit(),
        "host": platform.node(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": backend,
        "hardware": hardware(backend),
    }
