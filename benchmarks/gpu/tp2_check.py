"""Helpers for tp2_check.sh: the TP=2 consistency check of the specctl plugin (runs THERE, and here in tests).

    tp2_check.py publish ENDPOINT OUTJSONL [period_s] [duration_s]
        bind a policy PUB at ENDPOINT (controller/transport.policy_pub, the daemon's own), publish a new
        version every period_s (versions 1, 2, ...; tables cycle through TABLES), one JSON line per
        published frame -> OUTJSONL: {"t", "version", "table": [[min, max, steps], ...]}
    tp2_check.py drive URL OUTJSON DECISION_LOG DEADLINE_EPOCH [target] [levels] [server_pid]
        wait for /health, then closed-loop /generate at concurrencies cycling through `levels` (a few
        seconds each) until DECISION_LOG (rank 0's) holds `target` decisions or the deadline comes;
        records every request error / timeout (a hang shows up as timeouts); env TP2_LEVEL_S (2.5),
        TP2_MAX_NEW (128 new tokens a request), TP2_REQ_TIMEOUT (30 s)
    tp2_check.py compare OUTDIR [min_decisions]
        decisions-rank0.txt vs decisions-rank1.txt (+ published.jsonl, telemetry.jsonl, server.log,
        client.json) -> OUTDIR/summary.json with the verdict; prints it

The decision logs are the plugin's own (SPECCTL_DECISION_LOG, plugin/engine.py): one line
`step batch_size steps version` per decision (version `F`: the fixed-threshold fallback), `#` header.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plugin_smoke as PS  # noqa: E402  (same folder: summarize_log, _get, _post, PROMPTS)
import benchlib as B  # noqa: E402  (same folder: TREE)
import specctl_side as SC  # noqa: E402  (same folder: policy_obj)

# candidate steps built by SGLang (plugin_smoke_adaptive.json): 0, 1, 3. (min_batch, max_batch, steps)
TABLES: list[list[tuple[int, Optional[int], int]]] = [
    [(1, 2, 3), (3, 7, 1), (8, None, 0)],
    [(1, None, 1)],
    [(1, 8, 3), (9, None, 0)],
    [(1, None, 0)],
]
CANDIDATES = (0, 1, 3)
# TP2_TREE=1: the seed operator's tree (topk 4, 2 steps, 16 tokens) is runtime state 2 beside off, s1 and s3
# (`specctl sglang-args --configs off,s1,s2k4n16,s3`); rows name a configuration triple where it is the tree
TREE = B.TREE
TREE_TABLES: list[list[tuple[int, Optional[int], Any]]] = [
    [(1, 2, TREE), (3, 7, 1), (8, None, 0)],
    [(1, None, TREE)],
    [(1, 4, 3), (5, 12, TREE), (13, None, 0)],
    [(1, None, 0)],
    [(1, 3, 1), (4, None, TREE)],
]
TREE_CANDIDATES = (0, 1, 2, 3)
LEVELS = "1,2,4,8,16,32"


def tree_mode() -> bool:
    return os.environ.get("TP2_TREE", "") == "1"


def table_for(version: int) -> list[tuple[int, Optional[int], Any]]:
    tables = TREE_TABLES if tree_mode() else TABLES
    return tables[(version - 1) % len(tables)]


def key_rows(rows) -> list[tuple[int, Optional[int], int]]:
    """Rows with SGLang's state key (steps) in place of a configuration triple."""
    return [(lo, hi, c if isinstance(c, int) else c[0]) for lo, hi, c in rows]


def lookup(rows, bs: int) -> int:
    bs = max(1, bs)
    for lo, hi, steps in key_rows(rows):
        if bs >= lo and (hi is None or bs <= hi):
            return steps
    raise ValueError(f"no row for batch size {bs}")


def policy_frame(version: int) -> bytes:
    """The wire frame of `version`, built and checked by the real wire code."""
    from specctl.controller import wire

    return wire.encode(wire.policy_from_obj(SC.policy_obj(version, table_for(version), source="online")))


# ----------------------------------------------------------------------------- publish

