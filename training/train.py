"""`specctl train`: the daemon's cost model and table rule (training.fit, no time decay) fitted to
benchmark logs of any mix of formats, then the policy table; bench_serving sweeps pin the best
MEASURED configuration at every swept concurrency."""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..controller import wire
from ..policies import costmodel as cmpolicy
from ..policies.table import OFF, Config, PolicyTable, config_name, rows_from_choices
from .costmodel import Sample
from .fit import FitSettings, TableFitter
from .readers import BenchPoint, FileReport, Progress, expand_inputs, read_file

DEFAULT_MIN_STEPS = 32.0  # decode steps that make a batch-size range "measured" for a config
_KEEP_PER_CELL = 64  # step times kept per (config, batch size) for the report and the plot


@dataclass
class BenchChoice:
    concurrency: int
    throughput: dict[str, float]  # config name -> best measured output tokens/s at it
    best: Config
    table: Config  # what the final table picks there


@dataclass
class TrainReport:
    files: list[FileReport] = field(default_factory=list)
    num_samples: int = 0
    missing: list[str] = field(default_factory=list)  # non-empty: no policy was derived
    warnings: list[str] = field(default_factory=list)
    bench: list[BenchChoice] = field(default_factory=list)
    crossover: Optional[int] = None
    # the tables per context band: (min_ctx, max_ctx or None, rows); empty without a context axis
    ctx_bands: list[tuple[int, Optional[int], tuple]] = field(default_factory=list)
    max_observed_batch: int = 0
    coverage: dict[str, list[list[float]]] = field(default_factory=dict)  # config -> [[b, steps]]
    measured: dict[Config, dict[int, list[float]]] = field(default_factory=dict, repr=False)
    # the options the table was chosen from: config -> (tokens per step, step_ms at b = 1..n)
    curves: dict[Config, tuple[float, np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return not self.missing

    def to_obj(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "samples": self.num_samples, "missing": list(self.missing),
            "warnings": list(self.warnings), "crossover": self.crossover,
            "ctx_bands": [{"min_ctx": lo, "max_ctx": hi, "crossover": PolicyTable(rows=rows).spec_off_crossover(),
                           "table": [[r.min_batch, r.max_batch, config_name(r.config)] for r in rows]}
                          for lo, hi, rows in self.ctx_bands],
            "max_observed_batch": self.max_observed_batch,
            "files": [f.to_obj() for f in self.files],
            "bench": [{"concurrency": c.concurrency, "throughput": c.throughput,
                       "best": config_name(c.best), "table": config_name(c.table)} for c in self.bench],
        }


class _Collector:
    """Feeds samples to the model while keeping per-(config, batch) coverage and recent values."""

    def __init__(self, observe: Callable[[Sample], None]):
        self.observe = observe
        self.weight: dict[tuple[Config, int], float] = {}
        self.values: dict[tuple[Config, int], deque] = {}
        self.num = 0

    def take(self, s: Sample) -> None:
        self.observe(s)
        self.num += 1
        if s.step_ms is None or not (s.step_ms > 0 and math.isfinite(s.step_ms)):
            return
        key = (tuple(s.config), int(s.batch_size))
        self.weight[key] = self.weight.get(key, 0.0) + float(s.weight)
        q = self.values.get(key)
        if q is None:
            q = self.values[key] = deque(maxlen=_KEEP_PER_CELL)
        q.append(float(s.step_ms))

    def steps_between(self, c: Config, lo: float, hi: float) -> float:
        return sum(w for (k, b), w in self.weight.items() if k == c and lo <= b <= hi)

    def batches(self, c: Config) -> list[int]:
        return sorted(b for (k, b) in self.weight if k == c)


def _fitter(max_batch: int, candidates: Optional[Sequence[Config]], ctx_axis: bool = True) -> TableFitter:
    kw: dict[str, Any] = dict(
        explore_period=0, max_batch=max_batch,
        candidates=tuple(tuple(c) for c in candidates) if candidates else None, ctx_axis=ctx_axis,
    )
    # offline, every logged step and request counts the same: no time decay of any memory
    for f in dataclasses.fields(FitSettings):
        if f.name.endswith("half_life_s"):
            kw[f.name] = math.inf
    return TableFitter(FitSettings(**kw))


def _evidence_problem(options: list[cmpolicy.Option]) -> Optional[str]:
    have = {o.config for o in options}
    if OFF not in have:
        return "no steps measured with speculation off"
    if not any(c[0] > 0 for c in have):
        return ("no steps measured with speculation on (a configuration with steps > 0 needs both "
                "step times and acceptance)")
    return None


def _coverage_problems(col: _Collector, table: PolicyTable, min_steps: float) -> list[str]:
    """What the table relies on that was not measured (empty: enough evidence)."""
    out: list[str] = []
    spec_cfgs = sorted({k for (k, _) in col.weight if k[0] > 0})
    all_b = [b for (_, b) in col.weight]
    if not all_b:
        return ["no step times in the inputs"]
    top = max(all_b)
    low = min(all_b)
    off_b = [b for b in col.batches(OFF) if col.steps_between(OFF, b, b) > 0]
    hi_off = max(off_b) if off_b else 0
    x = table.spec_off_crossover()

    def measured(c: Config, lo: float, hi: float) -> bool:
        return col.steps_between(c, lo, hi) >= min_steps

    if x is None or x > top:
        # the table speculates over the whole observed range: plain decode must have been
        # measured at its top too, or "spec wins there" rests on extrapolated times
        if not measured(OFF, max(1, top // 2), top):
            out.append(f"no steps measured with speculation off above batch {hi_off} "
                       f"(the inputs reach batch {top} and the fit speculates up to "
                       f"{'every batch size' if x is None else f'batch {x - 1}'}; measure plain "
                       f"decode between batch {max(1, top // 2)} and {top})")
    elif x > 1:
        below = table.lookup(x - 1)
        lo, hi = max(1, x // 2), 2 * x
        for c, what in ((OFF, "speculation off"), (below, config_name(below))):
            if measured(c, lo, hi):
                continue
            bb = col.batches(c)
            where = (f"above batch {bb[-1]}" if bb and bb[-1] < lo else
                     f"below batch {bb[0]}" if bb and bb[0] > hi else f"between batch {lo} and {hi}")
            out.append(f"no steps measured with {what} {where} (the fitted spec→off crossover at "
                       f"batch {x} rests on extrapolated step times there; measure {what} between "
                       f"batch {lo} and {hi})")
    else:
        # never speculate: speculation must have been measured at the small batches it favours
        hi = max(2, 2 * low)
        if spec_cfgs and not any(measured(c, 1, hi) for c in spec_cfgs):
            lo_spec = min(b for c in spec_cfgs for b in col.batches(c))
            out.append(f"no steps measured with speculation on below batch {lo_spec} (the fit never "
                       f"speculates; measure it between batch 1 and {hi})")
    return out


def _bench_override(choices: list[Config], options: list[cmpolicy.Option],
                    points: list[BenchPoint], report: TrainReport) -> list[Config]:
    """Pin the best measured configuration at every concurrency where a sweep compared two or
    more; between two swept concurrencies the model's goodput places the boundary."""
    by_conc: dict[int, dict[Config, float]] = {}
    for p in points:
        d = by_conc.setdefault(p.concurrency, {})
        d[p.config] = max(d.get(p.config, 0.0), p.output_throughput)  # repeated runs: best one
    allowed = {o.config for o in options}
    pinned = {}
    for c, d in by_conc.items():
        d = {k: v for k, v in d.items() if k in allowed}  # --candidates may rule some out
        by_conc[c] = d
        if len(d) >= 2:
            pinned[c] = max(d, key=lambda k: d[k])
    if not pinned:
        return choices
    out = list(choices)
    n = len(out)
    idx = {o.config: i for i, o in enumerate(options)}
    g = cmpolicy.goodput_matrix(options) if options else None
    swept = sorted(c for c in pinned if c <= n)
    for c in swept:
        out[c - 1] = pinned[c]
    for c1, c2 in zip(swept, swept[1:]):
        a, z = pinned[c1], pinned[c2]
        if a == z:
            for b in range(c1 + 1, c2):
                out[b - 1] = a
            continue
        boundary = (c1 + c2 + 1) // 2
        if g is not None and a in idx and z in idx:
            ga, gz = g[idx[a]], g[idx[z]]
            later = [b for b in range(c1 + 1, c2 + 1) if gz[b - 1] >= ga[b - 1]]
            boundary = later[0] if later else c2
        for b in range(c1 + 1, c2):
            out[b - 1] = a if b < boundary else z
    for c in sorted(pinned):
        d = by_conc[c]
        report.bench.append(BenchChoice(
            concurrency=c, throughput={config_name(k): round(v, 2) for k, v in sorted(d.items())},
            best=pinned[c], table=out[c - 1] if c <= n else out[-1]))
    return out


def train(inputs: Sequence[str | Path], *, max_batch: int = 1024,
          candidates: Optional[Sequence[Config]] = None, min_steps: float = DEFAULT_MIN_STEPS,
          progress: Optional[Progress] = None, clock: Callable[[], float] = time.time,
          ctx_axis: bool = True) -> tuple[Optional[wire.PolicyRecord], TrainReport]:
    """Read every input, fit, derive. Returns (policy with source "file", report); the policy is
    None when the evidence is too thin, and `report.missing` says what to measure. Where the inputs
    carry ctx_tokens and step time depends on it, the policy has a table per context band, as the
    daemon's (`ctx_axis` False: one table for any context)."""
    report = TrainReport()
    files, missing_files = expand_inputs(inputs)
    report.files.extend(missing_files)
    fitter = _fitter(max_batch, candidates, ctx_axis)
    col = _Collector(fitter.model.observe)
    points: list[BenchPoint] = []
    for path in files:
        fr = FileReport(path=str(path))
        for s in read_file(path, fr, progress=progress):
            col.take(s)
        report.files.append(fr)
        points.extend(fr.bench_points)
    report.num_samples = col.num
    report.measured = {}
    for (c, b), q in col.values.items():
        report.measured.setdefault(c, {})[b] = list(q)
    report.coverage = {
        config_name(c): [[b, round(col.weight[(c, b)], 1)] for b in col.batches(c)]
        for c in sorted({k for (k, _) in col.weight})
    }
    report.max_observed_batch = max((b for (_, b) in col.weight), default=0)
    for fr in report.files:
        if fr.problems:
            report.warnings.append(f"{fr.path}: " + "; ".join(fr.problems))
    if col.num == 0:
        report.missing.append("no usable samples in the inputs (see the per-file report)")
        return None, report

    fitter.model.refit()
    options = fitter.options(fitter.table_max_batch())
    problem = _evidence_problem(options)
    if problem is not None:
        report.missing.append(problem)
        return None, report
    # the daemon's choice (with its near-tie merging margin), no previous table to stick to
    choices = cmpolicy.choose(options, None, fitter.settings.margin)
    report.curves = {o.config: (o.tokens_per_step, o.step_ms) for o in options}
    if points:
        choices = _bench_override(choices, options, points, report)
    table = PolicyTable(rows=rows_from_choices(choices), source="file")
    bands = fitter.ctx_bands(options, table, z=0.0)  # chosen as the rows for any context are
    table = PolicyTable(rows=table.rows, bands=bands, source="file")
    report.ctx_bands = [(b.min_ctx, b.max_ctx, b.rows) for b in bands]
    report.crossover = table.spec_off_crossover()
    report.missing.extend(_coverage_problems(col, table, min_steps))
    if report.missing:
        return None, report

    summary = fitter.model_summary(options)
    summary["evidence"] = "ok"
    summary["spec_off_crossover"] = report.crossover
    if bands:
        summary["ctx_bands"] = fitter.band_summary_
    summary["training"] = {
        "inputs": [f.path for f in report.files],
        "samples": report.num_samples,
        "files": [{"path": f.path, "format": f.format, "used": f.num_used,
                   "skipped": f.num_skipped} for f in report.files],
        "coverage_steps": report.coverage,
        "bench": [{"concurrency": c.concurrency, "throughput": c.throughput,
                   "best": config_name(c.best)} for c in report.bench],
    }
    obj = {"kind": "policy", "schema": wire.SCHEMA_VERSION, "version": 1,
           "created_at": float(clock()), "source": "file", "table": table.to_rows_obj(),
           "model": summary}
    try:
        policy = wire.policy_from_obj(obj)
    except wire.WireError as e:
        report.missing.append(f"the derived policy is not a valid policy record ({e})")
        return None, report
    return policy, report


# ---------------------------------------------------------------------------------------------
# outputs: markdown report and plot


def report_markdown(report: TrainReport, policy: Optional[wire.PolicyRecord]) -> str:
    L: list[str] = ["# specctl train report", ""]
    if policy is None:
        L += ["**No policy written: too little evidence.**", ""]
        L += [f"- {m}" for m in report.missing] + [""]
    else:
        x = report.crossover
        L += [f"Policy derived from {report.num_samples} samples; spec→off crossover: "
              f"{'never' if x is None else f'batch {x}'}.", "", "| batch | configuration |",
              "|---|---|"]
        for r in policy.table:
            if r.ctx_band is not None:
                continue
            rng = f"{r.min_batch}–{r.max_batch}" if r.max_batch is not None else f"{r.min_batch}+"
            L.append(f"| {rng} | {r.config.name} ({r.config.steps},{r.config.topk},"
                     f"{r.config.draft_tokens}) |")
        L.append("")
        if report.ctx_bands:
            L += ["## Context bands (mean context tokens per request; the table above serves batches of "
                  "unknown context)", "", "| context | table | spec→off crossover |", "|---|---|---|"]
            for lo, hi, rows in report.ctx_bands:
                cells = ", ".join(f"{config_name(r.config)} {r.min_batch}{'+' if r.max_batch is None else f'–{r.max_batch}'}"
                                  for r in rows)
                cx = PolicyTable(rows=rows).spec_off_crossover()
                L.append(f"| {lo}{'+' if hi is None else f'–{hi}'} | {cells} | "
                         f"{'never' if cx is None else f'batch {cx}'} |")
            L.append("")
        cfgs = policy.model.get("configs", {})
        if cfgs:
            L += ["## Fit", "", "| config | tokens/step | step-time points | batch range | fit error |",
                  "|---|---|---|---|---|"]
            err = policy.model.get("fit_error", {})
            for name, e in cfgs.items():
                br = e.get("batch_range")
                L.append(f"| {name} | {e.get('tokens_per_step')} | {e.get('step_ms_points', 0)} | "
                         f"{'-' if not br else f'{br[0]}–{br[1]}'} | {err.get(name, '-')} |")
            L.append("")
    if report.bench:
        L += ["## bench_serving sweeps (best measured per concurrency)", "",
              "| concurrency | output tok/s by config | best measured | table |", "|---|---|---|---|"]
        for c in report.bench:
            thr = ", ".join(f"{k} {v:.1f}" for k, v in c.throughput.items())
            L.append(f"| {c.concurrency} | {thr} | {config_name(c.best)} | {config_name(c.table)} |")
        L.append("")
    if report.warnings:
        L += ["## Warnings", ""] + [f"- {w}" for w in report.warnings] + [""]
    L += ["## Inputs", "", "| file | format | lines | used | skipped | ignored |",
          "|---|---|---|---|---|---|"]
    for f in report.files:
        L.append(f"| {f.path} | {f.format} | {f.num_lines} | {f.num_used} | {f.num_skipped} | "
                 f"{f.num_ignored} |")
    L.append("")
    for f in report.files:
        if not (f.skipped or f.problems or f.notes):
            continue
        L += [f"### {f.path}", ""]
        L += [f"- problem: {p}" for p in f.problems]
        for reason, n in f.skipped.most_common():
            ex = f.examples.get(reason, [])
            lines = ", ".join(str(i) for i, _ in ex)
            L.append(f"- skipped {n}: {reason} (lines {lines}{', …' if n > len(ex) else ''})")
            if ex:
                L.append(f"  - e.g. line {ex[0][0]}: `{ex[0][1].replace('`', '')}`")
        L += [f"- note: {n}" for n in f.notes]
        L.append("")
    return "\n".join(L)


def plot_fit(report: TrainReport, policy: Optional[wire.PolicyRecord], path: str | Path) -> None:
    """Left: measured step times (median per batch size) and the fitted curves. Right: predicted
    goodput relative to plain decode, with the table's ranges shaded. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors: dict[Config, Any] = {}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, c in enumerate(sorted(set(report.measured) | set(report.curves))):
        colors[c] = cycle[i % len(cycle)]
    top = max(2, 2 * report.max_observed_batch)
    for c in sorted(report.measured):
        pts = sorted(report.measured[c].items())
        ax1.scatter([p[0] for p in pts], [float(np.median(p[1])) for p in pts], s=14,
                    color=colors[c], label=f"{config_name(c)} measured")
    off = report.curves.get(OFF)
    for c, (tau, ms) in sorted(report.curves.items()):
        n = min(len(ms), top)
        b = np.arange(1, n + 1)
        ax1.plot(b, ms[:n], "--", color=colors[c], label=f"{config_name(c)} fit")
        if off is not None:
            ax2.plot(b, tau / ms[:n] / (1.0 / off[1][:n]), color=colors[c],
                     label=f"{config_name(c)} (tokens/step {tau:.2f})")
    if policy is not None:
        for r in policy.table:
            hi = top if r.max_batch is None else r.max_batch + 0.5
            ax2.axvspan(r.min_batch - 0.5 if r.min_batch > 1 else 1, hi, alpha=0.08,
                        color=colors.get(r.config.key, "grey"))
    if report.crossover is not None:
        ax2.axvline(report.crossover, color="k", ls=":", label=f"spec→off at {report.crossover}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_ylabel("step time (ms)")
    ax2.set_ylabel("predicted goodput / plain decode's")
    fig.suptitle(f"specctl train: {report.num_samples} samples"
                 + ("" if policy is not None else " (no policy: too little evidence)"))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["train", "TrainReport", "BenchChoice", "report_markdown", "plot_fit",
           "DEFAULT_MIN_STEPS"]
