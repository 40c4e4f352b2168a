"""The decode state's GPU testbed helpers: +verify policies, the resync probe's window arithmetic, and
the record built from run_bench outputs (benchmarks/gpu/offpath_results.py)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import benchlib as B  # noqa: E402
import offpath_results as O  # noqa: E402


@pytest.mark.parametrize("pol, plain_off, skip, deg", [
    ("plugin-fixed:1:s3", False, False, None),  # the plugin's defaults: decode state on, own-width graphs on
    ("plugin-fixed:1:s3+verify", True, False, None),
    ("plugin-fixed:5:s3+skipde+verify", True, True, None),
    ("plugin-fixed:5:s3+verify+skipde", True, True, None),
    ("specctl+verify", True, False, None),
    ("plugin-fixed:1:s3+deg", False, False, "on"),
    ("plugin-fixed:1:s3+verify+deg", True, False, "on"),
    ("specctl+deg+verify", True, False, "on"),
    ("plugin-fixed:1:s3+nodeg", False, False, "off"),
    ("plugin-fixed:5:s3+nodeg+skipde", False, True, "off"),
    ("specctl", False, False, None),
])
def test_suffixes_set_the_plugin_servers_switches(pol, plain_off, skip, deg):
    """+verify: the decode state off; +skipde: no steps-0 draft extend; +deg / +nodeg: each state's
    draft-extend graph at its own width, explicitly on / off (no suffix: the plugin's default)."""
    _, env, _ = B.policy_launch_args(pol, "/d")
    patches = B.env_patches(env)
    assert (patches.get("plain_decode") == "off") is plain_off
    assert (env.get("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND") == "1") is skip
    assert patches.get("draft_graphs") == deg


@pytest.mark.parametrize("pol,setting", [("plugin-fixed:1000:s3+splitkv", "on"), ("specctl+splitkv+deg", "on"),
                                         ("plugin-fixed:1000:s3+stockverify", "off"), ("specctl+deg+stockverify", "off"),
                                         ("plugin-fixed:1000:s3", None)])
def test_splitkv_suffixes_set_the_kernel_switch(pol, setting):
    """+splitkv / +stockverify: SPECCTL_PATCHES splitkv=on / off (issue 20's accept-length and identity checks:
    the same plugin server with and without the kernel); without either the plugin's default (on) stands."""
    _, env, _ = B.policy_launch_args(pol, "/d")
    assert B.env_patches(env).get("splitkv") == setting


def test_splitkv_suffixes_cannot_both_be_given():
    with pytest.raises(ValueError, match="both ways"):
        B.parse_policy("plugin-fixed:1000:s3+splitkv+stockverify")


@pytest.mark.parametrize("pol", ["off+verify", "static:s3+verify", "threshold:5:s3+verify", "sglang-adaptive+verify",
                                 "threshold:5:s3+deg", "static:s1+deg", "sglang-adaptive+nodeg",
                                 "plugin-fixed:1:s3+deg+nodeg", "static:s3+splitkv", "threshold:5:s3+splitkv",
                                 "static:s3+stockverify"])
def test_verify_suffix_needs_the_plugin(pol):
    with pytest.raises(ValueError, match="plugin"):
        B.parse_policy(pol)


def test_log_accept_reads_the_lines_at_the_probes_positions():
    """The resync probe's window: Decode-batch lines at exactly 4 running requests holding >= N KV tokens."""
    import run_bench as RB
    line = "[x] Decode batch, #running-req: {n}, #token: {t}, token usage: 0.01, accept len: {a}, gen throughput (token/s): 9.0"
    text = "\n".join([line.format(n=4, t=900, a="1.20"), line.format(n=64, t=9000, a="1.00"),
                      line.format(n=4, t=1000, a="1.80"), "Prefill batch, #running-req: 4, #token: 5000",
                      line.format(n=4, t=1400, a="2.00"), line.format(n=5, t=1500, a="3.00")])
    assert RB.log_accept(text, 4, 1000) == (1.9, 2)
    assert RB.log_accept(text, 4, 0) == (pytest.approx(5.0 / 3, abs=1e-4), 3)
    assert RB.log_accept(text, 4, 2000) == (None, 0)
    assert RB.log_accept("[x] Decode batch, #running-req: 4, #token: 1200, gen throughput (token/s): 9.0", 4, 0) == (None, 0)


def test_whole_request_accept_reads_the_final_chunks():
    import run_bench as RB
    # the stream's chunks carry no verify count until the request finishes (SGLang 0.5.17)
    assert RB._whole_accept([[(8, None), (16, None), (24, 12)], [(8, None), (32, 16)]]) == pytest.approx(56 / 28)
    assert RB._whole_accept([[(8, None)]]) is None and RB._whole_accept([[]]) is None


def _row(pol, c, steps, tok_s=1000.0):
    return {"policy": pol, "concurrency": c, "output_tokens_per_s": tok_s, "median_tpot_ms": 5.0,
            "repeats_step_ms": steps, "log": {"step_ms_med": steps[0] if steps else None}}


def test_record_has_the_issue_fields_and_checks_the_targets():
    bench1 = {"gpu": "NVIDIA H200", "sglang": "0.5.17", "model": "m", "draft": "d", "identity_concurrency": 1,
              "runs": [_row("off", 1, [6.0, 6.2, 6.1]), _row(O.DECODE_STATE, 1, [6.3, 6.2, 6.4]),
                       _row(O.TRIVIAL, 1, [7.8, 7.9, 7.7]), _row("off", 64, [8.0, 8.1, 7.9]),
                       _row(O.DECODE_STATE, 64, [8.5, 8.4]), _row(O.TRIVIAL, 64, [12.6, 12.5, 12.7])],
              "phase_runs": [], "identity": {O.DECODE_STATE: {"identical": 16, "of": 16, "first_divergence": {}},
                                             "off": {"identical": 16, "of": 16, "first_divergence": {}}},
              "resync": {O.RESYNC: {"accept_before": 1.8, "accept_after": 1.79, "off_stretch_s": 35.0},
                         O.RESYNC_SKIP: {"accept_before": 1.81, "accept_after": 1.05}}}
    bench2 = {"runs": [_row("off", 8, [], 900.0), _row("static:s3", 8, [], 1100.0), _row("specctl", 8, [], 1090.0)],
              "phase_runs": [{"policy": p, "output_tokens_per_s": v, "median_tpot_ms": 7.0, "phases": []}
                             for p, v in (("specctl", 2000), ("off", 1900), ("threshold:5:s3", 1700),
                                          ("specctl", 2100), ("off", 1950), ("sglang-adaptive", 1600))]}
    rec = O.build([bench1, bench2], ["call C", "call D"])
    for k in ("gpu", "sglang", "attention_backend", "model", "step_costs", "sweep", "phase_runs", "identity", "resync"):
        assert k in rec
    sc = {r["concurrency"]: r for r in rec["step_costs"]}
    assert sc[1] == {"concurrency": 1, "no_spec_ms": 6.1, "off_state_ms": 6.3, "trivial_verify_ms": 7.8, "rounds": 3,
                     "off_state_vs_no_spec": round(6.3 / 6.1, 4), "trivial_verify_vs_no_spec": round(7.8 / 6.1, 4)}
    assert sc[64]["rounds"] == 2  # the fewest rounds any of the three servers ran
    assert "off_state_deg_ms" not in sc[1] and "off_state_deg_le_1.03x_no_spec" not in rec["targets"]
    bench1["runs"].append(_row(O.DECODE_STATE_DEG, 1, [6.2, 6.1, 6.3]))
    rec2 = O.build([bench1, bench2], ["call C", "call D"])
    sc2 = {r["concurrency"]: r for r in rec2["step_costs"]}
    assert sc2[1]["off_state_deg_ms"] == 6.2 and rec2["targets"]["off_state_deg_le_1.03x_no_spec"]["1"] == round(6.2 / 6.1, 4)
    assert O.DECODE_STATE_DEG not in {r["policy"] for r in rec2["sweep"]}
    assert {r["policy"] for r in rec["sweep"]} == {"no-spec", "static:s3", "specctl"}
    assert rec["identity"] == {"prompts": 16, "identical": 16, "first_divergence": {}, "concurrency": 1,
                               "tokens": None, "call": "call C"}
    assert rec["resync"]["accept_after_skip_control"] == 1.05 and rec["resync"]["accept_after"] == 1.79
    assert [r["run"] for r in rec["phase_runs"] if r["policy"] == "specctl"] == [1, 2]
    t = rec["targets"]
    assert t["sweep_specctl_vs_envelope_ge_0.98"] == {"8": round(1090 / 1100, 4)}
    assert t["sweep_envelope_of"] == {"8": ["no-spec", "static:s3"]}
    assert t["phase_specctl_over"]["no-spec"] == round(2050 / 1925, 4)
    assert t["identity"] == "16/16"


def test_targets_read_the_clean_windows_of_the_decode_state_with_and_without_the_catchup():
    rec = {"step_costs": [], "sweep": [], "phase_runs": [], "identity": None,
           "step_costs_clean": [{"logs": "g0", "concurrency": 1, "off": {"ms": 6.2, "windows": 500},
                                 O.DECODE_STATE: {"ms": 6.39, "windows": 400, "vs_no_spec": 1.0306},
                                 O.DECODE_STATE_CATCHUP: {"ms": 6.29, "windows": 400, "vs_no_spec": 1.0145},
                                 O.S3_SPLITKV: {"ms": 7.1, "windows": 90, "vs_stock": 0.84}}]}
    t = O.targets(rec)
    assert t["off_state_clean_windows"] == {"1": [1.0306]}
    assert t["off_state_catchup_clean_windows"] == {"1": [1.0145]}
    assert t["s3_splitkv_clean_windows"] == {"1": [0.84]}


def test_deg_suffix_is_the_shipped_plugin_in_phase_sweep_and_resync_rows():
    """+deg is the plugin's default since 2026-12-01: specctl+deg's phase runs are specctl's, the resync servers
    named with +deg are the resync servers; the step-cost columns keep +deg and +nodeg apart."""
    bench = {"runs": [_row("off", 1, [6.0]), _row(O.DECODE_STATE_DEG, 1, [6.2]), _row(O.DECODE_STATE_NODEG, 1, [6.9]),
                      _row("specctl+deg", 8, [], 1090.0), _row("static:s3", 8, [], 1100.0)],
             "phase_runs": [{"policy": "specctl+deg", "output_tokens_per_s": 2000, "phases": []},
                            {"policy": "off", "output_tokens_per_s": 1900, "phases": []}],
             "resync": {O.RESYNC + "+deg": {"accept_after": 1.8}, O.RESYNC + "+deg+skipde": {"accept_after": 1.1}}}
    rec = O.build([bench], [])
    assert [r["policy"] for r in rec["phase_runs"]] == ["specctl", "no-spec"]
    assert rec["targets"]["phase_specctl_over"] == {"no-spec": round(2000 / 1900, 4)}
    assert {r["policy"] for r in rec["sweep"]} == {"no-spec", "specctl", "static:s3"}
    assert rec["resync"]["accept_after"] == 1.8 and rec["resync"]["accept_after_skip_control"] == 1.1
    sc = rec["step_costs"][0]
    assert sc["off_state_deg_ms"] == 6.2 and sc["off_state_nodeg_ms"] == 6.9


def test_plugin_threshold_servers_are_named_as_the_threshold_they_run():
    assert O.issue_name("plugin-fixed:5:s3") == "threshold:5:s3"
    assert O.issue_name("off") == "no-spec" and O.issue_name("static:s2") == "static:s2"


@pytest.mark.slow
def test_call_d_runs_end_to_end_against_the_stand_in_and_makes_the_record(tmp_path, bench_prompts, port0):
    """the testbed's decode-state call (docs/testbed.md) on the stand-in server (benchmarks/gpu/mock): the no-spec server,
    the decode state, the trivial verify and the two resync servers; the resync servers are probed and
    retired, never swept; then offpath_results.py makes the record from its output."""
    import json
    import subprocess

    pytest.importorskip("aiohttp")
    gpu = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu")
    out = tmp_path / "rb"
    env = dict(os.environ, PYTHONPATH=os.path.join(gpu, "mock") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pols = [O.NO_SPEC_POLICY, O.DECODE_STATE, O.TRIVIAL, O.RESYNC, O.RESYNC_SKIP]
    cmd = [sys.executable, os.path.join(gpu, "run_bench.py"), "--model", str(tmp_path), "--variant", "mock",
           "--draft", "/d", "--policies", ",".join(pols), "--levels", "1,4", "--new-tokens", "400",
           "--req-per-level", "max(2*c,4)", "--interleave", "--repeats", "2", "--identity-c", "1",
           "--identity-tokens", "24", "--resync", f"{O.RESYNC},{O.RESYNC_SKIP}", "--resync-off-s", "0.5",
           "--resync-probe-tokens", "8000", "--profile", f"{O.DECODE_STATE}@4,{O.NO_SPEC_POLICY}@4:churn,{O.DECODE_STATE}@4:stack", "--profile-steps", "6",
           "--parallel", "5", "--deadline-s", "300", "--out", str(out), "--prompts", bench_prompts,
           "--tokenizer", "simple", "--specctl-site", str(tmp_path / "site"), "--port0", port0, "--request-stats"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bench = json.load(open(out / "bench-mock.json"))
    assert set(bench["resync"]) == {O.RESYNC, O.RESYNC_SKIP}
    for probe in bench["resync"].values():
        assert probe["fillers"] > 0 and probe["filler_errors"] == 0 and probe["probe_c"] == 4
        assert probe["invalid"] is None and probe["lines_before"] > 0 and probe["lines_after"] > 0
        assert probe["accept_before"] == probe["accept_after"] == 2.5  # the stand-in's s3 accept length
        # the same-text reference: each probe's prompt + its run's tokens before the tail, prefilled afresh, at c = 4
        assert probe["accept_same_text"] == 2.5 and probe["lines_same_text"] > 0
        assert probe["same_text_cache_flushed"] is True and len(probe["same_text_tokens"]) == 4
        assert 0 < max(probe["tail_from_tokens"]) < 8000 - 200
    assert set(bench["identity_ids"]) == set(pols)
    # every server warmed at the call's largest batch (here the resync probe's 4 + 60) before anything is measured
    assert all(bench["servers"][p]["warmup_burst"]["concurrency"] == 64 for p in pols)
    assert all(bench["servers"][p]["warmup_burst"]["s"] > 0 for p in pols)
    # the no-spec server's margins, from a pass of their own whose ids are those of the plain pass
    assert len(bench["identity_margins"]) == 16 and bench["identity_margins_ids_same"] == 16
    assert all(len(m) == 24 and all(x is not None and x > 0 for x in m) for m in bench["identity_margins"].values())
    assert "median_margin" in bench["identity"][O.DECODE_STATE]
    # every server's identity prompts prefilled afresh (the warm-up's KV flushed from the radix cache), at
    # --identity-c 1 each prompt after a flush of its own (an EAGLE server reuses one token less of a cached prefix)
    assert all(bench["servers"][p]["identity_cache_flushed"] is True for p in pols)
    flushes = {p: open(out / f"mock-{p.replace(':', '_')}.log").read().count("Cache flushed successfully!") for p in pols}
    assert flushes[O.NO_SPEC_POLICY] >= 16 + 16 + 1 and flushes[O.DECODE_STATE] >= 16 + 1, flushes  # + the prefill probe
    # every server's finished requests, from their ReqTimeStats lines
    for p in pols:
        rs = bench["servers"][p]["request_stats"]
        assert rs["requests"] > 16 and rs["queue_ms_median"] == 0.5 and rs["arrival_groups"] >= 1
    assert all("--enable-request-time-stats-logging" in bench["servers"][p]["cmd"] for p in pols)
    # the prefill probe: the stand-in's speculative prefills part from the plain one's at prompt position 2 of
    # every other prompt (log p of the third token, the second the list holds)
    pre = bench["prefill_identity"]
    assert set(pre) == set(pols) - {O.NO_SPEC_POLICY}
    for rep in pre.values():
        assert rep["prompts"] == 16 and 0 < rep["identical"] < 16 and rep["max_abs_diff"] > 0
        assert set(rep["first_differing_position"].values()) == {2} and rep["first_token_same"] == 16
    assert all(bench["servers"][p]["prefill_cache_flushed"] is True for p in pols)
    assert all("prompt_lp" not in x for per in bench["prefill_lp"].values() for x in per.values())
    prof = bench["profiles"][f"{O.DECODE_STATE}@4"]  # the stand-in's trace: 6 steps, one 6 ms kernel each
    assert prof["steps"] == 5 and prof["median"]["gpu_busy_ms"] == 6.0 and prof["median"]["graph_launches"] == 1
    churn = bench["profiles"][f"{O.NO_SPEC_POLICY}@4:churn"]  # requests ending and arriving: the same reduction
    assert churn["steps"] == 5 and churn["prefill_windows"]["n"] == 0
    assert os.path.exists(out / "prof-off-churn-c4.json")
    assert "python_self_ms_per_step" not in prof  # asked without stacks: no Python tracer
    stack = bench["profiles"][f"{O.DECODE_STATE}@4:stack"]  # the stand-in's Python calls: 3 ms holding 1 ms a step
    assert stack["steps"] == 5 and stack["python_calls_per_step"] == 2.0
    assert stack["python_self_ms_per_step"] == {"scheduler.py(1): run_batch": 2.0, "worker.py(2): verify": 1.0}
    assert not [p for p in os.listdir(out) if p.startswith("trace-")]  # the raw trace is not kept
    swept = {row["policy"] for row in bench["runs"]}
    assert swept == {O.NO_SPEC_POLICY, O.DECODE_STATE, O.TRIVIAL}  # the probed servers were retired, not swept
    assert all(len(row["repeats_tok_s"]) == 2 for row in bench["runs"])
    rec = O.build([bench], ["call D (stand-in)"])
    assert [row["concurrency"] for row in rec["step_costs"]] == [1, 4]
    assert all(row["rounds"] == 2 and row["no_spec_ms"] and row["off_state_ms"] for row in rec["step_costs"])
    assert rec["identity"]["prompts"] == 16 and rec["resync"]["details"].keys() == bench["resync"].keys()
    assert rec["targets"]["resync_tail_vs_same_text"] == 1.0  # the stand-in's accept length is the same everywhere
    assert rec["targets"]["resync_control_tail_vs_same_text"] == 1.0
    assert [x["call"] for x in rec["request_stats"]] == ["call D (stand-in)"]
    assert set(rec["request_stats"][0]["servers"]) == {O.issue_name(p) for p in pols}


def test_phase_summary_splits_a_run_by_the_phase_each_request_was_sent_in():
    phases = [{"duration_s": 10.0, "concurrency": 2}, {"duration_s": 5.0, "concurrency": 64}]
    t0 = 1000.0
    req = lambda k, end, tok, lat=1.0, ttft=0.1: {"phase": k, "t_end": t0 + end, "tokens": tok, "latency": lat,  # noqa: E731
                                                  "ttft": ttft}
    outs = [req(0, 4.0, 101), req(0, 9.0, 11, lat=2.1), req(1, 12.0, 51), req(1, 17.0, 21),  # the last ends in the drain
            {"phase": 1, "error": "x", "t_end": t0 + 13}]
    rows = B.phase_summary(outs, phases, t0)
    assert [r["requests"] for r in rows] == [2, 2] and [r["errors"] for r in rows] == [0, 1]
    # whole requests by where they end (the last window runs to the last request)
    assert rows[0]["finished_tokens_per_s"] == pytest.approx(112 / 10.0)
    assert rows[1]["finished_tokens_per_s"] == pytest.approx(72 / 7.0, abs=0.05)
    # tokens by when they were made: each request's spread from its first token (end - latency + ttft) to its end;
    # the 21-token request runs 16.1..17 s, after phase 1's window (10..15 s): the drain belongs to no phase
    assert rows[0]["output_tokens_per_s"] == pytest.approx((101 + 11) / 10.0)
    assert rows[1]["output_tokens_per_s"] == pytest.approx(51 / 5.0)
    assert rows[0]["median_tpot_ms"] == pytest.approx((9.0 + 200.0) / 2)  # (0.9 s / 100, 2.0 s / 10) in ms
    assert [r["concurrency"] for r in rows] == [2, 64]


def test_phase_throughput_credits_each_phase_with_the_tokens_made_in_it():
    """A request sent late in one phase and ending in the next adds its tokens to both, by time."""
    phases = [{"duration_s": 4.0, "concurrency": 128}, {"duration_s": 4.0, "concurrency": 1}]
    t0 = 0.0
    outs = [{"phase": 0, "t_end": 5.0, "latency": 4.0, "ttft": 1.0, "tokens": 100},  # tokens made 2..5 s
            {"phase": 1, "t_end": 7.0, "latency": 2.0, "ttft": 0.0, "tokens": 40},  # 5..7 s
            {"phase": 1, "t_end": 6.0, "latency": 1.0, "ttft": 1.0, "tokens": 1}]  # one token at 6 s
    rows = B.phase_summary(outs, phases, t0)
    assert rows[0]["output_tokens_per_s"] == pytest.approx(100 * 2 / 3 / 4.0, abs=0.05)
    assert rows[1]["output_tokens_per_s"] == pytest.approx((100 / 3 + 40 + 1) / 4.0, abs=0.05)
    assert rows[0]["finished_tokens_per_s"] == 0.0 and rows[1]["finished_tokens_per_s"] == pytest.approx(141 / 4.0, abs=0.05)


def test_phase_targets_compare_specctl_phase_by_phase():
    def run(pol, tok, tpot):
        return {"policy": pol, "per_phase": [{"phase": k, "concurrency": c, "output_tokens_per_s": t, "median_tpot_ms": m}
                                             for k, (c, t, m) in enumerate(zip((2, 64), tok, tpot))]}
    runs = [run("specctl", (100, 500), (8.0, 20)), run("specctl", (110, 480), (9.0, 21)),
            run("no-spec", (90, 520), (10.0, 19)), run("threshold:5:s3", (120, 400), (7.0, 25))]
    t = O.phase_targets(runs)
    assert t["phase_each_vs_best_ge_0.97"] == {"0": round(105 / 120, 4), "1": round(490 / 520, 4)}
    assert t["phase_low_c_tpot_vs_no_spec_le_0.90"] == {"0": 0.85}  # only the c <= 8 phase
    assert O.phase_targets([run("no-spec", (1, 1), (1, 1))]) == {}


def test_a_sweeps_no_spec_round_stays_out_of_another_calls_step_costs():
    """2026-12-02: D1 (3 rounds of off beside the decode state) and F (a sweep, one round of off beside specctl and
    the statics) in one record: the step costs are D1's rounds alone, the sweep's envelope F's runs alone."""
    d1 = {"runs": [_row("off", 1, [6.1, 6.2, 6.15]), _row(O.DECODE_STATE, 1, [6.5, 6.6, 6.55])]}
    f = {"runs": [_row("off", 1, [9.0], 150.0), _row("specctl", 1, [], 180.0), _row("static:s3", 1, [], 178.0)]}
    rec = O.build([d1, f], ["D1", "F"])
    sc = rec["step_costs"][0]
    assert sc["no_spec_ms"] == 6.15 and sc["rounds"] == 3 and sc["off_state_ms"] == 6.55
    assert sorted((r["policy"], r["output_tokens_per_s"]) for r in rec["sweep"]) == [
        ("no-spec", 150.0), ("specctl", 180.0), ("static:s3", 178.0)]
    assert rec["targets"]["sweep_specctl_vs_envelope_ge_0.98"] == {"1": round(180 / 178, 4)}


def test_a_sweep_call_with_its_logs_gets_clean_step_rows_at_its_concurrencies(tmp_path):
    """A call of specctl and no-spec alone (no decode state, no kernel A/B): the no-spec server's clean windows at
    the sweep's c are in the record; the envelope says which servers it was taken over."""
    line = "Decode batch, #running-req: 4, gen throughput (token/s): {tp}\n"
    (tmp_path / "moe-off.log").write_text("".join(line.format(tp=round(4000 / 9.6, 3)) for _ in range(4)))
    f = {"runs": [_row("off", 4, [], 260.0), _row("specctl", 4, [], 290.0)]}
    rec = O.build([f], ["F"], [str(tmp_path)])
    assert rec["step_costs"] == [] and rec["step_costs_clean"][0]["concurrency"] == 4
    assert rec["step_costs_clean"][0]["off"] == {"ms": 9.6, "windows": 3}  # the first window of a log is not clean
    assert rec["targets"]["sweep_envelope_of"] == {"4": ["no-spec"]}


def test_a_sweep_split_over_calls_pairs_each_competitor_with_the_specctl_of_its_own_call():
    """2026-12-06 on an H100 (two 8B servers at once): F'3 ran specctl beside no-spec and s3, F'4 beside s1 and
    s2, and the two calls' specctl differ by more than the 0.98 bound; each call's ratio is its own, the target the
    lower of them per concurrency."""
    f3 = {"runs": [_row("specctl", 1, [], 200.0), _row("off", 1, [], 150.0), _row("static:s3", 1, [], 190.0),
                   _row("specctl", 64, [], 1000.0), _row("off", 64, [], 1010.0), _row("static:s3", 64, [], 800.0)]}
    f4 = {"runs": [_row("specctl", 1, [], 180.0), _row("static:s1", 1, [], 170.0), _row("static:s2", 1, [], 185.0),
                   _row("specctl", 64, [], 1100.0), _row("static:s1", 64, [], 1000.0), _row("static:s2", 64, [], 900.0)]}
    rec = O.build([f3, f4], ["F'3", "F'4"])
    assert {r["call"] for r in rec["sweep"]} == {1, 2}
    paired = rec["targets"]["sweep_specctl_vs_envelope_ge_0.98_paired"]
    assert paired["1"] == {"ratio": round(180 / 185, 4), "call": 2, "against": "static:s2",
                           "rivals": ["no-spec", "static:s1", "static:s2", "static:s3"]}
    assert paired["64"]["ratio"] == round(1000 / 1010, 4) and paired["64"]["against"] == "no-spec"
    assert O.build([f3], ["F'3"])["targets"].get("sweep_specctl_vs_envelope_ge_0.98_paired") is None


def test_request_stats_reads_sglangs_lines_and_groups_arrivals():
    """SGLang 0.5.17's Req.log_time_stats format (unified mode): queue times and how arrivals cluster (entries
    less than 1 ms apart form one group)."""
    line = ("[2026-12-02 01:31:18] ReqTimeStats(rid=abc, input_len={n}, cached_input_len={c}, output_len=128, "
            "attempts=1, type=unified): queue_duration={q}ms, forward_duration=900.10ms, entry_time={t}")
    text = "\n".join([line.format(n=100, c=90, q="2.00", t="1796168643.100"),
                      line.format(n=100, c=90, q="4.00", t="1796168643.1004"),
                      line.format(n=200, c=0, q="80.00", t="1796168643.200"),
                      "[x] Decode batch, #running-req: 3, #token: 400"])
    rs = B.request_stats(text)
    assert rs["requests"] == 3 and rs["arrival_groups"] == 2 and rs["requests_per_group"] == 1.5
    assert rs["queue_ms_median"] == 4.0 and rs["queue_ms_p90"] == 80.0
    assert rs["cached_input_frac"] == round(180 / 400, 4)
    assert B.request_stats("no such lines") is None


def test_logit_report_finds_where_the_top2_first_differs():
    """The +lp decode state's top-2 per position against the no-spec server's: the first position that differs
    at all, and whether it comes before the tokens part (identity_report's first_divergence)."""
    ref = {"a": [[-0.1, 5, -2.0, 7]] * 4, "b": [[-0.1, 5, -2.0, 7]] * 4, "c": [[-0.5, 1, -0.5, 2]] * 3}
    mine = {"a": [[-0.1, 5, -2.0, 7]] * 4,                                        # the same everywhere
            "b": [[-0.1, 5, -2.0, 7], [-0.1, 5, -2.0, 7], [-0.1, 5, -2.125, 7], [-0.1, 5, -2.0, 7]],  # from 2
            "c": [[-0.5, 1, -0.5, 2], [-0.5, 2, -0.5, 1], [-0.5, 2, -0.5, 1]]}    # a tie resolved the other way
    ident = {"plugin-fixed:1:s3+lp": {"first_divergence": {"c": 1}}}
    rep = B.logit_report({"off": ref, "plugin-fixed:1:s3+lp": mine}, identity=ident)["plugin-fixed:1:s3+lp"]
    assert rep["prompts"] == 3 and rep["agree_everywhere"] == 1
    assert rep["first_logit_difference"] == {"b": 2, "c": 1}
    assert rep["logits_part_before_tokens"] == 1  # b's logits differ while its tokens never part
    assert rep["first_margin_difference"] == {"b": 2, "c": 1}
    shifted = {"a": [[x[0] - 0.01, x[1], x[2] - 0.01, x[3]] for x in ref["a"]]}  # the same logits, renormalised
    rep2 = B.logit_report({"off": {"a": ref["a"]}, "lp": shifted})["lp"]
    assert rep2["first_logit_difference"] == {"a": 0} and rep2["first_margin_difference"] == {}


@pytest.mark.parametrize("pol,on", [("plugin-fixed:1:s3+lp", True), ("plugin-fixed:1:s3+lp+deg", True),
                                    ("plugin-fixed:1:s3", False)])
def test_lp_suffix_lets_logprob_steps_into_the_decode_state(pol, on):
    _, env, _ = B.policy_launch_args(pol, "/d")
    assert (B.env_patches(env).get("plain_logprobs") == "on") is on
    assert bool(B.parse_policy(pol).get("plain_decode_logprobs")) is on


def test_lp_suffix_needs_the_plugin():
    with pytest.raises(ValueError, match="plugin"):
        B.parse_policy("static:s3+lp")


def test_the_lp_decode_state_counts_as_the_decode_state_in_step_costs():
    """Call S: plugin-fixed:1:s3+lp beside the no-spec server and the s3 servers: its steps (the loads ask for no
    log-probabilities) are the decode state's column; the s3 servers are the split-KV rows, not the sweep's."""
    b = {"runs": [_row("off", 1, [6.1, 6.2, 6.15]), _row(O.DECODE_STATE + "+lp", 1, [6.4, 6.5, 6.45]),
                  _row("plugin-fixed:1000:s3", 1, [8.0], 170.0), _row(O.S3_SPLITKV, 1, [6.9], 190.0)]}
    rec = O.build([b], ["S"])
    sc = rec["step_costs"][0]
    assert sc["off_state_ms"] == 6.45 and sc["no_spec_ms"] == 6.15 and sc["rounds"] == 3
    assert rec["sweep"] == [] and rec["splitkv"][0]["stock_ms"] == 8.0 and rec["splitkv"][0]["splitkv_ms"] == 6.9


def test_the_plugins_s3_without_its_kernel_control_is_a_sweep_row():
    """2026-12-07 (the MoE target): plugin-fixed:1000:s1 and plugin-fixed:1000:s3 with the plugin's default kernel,
    no +splitkv beside them: sweep rows, not the stock side of a split-KV A/B (which it was until 2026-12-02)."""
    b = {"runs": [_row("plugin-fixed:1000:s1", 1, [10.0], 102.2), _row("plugin-fixed:1000:s3", 1, [10.9], 109.3)]}
    rec = O.build([b], ["S"])
    assert "splitkv" not in rec
    assert sorted((r["policy"], r["output_tokens_per_s"]) for r in rec["sweep"]) == [
        ("plugin-fixed:1000:s1", 102.2), ("plugin-fixed:1000:s3", 109.3)]


def _ident(identical, c):
    return {"identity_concurrency": c, "identity": {"off": {"identical": 16, "of": 16, "first_divergence": {}},
                                                    O.DECODE_STATE + "+lp": {"identical": identical, "of": 16,
                                                                             "first_divergence": {"x": 2}}},
            "identity_ids": {"off": {"x": list(range(128 if c == 1 else 64))}}, "runs": []}


def test_the_identity_figure_is_the_batch_1_run_and_every_run_is_kept():
    """2026-12-02, second lease: the decode state 4/16 at c = 1 x 128 tokens, 16/16 at c = 16 x 64 (a later call):
    the issue's figure is the batch-1 run; the other stays beside it."""
    rec = O.build([_ident(4, 1), _ident(16, 16)], ["S", "C64"])
    assert (rec["identity"]["identical"], rec["identity"]["concurrency"], rec["identity"]["tokens"]) == (4, 1, 128)
    assert [(e["concurrency"], e["identical"], e["call"]) for e in rec["identity_runs"]] == [(1, 4, "S"), (16, 16, "C64")]
    assert rec["targets"]["identity"] == "4/16"


def test_splitkv_rows_compare_s3_with_and_without_the_kernel():
    b = {"runs": [_row(O.S3_STOCK, 1, [8.4, 8.5, 8.45]), _row(O.S3_SPLITKV, 1, [7.1, 7.2, 7.0]),
                  _row(O.S3_STOCK_NOW, 16, [9.9, 9.8]), _row(O.S3_SPLITKV, 16, [8.5, 8.4])]}
    rec = O.build([b], ["S"])
    rows = {r["concurrency"]: r for r in rec["splitkv"]}
    assert rows[1] == {"concurrency": 1, "stock_ms": 8.45, "splitkv_ms": 7.1, "rounds": 3,
                       "splitkv_vs_stock": round(7.1 / 8.45, 4)}
    assert rows[16]["splitkv_vs_stock"] == round(8.45 / 9.85, 4)  # +stockverify is the stock kernel now
    assert rec["targets"]["s3_splitkv_le_0.87x_stock"] == {"1": round(7.1 / 8.45, 4), "16": round(8.45 / 9.85, 4)}
    assert all(r["policy"] not in (O.S3_STOCK, O.S3_SPLITKV) for r in rec["step_costs"] if "policy" in r)


def test_rounds_use_the_clean_windows_where_every_round_has_them():
    row = _row("off", 64, [9.5, 9.9, 9.7])
    assert O._round_steps(row) == [9.5, 9.9, 9.7]
    row["repeats_clean_step_ms"] = [7.9, 8.0, 8.1]
    assert O._round_steps(row) == [7.9, 8.0, 8.1]
    row["repeats_clean_step_ms"] = [7.9, None, 8.1]  # a round without a clean window: all windows, every round
    assert O._round_steps(row) == [9.5, 9.9, 9.7]


def test_clean_step_costs_read_the_server_logs_of_a_call(tmp_path):
    """--logs DIR: each server log's windows at exactly c requests without a prefill, pooled; the decode state
    against the no-spec server of the same call, the split-KV s3 against the stock one."""
    d = "Decode batch, #running-req: {c}, gen throughput (token/s): {tp}\n"
    p = "Prefill batch, #new-seq: 1, #running-req: 63\n"

    def log(step_ms, c, n, with_prefills=True):
        body = d.format(c=c, tp=1.0)
        for _ in range(n):
            body += d.format(c=c, tp=round(1000 * c / step_ms, 3)) + (p + d.format(c=c, tp=1.0) if with_prefills else "")
        return body
    (tmp_path / "8b-off.log").write_text(log(8.0, 64, 4))
    (tmp_path / "8b-plugin-fixed_1_s3+lp.log").write_text(log(8.2, 64, 4))
    (tmp_path / "8b-plugin-fixed_1000_s3.log").write_text(log(10.0, 16, 5, False))
    (tmp_path / "8b-plugin-fixed_1000_s3+splitkv.log").write_text(log(8.5, 16, 5, False))
    (tmp_path / "8b-static_s3.log").write_text(log(16.0, 64, 2))  # 2 clean windows: below the floor
    (tmp_path / "run.log").write_text("not a server log")
    assert O.log_policy("8b-plugin-fixed_1_s3+lp.log") == "plugin-fixed:1:s3+lp"
    rows = {r["concurrency"]: r for r in O.clean_step_costs([str(tmp_path)], [16, 64])}
    assert rows[64]["off"] == {"ms": 8.0, "windows": 4}
    assert rows[64][O.DECODE_STATE + "+lp"]["vs_no_spec"] == round(8.2 / 8.0, 4)
    assert "static:s3" not in rows[64]
    assert rows[16][O.S3_SPLITKV]["vs_stock"] == 0.85
    # a specctl server's windows mix the states of its table (the learning pass too): no pooled row for it
    (tmp_path / "moe-specctl.log").write_text(log(9.0, 64, 5, False))
    rows = {r["concurrency"]: r for r in O.clean_step_costs([str(tmp_path)], [16, 64])}
    assert "specctl" not in rows[64] and rows[64]["off"]["ms"] == 8.0


@pytest.mark.parametrize("pol,flags", [("off+eager", ["--disable-cuda-graph"]),
                                       ("plugin-fixed:1:s3+nooverlap", ["--disable-overlap-schedule"]),
                                       ("plugin-fixed:1:s3+lp+eager+nooverlap",
                                        ["--disable-overlap-schedule", "--disable-cuda-graph"]),
                                       ("static:s3+eager", ["--disable-cuda-graph"]), ("off", [])])
def test_server_flag_suffixes_reach_the_servers_command_line(pol, flags):
    """The identity probe's controls (2026-12-02: the decode state is bit-identical to the no-spec server at batch 16,
    not at 1): the same server without CUDA graphs, or without the overlap scheduler."""
    args, env, _ = B.policy_launch_args(pol, "/d")
    assert [a for a in args if a in ("--disable-cuda-graph", "--disable-overlap-schedule")] == flags
    base = B.parse_policy(pol.split("+")[0])
    assert B.parse_policy(pol)["kind"] == base["kind"]


@pytest.mark.parametrize("pol, want, without, not_plugin", [
    # +fi: the decode state on flashinfer; +hostlens: its host lengths checked beside it
    ("plugin-fixed:1:s3+fi", {"plain_flashinfer": "on"}, "plugin-fixed:1:s3", "static:s3+fi"),
    ("plugin-fixed:1:s3+fi+hostlens", {"host_lens": "check", "plain_flashinfer": "on"},
     "plugin-fixed:1:s3+fi", "off+hostlens"),
    # +fa3plain: the decode state on fa3 (off by default: SGLang's steps 0 there)
    ("plugin-fixed:1:s3+fa3plain", {"plain_fa3": "on"}, "plugin-fixed:1:s3", "static:s3+fa3plain"),
    # +catchup / +catchup4: the draft catch-up with its default window (16) or a window of 4
    ("plugin-fixed:1:s3+catchup", {"catchup": "on"}, "plugin-fixed:1:s3", "static:s3+catchup"),
    ("plugin-fixed:1:s3+catchup4", {"catchup": "4"}, "plugin-fixed:1:s3", "threshold:5:s3+catchup4"),
])
def test_a_flashinfer_suffix_sets_its_switch_and_needs_a_plugin(pol, want, without, not_plugin):
    _, env, _ = B.policy_launch_args(pol, "/d")
    assert {k: B.env_patches(env).get(k) for k in want} == want
    switch = next(iter(want))  # the suffix's own: absent from the policy without it
    assert switch not in B.env_patches(B.policy_launch_args(without, "/d")[1])
    with pytest.raises(ValueError, match="plugin"):
        B.parse_policy(not_plugin)


def test_the_controls_of_the_flashinfer_defaults_turn_them_off_and_refuse_their_opposites():
    _, env, _ = B.policy_launch_args("plugin-fixed:1:s3+nofi+nohostlens", "/d")
    assert B.env_patches(env) == {"plain_flashinfer": "off", "host_lens": "off"}
    for pol in ("plugin-fixed:1:s3+fi+nofi", "plugin-fixed:1:s3+nohostlens+hostlens", "plugin-fixed:1:s3+catchup+catchup4"):
        with pytest.raises(ValueError, match="both ways"):
            B.parse_policy(pol)


@pytest.mark.parametrize("pol, name", [
    ("plugin-fixed:1:s3+fi", "plugin-fixed:1:s3"), ("plugin-fixed:1:s3+fi+hostlens", "plugin-fixed:1:s3"),
    ("plugin-fixed:1:s3+lp", "plugin-fixed:1:s3"), ("plugin-fixed:1000:s3+fihost", "plugin-fixed:1000:s3+fihost"),
    ("plugin-fixed:1:s3+verify", "plugin-fixed:1:s3+verify"), ("off", "off"),
])
def test_step_cost_columns_fold_the_switches_that_leave_the_decode_states_forward_alone(pol, name):
    assert O.step_name(pol) == name


def test_a_call_whose_policies_share_a_step_cost_column_is_refused(tmp_path):
    assert O.folded_twice(["off", "plugin-fixed:1:s3+fi", "plugin-fixed:1:s3+fi+hostlens"]) == {
        "plugin-fixed:1:s3": ["plugin-fixed:1:s3+fi", "plugin-fixed:1:s3+fi+hostlens"]}
    assert O.folded_twice(["off", "plugin-fixed:1:s3+fi+hostlens", "plugin-fixed:1000:s3+fihost"]) == {}
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"runs": [{"policy": p, "concurrency": 1, "step_ms_rounds": [9.0]}
                                          for p in ("off", "plugin-fixed:1:s3+fi", "plugin-fixed:1:s3+fi+hostlens")]}))
    sys_argv = sys.argv
    try:
        sys.argv = ["offpath_results.py", str(tmp_path / "out.json"), str(bench)]
        with pytest.raises(SystemExit, match="share a step-cost column"):
            O.main()
    finally:
        sys.argv = sys_argv


