"""Decode step cost per policy, within one GPU (runs HERE on a device call's bench-g<N>.json files).

  python3 benchmarks/gpu/step_costs.py OUT.json DIR [DIR ...] [--ref off] [--pair A=B ...]
Per GPU, policy and concurrency: the step time of every round (the median of SGLang's `Decode batch` lines at
exactly c running requests: 1000 * c * accept_len / gen_throughput, i.e. one decode iteration whatever its
acceptance), the median over rounds, and its ratio to --ref's on the same GPU, round by round. --pair A=B
adds A ÷ B per round (e.g. plugin-fixed:5:s3=threshold:5:s3: the same server with and without the plugin).
"""
import json
import os
import statistics as st
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import gpu_benches, paired_ratios  # noqa: E402


def load(dirs):
    steps = {}  # (gpu, policy, c) -> [step ms per round]
    for d in dirs:
        for g, r, _ in gpu_benches(d):
            for x in r["runs"]:
                v = x.get("repeats_step_ms") or [x.get("log", {}).get("step_ms_med")]
                steps.setdefault((g, x["policy"], x["concurrency"]), []).extend(v)
    return steps


def report(steps, ref="off", pairs=()):
    rows = []
    for (g, pol, c), v in sorted(steps.items()):
        ok = [x for x in v if x]
        row = {"gpu_index": g, "policy": pol, "concurrency": c, "step_ms_rounds": v,
               "step_ms": round(st.median(ok), 4) if ok else None}
        if pol != ref and (g, ref, c) in steps:
            row[f"over_{ref}"] = paired_ratios(v, steps[(g, ref, c)])
        rows.append(row)
    pair_rows = []
    for a_, b_ in pairs:
        for (g, pol, c), v in sorted(steps.items()):
            if pol == a_ and (g, b_, c) in steps:
                pair_rows.append({"gpu_index": g, "concurrency": c, "pair": f"{a_} / {b_}",
                                  **paired_ratios(v, steps[(g, b_, c)])})
    return rows, pair_rows


def main():
    args = sys.argv[1:]
    ref, pairs, rest = "off", [], []
    i = 0
    while i < len(args):
        if args[i] == "--ref":
            ref = args[i + 1]; i += 2
        elif args[i] == "--pair":
            pairs.append(tuple(args[i + 1].split("=", 1))); i += 2
        else:
            rest.append(args[i]); i += 1
    out, dirs = rest[0], rest[1:]
    rows, pair_rows = report(load(dirs), ref, pairs)
    method = ("step time = median of SGLang 'Decode batch' lines at exactly c running requests "
              "(1000 * c * accept_len / gen_throughput: one decode iteration, whatever its acceptance), per round; "
              "ratios are paired per round within one GPU")
    json.dump({"method": method, "gpu": "NVIDIA H200", "sglang": "0.5.17", "ref": ref, "rows": rows, "pairs": pair_rows,
               "sources": [os.path.relpath(d) for d in dirs]}, open(out, "w"), indent=1)
    for g in sorted({r["gpu_index"] for r in rows}):
        pols = sorted({r["policy"] for r in rows if r["gpu_index"] == g}, key=lambda p: (p != ref, p))
        print(f"\nGPU {g}: decode step ms (median of rounds; ÷ {ref} per-round median)\n")
        print("| c | " + " | ".join(pols) + " |")
        print("| --- |" + " --- |" * len(pols))
        for c in sorted({r["concurrency"] for r in rows if r["gpu_index"] == g}):
            cells = []
            for p in pols:
                r = next((r for r in rows if (r["gpu_index"], r["policy"], r["concurrency"]) == (g, p, c)), None)
                if not r or r["step_ms"] is None:
                    cells.append("–")
                else:
                    x = r.get(f"over_{ref}")
                    cells.append(f"{r['step_ms']:.2f}" + (f" ({x['median']:.3f})" if x else ""))
            print(f"| {c} | " + " | ".join(cells) + " |")
    for r in pair_rows:
        print(f"GPU {r['gpu_index']} c={r['concurrency']} {r['pair']}: median {r.get('median')}, mean {r.get('mean')} "
              f"± {r.get('sem')} (per round {r.get('per_round', [])})")
    print("wrote", out)


if __name__ == "__main__":
    main()
