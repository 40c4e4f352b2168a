"""CPU tests of the GPU testbed's pure helpers (bundle manifest, runner log parsing, policies, profiles)."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import benchlib as B  # noqa: E402
import bundle_manifest as M  # noqa: E402
import prompts as P  # noqa: E402


def _write(d, name, data):
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def test_manifest_roundtrip_joins_parts_across_calls(tmp_path):
    bundle, stash = tmp_path / "bundle", tmp_path / "stash"
    bundle.mkdir()
    blob = os.urandom(3000)
    _write(bundle, "big.part00", blob[:1000])
    _write(bundle, "big.part01", blob[1000:2000])
    _write(bundle, "big.part02", blob[2000:])
    _write(bundle, "small.tgz", b"abc")
    m = M.build_manifest(str(bundle))
    json.dump(m, open(bundle / "MANIFEST.json", "w"))
    assert m["artifacts"]["big"]["bytes"] == 3000 and len(m["artifacts"]["big"]["parts"]) == 3
    # first call carries part00 + small.tgz only
    os.rename(bundle / "big.part01", tmp_path / "p1")
    os.rename(bundle / "big.part02", tmp_path / "p2")
    rows = {r["artifact"]: r for r in M.stash(str(bundle), str(stash))}
    assert rows["big"]["state"] == "partial" and rows["small.tgz"]["state"] == "complete"
    # second call carries the rest (bundle now holds only the later parts and the manifest)
    os.remove(bundle / "big.part00")
    os.rename(tmp_path / "p1", bundle / "big.part01")
    os.rename(tmp_path / "p2", bundle / "big.part02")
    rows = {r["artifact"]: r for r in M.stash(str(bundle), str(stash))}
    assert rows["big"]["state"] == "complete"
    assert open(stash / "big", "rb").read() == blob
    # idempotent
    rows = {r["artifact"]: r for r in M.stash(str(bundle), str(stash))}
    assert rows["big"]["state"] == "complete"


def test_manifest_rejects_corrupt_part(tmp_path):
    bundle, stash = tmp_path / "bundle", tmp_path / "stash"
    bundle.mkdir()
    _write(bundle, "x.part00", b"a" * 10)
    _write(bundle, "x.part01", b"b" * 10)
    json.dump(M.build_manifest(str(bundle)), open(bundle / "MANIFEST.json", "w"))
    _write(bundle, "x.part01", b"c" * 10)
    rows = {r["artifact"]: r for r in M.stash(str(bundle), str(stash))}
    assert rows["x"]["state"] == "partial" and rows["x"]["bad_parts"] == ["x.part01"]
    assert not (stash / "x").exists()


@pytest.mark.parametrize("limit_mib,n_staging", [(64.0, 3), (61.0, 4)])
def test_stage_fits_everything_but_the_jit_cache_into_the_fewest_calls(tmp_path, limit_mib, n_staging):
    """bundle_manifest.py stage: the GGUF and the site re-split so that the staging calls (each with the working
    tree) stay under the limit; the joined artifacts keep their bytes and sha256; the last call carries the JIT
    cache alone."""
    b = tmp_path / "bundle"
    b.mkdir()
    mib = 2**20
    gguf, site = os.urandom(94 * mib // 16), os.urandom(46 * mib // 16)  # the real sizes / 16
    _write(b, "gguf.part00", gguf[: 40 * mib // 16])
    _write(b, "gguf.part01", gguf[40 * mib // 16:])
    _write(b, "site.txz.part00", site)
    for n, k in (("aux.tgz", 0.17), ("deepgemm.tgz", 3.5), ("jitcache.tgz", 3.6)):
        _write(b, n, os.urandom(int(k * mib / 16)))
    before = M.build_manifest(str(b))["artifacts"]
    tree, limit = int(15.2 * mib / 16), limit_mib / 16
    calls = M.stage(str(b), tree, limit, 0.25 / 16)
    after = json.load(open(b / "MANIFEST.json"))["artifacts"]
    assert {k: v["sha256"] for k, v in after.items()} == {k: v["sha256"] for k, v in before.items()}
    names = list(calls)
    assert names == [chr(ord("A") + k) for k in range(n_staging + 1)]
    for k in names[:-1]:
        assert calls[k][-1] == "MANIFEST.json"
        assert sum(os.path.getsize(b / n) for n in calls[k]) + tree <= limit * mib
    carried = [n for k in names[:-1] for n in calls[k] if n != "MANIFEST.json"]
    assert sorted(carried) == sorted(p["name"] for a in ("gguf", "site.txz", "aux.tgz", "deepgemm.tgz")
                                     for p in after[a]["parts"])
    assert calls[names[-1]] == ["jitcache.tgz", "MANIFEST.json"]
    with pytest.raises(ValueError, match="do not fit"):
        M.stage(str(b), int(50 * mib / 16), limit, 0.25 / 16)


def test_stage_packs_fa3_and_the_flashinfer_cache_after_the_site(tmp_path):
    """With extras, FA3 (118 MB in parts that alone outgrow a call beside a 25 MiB tree) is re-split at the calls'
    boundaries and packed with the flashinfer and JIT caches after deep_gemm; every call stays under the limit
    and the joined artifacts keep their sha256."""
    b = tmp_path / "bundle"
    b.mkdir()
    mib = 2**20
    gguf, site, fa3 = (os.urandom(k * mib // 16) for k in (94, 46, 118))
    _write(b, "gguf.part00", gguf)
    _write(b, "site.txz.part00", site)
    for k in range(3):  # build_bundle.sh's 40 MiB parts
        _write(b, f"fa3.so.xz.part{k:02d}", fa3[k * 40 * mib // 16:(k + 1) * 40 * mib // 16])
    for n, k in (("aux.tgz", 0.17), ("deepgemm.tgz", 3.5), ("jitcache.tgz", 3.6),
                 ("flashinfer-jit-cache-sm90.tgz", 9.9)):
        _write(b, n, os.urandom(int(k * mib / 16)))
    before = M.build_manifest(str(b))["artifacts"]
    tree, limit = int(25 * mib / 16), 61.0 / 16
    with pytest.raises(ValueError, match="not in"):
        M.stage(str(b), tree, limit, 0.25 / 16, extras=["fa4.so.xz"])
    calls = M.stage(str(b), tree, limit, 0.25 / 16, extras=["fa3.so.xz", "flashinfer-jit-cache-sm90.tgz"])
    after = json.load(open(b / "MANIFEST.json"))["artifacts"]
    assert {k: v["sha256"] for k, v in after.items()} == {k: v["sha256"] for k, v in before.items()}
    for names in calls.values():
        assert names[-1] == "MANIFEST.json"
        assert sum(os.path.getsize(b / n) for n in names) + tree <= limit * mib
    carried = sorted(n for names in calls.values() for n in names if n != "MANIFEST.json")
    assert carried == sorted(p["name"] for a in after.values() for p in a["parts"])
    cap = (limit - 0.25 / 16) * mib - tree - 4096
    assert len(calls) == -(-sum(v["bytes"] for v in after.values()) // int(cap))  # no call wasted
    assert "jitcache.tgz" in calls[max(calls)]


def test_group_files_rejects_gaps():
    with pytest.raises(ValueError):
        M.group_files(["a.part00", "a.part02"])
    assert M.group_files(["a.part01", "a.part00", "b"]) == {"a": ["a.part00", "a.part01"], "b": ["b"]}


def test_policies():
    assert B.policy_launch_args("off", "/d") == ([], {}, None)
    args, env, cfg = B.policy_launch_args("static:s2", "/d")
    assert args[args.index("--speculative-num-steps") + 1] == "2" and args[args.index("--speculative-num-draft-tokens") + 1] == "3"
    assert cfg is None and "--speculative-adaptive" not in args
    args, env, cfg = B.policy_launch_args("threshold:5:s3", "/d")
    assert cfg == {"1": {"candidate_steps": [3]}, "5": {"candidate_steps": [0]}}
    assert args[args.index("--speculative-num-steps") + 1] == "3"  # launch at the largest candidate (0.5.17 bug)
    args, env, cfg = B.policy_launch_args("sglang-adaptive", "/d")
    assert args[args.index("--speculative-num-steps") + 1] == "7" and cfg is None
    args, env, cfg = B.policy_launch_args("plugin-fixed:5:s3", "/d")  # the same server as threshold:5:s3, plus the plugin
    assert cfg == {"1": {"candidate_steps": [3]}, "5": {"candidate_steps": [0]}}
    assert args == B.policy_launch_args("threshold:5:s3", "/d")[0]
    assert env == {"SGLANG_PLUGINS": "specctl", "SPECCTL_MODE": "fixed", "SPECCTL_FALLBACK": "5:s3"}
    args, env, cfg = B.policy_launch_args("specctl", "/d")
    assert env == {"SGLANG_PLUGINS": "specctl"} and cfg["1"]["candidate_steps"] == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        B.parse_policy("static:3")


@pytest.mark.parametrize("pol, cfg, env_skip", [
    ("plugin-fixed:1:s3", {"1": {"candidate_steps": [0, 3]}}, False),  # steps 0 at every batch size
    ("plugin-fixed:1:s3+skipde", {"1": {"candidate_steps": [0, 3]}}, True),
    ("threshold:5:s3+skipde", {"1": {"candidate_steps": [3]}, "5": {"candidate_steps": [0]}}, True),
    ("specctl+skipde", {"1": {"candidate_steps": [0, 1, 2, 3]}}, True),
])
def test_policy_variants(pol, cfg, env_skip):
    args, env, got = B.policy_launch_args(pol, "/d")
    assert got == cfg and "--speculative-adaptive" in args
    assert (env.get("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND") == "1") is env_skip
    assert B.parse_policy(pol).get("skip_zero_draft_extend", False) is env_skip
    if pol.startswith("specctl"):
        assert env["SGLANG_PLUGINS"] == "specctl" and B.parse_policy(pol)["kind"] == "specctl"


@pytest.mark.parametrize("pol", ["off+skipde", "static:s3+skipde", "threshold:1:s3", "plugin-fixed:0:s3", "specctl+x"])
def test_policy_variants_refused(pol):
    with pytest.raises(ValueError):
        B.policy_launch_args(pol, "/d")


LOG = """[2026-11-29] Decode batch, #running-req: 1, #token: 10, token usage: 0.00, accept len: 1.50, gen throughput (token/s): 10.00, #queue-req: 0
[2026-11-29] Decode batch, #running-req: 4, #token: 10, token usage: 0.00, accept len: 2.00, accept rate: 0.33, gen throughput (token/s): 800.00, #queue-req: 0
[2026-11-29] Decode batch, #running-req: 4, #token: 10, token usage: 0.00, accept len: 2.00, gen throughput (token/s): 1000.00, #queue-req: 0
[2026-11-29] Decode batch, #running-req: 3, #token: 10, token usage: 0.00, accept len: 3.00, gen throughput (token/s): 900.00, #queue-req: 0
"""


def test_parse_decode_lines():
    r = B.parse_decode_lines(LOG, 4)
    assert r["n_lines"] == 2 and r["step_ms_med"] == pytest.approx((10 + 8) / 2)
    assert r["accept_len"] == 2.0
    assert B.parse_decode_lines(LOG, 3)["step_ms_med"] == pytest.approx(10.0)
    assert B.parse_decode_lines("nothing", 1)["n_lines"] == 0
    off = "Decode batch, #running-req: 2, gen throughput (token/s): 1.0\nDecode batch, #running-req: 2, gen throughput (token/s): 400.0\n"
    assert B.parse_decode_lines(off, 2)["step_ms_med"] == pytest.approx(5.0)


def test_clean_windows_leave_out_the_ones_holding_a_prefill():
    """A Decode-batch line's throughput is over the time since the previous one: a prefill between them is in
    it. clean_step_ms_med takes only the windows without one (the first line's window is never clean)."""
    d = "Decode batch, #running-req: 64, gen throughput (token/s): {tp}\n"
    p = "Prefill batch, #new-seq: 1, #new-token: 80, #running-req: 63\n"
    log = d.format(tp=1.0) + d.format(tp=8000.0) + p + d.format(tp=4000.0) + d.format(tp=8000.0) + p + p + d.format(tp=2000.0)
    r = B.parse_decode_lines(log, 64)
    assert r["clean_lines"] == 2 and r["clean_step_ms_med"] == pytest.approx(8.0)
    assert r["step_ms_med"] == pytest.approx(16.0)  # over all windows (the first dropped): 16, 8, 32
    only_prefills = d.format(tp=1.0) + p + d.format(tp=4000.0)
    assert B.parse_decode_lines(only_prefills, 64)["clean_lines"] == 0
    assert "clean_step_ms_med" not in B.parse_decode_lines(only_prefills, 64)


def test_summarize_and_profile():
    outs = [{"ttft": 0.1, "latency": 1.1, "tokens": 101, "verify_ct": 50},
            {"ttft": 0.2, "latency": 2.2, "tokens": 201, "verify_ct": 100}, {"error": "x"}]
    s = B.summarize_requests(outs, 2.0)
    assert s["requests"] == 2 and s["errors"] == 1 and s["output_tokens_per_s"] == 151.0
    assert s["median_tpot_ms"] == pytest.approx(10.0) and s["accept_length"] == pytest.approx(302 / 150, abs=1e-3)
    runs = [{"policy": "off", "concurrency": 1, "log": {"step_ms_med": 4.0, "step_ms_cv": 0.01}},
            {"policy": "static:s3", "concurrency": 1, "log": {"step_ms_med": 6.0, "step_ms_cv": 0.03}},
            {"policy": "off", "concurrency": 8, "log": {"step_ms_med": 4.5, "step_ms_cv": 0.02}},
            {"policy": "sglang-adaptive", "concurrency": 8, "log": {"step_ms_med": 5.0}}]
    p = B.profile_from_runs(runs, "t")
    assert p["schema"] == "specctl.profile/1" and set(p["configs"]) == {"off", "s3"}
    assert p["configs"]["s3"] == {"steps": 3, "topk": 1, "draft_tokens": 4}
    assert p["step_ms"]["off"] == [[1, 4.0], [8, 4.5]] and p["noise_cv"] == 0.02


def test_prompt_sets_are_disjoint_from_benchmarks():
    gen = P.gen_train_prompts(500)
    assert len({x["text"] for x in gen}) == 500
    assert not any("Complete the following Python function.\n\n```python\ndef " in x["text"] and '"""Function that' not in x["text"]
                   and "\n    >>> " not in x["text"] for x in gen)
    seeds = P.self_instruct_seeds(50)
    assert len(seeds) == 50 and all("Write only" in s["text"] for s in seeds)


def test_draft_head_strip_restore(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file, save_file
    import draft_io as D
    base = tmp_path / "base"
    base.mkdir()
    emb = torch.randn(50, 8).to(torch.bfloat16)
    save_file({"model.embed_tokens.weight": emb}, str(base / "model.safetensors"))
    hot = torch.tensor([3, 7, 11, 40])
    full = {"d2t": hot - torch.arange(4), "fc.weight": torch.randn(8, 24).to(torch.bfloat16), "lm_head.weight": emb[hot].clone()}
    save_file(full, str(tmp_path / "full.safetensors"))
    D.strip(str(tmp_path / "full.safetensors"), str(base), str(tmp_path / "slim.safetensors"))
    assert "lm_head.weight" not in load_file(str(tmp_path / "slim.safetensors"))
    D.restore(str(tmp_path / "slim.safetensors"), str(base), str(tmp_path / "back.safetensors"))
    back = load_file(str(tmp_path / "back.safetensors"))
    assert all(torch.equal(back[k], full[k]) for k in full)
    full["lm_head.weight"] = full["lm_head.weight"] + 1  # a trained head must not be stripped
    save_file(full, str(tmp_path / "trained.safetensors"))
    with pytest.raises(SystemExit):
        D.strip(str(tmp_path / "trained.safetensors"), str(base), str(tmp_path / "x.safetensors"))


def test_identity_report():
    r = B.identity_report({"off": {"a": [1, 2, 3], "b": [4, 5]}, "static:s3": {"a": [1, 2, 3], "b": [4, 6]},
                           "x": {"a": [1, 2], "b": [4, 5]}})
    assert r["off"] == {"identical": 2, "of": 2, "first_divergence": {}}
    assert r["static:s3"] == {"identical": 1, "of": 2, "first_divergence": {"b": 1}}
    assert r["x"]["first_divergence"] == {"a": 2}
    assert B.identity_report({"static:s1": {"a": [1]}}) == {"static:s1": None}


def test_identity_report_reads_the_reference_margin_where_outputs_part():
    """With the no-spec server's top-1 - top-2 log-probability margins: the margin at each first divergence
    (a near-tie reads ~0) and the median margin for scale; positions past the margins' end are left out."""
    outs = {"off": {"a": [1, 2, 3, 4], "b": [4, 5, 6]}, "plugin-fixed:1:s3": {"a": [1, 2, 9, 9], "b": [4, 5, 7]}}
    margins = {"a": [3.0, 2.5, 0.002, 1.0], "b": [4.0, 1.5]}
    r = B.identity_report(outs, margins=margins)["plugin-fixed:1:s3"]
    assert r["first_divergence"] == {"a": 2, "b": 2}
    assert r["margin_at_divergence"] == {"a": 0.002}  # b's divergence lies past its margins
    assert r["median_margin"] == 2.5
    assert "margin_at_divergence" not in B.identity_report(outs)["plugin-fixed:1:s3"]


def test_walk_tau_follows_engine_chain_starts():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import train_draft as T
    acc = torch.tensor([[0, 0, 3, 1, 0, 2, 0, 0, 0, 0]])
    valid = torch.ones(1, 10, dtype=torch.bool)
    valid[0, 8:] = False
    # starts 0 (a=0), 1 (a=0), 2 (a=3), 6 (a=0), 7 (a=0): (1+1+4+1+1)/5
    assert T.walk_tau(acc, valid, torch.tensor([1]), 3) == pytest.approx(1.6)
    # capped at s=1: starts 0,1,2(a=1),4,5(a=1),7 -> (1+1+2+1+2+1)/6
    assert T.walk_tau(acc, valid, torch.tensor([1]), 1) == pytest.approx(8 / 6)


def test_server_args_shared_by_the_runner_and_the_checks():
    a = B.server_args(64, 0.85, max_total_tokens=80000)
    assert a[a.index("--max-running-requests") + 1] == "64" and a[a.index("--cuda-graph-max-bs-decode") + 1] == "64"
    assert a[a.index("--mem-fraction-static") + 1] == "0.85" and a[a.index("--max-total-tokens") + 1] == "80000"
    assert "--disable-prefill-cuda-graph" in a
    b = B.server_args(8, 0.2, prefill_graph=True)
    assert "--max-total-tokens" not in b and "--disable-prefill-cuda-graph" not in b
    assert a[a.index("--attention-backend") + 1] == "triton"
    f = B.server_args(8, 0.2, attention_backend="flashinfer")
    assert f[f.index("--attention-backend") + 1] == "flashinfer" and f.count("--attention-backend") == 1
    assert "--disable-radix-cache" not in a
    assert "--disable-radix-cache" in B.server_args(8, 0.2, radix_cache=False)


def test_identity_margins_and_deterministic_variant():
    import specctl_e2e as E
    assert E.variant_args("bfloat16") == ["--dtype", "bfloat16"]
    assert E.variant_args("bfloat16-det") == ["--dtype", "bfloat16", "--enable-deterministic-inference"]
    top2 = {"a": [2.0, 0.01, None], "b": [0.5]}
    assert E.margin_at(top2["a"], 1) == 0.01
    assert E.margin_at(top2["a"], 2) is None and E.margin_at(top2["a"], 9) is None and E.margin_at(None, 0) is None
    q = E.margin_quantiles(top2)
    assert q["n"] == 3 and q[0.01] == 0.01 and q[0.5] == 0.5
    assert E.margin_quantiles({"a": None}) is None


def test_paired_ratio_reads_adjacent_windows():
    import specctl_e2e as E
    r = E.paired_ratio([101.0, 99.0, 100.0], [100.0, 100.0, 100.0])
    assert r["pairs"] == 3 and r["ratio_with_over_without"] == 1.0 and r["ratio_min"] == 0.99 and r["ratio_max"] == 1.01
    lo, hi = r["ratio_ci95"]
    assert lo < 1.0 < hi and round(hi - 1.0, 4) == round(1.0 - lo, 4)
    assert E.paired_ratio([0.0], [100.0]) == {"ratio_with_over_without": None}
    assert "ratio_ci95" not in E.paired_ratio([100.0], [100.0])


def test_interleaved_ratios_compare_rounds_of_one_gpu_only():
    import interleaved_results as IR
    rounds = {(0, "off", 8): [100.0, 110.0], (0, "static:s3", 8): [120.0, 100.0], (0, "specctl", 8): [114.0, 110.0],
              (1, "off", 8): [500.0, 500.0], (1, "sglang-adaptive", 8): [50.0, 55.0], (1, "specctl", 8): [100.0, 110.0]}
    r = {(x["gpu_index"], x["concurrency"]): x for x in IR.ratios(rounds)}
    assert r[(0, 8)]["per_round"] == [0.95, 1.0]  # round 1: best static s3 120; round 2: off 110
    assert r[(0, 8)]["specctl_over_each_per_round"] == {"off": [1.14, 1.0], "static:s3": [0.95, 1.1]}
    assert r[(1, 8)]["per_round"] == [0.2, 0.22] and r[(1, 8)]["specctl_over_each_per_round"]["sglang-adaptive"] == [2.0, 2.0]
    assert IR.ratios({(0, "off", 1): [1.0]}) == []  # no specctl row: nothing to compare


def test_top2_margins_from_sglang_top_logprobs():
    import run_bench as RB
    meta = {"output_top_logprobs": [[[-0.1, 5, None], [-2.1, 7, None]], [[-1.0, 3, None]], None, [[None, 1, None], [-1, 2, None]]]}
    assert RB.top2_margins(meta) == [2.0, None, None, None]
    assert RB.top2_margins({}) == []


def test_step_costs(tmp_path):
    import step_costs as S
    d = tmp_path / "call"
    d.mkdir()
    runs = [{"policy": "off", "concurrency": 16, "repeats_step_ms": [6.0, 6.2]},
            {"policy": "plugin-fixed:1:s3", "concurrency": 16, "repeats_step_ms": [7.5, 7.75]},
            {"policy": "threshold:5:s3", "concurrency": 2, "repeats_step_ms": [5.0, 5.0, 5.1]},
            {"policy": "plugin-fixed:5:s3", "concurrency": 2, "repeats_step_ms": [5.05, 4.95, None]},
            {"policy": "static:s3", "concurrency": 1, "log": {"step_ms_med": 9.0}}]
    (d / "bench-g1.json").write_text(json.dumps({"runs": runs}))
    rows, pairs = S.report(S.load([str(d)]), "off", [("plugin-fixed:5:s3", "threshold:5:s3")])
    by = {(r["policy"], r["concurrency"]): r for r in rows}
    assert by[("plugin-fixed:1:s3", 16)]["over_off"]["per_round"] == [1.25, 1.25]
    assert by[("off", 16)]["step_ms"] == pytest.approx(6.1) and "over_off" not in by[("off", 16)]
    assert by[("static:s3", 1)]["step_ms"] == 9.0 and "over_off" not in by[("static:s3", 1)]  # no off at c=1
    assert by[("plugin-fixed:5:s3", 2)]["step_ms"] == pytest.approx(5.0)  # a round without lines is skipped
    assert len(pairs) == 1 and pairs[0]["per_round"] == [1.01, 0.99] and pairs[0]["gpu_index"] == 1


def test_tree_policies():
    """The issue-8 policies: SGLang's static tree, the threshold on the tree (the plugin's: SGLang's adaptive
    mode refuses topk 4) and specctl choosing among off, the launch chain and the tree."""
    args, env, cfg = B.policy_launch_args("static:tree", "/d")
    assert cfg is None and env == {} and "--speculative-adaptive" not in args
    assert [args[args.index(f) + 1] for f in ("--speculative-eagle-topk", "--speculative-num-steps",
                                               "--speculative-num-draft-tokens")] == ["4", "2", "16"]
    p = B.parse_policy("threshold:5:tree")
    assert p["kind"] == "plugin-fixed" and p["config"] == (2, 4, 16) and "SGLang refuses" in p["decided_by"]
    args, env, cfg = B.policy_launch_args("threshold:5:tree", "/d")
    assert cfg["specctl"] == {"states": {"2": [2, 4, 16]}} and cfg["1"]["candidate_steps"] == [0, 1, 2]
    assert args[args.index("--speculative-eagle-topk") + 1] == "1" and "--speculative-adaptive" in args
    assert args[args.index("--speculative-draft-model-path") + 1] == "/d"
    assert "--speculative-adaptive-config" not in args  # run_bench adds the path it writes cfg to
    assert env["SPECCTL_MODE"] == "fixed" and env["SPECCTL_FALLBACK"] == "5:2,4,16" and env["SGLANG_PLUGINS"] == "specctl"
    args, env, cfg = B.policy_launch_args("specctl:tree", "/d")
    assert env["SPECCTL_MODE"] == "online" and cfg["specctl"] == {"states": {"2": [2, 4, 16]}}
    assert B.daemon_configs(B.parse_policy("specctl:tree")) == "off,s1,s2k4n16"
    assert B.daemon_configs(B.parse_policy("specctl")) is None
    assert B.parse_policy("static:s2k4n8")["config"] == (2, 4, 8)
    with pytest.raises(ValueError):
        B.parse_policy("specctl:s3")


def test_tree_record_splits_a_sweep_into_its_up_and_down_legs(tmp_path):
    import tree_results as T

    rows = [{"policy": p, "concurrency": c, "t_start": t, "output_tokens_per_s": 100.0 + t, "accept_length": a}
            for p, base in (("threshold:5:tree", 0), ("static:tree", 100))
            for t, (c, a) in enumerate([(1, 2.08), (16, 1.01), (64, 1.01), (16, 1.01), (1, 2.05)], start=base)]
    got = [(x["policy"], x["concurrency"], leg) for x, leg in T.legs(rows)]
    assert got[:5] == [("threshold:5:tree", 1, "up"), ("threshold:5:tree", 16, "up"), ("threshold:5:tree", 64, "up"),
                       ("threshold:5:tree", 16, "down"), ("threshold:5:tree", 1, "down")]
    d = tmp_path / "call"
    d.mkdir()
    (d / "bench-g0.json").write_text(json.dumps({"gpu": "H200", "sglang": "0.5.17", "model": "m", "variant": "8b",
                                                 "draft": "d", "runs": rows, "phase_runs": [], "servers": {}}))
    out = tmp_path / "rec.json"
    sys.argv = ["tree_results.py", str(out), "--sweep", str(d)]
    T.main()
    rec = json.loads(out.read_text())
    acc = {(x["policy"], x["concurrency"]): (x["before"], x["after"]) for x in rec["acceptance_after_off"]}
    assert acc[("threshold:5:tree", 1)] == (2.08, 2.05) and ("threshold:5:tree", 64) not in acc
    assert {x["leg"] for x in rec["runs"]} == {"up", "down"}


def _telemetry_archive(path, rows):
    """A run_bench-style archive holding one gzipped telemetry file of the given frames."""
    import gzip
    import io
    import tarfile
    data = gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    with tarfile.open(path, "w:gz") as t:
        info = tarfile.TarInfo("g0/specctl-specctl/telemetry/telemetry-1.jsonl.gz")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("prompt_effect, low, high", [(False, 0.7, 1.4), (True, 4.0, None)])
def test_acceptance_correlation_design_effect(tmp_path, monkeypatch, prompt_effect, low, high):
    import numpy as np
    import acceptance_correlation as A
    rng = np.random.default_rng(0)
    rows = []
    for second in range(30):
        # 8 slots, 60 steps a second; with a prompt effect each slot's rate is its own
        p = rng.uniform(0.2, 0.9, 8) if prompt_effect else np.full(8, 0.55)
        for i in range(60):
            acc = (rng.random((8, 3)) < p[:, None]).cumprod(axis=1).sum(axis=1)
            rows.append({"ts": second + i / 60, "config": {"steps": 3, "topk": 1, "draft_tokens": 4},
                         "batch_size": 8, "accepted": acc.tolist(), "server": "s", "rank": 0})
    _telemetry_archive(tmp_path / "g0.tgz", rows)
    secs = list(A.seconds(A.frames(str(tmp_path / "g0.tgz"), "specctl-specctl/telemetry")))
    assert len(secs) == 30 and all(s[0] == 3 and s[1] == 8 and s[2].shape == (60, 8) for s in secs)
    out = tmp_path / "out.json"
    monkeypatch.setattr(sys, "argv", ["acceptance_correlation.py", f"{tmp_path / 'g0.tgz'}:specctl-specctl/telemetry",
                                      "--json", str(out)])
    A.main()
    (r,) = json.loads(out.read_text())["by_chain_and_batch"]
    assert r["seconds"] == 30 and r["deff"] > low and (high is None or r["deff"] < high)


@pytest.mark.parametrize("levels,phases,identity_c,resync,want", [
    ([1, 4, 16, 64, 128], (), 1, False, 128),
    ([], (2, 64, 8, 128, 1), 16, False, 128),
    ([], (), 1, True, B.RESYNC_PROBES + B.RESYNC_FILLERS),  # 2026-12-01: this call ran with a cap of 1
    ([], (), 16, False, 16),
    ([], (), 1, False, 1),
    ([2, 16], (), 1, True, 64),
])
def test_max_concurrency_covers_every_part_of_the_run(levels, phases, identity_c, resync, want):
    """A server's --max-running-requests holds every part of its run: the levels, the phases, the identity
    probe and the resync probe's probes beside its fillers; below that, requests queue and the figures lie."""
    assert B.max_concurrency(levels, phases, identity_c, resync=resync) == want


def test_closed_loop_clients_are_all_in_flight_at_once_beyond_100():
    """c = 128 closed-loop clients hold 128 requests open at once (aiohttp's default connector held 100, so every
    "c = 128" level and phase ran at most 100 at a time until 2026-12-03): a stdlib server that keeps each request
    open until 128 are in flight, or 3 s have passed, and records the most it saw."""
    pytest.importorskip("aiohttp")
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import run_bench as RB

    c = 128
    state = {"now": 0, "most": 0}
    lock, full = threading.Lock(), threading.Event()

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
                if state["now"] >= c:
                    full.set()
            full.wait(3.0)
            body = json.dumps({"meta_info": {"completion_tokens": 1}, "output_ids": [7]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            with lock:
                state["now"] -= 1

    class Server(ThreadingHTTPServer):
        request_queue_size = 2 * c  # the listen backlog (5 by default) would refuse a burst of 128 connects
        daemon_threads = True

    srv = Server(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        items = [{"ids": [1, 2, 3], "id": f"p{i}"} for i in range(4)]
        out, _ = asyncio.run(RB.closed_loop(srv.server_address[1], items, c, c, 1, stream=False))
    finally:
        srv.shutdown()
    assert len(out) == c and not any("error" in o for o in out)
    assert state["most"] == c


def test_the_moe_target_is_served_through_the_external_model_package(tmp_path):
    import run_bench as RB
    moe, dense = tmp_path / "moe", tmp_path / "dense"
    moe.mkdir(), dense.mkdir()
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen2_moe", "num_experts": 128,
                                                 "num_experts_per_tok": 8}))
    (dense / "config.json").write_text(json.dumps({"model_type": "llama"}))
    env, name = RB.target_env(str(moe), "moe")
    assert env["env"] == {"SGLANG_EXTERNAL_MODEL_PACKAGE": "specctl_testbed_models"}
    assert os.path.isdir(os.path.join(env["path"], "specctl_testbed_models"))
    assert "128 experts, top-8, build_moe.py" in name
    (moe / "config.json").write_text(json.dumps({"model_type": "qwen2_moe", "num_experts": 128,
                                                 "num_experts_per_tok": 8, "mlp_only_layers": list(range(30, 126))}))
    assert "128 experts, top-8, 96 zero-output dense tail layers" in RB.target_env(str(moe), "moe")[1]
    assert RB.target_env(str(dense), "8b") == (None, "SmolLM2-135M-Instruct zero-padded (8b)")
    assert RB.target_env(str(tmp_path / "missing"), "base") == (None, "SmolLM2-135M-Instruct")
