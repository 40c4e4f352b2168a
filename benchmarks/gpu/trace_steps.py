"""Reduce a torch-profiler chrome trace of an SGLang server to what one decode step costs, where (THERE: a
trace is tens of MB, its reduction a few KB):

  python3 benchmarks/gpu/trace_steps.py TRACE.json[.gz] OUT.json [--label L]

A step is the span from one target forward's `step[DECODE bs=N]` / `step[TARGET_VERIFY bs=N]` annotation
(SGLang's build_step_span_name, on the scheduler thread) to the next. Per step:
  - GPU: the window from the first GPU op launched inside target forward k to the first of k+1, the time the
    GPU was busy in it (union of kernel / memcpy / memset intervals) and idle, the number of GPU ops;
  - CPU (the scheduler thread): the wall between the two annotations, the time inside synchronising runtime
    calls (…Synchronize, blocking cudaMemcpy) and in the allocator's (cudaMalloc / cudaFree: torch's caching
    allocator could not serve a request, or emptied its cache to retry, which synchronises the device), kernel and
    graph launches;
  - where the scheduler's time goes: inclusive time per user annotation (scheduler.run_batch, draft_extend, …)
    and per CPU op name; the GPU's top kernels.
Steps whose window holds a prefill (an EXTEND annotation) are left out of the medians; `prefill_windows` says
what they cost: how many, their median wall, and their share of the profiled wall (where a server under churn —
requests ending and arriving, as in the phase workload — spends its time outside plain decode steps), and per
window (`rows`: one decode step and the prefill iteration after it) the prefill's extend spans — `[bs, tokens]`
each: the target's, then in an EAGLE server the draft's over the same prompts — with the GPU time of the work each
launched, the window's GPU busy and idle time, its synchronising and allocator calls and (per window, summed
over the windows) its CPU ops: what a prefill iteration costs each server, part by part.
A trace taken with stacks (SGLang's /start_profile with_stack: torch's Python tracer, `python_function` events)
also says where the scheduler thread's Python time goes over the kept steps: per function, its self time (less the
Python calls it made) and its inclusive time (its outermost call only, so recursion counts once), each per step,
over the calls that start and end inside one kept step; `prefill_windows` says the same per prefill window. The
tracer slows every call it sees, so such a profile's step times are not the server's: read its shares, not its
milliseconds.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import re
import statistics as st
from typing import Any

STEP_RE = re.compile(r"^step\[(\w+)(?: bs=(\d+))?")
TOKS_RE = re.compile(r"toks=(\d+)")
TARGET_MODES = ("DECODE", "TARGET_VERIFY")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
PY_CAT = "python_function"
ADDR_RE = re.compile(r" at 0x[0-9a-fA-F]+")


def _is_sync(name: str) -> bool:
    return "Synchronize" in name or name in ("cudaMemcpy", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2")


def _is_alloc(name: str) -> bool:
    """The CUDA allocator's calls into the runtime: what torch's caching allocator does when its cache cannot
    serve a request (cudaMalloc) or frees its cache to retry (cudaFree, which synchronises the device)."""
    return name.startswith(("cudaMalloc", "cudaFree", "cuMemAlloc", "cuMemFree", "cuMemCreate", "cuMemMap",
                            "cuMemUnmap", "cuMemRelease"))


def _is_launch(name: str) -> bool:
    return "LaunchKernel" in name or name.startswith("cuLaunch")


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1000.0


def _med(xs: list[float]) -> float | None:
    return round(st.median(xs), 4) if xs else None


def load(path: str) -> list[dict]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        tr = json.load(f)
    return tr["traceEvents"] if isinstance(tr, dict) else tr


def runtime_figures(calls: list[dict], by_name: bool = False) -> dict[str, Any]:
    """What the scheduler thread's runtime calls in one window cost: time in synchronising calls, in the
    allocator's calls (and how many; `by_name`: also per call name, for the windows a reduction lists)."""
    alloc = [e for e in calls if _is_alloc(e["name"])]
    out = {"sync_ms": round(sum(e["dur"] for e in calls if _is_sync(e["name"])) / 1000.0, 4),
           "alloc_ms": round(sum(e["dur"] for e in alloc) / 1000.0, 4), "alloc_calls": len(alloc)}
    if by_name:
        out["alloc_by_name"] = dict(collections.Counter(e["name"] for e in alloc))
    return out


