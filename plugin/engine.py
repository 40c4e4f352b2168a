"""The engine-side controller: per-step decision, policy intake, TP-synchronised apply, telemetry.

No sglang or torch import: the SGLang hooks (plugin/sglang_hooks.py) and the simulator
(training/) drive the same object, the latter on a virtual clock.

One decode step, on every TP rank, in the same order:

    decide(batch_size, ctx_tokens) -> steps   policy seam: AdaptiveSpeculativeParams.get_steps_for_batch
                                         (ctx_tokens: the batch's context, read from host-side lengths
                                         identical on every rank; None where unknown)
    ... draft / verify ...
    step_record(...) -> frame            rank 0 only: telemetry (attributed by the result's width)
    note_result() -> at_boundary         every `sync_every` results:
    sync(broadcast)                      rank 0's take_pending() is broadcast, every rank apply()s it

Only rank 0 ever looks at the clock or at policy frames; what it concludes (a new table, or
"fall back, because ...") reaches the other ranks through the broadcast, at the same step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

from ..controller import wire
from ..policies.fixed import fixed_threshold
from ..policies.table import OFF, Config, PolicyTable, chain
from .settings import PluginSettings

log = logging.getLogger("specctl.plugin")

@dataclass(frozen=True)
class PolicyUpdate:
    """What rank 0 broadcasts at a sync boundary: a table to use, or None = fall back (reason)."""

    table: Optional[PolicyTable]
    reason: Optional[str] = None


@dataclass
class EngineStats:
    num_decisions: int = 0
    num_results: int = 0
    num_syncs: int = 0
    num_updates_applied: int = 0
    num_frames: int = 0
    num_frames_rejected: int = 0
    steps_chosen: dict[int, int] = field(default_factory=dict)


class EngineController:
    """Per-process controller; one per SGLang scheduler process (= TP rank).

    `candidate_steps`: the step counts SGLang built a runtime state for (0 = no speculation); SGLang
    keys its runtime states by step count, and a decision is that key.
    `states`: what each key's runtime state runs, when not the chain of that many steps (a tree
    built by the plugin's tree hooks: `{2: (2, 4, 16)}`); keys missing here are chains.
    `clock`: seconds, monotonic (only consulted on rank 0, for staleness).
    `initial_policy`: a policy frame to start from (mode `file`: every rank reads the same file).
    """

    def __init__(self, settings: PluginSettings, *, candidate_steps: Iterable[int],
                 states: Optional[Mapping[int, Config]] = None,
                 clock: Callable[[], float] = time.monotonic, rank: int = 0,
                 initial_policy: Optional[bytes] = None):
        self.settings = settings
        self.clock = clock
        self.rank = rank
        self.candidate_steps: frozenset[int] = frozenset(int(s) for s in candidate_steps)
        if not self.candidate_steps:
            raise ValueError("no candidate steps: SGLang built no adaptive runtime state")
        self._set_states(state_configs(self.candidate_steps, states))
        self.stats = EngineStats()
        self._logged: set[str] = set()
        self.fallback = self._build_fallback(settings.fallback_threshold, settings.fallback_config)
        self.table: PolicyTable = self.fallback
        self.active_source = "fallback"
        self.active_version: Optional[int] = None
        self.fallback_reason: Optional[str] = None
        self.failed: Optional[str] = None  # an internal error: fallback for good
        self.step_counter = 0
        self._pending: Optional[PolicyUpdate] = None
        self._last_frame: Optional[bytes] = None
        self._last_good: Optional[PolicyUpdate] = None
        self._last_frame_at: Optional[float] = None
        self._started_at = clock() if rank == 0 else 0.0
        self._no_daemon_reported = False
        self._encoder = wire.StepEncoder(settings.server_id, int(rank))
        self._trace: Any = None
        if settings.mode == "fixed":
            self.active_source = "fixed"
        elif settings.mode == "file":
            if initial_policy is None:
                self._fall_back(f"mode file: no policy read from {settings.policy_file}")
            else:
                upd = self._update_from_frame(initial_policy)
                self.apply(upd)
        else:
            where = settings.policy_endpoint or "no SPECCTL_POLICY endpoint"
            self._fall_back(f"no policy received yet (daemon at {where})")
        # last: a file is opened only once nothing above can fail
        if settings.decision_log:
            self._trace = _open_trace(settings.decision_log, int(rank), self._log_once)

    # ------------------------------------------------------------------ decision (every rank)

    def decide(self, batch_size: int, ctx_tokens: Optional[int] = None) -> int:
        """The step count for this decode batch; advances the step counter (same on every rank).
        `ctx_tokens`: the batch's context tokens (all requests), where known: a table with context
        bands looks the batch up in the band of its mean context; None uses the rows naming none."""
        counter = self.step_counter
        self.step_counter = counter + 1
        try:
            steps = self.table.decide(batch_size, counter, ctx_tokens)[0]
            if steps not in self.candidate_steps:  # tables are checked on apply; belt and braces
                raise RuntimeError(f"table chose steps={steps} with no runtime state")
        except Exception as e:  # noqa: BLE001 - the server must keep serving
            self.fail(f"decide({batch_size}) raised {type(e).__name__}: {e}")
            steps = self.fallback.lookup(batch_size)[0]
        self.stats.num_decisions += 1
        sc = self.stats.steps_chosen
        sc[steps] = sc.get(steps, 0) + 1
        if self._trace is not None:
            self._write_trace(counter, batch_size, steps, ctx_tokens)
        return steps

    def _write_trace(self, counter: int, batch_size: int, steps: int, ctx_tokens: Optional[int] = None) -> None:
        try:
            v = self.active_version
            # a fifth field, the batch's ctx_tokens, where it was known (the audit replays bands with it)
            ctx = "" if ctx_tokens is None else f" {ctx_tokens}"
            self._trace.write(f"{counter} {batch_size} {steps} {'F' if v is None else v}{ctx}\n")
        except Exception as e:  # noqa: BLE001 - a diagnostic: never a reason to stop deciding
            self._trace_failed(e)

    def _trace_failed(self, e: Exception) -> None:
        self._trace = None
        self._log_once("warning", f"decision log off after an error: {type(e).__name__}: {e}")

    def close_trace(self) -> None:
        t, self._trace = self._trace, None
        if t is not None:
            try:
                t.close()
            except OSError:
                pass

    # ------------------------------------------------------------------ policy intake (rank 0)

    def offer_policy_frame(self, frame: bytes) -> Optional[str]:
        """Take one frame from the policy subscription; stage it for the next sync boundary.
        Returns why the frame was rejected, or None. A repeated frame is a heartbeat."""
        if self.settings.mode != "online" or self.failed:
            return None
        now = self.clock()
        self.stats.num_frames += 1
        if frame == self._last_frame and self._last_good is not None:
            self._last_frame_at = now
            if self.active_source == "fallback" and self._pending is None:
                self._pending = self._last_good  # back from staleness
            return None
        try:
            rec = wire.decode_policy(frame)
        except wire.WireError as e:
            self.stats.num_frames_rejected += 1
            self._log_once("warning", f"rejected a policy frame ({e.reason}): {e.detail}")
            return e.reason
        self._last_frame = frame
        self._last_frame_at = now
        upd = self._update_from_record(rec)
        if upd.table is not None:
            self._last_good = upd
            if (self.active_source != "fallback" and self.active_version == upd.table.version
                    and self.table == upd.table):
                return None  # the policy in force, re-sent
        else:
            self._last_good = None
        self._pending = upd
        return None

    def stage_fallback(self, reason: str) -> None:
        """Rank 0: fall back at the next sync boundary, on every rank (e.g. policy intake broke)."""
        self._pending = PolicyUpdate(None, reason)
        self._last_good = None

    def take_pending(self) -> Optional[PolicyUpdate]:
        """Rank 0 at a sync boundary: the update every rank should apply now, or None."""
        if self.settings.mode != "online" or self.failed:
            return None
        upd, self._pending = self._pending, None
        if upd is not None:
            return upd
        now = self.clock()
        if self.active_source != "fallback" and self._last_frame_at is not None:
            quiet_s = now - self._last_frame_at
            if quiet_s > self.settings.stale_after_s:
                return PolicyUpdate(None, (
                    f"policy v{self.active_version} is stale: no frame from the daemon for "
                    f"{quiet_s:.0f} s (timeout {self.settings.stale_after_s:g} s)"))
        elif (self._last_frame_at is None and not self._no_daemon_reported
              and now - self._started_at > self.settings.stale_after_s):
            self._no_daemon_reported = True
            return PolicyUpdate(None, (
                f"no daemon: no policy frame in {now - self._started_at:.0f} s "
                f"(is `specctl serve` publishing at {self.settings.policy_endpoint}?)"))
        return None

    # ------------------------------------------------------------------ TP-synchronised apply

    def note_result(self) -> bool:
        """Count one decode result (every rank, same order); True at a sync boundary."""
        n = self.stats.num_results + 1
        self.stats.num_results = n
        return n % self.settings.sync_every == 0

    def sync(self, broadcast: Optional[Callable[[Any], Any]] = None) -> Optional[PolicyUpdate]:
        """At a sync boundary on every rank: rank 0's pending update, broadcast, applied
        everywhere. `broadcast(obj)` returns rank 0's obj on every rank (None: a single rank)."""
        mine = self.take_pending() if self.rank == 0 else None
        upd = broadcast(mine) if broadcast is not None else mine
        self.stats.num_syncs += 1
        if upd is not None:
            self.apply(upd)
        if self._trace is not None:
            try:
                self._trace.flush()  # a killed server still leaves its decisions up to here
            except Exception as e:  # noqa: BLE001
                self._trace_failed(e)
        return upd

    def apply(self, update: PolicyUpdate) -> None:
        """Switch tables; the new one answers from the next decide() (the scheduler thread)."""
        if self.failed:
            return
        if update.table is None:
            self._fall_back(update.reason or "fallback requested")
            return
        why = self.table_problem(update.table)
        if why:
            self._fall_back(why)
            return
        t = update.table
        was = (self.active_source, self.active_version)
        self.table = t
        self.active_source = t.source
        self.active_version = t.version
        self.fallback_reason = None
        self.stats.num_updates_applied += 1
        if was != (t.source, t.version):
            log.info("specctl: policy v%d (%s) in force from decode step %d: %s", t.version, t.source,
                     self.step_counter, _describe(t))

    def replace_state(self, key: int, config: Config, reason: str) -> None:
        """SGLang built `config` under `key` instead of what was announced (a tree build failed):
        tables naming the announced configuration are refused from now on."""
        self._set_states(state_configs(self.candidate_steps, {**self.states, key: config}))
        self._log_once("error", f"runtime state {key} runs {wire.config_name(config)}: {reason}")
        why = self.table_problem(self.table) if self.active_source != "fallback" else None
        if why:
            self._fall_back(why)
        self.fallback = self._build_fallback(self.settings.fallback_threshold, self.settings.fallback_config)
        if self.active_source == "fallback":
            self.table = self.fallback

    def _set_states(self, states: dict[int, Config]) -> None:
        self.states = states
        # a result names its configuration only by its width (draft tokens verified per request)
        self._by_width: dict[int, Config] = {c[2]: c for c in states.values()}

    def fail(self, reason: str) -> None:
        """An internal error: the fixed-threshold fallback for the rest of this process."""
        if self.failed:
            return
        self.failed = reason
        self._fall_back(f"internal error, specctl stays on the fallback: {reason}", level="error")

    # ------------------------------------------------------------------ telemetry (rank 0)

    def step_record(self, *, iter: int, ts: float, batch_size: int, draft_tokens: int,
                    accepted: Optional[list[int]], step_ms: float,
                    ctx_tokens: Optional[int] = None, off_path: Optional[str] = None) -> bytes:
        """One `step` frame (docs/architecture.md), exactly `wire.encode(StepRecord(...))` (wire.StepEncoder). The configuration
        is the runtime state that produced this result, known by its width (`states` keeps widths unique); a width
        no state has is read as the chain of `draft_tokens - 1` steps."""
        c = self._by_width.get(draft_tokens) or chain(draft_tokens - 1 if draft_tokens > 1 else 0)
        return self._encoder.encode(iter=iter, ts=ts, batch_size=batch_size, config=c,
                                    accepted=accepted if draft_tokens > 1 else None, step_ms=step_ms,
                                    ctx_tokens=ctx_tokens, off_path=off_path if draft_tokens == 1 else None)

    # ------------------------------------------------------------------ helpers

    def table_problem(self, table: PolicyTable) -> Optional[str]:
        """Why this table cannot run on this server, or None."""
        for c in table.configs():
            if c[0] not in self.states:
                return (f"policy v{table.version} names steps={c[0]}, which has no runtime state "
                        f"(built: {self.describe_states()}; see `specctl sglang-args`)")
            if self.states[c[0]] != c:
                return (f"policy v{table.version} names {wire.config_name(c)}, but the runtime state "
                        f"for steps={c[0]} runs {wire.config_name(self.states[c[0]])} (built: "
                        f"{self.describe_states()})")
        return None

    def describe_states(self) -> str:
        return ", ".join(wire.config_name(self.states[k]) for k in sorted(self.states))

    def status(self) -> dict[str, Any]:
        return {
            "source": self.active_source, "version": self.active_version,
            "fallback_reason": self.fallback_reason, "failed": self.failed,
            "candidate_steps": sorted(self.candidate_steps), "step_counter": self.step_counter,
            "states": {k: list(self.states[k]) for k in sorted(self.states)},
            "num_results": self.stats.num_results, "num_syncs": self.stats.num_syncs,
            "num_updates_applied": self.stats.num_updates_applied,
            "num_frames": self.stats.num_frames, "num_frames_rejected": self.stats.num_frames_rejected,
            "steps_chosen": dict(sorted(self.stats.steps_chosen.items())),
        }

    def _update_from_frame(self, frame: bytes) -> PolicyUpdate:
        try:
            rec = wire.decode_policy(frame)
        except wire.WireError as e:
            return PolicyUpdate(None, f"unreadable policy ({e.reason}): {e.detail}")
        return self._update_from_record(rec)

    def _update_from_record(self, rec: wire.PolicyRecord) -> PolicyUpdate:
        try:
            table = PolicyTable.from_policy_obj(wire.to_obj(rec))
        except (ValueError, KeyError) as e:
            return PolicyUpdate(None, f"policy v{rec.version} is not a usable table: {e}")
        why = self.table_problem(table)
        return PolicyUpdate(None, why) if why else PolicyUpdate(table)

    def _build_fallback(self, threshold: int, config: Config) -> PolicyTable:
        steps = config[0]
        built = sorted(self.candidate_steps)
        if self.states.get(steps) != config:
            chains = [s for s in built if s > 0 and self.states[s] == chain(s)]
            lower = [s for s in chains if s <= steps]
            near = lower[-1] if lower else next(iter(chains), 0)
            self._log_once("warning", f"fallback {wire.config_name(config)} has no runtime state (built: "
                                      f"{self.describe_states()}); the fallback speculates with steps={near}")
            config = chain(near)
        table = fixed_threshold(threshold, config)
        if 0 not in self.candidate_steps and table.configs() != [config]:
            # no "off" state was built: speculate with the fallback configuration at every size
            self._log_once("warning", f"no runtime state for steps=0 (built: {built}); the fallback "
                                      f"cannot switch speculation off at batch >= {threshold}")
            table = PolicyTable.from_rows([(1, None, config)], source="fixed")
        if table.configs() == [OFF] and 0 not in self.candidate_steps:
            table = PolicyTable.from_rows([(1, None, chain(built[0]))], source="fixed")
        return table

    def _fall_back(self, reason: str, level: str = "warning") -> None:
        changed = self.active_source != "fallback" or self.fallback_reason != reason
        self.table = self.fallback
        self.active_source = "fallback"
        self.active_version = None
        self.fallback_reason = reason
        if changed:
            self._log_once(level, f"fixed-threshold fallback ({_describe(self.fallback)}) from decode "
                                  f"step {self.step_counter}: {reason}")

    def _log_once(self, level: str, msg: str) -> None:
        if msg in self._logged:
            return
        self._logged.add(msg)
        getattr(log, level)("specctl: %s", msg)