def cmd_publish(endpoint: str, out: str, period_s: float = 0.5, duration_s: float = 0.0,
                stop: Optional[threading.Event] = None) -> int:
    """Publish versions 1, 2, ... every period_s until killed, `duration_s` (> 0) or `stop`."""
    import zmq

    from specctl.controller import transport

    ctx = zmq.Context.instance()
    pub = transport.policy_pub(ctx, endpoint)
    policy_frame(1)  # imports pydantic and the wire models before the clock starts
    t0 = nxt = time.time()
    v = 0
    try:
        with open(out, "a", buffering=1) as f:
            while True:
                v += 1
                frame = policy_frame(v)
                pub.send(frame)
                f.write(json.dumps({"t": round(time.time(), 4), "version": v,
                                    "table": [list(r) for r in key_rows(table_for(v))]}) + "\n")
                nxt = max(nxt + period_s, time.time() + period_s / 2)  # never a burst after a stall
                while True:
                    if stop is not None and stop.is_set():
                        return v
                    left = nxt - time.time()
                    if left <= 0:
                        break
                    time.sleep(min(left, 0.05))
                if duration_s and time.time() - t0 >= duration_s:
                    return v
    finally:
        pub.close(linger=0)


# ----------------------------------------------------------------------------- decision logs

def parse_decisions(path: str) -> dict:
    """A rank's decision log: header lines, complete decision lines (strings), malformed lines, and
    whether the last line was cut (no newline: dropped)."""
    res: dict = {"path": path, "exists": os.path.exists(path), "headers": [], "lines": [], "malformed": [],
                 "partial_tail": None}
    if not res["exists"]:
        return res
    with open(path, "rb") as f:
        data = f.read().decode("utf-8", errors="replace")
    parts = data.split("\n")
    if parts and parts[-1] != "":
        res["partial_tail"] = parts[-1][:200]
    for ln in parts[:-1]:
        if ln.startswith("#"):
            res["headers"].append(ln)
        elif ln.strip():
            f4 = ln.split()  # a fifth field: the batch's ctx_tokens, where the plugin read it
            if len(f4) in (4, 5) and f4[0].isdigit() and f4[1].isdigit() and f4[2].isdigit() \
                    and (f4[3] == "F" or f4[3].isdigit()) and (len(f4) == 4 or f4[4].isdigit()):
                res["lines"].append(ln.strip())
            else:
                res["malformed"].append(ln[:200])
    return res


