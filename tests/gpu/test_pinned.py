"""run_bench's pinned servers: one plugin server measured under each of its configurations in turn, the tables
published by run_bench itself (specctl_side.Override), no daemon. Pure parts here; the whole flow against the
stand-in server, whose plugin part is specctl's real engine (its receiver, sync boundaries, decisions, log lines)."""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import benchlib as B  # noqa: E402

GPU = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu")


@pytest.mark.parametrize("pol, want", [
    ("pinned:s1/s2/s3", [(1, 1, 2), (2, 1, 3), (3, 1, 4)]),
    ("pinned:s1/s3/tree", [(1, 1, 2), (3, 1, 4), (2, 4, 16)]),
    ("pinned:s3+verify", [(3, 1, 4)]),
])
def test_a_pinned_server_names_its_configurations(pol, want):
    p = B.parse_policy(pol)
    assert p["kind"] == "pinned" and p["configs"] == want
    assert B.pin_names(p) == ["off", *(B.config_name(c) for c in want)]
    args, env, cfg = B.policy_launch_args(pol, "/d")
    # specctl's own launch: every state built (one slot from batch 1), online, no daemon's id; plain decode fallback
    assert cfg["1"]["candidate_steps"] == sorted({0, *(c[0] for c in want)})
    assert env["SGLANG_PLUGINS"] == "specctl" and env["SPECCTL_FALLBACK"].startswith("1:")
    assert "SPECCTL_MODE" not in env and "--speculative-adaptive" in args and "--speculative-adaptive-config" not in args
    assert ("--page-size" in args) == any(c[1] > 1 for c in want)
    assert (env.get("SPECCTL_PATCHES") == "plain_decode=off") == pol.endswith("+verify")


@pytest.mark.parametrize("pol, why", [
    ("pinned:s1/s2/tree", "both run 2 steps"),
    ("pinned:s1/s1", "each speculative configuration once"),
    ("pinned:", "each speculative configuration once"),
    ("pinned:s1/s3@s2", "not among the server's configurations"),
    ("static:s3@s3", "only a pinned"),
])
def test_bad_pinned_policies_are_refused_naming_the_problem(pol, why):
    with pytest.raises(ValueError, match=why):
        B.parse_policy(pol)


@pytest.mark.parametrize("run, threshold, where", [
    ("pinned:s1/s2/s3@off", 1, ("specctl", "off")),
    ("pinned:s1/s2/s3@s2", B.PIN_ALL, ("specctl", "s2")),
    ("pinned:s1/s2/s3+verify+stockverify+nodeg@off", 1, ("sglang", "off")),  # SGLang's steps-0 state
    ("pinned:s1/s2/s3+verify@off", 1, None),  # the decode state off, the plugin's other changes on: no build
    ("pinned:s1/s3/tree@tree", B.PIN_ALL, None),  # trees: tree_results.py
])
def test_a_pinned_run_decides_as_the_plugin_fixed_policy_it_stands_for(run, threshold, where):
    p = B.parse_policy(run)
    assert p["kind"] == "plugin-fixed" and p["threshold"] == threshold and p["pinned"] == run.rpartition("@")[0]
    assert B.path_config(run, 128) == where


def test_pinned_runs_against_the_stand_in_follow_each_published_table(tmp_path, bench_prompts, port0):
    pytest.importorskip("aiohttp")
    pytest.importorskip("zmq")
    out = tmp_path / "rb"
    env = dict(os.environ, PYTHONPATH=os.path.join(GPU, "mock") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pol = "pinned:s1/s3"
    cmd = [sys.executable, os.path.join(GPU, "run_bench.py"), "--model", str(tmp_path), "--variant", "mock",
           "--draft", "/d", "--policies", f"off,{pol}", "--levels", "1,4", "--new-tokens", "400",
           "--req-per-level", "max(2*c,4)", "--interleave", "--repeats", "2", "--identity-c", "4",
           "--identity-tokens", "8", "--parallel", "2", "--deadline-s", "240", "--out", str(out),
           "--prompts", bench_prompts, "--tokenizer", "simple", "--specctl-site", str(tmp_path / "site"),
           "--port0", port0]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=360)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bench = json.load(open(out / "bench-mock.json"))
    runs = {(row["policy"], row["concurrency"]): row for row in bench["runs"]}
    assert set(runs) == {(p, c) for p in ("off", f"{pol}@off", f"{pol}@s1", f"{pol}@s3") for c in (1, 4)}
    # each run's decode steps ran its configuration: the stand-in's accept length is 1 + steps / 2
    for c in (1, 4):
        assert [runs[(f"{pol}@{k}", c)]["log"]["accept_len"] for k in ("off", "s1", "s3")] == [1.0, 1.5, 2.5]
    aud = bench["servers"][pol]["specctl"]
    assert aud["match_frac"] == 1.0 and aud["unknown_version"] == 0 and aud["decisions"] > 0
    sw = aud["pin_switches"]
    assert sw and all(x["s"] is not None for x in sw)  # every table came in force before its run
    assert [x["version"] for x in sw] == list(range(2, len(sw) + 2)) and aud["policy_versions_seen"] == len(sw) + 1
    assert {x["pin"] for x in sw} == {"off", "s1", "s3"}
    # one profile of the plugin's build from the one server: its decode state, s1 and s3
    prof = B.path_profiles(bench["runs"], "mock")
    assert set(prof["specctl"]["step_ms"]) == {"off", "s1", "s3"}
    # the record reads the pinned server's off runs as the decode state of its build, beside the no-spec server
    import offpath_results as O

    rec = O.build([bench], ["stand-in"])
    assert [r["concurrency"] for r in rec["step_costs"]] == [1, 4]
    assert all(r["off_state_ms"] and r["no_spec_ms"] and r["rounds"] == 2 for r in rec["step_costs"])
    assert O.step_name(f"{pol}+verify@off") == O.TRIVIAL and O.step_name(f"{pol}@s1") == f"{pol}@s1"
    # with the logs: the pinned server's own steps by configuration (telemetry), never its log's mixed windows
    logged = O.build([bench], ["stand-in"], [str(out)])
    assert all(set(r) - {"logs", "concurrency"} == {"off"} for r in logged["step_costs_clean"])
    after = logged["prefill_iterations"][0]["servers"]["pinned:s1-s3"]["step_ms_after"]
    assert {k.split()[0] for k in after} == {"s0", "s1", "s3"}
    # the recorder daemon kept the plugin's step telemetry: steps of every configuration the server was pinned to
    tel = O.read_telemetry(str(out / "specctl-pinned_s1-s3"))
    assert {t["config"]["steps"] for t in tel} == {0, 1, 3} and len(tel) >= aud["decisions"] // 2
    assert {k: len(v) for k, v in O.pinned_telemetry([bench], [str(out)]).items()} == {"specctl": len(tel)}
    assert json.load(open(out / "specctl-pinned_s1-s3" / "telemetry" / ".." / "policies.json"))["pin_switches"] == sw
    pol_file = json.load(open(out / "specctl-pinned_s1-s3" / "policies.json"))
    assert [x["version"] for x in pol_file["policies"]] == list(range(1, len(sw) + 2))


@pytest.mark.parametrize("name, tag", [("pinned:s1/s2/s3", "pinned_s1-s2-s3"), ("pinned:s1/s3@s1", "pinned_s1-s3-at-s1"),
                                       ("plugin-fixed:1:s3+verify", "plugin-fixed_1_s3+verify"), ("off", "off")])
def test_a_policy_names_its_files_by_one_tag(name, tag):
    assert B.file_tag(name) == tag
