import signal
import subprocess
import sys

import pytest

from specctl.controller import transport
from specctl.controller.daemon import wait_for_status


class ServeProc:
    """`specctl serve` as a real subprocess."""

    def __init__(self, endpoints, state_dir, *extra):
        self.endpoints = endpoints
        self.state_dir = state_dir
        self.args = [sys.executable, "-m", "specctl.controller.cli", "serve",
                     "--telemetry", endpoints["telemetry"], "--publish", endpoints["publish"],
                     "--status", endpoints["status"], "--state-dir", str(state_dir), *extra]
        self.proc = None

    def start(self, ctx):
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_for_status(ctx, self.endpoints["status"], timeout_s=60)
        return self

    def status(self, ctx, cmd="status"):
        return transport.status_request(ctx, self.endpoints["status"], {"cmd": cmd}, timeout_ms=10_000)

    def kill(self, sig=signal.SIGKILL):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)

    def output(self):
        return self.proc.stdout.read().decode() if self.proc and self.proc.stdout else ""


@pytest.fixture
def serve(tmp_path, zctx, endpoints):
    procs = []

    def start(*extra, state_dir=None):
        p = ServeProc(endpoints, state_dir or (tmp_path / "state"), *extra).start(zctx)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
