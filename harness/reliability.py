"""Fault, load and hostile-input drills for `specctl bench reliability` (and, scaled down, CI).

Each drill runs the real pieces (StateStore, `specctl serve` as a subprocess, EngineController on
real sockets, the wire decoder and file readers) and returns a dict of figures; `run_all` writes
them to a JSON record and `render_markdown` to docs/reliability.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import zmq

from ..controller import transport, wire
from ..controller.state import StateStore

log = logging.getLogger("specctl.reliability")

CANDIDATE_STEPS = (0, 1, 3)


# ============================================================================ shared pieces


def policy_for_version(version: int) -> wire.PolicyRecord:
    """A distinct, valid policy per version (the crossover moves with it)."""
    cut = 2 + version % 60
    return wire.policy_from_obj({
        "kind": "policy", "schema": 1, "version": version, "created_at": 1764441600.0 + version,
        "source": "online",
        "table": [{"min_batch": 1, "max_batch": cut, "config": {"steps": 3, "topk": 1, "draft_tokens": 4}},
                  {"min_batch": cut + 1, "max_batch": None, "config": {"steps": 0, "topk": 1, "draft_tokens": 1}}],
        "model": {"note": "x" * (version % 200)},  # sizes vary: a torn write shows
    })


def model_for_version(version: int) -> dict[str, Any]:
    return {"kind": "specctl.model", "v": version, "cells": [[version, i] for i in range(version % 50)]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(math.ceil(q / 100.0 * len(v))) - 1))]


class ServeProcess:
    """`specctl serve` as a real subprocess (SIGKILL, SIGSTOP and restarts are real)."""

    def __init__(self, endpoints: dict[str, str], state_dir: Path, *extra: str):
        self.endpoints = endpoints
        self.args = [sys.executable, "-m", "specctl.controller.cli", "--log-level", "WARNING", "serve",
                     "--telemetry", endpoints["telemetry"], "--publish", endpoints["publish"],
                     "--status", endpoints["status"], "--state-dir", str(state_dir), *extra]
        self.proc: Optional[subprocess.Popen] = None
        self.ready_s = float("nan")

    def start(self, ctx: zmq.Context, timeout_s: float = 60.0) -> "ServeProcess":
        from ..controller.daemon import wait_for_status

        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_for_status(ctx, self.endpoints["status"], timeout_s=timeout_s)
        except transport.TransportError:
            self.kill()
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            raise RuntimeError(f"specctl serve did not start: {err[-2000:]}") from None
        self.ready_s = time.monotonic() - t0
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def status(self, ctx: zmq.Context, cmd: str = "status", timeout_ms: int = 3000) -> dict[str, Any]:
        return transport.status_request(ctx, self.endpoints["status"], {"cmd": cmd}, timeout_ms=timeout_ms)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process must run to die cleanly
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()


def _settings(**kw: Any):
    from ..plugin.engine import PluginSettings

    return PluginSettings(**kw)


class EngineLoop:
    """One engine rank as the SGLang hooks drive it (plugin/sglang_hooks.py), without SGLang:
    decide -> telemetry frame -> NOBLOCK send -> every `sync_every` results: drain the policy
    subscription, offer the newest frame, apply at the boundary."""

    def __init__(self, ctx: zmq.Context, endpoints: dict[str, str], *, stale_after_s: float = 30.0,
                 sync_every: int = 8, server_id: str = "drill-0", hwm: int = 10_000,
                 keys: Optional[transport.CurveKeys] = None):
        from ..plugin.engine import EngineController

        s = _settings(server_id=server_id, telemetry_endpoint=endpoints["telemetry"],
                      policy_endpoint=endpoints["publish"], stale_after_s=stale_after_s,
                      sync_every=sync_every, telemetry_hwm=hwm)
        self.engine = EngineController(s, candidate_steps=CANDIDATE_STEPS)
        self.sender = transport.TelemetrySender(ctx, endpoints["telemetry"], hwm=hwm, keys=keys)
        self.receiver = transport.PolicyReceiver(ctx, endpoints["publish"], keys=keys)
        self.iter = 0
        self.rng = random.Random(7)

    def step(self, batch_size: int) -> int:
        eng = self.engine
        steps = eng.decide(batch_size)
        self.iter += 1
        acc = [self.rng.randint(0, steps) for _ in range(batch_size)] if steps else None
        frame = eng.step_record(iter=self.iter, ts=time.time(), batch_size=batch_size,
                                draft_tokens=steps + 1 if steps else 1, accepted=acc, step_ms=8.0)
        self.sender.send(frame)
        if eng.note_result():
            f = self.receiver.poll()
            if f is not None:
                eng.offer_policy_frame(f)
            eng.sync()
        return steps

    def run_for(self, seconds: float, *, until: Optional[Callable[[], bool]] = None,
                rate_hz: float = 2000.0, batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)) -> bool:
        """Step at about `rate_hz` for up to `seconds`; True as soon as `until()` holds."""
        t0 = time.monotonic()
        n = 0
        while True:
            now = time.monotonic()
            if until is not None and until():
                return True
            if now - t0 >= seconds:
                return until is None
            due = int((now - t0) * rate_hz)
            while n < due:
                self.step(batch_sizes[n % len(batch_sizes)])
                n += 1
            time.sleep(0.0005)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


# ============================================================================ faults


_ZYGOTE = r"""
import os, signal, struct, sys
from specctl.harness.reliability import policy_for_version, model_for_version
from specctl.controller.state import StateStore
out = sys.stdout.buffer
for line in sys.stdin:
    cmd = line.split()
    if cmd[0] == "fork":
        directory, start = cmd[1], int(cmd[2])
        pid = os.fork()
        if pid == 0:
            try:
                store = StateStore(directory)
                v = start
                os.write(1, b"started\n")
                while True:
                    store.save_policy(policy_for_version(v))
                    store.save_model(model_for_version(v))
                    os.write(1, b"done %d\n" % v)
                    v += 1
            finally:
                os._exit(0)
        out.write(b"pid %d\n" % pid); out.flush()
    elif cmd[0] == "reap":
        os.waitpid(int(cmd[1]), 0)
        out.write(b"reaped\n"); out.flush()
