"""Helpers for plugin_smoke.sh: the specctl plugin inside a real SGLang server (runs THERE, and here in tests).

    plugin_smoke.py site REPO DEST          DEST/specctl/{policies,controller,training,plugin} -> REPO/...
                                            + DEST/specctl-0.1.0.dist-info (entry point sglang.srt.plugins)
    plugin_smoke.py policy PATH             the smoke policy: bs 1 -> s3, bs 2-3 -> s1, bs >= 4 -> off
    plugin_smoke.py listen ENDPOINT FILE    PULL-bind ENDPOINT, append every telemetry frame to FILE (one a line)
    plugin_smoke.py drive URL OUTJSON [wait_s] [levels]   wait for /health, closed-loop /generate per level
    plugin_smoke.py summary OUTDIR          server.log + telemetry.jsonl + client.json -> summary.json

No network, no install: the site is a folder on PYTHONPATH (specctl is a namespace package).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
import urllib.request

# the table the smoke test loads (SPECCTL_MODE=file); candidates built by SGLang: 0, 1, 3
TABLE = [(1, 1, 3), (2, 3, 1), (4, None, 0)]  # (min_batch, max_batch, steps)
CANDIDATES = "off,s1,s3"


def expected_steps(bs: int) -> int:
    for lo, hi, steps in TABLE:
        if bs >= lo and (hi is None or bs <= hi):
            return steps
    raise ValueError(bs)


def cmd_site(repo: str, dest: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import specctl_side  # one site builder for the smoke test, the TP=2 check and the runner

    specctl_side.make_site(dest, repo)
    print(f"specctl site at {dest}")


def policy_obj() -> dict:
    def cfg(steps: int) -> dict:
        return {"steps": steps, "topk": 1, "draft_tokens": steps + 1 if steps else 1}
    rows = []
    for lo, hi, steps in TABLE:
        row = {"min_batch": lo, "config": cfg(steps)}
        if hi is not None:
            row["max_batch"] = hi
        rows.append(row)
    return {"kind": "policy", "schema": 1, "version": 1, "created_at": time.time(), "source": "file",
            "table": rows}


def cmd_policy(path: str) -> None:
    with open(path, "w") as f:
        json.dump(policy_obj(), f)
    print(f"policy -> {path}")


def _specctl_site() -> None:
    """Make the specctl site importable (SPECCTL_SITE, as the smoke script builds it)."""
    site = os.environ.get("SPECCTL_SITE", "/tmp/specctl_site")
    if site not in sys.path:
        sys.path.insert(0, site)


def cmd_listen(endpoint: str, path: str) -> None:
    """Stand-in for the daemon's telemetry ingest: every frame, one per line, into PATH (the project's own
    socket builder, so the endpoint is checked and an ipc directory made private as for `specctl serve`)."""
    import zmq

    _specctl_site()
    from specctl.controller import transport

    s = transport.telemetry_pull(zmq.Context.instance(), endpoint)
    with open(path, "ab", buffering=0) as f:
        while True:
            frame = s.recv()
            f.write(frame.replace(b"\n", b" ") + b"\n")


def read_frames(path: str) -> tuple[list, int]:
    """A listener's JSONL (one frame a line): the parsed frames and how many lines did not parse."""
    frames, bad = [], 0
    if os.path.exists(path):
        for ln in open(path, "rb"):
            try:
                frames.append(json.loads(ln))
            except ValueError:
                bad += 1
    return frames, bad


def _get(url: str, t: float = 5) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=t) as r:
        return r.status, r.read().decode()


def _post(url: str, obj: dict, t: float = 120) -> dict:
    req = urllib.request.Request(url, data=json.dumps(obj).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=t) as r:
        return json.loads(r.read())


PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Config:\n    def __init__(self",
           "# compute the mean of a list", "for i in range(10):", "with open(path) as f:",
           "return self._cache[key]", "raise ValueError("]


