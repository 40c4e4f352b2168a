import json

import numpy as np
import pytest

from specctl.controller import wire
from specctl.controller.service import ControllerService, ServiceSettings
from specctl.controller.state import StateStore
from specctl.policies.table import PolicyTable
from specctl.training.costmodel import FRESH_WARM
from specctl.training.synth import generate, truth_with_crossover, truth_with_ctx_crossovers


class Clock:
    def __init__(self, t=1_764_441_600.0):
        self.t = t

    def __call__(self):
        return self.t


def feed(svc, clock, truth, n, bs, seed=0):
    for r in generate(truth, num_steps=n, batch_sizes=bs, seed=seed, t0=clock.t):
        clock.t = r["ts"]
        assert svc.observe_frame(json.dumps(r).encode())


def table(svc):
    return PolicyTable.from_policy_obj(wire.to_obj(svc.policy))


def test_starts_with_fixed_fallback_and_publishes_it_once_then_heartbeats():
    clock = Clock()
    svc = ControllerService(ServiceSettings(heartbeat_s=2.0), clock=clock)
    first = svc.tick()
    assert first is not None and first.source == "fixed" and first.version == 1
    assert table(svc).spec_off_crossover() == 5
    assert svc.tick() is None  # nothing new, heartbeat not due
    clock.t += 2.5
    hb = svc.tick()
    assert hb is not None and hb.version == 1
    assert svc.evidence == "no telemetry yet"


@pytest.mark.parametrize("crossover", [3, 8, 25, 60, 100])
def test_online_refit_recovers_crossover(crossover):
    clock = Clock()
    svc = ControllerService(ServiceSettings(refit_interval_s=1.0), clock=clock)
    truth = truth_with_crossover(crossover)
    feed(svc, clock, truth, 12000, list(range(1, 2 * crossover + 10)))
    clock.t += 1.0
    pol = svc.tick()
    assert pol is not None and pol.source == "online"
    got = table(svc).spec_off_crossover()
    assert abs(got - crossover) <= max(1, 0.15 * crossover), (got, crossover)


def test_new_version_only_when_table_changes():
    clock = Clock()
    svc = ControllerService(ServiceSettings(refit_interval_s=1.0, heartbeat_s=1000), clock=clock)
    truth = truth_with_crossover(20)
    feed(svc, clock, truth, 8000, list(range(1, 50)))
    clock.t += 1
    svc.tick()
    v, same = svc.policy.version, 0
    for i in range(5):
        before = table(svc)
        feed(svc, clock, truth, 500, list(range(1, 50)), seed=10 + i)
        clock.t += 1
        published = svc.tick()  # refits; no heartbeat due
        after = table(svc)
        changed = (after.rows, after.explore, after.bands) != (before.rows, before.explore, before.bands)
        assert (published is not None) == changed and svc.policy.version == v + changed
        v, same = svc.policy.version, same + (not changed)
    assert same >= 3 and svc.num_refits >= 6  # the same data: mostly the same table


def test_bad_frames_are_counted_by_reason_and_dropped():
    svc = ControllerService(ServiceSettings(), clock=Clock())
    bad = [b"\x00\x01", b"{}", b'{"kind":"step","schema":9}', json.dumps({"kind": "policy"}).encode(),
           b'{"kind":"step","schema":1,"server":"a","rank":0,"iter":1,"ts":1,"batch_size":-5,'
           b'"config":{"steps":0,"topk":1,"draft_tokens":1},"step_ms":1}']
    assert not any(svc.observe_frame(f) for f in bad)
    rej = svc.status()["rejected"]
    assert sum(rej.values()) == len(bad)
    assert rej["bad_json"] == 1 and rej["bad_schema_version"] == 1
    assert svc.model.num_samples_ == 0


def test_records_from_the_future_are_rejected():
    clock = Clock()
    svc = ControllerService(ServiceSettings(), clock=clock)
    r = next(generate(truth_with_crossover(5), num_steps=1, batch_sizes=[2], t0=clock.t + 86400))
    assert not svc.observe_frame(json.dumps(r).encode())
    assert svc.status()["rejected"] == {"ts_in_future": 1}


def test_fixed_mode_never_changes_the_table():
    clock = Clock()
    svc = ControllerService(ServiceSettings(mode="fixed", threshold=9, fixed_config=(1, 1, 2),
                                            refit_interval_s=1), clock=clock)
    feed(svc, clock, truth_with_crossover(40), 5000, list(range(1, 80)))
    clock.t += 5
    svc.tick()
    assert svc.policy.source == "fixed" and table(svc).spec_off_crossover() == 9
    assert table(svc).lookup(1) == (1, 1, 2)


