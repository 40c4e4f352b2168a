"""The context axis's record (benchmarks/gpu/ctx_results.py): the profile waves' spec/no-spec ratios, the
alternating workload's pairs, each server's last table per band and its telemetry's step costs by context
class, read from files in the forms the device calls write."""
import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import ctx_results as R  # noqa: E402


def _wave(pol, L, c, ms, rnd=0):
    return {"policy": pol, "round": rnd, "prompt_tokens": L, "concurrency": c, "ok": c, "wall_s": 1.0,
            "step_ms_med": ms, "ctx_per_req_med": L + 100.0, "step_ms_cv": 0.01}


def _telemetry(folder, steps):
    from specctl.controller.wire import encode_step_fields

    os.makedirs(os.path.join(folder, "telemetry"))
    with gzip.open(os.path.join(folder, "telemetry", "telemetry-1.jsonl.gz"), "wb") as f:
        for i, (b, L, s, ms) in enumerate(steps):
            f.write(encode_step_fields(server="x", rank=0, iter=i, ts=1000.0 + i, batch_size=b, steps=s, topk=1,
                                       draft_tokens=s + 1, accepted=[1] * b if s else None, step_ms=ms,
                                       ctx_tokens=b * L) + b"\n")
        f.write(b"not a record\n")  # a damaged line is skipped by specctl's reader, not fatal


def test_profile_waves_give_each_speculative_step_over_the_no_spec_one(tmp_path):
    waves = [_wave("off", 512, 4, 8.0), _wave("static:s3", 512, 4, 12.0), _wave("off", 6144, 4, 11.0),
             _wave("static:s3", 6144, 4, 40.0), _wave("static:s3", 6144, 32, None), _wave("off", 6144, 32, None)]
    p = tmp_path / "ctx-steps.json"
    p.write_text(json.dumps({"gpu": "H100", "prompt_tokens": [512, 6144], "new_tokens": 384, "waves": waves}))
    got = R.ctx_steps([str(p)])
    assert [(r["prompt_tokens"], r["over_off"]) for r in got["spec_over_off"]] == [(512, 1.5), (6144, round(40 / 11, 4))]
    assert {(r["policy"], r["concurrency"]) for r in got["no_steps"]} == {("off", 32), ("static:s3", 32)}


def test_alternating_record_reads_pairs_tables_and_telemetry_by_context_class(tmp_path):
    sd = tmp_path / "g0" / "specctl-specctl"
    _telemetry(str(sd), [(32, 300, 3, 11.8), (32, 300, 3, 11.9), (32, 300, 0, 9.0), (32, 4100, 3, 18.0),
                         (33, 4100, 0, 12.4), (5, 4100, 3, 10.6)])
    table = [{"min_batch": 1, "max_batch": 17, "config": {"steps": 3}}, {"min_batch": 18, "max_batch": 18, "config": {"steps": 0}},
             {"min_batch": 19, "config": {"steps": 3}},
             {"min_batch": 1, "config": {"steps": 3}, "min_ctx": 0, "max_ctx": 4095},
             {"min_batch": 1, "max_batch": 72, "config": {"steps": 3}, "min_ctx": 4096},
             {"min_batch": 73, "config": {"steps": 1}, "min_ctx": 4096}]
    (sd / "policies.json").write_text(json.dumps({"policies": [{"policy": {"table": table[:1]}}, {"policy": {"table": table}}]}))
    bench = {"gpu": "H100", "phase_pairs": {"specctl / specctl-noctx": {"per_round": [1.09, 1.02, 1.03], "mean": 1.0467}},
             "phase_runs": [{"policy": "specctl", "output_tokens_per_s": 1500.0, "median_tpot_ms": 17.5,
                             "phases": [{"concurrency": 32, "mix": {"short": 1.0}}],
                             "per_phase": [{"concurrency": 32, "output_tokens_per_s": 1956.9, "median_tpot_ms": 15.6}]}],
             "servers": {"specctl": {"daemon_args": [], "specctl": {"table_flaps": None, "ctx_bands": 2, "step_changes": 9}}}}
    alt = R.alternating(bench, str(tmp_path / "g0"), 2048)
    s = alt["servers"]["specctl"]
    assert s["table_flaps"] == {"any": 1, "0-4095": 0, "4096+": 0}  # from the saved table: the bench had none
    assert s["last_table"][-1] == {"min_ctx": 4096, "min_batch": 73, "steps": 1}
    steps = {(t["ctx"], t["batch_from"], t["config"]["steps"]): (t["steps"], t["step_ms_med"]) for t in s["telemetry_steps"]}
    assert steps == {("short", 32, 3): (2, pytest.approx(11.85)), ("short", 32, 0): (1, 9.0), ("long", 32, 3): (1, 18.0),
                     ("long", 32, 0): (1, 12.4), ("long", 4, 3): (1, 10.6)}
    assert alt["phase_runs"][0]["per_phase"][0]["prompts"] == "short"
    t = R.targets({"alternating": alt})
    assert t["specctl_over_noctx_mean_ge_1.05"] == 1.0467 and t["band_flaps_eq_0"] == {"0-4095": 0, "4096+": 0}


