"""The `specctl` command line: parse, build objects, call one function."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import click

from . import settings as _settings
from . import transport, wire
from .cli_options import CONFIG_HELP, CONFIGS_HELP, Commands, config_callback, configs_callback, oserror_line


def _env() -> dict[str, str]:
    return dict(os.environ)


def _parse_metrics(ctx: click.Context, param: click.Parameter, value: Optional[str]):
    """'[HOST:]PORT' -> (host, port); IPv6 hosts in brackets ('[::1]:9090')."""
    if not value:
        return None
    host, sep, port = value.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    try:
        p = int(port)
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected [HOST:]PORT, e.g. 9464 or 0.0.0.0:9464") from None
    if not 0 < p < 65536 or not host:
        raise click.BadParameter(f"{value!r}: expected [HOST:]PORT with a port in 1..65535")
    return host, p


_parse_configs = configs_callback  # the name older callers import

ENV_CURVE_SECRET = "SPECCTL_CURVE_SECRET_KEY"  # this client's certificate (NAME.key_secret)
ENV_CURVE_SERVER = "SPECCTL_CURVE_SERVER_KEY"  # the daemon's public certificate (server.key)


def _client_keys(env: dict[str, str]) -> Optional[transport.CurveKeys]:
    """CURVE client keys for talking to a daemon started with --curve-secret-key: the same
    SPECCTL_CURVE_* names the SGLang plugin reads."""
    secret, server = env.get(ENV_CURVE_SECRET), env.get(ENV_CURVE_SERVER)
    if not secret and not server:
        return None
    if not (secret and server):
        raise click.UsageError(f"set both {ENV_CURVE_SECRET} and {ENV_CURVE_SERVER} (or neither)")
    try:
        return transport.load_client_keys(secret, server)
    except OSError as e:
        raise click.UsageError(f"CURVE keys from {ENV_CURVE_SECRET}/{ENV_CURVE_SERVER}: {oserror_line(e)}") from None
    except ValueError as e:
        raise click.UsageError(f"CURVE keys from {ENV_CURVE_SECRET}/{ENV_CURVE_SERVER}: {e}") from None


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="Log verbosity; DEBUG also prints the traceback behind an error.")
def main(log_level: str) -> None:
    """specctl: decides, every decode step, whether SGLang speculates with EAGLE-3 (and how)."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# --------------------------------------------------------------------------- serve


@main.command()
@click.option("--telemetry", help="Telemetry endpoint to bind (PULL). Default: ipc in the runtime dir.")
@click.option("--publish", help="Policy endpoint to bind (PUB). Default: ipc in the runtime dir.")
@click.option("--status", "status_ep", help="Status endpoint to bind (REP). Default: ipc in the runtime dir.")
@click.option("--state-dir", type=click.Path(file_okay=False),
              help="Where policy and model state persist (one daemon per state dir). "
                   "Default: $XDG_STATE_HOME/specctl, else ~/.local/state/specctl.")
@click.option("--refit-interval", default=1.0, show_default=True, type=click.FloatRange(min=0.01),
              help="Seconds between refits.")
@click.option("--heartbeat", default=2.0, show_default=True, type=click.FloatRange(min=0.01),
              help="Seconds between re-publications of an unchanged policy.")
@click.option("--switch-z", default=2.0, show_default=True, type=click.FloatRange(min=0.0),
              help="The uncertainty acted on, in standard errors of a goodput difference (acceptance and "
                   "step time): a table boundary moves only where the better configuration leads by more, "
                   "and a configuration is measured while it may lead the table's choice by more than 1% "
                   "within it; 0 = the 1% margin alone, and only predicted wins measured.")
@click.option("--mode", type=click.Choice(["online", "fixed"]), default="online", show_default=True,
              help="online: fit telemetry and publish the learned table; fixed: publish the fixed-threshold "
                   "table (--threshold, --config) and only record.")
@click.option("--threshold", default=5, show_default=True, type=click.IntRange(min=1),
              help="Fixed mode and fallback: plain decode from this batch size up.")
@click.option("--config", "fixed_config", default="s3", show_default=True, callback=config_callback,
              help=f"Fixed mode and fallback: the configuration used below the threshold: {CONFIG_HELP}.")
