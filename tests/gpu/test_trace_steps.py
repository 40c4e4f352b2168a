"""trace_steps.py: a torch-profiler trace reduced to what one decode step costs (GPU busy and idle, the
scheduler thread's syncs and launches), on a hand-made trace whose answer is known."""
import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import trace_steps as T  # noqa: E402

S = {"pid": 1, "tid": 7}  # the scheduler thread


def _x(cat, name, ts, dur, corr=None, where=S):
    e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **where}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _gpu(name, ts, dur, corr):
    return _x("kernel", name, ts, dur, corr, {"pid": 0, "tid": 9})


def _trace():
    ev = []
    for k, t in enumerate((0, 10000, 20000, 30000)):
        ev.append(_x("user_annotation", "step[DECODE bs=4]", t, 1000))
    ev += [_x("cuda_runtime", "cudaLaunchKernel", 100, 5, 1), _gpu("attn", 500, 3000, 1),
           _x("cuda_runtime", "cudaLaunchKernel", 200, 5, 2), _gpu("mlp", 3600, 1000, 2),
           _x("cuda_runtime", "cudaStreamSynchronize", 5000, 2000),
           _x("user_annotation", "scheduler.run_batch", 50, 4000), _x("cpu_op", "aten::to", 300, 700),
           _x("cuda_runtime", "cudaLaunchKernel", 10100, 5, 3), _gpu("attn", 10500, 4000, 3),
           _x("cuda_runtime", "cudaGraphLaunch", 10200, 5, 4), _gpu("graph_kernel", 14600, 500, 4),
           _x("user_annotation", "scheduler.run_batch", 10050, 3000),
           _x("cuda_runtime", "cudaLaunchKernel", 20100, 5, 5), _gpu("attn", 20500, 1000, 5),
           _x("user_annotation", "step[EXTEND bs=1 toks=100]", 25000, 500),
           _x("cuda_runtime", "cudaGraphLaunch", 25100, 5, 7), _gpu("prefill_a", 25200, 2000, 7),
           _gpu("prefill_b", 27000, 1000, 7),  # one graph: two kernels, overlapping by 0.2 ms
           _x("user_annotation", "draft_extend", 25950, 450),  # SGLang's spec_stage_span around the draft's forward
           _x("user_annotation", "step[EXTEND bs=1 toks=100]", 26000, 300),  # the draft's extend
           _x("cuda_runtime", "cudaLaunchKernel", 26100, 5, 8), _gpu("draft", 28500, 500, 8),
           _x("cuda_runtime", "cudaLaunchKernel", 30100, 5, 6), _gpu("attn", 30500, 1000, 6),
           _x("user_annotation", "step[DECODE bs=4]", 40000, 100, where={"pid": 1, "tid": 8})]  # another thread
    return ev


def _with_allocator(ev):
    """The known trace, plus the caching allocator going to the runtime: once in kept step 0, twice (a malloc,
    and a free that syncs the device) and an op in the prefill window."""
    return ev + [_x("cuda_runtime", "cudaMalloc", 4000, 100), _x("cuda_runtime", "cudaMalloc", 25050, 300),
                 _x("cuda_runtime", "cudaFree", 26050, 1200), _x("cpu_op", "aten::empty", 25060, 400)]


