"""CPU tests of benchmarks/gpu/specctl_side.py: the decision audit against published policies, the
decision-log reader, and the daemon wrapper over real ipc sockets (the same code the GPU runs use)."""
import json
import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import specctl_side as SC  # noqa: E402

from specctl.policies.fixed import fixed_threshold  # noqa: E402
from specctl.policies.table import chain  # noqa: E402


def pol(version, rows, explore=None, period=None):
    def cfg(s):
        return {"steps": s, "topk": 1, "draft_tokens": s + 1 if s else 1}
    obj = {"kind": "policy", "schema": 1, "version": version, "created_at": 1.0, "source": "online",
           "table": [dict({"min_batch": a, "config": cfg(s)}, **({"max_batch": b} if b else {})) for a, b, s in rows]}
    if explore:
        obj["explore"] = [dict({"min_batch": a, "config": cfg(s)}, **({"max_batch": b} if b else {})) for a, b, s in explore]
        obj["explore_period"] = period
    return obj


def test_audit_replays_tables_fallback_and_exploration():
    from specctl.policies.table import PolicyTable
    p2 = pol(2, [(1, 3, 3), (4, None, 0)], explore=[(1, 3, 1)], period=64)
    t2 = PolicyTable.from_policy_obj(p2)
    fb = fixed_threshold(5, chain(3))
    dec = [(0, 1, 3, None), (1, 6, 0, None)]  # fallback: bs < 5 -> s3, else off
    for step in range(2, 200):
        bs = 1 + step % 6
        dec.append((step, bs, t2.decide(bs, step)[0], 2))  # exactly what the engine decides, explore rows included
    assert any(s == 1 for _, _, s, _ in dec)  # exploration happened
    r = SC.audit_decisions(dec, {2: p2}, fallback=fb)
    assert (r["decisions"], r["checked"], r["match"], r["match_frac"]) == (200, 200, 200, 1.0)
    assert r["versions"]["F"]["decisions"] == 2 and r["versions"]["2"]["match"] == 198
    bad = dec + [(200, 2, 0, 2), (201, 9, 3, 7)]  # a wrong choice; a version never seen
    r = SC.audit_decisions(bad, {2: p2}, fallback=fb)
    assert r["match"] == 200 and r["checked"] == 201 and r["unknown_version"] == 1
    assert r["mismatches"] == [{"step": 200, "batch_size": 2, "steps": 0, "version": 2, "table_says": 3}]


def test_audit_replays_context_bands_with_the_logged_context():
    p3 = pol(3, [(1, 3, 3), (4, None, 0)])
    p3["table"] += [dict(r, min_ctx=1024) for r in pol(3, [(1, 1, 1), (2, None, 0)])["table"]]
    dec = [(0, 2, 3, 3, 2 * 300), (1, 2, 0, 3, 2 * 6000), (2, 2, 3, 3, None), (3, 1, 1, 3, 6000)]
    r = SC.audit_decisions(dec, {3: p3})
    assert (r["checked"], r["match"]) == (4, 4)
    r = SC.audit_decisions([(4, 2, 3, 3, 2 * 6000)], {3: p3})  # s3 where the long band says off
    assert r["match"] == 0 and r["mismatches"][0]["table_says"] == 0


def test_read_decisions_skips_header_and_cut_lines(tmp_path):
    p = tmp_path / "d.txt"
    p.write_text("# specctl decisions rank 0: step batch_size steps version\n0 1 3 F\n1 2 3 4\n2 8 0 4\n3 8")
    assert SC.read_decisions(str(p)) == [(0, 1, 3, None, None), (1, 2, 3, 4, None), (2, 8, 0, 4, None)]
    p.write_text("0 8 3 4 2400\n1 8 0 4 48000\n2 8 0 4 48")  # the last line cut in its context field
    assert SC.read_decisions(str(p)) == [(0, 8, 3, 4, 2400), (1, 8, 0, 4, 48000)]
    assert SC.read_decisions(str(tmp_path / "missing.txt")) == []


def test_plugin_env():
    e = SC.plugin_env(mode="fixed", rundir="/r", server_id="s", threshold=5, config="s3", decision_log="/o/d{rank}.txt")
    assert e == {"SGLANG_PLUGINS": "specctl", "SPECCTL_MODE": "fixed", "SPECCTL_RUNDIR": "/r", "SPECCTL_SERVER_ID": "s",
                 "SPECCTL_DECISION_LOG": "/o/d{rank}.txt", "SPECCTL_FALLBACK": "5:s3"}
    assert SC.with_pythonpath({"PYTHONPATH": "/a:/b"}, "/s")["PYTHONPATH"] == "/s:/a:/b"


