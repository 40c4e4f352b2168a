"""The decode state's sequence lengths kept on the host (patch host_lens; SGLang 0.5.17; `check` by default).

Under the overlap scheduler SGLang's spec-v2 path learns each step's sequence lengths from the device:
`FutureMap.resolve_seq_lens_cpu` copies them on a private stream and then `synchronize()`s, whenever an attention
backend needs them on the host (flashinfer does: its plans read host lengths; triton does not). The scheduler
thread therefore waits for the previous step to finish on the GPU before it prepares the next one, and the GPU
idles while it does (docs/architecture.md, S1; fix P4). A speculative step cannot avoid that: how many
drafts were accepted exists only on the GPU. The decode state can: every request gains exactly one token a step,
so the lengths after a decode-state step are the lengths it planned with, plus one, known on the host when the
step is launched; and so can a prefill, whose lengths the scheduler built on the host.

How it stays exact:
  * every spec-v2 forward hands over its request-pool rows as the host has them (`begin_forward`), a prefill
    (an EXTEND batch) with the lengths it publishes (the scheduler builds its host and device lengths from one
    list), a decode step with none;
  * the decode state's verify call, once its decode forward ran, adds the lengths after the step: the committed
    lengths it planned with, plus one (`on_decode_step`);
  * the publish that follows (`FutureMap.publish`, SGLang's own write of the lengths to the device) updates the
    host's copy row by row: rows handed over with lengths take them, rows handed over without (a speculative
    step, the trivial verify) leave the copy, and a publish of another size than the hand-over (or with none:
    seeding) empties it;
  * a resolve whose rows the copy holds every one of takes the lengths from it: SGLang's own code still gathers
    the device lengths and orders the forward stream after the publish, only the host pull and its wait go;
    any other resolve runs as SGLang wrote it. A hand-over no publish took is dropped at the next resolve.

`check` (or `check:N`): the first N resolves that could use the copy run SGLang's pull as well and compare, and
so do the first N whose rows include a prefill's (the copy's two sources); a difference turns it off for the
process (logged once with the rows), then both counts done turns it on. After that (and with `on`) one such
resolve in AUDIT_EVERY still pulls and compares. Any fault in here turns it off too: SGLang's path runs.
Every rank holds the same batches and lengths, so every rank makes the same choice at every step.
A launch whose FutureMap never pulls (every attention backend plans without host lengths: triton) has nothing to
skip: the first publish stands the copy down (`stand_down`, logged once at info), and the hooks pass through.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import numpy as np
import torch

from .. import runtime as _rt
from .. import sglang_source
from ..guard import AROUND, BEFORE, Patch
from ..settings import CHECK_MODES

NAME = "host_lens"
LOST = "every step pulls its sequence lengths from the device (SGLang's path)"
log = logging.getLogger("specctl")

DEFAULT_CHECK_STEPS = 32
AUDIT_EVERY = 256  # after the check, one resolve in this many still pulls and compares (one wait per 256 steps)


class HostSeqLens:
    """The host's copy of the lengths the publishes wrote, row by row (arrays indexed by request-pool row: a
    decode step's bookkeeping is a few vectorised numpy operations), and its use by the next resolve."""

    def __init__(self, mode: str, check_steps: int = DEFAULT_CHECK_STEPS, patch: Optional[Patch] = None):
        self.patch = patch if patch is not None else Patch(NAME, lost=LOST, mode="check" if mode == "check" else "on")
        self.patch.when_off(self._drop)
        if mode not in CHECK_MODES:
            raise ValueError(f"host sequence lengths: mode must be one of {', '.join(CHECK_MODES)}, not {mode!r}")
        self.mode = mode
        self.check_left = check_steps if mode == "check" else 0  # resolves still to compare
        self.check_prefill_left = check_steps if mode == "check" else 0  # ... with rows a prefill published
        self.expect: Optional[np.ndarray] = None  # the rows of the forward in flight
        self.values: Optional[np.ndarray] = None  # and their lengths after it, where the host knows them
        self.from_prefill = False
        self._len = np.zeros(0, dtype=np.int64)  # per request-pool row: its length on the device ...
        self._ok = np.zeros(0, dtype=bool)  # ... where the host followed its last write
        self._pre = np.zeros(0, dtype=bool)  # ... and that write was a prefill's
        self.not_needed: Optional[str] = None  # why this launch has no pull to skip (stand_down)
        self.num_host = 0  # resolves served from the host copy
        self.num_device = 0  # resolves that pulled the lengths from the device
        self.num_checked = 0
        self.since_audit = 0

    @property
    def lens(self) -> dict[int, tuple[int, bool]]:
        """The copy as {row: (length, from a prefill)} (for status and tests; the hooks use the arrays)."""
        return {int(r): (int(self._len[r]), bool(self._pre[r])) for r in np.flatnonzero(self._ok)}

    def status(self) -> dict[str, Any]:
        return {"mode": self.mode, "on": self.on, "off_reason": self.off_reason, "not_needed": self.not_needed,
                "host_resolves": self.num_host,
                "device_resolves": self.num_device, "checked": self.num_checked, "check_left": self.check_left,
                "check_prefill_left": self.check_prefill_left, "rows_held": int(self._ok.sum())}

    @property
    def on(self) -> bool:
        return self.mode != "off" and self.patch.on and self.not_needed is None

    @property
    def off_reason(self) -> Optional[str]:
        return self.patch.off_reason

    def stand_down(self, why: str) -> None:
        """Nothing to keep in this launch (SGLang never pulls the lengths here): off, without a warning."""
        if self.not_needed is None and self.off_reason is None:
            self.not_needed = why
            log.info("specctl: host sequence lengths not used: %s", why)
        self.expect = self.values = None
        self._ok[:] = False

    def _drop(self) -> None:
        """Off: nothing of the copy is used again (SGLang's device pull for every step)."""
        self.expect = self.values = None
        self._ok[:] = False

    # ------------------------------------------------------------------ hand-overs

    def begin_forward(self, rows: Any, prefill_lens: Any = None) -> None:
        """A spec-v2 forward starts: its rows, and for a prefill the lengths it will publish."""
        if not self.on:
            return
        self.expect = None if rows is None else _arr(rows).copy()
        self.values = None
        self.from_prefill = False
        if self.expect is not None and prefill_lens is not None and len(prefill_lens) == len(self.expect):
            self.values, self.from_prefill = _arr(prefill_lens).copy(), True

    def on_decode_step(self, rows: Any, committed: Any) -> None:
        """After a decode-state verify call whose decode forward ran: the batch's request-pool rows and the
        committed lengths its decode forward planned with (each row's length after the step is one more)."""
        if not self.on or self.expect is None:
            return
        if rows is None or committed is None or len(committed) != len(self.expect) \
                or not np.array_equal(_arr(rows), self.expect):
            self.values = None
            return
        self.values, self.from_prefill = _arr(committed) + 1, False

    # ------------------------------------------------------------------ FutureMap hooks

    def after_publish(self, future_indices: Any) -> None:
        """After FutureMap.publish: the rows it wrote, as the forward in flight handed them over."""
        rows, vals, pre = self.expect, self.values, self.from_prefill
        self.expect = self.values = None
        if not self.on:
            return
        n = int(future_indices.shape[0])
        if n == 0:  # DP idle: SGLang writes nothing
            return
        if rows is None or len(rows) != n:
            self._ok[:] = False  # a write the host cannot follow row by row
            return
        if vals is None:
            self._ok[rows[rows < len(self._ok)]] = False
            return
        top = int(rows.max()) + 1
        if top > len(self._ok):
            grow = max(top, 2 * len(self._ok))
            self._len, self._ok, self._pre = (np.concatenate([a, np.zeros(grow - len(a), dtype=a.dtype)])
                                              for a in (self._len, self._ok, self._pre))
        self._len[rows] = vals
        self._ok[rows] = True
        self._pre[rows] = pre

    def host_lengths(self, fmap: Any, batch: Any) -> Optional[tuple[np.ndarray, bool]]:
        """The batch's lengths from the host copy and whether a prefill published any of them, or None where
        SGLang's pull must run."""
        self.expect = self.values = None  # a hand-over no publish took belongs to no step
        if not self.on or not _pulls(fmap, batch):
            return None
        rows = getattr(batch, "req_pool_indices_cpu", None)
        if rows is None or len(rows) == 0:
            return None
        r = _arr(rows)
        if int(r.max()) >= len(self._ok) or int(r.min()) < 0 or not self._ok[r].all():
            return None
        return self._len[r], bool(self._pre[r].any())


