"""The time between decode steps (CostModel._add_gap / gap_ms) and how the service prices it
(ControllerService.gap_ms): tables of cases on hand-made step sequences."""

import math

import numpy as np
import pytest

from specctl.controller.service import ControllerService, ServiceSettings
from specctl.training.costmodel import GAP_IDLE_S, GAP_MIN_STEPS, GAP_STRETCH, CostModel, Sample

OFF, S2 = (0, 1, 1), (2, 1, 3)


def _steps(model, config, n, *, b=48, step_ms=10.0, t0=100.0, it0=0, every=None, gap_ms=60.0, server="s", rank=0,
           accepted=None):
    """n decode steps of one configuration, back to back; every `every`-th gap holds one other iteration of gap_ms."""
    t, it = t0, it0
    for i in range(n):
        model.observe(Sample(ts=t, config=config, batch_size=b, step_ms=step_ms, server=server, rank=rank, iter=it,
                             accepted=accepted if accepted is not None else ([1] * b if config[0] else None)))
        other = every is not None and (i + 1) % every == 0
        t += (step_ms + (gap_ms if other else 0.0)) / 1000.0
        it += 2 if other else 1
    return t, it


@pytest.mark.parametrize("case, expect", [
    # contiguous iterations: no gap however the launches are spaced
    ("contiguous", 0.0),
    # one other iteration of 60 ms every 4th step: 15 ms per step
    ("every4", 15.0),
])
def test_gap_per_step_is_the_non_decode_time_inside_a_stretch(case, expect):
    m = CostModel()
    _steps(m, OFF, 200, every=None if case == "contiguous" else 4)
    g = m.gap_ms(OFF, [48])[0]
    assert g == pytest.approx(expect, rel=0.05)


def test_short_stretches_count_nothing_and_a_lone_step_inherits_no_gaps():
    m = CostModel()
    t, it = 100.0, 0
    for _ in range(40):  # stretches of GAP_STRETCH steps, each followed by one exploring step of s2
        t, it = _steps(m, OFF, GAP_STRETCH, t0=t, it0=it, every=2)
        t, it = _steps(m, S2, 1, t0=t, it0=it, every=1)
    assert math.isnan(m.gap_ms(OFF, [48])[0]) and math.isnan(m.gap_ms(S2, [48])[0])
    assert not m.gaps_ or all(c.n < GAP_MIN_STEPS for c in m.gaps_.values())


def test_idle_time_rank_and_server_boundaries_and_records_without_iter():
    m = CostModel()
    t, it = _steps(m, OFF, 100)
    # a 2 s pause with other iterations in it (a server waiting for requests): not a cost
    _steps(m, OFF, 100, t0=t + GAP_IDLE_S + 1.0, it0=it + 5)
    assert m.gap_ms(OFF, [48])[0] == 0.0
    # two ranks / servers interleaved never pair with each other's steps
    m2 = CostModel()
    for i in range(200):
        for key in (("a", 0), ("a", 1), ("b", 0)):
            m2.observe(Sample(ts=100 + 0.01 * i, config=OFF, batch_size=48, step_ms=10.0, server=key[0], rank=key[1],
                              iter=i))
    assert m2.gap_ms(OFF, [48])[0] == 0.0
    # telemetry without iterations (SGLang log lines, older plugins): no gap cells at all
    m3 = CostModel()
    for i in range(200):
        m3.observe(Sample(ts=100 + 0.01 * i, config=OFF, batch_size=48, step_ms=10.0))
    assert not m3.gaps_ and math.isnan(m3.gap_ms(OFF, [48])[0])


def test_gap_is_interpolated_between_regions_and_nan_beyond():
    m = CostModel()
    t, it = _steps(m, OFF, 300, b=16, every=None)          # region 16-31: 0 ms
    _steps(m, OFF, 300, b=64, every=2, t0=t + 0.1, it0=it)  # region 64-127: 30 ms per step
    g = m.gap_ms(OFF, [16 * math.sqrt(2), 32 * math.sqrt(2), 64 * math.sqrt(2), 200, 2])
    assert g[0] == pytest.approx(0.0, abs=1e-9) and g[2] == pytest.approx(30.0, rel=0.05)
    assert 0.0 < g[1] < 30.0
    assert math.isnan(g[3]) and math.isnan(g[4])


def test_state_round_trip_and_states_without_gaps():
    m = CostModel()
    _steps(m, OFF, 200, every=4)
    st = m.get_state()
    assert "gaps" in st
    m2 = CostModel().set_state(st)
    assert m2.gap_ms(OFF, [48])[0] == pytest.approx(m.gap_ms(OFF, [48])[0])
    st.pop("gaps")  # a state written before the gap cells
    assert math.isnan(CostModel().set_state(st).gap_ms(OFF, [48])[0])
    assert m.refit().summary()["configs"]["off"]["gaps"][0]["min_batch"] == 32


@pytest.mark.parametrize("measured, gap_term, expect", [
    ({OFF: 8.0}, True, {OFF: 0.0, S2: 0.0}),            # one measured: no comparison, no term
    ({OFF: 8.0, S2: 20.0}, True, {OFF: 8.0, S2: 20.0}),
    ({OFF: 8.0, S2: 20.0}, False, {OFF: 0.0, S2: 0.0}),  # the default (gap_term off)
    ({}, True, {OFF: 0.0, S2: 0.0}),
])
def test_the_service_prices_gaps_only_where_two_configurations_have_them(measured, gap_term, expect):
    svc = ControllerService(ServiceSettings(gap_term=gap_term), clock=lambda: 0.0)
    svc.model.gap_ms = lambda c, b: np.full(len(b), measured.get(c, np.nan))  # the cells' read-out, per case
    S3 = (3, 1, 4)
    got = svc.gap_ms([OFF, S2, S3], np.arange(1, 5))
    for c, v in expect.items():
        assert got[c].tolist() == [v] * 4
    pooled = np.mean(list(measured.values())) if len(measured) >= 2 and gap_term else 0.0
    assert got[S3].tolist() == [pooled] * 4  # unmeasured: the mean of the measured (no edge either way)
