"""Issue 8's record: the seed operator's EAGLE-3 tree (topk 4, 2 steps, 16 draft tokens) beside plain decode (runs HERE).

  python3 benchmarks/gpu/tree_results.py OUT.json --sweep DIR [--interleaved DIR] [--identity DIR]
      --sweep: a call of run_bench.py with levels going up and down again (e.g. 1,4,16,64,16,4,1), not interleaved:
               each row keeps its leg ("up" to the top level, then "down"), so acceptance at a level before and after
               the high-concurrency period (plain decode for threshold:5:tree) sits side by side
      --interleaved: run_bench.py --interleave --repeats N (every round kept; specctl:tree / each other policy, per round)
      --identity: run_bench.py --identity-c 1 (greedy outputs at batch 1, where every tree policy runs the tree)
Writes the issue's results format (`runs`, `phase_runs`) plus `acceptance_after_off`, `ratios`, `identity`, `audits`,
`tables` (what specctl:tree learned), `tree_state` (build time and memory from the server logs) and prints markdown.
"""
import argparse
import json
import os
import re
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as B  # noqa: E402

KEEP = ("policy", "concurrency", "output_tokens_per_s", "median_tpot_ms", "p99_tpot_ms", "accept_length")
R_BUILT = re.compile(r"Built adaptive runtime state steps=(\d+): elapsed=([\d.]+)s, mem=([\d.]+)GB")


def tar_members(d, g):
    p = os.path.join(d, f"g{g}.tgz")
    if not os.path.exists(p):
        return
    with tarfile.open(p) as t:
        for m in t.getmembers():
            if m.isfile():
                yield m.name, t.extractfile(m).read()


def legs(runs):
    """'up' until the first visit of the top level (inclusive), then 'down', per policy in call order."""
    out, seen_top = [], {}
    top = max(x["concurrency"] for x in runs)
    for x in sorted(runs, key=lambda x: x.get("t_start") or 0):
        leg = "down" if seen_top.get(x["policy"]) else "up"
        if x["concurrency"] == top:
            seen_top[x["policy"]] = True
        out.append((x, leg))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sweep", required=True)
    ap.add_argument("--interleaved")
    ap.add_argument("--identity")
    a = ap.parse_args()
    res = {"runs": [], "phase_runs": [], "acceptance_after_off": [], "ratios": [], "identity": [], "audits": [],
           "tables": [], "tree_state": [], "sources": []}
    calls = [("sweep", a.sweep), ("interleaved", a.interleaved), ("identity", a.identity)]
    for kind, d in calls:
        if not d:
            continue
        for g, r, src in B.gpu_benches(d):
            res["sources"].append(os.path.relpath(src))
            for k in ("gpu", "sglang", "model", "variant", "draft", "new_tokens"):
                res.setdefault(k, r.get(k))
            if kind == "sweep":
                for x, leg in legs(r["runs"]):
                    res["runs"].append({**{k: x.get(k) for k in KEEP}, "gpu_index": g, "call": kind, "leg": leg,
                                        "t_start": x.get("t_start"), "log_step_ms": (x.get("log") or {}).get("step_ms_med")})
                by = {}
                for x, leg in legs(r["runs"]):
                    by.setdefault((x["policy"], x["concurrency"]), {})[leg] = x
                for (p, c), v in sorted(by.items()):
                    if "up" in v and "down" in v and v["up"].get("accept_length"):
                        res["acceptance_after_off"].append({"gpu_index": g, "policy": p, "concurrency": c,
                                                            "before": v["up"]["accept_length"], "after": v["down"]["accept_length"]})
            if kind == "interleaved":
                rounds = {(x["policy"], x["concurrency"]): x.get("repeats_tok_s") or [x["output_tokens_per_s"]]
                          for x in r["runs"]}
                for x in r["runs"]:
                    res["runs"].append({**{k: x.get(k) for k in KEEP}, "gpu_index": g, "call": kind,
                                        "rounds_tok_s": x.get("repeats_tok_s")})
                for (p, c), v in sorted(rounds.items()):
                    if p != "specctl:tree":
                        continue
                    res["ratios"].append({"gpu_index": g, "concurrency": c, **{
                        f"specctl:tree / {q}": B.paired_ratios(v, rounds[(q, c)])
                        for q in ("off", "static:tree", "threshold:5:tree") if (q, c) in rounds}})
                for x in r["phase_runs"]:
                    res["phase_runs"].append({"gpu_index": g, "call": kind, **{k: x.get(k) for k in (
                        "policy", "output_tokens_per_s", "median_tpot_ms", "p99_tpot_ms", "accept_length")}})
            for ref in ("off", "static:tree"):
                rep = r.get("identity") if ref == "off" else r.get(f"identity_vs_{ref}")
                if rep:
                    res["identity"].append({"gpu_index": g, "call": kind, "reference": ref,
                                            "concurrency": r.get("identity_concurrency", 16),
                                            "policies": {p: (v and {"identical": v["identical"], "of": v["of"],
                                                                    "first_divergence": v["first_divergence"]})
                                                         for p, v in rep.items()}})
            for p, s in (r.get("servers") or {}).items():
                if s.get("specctl"):
                    au = s["specctl"]
                    res["audits"].append({"gpu_index": g, "call": kind, "policy": p, **{k: au.get(k) for k in (
                        "decisions", "checked", "match_frac", "step_changes", "sglang_switch_lines", "policy_versions_seen")}})
            for name, data in tar_members(d, g):
                base = os.path.basename(name)
                if name.endswith("policies.json") and "specctl_tree" in name:
                    pols = json.loads(data)["policies"]
                    last = pols[-1].get("policy", pols[-1])
                    res["tables"].append({"gpu_index": g, "call": kind, "versions": len(pols), "final": [
                        (x["min_batch"], x.get("max_batch"), B.config_name((x["config"]["steps"], x["config"]["topk"],
                                                                           x["config"]["draft_tokens"])))
                        for x in last["table"]]})
                if base.endswith(".log") and base.startswith(r.get("variant", "8b") + "-") and "tree" in base:
                    for m in R_BUILT.finditer(data.decode(errors="replace")):
                        res["tree_state"].append({"gpu_index": g, "call": kind, "server": base[:-4], "steps_key": int(m.group(1)),
                                                  "build_s": float(m.group(2)), "mem_gb": float(m.group(3))})
    res["method"] = ("H200 (two GPUs, one run_bench per GPU); compare within one gpu_index and call. Tree policies: static:tree "
                     "(SGLang's static tree, no adaptive), threshold:5:tree (the specctl plugin in fixed mode; SGLang's own "
                     "adaptive mode refuses topk 4), specctl:tree (the daemon learning over off, the launch chain s1 and the "
                     "tree). The trees of threshold:5:tree and specctl:tree are a runtime state the plugin builds in a server "
                     "launched as a topk-1 chain (`specctl sglang-args --configs off,s2k4n16`).")
    json.dump(res, open(a.out, "w"), indent=1)
    print_md(res)


