"""The daemon's life over real sockets: built all or nothing (a failure at each construction step
leaves no socket file, lock, ZAP thread or metrics server), one daemon per socket and state dir
(the second is refused with the first one's pid), and nothing left behind on exit."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from specctl.controller import transport
from specctl.controller.daemon import Daemon, Endpoints, wait_for_status
from specctl.controller.metrics import Metrics
from specctl.controller.service import ControllerService, ServiceSettings

CLI = [sys.executable, "-m", "specctl.controller.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leftovers(rundir: Path) -> list[str]:
    return sorted(p.name for p in rundir.iterdir()) if rundir.exists() else []


def _zap_threads() -> int:
    return sum(1 for t in threading.enumerate() if "Authenticator" in type(t).__name__)


def _service() -> ControllerService:
    return ControllerService(ServiceSettings(), metrics=Metrics())  # own registry: metrics servers may start


@pytest.fixture
def server_keys(tmp_path):
    _, secret = transport.create_certificates(tmp_path / "keys", "server")
    return transport.load_server_keys(secret, None)


def _bad_keys(keys):
    return transport.CurveKeys(public=keys.public, secret=b"not a z85 secret", allowed_clients=keys.allowed_clients)


@pytest.fixture
def busy_port():
    """A loopback port held by a plain listening socket for the test's length."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


STEPS = ["endpoint check", "metrics host check", "ipc lock held", "CURVE key", "bind publish",
         "bind status", "metrics port"]


@pytest.mark.parametrize("step", STEPS)
def test_a_failure_at_each_construction_step_leaves_nothing_behind(step, zctx, tmp_path, server_keys, busy_port):
    rundir = tmp_path / "run"
    eps = transport.default_endpoints(rundir)
    kw: dict = {}
    holder = None
    if step == "endpoint check":
        eps["status"] = f"tcp://0.0.0.0:{_free_port()}"
    elif step == "metrics host check":
        kw = {"metrics_port": _free_port(), "metrics_host": "0.0.0.0"}
    elif step == "ipc lock held":
        transport.runtime_dir(rundir)
        holder = transport.PidLock(rundir / "status.sock.lock", "test").acquire()
    elif step == "CURVE key":
        eps = {k: f"tcp://127.0.0.1:{_free_port()}" for k in eps}
        kw = {"keys": _bad_keys(server_keys)}
    elif step == "bind publish":
        eps["publish"] = f"tcp://127.0.0.1:{busy_port}"
    elif step == "bind status":
        eps["status"] = f"tcp://127.0.0.1:{busy_port}"
    elif step == "metrics port":
        kw = {"metrics_port": busy_port, "keys": server_keys}
        eps = {k: f"tcp://127.0.0.1:{_free_port()}" for k in eps}
    zap_before = _zap_threads()
    try:
        with pytest.raises(transport.TransportError) as err:
            Daemon(_service(), Endpoints(eps["telemetry"], eps["publish"], eps["status"]), ctx=zctx, **kw)
    finally:
        if holder is not None:
            holder.release()
    if step == "ipc lock held":
        assert f"pid {os.getpid()}" in str(err.value)
    assert _leftovers(rundir) == [], step  # no socket file, no lock
    assert _zap_threads() == zap_before, step  # the ZAP handler was stopped
    # and nothing is still bound: the same endpoints (the failing one made good) build and close
    if step in ("bind publish", "bind status", "endpoint check"):
        eps = transport.default_endpoints(rundir)
    kw.pop("metrics_host", None)
    if kw.get("keys") is not None:
        kw["keys"] = server_keys
    if "metrics_port" in kw:
        kw["metrics_port"] = _free_port()
    d = Daemon(_service(), Endpoints(eps["telemetry"], eps["publish"], eps["status"]), ctx=zctx, **kw)
    d.close()
    assert _leftovers(rundir) == []
    assert _zap_threads() == zap_before


def test_a_failing_telemetry_bind_undoes_the_locks_and_a_second_daemon_is_refused_by_pid(zctx, tmp_path):
    rundir = tmp_path / "run"
    eps = transport.default_endpoints(rundir)
    first = Daemon(_service(), Endpoints(eps["telemetry"], eps["publish"], eps["status"]), ctx=zctx)
    th = threading.Thread(target=first.run, daemon=True)
    th.start()
    try:
        wait_for_status(zctx, eps["status"], timeout_s=60)
        files = _leftovers(rundir)
        assert files == sorted(["telemetry.sock", "telemetry.sock.lock", "policy.sock", "policy.sock.lock",
                                "status.sock", "status.sock.lock"])
        with pytest.raises(transport.TransportError, match=f"in use by pid {os.getpid()}"):
            Daemon(_service(), Endpoints(eps["telemetry"], eps["publish"], eps["status"]), ctx=zctx)
        # the refused one took nothing over: the first still answers on the same sockets
        assert _leftovers(rundir) == files
        assert transport.status_request(zctx, eps["status"], {"cmd": "ping"}, timeout_ms=10_000) == {"kind": "pong"}
        st = transport.status_request(zctx, eps["status"], {"cmd": "status"}, timeout_ms=10_000)
        assert st["daemon"]["pid"] == os.getpid() and st["daemon"]["endpoints"]["status"] == eps["status"]
        assert st["kind"] == "status" and "servers" in st  # the older keys are all still there
    finally:
        first.stop_event.set()
        th.join(10)
    assert _leftovers(rundir) == []  # sockets and locks gone on a normal exit
    first.close()  # a second close is harmless


def _serve(endpoints, state_dir, env=None):
    args = [*CLI, "serve", "--telemetry", endpoints["telemetry"], "--publish", endpoints["publish"],
            "--status", endpoints["status"], "--state-dir", str(state_dir)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_removes_its_files_on_a_signal_and_refuses_a_second_serve_with_its_pid(sig, zctx, tmp_path):
    rundir = tmp_path / "run"
    eps = transport.default_endpoints(rundir)
    state = tmp_path / "state"
    first = _serve(eps, state)
    try:
        wait_for_status(zctx, eps["status"], timeout_s=60)
        assert (state / "serve.lock").read_text().strip() == str(first.pid)
        # the same state dir (other sockets), then the same sockets (another state dir)
        other = transport.default_endpoints(tmp_path / "run2")
        for e, s, what in ((other, state, f"state dir {state}"), (eps, tmp_path / "state2", eps["telemetry"])):
            second = subprocess.run([*CLI, "serve", "--telemetry", e["telemetry"], "--publish", e["publish"],
                                     "--status", e["status"], "--state-dir", str(s)],
                                    capture_output=True, text=True, timeout=120)
            out = second.stdout + second.stderr
            assert second.returncode != 0, out
            assert f"{what} is in use by pid {first.pid}" in out and "Traceback" not in out, out
        assert _leftovers(tmp_path / "run2") == []
        st = transport.status_request(zctx, eps["status"], {"cmd": "status"}, timeout_ms=10_000)
        assert st["daemon"]["pid"] == first.pid  # the first one was not orphaned
    finally:
        first.send_signal(sig)
        out = first.communicate(timeout=60)[0].decode()
    assert first.returncode == 0, out
    assert "Traceback" not in out, out
    assert _leftovers(rundir) == [], out
    assert not (state / "serve.lock").exists()
    assert (state / "model.json").exists()  # persisted on the way out, as before