def test_a_fixed_daemon_restarted_with_another_table_publishes_a_new_version(tmp_path):
    """A version names one table: restarting `--mode fixed` with the same threshold keeps the version, another
    threshold or config gets the next one (the engines log a change of version, and the audit keys tables by it)."""
    def fixed(threshold, config=(3, 1, 4)):
        return ControllerService(ServiceSettings(mode="fixed", threshold=threshold, fixed_config=config),
                                 clock=Clock(), store=StateStore(tmp_path))
    assert fixed(5).policy.version == 1
    assert fixed(5).policy.version == 1  # the same table again
    svc = fixed(1000)
    assert svc.policy.version == 2 and table(svc).lookup(999) == (3, 1, 4)
    svc = fixed(1000, (1, 1, 2))
    assert svc.policy.version == 3 and table(svc).lookup(1) == (1, 1, 2)
    assert StateStore(tmp_path).load_policy().version == 3
    svc = fixed(5)  # back to the first table: still a change from what was in force
    assert svc.policy.version == 4 and table(svc).spec_off_crossover() == 5


def test_restart_resumes_policy_and_model(tmp_path):
    clock = Clock()
    svc = ControllerService(ServiceSettings(refit_interval_s=1), clock=clock, store=StateStore(tmp_path))
    feed(svc, clock, truth_with_crossover(30), 8000, list(range(1, 70)))
    clock.t += 1
    svc.tick()
    svc.persist_model()
    before = svc.policy
    svc2 = ControllerService(ServiceSettings(refit_interval_s=1), clock=clock, store=StateStore(tmp_path))
    assert svc2.policy.version == before.version and svc2.policy.table == before.table
    assert svc2.model.num_samples_ == svc.model.num_samples_
    clock.t += 1
    svc2.tick()  # refit on the restored model reproduces the table: no new version
    assert svc2.policy.version == before.version


def test_truncated_policy_file_falls_back_to_previous(tmp_path):
    clock = Clock()
    store = StateStore(tmp_path)
    svc = ControllerService(ServiceSettings(refit_interval_s=1), clock=clock, store=store)
    v1 = svc.policy
    feed(svc, clock, truth_with_crossover(30), 8000, list(range(1, 70)))
    clock.t += 1
    svc.tick()
    assert svc.policy.version > v1.version
    p = tmp_path / "policy.json"
    p.write_bytes(p.read_bytes()[:57])  # torn write
    store2 = StateStore(tmp_path)
    got = store2.load_policy()
    assert got is not None and got.version == svc.policy.version - 1
    assert any("unusable" in x for x in store2.problems)


def test_init_policy_used_when_state_is_empty(tmp_path):
    init = wire.policy_from_obj({"kind": "policy", "schema": 1, "version": 3, "created_at": 1.0, "source": "file",
                                 "table": [{"min_batch": 1, "max_batch": 11, "config": {"steps": 2, "topk": 1, "draft_tokens": 3}},
                                           {"min_batch": 12, "config": {"steps": 0, "topk": 1, "draft_tokens": 1}}]})
    svc = ControllerService(ServiceSettings(), clock=Clock(), store=StateStore(tmp_path), init_policy=init)
    assert svc.policy.source == "file" and table(svc).spec_off_crossover() == 12
    assert StateStore(tmp_path).load_policy().version == 3


def _step(clock, config, batch_size, step_ms, accepted=None):
    rec = {"kind": "step", "schema": 1, "server": "e0", "rank": 0, "iter": 0, "ts": clock.t,
           "batch_size": batch_size, "config": {"steps": config[0], "topk": config[1], "draft_tokens": config[2]},
           "step_ms": step_ms}
    if accepted is not None:
        rec["accepted"] = accepted
    return json.dumps(rec).encode()


def test_refits_promptly_while_the_evidence_is_partial():
    clock = Clock()
    svc = ControllerService(ServiceSettings(refit_interval_s=1.0, partial_refit_s=0.1,
                                            candidates=((0, 1, 1), (3, 1, 4))), clock=clock)
    svc.tick()
    assert svc.num_refits == 1 and svc.evidence == "no telemetry yet"
    clock.t += 0.15
    assert svc.tick() is None and svc.num_refits == 1  # nothing came in: nothing to refit on
    for _ in range(20):  # batch 8 under the fallback: plain decode only
        clock.t += 0.005
        svc.observe_frame(_step(clock, (0, 1, 1), 8, 7.0))
    clock.t += 0.1
    svc.tick()
    assert svc.num_refits == 2 and svc.evidence.startswith("partial: no steps measured with speculation on")
    for _ in range(3):  # the first exploring steps of s3: accept length 3.5 at 1.5x the step time
        clock.t += 0.005
        svc.observe_frame(_step(clock, (3, 1, 4), 8, 10.5, [3, 3, 2, 3, 3, 2, 3, 3]))
    clock.t += 0.1
    svc.tick()
    assert svc.num_refits == 3 and svc.evidence is None
    assert table(svc).lookup(8) == (3, 1, 4)  # 0.1 s after the measurement, not 1 s
    # complete evidence: back to the refit interval
    svc.observe_frame(_step(clock, (3, 1, 4), 8, 10.5, [3] * 8))
    clock.t += 0.5
    svc.tick()
    assert svc.num_refits == 3
    clock.t += 0.5
    svc.tick()
    assert svc.num_refits == 4


