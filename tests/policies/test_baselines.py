"""Baseline policies: name parsing, SGLang's EMA policy (probing, hysteresis, routing), the oracle."""

import importlib.util
import random

import numpy as np
import pytest

from specctl.policies.baselines import (
    SGLANG_DEFAULT_ADAPTIVE_CONFIG,
    Oracle,
    PolicyName,
    SGLangAdaptiveParams,
    SGLangEMA,
    SGLangStepSlot,
    build_baseline,
    parse_config_text,
    parse_policy_name,
    sglang_spec_cuda_graph_bs,
    snap_adaptive_config,
)
from specctl.policies.table import OFF, chain

CONFIGS = [OFF, chain(1), chain(2), chain(3)]
NAMES = ["off", "s1", "s2", "s3"]


@pytest.mark.parametrize("text, expect", [
    ("off", PolicyName("off")),
    ("oracle", PolicyName("oracle")),
    ("sglang-ema", PolicyName("sglang-ema")),
    ("adaptive", PolicyName("adaptive")),
    ("static:s3", PolicyName("static", config="s3")),
    ("static:3,1,4", PolicyName("static", config="3,1,4")),
    ("threshold:5:s3", PolicyName("threshold", config="s3", threshold=5)),
    ("adaptive:refit_interval_s=2", PolicyName("adaptive", options=(("refit_interval_s", "2"),))),
])
def test_policy_names_parse(text, expect):
    assert parse_policy_name(text) == expect
    assert str(parse_policy_name(text)) == text


