"""Results of interleaved runs (run_bench.py --interleave), per GPU, every round kept (runs HERE).

  python3 benchmarks/gpu/interleaved_results.py OUT.json DIR [DIR ...] [--checks FILE ...]
      DIR: a device call's output with bench-g<N>.json files, one per GPU; --checks: specctl_e2e.py summaries
On one GPU a group of servers took turns per (round, level), so figures of one GPU and one round compare; GPUs
and calls (machine leases) are kept apart. Per GPU and level: each policy's tok/s of every round, the median,
and specctl / best static policy of the same round (the goal of issue 5 is >= 0.98 at every level). Writes the
issue's results format (`runs`: medians over rounds, with `gpu_index`; `phase_runs`) plus `rounds` and `ratios`,
and prints a markdown table.
"""
import json
import os
import statistics as st
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import gpu_benches  # noqa: E402

STATIC = ("off", "static:s1", "static:s2", "static:s3")


def load(dirs):
    rounds, phase, meta = {}, [], None  # rounds[(gpu, policy, c)] = [tok/s per round, in call order]
    for d in dirs:
        for g, r, p in gpu_benches(d):
            meta = meta or r
            for x in r["runs"]:
                v = x.get("repeats_tok_s") or [x["output_tokens_per_s"]]
                rounds.setdefault((g, x["policy"], x["concurrency"]), []).extend(v)
            for x in r["phase_runs"]:
                phase.append({"gpu_index": g, "source": os.path.relpath(p), **{k: x.get(k) for k in (
                    "policy", "output_tokens_per_s", "median_tpot_ms", "p99_tpot_ms", "accept_length",
                    "adaptive_switches")}})
    return rounds, phase, meta


def ratios(rounds):
    """Per (gpu, c): specctl / the best static policy present on that GPU, round by round; and specctl / each
    other policy of that GPU, round by round."""
    out = []
    for g, c in sorted({(g, c) for g, _, c in rounds}):
        spec = rounds.get((g, "specctl", c))
        statics = {p: rounds[(g, p, c)] for p in STATIC if (g, p, c) in rounds}
        if not spec or not statics:
            continue
        n = min([len(spec)] + [len(v) for v in statics.values()])
        per = [spec[i] / max(v[i] for v in statics.values()) for i in range(n)]
        med = {p: st.median(v) for p, v in statics.items()}
        best = max(med, key=med.get)
        vs = {p: [round(spec[i] / v[i], 3) for i in range(min(len(spec), len(v)))]
              for (g2, p, c2), v in rounds.items() if g2 == g and c2 == c and p != "specctl"}
        out.append({"gpu_index": g, "concurrency": c, "statics": sorted(statics), "per_round": [round(x, 3) for x in per],
                    "median_best_static": best, "specctl_over_best_static_medians": round(st.median(spec) / med[best], 3),
                    "specctl_over_each_per_round": dict(sorted(vs.items()))})
    return out


def main():
    args = sys.argv[1:]
    checks = [args[i + 1] for i, x in enumerate(args) if x == "--checks"]
    args = [x for i, x in enumerate(args) if x != "--checks" and (i == 0 or args[i - 1] != "--checks")]
    out_path, dirs = args[0], args[1:]
    rounds, phase, meta = load(dirs)
    runs = [{"policy": p, "concurrency": c, "gpu_index": g, "output_tokens_per_s": round(st.median(v), 1),
             "rounds_tok_s": v} for (g, p, c), v in sorted(rounds.items(), key=lambda k: (k[0][0], k[0][1], k[0][2]))]
    rat = ratios(rounds)
    res = {"gpu": meta["gpu"], "sglang": meta["sglang"], "model": meta["model"], "variant": meta["variant"],
           "draft": "benchmarks/gpu/draft/v2", "runs": runs, "phase_runs": phase, "ratios": rat,
           "method": "run_bench.py --interleave: per GPU a group of servers takes turns per (round, level) in a rotated "
                     "order; rows are medians over rounds; compare within one gpu_index only",
           "sources": [os.path.relpath(d) for d in dirs]}
    if checks:  # specctl_e2e.py summaries (identity, online, overhead) of the same lease
        res["checks"] = {os.path.basename(c).rsplit(".", 1)[0]: json.load(open(c)) for c in checks}
    json.dump(res, open(out_path, "w"), indent=1)
    for g in sorted({x["gpu_index"] for x in runs}):
        pols = sorted({x["policy"] for x in runs if x["gpu_index"] == g}, key=lambda p: (p == "specctl", p))
        levels = sorted({x["concurrency"] for x in runs if x["gpu_index"] == g})
        print(f"\nGPU {g}: output tokens/s, median of rounds [every round]\n")
        print("| c | " + " | ".join(pols) + " | specctl ÷ best static, per round |")
        print("| --- |" + " --- |" * (len(pols) + 1))
        for c in levels:
            cells = []
            for p in pols:
                v = rounds.get((g, p, c))
                cells.append(f"{st.median(v):.0f} [{', '.join(f'{x:.0f}' for x in v)}]" if v else "–")
            r = next((x for x in rat if x["gpu_index"] == g and x["concurrency"] == c), None)
            print(f"| {c} | " + " | ".join(cells) + f" | {', '.join(str(x) for x in r['per_round']) if r else '–'} |")
    for g in sorted({x["gpu_index"] for x in rat}):
        others = sorted({p for x in rat if x["gpu_index"] == g for p in x["specctl_over_each_per_round"]})
        print(f"\nGPU {g}: specctl ÷ each policy, per round (median)\n")
        print("| c | " + " | ".join(others) + " |")
        print("| --- |" + " --- |" * len(others))
        for x in (x for x in rat if x["gpu_index"] == g):
            v = x["specctl_over_each_per_round"]
            print(f"| {x['concurrency']} | " + " | ".join(
                f"{st.median(v[p]):.2f} ({', '.join(f'{y:.2f}' for y in v[p])})" if v.get(p) else "–" for p in others) + " |")
    if phase:
        print("\nphase workload: " + "; ".join(f"GPU {x['gpu_index']} {x['policy']} {x['output_tokens_per_s']}" for x in phase))
    print("wrote", out_path)


if __name__ == "__main__":
    main()
