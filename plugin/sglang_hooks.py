"""The registry: which hooks specctl puts into SGLang, and in which order.

    the seam (plugin/runtime.py, plugin/policy.py)
        REPLACE  AdaptiveSpeculativeParams               -> SpecctlSpeculativeParams: decide() per decode batch
        AROUND   EAGLEWorkerV2.forward_batch_generation  step time (CUDA events, rank 0) and the batch's context
        AFTER    SchedulerBatchResultProcessor._resolve_spec_v2_tokens   telemetry and the TP policy sync
    the patches (plugin/patches/, each through plugin/guard.py; SPECCTL_PATCHES switches them)
        trees, trivial_verify, splitkv, draft_graphs, spec_alloc, fi_plan, fi_extend, host_lens, plain_decode,
        catchup
    AFTER EAGLEWorkerV2.init_cuda_graphs, last: the start-up line (`specctl: startup {json}`)

Imported only inside SGLang scheduler processes (plugin/__init__.py gates it). Nothing is published (the runtime,
a hook) until every part is built; a hook's own error turns its patch off and hands the step to SGLang's path.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from typing import Any, Callable, Optional

from . import runtime as _rt
from .guard import AFTER, AROUND, BEFORE, REPLACE
from .policy import make_policy_class
from .runtime import SGLANG_TARGETS, PluginRuntime, Targets
from .settings import PluginSettings

__all__ = ["install", "runtime", "PluginRuntime", "Targets", "SGLANG_TARGETS", "PATCHES"]

log = logging.getLogger("specctl.plugin")

# each patch's factory (module of plugin/patches, function): a Patch (its hooks) or None where it is off or has
# nothing to do in this SGLang; the order is the registration order (a later hook on a target wraps an earlier one)
PATCHES: tuple[tuple[str, str], ...] = (
    ("trees", "patch"), ("trees", "width_patch"), ("trivial_verify", "patch"), ("splitkv", "patch"),
    ("draft_graphs", "patch"), ("spec_alloc", "patch"), ("fi_plan", "patch"), ("fi_extend", "patch"),
    ("host_lens", "patch"),
    ("plain_decode", "patch"), ("catchup", "patch"),
)


def factories() -> list[Callable[[PluginRuntime], Any]]:
    """The patch factories, imported here (some patch modules import torch: only a scheduler process loads them)."""
    return [getattr(importlib.import_module(f"{__package__}.patches.{mod}"), fn) for mod, fn in PATCHES]


def install(settings: PluginSettings, *, targets: Targets = SGLANG_TARGETS, policy_file_bytes: Optional[bytes] = None,
            registry: Any = None, **runtime_kw: Any) -> PluginRuntime:
    """Build the runtime and every patch, then register all hooks (applied by load_plugins afterwards) and publish
    the runtime. Raises, with nothing registered or published, where any part of that fails."""
    if registry is None:
        from sglang.srt.plugins.hook_registry import HookRegistry as registry
    from sglang.srt.plugins.hook_registry import HookType

    kinds = {REPLACE: HookType.REPLACE, AROUND: HookType.AROUND, BEFORE: HookType.BEFORE, AFTER: HookType.AFTER}
    rt = PluginRuntime(settings, targets=targets, policy_file_bytes=policy_file_bytes, patches=factories(),
                       **runtime_kw)
    mod, name = targets.policy.rsplit(".", 1)
    hooks: list[tuple[str, Any, str]] = [
        (targets.policy, make_policy_class(getattr(pkgutil.resolve_name(mod), name)), REPLACE),
        (targets.forward, _rt.around_forward, AROUND),
        (targets.result, _rt.after_resolve, AFTER),
        *rt.guard.registrations(),
        (targets.init_graphs, _rt.after_init_graphs, AFTER),
    ]
    done: list[tuple[str, Any]] = []
    try:
        for target, fn, kind in hooks:
            registry.register(target, fn, kinds[kind])
            done.append((target, fn))
    except BaseException:
        _unregister(registry, done)
        raise
    _rt.publish(rt)
    return rt


def _unregister(registry: Any, done: list[tuple[str, Any]]) -> None:
    """Take back the hooks of a failed install (SGLang's registry has no unregister: its per-target lists)."""
    table = getattr(registry, "_hooks", None)
    if table is None:
        return
    for target, fn in done:
        entries = table.get(target, [])
        entries[:] = [e for e in entries if e[1] is not fn]
        if not entries:
            table.pop(target, None)


def runtime() -> Optional[PluginRuntime]:
    return _rt.current()
