"""`specctl bench sim` and `specctl demo`: thin click commands over specctl.training.simbench."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from itertools import accumulate
from pathlib import Path
from typing import Any, Optional, TextIO

import click

# the situation specctl exists for: a mixture-of-experts target where an operator hand-picked
# "speculation off from batch 5", on traffic whose load and acceptance change. The profile is measured
# (benchmarks/results/gpu-2026-12-07-moe-profile-h100.json): the GPU testbed's MoE target through the plugin
DEMO_PROFILE = "h100-sglang-smollm2-135m-moe-triton-specctl"
DEMO_WORKLOAD = "code-chat-ramp"
OPERATOR_THRESHOLD = 5
RATIO_WORDS = "(x = specctl's tokens/s over that policy's, same workload and seed: above 1, specctl is faster)"


def _shipped(kind: str) -> str:
    # names for --help, without importing the simulator (numpy) on every `specctl` invocation
    from importlib import resources

    try:
        d = resources.files("specctl.training").joinpath("data", kind)
        return ", ".join(sorted(e.name[:-5] for e in d.iterdir() if e.name.endswith(".json")))
    except (ModuleNotFoundError, OSError):
        return "see `specctl bench sim --list`"


def _quiet_engine_logs() -> None:
    # the simulated engines and the in-process service log every policy switch; in a benchmark
    # those are figures in the table, not news. Restored when the command ends: a caller in the same
    # process (tests, an embedding program) keeps its own levels
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        quiet = {"specctl.plugin": logging.ERROR, "specctl.service": logging.ERROR,
                 "matplotlib": logging.WARNING}  # matplotlib: its font-cache notice on a first plot
        saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in quiet]
        for n, level in quiet.items():
            logging.getLogger(n).setLevel(level)
        ctx = click.get_current_context(silent=True)
        if ctx is not None:
            ctx.call_on_close(lambda: [lg.setLevel(lv) for lg, lv in saved])


def _load(profile: str, workload: str):
    from ..training.simulator import SimFileError, load_profile, load_workload

    try:
        return load_profile(profile), load_workload(workload)
    except SimFileError as e:
        raise click.UsageError(str(e)) from None


@click.group()
def bench() -> None:
    """Benchmarks: policies on the simulator (CPU only)."""


def _profile_words(name_or_path: str, profile: Any) -> tuple[str, str]:
    """The profile named for a reader, short and long: a synthetic one (its note says so) says so,
    with what it models; a measured one (its note starts "measured:") says where it was measured."""
    from ..training.simfiles import SimFileError, resolve

    try:
        note = json.loads(resolve(name_or_path, "profiles").read_text()).get("note", "")
    except (OSError, ValueError, SimFileError):
        note = ""
    note = note if isinstance(note, str) else ""
    what = note.partition(":")[2].partition(";")[0].strip()
    if note.lower().startswith("measured:"):
        return (f"measured profile {profile.name}",
                f"measured profile {profile.name}" + (f" ({what})" if what and len(what) <= 80 else ""))
    if not note.lower().startswith("synthetic"):
        return f"profile {profile.name}", f"profile {profile.name}"
    what = f"{what}; modelled, not measured" if what and len(what) <= 80 else "modelled, not measured"
    return f"synthetic profile {profile.name}", f"synthetic profile {profile.name} ({what})"


@bench.command("sim")
@click.option("--profile", "profile_name",
              help="Cost profile: a JSON file or a shipped name (e.g. h100-sglang-smollm2-135m-moe-triton-specctl).")
@click.option("--workload", "workload_name",
              help="Workload: a JSON file or a shipped name (e.g. ramp).")
@click.option("--policy", "policies", multiple=True,
              help="off | static:<config> | threshold:<N>:<config> | sglang-ema | adaptive | oracle "
                   "(repeatable; default: all, plus the searched best static and best threshold).")
@click.option("--search/--no-search", default=None,
              help="Also search the best static config and best threshold (default: on without --policy).")
@click.option("--seed", type=int, help="Override the workload's seed.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the JSON record here.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), help="Write a PNG: decisions and throughput over time.")
@click.option("--live", "live", metavar="TELEMETRY,POLICY",
              help="Also run `adaptive` live against a running `specctl serve` (its telemetry and "
                   "policy endpoints), in wall-clock time.")
@click.option("--jobs", default=1, show_default=True, type=click.IntRange(min=1),
              help="Simulate policies in this many processes.")
@click.option("--list", "list_only", is_flag=True, help="List the shipped profiles and workloads.")
def bench_sim(profile_name: Optional[str], workload_name: Optional[str], policies: tuple[str, ...], search: Optional[bool],
              seed: Optional[int], json_out: Optional[str], plot_out: Optional[str], live: Optional[str],
              jobs: int, list_only: bool) -> None:
    """Run policies on one seeded simulated workload; print tokens/s, TPOT and the oracle ratio."""
    from ..policies.baselines import parse_policy_name
    from . import simbench
    from ..training.simulator import shipped_names

    if list_only:
        click.echo("profiles:  " + " ".join(shipped_names("profiles")))
        click.echo("workloads: " + " ".join(shipped_names("workloads")))
        return
    if not profile_name or not workload_name:
        raise click.UsageError("--profile and --workload are required (see --list for the shipped ones)")
    profile, workload = _load(profile_name, workload_name)
    _quiet_engine_logs()
    try:
        for p in policies:
            parse_policy_name(p)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    try:
        rep = simbench.run_bench(profile, workload, list(policies) or None, seed=seed, search=search,
                                 jobs=jobs, progress=lambda m: click.echo(m, err=True))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if live:
        tel, _, pub = live.partition(",")
        if not tel or not pub:
            raise click.UsageError("--live needs TELEMETRY,POLICY endpoints, e.g. "
                                   "ipc:///run/specctl/telemetry.sock,ipc:///run/specctl/policy.sock")
        click.echo(f"live: driving `adaptive` against {tel} / {pub} for {workload.duration_s:.0f} s", err=True)
        res = _run_live(profile, workload, tel, pub, seed=seed, show=True)
        rep.results.append(res)
        rep.labels.append("adaptive over live ZeroMQ against specctl serve")
    click.echo(simbench.format_report(rep))
    cmd = " ".join(["specctl bench sim", "--profile", profile_name, "--workload", workload_name]
                   + [f"--policy {p}" for p in policies] + ([f"--seed {seed}"] if seed is not None else [])
                   + (["--search"] if search else ["--no-search"] if search is False else [])
                   + ([f"--live {live}"] if live else []))
    if json_out:
        simbench.write_json(rep, json_out, {"command": cmd})
        click.echo(f"wrote {json_out}", err=True)
    if plot_out:
        try:
            simbench.plot(rep.results, plot_out, subtitle=f"{_profile_words(profile_name, profile)[1]} · "
                          f"workload {workload.name}, seed {rep.seed}", workload=workload)
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"wrote {plot_out}", err=True)


class _Progress:
    """The live run as one progress line, redrawn in place on a terminal; one line per finished
    phase everywhere (the only lines when the output is not a terminal)."""

    BAR_WIDTH = 16

    def __init__(self, workload: Any, *, out: Optional[TextIO] = None, tty: Optional[bool] = None,
                 every_s: float = 0.2, window_s: float = 1.0):
        self.out = out if out is not None else sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.every_s = every_s
        self.window_s = window_s
        self.duration_s = workload.duration_s
        self.policy: Any = None
        self._ends = list(accumulate(p.duration_s for p in workload.phases))
        self._names = [p.name or f"phase {i + 1}" for i, p in enumerate(workload.phases)]
        self._name_width = max(len(n) for n in self._names)
        self._phase = 0
        self._phase_tok = 0
        self._phase_bs = 0
        self._phase_steps = 0
        self._recent: deque[tuple[float, int]] = deque()
        self._last_draw = float("-inf")

    def on_policy(self, rec: Any) -> None:
        self.policy = rec

    def on_step(self, t: float, bs: int, k: int, tokens: int) -> None:
        while self._phase < len(self._ends) - 1 and t >= self._ends[self._phase]:
            self._finish_phase()
        self._phase_tok += tokens
        self._phase_bs += bs
        self._phase_steps += 1
        self._recent.append((t, tokens))
        while self._recent and t - self._recent[0][0] > self.window_s:
            self._recent.popleft()
        now = time.monotonic()
        if self.tty and now - self._last_draw >= self.every_s:
            self._last_draw = now
            span = t - self._recent[0][0]
            # a step's tokens land at its end: the oldest step's count before the window opened
            rate = (sum(n for _, n in self._recent) - self._recent[0][1]) / span if span > 0 else 0.0
            self._draw(self._line(t, self._names[self._phase], bs, rate))

    def finish(self) -> None:
        """The last phase's line (call once, after the run)."""
        self._finish_phase()
        self._phase = len(self._ends)

    def _finish_phase(self) -> None:
        if self._phase >= len(self._ends):
            return
        end = self._ends[self._phase]
        start = self._ends[self._phase - 1] if self._phase else 0.0
        steps = max(self._phase_steps, 1)
        line = self._line(end, self._names[self._phase], round(self._phase_bs / steps),
                          self._phase_tok / max(end - start, 1e-9))
        if self.tty:
            self._draw(line)
            self.out.write("\n")
        else:
            self.out.write(line + "\n")
        self.out.flush()
        self._phase += 1
        self._phase_tok = self._phase_bs = self._phase_steps = 0

    def _line(self, t: float, phase: str, bs: int, rate: float) -> str:
        done = min(1.0, max(0.0, t / self.duration_s)) if self.duration_s > 0 else 1.0
        fill = round(done * self.BAR_WIDTH)
        w = len(f"{self.duration_s:.0f}")
        return (f"[{'#' * fill}{'.' * (self.BAR_WIDTH - fill)}] {t:{w}.0f}/{self.duration_s:.0f} s  "
                f"{phase:<{self._name_width}}  batch {bs:>3}  {rate:5.0f} tok/s  {self._policy_words()}")

    def _policy_words(self) -> str:
        if self.policy is None:
            return "policy: none yet (the engine's fallback)"
        rows = " ".join(f"{_band(r.min_batch, r.max_batch)}:{r.config.name}" for r in self.policy.table)
        return f"policy v{self.policy.version}: {rows}"

    def _draw(self, line: str) -> None:
        # cut to the terminal's width: a wrapped line could not be redrawn in place
        cols = shutil.get_terminal_size((100, 24)).columns
        self.out.write("\r\x1b[2K" + line[:max(20, cols - 1)])
        self.out.flush()