"""


def kill_during_write(directory: str | os.PathLike[str], *, num_kills: int = 200, seed: int = 0,
                      max_delay_s: float = 0.03) -> dict[str, Any]:
    """A writer saving policy + model state in a loop (the StateStore the daemon uses) is
    SIGKILLed at a random moment, `num_kills` times; after each kill a restart must load the last
    policy whose save completed (or the one in flight, if its rename landed), byte for byte.
    Children are forked by a single-threaded helper process, so a kill costs milliseconds."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    zyg = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert zyg.stdin is not None and zyg.stdout is not None
    failures: list[str] = []
    recovery_ms: list[float] = []
    num_torn_tmp = 0  # kills that left a half-written temporary file: the risky window was hit
    num_prev_used = 0
    num_survived = 0
    writes = 0
    # a daemon persists its first policy before it serves: that is the first "last good" state
    seed_store = StateStore(d)
    seed_store.save_policy(policy_for_version(1))
    seed_store.save_model(model_for_version(1))
    start = 2
    model_done = 1
    try:
        for i in range(num_kills):
            zyg.stdin.write(f"fork {d} {start}\n".encode())
            zyg.stdin.flush()
            pid, started = 0, False
            last_done = start - 1
            # the child's lines and the helper's may come in any order: on a loaded machine the
            # child can finish saves before the helper gets to report its pid
            while not (pid and started):
                line = zyg.stdout.readline()
                if line.startswith(b"pid "):
                    pid = int(line.split()[1])
                elif line == b"started\n":
                    started = True
                elif line.startswith(b"done "):
                    last_done = int(line.split()[1])
                else:
                    raise RuntimeError(f"state-writer helper failed: {line!r}")
            time.sleep(rng.uniform(0, max_delay_s))
            os.kill(pid, signal.SIGKILL)
            zyg.stdin.write(f"reap {pid}\n".encode())
            zyg.stdin.flush()
            while True:
                line = zyg.stdout.readline()
                if line == b"reaped\n" or not line:
                    break
                if line.startswith(b"done "):
                    last_done = int(line.split()[1])
            writes += last_done - (start - 1)
            if list(d.glob(".*.tmp.*")):
                num_torn_tmp += 1
            # the restart: what `specctl serve` does first
            t0 = time.perf_counter()
            store = StateStore(d)
            pol = store.load_policy()
            model = store.load_model()
            recovery_ms.append((time.perf_counter() - t0) * 1000.0)
            if store.problems:
                num_prev_used += 1
            ok = True
            if pol is None:
                failures.append(f"kill {i}: no policy recovered (last completed v{last_done})")
                ok = False
            else:
                if pol.version not in (last_done, last_done + 1):
                    failures.append(f"kill {i}: recovered v{pol.version}, last completed v{last_done}")
                    ok = False
                elif wire.encode(pol) != wire.encode(policy_for_version(pol.version)):
                    failures.append(f"kill {i}: recovered v{pol.version} differs from what was written")
                    ok = False
            # the model is saved after its policy: the last one saved whole may be older than the
            # policy (a kill between the two), never older than the last completed pair
            if last_done >= start:
                model_done = last_done  # printed "done": this pair was saved whole
            mv = model.get("v") if isinstance(model, dict) else None
            if (not isinstance(mv, int) or not model_done <= mv <= last_done + 1
                    or model != model_for_version(mv)):
                failures.append(f"kill {i}: model state v{mv} recovered, last completed v{model_done}")
                ok = False
            if list(d.glob(".*.tmp.*")):
                failures.append(f"kill {i}: temporary files left after the restart")
                ok = False
            num_survived += ok
            start = (pol.version if pol is not None else last_done) + 1
    finally:
        zyg.stdin.close()
        zyg.kill()
        zyg.wait(10)
    return {
        "kills": num_kills, "survived": num_survived, "failures": failures[:10],
        "num_failures": len(failures), "state_writes_completed": writes,
        "kills_mid_temp_file": num_torn_tmp, "restarts_using_prev_copy": num_prev_used,
        "recovery_ms_p50": round(percentile(recovery_ms, 50), 3),
        "recovery_ms_max": round(max(recovery_ms) if recovery_ms else float("nan"), 3),
    }


def _private_endpoints(base: Path) -> dict[str, str]:
    return transport.default_endpoints(transport.runtime_dir(base))


def _records_in(p: ServeProcess, ctx: zmq.Context) -> int:
    try:
        return int(p.status(ctx, timeout_ms=1000)["records_in"])
    except transport.TransportError:
        return -1


def engine_without_daemon(workdir: str | os.PathLike[str], *, ctx: Optional[zmq.Context] = None,
                          absent_s: float = 1.0, timeout_s: float = 60.0) -> dict[str, Any]:
    """The engine starts first: it decides on the fallback, its telemetry is dropped and counted
    without blocking; once the daemon starts, the engine picks up its policy and the daemon sees
    its telemetry, with no engine restart."""
    ctx = ctx or zmq.Context.instance()
    work = Path(workdir)
    eps = _private_endpoints(work / "run")
    eng = EngineLoop(ctx, eps, stale_after_s=0.5)
    proc = None
    try:
        eng.run_for(absent_s)
        before = eng.engine.status()
        dropped_absent = eng.sender.num_dropped
        proc = ServeProcess(eps, work / "state", "--heartbeat", "0.1").start(ctx)
        t0 = time.monotonic()
        got_policy = eng.run_for(timeout_s, until=lambda: eng.engine.active_source != "fallback")
        policy_s = time.monotonic() - t0
        got_tel = eng.run_for(timeout_s, until=lambda: _records_in(proc, ctx) > 0)
        tel_s = time.monotonic() - t0
        return {
            "steps_without_daemon": before["num_results"],
            "source_without_daemon": before["source"],
            "fallback_reason": before["fallback_reason"],
            "frames_dropped_without_daemon": dropped_absent,
            "daemon_start_s": round(proc.ready_s, 3),
            "policy_applied": got_policy, "policy_after_daemon_ready_s": round(policy_s, 3),
            "telemetry_arrives": got_tel, "telemetry_after_daemon_ready_s": round(tel_s, 3),
            "engine_source_after": eng.engine.active_source,
            "survived": bool(got_policy and got_tel and before["source"] == "fallback"),
        }
    finally:
        eng.close()
        if proc is not None:
            proc.kill()


def daemon_restart(workdir: str | os.PathLike[str], *, ctx: Optional[zmq.Context] = None,
                   stale_after_s: float = 1.0, timeout_s: float = 60.0) -> dict[str, Any]:
    """SIGKILL the daemon while an engine runs: the engine keeps deciding, goes to the fallback
    once the policy is stale; a restarted daemon (same state dir) is found again without an
    engine restart: its policy is applied and it receives telemetry."""
    ctx = ctx or zmq.Context.instance()
    work = Path(workdir)
    eps = _private_endpoints(work / "run")
    eng = EngineLoop(ctx, eps, stale_after_s=stale_after_s)
    p1 = p2 = None
    try:
        p1 = ServeProcess(eps, work / "state", "--heartbeat", "0.1").start(ctx)
        ok1 = eng.run_for(timeout_s, until=lambda: eng.engine.active_source != "fallback")
        version = eng.engine.active_version
        p1.signal(signal.SIGKILL)
        p1.proc.wait(10)  # type: ignore[union-attr]
        t_kill = time.monotonic()
        fell_back = eng.run_for(stale_after_s + timeout_s, until=lambda: eng.engine.active_source == "fallback")
        fallback_s = time.monotonic() - t_kill
        fallback_reason = eng.engine.fallback_reason
        results_before = eng.engine.stats.num_results
        p2 = ServeProcess(eps, work / "state", "--heartbeat", "0.1").start(ctx)
        t_up = time.monotonic()
        try:
            resumed = p2.status(ctx, timeout_ms=1000)["resumed_policy_version"]
        except transport.TransportError:
            resumed = None
        back = eng.run_for(timeout_s, until=lambda: eng.engine.active_source != "fallback")
        back_s = time.monotonic() - t_up
        tel = eng.run_for(timeout_s, until=lambda: _records_in(p2, ctx) > 0)
        tel_s = time.monotonic() - t_up
        return {
            "policy_before_kill": ok1, "version_before": version,
            "engine_kept_stepping": eng.engine.stats.num_results > results_before,
            "fell_back_after_kill": fell_back, "fallback_after_kill_s": round(fallback_s, 3),
            "fallback_reason": fallback_reason,
            "stale_after_s": stale_after_s,
            "restart_s": round(p2.ready_s, 3),
            "policy_back": back, "policy_back_after_restart_s": round(back_s, 3),
            "resumed_version": resumed, "version_after": eng.engine.active_version,
            "telemetry_resumes": tel, "telemetry_after_restart_s": round(tel_s, 3),
            # the restarted daemon took up the persisted policy: the engine's, or a newer one the
            # killed daemon had made since; and the version count goes on from it (telemetry may
            # already have made a newer one by the time the engine hears from the daemon)
            "survived": bool(ok1 and fell_back and back and tel and resumed is not None and resumed >= version
                             and (eng.engine.active_version or 0) >= resumed),
        }
    finally:
        eng.close()
        for p in (p1, p2):
            if p is not None:
                p.kill()


