"""The one reader of documents people write (scenarios, plans, clusters): the file read within its kind's size limit,
its text screened (``ppharness.document.yaml_limits``) and decoded. Every problem is an error of the caller's kind
(``ScenarioError``, ``PlanError``) naming the file, the ``$.path`` and the fix; the caller turns the decoded data into
its own typed document.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from ppharness.document.explain import explain_yaml
from ppharness.document.json_fast import read_json
from ppharness.document.keys import Keys
from ppharness.document.yaml_limits import MAX_FILE_BYTES, PLAN_LIMITS, SCENARIO_LIMITS, Limits, YamlLimit, screen
from ppharness.errors import HarnessError

# what each kind of document may weigh: a plan (or cluster) is written by a program and may name every expert; a
# kernel table (JSON, ``ppharness tune``) only its file size counts
LIMITS = {"scenario": SCENARIO_LIMITS, "plan": PLAN_LIMITS, "cluster": PLAN_LIMITS, "kernel table": PLAN_LIMITS}


def read_text_file(path: Path, what: str, pattern: str, error: type[HarnessError]) -> str:
    """A small UTF-8 text file's contents, read only up to its kind's limit (``LIMITS``); every problem is ``error``
    naming the file and the fix (``what``: a key of ``LIMITS``; ``pattern``: the siblings to suggest when it is
    missing)."""
    if not path.is_file():
        hint = f"pass the path of a {what} file"
        siblings = sorted(p.name for p in path.parent.glob(pattern)) if path.parent.is_dir() else []
        if siblings:
            more = ", ..." if len(siblings) > 8 else ""
            hint += f" (in {path.parent}/: {', '.join(siblings[:8])}{more})"
        kind = "is a directory" if path.is_dir() else "no such file"
        raise error(f"{path}: {kind} — {hint}")
    limit = LIMITS[what].file_bytes
    usual = "a few KiB" if limit <= MAX_FILE_BYTES else "far smaller"
    too_big = (
        f"{path}: $: the file is over the limit of {limit:,} bytes ({limit >> 20} MiB) — a {what} is {usual}; "
        f"check that this is the {what} file"
    )
    try:
        if path.stat().st_size > limit:
            raise error(too_big)
        with path.open("rb") as f:
            data = f.read(limit + 1)  # the file may have grown since stat
        if len(data) > limit:
            raise error(too_big)
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text (byte {exc.start}) — save the file as UTF-8") from None
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror}") from None


def screen_text(text: str, source: str, limits: Limits, error: type[HarnessError], keys: Keys | None = None) -> None:
    """Refuse ``text`` that breaks ``limits`` or is not YAML, or holds a key or more list items than ``keys`` allows
    (``ppharness.document.keys``), as ``error`` naming ``source`` and the ``$.path``."""
    try:
        screen(text, limits, keys)
    except YamlLimit as exc:
        raise error(f"{source}: {exc}" if exc.located else f"{source}: {exc.path}: {exc}") from None


def parse_text(text: str, source: str, limits: Limits, error: type[HarnessError], keys: Keys | None = None) -> object:
    """``text`` screened (``keys``: as ``screen_text`` takes them), then decoded as plain YAML (JSON is YAML):
    mappings, lists and scalars, ``None`` for an empty document. A JSON object within the limits is read the
    faster JSON way (``ppharness.document.json_fast``), to the same data."""
    fast = read_json(text, limits, keys)
    if fast is not None:
        return fast
    screen_text(text, source, limits, error, keys)
    try:
        return msgspec.yaml.decode(text)
    except msgspec.DecodeError as exc:
        raise error(f"{source}: {explain_yaml(exc)}") from None
