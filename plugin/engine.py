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
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional

from ..controller import wire
from ..policies.fixed import DEFAULT_CONFIG, DEFAULT_THRESHOLD, fixed_threshold
from ..policies.table import OFF, Config, PolicyTable, chain

log = logging.getLogger("specctl.plugin")

MODES = ("online", "fixed", "file", "off")
SWITCH_ON, SWITCH_OFF = ("on", "1", "true"), ("off", "0", "false")  # how a SPECCTL_ switch may be spelled
CHECK_MODES = ("off", "on", "check")  # SPECCTL_FI_VERIFY_HOST_PLAN and SPECCTL_HOST_SEQ_LENS (with check:N)
ENV_PREFIX = "SPECCTL_"


@dataclass(frozen=True)
class PluginSettings:
    """Everything the plugin is told, read once from `SPECCTL_*` by `register()` (see from_env)."""

    mode: str = "online"  # online: follow the daemon | fixed: threshold only | file: policy_file
    #                       | off: register() installs nothing (SGLang's own policy runs)
    server_id: str = "sglang-0"
    telemetry_endpoint: Optional[str] = None  # None: no telemetry is sent
    policy_endpoint: Optional[str] = None  # None: no daemon is listened to
    fallback_threshold: int = DEFAULT_THRESHOLD
    fallback_config: Config = DEFAULT_CONFIG
    stale_after_s: float = 30.0  # no policy frame (heartbeats count) for this long -> fallback
    policy_file: Optional[str] = None
    sync_every: int = 16  # decode results between two TP broadcasts (one costs ~70 us on 2 CPU ranks)
    telemetry_hwm: int = 10_000
    # CURVE client certificates for a daemon reachable over tcp (specctl keys generate)
    curve_secret_key_file: Optional[str] = None  # this engine's NAME.key_secret
    curve_server_key_file: Optional[str] = None  # the daemon's public server.key
    # diagnostics: every decision of this rank, one line `step batch_size steps version` ("{rank}" in
    # the path is replaced by the TP rank): how a TP run proves every rank chose the same
    decision_log: Optional[str] = None
    # "off" as a true decode forward inside the EAGLE server (plugin/plain_decode.py); False: SGLang's
    # steps-0 state (a 1-token verify) runs as it is
    plain_decode: bool = True
    # SGLang's split-KV verify attention kernel (upstream: AMD gfx95 only) for topk-1 chains on CUDA: on
    # since its GPU checks passed (H200, 2026-12-02: 48/48 cases within the extend kernel's error against
    # fp32; an s3 step through the plugin 0.84x / 0.86x the stock one at c = 1 / 16, accept length and
    # greedy agreement with the no-spec server unchanged). SGLANG_ENABLE_SPLITKV_VERIFY=0 keeps it off too
    splitkv_verify: bool = True
    # SPECCTL_DRAFT_EXTEND_GRAPHS: each chain state's draft-extend CUDA graph captured at its own width
    # (SGLang 0.5.17 captures every state's at the launch width, so steps 0 / s1 / s2 extend eagerly: on the
    # H200, 2026-12-01, the decode state's step at batch 5 went from 10.7 to 6.7 ms under the profiler with it)
    draft_extend_graphs: bool = True
    # SPECCTL_SPEC_ALLOC_LIST: the speculative decode's KV allocation reads its per-request next lengths as one
    # host list (SGLang 0.5.17 reads them one tensor scalar at a time, 2 ATen calls per request every EAGLE
    # decode step, on the scheduler thread; 0.5.23 reads them once itself)
    spec_alloc_list: bool = True
    # SPECCTL_PLAIN_DECODE_FLASHINFER: the decode state on the flashinfer attention backend too (its own
    # FlashInferAttnBackend and decode graphs, as on triton); on since its GPU checks (H100, 2026-12-06: greedy
    # outputs 16 / 16 equal to the no-spec flashinfer server's at batch 1 and at batch 16; with SPECCTL_HOST_SEQ_LENS
    # its step 1.024x the no-spec step at c = 1 / 4 / 16); off: flashinfer launches keep SGLang's 1-token verify
    plain_decode_flashinfer: bool = True
    # SPECCTL_PLAIN_DECODE_LOGPROBS: steps where a request asks for log-probabilities run the decode state
    # too (SGLang computes them from its logits); off (the default until the GPU has compared them with the
    # no-spec server's): those steps run the trivial verify
    plain_decode_logprobs: bool = False
    # SPECCTL_FI_VERIFY_HOST_PLAN: SGLang 0.5.17's TARGET_VERIFY flashinfer plan built from the host's lengths
    # instead of plan()'s four blocking device-to-host reads (plugin/fi_verify_plan.py; on 0.5.23 SGLang's own
    # SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN). "off" (the default until a GPU run has checked it), "on", or
    # "check": the first fi_verify_check_steps plans are built both ways and compared, a mismatch turns it off
    fi_verify_host_plan: str = "off"
    fi_verify_check_steps: int = 32
    # SPECCTL_HOST_SEQ_LENS: a step after a decode-state step or a prefill takes its sequence lengths from the host
    # instead of SGLang 0.5.17's device pull and its wait for the previous step, which the overlap scheduler runs
    # for backends that plan from host lengths (flashinfer) (plugin/host_seq_lens.py). "check" (the default since
    # its GPU run: H100, 2026-12-06, the decode state on flashinfer 1.16x -> 1.024x the no-spec step, the self-check
    # passed in both servers), "on", or "off": with "check" the first host_seq_lens_check_steps such steps (and as
    # many with a prefill's rows) pull too and compare, a difference turns it off; a launch whose backends plan
    # without host lengths (triton) has nothing to skip and stands it down at its first step
    host_seq_lens: str = "check"
    host_seq_lens_check_steps: int = 32
    host_seq_lens_set: bool = False  # SPECCTL_HOST_SEQ_LENS given: where it cannot apply, a warning (else info)
    # SPECCTL_DRAFT_CATCHUP: steps 0 defers the draft's 1-token extends and extends the draft over what is
    # pending once per this many steps-0 steps and before the first draft after plain decode
    # (plugin/draft_catchup.py); 0 = off, SGLang's extend every step (the default: measured on the H200 it
    # takes the decode state to 1.013-1.018x the no-spec step at c <= 16 and 1.024x at c = 128, but its c = 64
    # throughput was below the shipped decode state's in three calls of three, unexplained)
    draft_catchup: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"SPECCTL_MODE must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.mode == "file" and not self.policy_file:
            raise ValueError("SPECCTL_MODE=file needs SPECCTL_POLICY_FILE")
        if self.fallback_threshold < 1:
            raise ValueError(f"SPECCTL_FALLBACK_THRESHOLD must be >= 1, got {self.fallback_threshold}")
        if not self.stale_after_s > 0:
            raise ValueError(f"SPECCTL_STALE_AFTER_S must be > 0, got {self.stale_after_s}")
        if self.sync_every < 1:
            raise ValueError(f"SPECCTL_SYNC_EVERY must be >= 1, got {self.sync_every}")
        if self.fi_verify_host_plan not in CHECK_MODES:
            raise ValueError(f"SPECCTL_FI_VERIFY_HOST_PLAN must be one of on, off, check, check:N, "
                             f"not {self.fi_verify_host_plan!r}")
        if self.fi_verify_check_steps < 1:
            raise ValueError(f"SPECCTL_FI_VERIFY_HOST_PLAN=check:N needs N >= 1, got {self.fi_verify_check_steps}")
        if self.host_seq_lens not in CHECK_MODES:
            raise ValueError(f"SPECCTL_HOST_SEQ_LENS must be one of on, off, check, check:N, not {self.host_seq_lens!r}")
        if self.host_seq_lens_check_steps < 1:
            raise ValueError(f"SPECCTL_HOST_SEQ_LENS=check:N needs N >= 1, got {self.host_seq_lens_check_steps}")
        if self.draft_catchup != 0 and self.draft_catchup < 2:
            raise ValueError(f"SPECCTL_DRAFT_CATCHUP must be off, on or a number of steps >= 2, got {self.draft_catchup}")
        if (self.curve_secret_key_file is None) != (self.curve_server_key_file is None):
            raise ValueError("set both SPECCTL_CURVE_SECRET_KEY and SPECCTL_CURVE_SERVER_KEY (or neither)")

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, default_rundir: Optional[str] = None) -> "PluginSettings":
        """`SPECCTL_MODE`, `SPECCTL_SERVER_ID`, `SPECCTL_RUNDIR` (ipc endpoints of `specctl serve`),
        `SPECCTL_TELEMETRY` / `SPECCTL_POLICY` (endpoints; override the rundir ones; `none` turns
        one off), `SPECCTL_FALLBACK_THRESHOLD`, `SPECCTL_FALLBACK_CONFIG` (`s3`, `off`, `3,1,4`),
        `SPECCTL_STALE_AFTER_S`, `SPECCTL_POLICY_FILE`, `SPECCTL_SYNC_EVERY`,
        `SPECCTL_CURVE_SECRET_KEY` / `SPECCTL_CURVE_SERVER_KEY` (certificate files),
        `SPECCTL_DECISION_LOG` (a path, `{rank}` replaced: every decision of the rank, for audits),
        `SPECCTL_PLAIN_DECODE` (`on` | `off`: speculation off as a decode forward, or SGLang's
        1-token verify), `SPECCTL_SPLITKV_VERIFY` (`on` | `off`: the split-KV verify kernel for
        topk-1 chains on CUDA), `SPECCTL_DRAFT_EXTEND_GRAPHS` (`on` | `off`), `SPECCTL_SPEC_ALLOC_LIST` (`on` |
        `off`: the speculative KV allocation's lengths read as one list), `SPECCTL_PLAIN_DECODE_LOGPROBS`
        (`on` | `off`: steps with log-probability requests in the decode state too),
        `SPECCTL_PLAIN_DECODE_FLASHINFER` (`on` | `off`: the decode state on flashinfer too),
        `SPECCTL_FI_VERIFY_HOST_PLAN` (`off` | `on` | `check` | `check:N`: flashinfer's verify plan from host
        values; `check` compares it with plan()'s for the first N plans, 32 by default),
        `SPECCTL_HOST_SEQ_LENS` (`check` | `check:N` | `on` | `off`: a step after a decode-state step or a prefill
        takes its sequence lengths from the host; `check`, the default, compares them with the device's for the
        first N, 32 by default),
        `SPECCTL_DRAFT_CATCHUP` (`off` | `on` | N >= 2: steps 0 extends the draft once per N steps-0 steps,
        16 with `on`, and before the first draft after them, instead of every step)."""

        def get(name: str) -> Optional[str]:
            v = env.get(ENV_PREFIX + name)
            return v.strip() if v is not None and v.strip() else None

        kw: dict[str, Any] = {}
        if get("MODE"):
            kw["mode"] = get("MODE").lower()  # type: ignore[union-attr]
        if get("SERVER_ID"):
            kw["server_id"] = get("SERVER_ID")
        rundir = get("RUNDIR") or default_rundir
        tel = get("TELEMETRY") or (f"ipc://{rundir}/telemetry.sock" if rundir else None)
        pol = get("POLICY") or (f"ipc://{rundir}/policy.sock" if rundir else None)
        kw["telemetry_endpoint"] = None if tel in (None, "none", "off") else tel
        kw["policy_endpoint"] = None if pol in (None, "none", "off") else pol
        try:
            if get("FALLBACK_THRESHOLD"):
                kw["fallback_threshold"] = int(get("FALLBACK_THRESHOLD"))  # type: ignore[arg-type]
            if get("FALLBACK_CONFIG"):
                kw["fallback_config"] = wire.parse_config(get("FALLBACK_CONFIG")).key  # type: ignore[arg-type]
            if get("STALE_AFTER_S"):
                kw["stale_after_s"] = float(get("STALE_AFTER_S"))  # type: ignore[arg-type]
            if get("SYNC_EVERY"):
                kw["sync_every"] = int(get("SYNC_EVERY"))  # type: ignore[arg-type]
        except ValueError as e:
            raise ValueError(f"bad SPECCTL_* setting: {e}") from None
        kw["curve_secret_key_file"] = get("CURVE_SECRET_KEY")
        kw["curve_server_key_file"] = get("CURVE_SERVER_KEY")
        kw["decision_log"] = get("DECISION_LOG")
        for name, field_, default in (("PLAIN_DECODE", "plain_decode", "on"), ("SPLITKV_VERIFY", "splitkv_verify", "on"),
                                      ("DRAFT_EXTEND_GRAPHS", "draft_extend_graphs", "on"),
                                      ("SPEC_ALLOC_LIST", "spec_alloc_list", "on"),
                                      ("PLAIN_DECODE_LOGPROBS", "plain_decode_logprobs", "off"),
                                      ("PLAIN_DECODE_FLASHINFER", "plain_decode_flashinfer", "on")):
            v = (get(name) or default).lower()
            if v not in SWITCH_ON + SWITCH_OFF:
                raise ValueError(f"SPECCTL_{name} must be on or off, not {v!r}")
            kw[field_] = v in SWITCH_ON
        kw["draft_catchup"] = _draft_catchup(get("DRAFT_CATCHUP"))
        kw["fi_verify_host_plan"], steps = _fi_verify_host_plan(get("FI_VERIFY_HOST_PLAN"))
        if steps is not None:
            kw["fi_verify_check_steps"] = steps
        kw["host_seq_lens"], steps = _check_mode(get("HOST_SEQ_LENS") or "check", "SPECCTL_HOST_SEQ_LENS")
        kw["host_seq_lens_set"] = get("HOST_SEQ_LENS") is not None
        if steps is not None:
            kw["host_seq_lens_check_steps"] = steps
        if get("POLICY_FILE"):
            kw["policy_file"] = get("POLICY_FILE")
            kw.setdefault("mode", "file")
        return cls(**kw)


