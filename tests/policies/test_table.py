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


@pytest.mark.parametrize("batch, step, expect", [
    (10, 0, S1),       # step 0 % 64: an exploring step, the exploration row covers 10
    (10, 16, S3),      # 16 % 16: a challenging step, the challenge row covers 10
    (10, 17, OFF),     # neither: the table
    (10, 64, S1),      # exploring steps keep precedence
    (3, 0, S3),        # no exploration row at 3, and no challenge at 3 either: the table's s3
    (3, 16, S3),
    (20, 32, S3),      # a challenge row at 16-31; no exploration row there
    (20, 64, S3),      # an exploring step with no exploration row at 20 is a challenging step
    (40, 16, OFF),     # nothing covers 40
])
def test_challenging_steps_come_from_the_steps_exploring_leaves(batch, step, expect):
    t = PolicyTable(rows=(Row(1, 4, S3), Row(5, None, OFF)), explore=(Row(8, 15, S1),), explore_period=64,
                    challenge=(Row(8, 15, S3), Row(16, 31, S3)), challenge_period=16)
    assert t.decide(batch, step) == expect
    # challenge_period 0: exploring steps and the table only
    plain = PolicyTable(rows=t.rows, explore=t.explore, explore_period=64, challenge=t.challenge)
    assert plain.decide(batch, step) == (S1 if step % 64 == 0 and 8 <= batch <= 15 else t.lookup(batch))


def test_challengers_rotate_and_every_rank_agrees():
    t = PolicyTable(rows=(Row(1, None, OFF),), challenge=(Row(1, 7, S1), Row(1, 7, S3)), challenge_period=16)
    picks = [t.decide(4, step) for step in range(16 * 100)]
    assert picks.count(S1) == picks.count(S3) == 50 and picks.count(OFF) == 1500
    assert picks == [t.decide(4, step) for step in range(16 * 100)]
    assert t.configs() == [OFF, S1, S3]