def summarize_prefill_rows(pre_rows: list[dict]) -> dict[str, Any]:
    """Medians over a profile's prefill windows (`prefill_windows.rows`): the window's GPU time, the scheduler's
    time in synchronising and allocator calls, and per prefill the target's and (EAGLE) the draft's extend."""
    pw: dict[str, Any] = {}
    for key in ("gpu_window_ms", "gpu_busy_ms", "gpu_idle_ms", "sync_ms", "alloc_ms", "alloc_calls"):
        pw[key + "_median"] = _med([r[key] for r in pre_rows if key in r])
    # in an EAGLE server each prefill is two extend spans over the same [bs, tokens]: the target's, then the
    # draft's, inside SGLang's `draft_extend` span (`extend_kinds`); in a no-spec server two spans in a window are two
    # prefills. Rows without kinds (reduced before they were kept) pair spans of one shape
    tgt_gpu, tgt_cpu, dr_gpu, dr_cpu = [], [], [], []
    for r in pre_rows:
        if "extend_kinds" in r:
            for kind, g, c in zip(r["extend_kinds"], r["extend_gpu_ms"], r["extend_cpu_ms"]):
                (dr_gpu if kind == "draft" else tgt_gpu).append(g)
                (dr_cpu if kind == "draft" else tgt_cpu).append(c)
            continue
        ex, i = r["extends"], 0
        while i < len(ex):
            tgt_gpu.append(r["extend_gpu_ms"][i])
            tgt_cpu.append(r["extend_cpu_ms"][i])
            if i + 1 < len(ex) and ex[i + 1] == ex[i]:
                dr_gpu.append(r["extend_gpu_ms"][i + 1])
                dr_cpu.append(r["extend_cpu_ms"][i + 1])
                i += 1
            i += 1
    pw.update(target_extend_gpu_ms_median=_med(tgt_gpu), target_extend_cpu_ms_median=_med(tgt_cpu))
    if dr_gpu:
        pw.update(draft_extend_gpu_ms_median=_med(dr_gpu), draft_extend_cpu_ms_median=_med(dr_cpu))
    toks = [r["extends"][0][1] for r in pre_rows if r["extends"] and r["extends"][0][1]]
    pw["prefill_tokens_median"] = _med(toks)  # of each window's first prefill
    pw["rows"] = pre_rows
    return pw


def python_functions(py: list[dict], windows: list[tuple[float, float]], top: int = 30) -> dict[str, Any]:
    """Self and inclusive time per Python function (ms per window) of one thread's `python_function` events,
    counting the calls that lie wholly inside one of `windows` (sorted (start, end) pairs, µs): the kept steps',
    or the prefill windows'."""
    starts = [w[0] for w in windows]

    def inside(e: dict) -> bool:
        i = bisect.bisect_right(starts, e["ts"]) - 1
        return i >= 0 and e["ts"] + e["dur"] <= windows[i][1]
    self_t: collections.Counter = collections.Counter()
    incl_t: collections.Counter = collections.Counter()
    calls = 0
    stack: list[tuple[float, str, bool]] = []  # the open calls: (end, name, counted)
    for e in sorted(py, key=lambda e: (e["ts"], -e["dur"])):
        end, name = e["ts"] + e["dur"], ADDR_RE.sub("", e.get("name", ""))[:110]
        while stack and stack[-1][0] <= e["ts"]:
            stack.pop()
        counted = inside(e)
        if counted:
            calls += 1
            self_t[name] += e["dur"]
            if name not in {n for _, n, _ in stack}:  # its outermost call: recursion counts once
                incl_t[name] += e["dur"]
            if stack and stack[-1][2] and end <= stack[-1][0]:
                self_t[stack[-1][1]] -= e["dur"]  # a call's time is not its caller's own
        stack.append((end, name, counted))
    n = max(len(windows), 1)
    return {"python_calls_per_step": round(calls / n, 1),
            "python_self_ms_per_step": {k: round(v / 1000.0 / n, 4) for k, v in self_t.most_common(top)},
            "python_inclusive_ms_per_step": {k: round(v / 1000.0 / n, 4) for k, v in incl_t.most_common(top)}}