def _band(lo: int, hi: Optional[int]) -> str:
    return f"{lo}+" if hi is None else str(lo) if hi == lo else f"{lo}-{hi}"


def _run_live(profile: Any, workload: Any, telemetry: str, policy_ep: str, *, seed: Optional[int] = None,
              show: bool = True) -> Any:
    from .simbench import LiveAdaptivePolicy
    from ..training.simulator import simulate

    view = _Progress(workload)
    t0 = time.monotonic()
    pol = LiveAdaptivePolicy(profile, telemetry, policy_ep, name="adaptive-live", clock=time.time,
                             on_policy=view.on_policy)
    try:
        res = simulate(profile, workload, pol, seed=seed, on_step=view.on_step if show else None,
                       clock=lambda: time.monotonic() - t0)
    finally:
        pol.close()
    if show:
        view.finish()
    return res


@click.command()
@click.option("--profile", "profile_name", default=DEMO_PROFILE, show_default=True,
              help=f"Cost profile: a JSON file or a shipped name ({_shipped('profiles')}).")
@click.option("--workload", "workload_name", default=DEMO_WORKLOAD, show_default=True,
              help=f"Workload: a JSON file or a shipped name ({_shipped('workloads')}); the live part "
                   "runs for as long as the workload lasts (the default: 40 s).")
