"""CPU tests of benchmarks/gpu/tp2_check.{py,sh}: the rank compare, the policy publisher (real zmq), the
script's syntax, and a dry run of the whole script against a CPU stand-in for a TP=2 SGLang server (two rank
processes, each with the real EngineController, rank 0's policy broadcast to rank 1 at sync boundaries)."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import tp2_check as T  # noqa: E402

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu", "tp2_check.sh")


def _write_log(path, rows, rank=0, headers=1, tail=""):
    with open(path, "w") as f:
        for _ in range(headers):
            f.write(f"# specctl decisions rank {rank}: step batch_size steps version\n")
        for r in rows:
            f.write(" ".join(str(x) for x in r) + "\n")
        f.write(tail)


def _rows(n, start_version=1, every=100, fallback_first=16):
    """n decisions: fallback for the first steps, then versions changing every `every` steps, each
    decision = the published table's choice for a batch size cycling 1..40."""
    out = []
    for i in range(n):
        bs = 1 + (i // 7) % 40
        if i < fallback_first:
            fb = T._fallback_lookup()
            out.append((i, bs, fb(bs), "F"))
        else:
            v = start_version + (i - fallback_first) // every
            out.append((i, bs, T.lookup(T.table_for(v), bs), v))
    return out


def _published(d, versions):
    with open(os.path.join(d, "published.jsonl"), "w") as f:
        for v in versions:
            f.write(json.dumps({"t": 0.0, "version": v, "table": [list(r) for r in T.table_for(v)]}) + "\n")


def _client(d, **kw):
    c = {"ready": True, "requests": 10, "ok": 10, "errors": 0, "timeouts": 0, "stopped_because": "target",
         "healthy_at_end": True}
    c.update(kw)
    with open(os.path.join(d, "client.json"), "w") as f:
        json.dump(c, f)


SERVER_LOG = ("[2026-12-01 10:00:00 TP0] specctl: engine ready on TP rank 0/2, mode online, candidate steps [0, 1, 3]\n"
              "[2026-12-01 10:00:00 TP1] specctl: engine ready on TP rank 1/2, mode online, candidate steps [0, 1, 3]\n"
              "[2026-12-01 10:00:01 TP0] specctl: policy v1 (online) in force from decode step 16: bs 1+: steps=1\n"
              "[2026-12-01 10:00:01 TP1] specctl: policy v1 (online) in force from decode step 16: bs 1+: steps=1\n"
              "[2026-12-01 10:00:02 TP0] Switch adaptive runtime state: steps 3 -> 1, draft_tokens 4 -> 2\n"
              "[2026-12-01 10:00:02] INFO: 127.0.0.1 - POST /generate 200\n")


def _setup(tmp_path, r0, r1, versions=range(1, 200), headers=(1, 1), log=SERVER_LOG):
    d = str(tmp_path)
    _write_log(os.path.join(d, "decisions-rank0.txt"), r0, 0, headers[0])
    if r1 is not None:
        _write_log(os.path.join(d, "decisions-rank1.txt"), r1, 1, headers[1])
    _published(d, versions)
    _client(d)
    with open(os.path.join(d, "server.log"), "w") as f:
        f.write(log)
    return d


# ----------------------------------------------------------------------------- compare

def test_identical_logs_pass(tmp_path):
    rows = _rows(3000)
    d = _setup(tmp_path, rows, rows)
    s = T.cmd_compare(d, min_decisions=2000)
    v = s["verdict"]
    assert v["ok"], v
    assert v["identical"] and v["decisions_compared"] == 3000
    assert v["versions_applied"] == (3000 - 16 + 99) // 100
    assert s["rank0_decisions"]["version_changes"] == v["versions_applied"]  # F->1, 1->2, ...
    assert s["rank0_decisions"]["fallback_lines"] == 16 and s["rank0_decisions"]["first_policy_step"] == 16
    assert s["rank0_decisions"]["fallback_lines_not_fallback_table"] == 0
    assert s["rank0_decisions"]["table_mismatches"] == 0 and s["rank0_decisions"]["step_gaps"] == 0
    assert sum(s["rank0_decisions"]["steps_histogram"].values()) == 3000
    assert s["tp_log"]["counts"]["engine_ready"] == {"0": 1, "1": 1}
    assert s["tp_log"]["in_force_lines"]["identical"] and s["tp_log"]["in_force_lines"]["compared"] == 1
    assert s["log"]["switch_state"]["count"] == 1
    with open(os.path.join(d, "summary.json")) as f:
        assert json.load(f)["verdict"] == v


def test_a_mismatch_is_reported_with_its_place(tmp_path):
    rows = _rows(500)
    bad = list(rows)
    st, bs, steps, ver = bad[321]
    bad[321] = (st, bs, 3 if steps != 3 else 0, ver)
    d = _setup(tmp_path, rows, bad)
    s = T.cmd_compare(d, min_decisions=100)
    assert not s["verdict"]["identical"] and not s["verdict"]["ok"]
    assert "identical" in s["verdict"]["failed_checks"]
    fm = s["compare"]["first_mismatch"]
    assert fm["index"] == 321 and fm["rank0"] == " ".join(map(str, rows[321]))
    assert s["compare"]["mismatches"] == 1


def test_one_rank_longer_compares_the_common_prefix(tmp_path):
    rows = _rows(1000)
    d = _setup(tmp_path, rows, rows[:990])
    s = T.cmd_compare(d, min_decisions=900)
    assert s["verdict"]["ok"] and s["verdict"]["decisions_compared"] == 990
    assert s["compare"]["rank0_extra"] == 10 and s["compare"]["rank1_extra"] == 0
    assert any("rank0 +10" in n for n in s["verdict"]["notes"])


def test_partial_last_line_is_dropped_not_malformed(tmp_path):
    rows = _rows(200)
    d = str(tmp_path)
    _setup(tmp_path, rows, rows)
    _write_log(os.path.join(d, "decisions-rank1.txt"), rows, 1, tail="200 4 1")
    s = T.cmd_compare(d, min_decisions=100)
    assert s["ranks"]["rank1"]["partial_tail"] == "200 4 1" and s["ranks"]["rank1"]["malformed"] == 0
    assert s["verdict"]["identical"]


def test_fallback_only_run_fails_policy_updates_check(tmp_path):
    fb = T._fallback_lookup()
    rows = [(i, 1 + i % 40, fb(1 + i % 40), "F") for i in range(500)]
    d = _setup(tmp_path, rows, rows)
    s = T.cmd_compare(d, min_decisions=100)
    assert s["verdict"]["identical"] and not s["verdict"]["ok"]
    assert s["verdict"]["versions_applied"] == 0
    assert "policy_updates_landed" in s["verdict"]["failed_checks"]


def test_unpublished_version_and_table_mismatch_fail(tmp_path):
    rows = _rows(600)
    d = _setup(tmp_path, rows, rows, versions=range(1, 3))  # versions >= 3 never published
    s = T.cmd_compare(d, min_decisions=100)
    assert "applied_versions_were_published" in s["verdict"]["failed_checks"]
    assert s["rank0_decisions"]["num_unknown_versions"] > 0
    rows2 = list(rows)
    st, bs, steps, ver = rows2[100]
    rows2[100] = (st, bs, 3 if steps != 3 else 1, ver)  # both ranks agree, but not with the table
    os.makedirs(tmp_path / "b")
    d2 = _setup(tmp_path / "b", rows2, rows2)
    s2 = T.cmd_compare(d2, min_decisions=100)
    assert s2["verdict"]["identical"] and "decisions_follow_tables" in s2["verdict"]["failed_checks"]


def test_missing_rank1_log_and_two_engines_fail(tmp_path):
    rows = _rows(300)
    d = _setup(tmp_path, rows, None)
    s = T.cmd_compare(d, min_decisions=100)
    assert not s["verdict"]["ok"] and "both_rank_logs" in s["verdict"]["failed_checks"]
    os.makedirs(tmp_path / "b")
    d2 = _setup(tmp_path / "b", rows, rows, headers=(2, 1))
    s2 = T.cmd_compare(d2, min_decisions=100)
    assert "one_engine_per_rank" in s2["verdict"]["failed_checks"]


def test_nccl_errors_and_client_timeouts_fail(tmp_path):
    rows = _rows(300)
    d = _setup(tmp_path, rows, rows, log=SERVER_LOG + "[2026-12-01 10:00:03 TP1] NCCL error: unhandled system error\n")
    _client(d, timeouts=2, errors=2, stopped_because="timeouts (hang?)")
    s = T.cmd_compare(d, min_decisions=100)
    assert {"no_nccl_errors", "no_request_errors", "no_hang"} <= set(s["verdict"]["failed_checks"])
    assert s["tp_log"]["counts"]["nccl_error"] == {"1": 1}


def test_tp_log_in_force_sequences_compared():
    text = SERVER_LOG + ("[2026-12-01 10:00:04 TP0] specctl: policy v2 (online) in force from decode step 32: x\n"
                         "[2026-12-01 10:00:04 TP1] specctl: policy v2 (online) in force from decode step 48: x\n")
    s = T.summarize_tp_log(text)
    assert not s["in_force_lines"]["identical"]
    assert s["in_force_lines"]["first_difference"] == {"rank0": [2, 32], "rank1": [2, 48]} or \
        s["in_force_lines"]["first_difference"] == {"rank0": (2, 32), "rank1": (2, 48)}
    assert s["by_rank_lines"]["main"] == 1


def test_count_decisions_ignores_header(tmp_path):
    p = str(tmp_path / "d.txt")
    _write_log(p, _rows(40))
    assert T.count_decisions(p) == 40
    assert T.count_decisions(str(tmp_path / "missing")) == 0


# ----------------------------------------------------------------------------- publisher

def test_tables_are_valid_policies_the_engine_accepts():
    from specctl.controller import wire
    from specctl.plugin.engine import EngineController, PluginSettings

    eng = EngineController(PluginSettings(mode="online", policy_endpoint="ipc:///nowhere"), candidate_steps=[0, 1, 3])
    for v in range(1, len(T.TABLES) + 1):
        rec = wire.decode_policy(T.policy_frame(v))
        assert rec.version == v and rec.source == "online"
        assert eng.offer_policy_frame(T.policy_frame(v)) is None
        eng.sync(None)
        assert eng.active_version == v
        for bs in (1, 2, 3, 7, 8, 9, 16, 32):
            assert eng.decide(bs) == T.lookup(T.table_for(v), bs)
    # every candidate step is used by some table, and no table names another
    used = {s for rows in T.TABLES for _, _, s in rows}
    assert used == set(T.CANDIDATES)


def test_publisher_publishes_increasing_versions_cycling_the_tables(tmp_path):
    import zmq

    from specctl.controller import transport, wire

    ep = f"ipc://{transport.runtime_dir(tmp_path / 'run')}/p.sock"
    out = str(tmp_path / "published.jsonl")
    stop = threading.Event()
    th = threading.Thread(target=T.cmd_publish, args=(ep, out, 0.02), kwargs={"stop": stop}, daemon=True)
    th.start()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(ep)
    got = []
    t0 = time.time()
    try:
        while len(got) < 10 and time.time() - t0 < 60:
            if sub.poll(200):
                got.append(wire.decode_policy(sub.recv()))
    finally:
        stop.set()
        th.join(5)
        sub.close(linger=0)
        ctx.term()
    assert len(got) == 10 and not th.is_alive()
    vs = [r.version for r in got]
    assert vs == list(range(vs[0], vs[0] + 10))  # consecutive, increasing (a late joiner misses the first)
    for r in got:
        rows = [(e.min_batch, e.max_batch, e.config.steps) for e in r.table]
        assert rows == T.table_for(r.version)
    assert len({tuple(map(tuple, T.table_for(v))) for v in vs}) == len(T.TABLES)
    pub = T.read_published(out)
    assert set(vs) <= set(pub) and min(pub) == 1
    ts = [json.loads(ln)["t"] for ln in open(out)]
    gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
    assert gaps[0] >= 0.01 - 1e-4  # never a burst, however late a version is (t is rounded to 0.1 ms)
    assert pub[vs[0]] == T.table_for(vs[0])


def test_publisher_schedule_is_one_version_a_period_and_never_a_burst(tmp_path, monkeypatch):
    """The schedule on a virtual clock: a version every period; after a stall (a slow send), the
    next one half a period later, not a burst to catch up."""
    class VirtualTime:
        t = 1000.0

        def time(self):
            return self.t

        def sleep(self, s):
            self.t += s

    vt = VirtualTime()
    monkeypatch.setattr(T, "time", vt)
    frame = T.policy_frame

    def slow_frame(v):
        if v == 4:
            vt.t += 0.35  # this version takes 3.5 periods to build and send
        return frame(v)

    monkeypatch.setattr(T, "policy_frame", slow_frame)
    out = str(tmp_path / "published.jsonl")
    ep = f"ipc://{tmp_path}/p.sock"
    assert T.cmd_publish(ep, out, period_s=0.1, duration_s=1.0) == 7  # 1 s: v1..v7 (v4 cost 0.35 s)
    ts = [json.loads(ln)["t"] for ln in open(out)]
    gaps = [round(b - a, 3) for a, b in zip(ts, ts[1:])]
    # v4 started on time, finished 0.35 s late; v5 follows it half a period later, then the period again
    assert gaps[:4] == [0.1, 0.1, 0.45, 0.05] and set(gaps[4:]) == {0.1}, gaps


# ----------------------------------------------------------------------------- the script

def test_tree_tables_are_valid_policies_a_tree_engine_accepts(monkeypatch):
    """TP2_TREE=1: the tables name the tree (runtime state 2) beside off, s1 and s3; a chain-only engine refuses them."""
    from specctl.plugin.engine import EngineController, PluginSettings

    monkeypatch.setenv("TP2_TREE", "1")
    eng = EngineController(PluginSettings(mode="online", policy_endpoint="ipc:///nowhere"),
                           candidate_steps=T.TREE_CANDIDATES, states={2: T.TREE})
    for v in range(1, len(T.TREE_TABLES) + 1):
        assert eng.offer_policy_frame(T.policy_frame(v)) is None
        eng.sync(None)
        assert eng.active_version == v
        for bs in (1, 2, 3, 4, 5, 7, 8, 12, 13, 32):
            assert eng.decide(bs) == T.lookup(T.table_for(v), bs)
    assert {s for rows in T.TREE_TABLES for _, _, s in T.key_rows(rows)} == set(T.TREE_CANDIDATES)
    chains = EngineController(PluginSettings(mode="online", policy_endpoint="ipc:///nowhere"),
                              candidate_steps=T.TREE_CANDIDATES)
    chains.offer_policy_frame(T.policy_frame(2))
    chains.sync(None)
    assert chains.active_source == "fallback" and "s2k4n16" in chains.fallback_reason
    assert T._fallback_lookup()(3) == 3  # the fallback is the plugin's default (s3 below 5)


def test_script_syntax():
    for s in ("tp2_check.sh", "plugin_smoke.sh", "overlay.sh"):
        r = subprocess.run(["bash", "-n", os.path.join(REPO, "benchmarks", "gpu", s)], capture_output=True, text=True)
        assert r.returncode == 0, (s, r.stderr)


def test_script_sets_the_multicast_guards_and_tp2_flags():
    text = open(SCRIPT).read()
    for needle in ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1",
                   "--tp-size 2", "--disable-custom-all-reduce", "SPECCTL_MODE=online",
                   'SPECCTL_DECISION_LOG="$OUT/decisions-rank{rank}.txt"', "--speculative-num-steps 3",
                   "plugin_smoke_adaptive.json", "set -m", "trap cleanup EXIT"):
        assert needle in text, needle
    assert "enable-nccl-nvls" not in text and "enable-symm-mem" not in text and "enable-torch-symm-mem" not in text


