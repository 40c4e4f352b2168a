import numpy as np
import pytest

from specctl.policies.costmodel import Option, choose, derive, measuring_gain
from specctl.policies.table import OFF, PolicyTable, Row, chain

S1, S3 = chain(1), chain(3)
B = np.arange(1, 129, dtype=float)


def opt(c, tau, base, slope):
    return Option(c, tau, base + slope * B)


@pytest.mark.parametrize("options, expect", [
    # spec with tau 2 and 1.5x the step time wins everywhere
    ([opt(OFF, 1.0, 6, 0.0), opt(S3, 2.0, 9, 0.0)], {1: S3, 128: S3}),
    # steep spec cost: crossover where 2.5/(7.1+0.3b) = 1/(6+0.02b) -> b = 31.6
    ([opt(OFF, 1.0, 6, 0.02), opt(S3, 2.5, 7.1, 0.3)], {1: S3, 31: S3, 32: OFF, 128: OFF}),
    # three options: s3 at small b, s1 in the middle, off at large b
    ([opt(OFF, 1.0, 6, 0.02), opt(S1, 1.7, 7, 0.07), opt(S3, 2.6, 8, 0.2)], {1: S3, 40: S1, 128: OFF}),
])
def test_argmax_goodput(options, expect):
    choices = choose(options)
    for b, c in expect.items():
        assert choices[b - 1] == c, b


def test_hysteresis_keeps_boundary_within_margin():
    options = [opt(OFF, 1.0, 6, 0.02), opt(S3, 2.5, 7.1, 0.3)]
    first = derive(options)
    assert first.spec_off_crossover() == 32
    # estimates wobble by 0.9% (spec looks a bit better): without hysteresis the boundary moves...
    wobble = [opt(OFF, 1.0, 6, 0.02), opt(S3, 2.5 * 1.009, 7.1, 0.3)]
    assert derive(wobble).spec_off_crossover() != 32
    # ...with the previous table as reference it stays
    assert derive(wobble, previous=first).spec_off_crossover() == 32
    # a real change (10% better acceptance) moves it
    moved = [opt(OFF, 1.0, 6, 0.02), opt(S3, 2.5 * 1.1, 7.1, 0.3)]
    assert derive(moved, previous=first).spec_off_crossover() > 32


def se_opt(c, tau, base, slope, se=0.0, trusted=None):
    return Option(c, tau, base + slope * B, trusted, np.full(len(B), se))


INF = float("inf")


@pytest.mark.parametrize("case, options, tau_var, chosen, z, expect", [
    # clear loser, well measured: not worth a step
    ("decided", [se_opt(OFF, 1.0, 6, 0.0, 0.01), se_opt(S3, 2.5, 8, 0.0, 0.01)], 0.0, S3, 2.0, {OFF: "<0"}),
    # the same loser measured once (20% error): it might win, measure it
    ("thin", [se_opt(OFF, 1.0, 6, 0.0, 0.5), se_opt(S3, 2.5, 8, 0.0, 0.01)], 0.0, S3, 2.0, {OFF: ">0"}),
    # a near-tie within the margin's reach: 2 s.e. of 3% cover a 2% shortfall
    ("near-tie", [se_opt(OFF, 1.0, 6, 0.0, 0.03), se_opt(S1, 1.0 / 0.98, 6, 0.0, 0.0)], 0.0, S1, 2.0,
     {OFF: ">0"}),
    # ... but z = 0 measures only predicted wins (by more than the margin)
    ("near-tie z=0", [se_opt(OFF, 1.0, 6, 0.0, 0.03), se_opt(S1, 1.0 / 0.98, 6, 0.0, 0.0)], 0.0, S1, 0.0,
     {OFF: "<0"}),
    # uncertain acceptance where plain decode is chosen: s3 may win (tau 1.8, could be 2.5)
    ("acceptance", [se_opt(OFF, 1.0, 6, 0.0, 0.0), se_opt(S3, 1.8, 12, 0.0, 0.0)], 0.3, OFF, 2.0, {S3: ">0"}),
    # ... unless it could not win even with every draft accepted (4 tokens at 5x the step time)
    ("hopeless", [se_opt(OFF, 1.0, 6, 0.0, 0.0), se_opt(S3, 1.8, 30, 0.0, 0.0)], 9.0, OFF, 2.0, {S3: "<0"}),
    # untrusted (never measured near here): nothing bounds it, measure it
    ("untrusted", [se_opt(OFF, 1.0, 6, 0.0, 0.0, np.zeros(len(B), bool)), se_opt(S3, 2.5, 8, 0.0, 0.0)], 0.0,
     S3, 2.0, {OFF: INF}),
])
def test_measuring_gain(case, options, tau_var, chosen, z, expect):
    tv = np.array([[0.0, tau_var], [tau_var, 0.0]])
    gains = measuring_gain(options, [chosen] * 8, 9, z=z, tau_log_var=tv)
    assert set(gains) == set(expect), case
    for c, want in expect.items():
        g = gains[c]
        if want == ">0":
            assert 0 < g < INF, (case, g)
        elif want == "<0":
            assert g <= 0, (case, g)
        else:
            assert g == want, (case, g)


