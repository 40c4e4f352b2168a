"""The context axis's record (issue "step time that depends on context length"), HERE, from the device calls'
outputs:

  python3 benchmarks/gpu/ctx_results.py OUT.json [--steps G/ctx-steps.json ...] [--alternating H/bench-g0.json
      --logs H's g0/ (g0.tgz or server-logs.tgz extracted)] ... [--call "command" ...] [--ctx-split 2048]
      [--replay]

--steps: ctx_profile.py measure outputs (several calls' merge as `convert` merges them): per policy, prompt length
and concurrency the decode step (median over rounds) and, per prompt length and concurrency, each speculative
policy's step over the no-spec server's (`ctx_steps`, `spec_over_off`).
--alternating: run_bench.py --phase-set alternating with specctl and specctl-noctx taking turns: the phase runs,
specctl ÷ specctl-noctx run by run (`phase_pairs`), each server's last table per context band and its flaps
(speculating rows above its first plain-decode row), and with --logs what each server's steps cost by
configuration, batch size and context class (the telemetry's step_ms: the build the plugin runs, split-KV verify
and decode state included), the class being the mean context per request below / from --ctx-split.
--replay: each server's telemetry replayed through this checkout's daemon (controller.replay.replay_into, a refit a
second of its timestamps, the server's daemon arguments): the table it would publish now and its flaps
(`replayed_last_table`, `replayed_table_flaps`), beside the table the run published. A fix of the fit shows
there before a GPU run does.
Several --alternating calls (H and H-stock, say; each with its --logs, in the same order) go into one record when
their servers' names differ: their runs, pairs and servers side by side. Two calls of the same servers (H-stock and
H-stock-low) differ by --label: one per --alternating, in order ("" for none), appended to that call's server names
("specctl+stockverify" -> "specctl+stockverify@low"), so its targets carry it too.
The record's "notes", where OUT already has them, are kept.
Prints each target against its figure: specctl ÷ specctl-noctx mean >= 1.05, no flap in any context band.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics as st
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import policy_flaps, write_record  # noqa: E402

TARGET_OVER_NOCTX = 1.05
BATCH_BINS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 96, 128, 192, 256)  # a step's batch size counts at the bin below


def ctx_steps(paths: list[str]) -> dict:
    """ctx_profile measure outputs -> {"gpu", "prompt_tokens", "new_tokens", "rows", "spec_over_off"}."""
    import ctx_profile as CP

    res = CP.merge_steps(paths)
    rows = CP.rows_of(res)
    off = {(r["prompt_tokens"], r["concurrency"]): r["step_ms"] for r in rows if r["policy"] == "off"}
    ratios = [{"policy": r["policy"], "prompt_tokens": r["prompt_tokens"], "concurrency": r["concurrency"],
               "ctx_per_req": r["ctx_per_req"], "over_off": round(r["step_ms"] / off[(r["prompt_tokens"], r["concurrency"])], 4)}
              for r in rows if r["policy"] != "off" and r["step_ms"] and off.get((r["prompt_tokens"], r["concurrency"]))]
    missing = [{"policy": r["policy"], "prompt_tokens": r["prompt_tokens"], "concurrency": r["concurrency"]}
               for r in rows if not r["step_ms"]]
    return {"gpu": res.get("gpu"), "prompt_tokens": res.get("prompt_tokens"), "new_tokens": res.get("new_tokens"),
            "rows": rows, "spec_over_off": ratios, "no_steps": missing}


def batch_bin(b: int) -> int:
    return max(x for x in BATCH_BINS if x <= b) if b >= 1 else 0


def telemetry_steps(folder: str, split: int) -> list[dict]:
    """A plugin server's recorded telemetry -> median step ms per (context class, batch bin, configuration)."""
    from offpath_results import read_telemetry

    groups: dict[tuple, list[float]] = {}
    for s in read_telemetry(folder):
        if s["step_ms"] is None or not s["ctx_tokens"] or s["batch_size"] < 1:
            continue
        cls = "long" if s["ctx_tokens"] / s["batch_size"] >= split else "short"
        cfg = s["config"]
        groups.setdefault((cls, batch_bin(s["batch_size"]), (cfg["steps"], cfg["topk"], cfg["draft_tokens"])),
                          []).append(s["step_ms"])
    return [{"ctx": k[0], "batch_from": k[1], "config": {"steps": k[2][0], "topk": k[2][1], "draft_tokens": k[2][2]},
             "steps": len(v), "step_ms_med": round(st.median(v), 3)} for k, v in sorted(groups.items())]


