"""Where things live by default, computed from an environment mapping handed in by the edge
(CLI or plugin `register()`); library code never reads `os.environ` itself."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from . import transport


def runtime_base(environ: Mapping[str, str]) -> Path:
    """Private runtime dir for ipc sockets: $SPECCTL_RUNTIME_DIR, else $XDG_RUNTIME_DIR/specctl,
    else /tmp/specctl-<uid>."""
    if environ.get("SPECCTL_RUNTIME_DIR"):
        return Path(environ["SPECCTL_RUNTIME_DIR"])
    if environ.get("XDG_RUNTIME_DIR"):
        return Path(environ["XDG_RUNTIME_DIR"]) / "specctl"
    return Path(f"/tmp/specctl-{os.getuid()}")


def state_base(environ: Mapping[str, str]) -> Path:
    if environ.get("SPECCTL_STATE_DIR"):
        return Path(environ["SPECCTL_STATE_DIR"])
    if environ.get("XDG_STATE_HOME"):
        return Path(environ["XDG_STATE_HOME"]) / "specctl"
    return Path.home() / ".local" / "state" / "specctl"


def default_endpoints(environ: Mapping[str, str]) -> dict[str, str]:
    """telemetry / publish / status endpoints, each overridable by SPECCTL_<NAME>_ENDPOINT."""
    eps = transport.default_endpoints(runtime_base(environ))
    for name in list(eps):
        override = environ.get(f"SPECCTL_{name.upper()}_ENDPOINT")
        if override:
            eps[name] = override
    return eps
