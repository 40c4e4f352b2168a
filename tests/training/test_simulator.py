"""The simulator: file loading and its error messages, the decode-loop physics, determinism, and
the oracle bounding every policy."""

import copy
import re
import logging
from dataclasses import replace

import numpy as np
import pytest

from specctl.harness.simbench import AdaptivePolicy, make_policy
from specctl.training.simulator import (
    SimFileError,
    accept_matrix,
    expected_tau,
    load_profile,
    load_workload,
    parse_profile,
    parse_workload,
    shipped_names,
    simulate,
)

PROFILE = {"schema": "specctl.profile/1", "name": "t",
           "configs": {"off": {"steps": 0, "topk": 1, "draft_tokens": 1},
                       "s1": {"steps": 1, "topk": 1, "draft_tokens": 2},
                       "s3": {"steps": 3, "topk": 1, "draft_tokens": 4}},
           "step_ms": {"off": [[1, 10.0], [64, 12.0]], "s1": [[1, 12.0], [64, 20.0]],
                       "s3": [[1, 15.0], [64, 40.0]]},
           "noise_cv": 0.0}
WORKLOAD = {"schema": "specctl.workload/1", "seed": 3,
            "classes": {"code": {"accept": {"s1": [0.8], "s3": [0.8, 0.5, 0.5]}, "output_tokens": [50, 100]},
                        "chat": {"accept": {"s1": [0.4]}, "output_tokens": [20, 40]}},
            "phases": [{"duration_s": 5, "concurrency": 2, "mix": {"code": 1.0}},
                       {"duration_s": 5, "arrival_rate": 20.0, "mix": {"chat": 0.5, "code": 0.5}}]}


def _with(obj, path, value):
    obj = copy.deepcopy(obj)
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    if value is _DEL:
        del cur[path[-1]]
    else:
        cur[path[-1]] = value
    return obj


_DEL = object()


def _sim(profile, workload, name, **kw):
    return simulate(profile, workload, make_policy(name, profile), **kw)


# ------------------------------------------------------------------------------ loading


@pytest.mark.parametrize("path, value, fragment", [
    (("schema",), "specctl.profile/2", "schema must be 'specctl.profile/1'"),
    (("configs",), {}, "'configs' must be a non-empty object"),
    (("configs", "s1", "steps"), "one", "configs.s1 needs integer 'steps'"),
    (("configs", "s1", "topk"), 0, "configs.s1 has steps < 0, topk < 1"),
    (("step_ms", "s3"), _DEL, "step_ms has no entry for config 's3'"),
    (("step_ms", "s3"), [[0, 5.0]], r"step_ms.s3 has point \[0.0, 5.0\]"),
    (("step_ms", "s3"), [[1, -5.0]], "ms > 0"),
    (("step_ms", "s3"), [[1, 5.0], [1, 6.0]], "step_ms.s3 repeats a batch size"),
    (("step_ms", "s3"), "fast", r"step_ms.s3 must be a list of \[batch_size, ms\] pairs"),
    (("step_ms", "s9"), [[1, 5.0]], r"step_ms names configs not in 'configs': \['s9'\]"),
    (("noise_cv",), 2.0, r"noise_cv must be a number in \[0, 1\)"),
])
def test_bad_profile_names_the_problem(path, value, fragment):
    with pytest.raises(SimFileError, match="p.json: .*" + fragment):
        parse_profile(_with(PROFILE, path, value), "p.json")


@pytest.mark.parametrize("path, value, fragment", [
    (("schema",), None, "schema must be 'specctl.workload/1'"),
    (("seed",), -1, "seed must be a non-negative integer"),
    (("classes",), [], "'classes' must be a non-empty object"),
    (("classes", "code", "accept", "s1"), [1.5], r"classes.code.accept.s1 must be a list of acceptance rates in \[0, 1\]"),
    (("classes", "code", "output_tokens"), [100, 50], r"classes.code.output_tokens must be \[min, max\]"),
    (("phases",), [], "'phases' must be a non-empty list"),
    (("phases", 0, "duration_s"), 0, r"phases\[0\].duration_s must be a positive number"),
    (("phases", 0, "arrival_rate"), 3.0, r"phases\[0\] needs exactly one of 'concurrency'"),
    (("phases", 1, "arrival_rate"), _DEL, r"phases\[1\] needs exactly one of"),
    (("phases", 0, "concurrency"), 2.5, r"phases\[0\].concurrency must be a non-negative integer"),
    (("phases", 0, "mix"), {"math": 1.0}, r"phases\[0\].mix names unknown class\(es\) \['math'\]"),
    (("phases", 0, "mix"), {"code": 0}, r"phases\[0\].mix weights sum to 0"),
    (("max_running",), 0, "max_running must be a positive integer"),
])
def test_bad_workload_names_the_problem(path, value, fragment):
    with pytest.raises(SimFileError, match="w.json: .*" + fragment):
        parse_workload(_with(WORKLOAD, path, value), "w.json")