@click.option("--plot", "plot_out", default="specctl-demo.png", show_default=True,
              type=click.Path(dir_okay=False), help="Where to write the PNG.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the JSON record.")
def demo(profile_name: str, workload_name: str, plot_out: str, json_out: Optional[str]) -> None:
    """Start `specctl serve`, drive a simulated SGLang engine against it over ZeroMQ for the length of
    the workload, then compare it, on the same seeded workload, with an operator's hand-picked
    threshold (speculation below batch 5, plain decode from 5), SGLang's built-in adaptive policy,
    speculation off, every static configuration and the oracle. Prints the verdict first, then the
    details, and the verdict again as its last line (`verdict: ...`); writes a PNG. Needs no GPU.

    By default: the cost profile measured on the GPU testbed's mixture-of-experts target (128 experts,
    top-8; H100, SGLang 0.5.17, triton, through the plugin: h100-sglang-smollm2-135m-moe-triton-specctl)
    on code traffic ramping up, a mixed surge and chat ramping down (code-chat-ramp). The synthetic
    (modelled, not measured) 1T INT4 MoE served TP8 over PCIe: --profile moe-1t-int4-tp8-pcie."""
    from ..controller.daemon import wait_for_status
    from . import simbench

    profile, workload = _load(profile_name, workload_name)
    short, long = _profile_words(profile_name, profile)
    _quiet_engine_logs()
    chains = [n for n, c in zip(profile.config_names, profile.configs) if c[1] == 1]
    with tempfile.TemporaryDirectory(prefix="specctl-demo-") as tmp:
        eps = {k: f"ipc://{tmp}/{k}.sock" for k in ("telemetry", "policy", "status")}
        log_path = Path(tmp) / "serve.log"
        cmd = [sys.executable, "-m", "specctl.controller.cli", "--log-level", "WARNING", "serve",
               "--telemetry", eps["telemetry"], "--publish", eps["policy"], "--status", eps["status"],
               "--state-dir", str(Path(tmp) / "state"), "--refit-interval", "1", "--heartbeat", "0.5",
               "--configs", " ".join(chains)]
        click.echo(f"starting specctl serve (state and sockets in {tmp}) ...")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        try:
            import zmq

            ctx = zmq.Context()
            try:
                wait_for_status(ctx, eps["status"], timeout_s=20.0)
            except Exception as e:  # noqa: BLE001 - report the daemon's own words
                raise click.ClickException(f"specctl serve did not come up: {e}\n{log_path.read_text()[-2000:]}")
            finally:
                ctx.term()
            click.echo(f"a simulated engine ({short}, workload {workload.name}) drives it over ZeroMQ "
                       f"for {workload.duration_s:.0f} s:")
            live = _run_live(profile, workload, eps["telemetry"], eps["policy"])
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    names = ["off"] + [f"static:{n}" for n, c in zip(profile.config_names, profile.configs) if c[0] > 0]
    operator = None
    if profile.off_index is not None:
        fb = simbench._fallback_config(profile)
        if fb[0] > 0:
            operator = f"threshold:{OPERATOR_THRESHOLD}:{simbench.config_label(profile, fb)}"
            names.append(operator)
    names += ["sglang-ema", "adaptive", "oracle"]
    rep = simbench.run_bench(profile, workload, names, search=False)
    rep.results.insert(len(rep.results) - 1, live)
    rep.labels.insert(len(rep.labels) - 1, "adaptive over live ZeroMQ against specctl serve")
    head, ratios = simbench.verdict_lines(rep, live.policy, operator or "off")
    click.echo()
    click.secho(head, bold=True)
    if ratios:
        click.secho(ratios, bold=True)
    click.echo(RATIO_WORDS)
    click.echo("\ndetails: the same workload and seed, every policy on the simulator's virtual clock "
               "(adaptive-live: the run above)")
    click.echo(simbench.format_report(rep))
    line = simbench.verdict(rep, live.policy, operator or "off", label="specctl (live, against specctl serve)")
    click.echo()
    if json_out:
        simbench.write_json(rep, json_out, {"command": "specctl demo"
                                            + (f" --profile {profile_name}" if profile_name != DEMO_PROFILE else "")
                                            + (f" --workload {workload_name}" if workload_name != DEMO_WORKLOAD else ""),
                                            "verdict": line})
        click.echo(f"wrote {json_out}")
    try:
        simbench.plot(rep.results, plot_out, head, f"{long} · workload {workload.name}, seed {rep.seed}\n"
                      + RATIO_WORDS, ratios=ratios, operator=operator, workload=workload)
        click.echo(f"wrote {plot_out}")
    except RuntimeError as e:
        click.echo(f"(no plot: {e})")
    click.echo(line)  # last: scripts read it