def test_a_rebuilt_record_keeps_its_notes_and_leaves_no_temporary_file(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"runs": [{"policy": p, "concurrency": 1, "step_ms_rounds": [ms]}
                                          for p, ms in (("off", 9.0), ("plugin-fixed:1:s3", 9.2))]}))
    out = tmp_path / "out.json"
    out.write_text(json.dumps({"notes": ["what the call showed"], "step_costs": "stale"}))
    sys_argv = sys.argv
    try:
        sys.argv = ["offpath_results.py", str(out), str(bench)]
        O.main()
    finally:
        sys.argv = sys_argv
    rec = json.loads(out.read_text())
    assert rec["notes"] == ["what the call showed"] and rec["step_costs"] != "stale"
    assert [row["concurrency"] for row in rec["step_costs"]] == [1]
    assert sorted(os.listdir(tmp_path)) == ["bench.json", "out.json"]


def test_spread_tokens_is_a_fixed_sequence_around_the_cap():
    assert [B.spread_tokens(128, 0, k) for k in range(5)] == [128] * 5
    seq = [B.spread_tokens(128, 32, k) for k in range(400)]
    assert seq == [B.spread_tokens(128, 32, k) for k in range(400)]  # the same for every server
    assert min(seq) >= 96 and max(seq) <= 160 and len(set(seq)) > 40
    assert B.spread_tokens(4, 10, 3) >= 1


