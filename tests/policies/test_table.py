import pytest

from specctl.policies.fixed import fixed_threshold, static
from specctl.policies.table import (OFF, Band, PolicyTable, Row, chain, ctx_band_index, ctx_band_range, mean_ctx,
                                   rows_from_choices)

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


# ------------------------------------------------------------------------- context bands

BANDED = PolicyTable(rows=(Row(1, 20, S3), Row(21, None, OFF)),
                     bands=(Band(0, 1023, (Row(1, 60, S3), Row(61, None, OFF))),
                            Band(1024, None, (Row(1, 8, S3), Row(9, 12, S1), Row(13, None, OFF)))))


@pytest.mark.parametrize("batch, ctx_tokens, expect", [
    (10, None, S3), (30, None, OFF),          # context unknown: the rows naming none
    (30, 30 * 300, S3), (61, 61 * 300, OFF),  # mean 300 tokens: the short band
    (30, 30 * 1023, S3), (30, 30 * 1024, OFF),  # the band edge is on the mean, inclusive
    (10, 10 * 6000, S1), (8, 8 * 6000, S3), (13, 13 * 6000, OFF),
    (30, 0, S3),                              # an empty context is the lowest band's
    (1, 10_000_000, S3), (0, 5000, S3),       # batch sizes clamp to 1, as without bands
])
def test_a_banded_table_looks_up_by_batch_and_mean_context(batch, ctx_tokens, expect):
    assert BANDED.lookup(batch, ctx_tokens) == expect
    assert BANDED.decide(batch, 17, ctx_tokens) == expect


def test_bands_outside_every_range_use_the_rows_naming_no_context():
    t = PolicyTable(rows=(Row(1, None, OFF),), bands=(Band(256, 511, (Row(1, None, S3),)),))
    assert [t.lookup(4, 4 * m) for m in (255, 256, 511, 512)] == [OFF, S3, S3, OFF]
    assert t.rows_for(300) == (Row(1, None, S3),) and t.rows_for(None) == t.rows and t.rows_for(100) == t.rows


def test_exploring_rows_for_any_context_ignore_it_and_banded_ones_cover_their_band_only():
    t = PolicyTable(rows=BANDED.rows, bands=BANDED.bands, explore=(Row(8, 15, S1),), explore_period=64)
    assert t.decide(10, 0, 10 * 6000) == S1 and t.decide(10, 1, 10 * 6000) == S1
    assert t.decide(10, 0, 10 * 300) == S1 and t.decide(10, 1, 10 * 300) == S3
    t = PolicyTable(rows=BANDED.rows, bands=BANDED.bands, explore_period=64,
                    explore=(Row(8, 15, S1), Row(1, None, OFF, min_ctx=4096)))
    # at 6000 tokens a request both rows cover batch 10 and take turns; at 300 only the first does
    assert [t.decide(10, 64 * k, 10 * 6000) for k in range(4)] == [S1, OFF, S1, OFF]
    assert [t.decide(10, 64 * k, 10 * 300) for k in range(4)] == [S1] * 4
    assert [t.decide(3, 64 * k, 3 * 5000) for k in range(2)] == [OFF, OFF]
    assert [t.decide(3, 64 * k) for k in range(2)] == [S3, S3]  # unknown context: no banded row covers it
    back = PolicyTable.from_policy_obj({"table": t.to_rows_obj(), "explore": [
        {"min_batch": 8, "max_batch": 15, "config": {"steps": 1, "topk": 1, "draft_tokens": 2}},
        {"min_batch": 1, "max_batch": None, "config": {"steps": 0, "topk": 1, "draft_tokens": 1}, "min_ctx": 4096}],
        "explore_period": 64})
    assert back.explore == t.explore


def test_banded_rows_round_trip_through_the_policy_json():
    obj = {"table": BANDED.to_rows_obj(), "version": 4, "source": "online"}
    assert [("min_ctx" in r, "max_ctx" in r) for r in obj["table"]] == [(False, False)] * 2 + [(True, True)] * 2 + [(True, False)] * 3
    back = PolicyTable.from_policy_obj(obj)
    assert back == BANDED.__class__(rows=BANDED.rows, bands=BANDED.bands, version=4, source="online")
    assert back.configs() == [S3, OFF, S1]
    # a table without bands writes exactly what it wrote before bands existed
    plain = PolicyTable(rows=BANDED.rows)
    assert plain.to_rows_obj() == [{"min_batch": 1, "max_batch": 20, "config": {"steps": 3, "topk": 1, "draft_tokens": 4}},
                                   {"min_batch": 21, "max_batch": None, "config": {"steps": 0, "topk": 1, "draft_tokens": 1}}]


@pytest.mark.parametrize("bands, problem", [
    ((Band(0, 99, (Row(1, 4, S3),)),), "band 0-99: the last table row must be open-ended"),
    ((Band(0, 99, (Row(2, None, S3),)),), "band 0-99: table row 0 starts at batch 2"),
    ((Band(100, 50, (Row(1, None, S3),)),), "empty"),
    ((Band(0, 99, (Row(1, None, S3),)), Band(99, None, (Row(1, None, OFF),))), "overlaps"),
    ((Band(100, None, (Row(1, None, S3),)), Band(0, 99, (Row(1, None, OFF),))), "overlaps or precedes"),
    ((Band(0, None, (Row(1, None, S3),)), Band(200, None, (Row(1, None, OFF),))), "overlaps or precedes"),
])
def test_invalid_bands_rejected(bands, problem):
    with pytest.raises(ValueError, match=problem):
        PolicyTable(rows=(Row(1, None, OFF),), bands=bands)


def test_a_band_split_across_the_list_is_refused():
    rows = BANDED.to_rows_obj()
    with pytest.raises(ValueError, match="not consecutive"):
        PolicyTable.from_policy_obj({"table": [rows[2], rows[0], rows[1], rows[3]]})


@pytest.mark.parametrize("mean, band, lo_hi", [
    (0, 0, (0, 1)), (1, 0, (0, 1)), (2, 1, (2, 3)), (3, 1, (2, 3)), (300, 8, (256, 511)),
    (6000, 12, (4096, 8191)), (8191, 12, (4096, 8191)), (8192, 13, (8192, 16383)),
])
def test_power_of_two_context_bands(mean, band, lo_hi):
    assert ctx_band_index(mean) == band and ctx_band_range(band) == lo_hi
    assert mean_ctx(mean * 7 + 6, 7) == mean


def test_a_table_uses_the_context_where_a_band_or_a_banded_row_does():
    assert not PolicyTable(rows=BANDED.rows).uses_ctx and BANDED.uses_ctx
    assert PolicyTable(rows=BANDED.rows, explore=(Row(1, None, S1, min_ctx=512),), explore_period=64).uses_ctx
    assert not PolicyTable(rows=BANDED.rows, explore=(Row(1, None, S1),), explore_period=64).uses_ctx
