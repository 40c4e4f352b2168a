"""run_bench --log-gc: SGLang's GC log lines (SGLANG_LOG_GC=1) -> the collections in a measurement window."""
import gc
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
def test_gc_summary_reads_what_sglang_logs():
    """SGLang's own GC logger (what SGLANG_LOG_GC=1 installs in the scheduler), on real collections."""
    from sglang.srt.utils import common  # marked sglang: only the sglang environments run it, where it must import
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