def last_policy(folder: str) -> dict | None:
    """The newest policy of run_bench's specctl-<policy>/policies.json (by version, else the last saved)."""
    p = os.path.join(folder, "policies.json")
    if not os.path.exists(p):
        return None
    pols = json.load(open(p)).get("policies") or []
    if not pols:
        return None
    newest = max(range(len(pols)), key=lambda i: (pols[i].get("version", 0), i))
    return pols[newest].get("policy", pols[newest])


def table_rows(policy: dict) -> list[dict]:
    """A policy's table as the record keeps it: bounds and steps per row."""
    return [{k: r.get(k) for k in ("min_ctx", "max_ctx", "min_batch", "max_batch") if r.get(k) is not None}
            | {"steps": r["config"]["steps"]} for r in policy.get("table", [])]


DAEMON_ARGS = {"--no-ctx-axis": ("ctx_axis", False)}  # run_bench's daemon arguments -> ServiceSettings fields


def replayed_policy(folder: str, daemon_args: list[str] | None) -> dict:
    """A server's telemetry (telemetry/*.jsonl[.gz], in name order) through this checkout's daemon: its last policy."""
    import glob

    from specctl.controller import wire
    from specctl.controller.replay import recording_frames, replay_into
    from specctl.controller.service import ServiceSettings

    unknown = [a for a in daemon_args or [] if a not in DAEMON_ARGS]
    if unknown:
        raise SystemExit(f"ctx_results --replay: no ServiceSettings for the daemon arguments {unknown}")
    settings = ServiceSettings(**dict(DAEMON_ARGS[a] for a in daemon_args or []))
    frames = recording_frames(sorted(glob.glob(os.path.join(folder, "telemetry", "*.jsonl*"))))
    obj = wire.to_obj(replay_into(frames, settings).policy)
    return obj.get("policy", obj)


def alternating(bench: dict, log_dir: str | None, split: int, replay: bool = False) -> dict:
    out = {"phase_runs": [], "phase_pairs": bench.get("phase_pairs") or {}, "servers": {}}
    seen: dict[str, int] = {}
    for r in bench.get("phase_runs", []):
        seen[r["policy"]] = seen.get(r["policy"], 0) + 1
        out["phase_runs"].append({"policy": r["policy"], "run": seen[r["policy"]],
                                  "output_tokens_per_s": r.get("output_tokens_per_s"),
                                  "median_tpot_ms": r.get("median_tpot_ms"),
                                  "per_phase": [{"concurrency": p.get("concurrency"),
                                                 "prompts": ",".join(sorted((ph.get("mix") or {}))) or None,
                                                 "output_tokens_per_s": p.get("output_tokens_per_s"),
                                                 "median_tpot_ms": p.get("median_tpot_ms")}
                                                for p, ph in zip(r.get("per_phase", []),
                                                                 r.get("phases") or [{}] * len(r.get("per_phase", [])))]})
    for pol, srv in (bench.get("servers") or {}).items():
        aud = (srv or {}).get("specctl") or {}
        s = {k: aud.get(k) for k in ("table_flaps", "ctx_bands", "step_changes", "policy_versions_seen", "match_frac")}
        s["daemon_args"] = srv.get("daemon_args")
        if log_dir:
            sdir = os.path.join(log_dir, f"specctl-{pol.replace(':', '_')}")
            last = last_policy(sdir)
            s["last_table"] = table_rows(last) if last else None
            s["telemetry_steps"] = telemetry_steps(sdir, split)
            if last:  # the flaps of the table as saved, where the bench has none
                s["table_flaps"] = s["table_flaps"] or policy_flaps(last)
            if replay:
                rp = replayed_policy(sdir, srv.get("daemon_args"))
                s["replayed_last_table"], s["replayed_table_flaps"] = table_rows(rp), policy_flaps(rp)
        out["servers"][pol] = s
    return out


def labelled(part: dict, label: str) -> dict:
    """One call's alternating() with `label` appended to every server name (runs, pairs, servers)."""
    if not label:
        return part
    name = lambda pol: f"{pol}{label}"
    return {"phase_runs": [r | {"policy": name(r["policy"])} for r in part["phase_runs"]],
            "phase_pairs": {" / ".join(name(p) for p in k.split(" / ")): v for k, v in part["phase_pairs"].items()},
            "servers": {name(pol): s for pol, s in part["servers"].items()}}


