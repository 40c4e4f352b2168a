"""Re-simulate the shipped benchmark records and say whether every figure is what they hold.

    python scripts/simidentity.py [--profile P ...] [--workload W ...] [--policy NAME ...] [--jobs N]

For every `benchmarks/results/sim-<profile>-<workload>.json` of the shipped pairs, each policy it
records (a searched best-static / best-threshold row is the policy it names) is simulated again at
the record's seed; its tokens/s, output tokens and step count must equal the record's exactly. A
check that a change left every decision and simulated figure bit for bit where it was.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from specctl.harness import simbench
from specctl.training.simulator import load_profile, load_workload, shipped_names

ROOT = Path(__file__).resolve().parent.parent


def _policy_of(label: str) -> str:
    return label.split("=", 1)[1] if label.startswith(("best-static=", "best-threshold=")) else label


def _one(args: tuple[str, str, str, int]) -> tuple[str, str, str, dict]:
    logging.disable(logging.WARNING)
    p, w, name, seed = args
    (r,) = simbench.run_many([name], load_profile(p), load_workload(w), seed=seed)
    return p, w, name, {"tokens_per_s": r.tokens_per_s, "output_tokens": r.output_tokens, "num_steps": r.num_steps}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", action="append")
    ap.add_argument("--workload", action="append")
    ap.add_argument("--policy", action="append", help="only these policies (default: every one recorded)")
    ap.add_argument("--jobs", type=int, default=1)
    a = ap.parse_args()
    work, want = [], {}
    for p in a.profile or shipped_names("profiles"):
        for w in a.workload or shipped_names("workloads"):
            path = ROOT / "benchmarks" / "results" / f"sim-{p}-{w}.json"
            if not path.exists():
                print(f"{p} / {w}: no record", file=sys.stderr)
                continue
            rec = json.loads(path.read_text())
            for r in rec["results"]:
                name = _policy_of(r["policy"])
                if (a.policy and name not in a.policy) or (p, w, name) in want:
                    continue
                want[(p, w, name)] = {k: r[k] for k in ("tokens_per_s", "output_tokens", "num_steps")}
                work.append((p, w, name, rec["seed"]))
    if a.jobs > 1:
        with ProcessPoolExecutor(max_workers=a.jobs) as ex:
            got = list(ex.map(_one, work))
    else:
        got = [_one(x) for x in work]
    bad = 0
    for p, w, name, g in got:
        ref = want[(p, w, name)]
        same = all(g[k] == ref[k] for k in ref)
        bad += not same
        print(f"{'same' if same else 'DIFFERENT':9s} {p:34s} {w:16s} {name:28s} {g['tokens_per_s']:.6f}"
              + ("" if same else f" (record {ref['tokens_per_s']:.6f}, steps {g['num_steps']} vs {ref['num_steps']})"))
    print(f"{len(got) - bad}/{len(got)} simulations identical to the shipped records")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