def wait_healthy(url: str, until: float, pid: int, res: dict) -> dict:
    """Poll URL/health once a second until it answers 200 or the epoch time `until`, or until process `pid` is
    gone: sets res["ready"], res["server_died"] (when so) and res["start_s"]."""
    t0 = time.time()
    while time.time() < until:
        if pid and not os.path.exists(f"/proc/{pid}"):
            res["server_died"] = True
            break
        try:
            if _get(url + "/health", 2)[0] == 200:
                res["ready"] = True
                break
        except Exception:  # noqa: BLE001
            pass
        time.sleep(1)
    res["start_s"] = round(time.time() - t0, 1)
    print(f"ready={res['ready']} after {res['start_s']} s", flush=True)
    return res


def cmd_drive(url: str, out: str, wait_s: float = 240, levels: str = "1,2,8,1", pid: int = 0,
              max_new: int = 64, rounds: int = 3) -> dict:
    res: dict = {"ready": False}
    wait_healthy(url, time.time() + wait_s, pid, res)
    if res["ready"]:
        sp = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
        try:
            w = _post(url + "/generate", {"text": "hello", "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
            res["warm"] = {k: v for k, v in w.get("meta_info", {}).items() if k.startswith("spec") or k == "completion_tokens"}
        except Exception as e:  # noqa: BLE001
            res["warm_error"] = repr(e)
        res["levels"] = []
        for conc in (int(x) for x in levels.split(",")):
            outs: list = []
            lock = threading.Lock()

            def worker(i: int) -> None:
                for r in range(rounds):
                    t = time.time()
                    try:
                        o = _post(url + "/generate", {"text": PROMPTS[(i + r) % len(PROMPTS)], "sampling_params": sp})
                        o["_lat"] = time.time() - t
                    except Exception as e:  # noqa: BLE001
                        o = {"error": repr(e)}
                    with lock:
                        outs.append(o)

            t = time.time()
            th = [threading.Thread(target=worker, args=(i,)) for i in range(conc)]
            [x.start() for x in th]
            [x.join() for x in th]
            dt = time.time() - t
            good = [o for o in outs if "meta_info" in o]
            toks = sum(o["meta_info"].get("completion_tokens", 0) for o in good)
            acc = [o["meta_info"]["spec_accept_length"] for o in good
                   if o["meta_info"].get("spec_accept_length") is not None]
            row = {"conc": conc, "requests": len(outs), "ok": len(good), "tokens": toks, "wall_s": round(dt, 2),
                   "agg_tok_s": round(toks / dt, 1) if dt > 0 else None,
                   "spec_accept_length_mean": round(sum(acc) / len(acc), 3) if acc else None,
                   "spec_verify_ct": sum(o["meta_info"].get("spec_verify_ct", 0) or 0 for o in good),
                   "errors": [o["error"] for o in outs if "error" in o][:2],
                   "t_start": t, "t_end": t + dt}
            res["levels"].append(row)
            print(f"conc={conc} ok={row['ok']}/{row['requests']} tok={toks} {row['agg_tok_s']} tok/s "
                  f"accept_len={row['spec_accept_length_mean']} verify_ct={row['spec_verify_ct']}", flush=True)
        try:
            si = json.loads(_get(url + "/get_server_info", 10)[1])
            res["internal_states"] = si.get("internal_states", si.get("internal_state"))
        except Exception as e:  # noqa: BLE001
            res["server_info_error"] = repr(e)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    return res


LOG_PATTERNS = {
    "hooks_all_in_place": r"specctl: all \d+ hooks in place",
    "hook_not_effective": r"specctl: hook on .* did not take effect",
    "sglang_failed_hooks": r"Failed to apply hook",
    "plugin_executed": r"Executed general plugin: specctl",
    "plugin_failed": r"Failed to execute general plugin",
    "engine_ready": r"specctl: engine ready",
    "policy_in_force": r"specctl: policy v\d+",
    "fallback": r"specctl: fixed-threshold fallback",
    "specctl_warning_or_error": r"(WARNING|ERROR).*specctl|specctl: .*(error|off after|unavailable|idle)",
    "switch_state": r"Switch adaptive runtime state",
    "built_state": r"Built adaptive runtime state",
    "traceback": r"Traceback",
}


def summarize_log(text: str) -> dict:
    out: dict = {}
    lines = text.splitlines()
    for key, pat in LOG_PATTERNS.items():
        rx = re.compile(pat)
        hits = [ln for ln in lines if rx.search(ln)]
        out[key] = {"count": len(hits), "first": [h[-300:] for h in hits[:3]]}
    sw = re.compile(r"steps (\d+) -> (\d+)")
    trans: dict = {}
    for ln in lines:
        if "Switch adaptive runtime state" in ln:
            m = sw.search(ln)
            if m:
                k = f"{m.group(1)}->{m.group(2)}"
                trans[k] = trans.get(k, 0) + 1
    out["switch_transitions"] = trans
    out["specctl_lines"] = [ln[-300:] for ln in lines if "specctl" in ln][:40]
    return out


def _pct(xs: list, q: float):
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))], 4)