def frozen_daemon(workdir: str | os.PathLike[str], *, ctx: Optional[zmq.Context] = None,
                  stale_after_s: float = 1.0, frozen_s: float = 2.5, hwm: int = 10_000,
                  stall_budget_us: float = 50.0, max_frozen_s: float = 120.0) -> dict[str, Any]:
    """SIGSTOP the daemon (it stops reading and publishing) while the engine steps flat out, for
    `frozen_s` and on until the engine has fallen back and dropped frames (at most `max_frozen_s`:
    a loaded machine steps slower). Every step is timed (the figures) and its voluntary context
    switches counted: a step that waited on anything (a blocking send, a send timeout, a lock)
    slept in the kernel, whatever the machine's load; preemption by other processes is
    involuntary. Frames beyond the queue are dropped and counted; the policy goes stale ->
    fallback; SIGCONT -> the policy is back."""
    ctx = ctx or zmq.Context.instance()
    work = Path(workdir)
    eps = _private_endpoints(work / "run")
    eng = EngineLoop(ctx, eps, stale_after_s=stale_after_s, hwm=hwm)
    p = None
    try:
        p = ServeProcess(eps, work / "state", "--heartbeat", "0.1").start(ctx)
        ok = eng.run_for(60.0, until=lambda: eng.engine.active_source != "fallback")
        p.signal(signal.SIGSTOP)
        t_stop = time.monotonic()
        sizes = (1, 2, 4, 8, 16, 32, 64)
        stalls: list[int] = []
        sends: list[int] = []
        fallback_at = None
        fallback_reason = None
        dropped0, sent0 = eng.sender.num_dropped, eng.sender.num_sent
        clock = time.perf_counter_ns
        e = eng.engine
        n = 0
        import resource

        usage = resource.getrusage
        who = resource.RUSAGE_THREAD
        waited = 0  # steps with a voluntary context switch: the thread slept on something
        blocked = preempted = on_cpu = 0  # why each step over the budget took long
        cpu = time.thread_time_ns
        worst_cpu_ns = 0
        threads = threading.active_count()  # another Python thread could make a step wait for the GIL
        while True:
            frozen_for = time.monotonic() - t_stop
            if frozen_for >= max_frozen_s or (frozen_for >= frozen_s and fallback_at is not None
                                              and eng.sender.num_dropped > dropped0):
                break
            bs = sizes[n % 7]
            u0 = usage(who)
            c0 = cpu()
            t0 = clock()
            # one engine step, as the hooks run it (decide, frame, send, result, sync)
            steps = e.decide(bs)
            eng.iter += 1
            frame = e.step_record(iter=eng.iter, ts=1764441600.0, batch_size=bs,
                                  draft_tokens=steps + 1 if steps else 1,
                                  accepted=[1] * bs if steps else None, step_ms=8.0)
            t1 = clock()
            eng.sender.send(frame)
            t2 = clock()
            if e.note_result():
                f = eng.receiver.poll()
                if f is not None:
                    e.offer_policy_frame(f)
                e.sync()
            t3 = clock()
            c3 = cpu()
            u1 = usage(who)
            if c3 - c0 > worst_cpu_ns:
                worst_cpu_ns = c3 - c0
            # a voluntary context switch = the thread waited on something (a blocking send
            # would); an involuntary one = the OS ran another process (2 shared cores)
            slept = u1.ru_nvcsw > u0.ru_nvcsw
            waited += slept
            if t3 - t0 > stall_budget_us * 1000:
                if slept:
                    blocked += 1
                elif u1.ru_nivcsw > u0.ru_nivcsw:
                    preempted += 1
                else:
                    on_cpu += 1
            stalls.append(t3 - t0)
            sends.append(t2 - t1)
            n += 1
            if fallback_at is None and e.active_source == "fallback":
                fallback_at = time.monotonic() - t_stop
                fallback_reason = e.fallback_reason
        frozen_for = time.monotonic() - t_stop
        dropped = eng.sender.num_dropped - dropped0
        sent = eng.sender.num_sent - sent0
        p.signal(signal.SIGCONT)
        t_cont = time.monotonic()
        back = eng.run_for(60.0, until=lambda: e.active_source != "fallback")
        back_s = time.monotonic() - t_cont
        stalls_us = [x / 1000.0 for x in stalls]
        sends_us = [x / 1000.0 for x in sends]
        over = sum(1 for x in stalls_us if x > stall_budget_us)
        return {
            "policy_before": ok, "frozen_s": round(frozen_for, 3), "steps_while_frozen": n,
            "frames_queued_then_dropped": {"sent": sent, "dropped": dropped},
            "step_us_p50": round(percentile(stalls_us, 50), 2),
            "step_us_p99": round(percentile(stalls_us, 99), 2),
            "step_us_p9999": round(percentile(stalls_us, 99.99), 2),
            "step_us_max": round(max(stalls_us), 2),
            "send_us_max": round(max(sends_us), 2),
            "steps_over_budget": over, "stall_budget_us": stall_budget_us,
            "over_budget_waiting": blocked, "over_budget_preempted": preempted,
            "over_budget_on_cpu": on_cpu,
            "steps_waited": waited, "python_threads": threads,
            "step_cpu_us_max": round(worst_cpu_ns / 1000.0, 2),
            "fell_back": fallback_at is not None,
            "fallback_after_freeze_s": None if fallback_at is None else round(fallback_at, 3),
            "fallback_reason": fallback_reason, "stale_after_s": stale_after_s,
            "policy_back_after_resume_s": round(back_s, 3), "policy_back": back,
            "survived": bool(ok and fallback_at is not None and back and dropped > 0 and waited == 0),
        }
    finally:
        eng.close()
        if p is not None:
            p.kill()


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
from specctl.harness.reliability import load_frames
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


# ============================================================================ hostile input
#
# Property-based (hypothesis): every case goes through the real decoder / reader; the outcome is
# "accepted" (and then the result must satisfy its invariants) or a rejection with a reason.
# Anything else raised is a crash; an accepted result that breaks an invariant is a bad policy or
# a bad sample. Both are counted with the first examples, never raised, so a run reports figures.


class Violation(AssertionError):
    """An accepted input produced something it must not (a bad policy, a bad sample)."""


@dataclass
class FuzzTally:
    target: str
    tried: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> cases
    crashes: int = 0
    violations: int = 0
    examples: list[str] = field(default_factory=list)
    extra: Counter = field(default_factory=Counter)

    def to_obj(self) -> dict[str, Any]:
        return {"target": self.target, "tried": self.tried, "accepted": self.accepted,
                "rejected": sum(self.rejected.values()), "rejected_by_reason": dict(self.rejected.most_common(12)),
                "crashes": self.crashes, "violations": self.violations, "examples": self.examples[:5],
                **dict(self.extra)}


