"""Comparing a chain with the unsplit model: tokens and stage-boundary digests, and `ppharness split-check`."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from ppharness.model.decode.exactness import compare, first_difference
from ppharness.model.engine.hidden import digest
from ppharness.run.inprocess import check_splits

RANGES = [(0, 3), (3, 5), (5, 8)]


def _digests(steps: int, salt: int = 0) -> dict[int, list[bytes]]:
    """Oracle-style digests: one list per block, one digest per step."""
    return {
        b: [digest(np.full((1, 1, 4), b * 100 + s + salt, dtype=np.float16)) for s in range(steps)] for b in range(8)
    }


def _stage_view(oracle: dict[int, list[bytes]]) -> dict[int, list[bytes]]:
    """What stages that compute exactly like the unsplit model report: the output of their last block."""
    return {i: list(oracle[hi - 1]) for i, (_, hi) in enumerate(RANGES[:-1])} | {len(RANGES) - 1: []}


@pytest.mark.parametrize(
    "a, b, expected",
    [([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1), ([1, 2], [1, 2, 3], 2), ([], [], None), ([5], [], 0)],
)
def test_first_difference(a, b, expected):
    assert first_difference(a, b) == expected


def test_equal_digests_and_tokens_are_exact():
    oracle = _digests(4)
    v = compare([1, 2, 3, 4], [1, 2, 3, 4], RANGES, _stage_view(oracle), oracle, prompt_tokens=6)
    assert v.exact and v.boundaries_compared == 2 * 4


def test_the_first_differing_boundary_is_named_in_step_then_stage_order():
    oracle = _digests(4)
    stages = _stage_view(oracle)
    stages[1][2] = b"\0" * 8  # stage 1 (after block 4) at decode step 2
    stages[0][3] = b"\0" * 8  # later step: not the first
    v = compare([1, 2, 3, 4], [1, 2, 3, 4], RANGES, stages, oracle, prompt_tokens=6)
    assert not v.exact and v.tokens_equal
    d = v.boundary_diff
    assert (d.stage, d.block, d.step, d.position) == (1, 4, 2, 7)
    line = v.describe([1, 2, 3, 4], [1, 2, 3, 4])
    assert "stage 1 sent to stage 2 (after block 4)" in line and "decode step 2 (position 7)" in line


def test_a_token_difference_names_the_token_and_both_values():
    oracle = _digests(3)
    v = compare([1, 7, 3], [1, 2, 3], RANGES, _stage_view(oracle), oracle, prompt_tokens=2)
    assert not v.exact and v.first_token_diff == 1
    assert "token 1 differs: the chain gave 7, the unsplit model 2" in v.describe([1, 7, 3], [1, 2, 3])


def test_a_stage_without_digests_is_not_called_exact():
    oracle = _digests(2)
    stages = _stage_view(oracle)
    stages[0] = []
    v = compare([1, 2], [1, 2], RANGES, stages, oracle, prompt_tokens=2)
    assert not v.exact and v.missing == [0]
    assert "stage(s) [0] sent no hidden-state digests" in v.describe([1, 2], [1, 2])


def test_a_stage_that_reports_fewer_steps_than_the_oracle_is_not_called_exact():
    oracle = _digests(3)
    stages = _stage_view(oracle)
    stages[1] = stages[1][:2]  # the last step's digest is not there: that step was never checked
    v = compare([1, 2, 3], [1, 2, 3], RANGES, stages, oracle, prompt_tokens=2)
    assert not v.exact and v.truncated == [1] and v.boundary_diff is None
    assert "stage(s) [1] reported fewer hidden-state digests" in v.describe([1, 2, 3], [1, 2, 3])


def test_the_check_catches_an_fp32_residual_between_blocks(tiny_model_path, monkeypatch):
    """The check can fail: with tinygrad's own block (fp32 residual stream between blocks, rounded only where a split
    puts a stage boundary) a split changes the hidden states, and split-check says where."""
    from tinygrad.apps.llm import TransformerBlock

    import ppharness.model.layers.block
    from ppharness.model.layers.attention import Chunk, attention_chunk

    class Fp32Block(TransformerBlock):  # tinygrad's block, which prefills in the project's chunks too
        def _attention(self, x, start_pos):
            if isinstance(start_pos, Chunk):
                return attention_chunk(self, x, start_pos)
            return super()._attention(x, start_pos)

    monkeypatch.setattr(ppharness.model.layers.block, "block_class", lambda: Fp32Block)
    _, checks = check_splits(tiny_model_path, "The quick brown fox", 8, [[(0, 3), (3, 5), (5, 8)]])
    assert not checks[0].exact
    assert checks[0].verdict.boundary_diff is not None or not checks[0].same_kernels


def test_split_check_command(tiny_model_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ppharness.cli",
            "split-check",
            "--model",
            tiny_model_path,
            "--stages",
            "2,1/6",
            "--max-tokens",
            "24",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("MATCH", "MISMATCH"))]
    assert len(lines) == 2 and all(ln.startswith("MATCH") for ln in lines), proc.stdout
    assert "[0,1), [1,6), [6,8)" in proc.stdout and "same kernels" in lines[1]


def test_split_check_refuses_bad_stages(tiny_model_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ppharness.cli", "split-check", "--model", tiny_model_path, "--stages", "two"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "--stages: 'two' is neither a stage count nor cut points" in proc.stderr + proc.stdout


def test_a_replaced_stage_without_digests_is_unverified_not_missing():
    from ppharness.model.decode.exactness import compare

    ranges = [(0, 2), (2, 4), (4, 8)]
    oracle = {1: [b"a", b"b"], 3: [b"c", b"d"]}
    v = compare([1, 2], [1, 2], ranges, {0: [], 1: [b"c", b"d"]}, oracle, 3, replaced=[0])
    assert v.exact and v.unverified == [0] and v.missing == [] and v.boundaries_compared == 2
    v = compare([1, 2], [1, 2], ranges, {0: [], 1: [b"c", b"d"]}, oracle, 3)
    assert not v.exact and v.missing == [0], "a stage that sent nothing, not replaced, must count as missing"