def test_prompt_refits_last_a_while_only_when_the_evidence_stays_partial():
    clock = Clock()
    svc = ControllerService(ServiceSettings(refit_interval_s=1.0, partial_refit_s=0.1, partial_refit_for_s=2.0,
                                            candidates=((0, 1, 1), (3, 1, 4))), clock=clock)
    svc.tick()
    clock.t += 100.0  # an idle daemon: the window opens with the first telemetry, not at start
    times = []
    for _ in range(600):  # plain decode only, for 6 s: speculation is never measured
        clock.t += 0.01
        svc.observe_frame(_step(clock, (0, 1, 1), 8, 7.0))
        n = svc.num_refits
        svc.tick()
        if svc.num_refits > n:
            times.append(clock.t)
    gaps = [round(b - a, 2) for a, b in zip(times, times[1:])]
    assert svc.evidence.startswith("partial")
    assert all(g <= 0.11 for g in gaps[:15]) and all(g >= 0.99 for g in gaps[-3:]), gaps


def test_explores_configs_lacking_data():
    clock = Clock()
    svc = ControllerService(ServiceSettings(refit_interval_s=1, candidates=((0, 1, 1), (1, 1, 2), (3, 1, 4))),
                            clock=clock)
    feed(svc, clock, truth_with_crossover(20), 6000, list(range(1, 40)))
    clock.t += 1
    pol = svc.tick()
    assert pol.explore and pol.explore_period == 64
    s1_rows = [r for r in pol.explore if r.config.key == (1, 1, 2)]  # s1 was never measured
    assert [(r.min_batch, r.max_batch) for r in s1_rows] == [(1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63)]
    # s3, measured and chosen at small batches, is measured where the table decodes plainly only
    t = table(svc)
    probes = [r for r in pol.explore if r.config.key == (3, 1, 4)]
    assert all(t.lookup(r.max_batch) == (0, 1, 1) for r in probes)
    assert (1, 1) not in [(r.min_batch, r.max_batch) for r in probes]


@pytest.mark.parametrize("per_region", [1, 2, 0])
def test_the_configurations_with_the_largest_bound_share_a_regions_exploring_steps(per_region):
    """Three candidates, one (s1) never measured: in each region the exploring steps go to the
    `explore_per_region` configurations worth measuring with the largest bound, s1 (no bound at all)
    first; 0 = every one worth measuring."""
    clock = Clock()
    cands = ((0, 1, 1), (1, 1, 2), (3, 1, 4))
    everyone = ControllerService(ServiceSettings(refit_interval_s=1, candidates=cands, explore_per_region=0),
                                 clock=Clock())
    svc = ControllerService(ServiceSettings(refit_interval_s=1, candidates=cands, explore_per_region=per_region),
                            clock=clock)
    for r in generate(truth_with_crossover(20), num_steps=6000, batch_sizes=list(range(1, 40)), seed=0,
                      t0=clock.t):
        clock.t = everyone.clock.t = r["ts"]
        svc.observe_frame(json.dumps(r).encode())
        everyone.observe_frame(json.dumps(r).encode())
    clock.t += 1
    everyone.clock.t = clock.t
    svc.tick(), everyone.tick()
    by_region, all_rows = {}, {}
    for r in svc.policy.explore:
        by_region.setdefault(r.min_batch, []).append(r.config.key)
    for r in everyone.policy.explore:
        all_rows.setdefault(r.min_batch, []).append(r.config.key)
    assert set(by_region) == set(all_rows) and len(by_region) == 6
    for lo, configs in by_region.items():
        assert (1, 1, 2) in configs and set(configs) <= set(all_rows[lo])
        assert len(configs) == (min(per_region, len(all_rows[lo])) if per_region else len(all_rows[lo]))


