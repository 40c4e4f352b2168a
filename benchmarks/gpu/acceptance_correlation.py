"""How much one request's decode steps within a second say about acceptance, from recorded GPU telemetry.

  python3 benchmarks/gpu/acceptance_correlation.py ARCHIVE:MEMBER_SUBSTRING [...] [--json OUT]
  e.g. benchmarks/gpu/logs/2026-11-30/call6-sweep-online-overhead/g0-telemetry.tar:specctl-specctl/telemetry
  (the archives of calls 12-29 it was run on are in git only: `git log -- benchmarks/gpu/logs`)

For every second in which one chain ran at least 20 steps at one batch size b >= 2, each batch slot is
taken as one request (SGLang keeps a running request in its slot) and the design effect is the
variance of the per-slot mean accepted drafts over what independent steps would give (the per-step
variance / m, m the steps of that second). m / deff is what one request's m steps are worth in
independent steps: the figure behind `training.costmodel.ACCEPT_STEPS_PER_REQUEST`. The lag-1
autocorrelation of a slot's accepted drafts is printed too (batch 1 included).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from replay_versions import frames_from  # noqa: E402


def frames(tar: str, sub: str) -> list[dict]:
    """The telemetry records of an archive's members matching `sub` (replay_versions' reader)."""
    return [json.loads(b) for b in frames_from(tar, sub)]


def seconds(fr: list[dict], min_steps: int = 20):
    """(steps, batch, m x b accepted array) per (chain, second, server, rank) at one batch size."""
    groups = collections.defaultdict(list)
    for f in fr:
        c = f["config"]
        if c["topk"] == 1 and c["steps"] > 0 and f.get("accepted"):
            groups[(c["steps"], int(f["ts"]), f.get("server"), f.get("rank"))].append(f)
    for (steps, *_), fs in groups.items():
        b = fs[0]["batch_size"]
        rows = [f["accepted"] for f in fs if f["batch_size"] == b and len(f["accepted"]) == b]
        if len(rows) >= min_steps:
            yield steps, b, np.asarray(rows, dtype=float)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sources", nargs="+", help="ARCHIVE:MEMBER_SUBSTRING")
    ap.add_argument("--json")
    args = ap.parse_args()
    by = collections.defaultdict(list)
    for src in args.sources:
        tar, _, sub = src.partition(":")
        for steps, b, a in seconds(frames(tar, sub)):
            m = a.shape[0]
            v = a.var(ddof=1)
            if v <= 0:
                continue
            x = a - a.mean()
            lag1 = float((x[1:] * x[:-1]).sum() / (x * x).sum())
            deff = float(a.mean(axis=0).var(ddof=1) / (v / m)) if b >= 2 else None
            by[(steps, b)].append((m, deff, lag1))
    out = []
    print(f"{'chain':>5} {'batch':>5} {'seconds':>7} {'steps/s':>7} {'deff':>6} {'worth':>6} {'lag1':>6}")
    for (steps, b), rows in sorted(by.items()):
        m = float(np.mean([r[0] for r in rows]))
        d = [r[1] for r in rows if r[1] is not None]
        deff = float(np.median(d)) if d else None
        lag1 = float(np.mean([r[2] for r in rows]))
        worth = m / deff if deff else None
        out.append({"steps": steps, "batch": b, "seconds": len(rows), "steps_per_s": m, "deff": deff,
                    "steps_worth_per_request": worth, "lag1": lag1})
        print(f"{'s%d' % steps:>5} {b:5d} {len(rows):7d} {m:7.1f} {deff if deff else float('nan'):6.2f} "
              f"{worth if worth else float('nan'):6.1f} {lag1:6.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"sources": args.sources, "by_chain_and_batch": out}, fh, indent=1)


if __name__ == "__main__":
    main()
