"""Benchmark logs -> cost-model `Sample`s: SGLang server logs, bench_serving result JSONL, specctl
telemetry JSONL(.gz); format detected per file, a `FileReport` per file (used / skipped by reason,
line-numbered examples). Bad input is reported, never raised; what precedes damage is kept."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator, Optional, Sequence


from ..controller import wire
from ..policies.table import OFF, Config
from .costmodel import Sample
# what train, the CLI, the harness and the tests import from here (the readers' one entry point)
from .lines import BenchPoint, FileReport, Progress, _is_bench, detect_format, iter_lines  # noqa: F401
from .sglang_log import (draft_widths_consistent, estimate_prefill_ms, parse_server_args,  # noqa: F401
                         read_sglang_log)


# ---------------------------------------------------------------------------------------------
# (c) specctl telemetry


def read_telemetry(path: Path, report: FileReport, progress: Optional[Progress] = None
                   ) -> Iterator[Sample]:
    last_bad: Optional[int] = None
    for lineno, text in iter_lines(path, report, progress):
        if not text.strip():
            report.num_ignored += 1
            continue
        try:
            rec = wire.decode(text)
        except wire.WireError as e:
            report.skip(lineno, e.reason, text, detail=e.detail)
            last_bad = lineno
            continue
        if isinstance(rec, wire.PolicyRecord):
            report.num_ignored += 1
            continue
        report.num_used += 1
        report.num_samples += 1
        yield Sample.from_record(rec)
    if last_bad is not None and last_bad == report.num_lines and not report.problems:
        report.note(f"the last line ({last_bad}) is unparseable: the file may have been cut "
                    f"while being written")


# ---------------------------------------------------------------------------------------------
# (b) sglang.bench_serving results


def _bench_config(info: dict) -> tuple[Optional[Config], Optional[str]]:
    """The speculative configuration a run used, from its `server_info`, or a reason why not."""
    if "decode" in info and isinstance(info["decode"], list) and info["decode"]:
        info = info["decode"][0]  # PD disaggregation: bench_serving itself reads decode[0]
        if not isinstance(info, dict):
            return None, "server_info.decode[0] is not an object"
    alg = info.get("speculative_algorithm")
    if alg in (None, "", "NONE", "None"):
        return OFF, None
    if info.get("speculative_adaptive"):
        return None, "adaptive speculation: the configuration varied during the run"
    steps = info.get("speculative_num_steps")
    topk = info.get("speculative_eagle_topk") or 1
    draft = info.get("speculative_num_draft_tokens")
    if not isinstance(steps, int) or steps < 0 or steps > wire.MAX_STEPS:
        return None, "server_info has no speculative_num_steps"
    if steps == 0:
        return OFF, None
    if not isinstance(topk, int) or topk < 1 or topk > wire.MAX_TOPK:
        return None, "bad speculative_eagle_topk"
    if topk == 1:
        draft = steps + 1
    if not isinstance(draft, int) or draft < 2 or draft > wire.MAX_DRAFT_TOKENS:
        return None, "server_info has no speculative_num_draft_tokens"
    return (steps, topk, draft), None


def _running_cap(info: dict) -> Optional[int]:
    if "decode" in info and isinstance(info["decode"], list) and info["decode"]:
        info = info["decode"][0] if isinstance(info["decode"][0], dict) else {}
    v = info.get("max_running_requests")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _num(obj: dict, key: str) -> Optional[float]:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def read_bench_serving(path: Path, report: FileReport, progress: Optional[Progress] = None
                       ) -> Iterator[Sample]:
    """One sample per run: batch size = max_concurrency (capped at the server's
    max_running_requests), step_ms = median TPOT x accept length
    (tokens per step per request; 1 without speculation), weight = decode steps the run stands
    for. Each run also gives a `BenchPoint` (its output throughput) for the table's
    best-measured choice at every swept concurrency.

    `accept_length` is SGLang's cumulative average since server start (`/server_info`), so a
    server reused across runs reports a running mean.
    """
    for lineno, text in iter_lines(path, report, progress):
        if not text.strip():
            report.num_ignored += 1
            continue
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply to parse
            report.skip(lineno, "not JSON", text)
            continue
        if not isinstance(obj, dict) or not _is_bench(obj):
            report.skip(lineno, "not a bench_serving result", text)
            continue
        info = obj.get("server_info")
        if not isinstance(info, dict):
            report.skip(lineno, "no server_info (speculative settings unknown)", text)
            continue
        cfg, why = _bench_config(info)
        if cfg is None:
            report.skip(lineno, why or "unknown configuration", text)
            continue
        mc = obj.get("max_concurrency")
        conc: Optional[int] = None
        if isinstance(mc, int) and not isinstance(mc, bool) and mc > 0:
            conc = mc
        else:
            measured = _num(obj, "concurrency")
            if measured is not None and measured >= 1:
                conc = int(round(measured))
                report.note("runs without max_concurrency: batch size taken from the measured "
                            "mean concurrency")
        if conc is None:
            report.skip(lineno, "no max_concurrency (and no measured concurrency)", text)
            continue
        thr = _num(obj, "output_throughput")
        if thr is None or thr <= 0:
            report.skip(lineno, "no output_throughput", text)
            continue
        report.bench_points.append(BenchPoint(cfg, conc, thr, str(path), lineno))
        report.num_used += 1
        tau = 1.0
        if cfg != OFF:
            al = _num(obj, "accept_length")
            if al is None or al < 1.0:
                report.note(f"line {lineno}: no accept_length: used for the measured-best choice "
                            f"only, not for the cost model")
                continue
            tau = al
        tpot = _num(obj, "median_tpot_ms")
        if tpot is None or tpot <= 0 or not math.isfinite(tpot * tau):
            report.note(f"line {lineno}: no median_tpot_ms: used for the measured-best choice only")
            continue
        batch = conc
        mrr = _running_cap(info)
        if mrr is not None and mrr < conc:
            # the server never ran more than max_running_requests at once (SGLang defaults it to
            # 48 with speculation), whatever concurrency the client offered
            batch = mrr
            report.note(f"line {lineno}: max_concurrency {conc} above the server's "
                        f"max_running_requests {mrr}: batch size {mrr} for the cost model")
        out_tokens = _num(obj, "total_output_tokens") or 0.0
        steps = max(1.0, out_tokens / (tau * batch))
        report.num_samples += 1
        yield Sample(ts=0.0, config=cfg, batch_size=batch, step_ms=tpot * tau, weight=steps,
                     mean_accepted=None if cfg == OFF else tau - 1.0,
                     # each run is its own measurement (no switch warm-up between runs)
                     server=f"{path.name}#{lineno}", rank=0)


# ---------------------------------------------------------------------------------------------
# entry points

_READERS = {"telemetry": read_telemetry, "sglang-log": read_sglang_log,
            "bench-serving": read_bench_serving}


def expand_inputs(inputs: Sequence[str | Path]) -> tuple[list[Path], list[FileReport]]:
    """Files named, and the files inside directories named (sorted; hidden files and `.part`
    files still being written are left out). Missing paths come back as problem reports."""
    files: list[Path] = []
    missing: list[FileReport] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            for q in sorted(p.rglob("*")):
                if q.is_file() and not q.name.startswith(".") and not q.name.endswith(".part"):
                    files.append(q)
        elif p.is_file():
            files.append(p)
        else:
            r = FileReport(path=str(p))
            r.problems.append("no such file or directory" if not p.exists() else "not a regular file")
            missing.append(r)
    return files, missing


def read_file(path: str | Path, report: Optional[FileReport] = None, *,
              progress: Optional[Progress] = None, fmt: Optional[str] = None) -> Iterator[Sample]:
    """Samples from one file of any supported format; `report` is filled as they are read."""
    p = Path(path)
    rep = report if report is not None else FileReport(path=str(p))
    if fmt is None:
        fmt, problem = detect_format(p)
        if problem:
            rep.problems.append(problem)
    rep.format = fmt
    reader = _READERS.get(fmt)
    if reader is None:
        if progress is not None:
            try:
                progress(p.stat().st_size)
            except OSError:
                pass
        return iter(())
    return reader(p, rep, progress)