def print_md(res):
    for call in ("sweep", "interleaved"):
        rows = [x for x in res["runs"] if x["call"] == call]
        for g in sorted({x["gpu_index"] for x in rows}):
            sel = [x for x in rows if x["gpu_index"] == g]
            pols = list(dict.fromkeys(x["policy"] for x in sel))
            keys = list(dict.fromkeys((x["concurrency"], x.get("leg")) for x in sorted(sel, key=lambda x: x.get("t_start") or 0)))
            if call == "interleaved":
                keys = sorted(set(keys))
            print(f"\n{call}, GPU {g}: output tokens/s (accept length)\n")
            print("| c | " + " | ".join(pols) + " |")
            print("|---" * (len(pols) + 1) + "|")
            for c, leg in keys:
                cells = []
                for p in pols:
                    x = next((x for x in sel if x["policy"] == p and x["concurrency"] == c and x.get("leg") == leg), None)
                    cells.append("—" if x is None else f"{x['output_tokens_per_s']:.0f}" + (
                        f" ({x['accept_length']:.2f})" if x.get("accept_length") else ""))
                print(f"| {c}{' ' + leg if leg else ''} | " + " | ".join(cells) + " |")
    if res["ratios"]:
        print("\nspecctl:tree ÷ each, paired per round (mean [min, max])\n")
        for x in res["ratios"]:
            parts = [f"{k.split(' / ')[1]} {v['mean']} [{v['min']}, {v['max']}]" for k, v in x.items() if "/" in k and v]
            print(f"GPU {x['gpu_index']} c={x['concurrency']}: " + "; ".join(parts))
    for x in res["phase_runs"]:
        print(f"phase GPU {x['gpu_index']}: {x['policy']} {x['output_tokens_per_s']} tok/s, accept {x['accept_length']}")
    for x in res["acceptance_after_off"]:
        print(f"accept GPU {x['gpu_index']} {x['policy']} c={x['concurrency']}: {x['before']} -> {x['after']}")


if __name__ == "__main__":
    main()