@pytest.mark.parametrize("text, fragment", [
    ("greedy", "unknown policy 'greedy'"),
    ("static", "expected static:<config>"),
    ("threshold:5", "expected threshold:<N>:<config>"),
    ("threshold:x:s3", "threshold N must be an integer"),
    ("threshold:0:s3", "threshold N must be >= 1"),
    ("oracle:3", "takes no argument"),
    ("adaptive:fast", "expected adaptive:key=value"),
])
def test_bad_policy_names_say_why(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_policy_name(text)


@pytest.mark.parametrize("text, config", [
    ("off", OFF), ("s1", (1, 1, 2)), ("s2k4n8", (2, 4, 8)), ("3,1,4", (3, 1, 4)), ("0,1,1", OFF),
])
def test_config_text(text, config):
    assert parse_config_text(text) == config


def test_config_missing_from_profile_is_named():
    with pytest.raises(ValueError, match=r"'s5' = \(5, 1, 6\) is not in the profile"):
        build_baseline("static:s5", NAMES, CONFIGS, lambda b: np.ones(4))


@pytest.mark.parametrize("name, batch, expect", [
    ("off", 1, OFF), ("static:s2", 200, chain(2)),
    ("threshold:5:s3", 4, chain(3)), ("threshold:5:s3", 5, OFF), ("threshold:1:s3", 1, OFF),
])
def test_table_baselines(name, batch, expect):
    assert build_baseline(name, NAMES, CONFIGS, lambda b: np.ones(4)).decide(batch) == expect


# ------------------------------------------------------------------------------ SGLang EMA


def _steps_trace(slot, accepted_per_batch, n):
    out = []
    for _ in range(n):
        out.append(slot.current_steps)
        slot.update([accepted_per_batch] * 4)
    return out


def test_sglang_slot_at_zero_probes_up_every_update_half_the_time():
    # documented behaviour (sglang-integration.md 1.2): never-accepted drafts, candidates [0,1,3]:
    # 5 batches at 0, 5 at 1, and again: half of all batches probe speculation
    slot = SGLangStepSlot(1, {"candidate_steps": [0, 1, 3], "down_hysteresis": 0.0})
    trace = _steps_trace(slot, 0, 200)[40:]
    assert set(trace) == {0, 1}
    assert trace.count(1) == trace.count(0)
    runs = [len(list(g)) for _, g in __import__("itertools").groupby(trace)][1:-1]
    assert set(runs) == {5}


def test_sglang_slot_warmup_then_update_interval():
    slot = SGLangStepSlot(3, {"candidate_steps": [1, 3, 5, 7], "down_hysteresis": -0.25})
    trace = _steps_trace(slot, 0, 16)
    # EMA falls from 2.0 at once, but nothing moves before batch 10 + 5 = 15
    assert trace[:15] == [3] * 15 and trace[15] == 1


@pytest.mark.parametrize("candidates, current, ema, down_hyst, expect", [
    ([1, 3, 5, 7], 3, 0.26, -0.25, 3),   # drop threshold 1 - 0.5 - 0.25 = 0.25: not reached
    ([1, 3, 5, 7], 3, 0.25, -0.25, 1),
    ([1, 3, 5, 7], 3, 2.49, -0.25, 3),   # rise threshold 3 - 0.5 = 2.5: not passed
    ([1, 3, 5, 7], 3, 2.51, -0.25, 5),
    ([1, 3, 5, 7], 3, 6.9, -0.25, 7),    # climbs several candidates at once
    ([0, 1, 3], 1, 0.5, 0.0, 0),         # drop to 0 when the EMA is at most 0.5
    ([0, 1, 3], 1, 0.51, 0.0, 3),        # no dead band: just above the drop line is the rise line
    ([0, 1, 3], 0, 9.0, 0.0, 1),         # at 0: always one candidate up, whatever the EMA
])
def test_sglang_hysteresis(candidates, current, ema, down_hyst, expect):
    slot = SGLangStepSlot(current, {"candidate_steps": candidates, "down_hysteresis": down_hyst})
    slot.ema_accept_len = ema
    slot._recompute_params()
    assert slot.current_steps == expect


@pytest.mark.parametrize("batch, padded_slot, no_pad_slot", [
    (1, 1, 1), (7, 1, 1), (8, 8, 8), (31, 32, 8), (33, 32, 32), (61, 64, 32), (63, 64, 32), (300, 64, 64),
])
def test_sglang_routing_pads_to_cuda_graph_sizes(batch, padded_slot, no_pad_slot):
    p = SGLangAdaptiveParams()
    assert p.slot_for(batch) is p._slots[no_pad_slot]
    p.set_cuda_graph_bs(sglang_spec_cuda_graph_bs(256))
    assert p.slot_for(batch) is p._slots[padded_slot]


def test_sglang_defaults_start_at_the_middle_candidate():
    p = SGLangAdaptiveParams()
    assert p.candidate_steps == [0, 1, 3, 5, 7]
    assert [p._slots[k].current_steps for k in (1, 8, 32, 64)] == [3, 3, 1, 0]


def test_snap_maps_steps_onto_the_profile():
    snapped = snap_adaptive_config(SGLANG_DEFAULT_ADAPTIVE_CONFIG, [0, 1, 2, 3])
    assert [snapped[k]["candidate_steps"] for k in ("1", "8", "32", "64")] == [[1, 3], [0, 1, 3], [0, 1], [0]]


def test_overlap_delays_feedback_by_one_step():
    def run(overlap):
        pol = SGLangEMA({0: OFF, 1: chain(1), 3: chain(3)}, overlap=overlap, cuda_graph_bs=None)
        out = []
        for _ in range(30):
            c = pol.decide(8)
            out.append(c[0])
            pol.observe(8, c, np.zeros(8, dtype=int), 1.0, 0.0)
        return out

    a, b = run(False), run(True)
    first = next(i for i, s in enumerate(a) if s != a[0])
    assert a[:first] == b[:first] and b[first] == a[0] and b[first + 1] == a[first]


@pytest.mark.sglang
def test_port_matches_sglang_when_installed():
    """The port against the real SGLang class on random acceptance streams (needs sglang; run it
    with each `.cache/sglang-<version>/bin/python`). Slot logic and routing must agree exactly."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("needs the sglang modules: `make test` runs it under each release's CPU environment")
    import sglang.srt.speculative.adaptive_spec_params as real_mod

    # that version's own default slots (0.5.17's "1" slot is [1, 3, 7])
    config = getattr(real_mod, "DEFAULT_ADAPTIVE_CONFIG", SGLANG_DEFAULT_ADAPTIVE_CONFIG)
    for seed in range(4):
        rng = random.Random(seed)
        real = real_mod.AdaptiveSpeculativeParams(initial_steps=3)
        ours = SGLangAdaptiveParams(3, config=config)
        cg = sglang_spec_cuda_graph_bs(256)
        real.set_cuda_graph_bs(cg)
        ours.set_cuda_graph_bs(cg)
        moved = set()
        for i in range(6000):
            if i % 500 == 0:
                p_accept = rng.choice([0.0, 0.3, 0.6, 0.85, 0.97])  # from never to almost always
            bs = rng.choice([1, 2, 5, 7, 9, 20, 31, 33, 50, 63, 70])
            steps = ours.get_steps_for_batch(bs)
            assert real.get_steps_for_batch(bs) == steps
            moved.add(steps)
            acc = []
            for _ in range(bs):
                k = 0
                while k < steps and rng.random() < p_accept:
                    k += 1
                acc.append(k)
            assert real.on_verify_complete(acc, bs) == ours.on_verify_complete(acc, bs)
        assert len(moved) >= 3  # the streams drove the slots through several candidates


# ------------------------------------------------------------------------------ oracle


@pytest.mark.parametrize("batch, tau, expect", [
    (1, [1.0, 1.8, 2.4, 3.0], chain(3)),   # cheap drafts: the longest chain
    (64, [1.0, 1.8, 2.4, 3.0], OFF),       # costly verify at large batch: plain decode
    (1, [1.0, 1.05, 1.05, 1.05], OFF),     # drafts never accepted: off even at batch 1
])
def test_oracle_maximises_expected_goodput(batch, tau, expect):
    def step_ms(b):
        return np.array([5.0, 6.0, 7.0, 8.0]) * (1 + b / 8 * np.array([0.05, 0.5, 1.0, 1.5]))

    o = Oracle(CONFIGS, step_ms)
    assert o.decide_with_truth(batch, np.array(tau)) == expect
    with pytest.raises(TypeError):
        o.decide(batch)