def summarize_telemetry(frames: list) -> dict:
    per: dict = {}
    match = mismatch = 0
    mism_examples = []
    prev = None
    lag_explained = 0
    accepted_ok = 0
    for fr in frames:
        bs = fr["batch_size"]
        steps = fr["config"]["steps"]
        key = f"bs{bs}/s{steps}"
        d = per.setdefault(key, {"n": 0, "step_ms": []})
        d["n"] += 1
        d["step_ms"].append(fr["step_ms"])
        if steps > 0 and fr.get("accepted") is not None and len(fr["accepted"]) == bs:
            accepted_ok += 1
        if steps == expected_steps(bs):
            match += 1
        else:
            mismatch += 1
            # the overlap scheduler: the previous batch's size may have decided this step
            if prev is not None and steps == expected_steps(prev["batch_size"]):
                lag_explained += 1
            if len(mism_examples) < 8:
                mism_examples.append({"iter": fr["iter"], "batch_size": bs, "steps": steps,
                                      "expected": expected_steps(bs),
                                      "prev_bs": prev["batch_size"] if prev else None})
        prev = fr
    table = {}
    for key, d in sorted(per.items()):
        ms = d["step_ms"]
        table[key] = {"n": d["n"], "step_ms_p10": _pct(ms, 0.1), "step_ms_p50": _pct(ms, 0.5),
                      "step_ms_p90": _pct(ms, 0.9), "step_ms_min": round(min(ms), 4), "step_ms_max": round(max(ms), 4)}
    # the first step in a runtime state after a switch (and the very first decode step)
    first_after_switch = [{"iter": b["iter"], "batch_size": b["batch_size"], "steps": b["config"]["steps"],
                           "step_ms": round(b["step_ms"], 3)}
                          for a, b in zip([None] + frames, frames) if a is None or a["config"] != b["config"]]
    # launch cadence (ts of consecutive iters, same batch size and config) against the CUDA-event time
    cad: dict = {}
    for a, b in zip(frames, frames[1:]):
        if b["iter"] == a["iter"] + 1 and a["batch_size"] == b["batch_size"] and a["config"] == b["config"]:
            c = cad.setdefault(f"bs{b['batch_size']}/s{b['config']['steps']}", {"cadence_ms": [], "event_ms": []})
            c["cadence_ms"].append((b["ts"] - a["ts"]) * 1000.0)
            c["event_ms"].append(b["step_ms"])
    cadence = {k: {"n": len(v["cadence_ms"]), "cadence_ms_p50": _pct(v["cadence_ms"], 0.5),
                   "event_ms_p50": _pct(v["event_ms"], 0.5)} for k, v in sorted(cad.items())}
    iters = [fr["iter"] for fr in frames]
    gaps = sum(1 for a, b in zip(iters, iters[1:]) if b != a + 1)
    return {"frames": len(frames), "by_batch_and_steps": table, "config_matches_table": match,
            "config_mismatches": mismatch, "mismatches_explained_by_previous_batch": lag_explained,
            "mismatch_examples": mism_examples, "frames_with_accepted_per_req": accepted_ok,
            "first_step_after_switch": first_after_switch, "cadence_vs_event": cadence,
            "iter_gaps": gaps, "servers": sorted({fr.get("server") for fr in frames}),
            "ranks": sorted({fr.get("rank") for fr in frames})}


