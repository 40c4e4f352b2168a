"""One guard for every SGLang patch: its hooks registered and checked at start-up, its state, one way off.

A hook's own error turns its patch off for the process (logged once) and hands the step to SGLang's path;
SGLang's own errors are never swallowed and SGLang's call is never run twice by the guard.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterable, Optional

log = logging.getLogger("specctl.plugin")

AROUND, BEFORE, AFTER, REPLACE = "AROUND", "BEFORE", "AFTER", "REPLACE"


class Patch:
    """One SGLang patch: its hooks, what it built (`obj`, published by `build`) and whether it is on.

    `lost`: what the server does without it. `mode`: "on" or "check" (the patch compares its answer with SGLang's for a while).
    `must_run`: its hooks keep widths consistent, so skipping them would hand SGLang a state it fails on one
    step later: an error there is not skipped; `on_must_run_error(reason)` (the engine's fixed policy, whose
    states are all chains) is called and the error propagates as SGLang's own would.
    `collective`: it changes what a step computes on every TP rank (the decode state). Its build is agreed over
    the TP group (`tp_agree`: on for every rank or for none), and it decides each step from values identical on
    every rank. A runtime error inside one rank's step hook is that rank's alone: the rank turns the patch off
    and runs SGLang's path for that step, as each rank did before the guard; the error is logged with the rank.
    """

    def __init__(self, name: str, *, lost: str = "", mode: str = "on", must_run: bool = False,
                 collective: bool = False, on_must_run_error: Optional[Callable[[str], None]] = None):
        if mode not in ("on", "check"):
            raise ValueError(f"patch {name}: mode must be on or check, not {mode!r}")
        self.name = name
        self.lost = lost  # what the server does without it (the start-up check says so)
        self.mode = mode
        self.must_run = must_run
        self.collective = collective
        self.on_must_run_error = on_must_run_error
        self.off_reason: Optional[str] = None
        self.obj: Any = None
        self.hooks: list[tuple[str, str, Callable[..., Any]]] = []
        self._when_off: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ state

    @property
    def on(self) -> bool:
        return self.off_reason is None

    def live(self) -> Any:
        """What the patch built, while it is on; None otherwise (each hook's first question)."""
        return self.obj if self.off_reason is None else None

    def when_off(self, drop: Callable[[], None]) -> None:
        """`drop()` once the patch is off: what it held is never used again (the patch's own clean-up)."""
        self._when_off.append(drop)

    def turn_off(self, reason: str, level: int = logging.ERROR) -> None:
        """Off for the rest of the process; the first reason is kept and logged, later ones are not."""
        if self.off_reason is not None:
            return
        self.off_reason = reason
        log.log(level, "specctl: patch %s off: %s", self.name, reason)
        for drop in self._when_off:
            try:
                drop()
            except Exception:  # noqa: BLE001 - off already; what it held is unread from here on
                log.exception("specctl: patch %s: clean-up after turning off failed", self.name)

    def publish(self, obj: Any) -> Any:
        """What the patch runs, built complete elsewhere (at install): from now on its hooks use it."""
        self.obj = obj
        return obj

    def status(self) -> str:
        return self.mode if self.off_reason is None else f"off: {self.off_reason}"

    def build(self, make: Callable[[], Any], *, agree: Optional[Callable[[bool], bool]] = None) -> Any:
        """Build what the patch runs and publish it only once built (and, with `agree`, built on every TP rank:
        every rank takes part in the vote whatever happened here). `make` returns the object, or a string: why
        it cannot run here. Returns the object, or None with the patch off and the reason logged."""
        obj: Any = None
        why: Optional[str] = None
        try:
            obj = make()
            if isinstance(obj, str) or obj is None:
                why, obj = obj or "nothing built", None
        except Exception as e:  # noqa: BLE001 - the server starts without this patch
            why = f"building it failed: {type(e).__name__}: {e}"
            log.exception("specctl: building patch %s failed", self.name)
        if agree is not None:
            all_ok = agree(why is None)
            if why is None and not all_ok:
                why = "another TP rank could not build it"
        if why is not None:
            self.turn_off(why, logging.WARNING)
            return None
        self.obj = obj
        return obj

    # ------------------------------------------------------------------ hooks

    def hook(self, kind: str, target: str, fn: Callable[..., Any]) -> "Patch":
        """Add a hook of this patch (registered by `register`, wrapped in the guard)."""
        self.hooks.append((target, kind, fn))
        return self

    def targets(self) -> list[str]:
        return [t for t, _, _ in self.hooks]

    def wrapped(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        return {AROUND: self._around, BEFORE: self._before, AFTER: self._after}[kind](fn)

    def _failed(self, e: Exception) -> None:
        reason = f"{type(e).__name__}: {e}"
        if self.must_run:
            log.exception("specctl: patch %s raised (it cannot be skipped)", self.name)
            if self.on_must_run_error is not None:
                self.on_must_run_error(f"patch {self.name} raised {reason}")
            raise e
        self.turn_off(reason)
        log.debug("specctl: patch %s traceback", self.name, exc_info=e)

    def _around(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        patch = self

        @functools.wraps(fn)
        def around(orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            if patch.off_reason is not None and not patch.must_run:
                return orig(*args, **kwargs)
            call = _Call(orig)
            try:
                return fn(call, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - ours: off, SGLang's path; SGLang's: SGLang's to handle
                if call.raised:
                    raise
                patch._failed(e)
                if call.done:
                    return call.result  # never run SGLang's call twice
                return orig(*args, **kwargs)

        return around

    def _before(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        patch = self

        @functools.wraps(fn)
        def before(*args: Any, **kwargs: Any) -> None:
            if patch.off_reason is not None and not patch.must_run:
                return None
            try:
                fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                patch._failed(e)
            return None

        return before

    def _after(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        patch = self

        @functools.wraps(fn)
        def after(ret: Any, *args: Any, **kwargs: Any) -> Any:
            if patch.off_reason is not None and not patch.must_run:
                return None
            try:
                return fn(ret, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - SGLang's return value stands
                patch._failed(e)
                return None

        return after


class PatchObject:
    """What a patch builds and runs (its `obj`): on and off exactly while its patch is (`self.patch`)."""

    patch: Patch

    @property
    def on(self) -> bool:
        return self.patch.on

    @property
    def off_reason(self) -> Optional[str]:
        return self.patch.off_reason

    def say(self, msg: str, level: int = logging.INFO) -> None:
        """Log `msg` once in this object's life (a refusal that repeats every step is said at its first)."""
        said = self.__dict__.setdefault("_said", set())
        if msg not in said:
            said.add(msg)
            log.log(level, "specctl: %s", msg)


class _Call:
    """SGLang's original, as handed to an AROUND hook: records whether it ran and whether it raised."""

    __slots__ = ("orig", "done", "raised", "result")

    def __init__(self, orig: Callable[..., Any]):
        self.orig, self.done, self.raised, self.result = orig, False, False, None

    @property
    def __wrapped__(self) -> Callable[..., Any]:  # inspect.signature / unwrap see SGLang's own function
        return self.orig

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = self.orig(*args, **kwargs)
        except BaseException:
            self.raised = True
            raise
        self.done, self.result = True, out
        return out


class Guard:
    """Every patch of the process, by name: registers their hooks, checks them, reports their states."""

    def __init__(self, patches: Iterable[Patch] = ()):
        self.patches: dict[str, Patch] = {}
        for p in patches:
            self.add(p)

    def add(self, patch: Patch) -> Patch:
        if patch.name in self.patches:
            raise ValueError(f"patch {patch.name} added twice")
        self.patches[patch.name] = patch
        return patch

    def get(self, name: str) -> Optional[Patch]:
        return self.patches.get(name)

    def registrations(self) -> list[tuple[str, Callable[..., Any], str]]:
        """(target, guarded hook, kind) of every hook of every patch that is on, in order."""
        return [(t, p.wrapped(kind, fn), kind) for p in self.patches.values() if p.on for t, kind, fn in p.hooks]

    def check(self, patched: Optional[set[str]], skip: Iterable[str] = ()) -> dict[str, list[str]]:
        """At start-up: a patch some of whose hooks did not take effect is off (a part of one changes nothing
        or worse). `patched` None: SGLang's registry could not be read, so no patch is verified. `skip`: patches
        not in use in this launch (their hooks pass through)."""
        missing: dict[str, list[str]] = {}
        for p in self.patches.values():
            if p.name in skip or not p.on or not p.hooks:
                continue
            gone = sorted({t for t in p.targets() if patched is None or t not in patched})
            if gone:
                missing[p.name] = gone
                p.turn_off("SGLang's hook registry could not be read" if patched is None
                           else f"the hooks on {', '.join(gone)} did not take effect")
        return missing

    def status(self) -> dict[str, str]:
        return {name: p.status() for name, p in self.patches.items()}


def tp_agree(tp_group: Any) -> Callable[[bool], bool]:
    """`agree(ok)`: True only if every rank of the TP group says ok (MIN over its gloo group)."""
    world = int(getattr(tp_group, "world_size", 1) or 1)

    def agree(ok: bool) -> bool:
        if world <= 1:
            return ok
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp_group.cpu_group)
        return bool(int(t.item()))

    return agree