STEP_BASES: list[dict[str, Any]] = [
    {"kind": "step", "schema": 1, "server": "sglang-0", "rank": 0, "iter": 18234, "ts": 1764441600.125,
     "batch_size": 4, "config": {"steps": 3, "topk": 1, "draft_tokens": 4}, "accepted": [3, 1, 0, 2],
     "step_ms": 11.8, "ctx_tokens": 51234},
    {"kind": "step", "schema": 1, "server": "s", "rank": 1, "iter": 0, "ts": 1.0, "batch_size": 1,
     "config": {"steps": 0, "topk": 1, "draft_tokens": 1}, "step_ms": 6.0},
    {"kind": "step", "schema": 1, "server": "tree", "rank": 0, "iter": 5, "ts": 2.0, "batch_size": 2,
     "config": {"steps": 2, "topk": 4, "draft_tokens": 8}, "accepted": [2, 0], "step_ms": 9.5},
]
POLICY_BASES: list[dict[str, Any]] = [
    {"kind": "policy", "schema": 1, "version": 7, "created_at": 1764441600.0, "source": "online",
     "table": [{"min_batch": 1, "max_batch": 6, "config": {"steps": 3, "topk": 1, "draft_tokens": 4}},
               {"min_batch": 7, "max_batch": None, "config": {"steps": 0, "topk": 1, "draft_tokens": 1}}],
     "model": {"samples": 10}},
    {"kind": "policy", "schema": 1, "version": 2, "created_at": 5.0, "source": "fixed",
     "table": [{"min_batch": 1, "max_batch": None, "config": {"steps": 1, "topk": 1, "draft_tokens": 2}}],
     "explore": [{"min_batch": 1, "max_batch": 8, "config": {"steps": 3, "topk": 1, "draft_tokens": 4}}],
     "explore_period": 64},
    {"kind": "policy", "schema": 1, "version": 9, "created_at": 6.0, "source": "online",
     "table": [{"min_batch": 1, "max_batch": None, "config": {"steps": 0, "topk": 1, "draft_tokens": 1}}],
     "challenge": [{"min_batch": 4, "max_batch": 7, "config": {"steps": 1, "topk": 1, "draft_tokens": 2}}],
     "challenge_period": 16},
]
BENCH_BASE: dict[str, Any] = {
    "backend": "sglang", "dataset_name": "random", "request_rate": float("inf"), "max_concurrency": 16,
    "duration": 100.0, "completed": 256, "output_throughput": 2100.5, "median_tpot_ms": 7.9,
    "accept_length": 2.6,
    "server_info": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
                    "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
                    "speculative_adaptive": False, "max_running_requests": 256, "tp_size": 1,
                    "version": "0.5.23"},
}
SGLANG_LINES: list[str] = [
    "[2025-11-29 12:00:00] server_args=ServerArgs(model_path='/m', tp_size=1, max_running_requests=256, "
    "speculative_algorithm='EAGLE3', speculative_num_steps=3, speculative_eagle_topk=1, "
    "speculative_num_draft_tokens=4, decode_log_interval=40)",
    "[2025-11-29 12:00:00] server_args={'model_path': '/m', 'tp_size': 1, 'speculative_algorithm': 'EAGLE3', "
    "'speculative_num_steps': 3, 'speculative_eagle_topk': 1, 'speculative_num_draft_tokens': 4, "
    "'speculative_adaptive': True, 'decode_log_interval': 10, 'max_running_requests': None}",
    "[2025-11-29 12:00:30] Decode batch, #running-req: 2, #token: 1491, token usage: 0.01, cuda graph: True, "
    "gen throughput (token/s): 305.34, #queue-req: 0",
    "[2025-11-29 12:00:30.092 TP0] Decode batch, #running-req: 4, #token: 2237, token usage: 0.01, "
    "accept len: 2.73, accept rate: 0.57, cuda graph: True, gen throughput (token/s): 1172.80, #queue-req: 0",
    "[2025-11-29 12:00:31.180 TP0] Decode batch [4321], #running-req: 64, #token: 9000, token usage: 0.31, "
    "accept len: 1.92, accept rate: 0.46, cuda graph: True, gen throughput (token/s): 8000.10, #queue-req: 3",
    "[2025-11-29 12:00:30] Prefill batch, #new-seq: 2, #new-token: 586, #cached-token: 0, token usage: 0.05, "
    "#running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 10.0",
    "[2025-11-29 12:00:30.092 TP0] Built adaptive runtime state steps=1: elapsed=1.92s, mem=0.41GB",
    "[2025-11-29 12:00:30.694 TP0] Adaptive spec params updated: steps 3 -> 1 (ema_accept_len=3.25)",
    "[2025-11-29 12:00:30.695 TP0] Switch adaptive runtime state: steps 3 -> 1, draft_tokens 4 -> 2",
]
HOSTILE_NUMBER_TEXT = ["nan", "NaN", "inf", "-inf", "Infinity", "-1", "-0.0", "0", "1e309", "1e-320",
                       "99999999999999999999999", "", "abc", "0x10", "1_000", "+3", ".", "--1", "2.5.1"]


def _hostile_value(st: Any) -> Any:
    # fresh objects each draw: a shared list mutated in place by later mutations can grow into a
    # DAG whose JSON expansion is exponential
    return st.one_of(
        st.none(), st.booleans(),
        st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([float("nan"), float("inf"), float("-inf"), -1, -1.5, 0, 1e308, 2 ** 63, -(2 ** 63)]),
        st.text(max_size=16), st.builds(lambda: [1] * 70_000), st.builds(lambda: [[[[[]]]]]),
        st.lists(st.integers(min_value=-5, max_value=100), max_size=8),
        st.dictionaries(st.text(max_size=6), st.integers(), max_size=3),
    )


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            out += _paths(v, prefix + (i,))
    return out


def _mutate(draw: Callable[[Any], Any], st: Any, obj: dict[str, Any]) -> None:
    op = draw(st.sampled_from(["replace", "replace", "delete", "add", "schema", "kind", "config",
                               "number"]))
    paths = _paths(obj)
    if op == "schema":
        obj["schema"] = draw(st.one_of(st.integers(min_value=-3, max_value=10), _hostile_value(st)))
        return
    if op == "kind":
        obj["kind"] = draw(st.sampled_from(["step", "policy", "Step", "", "status", None, 1]))
        return
    if op == "config":  # unknown / inconsistent configurations
        cfg = {"steps": draw(st.integers(-2, 80)), "topk": draw(st.integers(-1, 80)),
               "draft_tokens": draw(st.integers(-1, 5000))}
        table = obj.get("table")
        rows = [r for r in table if isinstance(r, dict)] if isinstance(table, list) else []
        if rows:
            draw(st.sampled_from(rows))["config"] = cfg
        else:
            obj["config"] = cfg
        return
    if op == "add":
        parent = obj
        if paths:
            p = draw(st.sampled_from(paths))
            target = obj
            for k in p[:-1]:
                target = target[k]
            parent = target if isinstance(target, dict) else obj
        parent[draw(st.sampled_from(["extra", "Kind", "schema_", "__proto__", "version2"]))] = draw(_hostile_value(st))
        return
    if not paths:
        return
    p = draw(st.sampled_from(paths))
    target = obj
    for k in p[:-1]:
        target = target[k]
    if op == "delete":
        if isinstance(target, dict):
            target.pop(p[-1], None)
        elif isinstance(target, list) and target:
            target.pop(p[-1] if p[-1] < len(target) else -1)
        return
    if op == "number":
        target[p[-1]] = draw(st.sampled_from([float("nan"), float("inf"), -1, -0.0, 0, 1e300, 2 ** 64]))
        return
    target[p[-1]] = draw(_hostile_value(st))