def test_measuring_gain_skips_the_choice_and_names_unknown_candidates():
    options = [se_opt(OFF, 1.0, 6, 0.0, 0.01), se_opt(S3, 2.5, 8, 0.0, 0.01)]
    # s3 chosen at batch 1, off at batch 2: each is measured where the other is chosen
    gains = measuring_gain(options, [S3, OFF], 1, z=2.0, candidates=[OFF, S1, S3])
    assert set(gains) == {OFF, S3, S1} and gains[S1] == INF
    # where a configuration is the choice at every batch size of the region it is not listed
    assert set(measuring_gain(options, [S3, S3], 1, z=2.0, candidates=[OFF, S3])) == {OFF}
    # the gain is the region's largest: the advantage of s3 at batch 1 (2.08x) counts
    assert measuring_gain(options, [OFF, OFF], 1, z=0.0)[S3] == pytest.approx(np.log(2.5 * 6 / 8 / 1.01))


def test_untrusted_extrapolation_never_wins_or_absorbs_a_run():
    # s3 measured only at batch <= 4 extrapolates to look great at batch 100; off is measured
    # everywhere. The default (current) table decodes plainly from 5: that must stay.
    trusted_small = np.arange(1, 129) <= 8
    s3 = Option(S3, 3.0, 7 + 0.001 * B, trusted_small)
    off = Option(OFF, 1.0, 6 + 0.02 * B)
    current = PolicyTable(rows=(Row(1, 4, S3), Row(5, None, OFF)))
    choices = choose([off, s3], previous=current, default=current)
    assert choices[0] == S3 and all(c == OFF for c in choices[8:])
    # with no default at all the best extrapolation fills in (no crash, no None)
    assert all(c in (OFF, S3) for c in choose([off, s3]))


S2 = chain(2)
FLAT_MS = np.full(len(B), 10.0)


def _pair(gain, se):
    """s2 and s3 at the same step time, s3 emitting `gain` more tokens a step; the log tau
    difference known to standard error `se`."""
    return [Option(S2, 1.7, FLAT_MS), Option(S3, 1.7 * (1.0 + gain), FLAT_MS)], np.array([[0.0, se ** 2], [se ** 2, 0.0]])


@pytest.mark.parametrize("gain, se, z, switches", [
    (0.02, 0.02, 2.0, False),   # a near tie on few samples (SE 2%): a 2% lead is noise
    (0.02, 0.02, 0.0, True),    # the margin alone (1%) takes it
    (0.05, 0.005, 2.0, True),   # a clear win on enough samples: the first refit that shows it
    (0.02, 0.005, 2.0, True),   # 2% with SE 0.5%: beyond 2 standard errors
    (0.008, 0.0, 2.0, False),   # certain, but below the 1% margin: not worth a new table
    (-0.05, 0.005, 2.0, False),  # the current choice is the better one
])
def test_a_new_best_moves_the_table_only_beyond_its_uncertainty(gain, se, z, switches):
    options, var = _pair(gain, se)
    current = PolicyTable(rows=(Row(1, None, S2),))
    t = derive(options, previous=current, z=z, tau_log_var=var)
    assert t.configs() == ([S3] if switches else [S2])


