import json
import warnings

import numpy as np
import pytest

from specctl.training.costmodel import FRESH_WARM, RING, CostModel, Sample
from specctl.training.synth import generate, truth_with_crossover, truth_with_ctx_crossovers

OFF, S1, S2, S3, S5 = (0, 1, 1), (1, 1, 2), (2, 1, 3), (3, 1, 4), (5, 1, 6)


def _samples(truth, n, bs, seed=0, **kw):
    for r in generate(truth, num_steps=n, batch_sizes=bs, seed=seed, **kw):
        c = r["config"]
        yield Sample(ts=r["ts"], config=(c["steps"], c["topk"], c["draft_tokens"]), batch_size=r["batch_size"],
                     step_ms=r["step_ms"], accepted=r.get("accepted"), server=r["server"])


def test_unfitted_model_refuses_to_predict():
    with pytest.raises(RuntimeError, match="not fitted"):
        CostModel().predict_step_ms(OFF, [1])


def test_recovers_linear_step_time_and_acceptance():
    truth = truth_with_crossover(30, accept=(0.8, 0.6, 0.5))
    m = CostModel().fit(_samples(truth, 20000, list(range(1, 97))))
    b = np.array([1, 16, 48, 96])
    for ct in truth.configs:
        pred = m.predict_step_ms(ct.config, b)
        np.testing.assert_allclose(pred, ct.step_ms(b), rtol=0.03)
    a = m.acceptance_by_position(S3)
    np.testing.assert_allclose(a, [0.8, 0.6, 0.5], atol=0.02)
    assert m.tokens_per_step(S3) == pytest.approx(truth.configs[1].tokens_per_step(), rel=0.02)
    assert m.tokens_per_step(OFF) == 1.0


def test_pooled_chain_acceptance_predicts_longer_chain():
    # only s1 and s2 measured; s3's tau comes from pooled per-position rates (last rate repeated)
    m = CostModel()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(4000):
        c = S1 if i % 2 else S2
        steps = c[0]
        ok = rng.random((8, steps)) < np.array([0.9, 0.7][:steps])
        acc = np.where(ok.all(axis=1), steps, np.argmin(ok, axis=1)).tolist()
        rows.append(Sample(ts=i * 0.01, config=c, batch_size=8, step_ms=5.0, accepted=acc))
    m.fit(rows)
    np.testing.assert_allclose(m.acceptance_by_position(S2), [0.9, 0.7], atol=0.02)
    # position 3 was never reached: its rate follows the trend of positions 1-2 (0.7 * 0.7/0.9)
    a3 = 0.7 * 0.7 / 0.9
    assert m.tokens_per_step(S3) == pytest.approx(1 + 0.9 + 0.9 * 0.7 + 0.9 * 0.7 * a3, rel=0.03)


def test_stale_deep_position_reverts_to_fresh_trend():
    # s5 ran long ago on easy traffic; now only s2 runs, on hard traffic: positions 3-5 must not
    # keep the stale easy rates
    rows = [Sample(ts=i * 0.01, config=S5, batch_size=4, step_ms=5.0, accepted=[5, 5, 5, 4]) for i in range(2000)]
    rng = np.random.default_rng(1)
    for i in range(6000):
        ok = rng.random((4, 2)) < np.array([0.6, 0.5])
        acc = np.where(ok.all(axis=1), 2, np.argmin(ok, axis=1)).tolist()
        rows.append(Sample(ts=200 + i * 0.01, config=S2, batch_size=4, step_ms=4.0, accepted=acc))
    m = CostModel(accept_half_life_s=10.0).fit(rows)
    a = m.acceptance_by_position(S5)
    np.testing.assert_allclose(a[:2], [0.6, 0.5], atol=0.03)
    assert a[2] < 0.55 and a[4] < 0.5  # not the stale ~0.95


def test_robust_to_outliers_and_switch_warmup():
    m = CostModel(warmup_steps=2)
    rows, ts = [], 0.0
    for block in range(200):
        c = S3 if block % 2 else OFF
        for j in range(10):
            ts += 0.01
            ms = 10.0 if c == S3 else 5.0
            if j < 2:
                ms *= 8  # the first steps after a switch are slow (graph/state warm-up)
            if (block * 10 + j) % 37 == 0:
                ms *= 20  # rare spikes
            rows.append(Sample(ts=ts, config=c, batch_size=4, step_ms=ms,
                               accepted=[1, 1, 1, 1] if c == S3 else None))
    m.fit(rows)
    assert m.predict_step_ms(S3, [4])[0] == pytest.approx(10.0, rel=0.01)
    assert m.predict_step_ms(OFF, [4])[0] == pytest.approx(5.0, rel=0.01)
    assert m.num_warmup_dropped_ > 0