def _frames_strategy(st: Any, bases: list[dict[str, Any]]) -> Any:
    import copy

    @st.composite
    def frames(draw: Any) -> bytes:
        kind = draw(st.sampled_from(["bytes", "truncated", "mutated", "mutated", "mutated", "valid",
                                     "nested", "text"]))
        if kind == "bytes":
            return draw(st.binary(max_size=512))
        if kind == "text":
            return draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")
        if kind == "nested":
            depth = draw(st.integers(1, 200_000))
            return b"[" * depth + b"]" * draw(st.integers(0, depth))
        base = copy.deepcopy(draw(st.sampled_from(bases)))
        enc = json.dumps(base).encode()
        if kind == "valid":
            return enc
        if kind == "truncated":
            return enc[: draw(st.integers(0, len(enc) - 1))]
        for _ in range(draw(st.integers(1, 3))):
            _mutate(draw, st, base)
        if draw(st.integers(0, 5)) == 0:
            _huge_list(draw, st, base)  # last, so no later mutation multiplies it
        return json.dumps(base, allow_nan=True, default=str).encode()

    return frames()


def _huge_list(draw: Callable[[Any], Any], st: Any, obj: dict[str, Any]) -> None:
    n = draw(st.sampled_from([0, 1025, 65537, 70000]))
    if obj.get("kind") == "policy":
        obj["table"] = [{"min_batch": i + 1, "max_batch": None if i == n - 1 else i + 1,
                         "config": {"steps": 1, "topk": 1, "draft_tokens": 2}} for i in range(n)]
    else:
        obj["accepted"] = [1] * n
        if draw(st.booleans()):
            obj["batch_size"] = n