def test_file_errors_are_user_errors(tmp_path):
    with pytest.raises(SimFileError, match="no such file, and no shipped profile of that name .*moe-1t"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "specctl.profile/1",\n "configs": }')
    with pytest.raises(SimFileError, match=r"bad.json: not valid JSON \(line 2, column 13"):
        load_profile(bad)


def test_every_shipped_file_loads_and_runs():
    profiles, workloads = shipped_names("profiles"), shipped_names("workloads")
    assert {"moe-1t-int4-tp8-pcie", "dense-8b-h200", "h200-smollm2-135m"} <= set(profiles)
    assert {"stationary-low", "stationary-high", "ramp", "burst", "code-chat-shift", "demo"} <= set(workloads)
    for w in workloads:
        load_workload(w)
    wl = replace(load_workload("code-chat-shift"),
                 phases=tuple(replace(p, duration_s=1.0) for p in load_workload("code-chat-shift").phases))
    for p in profiles:
        r = _sim(load_profile(p), wl, "oracle")
        assert r.output_tokens > 0


# ------------------------------------------------------------------------------ physics


def test_step_time_is_piecewise_linear_and_extrapolates():
    p = parse_profile(PROFILE)
    off = p.config_names.index("off")
    assert p.step_ms(off, 1) == 10.0 and p.step_ms(off, 64) == 12.0
    assert p.step_ms(off, 32) == pytest.approx(10.0 + 2.0 * 31 / 63)
    assert p.step_ms(off, 127) == pytest.approx(14.0)  # the last segment, continued
    assert p.step_ms(off, 5000) == pytest.approx(10.0 + 2.0 * 4999 / 63)


def test_closed_loop_plain_decode_is_exact():
    prof = parse_profile(PROFILE)
    wl = parse_workload(_with(WORKLOAD, ("phases",), [{"duration_s": 1.0, "concurrency": 4, "mix": {"code": 1}}]))
    r = _sim(prof, wl, "off")
    # 10 ms + (4-1)*2/63 ms per step, 4 tokens a step, no noise
    step = 10.0 + 3 * 2.0 / 63
    assert r.num_steps == int(np.ceil(1000.0 / step))
    assert r.output_tokens == 4 * r.num_steps
    assert set(r.trace_bs.tolist()) == {4}


@pytest.mark.parametrize("rates, config", [([1.0, 1.0, 1.0], "s3"), ([0.0, 1.0, 1.0], "s3"), ([0.8, 0.5, 0.5], "s3"),
                                           ([0.8], "s1")])
def test_acceptance_follows_the_chain_rule(rates, config):
    prof = parse_profile(PROFILE)
    cls = {"x": {"accept": {config: rates}, "output_tokens": [100000, 100000]}}
    wl = parse_workload({"schema": "specctl.workload/1", "seed": 1, "classes": cls,
                         "phases": [{"duration_s": 30, "concurrency": 16, "mix": {"x": 1}}]})
    r = _sim(prof, wl, f"static:{config}")
    tau = float(expected_tau(accept_matrix(prof, wl))[0, prof.config_names.index(config)])
    assert tau == pytest.approx(1 + np.cumprod(rates).sum())
    per_step = r.output_tokens / (16 * r.num_steps)
    assert per_step == pytest.approx(tau, rel=0.01)


def test_unlisted_configuration_accepts_nothing():
    prof = parse_profile(PROFILE)
    wl = parse_workload(_with(WORKLOAD, ("phases",), [{"duration_s": 2.0, "concurrency": 3, "mix": {"chat": 1}}]))
    r = _sim(prof, wl, "static:s3")  # chat lists no s3 acceptance
    assert r.output_tokens == 3 * r.num_steps


