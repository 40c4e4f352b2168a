"""`specctl doctor` against recorded SGLang server logs and a real daemon over real sockets."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from specctl.controller import doctor, transport, wire
from specctl.controller.daemon import Daemon, Endpoints, wait_for_status
from specctl.controller.service import ControllerService, ServiceSettings

CLI = [sys.executable, "-m", "specctl.controller.cli"]
LOGS = Path(__file__).parent.parent / "fixtures" / "logs"
DOC = LOGS / "doctor"


def _doctor(*args, timeout=120):
    res = subprocess.run([*CLI, "doctor", *args], capture_output=True, text=True, timeout=timeout)
    return res.returncode, res.stdout + res.stderr


def _findings(path):
    rep = doctor.read_log(path)
    lines, found = doctor.check_log(rep)
    return rep, lines, found


# (log, problems expected (substrings, one per problem), warnings expected (substrings))
LOG_CASES = [
    ("tp2-healthy.log", [], ["patch fi_plan off: SGLang 0.5.23", "patch host_lens off: SPECCTL_HOST_SEQ_LENS=off"]),
    ("tp2-rank1-hooks-missing.log",
     ["sglang-b TP1/2: hooks did not take effect: sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.verify",
      "sglang-b: ranks disagree on patch plain_decode: TP0 on, TP1 off"],
     ["TP1/2: patch plain_decode off: the hooks on"]),
    ("tp1-patch-off.log", ["sglang-c TP0/1: patch catchup turned off after start-up: IndexError: ring slot 4097"], []),
    ("tp1-fallback.log",
     ["sglang-d TP0/1: fixed-threshold fallback in force since 10:09:30 (83 s before the log's last line): "
      "policy v5 is stale: no frame from the daemon for 12 s"], []),
    ("tp2-old-plugin.log", [], ["TP0,TP1/2: plugin version without startup line"]),
    ("tp2-rank1-half-started.log",
     ["sglang-e: TP size 2 but no start-up line from rank(s) 1",
      "sglang-e TP0/2: fixed-threshold fallback in force since 10:00:43"], []),
]


@pytest.mark.parametrize("name, problems, warnings", LOG_CASES, ids=[c[0] for c in LOG_CASES])
def test_recorded_logs_give_the_findings_they_hold(name, problems, warnings):
    _, _, found = _findings(DOC / name)
    got_p = [f"{f.where}: {f.text}" for f in found if f.level == doctor.PROBLEM]
    got_w = [f"{f.where}: {f.text}" for f in found if f.level == doctor.WARNING]
    assert len(got_p) == len(problems), got_p
    for want in problems:
        assert any(want in g for g in got_p), (want, got_p)
    for want in warnings:
        assert any(want in g for g in got_w), (want, got_w)


def test_per_rank_lines_say_plugin_hooks_off_path_patches_and_policy():
    rep, lines, _ = _findings(DOC / "tp2-rank1-hooks-missing.log")
    assert [st.rank for st in rep.ranks.values()] == [0, 1]
    r0, r1 = lines
    assert r0.startswith("  sglang-b TP0/2: loaded (sglang 0.5.23, online); hooks in place; off path decode; "
                         "patches on: catchup, draft_graphs, plain_decode, spec_alloc, splitkv, trivial_verify; "
                         "off: fi_plan, host_lens; policy v2 (online) in force since 10:01:02")
    assert "hooks MISSING: EAGLEWorkerV2.verify, TpModelWorker.forward_batch_generation; off path verify" in r1
    _, lines, _ = _findings(DOC / "tp2-old-plugin.log")
    assert "plugin version without startup line" in lines[0] and "all 3 hooks in place" in lines[0]
    _, lines, _ = _findings(DOC / "tp1-fallback.log")  # SGLang's prefix without a TP tag
    assert lines[0].startswith("  sglang-d TP0/1: loaded") and "FALLBACK in force since 10:09:30" in lines[0]


def test_a_log_without_the_plugin_says_it_did_not_load():
    _, _, found = _findings(LOGS / "sglang-0.5.23-adaptive-tp2.log")
    assert [f.level for f in found] == [doctor.PROBLEM]
    assert "no 'specctl:' line in 197 lines: the plugin did not load" in found[0].text


def test_a_restart_in_the_same_log_starts_each_rank_afresh(tmp_path):
    text = (DOC / "tp1-patch-off.log").read_text() + (DOC / "tp1-patch-off.log").read_text().split(
        "specctl: patch catchup off")[0].replace("2026-12-06 10:0", "2026-12-06 11:0")
    log = tmp_path / "restarted.log"
    log.write_text(text)
    _, _, found = _findings(log)
    assert [f for f in found if f.level == doctor.PROBLEM] == []  # the turned-off patch was the old process's


def test_doctor_cli_on_logs_exits_by_what_it_found():
    rc, out = _doctor("--log", str(DOC / "tp2-healthy.log"))
    assert rc == 0, out
    assert out.splitlines()[-1] == "doctor: 0 problem(s), 2 warning(s) -- specctl is working"
    assert len(out.splitlines()) <= 24  # one screen
    rc, out = _doctor("--log", str(DOC / "tp2-healthy.log"), "--log", str(DOC / "tp2-rank1-hooks-missing.log"))
    assert rc == 1, out
    assert "PROBLEM: tp2-rank1-hooks-missing.log: sglang-b TP1/2: hooks did not take effect" in out
    assert "Traceback" not in out
    rc, out = _doctor("--help")
    assert rc == 0 and "Is specctl working?" in out and "--log" in out
    rc, out = _doctor("--rules")
    assert rc == 0 and "Problems (exit 1)" in out


def _frame(server, i, steps=1):
    return wire.encode(wire.StepRecord(
        server=server, rank=0, iter=i, ts=time.time(), batch_size=2,
        config=wire.SpecConfig(steps=steps, topk=1, draft_tokens=steps + 1),
        accepted=[1, 0] if steps else None, step_ms=7.5, off_path="decode" if steps == 0 else None))


@pytest.fixture
def live_daemon(zctx, endpoints):
    svc = ControllerService(ServiceSettings(refit_interval_s=0.2, heartbeat_s=0.2))
    d = Daemon(svc, Endpoints(endpoints["telemetry"], endpoints["publish"], endpoints["status"]), ctx=zctx)
    th = threading.Thread(target=d.run, daemon=True)
    th.start()
    wait_for_status(zctx, endpoints["status"], timeout_s=60)
    yield d
    d.stop_event.set()
    th.join(10)


def test_doctor_against_a_real_daemon(live_daemon, zctx, endpoints):
    ep = endpoints["status"]
    rc, out = _doctor("--endpoint", ep)
    assert rc == 1, out
    assert f"daemon {ep}: pid" in out and "no telemetry from any server yet" in out

    tx = transport.TelemetrySender(zctx, endpoints["telemetry"])
    try:
        deadline = time.monotonic() + 60
        i = 0
        while live_daemon.service.servers.get("sglang-a") is None or time.monotonic() < deadline - 58:
            assert time.monotonic() < deadline
            tx.send(_frame("sglang-a", i, steps=i % 2))
            i += 1
            time.sleep(0.005)
        # records keep coming while doctor asks: the daemon reports a rate and the server as live
        stop = threading.Event()

        def keep_sending():
            j = i
            while not stop.is_set():
                tx.send(_frame("sglang-a", j, steps=j % 2))
                j += 1
                time.sleep(0.01)

        th = threading.Thread(target=keep_sending, daemon=True)
        th.start()
        try:
            rc, out = _doctor("--endpoint", ep, "--log", str(DOC / "tp2-healthy.log"))
        finally:
            stop.set()
            th.join(5)
        assert rc == 0, out
        line = next(ln for ln in out.splitlines() if ln.startswith("  server sglang-a:"))
        rate = float(line.split(" records/s")[0].rsplit(" ", 1)[1])
        assert rate > 0, line
        assert "steps with speculation off by path: decode" in line
        assert "log " in out and "sglang-a TP1/2: loaded" in out
        st = transport.status_request(zctx, ep, {"cmd": "status"}, timeout_ms=10_000)
        # the reply names the server's rate (its value depends on the window and the machine's load: not asserted)
        assert "sglang-a" in st["daemon"]["records_per_s"]
        # the server goes quiet: past --stale-after that is a problem
        time.sleep(1.2)
        rc, out = _doctor("--endpoint", ep, "--stale-after", "0.5")
        assert rc == 1, out
        assert "PROBLEM: " in out and "sglang-a: no telemetry for" in out
    finally:
        tx.close()


def test_a_status_reply_from_an_older_daemon_still_reads():
    svc = ControllerService(ServiceSettings())
    assert svc.observe_frame(_frame("old", 0))
    reply = svc.status()  # no "daemon" section: what daemons before it answered
    lines, found = doctor.check_status(reply, "ipc:///x", stale_after_s=1e9)
    assert "rate unknown (daemon without rates)" in lines[1]
    assert [f for f in found if f.level == doctor.PROBLEM] == []
