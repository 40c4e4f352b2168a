"""Where things live by default, computed from an environment mapping handed in by the edge
(CLI or plugin `register()`); library code never reads `os.environ` itself."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from . import transport


def runtime_base(environ: Mapping[str, str]) -> Path:
    """Private runtime dir for ipc sockets: $SPECCTL_RUNDIR, else $XDG_RUNTIME_DIR/specctl,
    else /tmp/specctl-<uid>. The plugin resolves the same way, so both sides meet by default."""
    if environ.get("SPECCTL_RUNDIR"):
        return Path(environ["SPECCTL_RUNDIR"])
    if environ.get("XDG_RUNTIME_DIR"):
        return Path(environ["XDG_RUNTIME_DIR"]) / "specctl"
    return Path(f"/tmp/specctl-{os.getuid()}")


def state_base(environ: Mapping[str, str]) -> Path:
    """The daemon's state dir unless --state-dir names one: $XDG_STATE_HOME/specctl, else ~/.local/state/specctl."""
    if environ.get("XDG_STATE_HOME"):
        return Path(environ["XDG_STATE_HOME"]) / "specctl"
    return Path.home() / ".local" / "state" / "specctl"


ENV_ENDPOINTS = {"telemetry": "SPECCTL_TELEMETRY", "publish": "SPECCTL_POLICY"}  # the plugin's names; status: --status


def default_endpoints(environ: Mapping[str, str]) -> dict[str, str]:
    """telemetry / publish / status endpoints in the runtime dir; SPECCTL_TELEMETRY and SPECCTL_POLICY (the
    plugin's names, so one environment serves both sides) override the first two."""
    eps = transport.default_endpoints(runtime_base(environ))
    for name, var in ENV_ENDPOINTS.items():
        if environ.get(var):
            eps[name] = environ[var]
    return eps
