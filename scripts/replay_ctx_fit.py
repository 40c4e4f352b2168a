"""What the daemon's context axis makes of a real telemetry recording: the recording replayed into a
ControllerService on its own timestamps (a refit every second of them, as `specctl serve` does by default),
then per configuration the pooled context slope, the within-batch-size slopes it pools, the step times it
predicts at two contexts, and the banded table it publishes.

    python scripts/replay_ctx_fit.py benchmarks/gpu/logs/2026-12-01/call5-phase-repeats/specctl-telemetry.jsonl.gz [--json OUT]

On the 2026-12-01 H200 recording (specctl's phase runs, short prompts) s3's within-batch-size slope falls from
~5 µs per context token at batch 1 to ~0.6-1.3 µs at batch 4-8: one cost per context token of the batch (the
model's context term before its batch exponent) carried to batch 100 made s3 look 40 % cheaper at 48 tokens of
context than at 192, and the bands below 128 tokens speculated up to batch 80-144 (git history: docs/gpu-testbed.md, item 2).
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from specctl.controller.replay import recording_frames, replay_into
from specctl.controller.service import ServiceSettings


def within_slopes(steps: list[dict], config: tuple) -> dict[int, dict]:
    """Least-squares slope of step_ms on ctx_tokens per batch size (>= 30 steps), for one configuration."""
    out = {}
    by: dict[int, list[tuple[float, float]]] = {}
    for r in steps:
        if tuple(r["config"].values()) == config and r.get("ctx_tokens") is not None:
            by.setdefault(r["batch_size"], []).append((r["ctx_tokens"], r["step_ms"]))
    for b, v in sorted(by.items()):
        if len(v) >= 30:
            a = np.array(v)
            if a[:, 0].std() > 0:
                out[b] = {"steps": len(v), "us_per_ctx_token": round(1000 * float(np.polyfit(a[:, 0], a[:, 1], 1)[0]), 3),
                          "median_ms": round(float(np.median(a[:, 1])), 3)}
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("recording")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    frames = recording_frames([a.recording])
    recs = [json.loads(frame) for _, frame in frames]
    svc = replay_into(frames, ServiceSettings())
    steps = [r for r in recs if r.get("kind") == "step"]
    configs = sorted({tuple(r["config"].values()) for r in steps})
    b = np.array([1, 8, 32, 64, 100, 128])
    out: dict = {"steps": len(steps), "configs": {}}
    for c in configs:
        g, se = svc.model.ctx_slope(c)
        ent = {"pooled_us_per_ctx_token": round(1000 * g, 4), "se": None if se == float("inf") else round(1000 * se, 4),
               "within_batch_size": within_slopes(steps, c)}
        if svc.model.has_step_time(c):
            ent["predicted_ms"] = {str(L): [round(float(x), 2) for x in svc.model.predict_step_ms_ctx(c, b, L)]
                                   for L in (48, 192)}
            ent["predicted_at_batch"] = b.tolist()
        out["configs"]["s%d" % c[0] if c[0] else "off"] = ent
    out["table"] = [{"min_batch": r.min_batch, "max_batch": r.max_batch, "steps": r.config.steps, "min_ctx": r.min_ctx,
                     "max_ctx": r.max_ctx} for r in svc.policy.table]
    text = json.dumps(out, indent=1)
    if a.json:
        open(a.json, "w").write(text)
    print(text if len(text) < 6000 else text[:6000] + "\n...")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