def test_a_step_time_curve_is_trusted_up_to_twice_its_largest_measured_batch():
    """However many batch sizes a curve spans, its extrapolation is trusted to 2x the largest:
    on the simulated MoE a curve measured to 32 looked even with plain decode at 64-96, where
    plain decode is 8-12% better."""
    from specctl.training.synth import GroundTruth

    clock = Clock()
    svc = ControllerService(ServiceSettings(refit_interval_s=1, candidates=((0, 1, 1), (3, 1, 4))), clock=clock)
    off, s3 = truth_with_crossover(24).configs
    feed(svc, clock, GroundTruth((off,)), 3000, [1, 2, 4, 8, 16])  # 5 sizes over a 16x span
    feed(svc, clock, GroundTruth((s3,)), 3000, [1, 2, 4, 8, 16, 32], seed=1)
    clock.t += 1
    svc.tick()
    trust = {o.config: o.trust() for o in svc.fitter.options(128)}
    assert trust[(0, 1, 1)][31] and not trust[(0, 1, 1)][32]  # b = 32 yes, 33 no
    assert trust[(3, 1, 4)][63] and not trust[(3, 1, 4)][64]


def test_acceptance_is_probed_while_plain_decode_runs_and_tracks_a_shift():
    clock = Clock()
    svc = ControllerService(ServiceSettings(refit_interval_s=1), clock=clock)
    easy = truth_with_crossover(24, accept=(0.9, 0.85, 0.8))
    feed(svc, clock, easy, 8000, list(range(1, 48)))
    clock.t += 1
    svc.tick()
    before = table(svc).spec_off_crossover()
    # the traffic turns hard while the engine sits at batch 40 (plain decode), speculating only
    # on the probing steps the policy asks for (1 in 64)
    hard = truth_with_crossover(24, accept=(0.5, 0.4, 0.3))
    steps = [r for r in generate(hard, num_steps=64 * 40 * 8, batch_sizes=[40], seed=3, t0=clock.t, dwell=1)
             if r["config"]["steps"] == 0]
    probes = iter(r for r in generate(hard, num_steps=64 * 40 * 8, batch_sizes=[40], seed=4, t0=clock.t, dwell=1)
                  if r["config"]["steps"] == 3)
    for i, r in enumerate(steps[: 64 * 40 * 2]):
        r = next(probes) if i % 64 == 0 else r
        r["ts"] = clock.t = clock.t + 0.01
        r["iter"] = 100000 + i  # one engine's consecutive decode steps (the filtering left holes)
        svc.observe_frame(json.dumps(r).encode())
        if i % 100 == 0:
            svc.tick()
    tau = svc.model.tokens_per_step((3, 1, 4))
    assert tau == pytest.approx(1 + 0.5 + 0.2 + 0.06, abs=0.15)  # the hard traffic's, not the easy
    assert table(svc).spec_off_crossover() < before


def test_engines_without_plain_decode_never_get_it():
    clock = Clock()
    cands = ((1, 1, 2), (3, 1, 4))
    svc = ControllerService(ServiceSettings(refit_interval_s=1, candidates=cands), clock=clock)
    assert table(svc).configs() == [(3, 1, 4)]  # the fallback speculates everywhere
    truth = truth_with_crossover(20)
    for r in generate(truth, num_steps=6000, batch_sizes=list(range(1, 40)), t0=clock.t):
        if r["config"]["steps"] == 0:
            continue
        clock.t = r["ts"]
        svc.observe_frame(json.dumps(r).encode())
    clock.t += 1
    svc.tick()
    assert set(table(svc).configs()) <= set(cands)
    assert all(r.config.key in cands for r in (svc.policy.explore or []))


def test_a_flood_of_distinct_configurations_is_bounded():
    clock = Clock()
    svc = ControllerService(ServiceSettings(refit_interval_s=1), clock=clock)
    for k in range(2, 40):
        for n in range(3, 9):
            for i in range(3):
                clock.t += 0.01
                rec = {"kind": "step", "schema": 1, "server": "s", "rank": 0, "iter": i, "ts": clock.t,
                       "batch_size": 2, "config": {"steps": 2, "topk": k, "draft_tokens": n},
                       "accepted": [1, 2], "step_ms": 5.0}
                assert svc.observe_frame(json.dumps(rec).encode())
    clock.t += 1
    svc.tick()  # no exception: candidates and explore rows are capped
    assert len(svc.fitter.candidates()) <= 17
    assert len(svc.policy.explore or []) <= 256


