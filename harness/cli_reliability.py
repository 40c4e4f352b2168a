"""`specctl bench reliability`: faults, load and hostile input, as figures (controller/reliability.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("reliability")
@click.option("--kills", default=1000, show_default=True, type=click.IntRange(min=1),
              help="SIGKILLs during state writes.")
@click.option("--fuzz-cases", default=10_000, show_default=True, type=click.IntRange(min=1),
              help="Hypothesis cases per decoder / reader.")
@click.option("--load-seconds", default=60.0, show_default=True, type=click.FloatRange(min=1),
              help="Load run (64 ranks x 1000 steps/s) with shedding on.")
@click.option("--compare-seconds", default=20.0, show_default=True, type=click.FloatRange(min=0),
              help="The same load with shedding off (0: skip).")
@click.option("--json", "json_out", default="benchmarks/results/reliability.json", show_default=True,
              type=click.Path(dir_okay=False), help="Where the JSON record goes.")
@click.option("--doc", "doc_out", default="benchmarks/results/reliability.md", show_default=True,
              type=click.Path(dir_okay=False), help="Where the record's Markdown page goes.")
def reliability(kills: int, fuzz_cases: int, load_seconds: float, compare_seconds: float,
                json_out: str, doc_out: str) -> None:
    """Inject faults, flood the daemon, fuzz every input; write the JSON record and the doc."""
    from . import reliability as rel

    rec = rel.run_all(kills=kills, fuzz_cases=fuzz_cases, load_s=load_seconds,
                      load_compare_s=compare_seconds, progress=lambda m: click.echo(m, err=True))
    cmd = (f"specctl bench reliability --kills {kills} --fuzz-cases {fuzz_cases} "
           f"--load-seconds {load_seconds:g} --compare-seconds {compare_seconds:g}")
    rec["command"] = cmd
    for path, text in ((json_out, json.dumps(rec, indent=2, default=str)), (doc_out, rel.render_markdown(rec, cmd))):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n")
        click.echo(f"wrote {path}", err=True)
    kill = rec["faults"]["kill_during_write"]
    bad = (sum(t["crashes"] + t["violations"] for t in rec["fuzz"].values())
           + kill["kills"] - kill["survived"]
           + sum(not f["survived"] for name, f in rec["faults"].items() if name != "kill_during_write"))
    if bad:
        raise click.ClickException(f"{bad} failures: see {doc_out}")


if __name__ == "__main__":
    reliability()
