"""llama.cpp on the same GGUF file: ``bench gpu --llamacpp DIR`` runs llama.cpp's ``llama-bench`` on the file that
ppharness's single process decodes, and on copies of it that ``llama-quantize`` makes (``--llamacpp-types``).

``DIR`` is a llama.cpp build (``../shared/tools/llamacpp/build.sh ARCHIVE DEST cuda`` makes one): ``llama-bench``
and ``llama-quantize`` are looked for in ``DIR``, ``DIR/bin``, ``DIR/build/bin`` and then anywhere under ``DIR``.
Each file is measured with ``llama-bench -m FILE -p 0 -n TOKENS -ngl 99 -r REPEATS -o json``: decode only (no
prompt), every layer on the GPU, its JSON's mean tokens/s (``avg_ts``), standard deviation (``stddev_ts``) and
per-repeat samples (``samples_ts``). A type other than the file's own is made once by ``llama-quantize FILE OUT TYPE``
into the files directory and reused by later runs.

Every step has a timeout; a step that fails, times out or prints no JSON makes a failed entry (what failed and the
last lines of its stderr) and the bench goes on: a llama.cpp failure never loses another contender's figures.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppharness.errors import HarnessError
from ppharness.model.gguf.header import read_gguf
from ppharness.model.synthetic.spec import WEIGHT_TYPES, parse_synthetic

BUILD_HINT = "bash ../shared/tools/llamacpp/build.sh ARCHIVE DEST cuda (on the GPU machine; see its README.md)"
BENCH_TIMEOUT_S = 900
QUANTIZE_TIMEOUT_S = 1800
STDERR_LINES = 12  # of a failed step's stderr, in its entry
_SUBDIRS = (".", "bin", "build/bin", "build/bin/Release", "build")


def _type_names() -> dict[str, int]:
    """llama-quantize's type names (upper case) -> llama.cpp's file type (``general.file_type``)."""
    from gguf import LlamaFileType

    out = {"F32": int(LlamaFileType.ALL_F32)}
    for t in LlamaFileType:
        if t.name.startswith("MOSTLY_"):
            out[t.name.removeprefix("MOSTLY_")] = int(t)
    return out


@dataclass(frozen=True)
class Tools:
    bench: Path
    quantize: Path | None  # None: not found (only needed to make another type)


def _executable(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def _find(directory: Path, name: str) -> tuple[Path | None, list[str]]:
    """``name`` in ``directory``'s usual places, then anywhere under it; (None, the places looked in) if absent."""
    looked = []
    for sub in _SUBDIRS:
        p = directory / sub / name
        looked.append(str(p))
        if _executable(p):
            return p, looked
    found = sorted((p for p in directory.rglob(name) if _executable(p)), key=lambda p: len(p.parts))
    looked.append(f"anywhere under {directory}")
    return (found[0] if found else None), looked


def find_tools(directory: str | os.PathLike[str], need_quantize: bool) -> Tools:
    """``llama-bench`` (and ``llama-quantize`` when ``need_quantize``) under ``directory``; ``HarnessError`` naming
    where it looked and how to build them."""
    d = Path(directory).expanduser()
    if not d.is_dir():
        raise HarnessError(
            f"--llamacpp {directory}: not a directory — point it at a llama.cpp build; make one with {BUILD_HINT}"
        )
    bench, looked = _find(d, "llama-bench")
    if bench is None:
        raise HarnessError(
            f"--llamacpp {directory}: no executable llama-bench (looked in {', '.join(looked)}) — build llama.cpp's "
            f"tools with {BUILD_HINT}, then pass its DEST (or DEST/build/bin)"
        )
    quantize, looked = _find(d, "llama-quantize")
    if quantize is None and need_quantize:
        raise HarnessError(
            f"--llamacpp {directory}: llama-bench is there but llama-quantize is not (looked in {', '.join(looked)}), "
            f"and --llamacpp-types names a type other than the file's own — build it with {BUILD_HINT}, or ask "
            "only for the file's own type"
        )
    return Tools(bench, quantize)