@pytest.mark.parametrize("pols,pairs", [
    (["specctl", "specctl-noctx"], [("specctl", "specctl-noctx")]),
    (["specctl-noctx+stockverify", "specctl+stockverify", "specctl", "specctl-noctx", "off"],
     [("specctl", "specctl-noctx"), ("specctl+stockverify", "specctl-noctx+stockverify")]),
    (["specctl+stockverify", "specctl-noctx"], []),  # another build is no pair
])
def test_the_context_axis_pairs_each_build_with_itself_without_the_axis(pols, pairs):
    import benchlib as B

    assert B.ctx_pairs(pols) == pairs


def test_a_suffixed_pair_has_targets_of_its_own():
    alt = {"phase_pairs": {"specctl+stockverify / specctl-noctx+stockverify": {"mean": 1.2, "per_round": [1.2]}},
           "servers": {"specctl+stockverify": {"table_flaps": {"any": 3, "0-4095": 0}, "ctx_bands": 2}}}
    t = R.targets({"alternating": alt})
    assert t["specctl_over_noctx+stockverify_mean_ge_1.05"] == 1.2
    assert t["band_flaps+stockverify_eq_0"] == {"0-4095": 0} and t["ctx_bands+stockverify_ge_2"] == 2


@pytest.mark.parametrize("b,bin_", [(1, 1), (3, 2), (32, 32), (33, 32), (47, 40), (300, 256), (0, 0)])
def test_batch_sizes_count_at_the_bin_below(b, bin_):
    assert R.batch_bin(b) == bin_


def test_two_alternating_calls_share_one_record_and_a_server_named_twice_is_refused():
    part = lambda pol, mean: {"phase_runs": [{"policy": pol, "run": 1}],  # noqa: E731
                              "phase_pairs": {f"{pol} / specctl-noctx{pol[len('specctl'):]}": {"mean": mean}},
                              "servers": {pol: {"ctx_bands": 2, "table_flaps": {"any": 0, "0-2047": 0}}}}
    alt = R.merge_alternating([part("specctl", 1.046), part("specctl+stockverify", 1.026)])
    assert [r["call"] for r in alt["phase_runs"]] == [0, 1]
    t = R.targets({"alternating": alt})
    assert t["specctl_over_noctx_mean_ge_1.05"] == 1.046 and t["specctl_over_noctx+stockverify_mean_ge_1.05"] == 1.026
    assert R.merge_alternating([part("specctl", 1.0)]) == part("specctl", 1.0)  # one call: as it was
    with pytest.raises(SystemExit, match="names servers another one does"):
        R.merge_alternating([part("specctl", 1.0), part("specctl", 1.1)])


def test_a_label_tells_two_calls_of_the_same_servers_apart():
    pol, noctx = "specctl+stockverify", "specctl-noctx+stockverify"
    part = lambda mean: {"phase_runs": [{"policy": pol, "run": 1}, {"policy": noctx, "run": 1}],  # noqa: E731
                         "phase_pairs": {f"{pol} / {noctx}": {"mean": mean, "per_round": [mean]}},
                         "servers": {pol: {"ctx_bands": 5, "table_flaps": {"any": 1, "0-255": 0}}, noctx: {}}}
    assert R.labelled(part(1.0), "") == part(1.0)
    alt = R.merge_alternating([part(1.026), R.labelled(part(1.116), "@low")])
    assert [r["policy"] for r in alt["phase_runs"]] == [pol, noctx, pol + "@low", noctx + "@low"]
    assert set(alt["servers"]) == {pol, noctx, pol + "@low", noctx + "@low"}
    t = R.targets({"alternating": alt})
    assert t["specctl_over_noctx+stockverify_mean_ge_1.05"] == 1.026
    assert t["specctl_over_noctx+stockverify@low_mean_ge_1.05"] == 1.116
    assert t["band_flaps+stockverify@low_eq_0"] == {"0-255": 0} and t["ctx_bands+stockverify@low_ge_2"] == 5


def test_replay_runs_a_servers_telemetry_through_this_daemon_with_its_arguments(tmp_path):
    """--replay: the table this checkout's daemon makes of a run's telemetry; --no-ctx-axis (specctl-noctx's
    daemon) publishes no context bands; an argument it cannot map is refused, not ignored."""
    steps = []
    for i in range(400):  # s3 and plain decode at batch 8 / 32, short and long contexts taking turns
        b, L = (8, 300) if i % 4 < 2 else (32, 4000)
        steps.append((b, L, 3 if i % 2 else 0, (9.0 if L == 300 else 11.0) * (1.6 if i % 2 else 1.0)))
    sd = tmp_path / "srv"
    _telemetry(str(sd), steps)
    with_axis = R.replayed_policy(str(sd), [])
    without = R.replayed_policy(str(sd), ["--no-ctx-axis"])
    assert "table" in with_axis and all(r.get("min_ctx") is None and r.get("max_ctx") is None
                                        for r in without["table"])
    with pytest.raises(SystemExit, match="--gap-term"):
        R.replayed_policy(str(sd), ["--gap-term"])
