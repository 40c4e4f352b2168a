"""run_bench --log-gc: SGLang's GC log lines (SGLANG_LOG_GC=1) -> the collections in a measurement window."""
import gc
import importlib.util
import io
import logging
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import benchlib as B  # noqa: E402

LINES = """[2026-12-07 20:00:00] GC start: Time 1765137600.1 | Generation 0
[2026-12-07 20:00:00] GC end: Time 1765137600.1012 | Generation 0 | Duration: 0.0012s | Collected: 3 | Uncollectable: 0 
[2026-12-07 20:00:00] Decode batch, #running-req: 64, #token: 9000, accept len: 1.00, gen throughput (token/s): 5000.00
[2026-12-07 20:00:01] GC end: Time 1765137601.2 | Generation 0 | Duration: 0.0003s | Collected: 0 | Uncollectable: 0 
[2026-12-07 20:00:02] GC end: Time 1765137602.3 | Generation 2 | Duration: 0.1250s | Collected: 812 | Uncollectable: 0 (LONG GC)
"""


def test_gc_summary_adds_up_each_generation_and_the_share_of_the_window():
    s = B.gc_summary(LINES, wall_s=2.0)
    assert s["gen0"] == {"n": 2, "ms": 1.5, "max_ms": 1.2}
    assert s["gen2"] == {"n": 1, "ms": 125.0, "max_ms": 125.0}
    assert "gen1" not in s and s["ms"] == 126.5 and s["ms_per_s"] == pytest.approx(63.25)
    assert "ms_per_s" not in B.gc_summary(LINES)


def test_gc_summary_is_none_without_gc_lines():
    assert B.gc_summary("Decode batch, #running-req: 1, accept len: 1.00, gen throughput (token/s): 90.00\n") is None
    assert B.gc_summary("GC start: Time 1.0 | Generation 0\n") is None  # a collection still running: no end


def test_gc_lines_leave_the_decode_step_parser_alone():
    r = B.parse_decode_lines(LINES + LINES.replace("20:00:0", "20:00:1"))
    assert r["n_lines"] == 1  # the first window is dropped; GC lines are neither decode nor prefill lines


@pytest.mark.sglang
@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="needs the sglang modules: `make test` runs it under each release's CPU environment")
def test_gc_summary_reads_what_sglang_logs():
    """SGLang's own GC logger (what SGLANG_LOG_GC=1 installs in the scheduler), on real collections."""
    from sglang.srt.utils import common  # installed: it must import
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    log = logging.getLogger(common.__name__)
    log.addHandler(handler)
    old_level, n_callbacks = log.level, len(gc.callbacks)
    log.setLevel(logging.INFO)
    try:
        common.configure_gc_logger()
        assert len(gc.callbacks) == n_callbacks + 1
        gc.collect(0)
        gc.collect(2)
    finally:
        del gc.callbacks[n_callbacks:]
        log.removeHandler(handler)
        log.setLevel(old_level)
    s = B.gc_summary(buf.getvalue(), wall_s=1.0)
    assert s is not None and s["gen0"]["n"] >= 1 and s["gen2"]["n"] >= 1, buf.getvalue()
    assert s["ms"] >= 0.0 and s["ms_per_s"] == s["ms"]


def test_freezegc_and_log_gc_run_against_the_stand_in(tmp_path, bench_prompts, port0):
    """--log-gc starts every server with SGLANG_LOG_GC=1 and counts the collections in each measured window;
    +freezegc posts /freeze_gc once the server is warm and keeps what its scheduler froze; such a server measures
    no cost-profile configuration (the freeze is not the build's)."""
    import json
    import subprocess

    pytest.importorskip("aiohttp")
    gpu = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu")
    out = tmp_path / "rb"
    env = dict(os.environ, PYTHONPATH=os.path.join(gpu, "mock") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.join(gpu, "run_bench.py"), "--model", str(tmp_path), "--variant", "mock",
           "--draft", "/d", "--policies", "off,off+freezegc", "--levels", "4,16", "--new-tokens", "400",
           "--req-per-level", "max(2*c,4)", "--interleave", "--repeats", "2", "--identity-c", "4",
           "--identity-tokens", "8", "--parallel", "2", "--deadline-s", "200", "--out", str(out),
           "--prompts", bench_prompts, "--tokenizer", "simple", "--specctl-site", str(tmp_path / "site"),
           "--port0", port0, "--log-gc"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bench = json.load(open(out / "bench-mock.json"))
    frozen = bench["servers"]["off+freezegc"]["gc_frozen"]
    assert set(frozen) == {"gen0", "gen1", "gen2"} and frozen["gen2"] > 1000, frozen  # an interpreter's objects
    assert "gc_frozen" not in bench["servers"]["off"]
    rows = bench["runs"]
    assert {row["policy"] for row in rows} == {"off", "off+freezegc"}
    assert all("gc" in row and len(row["repeats_gc_ms_per_s"]) == 2 for row in rows)
    # the stand-in leaves cyclic garbage every step: the windows hold its collections (a window without one has None)
    seen = [row["gc"] for row in rows if row["gc"] is not None]
    assert seen and sum(g["gen0"]["n"] for g in seen if "gen0" in g) >= 1, [r["gc"] for r in rows]
    assert all(g["ms"] == round(sum(v["ms"] for k, v in g.items() if k.startswith("gen")), 1) for g in seen)
    assert B.path_config("off+freezegc", 16) is None and B.path_config("off", 16) == ("nospec", "off")
    # the record keeps every window's collections and what each frozen server froze
    import offpath_results as O

    rec = O.build([bench], ["stand-in"])
    (g,) = rec["gc"]
    assert g["frozen"] == {"off+freezegc": frozen}
    assert sorted((x["policy"], x["concurrency"]) for x in g["runs"]) == [
        ("no-spec", 4), ("no-spec", 16), ("off+freezegc", 4), ("off+freezegc", 16)]
    assert all(len(x["gc_ms_per_s"]) == 2 for x in g["runs"])