def test_request_stats_count_finish_steps_and_lockstep_cohorts():
    """Two receive passes (entries 0.2 ms apart within each); the first pass's three capped requests finish
    together (one step), the second's two at different steps; one request ended early at EOS."""
    line = ("[x] ReqTimeStats(rid=r{i}, input_len=100, cached_input_len=90, output_len={n}, attempts=1, type=unified): "
            "queue_duration={q}ms, forward_duration={f}ms, entry_time={t}")
    rows = [(0, 128, "1.00", "800.00", "1000.0000"), (1, 128, "1.00", "799.80", "1000.0002"),
            (2, 128, "1.00", "799.60", "1000.0004"), (3, 40, "1.00", "300.00", "1000.0006"),
            (4, 128, "1.00", "800.00", "1000.5000"), (5, 128, "1.00", "900.00", "1000.5002")]
    text = "\n".join(line.format(i=i, n=n, q=q, f=f, t=t) for i, n, q, f, t in rows)
    rs = B.request_stats(text, cap=128)
    assert rs["arrival_groups"] == 2
    assert rs["finish_groups"] == 4  # 1000.801 (three), 1000.302, 1001.301, 1001.401
    assert rs["lockstep"] == round(3 / (3 + 1), 3)  # 3 of the 4 same-pass capped pairs finished together
    assert rs["capped_frac"] == round(5 / 6, 3)
    assert "lockstep" not in B.request_stats(text)


