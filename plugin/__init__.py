"""specctl's SGLang plugin: entry point `sglang.srt.plugins: specctl = specctl.plugin:register`.

`register()` runs wherever SGLang calls load_plugins() (main, scheduler, detokenizer, DP
controller); it acts only inside scheduler processes, reads its `SPECCTL_*` settings once and
registers the hooks of plugin/sglang_hooks.py. The decision logic is plugin/engine.py.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Mapping, Optional

from .engine import EngineController, PolicyUpdate
from .settings import PluginSettings

__all__ = ["register", "EngineController", "PluginSettings", "PolicyUpdate", "default_rundir"]

log = logging.getLogger("specctl.plugin")
_registered = False

# the frame SGLang calls load_plugins() from in each scheduler process (0.5.15 .. 0.5.23)
SCHEDULER_ENTRY = "run_scheduler_process"


def default_rundir(env: Mapping[str, str]) -> str:
    """Where `specctl serve` puts its ipc sockets (controller/settings.py decides, for both sides)."""
    from ..controller.settings import runtime_base

    return str(runtime_base(env))


def in_scheduler_process() -> bool:
    return any(f.function == SCHEDULER_ENTRY for f in inspect.stack(context=0))


def register() -> None:
    """SGLang plugin entry point (zero arguments, side effects only, idempotent)."""
    global _registered
    if _registered or not in_scheduler_process():
        return
    _registered = True
    env = os.environ
    try:
        settings = PluginSettings.from_env(env, default_rundir=default_rundir(env))
    except ValueError as e:
        log.error("specctl: not installed, bad settings: %s", e)
        return
    if settings.mode == "off":
        log.info("specctl: SPECCTL_MODE=off, plugin inert")
        return
    install(settings)


def install(settings: PluginSettings, **kw: Any) -> Optional[Any]:
    """Register the hooks with these settings; returns the PluginRuntime (None on failure)."""
    policy_bytes = None
    if settings.mode == "file" and settings.policy_file:
        try:
            with open(settings.policy_file, "rb") as f:
                policy_bytes = f.read()
        except OSError as e:
            log.error("specctl: cannot read SPECCTL_POLICY_FILE %s: %s", settings.policy_file, e)
    try:
        from . import sglang_hooks

        return sglang_hooks.install(settings, policy_file_bytes=policy_bytes, **kw)
    except Exception as e:  # noqa: BLE001 - SGLang must start even if the plugin cannot
        # install() registers and publishes nothing unless every part of it was built: this is then true
        log.exception("specctl: hooks not registered (%s); SGLang runs its own policy", e)
        return None