def parse_types(csv: str) -> list[str]:
    """``"f16, q8_0,Q4_K_M"`` -> ``["F16", "Q8_0", "Q4_K_M"]``, each a type llama-quantize knows, none twice;
    ``HarnessError`` naming the unknown ones and the known."""
    known = _type_names()
    out: list[str] = []
    for t in (x.strip().upper() for x in csv.split(",")):
        if t and t not in out:
            out.append(t)
    bad = [t for t in out if t not in known]
    if bad or not out:
        raise HarnessError(
            f"--llamacpp-types {csv!r}: {'unknown type(s) ' + ', '.join(bad) if bad else 'no type'} — name "
            f"llama-quantize's types, comma-separated (e.g. f16,q8_0,q4_k_m): {', '.join(known)}"
        )
    return out


def file_type(path: str | os.PathLike[str]) -> str | None:
    """The file's own type by its ``general.file_type`` (e.g. ``F16``), or None where it has none or an unknown one."""
    value = read_gguf(path, arrays=False).kv.get("general.file_type")
    names = {v: k for k, v in _type_names().items()}
    return names.get(value) if isinstance(value, int) else None


def synthetic_file_type(source: str) -> str | None:
    """The type (``file_type``'s names) of the file a ``synthetic:`` source would build, before it is built; None
    where it cannot be told."""
    try:
        name = WEIGHT_TYPES[parse_synthetic(source).type][1]
    except (HarnessError, KeyError, IndexError, TypeError):
        return None
    name = "F32" if name == "ALL_F32" else name.removeprefix("MOSTLY_")
    return name if name in _type_names() else None


@dataclass
class BenchSample:
    """One llama-bench test (its JSON entry with ``n_gen`` > 0), the fields used here."""

    avg_ts: float
    stddev_ts: float
    samples_ts: list[float]
    n_gen: int
    model_type: str = ""  # llama.cpp's description, e.g. "llama 1B F16"
    model_size: int = 0  # bytes of the model's tensors, as llama.cpp counts them
    model_n_params: int = 0
    backends: str = ""
    gpu_info: str = ""
    build: str = ""  # build_commit (build_number)


def _number(entry: dict[str, Any], key: str) -> float | None:
    try:
        return float(entry[key])
    except (KeyError, TypeError, ValueError):
        return None


def parse_bench_json(text: str) -> BenchSample:
    """llama-bench's ``-o json`` output (a JSON array of tests, after any log lines) -> its decode test (``n_gen`` >
    0, no prompt); ``ValueError`` naming what is missing."""
    m = re.search(r"^\s*\[", text, re.MULTILINE)
    if m is None:
        raise ValueError("no JSON array in llama-bench's output")
    try:
        doc, _ = json.JSONDecoder().raw_decode(text, m.start() + len(m.group(0)) - 1)
    except json.JSONDecodeError as exc:
        raise ValueError(f"llama-bench's JSON does not parse: {exc}") from None
    entries = [e for e in doc if isinstance(e, dict)] if isinstance(doc, list) else []
    gen = [e for e in entries if (_number(e, "n_gen") or 0) > 0 and not (_number(e, "n_prompt") or 0)]
    if not gen:
        raise ValueError(f"llama-bench's JSON has no decode test (n_gen > 0, n_prompt 0) among {len(entries)} entries")
    e = gen[-1]
    n_gen = int(_number(e, "n_gen") or 0)
    samples = [float(x) for x in e.get("samples_ts") or []]
    if not samples and e.get("samples_ns"):
        samples = [1e9 * n_gen / float(ns) for ns in e["samples_ns"] if float(ns) > 0]
    avg = _number(e, "avg_ts")
    if avg is None:
        if not samples:
            raise ValueError("llama-bench's decode test has neither avg_ts nor samples")
        avg = statistics.mean(samples)
    sd = _number(e, "stddev_ts")
    if sd is None:
        sd = statistics.stdev(samples) if len(samples) > 1 else 0.0
    commit, number = e.get("build_commit", ""), e.get("build_number", "")
    return BenchSample(
        avg_ts=avg,
        stddev_ts=sd,
        samples_ts=samples or [avg],
        n_gen=n_gen,
        model_type=str(e.get("model_type", "")),
        model_size=int(_number(e, "model_size") or 0),
        model_n_params=int(_number(e, "model_n_params") or 0),
        backends=str(e.get("backends", e.get("backend", ""))),
        gpu_info=str(e.get("gpu_info", "")),
        build=f"{commit} ({number})" if commit or number else "",
    )


