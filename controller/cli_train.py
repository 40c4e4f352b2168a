"""`specctl train`: a policy file from SGLang logs, bench_serving results and telemetry recordings."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import click

from . import wire
from .cli_options import CONFIGS_HELP, configs_callback

PROGRESS_MIN_BYTES = 16 * 1024 * 1024  # smaller inputs read in a blink: no bar


@click.command("train")
@click.argument("inputs", nargs=-1, required=True, type=click.Path())
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False),
              help="Policy file to write (the policy JSON of docs/architecture.md, source \"file\").")
@click.option("--plot", type=click.Path(dir_okay=False), help="Draw the fit to this PNG (needs matplotlib).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False),
              help="Write the per-file and fit report (Markdown) here; written even when no policy is.")
@click.option("--configs", "--candidates", "candidates", callback=configs_callback,
              help=f"Configurations the engines have runtime states for, {CONFIGS_HELP} "
                   "(default: every one seen in the inputs). --candidates is its older name.")
@click.option("--max-batch", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Largest batch size the table is derived for (the last row extends beyond).")
@click.option("--min-steps", default=32.0, show_default=True, type=click.FloatRange(min=1),
              help="Decode steps that make a batch-size range count as measured for a configuration.")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar (default: on for inputs over 16 MiB).")
@click.option("--ctx-axis/--no-ctx-axis", default=True, show_default=True,
              help="Where the inputs carry ctx_tokens and step time depends on it, a table per band of mean "
                   "context per request (--no-ctx-axis: one table for any context).")
@click.option("--json", "as_json", is_flag=True, help="Print the training report as JSON on stdout.")
def train(inputs: tuple[str, ...], out: str, plot: Optional[str], report_path: Optional[str],
          candidates, max_batch: int, min_steps: float, progress: Optional[bool], ctx_axis: bool,
          as_json: bool) -> None:
    """Fit the cost model to INPUT files or directories (any mix of SGLang server logs,
    bench_serving result JSONL and specctl telemetry .jsonl/.jsonl.gz) and write a policy file
    for `specctl serve --init-policy` or the plugin's SPECCTL_POLICY_FILE.

    Exits 2 without writing a policy when the inputs do not carry enough evidence."""
    from ..training import train as training
    from ..training.readers import expand_inputs
    from .state import atomic_write

    files, _ = expand_inputs(inputs)
    total = 0
    for f in files:
        try:
            total += f.stat().st_size
        except OSError:
            pass
    show_bar = progress if progress is not None else total >= PROGRESS_MIN_BYTES
    if show_bar:
        with click.progressbar(length=max(total, 1), label="reading", file=sys.stderr,
                               show_percent=True, show_eta=True) as bar:
            policy, report = training.train(inputs, max_batch=max_batch, candidates=candidates,
                                            min_steps=min_steps, progress=bar.update, ctx_axis=ctx_axis)
    else:
        policy, report = training.train(inputs, max_batch=max_batch, candidates=candidates,
                                        min_steps=min_steps, ctx_axis=ctx_axis)

    for f in report.files:
        line = (f"{f.path}: {f.format}, {f.num_lines} lines, {f.num_used} used, "
                f"{f.num_skipped} skipped")
        top = ", ".join(f"{n} {r}" for r, n in f.skipped.most_common(3))
        click.echo(line + (f" ({top})" if top else ""), err=True)
        for p in f.problems:
            click.echo(f"  problem: {p}", err=True)
    if report_path:
        Path(report_path).write_text(training.report_markdown(report, policy))
    if plot:
        try:
            training.plot_fit(report, policy, plot)
        except ImportError:
            click.echo("--plot needs matplotlib (pip install 'specctl[plot]'); no plot written",
                       err=True)
    if as_json:
        click.echo(json.dumps(report.to_obj(), indent=2))
    if policy is None:
        click.echo("no policy written: too little evidence:", err=True)
        for m in report.missing:
            click.echo(f"  - {m}", err=True)
        sys.exit(2)
    atomic_write(Path(out), wire.encode(policy) + b"\n", keep_prev=False)
    x = report.crossover
    rows = "; ".join(f"{r.min_batch}-{'' if r.max_batch is None else r.max_batch}: {r.config.name}"
                     for r in policy.table if r.ctx_band is None)
    click.echo(f"wrote {out}: {rows} (spec→off crossover: {'never' if x is None else x}; "
               f"{report.num_samples} samples)", err=True)
    for lo, hi, band_rows in report.ctx_bands:
        cells = "; ".join(f"{r.min_batch}-{'' if r.max_batch is None else r.max_batch}: {wire.config_name(r.config)}"
                          for r in band_rows)
        click.echo(f"  context {lo}{'+' if hi is None else f'-{hi}'} tokens a request: {cells}", err=True)