def test_monotone_in_batch_size_even_with_noisy_medians():
    rows = []
    rng = np.random.default_rng(3)
    for i in range(6000):
        b = int(rng.integers(1, 64))
        rows.append(Sample(ts=i * 0.01, config=OFF, batch_size=b, step_ms=6 + 0.01 * b + rng.normal(0, 0.6)))
    m = CostModel().fit(rows)
    pred = m.predict_step_ms(OFF, np.arange(1, 200))
    assert np.all(np.diff(pred) >= -1e-9)


@pytest.mark.parametrize("n32, expect32", [
    (16, 1.248),  # a dip well beyond the noise of 16 values: the batch size keeps its median
    (2, 1.389),   # two values cannot show a dip (one slow step is not one): pooled
])
def test_a_dip_beyond_the_noise_keeps_its_median(n32, expect32):
    # the measured h200-smollm2-135m profile: plain decode at 16 (1.389 ms) is slower than at 32
    # (1.248 ms); the table runs it at 16, and batch 32 sees it only on exploring steps
    rng = np.random.default_rng(5)
    rows = [Sample(ts=i * 0.002, config=OFF, batch_size=b, step_ms=t * rng.lognormal(0, 0.06))
            for i, (b, t) in enumerate([(16, 1.389)] * 2000 + [(8, 1.14)] * 500 + [(64, 1.366)] * 500)]
    rows += [Sample(ts=6.0 + i, config=OFF, batch_size=32, step_ms=1.248 * rng.lognormal(0, 0.06))
             for i in range(n32)]
    m = CostModel().fit(rows)
    assert m.predict_step_ms(OFF, [32])[0] == pytest.approx(expect32, rel=0.02)
    assert m.predict_step_ms(OFF, [16])[0] == pytest.approx(1.389, rel=0.01)


@pytest.mark.parametrize("slow_steps", [1, 2])
def test_a_few_slow_steps_are_not_a_bump(slow_steps):
    # a steady engine (1% noise): one or two slow steps at batch 12, between well-measured 8 and 16
    rng = np.random.default_rng(9)
    rows = [Sample(ts=i * 0.002, config=OFF, batch_size=b, step_ms=t * rng.lognormal(0, 0.01))
            for i, (b, t) in enumerate([(8, 1.0), (16, 1.1)] * 500)]
    rows += [Sample(ts=3.0 + i, config=OFF, batch_size=12, step_ms=1.3) for i in range(slow_steps)]
    m = CostModel().fit(rows)
    assert m.predict_step_ms(OFF, [12])[0] == pytest.approx(1.1, rel=0.02)


def test_the_thin_part_of_the_step_time_error_is_that_of_batch_sizes_with_few_values():
    rng = np.random.default_rng(2)
    rows = [Sample(ts=i * 0.01, config=OFF, batch_size=b, step_ms=6 * rng.lognormal(0, 0.05))
            for i, b in enumerate([4, 8] * 200)]
    rows += [Sample(ts=5.0, config=S3, batch_size=8, step_ms=9.0)]  # one exploring step
    m = CostModel().fit(rows)
    assert np.all(m.step_ms_errors(OFF, [4, 6, 8])[1] == 0.0)
    thin = m.step_ms_errors(S3, [8, 16])[1]
    # one value: 1.25 cv, cv the engine's (pooled over cells)
    np.testing.assert_allclose(thin, 1.25 * m.step_time_cv(), rtol=1e-9)
    assert np.all(m.step_ms_errors(S3, [8])[0] >= thin[0])
    # the first two steps after a switch are warm-up: three settled values take five more steps
    m.partial_fit([Sample(ts=5.1 + 0.01 * i, config=S3, batch_size=8, step_ms=9.0) for i in range(5)])
    assert m.step_ms_errors(S3, [8])[1][0] == 0.0


def test_recent_traffic_dominates():
    m = CostModel(half_life_s=10.0)
    old = [Sample(ts=float(i) * 0.1, config=S1, batch_size=2, step_ms=5.0, accepted=[1, 1]) for i in range(1000)]
    new = [Sample(ts=300 + i * 0.1, config=S1, batch_size=2, step_ms=5.0, accepted=[0, 0]) for i in range(200)]
    m.fit(old + new)
    assert m.tokens_per_step(S1) < 1.05  # 30 half-lives later the old acceptance is forgotten


