"""specctl end to end inside a real SGLang 0.5.17 server on the GPU machine: the checks of issue 4.

    specctl_e2e.py online   --model /tmp/m/8b --draft /tmp/m/draft --out DIR
        plugin (online) + `specctl serve`, one server; stages on one timeline:
          learn     closed loop at c = 1, 4, 16, 64 (the daemon sees every region)
          before    12 MT-Bench prompts one at a time (c=1): accept length and output ids per prompt
          off       c=64 for --off-s seconds, plain decode forced: the daemon is stopped and an override
                    publishes "steps 0 at every batch size" at its endpoint; the daemon then restarts
          after     the same 12 prompts at c=1: accept length back to `before`? ids identical?
          kill      c=4 closed loop; SIGKILL the daemon after 5 s, restart it (same state dir) 15 s later:
                    no request fails, the plugin falls back after SPECCTL_STALE_AFTER_S and takes the
                    restored policy version back
        audits every decision of the plugin (SPECCTL_DECISION_LOG) against the daemon's published tables,
        counts SGLang's own `Switch adaptive runtime state` lines, telemetry per stage -> DIR/online.json
    specctl_e2e.py identity --model /tmp/m/base --draft /tmp/m/draft --out DIR [--variants bfloat16,bfloat16-det]
        per variant three servers: `off`, `static:s3` (SGLang's EAGLE-3 alone) and specctl (file mode: bs 1-2 -> s3,
        3-8 -> s1, 9+ -> off); 32 prompts sent at once with max_new_tokens 24..272, so the batch shrinks through
        every row of the table while requests decode; greedy output ids compared with off prompt by prompt, and
        where they differ, off's own top-1 minus top-2 log-probability at the first differing position (a
        near-tie or not) -> DIR/identity.json; `-det` adds --enable-deterministic-inference
    specctl_e2e.py overhead --model /tmp/m/8b --draft /tmp/m/draft --out DIR
        threshold:5:s3 without and with the plugin (fixed mode, telemetry to a live daemon), both servers on
        the same GPU, measured alternately (A B B A A B ...) at each level on the same request set every window;
        paired ratios with a 95 % interval -> DIR/overhead.json

Runs THERE with PYTHONPATH=/tmp/site (device_call.sh e2e); stdlib + aiohttp + the specctl site.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics as st
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prompts as P  # noqa: E402
import run_bench as RB  # noqa: E402
import specctl_side as SC  # noqa: E402
from benchlib import eagle_args, identity_report, paired_ratios, server_args, summarize_requests  # noqa: E402

T0 = time.time()
FILE_TABLE = [(1, 2, 3), (3, 8, 1), (9, None, 0)]  # identity: every candidate used while the batch shrinks


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


MAX_TOTAL_TOKENS = 80000  # per server KV cap, so that servers started together on one GPU all fit (run_bench.py)


def common_args(maxc, memf):
    return server_args(maxc, memf, max_total_tokens=MAX_TOTAL_TOKENS)


async def timed_loop(port, items, conc, duration_s, new, offset=0):
    """c closed-loop streaming clients for duration_s (requests started before the end finish)."""
    out, nxt = [], [offset]
    t_end = time.time() + duration_s
    async with RB.client_session() as s:
        async def worker():
            while time.time() < t_end:
                x = items[nxt[0] % len(items)]
                nxt[0] += 1
                await RB.one_request(s, port, x["ids"], new, out, True, x.get("id"))
        t = time.time()
        await asyncio.gather(*[worker() for _ in range(conc)])
        return out, time.time() - t


async def one_by_one(port, items, new):
    """Each prompt alone (c=1), non-streaming: output ids and accept length per prompt."""
    out = []
    async with RB.client_session() as s:
        for x in items:
            await RB.one_request(s, port, x["ids"], new, out, False, x.get("id"))
    return out


def per_prompt(outs):
    return {o.get("pid"): {"ids": o.get("ids"), "accept": (o["tokens"] / o["verify_ct"]) if o.get("verify_ct") else None}
            for o in outs if "error" not in o}


def grep(path, pat, n=8):
    rx = re.compile(pat)
    try:
        lines = [ln.rstrip()[-300:] for ln in open(path, errors="replace") if rx.search(ln)]
    except OSError:
        return {"count": 0, "lines": []}
    return {"count": len(lines), "lines": lines[:n] + (lines[-2:] if len(lines) > n else [])}


def telemetry_by_window(tel_dir, windows):
    """Recorded step frames (the daemon's --record) grouped by stage window: steps histogram, batch sizes."""
    import gzip
    frames = []
    for root, _, files in os.walk(tel_dir):
        for fn in files:
            if not fn.endswith((".jsonl", ".jsonl.gz")):
                continue
            op = gzip.open if fn.endswith(".gz") else open
            try:
                with op(os.path.join(root, fn), "rt") as f:
                    for ln in f:
                        try:
                            frames.append(json.loads(ln))
                        except ValueError:
                            pass
            except (OSError, EOFError):
                pass  # a file cut by a SIGKILL: what was flushed was read
    res = {}
    for name, (t0, t1) in windows.items():
        fr = [x for x in frames if x.get("kind") == "step" and t0 <= x.get("ts", 0) < t1]
        steps, bs = {}, []
        for x in fr:
            s = x["config"]["steps"]
            steps[s] = steps.get(s, 0) + 1
            bs.append(x["batch_size"])
        res[name] = {"frames": len(fr), "steps": dict(sorted(steps.items())),
                     "batch_size_med": st.median(bs) if bs else None}
    return {"frames_total": len(frames), "windows": res}


# ---------------------------------------------------------------- online

def cmd_online(a):
    os.makedirs(a.out, exist_ok=True)
    site = SC.make_site(a.site)
    mtb, he = P.load_benchmark_sets(a.model, a.prompts)
    mixed = [x for pair in zip(mtb, he) for x in pair]
    rundir, state = "/tmp/specctl-e2e-run", "/tmp/specctl-e2e-state"
    shutil.rmtree(state, ignore_errors=True)  # learn from scratch (the kill stage restarts on this dir)
    d = SC.Daemon(rundir=rundir, state_dir=state, site=site, log_path=os.path.join(a.out, "serve.log"),
                  record_dir=os.path.join(a.out, "telemetry"))
    d.start()
    env = SC.with_pythonpath(dict(os.environ, **SC.plugin_env(
        mode="online", rundir=rundir, server_id="e2e-8b", stale_after_s=a.stale_s,
        decision_log=os.path.join(a.out, "decisions-rank{rank}.txt"))), site)
    cfg = os.path.join(a.out, "adaptive.json")
    json.dump({"1": {"candidate_steps": [0, 1, 2, 3]}}, open(cfg, "w"))
    args = common_args(64, a.mem_fraction) + eagle_args(a.draft, 3) + [
        "--speculative-adaptive", "--speculative-adaptive-config", cfg]
    sv = RB.start_server(a.model, a.port, args, env, os.path.join(a.out, "server.log"))
    res = {"model": a.model, "draft": a.draft, "stale_after_s": a.stale_s, "stages": {}, "windows": {}}
    try:
        ok = RB.wait_ready(sv, a.ready_s)
        res["ready"], res["ready_s"] = ok, round(time.time() - sv["t"], 1)
        log("server ready" if ok else "server NOT ready", res["ready_s"], "s")
        if not ok:
            res["server_tail"] = open(sv["log"], errors="replace").read()[-3000:]
            return res
        asyncio.run(RB.closed_loop(a.port, mixed[:8], 8, 8, 16))
        port = a.port

        def stage(name, fn):
            t0 = time.time()
            r = fn()
            res["windows"][name] = (t0, time.time())
            log(name, json.dumps({k: v for k, v in r.items() if k != "per_prompt"})[:400])
            res["stages"][name] = r
            return r

        def learn():
            rows = []
            for c in (1, 4, 16, 64):
                outs, wall = asyncio.run(timed_loop(port, mixed, c, a.learn_s, a.new_tokens, offset=40))
                rows.append({"concurrency": c, **summarize_requests(outs, wall)})
            return {"levels": rows, "policy": d.status()["policy"]}
        stage("learn", learn)
        probe = mtb[:12]

        def alone():
            outs = asyncio.run(one_by_one(port, probe, a.probe_tokens))
            pp = per_prompt(outs)
            acc = [v["accept"] for v in pp.values() if v["accept"]]
            return {"requests": len(outs), "errors": sum(1 for o in outs if "error" in o),
                    "accept_length_mean": round(st.mean(acc), 4) if acc else None, "per_prompt": pp}
        before = stage("before", alone)

        def off_period():
            # force plain decode: the daemon stops (state kept), an override publishes "steps 0 everywhere" at its
            # endpoint for the whole stage, then the daemon comes back on the same state dir
            ver = d.status()["policy"]["version"]
            d.stop()
            ov = SC.Override(rundir, [(1, None, 0)], version=ver + 1000)
            ov.start()
            try:
                outs, wall = asyncio.run(timed_loop(port, mixed, 64, a.off_s, a.new_tokens, offset=100))
            finally:
                ov.stop()
                st_ = d.start()
            r = summarize_requests(outs, wall)
            r.update(override_version=ov.version, override_frames=ov.sent, version_after=st_["policy"]["version"])
            res["override_policy"] = ov.obj()
            return r
        stage("off", off_period)
        after = stage("after", alone)
        same_ids = sum(1 for k, v in before["per_prompt"].items()
                       if k in after["per_prompt"] and after["per_prompt"][k]["ids"] == v["ids"])
        res["acceptance_after_off"] = {
            "before": before["accept_length_mean"], "after": after["accept_length_mean"],
            "ratio": round(after["accept_length_mean"] / before["accept_length_mean"], 4)
            if before["accept_length_mean"] and after["accept_length_mean"] else None,
            "per_prompt": {k: [v["accept"], after["per_prompt"].get(k, {}).get("accept")] for k, v in before["per_prompt"].items()},
            "ids_identical_before_after": f"{same_ids}/{len(before['per_prompt'])}"}

        def kill_restart():
            ver_before = d.status()["policy"]["version"]
            marks = {}

            async def run():
                task = asyncio.ensure_future(timed_loop(port, mixed, 4, a.kill_total_s, a.new_tokens, offset=200))
                loop = asyncio.get_running_loop()
                await asyncio.sleep(5)
                await loop.run_in_executor(None, d.kill, signal.SIGKILL)
                marks["killed"] = time.time()
                await asyncio.sleep(a.dead_s)
                st_ = await loop.run_in_executor(None, d.start)  # the clients keep going meanwhile
                marks["restarted"] = time.time()
                marks["version_after_restart"] = st_["policy"]["version"]
                return await task
            outs, wall = asyncio.run(run())
            r = summarize_requests(outs, wall)
            r.update(version_before_kill=ver_before, **marks)
            return r
        stage("kill", kill_restart)
    finally:
        RB.kill_tree(sv["proc"])
        time.sleep(3)
        d.stop()
        d.save(os.path.join(a.out, "policies.json"))
    from specctl.policies.fixed import fixed_threshold
    from specctl.policies.table import chain
    dec = SC.read_decisions(os.path.join(a.out, "decisions-rank0.txt"))
    published = {v: x["policy"] for v, x in d.policies.items()}
    if res.get("override_policy"):
        published[res["override_policy"]["version"]] = res["override_policy"]
    res["audit"] = SC.audit_decisions(dec, published,
                                      fallback=fixed_threshold(5, chain(3)))
    slog = os.path.join(a.out, "server.log")
    res["audit"]["sglang_switch_lines"] = SC.count_switch_lines(open(slog, errors="replace").read())
    res["log"] = {k: grep(slog, p) for k, p in {
        "policy_in_force": r"specctl: policy v\d+", "fallback": r"specctl: fixed-threshold fallback",
        "hooks": r"specctl: all \d+ hooks in place|did not take effect", "engine": r"specctl: engine ready",
        "switch": r"Switch adaptive runtime state", "traceback": r"Traceback", "error": r"\bERROR\b"}.items()}
    res["telemetry"] = telemetry_by_window(os.path.join(a.out, "telemetry"), res["windows"])
    res["daemon_events"] = d.events
    return res


# ---------------------------------------------------------------- identity

def file_policy(path):
    rows = []
    for lo, hi, s in FILE_TABLE:
        r = {"min_batch": lo, "config": {"steps": s, "topk": 1, "draft_tokens": s + 1 if s else 1}}
        if hi is not None:
            r["max_batch"] = hi
        rows.append(r)
    json.dump({"kind": "policy", "schema": 1, "version": 1, "created_at": time.time(), "source": "file", "table": rows},
              open(path, "w"))


IDENTITY_MODES = ("off", "static:s3", "specctl")


def variant_args(v):
    """'bfloat16' or 'bfloat16-det' (SGLang's --enable-deterministic-inference: batch-invariant kernels)."""
    dt, _, det = v.partition("-")
    return ["--dtype", dt] + (["--enable-deterministic-inference"] if det == "det" else [])


def cmd_identity(a):
    """Per variant three servers: off, static:s3 (SGLang's own EAGLE-3, no specctl) and specctl (file table).
    Same prompts sent at once; greedy ids compared with off. Where they differ, the off server's own top-2
    log-probabilities at the first differing position say whether it was a near-tie (a numerical coin flip
    between two kernels) or a real disagreement."""
    os.makedirs(a.out, exist_ok=True)
    site = SC.make_site(a.site)
    mtb, he = P.load_benchmark_sets(a.model, a.prompts)
    items = [x for pair in zip(mtb, he) for x in pair][:a.n_prompts]
    pol = os.path.join(a.out, "identity-policy.json")
    file_policy(pol)
    cfg = os.path.join(a.out, "adaptive.json")
    json.dump({"1": {"candidate_steps": [0, 1, 3]}}, open(cfg, "w"))
    variants = [v for v in a.variants.split(",") if v]
    servers = {}
    k = 0
    for v in variants:
        for mode in IDENTITY_MODES:
            args = common_args(64, a.mem_fraction) + variant_args(v)
            env = dict(os.environ)
            if mode == "static:s3":
                args += eagle_args(a.draft, 3)
            elif mode == "specctl":
                args += eagle_args(a.draft, 3) + ["--speculative-adaptive", "--speculative-adaptive-config", cfg]
                env = SC.with_pythonpath(dict(env, SGLANG_PLUGINS="specctl", SPECCTL_MODE="file",
                                              SPECCTL_POLICY_FILE=pol, SPECCTL_TELEMETRY="none", SPECCTL_POLICY="none",
                                              SPECCTL_DECISION_LOG=os.path.join(a.out, f"decisions-{v}-rank{{rank}}.txt")), site)
            tag = mode.replace(":", "_")
            servers[(v, mode)] = RB.start_server(a.model, a.port + 10 * k, args, env, os.path.join(a.out, f"identity-{v}-{tag}.log"))
            k += 1
    res = {"model": a.model, "table": FILE_TABLE, "n_prompts": len(items), "variants": {}}
    try:
        for key, sv in servers.items():
            sv["ok"] = RB.wait_ready(sv, a.ready_s)
            log("ready" if sv["ok"] else "NOT READY", key, round(time.time() - sv["t"], 1), "s")
        for v in variants:
            outs = {}
            for mode in IDENTITY_MODES:
                sv = servers[(v, mode)]
                outs[mode] = asyncio.run(all_at_once(sv["port"], items, a.min_tokens, a.step_tokens)) if sv["ok"] else None
            r = {"ready": {m: servers[(v, m)]["ok"] for m in IDENTITY_MODES}}
            if outs["off"] is not None:
                ref = {o["pid"]: o.get("ids") for o in outs["off"] if "error" not in o}
                # the off server again, with its top-2 log-probabilities at every output position
                lp = asyncio.run(all_at_once(servers[(v, "off")]["port"], items, a.min_tokens, a.step_tokens, top2=True))
                top2 = {o["pid"]: o.get("top2") for o in lp if "error" not in o}
                r["off_repeat_identical"] = sum(1 for o in lp if "error" not in o and o.get("ids") == ref.get(o["pid"]))
                r["off_margin_quantiles"] = margin_quantiles(top2)
                for mode in IDENTITY_MODES[1:]:
                    if outs[mode] is None:
                        continue
                    got = {o["pid"]: o.get("ids") for o in outs[mode] if "error" not in o}
                    rep = identity_report({"off": ref, mode: got})[mode]
                    rep["tokens_compared"] = sum(len(ref[p]) for p in got if p in ref and ref[p] is not None)
                    rep["errors"] = sum(1 for o in outs[mode] if "error" in o)
                    rep["margin_at_divergence"] = {p: margin_at(top2.get(p), j) for p, j in rep["first_divergence"].items()}
                    r[mode] = rep
            dl = os.path.join(a.out, f"decisions-{v}-rank0.txt")
            if os.path.exists(dl):
                hist = {}
                for _, _, st_, *_ in SC.read_decisions(dl):
                    hist[st_] = hist.get(st_, 0) + 1
                r["specctl_steps_used"] = dict(sorted(hist.items()))
            r["sglang_switch_lines"] = SC.count_switch_lines(open(servers[(v, "specctl")]["log"], errors="replace").read())
            r["tails"] = {m: open(servers[(v, m)]["log"], errors="replace").read()[-1500:] for m in IDENTITY_MODES
                          if not servers[(v, m)]["ok"]}
            res["variants"][v] = r
            log("identity", v, json.dumps({k2: (x if k2 != "tails" else list(x)) for k2, x in r.items()})[:900])
    finally:
        for sv in servers.values():
            RB.kill_tree(sv["proc"])
    return res


def margin_at(top2, j):
    """log p(top-1) - log p(top-2) of the off server at output position j (None where not recorded)."""
    if not top2 or j is None or j >= len(top2) or top2[j] is None:
        return None
    return round(top2[j], 4)


def margin_quantiles(top2):
    m = sorted(x for v in top2.values() if v for x in v if x is not None)
    if not m:
        return None
    return {q: round(m[min(len(m) - 1, int(q * len(m)))], 4) for q in (0.01, 0.05, 0.1, 0.5)} | {"n": len(m)}


async def all_at_once(port, items, min_tokens, step_tokens, top2=False):
    out = []
    async with RB.client_session() as s:
        await asyncio.gather(*[RB.one_request(s, port, x["ids"], min_tokens + step_tokens * i, out, False, x.get("id"),
                                              top2=top2) for i, x in enumerate(items)])
    return out


# ---------------------------------------------------------------- overhead

def cmd_overhead(a):
    os.makedirs(a.out, exist_ok=True)
    site = SC.make_site(a.site)
    mtb, he = P.load_benchmark_sets(a.model, a.prompts)
    mixed = [x for pair in zip(mtb, he) for x in pair]
    cfg = os.path.join(a.out, "adaptive-threshold.json")
    json.dump({"1": {"candidate_steps": [3]}, "5": {"candidate_steps": [0]}}, open(cfg, "w"))
    rundir = "/tmp/specctl-ovh-run"
    d = SC.Daemon(rundir=rundir, state_dir="/tmp/specctl-ovh-state", site=site, log_path=os.path.join(a.out, "serve-ovh.log"),
                  extra=("--mode", "fixed"))
    d.start()
    base_args = common_args(64, a.mem_fraction) + eagle_args(a.draft, 3) + [
        "--speculative-adaptive", "--speculative-adaptive-config", cfg]
    env_plain = dict(os.environ)
    env_plug = SC.with_pythonpath(dict(os.environ, **SC.plugin_env(mode="fixed", rundir=rundir, server_id="ovh",
                                                                   threshold=5, config="s3")), site)
    sv = {"without": RB.start_server(a.model, a.port, base_args, env_plain, os.path.join(a.out, "ovh-without.log")),
          "with": RB.start_server(a.model, a.port + 10, base_args, env_plug, os.path.join(a.out, "ovh-with.log"))}
    res = {"policy": "threshold:5:s3", "levels": [], "reps": a.reps, "requests_per_window": a.ovh_req}
    try:
        for k, s in sv.items():
            s["ok"] = RB.wait_ready(s, a.ready_s)
            log(k, "ready" if s["ok"] else "NOT READY", round(time.time() - s["t"], 1), "s")
        if not all(s["ok"] for s in sv.values()):
            res["tails"] = {k: open(s["log"], errors="replace").read()[-1500:] for k, s in sv.items() if not s["ok"]}
            return res
        for s in sv.values():
            asyncio.run(RB.closed_loop(s["port"], mixed[:8], 8, 8, 16))
        for c in (int(x) for x in a.levels.split(",")):
            n_req = int(eval(a.ovh_req, {"max": max, "min": min}, {"c": c}))
            runs = {"without": [], "with": []}
            order = ["without", "with"]
            for rep in range(a.reps):  # the same n_req requests in every window: only the server differs
                for k in (order if rep % 2 == 0 else order[::-1]):
                    outs, wall = asyncio.run(RB.closed_loop(sv[k]["port"], mixed, c, n_req, a.new_tokens))
                    runs[k].append(summarize_requests(outs, wall)["output_tokens_per_s"])
            row = {"concurrency": c, "requests_per_window": n_req, "tok_s_without": runs["without"],
                   "tok_s_with": runs["with"], **paired_ratio(runs["with"], runs["without"]),
                   "rep_spread_without": round((max(runs["without"]) - min(runs["without"])) / st.mean(runs["without"]), 4)}
            res["levels"].append(row)
            log("overhead", json.dumps(row))
        res["plugin_log"] = grep(sv["with"]["log"], r"specctl:")
    finally:
        for s in sv.values():
            RB.kill_tree(s["proc"])
        d.stop()
    return res


def paired_ratio(with_, without):
    """Ratios of adjacent windows (with / without, one pair per repetition): mean, median, range and a 95 %
    t interval of the mean, so that 'within 0.5 %' is read against the measurement's own resolution."""
    r = paired_ratios(with_, without)
    if not r:
        return {"ratio_with_over_without": None}
    out = {"ratio_with_over_without": r["mean"], "ratio_median": r["median"], "ratio_min": r["min"],
           "ratio_max": r["max"], "pairs": r["pairs"]}
    if "ci95" in r:
        out["ratio_ci95"] = r["ci95"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["online", "identity", "overhead"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", default="/tmp/specctl-stash/aux/prompts")
    ap.add_argument("--site", default="/tmp/specctl_site")
    ap.add_argument("--port", type=int, default=32000)
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--ready-s", type=float, default=300)
    ap.add_argument("--new-tokens", type=int, default=128)
    # online
    ap.add_argument("--stale-s", type=float, default=5.0)
    ap.add_argument("--learn-s", type=float, default=10.0)
    ap.add_argument("--probe-tokens", type=int, default=128)
    ap.add_argument("--off-s", type=float, default=45.0)
    ap.add_argument("--kill-total-s", type=float, default=35.0)
    ap.add_argument("--dead-s", type=float, default=15.0)
    # identity
    ap.add_argument("--variants", default="bfloat16,bfloat16-det",
                    help="dtype[-det] per server trio; -det = --enable-deterministic-inference")
    ap.add_argument("--n-prompts", type=int, default=32)
    ap.add_argument("--min-tokens", type=int, default=24)
    ap.add_argument("--step-tokens", type=int, default=8)
    # overhead
    ap.add_argument("--levels", default="2,16")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--ovh-req", default="max(6*c,24)", help="requests per window (python expression in c); the "
                                                             "same requests in every window")
    a = ap.parse_args()
    fn = {"online": cmd_online, "identity": cmd_identity, "overhead": cmd_overhead}[a.cmd]
    res = fn(a)
    res["wall_s"] = round(time.time() - T0, 1)
    path = os.path.join(a.out, f"{a.cmd}.json")
    json.dump(res, open(path, "w"), indent=1, default=str)
    log("wrote", path)


if __name__ == "__main__":
    main()