def test_open_loop_arrivals_and_queueing():
    prof = parse_profile(PROFILE)
    obj = {"schema": "specctl.workload/1", "seed": 5, "max_running": 8,
           "classes": {"x": {"accept": {}, "output_tokens": [10, 10]}},
           "phases": [{"duration_s": 60, "arrival_rate": 5.0, "mix": {"x": 1}}]}
    r = _sim(prof, parse_workload(obj), "off")
    assert 240 <= len(r.tpot_ms) <= 360  # ~300 Poisson arrivals of 10 tokens each
    assert r.trace_bs.max() <= 8
    fast = _sim(prof, parse_workload({**obj, "phases": [{"duration_s": 60, "arrival_rate": 50.0, "mix": {"x": 1}}]}), "off")
    assert fast.trace_bs.max() == 8  # overloaded: the running batch is capped, the rest queue


def test_phases_are_reported_separately():
    prof, wl = parse_profile(PROFILE), parse_workload(WORKLOAD)
    s = _sim(prof, wl, "static:s1").summary()
    assert [p["duration_s"] for p in s["phases"]] == [5.0, 5.0]
    assert s["phases"][0]["mean_batch"] == pytest.approx(2.0, abs=0.05)
    assert sum(p["output_tokens"] for p in s["phases"]) == s["output_tokens"]
    assert s["phases"][1]["config_share"] == {"s1": 1.0}


# ------------------------------------------------------------------------------ determinism


def test_seeded_runs_repeat_exactly_and_seeds_differ():
    prof, wl = load_profile("moe-1t-int4-tp8-pcie"), load_workload("burst")
    wl = replace(wl, phases=tuple(replace(p, duration_s=p.duration_s / 4) for p in wl.phases))
    a, b = _sim(prof, wl, "sglang-ema"), _sim(prof, wl, "sglang-ema")
    assert a.output_tokens == b.output_tokens and np.array_equal(a.trace_t, b.trace_t)
    assert np.array_equal(a.trace_cfg, b.trace_cfg)
    c = _sim(prof, wl, "sglang-ema", seed=99)
    assert c.output_tokens != a.output_tokens


@pytest.mark.parametrize("profile, workload", [
    ("moe-1t-int4-tp8-pcie", "code-chat-shift"),
    ("dense-8b-h200", "ramp"),
    ("dense-8b-h200", "burst"),
])
def test_oracle_bounds_every_policy(profile, workload, caplog):
    caplog.set_level(logging.ERROR)
    prof, wl = load_profile(profile), load_workload(workload)
    wl = replace(wl, phases=tuple(replace(p, duration_s=p.duration_s / 3) for p in wl.phases))
    oracle = _sim(prof, wl, "oracle").tokens_per_s
    names = ["off", "sglang-ema", "adaptive", "threshold:5:s3"] + [f"static:{n}" for n in prof.config_names if n != "off"]
    for n in names:
        r = _sim(prof, wl, n)
        assert r.tokens_per_s <= oracle * 1.002, (n, r.tokens_per_s, oracle)


def test_adaptive_runs_the_real_controller_and_engine(caplog):
    caplog.set_level(logging.ERROR)
    prof, wl = load_profile("dense-8b-h200"), load_workload("demo")
    pol = AdaptivePolicy(prof)
    r = simulate(prof, wl, pol)
    assert pol.service.status()["records_in"] == r.num_steps  # every step reached the service
    assert len(pol.versions) >= 2  # and the service published policies back to the engine
    assert pol.engine.stats.num_updates_applied >= 1


