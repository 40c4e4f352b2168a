"""`--live`: the simulated engine against a real daemon over real ZeroMQ sockets, on the wall clock."""

import threading
import time
from dataclasses import replace

import pytest
import zmq

from specctl.controller import transport
from specctl.controller.daemon import Daemon, Endpoints, wait_for_status
from specctl.controller.service import ControllerService, ServiceSettings
from specctl.harness.simbench import LiveAdaptivePolicy
from specctl.training.simulator import load_profile, load_workload, simulate


@pytest.fixture
def daemon(tmp_path):
    ctx = zmq.Context()
    eps = transport.default_endpoints(transport.runtime_dir(tmp_path / "run"))
    svc = ControllerService(ServiceSettings(refit_interval_s=0.3, heartbeat_s=0.2))
    d = Daemon(svc, Endpoints(eps["telemetry"], eps["publish"], eps["status"]), ctx=ctx)
    th = threading.Thread(target=d.run, daemon=True)
    th.start()
    wait_for_status(ctx, eps["status"], timeout_s=60)
    yield d, eps
    d.stop_event.set()
    th.join(5)
    ctx.destroy(linger=0)


def test_live_engine_streams_telemetry_and_follows_the_daemon(daemon):
    d, eps = daemon
    prof = load_profile("dense-8b-h200")
    wl = load_workload("demo")
    wl = replace(wl, phases=tuple(replace(p, duration_s=1.0) for p in wl.phases))
    seen = []
    t0 = time.monotonic()
    pol = LiveAdaptivePolicy(prof, eps["telemetry"], eps["publish"], on_policy=seen.append)
    outcomes = []
    send = pol.sender.send
    pol.sender.send = lambda frame: outcomes.append(send(frame)) or outcomes[-1]
    try:
        r = simulate(prof, wl, pol, clock=lambda: time.monotonic() - t0)
    finally:
        pol.close()
    assert time.monotonic() - t0 >= 2.9  # paced to the wall clock: never ahead of 3 virtual seconds
    # IMMEDIATE: frames offered before the connection completes are dropped (and counted), not
    # queued; once connected none is, as the queue's bound is far above this run's frames
    assert len(outcomes) == r.num_steps < transport.DEFAULT_TELEMETRY_HWM and True in outcomes
    first = outcomes.index(True)
    assert outcomes == [False] * first + [True] * (r.num_steps - first)
    sent = pol.sender.num_sent
    assert (sent, pol.sender.num_dropped) == (r.num_steps - first, first)
    deadline = time.monotonic() + 60
    while d.service.model.num_samples_ < sent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.service.model.num_samples_ == sent  # every frame sent reached the daemon's model
    assert seen and pol.engine.stats.num_updates_applied >= 1  # and its policies came back
    assert max(p.version for p in seen) >= 2
