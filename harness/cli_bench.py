"""`specctl bench sim` and `specctl demo`: thin click commands over specctl.training.simbench."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import click

# the situation specctl exists for: a 1T INT4 MoE served TP8 over PCIe, where an operator
# hand-picked "speculation off from batch 5", on traffic whose load and acceptance change
DEMO_PROFILE = "moe-1t-int4-tp8-pcie"
DEMO_WORKLOAD = "code-chat-ramp"
OPERATOR_THRESHOLD = 5


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
    # those are figures in the table, not news
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in ("specctl.plugin", "specctl.service"):
            logging.getLogger(name).setLevel(logging.ERROR)
        logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font-cache notice on a first plot


def _load(profile: str, workload: str):
    from ..training.simulator import SimFileError, load_profile, load_workload

    try:
        return load_profile(profile), load_workload(workload)
    except SimFileError as e:
        raise click.UsageError(str(e)) from None


@click.group()
def bench() -> None:
    """Benchmarks: policies on the simulator (CPU only)."""


@bench.command("sim")
@click.option("--profile", "profile_name",
              help="Cost profile: a JSON file or a shipped name (e.g. moe-1t-int4-tp8-pcie).")
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
            simbench.plot(rep.results, plot_out)
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"wrote {plot_out}", err=True)


class _LiveView:
    """A few lines, redrawn in place on a terminal (one line per update otherwise)."""

    def __init__(self, profile: Any, workload: Any, every_s: float = 0.5):
        self.profile = profile
        self.workload = workload
        self.every_s = every_s
        self.tty = sys.stdout.isatty()
        self.policy: Any = None
        self.num_policies = 0
        self._last = time.monotonic()
        self._drawn = 0
        self._tok = 0
        self._steps: dict[int, int] = {}
        self._bs = 0
        ends = []
        acc = 0.0
        for p in workload.phases:
            acc += p.duration_s
            ends.append((acc, p.name))
        self._ends = ends

    def on_policy(self, rec: Any) -> None:
        if self.policy is None or rec.version != self.policy.version:
            self.num_policies += 1
        self.policy = rec

    def on_step(self, t: float, bs: int, k: int, tokens: int) -> None:
        self._tok += tokens
        self._bs = bs
        self._steps[k] = self._steps.get(k, 0) + 1
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        span = now - self._last
        self._last = now
        phase = next((n for e, n in self._ends if t < e), self._ends[-1][1])
        total = sum(self._steps.values()) or 1
        mix = " ".join(f"{self.profile.config_names[i]} {100 * n / total:.0f}%" for i, n in sorted(self._steps.items()))
        lines = [f"t={t:5.1f}/{self.workload.duration_s:.0f}s  phase {phase:<8} batch {bs:>3}  "
                 f"{self._tok / max(span, 1e-9):7.0f} tok/s  configs: {mix}"]
        if self.policy is None:
            lines.append("policy: none received yet (engine on its fixed-threshold fallback)")
        else:
            rows = ", ".join(
                f"{r.min_batch}{'+' if r.max_batch is None else '-' + str(r.max_batch)}:{r.config.name}"
                for r in self.policy.table)
            ev = (self.policy.model or {}).get("evidence", "")
            lines.append(f"policy v{self.policy.version} ({self.policy.source}): {rows}"
                         + (f"   [{ev}]" if ev and ev != "ok" else ""))
        self._tok = 0
        self._steps.clear()
        if self.tty:
            if self._drawn:
                sys.stdout.write(f"\x1b[{self._drawn}A")
            for ln in lines:
                sys.stdout.write("\x1b[2K" + ln[:160] + "\n")
            sys.stdout.flush()
            self._drawn = len(lines)
        else:
            click.echo(" | ".join(lines))


def _run_live(profile: Any, workload: Any, telemetry: str, policy_ep: str, *, seed: Optional[int] = None,
              show: bool = True) -> Any:
    from .simbench import LiveAdaptivePolicy
    from ..training.simulator import simulate

    view = _LiveView(profile, workload)
    t0 = time.monotonic()
    pol = LiveAdaptivePolicy(profile, telemetry, policy_ep, name="adaptive-live", clock=time.time,
                             on_policy=view.on_policy)
    try:
        return simulate(profile, workload, pol, seed=seed, on_step=view.on_step if show else None,
                        clock=lambda: time.monotonic() - t0)
    finally:
        pol.close()


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
    speculation off, every static configuration and the oracle; print one verdict line and write a
    PNG. Needs no GPU.

    By default: a 1T-parameter INT4 MoE served TP8 over PCIe (moe-1t-int4-tp8-pcie) on code traffic
    ramping up, a mixed surge and chat ramping down (code-chat-ramp). The dense 8B profile of earlier
    demos: --profile dense-8b-h200 --workload demo."""
    from ..controller.daemon import wait_for_status
    from . import simbench

    profile, workload = _load(profile_name, workload_name)
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
            click.echo(f"driving a simulated engine ({profile.name}, workload {workload.name}, "
                       f"{workload.duration_s:.0f} s) against it over ZeroMQ:\n")
            live = _run_live(profile, workload, eps["telemetry"], eps["policy"])
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    click.echo("\nsame workload, same seed, on the simulator's virtual clock:")
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
    click.echo(simbench.format_report(rep))
    line = simbench.verdict(rep, live.policy, operator or "off", label="specctl (live, against specctl serve)")
    click.echo("\n" + line)
    if json_out:
        simbench.write_json(rep, json_out, {"command": "specctl demo"
                                            + (f" --profile {profile_name}" if profile_name != DEMO_PROFILE else "")
                                            + (f" --workload {workload_name}" if workload_name != DEMO_WORKLOAD else ""),
                                            "verdict": line})
    try:
        simbench.plot(rep.results, plot_out, title=f"specctl demo: workload {workload.name} on {profile.name}",
                      subtitle=line)
        click.echo(f"\nwrote {plot_out}")
    except RuntimeError as e:
        click.echo(f"\n(no plot: {e})")