def _fuzz(target: str, strategy: Any, check: Callable[[Any, FuzzTally], str], num_cases: int,
          seed: int) -> FuzzTally:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    tally = FuzzTally(target)

    @hseed(seed)
    @settings(max_examples=num_cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def prop(case: Any) -> None:
        tally.tried += 1
        try:
            outcome = check(case, tally)
        except Violation as e:
            tally.violations += 1
            if len(tally.examples) < 5:
                tally.examples.append(f"violation: {e} <- {repr(case)[:300]}")
            return
        except Exception as e:  # noqa: BLE001 - a crash is what we count
            tally.crashes += 1
            if len(tally.examples) < 5:
                import traceback

                where = traceback.extract_tb(e.__traceback__)[-1]
                tally.examples.append(f"crash: {type(e).__name__}: {str(e)[:200]} at "
                                      f"{Path(where.filename).name}:{where.lineno} <- {repr(case)[:300]}")
            return
        if outcome == "accepted":
            tally.accepted += 1
        else:
            tally.rejected[outcome] += 1

    quiet = [logging.getLogger(n) for n in ("specctl.state", "specctl.plugin", "specctl.service")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)  # every rejection is logged once by design: thousands here
    try:
        prop()
    finally:
        for q, lv in zip(quiet, levels):
            q.setLevel(lv)
    return tally


def _check_step(rec: wire.StepRecord) -> None:
    if not (math.isfinite(rec.ts) and math.isfinite(rec.step_ms) and rec.step_ms > 0 and rec.batch_size >= 1):
        raise Violation(f"accepted a step with ts={rec.ts} step_ms={rec.step_ms} bs={rec.batch_size}")
    if rec.config.steps > 0 and (rec.accepted is None or len(rec.accepted) != rec.batch_size):
        raise Violation("accepted a speculative step without one accepted count per request")


def _strip_model(rec: Any) -> Any:
    return rec.model_copy(update={"model": {}}) if isinstance(rec, wire.PolicyRecord) else rec


def _check_policy(rec: wire.PolicyRecord) -> None:
    wire.check_table_covers(list(rec.table))
    if _strip_model(wire.decode_policy(wire.encode(rec))) != _strip_model(rec):
        raise Violation("an accepted policy does not round-trip")


def fuzz_wire(num_cases: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """wire.decode on hostile frames, and the same frames into the daemon's ingest
    (ControllerService.observe_frame), whose model must still refit to a valid policy."""
    from hypothesis import strategies as st

    from ..controller.metrics import Metrics
    from ..controller.service import ControllerService, ServiceSettings

    svc = ControllerService(ServiceSettings(), metrics=Metrics(), clock=lambda: 1764441700.0)

    def check(frame: bytes, tally: FuzzTally) -> str:
        try:
            rec = wire.decode(frame)
        except wire.WireError as e:
            outcome = e.reason
        else:
            outcome = "accepted"
            if isinstance(rec, wire.StepRecord):
                _check_step(rec)
            else:
                _check_policy(rec)
            again = wire.decode(wire.encode(rec))
            if again != rec and _strip_model(again) != _strip_model(rec):
                raise Violation("an accepted record does not round-trip")
            if again != rec:
                # NaN/inf inside the free-form `model` summary: serialised as null, so the
                # summary (informational, never used to decide) differs; the table does not
                tally.extra["policies_with_nonfinite_model_summary"] += 1
        try:
            step: Optional[wire.StepRecord] = wire.decode_step(frame)
        except wire.WireError:
            step = None
        should_take = step is not None and step.ts <= svc.clock() + svc.settings.max_future_s
        took = svc.observe_frame(frame)
        if took != should_take:
            raise Violation(f"the daemon {'took' if took else 'refused'} a frame decode_step "
                            f"{'rejects' if step is None else 'accepts'}")
        if took and outcome != "accepted":
            tally.extra["steps_taken_without_kind"] += 1  # decode_step defaults `kind`
        return outcome

    tally = _fuzz("wire decoder + daemon ingest", _frames_strategy(st, STEP_BASES + POLICY_BASES),
                  check, num_cases, seed)
    from ..controller.daemon import safe_tick

    try:
        svc.last_refit = -float("inf")  # due now
        safe_tick(svc)  # what the daemon's loop runs
        _check_policy(svc.policy)
        tally.extra["daemon_policy_after"] = f"v{svc.policy.version} {svc.policy.source}"  # type: ignore[assignment]
        errors = getattr(svc, "num_tick_errors", 0)
        if errors:
            # contained by the daemon (the policy in force stays), but a service bug: reported
            tally.extra["refit_failures_contained"] += errors
            try:
                svc.refit()
            except Exception as e:  # noqa: BLE001
                tally.examples.append(f"refit failure (contained): {type(e).__name__}: {str(e)[:200]}")
    except Exception as e:  # noqa: BLE001
        tally.crashes += 1
        tally.examples.append(f"crash: refit after the fuzzed ingest: {type(e).__name__}: {e}")
    tally.extra["daemon_records_taken"] = svc.model.num_samples_
    return tally.to_obj()


def _policy_table_frames(st: Any) -> Any:
    """Valid-looking policies whose rows or exploration rows may name step counts with no runtime
    state (and challenge rows, which older daemons wrote and engines ignore)."""

    @st.composite
    def frames(draw: Any) -> bytes:
        def config() -> dict[str, int]:
            steps = draw(st.integers(0, 8))
            topk = 1 if steps == 0 else draw(st.sampled_from([1, 1, 1, 2]))
            dt = 1 if steps == 0 else (steps + 1 if topk == 1 else draw(st.integers(steps + 1, 16)))
            return {"steps": steps, "topk": topk, "draft_tokens": dt}

        n = draw(st.integers(1, 6))
        rows, lo = [], 1
        for i in range(n):
            hi = None if i == n - 1 else lo + draw(st.integers(0, 40))
            rows.append({"min_batch": lo, "max_batch": hi, "config": config()})
            lo = (hi or 0) + 1
        obj = {"kind": "policy", "schema": 1, "version": draw(st.integers(0, 10 ** 6)),
               "created_at": 1.0, "source": "online", "table": rows}
        for key, period in (("explore", 64), ("challenge", 16)):
            if draw(st.booleans()):
                a = draw(st.integers(1, 64))
                obj[key] = [{"min_batch": a, "max_batch": a + draw(st.integers(0, 64)), "config": config()}]
                obj[key + "_period"] = period
        return json.dumps(obj).encode()

    return frames()


def fuzz_engine_policy(num_cases: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """Policy frames into the engine (EngineController.offer_policy_frame + sync): whatever
    arrives, every decision names a step count the engine has a runtime state for; a table whose
    rows or exploration rows name any other step count (or a tree) is refused and the engine stays
    on its fallback; challenge rows (older daemons) are ignored."""
    from hypothesis import strategies as st

    from ..plugin.engine import EngineController

    settings = _settings(policy_endpoint="ipc:///nowhere", sync_every=1, stale_after_s=1e9)
    candidates = frozenset(CANDIDATE_STEPS)
    probe = (1, 2, 3, 5, 7, 8, 16, 41, 64, 200, 65536, 10 ** 7)

    def check(frame: bytes, tally: FuzzTally) -> str:
        eng = EngineController(settings, candidate_steps=CANDIDATE_STEPS)
        why = eng.offer_policy_frame(frame)
        if eng.note_result():
            eng.sync()
        for b in probe:
            s = eng.decide(b)
            if s not in candidates:
                raise Violation(f"decided steps={s} at batch {b}: no runtime state")
        if eng.failed:
            raise Violation(f"engine failed: {eng.failed}")
        if why is not None:
            return why
        try:
            rec = wire.decode_policy(frame)
        except wire.WireError as e:
            return e.reason
        # exploring steps run their rows' configurations too: they need runtime states as well
        names = {(r.config.steps, r.config.topk) for r in list(rec.table) + list(rec.explore or [])}
        runnable = all(s in candidates and (s == 0 or k == 1) for s, k in names)
        if eng.active_source == "fallback":
            if runnable:
                raise Violation(f"refused a runnable policy: {eng.fallback_reason}")
            tally.extra["refused_no_runtime_state"] += 1
            return "refused: step count without runtime state (or a tree)"
        if not runnable:
            raise Violation("applied a policy naming a step count without a runtime state")
        return "accepted"

    strategy = st.one_of(_frames_strategy(st, POLICY_BASES), _policy_table_frames(st))
    return _fuzz("engine policy intake", strategy, check, num_cases, seed).to_obj()


def fuzz_policy_files(num_cases: int = 10_000, seed: int = 0,
                      workdir: Optional[str | os.PathLike[str]] = None) -> dict[str, Any]:
    """Hostile bytes as the daemon's persisted policy.json (a good .prev beside it): the store
    returns the file's policy only if it is valid, else the previous copy, never raises."""
    from hypothesis import strategies as st

    d = Path(workdir or tempfile.mkdtemp(prefix="specctl-fuzz-"))
    d.mkdir(parents=True, exist_ok=True)
    prev = policy_for_version(3)
    (d / "policy.json.prev").write_bytes(wire.encode(prev))

    def check(frame: bytes, tally: FuzzTally) -> str:
        (d / "policy.json").write_bytes(frame)
        store = StateStore(d)
        pol = store.load_policy()
        try:
            want: Optional[wire.PolicyRecord] = wire.decode_policy(frame)
        except wire.WireError as e:
            want = None
            reason = e.reason
        if want is not None:
            if pol is None or _strip_model(pol) != _strip_model(want):  # NaN in `model` != itself
                raise Violation("a valid policy file was not the one loaded")
            return "accepted"
        if pol != prev:
            raise Violation(f"an invalid policy file gave {pol!r} instead of the previous copy")
        if not store.problems:
            raise Violation("an unusable policy file was not reported")
        return reason

    return _fuzz("policy files (StateStore)", _frames_strategy(st, POLICY_BASES), check, num_cases, seed).to_obj()


def _check_sample(s: Any) -> None:
    steps, topk, draft = s.config
    ok = (math.isfinite(s.ts) and isinstance(s.batch_size, int) and s.batch_size >= 1
          and (s.step_ms is None or (math.isfinite(s.step_ms) and s.step_ms > 0))
          and math.isfinite(s.weight) and s.weight > 0
          and (s.mean_accepted is None or (math.isfinite(s.mean_accepted) and s.mean_accepted >= 0))
          and 0 <= steps <= wire.MAX_STEPS and 1 <= topk <= wire.MAX_TOPK and 1 <= draft <= wire.MAX_DRAFT_TOKENS
          and (s.accepted is None or all(isinstance(a, int) and 0 <= a <= steps for a in s.accepted)))
    if not ok:
        raise Violation(f"reader produced a bad sample {s!r:.300}")


def _file_strategy(st: Any, line: Any, *, gz: bool = True) -> Any:
    @st.composite
    def files(draw: Any) -> tuple[bytes, Optional[str]]:
        lines = draw(st.lists(st.one_of(line, st.just(b""), st.binary(max_size=80)), min_size=0, max_size=12))
        data = b"\n".join(lines)
        if draw(st.booleans()):
            data += b"\n"
        if gz and draw(st.integers(0, 4)) == 0:
            import gzip

            data = gzip.compress(data)
            if draw(st.booleans()):
                data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
        return data, draw(st.sampled_from([None, "forced", "forced"]))

    return files()


def _sglang_run(st: Any) -> Any:
    """A plausible log: server_args, then decode lines 0.1-2 s apart (some of them damaged)."""

    @st.composite
    def runs(draw: Any) -> bytes:
        new = draw(st.booleans())
        lines = [SGLANG_LINES[1] if new else SGLANG_LINES[0]]
        t = 30.0
        damaged = _sglang_line(st)
        for i in range(draw(st.integers(2, 30))):
            t += draw(st.floats(0.05, 2.0))
            stamp = f"[2025-11-29 12:{int(t // 60):02d}:{t % 60:06.3f}{' TP0' if new else ''}]"
            running = draw(st.sampled_from([1, 2, 4, 8, 64, 0, 10 ** 9]))
            al = draw(st.sampled_from(["2.73", "1.00", "4.00", "0.50", "nan", "9.99"]))
            text = (f"{stamp} Decode batch, #running-req: {running}, #token: 1491, token usage: 0.01, "
                    f"accept len: {al}, accept rate: 0.57, cuda graph: True, "
                    f"gen throughput (token/s): {draw(st.sampled_from(['305.34', '0.00', '-5', 'inf', '1e9']))}, "
                    f"#queue-req: 0")
            lines.append(draw(damaged) if draw(st.integers(0, 9)) == 0 else text.encode())
        return b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines)

    return runs()


def _sglang_line(st: Any) -> Any:
    import re

    num = re.compile(r"(?<=[:= (])-?\d+(?:\.\d+)?")

    @st.composite
    def lines(draw: Any) -> bytes:
        text = draw(st.sampled_from(SGLANG_LINES))
        op = draw(st.sampled_from(["keep", "numbers", "numbers", "truncate", "splice", "bools"]))
        if op == "numbers":
            matches = list(num.finditer(text))
            if matches:
                out, last = [], 0
                for m in matches:
                    out.append(text[last:m.start()])
                    out.append(draw(st.sampled_from(HOSTILE_NUMBER_TEXT + [m.group(0)] * 3)))
                    last = m.end()
                text = "".join(out) + text[last:]
        elif op == "truncate":
            text = text[: draw(st.integers(0, len(text)))]
        elif op == "splice":
            i = draw(st.integers(0, len(text)))
            text = text[:i] + draw(st.text(max_size=30)) + text[i:]
        elif op == "bools":
            text = text.replace("True", draw(st.sampled_from(["False", "None", "1", ""])))
        return text.encode("utf-8", "surrogatepass")

    return lines()


def _bench_line(st: Any) -> Any:
    import copy

    @st.composite
    def lines(draw: Any) -> bytes:
        obj = copy.deepcopy(BENCH_BASE)
        for _ in range(draw(st.integers(0, 3))):
            _mutate(draw, st, obj)
        return json.dumps(obj, allow_nan=True, default=str).encode()

    return lines()


def _fuzz_reader(target: str, fmt: str, line: Any, num_cases: int, seed: int,
                 workdir: Optional[str | os.PathLike[str]]) -> dict[str, Any]:
    from hypothesis import strategies as st

    from ..training.costmodel import CostModel
    from ..training.readers import FileReport, read_file
    from ..controller.replay import replay

    d = Path(workdir or tempfile.mkdtemp(prefix="specctl-fuzz-"))
    d.mkdir(parents=True, exist_ok=True)
    path = d / "input"
    model = CostModel()
    model.fit([])

    class _NullSock:
        def send(self, data: bytes) -> None:
            pass

    def check(case: tuple[bytes, Optional[str]], tally: FuzzTally) -> str:
        data, mode = case
        path.write_bytes(data)
        rep = FileReport(path=str(path))
        n = 0
        for s in read_file(path, rep, fmt=fmt if mode == "forced" else None):
            _check_sample(s)
            model.observe(s)
            n += 1
        tally.extra["samples"] += n
        tally.extra["lines_skipped"] += rep.num_skipped
        if fmt == "telemetry":
            replay(path, _NullSock())  # `specctl replay` reads the same files
        if n:
            return "accepted"  # (damaged lines beside the good ones are counted in lines_skipped)
        if rep.problems:
            return "file problem: " + rep.problems[0].split(":")[0][:60]
        if rep.num_skipped:
            return "lines skipped: " + sorted(rep.skipped)[0][:60]
        return "nothing usable (ignored)"

    tally = _fuzz(target, _file_strategy(st, line), check, num_cases, seed)
    try:
        model.refit()
    except Exception as e:  # noqa: BLE001
        tally.crashes += 1
        tally.examples.append(f"crash: cost-model refit on the fuzzed samples: {type(e).__name__}: {e}")
    return tally.to_obj()


def fuzz_telemetry_files(num_cases: int = 10_000, seed: int = 0, workdir: Optional[str] = None) -> dict[str, Any]:
    from hypothesis import strategies as st

    return _fuzz_reader("telemetry JSONL (train reader + replay)", "telemetry",
                        _frames_strategy(st, STEP_BASES + POLICY_BASES), num_cases, seed, workdir)


def fuzz_sglang_logs(num_cases: int = 10_000, seed: int = 0, workdir: Optional[str] = None) -> dict[str, Any]:
    from hypothesis import strategies as st

    return _fuzz_reader("SGLang server logs", "sglang-log", st.one_of(_sglang_line(st), _sglang_run(st)),
                        num_cases, seed, workdir)


def fuzz_bench_serving(num_cases: int = 10_000, seed: int = 0, workdir: Optional[str] = None) -> dict[str, Any]:
    from hypothesis import strategies as st

    return _fuzz_reader("bench_serving JSONL", "bench-serving", _bench_line(st), num_cases, seed, workdir)


FUZZ_TARGETS: dict[str, Callable[..., dict[str, Any]]] = {
    "wire": fuzz_wire, "engine_policy": fuzz_engine_policy, "policy_files": fuzz_policy_files,
    "telemetry_files": fuzz_telemetry_files, "sglang_logs": fuzz_sglang_logs,
    "bench_serving": fuzz_bench_serving,
}


# ============================================================================ the whole run


def run_all(*, kills: int = 1000, fuzz_cases: int = 10_000, load_s: float = 60.0,
            load_compare_s: float = 20.0, frozen_s: float = 5.0, workdir: Optional[str] = None,
            progress: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Every drill, benchmark-sized; returns the JSON record."""
    import platform

    base = Path(workdir or tempfile.mkdtemp(prefix="specctl-reliability-"))
    ctx = zmq.Context()
    rec: dict[str, Any] = {
        "kind": "specctl.reliability/1", "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "zmq": zmq.zmq_version(),
                 "loadavg_start": os.getloadavg()},
        "faults": {}, "load": {}, "fuzz": {},
    }
    t0 = time.monotonic()
    try:
        progress(f"faults: SIGKILL during state writes x{kills}")
        rec["faults"]["kill_during_write"] = kill_during_write(base / "kill", num_kills=kills)
        progress("faults: engine started before the daemon")
        rec["faults"]["engine_without_daemon"] = engine_without_daemon(base / "absent", ctx=ctx)
        progress("faults: daemon SIGKILLed and restarted under a running engine")
        rec["faults"]["daemon_restart"] = daemon_restart(base / "restart", ctx=ctx)
        progress(f"faults: daemon frozen (SIGSTOP) for {frozen_s} s")
        rec["faults"]["frozen_daemon"] = frozen_daemon(base / "frozen", ctx=ctx, frozen_s=frozen_s)
        progress(f"load: 64 ranks x 1000 steps/s for {load_s} s (shedding on)")
        rec["load"]["shed"] = load_test(base / "load-shed", duration_s=load_s, shed=True, ctx=ctx)
        if load_compare_s > 0:
            progress(f"load: the same for {load_compare_s} s with shedding off (the default)")
            rec["load"]["no_shed"] = load_test(base / "load-noshed", duration_s=load_compare_s, shed=False, ctx=ctx)
        for name, fn in FUZZ_TARGETS.items():
            progress(f"fuzz: {name} x{fuzz_cases}")
            kw = {} if name in ("wire", "engine_policy") else {"workdir": str(base / f"fuzz-{name}")}
            t = time.monotonic()
            rec["fuzz"][name] = fn(fuzz_cases, **kw)
            rec["fuzz"][name]["seconds"] = round(time.monotonic() - t, 1)
    finally:
        ctx.destroy(linger=0)
    rec["host"]["loadavg_end"] = os.getloadavg()
    rec["elapsed_s"] = round(time.monotonic() - t0, 1)
    return rec


def _yes(ok: Any) -> str:
    return "yes" if ok else "**NO**"


def render_markdown(rec: dict[str, Any], command: str = "specctl bench reliability") -> str:
    f, ld, fz = rec["faults"], rec["load"], rec["fuzz"]
    h = rec["host"]
    out = [
        "# Reliability and security figures",
        "",
        f"Generated by `{command}` on {rec['started_at']} ({rec['elapsed_s']} s): Python {h['python']}, "
        f"{h['cpus']} CPUs, libzmq {h['zmq']}, load average {h['loadavg_start'][0]:.1f} at the start "
        f"and {h['loadavg_end'][0]:.1f} at the end (a shared machine: wall-clock maxima include other "
        "processes' time). The CI tests (`tests/reliability/`) run the same drills, smaller.",
        "",
        "## Faults",
        "",
        "| fault injected | injected | survived | recovery |",
        "|---|---|---|---|",
    ]
    k = f.get("kill_during_write")
    if k:
        out.append(f"| `StateStore` writer SIGKILLed at a random moment (policy + model saved in a loop; "
                   f"{k['kills_mid_temp_file']} kills left a half-written temp file) | {k['kills']} | "
                   f"{k['survived']} (last good policy, byte for byte) | load {k['recovery_ms_p50']} ms p50, "
                   f"{k['recovery_ms_max']} ms max |")
    a = f.get("engine_without_daemon")
    if a:
        out.append(f"| daemon absent when the engine starts ({a['steps_without_daemon']} steps on the fallback, "
                   f"{a['frames_dropped_without_daemon']} frames dropped and counted) | 1 | {_yes(a['survived'])} | "
                   f"policy {a['policy_after_daemon_ready_s']} s, telemetry {a['telemetry_after_daemon_ready_s']} s "
                   f"after the daemon is up |")
    r = f.get("daemon_restart")
    if r:
        out.append(f"| daemon SIGKILLed under a running engine, restarted (same state dir) | 1 | "
                   f"{_yes(r['survived'])} (v{r['version_before']} resumed; engine on v{r['version_after']}) | fallback "
                   f"{r['fallback_after_kill_s']} s after the kill (timeout {r['stale_after_s']} s); policy back "
                   f"{r['policy_back_after_restart_s']} s, telemetry {r['telemetry_after_restart_s']} s after the "
                   f"restart ({r['restart_s']} s to start) |")
    z = f.get("frozen_daemon")
    if z:
        q = z["frames_queued_then_dropped"]
        out.append(f"| daemon frozen (SIGSTOP: reads and publishes nothing) for {z['frozen_s']} s | 1 | "
                   f"{_yes(z['survived'])} | fallback {z['fallback_after_freeze_s']} s (timeout "
                   f"{z['stale_after_s']} s); policy back {z['policy_back_after_resume_s']} s after SIGCONT |")
        out += [
            "",
            f"Engine side while the daemon was frozen: {z['steps_while_frozen']} steps, {q['sent']} frames queued "
            f"(bounded by the high-water mark) then {q['dropped']} dropped and counted. Per-step time "
            f"(decide + frame + NOBLOCK send + sync): p50 {z['step_us_p50']} µs, p99 {z['step_us_p99']} µs, "
            f"p99.99 {z['step_us_p9999']} µs, max {z['step_us_max']} µs (send alone: max {z['send_us_max']} µs). "
            f"{z['steps_waited']} steps of all waited on anything (slept in the kernel: a voluntary context "
            f"switch). {z['steps_over_budget']} steps took over {z['stall_budget_us']:g} µs of wall time: "
            f"{z['over_budget_waiting']} of them waited on anything (a voluntary context switch: a blocking "
            f"send would), {z['over_budget_preempted']} were preempted by another process, "
            f"{z['over_budget_on_cpu']} had neither (VM steal, interrupts, GC). The most CPU any step used: "
            f"{z['step_cpu_us_max']} µs.",
        ]
    out += ["", "## Load: 64 simulated ranks x 1000 steps/s into one daemon", ""]
    if ld:
        out += ["| | shedding on (`--shed-when-behind`) | shedding off (default) |", "|---|---|---|"]
        on, off = ld.get("shed", {}), ld.get("no_shed", {})

        def row(label: str, key: str, fmt: str = "{}") -> None:
            out.append(f"| {label} | {fmt.format(on[key]) if key in on else '-'} | "
                       f"{fmt.format(off[key]) if key in off else '-'} |")

        row("duration (s)", "duration_s")
        row("offered (frames/s, 2 sender processes, pre-encoded)", "offered_per_s")
        row("dropped at the engines (SNDHWM full)", "dropped_at_engines")
        row("fitted by the daemon (frames)", "fitted")
        row("fitted per second (steady state)", "fitted_per_s_steady")
        row("shed by the daemon, counted (frames)", "shed")
        row("still queued / lost at the end (frames)", "unaccounted")
        row("taken (fitted + shed) per second", "taken_per_s")
        row("daemon peak RSS (MB)", "peak_rss_mb")
        row("status queries (every 50 ms)", "status_queries")
        row("status latency p50 / p99 / max (ms)", "status_ms_p99")
        out[-1] = (f"| status latency p50 / p99 / max (ms) | {on.get('status_ms_p50')} / {on.get('status_ms_p99')} / "
                   f"{on.get('status_ms_max')} | {off.get('status_ms_p50', '-')} / {off.get('status_ms_p99', '-')} / "
                   f"{off.get('status_ms_max', '-')} |")
        row("status timeouts", "status_timeouts")
        row("last refit (ms)", "last_refit_ms")
    out += ["", "## Hostile input (hypothesis, property-based)", "",
            "| target | inputs tried | accepted | rejected (clear reason, counted) | crashes | bad policy / sample let through | top rejection reasons |",
            "|---|---|---|---|---|---|---|"]
    for name, t in fz.items():
        reasons = ", ".join(f"{k} {v}" for k, v in list(t["rejected_by_reason"].items())[:4])
        out.append(f"| {t['target']} | {t['tried']} | {t['accepted']} | {t['rejected']} | {t['crashes']} | "
                   f"{t['violations']} | {reasons} |")
    out += [
        "",
        "Inputs: random bytes and text, truncated frames, valid records with 1-3 mutations (wrong schema "
        "versions and kinds, NaN/inf/negative/huge numbers, wrong types, missing and unknown fields, unknown "
        "or inconsistent configurations), lists of 65k-70k entries, 200k-deep nesting; files of such lines, "
        "plain or gzip (sometimes truncated). Engine policy intake also gets valid tables naming step counts "
        "with no runtime state (refused, the engine stays on its fallback): "
        f"{fz.get('engine_policy', {}).get('refused_no_runtime_state', 0)} such policies refused.",
        "",
        "## Security (tested in tests/reliability/test_security.py)",
        "",
        "- `specctl keys generate DIR --name server` (and `--name engine` per client) writes CURVE "
        "certificates. `specctl serve --curve-secret-key DIR/server.key_secret --curve-allowed-dir "
        "ALLOWED/` runs CURVE on every daemon socket (telemetry, policy, status) and a ZAP handler that "
        "admits only the public certificates in ALLOWED/; refused keys are counted and logged.",
        "- A tcp endpoint on a non-loopback interface is refused unless keys *and* an allow-list are given "
        "(any holder of the public server key could otherwise feed the model), or `--insecure` explicitly.",
        "- Engines and CLI clients (`policy show --endpoint`, `replay`) read `SPECCTL_CURVE_SECRET_KEY` "
        "(their own `.key_secret`) and `SPECCTL_CURVE_SERVER_KEY` (the daemon's public `server.key`).",
        "- ipc sockets are created in a directory that must be a real directory owned by the user; it is "
        "made 0700 (a symlink or someone else's directory is refused).",
        "- Tested with real sockets: a client without CURVE and a client with a valid but unlisted key pair "
        "push nothing (the daemon sees no frame, not even a rejected one), receive no policy and get no "
        "status answer; the listed engine key does all three.",
        "",
    ]
    return "\n".join(out)