@dataclass
class LlamaCppRun:
    """llama-bench on one file: its figures, or ``error`` (what failed and its stderr's last lines)."""

    type: str  # F16, Q8_0, Q4_K_M, ...
    file: str
    quantised: bool  # made here by llama-quantize from the bench's file
    file_bytes: int = 0
    tokens: int = 0  # llama-bench's -n
    repeats: int = 0  # llama-bench's -r
    command: list[str] = field(default_factory=list)
    tok_s: float | None = None  # llama-bench's avg_ts
    stddev_tok_s: float | None = None
    samples_tok_s: list[float] = field(default_factory=list)
    model_type: str = ""
    backends: str = ""
    gpu_info: str = ""
    build: str = ""
    seconds: float = 0.0  # llama-bench's wall time (and llama-quantize's, when it made the file in this run)
    error: str = ""
    read_bytes: int | None = None  # what one decode position reads of this file (packed_floor.decode_read_bytes)
    floor_tok_s: float | None = None  # the packed floor of this file at the run's copy bandwidth
    one_process_over_llamacpp: float | None = None  # tinygrad one process's tok/s / this tok/s

    @property
    def name(self) -> str:
        return f"llama.cpp {self.type} (llama-bench)"


def _tail(text: str | bytes | None, n: int = STDERR_LINES) -> str:
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return "\n".join(lines[-n:])


def _run(cmd: list[str], timeout: float, what: str) -> subprocess.CompletedProcess[str]:
    """``cmd``, or ``HarnessError`` saying that ``what`` failed (exit status or timeout) with its stderr's tail."""
    try:
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="replace",
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        raise HarnessError(
            f"{what} did not finish in {timeout:.0f} s; stderr's last lines:\n{_tail(exc.stderr)}"
        ) from None
    except OSError as exc:
        raise HarnessError(f"{what} could not start: {exc}") from None
    if done.returncode != 0:
        raise HarnessError(f"{what} exited {done.returncode}; stderr's last lines:\n{_tail(done.stderr)}")
    return done


def quantised_path(src: Path, files_dir: Path, qtype: str) -> Path:
    return files_dir / f"{src.stem}.{qtype.lower()}.gguf"


def quantise(
    tools: Tools,
    src: Path,
    files_dir: Path,
    qtype: str,
    own: str | None,
    timeout: float,
    progress: Callable[[str], None],
) -> Path:
    """``src`` as ``qtype``, made once by llama-quantize into ``files_dir`` (written aside, then renamed: an
    interrupted run leaves no half file to reuse)."""
    out = quantised_path(src, files_dir, qtype)
    if out.is_file() and out.stat().st_size > 0 and out.stat().st_mtime >= src.stat().st_mtime:
        progress(f"llama.cpp: {qtype}: reusing {out}")
        return out
    if tools.quantize is None:
        raise HarnessError(f"no llama-quantize to make {qtype} with — build it with {BUILD_HINT}")
    files_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    cmd = [str(tools.quantize)]
    if own not in (None, "F32", "F16", "BF16"):  # the source is quantised already
        cmd.append("--allow-requantize")
    cmd += [str(src), str(tmp), qtype]
    progress(f"llama.cpp: quantising {src.name} to {qtype} into {files_dir} (once; up to {timeout:.0f} s)")
    t0 = time.monotonic()
    try:
        _run(cmd, timeout, f"llama-quantize to {qtype}")
        if not tmp.is_file() or tmp.stat().st_size == 0:
            raise HarnessError(f"llama-quantize to {qtype} exited 0 but wrote no {tmp}")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    progress(f"llama.cpp: {qtype}: {out.stat().st_size / 2**20:.0f} MiB in {time.monotonic() - t0:.0f} s")
    return out


