import gzip
import json
import subprocess
import sys
import time

import pytest
import zmq

from specctl.controller import show, wire
from specctl.controller.replay import recording_frames, replay
from specctl.controller.service import ControllerService, ServiceSettings
from specctl.training.synth import generate, truth_with_crossover

CLI = [sys.executable, "-m", "specctl.controller.cli"]


def _recording(path, n=200, span_s=None):
    recs = list(generate(truth_with_crossover(10), num_steps=n, batch_sizes=[1, 4, 16, 32], seed=1))
    if span_s is not None:
        t0 = recs[0]["ts"]
        for i, r in enumerate(recs):
            r["ts"] = t0 + span_s * i / (n - 1)
    with open(path, "w") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
        f.write("not json\n")
        f.write("[1, 2]\n")
    return recs


def test_replay_sends_every_line_and_reports_skips(tmp_path, zctx):
    path = tmp_path / "r.jsonl"
    recs = _recording(path)
    pull = zctx.socket(zmq.PULL)
    pull.bind("inproc://replay")
    push = zctx.socket(zmq.PUSH)
    push.connect("inproc://replay")
    rep = replay(path, push)
    assert rep.sent == len(recs) and rep.skipped == 2
    assert any("line 201" in p for p in rep.problems)
    got = [wire.decode_step(pull.recv()) for _ in range(rep.sent)]
    assert [g.iter for g in got] == [r["iter"] for r in recs]


def test_replay_speed_paces_by_recorded_timestamps(tmp_path, zctx, monkeypatch):
    path = tmp_path / "r.jsonl"
    _recording(path, n=101, span_s=10.0)
    pull = zctx.socket(zmq.PULL)
    pull.bind("inproc://replay2")
    push = zctx.socket(zmq.PUSH)
    push.connect("inproc://replay2")
    now = [0.0]
    slept = []

    def fake_sleep(s):
        slept.append(s)
        now[0] += s

    def real_sleep(s):
        raise AssertionError(f"replay slept {s} s on the real clock, not the injected one")

    monkeypatch.setattr(time, "sleep", real_sleep)
    rep = replay(path, push, speed=4.0, sleep=fake_sleep, clock=lambda: now[0])
    assert rep.sent == 101
    # 10 s recorded at 4x: the schedule waits 2.5 s in total, in 100 steps of 25 ms
    assert sum(slept) == pytest.approx(2.5, rel=1e-4)
    assert len(slept) == 100 and max(slept) == pytest.approx(0.025, rel=1e-4)


def test_render_and_plot(tmp_path):
    svc = ControllerService(ServiceSettings(refit_interval_s=1), clock=lambda: 2e9)
    for r in generate(truth_with_crossover(12), num_steps=6000, batch_sizes=list(range(1, 40)), t0=2e9 - 100):
        svc.observe_frame(json.dumps(r).encode())
    svc.refit()
    text = show.render(svc.policy, now=2e9 + 30)
    assert "source=online" in text and "age=30s" in text and "*" in text and "tau=" in text
    png = tmp_path / "p.png"
    show.plot(svc.policy, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [{"min_batch": 8, "max_batch": 15, "config": {"steps": 1, "topk": 1, "draft_tokens": 2}}]
    pol = wire.policy_from_obj({**wire.to_obj(svc.policy), "explore": rows, "explore_period": 64})
    text = show.render(pol, now=2e9 + 30)
    assert "exploring 1 step in 64: s1@8-15" in text


def test_render_and_plot_a_policy_with_context_bands(tmp_path):
    s3, off = {"steps": 3, "topk": 1, "draft_tokens": 4}, {"steps": 0, "topk": 1, "draft_tokens": 1}
    table = [{"min_batch": 1, "max_batch": 20, "config": s3}, {"min_batch": 21, "config": off},
             {"min_batch": 1, "max_batch": 70, "config": s3, "min_ctx": 0, "max_ctx": 1023},
             {"min_batch": 71, "config": off, "min_ctx": 0, "max_ctx": 1023},
             {"min_batch": 1, "max_batch": 13, "config": s3, "min_ctx": 1024},
             {"min_batch": 14, "config": off, "min_ctx": 1024}]
    model = {"predicted_goodput_tok_s": {"off": [[1, 150.0], [64, 8000.0]], "s3": [[1, 300.0], [64, 9000.0]]}}
    pol = wire.policy_from_obj({"kind": "policy", "schema": 1, "version": 3, "created_at": 2e9, "source": "online",
                                "table": table, "model": model})
    text = show.render(pol, now=2e9 + 5)
    lines = text.splitlines()
    assert any(ln.strip().startswith("1-20  s3") for ln in lines) and any(ln.strip().startswith("21+  off") for ln in lines)
    assert "context 0-1023  s3 1-70, off 71+  (spec->off at batch 71)" in text
    assert "context 1024+  s3 1-13, off 14+  (spec->off at batch 14)" in text
    assert sum("s3" in ln for ln in lines) == 4  # the header, the s3 row for any context, one line per band
    png = tmp_path / "bands.png"
    show.plot(pol, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_records_accepted_telemetry(serve, zctx, endpoints, tmp_path):
    rec_dir = tmp_path / "rec"
    p = serve("--record", str(rec_dir), "--refit-interval", "0.5")
    path = tmp_path / "r.jsonl"
    recs = _recording(path)
    out = subprocess.run(CLI + ["replay", str(path), "--to", endpoints["telemetry"]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    t = time.monotonic()
    while p.status(zctx)["records_in"] < len(recs) and time.monotonic() - t < 60:
        time.sleep(0.05)
    p.kill(__import__("signal").SIGTERM)
    import gzip
    lines = []
    for f in sorted(rec_dir.glob("*.jsonl.gz")):
        lines += gzip.open(f, "rt").read().splitlines()
    assert len(lines) == len(recs)
    assert json.loads(lines[0])["iter"] == recs[0]["iter"]


@pytest.mark.parametrize("value, expect", [
    ("off,s1,s3", ((0, 1, 1), (1, 1, 2), (3, 1, 4))),  # as `specctl sglang-args --configs` takes it
    ("off s1 s3", ((0, 1, 1), (1, 1, 2), (3, 1, 4))),
    ("0,1,1 3,1,4", ((0, 1, 1), (3, 1, 4))),
    ("3,1,4", ((3, 1, 4),)),
])
def test_serve_configs_option_forms(value, expect):
    from specctl.controller.cli import _parse_configs

    assert _parse_configs(None, None, value) == expect


def test_recording_frames_reads_plain_and_gzip_files_in_order_carrying_ts_over_bad_lines(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text('{"ts": 1.5, "kind": "step"}\n\n  \nnot json\n[1, 2]\n{"ts": null}\r\n')
    b = tmp_path / "b.jsonl.gz"
    with gzip.open(b, "wt") as f:
        f.write('{"ts": 7, "kind": "step"}\n{"kind": "hello"}\n')
    frames = recording_frames([a, str(b)])
    assert frames == [(1.5, b'{"ts": 1.5, "kind": "step"}'), (1.5, b"not json"), (1.5, b"[1, 2]"),
                      (1.5, b'{"ts": null}'), (7.0, b'{"ts": 7, "kind": "step"}'), (7.0, b'{"kind": "hello"}')]
    assert recording_frames([]) == []