def test_a_known_trace_reduces_to_its_figures():
    r = T.reduce_events(_trace(), "known")
    assert r["steps"] == 2 and r["skipped_for_prefill"] == 1 and r["scheduler_thread"] == [1, 7]
    m = r["median"]
    assert m["cpu_window_ms"] == 10.0 and m["gpu_window_ms"] == 10.0
    assert m["gpu_busy_ms"] == pytest.approx(4.25) and m["gpu_idle_ms"] == pytest.approx(5.75)
    assert m["sync_ms"] == pytest.approx(1.0)  # 2 ms in step 0, none in step 1
    assert m["kernel_launches"] == 1.5 and m["graph_launches"] == 0.5 and m["gpu_ops"] == 2
    assert r["cpu_annotations_ms_per_step"] == {"scheduler.run_batch": 3.5}
    assert r["cpu_annotations_ms_median"] == {"scheduler.run_batch": 3.5}
    assert r["cpu_ops_ms_per_step"] == {"aten::to": 0.35}
    assert r["gpu_kernels_ms_per_step"]["attn"] == pytest.approx(3.5)
    assert r["batch_sizes"] == {4: 2} and r["per_step_gpu_window_ms"] == [10.0, 10.0]
    # the window holding the prefill (20 -> 30 ms) is one of three between the four steps: 10 of 30 ms
    pw = r["prefill_windows"]
    assert {k: pw[k] for k in ("n", "cpu_window_ms_median", "wall_ms")} == {"n": 1, "cpu_window_ms_median": 10.0,
                                                                          "wall_ms": 30.0}
    assert pw["share_of_wall"] == pytest.approx(1 / 3, abs=1e-4)
    # that window: decode step 2's attn (20.5-21.5 ms), the target's prefill graph (25.2-28.0) and the draft's
    # extend (28.5-29.0) up to step 3's first GPU op at 30.5: busy 1 + 2.8 + 0.5 of 10 ms
    assert pw["rows"] == [{"decode_bs": 4, "extends": [[1, 100], [1, 100]], "extend_gpu_ms": [2.8, 0.5],
                           "extend_cpu_ms": [0.5, 0.3], "extend_kinds": ["target", "draft"], "cpu_window_ms": 10.0, "sync_ms": 0.0, "alloc_ms": 0.0,
                           "alloc_calls": 0, "alloc_by_name": {}, "gpu_window_ms": 10.0,
                           "gpu_busy_ms": 4.3, "gpu_idle_ms": 5.7}]
    assert pw["target_extend_gpu_ms_median"] == 2.8 and pw["draft_extend_gpu_ms_median"] == 0.5
    assert pw["gpu_busy_ms_median"] == 4.3 and pw["prefill_tokens_median"] == 100
    assert m["alloc_ms"] == 0.0 and pw["alloc_calls_median"] == 0 and pw["cpu_ops_ms_per_window"] == {}


def test_the_allocators_runtime_calls_are_counted_per_window():
    """Where a window's CPU time goes when torch's caching allocator has to call the runtime (a cudaFree to
    retry syncs the device): per prefill window and in the kept steps' medians."""
    r = T.reduce_events(_with_allocator(_trace()), "alloc")
    assert r["median"]["alloc_ms"] == pytest.approx(0.05) and r["median"]["alloc_calls"] == 0.5
    pw = r["prefill_windows"]
    row = pw["rows"][0]
    assert (row["alloc_ms"], row["alloc_calls"]) == (1.5, 2)
    assert row["alloc_by_name"] == {"cudaMalloc": 1, "cudaFree": 1}
    assert pw["alloc_ms_median"] == 1.5 and pw["alloc_calls_median"] == 2
    assert pw["cpu_ops_ms_per_window"] == {"aten::empty": 0.4}
    assert r["cpu_ops_ms_per_step"] == {"aten::to": 0.35}  # the prefill window's op is not a kept step's


def test_one_outlier_window_moves_the_annotation_means_not_the_medians():
    ev = []
    for k in range(5):
        t = k * 10000
        ev.append(_x("user_annotation", "step[DECODE bs=4]", t, 1000))
        ev += [_x("cuda_runtime", "cudaLaunchKernel", t + 100, 5, k), _gpu("attn", t + 500, 3000, k)]
        if k < 4:  # windows 0..3: run_batch 3 ms, except 100 ms in window 2 (a first-use compile, a GC pass)
            ev.append(_x("user_annotation", "scheduler.run_batch", t + 50, 100000 if k == 2 else 3000))
    r = T.reduce_events(ev)
    assert r["steps"] == 4
    assert r["cpu_annotations_ms_per_step"] == {"scheduler.run_batch": 27.25}
    assert r["cpu_annotations_ms_median"] == {"scheduler.run_batch": 3.0}


def test_overlapping_gpu_ops_count_once():
    assert T._union_ms([(0, 1000), (500, 1500), (3000, 3500)]) == pytest.approx(2.0)
    assert T._union_ms([]) == 0.0


def test_a_trace_without_target_steps_says_so(tmp_path):
    p = tmp_path / "t.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump({"traceEvents": [_x("user_annotation", "step[EXTEND bs=1 toks=5]", 0, 10)]}, f)
    r = T.reduce_events(T.load(str(p)))
    assert "error" in r and r["step_spans"] == {"step[EXTEND bs=1]": 1}  # spans are counted by mode and batch