@pytest.mark.parametrize("pol, where", [
    ("off", ("nospec", "off")),
    ("static:s1", ("sglang", "s1")),
    ("static:s3", ("sglang", "s3")),
    ("plugin-fixed:1:s3+verify+stockverify+nodeg", ("sglang", "off")),  # SGLang's own steps-0 state, held
    ("plugin-fixed:1:s3+nodeg+verify+stockverify", ("sglang", "off")),
    ("plugin-fixed:1:s3", ("specctl", "off")),  # the decode state
    ("plugin-fixed:1000:s2", ("specctl", "s2")),
    ("plugin-fixed:1000:s3", ("specctl", "s3")),
    ("plugin-fixed:1:s3+fi+hostlens", ("specctl", "off")),  # the plugin's defaults since 2026-12-06, named
    ("plugin-fixed:1:s3+nofi", None),  # the control: flashinfer's trivial verify
    ("plugin-fixed:1:s3+nohostlens", None),
    ("plugin-fixed:64:s3", None),  # switches inside a sweep up to 128
    ("plugin-fixed:1:s3+verify", None),  # the trivial verify with the plugin's kernel and graphs: neither build
    ("plugin-fixed:1000:s3+stockverify", None),
    ("plugin-fixed:1:s3+eager", None),
    ("off+nooverlap", None),
    ("static:tree", None),
    ("specctl", None),
    ("threshold:5:s3", None),
    ("sglang-adaptive", None),
])
def test_each_run_measures_one_configuration_of_one_build_or_none(pol, where):
    assert B.path_config(pol, 128) == where