def merge_alternating(parts: list[dict]) -> dict:
    """Several calls' alternating() -> one: runs, pairs and servers side by side (a server named twice is an error:
    the record could not say which call a figure came from)."""
    out = {"phase_runs": [], "phase_pairs": {}, "servers": {}}
    for i, part in enumerate(parts):
        twice = sorted(set(part["servers"]) & set(out["servers"]))
        if twice:
            raise SystemExit(f"ctx_results: --alternating number {i + 1} names servers another one does: {twice}")
        out["phase_runs"] += [r | {"call": i} for r in part["phase_runs"]] if len(parts) > 1 else part["phase_runs"]
        out["phase_pairs"] |= part["phase_pairs"]
        out["servers"] |= part["servers"]
    return out


def targets(rec: dict) -> dict:
    t = {}
    alt = rec.get("alternating")
    for name, pair in ((alt or {}).get("phase_pairs") or {}).items():
        with_axis = name.split(" / ")[0]  # "specctl" or "specctl+stockverify", ...
        tag = "" if with_axis == "specctl" else with_axis[len("specctl"):]
        t[f"specctl_over_noctx{tag}_mean_ge_{TARGET_OVER_NOCTX}"] = pair.get("mean")
        t[f"specctl_over_noctx{tag}_runs"] = pair.get("per_round")
        srv = alt["servers"].get(with_axis) or {}
        t[f"band_flaps{tag}_eq_0"] = {k: v for k, v in (srv.get("table_flaps") or {}).items() if k != "any"}
        t[f"ctx_bands{tag}_ge_2"] = srv.get("ctx_bands")
        if srv.get("replayed_table_flaps") is not None:  # not a target: what this checkout's daemon makes of the run
            t[f"band_flaps{tag}_replayed"] = {k: v for k, v in srv["replayed_table_flaps"].items() if k != "any"}
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--steps", action="append", default=[])
    ap.add_argument("--alternating", action="append", default=[])
    ap.add_argument("--logs", action="append", default=[], help="each --alternating call's server logs, in order")
    ap.add_argument("--label", action="append", default=[],
                    help="each --alternating call's suffix for its server names, in order (\"\" for none)")
    ap.add_argument("--call", action="append", default=[])
    ap.add_argument("--ctx-split", type=int, default=2048, help="mean context tokens per request: short below, long from")
    ap.add_argument("--replay", action="store_true", help="also replay each server's telemetry through this daemon")
    a = ap.parse_args()
    rec = {"calls": a.call}
    if a.steps:
        rec["ctx_steps"] = ctx_steps(a.steps)
    if a.logs and len(a.logs) != len(a.alternating):
        ap.error(f"{len(a.logs)} --logs for {len(a.alternating)} --alternating: give each call its logs, in order")
    if a.label and len(a.label) != len(a.alternating):
        ap.error(f"{len(a.label)} --label for {len(a.alternating)} --alternating: give each call one, in order")
    if any(lab and not re.fullmatch(r"@[A-Za-z0-9_.-]+", lab) for lab in a.label):
        ap.error(f"--label {a.label}: each is empty or '@' and letters, digits, '_', '.', '-'")
    if a.alternating:
        parts = []
        for i, path in enumerate(a.alternating):
            bench = json.load(open(path))
            for k in ("gpu", "sglang", "attention_backend", "model", "draft"):
                rec.setdefault(k, bench.get(k))
            part = alternating(bench, a.logs[i] if a.logs else None, a.ctx_split, replay=a.replay)
            parts.append(labelled(part, a.label[i] if a.label else ""))
        rec["alternating"] = merge_alternating(parts)
        rec["ctx_split"] = a.ctx_split
    if a.steps:
        rec["gpu"] = rec.get("gpu") or rec["ctx_steps"]["gpu"]
    rec["targets"] = targets(rec)
    write_record(a.out, rec)
    print(json.dumps(rec["targets"], indent=1))
    for r in (rec.get("ctx_steps") or {}).get("spec_over_off", []):
        print(f"{r['policy']:10s} L={r['prompt_tokens']:6d} c={r['concurrency']:4d}  {r['over_off']}x the no-spec step")
    print("wrote", a.out)


if __name__ == "__main__":
    main()