def _open_trace(pattern: str, rank: int, log_once: Callable[[str, str], None]) -> Any:
    path = pattern.replace("{rank}", str(rank))
    f = None
    try:
        f = open(path, "a", buffering=1 << 16)
        f.write(f"# specctl decisions rank {rank}: step batch_size steps version [ctx_tokens]\n")
        return f
    except OSError as e:
        if f is not None:
            f.close()
        log_once("warning", f"no decision log ({e})")
        return None


def state_configs(keys: Iterable[int], states: Optional[Mapping[int, Config]] = None) -> dict[int, Config]:
    """Key -> configuration of every runtime state: `states` where given, else the chain of that many
    steps. Widths must be unique (telemetry tells configurations apart by width alone), and key 0 is
    plain decode."""
    out: dict[int, Config] = {}
    given = dict(states or {})
    for k in sorted(set(int(x) for x in keys)):
        c = tuple(int(v) for v in given.pop(k, chain(k)))
        if len(c) != 3 or c[0] != k:
            raise ValueError(f"runtime state {k}: configuration {c} does not run {k} steps")
        if k == 0 and c != OFF:
            raise ValueError(f"runtime state 0 is plain decode, not {c}")
        out[k] = c  # type: ignore[assignment]
    if given:
        raise ValueError(f"configurations for states SGLang did not build: {sorted(given)}")
    widths: dict[int, Config] = {}
    for c in out.values():
        if c[2] in widths:
            raise ValueError(f"{wire.config_name(widths[c[2]])} and {wire.config_name(c)} both verify "
                             f"{c[2]} tokens: telemetry could not tell them apart")
        widths[c[2]] = c
    return out


def _describe(t: PolicyTable) -> str:
    parts = []
    for r in t.rows:
        rng = f"{r.min_batch}+" if r.max_batch is None else f"{r.min_batch}-{r.max_batch}"
        parts.append(f"bs {rng}: {wire.config_name(r.config)}")
    if t.explore:
        parts.append(f"explore 1/{t.explore_period}")
    return ", ".join(parts)