@pytest.mark.parametrize("crossover, steps_at_40, explored", [
    (8, 4, False),  # s3 at batch 40 is 3x worse than plain decode: 4 steps settle it
    (38, 4, True),  # a near tie (and s3 chosen lower in the region): keep measuring
    (8, 0, True),   # s3 never measured near 40: nothing bounds it there
])
def test_exploration_stops_where_the_evidence_is_decisive(crossover, steps_at_40, explored):
    from specctl.training.synth import GroundTruth

    clock = Clock()
    cands = ((0, 1, 1), (3, 1, 4))
    svc = ControllerService(ServiceSettings(refit_interval_s=1, candidates=cands), clock=clock)
    off, s3 = truth_with_crossover(crossover).configs
    feed(svc, clock, GroundTruth((off,)), 6000, list(range(1, 41)))
    feed(svc, clock, GroundTruth((s3,)), 3000, list(range(1, 8)), seed=1)
    if steps_at_40:
        feed(svc, clock, GroundTruth((s3,)), steps_at_40, [40], seed=2)  # exploring steps at batch 40
    clock.t += 1
    svc.tick()
    rows = {(r.min_batch, r.max_batch) for r in (svc.policy.explore or []) if r.config.key == (3, 1, 4)}
    assert ((32, 63) in rows) == explored


def _feed_ticking(svc, clock, truth, seconds, bs, seed):
    """Telemetry of `truth` for `seconds`, the service ticking once a second as the daemon does;
    the table after each refit."""
    out, end, next_tick = [], clock.t + seconds, clock.t + 1.0
    for r in generate(truth, num_steps=10 ** 9, batch_sizes=bs, seed=seed, t0=clock.t):
        if r["ts"] >= end:
            break
        while r["ts"] >= next_tick:
            clock.t = next_tick
            svc.tick()
            out.append(table(svc))
            next_tick += 1.0
        clock.t = r["ts"]
        svc.observe_frame(json.dumps(r).encode())
    return out


def _shortfall(t, truth, bs):
    """The largest goodput the table gives up against the truth's best choice, over `bs`."""
    by_config = {c.config: c for c in truth.configs}
    best = truth.best(max(bs))
    return max(1.0 - truth.goodput(by_config[t.lookup(b)], b) / truth.goodput(by_config[best[b - 1]], b)
               for b in bs)


ACCEPT = {"code": (0.9, 0.85, 0.8), "chat": (0.55, 0.45, 0.4)}


@pytest.mark.parametrize("before, after", [("code", "chat"), ("chat", "code")])
def test_an_acceptance_shift_moves_the_table_within_a_few_refits(before, after):
    from dataclasses import replace

    from specctl.training.synth import GroundTruth

    off, s3 = truth_with_crossover(40, accept=ACCEPT["code"]).configs  # chat: crossover 12
    truths = {k: GroundTruth((off, replace(s3, accept=a))) for k, a in ACCEPT.items()}
    clock = Clock()
    svc = ControllerService(ServiceSettings(candidates=(off.config, s3.config)), clock=clock)
    bs = list(range(1, 90))
    settled = _feed_ticking(svc, clock, truths[before], 40, bs, seed=0)[-1]
    assert _shortfall(settled, truths[before], bs) < 0.03
    assert _shortfall(settled, truths[after], bs) > 0.15  # wrong for the new traffic
    shifted = [_shortfall(t, truths[after], bs) for t in _feed_ticking(svc, clock, truths[after], 20, bs, seed=1)]
    # within a few refits only a near tie at the crossover is left (the history right after a
    # detected shift is two seconds deep: its standard error is wide), and it keeps closing
    assert next(i + 1 for i, x in enumerate(shifted) if x < 0.07) <= 4, shifted
    assert shifted[-1] < 0.045 and all(b <= a for a, b in zip(shifted[3:], shifted[4:])), shifted


@pytest.mark.parametrize("bad", [{"switch_z": -1.0}, {"max_margin": 1.5}, {"margin": -0.01}])
def test_tolerance_settings_are_checked(bad):
    with pytest.raises(ValueError, match="switch_z"):
        ServiceSettings(**bad)


def _near_tie(lead):
    """s2 and s3 whose goodput differs by `lead` (s3 ahead) at every batch size: the GPU sweep's
    s2/s3 situation, where s3's extra drafts cost about what they bring."""
    from specctl.training.synth import ConfigTruth, GroundTruth

    accept = (0.7, 0.6, 0.5)
    s2 = ConfigTruth((2, 1, 3), 7.0, 0.10, accept[:2])
    k = (s2.tokens_per_step() + 0.7 * 0.6 * 0.5) / s2.tokens_per_step() / (1.0 + lead)
    return GroundTruth((s2, ConfigTruth((3, 1, 4), 7.0 * k, 0.10 * k, accept)))