@click.option("--configs", callback=configs_callback,
              help=f"Configurations the engines have runtime states for, {CONFIGS_HELP} "
                   "(default: those seen in telemetry). See `specctl sglang-args`.")
@click.option("--explore-period", default=64, show_default=True, type=click.IntRange(min=0),
              help="The exploration budget: one step in N runs a configuration worth measuring (unmeasured, "
                   "thinly or long ago measured, or within --switch-z standard errors of winning); "
                   "0 = never; >= 50.")
@click.option("--metrics", "metrics_addr", callback=_parse_metrics, metavar="[HOST:]PORT",
              help="Serve Prometheus /metrics here (HOST defaults to 127.0.0.1).")
@click.option("--init-policy", type=click.Path(exists=True, dir_okay=False),
              help="Policy file (specctl train) to start from when the state dir holds none.")
@click.option("--record", type=click.Path(file_okay=False), help="Record accepted telemetry here (rotating .jsonl.gz).")
@click.option("--record-max-mb", default=1024, show_default=True, type=click.IntRange(min=1),
              help="Disk the --record files may take, in MiB (the oldest go first).")
@click.option("--curve-secret-key", type=click.Path(exists=True, dir_okay=False),
              help="Server certificate (specctl keys generate): enables CURVE on every endpoint.")
@click.option("--curve-allowed-dir", type=click.Path(exists=True, file_okay=False),
              help="Directory of client public certificates allowed to connect.")
@click.option("--insecure", is_flag=True, help="Allow binding non-loopback tcp without CURVE keys.")
@click.option("--ctx-axis/--no-ctx-axis", default=True, show_default=True,
              help="Where telemetry carries ctx_tokens and step time depends on it, publish a table per "
                   "band of mean context per request (--no-ctx-axis: one table for any context).")
@click.option("--shed-when-behind", is_flag=True,
              help="When telemetry arrives faster than it can be fitted, fit every other record "
                   "(counted as shed) instead of back-pressuring the senders.")
def serve(telemetry, publish, status_ep, state_dir, refit_interval, heartbeat, switch_z, mode,
          threshold, fixed_config, configs, explore_period, metrics_addr, init_policy,
          record, record_max_mb, curve_secret_key, curve_allowed_dir, insecure,
          ctx_axis, shed_when_behind) -> None:
    """Run the sidecar daemon: ingest telemetry, fit, publish the policy."""
    import signal

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    # until the loop runs (it stops on SIGTERM by itself): a SIGTERM during start-up unwinds, so
    # that what was already claimed (state dir lock, sockets) is given back
    signal.signal(signal.SIGTERM, _exit)
    from .daemon import Daemon, Endpoints, serve_forever
    from .metrics import Metrics
    from .service import ControllerService, ServiceSettings
    from .state import StateStore, state_lock

    env = _env()
    defaults = _settings.default_endpoints(env)
    eps = Endpoints(telemetry=telemetry or defaults["telemetry"], publish=publish or defaults["publish"],
                    status=status_ep or defaults["status"])
    for name, ep in (("--telemetry", eps.telemetry), ("--publish", eps.publish), ("--status", eps.status)):
        why = transport.check_endpoint(ep, insecure=True)  # the form only: keys are checked below
        if why:
            raise click.BadParameter(why, param_hint=name)
    try:
        svc_settings = ServiceSettings(mode=mode, threshold=threshold, fixed_config=fixed_config,
                                       refit_interval_s=refit_interval, heartbeat_s=heartbeat,
                                       switch_z=switch_z, candidates=configs,
                                       explore_period=explore_period, ctx_axis=ctx_axis)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    init = None
    if init_policy:
        try:
            init = wire.decode_policy(Path(init_policy).read_bytes())
        except OSError as e:
            raise click.BadParameter(f"{init_policy}: {e.strerror or e}", param_hint="--init-policy") from None
        except wire.WireError as e:
            raise click.BadParameter(f"{init_policy}: not a policy file: {e}", param_hint="--init-policy") from None
    keys = None
    if curve_secret_key:
        try:
            keys = transport.load_server_keys(curve_secret_key, curve_allowed_dir)
        except (OSError, ValueError) as e:
            raise click.BadParameter(f"{curve_secret_key}: not a CURVE certificate ({e})",
                                     param_hint="--curve-secret-key") from None
    elif curve_allowed_dir:
        raise click.UsageError("--curve-allowed-dir needs --curve-secret-key")
    state_dir = Path(state_dir or _settings.state_base(env))
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        lock = state_lock(state_dir).acquire()
    except transport.LockHeld as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.BadParameter(f"cannot use {state_dir}: {oserror_line(e)}", param_hint="--state-dir") from None
    try:
        store = StateStore(state_dir)
        recorder = None
        if record:
            from .recorder import Recorder

            recorder = Recorder(record, max_bytes=record_max_mb * 1024 * 1024)
        service = ControllerService(svc_settings, store=store, metrics=Metrics(), recorder=recorder,
                                    init_policy=init)
        for problem in store.problems:
            click.echo(f"state: {problem}", err=True)
        metrics_host, metrics_port = metrics_addr or ("127.0.0.1", None)
        try:
            daemon = Daemon(service, eps, keys=keys, insecure=insecure, metrics_port=metrics_port,
                            metrics_host=metrics_host, shed_when_behind=shed_when_behind)
        except transport.TransportError as e:
            if recorder is not None:
                recorder.close()
            raise click.ClickException(str(e)) from None
        click.echo(f"specctl serve (pid {os.getpid()}): policy v{service.policy.version} ({service.policy.source}) "
                   f"from {store.dir}; telemetry {eps.telemetry}; policy {eps.publish}; status {eps.status}"
                   + (f"; metrics http://{metrics_host}:{metrics_port}/metrics" if metrics_port else ""),
                   err=True)
        serve_forever(daemon)
    finally:
        lock.release()