def test_daemon_start_poll_kill_restart_keeps_the_version(tmp_path):
    """The real `specctl serve` over ipc: started, polled, SIGKILLed, restarted on the same state dir."""
    import time
    site = str(tmp_path / "site")
    SC.make_site(site)
    d = SC.Daemon(rundir=str(tmp_path / "run"), state_dir=str(tmp_path / "state"), site=site,
                  log_path=str(tmp_path / "serve.log"), record_dir=str(tmp_path / "rec"))
    try:
        st = d.start(wait_s=60)
        v = st["policy"]["version"]
        deadline = time.monotonic() + 60
        while v not in d.policies and time.monotonic() < deadline:  # the poller runs every 0.25 s
            time.sleep(0.05)
        assert v in d.policies
        d.kill(signal.SIGKILL)
        assert d.proc.poll() is not None
        st2 = d.start(wait_s=60)
        assert st2["policy"]["version"] == v
    finally:
        d.stop()
    d.save(str(tmp_path / "p.json"))
    saved = json.loads((tmp_path / "p.json").read_text())
    assert [e["event"] for e in saved["events"]][:2] == ["start", "ready"]
    assert any(e["event"] == "signal 9" for e in saved["events"])
    assert saved["policies"][0]["version"] == v


def test_collect_merges_calls_later_rows_win_and_plots(tmp_path):
    """collect_results.py --also: rows of a later call replace the same (policy, concurrency); plot_results.py
    draws the committed kind of file."""
    import subprocess

    def bench(d, rows, phase):
        os.makedirs(d, exist_ok=True)
        json.dump({"gpu": "G", "sglang": "0.5.17", "model": "m", "variant": "vt", "draft": "d", "runs": rows,
                   "phase_runs": phase, "servers": {}, "identity": {}}, open(os.path.join(d, "bench-g0.json"), "w"))

    row = lambda p, c, v: {"policy": p, "concurrency": c, "output_tokens_per_s": v, "accept_length": None}  # noqa: E731
    bench(tmp_path / "a", [row("off", 1, 10.0), row("off", 2, 20.0), row("specctl", 1, 5.0)], [{"policy": "off", "output_tokens_per_s": 1.0}])
    bench(tmp_path / "b", [row("specctl", 1, 12.0), row("specctl", 2, 22.0)], [{"policy": "specctl", "output_tokens_per_s": 2.0}])
    chk = tmp_path / "tp2.json"
    chk.write_text(json.dumps({"verdict": {"ok": True}}))
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    out = os.path.join(root, "benchmarks", "results", "gpu-TESTDATE-vt.json")
    prof = os.path.join(root, "benchmarks", "gpu", "profiles", "h200-smollm2-135m-vt.json")
    try:
        subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu", "collect_results.py"), str(tmp_path / "a"),
                        "TESTDATE", "--also", str(tmp_path / "b"), "--checks", str(chk)], check=True, capture_output=True)
        r = json.load(open(out))
        got = {(x["policy"], x["concurrency"]): x["output_tokens_per_s"] for x in r["runs"]}
        assert got == {("off", 1): 10.0, ("off", 2): 20.0, ("specctl", 1): 12.0, ("specctl", 2): 22.0}
        assert sorted(x["policy"] for x in r["phase_runs"]) == ["off", "specctl"] and r["checks"]["tp2"]["verdict"]["ok"]
        pytest.importorskip("matplotlib")
        subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu", "plot_results.py"), out, "--out",
                        str(tmp_path / "p")], check=True, capture_output=True)
        assert (tmp_path / "p.png").stat().st_size > 1000
    finally:
        for f in (out, prof):
            if os.path.exists(f):
                os.remove(f)