def _table_changes(truth, switch_z, seconds=60, seed=0):
    clock = Clock()
    cands = tuple(c.config for c in truth.configs)
    svc = ControllerService(ServiceSettings(candidates=cands, switch_z=switch_z), clock=clock)
    tables = _feed_ticking(svc, clock, truth, seconds, list(range(1, 33)), seed)[5:]  # once learned
    return sum(a.rows != b.rows for a, b in zip(tables, tables[1:])), tables[-1]


def test_a_stationary_near_tie_does_not_churn_the_table():
    churn_margin_only = sum(_table_changes(_near_tie(0.005), switch_z=0.0, seed=s)[0] for s in range(3))
    churn = sum(_table_changes(_near_tie(0.005), switch_z=2.0, seed=s)[0] for s in range(3))
    assert churn <= 8 < 24 <= churn_margin_only, (churn, churn_margin_only)  # 3 minutes of traffic
    # a 2% lead on a minute of traffic is evidence: s3 everywhere, and it stays
    churn, last = _table_changes(_near_tie(0.02), switch_z=2.0)
    assert churn == 0 and {r.config for r in last.rows} == {(3, 1, 4)}


def test_a_tree_competes_with_plain_decode_and_is_probed_where_plain_decode_runs():
    """The seed operator's candidates: plain decode and an EAGLE-3 tree (topk 4, 2 steps, 16
    tokens), no chain. The table follows the measured goodput, and where it decodes plainly the
    tree keeps being measured on exploring steps (no chain exists to probe with)."""
    from specctl.training.synth import ConfigTruth, GroundTruth

    tree = (2, 4, 16)
    # tau 2.62; the tree pays below batch 26 and loses by little above: a little more acceptance
    # would turn it, so it is worth probing where plain decode runs
    truth = GroundTruth((ConfigTruth((0, 1, 1), 6.0, 0.02), ConfigTruth(tree, 13.0, 0.16, (0.9, 0.8))))
    clock = Clock()
    svc = ControllerService(ServiceSettings(refit_interval_s=1, candidates=((0, 1, 1), tree), fixed_config=tree),
                            clock=clock)
    feed(svc, clock, truth, 12000, list(range(1, 40)))
    clock.t += 1
    svc.tick()
    t = table(svc)
    assert set(t.configs()) == {(0, 1, 1), tree}
    assert t.lookup(2) == tree and t.lookup(36) == (0, 1, 1)
    assert abs(t.spec_off_crossover() - truth.crossover()) <= 2
    assert svc.model.tokens_per_step(tree) == pytest.approx(truth.configs[1].tokens_per_step(), abs=0.1)
    probes = [r for r in (svc.policy.explore or []) if r.config.key == tree]
    assert probes and all(t.lookup(r.min_batch) == (0, 1, 1) or t.lookup(r.max_batch or 40) == (0, 1, 1)
                          for r in probes)


def test_a_fallback_the_engines_have_no_state_for_is_refused_up_front():
    with pytest.raises(ValueError, match="fallback configuration s3 is not among the engines' runtime states"):
        ServiceSettings(candidates=((0, 1, 1), (1, 1, 2), (2, 4, 16)))
    ServiceSettings(candidates=((0, 1, 1), (2, 4, 16)), fixed_config=(2, 4, 16))


def _closed_loop(svc, clock, seconds, step_ms, tau, seed, batch=4, start_ms=None, start_steps=0):
    """An engine at a fixed batch size following the service's table (exploring steps
    included), its step times lognormal around `step_ms[config]` (cv 0.3), the service ticking
    every second of its clock. The first `start_steps` steps run plain decode at `start_ms`
    (the engine was slower then). Returns the configuration run at each step."""
    rng = np.random.default_rng(seed)
    sigma = np.sqrt(np.log1p(0.3 ** 2))
    ran, next_tick, end, i = [], clock.t + 1.0, clock.t + seconds, 0
    while clock.t < end:
        if i < start_steps:
            c, ms = (0, 1, 1), start_ms
        else:
            c = table(svc).decide(batch, i)
            ms = step_ms[c]
        ms *= rng.lognormal(-0.5 * sigma * sigma, sigma)
        rec = {"kind": "step", "schema": 1, "server": "s", "rank": 0, "iter": i, "ts": clock.t,
               "batch_size": batch, "config": {"steps": c[0], "topk": c[1], "draft_tokens": c[2]},
               "step_ms": round(ms, 4)}
        if c[0]:  # accepted drafts per request: tau - 1 on average
            k = tau[c] - 1.0
            rec["accepted"] = [int(x) for x in rng.random(batch) < k - int(k)] if k < 1 else [
                int(k) + int(x) for x in rng.random(batch) < k - int(k)]
        assert svc.observe_frame(json.dumps(rec).encode())
        ran.append(c)
        clock.t += ms / 1000.0
        i += 1
        if clock.t >= next_tick:
            svc.tick()
            next_tick += 1.0
    return ran