def bench_command(tools: Tools, path: Path, tokens: int, repeats: int) -> list[str]:
    return [str(tools.bench), "-m", str(path), "-p", "0", "-n", str(tokens), "-ngl", "99", "-r", str(repeats)] + [
        "-o",
        "json",
    ]


def bench_file(run: LlamaCppRun, tools: Tools, tokens: int, repeats: int, timeout: float) -> None:
    """llama-bench on ``run.file``: its figures into ``run``; ``HarnessError`` if it fails or prints no decode test."""
    run.command = bench_command(tools, Path(run.file), tokens, repeats)
    t0 = time.monotonic()
    done = _run(run.command, timeout, f"llama-bench on {run.type}")
    run.seconds += time.monotonic() - t0
    try:
        s = parse_bench_json(done.stdout)
    except ValueError as exc:
        raise HarnessError(
            f"llama-bench on {run.type}: {exc}; stdout's last lines:\n{_tail(done.stdout, 6)}\n"
            f"stderr's last lines:\n{_tail(done.stderr)}"
        ) from None
    run.tok_s, run.stddev_tok_s, run.samples_tok_s = s.avg_ts, s.stddev_ts, s.samples_ts
    run.model_type, run.backends, run.gpu_info, run.build = s.model_type, s.backends, s.gpu_info, s.build


def run_llamacpp(
    tools: Tools,
    model_path: str | os.PathLike[str],
    types: list[str],
    files_dir: str | os.PathLike[str],
    tokens: int,
    repeats: int,
    progress: Callable[[str], None],
    bench_timeout: float = BENCH_TIMEOUT_S,
    quantize_timeout: float = QUANTIZE_TIMEOUT_S,
) -> list[LlamaCppRun]:
    """llama-bench on ``model_path`` as each of ``types`` (its own type: the file as it is; another: quantised once
    into ``files_dir``); one entry per type, failed ones with ``error``. Never raises for a step that fails."""
    src = Path(model_path)
    try:
        own = file_type(src)
    except HarnessError as exc:  # ModelError: the run goes on and says so in each entry
        own, why = None, str(exc)
    else:
        why = ""
    out: list[LlamaCppRun] = []
    for qtype in types:
        as_is = qtype == own
        run = LlamaCppRun(qtype, str(src) if as_is else "", not as_is, tokens=tokens, repeats=repeats)
        out.append(run)
        t0 = time.monotonic()
        try:
            if why:
                raise HarnessError(f"the bench's file could not be read: {why}")
            path = src if as_is else quantise(tools, src, Path(files_dir), qtype, own, quantize_timeout, progress)
            run.file, run.file_bytes = str(path), path.stat().st_size
            run.seconds = time.monotonic() - t0
            progress(f"{run.name}: -n {tokens} -r {repeats} on {path.name} (up to {bench_timeout:.0f} s)")
            bench_file(run, tools, tokens, repeats, bench_timeout)
        except Exception as exc:  # whatever it is, this contender's failure, never the bench's
            run.error = str(exc) if isinstance(exc, HarnessError) and str(exc) else f"{type(exc).__name__}: {exc}"
            progress(f"{run.name}: FAILED: {run.error.splitlines()[0]}")
            continue
        progress(f"{run.name}: {run.tok_s:.1f} ± {run.stddev_tok_s or 0:.1f} tok/s ({run.seconds:.0f} s)")
    return out