def test_a_warm_adaptive_serves_calibration_traffic_first_on_the_same_controller(caplog):
    """adaptive:warm_s=N: the engine and daemon first serve N s of a concurrency sweep (the workload's
    classes, an even mix, another seed), then the workload on a clock that continues from there."""
    from specctl.harness.simbench import calibration_workload

    caplog.set_level(logging.ERROR)
    prof, wl = load_profile("dense-8b-h200"), load_workload("ramp")
    cal = calibration_workload(wl, 60, seed=5)
    assert [p.concurrency for p in cal.phases] == [1, 2, 4, 8, 16, 32, 64, 96]
    assert abs(cal.duration_s - 60) < 1e-9 and cal.class_names == wl.class_names and cal.seed == 5
    wl = replace(wl, phases=wl.phases[:3])
    pol = make_policy("adaptive:warm_s=30", prof, wl)
    assert pol.warm_s == 30 and pol.offset_s >= 29.0
    before = pol.service.status()["records_in"]
    version_before = pol.engine.active_version
    assert before > 0 and version_before is not None  # a learned table is in force before the workload starts
    r = simulate(prof, wl, pol)
    assert pol.service.status()["records_in"] == before + r.num_steps
    assert r.trace_t[0] < 1.0  # the workload's own clock starts at 0; only the controller's continues
    with pytest.raises(ValueError, match="warm_s"):
        make_policy("adaptive:warm_s=abc", prof, wl)


def test_truth_policy_sees_the_batch_composition():
    prof, wl = parse_profile(PROFILE), parse_workload(WORKLOAD)
    seen = []

    class Spy:
        name, uses_truth = "spy", True

        def decide_with_truth(self, bs, tau):
            seen.append(tau.copy())
            return prof.configs[0]

        def observe(self, *a):
            pass

    simulate(prof, wl, Spy())
    code_only = seen[0]
    tau = expected_tau(accept_matrix(prof, wl))
    assert np.allclose(code_only, tau[0])  # phase 1 is all code
    assert any(not np.allclose(t, tau[0]) for t in seen)  # phase 2 mixes chat in


def test_sglang_ema_keeps_probing_in_the_simulator():
    # drafts never accepted, batch 16 (slot "8": [0, 1, 3]): SGLang's slot sits at 0 but probes
    # steps=1 for 5 of every 10 batches, forever (the documented 50 % probing)
    prof = parse_profile(PROFILE)
    cls = {"x": {"accept": {"s1": [0.0], "s3": [0.0, 0.0, 0.0]}, "output_tokens": [100000, 100000]}}
    wl = parse_workload({"schema": "specctl.workload/1", "seed": 1, "classes": cls,
                         "phases": [{"duration_s": 20, "concurrency": 16, "mix": {"x": 1}}]})
    r = _sim(prof, wl, "sglang-ema")
    share = r.phases[0].summary()["config_share"]
    assert share["s1"] == pytest.approx(0.5, abs=0.02) and share["off"] == pytest.approx(0.5, abs=0.02)
    assert _sim(prof, wl, "oracle").phases[0].summary()["config_share"] == {"off": 1.0}


# ------------------------------------------------------------------------------ context

CTX_PROFILE = _with(_with(PROFILE, ("ctx_tokens",), 500), ("ctx_step_ms",), [
    {"ctx_tokens": 4500, "step_ms": {"off": [[1, 10.4], [64, 20.0]], "s1": [[1, 12.8], [64, 36.0]],
                                     "s3": [[1, 16.6], [64, 72.0]]}}])
CTX_WORKLOAD = _with(_with(WORKLOAD, ("classes", "code", "ctx_tokens"), [1000, 1000]),
                     ("phases",), [{"duration_s": 1.0, "concurrency": 4, "mix": {"code": 1.0}}])


@pytest.mark.parametrize("path, value, fragment", [
    (("ctx_step_ms",), _DEL, "ctx_step_ms must be a non-empty list"),
    (("ctx_tokens",), -1, "ctx_tokens (the mean context per request"),
    (("ctx_step_ms", 0, "ctx_tokens"), 500, "repeats a context"),
    (("ctx_step_ms", 0, "step_ms", "s3"), _DEL, "must name every config"),
    (("ctx_step_ms", 0, "step_ms", "off"), [[1, -2.0]], "ctx_step_ms[0].step_ms.off has point"),
    (("ctx_step_ms", 0, "extra"), 1, "ctx_tokens and step_ms only"),
])
def test_a_bad_context_term_names_the_problem(path, value, fragment):
    with pytest.raises(SimFileError, match=re.escape(fragment)):
        parse_profile(_with(CTX_PROFILE, path, value), "p.json")


def test_a_bad_prompt_length_names_the_problem():
    with pytest.raises(SimFileError, match=re.escape("classes.code.ctx_tokens (prompt tokens) must be [min, max]")):
        parse_workload(_with(WORKLOAD, ("classes", "code", "ctx_tokens"), [10, 5]), "w.json")


