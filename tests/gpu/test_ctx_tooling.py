"""CPU tests of the context-length tooling of the GPU testbed: the wave runner and profile converter
(ctx_profile.py) and run_bench.py's alternating short/long workload, against the stand-in server
benchmarks/gpu/mock/sglang/launch_server.py."""
import json
import os
import subprocess
import sys

import pytest

GPU = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu")
sys.path.insert(0, GPU)
import benchlib as B  # noqa: E402
import prompts as P  # noqa: E402

MOCK = os.path.join(GPU, "mock")


def test_decode_lines_give_the_context_per_request():
    log = "".join(f"Decode batch, #running-req: 4, #token: {4 * n}, token usage: 0.1, accept len: 2.00, "
                  f"gen throughput (token/s): 800.0, #queue-req: 0\n" for n in (100, 6000, 6010, 6020, 6030))
    r = B.parse_decode_lines(log, 4)
    assert r["ctx_per_req_med"] == 6020.0 and r["step_ms_med"] == pytest.approx(10.0)
    hybrid = log.replace("#token", "#full token")
    assert B.parse_decode_lines(hybrid, 4)["ctx_per_req_med"] == 6020.0  # the first two lines dropped, as for steps
    assert "ctx_per_req_med" not in B.parse_decode_lines(log.replace("#token: ", "#tok "), 4)


def test_long_prompts_reach_their_length_with_distinct_documents():
    tok = P.SimpleTokenizer()
    items = [{"id": f"q{i}", "text": f"Question {i}: what is {i} plus {i}?"} for i in range(3)]
    filler = P.gen_train_prompts(200, seed=5)
    for n in (512, 6000):
        out = P.long_prompts(tok, items, n, filler)
        assert all(abs(x["n_tokens"] - n) <= 0.02 * n for x in out) and [x["id"] for x in out] == ["q0-L%d" % n, "q1-L%d" % n, "q2-L%d" % n]
        assert len({tuple(x["ids"][10:60]) for x in out}) == 3  # no two prompts share their document's start
    with pytest.raises(ValueError, match="more than 5"):
        P.long_prompts(tok, items, 5, filler)


@pytest.mark.parametrize("length,new,ctx,tol", [
    (512, 384, 8192, 0.02),        # far from the context: the usual 2 %
    (7680, 384, 8192, 0.0167),     # 2 % more would not fit SmolLM2's 8,192 with 384 new tokens
    (7800, 384, 8192, 0.001),      # no room at all: as tight as the search goes (the measure then refuses)
    (6000, 128, None, 0.02),       # context unknown
])
def test_a_long_prompt_misses_its_length_only_by_what_the_context_leaves(length, new, ctx, tol):
    import ctx_profile as CP

    assert CP.prompt_tol(length, new, ctx) == pytest.approx(tol, abs=1e-4)
    if ctx:
        assert length * (1 + CP.prompt_tol(length, new, ctx)) + new <= max(ctx, length * 1.001 + new)


@pytest.mark.parametrize("cap,c,longest,new,ok", [
    (0, 48, 7800, 384, True),            # no cap: SGLang sizes the pool from memory
    (214000, 32, 6163, 384, False),      # 2026-12-06's G1: the 32nd request of the 6,144-token wave queued
    (236000, 32, 6163, 384, True),
    (435000, 48, 7808, 384, True),       # G on an H200 (7,680 + 1.67 %: prompt_tol)
])
def test_a_kv_cap_must_hold_a_whole_wave_with_headroom(cap, c, longest, new, ok):
    import ctx_profile as CP

    problem = CP.kv_cap_problem(cap, c, longest, new)
    assert (problem is None) is ok
    if not ok:
        assert str(cap) in problem and "queue" in problem


def _rows(lengths=(512, 7680)):
    rows = []
    for L in lengths:
        for pol, base in (("off", 6.0), ("static:s1", 7.0), ("static:s3", 9.0)):
            for c in (1, 16, 64):
                rows.append({"policy": pol, "prompt_tokens": L, "concurrency": c, "step_ms": base + c * (0.01 + L * 1e-5),
                             "ctx_per_req": L + 150.0, "step_ms_cv": 0.02})
    return rows


