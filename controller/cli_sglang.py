"""`specctl sglang-args`: the SGLang launch flags and adaptive config that wire specctl in."""

from __future__ import annotations

import json

import click

from ..plugin import launch_args
from . import wire
from .cli_options import CONFIG_HELP, CONFIGS_HELP, config_callback, parse_configs


@click.command("sglang-args")
@click.option("--configs", default="off,s1,s3", show_default=True,
              help=f"Configurations the policy may use, {CONFIGS_HELP}.")
@click.option("--initial-steps", type=click.IntRange(min=1), default=None,
              help="--speculative-num-steps (default: the largest chain among --configs).")
@click.option("--algorithm", default="EAGLE3", show_default=True, type=click.Choice(["EAGLE3", "EAGLE"]),
              help="--speculative-algorithm.")
@click.option("--config-path", default="specctl-adaptive.json", show_default=True,
              help="Where the printed snippet writes the adaptive config JSON.")
@click.option("--server-id", default="sglang-0", show_default=True,
              help="SPECCTL_SERVER_ID: how this server is named in telemetry, `specctl doctor` and metrics.")
@click.option("--plugin-mode", default=None, type=click.Choice(["online", "fixed", "file", "off"]),
              help="SPECCTL_MODE, where the plugin's policy comes from: online (a `specctl serve` daemon), "
                   "fixed (the fixed-threshold table), file (SPECCTL_POLICY_FILE), off (plugin inert). "
                   "[default: online]")
@click.option("--mode", "old_mode", default=None, hidden=True,
              type=click.Choice(["online", "fixed", "file", "off"]))  # the older name of --plugin-mode
@click.option("--rundir", default=None, help="SPECCTL_RUNDIR shared with `specctl serve`.")
@click.option("--fallback-threshold", type=click.IntRange(min=1), default=launch_args.DEFAULT_THRESHOLD,
              show_default=True, help="The fixed-threshold fallback switches speculation off from this batch size up.")
@click.option("--fallback-config", default="s3", show_default=True, callback=config_callback,
              help=f"The fallback's configuration below the threshold: {CONFIG_HELP}.")
@click.option("--plain-decode/--no-plain-decode", default=True, show_default=True,
              help="Speculation off as a true decode forward (the plugin's decode state: decode CUDA graphs "
                   "captured at start-up), or SGLang's 1-token verify.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def sglang_args(configs: str, initial_steps, algorithm, config_path, server_id, plugin_mode, old_mode, rundir,
                fallback_threshold, fallback_config, plain_decode, as_json) -> None:
    """Print the --speculative-adaptive-config JSON and the launch flags for SGLang.

    The runtime states built are --configs plus what the plugin cannot run without, each said in
    a comment line (with --json: under "notes"): off (the fallback's plain decode), the --fallback-config, and a chain when --configs
    holds only trees (SGLang launches adaptive speculation as a chain)."""
    if plugin_mode and old_mode and plugin_mode != old_mode:
        raise click.UsageError(f"--plugin-mode {plugin_mode} and --mode {old_mode} disagree (--mode is its older name)")
    try:
        cands = list(parse_configs(configs))
        args = launch_args.build(cands, algorithm=algorithm, initial_steps=initial_steps,
                                 config_path=config_path, server_id=server_id,
                                 mode=plugin_mode or old_mode or "online", rundir=rundir,
                                 fallback_threshold=fallback_threshold, fallback_config=fallback_config,
                                 plain_decode=plain_decode)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    notes = added_states(cands, args.adaptive_config, fallback_config)
    if as_json:
        click.echo(json.dumps({**args.to_obj(), "notes": notes}, indent=2))
    else:
        click.echo("".join(f"# {n}\n" for n in notes) + args.shell(), nl=False)


def added_states(asked: list[tuple[int, int, int]], config: dict, fallback: tuple[int, int, int]) -> list[str]:
    """What the launch config builds beyond the configurations asked for, and why."""
    built = set(config.get("1", {}).get("candidate_steps", []))
    asked_steps = {c[0] for c in asked}
    notes = []
    for steps in sorted(built - asked_steps):
        name = wire.config_name((steps, 1, steps + 1)) if steps else "off"
        if steps == 0:
            why = "the fallback switches speculation off from --fallback-threshold up"
        elif steps == fallback[0]:
            why = (f"it is --fallback-config ({wire.config_name(fallback)}), which needs a runtime state; "
                   "pass one of --configs as --fallback-config to avoid it")
        else:
            why = "SGLang launches adaptive speculation as a chain, and --configs holds only trees"
        notes.append(f"added {name} to --configs: {why}")
    return notes