def count_decisions(path: str) -> int:
    """Cheap: decision lines flushed so far (the plugin flushes at every TP sync, every 16 results)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return 0
    return data.count(b"\n") - data.count(b"#")


def compare_lines(a: list[str], b: list[str]) -> dict:
    """Line-by-line identity over the common prefix."""
    n = min(len(a), len(b))
    first = None
    mismatches = 0
    for i in range(n):
        if a[i] != b[i]:
            mismatches += 1
            if first is None:
                first = {"index": i, "rank0": a[i], "rank1": b[i],
                         "rank0_context": a[max(0, i - 3):i + 3], "rank1_context": b[max(0, i - 3):i + 3]}
    return {"compared": n, "mismatches": mismatches, "first_mismatch": first,
            "identical": n > 0 and mismatches == 0, "rank0_extra": len(a) - n, "rank1_extra": len(b) - n}


def _fallback_lookup():
    """steps the fixed-threshold fallback gives per batch size (the engine's own, default settings)."""
    try:
        from specctl.plugin.engine import EngineController, PluginSettings

        eng = (EngineController(PluginSettings(mode="fixed"), candidate_steps=TREE_CANDIDATES, states={2: TREE})
               if tree_mode() else EngineController(PluginSettings(mode="fixed"), candidate_steps=CANDIDATES))
        return lambda bs: eng.fallback.lookup(bs)[0]
    except Exception:  # noqa: BLE001
        return None


def analyse_decisions(lines: list[str], published: dict[int, list]) -> dict:
    """Versions seen and changes, steps histogram, and every decision against the table of its
    version (published) or the fallback (F)."""
    steps_hist: dict[str, int] = {}
    bs_steps: dict[str, int] = {}
    versions: list[int] = []
    seen: set = set()
    changes = 0
    prev_v = None
    step_gaps = 0
    prev_step = None
    fallback_lines = 0
    table_mismatch = 0
    mism_examples: list = []
    unknown: set = set()
    fb = _fallback_lookup()
    fb_mismatch = 0
    first_version_step = None
    for ln in lines:
        st, bs, steps, v = ln.split()
        st_i, bs_i, steps_i = int(st), int(bs), int(steps)
        if prev_step is not None and st_i != prev_step + 1:
            step_gaps += 1
        prev_step = st_i
        steps_hist[steps] = steps_hist.get(steps, 0) + 1
        k = f"bs{bs_i}/s{steps_i}"
        bs_steps[k] = bs_steps.get(k, 0) + 1
        if prev_v is not None and v != prev_v:
            changes += 1
        prev_v = v
        if v == "F":
            fallback_lines += 1
            if fb is not None and fb(bs_i) != steps_i:
                fb_mismatch += 1
            continue
        vi = int(v)
        if first_version_step is None:
            first_version_step = st_i
        if vi not in seen:
            seen.add(vi)
            versions.append(vi)
        rows = published.get(vi)
        if rows is None:
            unknown.add(vi)
            continue
        want = lookup(rows, bs_i)
        if want != steps_i:
            table_mismatch += 1
            if len(mism_examples) < 5:
                mism_examples.append({"line": ln, "table_says": want})
    return {"decisions": len(lines), "first_step": int(lines[0].split()[0]) if lines else None,
            "last_step": int(lines[-1].split()[0]) if lines else None, "step_gaps": step_gaps,
            "steps_histogram": dict(sorted(steps_hist.items())),
            "by_batch_and_steps": dict(sorted(bs_steps.items(), key=lambda kv: (int(kv[0][2:].split("/")[0]),
                                                                                 kv[0]))),
            "versions_applied": len(versions), "first_versions": versions[:10], "last_versions": versions[-5:],
            "version_changes": changes, "fallback_lines": fallback_lines,
            "fallback_lines_not_fallback_table": fb_mismatch if fb is not None else None,
            "first_policy_step": first_version_step,
            "unknown_versions": sorted(unknown)[:20], "num_unknown_versions": len(unknown),
            "table_mismatches": table_mismatch, "table_mismatch_examples": mism_examples}


def read_published(path: str) -> dict[int, list]:
    out: dict[int, list] = {}
    if not os.path.exists(path):
        return out
    for ln in open(path, errors="replace"):
        try:
            o = json.loads(ln)
            out[int(o["version"])] = [tuple(r) for r in o["table"]]
        except (ValueError, KeyError, TypeError):
            continue
    return out


# server-log lines that matter for TP=2 (SGLang prefixes scheduler lines with " TP0" / " TP1")
TP_PATTERNS = {
    "engine_ready": r"specctl: engine ready on TP rank (\d+)/(\d+)",
    "policy_in_force": r"specctl: policy v(\d+) \((\w+)\) in force from decode step (\d+)",
    "fallback": r"specctl: fixed-threshold fallback .* from decode step (\d+)",
    "nccl_error": r"NCCL error|ncclInternalError|ncclSystemError|ncclUnhandledCudaError|ncclInvalidUsage|"
                  r"collective operation timeout|Watchdog caught",
    "nccl_warn": r"NCCL WARN",
    "adaptive_disabled": r"speculative_adaptive disabled",
    "watchdog": r"[Ww]atchdog timeout|Scheduler hit an exception|SIGQUIT|Received sigquit",
    "cuda_error": r"CUDA error|illegal memory access|out of memory",
}
_RANK = re.compile(r"^\[[^\]]*? TP(\d+)[^\]]*\]")


def summarize_tp_log(text: str) -> dict:
    out: dict = {"lines": 0, "by_rank_lines": {}}
    per: dict = {k: {} for k in TP_PATTERNS}
    seq: dict = {}  # rank -> [(version, step)] from the "in force" lines
    rx = {k: re.compile(p) for k, p in TP_PATTERNS.items()}
    first: dict = {k: [] for k in TP_PATTERNS}
    for ln in text.splitlines():
        out["lines"] += 1
        m = _RANK.match(ln)
        rank = m.group(1) if m else "main"
        out["by_rank_lines"][rank] = out["by_rank_lines"].get(rank, 0) + 1
        for k, r in rx.items():
            h = r.search(ln)
            if h:
                per[k][rank] = per[k].get(rank, 0) + 1
                if len(first[k]) < 3:
                    first[k].append(ln[-300:])
                if k == "policy_in_force":
                    seq.setdefault(rank, []).append((int(h.group(1)), int(h.group(3))))
    out["counts"] = per
    out["first"] = {k: v for k, v in first.items() if v}
    r0, r1 = seq.get("0", []), seq.get("1", [])
    n = min(len(r0), len(r1))
    out["in_force_lines"] = {"rank0": len(r0), "rank1": len(r1), "compared": n,
                             "identical": r0[:n] == r1[:n],
                             "first_difference": next(({"rank0": r0[i], "rank1": r1[i]} for i in range(n)
                                                       if r0[i] != r1[i]), None)}
    return out


def cmd_compare(outdir: str, min_decisions: int = 10000) -> dict:
    r0 = parse_decisions(os.path.join(outdir, "decisions-rank0.txt"))
    r1 = parse_decisions(os.path.join(outdir, "decisions-rank1.txt"))
    published = read_published(os.path.join(outdir, "published.jsonl"))
    cmp = compare_lines(r0["lines"], r1["lines"])
    ana = analyse_decisions(r0["lines"], published)
    s: dict = {"ranks": {}}
    for name, r in (("rank0", r0), ("rank1", r1)):
        s["ranks"][name] = {"exists": r["exists"], "headers": len(r["headers"]), "decisions": len(r["lines"]),
                            "malformed": len(r["malformed"]), "malformed_examples": r["malformed"][:3],
                            "partial_tail": r["partial_tail"]}
    s["compare"] = cmp
    s["rank0_decisions"] = ana
    if r1["lines"]:
        a1 = analyse_decisions(r1["lines"], published)
        s["rank1_versions_applied"] = a1["versions_applied"]
    s["published"] = {"versions": len(published), "first": min(published) if published else None,
                      "last": max(published) if published else None}
    # telemetry (rank 0 only) and the server log
    frames, bad = PS.read_frames(os.path.join(outdir, "telemetry.jsonl"))
    tel_steps: dict = {}
    for fr in frames:
        k = str(fr.get("config", {}).get("steps"))
        tel_steps[k] = tel_steps.get(k, 0) + 1
    s["telemetry"] = {"frames": len(frames), "unparsable": bad, "ranks": sorted({fr.get("rank") for fr in frames},
                                                                              key=str),
                      "steps_histogram": dict(sorted(tel_steps.items()))}
    logp = os.path.join(outdir, "server.log")
    if os.path.exists(logp):
        text = open(logp, errors="replace").read()
        lg = PS.summarize_log(text)
        s["log"] = {k: lg[k] for k in ("hooks_all_in_place", "hook_not_effective", "sglang_failed_hooks",
                                       "plugin_failed", "engine_ready", "specctl_warning_or_error",
                                       "switch_state", "built_state", "traceback")}
        s["log"]["switch_transitions"] = lg["switch_transitions"]
        s["tp_log"] = summarize_tp_log(text)
    cp = os.path.join(outdir, "client.json")
    client = json.load(open(cp)) if os.path.exists(cp) else {}
    s["client"] = {k: client.get(k) for k in ("ready", "start_s", "server_died", "requests", "ok", "errors",
                                              "timeouts", "stopped_because", "healthy_at_end", "drive_s",
                                              "decisions_at_end", "error_examples")}
    # ---- verdict
    tpl = s.get("tp_log", {})
    ready = tpl.get("counts", {}).get("engine_ready", {})
    checks = {
        "both_rank_logs": r0["exists"] and r1["exists"],
        "identical": cmp["identical"],
        "enough_decisions": cmp["compared"] >= min_decisions,
        "policy_updates_landed": ana["versions_applied"] >= 2 and ana["version_changes"] >= 2,
        "applied_versions_were_published": ana["num_unknown_versions"] == 0 and bool(published),
        "decisions_follow_tables": ana["table_mismatches"] == 0,
        "no_malformed_lines": not r0["malformed"] and not r1["malformed"],
        "one_engine_per_rank": len(r0["headers"]) == 1 and len(r1["headers"]) == 1,
        "server_ready": bool(client.get("ready")),
        "no_request_errors": bool(client) and not client.get("errors") and not client.get("timeouts"),
        "no_hang": bool(client) and not client.get("server_died") and client.get("healthy_at_end") is True
                   and client.get("stopped_because") in ("target", "deadline"),
        "both_ranks_engine_ready": "0" in ready and "1" in ready,
        "no_nccl_errors": not tpl.get("counts", {}).get("nccl_error"),
    }
    problems = [k for k, v in checks.items() if not v]
    notes = []
    if s.get("log", {}).get("traceback", {}).get("count"):
        notes.append(f"{s['log']['traceback']['count']} Traceback line(s) in server.log (see log.traceback)")
    if tpl and not tpl.get("in_force_lines", {}).get("identical", True):
        notes.append("the 'policy vN in force from decode step S' lines differ between TP0 and TP1")
    if tpl.get("counts", {}).get("nccl_warn"):
        notes.append(f"NCCL WARN lines: {tpl['counts']['nccl_warn']} (see tp_log.first.nccl_warn)")
    for k in ("adaptive_disabled", "watchdog", "cuda_error"):
        if tpl.get("counts", {}).get(k):
            notes.append(f"server.log: {k} {tpl['counts'][k]} (see tp_log.first.{k})")
    if cmp["rank0_extra"] or cmp["rank1_extra"]:
        notes.append(f"beyond the common prefix: rank0 +{cmp['rank0_extra']}, rank1 +{cmp['rank1_extra']} "
                     "(the last flush before the kill may differ)")
    verdict = {"decisions_compared": cmp["compared"], "identical": cmp["identical"],
               "versions_applied": ana["versions_applied"], "version_changes": ana["version_changes"],
               "ok": not problems, "failed_checks": problems, "notes": notes}
    out = {"verdict": verdict, "checks": checks, "min_decisions": min_decisions}
    out.update(s)
    with open(os.path.join(outdir, "summary.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


# ----------------------------------------------------------------------------- drive

def cmd_drive(url: str, out: str, decision_log: str, deadline: float, target: int = 12000,
              levels: str = LEVELS, pid: int = 0, level_s: float = 2.5, max_new: int = 128,
              req_timeout: float = 30.0, ready_by: Optional[float] = None) -> dict:
    """Closed-loop load with varying concurrency until `target` decisions in rank 0's log or the
    deadline (epoch seconds). Never waits past deadline + req_timeout + a few seconds."""
    res: dict = {"ready": False, "requests": 0, "ok": 0, "errors": 0, "timeouts": 0, "levels": [],
                 "error_examples": [], "target": target}
    ready_by = deadline if ready_by is None else min(ready_by, deadline)
    PS.wait_healthy(url, ready_by, pid, res)
    if not res["ready"]:
        res["stopped_because"] = "server died" if res.get("server_died") else "not ready"
        _write(out, res)
        return res
    sp = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    lock = threading.Lock()
    td = time.time()
    conc_list = [int(x) for x in levels.split(",")]
    i = 0
    stop = None
    while stop is None:
        n_before = count_decisions(decision_log)
        if n_before >= target:
            stop = "target"
            break
        if time.time() + level_s > deadline:
            stop = "deadline"
            break
        if pid and not os.path.exists(f"/proc/{pid}"):
            res["server_died"] = True
            stop = "server died"
            break
        conc = conc_list[i % len(conc_list)]
        i += 1
        row = {"conc": conc, "requests": 0, "ok": 0, "errors": 0, "timeouts": 0, "tokens": 0}
        lvl_end = time.time() + level_s

        def worker(w: int) -> None:
            r = 0
            while time.time() < lvl_end:
                try:
                    o = PS._post(url + "/generate", {"text": PS.PROMPTS[(w + r) % len(PS.PROMPTS)],
                                                     "sampling_params": sp}, t=req_timeout)
                    ok, err = "meta_info" in o, None if "meta_info" in o else f"no meta_info: {str(o)[:200]}"
                    toks = o.get("meta_info", {}).get("completion_tokens", 0) if ok else 0
                except Exception as e:  # noqa: BLE001
                    ok, err, toks = False, repr(e)[:300], 0
                r += 1
                with lock:
                    row["requests"] += 1
                    row["ok"] += int(ok)
                    row["tokens"] += toks
                    if err is not None:
                        row["errors"] += 1
                        if "timed out" in err or "timeout" in err.lower():
                            row["timeouts"] += 1
                        if len(res["error_examples"]) < 5:
                            res["error_examples"].append({"conc": conc, "error": err})
                if err is not None:
                    time.sleep(0.5)

        t = time.time()
        th = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(conc)]
        for x in th:
            x.start()
        for x in th:
            x.join(max(0.1, lvl_end + req_timeout + 5 - time.time()))
        row["stuck_workers"] = sum(1 for x in th if x.is_alive())
        row["wall_s"] = round(time.time() - t, 2)
        row["decisions_after"] = count_decisions(decision_log)
        row["decisions_in_level"] = row["decisions_after"] - n_before
        res["levels"].append(row)
        for k in ("requests", "ok", "errors", "timeouts"):
            res[k] += row[k]
        print(f"conc={conc:2d} ok={row['ok']}/{row['requests']} tok={row['tokens']} "
              f"decisions={row['decisions_after']} (+{row['decisions_in_level']}) t={time.time() - td:.0f}s",
              flush=True)
        if row["timeouts"] or row["stuck_workers"]:
            stop = "timeouts (hang?)"
        res["stopped_because"] = stop or "running"
        _write(out, res)  # a driver killed by the outer timeout still leaves its levels behind
    res["stopped_because"] = stop
    res["drive_s"] = round(time.time() - td, 1)
    res["decisions_at_end"] = count_decisions(decision_log)
    try:
        res["healthy_at_end"] = PS._get(url + "/health", 5)[0] == 200
    except Exception as e:  # noqa: BLE001
        res["healthy_at_end"] = False
        res["health_error"] = repr(e)[:300]
    try:
        si = json.loads(PS._get(url + "/get_server_info", 10)[1])
        res["internal_states"] = json.dumps(si.get("internal_states", si.get("internal_state")))[:3000]
    except Exception as e:  # noqa: BLE001
        res["server_info_error"] = repr(e)[:300]
    print(f"stopped: {stop}; decisions {res['decisions_at_end']}; requests {res['ok']}/{res['requests']} ok, "
          f"{res['errors']} errors, {res['timeouts']} timeouts; healthy at end: {res['healthy_at_end']}", flush=True)
    _write(out, res)
    return res


def _write(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def main(a: list[str]) -> int:
    if not a:
        sys.exit(__doc__)
    if a[0] == "publish":
        cmd_publish(a[1], a[2], float(a[3]) if len(a) > 3 else 0.5, float(a[4]) if len(a) > 4 else 0.0)
    elif a[0] == "drive":
        cmd_drive(a[1], a[2], a[3], float(a[4]), int(a[5]) if len(a) > 5 else 12000,
                  a[6] if len(a) > 6 else LEVELS, int(a[7]) if len(a) > 7 else 0,
                  level_s=float(os.environ.get("TP2_LEVEL_S", "2.5")),
                  max_new=int(os.environ.get("TP2_MAX_NEW", "128")),
                  req_timeout=float(os.environ.get("TP2_REQ_TIMEOUT", "30")))
    elif a[0] == "compare":
        s = cmd_compare(a[1], int(a[2]) if len(a) > 2 else 10000)
        print("VERDICT", json.dumps(s["verdict"]))
        r = s["rank0_decisions"]
        print("DETAIL", json.dumps({"steps_histogram": r["steps_histogram"], "fallback_lines": r["fallback_lines"],
                                    "first_policy_step": r["first_policy_step"],
                                    "first_mismatch": s["compare"]["first_mismatch"],
                                    "rank0_extra": s["compare"]["rank0_extra"],
                                    "rank1_extra": s["compare"]["rank1_extra"],
                                    "published": s["published"], "telemetry_frames": s["telemetry"]["frames"],
                                    "switches": s.get("log", {}).get("switch_state", {}).get("count"),
                                    "tracebacks": s.get("log", {}).get("traceback", {}).get("count"),
                                    "engine_ready": s.get("tp_log", {}).get("counts", {}).get("engine_ready"),
                                    "in_force_lines": s.get("tp_log", {}).get("in_force_lines"),
                                    "client": {k: s["client"].get(k) for k in ("requests", "ok", "errors",
                                                                                "timeouts", "stopped_because")}}))
        return 0 if s["verdict"]["ok"] else 1
    else:
        sys.exit(f"unknown command {a[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