def reduce_events(events: list[dict], label: str = "") -> dict[str, Any]:
    X = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    tkey = lambda e: (e.get("pid"), e.get("tid"))  # noqa: E731
    ann = [e for e in X if e.get("cat") == "user_annotation"]
    steps = [e for e in ann if STEP_RE.match(e.get("name", ""))]
    target = [e for e in steps if STEP_RE.match(e["name"]).group(1) in TARGET_MODES]
    res: dict[str, Any] = {"label": label, "events": len(events),
                           "step_spans": dict(collections.Counter(STEP_RE.match(e["name"]).group(0) + "]" for e in steps))}
    if len(target) < 2:
        res["error"] = "fewer than two target-forward step spans"
        return res
    sched = collections.Counter(tkey(e) for e in target).most_common(1)[0][0]
    target = sorted((e for e in target if tkey(e) == sched), key=lambda e: e["ts"])
    extend = sorted(e["ts"] for e in steps if tkey(e) == sched and STEP_RE.match(e["name"]).group(1) == "EXTEND")
    rt = sorted((e for e in X if e.get("cat") in RUNTIME_CATS and tkey(e) == sched), key=lambda e: e["ts"])
    rt_ts = [e["ts"] for e in rt]
    gpu = sorted((e for e in X if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    gpu_by_corr: dict = {}
    ops_by_corr: dict = collections.defaultdict(list)  # a graph launch's kernels share its correlation id
    for g in gpu:
        cid = (g.get("args") or {}).get("correlation")
        if cid is not None:
            gpu_by_corr.setdefault(cid, g)
            ops_by_corr[cid].append(g)
    ext_spans = sorted((e for e in steps if tkey(e) == sched and STEP_RE.match(e["name"]).group(1) == "EXTEND"),
                       key=lambda e: e["ts"])

    def launched_gpu_ms(span: dict) -> float:
        """GPU busy time of everything launched from inside a CPU span (kernels of replayed graphs included)."""
        a, b = bisect.bisect_left(rt_ts, span["ts"]), bisect.bisect_right(rt_ts, span["ts"] + span["dur"])
        ops = [g for e in rt[a:b] for g in ops_by_corr.get((e.get("args") or {}).get("correlation"), ())]
        return _union_ms([(g["ts"], g["ts"] + g["dur"]) for g in ops])
    # the GPU anchor of each target forward: the first GPU op launched from inside its span
    anchors = []
    for s in target:
        a, b = bisect.bisect_left(rt_ts, s["ts"]), bisect.bisect_right(rt_ts, s["ts"] + s["dur"])
        starts = [gpu_by_corr[c]["ts"] for c in ((e.get("args") or {}).get("correlation") for e in rt[a:b])
                  if c in gpu_by_corr]
        anchors.append(min(starts) if starts else None)
    gpu_ts = [g["ts"] for g in gpu]
    ann_s = [e for e in ann if tkey(e) == sched and not STEP_RE.match(e["name"])]
    # SGLang's spec_stage_span("draft_extend"): a forward inside one is the draft's (its prefill extend included)
    draft_spans = [(e["ts"], e["ts"] + e["dur"]) for e in ann_s if e["name"] == "draft_extend"]
    cpu_ops = [e for e in X if e.get("cat") == "cpu_op" and tkey(e) == sched]
    rows, skipped, pre_ms, pre_rows = [], 0, [], []
    by_ann: collections.Counter = collections.Counter()
    by_op: collections.Counter = collections.Counter()
    by_kernel: collections.Counter = collections.Counter()
    by_op_pre: collections.Counter = collections.Counter()  # the CPU ops of the prefill windows
    for k in range(len(target) - 1):
        c0, c1 = target[k]["ts"], target[k + 1]["ts"]
        if bisect.bisect_right(extend, c1) - bisect.bisect_left(extend, c0):
            skipped += 1
            pre_ms.append((c1 - c0) / 1000.0)
            spans = [e for e in ext_spans if c0 <= e["ts"] < c1]
            pr: dict[str, Any] = {
                "decode_bs": int(STEP_RE.match(target[k]["name"]).group(2) or 0),
                "extends": [[int(STEP_RE.match(e["name"]).group(2) or 0),
                             int(m.group(1)) if (m := TOKS_RE.search(e["name"])) else None] for e in spans],
                "extend_gpu_ms": [round(launched_gpu_ms(e), 4) for e in spans],
                "extend_cpu_ms": [round(e["dur"] / 1000.0, 4) for e in spans],
                "extend_kinds": ["draft" if any(a <= e["ts"] and e["ts"] + e["dur"] <= b for a, b in draft_spans)
                                 else "target" for e in spans],
                "cpu_window_ms": round((c1 - c0) / 1000.0, 4)}
            a, b = bisect.bisect_left(rt_ts, c0), bisect.bisect_left(rt_ts, c1)
            pr.update(runtime_figures(rt[a:b], by_name=True))
            g0, g1 = anchors[k], anchors[k + 1]
            if g0 is not None and g1 is not None and g1 > g0:
                i, j = bisect.bisect_left(gpu_ts, g0), bisect.bisect_left(gpu_ts, g1)
                busy = _union_ms([(g["ts"], min(g["ts"] + g["dur"], g1)) for g in gpu[i:j]])
                pr.update(gpu_window_ms=round((g1 - g0) / 1000.0, 4), gpu_busy_ms=round(busy, 4),
                          gpu_idle_ms=round((g1 - g0) / 1000.0 - busy, 4))
            pr["c0"], pr["c1"] = c0, c1
            pre_rows.append(pr)
            for e in cpu_ops:
                if c0 <= e["ts"] < c1:
                    by_op_pre[e["name"][:60]] += e["dur"]
            continue
        row: dict[str, Any] = {"bs": int(STEP_RE.match(target[k]["name"]).group(2) or 0),
                               "cpu_window_ms": (c1 - c0) / 1000.0, "c0": c0, "c1": c1}
        a, b = bisect.bisect_left(rt_ts, c0), bisect.bisect_left(rt_ts, c1)
        calls = rt[a:b]
        row.update(runtime_figures(calls))
        row["kernel_launches"] = sum(1 for e in calls if _is_launch(e["name"]))
        row["graph_launches"] = sum(1 for e in calls if "GraphLaunch" in e["name"])
        row["runtime_calls"] = len(calls)
        g0, g1 = anchors[k], anchors[k + 1]
        if g0 is not None and g1 is not None and g1 > g0:
            i, j = bisect.bisect_left(gpu_ts, g0), bisect.bisect_left(gpu_ts, g1)
            ops = gpu[i:j]
            busy = _union_ms([(g["ts"], min(g["ts"] + g["dur"], g1)) for g in ops])
            row.update(gpu_window_ms=(g1 - g0) / 1000.0, gpu_busy_ms=busy, gpu_idle_ms=(g1 - g0) / 1000.0 - busy,
                       gpu_ops=len(ops))
            for g in ops:
                by_kernel[g["name"][:90]] += g["dur"]
        row_ann: collections.Counter = collections.Counter()
        for e in ann_s:
            if c0 <= e["ts"] < c1:
                row_ann[e["name"][:60]] += e["dur"]
        by_ann.update(row_ann)
        row["ann"] = row_ann
        for e in cpu_ops:
            if c0 <= e["ts"] < c1:
                by_op[e["name"][:60]] += e["dur"]
        rows.append(row)
    n = len(rows)
    res.update(steps=n, skipped_for_prefill=skipped, scheduler_thread=list(sched))
    wall = (target[-1]["ts"] - target[0]["ts"]) / 1000.0
    res["prefill_windows"] = {"n": skipped, "cpu_window_ms_median": _med(pre_ms),
                              "share_of_wall": round(sum(pre_ms) / wall, 4) if wall > 0 else None,
                              "wall_ms": round(wall, 3)}
    py = [e for e in X if e.get("cat") == PY_CAT and tkey(e) == sched]
    if pre_rows:
        res["prefill_windows"].update(summarize_prefill_rows([{k: v for k, v in r.items() if k not in ("c0", "c1")}
                                                              for r in pre_rows]))
        res["prefill_windows"]["cpu_ops_ms_per_window"] = {k: round(v / 1000.0 / len(pre_rows), 4)
                                                           for k, v in by_op_pre.most_common(15)}
        if py:  # a profile with stacks: the prefill windows' Python time, per window
            res["prefill_windows"].update(python_functions(py, sorted((r["c0"], r["c1"]) for r in pre_rows)))
    if not n:
        res["error"] = "no step without a prefill"
        return res
    keys = ("cpu_window_ms", "gpu_window_ms", "gpu_busy_ms", "gpu_idle_ms", "sync_ms", "alloc_ms", "alloc_calls",
            "gpu_ops", "kernel_launches", "graph_launches", "runtime_calls")
    res["median"] = {k: _med([r[k] for r in rows if k in r]) for k in keys}
    res["batch_sizes"] = dict(collections.Counter(r["bs"] for r in rows))
    res["cpu_annotations_ms_per_step"] = {k: round(v / 1000.0 / n, 4) for k, v in by_ann.most_common(12)}
    # the same per window, as medians: one outlier window (a first-use compile, a GC pass) moves the means above
    # by its whole length / n (2026-12-03: one 127.7 ms window of 16 put ~7 ms a step into two annotations)
    res["cpu_annotations_ms_median"] = {k: round(_med([r["ann"].get(k, 0) for r in rows]) / 1000.0, 4)
                                        for k, _ in by_ann.most_common(12)}
    res["cpu_ops_ms_per_step"] = {k: round(v / 1000.0 / n, 4) for k, v in by_op.most_common(15)}
    res["gpu_kernels_ms_per_step"] = {k: round(v / 1000.0 / n, 4) for k, v in by_kernel.most_common(12)}
    res["per_step_gpu_window_ms"] = [round(r.get("gpu_window_ms", 0.0), 3) for r in rows]
    if py:  # a profile with stacks: the kept steps' Python time (the prefill windows' is above)
        res.update(python_functions(py, sorted((r["c0"], r["c1"]) for r in rows)))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    res = reduce_events(load(a.trace), a.label or a.trace)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res.get(k) for k in ("label", "steps", "median", "error") if k in res}))


if __name__ == "__main__":
    main()