def cmd_summary(outdir: str) -> dict:
    s: dict = {"expected_table": [{"min_batch": lo, "max_batch": hi, "steps": st} for lo, hi, st in TABLE]}
    logp = os.path.join(outdir, "server.log")
    if os.path.exists(logp):
        s["log"] = summarize_log(open(logp, errors="replace").read())
    tp = os.path.join(outdir, "telemetry.jsonl")
    frames, bad = read_frames(tp)
    s["telemetry"] = summarize_telemetry(frames)
    s["telemetry"]["unparsable_frames"] = bad
    try:
        _specctl_site()
        from specctl.controller import wire

        invalid = 0
        for ln in open(tp, "rb"):
            try:
                wire.decode_step(ln.strip()) if hasattr(wire, "decode_step") else None
            except Exception:  # noqa: BLE001
                invalid += 1
        s["telemetry"]["wire_invalid"] = invalid
    except Exception as e:  # noqa: BLE001
        s["telemetry"]["wire_check_error"] = repr(e)
    cp = os.path.join(outdir, "client.json")
    if os.path.exists(cp):
        c = json.load(open(cp))
        s["client"] = {k: c.get(k) for k in ("ready", "start_s", "warm", "levels", "server_died")}
        ist = c.get("internal_states")
        s["client"]["internal_states"] = json.dumps(ist)[:1500] if ist is not None else None
        # which steps did telemetry show inside each level's time window
        for row in c.get("levels") or []:
            win = [fr for fr in frames if row["t_start"] <= fr["ts"] <= row["t_end"]]  # ts = launch time
            cnt: dict = {}
            for fr in win:
                k = f"bs{fr['batch_size']}/s{fr['config']['steps']}"
                cnt[k] = cnt.get(k, 0) + 1
            row["telemetry_in_window"] = cnt
    with open(os.path.join(outdir, "summary.json"), "w") as f:
        json.dump(s, f, indent=1)
    return s


if __name__ == "__main__":
    a = sys.argv[1:]
    if a[0] == "site":
        cmd_site(a[1], a[2])
    elif a[0] == "policy":
        cmd_policy(a[1])
    elif a[0] == "listen":
        cmd_listen(a[1], a[2])
    elif a[0] == "drive":
        cmd_drive(a[1], a[2], float(a[3]) if len(a) > 3 else 240, a[4] if len(a) > 4 else "1,2,8,1",
                  int(a[5]) if len(a) > 5 else 0)
    elif a[0] == "summary":
        s = cmd_summary(a[1])
        log = s.get("log", {})
        print("SUMMARY", json.dumps({
            "hooks_all_in_place": log.get("hooks_all_in_place", {}).get("count"),
            "hook_problems": log.get("hook_not_effective", {}).get("count"),
            "policy_in_force": log.get("policy_in_force", {}).get("count"),
            "fallback": log.get("fallback", {}).get("count"),
            "switches": log.get("switch_transitions"),
            "tracebacks": log.get("traceback", {}).get("count"),
            "frames": s["telemetry"]["frames"], "match": s["telemetry"]["config_matches_table"],
            "mismatch": s["telemetry"]["config_mismatches"],
            "by": {k: (v["n"], v["step_ms_p50"]) for k, v in s["telemetry"]["by_batch_and_steps"].items()}}))
    else:
        sys.exit(f"unknown command {a[0]}")