@pytest.mark.parametrize("idle_s, back_to_plain", [(1200.0, True), (0.0, False)])
def test_a_configuration_left_on_high_step_times_is_measured_again_as_its_values_age(idle_s, back_to_plain):
    """Plain decode ran slowly for a while (2.9 ms at batch 4), long enough to be measured and
    dropped for s2 (2.2 tokens per 5 ms step: 28% ahead); then the engine became fast again
    (2.0 ms), which only exploring steps can show. Plain decode is 14% better than s2 at batch 4
    then. Its old values decided the comparison, but they age: after 20 minutes (here an idle
    engine's) their standard error covers the 28%, plain decode is measured again, and its
    exploring steps stand for it once there are FRESH_WARM of them: the engine goes back to
    plain decode. Two minutes after it was left, it is still decided against."""
    off, s2 = (0, 1, 1), (2, 1, 3)
    clock = Clock()
    svc = ControllerService(ServiceSettings(refit_interval_s=1, candidates=(off, s2), fixed_config=s2),
                            clock=clock)
    step_ms, tau = {off: 2.0, s2: 5.0}, {s2: 2.2}
    _closed_loop(svc, clock, 20, step_ms, tau, seed=1, start_ms=2.9, start_steps=2000)
    assert table(svc).lookup(4) == s2
    _closed_loop(svc, clock, 30, step_ms, tau, seed=2)
    assert all(r.config.key != off for r in (svc.policy.explore or []))  # decided
    clock.t += idle_s
    before = _closed_loop(svc, clock, 90, step_ms, tau, seed=3)
    after = _closed_loop(svc, clock, 40, step_ms, tau, seed=4)
    if back_to_plain:
        switch = next(i for i in range(len(before)) if before[i:i + 10] == [off] * 10)
        assert FRESH_WARM <= before[:switch].count(off) <= 4 * FRESH_WARM, before[:switch].count(off)
        assert after.count(off) >= 0.8 * len(after)  # the table's noise aside, plain decode
    else:
        assert before.count(off) == after.count(off) == 0  # nothing measured plain decode again


@pytest.mark.parametrize("step_drift, off_steps, row", [
    (0.1, 500, False),     # at 32-63 s3 has values only at 48, where plain decode wins by 27%
    (50.0, 500, True),     # step times aging this fast leave 48 open: the row is there
    # minutes later s3's acceptance has not been measured for many half-lives: with all its
    # drafts accepted it would win at 48, so it is worth a step again
    (0.1, 20000, True),
])
def test_a_left_configuration_is_measured_again_only_where_its_own_values_leave_it_in_the_running(
        step_drift, off_steps, row):
    """Between its measured batch sizes a configuration's prediction is an interpolation whose
    standard error spans the whole gap: judged there, s3 at 32-47 (measured at 2 and 48) would
    look undecided and be probed on every exploring step, each 3.6x a plain step here. It is
    judged where it has values of its own, and measured again as those values (step time or
    acceptance) age."""
    from specctl.training.synth import GroundTruth

    clock = Clock()
    svc = ControllerService(ServiceSettings(refit_interval_s=1, candidates=((0, 1, 1), (3, 1, 4)),
                                            step_drift=step_drift), clock=clock)
    off, s3 = truth_with_crossover(24).configs
    feed(svc, clock, GroundTruth((off,)), 4000, list(range(1, 64)))
    feed(svc, clock, GroundTruth((s3,)), 3000, [2, 48], seed=1)
    t0 = clock.t
    feed(svc, clock, GroundTruth((off,)), off_steps, [40], seed=2)  # plain decode at 40 for a while
    clock.t += 1
    svc.tick()
    assert table(svc).lookup(40) == (0, 1, 1)
    rows = {(r.min_batch, r.config.key) for r in (svc.policy.explore or [])}
    assert ((32, (3, 1, 4)) in rows) == row, (rows, clock.t - t0)


