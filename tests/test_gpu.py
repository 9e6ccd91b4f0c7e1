"""On a GPU (``pytest -m gpu``; skipped elsewhere with the reason): kernels searched on the GPU keep a split in
separate processes exact, co-located stages hand over on the device and match, and a decode block is measured beside
the PyTorch fp16 GEMV floor of its shapes.

Run with DEV=CUDA (or CUDA=1) on a machine with an NVIDIA GPU; the floor also needs PyTorch with CUDA.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ppharness.model.layers import kernels

pytestmark = pytest.mark.gpu


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "DEV": os.environ.get("DEV") or "CUDA"}
    env.pop(kernels.ENV, None)  # only the table a test names
    return env | extra


def test_kernels_tuned_on_the_gpu_keep_a_split_in_processes_exact(tmp_path):
    """Tune synthetic:tiny on the GPU, then a 3-stage chain of node processes and the oracle (in this run's own
    process) both compile from the table: every token and every stage boundary equal, bit for bit."""
    table = tmp_path / "kernels.json"
    tuned = subprocess.run(
        [sys.executable, "-m", "ppharness.cli", "tune", "--model", "synthetic:tiny", "--beam", "2", "--out", table],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(),
    )
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    doc = json.loads(table.read_text())
    assert doc["device"] in ("CUDA", "NV") and doc["kernels"], doc
    assert "(0 other than" not in tuned.stdout, f"the search changed no kernel, so this proves nothing: {tuned.stdout}"
    run = subprocess.run(
        [sys.executable, "-m", "ppharness.cli.smoke", "--num-stages", "3", "--max-tokens", "32"],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(**{kernels.ENV: str(table)}),
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "MATCH" in out and "compiled from the table" in out, out[-4000:]


def test_a_decode_block_is_measured_beside_the_floor_of_its_shapes(tmp_path):
    """`bench block` on the 1B shape: tinygrad's block and fixed cost, and a PyTorch floor whose bandwidth is that
    of a real memory read (between 100 GB/s and 10 TB/s), in one run."""
    pytest.importorskip("torch", reason="the floor needs PyTorch with CUDA")
    out = tmp_path / "block.json"
    run = subprocess.run(
        [sys.executable, "-m", "ppharness.cli", "bench", "block", "--model", "synthetic:llama-3.2-1b,blocks=4"]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(),
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    (cost,) = json.loads(out.read_text())
    print(run.stdout)
    assert cost["floor_block_ms"], f"no floor was measured: {cost['floor_note']}"
    gbs = cost["weight_mib"] * 2**20 / (cost["floor_block_ms"] / 1e3) / 1e9
    assert 100 < gbs < 10_000, f"the floor read {cost['weight_mib']:.0f} MiB at {gbs:.0f} GB/s: not a memory read"
    assert cost["tinygrad_block_ms"] > 0 and cost["ratio"] == pytest.approx(
        cost["tinygrad_block_ms"] / cost["floor_block_ms"]
    )


def test_batched_rows_on_the_gpu_are_the_bytes_of_each_request_alone():
    """On the GPU, where tinygrad's own choices differ by batch width (a split reduction for one row, other
    optimisations for many), a batched slice's rows are still each request's bytes alone: the batched-decode property
    of ``tests/test_batched_decode.py``, run on the GPU over the 1B shape's width (4 blocks)."""
    code = (
        "import numpy as np\n"
        "from ppharness.model.sources.files import resolve_model\n"
        "from ppharness.model.gguf_file import GGUFFile\n"
        "from ppharness.model.engine.slicing import ModelSlice\n"
        "f = GGUFFile(resolve_model('synthetic:llama-3.2-1b,blocks=4'))\n"
        "m = ModelSlice(f, 0, 2, True, False, 64, slots=8, batched=True)\n"
        "rng = np.random.default_rng(0)\n"
        "prompts = [[int(t) for t in rng.integers(0, 1000, 3 + s)] for s in range(8)]\n"
        "for s in range(8): m.prefill(prompts[s], s)\n"
        "alone = [m.decode_rows([[7 + s]], [3 + s], [s])[0] for s in range(8)]\n"
        "for s in range(8): m.prefill(prompts[s], s)\n"
        "both = m.decode_rows([[7 + s] for s in range(8)], [3 + s for s in range(8)], list(range(8)))\n"
        "bad = [s for s in range(8) if alone[s].tobytes() != both[s].tobytes()]\n"
        "print('rows differing from alone:', bad)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=_env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rows differing from alone: []" in run.stdout, run.stdout + run.stderr[-2000:]


def test_co_located_stages_on_the_gpu_hand_the_hidden_state_over_on_the_device_and_match(tmp_path):
    """Three stages in one process on the GPU, each hand-over left on the device (``ppharness.model.engine.hidden``):
    the answer and every stage boundary equal the unsplit model's, bit for bit."""
    run = subprocess.run(
        [sys.executable, "-m", "ppharness.cli.smoke", "--num-stages", "3", "--colocated", "--max-tokens", "32"],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(),
    )
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert "MATCH" in out and "serving stages 0-2 in one process" in out, out[-4000:]