def _no_spec_two_prefills(second, second_gpu_us):
    """Three decode steps of a no-spec server, the window between the second and third holding two prefills: a
    3 ms one of [1, 50], then `second` ("bs=B toks=T") taking second_gpu_us on the GPU; no draft_extend span."""
    ev = []
    for k, t in enumerate((0, 10000, 40000)):
        ev += [_x("user_annotation", "step[DECODE bs=4]", t, 1000), _x("cuda_runtime", "cudaLaunchKernel", t + 100, 5, k),
               _gpu("attn", t + 500, 1000, k)]
    ev += [_x("user_annotation", "step[EXTEND bs=1 toks=50]", 12000, 2000),
           _x("cuda_runtime", "cudaGraphLaunch", 12100, 5, 10), _gpu("prefill", 12500, 3000, 10),
           _x("user_annotation", f"step[EXTEND {second}]", 20000, 2000),
           _x("cuda_runtime", "cudaGraphLaunch", 20100, 5, 11), _gpu("prefill", 20500, second_gpu_us, 11)]
    return T.reduce_events(ev)["prefill_windows"]


def test_two_prefills_of_a_no_spec_server_are_two_targets_not_a_target_and_a_draft():
    pw = _no_spec_two_prefills("bs=2 toks=300", 9000)
    assert pw["rows"][0]["extends"] == [[1, 50], [2, 300]] and pw["rows"][0]["extend_gpu_ms"] == [3.0, 9.0]
    assert pw["target_extend_gpu_ms_median"] == 6.0 and "draft_extend_gpu_ms_median" not in pw
    assert pw["prefill_tokens_median"] == 50


def test_two_prefills_of_one_shape_in_a_no_spec_server_are_two_targets():
    """Without SGLang's draft_extend span around the second, two extends of one shape are two prefills."""
    pw = _no_spec_two_prefills("bs=1 toks=50", 5000)
    assert pw["rows"][0]["extend_kinds"] == ["target", "target"]
    assert pw["target_extend_gpu_ms_median"] == 4.0 and "draft_extend_gpu_ms_median" not in pw
    # a row reduced before kinds were kept still pairs one shape as target and draft
    old = {k: v for k, v in pw["rows"][0].items() if k != "extend_kinds"}
    assert T.summarize_prefill_rows([old])["draft_extend_gpu_ms_median"] == 5.0


def _py(name, ts, dur, where=S):
    return _x("python_function", name, ts, dur, where=where)


def test_a_stack_profile_says_where_the_python_time_goes():
    """Kept steps 0-10 and 10-20 ms (20-30 holds a prefill). Each kept step: verify (4 ms) calls prepare (1 ms),
    which calls a built-in (0.2 ms, its address differs per call), then verify calls itself (1 ms, recursion);
    the event loop spans every step and counts in neither figure; the prefill window's calls count in its own."""
    ev = _trace()
    ev.append(_py("scheduler.py(10): event_loop", 0, 40000))
    for t in (0, 10000, 20000):
        ev += [_py("worker.py(5): verify", t + 1000, 4000), _py("worker.py(9): prepare", t + 1500, 1000),
               _py(f"<built-in method item of Tensor object at 0x7f{t:04x}>", t + 1600, 200),
               _py("worker.py(5): verify", t + 3000, 1000)]
    ev.append(_py("worker.py(5): verify", 1000, 500, where={"pid": 1, "tid": 8}))  # another thread's call
    r = T.reduce_events(ev)
    assert r["steps"] == 2 and r["python_calls_per_step"] == 4.0
    assert r["python_self_ms_per_step"] == {"worker.py(5): verify": 4.0 - 1.0, "worker.py(9): prepare": 0.8,
                                            "<built-in method item of Tensor object>": 0.2}
    assert r["python_inclusive_ms_per_step"] == {"worker.py(5): verify": 4.0, "worker.py(9): prepare": 1.0,
                                                 "<built-in method item of Tensor object>": 0.2}
    pw = r["prefill_windows"]  # the window holding the prefill: the same calls, per window
    assert pw["python_calls_per_step"] == 4.0 and pw["python_self_ms_per_step"]["worker.py(5): verify"] == 3.0
    assert "rows" in pw and all("c0" not in row for row in pw["rows"])


def test_a_profile_without_stacks_has_no_python_figures():
    assert not [k for k in T.reduce_events(_trace()) if k.startswith("python")]


@pytest.mark.parametrize("spec", ["off@1:stacks", "off", "off@c1", "off@1:churn:bogus"])
def test_run_bench_refuses_a_profile_spec_it_cannot_read(spec):
    import subprocess
    rb = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu", "run_bench.py")
    r = subprocess.run([sys.executable, rb, "--model", "/nonexistent", "--variant", "x", "--draft", "/d", "--out",
                        "/nonexistent/out", "--policies", "off", "--profile", spec],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"--profile {spec!r}: expected POLICY@C" in r.stderr, r.stderr[-800:]
