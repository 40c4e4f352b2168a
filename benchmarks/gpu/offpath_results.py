"""The decode state's record (issue "plain decode at the speed of a server without speculation"), HERE, from
run_bench.py outputs of one or more device calls:

  python3 benchmarks/gpu/offpath_results.py OUT.json BENCH.json [BENCH.json ...] [--call "command" ...]
      [--logs DIR ...]   (a call's server logs, g0.tgz's g0/: step costs over the windows without a prefill)
      [--profiles DIR [--profile-name NAME]]   (issue "cheaper speculative steps", item 3: one simulator cost
      profile per server build, benchlib.path_profiles: NAME-<backend>-sglang.json, NAME-<backend>-specctl.json,
      and in OUT.json `path_profiles`: each build's break-even accept length against the no-spec server)

Reads the run_bench rows of these policies (any call may hold any of them):
  off                          -> no-spec                   (a server launched without speculation)
  plugin-fixed:1:s3            -> the decode state          (the plugin holding "off" at every batch size)
  plugin-fixed:1:s3+verify     -> SGLang's trivial verify   (the same, plain_decode=off)
  plugin-fixed:1:s3+deg        -> the decode state, each state's draft extend in its own graph (draft_graphs=on;
                                  the plugin's default since 2026-12-01: before that, plugin-fixed:1:s3 ran without it)
  plugin-fixed:1:s3+nodeg      -> the decode state with 0.5.17's launch-width draft-extend graphs (the control)
  plugin-fixed:1000:s3(+splitkv | +stockverify) -> s3 at every batch size with / without the split-KV verify kernel
                                  (issue "cheaper speculative steps": `splitkv`; before 2026-12-02 the plugin's
                                  default was the stock kernel, since then the split-KV one)
  static:sN, threshold:5:s3, sglang-adaptive, specctl       (sweep and phase rows, named as the issue names them)
and writes (benchlib.write_record: atomically, keeping a rebuilt OUT.json's "notes") step_costs (median of the
per-round Decode-batch step medians, per concurrency), sweep, phase_runs, identity (the decode state vs no-spec,
greedy), resync (threshold:5:s3 probes, with and without SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND), and targets
(each figure against the issue's bound).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics as st
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import (OFF, PIN_ALL, file_tag, iteration_gaps, logit_report, parse_config,  # noqa: E402
                      parse_decode_lines, parse_policy, path_config, path_profiles, prefill_batches,
                      prefill_window_cost, steps_after_prefill, telemetry_step_points, write_record)

NO_SPEC_POLICY, DECODE_STATE, TRIVIAL = "off", "plugin-fixed:1:s3", "plugin-fixed:1:s3+verify"
SKIP_DE = "+skipde"  # the decode state without the steps-0 draft extend (SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1)
DECODE_STATE_DEG = "plugin-fixed:1:s3+deg"  # the decode state with the steps-0 draft extend in its own graph
DECODE_STATE_NODEG = "plugin-fixed:1:s3+nodeg"  # ... and without (0.5.17's launch-width graphs)
DECODE_STATE_CATCHUP = "plugin-fixed:1:s3+catchup"  # ... with the steps-0 draft extends deferred (catchup=on: 16)
DECODE_STATE_CATCHUP4 = "plugin-fixed:1:s3+catchup4"  # ... once per 4 steps, through the s3 state's draft-extend graph
# the decode state's catch-up variants -> their columns' key
CATCHUP_KEYS = {DECODE_STATE_CATCHUP: "off_state_catchup", DECODE_STATE_CATCHUP4: "off_state_catchup4"}
STEP_POLICIES = ("off", DECODE_STATE, TRIVIAL, DECODE_STATE_DEG, DECODE_STATE_NODEG, *CATCHUP_KEYS)


def shipped(pol: str) -> str:
    """A policy as the plugin now ships it: +deg is the default (draft_graphs=on), so
    specctl+deg is specctl and plugin-fixed:5:s3+deg+skipde is plugin-fixed:5:s3+skipde."""
    return pol.replace("+deg", "")
RESYNC, RESYNC_SKIP = "plugin-fixed:5:s3", "plugin-fixed:5:s3+skipde"
RESYNC_CATCHUP = "plugin-fixed:5:s3+catchup"  # the resync probe with the steps-0 draft extends deferred
RESYNC_CATCHUPS = {RESYNC_CATCHUP: "catchup", "plugin-fixed:5:s3+catchup4": "catchup4"}  # -> the fields' suffix


def step_name(pol: str) -> str:
    """A policy's name in the step-cost columns: +lp (log-probability steps in the decode state) changes
    nothing on the loads' steps, which ask for none; +fi (the decode state on flashinfer) is the decode state
    of a flashinfer call (the record's attention_backend); +hostlens (host_lens) is the decode state
    with its lengths kept on the host (the record's calls name it). Two policies of one call with one step name
    are refused (`folded_twice`). A pinned server's run under `off` (run_bench's pinned:C1/...@off) is the decode state
    of that server's build: plugin-fixed:1:s3 with the server's suffixes."""
    server, at, pin = pol.rpartition("@")
    if at and pin == "off" and server.startswith("pinned:"):
        suffix = server[server.index("+"):] if "+" in server else ""
        pol = DECODE_STATE + suffix
    return re.sub(r"\+(lp|fi|hostlens)(?=\+|$)", "", pol)


def folded_twice(policies) -> dict[str, list[str]]:
    """Step names that more than one of these policies (one call's) would fill: their columns would overwrite."""
    by: dict[str, list[str]] = {}
    for p in sorted(set(policies)):
        by.setdefault(step_name(p), []).append(p)
    return {k: v for k, v in by.items() if len(v) > 1}


def issue_name(pol: str) -> str:
    """run_bench's policy -> the record's name (no-spec, static:sN, threshold:5:s3, sglang-adaptive, specctl)."""
    if pol == "off":
        return "no-spec"
    p = parse_policy(pol)
    if p["kind"] == "plugin-fixed" and pol.startswith("plugin-fixed:5:"):
        return pol.replace("plugin-fixed:", "threshold:")  # the same threshold, decided by the plugin
    return pol


S3_STOCK, S3_SPLITKV = "plugin-fixed:1000:s3", "plugin-fixed:1000:s3+splitkv"
S3_STOCK_NOW = "plugin-fixed:1000:s3+stockverify"  # the stock kernel since the split-KV one is the default
S3_POLICIES = (S3_STOCK, S3_SPLITKV, S3_STOCK_NOW)


def kernel_rows(runs: list[dict]) -> list[dict]:
    """One call's runs that belong to the split-KV A/B (rec["splitkv"]): +splitkv and +stockverify always; the bare
    plugin-fixed:1000:s3 only beside +splitkv, where it was the stock control (the plugin's default kernel until
    2026-12-02). Alone it is the plugin's s3 with its default (split-KV) kernel: a sweep row like any static."""
    ab = any(r["policy"] == S3_SPLITKV for r in runs)
    return [r for r in runs if r["policy"] in (S3_SPLITKV, S3_STOCK_NOW) or (ab and r["policy"] == S3_STOCK)]


def _round_steps(row: dict) -> list[float]:
    """The step time (ms) of each round of a run_bench row: Decode-batch medians at exactly c requests, over
    the windows without a prefill where every round has some (run_bench since 2026-12-02), else over all."""
    clean = row.get("repeats_clean_step_ms")
    if clean and all(clean):
        return [float(x) for x in clean]
    per = row.get("repeats_step_ms") or [(row.get("log") or {}).get("step_ms_med")]
    return [float(x) for x in per if x]


def log_policy(name: str) -> str:
    """A run_bench server log's file name -> its policy: 8b-plugin-fixed_1_s3+lp.log -> plugin-fixed:1:s3+lp."""
    base = os.path.basename(name)
    base = base[base.index("-") + 1:] if "-" in base else base
    return base[:-4].replace("_", ":") if base.endswith(".log") else base.replace("_", ":")


MIN_CLEAN_WINDOWS = 3  # fewer windows without a prefill at exactly c requests: no figure


def clean_step_costs(log_dirs: list[str], concurrencies: list[int]) -> list[dict]:
    """Per call (a directory of run_bench server logs) and concurrency: each step policy's median step time over
    the whole log's Decode-batch windows at exactly c running requests that hold no prefill (benchlib's
    clean_step_ms_med; at least MIN_CLEAN_WINDOWS of them), with how many windows; the decode state and the
    split-KV s3 against their call's no-spec / stock s3 server. The rounds are pooled (the logs do not mark them),
    so a specctl server, whose state changes with its table (the learning pass too), has no row here, nor a pinned
    one (run_bench's pinned:...: a configuration per run): their windows mix states (the runs' own
    repeats_clean_step_ms are per round and configuration)."""
    out = []
    for d in log_dirs:
        logs = {log_policy(f): open(os.path.join(d, f), errors="replace").read() for f in sorted(os.listdir(d))
                if f.endswith(".log") and f != "run.log" and not log_policy(f).startswith(("specctl", "pinned"))}
        for c in concurrencies:
            row: dict = {"logs": d, "concurrency": c}
            for pol, text in logs.items():
                r = parse_decode_lines(text, c)
                if r.get("clean_step_ms_med") and r["clean_lines"] >= MIN_CLEAN_WINDOWS:
                    row[pol] = {"ms": r["clean_step_ms_med"], "windows": r["clean_lines"]}
            ref = (row.get(NO_SPEC_POLICY) or {}).get("ms")
            for pol in (DECODE_STATE, DECODE_STATE + "+lp", DECODE_STATE + SKIP_DE, *CATCHUP_KEYS, TRIVIAL):
                if ref and (row.get(pol) or {}).get("ms"):
                    row[pol]["vs_no_spec"] = round(row[pol]["ms"] / ref, 4)
            stock = (row.get(S3_STOCK_NOW) or {}).get("ms") or (row.get(S3_STOCK) or {}).get("ms")
            if stock and (row.get(S3_SPLITKV) or {}).get("ms"):
                row[S3_SPLITKV]["vs_stock"] = round(row[S3_SPLITKV]["ms"] / stock, 4)
            if len(row) > 2:
                out.append(row)
    return out


def read_telemetry(folder: str) -> list[dict]:
    """The step records of a run_bench plugin server's recorded telemetry (its specctl-<policy>/telemetry/), read
    by specctl's own reader (wire-validated, damaged gzip streams kept up to the damage), in the form
    benchlib.iteration_gaps takes, with each step's whole configuration and its batch's ctx_tokens (None where
    the plugin sent none) for ctx_results."""
    import glob
    from pathlib import Path

    from specctl.training.readers import FileReport
    from specctl.training.readers import read_telemetry as read_samples

    out = []
    for f in sorted(glob.glob(os.path.join(folder, "telemetry", "*.jsonl*"))):
        for s in read_samples(Path(f), FileReport(path=f)):
            out.append({"iter": s.iter, "ts": s.ts, "step_ms": s.step_ms, "batch_size": s.batch_size,
                        "config": {"steps": s.config[0], "topk": s.config[1], "draft_tokens": s.config[2]},
                        "rank": s.rank, "ctx_tokens": s.ctx_tokens})
    return out


def prefill_iterations(log_dirs: list[str]) -> list[dict]:
    """Per call: each server's prefill batches at high load and over the whole call (benchlib.prefill_batches over
    its log) and, for the plugin's servers, the wall time one prefill iteration takes between two decode steps,
    per configuration and batch region (benchlib.iteration_gaps over the recorded telemetry), and the step's own time right after
    another step and right after a prefill (benchlib.steps_after_prefill: the worker's host work the GPU waits
    for there). Where a whole-iteration loss at c >= 64 comes from: more prefill iterations, dearer ones, dearer
    steps after them, or neither."""
    out = []
    for d in log_dirs:
        row: dict = {"logs": d, "servers": {}}
        for f in sorted(os.listdir(d)):
            if f.endswith(".log") and f != "run.log":
                text = open(os.path.join(d, f), errors="replace").read()
                srv = row["servers"].setdefault(log_policy(f), {})
                # at high load, and over the whole call (every level: how far the closed loop's prefills batch)
                srv["prefill"], srv["prefill_all"] = prefill_batches(text), prefill_batches(text, min_running=0)
                srv["prefill_window_cost"] = prefill_window_cost(text)  # every server alike, from its log lines
            elif f.startswith("specctl-") and os.path.isdir(os.path.join(d, f)):
                tel = read_telemetry(os.path.join(d, f))
                for field, by in (("one_iteration_gap_ms", iteration_gaps(tel)),
                                  ("step_ms_after", steps_after_prefill(tel))):
                    if by:
                        row["servers"].setdefault(log_policy(f), {})[field] = {
                            f"s{k[0]} b{k[1]}": v for k, v in by.items()}
        out.append(row)
    return out


def tdump_summary(path: str) -> dict:
    """tensor_dump.py's tensor-dump.json in brief: per prompt, whether both servers' greedy ids agree, how many
    forward passes were matched and how many of them hold no differing module output, and the first difference."""
    d = json.load(open(path))
    per = {}
    for pid, r in (d.get("report") or {}).items():
        passes = r.get("matched_passes") or []
        first = next((p for p in passes if p.get("differing")), None)
        per[pid] = {"ids_same": r.get("ids_off") == r.get("ids_decode_state"), "passes": len(passes),
                    "passes_identical": sum(1 for p in passes if p.get("differing") == 0),
                    "first_difference": None if first is None else {"positions": first.get("positions"),
                                                                    "module": first.get("first_differing"),
                                                                    "diff": first.get("first_diff")}}
    return {"file": path, "layers": d.get("layers"), "new_tokens": d.get("new_tokens"),
            "flushed_each_prompt": d.get("flush"),  # None: a dump from before tensor_dump.py had --flush
            "prompts": per}


def splitkv_costs(runs: list[dict]) -> list[dict]:
    """s3 through the plugin at every batch size, with the split-KV verify kernel and with the stock one:
    per concurrency the median of the rounds (issue "cheaper speculative steps": <= 0.87x at c = 1 / 16 / 64)."""
    by: dict[int, dict[str, list[float]]] = {}
    for r in runs:
        pol = r["policy"]
        if pol in S3_POLICIES:
            key = "splitkv" if pol == S3_SPLITKV else "stock"
            by.setdefault(r["concurrency"], {})[key] = _round_steps(r)
    out = []
    for c in sorted(by):
        got = by[c]
        row = {"concurrency": c, **{f"{k}_ms": round(st.median(v), 4) for k, v in got.items() if v},
               "rounds": min(len(v) for v in got.values())}
        if row.get("stock_ms") and row.get("splitkv_ms"):
            row["splitkv_vs_stock"] = round(row["splitkv_ms"] / row["stock_ms"], 4)
        out.append(row)
    return out


def step_costs(runs: list[dict]) -> list[dict]:
    by = {}
    for r in runs:
        if step_name(r["policy"]) in STEP_POLICIES:
            by.setdefault(r["concurrency"], {})[step_name(r["policy"])] = _round_steps(r)
    out = []
    for c in sorted(by):
        got = by[c]
        med = {k: round(st.median(v), 4) if v else None for k, v in got.items()}
        row = {"concurrency": c, "no_spec_ms": med.get("off"), "off_state_ms": med.get(DECODE_STATE),
               "trivial_verify_ms": med.get(TRIVIAL), "rounds": min(len(v) for v in got.values()) if got else 0}
        if row["no_spec_ms"] and row["off_state_ms"]:
            row["off_state_vs_no_spec"] = round(row["off_state_ms"] / row["no_spec_ms"], 4)
        if row["no_spec_ms"] and row["trivial_verify_ms"]:
            row["trivial_verify_vs_no_spec"] = round(row["trivial_verify_ms"] / row["no_spec_ms"], 4)
        for pol, key in ((DECODE_STATE_DEG, "off_state_deg"), (DECODE_STATE_NODEG, "off_state_nodeg"),
                         *CATCHUP_KEYS.items()):
            if med.get(pol):
                row[f"{key}_ms"] = med[pol]
                if row["no_spec_ms"]:
                    row[f"{key}_vs_no_spec"] = round(med[pol] / row["no_spec_ms"], 4)
        out.append(row)
    return out


def throughput_rows(benches: list[dict]) -> list[dict]:
    """Every sweep row of every call, its rounds, and whether its server was torch-profiled before it measured:
    a profile leaves its server slower for the rest of its life (Kineto keeps CUPTI attached, pytorch#144455),
    so such a row is not comparable (run_bench profiles after the measurements since 2026-12-03's fourth lease:
    `profiles_after_measurements`)."""
    out = []
    for i, b in enumerate(benches, 1):
        before = set() if b.get("profiles_after_measurements") else {k.split("@")[0] for k in b.get("profiles") or {}}
        for r in b.get("runs", []):
            out.append({"call": i, "policy": r["policy"], "concurrency": r["concurrency"],
                        "output_tokens_per_s": r.get("output_tokens_per_s"), "rounds": r.get("repeats_tok_s"),
                        "profiled_before": r["policy"] in before})
    return out


def build(benches: list[dict], calls: list[str], log_dirs: list[str] | None = None) -> dict:
    first = benches[0]
    # a call's no-spec runs are the reference of the step costs only if the call ran a decode state or the
    # trivial verify beside them, and of the sweep only if it ran specctl or a static beside them: a sweep's
    # single round never stands in a step-cost median (the rounds of one call are what the ratio is of)
    step_runs, sweep_runs, kernel_runs = [], [], []
    for i, b in enumerate(benches, 1):
        runs = b.get("runs", [])
        twice = folded_twice(r["policy"] for r in runs)
        if twice:
            raise SystemExit(f"offpath_results: call {i} ran policies that share a step-cost column: {twice}")
        kernel = kernel_rows(runs)  # the s3 kernel rows: rec["splitkv"] (kernel_rows decides per policy)
        kernel_runs += kernel
        kernel_pols = {k["policy"] for k in kernel}
        runs = [r for r in runs if r["policy"] not in kernel_pols]
        pols = {step_name(r["policy"]) for r in runs}
        has_steps, has_sweep = bool(pols & (set(STEP_POLICIES) - {"off"})), bool(pols - set(STEP_POLICIES))
        step_runs += [r for r in runs if step_name(r["policy"]) in STEP_POLICIES and (r["policy"] != "off" or has_steps)]
        sweep_runs += [dict(r, call=i) for r in runs if step_name(r["policy"]) not in STEP_POLICIES
                       or (r["policy"] == "off" and has_sweep)]
    phase = [r for b in benches for r in b.get("phase_runs", [])]
    rec = {"gpu": first.get("gpu"), "sglang": first.get("sglang"), "attention_backend": first.get("attention_backend", "triton"),
           "model": first.get("model"), "draft": first.get("draft"), "calls": calls,
           "step_costs": step_costs(step_runs),
           "sweep": [{"concurrency": r["concurrency"], "policy": issue_name(shipped(r["policy"])),
                      "output_tokens_per_s": r.get("output_tokens_per_s"), "call": r["call"]}
                     for r in sweep_runs],
           "phase_runs": [], "identity": None, "resync": None}
    sk = splitkv_costs(kernel_runs)
    if sk:
        rec["splitkv"] = sk
    rec["throughput"] = throughput_rows(benches)
    if log_dirs:
        rec["prefill_iterations"] = prefill_iterations(log_dirs)
        rec["step_costs_clean"] = clean_step_costs(log_dirs, sorted({r["concurrency"] for r in rec["step_costs"]}
                                                                    | {r["concurrency"] for r in sk}
                                                                    | {r["concurrency"] for r in rec["sweep"]}))
    seen: dict[str, int] = {}
    for r in phase:
        name = issue_name(shipped(r["policy"]))
        seen[name] = seen.get(name, 0) + 1
        rec["phase_runs"].append({"policy": name, "run": seen[name], "output_tokens_per_s": r.get("output_tokens_per_s"),
                                  "median_tpot_ms": r.get("median_tpot_ms"),
                                  "phases": [dict(p) for p in r.get("phases", [])],
                                  "per_phase": [dict(p) for p in r.get("per_phase", [])]})
    runs_of_identity = []
    for i, b in enumerate(benches):
        ident = next((v for k, v in (b.get("identity") or {}).items() if step_name(k) == DECODE_STATE and v), None)
        if ident:
            tokens = max((len(x) for x in ((b.get("identity_ids") or {}).get("off") or {}).values()), default=None)
            entry = {"prompts": ident["of"], "identical": ident["identical"],
                     "first_divergence": ident.get("first_divergence", {}),
                     "concurrency": b.get("identity_concurrency"), "tokens": tokens,
                     "call": calls[i] if i < len(calls) else i}
            if ident.get("margin_at_divergence") is not None:
                entry["margin_at_divergence"] = ident["margin_at_divergence"]
                entry["median_margin"] = ident.get("median_margin")
            runs_of_identity.append(entry)
        if (b.get("identity_logits") or b.get("identity_top2")) and rec.get("identity_logits") is None:
            # run_bench's logprob pass through a +lp decode state: where its top-2 first differs from the no-spec's
            # (recomputed from the raw top-2 where the call kept it: the margin comparison came later)
            tops = b.get("identity_top2")
            rec["identity_logits"] = logit_report(tops, identity=b.get("identity")) if tops else b["identity_logits"]
        if b.get("prefill_identity") and rec.get("prefill_identity") is None:
            # run_bench's prefill probe: the prompts' log-probabilities against the no-spec server's
            rec["prefill_identity"] = b["prefill_identity"]
        rs = {shipped(k): v for k, v in (b.get("resync") or {}).items()}
        if RESYNC in rs or RESYNC_SKIP in rs or any(p in rs for p in RESYNC_CATCHUPS):
            a, s = rs.get(RESYNC) or {}, rs.get(RESYNC_SKIP) or {}
            rec["resync"] = {"accept_before": a.get("accept_before"), "accept_after": a.get("accept_after"),
                             "accept_after_skip_control": s.get("accept_after"),
                             "accept_before_skip_control": s.get("accept_before"),
                             # the reference continued from the run's own text (run_bench.resync_probe, stage 3)
                             "accept_same_text": a.get("accept_same_text"),
                             "accept_same_text_skip_control": s.get("accept_same_text"),
                             "off_stretch_s": a.get("off_stretch_s"), "details": rs}
            for pol, suffix in RESYNC_CATCHUPS.items():  # the draft's steps-0 extends deferred to catch-ups
                c = rs.get(pol) or {}
                if c or suffix == "catchup":
                    rec["resync"][f"accept_after_{suffix}"] = c.get("accept_after")
                    rec["resync"][f"accept_same_text_{suffix}"] = c.get("accept_same_text")
    if runs_of_identity:
        # the issue's figure: batch 1 (each prompt alone), the longest run; every run per concurrency beside it
        one = [e for e in runs_of_identity if e["concurrency"] == 1] or runs_of_identity
        rec["identity"] = max(one, key=lambda e: e["tokens"] or 0)
        rec["identity_runs"] = runs_of_identity
    stats = []
    for i, b in enumerate(benches):
        per = {issue_name(shipped(k)): v["request_stats"] for k, v in (b.get("servers") or {}).items()
               if isinstance(v, dict) and v.get("request_stats")}
        if per:  # run_bench --request-stats: queue time and arrival clustering per server, per call
            stats.append({"call": calls[i] if i < len(calls) else i, "servers": per})
    if stats:
        rec["request_stats"] = stats
    gcs = []
    for i, b in enumerate(benches):  # run_bench --log-gc / +freezegc: the collections in each measured window
        rows = [{"policy": issue_name(shipped(r["policy"])), "concurrency": r.get("concurrency"),
                 "gc_ms_per_s": r.get("repeats_gc_ms_per_s") or [(r.get("gc") or {}).get("ms_per_s", 0.0)],
                 "median_run": r.get("gc")} for r in b.get("runs", []) if "gc" in r]
        rows += [{"policy": issue_name(shipped(r["policy"])), "phase_run": k, "gc": r.get("gc")}
                 for k, r in enumerate(b.get("phase_runs", [])) if "gc" in r]
        frozen = {issue_name(shipped(k)): v["gc_frozen"] for k, v in (b.get("servers") or {}).items()
                  if isinstance(v, dict) and v.get("gc_frozen")}
        if rows or frozen:
            gcs.append({"call": calls[i] if i < len(calls) else i, "runs": rows, "frozen": frozen})
    if gcs:
        rec["gc"] = gcs
    profiles = {k: v for b in benches for k, v in (b.get("profiles") or {}).items()}
    if profiles:  # trace_steps.py's reductions (per-step medians: GPU busy / idle, syncs, launches)
        rec["profiles"] = {k: (v.get("median", v) if isinstance(v, dict) else v) for k, v in profiles.items()}
    rec["targets"] = targets(rec)
    return rec


def paired_envelope(sweep: list[dict]) -> dict:
    """The sweep target where the competitors ran in several calls, each beside a specctl server of its own (an
    H100 holds two 8B testbed servers: 2026-12-06's F'3 ran specctl with no-spec and s3, F'4 with s1 and s2): per
    concurrency, the lowest over calls of that call's specctl ÷ the best competitor of the same call, so that no
    ratio divides one call's figure by another's (their rounds differ by more than the bound). {} unless at least
    two calls ran specctl beside a competitor."""
    calls: dict[int, dict[int, dict[str, float]]] = {}
    for r in sweep:
        if r.get("call") is None or not r.get("output_tokens_per_s"):
            continue
        calls.setdefault(r["call"], {}).setdefault(r["concurrency"], {})[r["policy"]] = r["output_tokens_per_s"]
    out: dict[str, dict] = {}
    n_calls = 0
    for call, levels in sorted(calls.items()):
        used = False
        for c, pols in levels.items():
            rivals = {k: v for k, v in pols.items() if k == "no-spec" or k.startswith("static:")}
            if "specctl" not in pols or not rivals:
                continue
            used = True
            best = max(rivals, key=rivals.get)
            ratio = round(pols["specctl"] / rivals[best], 4)
            cur = out.setdefault(str(c), {"ratio": None, "call": None, "against": None, "rivals": []})
            if cur["ratio"] is None or ratio < cur["ratio"]:
                cur.update(ratio=ratio, call=call, against=best)
            cur["rivals"] = sorted(set(cur["rivals"]) | set(rivals))  # every competitor some call paired
        n_calls += used
    return dict(sorted(out.items(), key=lambda kv: int(kv[0]))) if n_calls >= 2 else {}


def targets(rec: dict) -> dict:
    """Each of the issue's bounds with the figure it is checked on (None where the figure is missing)."""
    t = {"off_state_le_1.03x_no_spec": {str(r["concurrency"]): r.get("off_state_vs_no_spec") for r in rec["step_costs"]}}
    for key in (*CATCHUP_KEYS.values(), "off_state_deg"):  # the decode state's variants, where a call ran them
        if any(f"{key}_vs_no_spec" in r for r in rec["step_costs"]):
            t[f"{key}_le_1.03x_no_spec"] = {str(r["concurrency"]): r.get(f"{key}_vs_no_spec") for r in rec["step_costs"]}
    env: dict[int, float] = {}
    of: dict[int, set] = {}  # the servers each c's envelope was taken over (a call without statics: no-spec alone)
    mine: dict[int, float] = {}
    for r in rec["sweep"]:
        v = r["output_tokens_per_s"] or 0.0
        if r["policy"] == "no-spec" or r["policy"].startswith("static:"):
            env[r["concurrency"]] = max(env.get(r["concurrency"], 0.0), v)
            of.setdefault(r["concurrency"], set()).add(r["policy"])
        if r["policy"] == "specctl":
            mine[r["concurrency"]] = v
    t["sweep_specctl_vs_envelope_ge_0.98"] = {str(c): round(mine[c] / env[c], 4) for c in sorted(mine) if env.get(c)}
    t["sweep_envelope_of"] = {str(c): sorted(of[c]) for c in sorted(mine) if env.get(c)}
    paired = paired_envelope(rec["sweep"])
    if paired:
        t["sweep_specctl_vs_envelope_ge_0.98_paired"] = paired
    med = {}
    for r in rec["phase_runs"]:
        med.setdefault(r["policy"], []).append(r["output_tokens_per_s"] or 0.0)
    med = {k: st.median(v) for k, v in med.items()}
    if "specctl" in med:
        t["phase_specctl_over"] = {k: round(med["specctl"] / v, 4) for k, v in med.items() if k != "specctl" and v}
    t.update(phase_targets(rec["phase_runs"]))
    if rec["identity"]:
        t["identity"] = f"{rec['identity']['identical']}/{rec['identity']['prompts']}"
    if rec.get("splitkv"):
        t["s3_splitkv_le_0.87x_stock"] = {str(r["concurrency"]): r.get("splitkv_vs_stock") for r in rec["splitkv"]}
    for r in rec.get("step_costs_clean") or []:
        for pol, key in ((DECODE_STATE, "off_state"), (DECODE_STATE + "+lp", "off_state"),
                         *CATCHUP_KEYS.items(), (S3_SPLITKV, "s3_splitkv")):
            v = (r.get(pol) or {}).get("vs_stock" if key == "s3_splitkv" else "vs_no_spec")
            if v is not None:
                t.setdefault(f"{key}_clean_windows", {}).setdefault(str(r["concurrency"]), []).append(v)
    rs = rec.get("resync") or {}
    if rs.get("accept_same_text") and rs.get("accept_after"):
        # item 4 against the same-text reference: the shipped plugin's tail ÷ its reference (target: within
        # noise of 1), and the control's (it must fall below, or the probe cannot tell)
        t["resync_tail_vs_same_text"] = round(rs["accept_after"] / rs["accept_same_text"], 4)
        for suffix in RESYNC_CATCHUPS.values():
            if rs.get(f"accept_same_text_{suffix}") and rs.get(f"accept_after_{suffix}"):
                t[f"resync_{suffix}_tail_vs_same_text"] = round(
                    rs[f"accept_after_{suffix}"] / rs[f"accept_same_text_{suffix}"], 4)
        if rs.get("accept_same_text_skip_control") and rs.get("accept_after_skip_control"):
            t["resync_control_tail_vs_same_text"] = round(
                rs["accept_after_skip_control"] / rs["accept_same_text_skip_control"], 4)
    return t


def phase_targets(runs: list[dict]) -> dict:
    """Per phase (run_bench's per_phase rows): specctl's median output tokens/s over its runs ÷ the best other
    server's median (the issue: >= 0.97 in each phase), and in the phases at concurrency <= 8 specctl's median
    TPOT ÷ the no-spec server's (<= 0.90). Empty where the runs carry no per-phase rows."""
    per: dict[str, dict[int, list[dict]]] = {}
    conc: dict[int, int] = {}
    for r in runs:
        for p in r.get("per_phase") or []:
            per.setdefault(r["policy"], {}).setdefault(p["phase"], []).append(p)
            conc[p["phase"]] = p["concurrency"]
    if "specctl" not in per or len(per) < 2:
        return {}
    med = lambda rows, k: st.median([x[k] for x in rows if x.get(k) is not None] or [0.0])  # noqa: E731
    best, tpot = {}, {}
    for k in sorted(per["specctl"]):
        mine = med(per["specctl"][k], "output_tokens_per_s")
        others = [med(v[k], "output_tokens_per_s") for pol, v in per.items() if pol != "specctl" and k in v]
        if others and max(others) > 0:
            best[str(k)] = round(mine / max(others), 4)
        if conc[k] <= 8 and k in per.get("no-spec", {}):
            ref = med(per["no-spec"][k], "median_tpot_ms")
            if ref > 0:
                tpot[str(k)] = round(med(per["specctl"][k], "median_tpot_ms") / ref, 4)
    return {"phase_each_vs_best_ge_0.97": best, "phase_low_c_tpot_vs_no_spec_le_0.90": tpot}


def break_even(prof: dict) -> dict:
    """Per speculative configuration and concurrency, the tokens a step must yield to beat the no-spec server
    (its step ÷ the no-spec step) and to beat the build's own off (÷ its off step): where accept length falls
    below the first, speculating loses to not launching EAGLE-3 at all."""
    ref = dict(map(tuple, prof["source"]["no_spec_step_ms"]))
    own = dict(map(tuple, prof["step_ms"].get("off", [])))
    out = {}
    for n, pts in prof["step_ms"].items():
        if n == "off":
            continue
        out[n] = {str(c): {"vs_no_spec": round(ms / ref[c], 3) if c in ref else None,
                           "vs_own_off": round(ms / own[c], 3) if c in own else None} for c, ms in pts}
    if own and ref:
        out["off_vs_no_spec"] = {str(c): round(ms / ref[c], 3) for c, ms in own.items() if c in ref}
    return out


def borrow_static(profiles: dict) -> dict:
    """The specctl build's speculative curves, where its calls ran none, from SGLang's static servers of the same
    calls (--borrow-static, for flashinfer: the plugin's own changes to a chain's speculative step are triton's
    split-KV kernel and, at steps 0 only, the draft-extend graphs, so on flashinfer its sN should cost what SGLang's
    does; record gpu-2026-12-06-offpath-fi-s3-phase-h100.json's J6 measured that it does); each borrowed curve is named in `source.borrowed`.
    The other builds as they are."""
    mine, theirs = profiles.get("specctl"), profiles.get("sglang")
    if not mine or not theirs:
        return profiles
    for n, pts in theirs["step_ms"].items():
        if n != "off" and n not in mine["step_ms"]:
            mine["step_ms"][n], mine["configs"][n] = pts, theirs["configs"][n]
            mine["source"].setdefault("borrowed", {})[n] = f"static:{n} (SGLang's EAGLE-3 server without the plugin)"
            if n in theirs["source"].get("no_clean_window", {}):
                mine["source"]["no_clean_window"][n] = theirs["source"]["no_clean_window"][n]
    return profiles


def add_telemetry_points(prof: dict, steps: list[dict], levels: list[int], min_steps: int = 3) -> dict:
    """A profile's missing levels from the plugin's own step telemetry (benchlib.telemetry_step_points: steps
    right after a step, at batch sizes just under the level) where the server's telemetry holds >= min_steps of
    them; `source.telemetry_points` names each point taken ([level, steps]) and `source.telemetry_vs_log` the
    telemetry / log-line ratio at the levels both measured, the check that the two methods agree."""
    pts = telemetry_step_points(steps, levels)
    src = prof["source"]
    for n in list(prof["step_ms"]):
        cfg = OFF if n == "off" else parse_config(n)
        have = dict(map(tuple, prof["step_ms"][n]))
        took, check = [], {}
        for lv, ms, k in pts.get(cfg, []):
            if lv in have:
                check[str(lv)] = round(ms / have[lv], 4)
            elif k >= min_steps:
                have[lv] = ms
                took.append([lv, k])
        if took:
            prof["step_ms"][n] = [[lv, ms] for lv, ms in sorted(have.items())]
            src.setdefault("telemetry_points", {})[n] = took
            loose = src.get("no_clean_window", {})
            if n in loose:
                loose[n] = [lv for lv in loose[n] if lv not in have]
                if not loose[n]:
                    del loose[n]
        if check:
            src.setdefault("telemetry_vs_log", {})[n] = check
    if src.get("telemetry_points"):
        src["method"] += ("; at the levels in telemetry_points (no clean window in the log), the median step_ms of "
                          "the plugin's step telemetry over decode steps right after a decode step at batch sizes "
                          "L - L/16 .. L")
    return prof


def pinned_telemetry(benches: list[dict], log_dirs: list[str]) -> dict[str, list[dict]]:
    """Per build, the step telemetry that the calls' pinned servers recorded (run_bench's specctl-<policy>/ in
    each --logs directory): a pinned server runs every configuration of its build at every batch size."""
    out: dict[str, list[dict]] = {}
    pols = {p for b in benches for p in b.get("servers", {}) if p.startswith("pinned:")}
    for d in log_dirs:
        for pol in sorted(pols):
            folder = os.path.join(d, "specctl-" + file_tag(pol))
            where = path_config(f"{pol}@off", PIN_ALL)
            if where and os.path.isdir(folder):
                out.setdefault(where[0], []).extend(read_telemetry(folder))
    return out


def write_profiles(benches: list[dict], out_dir: str, name: str, calls: list[str], borrow: bool = False,
                   telemetry: dict[str, list[dict]] | None = None, note: str | None = None) -> dict:
    backends = {b.get("attention_backend", "triton") for b in benches}
    if len(backends) != 1:
        raise SystemExit(f"--profiles: the calls ran different attention backends {sorted(backends)}: one at a time")
    os.makedirs(out_dir, exist_ok=True)
    runs = [r for b in benches for r in b.get("runs", [])]
    written = {}
    profiles = path_profiles(runs, f"{name}-{backends.pop()}")
    levels = sorted({r["concurrency"] for r in runs if r.get("concurrency")})
    for build, steps in (telemetry or {}).items():
        if build in profiles:
            add_telemetry_points(profiles[build], steps, levels)
    for build, prof in (borrow_static(profiles) if borrow else profiles).items():
        prof["source"]["calls"] = calls
        if note:  # what a reader is told the profile is (specctl demo names it by its note)
            prof = {"note": note, **prof}
        path = os.path.join(out_dir, prof["name"] + ".json")
        with open(path, "w") as f:
            json.dump(prof, f, indent=1)
        written[build] = {"file": path, "break_even_accept": break_even(prof)}
    return written


def moe_section(moe: dict, check: dict | None) -> dict:
    """The MoE record's own parts: the target (its dims and sizes, as build_moe.py wrote them), the measured
    experts-touched curves beside uniform routing and DeepSeek-V3 / Kimi-K2, and the target's checks."""
    out = {"moe_target": {k: v for k, v in moe.items() if k != "experts_touched"},
           "experts_touched": moe.get("experts_touched")}
    if check is not None:
        out["moe_check"] = check
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("bench", nargs="+")
    ap.add_argument("--call", action="append", default=[])
    ap.add_argument("--logs", action="append", default=[],
                    help="a directory of one call's server logs (g0.tgz's g0/): step costs over clean windows")
    ap.add_argument("--profiles", default=None,
                    help="also write each server build's simulator cost profile (benchlib.path_profiles) here")
    ap.add_argument("--tdump", action="append", default=[],
                    help="a tensor_dump.py tensor-dump.json (item 5: where the decode state's forward parts)")
    ap.add_argument("--profile-name", default="h200-sglang-smollm2-135m-8b",
                    help="profile names: NAME-<attention backend>-<build>")
    ap.add_argument("--profile-note", default=None,
                    help='each profile\'s "note", e.g. "measured: GPU, SGLang release backend, target; record R"')
    ap.add_argument("--borrow-static", action="store_true",
                    help="the specctl profile's sN curves from static:sN where the calls ran no plugin sN")
    ap.add_argument("--moe", default=None,
                    help="the MoE target's moe.json (build_moe.py): its dims and experts_touched curves go in the record")
    ap.add_argument("--moe-check", default=None,
                    help="moe_check.sh's moe_check.json: greedy identity with the dense base, accept lengths")
    a = ap.parse_args()
    benches = [json.load(open(f)) for f in a.bench]
    rec = build(benches, a.call, a.logs)
    if a.moe:
        rec.update(moe_section(json.load(open(a.moe)), json.load(open(a.moe_check)) if a.moe_check else None))
    if a.tdump:
        rec["tensor_dump"] = [tdump_summary(p) for p in a.tdump]
    if a.profiles:
        rec["path_profiles"] = write_profiles(benches, a.profiles, a.profile_name, a.call, a.borrow_static,
                                              pinned_telemetry(benches, a.logs), a.profile_note)
        print(json.dumps(rec["path_profiles"], indent=1))
    write_record(a.out, rec)
    print(json.dumps(rec["targets"], indent=1))


if __name__ == "__main__":
    main()
