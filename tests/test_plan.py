from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ppharness.errors import ScenarioError
from ppharness.plan.stages import ENTRY, EXIT, even_splits, make_plan, names_of


def test_even_split_gives_the_remainder_to_the_first_stages():
    """The default (balanced) rule: 8 blocks over 5 stages are 2/2/2/1/1, not 1/1/1/1/4."""
    assert make_plan(8, 3).ranges == ((0, 3), (3, 6), (6, 8))
    assert make_plan(8, 5).ranges == ((0, 2), (2, 4), (4, 6), (6, 7), (7, 8))
    assert make_plan(8, 1).ranges == ((0, 8),)
    assert make_plan(8, 8).ranges == tuple((i, i + 1) for i in range(8))


def test_floor_split_rule_gives_the_last_stage_the_remainder():
    """The SPEC's rule, kept as ``split_rule: floor``: k = blocks // N per stage, the last stage takes the rest."""
    assert make_plan(8, 3, split_rule="floor").ranges == ((0, 2), (2, 4), (4, 8))
    assert make_plan(8, 5, split_rule="floor").ranges == ((0, 1), (1, 2), (2, 3), (3, 4), (4, 8))
    with pytest.raises(ScenarioError, match="unknown rule 'ceil'"):
        make_plan(8, 3, split_rule="ceil")


def test_explicit_splits():
    assert make_plan(8, splits=[1, 6]).ranges == ((0, 1), (1, 6), (6, 8))
    assert make_plan(8, 3, splits=[1, 6]).num_stages == 3


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"num_stages": 9}, "9 stages but the model has 8 blocks"),
        ({"num_stages": 0}, "at least 1"),
        ({"splits": [3, 3]}, "strictly increasing"),
        ({"splits": [0, 4]}, "strictly increasing"),
        ({"splits": [4, 8]}, "strictly increasing"),
        ({"num_stages": 2, "splits": [2, 4]}, "disagrees"),
    ],
)
def test_impossible_plans_are_rejected(kwargs, needle):
    with pytest.raises(ScenarioError, match=needle):
        make_plan(8, **kwargs)


@given(blocks=st.integers(1, 64), data=st.data())
def test_even_split_covers_every_block_once(blocks, data):
    n = data.draw(st.integers(1, blocks))
    ranges = make_plan(blocks, n).ranges
    assert len(ranges) == n
    assert [b for lo, hi in ranges for b in range(lo, hi)] == list(range(blocks))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert even_splits(blocks, n) == [lo for lo, _ in ranges[1:]]
    floor = make_plan(blocks, n, split_rule="floor").ranges
    assert all(hi - lo == blocks // n for lo, hi in floor[:-1])


def test_plan_id_depends_on_model_and_split():
    a, b, c = make_plan(8, 2, model_id="m1"), make_plan(8, 4, model_id="m1"), make_plan(8, 2, model_id="m2")
    assert len({a.plan_id, b.plan_id, c.plan_id}) == 3
    assert make_plan(8, 2, model_id="m1").plan_id == a.plan_id


def test_names():
    assert names_of(0, 1) == ["pp-stage-0", ENTRY, EXIT]
    assert names_of(0, 3) == ["pp-stage-0", ENTRY]
    assert names_of(1, 3) == ["pp-stage-1"]
    assert names_of(2, 3) == ["pp-stage-2", EXIT]