def test_interval_samples_give_tau_and_time():
    m = CostModel().fit([Sample(ts=1.0, config=S2, batch_size=16, step_ms=8.0, weight=40, mean_accepted=1.2),
                         Sample(ts=2.0, config=S2, batch_size=32, step_ms=9.0, weight=40, mean_accepted=1.2)])
    assert m.tokens_per_step(S2) == pytest.approx(2.2)
    assert m.predict_step_ms(S2, [24])[0] == pytest.approx(8.5)


def test_single_point_config_borrows_shape():
    rows = [Sample(ts=i, config=OFF, batch_size=b, step_ms=5 + 0.1 * b) for i, b in enumerate(range(1, 65))]
    rows += [Sample(ts=100 + i, config=S1, batch_size=4, step_ms=7.0, accepted=[1] * 4) for i in range(10)]
    m = CostModel(warmup_steps=0).fit(rows)
    p = m.predict_step_ms(S1, [4, 64])
    assert p[0] == pytest.approx(7.0)
    assert p[1] == pytest.approx(7.0 * (5 + 6.4) / (5 + 0.4), rel=0.01)


def test_state_round_trip():
    truth = truth_with_crossover(12)
    m = CostModel().fit(_samples(truth, 3000, list(range(1, 33))))
    m2 = CostModel().set_state(m.get_state())
    b = np.arange(1, 40)
    for c in (OFF, S3):
        np.testing.assert_allclose(m2.predict_step_ms(c, b), m.predict_step_ms(c, b))
        assert m2.tokens_per_step(c) == pytest.approx(m.tokens_per_step(c))
    with pytest.raises(ValueError):
        CostModel().set_state({"kind": "other"})
    # a state written while the model kept gap cells (an experiment since removed) still loads
    old = {**m.get_state(), "gaps": [[[0, 1, 1], 16, 40, 40.0, 120.0, 2, 900.0]]}
    np.testing.assert_allclose(CostModel().set_state(old).predict_step_ms(S3, b), m.predict_step_ms(S3, b))


def _left_then_probed(probes, steady_after=0):
    """Plain decode runs steadily at batch 4 (its values 2.5 ms), then the table leaves it: only
    single exploring steps between s2 steps (2.0 ms) measure it, then maybe steady steps (3.0 ms)."""
    rows, ts = [], 0.0
    for _ in range(200):
        ts += 0.01
        rows.append(Sample(ts=ts, config=OFF, batch_size=4, step_ms=2.5))
    for i in range(probes):
        for j in range(63):
            ts += 0.01
            rows.append(Sample(ts=ts, config=S2, batch_size=4, step_ms=5.0, accepted=[1, 1, 1, 1]))
        ts += 0.01
        rows.append(Sample(ts=ts, config=OFF, batch_size=4, step_ms=2.0))
    for _ in range(steady_after):
        ts += 0.01
        rows.append(Sample(ts=ts, config=OFF, batch_size=4, step_ms=3.0))
    return rows


@pytest.mark.parametrize("probes, steady_after, expect", [
    (0, 0, 2.5),    # the steady values
    (FRESH_WARM - 1, 0, 2.5),  # fewer than FRESH_WARM exploring steps since: the steady values stand
    (FRESH_WARM, 0, 2.0),      # FRESH_WARM of them, newer than every steady value: they stand for the cell
    (40, 0, 2.0),
    (40, 3, 2.0),   # steady again (2 post-switch steps, then 1 steady): not yet the old steady values
    (40, 5, 3.0),   # MIN_SETTLED new steady values take over
])
def test_a_left_configuration_is_measured_by_its_exploring_steps(probes, steady_after, expect):
    m = CostModel(warmup_steps=2).fit(_left_then_probed(probes, steady_after))
    assert m.predict_step_ms(OFF, [4])[0] == pytest.approx(expect)
    m2 = CostModel(warmup_steps=2).set_state(m.get_state())  # the timestamps survive a restart
    assert m2.predict_step_ms(OFF, [4])[0] == pytest.approx(expect)


def test_values_since_counts_both_kinds_of_step_time_per_region():
    m = CostModel(warmup_steps=2).fit(_left_then_probed(20))
    last_steady = 200 * 0.01
    assert m.values_since(OFF, 4, 7, 0.0, 1000) == RING + 20  # a full steady ring + 20 probes
    assert m.values_since(OFF, 4, 7, last_steady + 1e-6, 1000) == 20
    assert m.values_since(OFF, 4, 7, last_steady + 1e-6, 16) == 16  # counting stops at enough
    assert m.values_since(OFF, 8, 15, 0.0, 1000) == 0
    assert m.values_since(S2, 1, 3, 0.0, 1000) == 0


