"""specctl beside a real SGLang server on the GPU machine: install-free site, the daemon, the plugin's
environment, policy snapshots and the audit of the plugin's decisions against the published tables.

Used by run_bench.py (policies `specctl` and `plugin-fixed:T:sN`) and specctl_e2e.py. Runs THERE
(PYTHONPATH holds the overlay with pyzmq/pydantic; scikit-learn comes with the image) and here in tests.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CONFIGS = "off,s1,s2,s3"  # the runtime states the specctl servers are launched with (adaptive candidates 0..3)


def make_site(dest: str = "/tmp/specctl_site", repo: str = REPO) -> str:
    """specctl as a PYTHONPATH folder with its entry points (no wheel, no network); importable here too:
    DEST/specctl/{policies,controller,training,plugin} -> REPO/... (specctl is a namespace package) and
    DEST/specctl-0.1.0.dist-info with the `sglang.srt.plugins` entry point that SGLang's load_plugins() finds."""
    repo = os.path.abspath(repo)
    pkg = os.path.join(dest, "specctl")
    os.makedirs(pkg, exist_ok=True)
    for sub in ("policies", "controller", "training", "plugin"):
        link = os.path.join(pkg, sub)
        if os.path.islink(link):
            os.remove(link)
        os.symlink(os.path.join(repo, sub), link)
    di = os.path.join(dest, "specctl-0.1.0.dist-info")
    os.makedirs(di, exist_ok=True)
    with open(os.path.join(di, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: specctl\nVersion: 0.1.0\n")
    with open(os.path.join(di, "entry_points.txt"), "w") as f:
        f.write("[sglang.srt.plugins]\nspecctl = specctl.plugin:register\n\n"
                "[console_scripts]\nspecctl = specctl.controller.cli:main\n")
    if dest not in sys.path:
        sys.path.insert(0, dest)
    return dest


def with_pythonpath(env: dict, *dirs: str) -> dict:
    parts = [d for d in dirs if d] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(env, PYTHONPATH=os.pathsep.join(dict.fromkeys(parts)))


def plugin_env(*, mode: str, rundir: str, server_id: str, decision_log: Optional[str] = None,
               stale_after_s: Optional[float] = None, threshold: Optional[int] = None,
               config: Optional[str] = None) -> dict:
    """The SPECCTL_* environment of a plugin-enabled SGLang server (daemon endpoints from the rundir)."""
    env = {"SGLANG_PLUGINS": "specctl", "SPECCTL_MODE": mode, "SPECCTL_RUNDIR": rundir,
           "SPECCTL_SERVER_ID": server_id}
    if decision_log:
        env["SPECCTL_DECISION_LOG"] = decision_log
    if stale_after_s is not None:
        env["SPECCTL_STALE_AFTER_S"] = str(stale_after_s)
    if threshold is not None or config is not None:
        from specctl.policies.fixed import DEFAULT_CONFIG, DEFAULT_THRESHOLD

        default = ",".join(map(str, DEFAULT_CONFIG))
        env["SPECCTL_FALLBACK"] = f"{DEFAULT_THRESHOLD if threshold is None else threshold}:{config or default}"
    return env


class Daemon:
    """`specctl serve` as a child process, its status endpoint, and a poller that keeps every policy
    version it sees (with the daemon's created_at) for the audit."""

    def __init__(self, *, rundir: str, state_dir: str, log_path: str, site: str,
                 record_dir: Optional[str] = None, configs: str = CONFIGS, extra: tuple = (),
                 python: str = sys.executable):
        self.rundir, self.state_dir, self.log_path, self.site = rundir, state_dir, log_path, site
        self.record_dir, self.configs, self.extra, self.python = record_dir, configs, tuple(extra), python
        self.proc: Optional[subprocess.Popen] = None
        self.policies: dict[int, dict] = {}  # version -> {"seen": wall s, "policy": obj}
        self.events: list[dict] = []  # starts, kills, poll failures (wall time)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._ctx: Any = None

    @property
    def status_endpoint(self) -> str:
        return f"ipc://{self.rundir}/status.sock"

    def start(self, wait_s: float = 60.0) -> dict:
        os.makedirs(self.rundir, mode=0o700, exist_ok=True)
        os.chmod(self.rundir, 0o700)
        os.makedirs(self.state_dir, exist_ok=True)
        cmd = [self.python, "-m", "specctl.controller.cli", "serve", "--state-dir", self.state_dir,
               "--configs", self.configs, *self.extra]
        if self.record_dir:
            cmd += ["--record", self.record_dir]
        env = with_pythonpath(dict(os.environ, SPECCTL_RUNDIR=self.rundir), self.site)
        self.proc = subprocess.Popen(cmd, stdout=open(self.log_path, "a"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.events.append({"t": time.time(), "event": "start", "pid": self.proc.pid})
        t0 = time.time()
        last = None
        while time.time() - t0 < wait_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specctl serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                st = self.status(timeout_ms=500)
                self.events.append({"t": time.time(), "event": "ready", "version": st["policy"]["version"]})
                self._poll_start()
                return st
            except Exception as e:  # noqa: BLE001
                last = e
                time.sleep(0.2)
        raise RuntimeError(f"specctl serve not answering after {wait_s} s: {last}")

    def status(self, timeout_ms: int = 1000) -> dict:
        import zmq

        from specctl.controller import transport

        if self._ctx is None:
            self._ctx = zmq.Context()
        return transport.status_request(self._ctx, self.status_endpoint, {"cmd": "status"}, timeout_ms=timeout_ms)

    def _poll_start(self, period_s: float = 0.25) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()

        def run() -> None:
            while not self._stop.wait(period_s):
                try:
                    st = self.status(timeout_ms=1000)
                except Exception as e:  # noqa: BLE001 - a killed daemon: keep polling until stopped
                    if not self.events or self.events[-1].get("event") != "unreachable":
                        self.events.append({"t": time.time(), "event": "unreachable", "why": str(e)[:200]})
                    continue
                pol = st.get("policy") or {}
                v = pol.get("version")
                if v is not None and v not in self.policies:
                    self.policies[v] = {"seen": time.time(), "policy": pol, "evidence": st.get("evidence")}

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=10)
            self.events.append({"t": time.time(), "event": f"signal {sig}", "pid": self.proc.pid})

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=3)
        try:
            self.kill(signal.SIGTERM)
        except Exception:  # noqa: BLE001
            self.kill(signal.SIGKILL)

    def save(self, path: str) -> None:
        """Every policy version seen, in order, plus the daemon's events."""
        with open(path, "w") as f:
            json.dump({"policies": [dict(version=v, **x) for v, x in sorted(self.policies.items())],
                       "events": self.events}, f, indent=1)


def policy_obj(version: int, rows: list, *, source: str = "fixed", created_at: Optional[float] = None) -> dict:
    """A policy object (docs/architecture.md) for rows (min_batch, max_batch or None, steps of a chain or a (steps, topk,
    draft_tokens) triple), its table written by the product's own PolicyTable (checked: contiguous from batch 1)."""
    from specctl.policies.table import PolicyTable, chain

    table = PolicyTable.from_rows((lo, hi, chain(c) if isinstance(c, int) else tuple(c)) for lo, hi, c in rows)
    return {"kind": "policy", "schema": 1, "version": version,
            "created_at": time.time() if created_at is None else created_at, "source": source,
            "table": table.to_rows_obj()}


class Override:
    """An operator's stand-in for the daemon: publishes a fixed table at the daemon's policy endpoint (the daemon
    must be stopped, or never started), re-sent every period as a heartbeat. specctl_e2e.py uses it to force a long
    plain-decode period whatever the cost model would choose; run_bench.py's `pinned:` servers to run one
    configuration at every batch size at a time (set() publishes the next table at once)."""

    def __init__(self, rundir: str, rows: list, version: int):
        self.endpoint = f"ipc://{rundir}/policy.sock"
        self.rows, self.version = rows, version
        self.published: dict[int, dict] = {}  # version -> the policy object sent under it (the decision audit's)
        self._frame: Optional[bytes] = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.sent = 0

    def obj(self) -> dict:
        return policy_obj(self.version, self.rows)

    def frame(self) -> bytes:
        from specctl.controller import wire
        obj = self.obj()
        self.published[self.version] = obj
        return wire.encode(wire.policy_from_obj(obj))

    def set(self, rows: list, version: int) -> None:
        """Publish this table from now on: at once, then as the heartbeat. A version names one table (the plugin
        logs each new one): give each table its own."""
        if version in self.published and policy_obj(version, rows)["table"] != self.published[version]["table"]:
            raise ValueError(f"version {version} was already published with another table")
        self.rows, self.version = rows, version
        self._frame = self.frame()
        self._wake.set()

    def start(self, period_s: float = 0.5) -> None:
        import zmq

        from specctl.controller import transport

        self._frame = self.frame()  # every re-send of a frame is a heartbeat of its version
        ready = threading.Event()

        def run() -> None:
            ctx = zmq.Context()
            pub = transport.policy_pub(ctx, self.endpoint)
            ready.set()
            try:
                while not self._stop.is_set():
                    pub.send(self._frame)
                    self.sent += 1
                    self._wake.wait(period_s)
                    self._wake.clear()
            finally:
                pub.close(linger=0)
                ctx.term()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.wait(10)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


# ---------------------------------------------------------------- audit (pure; tested on CPU)

def read_decisions(path: str) -> list[tuple[int, int, int, Optional[int], Optional[int]]]:
    """SPECCTL_DECISION_LOG lines `step batch_size steps version|F [ctx_tokens]` -> tuples (step, batch
    size, steps, version or None, ctx_tokens or None), comments skipped."""
    out: list = []
    if not os.path.exists(path):
        return out  # the audit then reports 0 decisions: the plugin never decided (or never logged)
    with open(path) as f:
        for ln in f:
            if not ln.strip() or ln.startswith("#"):
                continue
            p = ln.split()
            if not ln.endswith("\n") or len(p) not in (4, 5) or (len(p) == 5 and not p[4].isdigit()):
                continue  # a line cut by a kill
            out.append((int(p[0]), int(p[1]), int(p[2]), None if p[3] == "F" else int(p[3]),
                        int(p[4]) if len(p) == 5 else None))
    return out


def audit_decisions(decisions: list, policies: dict[int, dict], fallback: Optional[Any] = None) -> dict:
    """Replay each logged decision through the PolicyTable of the version in force (the daemon's own
    policy objects, exploration rows included): how many decisions the published tables explain.
    `policies`: version -> policy object. `fallback`: the PolicyTable of the fixed fallback (lines `F`)."""
    from specctl.policies.table import PolicyTable

    tables = {}
    for v, obj in policies.items():
        tables[v] = PolicyTable.from_policy_obj(obj)
    n = match = unknown = 0
    mism: list = []
    per_version: dict = {}
    changes = 0
    prev_steps = None
    for step, bs, steps, v, *ctx in decisions:
        n += 1
        if prev_steps is not None and steps != prev_steps:
            changes += 1
        prev_steps = steps
        t = fallback if v is None else tables.get(v)
        key = "F" if v is None else v
        pv = per_version.setdefault(key, {"decisions": 0, "match": 0, "steps": {}})
        pv["decisions"] += 1
        pv["steps"][steps] = pv["steps"].get(steps, 0) + 1
        if t is None:
            unknown += 1
            continue
        want = t.decide(bs, step, ctx[0] if ctx else None)[0]  # a band by the batch context, where logged
        if want == steps:
            match += 1
            pv["match"] += 1
        elif len(mism) < 10:
            mism.append({"step": step, "batch_size": bs, "steps": steps, "version": key, "table_says": want})
    checked = n - unknown
    return {"decisions": n, "checked": checked, "match": match, "unknown_version": unknown,
            "match_frac": round(match / checked, 6) if checked else None, "mismatches": mism,
            "step_changes": changes, "versions": {str(k): v for k, v in per_version.items()}}


def count_switch_lines(log_text: str) -> int:
    return sum(1 for ln in log_text.splitlines() if "Switch adaptive runtime state" in ln)
