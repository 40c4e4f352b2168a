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
    if environ.get("SPECCTL_STATE_DIR"):
        return Path(environ["SPECCTL_STATE_DIR"])
    if environ.get("XDG_STATE_HOME"):
        return Path(environ["XDG_STATE_HOME"]) / "specctl"
    return Path.home() / ".local" / "state" / "specctl"


ENV_ENDPOINTS = {"telemetry": "SPECCTL_TELEMETRY", "publish": "SPECCTL_POLICY", "status": "SPECCTL_STATUS"}


def default_endpoints(environ: Mapping[str, str]) -> dict[str, str]:
    """telemetry / publish / status endpoints; SPECCTL_TELEMETRY, SPECCTL_POLICY and
    SPECCTL_STATUS override the runtime-dir defaults (same names as the plugin's)."""
    eps = transport.default_endpoints(runtime_base(environ))
    for name, var in ENV_ENDPOINTS.items():
        if environ.get(var):
            eps[name] = environ[var]
    return eps