def _prow(pol, c, clean, all_windows, cv=None):
    log = {"step_ms_med": all_windows, "n_lines": 40, "clean_lines": 0 if clean is None else 30}
    if clean is not None:
        log.update(clean_step_ms_med=clean, clean_step_ms_cv=cv)
    return {"policy": pol, "concurrency": c, "log": log}


def test_path_profiles_take_clean_medians_per_build_and_load_in_the_simulator(tmp_path):
    from training.simulator import parse_profile

    runs = [_prow("off", 1, 6.2, 6.3, 0.02), _prow("off", 1, 6.0, 6.1, 0.04), _prow("off", 16, 6.7, 7.5, 0.03),
            _prow("plugin-fixed:1:s3", 1, 6.4, 6.5, 0.03), _prow("plugin-fixed:1:s3", 16, 6.9, 7.9, 0.05),
            _prow("plugin-fixed:1000:s3", 1, 7.1, 7.2), _prow("plugin-fixed:1000:s3", 16, None, 12.0),
            _prow("plugin-fixed:1000:s3", 16, None, 13.0),
            _prow("static:s3", 1, 8.4, 8.5), _prow("plugin-fixed:1:s3+verify+stockverify+nodeg", 1, 7.8, 7.9),
            _prow("plugin-fixed:8:s3", 1, 1.0, 1.0),  # switches inside this sweep (c <= 16)
            _prow("off+eager", 1, 35.0, 35.0)]
    profs = B.path_profiles(runs, "t")
    assert set(profs) == {"specctl", "sglang"}
    sp = profs["specctl"]
    assert sp["step_ms"] == {"off": [[1, 6.4], [16, 6.9]], "s3": [[1, 7.1]]}
    assert sp["source"]["no_clean_window"] == {"s3": [16]}  # no clean window at c = 16: left out, not 12.5
    assert sp["source"]["no_spec_step_ms"] == [[1, 6.1], [16, 6.7]]  # the eager no-spec server is not in it
    assert sp["noise_cv"] == 0.04 and profs["sglang"]["noise_cv"] == 0.05
    assert profs["sglang"]["step_ms"] == {"off": [[1, 7.8]], "s3": [[1, 8.4]]}
    assert list(sp["configs"]) == ["off", "s3"] and sp["configs"]["s3"] == {"steps": 3, "topk": 1, "draft_tokens": 4}
    for prof in profs.values():
        p = parse_profile(prof)
        assert p.config_names == tuple(prof["configs"])

    written = O.write_profiles([{"attention_backend": "triton", "runs": runs}], str(tmp_path), "t", ["call X"])
    be = written["specctl"]["break_even_accept"]
    assert be["s3"]["1"] == {"vs_no_spec": round(7.1 / 6.1, 3), "vs_own_off": round(7.1 / 6.4, 3)}
    assert be["off_vs_no_spec"] == {"1": round(6.4 / 6.1, 3), "16": round(6.9 / 6.7, 3)}
    saved = json.load(open(tmp_path / "t-triton-specctl.json"))
    assert saved["source"]["calls"] == ["call X"] and saved["name"] == "t-triton-specctl"
    with pytest.raises(SystemExit, match="attention backends"):
        O.write_profiles([{"attention_backend": "triton", "runs": runs}, {"attention_backend": "flashinfer", "runs": []}],
                         str(tmp_path), "t", [])


