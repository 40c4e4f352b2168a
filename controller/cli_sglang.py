"""`specctl sglang-args`: the SGLang launch flags and adaptive config that wire specctl in."""

from __future__ import annotations

import json

import click

from ..plugin import launch_args
from . import wire


@click.command("sglang-args")
@click.option("--configs", default="off,s1,s3", show_default=True,
              help="configurations the policy may use (comma-separated: off, sN, and trees sNkKnD, "
                   "e.g. s2k4n16 = 2 steps, topk 4, 16 draft tokens)")
@click.option("--initial-steps", type=int, default=None, help="--speculative-num-steps (default: the largest candidate)")
@click.option("--algorithm", default="EAGLE3", show_default=True, type=click.Choice(["EAGLE3", "EAGLE"]))
@click.option("--config-path", default="specctl-adaptive.json", show_default=True,
              help="where the adaptive config JSON is written by the printed snippet")
@click.option("--server-id", default="sglang-0", show_default=True)
@click.option("--mode", default="online", show_default=True, type=click.Choice(["online", "fixed", "file", "off"]))
@click.option("--rundir", default=None, help="SPECCTL_RUNDIR shared with `specctl serve`")
@click.option("--fallback-threshold", type=int, default=launch_args.DEFAULT_THRESHOLD, show_default=True)
@click.option("--fallback-config", default="s3", show_default=True,
              help="fixed-threshold fallback's configuration below the threshold (a tree is allowed)")
@click.option("--plain-decode/--no-plain-decode", default=True, show_default=True,
              help="speculation off as a true decode forward (the plugin's decode state: decode CUDA graphs "
                   "captured at start-up), or SGLang's 1-token verify")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
def sglang_args(configs: str, initial_steps, algorithm, config_path, server_id, mode, rundir,
                fallback_threshold, fallback_config, plain_decode, as_json) -> None:
    """Print the --speculative-adaptive-config JSON and the launch flags for SGLang."""
    try:
        cands = [wire.parse_config(c).key for c in configs.split(",") if c.strip()]
        args = launch_args.build(cands, algorithm=algorithm, initial_steps=initial_steps,
                                 config_path=config_path, server_id=server_id, mode=mode, rundir=rundir,
                                 fallback_threshold=fallback_threshold,
                                 fallback_config=wire.parse_config(fallback_config).key,
                                 plain_decode=plain_decode)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        click.echo(json.dumps(args.to_obj(), indent=2))
    else:
        click.echo(args.shell(), nl=False)