def test_profile_with_a_context_term_from_waves_at_two_prompt_lengths():
    from specctl.training.simulator import parse_profile

    prof = B.profile_with_ctx(_rows(), "h200-test-ctx", source={"x": 1})
    assert prof["ctx_tokens"] == 662.0 and [e["ctx_tokens"] for e in prof["ctx_step_ms"]] == [7830.0]
    assert prof["step_ms"]["s3"][2] == [64, pytest.approx(9.0 + 64 * (0.01 + 512e-5))]
    p = parse_profile(prof)
    assert p.has_ctx and p.config_names == ("off", "s1", "s3") and prof["source"] == {"x": 1}
    s3 = p.config_names.index("s3")
    assert p.step_ms_ctx(s3, 64, 7830.0) == pytest.approx(9.0 + 64 * (0.01 + 7680e-5))
    with pytest.raises(ValueError, match="two or more prompt lengths"):
        B.profile_with_ctx(_rows((512,)), "one")


def test_table_flaps_count_speculating_rows_after_plain_decode():
    s3, off = {"steps": 3, "topk": 1, "draft_tokens": 4}, {"steps": 0, "topk": 1, "draft_tokens": 1}
    pol = {"table": [{"min_batch": 1, "config": s3}, {"min_batch": 14, "config": off}, {"min_batch": 16, "config": s3},
                     {"min_batch": 18, "config": off},
                     {"min_batch": 1, "config": s3, "min_ctx": 0, "max_ctx": 1023}, {"min_batch": 70, "config": off, "min_ctx": 0, "max_ctx": 1023},
                     {"min_batch": 1, "config": s3, "min_ctx": 1024}, {"min_batch": 14, "config": off, "min_ctx": 1024}]}
    assert B.policy_flaps(pol) == {"any": 1, "0-1023": 0, "1024+": 0}
    assert B.parse_policy("specctl-noctx") == {"kind": "specctl", "ctx_axis": False}
    assert B.policy_launch_args("specctl-noctx", "/d") == B.policy_launch_args("specctl", "/d")  # the same server