def test_override_publishes_one_fixed_table_at_the_daemon_endpoint(tmp_path):
    """The forced plain-decode stage of specctl_e2e.py: a real SUB (the plugin's PolicyReceiver) gets the override
    frame, which the plugin's engine applies like any policy."""
    import time

    import zmq

    from specctl.controller import transport, wire
    from specctl.plugin.engine import EngineController, PluginSettings

    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    ov = SC.Override(str(rundir), [(1, None, 0)], version=1041)
    ov.start(period_s=0.05)
    ctx = zmq.Context()
    try:
        rx = transport.PolicyReceiver(ctx, ov.endpoint)
        frame = None
        t0 = time.time()
        while frame is None and time.time() - t0 < 60:
            frame = rx.poll()
            time.sleep(0.02)
        assert frame is not None
        rec = wire.decode_policy(frame)
        assert rec.version == 1041 and [r.config.steps for r in rec.table] == [0]
        eng = EngineController(PluginSettings(policy_endpoint=ov.endpoint, sync_every=1), candidate_steps=(0, 1, 3))
        eng.offer_policy_frame(frame)
        eng.sync()
        assert (eng.active_version, [eng.decide(b) for b in (1, 4, 64)]) == (1041, [0, 0, 0])
        rx.close()
    finally:
        ov.stop()
        ctx.term()
    assert ov.sent >= 1


def test_override_set_publishes_the_next_table_at_once_and_keeps_every_version(tmp_path):
    """run_bench's pinned servers: each set() is a new version, received (and applied by the plugin's engine) well
    before the next heartbeat would have carried it; a version is never reused for another table."""
    import time

    import zmq

    from specctl.controller import transport, wire
    from specctl.plugin.engine import EngineController, PluginSettings

    rundir = tmp_path / "run"
    rundir.mkdir(mode=0o700)
    ov = SC.Override(str(rundir), [(1, None, 0)], version=1)
    ov.start(period_s=30.0)  # a heartbeat far beyond the test: only set() can deliver the second table in time
    ctx = zmq.Context()
    eng = EngineController(PluginSettings(policy_endpoint=ov.endpoint, sync_every=1), candidate_steps=(0, 1, 3))

    def next_version(want):
        t0 = time.time()
        while time.time() - t0 < 20:
            frame = rx.poll()
            if frame is not None and wire.decode_policy(frame).version == want:
                eng.offer_policy_frame(frame)
                eng.sync()
                return time.time() - t0
            time.sleep(0.01)
        raise AssertionError(f"version {want} never arrived")

    try:
        rx = transport.PolicyReceiver(ctx, ov.endpoint)
        time.sleep(0.3)  # the subscription reaches the publisher (a slow joiner misses the first frame)
        ov.set([(1, None, 0)], version=2)  # re-sent at once: the subscriber sees it now
        next_version(2)
        assert [eng.decide(b) for b in (1, 64)] == [0, 0]
        ov.set([(1, None, 3)], version=3)
        assert next_version(3) < 5.0
        assert (eng.active_version, [eng.decide(b) for b in (1, 4, 64)]) == (3, [3, 3, 3])
        with pytest.raises(ValueError, match="version 2 was already published"):
            ov.set([(1, None, 3)], version=2)  # v2 was plain decode; the table in force (v3) is this one
        ov.set([(1, None, 3)], version=3)  # the same table under its own version again: a heartbeat
        assert sorted(ov.published) == [1, 2, 3] and ov.published[3]["table"][0]["config"]["steps"] == 3
        rx.close()
    finally:
        ov.stop()
        ctx.term()


def test_replay_versions_on_the_committed_gpu_telemetry():
    """benchmarks/gpu/replay_versions.py replays real H200 telemetry (session 2) through the ControllerService."""
    import subprocess

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    arch = os.path.join(root, "benchmarks", "gpu", "logs", "2026-11-30", "call6-sweep-online-overhead", "g0-telemetry.tar")
    r = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "gpu", "replay_versions.py"), arch,
                        "specctl-specctl/telemetry"], check=True, capture_output=True, text=True, timeout=300)
    first = r.stdout.splitlines()[0]
    assert first.startswith("7239 frames;"), first
    n_versions = int(first.split(";")[1].split()[0])
    assert n_versions > 1


def test_the_runner_imports_on_a_machine_where_specctl_is_not_installed(tmp_path):
    """The GPU machine has the repository and no specctl install: benchlib (run_bench's first import) makes the
    PYTHONPATH site itself. `-S` leaves out site-packages and the editable install; numpy comes by path."""
    import subprocess

    import numpy

    gpu = os.path.join(SC.REPO, "benchmarks", "gpu")
    deps = os.path.dirname(os.path.dirname(numpy.__file__))
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"{gpu}:{deps}", "SPECCTL_SITE": str(tmp_path / "site")}
    code = "import importlib.util as u; import benchlib, specctl; print(benchlib.OFF, u.find_spec('specctl.plugin').origin)"
    r = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split(") ")[0] == "(0, 1, 1" and str(tmp_path / "site") in r.stdout
