"""What the cost model's time between decode steps (CostModel.gap_ms) makes of real telemetry: recordings
replayed, merged by timestamp, into a ControllerService with and without the gap term (a refit every second
of their timestamps, as `specctl serve` does by default), then per configuration and batch region the measured
gap per step and the non-decode iterations per step behind it, and the two tables.

    python scripts/replay_gaps.py benchmarks/gpu/logs/2026-12-02/lease4-call9-build-step-costs/server-logs.tgz [--json OUT]

Arguments: telemetry files (*.jsonl, *.jsonl.gz) or run_bench `server-logs.tgz` archives (every
`*/telemetry/*.jsonl.gz` inside). On 2026-12-02's fourth lease (P: one server per fixed configuration, the same
sweep) the decode state's stretches at batch 32-63 spend 7.1 ms per step between decode steps, s1 / s2 / s3's
15.1 / 17.2 / 17.1 (at 64-127: 9.3 against 18.6-21.2), and the tables flap at batch 44-128 where the gap term makes
near-ties; on F (specctl's own server) plain decode moves from batch 138 down to 76 (docs/gpu-testbed.md, item 1,
fourth lease).
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
import tarfile

from specctl.controller.replay import replay_into
from specctl.controller.service import ControllerService, ServiceSettings


def read_lines(path: str) -> list[bytes]:
    """Every step/policy line of a telemetry file or of the telemetry files in a tgz."""
    if path.endswith(".tgz") or path.endswith(".tar.gz"):
        out: list[bytes] = []
        with tarfile.open(path) as tf:
            for m in tf.getmembers():
                if m.isfile() and "/telemetry/" in m.name and m.name.endswith(".jsonl.gz"):
                    data = tf.extractfile(m).read()  # type: ignore[union-attr]
                    out += [ln for ln in gzip.open(io.BytesIO(data)).read().splitlines() if ln.strip()]
        return out
    raw = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
    return [ln for ln in raw.splitlines() if ln.strip()]


def table(svc: ControllerService) -> list[str]:
    return [f"{r.min_batch}-{'' if r.max_batch is None else r.max_batch}: {'off' if r.config.steps == 0 else 's%d' % r.config.steps}"
            + ("" if r.min_ctx is None and r.max_ctx is None else f" ctx {r.min_ctx}-{r.max_ctx}")
            for r in svc.policy.table]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("recordings", nargs="+")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    lines = []
    for p in a.recordings:
        for ln in read_lines(p):
            try:
                r = json.loads(ln)
            except ValueError:
                continue
            if r.get("kind") == "step":
                lines.append((float(r["ts"]), ln))
    lines.sort(key=lambda x: x[0])
    on = replay_into(lines, ServiceSettings(gap_term=True))  # the service setting gap_term (an experiment)
    off = replay_into(lines, ServiceSettings())
    gaps = {name: c.get("gaps") for name, c in on.model.summary()["configs"].items() if c.get("gaps")}
    out = {"steps": len(lines), "gaps": gaps, "table_with_gap_term": table(on), "table_without": table(off)}
    text = json.dumps(out, indent=1)
    if a.json:
        open(a.json, "w").write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
