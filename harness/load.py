"""The load drill for `specctl bench reliability`: many ranks' telemetry into a real `specctl serve`,
from sender subprocesses (and the CURVE certificates the security tests use)."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

import zmq

from ..controller import transport, wire

from .drills import ServeProcess, _private_endpoints, free_port, percentile


# ============================================================================ security


def generate_certs(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """server, engine (allowed) and rogue (not allowed) certificates, as `specctl keys generate`
    writes them; the allowed directory holds only the engine's public certificate."""
    import shutil

    d = Path(directory)
    (d / "allowed").mkdir(parents=True, exist_ok=True, mode=0o700)
    out = {}
    for name in ("server", "engine", "rogue"):
        pub, sec = transport.create_certificates(d / "keys", name)
        out[name] = Path(sec)
        out[name + "_public"] = Path(pub)
    shutil.copy(out["engine_public"], d / "allowed" / "engine.key")
    out["allowed_dir"] = d / "allowed"
    return out


# ============================================================================ load


_SENDER = r"""
import json, sys, time, zmq
from specctl.controller import transport
from specctl.harness.load import load_frames
cfg = json.loads(sys.argv[1])
ctx = zmq.Context()
ranks = cfg["ranks"]
senders = [transport.TelemetrySender(ctx, cfg["endpoint"], hwm=cfg["hwm"]) for _ in ranks]
frames = [load_frames(r, cfg["frames_per_rank"]) for r in ranks]
time.sleep(0.5)  # connections up
rate = cfg["rate"] * len(ranks)
t0 = time.monotonic(); n = 0; k = len(ranks); m = cfg["frames_per_rank"]
end = t0 + cfg["duration_s"]
while True:
    now = time.monotonic()
    if now >= end:
        break
    due = int((now - t0) * rate)
    while n < due:
        i = n % k
        senders[i].send(frames[i][(n // k) % m])
        n += 1
    time.sleep(0.001)
sent = sum(s.num_sent for s in senders); dropped = sum(s.num_dropped for s in senders)
print(json.dumps({"sent": sent, "dropped": dropped, "elapsed_s": time.monotonic() - t0}))
for s in senders:
    s.close()
"""


def load_frames(rank_index: int, n: int) -> list[bytes]:
    """Pre-encoded step frames of one simulated rank (8 ranks per server), spec on and off."""
    rng = random.Random(rank_index)
    out = []
    now = time.time()
    for i in range(n):
        bs = rng.choice((1, 2, 4, 8, 16, 32, 64, 128))
        steps = rng.choice((0, 1, 3))
        acc = [rng.randint(0, steps) for _ in range(bs)] if steps else None
        out.append(wire.encode_step_fields(
            server=f"load-{rank_index // 8}", rank=rank_index % 8, iter=i, ts=now - 1.0, batch_size=bs,
            steps=steps, topk=1, draft_tokens=steps + 1 if steps else 1, accepted=acc,
            step_ms=6.0 + 0.05 * bs + 2.0 * steps))
    return out


def _peak_rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def _metric(port: int, name: str) -> float:
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return float("nan")
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def load_test(workdir: str | os.PathLike[str], *, ranks: int = 64, rate_per_rank: float = 1000.0,
              duration_s: float = 60.0, processes: int = 2, shed: bool = True,
              status_interval_s: float = 0.05, ctx: Optional[zmq.Context] = None,
              frames_per_rank: int = 256, hwm: int = 10_000) -> dict[str, Any]:
    """`ranks` simulated engine ranks (one PUSH socket each, pre-encoded frames, spread over
    `processes` sender processes) push at `rate_per_rank` steps/s into one `specctl serve` for
    `duration_s`; status is queried every `status_interval_s` from here. Figures: offered vs
    taken (fitted + shed + still queued), engine-side drops, peak RSS, status latency."""
    ctx = ctx or zmq.Context.instance()
    work = Path(workdir)
    eps = _private_endpoints(work / "run")
    mport = free_port()
    extra = ["--metrics", str(mport), "--refit-interval", "5", "--configs", "off s1 s3"]
    if shed:
        extra.append("--shed-when-behind")
    p = ServeProcess(eps, work / "state", *extra).start(ctx)
    procs = []
    try:
        rank_ids = list(range(ranks))
        for k in range(processes):
            cfg = {"endpoint": eps["telemetry"], "ranks": rank_ids[k::processes], "rate": rate_per_rank,
                   "duration_s": duration_s, "frames_per_rank": frames_per_rank, "hwm": hwm}
            procs.append(subprocess.Popen([sys.executable, "-c", _SENDER, json.dumps(cfg)],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        lat_ms: list[float] = []
        timeouts = 0
        t0 = time.monotonic()
        samples_at: list[tuple[float, int]] = []
        while any(q.poll() is None for q in procs):
            t = time.perf_counter()
            try:
                st = p.status(ctx, timeout_ms=2000)
                lat_ms.append((time.perf_counter() - t) * 1000.0)
                samples_at.append((time.monotonic() - t0, int(st["records_in"])))
            except transport.TransportError:
                timeouts += 1
            time.sleep(status_interval_s)
        results = []
        for q in procs:
            out, err = q.communicate(timeout=30)
            try:
                results.append(json.loads(out.decode().strip().splitlines()[-1]))
            except (ValueError, IndexError):
                raise RuntimeError(f"sender failed: {err.decode()[-2000:]}") from None
        # what arrives within a few seconds after the senders stop counts as taken, late
        time.sleep(2.0)
        st = p.status(ctx)
        records = int(st["records_in"])
        shed_n = _metric(mport, "specctl_records_shed_total")
        rejected = sum(st["rejected"].values())
        rss = _peak_rss_mb(p.pid)
        refit_ms = float(st.get("last_refit_ms", float("nan")))
    finally:
        for q in procs:
            if q.poll() is None:
                q.kill()
        p.kill()
    sent = sum(r["sent"] for r in results)
    dropped = sum(r["dropped"] for r in results)
    elapsed = max(r["elapsed_s"] for r in results)
    offered = sent + dropped
    in_window = [n for t, n in samples_at if 1.0 <= t <= duration_s]
    fit_rate = ((in_window[-1] - in_window[0]) / max(1e-9, (duration_s - 1.0)) if len(in_window) > 1 else float("nan"))
    return {
        "ranks": ranks, "target_steps_per_s": ranks * rate_per_rank, "duration_s": duration_s,
        "sender_processes": processes, "shed_when_behind": shed,
        "offered": offered, "offered_per_s": round(offered / elapsed, 1),
        "sent": sent, "dropped_at_engines": dropped,
        "fitted": records, "shed": int(shed_n) if math.isfinite(shed_n) else None, "rejected": rejected,
        "taken_per_s": round((records + (shed_n if math.isfinite(shed_n) else 0)) / elapsed, 1),
        "fitted_per_s_steady": round(fit_rate, 1),
        "unaccounted": int(sent - records - (shed_n if math.isfinite(shed_n) else 0) - rejected),
        "peak_rss_mb": round(rss, 1), "last_refit_ms": refit_ms,
        "status_queries": len(lat_ms), "status_timeouts": timeouts,
        "status_ms_p50": round(percentile(lat_ms, 50), 2), "status_ms_p99": round(percentile(lat_ms, 99), 2),
        "status_ms_max": round(max(lat_ms) if lat_ms else float("nan"), 2),
    }