def around_resolve(hl: HostSeqLens, debug_assert: Callable[[], bool], orig: Callable[..., Any], fmap: Any,
                   batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND FutureMap.resolve_seq_lens_cpu(batch)."""
    try:
        found = None if debug_assert() else hl.host_lengths(fmap, batch)
        host = None if found is None else (torch.from_numpy(found[0]), int(found[0].sum()))
    except Exception as e:  # noqa: BLE001 - SGLang's pull runs
        hl.patch.turn_off(f"{type(e).__name__}: {e}")
        found = host = None
    if host is None:
        if hl.on and _pulls(fmap, batch):
            hl.num_device += 1
        return orig(fmap, batch, *args, **kwargs)
    vals, prefilled = found
    hl.since_audit += 1
    checking = hl.check_left > 0 or (prefilled and hl.check_prefill_left > 0)
    if checking or hl.since_audit >= AUDIT_EVERY:
        hl.since_audit = 0
        out = orig(fmap, batch, *args, **kwargs)
        got = _ints(batch.seq_lens_cpu) if batch.seq_lens_cpu is not None else None
        hl.num_checked += 1
        hl.num_device += 1
        if got != vals.tolist():
            bad = [(r, h, d) for r, h, d in zip(_ints(batch.req_pool_indices_cpu), vals.tolist(),
                                                got or [None] * len(vals)) if h != d][:4]
            hl.patch.turn_off(f"self-check: the host's lengths differ from the device's (row, host, device: {bad})")
            return out
        if not checking:
            return out
        hl.check_left = max(0, hl.check_left - 1)
        if prefilled:
            hl.check_prefill_left = max(0, hl.check_prefill_left - 1)
        if hl.check_left == 0 and hl.check_prefill_left == 0:
            log.info("specctl: self-check passed: %d steps' host sequence lengths equal the device's; "
                     "host lengths from now on", hl.num_checked)
        return out
    keep = fmap.needs_cpu_seq_lens
    fmap.needs_cpu_seq_lens = False  # SGLang's own path without the pull: the gather and the stream order stay
    try:
        out = orig(fmap, batch, *args, **kwargs)
    finally:
        fmap.needs_cpu_seq_lens = keep
    batch.seq_lens_cpu, batch.seq_lens_sum = host
    if hl.num_host == 0:
        log.info("specctl: host sequence lengths in use: steps after a decode-state step or a prefill resolve "
                 "without the device pull")
    hl.num_host += 1
    return out


def around_publish(hl: HostSeqLens, orig: Callable[..., Any], fmap: Any, future_indices: Any,
                   *args: Any, **kwargs: Any) -> Any:
    """AROUND FutureMap.publish(future_indices, new_seq_lens, ...): SGLang's write first, then the host copy."""
    if not getattr(fmap, "needs_cpu_seq_lens", True):
        hl.stand_down("this launch's attention backends plan without host lengths (FutureMap.needs_cpu_seq_lens "
                      "is False: SGLang pulls none to skip)")
        return orig(fmap, future_indices, *args, **kwargs)
    out = orig(fmap, future_indices, *args, **kwargs)
    try:
        hl.after_publish(future_indices)
    except Exception as e:  # noqa: BLE001
        hl.patch.turn_off(f"{type(e).__name__}: {e}")
    return out


def supported(resolve: Any) -> Optional[str]:
    """None where this SGLang's FutureMap is the one this module was written against (0.5.17's: resolve takes
    the batch alone, the host pull gated by needs_cpu_seq_lens), else why not."""
    import inspect

    try:
        params = list(inspect.signature(resolve).parameters)
    except (TypeError, ValueError) as e:
        return f"FutureMap.resolve_seq_lens_cpu unreadable ({e})"
    if params != ["self", "batch"]:
        return (f"this SGLang's FutureMap.resolve_seq_lens_cpu takes {params[1:]} (0.5.17's takes the batch "
                "alone); nothing done")
    try:
        src = inspect.getsource(resolve)
    except (OSError, TypeError) as e:
        return f"FutureMap.resolve_seq_lens_cpu's source unreadable ({e})"
    if "needs_cpu_seq_lens" not in src:
        return "this SGLang's FutureMap does not gate the host pull by needs_cpu_seq_lens; nothing done"
    return None


def _pulls(fmap: Any, batch: Any) -> bool:
    """Whether SGLang's resolve pulls this batch's lengths from the device."""
    spec = getattr(batch, "spec_info", None)
    return (bool(getattr(fmap, "needs_cpu_seq_lens", False)) and spec is not None
            and getattr(spec, "future_indices", None) is not None)


def _ints(x: Any) -> list[int]:
    return [int(v) for v in (x.tolist() if hasattr(x, "tolist") else x)]


def _arr(x: Any) -> np.ndarray:
    """Request-pool rows or lengths (a CPU tensor, as SGLang keeps them on the host, or a sequence) as int64."""
    if isinstance(x, torch.Tensor):
        return x.numpy().astype(np.int64, copy=False)
    return np.asarray(x, dtype=np.int64)


# ---------------------------------------------------------------------------- hooks


def problem(settings: Any, targets: Any) -> Optional[str]:
    """Why host_lens cannot apply here, or None."""
    if not settings.plain_decode:
        return "it keeps the decode state's lengths, and plain_decode is off; nothing done"
    import pkgutil

    mod, cls, name = targets.fmap_resolve.rsplit(".", 2)
    try:
        resolve = getattr(getattr(pkgutil.resolve_name(mod), cls), name)
    except Exception as e:  # noqa: BLE001
        return f"{targets.fmap_resolve} not found ({type(e).__name__}: {e}); nothing done"
    return supported(resolve)


def patch(rt: Any) -> Optional[Patch]:
    """The host copy's hooks and the copy itself, or None where host_lens is off or cannot apply (said)."""
    s = rt.settings
    if s.host_seq_lens == "off":
        return None
    why = problem(s, rt.targets)
    if why is not None:  # the default quietly, a setting the operator gave loudly
        (log.warning if s.host_seq_lens_set else log.info)("specctl: SPECCTL_PATCHES host_lens=%s: %s",
                                                           s.host_seq_lens, why)
        return None
    p = Patch(NAME, lost=LOST, mode="check" if s.host_seq_lens == "check" else "on")
    p.publish(HostSeqLens(s.host_seq_lens, check_steps=s.host_seq_lens_check_steps, patch=p))
    # its copy follows the forward, the publish and the resolve, or none of them (the guard checks all three)
    p.hook(BEFORE, rt.targets.forward, before_forward)
    p.hook(AROUND, rt.targets.fmap_publish, around_fmap_publish)
    p.hook(AROUND, rt.targets.fmap_resolve, around_fmap_resolve)
    return p


def before_forward(worker: Any, *args: Any, **kwargs: Any) -> None:
    """The rows of the forward starting, and a prefill's lengths (an EXTEND batch's host and device lengths come
    from one list: ScheduleBatch.prepare_for_extend), for the publish inside it."""
    hl = _rt.live("host_lens")
    if hl is None:
        return None
    batch = args[0] if args else kwargs["batch"]
    prefill = getattr(batch.forward_mode, "name", None) == "EXTEND"
    hl.begin_forward(batch.req_pool_indices_cpu, batch.seq_lens_cpu if prefill else None)
    return None


def around_fmap_publish(orig: Callable[..., Any], fmap: Any, *args: Any, **kwargs: Any) -> Any:
    hl = _rt.live("host_lens")
    if hl is None:
        return orig(fmap, *args, **kwargs)
    indices, args, rest = _rt.first_arg(args, kwargs, "future_indices")
    return around_publish(hl, orig, fmap, indices, *args, **rest)


def around_fmap_resolve(orig: Callable[..., Any], fmap: Any, *args: Any, **kwargs: Any) -> Any:
    hl = _rt.live("host_lens")
    if hl is None:
        return orig(fmap, *args, **kwargs)
    batch, args, rest = _rt.first_arg(args, kwargs, "batch")
    return around_resolve(hl, sglang_source.overlap_debug_assert, orig, fmap, batch, *args, **rest)
