import pytest

from specctl.policies.fixed import fixed_threshold, static
from specctl.policies.table import OFF, PolicyTable, Row, chain, rows_from_choices

S1, S3 = chain(1), chain(3)


@pytest.mark.parametrize("threshold, config, expect", [
    (5, S3, {1: S3, 4: S3, 5: OFF, 6: OFF, 1000: OFF}),
    (1, S3, {1: OFF, 2: OFF}),
    (2, S1, {1: S1, 2: OFF}),
    (64, S1, {63: S1, 64: OFF}),
    (10, OFF, {1: OFF, 50: OFF}),
])
def test_fixed_threshold(threshold, config, expect):
    t = fixed_threshold(threshold, config)
    for b, c in expect.items():
        assert t.lookup(b) == c, b
    assert t.source == "fixed"


def test_fixed_threshold_rejects_zero():
    with pytest.raises(ValueError):
        fixed_threshold(0, S3)


@pytest.mark.parametrize("rows, problem", [
    ((), "empty"),
    ((Row(2, None, OFF),), "expected 1"),
    ((Row(1, 3, S3),), "open-ended"),
    ((Row(1, None, S3), Row(2, None, OFF)), "not last"),
    ((Row(1, 3, S3), Row(5, None, OFF)), "expected 4"),
])
def test_invalid_tables_rejected(rows, problem):
    with pytest.raises(ValueError, match=problem):
        PolicyTable(rows=rows)


def test_rows_from_choices_compresses_and_round_trips():
    choices = [S3] * 4 + [S1] * 3 + [OFF] * 5
    t = PolicyTable(rows=rows_from_choices(choices))
    assert [(r.min_batch, r.max_batch, r.config) for r in t.rows] == [(1, 4, S3), (5, 7, S1), (8, None, OFF)]
    assert all(t.lookup(b + 1) == c for b, c in enumerate(choices))
    assert t.lookup(10_000) == OFF
    assert t.spec_off_crossover() == 8
    back = PolicyTable.from_policy_obj({"table": t.to_rows_obj(), "version": 3, "source": "online"})
    assert back.rows == t.rows and back.version == 3


def test_exploration_is_deterministic_and_bounded():
    t = PolicyTable(rows=(Row(1, 4, S3), Row(5, None, OFF)),
                    explore=(Row(8, 15, S1), Row(8, 15, S3)), explore_period=64)
    picks = [t.decide(10, step) for step in range(64 * 100)]
    explored = [p for p in picks if p != OFF]
    assert len(explored) == 100  # exactly one step in 64
    assert len(explored) / len(picks) <= 0.02
    assert explored.count(S1) == explored.count(S3) == 50  # rotates through the candidates
    # a second "rank" counting the same steps makes the same choices
    assert picks == [t.decide(10, step) for step in range(64 * 100)]
    # outside the explore ranges nothing changes
    assert all(t.decide(3, s) == S3 for s in range(200))
    assert static(S1).lookup(999) == S1
