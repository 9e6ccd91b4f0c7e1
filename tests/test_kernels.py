"""Kernel tables (ppharness/model/layers/kernels.py): a bad table is refused with the file, the place and the fix; a
kernel's key leaves out buffer lengths and variable bounds and nothing else; with ``-m slow``, a table tuned on this
machine keeps a split in separate processes exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ppharness.errors import ModelError
from ppharness.model.layers import kernels
from ppharness.model.layers.kernels import FORMAT, decode_table, kernel_key, load_table


def table_doc(**over: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "format": FORMAT,
        "device": "CPU",
        "renderer": "ClangRenderer",
        "tinygrad": kernels.tinygrad_version(),
        "beam": 2,
        "kernels": {"ab" * 32: [["UPCAST", 0, 4], ["TC", 0, [0, 0, 1]], ["NOLOCALS", None, None]]},
    }
    doc.update(over)
    return doc


def test_a_good_table_reads_back(tmp_path):
    path = tmp_path / "k.json"
    path.write_text(json.dumps(table_doc()))
    table = load_table(path)
    assert table.beam == 2 and len(table.kernels["ab" * 32]) == 3
    kernels.save_table(table, tmp_path / "again.json")
    assert load_table(tmp_path / "again.json") == table


@pytest.mark.parametrize(
    "doc, says",
    [
        (b"{not json", "not JSON"),
        (json.dumps(table_doc(format="other/9")).encode(), "$.format"),
        (json.dumps(table_doc(beam=0)).encode(), "$.beam"),
        (json.dumps(table_doc(extra=1)).encode(), "not a kernel table"),
        (json.dumps(table_doc(kernels={"xyz": []})).encode(), "is not a kernel key"),
        (json.dumps(table_doc(kernels={"ab" * 32: [["FLY", 0, 1]]})).encode(), "unknown optimisation 'FLY'"),
        (json.dumps(table_doc(kernels={"ab" * 32: [["UPCAST", 99, 4]]})).encode(), "out of range"),
        (json.dumps(table_doc(kernels={"ab" * 32: [["UPCAST", 0, 4]] * 40})).encode(), "over the limit"),
    ],
    ids=["not-json", "format", "beam", "unknown-field", "key", "op", "axis", "too-many"],
)
def test_a_bad_table_is_refused_naming_the_place_and_the_fix(doc, says):
    with pytest.raises(ModelError) as err:
        decode_table(doc, "hand.json")
    assert str(err.value).startswith("hand.json: ") and says in str(err.value)


def test_a_missing_or_oversized_table_file_is_refused_naming_it(tmp_path):
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ModelError, match=r"nope\.json: no such file .*other\.json"):
        load_table(tmp_path / "nope.json")
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (kernels.MAX_FILE_BYTES + 1))
    with pytest.raises(ModelError, match=r"big\.json: \$: the file is over the limit"):
        load_table(big)


def test_a_table_of_another_tinygrad_is_refused(tmp_path):
    table = decode_table(json.dumps(table_doc(tinygrad="0.0.1")).encode(), "old.json")
    with pytest.raises(ModelError, match="searched with tinygrad 0.0.1"):
        kernels.pin(table, "old.json")


def _bank_ast(rows: int, reduce: str = "sum"):
    """The AST of a kernel that reads one row (a bound variable) of a (rows, 16) buffer, as an expert bank does."""
    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp

    v = UOp.variable("slot", 0, rows - 1).bind(1)
    x = Tensor.empty(rows, 16, dtype="float16")[v : v + 1]
    y = x.sum(axis=1) if reduce == "sum" else x.max(axis=1)
    schedule, _ = y.schedule_with_vars()
    (item,) = [s for s in schedule if s.ast.op.name == "SINK"]
    return item.ast


def test_a_kernels_key_leaves_out_buffer_lengths_and_variable_bounds_only():
    assert _bank_ast(4).key != _bank_ast(64).key, "tinygrad's own key tells the two apart"
    assert kernel_key(_bank_ast(4), "R") == kernel_key(_bank_ast(64), "R")
    assert kernel_key(_bank_ast(4), "R") != kernel_key(_bank_ast(4, "max"), "R")
    assert kernel_key(_bank_ast(4), "R") != kernel_key(_bank_ast(4), "S")


@pytest.mark.slow
def test_a_tuned_table_keeps_a_split_in_processes_exact(tmp_path):
    """Tune synthetic:tiny on this machine, then run a 3-stage chain of local processes and the oracle with the
    table: the answer and every boundary equal, and the table did change kernels (else this proves nothing)."""
    table = tmp_path / "kernels.json"
    tuned = subprocess.run(
        [sys.executable, "-m", "ppharness.cli", "tune", "--model", "synthetic:tiny", "--beam", "1", "--out", table],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert tuned.returncode == 0, tuned.stderr[-2000:]
    assert "other than the heuristic" in tuned.stdout and "(0 other than" not in tuned.stdout, tuned.stdout
    run = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "pp-smoke-run"), "--num-stages", "3"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, kernels.ENV: str(table)},
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "MATCH" in out and "compiled from the table" in out, out[-3000:]


def test_the_committed_tables_read_and_match_this_tinygrad():
    """Every table under scenarios/kernels/ is a good table for the tinygrad this project locks (else a user who
    names it gets a refusal)."""
    from pathlib import Path

    tables = sorted((Path(__file__).resolve().parents[1] / "scenarios" / "kernels").glob("*.json"))
    assert tables, "no committed kernel table"
    for path in tables:
        table = load_table(path)
        assert table.tinygrad == kernels.tinygrad_version() and table.kernels, path
        assert len(kernels.msgspec.json.encode(table)) <= kernels.MAX_ENV_BYTES, f"{path} cannot be handed to nodes"


@pytest.mark.slow  # a search interrupted on purpose (20 s); the tune's table itself is checked by the default run
def test_an_interrupted_tune_keeps_the_kernels_it_searched(tmp_path):
    """SIGTERM (or Ctrl-C) during `ppharness tune` ends it with exit 128 + the signal and one line, and the table it
    leaves is a good table of the kernels searched so far."""
    import signal
    import time

    table = tmp_path / "partial.json"
    with subprocess.Popen(
        [sys.executable, "-m", "ppharness.cli", "tune", "--model", "synthetic:tiny", "--beam", "1", "--out", table],
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stderr is not None
        deadline = time.monotonic() + 300
        for line in proc.stderr:
            if "searched 2 kernel(s)" in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, rest
    assert f"interrupted; the kernels searched so far are in {table}" in rest, rest
    assert len(load_table(table).kernels) >= 2