def test_a_state_without_timestamps_loads_with_the_states_time():
    m = CostModel(warmup_steps=2).fit(_left_then_probed(20))
    state = m.get_state()
    state["times"] = [cell[:6] for cell in state["times"]]  # as written before values were stamped
    m2 = CostModel(warmup_steps=2).set_state(state)
    assert m2.predict_step_ms(OFF, [4])[0] == pytest.approx(2.5)  # nothing is newer than the steady values
    assert m2.values_since(OFF, 4, 7, state["now"], 1000) == RING + 20
    state["times"][0] = state["times"][0] + [[]]
    with pytest.raises(ValueError, match="6, 8 nor 10 fields"):
        CostModel().set_state(state)


def test_summary_reports_regions_and_uncertainty():
    truth = truth_with_crossover(12)
    m = CostModel().fit(_samples(truth, 3000, list(range(1, 33))))
    s = m.summary(max_batch=32)
    off = s["configs"]["off"]
    assert [r["min_batch"] for r in off["regions"]] == [1, 2, 4, 8, 16, 32]
    assert sum(r["samples"] for r in off["regions"]) > 0
    assert s["configs"]["s3"]["accept_rate_by_position"][0] == pytest.approx(0.8, abs=0.03)


def test_engine_switching_every_step_still_measures_step_time():
    # an engine alternating configurations each step never "settles": the post-switch steps ARE
    # its steady state, and the model must use them rather than end up with nothing
    rows = []
    for i in range(4000):
        c = S3 if i % 2 else OFF
        b = 1 + (i // 2) % 48
        ms = (7.0 + 0.3 * b) if c == S3 else (6.0 + 0.02 * b)
        rows.append(Sample(ts=i * 0.01, config=c, batch_size=b, step_ms=ms, accepted=[2] * b if c == S3 else None))
    m = CostModel(warmup_steps=2).fit(rows)
    assert m.predict_step_ms(S3, [10])[0] == pytest.approx(10.0, rel=0.01)
    assert m.predict_step_ms(OFF, [10])[0] == pytest.approx(6.2, rel=0.01)


def _chain_steps(accept, seconds, t0, batch=8, steps_per_s=100, seed=0, config=S3):
    """Telemetry of one chain at a fixed batch size with independent per-position acceptance."""
    rng = np.random.default_rng(seed)
    a = np.asarray(accept[: config[0]])
    for i in range(int(seconds * steps_per_s)):
        ok = rng.random((batch, config[0])) < a
        acc = np.where(ok.all(axis=1), config[0], np.argmin(ok, axis=1))
        yield Sample(ts=t0 + i / steps_per_s, config=config, batch_size=batch, step_ms=10.0,
                     accepted=acc.tolist())


def _tau(accept):
    return 1.0 + float(np.cumprod(accept).sum())


@pytest.mark.parametrize("z, within", [(3.0, 0.15), (0.0, None)])
def test_acceptance_shift_is_followed_within_seconds_when_detected(z, within):
    easy, hard = (0.9, 0.85, 0.8), (0.45, 0.4, 0.35)
    m = CostModel(accept_change_z=z)
    m.fit(list(_chain_steps(easy, 30, 0.0)) + list(_chain_steps(hard, 3.5, 30.0, seed=1)))
    got = m.tokens_per_step(S3)
    if within is not None:
        assert got == pytest.approx(_tau(hard), abs=within)
        assert m.num_accept_changes_ == 1
    else:  # an 8 s half-life alone is still far from the new traffic after 3.5 s
        assert got > _tau(hard) + 0.4
        assert m.num_accept_changes_ == 0


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_stationary_acceptance_is_never_taken_for_a_shift(batch):
    accept = (0.7, 0.6, 0.5)
    m = CostModel(accept_change_z=3.0).fit(_chain_steps(accept, 120, 0.0, batch=batch))
    assert m.num_accept_changes_ == 0
    assert m.tokens_per_step(S3) == pytest.approx(_tau(accept), abs=0.15)


def test_a_shift_seen_on_one_chain_ages_the_pooled_history_of_the_others():
    easy, hard = (0.9, 0.85, 0.8, 0.8, 0.8), (0.45, 0.4, 0.35, 0.3, 0.3)
    m = CostModel(accept_change_z=3.0)
    # s5 explored on 1 step in 64 for a minute of easy traffic; then only s3 runs, on hard traffic
    m.fit(list(_chain_steps(easy, 60, 0.0, steps_per_s=100 / 64, config=S5))
          + list(_chain_steps(easy, 60, 0.0)) + list(_chain_steps(hard, 3.5, 60.0, seed=1)))
    assert m.num_accept_changes_ >= 1
    assert m.acceptance_by_position(S3)[0] == pytest.approx(0.45, abs=0.08)


@pytest.mark.parametrize("z", [3.0, 0.0])
def test_a_shift_is_judged_against_the_pooled_belief_not_the_running_chain_alone(z):
    """s3 measured a minute of easy traffic; then the traffic turns hard and only s2 runs, a chain
    with no history of its own. Its seconds agree with its own (new) history, but the pooled
    estimate that decides still rests on s3's easy minute: the shift must be found against that.
    The samples carry their own timestamps (seeded, synthetic): nothing here reads the wall clock."""
    easy, hard = (0.9, 0.85, 0.8), (0.45, 0.4, 0.35)
    m = CostModel(accept_change_z=z)
    m.fit(list(_chain_steps(easy, 60, 0.0)) + list(_chain_steps(hard, 3.5, 60.0, seed=1, config=S2)))
    halfway_tau = (_tau(easy[:2]) + _tau(hard[:2])) / 2
    if z:  # s3's easy minute is aged as s2's own history would have been: the estimate past halfway
        assert m.num_accept_changes_ == 1
        assert m.tokens_per_step(S2) < halfway_tau
    else:  # without detection s3's easy minute still holds the pooled positions up
        assert m.num_accept_changes_ == 0
        assert m.tokens_per_step(S2) > halfway_tau


def test_a_longer_chain_measuring_the_same_traffic_flags_no_shift():
    """The belief a chain is judged against pools only chains at least as long: s3 measuring
    what s1 measured is no shift, whatever s1's own history holds."""
    accept = (0.6, 0.5, 0.4)
    m = CostModel(accept_change_z=3.0)
    m.fit(list(_chain_steps(accept, 30, 0.0, config=S1)) + list(_chain_steps(accept, 30, 30.0, seed=1)))
    assert m.num_accept_changes_ == 0


@pytest.mark.parametrize("batch, steps, weight", [
    (1, 100, 16),  # one request's steps share its prompt: at most 16 of them count
    (2, 100, 32),
    (48, 1, 48),   # one step of 48 requests: 48 prompts
    (8, 100, 64),  # ACCEPT_CAP_PER_S
    (2, 5, 10),
])
def test_one_second_of_acceptance_weighs_at_most_16_steps_per_request_and_64_in_all(batch, steps, weight):
    m = CostModel().fit(_chain_steps((0.7, 0.6, 0.5), 1.0, 0.0, batch=batch, steps_per_s=steps))
    aged = 2.0 ** (-((steps - 1) / steps) / 8.0)  # the second's weight as of its last step (8 s half-life)
    assert m.accept_weight(S3) == pytest.approx(weight * aged, rel=0.01)


def _log_tau_ratio_and_var(m, c=S3, ref=S2):
    return float(np.log(m.tokens_per_step(c) / m.tokens_per_step(ref))), float(m.tau_log_diff_var([ref, c])[0, 1])


@pytest.mark.parametrize("batch, steps_per_s, calibrated", [
    (2, 8, True),     # within both caps (16 a second): the estimate's own spread
    (1, 50, False),   # 50 steps of one request a second, counted as 16 (its steps correlate in real traffic)
    (8, 100, False),  # 800 a second, counted as 64: conservative (a second is worth at most 64)
])
def test_tau_difference_variance_follows_the_spread_of_the_estimate(batch, steps_per_s, calibrated):
    accept = (0.7, 0.6, 0.5)
    got, predicted = [], []
    for seed in range(40):
        m = CostModel().fit(_chain_steps(accept, 30, 0.0, batch=batch, steps_per_s=steps_per_s, seed=seed))
        d, v = _log_tau_ratio_and_var(m)
        got.append(d)
        predicted.append(v)
    ratio = np.sqrt(np.mean(predicted)) / np.std(got, ddof=1)
    assert (0.8 < ratio < 1.5) if calibrated else ratio > 1.0


def test_tau_difference_variance_shrinks_with_evidence_and_grows_after_a_shift():
    easy, hard = (0.9, 0.85, 0.8), (0.45, 0.4, 0.35)
    few = CostModel().fit(_chain_steps(easy, 2, 0.0, batch=1, steps_per_s=20))
    many = CostModel().fit(_chain_steps(easy, 30, 0.0, batch=1, steps_per_s=20))
    assert _log_tau_ratio_and_var(many)[1] < 0.5 * _log_tau_ratio_and_var(few)[1]
    # chains share positions: s2 vs s3 differ by position 3 only, s1 vs s3 by positions 2-3
    v = many.tau_log_diff_var([S1, S2, S3, OFF])
    assert 0 < v[1, 2] < v[0, 2] and v[3, 3] == 0.0 and v[3, 2] > 0
    # a detected shift replaces the history by two seconds: less evidence, a wider estimate
    m = CostModel(accept_change_z=3.0).fit(list(_chain_steps(easy, 30, 0.0)) + list(_chain_steps(hard, 2.5, 30.0, seed=1)))
    before = CostModel(accept_change_z=3.0).fit(_chain_steps(easy, 30, 0.0))
    assert m.num_accept_changes_ == 1
    assert _log_tau_ratio_and_var(m)[1] > 2 * _log_tau_ratio_and_var(before)[1]


@pytest.mark.parametrize("drift", [0.1, 0.0])
def test_a_step_time_gains_error_with_the_age_of_its_newest_value(drift):
    """The standard error of a measured step time grows by `step_drift` per half-life of its age
    (linear in age), so a comparison decided long ago opens again; 0 turns that off."""
    rows = [Sample(ts=i * 0.01, config=c, batch_size=8, step_ms=ms * (1 + 0.02 * np.sin(i)))
            for i in range(400) for c, ms in ((OFF, 7.0), (S3, 12.0)) if (i % 2 == 0) == (c == OFF)]
    m = CostModel(warmup_steps=0, step_drift=drift).fit(rows)
    fresh = m.step_ms_errors(S3, [8])[0][0]
    # ten minutes (one half-life) of plain decode only: S3's values age, OFF's do not
    m.partial_fit([Sample(ts=4.0 + i * 0.5, config=OFF, batch_size=8, step_ms=7.0) for i in range(1200)])
    old = m.step_ms_errors(S3, [8])[0][0]
    if drift:
        assert old ** 2 - fresh ** 2 == pytest.approx(drift ** 2, rel=0.05)  # 10 % after 600 s
        assert m.cell_age_[(OFF, 8)] == 0.0  # plain decode kept running: its values have no age
    else:
        assert old == pytest.approx(fresh, rel=0.05)


def test_acceptance_not_measured_for_a_while_gets_a_wider_estimate_and_a_few_probes_do_not_reset_it():
    """A chain measured for 30 s, then not for 40 s (the table decoded plainly): the variance of its
    tau against plain decode doubles per half-life (8 s) of excess age. A single probing second
    brings only its own weight of fresh evidence: the estimate stays wide."""
    easy = (0.9, 0.85, 0.8)
    steady = list(_chain_steps(easy, 30, 0.0, batch=4, steps_per_s=20))
    plain = [Sample(ts=30.0 + i * 0.05, config=OFF, batch_size=4, step_ms=7.0) for i in range(800)]
    m = CostModel().fit(steady)
    v0 = m.tau_log_diff_var([OFF, S3])[0, 1]
    m.partial_fit(plain)
    v40 = m.tau_log_diff_var([OFF, S3])[0, 1]
    assert v40 > 2 ** 3 * v0  # 40 s of silence: well over three half-lives of excess age
    m.partial_fit(_chain_steps(easy, 0.1, 70.0, batch=4, steps_per_s=20, seed=1))  # two probing steps
    assert m.tau_log_diff_var([OFF, S3])[0, 1] > 0.5 * v40
    # offline (no decay), age means nothing
    def offline():
        return CostModel(half_life_s=float("inf"), accept_half_life_s=float("inf"))

    later = offline().fit(steady + plain).tau_log_diff_var([OFF, S3])[0, 1]
    assert later == pytest.approx(offline().fit(steady).tau_log_diff_var([OFF, S3])[0, 1], rel=0.01)


def test_step_time_standard_error_counts_noise_gaps_and_extrapolation():
    rng = np.random.default_rng(0)
    sizes = (4, 8, 16, 24, 32)
    rows = [Sample(ts=i * 0.01, config=OFF, batch_size=sizes[i % 5],
                   step_ms=(5.0 + 0.25 * sizes[i % 5]) * (1 + 0.02 * rng.standard_normal())) for i in range(500)]
    m = CostModel(warmup_steps=0).fit(rows)
    se = m.step_ms_errors(OFF, [8, 12, 64])[0]
    assert m.step_time_cv() == pytest.approx(0.02, rel=0.3)
    assert se[0] == pytest.approx(1.25 * 0.02 / np.sqrt(RING), rel=0.35)  # the median of RING recent values
    assert se[1] > (9.0 - 7.0) / 8.0 / np.sqrt(12) * 0.95  # 12 is anywhere between the measured 7 and 9 ms
    assert se[2] > (21.0 - 13.0) / 21.0 / np.sqrt(3) * 0.9  # an extrapolation: anywhere up to twice as far
    # a batch size noisier than the engine's usual counts with its own scatter
    m.partial_fit([Sample(ts=10 + i * 0.01, config=OFF, batch_size=24, step_ms=11.0 * (1 + 0.2 * rng.standard_normal()))
                   for i in range(RING)])
    assert m.step_ms_errors(OFF, [24])[0][0] > 4 * m.step_ms_errors(OFF, [8])[0][0]


def test_state_round_trip_keeps_the_acceptance_uncertainty():
    m = CostModel().fit(_chain_steps((0.7, 0.6, 0.5), 20, 0.0, batch=2, steps_per_s=30))
    m2 = CostModel().set_state(m.get_state())
    np.testing.assert_allclose(m2.tau_log_diff_var([OFF, S1, S3]), m.tau_log_diff_var([OFF, S1, S3]), rtol=1e-9)
    legacy = m.get_state()
    legacy["accept"] = [row[:4] for row in legacy["accept"]]  # written before standard errors were kept
    assert np.all(np.isfinite(CostModel().set_state(legacy).tau_log_diff_var([S1, S3])))


def test_step_time_standard_error_is_never_nan_beside_a_cell_with_no_weight_left():
    # a cell whose decayed weight reached 0 (a very old one, or a state file saying so) has an
    # unknown (infinite) error; a measured batch size beside it keeps its own finite one
    rows = [Sample(ts=i * 0.01, config=OFF, batch_size=4 if i % 2 else 8, step_ms=5.0 + 0.01 * (i % 7))
            for i in range(200)]
    state = CostModel(warmup_steps=0).fit(rows).get_state()
    for cell in state["times"]:
        if cell[1] == 8:
            cell[2] = 0.0
    m = CostModel().set_state(state).refit()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        se, thin = m.step_ms_errors(OFF, [4, 6, 8])
    assert np.isfinite(se[0]) and se[0] > 0 and np.isinf(se[1:]).all()
    assert thin[0] == 0.0 and np.isinf(thin[1:]).all()


# ------------------------------------------------------------------------- context


def _ctx_samples(truth, n, bs, *, seed=1, levels=(300, 6000), drop_ctx=False):
    for r in generate(truth, num_steps=n, batch_sizes=bs, seed=seed, ctx_per_request=levels):
        c = r["config"]
        yield Sample(ts=r["ts"], config=(c["steps"], c["topk"], c["draft_tokens"]), batch_size=r["batch_size"],
                     step_ms=r["step_ms"], accepted=r.get("accepted"),
                     ctx_tokens=None if drop_ctx else r.get("ctx_tokens"))


CTX_BS = [1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]


def test_the_context_slope_and_the_step_time_at_each_context_are_recovered():
    truth = truth_with_ctx_crossovers((300, 76), (6000, 14))
    m = CostModel().fit(_ctx_samples(truth, 30000, CTX_BS))
    assert m.has_ctx()
    b = np.array([1, 8, 32, 128])
    for ct in truth.configs:
        slope, se = m.ctx_slope(ct.config)
        assert slope == pytest.approx(ct.per_ctx_token_ms, rel=0.05) and se < 0.05 * slope
        for mean in (300, 6000):
            np.testing.assert_allclose(m.predict_step_ms_ctx(ct.config, b, mean), ct.step_ms(b, b * mean), rtol=0.03)
        # measured in the bands of 240..360 and 4800..7200 tokens a request: trusted one band beyond
        assert m.ctx_bands(ct.config) == [7, 8, 12]
        assert [m.ctx_trusted(ct.config, k) for k in (5, 6, 10, 13, 14)] == [False, True, True, True, False]
        assert m.summary()["configs"]["off" if ct.config == OFF else "s3"]["ctx_ms_per_ktoken"] == pytest.approx(
            1000 * slope, rel=1e-3)
        assert m.ctx_exponent(ct.config) == 1.0  # a cost per context token of the batch, as the truth has it


@pytest.mark.parametrize("exponent", [0.25, 0.5, 1.0])
def test_a_context_cost_that_grows_slower_than_the_batch_is_fitted_as_such(exponent):
    """Step time f(b) + g * b^e * L (e < 1: an attention kernel latency-bound at small batches, as the H200's
    s3 verify was): the fit finds e, and the step time it predicts at a large batch and a short context
    is the truth's, not the one a cost per context token of the batch (e = 1) fitted at small batches gives."""
    rng = np.random.default_rng(5)
    g = 0.004  # ms per context token at batch 1
    f = lambda b: 6.0 + 0.05 * b  # noqa: E731
    samples, ts = [], 1_764_441_600.0
    for i in range(24000):
        b = int(rng.choice([1, 2, 4, 8, 16, 32, 64, 128]))
        L = float(rng.uniform(100, 4000))
        ms = (f(b) + g * b ** exponent * L) * (1 + 0.02 * rng.standard_normal())
        ts += 0.01
        samples.append(Sample(ts=ts, config=S3, batch_size=b, step_ms=ms, accepted=[1] * b, ctx_tokens=int(b * L)))
    m = CostModel().fit(samples)
    assert m.ctx_exponent(S3) == exponent
    assert m.ctx_slope(S3)[0] == pytest.approx(g, rel=0.1)
    b = np.array([1, 16, 128])
    for L in (200.0, 3000.0):
        np.testing.assert_allclose(m.predict_step_ms_ctx(S3, b, L), f(b) + g * b ** exponent * L, rtol=0.04)


@pytest.mark.parametrize("online", [False, True])
def test_a_servers_warm_up_step_does_not_bend_the_context_fit(online):
    """A server's first decode step is its warm-up (2026-12-06, H100, SGLang's stock verify: 735 ms at batch 1
    with 6 tokens of context, where a step there takes ~10 ms). Its cell has no median yet to clip it against,
    and in a thin cell (batch 1 is seen only while phases ramp) one such value decided the batch exponent: 1
    instead of 0.25, a context cost 5x too small at batch 4. The fit must be the one without it."""
    rng = np.random.default_rng(11)
    g, e = 0.0037, 0.25  # ms per context token at batch 1; the stock verify's latency-bound exponent
    f = lambda b: 9.0 + 0.1 * b  # noqa: E731
    ts = 1_764_441_600.0
    first = [Sample(ts=ts, config=S3, batch_size=1, step_ms=735.0, accepted=[1], ctx_tokens=6)]
    rest = []
    for b, n in ((1, 20), (4, 20), (8, 30), (32, 300), (48, 100)):
        for i in range(n):
            L = 300.0 if i % 2 else 4000.0
            ts += 0.01
            ms = (f(b) + g * b ** e * L) * (1 + 0.02 * rng.standard_normal())
            rest.append(Sample(ts=ts, config=S3, batch_size=b, step_ms=ms, accepted=[1] * b, ctx_tokens=int(b * L)))
    order = rng.permutation(len(rest))
    samples = first + [rest[i] for i in order]
    if online:  # the daemon: a refit every 50 steps
        m = CostModel()
        for k in range(0, len(samples), 50):
            m.partial_fit(samples[k:k + 50])
            m.refit()
    else:
        m = CostModel().fit(samples)
    assert m.ctx_exponent(S3) == e
    assert m.ctx_slope(S3)[0] == pytest.approx(g, rel=0.1)


def test_without_ctx_tokens_no_context_fit_runs_and_the_state_is_as_before():
    truth = truth_with_ctx_crossovers((300, 76), (6000, 14))
    m = CostModel().fit(_ctx_samples(truth, 6000, CTX_BS, drop_ctx=True))
    assert not m.has_ctx() and m.ctx_bands() == [] and m.ctx_slope(S3) == (0.0, float("inf"))
    np.testing.assert_array_equal(m.predict_step_ms_ctx(S3, [4, 40], 6000.0), m.predict_step_ms(S3, [4, 40]))
    state = m.get_state()
    assert "ctx" not in state and all(len(cell) == 8 for cell in state["times"])
    assert "ctx_ms_per_ktoken" not in str(m.summary())


def test_a_context_that_does_not_change_step_times_gives_no_slope():
    truth = truth_with_crossover(30)  # no context term; the telemetry still carries ctx_tokens
    m = CostModel().fit(_ctx_samples(truth, 20000, CTX_BS))
    assert m.has_ctx()
    for ct in truth.configs:
        assert m.ctx_slope(ct.config)[0] == 0.0
        b = np.arange(1, 200)
        np.testing.assert_array_equal(m.predict_step_ms_ctx(ct.config, b, 6000.0), m.predict_step_ms(ct.config, b))


def test_the_context_fit_survives_a_restart():
    truth = truth_with_ctx_crossovers((300, 76), (6000, 14))
    m = CostModel().fit(_ctx_samples(truth, 8000, CTX_BS))
    state = json.loads(json.dumps(m.get_state()))  # through JSON, as the state dir keeps it
    m2 = CostModel().set_state(state)
    for c in (OFF, S3):
        assert m2.ctx_slope(c) == pytest.approx(m.ctx_slope(c))
        np.testing.assert_allclose(m2.predict_step_ms_ctx(c, [2, 50], 3000), m.predict_step_ms_ctx(c, [2, 50], 3000))
        assert m2.ctx_bands(c) == m.ctx_bands(c)