def _tsteps(rows, t0=100.0):
    """Step telemetry from (iter, batch, steps, ms): configurations as chains (steps, 1, steps + 1)."""
    return [{"iter": i, "ts": t0 + i, "step_ms": ms, "batch_size": b, "rank": 0,
             "config": {"steps": s, "topk": 1, "draft_tokens": s + 1}} for i, b, s, ms in rows]


@pytest.mark.parametrize("rows, want", [
    # steps right after a step only: the first has none before it, iteration 5 follows a skipped iteration
    # (a prefill)
    ([(1, 64, 0, 15.0), (2, 64, 0, 15.2), (3, 63, 0, 14.8), (5, 64, 0, 40.0), (6, 64, 0, 15.1)],
     {(0, 1, 1): [[64, 15.1, 3]]}),
    # batch sizes L - L/16 .. L count for L (60 .. 64), 59 does not; 1 only for 1
    ([(1, 1, 3, 8.0), (2, 59, 3, 20.0), (3, 60, 3, 21.0), (4, 64, 3, 22.0), (5, 2, 3, 9.0), (6, 1, 3, 8.5)],
     {(3, 1, 4): [[1, 8.5, 1], [64, 21.5, 2]]}),
    # per configuration: a step of s1 after one of off counts for s1
    ([(1, 1, 0, 8.0), (2, 1, 1, 10.0), (3, 1, 1, 10.4)], {(1, 1, 2): [[1, 10.2, 2]]}),
])
def test_telemetry_step_points_take_steps_after_a_step_just_under_each_level(rows, want):
    assert B.telemetry_step_points(_tsteps(rows), [1, 64]) == want