# --------------------------------------------------------------------------- policy show


@main.group()
def policy() -> None:
    """Inspect policies."""


@policy.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print the policy JSON (docs/architecture.md).")
@click.option("--state-dir", type=click.Path(exists=True, file_okay=False), help="Read the daemon's persisted policy.")
@click.option("--endpoint", help="Ask a running daemon (its status endpoint; default: ipc in the runtime dir).")
@click.option("--file", "file_", type=click.Path(dir_okay=False), help="Read a policy file.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Draw goodput vs batch size to this PNG.")
def policy_show(as_json: bool, state_dir: Optional[str], endpoint: Optional[str],
                file_: Optional[str], plot: Optional[str]) -> None:
    """Show the current policy: table, predicted goodput, samples, version, age, source."""
    from . import show
    from .state import StateStore

    if sum(x is not None for x in (state_dir, endpoint, file_)) > 1:
        raise click.UsageError("give at most one of --state-dir, --endpoint, --file")
    env = _env()
    if file_:
        try:
            pol = wire.decode_policy(Path(file_).read_bytes())
        except OSError as e:
            raise click.ClickException(f"{file_}: {e.strerror}") from None
        except wire.WireError as e:
            raise click.ClickException(f"{file_}: not a valid policy: {e}") from None
    elif state_dir is not None:
        store = StateStore(state_dir)
        pol = store.load_policy()
        for p in store.problems:
            click.echo(f"state: {p}", err=True)
        if pol is None:
            raise click.ClickException(f"no policy in {state_dir}")
    else:
        ep = endpoint or _settings.default_endpoints(env)["status"]
        import zmq

        try:
            obj = transport.status_request(zmq.Context.instance(), ep, {"cmd": "policy"},
                                           keys=_client_keys(env))
            pol = wire.policy_from_obj(obj)
        except transport.TransportError as e:
            raise click.ClickException(str(e)) from None
        except wire.WireError as e:
            raise click.ClickException(f"{ep} answered with an invalid policy: {e}") from None
    if as_json:
        click.echo(json.dumps(wire.to_obj(pol), indent=2))
    else:
        click.echo(show.render(pol))
    if plot:
        try:
            show.plot(pol, plot)
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"wrote {plot}", err=True)


# --------------------------------------------------------------------------- replay


@main.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--to", "endpoint", help="Daemon telemetry endpoint (default: ipc in the runtime dir).")
@click.option("--speed", type=click.FloatRange(min=0.001),
              help="Pace at X times the recorded cadence (default: as fast as the daemon takes it).")