def test_step_time_uncertainty_counts_too():
    options, var = _pair(0.02, 0.0)
    current = PolicyTable(rows=(Row(1, None, S2),))
    assert derive(options, previous=current, z=2.0, tau_log_var=var).configs() == [S3]
    # the same lead where each step time is known to 1.5% only (the difference: 2.1%)
    noisy = [Option(o.config, o.tokens_per_step, o.step_ms, step_ms_se=np.full(len(B), 0.015)) for o in options]
    assert derive(noisy, previous=current, z=2.0, tau_log_var=var).configs() == [S2]


@pytest.mark.parametrize("lead, thin_se, switches", [
    (0.10, 0.0, True),    # full windows: the cap (5%) holds, a 10% lead takes the table
    (0.10, 0.20, False),  # the challenger's step time rests on one value (SE 20%): not yet
    (1.00, 0.20, True),   # ...unless it wins beyond z of that error (s2 at half its goodput)
])
def test_a_thin_step_time_does_not_displace_the_previous_choice(lead, thin_se, switches):
    # both step times are known to 30% at most (a noisy engine, full windows): uncapped, z = 2
    # would keep any choice within 85%; the cap (5%) lets a 10% lead in. A step time resting on
    # fewer values than a window settles on keeps its own error above the cap.
    se = np.full(len(B), 0.3)
    s2 = Option(S2, 1.7, FLAT_MS, step_ms_se=se)
    s3 = Option(S3, 1.7 * (1.0 + lead), FLAT_MS, step_ms_se=se, step_ms_thin_se=np.full(len(B), thin_se))
    current = PolicyTable(rows=(Row(1, None, S2),))
    assert derive([s2, s3], previous=current, z=2.0).configs() == ([S3] if switches else [S2])


def test_a_thin_step_time_does_not_widen_island_merging():
    # s1 leads at 59-63 by 8%, beyond the cap (5%): an island that stands, whatever s3's thin
    # error (merging away a run is a change, which a wide tolerance must not make easier)
    options, var = _island(0.08, 0.0)
    s1, s3 = options
    se = np.full(len(B), 0.3)
    s3 = Option(S3, s3.tokens_per_step, s3.step_ms, step_ms_se=se)
    thin_s3 = Option(S3, s3.tokens_per_step, s3.step_ms, step_ms_se=se, step_ms_thin_se=np.full(len(B), 0.2))
    assert choose([s1, s3], z=2.0, tau_log_var=var)[60] == S1
    assert choose([s1, thin_s3], z=2.0, tau_log_var=var)[60] == S1


def _island(adv, se):
    """s3 best everywhere but at batch 59-63, where s1 leads by `adv` (and trails by 10%
    elsewhere); the log tau difference known to standard error `se`."""
    s3 = Option(S3, 2.0, FLAT_MS)
    ratio = np.where((B >= 59) & (B <= 63), 1.0 + adv, 0.9)
    s1 = Option(S1, 1.5, 10.0 * 1.5 / (2.0 * ratio))
    return [s1, s3], np.array([[0.0, se ** 2], [se ** 2, 0.0]])


@pytest.mark.parametrize("adv, se, island", [
    (0.015, 0.01, False),  # within 2 standard errors (2%): absorbed
    (0.05, 0.01, True),    # 5%: a real island
    (0.015, 0.002, True),  # the same 1.5% known to 0.2%: kept (tolerance = the 1% margin)
])
def test_an_island_stands_only_beyond_its_uncertainty(adv, se, island):
    options, var = _island(adv, se)
    choices = choose(options, z=2.0, tau_log_var=var)
    assert (choices[60] == S1) == island
    assert choices[10] == S3 and choices[100] == S3


def test_an_island_is_neither_made_nor_unmade_inside_the_dead_band():
    # s1 leads at 59-63 by 1.5%: inside the tolerance (2%), outside half of it (1%)
    options, var = _island(0.015, 0.01)
    without = PolicyTable(rows=(Row(1, None, S3),))
    with_island = PolicyTable(rows=(Row(1, 58, S3), Row(59, 63, S1), Row(64, None, S3)))
    assert derive(options, previous=without, z=2.0, tau_log_var=var).rows == without.rows
    assert derive(options, previous=with_island, z=2.0, tau_log_var=var).rows == with_island.rows
    # once the lead falls within half the tolerance the island goes
    options, var = _island(0.005, 0.01)
    assert derive(options, previous=with_island, z=2.0, tau_log_var=var).rows == without.rows