def test_telemetry_points_fill_only_the_levels_without_a_clean_window():
    prof = {"step_ms": {"off": [[1, 8.0], [32, 13.0]], "s3": [[1, 10.0]]},
            "source": {"no_clean_window": {"s3": [32, 64]}, "method": "log"}}
    rows = [(i, 64, 0, 15.0 + i / 100) for i in range(1, 5)]  # off at 64: 3 steps after a step
    rows += [(i, 1, 3, 10.1) for i in range(10, 13)] + [(i, 64, 3, 22.0) for i in range(20, 22)]  # s3: 1 at 64
    rows += [(i, 32, 0, 26.0) for i in range(30, 34)]  # off at 32 is in the log: a check, never a point
    O.add_telemetry_points(prof, _tsteps(rows), [1, 32, 64], min_steps=3)
    assert prof["step_ms"] == {"off": [[1, 8.0], [32, 13.0], [64, 15.03]], "s3": [[1, 10.0]]}  # s3: 1 < 3 steps
    src = prof["source"]
    assert src["telemetry_points"] == {"off": [[64, 3]]}
    assert src["telemetry_vs_log"] == {"off": {"32": 2.0}, "s3": {"1": 1.01}}
    assert src["no_clean_window"] == {"s3": [32, 64]} and "telemetry" in src["method"]
    O.add_telemetry_points(prof, _tsteps(rows[:9] + [(22, 64, 3, 23.0), (23, 64, 3, 22.5)]), [1, 32, 64], min_steps=3)
    assert prof["step_ms"]["s3"] == [[1, 10.0], [64, 22.5]] and src["no_clean_window"] == {"s3": [32]}


def test_borrowed_static_curves_fill_only_the_specctl_builds_missing_configurations(tmp_path):
    from training.simulator import parse_profile

    runs = [_prow("off", 1, 8.1, 8.2), _prow("off", 16, 8.9, 9.5),
            _prow("plugin-fixed:1:s3+fi+hostlens", 1, 8.3, 8.4), _prow("plugin-fixed:1:s3+fi+hostlens", 16, 9.1, 9.6),
            _prow("plugin-fixed:1000:s1", 1, 10.0, 10.1),
            _prow("static:s1", 1, 10.4, 10.5), _prow("static:s3", 1, 10.9, 11.0), _prow("static:s3", 16, None, 17.0)]
    fi = [{"attention_backend": "flashinfer", "runs": runs}]
    plain = O.write_profiles(fi, str(tmp_path / "a"), "t", [])
    assert json.load(open(plain["specctl"]["file"]))["step_ms"] == {"off": [[1, 8.3], [16, 9.1]], "s1": [[1, 10.0]]}
    got = O.write_profiles(fi, str(tmp_path / "b"), "t", [], borrow=True)
    sp = json.load(open(got["specctl"]["file"]))
    assert sp["step_ms"] == {"off": [[1, 8.3], [16, 9.1]], "s1": [[1, 10.0]], "s3": [[1, 10.9]]}  # its own s1 stays
    assert list(sp["source"]["borrowed"]) == ["s3"] and sp["source"]["no_clean_window"] == {"s3": [16]}
    assert json.load(open(got["sglang"]["file"]))["step_ms"] == {"s1": [[1, 10.4]], "s3": [[1, 10.9]]}
    assert parse_profile(sp).config_names == ("off", "s1", "s3")


def test_prefill_batches_count_the_high_load_lines_and_their_new_requests():
    line = ("[t] Prefill batch, #new-seq: {n}, #new-token: 40, #cached-token: 20, token usage: 0.1, "
            "#running-req: {r}, #queue-req: 0\n")
    text = (line.format(n=2, r=100) + line.format(n=1, r=127) + line.format(n=5, r=40)
            + "[t] Decode batch, #running-req: 128, #token: 900, gen throughput (token/s): 10.0\n")
    assert B.prefill_batches(text) == {"min_running": 90, "prefill_batches": 2, "new_requests_per_batch": 1.5,
                                       "new_tokens_per_request": round(80 / 3, 2), "cached_token_share": 0.3333,
                                       "cuda_graph_share": None}
    assert B.prefill_batches(text, min_running=30)["prefill_batches"] == 3
    assert B.prefill_batches("")["new_requests_per_batch"] is None


def test_prefill_window_cost_prices_a_prefill_by_what_it_adds_to_its_decode_window():
    """A window of 10 decode steps at 10 ms with one prefill of 30 ms logs a 13 ms step (its throughput spans the
    prefill); two prefills of 30 ms: 16 ms. Each costs 30 ms; the clean step is the windows' without a prefill."""
    dec = "[t] Decode batch, #running-req: {n}, #token: 900, accept len: {a}, gen throughput (token/s): {tp}\n"
    pre = "[t] Prefill batch, #new-seq: 1, #new-token: {t}, #cached-token: 0, #running-req: {n}, #queue-req: 0\n"

    def window(n, step_ms, prefills=(), acc=1.0):
        return "".join(pre.format(t=t, n=n) for t in prefills) + dec.format(n=n, a=acc, tp=1000.0 * n * acc / step_ms)

    text = (window(64, 99.0)  # the first window spans whatever came before: left out
            + window(64, 10.0) * 3 + window(64, 13.0, [100]) + window(64, 16.0, [100, 300])
            + window(128, 12.0, acc=2.0) + window(128, 16.0, [50], acc=2.0) + window(8, 5.0, [20]))
    cost = B.prefill_window_cost(text)
    assert cost["48-95"] == {"clean_step_ms": 10.0, "clean_windows": 3, "prefill_windows": 2, "per_prefill_ms": 30.0,
                             "new_tokens_per_prefill": round(500 / 3, 1)}
    # a speculating server's lines: the step is n x accept / throughput, as parse_decode_lines reads it
    assert cost["96-"]["clean_step_ms"] == 12.0 and cost["96-"]["per_prefill_ms"] == 40.0
    assert "1-15" not in cost  # a region without a clean window has no baseline
    assert B.prefill_window_cost("") == {}


