"""Which "off" the engines ran (telemetry's off_path): the wire's rule, the daemon's counts in its
metrics and status, and `specctl policy show`."""

import json

import pytest

from specctl.controller import show, wire
from specctl.controller.service import ControllerService, ServiceSettings

BASE = {"kind": "step", "schema": 1, "server": "a", "rank": 0, "ts": 1_764_441_600.0, "batch_size": 4,
        "step_ms": 7.0}
OFF = {"steps": 0, "topk": 1, "draft_tokens": 1}
S3 = {"steps": 3, "topk": 1, "draft_tokens": 4}


def frame(i, config=OFF, **kw):
    rec = dict(BASE, iter=i, ts=BASE["ts"] + i * 0.01, config=config, **kw)
    if config["steps"]:
        rec["accepted"] = [1, 2, 0, 3]
    return json.dumps(rec).encode()


@pytest.mark.parametrize("kw, ok", [
    ({}, True), ({"off_path": "decode"}, True), ({"off_path": "verify"}, True),
    ({"off_path": "eager"}, False),                      # not a path the plugin runs
    ({"config": S3, "off_path": "decode"}, False),       # only steps-0 records say it
])
def test_off_path_is_one_of_two_and_only_on_steps0_records(kw, ok):
    f = frame(1, **kw)
    if ok:
        assert wire.decode_step(f).off_path == kw.get("off_path")
    else:
        with pytest.raises(wire.WireError):
            wire.decode_step(f)


def test_the_daemon_counts_each_off_path_per_server_and_policy_show_prints_them():
    clock = [BASE["ts"]]
    svc = ControllerService(ServiceSettings(refit_interval_s=1.0), clock=lambda: clock[0])
    frames = ([frame(i, off_path="decode") for i in range(30)] + [frame(100 + i, off_path="verify") for i in range(5)]
              + [frame(200 + i) for i in range(2)] + [frame(300 + i, config=S3) for i in range(40)])
    for f in frames:
        assert svc.observe_frame(f)
    m = svc.metrics
    for path, n in (("decode", 30), ("verify", 5), ("unknown", 2)):
        assert m.value("specctl_off_steps_total", {"server": "a", "path": path}) == n
    assert svc.status()["servers"]["a"]["off_paths"] == {"decode": 30, "verify": 5, "unknown": 2}
    clock[0] += 5.0
    svc.refit()
    assert svc.policy.model["off_paths"] == {"decode": 30, "unknown": 2, "verify": 5}
    text = show.render(svc.policy, now=clock[0])
    assert "off steps ran: decode state 30, trivial verify 5, not said 2" in text