def replay(file: str, endpoint: Optional[str], speed: Optional[float]) -> None:
    """Stream recorded telemetry (.jsonl / .jsonl.gz) into a running daemon."""
    from .replay import replay_to

    env = _env()
    ep = endpoint or _settings.default_endpoints(env)["telemetry"]
    try:
        rep = replay_to(file, ep, speed=speed, keys=_client_keys(env))
    except transport.TransportError as e:
        raise click.ClickException(f"nothing sent: {e}") from None
    click.echo(f"sent {rep.sent} records to {ep}; skipped {rep.skipped} lines")
    for p in rep.problems:
        click.echo(f"  {p}", err=True)
    if rep.sent == 0:
        sys.exit(1)


# --------------------------------------------------------------------------- doctor


@main.command()
@click.option("--endpoint", help="A daemon's status endpoint to ask (default: ipc in the runtime dir; "
                                 "asked unless only --log is given).")
@click.option("--log", "logs", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An SGLang server log to read (repeatable: one per server, or per rank).")
@click.option("--server", help="Server name for log lines that do not say it (plugins without the start-up "
                               "line). Default: the log file's name.")
@click.option("--stale-after", default=30.0, show_default=True, type=click.FloatRange(min=0.1),
              help="A server silent this many seconds (no telemetry at the daemon) is a problem.")
@click.option("--timeout", "timeout_s", default=3.0, show_default=True, type=click.FloatRange(min=0.1),
              help="Seconds to wait for the daemon's answer.")
@click.option("--rules", is_flag=True, help="Print what counts as a problem (exit 1) and what as a warning, and exit.")
def doctor(endpoint: Optional[str], logs: tuple[str, ...], server: Optional[str], stale_after: float,
           timeout_s: float, rules: bool) -> None:
    """Is specctl working? Per server and TP rank: whether the plugin loaded and its hooks took
    effect, the off path and patches in force (or off, and why), the policy version and its age,
    whether the fixed-threshold fallback is in force (and why), and telemetry rate and drops.
    Exits 1 when something is wrong (see --rules)."""
    from . import doctor as dr

    if rules:
        click.echo(dr.RULES)
        return
    env = _env()
    sections: list[tuple[str, list[str]]] = []
    findings: list[dr.Finding] = []
    reply = None
    if endpoint is not None or not logs:
        ep = endpoint or _settings.default_endpoints(env)["status"]
        import zmq

        try:
            reply = transport.status_request(zmq.Context.instance(), ep, {"cmd": "status"},
                                             timeout_ms=int(timeout_s * 1000), keys=_client_keys(env))
            if "error" in reply:
                raise transport.TransportError(f"{ep} answered an error: {reply['error']}")
            body, found = dr.check_status(reply, ep, stale_after)
            sections.append((body[0], body[1:]))
            findings += found
        except transport.TransportError as e:
            reply = None
            sections.append((f"daemon {ep}: no answer", []))
            findings.append(dr.Finding(dr.PROBLEM, ep, str(e)))
    reports = []
    for path in logs:
        rep = dr.read_log(path, server)
        reports.append(rep)
        body, found = dr.check_log(rep)
        span = (f", {rep.first_ts:%Y-%m-%d %H:%M:%S} to {rep.last_ts:%H:%M:%S}"
                if rep.first_ts and rep.last_ts else "")
        sections.append((f"log {path} ({rep.num_lines} lines{span}):", body))
        findings += found
    findings += dr.compare(reply, reports)
    click.echo(dr.render(sections, findings))
    if any(f.level == dr.PROBLEM for f in findings):
        sys.exit(1)


# --------------------------------------------------------------------------- keys


@main.group()
def keys() -> None:
    """CURVE keys for endpoints reachable from other hosts."""


@keys.command("generate")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--name", default="server", show_default=True, help="Certificate base name.")
def keys_generate(directory: str, name: str) -> None:
    """Write NAME.key (public) and NAME.key_secret (0600) into DIRECTORY."""
    if not name or "/" in name or name.startswith("."):
        raise click.BadParameter(f"{name!r}: a plain file name, e.g. server or engine-0", param_hint="--name")
    pub, sec = transport.create_certificates(directory, name)
    click.echo(f"public: {pub}\nsecret: {sec}")


# Sub-commands that live in their own modules (each a thin layer over its package). The benchmark
# and demo commands are the harness's: specctl.harness.cli adds them to this group.
from .cli_sglang import sglang_args  # noqa: E402
from .cli_train import train  # noqa: E402

for _cmd in (sglang_args, train):
    main.add_command(_cmd)


if __name__ == "__main__":
    main()