def test_prefill_iterations_count_each_servers_prefills_at_high_load_and_over_the_call(tmp_path):
    """2026-12-07 (MoE, equal caps): the no-spec server's replacements prefilled together, the speculating
    server's one by one; the whole-call count says so where the high-load one (c >= 90) sees little."""
    line = "[t] Prefill batch, #new-seq: {n}, #new-token: 90, #cached-token: 0, token usage: 0.1, #running-req: {r}, #queue-req: 0\n"
    (tmp_path / "moe-off.log").write_text(line.format(n=16, r=0) + line.format(n=16, r=0) + line.format(n=2, r=126))
    (tmp_path / "moe-specctl.log").write_text(line.format(n=1, r=15) * 20 + line.format(n=1, r=127) * 3)
    (tmp_path / "run.log").write_text(line.format(n=9, r=0))
    got = O.prefill_iterations([str(tmp_path)])[0]["servers"]
    assert sorted(got) == ["off", "specctl"]
    assert (got["off"]["prefill"]["prefill_batches"], got["off"]["prefill_all"]["prefill_batches"]) == (1, 3)
    assert got["off"]["prefill_all"]["new_requests_per_batch"] == round(34 / 3, 3)
    assert (got["specctl"]["prefill"]["prefill_batches"], got["specctl"]["prefill_all"]["prefill_batches"]) == (3, 23)


def test_prefill_batches_say_which_ran_in_the_prefill_graph():
    # 0.5.17's lines with a prefill CUDA graph (call M2 of 2026-12-03): a cached prompt's 1-token prefill
    # eager, a 2-token one in the graph
    line = ("[t] Prefill batch, #new-seq: {n}, #new-token: {t}, #cached-token: 300, token usage: 0.26, "
            "#running-req: 127, #queue-req: 0, #pending-token: 0, cuda graph: {g}, input throughput (token/s): 18.13\n")
    text = line.format(n=1, t=1, g="False") * 3 + line.format(n=2, t=4, g="True")
    r = B.prefill_batches(text)
    assert r["prefill_batches"] == 4 and r["cuda_graph_share"] == 0.25
    assert r["new_tokens_per_request"] == round(7 / 5, 2) and r["cached_token_share"] == round(1200 / 1207, 4)


def test_iteration_gaps_time_one_skipped_iteration_per_config_and_batch_region():
    def step(it, ts, ms, bs, steps=0, rank=0):
        return {"iter": it, "ts": ts, "step_ms": ms, "batch_size": bs, "config": {"steps": steps}, "rank": rank}

    steps = [step(10, 0.000, 8.0, 100), step(11, 0.008, 8.0, 100),  # consecutive: no gap
             step(13, 0.078, 8.0, 100),  # one iteration skipped: 70 ms launch to launch, less the 8 ms step = 62
             step(16, 0.300, 8.0, 100),  # two skipped: not a one-iteration gap
             step(17, 0.308, 9.0, 20, steps=3), step(19, 0.358, 9.0, 20, steps=3),  # s3 at batch 20: 50 - 9 = 41
             step(21, 0.400, 9.0, 20, steps=3),  # 42 - 9 = 33
             step(23, 3.000, 9.0, 20, steps=3),  # an idle server (2.6 s): left out
             step(12, 0.050, 8.0, 100, rank=1)]  # another rank's step never pairs with rank 0's
    got = B.iteration_gaps(steps)
    assert got == {(0, "96-"): [1, 62.0], (3, "16-47"): [2, 37.0]}


def test_steps_after_a_prefill_are_told_from_steps_after_a_step():
    def step(it, ms, bs, steps=0, rank=0):
        return {"iter": it, "ts": it / 100, "step_ms": ms, "batch_size": bs, "config": {"steps": steps}, "rank": rank}

    steps = [step(10, 9.5, 128), step(11, 9.6, 128), step(12, 9.4, 128),  # two steps after a step
             step(14, 10.8, 128),  # after one other iteration (a prefill)
             step(15, 9.5, 127), step(17, 11.0, 127),  # after a step; after a prefill
             step(20, 30.0, 128),  # after two other iterations: neither
             step(21, 9.0, 20, steps=3), step(23, 12.0, 20, steps=3),  # s3 at batch 20 (the first after a step)
             step(13, 50.0, 128, rank=1)]  # another rank's step never pairs with rank 0's
    got = B.steps_after_prefill(steps)
    assert got == {(0, "96-"): {"after_prefill": [2, 10.9], "after_step": [3, 9.5]},
                   (3, "16-47"): {"after_prefill": [1, 12.0], "after_step": [1, 9.0]}}


@pytest.mark.parametrize("suffix", ["catchup", "catchup4"])
def test_the_catch_up_servers_have_their_own_step_cost_and_resync_columns(suffix):
    pol, resync = f"{O.DECODE_STATE}+{suffix}", f"{O.RESYNC}+{suffix}"
    bench = {"gpu": "NVIDIA H200", "sglang": "0.5.17", "model": "m", "draft": "d",
             "runs": [_row("off", 16, [6.7, 6.7]), _row(O.DECODE_STATE, 16, [6.92, 6.9]), _row(pol, 16, [6.78, 6.8]),
                      _row("static:s3", 16, [5.0, 5.0])],
             "phase_runs": [], "identity": {},
             "resync": {O.RESYNC: {"accept_after": 1.67, "accept_same_text": 1.70},
                        resync: {"accept_after": 1.66, "accept_same_text": 1.69}}}
    rec = O.build([bench], ["call C"])
    row = rec["step_costs"][0]
    assert row["off_state_ms"] == 6.91 and row[f"off_state_{suffix}_ms"] == 6.79
    assert rec["targets"][f"off_state_{suffix}_le_1.03x_no_spec"] == {"16": round(6.79 / 6.7, 4)}
    assert rec["resync"][f"accept_after_{suffix}"] == 1.66
    assert rec["targets"][f"resync_{suffix}_tail_vs_same_text"] == round(1.66 / 1.69, 4)
    assert {r["policy"] for r in rec["sweep"]} == {"no-spec", "static:s3"}  # a catch-up server: a step-cost column


def test_throughput_rows_mark_the_servers_profiled_before_they_measured():
    run = lambda pol, tok: {"policy": pol, "concurrency": 64, "output_tokens_per_s": tok,  # noqa: E731
                            "repeats_tok_s": [tok]}
    old = {"runs": [run("off", 2700.0), run("plugin-fixed:1:s3", 3500.0)], "profiles": {"off@128:churn": {}}}
    new = dict(old, profiles_after_measurements=True)
    rows = O.throughput_rows([old, new])
    assert [(r["call"], r["policy"], r["profiled_before"]) for r in rows] == [
        (1, "off", True), (1, "plugin-fixed:1:s3", False), (2, "off", False), (2, "plugin-fixed:1:s3", False)]
    assert rows[0]["rounds"] == [2700.0]


def test_moe_section_carries_the_targets_curves_and_checks():
    moe = {"experts": 128, "top_k": 8, "bytes": 20.5e9, "experts_touched": {"no_spec": {"1": 8.0, "128": 110.2}}}
    sec = O.moe_section(moe, {"identity_mtbench": {"identical": 16, "of": 16}})
    assert sec["moe_target"] == {"experts": 128, "top_k": 8, "bytes": 20.5e9}
    assert sec["experts_touched"]["no_spec"]["128"] == 110.2
    assert sec["moe_check"]["identity_mtbench"]["identical"] == 16
    assert "moe_check" not in O.moe_section(moe, None)