def test_step_time_is_piecewise_linear_in_the_mean_context_too():
    p = parse_profile(CTX_PROFILE)
    assert p.has_ctx and not parse_profile(PROFILE).has_ctx
    off, s3 = p.config_names.index("off"), p.config_names.index("s3")
    assert p.step_ms_ctx(off, 1, 500) == pytest.approx(10.0) and p.step_ms_ctx(off, 1, 4500) == pytest.approx(10.4)
    assert p.step_ms_ctx(s3, 64, 2500) == pytest.approx(0.5 * (40.0 + 72.0))
    assert p.step_ms_ctx(s3, 64, 8500) == pytest.approx(40.0 + 2 * 32.0)  # the last segment, continued
    assert p.step_ms_ctx(off, 64, 0) == pytest.approx(12.0 - 8.0 / 8)  # and the first, below it
    np.testing.assert_array_equal(parse_profile(PROFILE).step_ms_all_ctx(32, 9000.0), parse_profile(PROFILE).step_ms_all(32))


def test_the_context_is_prompt_plus_generated_tokens_and_sets_the_step_time():
    prof = parse_profile(CTX_PROFILE)
    wl = parse_workload(CTX_WORKLOAD)
    seen = []

    class Recorder:
        name, uses_ctx = "rec", True

        def decide(self, batch_size, ctx_tokens=None):
            seen.append((batch_size, ctx_tokens))
            return (0, 1, 1)

        def observe(self, batch_size, config, accepted, step_ms, now_s, ctx_tokens=None):
            seen[-1] += (step_ms,)

    r = simulate(prof, wl, Recorder())
    assert r.num_steps == len(seen) > 10
    # 4 requests of 1000 prompt tokens, one token more each step (until one finishes and is replaced)
    assert seen[0][:2] == (4, 4000) and seen[1][:2] == (4, 4004) and seen[5][:2] == (4, 4020)
    off = prof.config_names.index("off")
    assert all(ms == prof.step_ms_ctx(off, bs, ctx / bs) for bs, ctx, ms in seen)
    # policies that do not read the context are driven as before
    assert _sim(prof, wl, "off").num_steps == r.num_steps


def test_the_oracle_decides_with_the_step_times_at_the_batch_context():
    prof = parse_profile(_with(CTX_PROFILE, ("noise_cv",), 0.0))
    short = parse_workload(_with(CTX_WORKLOAD, ("classes", "code", "ctx_tokens"), [100, 100]))
    long = parse_workload(_with(CTX_WORKLOAD, ("classes", "code", "ctx_tokens"), [20000, 20000]))
    s = _sim(prof, replace(short, phases=(replace(short.phases[0], concurrency=48),)), "oracle")
    lo = _sim(prof, replace(long, phases=(replace(long.phases[0], concurrency=48),)), "oracle")
    share = lambda r: r.phases[0].summary()["config_share"]  # noqa: E731
    assert share(s).get("s1", 0) > 0.9 and share(lo).get("off", 0) > 0.9


def test_a_shipped_pair_with_a_context_term_and_alternating_prompts_runs_the_context_axis(caplog):
    caplog.set_level(logging.ERROR)
    prof, wl = load_profile("dense-8b-h200-ctx"), load_workload("long-context-alternating")
    assert prof.has_ctx and wl.has_ctx
    pol = make_policy("adaptive", prof, wl)
    r = simulate(prof, wl, pol)
    t = pol.engine.table
    assert len(t.bands) >= 2 and r.tokens_per_s > 0
    # the long-context band stops speculating far below the short-context band
    from specctl.policies.table import PolicyTable
    short, long = (PolicyTable(rows=t.rows_for(m)).spec_off_crossover() for m in (400, 6000))
    assert long is not None and (short is None or short > 2 * long)


@pytest.mark.slow
def test_on_alternating_contexts_the_context_axis_beats_one_table(caplog):
    caplog.set_level(logging.ERROR)
    prof, wl = load_profile("dense-8b-h200-ctx"), load_workload("long-context-alternating")
    banded = simulate(prof, wl, make_policy("adaptive", prof, wl)).tokens_per_s
    flat = simulate(prof, wl, make_policy("adaptive:ctx_axis=false", prof, wl)).tokens_per_s
    assert banded >= 1.03 * flat, (banded, flat)  # 1.056 when written