@pytest.mark.parametrize("cv, accepted, table_at_4, measured", [
    (0.05, [1, 1, 1, 0], "off", True),   # s1 4% ahead on 4 acceptances a second: held, kept measured
    (0.05, [1, 1, 1, 1], "s1", False),   # s1 19% ahead: it simply wins, plain decode is decided
])
def test_a_configuration_held_back_by_the_tolerance_keeps_being_measured(cv, accepted, table_at_4, measured):
    """Plain decode runs at batch 4 (25 ms) and s1 (42 ms) is measured once a second, as
    exploring steps measure it on a slow engine. At first s1 accepts 2 drafts of 4 and the table
    takes plain decode; then 3 of 4: s1 leads by 4%, within the tolerance its thin acceptance
    leaves (capped at 5%). The table keeps plain decode, and s1 stays among the configurations
    worth measuring at 4-7 until that is settled."""
    off, s1 = (0, 1, 1), (1, 1, 2)
    clock = Clock()
    svc = ControllerService(ServiceSettings(refit_interval_s=1, candidates=(off, s1), fixed_config=s1,
                                            threshold=1), clock=clock)
    rng = np.random.default_rng(0)
    sigma = np.sqrt(np.log1p(cv ** 2))
    for second in range(80):
        for i in range(40):
            c, ms = (s1, 42.0) if i == 0 else (off, 25.0)
            ms *= rng.lognormal(-0.5 * sigma * sigma, sigma)
            acc = ([1, 1, 0, 0] if second < 20 else accepted) if c == s1 else None
            assert svc.observe_frame(_step(clock, c, 4, round(ms, 4), acc))
            clock.t += ms / 1000.0
        svc.tick()
        if second == 19:
            assert table(svc).lookup(4) == off
    assert table(svc).lookup(4) == {"off": off, "s1": s1}[table_at_4]
    rows = [(r.min_batch, r.max_batch, r.config.key) for r in (svc.policy.explore or [])]
    assert ((4, 7, s1) in rows) == measured and (4, 7, off) not in rows, rows


# ------------------------------------------------------------------------- context bands

CTX_TRUTH = truth_with_ctx_crossovers((300, 76), (6000, 14))


def _ctx_service(seed=3, n=30000, drop_ctx=False, truth=CTX_TRUTH, **kw):
    clock = Clock()
    svc = ControllerService(ServiceSettings(**kw), clock=clock)
    for r in generate(truth, num_steps=n, batch_sizes=list(range(1, 129)), seed=seed, t0=clock.t,
                      ctx_per_request=[300, 6000]):
        clock.t = r["ts"]
        if drop_ctx:
            r.pop("ctx_tokens")
        assert svc.observe_frame(json.dumps(r).encode())
    clock.t += 1.0
    svc.refit()
    return svc, clock


def test_alternating_contexts_give_a_table_per_context_band():
    svc, _ = _ctx_service()
    t = table(svc)
    assert len(t.bands) >= 2 and t.bands[0].min_ctx == 0 and t.bands[-1].max_ctx is None
    # every band is a plain two-row table: speculate below its crossover, plain decode from it up
    for band in t.bands:
        assert [r.config[0] for r in band.rows] == [3, 0], band
    short = PolicyTable(rows=t.rows_for(300)).spec_off_crossover()
    long = PolicyTable(rows=t.rows_for(6000)).spec_off_crossover()
    assert abs(short - CTX_TRUTH.crossover(mean_ctx=300)) <= 0.1 * 76, short
    assert abs(long - CTX_TRUTH.crossover(mean_ctx=6000)) <= 2, long
    # crossovers fall as the context grows
    xs = [PolicyTable(rows=b.rows).spec_off_crossover() for b in t.bands]
    assert xs == sorted(xs, reverse=True)
    # the engine looks its batch up by mean context
    assert t.lookup(40, 40 * 300) == (3, 1, 4) and t.lookup(40, 40 * 6000) == (0, 1, 1)
    assert [b["min_ctx"] for b in svc.policy.model["ctx_bands"]] == [b.min_ctx for b in t.bands]
    # more of the same traffic leaves the bands as they are
    v = svc.policy.version
    bands = t.bands
    for r in generate(CTX_TRUTH, num_steps=4000, batch_sizes=list(range(1, 129)), seed=4,
                      t0=svc.clock.t, ctx_per_request=[300, 6000]):
        svc.clock.t = r["ts"]
        svc.observe_frame(json.dumps(r).encode())
    svc.clock.t += 1.0
    svc.refit()
    assert table(svc).bands == bands and (svc.policy.version == v or table(svc).rows != t.rows)


def test_without_ctx_tokens_or_with_the_context_axis_off_there_is_one_table_as_before():
    plain, _ = _ctx_service(drop_ctx=True)
    off, _ = _ctx_service(ctx_axis=False)
    assert table(plain).bands == () and table(off).bands == ()
    assert table(plain).rows == table(off).rows  # the rows for any context do not use ctx_tokens
    assert "ctx_bands" not in plain.policy.model and "ctx_bands" not in off.policy.model
    assert all(r.ctx_band is None for r in plain.policy.table)


def test_a_context_that_does_not_change_step_times_gives_no_bands():
    svc, _ = _ctx_service(truth=truth_with_crossover(30), n=12000)
    assert svc.model.has_ctx() and table(svc).bands == ()