@pytest.mark.slow
def test_ctx_profile_measures_waves_against_the_stand_in_and_converts(tmp_path, bench_prompts, port0):
    from specctl.training.simulator import load_profile

    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=MOCK + os.pathsep + os.environ.get("PYTHONPATH", ""))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    cmd = [sys.executable, os.path.join(GPU, "ctx_profile.py"), "measure", "--model", str(tmp_path / "model"),
           "--draft", "/d", "--out", str(out), "--prompt-tokens", "128,1024", "--levels", "2,4", "--new-tokens", "150",
           "--rounds", "2", "--prompts", bench_prompts, "--tokenizer", "simple",
           "--deadline-s", "200", "--port0", port0]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    steps = json.load(open(out / "ctx-steps.json"))
    assert len(steps["waves"]) == 3 * 2 * 2 * 2 and all(w["ok"] == w["concurrency"] for w in steps["waves"])
    assert {s["ready"] for s in steps["servers"].values()} == {True}
    assert "--speculative-num-steps 3" in steps["servers"]["static:s3"]["cmd"]
    prof_path = tmp_path / "p.json"
    subprocess.run([sys.executable, os.path.join(GPU, "ctx_profile.py"), "convert", str(out / "ctx-steps.json"),
                    "--name", "mock-ctx", "--out", str(prof_path)], check=True, capture_output=True, timeout=60)
    assert json.load(open(prof_path)) == dict(json.load(open(out / "profile-ctx.json")), name="mock-ctx",
                                              source=json.load(open(prof_path))["source"])
    # the same waves measured over two calls (an H100 holds two servers): the same profile
    parts = []
    for k, pols in enumerate(({"off", "static:s3"}, {"static:s1"})):
        part = dict(steps, waves=[w for w in steps["waves"] if w["policy"] in pols])
        parts.append(tmp_path / f"part{k}.json")
        parts[-1].write_text(json.dumps(part))
    merged = tmp_path / "merged.json"
    subprocess.run([sys.executable, os.path.join(GPU, "ctx_profile.py"), "convert", *map(str, parts),
                    "--name", "mock-ctx", "--out", str(merged)], check=True, capture_output=True, timeout=60)
    got, want = json.load(open(merged)), json.load(open(prof_path))
    assert len(got["source"]["waves"]) == 2
    assert dict(got, source=None) == dict(want, source=None)
    # a policy in both, or another GPU: refused with the reason
    for bad_part in (dict(steps, waves=steps["waves"][:1]), dict(steps, waves=[], gpu="other")):
        (tmp_path / "bad.json").write_text(json.dumps(bad_part))
        r = subprocess.run([sys.executable, os.path.join(GPU, "ctx_profile.py"), "convert", str(out / "ctx-steps.json"),
                            str(tmp_path / "bad.json"), "--name", "x", "--out", str(tmp_path / "x.json")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and ("measured by an earlier file" in r.stderr or "gpu" in r.stderr), r.stderr
    p = load_profile(prof_path)
    assert p.has_ctx and set(p.config_names) == {"off", "s1", "s3"}
    for k in range(3):  # the stand-in's steps take longer at the longer context, and longer with more draft steps
        assert p.step_ms_ctx(k, 4, 1024) > p.step_ms_ctx(k, 4, 128)
    assert p.step_ms(p.config_names.index("s3"), 4) > p.step_ms(p.config_names.index("off"), 4)
    # prompt + new tokens beyond the model's context: refused before any server starts
    bad = subprocess.run(cmd[:cmd.index("--prompt-tokens") + 1] + ["4096"] + cmd[cmd.index("--prompt-tokens") + 2:],
                         env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "exceed the model's context 2048" in bad.stdout + bad.stderr


@pytest.mark.slow
def test_run_bench_alternating_workload_specctl_with_and_without_the_context_axis(tmp_path, bench_prompts, port0):
    pytest.importorskip("aiohttp")  # run_bench's clients (there: installed with SGLang)
    out = tmp_path / "rb"
    env = dict(os.environ, PYTHONPATH=MOCK + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(GPU, "run_bench.py"), "--model", str(tmp_path), "--variant", "mock", "--draft", "/d",
           "--policies", "specctl,specctl-noctx", "--levels", "2", "--phase", "--phase-set", "alternating",
           "--alt-concurrency", "2,3", "--long-prompt-tokens", "600", "--interleave", "--phase-repeats", "2", "--phase-scale", "0.1",
           "--specctl-learn", "2", "--out", str(out), "--prompts", bench_prompts,
           "--tokenizer", "simple", "--deadline-s", "300", "--specctl-site", str(tmp_path / "site"), "--new-tokens", "32",
           "--port0", port0]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.load(open(out / "bench-mock.json"))
    assert res["servers"]["specctl-noctx"]["daemon_args"] == ["--no-ctx-axis"]
    assert res["servers"]["specctl"]["daemon_args"] == []
    # the servers took turns, run by run, and the pairs are run k of one with run k of the other
    assert [x["policy"] for x in res["phase_runs"]] == ["specctl", "specctl-noctx", "specctl-noctx", "specctl"]
    assert all(x["phase_set"] == "alternating" and x["errors"] == 0 for x in res["phase_runs"])
    assert [(p["concurrency"], *p["mix"]) for p in res["phase_runs"][0]["phases"]] == \
        [(2, "short"), (2, "long"), (3, "short"), (3, "long")]  # --alt-concurrency
    for x in res["phase_runs"]:  # every phase of every run has its own figures, and they add up to the run's
        pp = x["per_phase"]
        assert [p["phase"] for p in pp] == list(range(len(x["phases"]))) and all(p["requests"] > 0 for p in pp)
        assert sum(p["requests"] for p in pp) == x["requests"]
    assert res["phase_pairs"]["specctl / specctl-noctx"]["pairs"] == 2
    assert "table_flaps" in res["servers"]["specctl"]["specctl"]


def test_replay_ctx_fit_reads_the_h200_recording(tmp_path):
    """scripts/replay_ctx_fit.py on the 2026-12-01 recording (specctl's phase runs on the H200): the replay
    yields a table, and the recording's within-batch-size context slopes of s3 fall with the batch size
    (the observation the pooled slope ignores)."""
    import json
    import subprocess
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    rec = os.path.join(root, "benchmarks", "gpu", "logs", "2026-12-01", "call5-phase-repeats", "specctl-telemetry.jsonl.gz")
    out = tmp_path / "fit.json"
    r = subprocess.run([sys.executable, os.path.join(root, "scripts", "replay_ctx_fit.py"), rec, "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.load(open(out))
    assert d["steps"] > 5000 and d["table"]
    s3 = d["configs"]["s3"]["within_batch_size"]
    assert s3["1"]["us_per_ctx_token"] > 2 * s3["8"]["us_per_ctx_token"] > 0


@pytest.mark.parametrize("arg,want", [
    ("32,48", [(32, "short"), (32, "long"), (48, "short"), (48, "long")]),
    ("8,16", [(8, "short"), (8, "long"), (16, "short"), (16, "long")]),
    ([4], [(4, "short"), (4, "long")]),
])
def test_alternating_phases_pair_a_short_and_a_long_phase_at_each_concurrency(arg, want):
    got = B.alt_phases(arg)
    assert [(p["concurrency"], *p["mix"]) for p in got] == want and {p["duration_s"] for p in got} == {15}


@pytest.mark.parametrize("bad", ["", "0,16", "x"])
def test_alternating_phases_refuse_no_or_bad_concurrencies(bad):
    with pytest.raises(ValueError):
        B.alt_phases(bad)
