"""Control-loop benchmarks: wire encode/decode, daemon ingest over real sockets, refit time.

    python benchmarks/control_loop.py [wire|ingest|refit|all] [--out benchmarks/results/control-loop.json]

Prints figures and writes a JSON record (machine facts included)."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import zmq

from specctl.controller import transport, wire
from specctl.controller.daemon import Daemon, Endpoints, wait_for_status
from specctl.controller.service import ControllerService, ServiceSettings
from specctl.training.costmodel import CostModel, Sample
from specctl.training.synth import generate, truth_with_crossover


def _frames(n: int, seed: int = 1) -> list[bytes]:
    truth = truth_with_crossover(24)
    return [json.dumps(r, separators=(",", ":")).encode()
            for r in generate(truth, num_steps=n, batch_sizes=list(range(1, 65)), seed=seed)]


def bench_wire(n: int = 50_000) -> dict:
    rec = wire.StepRecord(server="sglang-0", rank=0, iter=18234, ts=1764441600.125, batch_size=24,
                          config=wire.SpecConfig(steps=3, topk=1, draft_tokens=4),
                          accepted=[3, 1, 0, 2] * 6, step_ms=11.8, ctx_tokens=51234)
    frame = wire.encode(rec)
    for _ in range(2000):
        wire.decode(wire.encode(rec))
    t = time.perf_counter()
    for _ in range(n):
        wire.decode(wire.encode(rec))
    roundtrip = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(n):
        wire.decode_step(frame)
    dec = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(n):
        wire.encode_step_fields(server="sglang-0", rank=0, iter=18234, ts=1764441600.125, batch_size=24,
                                steps=3, topk=1, draft_tokens=4, accepted=[3, 1, 0, 2] * 6,
                                step_ms=11.8, ctx_tokens=51234)
    fast = (time.perf_counter() - t) / n * 1e6
    # the engine's send with no daemon at the endpoint: NOBLOCK, dropped and counted
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as d:
        tx = transport.TelemetrySender(ctx, f"ipc://{d}/nobody.sock", hwm=10)
        t = time.perf_counter()
        for _ in range(n):
            tx.send(frame)
        alone = (time.perf_counter() - t) / n * 1e6
        dropped = tx.num_dropped
        tx.close()
    ctx.term()
    out = {"record_bytes": len(frame), "encode_decode_us": round(roundtrip, 2),
           "decode_us": round(dec, 2), "hot_path_encode_us": round(fast, 2),
           "send_without_daemon_us": round(alone, 2), "n": n, "goal_encode_decode_us": 20}
    print(f"wire: encode+decode {roundtrip:.2f} us/record (goal <= 20), decode {dec:.2f} us, "
          f"engine hot-path encode {fast:.2f} us ({len(frame)} B, batch 24); a send with no daemon "
          f"{alone:.2f} us ({dropped} of {n} dropped and counted)")
    return out


def _sender(endpoint: str, frames: list[bytes], ready: "mp.Event") -> None:  # type: ignore[name-defined]
    ctx = zmq.Context()
    sock = transport.telemetry_blocking_push(ctx, endpoint, hwm=10_000)
    ready.wait()
    for f in frames:
        sock.send(f)
    sock.close()
    ctx.term()


def bench_ingest(n: int = 300_000) -> dict:
    """A separate process pushes pre-encoded frames as fast as it can (blocking at the HWM, so
    nothing is dropped); the daemon (this process, one thread) validates and fits every one."""
    frames = _frames(n)
    with tempfile.TemporaryDirectory() as d:
        eps = Endpoints(telemetry=f"ipc://{d}/t.sock", publish=f"ipc://{d}/p.sock", status=f"ipc://{d}/s.sock")
        svc = ControllerService(ServiceSettings(refit_interval_s=5.0), clock=time.time)
        daemon = Daemon(svc, eps, ctx=zmq.Context())
        th = threading.Thread(target=daemon.run, daemon=True)
        th.start()
        wait_for_status(daemon.ctx, eps.status)
        mpctx = mp.get_context("spawn")
        ready = mpctx.Event()
        p = mpctx.Process(target=_sender, args=(eps.telemetry, frames, ready))
        p.start()
        time.sleep(1.0)
        t0 = time.perf_counter()
        ready.set()
        while svc.model.num_samples_ < n and time.perf_counter() - t0 < 120:
            time.sleep(0.01)
        el = time.perf_counter() - t0
        got = svc.model.num_samples_
        daemon.stop_event.set()
        th.join(5)
        p.join(10)
    rate = got / el
    print(f"ingest: {got}/{n} records in {el:.2f} s = {rate:,.0f} records/s over ipc "
          f"(goal >= 50,000/s on one core); rejected {int(sum(svc.status()['rejected'].values()))}")
    return {"records": got, "sent": n, "seconds": round(el, 3), "records_per_s": round(rate),
            "goal_records_per_s": 50_000}


def bench_refit(n: int = 1_000_000) -> dict:
    """Refit time with a 1M-record window (the model aggregates, so refit cost depends on the
    number of (config, batch size) cells, not on the number of records)."""
    truth = truth_with_crossover(40)
    model = CostModel(half_life_s=1e9)
    t = time.perf_counter()
    recs = generate(truth, num_steps=n, batch_sizes=list(range(1, 257)), seed=2)
    for r in recs:
        c = r["config"]
        model.observe(Sample(ts=r["ts"], config=(c["steps"], c["topk"], c["draft_tokens"]),
                             batch_size=r["batch_size"], step_ms=r["step_ms"], accepted=r.get("accepted")))
    ingest = time.perf_counter() - t
    times = []
    for _ in range(5):
        t = time.perf_counter()
        model.refit()
        [model.predict_step_ms(c, range(1, 1025)) for c in model.configs() if model.has_step_time(c)]
        times.append(time.perf_counter() - t)
    svc = ControllerService(ServiceSettings(), clock=lambda: 2e9)
    svc.fitter.model = model
    t = time.perf_counter()
    svc.refit()
    full = time.perf_counter() - t
    best = min(times) * 1000
    print(f"refit: 1M-record window ({len(model.times_)} cells): model refit {best:.1f} ms, "
          f"full refit + table derivation {full * 1000:.1f} ms (observe took {ingest:.1f} s for 1M)")
    return {"records": n, "cells": len(model.times_), "model_refit_ms": round(best, 2),
            "service_refit_ms": round(full * 1000, 2), "observe_s_per_1M": round(ingest, 2),
            "policy_crossover": svc.policy.model.get("spec_off_crossover"), "true_crossover": truth.crossover()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", nargs="?", default="all", choices=["wire", "ingest", "refit", "all"])
    ap.add_argument("--out", default="benchmarks/results/control-loop.json")
    args = ap.parse_args()
    res: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                             "python": platform.python_version()},
                 "date": time.strftime("%Y-%m-%d")}
    if args.which in ("wire", "all"):
        res["wire"] = bench_wire()
    if args.which in ("ingest", "all"):
        res["ingest"] = bench_ingest()
    if args.which in ("refit", "all"):
        res["refit"] = bench_refit()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    prev = json.loads(out.read_text()) if out.exists() else {}
    prev.update(res)
    out.write_text(json.dumps(prev, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
