"""A kernel table whose optimisation changes the arithmetic fails closed (ppharness/model/layers/kernels.py's docstring
says what a table can change): tinygrad 0.12 takes PADTO on ``sum(x + 1)`` and adds the padding's ones, so a table
holding it is refused when read and a run under it exits 1 naming the table; a mismatch under a table names the
table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ppharness.errors import ModelError
from ppharness.model.decode.exactness import BoundaryDiff, SplitVerdict
from ppharness.model.layers import kernels

ROOT = Path(__file__).resolve().parent.parent
PADDING: kernels.OptRow = ("PADTO", 0, 64)  # 100 values padded to 128
N = 100


def _sum_kernel():
    """The kernel that sums ``x + 1`` over N values, scheduled with its buffers, and tinygrad's scheduler for it as
    a kernel table's choice starts from (``kernels.Pinning.choose``)."""
    # tinygrad imported when used, as in tests/test_kernels.py: collecting the tests does not load it
    from tinygrad import Device, Tensor
    from tinygrad.codegen.opt.postrange import Scheduler
    from tinygrad.uop import Ops

    x = Tensor(np.arange(N, dtype=np.float32) / N).realize()
    schedule, _ = (x + 1).sum().schedule_with_vars()
    (item,) = [s for s in schedule if s.ast.op is Ops.SINK]
    s = Scheduler(item.ast, Device[Device.DEFAULT].renderer)
    s.convert_loop_to_global()
    return item, s


def _run(item, s) -> float:
    """The sum as the kernel compiled by ``s`` computes it."""
    # tinygrad imported when used (above)
    from tinygrad.codegen import get_program
    from tinygrad.engine.realize import CompiledRunner

    runner = CompiledRunner(get_program(s.get_optimized_ast(), s.ren))
    bufs = [b.ensure_allocated() for b in item.bufs]
    runner([bufs[i] for i in runner.p.globals], {}, wait=True)
    return float(np.frombuffer(bufs[0].as_buffer(), dtype=np.float32)[0])


def _hostile_table(path: Path) -> Path:
    """A kernel table, made with the project's table API, that pads the sum's loop (key: the sum's kernel)."""
    _, s = _sum_kernel()
    table = kernels.new_table(s.ren.device.split(":")[0], type(s.ren).__name__, 1)
    table.kernels[kernels.kernel_key(s.ast, type(s.ren).__name__)] = [PADDING]
    kernels.save_table(table, path)
    return path


def test_tinygrad_takes_a_padding_that_changes_a_sum():
    """Why a table may not pad: tinygrad applies the row without complaint and the kernel sums 28 ones more."""
    # tinygrad imported when used (above)
    from tinygrad.codegen.opt import Opt, OptOps

    item, s = _sum_kernel()
    want = float((np.arange(N, dtype=np.float32) / N + 1).sum())
    assert _run(item, kernels.heuristic(s.copy())) == pytest.approx(want, rel=1e-6)
    name, axis, arg = PADDING
    padded = s.copy()
    padded.apply_opt(Opt(OptOps[name], axis, arg))  # accepted: no KernelOptError
    assert _run(item, padded) == pytest.approx(want + (128 - N), rel=1e-6), "tinygrad no longer pads this sum wrongly"


def test_a_table_that_pads_a_loop_is_refused_when_read(tmp_path):
    path = _hostile_table(tmp_path / "hostile.json")
    with pytest.raises(ModelError) as err:
        kernels.load_table(path)
    says = str(err.value)
    assert says.startswith(f"{path}: $.kernels.") and "pads a loop, which a kernel table does not" in says, says
    assert "make the table again with `ppharness tune`, or unset PPHARNESS_KERNELS" in says, says


def test_a_run_under_a_table_that_changes_the_arithmetic_exits_1_naming_the_table(tmp_path):
    """pp-smoke-run with PPHARNESS_KERNELS naming the table: exit 1 before any node starts, one line naming the
    table file, the kernel's row and the fix."""
    path = _hostile_table(tmp_path / "hostile.json")
    env = {k: v for k, v in os.environ.items() if k != kernels.TABLE_ENV} | {kernels.ENV: str(path)}
    run = subprocess.run(
        [sys.executable, "-m", "ppharness.cli.smoke", "--num-stages", "2", "--max-tokens", "4", "--no-trace"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    out = run.stdout + run.stderr
    assert run.returncode == 1, out[-3000:]
    assert f"{path}: $.kernels." in out and "pads a loop, which a kernel table does not" in out, out[-3000:]
    assert "MATCH" not in out and "Traceback" not in out, out[-3000:]


def test_tune_does_not_search_paddings(tmp_path):
    """BEAM_PADTO adds PADTO to tinygrad's search: `ppharness tune` refuses to run with it rather than write a table
    every process would refuse."""
    out = tmp_path / "t.json"
    env = {k: v for k, v in os.environ.items() if k not in (kernels.ENV, kernels.TABLE_ENV)} | {"BEAM_PADTO": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "ppharness.cli", "tune", "--model", "synthetic:tiny", "--beam", "1", "--out", out],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert "BEAM_PADTO is set: the search would pad loops" in run.stderr and not out.exists(), run.stderr[-2000:]


def test_a_mismatch_under_a_kernel_table_names_the_table(monkeypatch):
    """A process that read another table, or none, computes other bits: the mismatch line says which table the
    unsplit model compiled with, and how to tell whether it is the cause."""
    table = kernels.new_table("CPU", "ClangJITRenderer", 1)
    verdict = SplitVerdict(False, 1, 2, BoundaryDiff(0, 3, 1, 5))
    assert "kernel table" not in verdict.describe([1, 7], [1, 2])
    monkeypatch.setattr(kernels, "_active", kernels.Pinning(table, "tuned.json"))
    line = verdict.describe([1, 7], [1, 2])
    assert line.startswith("token 1 differs: the chain gave 7, the unsplit model 2"), line
    assert "the unsplit model compiled with the kernel table tuned.json" in line and "unset PPHARNESS_KERNELS" in line
    exact = SplitVerdict(True, None, 4)
    assert "kernel table" not in exact.describe([1, 2], [1, 2])
