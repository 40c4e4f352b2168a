"""Two controller variants compared over several simulator seeds, from `scripts/simtargets.py --json` files.

    python scripts/simseeds.py --base 'adaptive' BASE_SEED0.json BASE_SEED7.json ... \
        --variant 'adaptive:explore_period=65' VAR_SEED0.json VAR_SEED7.json ... [--json OUT.json]

Each file holds one seed's per-pair rows (profile, workload, policy, oracle = tokens/s ÷ the per-step oracle's);
the i-th variant file is compared with the i-th base file (the same seed). Printed and written: each seed's mean
over the pairs for both, the pairs more than --tol (0.5 % of the oracle) below the base at single seeds, and the
same over the seed-averaged figure of each pair. Why seed averages: one seed's figure of one pair moves by up to
a few % when anything changes a trajectory (2026-12-03: explore_period 64 -> 65, no other change, put 1-3 of 36
pairs per seed more than 0.5 % below, dense-8b-h200 / demo 2.3 % at seed 7), so single-seed pair differences
cannot tell a rule from a perturbation.
"""

from __future__ import annotations

import argparse
import json
import statistics as st
import sys
from pathlib import Path

Pair = tuple[str, str]


def load(path: str, policy: str) -> dict[Pair, float]:
    """One simtargets --json file: {(profile, workload): ratio to the oracle} of `policy`."""
    rows = json.loads(Path(path).read_text())
    out = {(r["profile"], r["workload"]): float(r["oracle"]) for r in rows if r.get("policy") == policy}
    if not out:
        have = sorted({r.get("policy") for r in rows})
        raise SystemExit(f"{path}: no rows of policy {policy!r} (it holds {have})")
    return out


def compare(base: list[dict[Pair, float]], var: list[dict[Pair, float]], tol: float = 0.005) -> dict:
    """base[i] and var[i] are the same seed's runs; every run must hold the same pairs."""
    if len(base) != len(var) or not base:
        raise ValueError(f"need one variant run per base run (got {len(base)} base, {len(var)} variant)")
    pairs = sorted(base[0])
    for i, run in enumerate(base + var):
        if sorted(run) != pairs:
            raise ValueError(f"run {i} holds other pairs than the first base run")
    single = [{"seed_index": i, "pair": list(k), "diff": round(v[k] - b[k], 5)}
              for i, (b, v) in enumerate(zip(base, var)) for k in pairs if v[k] - b[k] < -tol]
    avg_b = {k: st.mean(r[k] for r in base) for k in pairs}
    avg_v = {k: st.mean(r[k] for r in var) for k in pairs}
    below = sorted(([list(k), round(avg_v[k] - avg_b[k], 5)] for k in pairs if avg_v[k] - avg_b[k] < -tol),
                   key=lambda x: x[1])
    return {"pairs": len(pairs), "seeds": len(base), "tol": tol,
            "base_mean_per_seed": [round(st.mean(r.values()), 5) for r in base],
            "variant_mean_per_seed": [round(st.mean(r.values()), 5) for r in var],
            "base_mean": round(st.mean(avg_b.values()), 5), "variant_mean": round(st.mean(avg_v.values()), 5),
            "single_seed_below": single, "seed_avg_below": below,
            "base_min": round(min(min(r.values()) for r in base), 4),
            "variant_min": round(min(min(r.values()) for r in var), 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", nargs="+", required=True, metavar=("POLICY", "JSON"),
                    help="the base variant's policy name in the files, then one simtargets --json file per seed")
    ap.add_argument("--variant", nargs="+", required=True, metavar=("POLICY", "JSON"),
                    help="the same for the variant, the files in the same seed order")
    ap.add_argument("--tol", type=float, default=0.005, help="a pair counts as below beyond this (fraction of oracle)")
    ap.add_argument("--json", help="write the comparison here")
    a = ap.parse_args(argv)
    if len(a.base) < 2 or len(a.variant) < 2:
        ap.error("--base and --variant each take a policy name and at least one file")
    base = [load(f, a.base[0]) for f in a.base[1:]]
    var = [load(f, a.variant[0]) for f in a.variant[1:]]
    try:
        r = compare(base, var, a.tol)
    except ValueError as e:
        ap.error(str(e))
    r.update(base_policy=a.base[0], variant_policy=a.variant[0], base_files=a.base[1:], variant_files=a.variant[1:])
    print(f"{r['pairs']} pairs x {r['seeds']} seeds")
    print(f"mean per seed: base {r['base_mean_per_seed']}  variant {r['variant_mean_per_seed']}")
    print(f"mean over seeds: base {r['base_mean']}  variant {r['variant_mean']}")
    print(f"pairs > {a.tol:.1%} below the base at single seeds: {len(r['single_seed_below'])} of "
          f"{r['pairs'] * r['seeds']}")
    print(f"pairs > {a.tol:.1%} below the base in the seed average: {len(r['seed_avg_below'])} "
          + " ".join(f"{p[0]}/{p[1]} {d:+.2%}" for p, d in r["seed_avg_below"]))
    print(f"lowest pair at any seed: base {r['base_min']}  variant {r['variant_min']}")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