DRAFT_CATCHUP_ON = 16  # SPECCTL_DRAFT_CATCHUP=on: steps-0 steps between two catch-ups at most


def _draft_catchup(value: Optional[str]) -> int:
    """SPECCTL_DRAFT_CATCHUP: off (0), on (DRAFT_CATCHUP_ON) or a number of steps."""
    v = (value or "off").lower()
    if v in SWITCH_OFF:
        return 0
    if v in SWITCH_ON:
        return DRAFT_CATCHUP_ON
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"SPECCTL_DRAFT_CATCHUP must be off, on or a number of steps, not {value!r}") from None


def _fi_verify_host_plan(value: Optional[str]) -> tuple[str, Optional[int]]:
    """SPECCTL_FI_VERIFY_HOST_PLAN: (mode, check steps or None for the default)."""
    return _check_mode(value, "SPECCTL_FI_VERIFY_HOST_PLAN")


def _check_mode(value: Optional[str], name: str) -> tuple[str, Optional[int]]:
    """An off / on / check / check:N switch: (mode, check steps or None for the default)."""
    v = (value or "off").lower()
    if v in SWITCH_ON:
        return "on", None
    if v in SWITCH_OFF:
        return "off", None
    mode, sep, n = v.partition(":")
    if mode == "check":
        try:
            return "check", int(n) if sep else None
        except ValueError:
            pass
    raise ValueError(f"{name} must be one of on, off, check, check:N, not {value!r}")


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
        self._config_frag: dict[int, bytes] = {}
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
        self._prefix = (
            '{"kind":"step","schema":1,"server":' + _json_str(settings.server_id)
            + ',"rank":' + str(int(rank)) + ',"iter":'
        ).encode()
        self._trace: Any = None
        if settings.decision_log:
            path = settings.decision_log.replace("{rank}", str(int(rank)))
            try:
                self._trace = open(path, "a", buffering=1 << 16)
                self._trace.write(f"# specctl decisions rank {int(rank)}: step batch_size steps version [ctx_tokens]\n")
            except OSError as e:
                self._log_once("warning", f"no decision log ({e})")

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
        self._config_frag.clear()  # the step-frame fragments cached per width

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
        """One DESIGN.md `step` frame, exactly `wire.encode(StepRecord(...))`. The configuration is
        the runtime state that produced this result, known by its width (`states` keeps widths
        unique); a width no state has is read as the chain of `draft_tokens - 1` steps."""
        frag = self._config_frag.get(draft_tokens)
        if frag is None:
            c = self._by_width.get(draft_tokens) or chain(draft_tokens - 1 if draft_tokens > 1 else 0)
            frag = (',"config":{"steps":%d,"topk":%d,"draft_tokens":%d}' % c).encode()
            self._config_frag[draft_tokens] = frag
        if draft_tokens > 1 and accepted is not None:
            acc = b',"accepted":[' + _int_list(accepted) + b"]"
        else:
            acc = b""
        ms = float(step_ms)
        tail = b'}'
        if off_path is not None and draft_tokens == 1:  # the wire's field order: ctx_tokens, off_path
            tail = (_OFF_DECODE if off_path == "decode" else _OFF_VERIFY) + tail
        if ctx_tokens is not None:
            tail = b',"ctx_tokens":%d' % ctx_tokens + tail
        return b"".join((
            self._prefix, b"%d" % iter, b',"ts":', repr(float(ts)).encode(),
            b',"batch_size":%d' % batch_size, frag, acc,
            b',"step_ms":', (repr(ms) if math.isfinite(ms) else "null").encode(), tail,
        ))

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


_OFF_DECODE, _OFF_VERIFY = b',"off_path":"decode"', b',"off_path":"verify"'
_DIGIT = bytes(range(48, 58)) + bytes(246)  # byte value v < 10 -> ASCII digit
_BELOW_10 = bytes(range(10))
_INT_BYTES = [str(i).encode() for i in range(256)]


def _int_list(values: list[int]) -> bytes:
    """`3,1,0,2` for accepted-draft counts: C-speed when all are < 10 (the common case; a per-element
    Python loop costs ~0.3 us a request, too much at batch 256 on the scheduler thread)."""
    b = bytes(values)  # ValueError outside 0..255: the caller's telemetry guard turns it off
    if b.translate(None, _BELOW_10):
        return b",".join([_INT_BYTES[v] for v in b])
    out = bytearray(b"," * (2 * len(b) - 1))
    out[::2] = b.translate(_DIGIT)
    return bytes(out)


def _json_str(s: str) -> str:
    import json

    return json.dumps(s)
