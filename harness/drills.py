"""Fault drills for `specctl bench reliability` (and, scaled down, CI): the real StateStore, `specctl serve`
as a subprocess and EngineController on real sockets, under SIGKILL, absence, restarts and SIGSTOP."""

from __future__ import annotations

import logging
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
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
from specctl.harness.drills import policy_for_version, model_for_version
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