# A CPU stand-in for `python3 -m sglang.launch_server --tp-size 2`: the main process serves HTTP; two forked
# "scheduler" processes (TP0, TP1) each run the real EngineController from SPECCTL_* like the plugin does;
# rank 0 takes requests, decides, sends telemetry, polls the policy SUB and broadcasts at sync boundaries;
# rank 1 mirrors every step. Logs go to stdout with SGLang's " TP0" / " TP1" prefixes.
MOCK = textwrap.dedent('''
    import json, logging, multiprocessing as mp, os, sys, threading, time
    from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1]); tp = int(args[args.index("--tp-size") + 1])
    cands = json.load(open(args[args.index("--speculative-adaptive-config") + 1]))["1"]["candidate_steps"]

    def setup_log(rank):
        logging.basicConfig(level=logging.INFO, format=f"[%(asctime)s TP{rank}] %(message)s",
                            datefmt="%Y-%m-%d %H:%M:%S", force=True, stream=sys.stdout)

    def engine(rank):
        from specctl.plugin.engine import EngineController, PluginSettings
        s = PluginSettings.from_env(os.environ)
        from specctl.plugin.launch_args import read_tree_states
        trees = read_tree_states(args[args.index("--speculative-adaptive-config") + 1])
        eng = EngineController(s, candidate_steps=cands, states=trees, rank=rank)
        logging.getLogger("specctl.plugin").info("specctl: engine ready on TP rank %d/%d, mode %s, candidate steps %s",
                                                 rank, tp, s.mode, sorted(cands))
        return s, eng

    FAULT = os.environ.get("MOCK_FAULT", "")

    def rank1(conn):
        setup_log(1)
        s, eng = engine(1)
        while True:
            msg = conn.recv()
            if msg[0] == "step":
                eng.decide(msg[1])
                if eng.note_result():
                    kind, upd = conn.recv()
                    assert kind == "sync"
                    eng.sync(lambda _o, u=(None if FAULT == "diverge" else upd): u)

    def rank0(req_conn, peer):
        setup_log(0)
        import zmq
        from specctl.controller.transport import PolicyReceiver, TelemetrySender
        s, eng = engine(0)
        ctx = zmq.Context.instance()
        rx = PolicyReceiver(ctx, s.policy_endpoint)
        tx = TelemetrySender(ctx, s.telemetry_endpoint)
        running = {}
        it = 0
        prev = None
        while True:
            while req_conn.poll(0 if running else 0.01):
                rid, n = req_conn.recv()
                running[rid] = [0, n]
            if not running:
                continue
            if FAULT == "stall" and it >= 1500:
                time.sleep(3600)
            bs = len(running)
            peer.send(("step", bs))
            steps = eng.decide(bs)
            if prev is not None and steps != prev:
                logging.info("Switch adaptive runtime state: steps %d -> %d, draft_tokens %d -> %d",
                             prev, steps, prev + 1, steps + 1)
            prev = steps
            time.sleep(0.001)  # >= 3 s for TARGET=3000: the driver's 2.5 s levels change at least once
            for rid in list(running):
                running[rid][0] += steps + 1
                if running[rid][0] >= running[rid][1]:
                    req_conn.send((rid, running.pop(rid)[1]))
            tx.send(eng.step_record(iter=it, ts=time.time(), batch_size=bs, draft_tokens=steps + 1,
                                    accepted=[steps] * bs if steps else None, step_ms=0.5))
            it += 1
            if eng.note_result():
                f = rx.poll()
                if f is not None:
                    eng.offer_policy_frame(f)
                def bc(obj):
                    peer.send(("sync", obj))
                    return obj
                eng.sync(bc)

    if __name__ == "__main__":
        if FAULT == "die":
            print("[2026-12-01 10:00:00] RuntimeError: mock failure at start", flush=True)
            sys.exit(1)
        ctx = mp.get_context("fork")
        a, b = ctx.Pipe()
        main_end, r0_end = ctx.Pipe()
        ctx.Process(target=rank1, args=(b,), daemon=False).start()
        ctx.Process(target=rank0, args=(r0_end, a), daemon=False).start()
        print("[2026-12-01 10:00:00] mock sglang: TP=%d ranks started" % tp, flush=True)
        waiting, lock, nid = {}, threading.Lock(), [0]
        def collector():
            while True:
                rid, n = main_end.recv()
                with lock:
                    ev = waiting.pop(rid, None)
                if ev:
                    ev[1] = n; ev[0].set()
        threading.Thread(target=collector, daemon=True).start()
        class H(BaseHTTPRequestHandler):
            def log_message(self, *a): pass
            def do_GET(self):
                o = b"{}"; self.send_response(200); self.send_header("Content-Length", str(len(o))); self.end_headers(); self.wfile.write(o)
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n = body["sampling_params"]["max_new_tokens"]
                with lock:
                    nid[0] += 1; rid = nid[0]; ev = [threading.Event(), 0]; waiting[rid] = ev
                    main_end.send((rid, n))
                ev[0].wait(60)
                o = json.dumps({"text": "x", "meta_info": {"completion_tokens": ev[1]}}).encode()
                self.send_response(200); self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(o))); self.end_headers(); self.wfile.write(o)
        time.sleep(3600 if FAULT == "nohealth" else 1)
        # a listen backlog like a real server's: the stdlib default of 5 resets connections when
        # 32 clients connect at once on a loaded 2-core machine
        ThreadingHTTPServer.request_queue_size = 128
        ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


def _free_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _dry_run(tmp_path, limit=150, target=3000, fault="", extra=None):
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / ".installed").write_text("")
    (site / "sglang" / "__init__.py").write_text("")
    (site / "sglang" / "launch_server.py").write_text(MOCK)
    m = tmp_path / "m" / "draft_agree"
    m.mkdir(parents=True)
    (m / "config.json").write_text("{}")
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), LIMIT=str(limit), TARGET=str(target), MIN_DECISIONS="2500",
               LEVELS="1,4,16,32", PERIOD="0.1", PORT=str(_free_port()), RUNDIR=str(tmp_path / "run"),
               SITE=str(site), SP=str(tmp_path / "sp"), M=str(tmp_path / "m"), MOCK_FAULT=fault,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.update(extra or {})
    env.pop("PYTHONPATH", None)
    t = time.time()
    r = subprocess.run(["bash", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=limit + 300)
    took = time.time() - t
    files = sorted(os.listdir(out))
    msg = f"rc={r.returncode} took={took:.0f}s files={files}\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    # nothing of the stand-in survives the script (a SIGKILLed process may take a moment to vanish)
    deadline = time.monotonic() + 30
    while True:
        ps = subprocess.run(["pgrep", "-f", f"launch_server --host 127.0.0.1 --port {env['PORT']}"],
                            capture_output=True, text=True).stdout.split()
        if not ps or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert ps == [], (ps, msg)
    s = json.load(open(out / "summary.json")) if (out / "summary.json").exists() else None
    return r, out, files, s, msg


OUT_FILES = sorted(["tp2.log", "summary.json", "decisions-rank0.txt", "decisions-rank1.txt", "server.log",
                    "client.json", "extra.tar.xz"])


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_dry_run_against_a_cpu_tp2_standin(tmp_path):
    r, out, files, s, msg = _dry_run(tmp_path)
    assert r.returncode == 0, msg
    assert files == OUT_FILES, msg
    v = s["verdict"]
    assert v["ok"] and v["identical"] and v["decisions_compared"] >= 2500, msg
    assert v["versions_applied"] >= 5 and s["rank0_decisions"]["table_mismatches"] == 0
    assert s["telemetry"]["frames"] > 0 and s["telemetry"]["ranks"] == [0]
    assert s["client"]["stopped_because"] == "target" and s["client"]["errors"] == 0
    assert len(json.load(open(out / "client.json"))["levels"]) >= 2  # concurrency varied
    assert s["tp_log"]["counts"]["engine_ready"] == {"0": 1, "1": 1}
    assert s["tp_log"]["in_force_lines"]["identical"] and s["tp_log"]["in_force_lines"]["compared"] >= 5
    import tarfile

    with tarfile.open(out / "extra.tar.xz") as tf:
        assert {"telemetry.jsonl", "published.jsonl"} <= set(tf.getnames())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_dry_run_with_the_tree_state(tmp_path):
    r, out, files, s, msg = _dry_run(tmp_path, extra={"TP2_TREE": "1"})
    assert r.returncode == 0, msg
    assert files == sorted(OUT_FILES + ["adaptive.json"]), msg
    cfg = json.load(open(out / "adaptive.json"))
    assert cfg["specctl"] == {"states": {"2": [2, 4, 16]}} and cfg["1"]["candidate_steps"] == [0, 1, 2, 3]
    v = s["verdict"]
    assert v["ok"] and v["identical"] and s["rank0_decisions"]["table_mismatches"] == 0, msg
    assert "2" in s["rank0_decisions"]["steps_histogram"], msg  # the tree was chosen
    assert "--page-size 1" in open(out / "tp2.log").read()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_dry_run_diverging_ranks_fail(tmp_path):
    r, out, files, s, msg = _dry_run(tmp_path, fault="diverge")
    assert r.returncode == 1, msg
    assert not s["verdict"]["identical"] and s["compare"]["first_mismatch"]["index"] == 16, msg


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_dry_run_server_dies_at_start(tmp_path):
    r, out, files, s, msg = _dry_run(tmp_path, fault="die")
    assert r.returncode == 1 and "server NOT ready" in r.stdout and "mock failure at start" in r.stdout, msg
    assert s["client"]["server_died"] and not s["verdict"]["ok"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_dry_run_never_ready_ends_within_limit(tmp_path):
    r, out, files, s, msg = _dry_run(tmp_path, limit=98, fault="nohealth")
    # it waited for /health until its deadline (LIMIT - 90 s after the start), then gave up
    done = [ln for ln in open(out / "tp2.log") if "] driver done" in ln]
    assert done and int(done[0][1:done[0].index("s]")]) >= 98 - 90, msg
    assert r.returncode == 1 and "server NOT ready" in r.stdout, msg
    assert s["client"]["stopped_because"] == "not ready"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_dry_run_hang_mid_run_is_reported(tmp_path):
    r, out, files, s, msg = _dry_run(tmp_path, fault="stall", extra={"TP2_REQ_TIMEOUT": "3"})
    assert r.returncode == 1, msg
    assert s["client"]["stopped_because"] == "timeouts (hang?)" and s["client"]["timeouts"] > 0, msg
    assert {"no_hang", "no_request_errors"} <= set(s["verdict"]["failed_checks"])
