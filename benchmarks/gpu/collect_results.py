"""Turn a device call's run_bench outputs into the committed results and profiles (runs HERE).

  python3 benchmarks/gpu/collect_results.py DEVICE_OUT_DIR DATE [--call "the run command"]
      [--also DIR ...]      more device outputs (calls) merged into the same per-variant file; every run row
                            keeps the directory it came from under details.runs[].source
      [--checks FILE ...]   specctl_e2e.py / tp2_check.py summaries recorded under "checks"
-> benchmarks/results/gpu-DATE-<variant>.json  (issue 5's format + extras)
   benchmarks/gpu/profiles/h200-smollm2-135m-<variant>.json  (simulator format, client-side step times)
"""
import argparse
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as B  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
KEEP = ("policy", "concurrency", "output_tokens_per_s", "median_tpot_ms", "p99_tpot_ms", "accept_length")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("date")
    ap.add_argument("--call", default=None)
    ap.add_argument("--note", default=None)
    ap.add_argument("--draft-name", default=None, help="what to record as the draft (default: the path used there)")
    ap.add_argument("--also", action="append", default=[])
    ap.add_argument("--checks", action="append", default=[])
    a = ap.parse_args()
    merged = {}
    for d in [a.outdir] + a.also:
        for f in sorted(glob.glob(os.path.join(d, "bench-*.json"))):
            r = json.load(open(f))
            src = os.path.relpath(f, ROOT) if os.path.abspath(f).startswith(ROOT) else f
            for x in r["runs"] + r["phase_runs"]:
                x["source"] = src
            m = merged.get(r["variant"])
            if m is None:
                merged[r["variant"]] = r
            else:
                # a later call's row replaces an earlier one of the same policy and concurrency (a rerun)
                new = {(x["policy"], x["concurrency"]) for x in r["runs"]}
                m["runs"] = [x for x in m["runs"] if (x["policy"], x["concurrency"]) not in new] + r["runs"]
                newp = {x["policy"] for x in r["phase_runs"]}
                m["phase_runs"] = [x for x in m["phase_runs"] if x["policy"] not in newp] + r["phase_runs"]
                m["servers"].update(r.get("servers") or {})
                (m.setdefault("identity_by_call", [])).append(r.get("identity"))
    checks = {os.path.basename(c).rsplit(".", 1)[0]: json.load(open(c)) for c in a.checks}
    for v, r in merged.items():
        res = {"gpu": r["gpu"], "sglang": r["sglang"], "model": r["model"], "variant": v, "draft": a.draft_name or r["draft"],
               "runs": [{k: x.get(k) for k in KEEP} for x in r["runs"]],
               "phase_runs": [{k: x.get(k) for k in ("policy", "output_tokens_per_s", "median_tpot_ms", "p99_tpot_ms",
                                                      "accept_length", "adaptive_switches")} for x in r["phase_runs"]],
               "details": {"new_tokens": r.get("new_tokens"), "prompts": r.get("prompts"), "runs": r["runs"],
                           "accept_eval": r.get("accept_eval"), "identity_vs_off": r.get("identity"),
                           "servers": r.get("servers"), "call": a.call, "note": a.note}}
        if checks:
            res["checks"] = checks
        out = os.path.join(ROOT, "benchmarks", "results", f"gpu-{a.date}-{v}.json")
        json.dump(res, open(out, "w"), indent=1)
        prof = B.profile_from_runs(r["runs"], f"h200-smollm2-135m-{v}-measured-{a.date}", source="client")
        prof["source"] = {"runs": os.path.relpath(out, ROOT), "method": "client median TPOT x accept length", "log_profile":
                          B.profile_from_runs(r["runs"], "log", source="log")["step_ms"]}
        pd = os.path.join(ROOT, "benchmarks", "gpu", "profiles")
        os.makedirs(pd, exist_ok=True)
        json.dump(prof, open(os.path.join(pd, f"h200-smollm2-135m-{v}.json"), "w"), indent=1)
        print("wrote", out, "and profile", v)


if __name__ == "__main__":
    main()
