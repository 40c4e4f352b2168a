"""The plugin's settings: one frozen object, read once from the environment by `register()` and passed down.

OPERATOR_TABLE documents every operator-facing variable and every patch of `SPECCTL_PATCHES`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..controller import wire
from ..policies.fixed import DEFAULT_CONFIG, DEFAULT_THRESHOLD
from ..policies.table import Config

MODES = ("online", "fixed", "file", "off")
SWITCH_ON, SWITCH_OFF = ("on", "1", "true"), ("off", "0", "false")
CHECK_MODES = ("off", "on", "check")
ENV_PREFIX = "SPECCTL_"
SYNC_EVERY = 16  # decode results between two TP policy broadcasts (one costs ~70 us on 2 CPU ranks)
CHECK_STEPS = 32  # `check` without `:N`: the steps a self-checking patch compares before it trusts itself
CATCHUP_ON = 16  # catchup=on: steps-0 steps between two draft catch-ups at most

OPERATOR_TABLE = """\
| Variable | Default | What it sets |
|---|---|---|
| `SPECCTL_MODE` | `online` | `online`: follow the daemon; `fixed`: the fixed threshold only; `file`: the policy in `SPECCTL_POLICY_FILE`; `off`: nothing is installed (SGLang's own policy runs) |
| `SPECCTL_SERVER_ID` | `sglang-0` | the name this server's telemetry carries |
| `SPECCTL_RUNDIR` | `specctl serve`'s | the folder of the daemon's ipc sockets (`telemetry.sock`, `policy.sock`) |
| `SPECCTL_TELEMETRY` | from the rundir | telemetry endpoint (overrides the rundir's); `none`: no telemetry |
| `SPECCTL_POLICY` | from the rundir | policy endpoint (overrides the rundir's); `none`: no daemon |
| `SPECCTL_POLICY_FILE` | unset | a policy file every rank reads at start-up (sets mode `file`) |
| `SPECCTL_FALLBACK` | `5:s3` | the fixed-threshold fallback, `N:config`: speculate with `config` (`s3`, `off`, `3,1,4`) below batch `N`, not from `N` on |
| `SPECCTL_STALE_AFTER_S` | `30` | no policy frame (heartbeats count) for this long: the fallback |
| `SPECCTL_CURVE_SECRET_KEY` | unset | this engine's CURVE `.key_secret` (with the next one, for a daemon over tcp) |
| `SPECCTL_CURVE_SERVER_KEY` | unset | the daemon's public `server.key` |
| `SPECCTL_DECISION_LOG` | unset | a path (`{rank}` replaced): every decision of the rank, for audits |
| `SPECCTL_PATCHES` | the defaults below | comma list `name=value` overriding patch defaults, for diagnosis and A/B runs |

| Patch (`SPECCTL_PATCHES`) | Default | Values | What it does, and why the default |
|---|---|---|---|
| `plain_decode` | `on` | `on`, `off` | speculation off runs as a decode forward with its own CUDA graphs, not SGLang's 1-token verify; on since its GPU checks matched the no-spec server |
| `plain_flashinfer` | `on` | `on`, `off` | the decode state on the flashinfer backend too (triton always); on since its greedy outputs matched the no-spec flashinfer server |
| `plain_fa3` | `off` | `on`, `off` | the decode state on the fa3 backend too (SGLang's default on Hopper); off until a GPU run compares its greedy outputs with the no-spec fa3 server's |
| `plain_logprobs` | `off` | `on`, `off` | steps with log-probability requests run the decode state too; off until a GPU run compares them with the no-spec server's |
| `splitkv` | `on` | `on`, `off` | SGLang's split-KV verify kernel for topk-1 chains on CUDA (SGLang gates it to AMD); on since it matched the extend kernel and was faster |
| `draft_graphs` | `on` | `on`, `off` | each chain state's draft-extend CUDA graph at its own width (SGLang 0.5.17 captures the launch width, so small states extend eagerly) |
| `spec_alloc` | `on` | `on`, `off` | the speculative KV allocation reads its lengths as one list (SGLang 0.5.17: two ATen calls per request per step) |
| `fi_plan` | `off` | `off`, `on`, `check`, `check:N` | flashinfer's verify plan built from host lengths, without plan()'s blocking reads (0.5.23: SGLang's own switch); off until a GPU run checks it |
| `fi_extend` | `off` | `off`, `on`, `check`, `check:N` | flashinfer's prefill (EXTEND) plans, the target's and the EAGLE draft's extend over it, given host indptrs: plan() makes no blocking reads (they cost where a prefill's GPU time exceeds the host's: long prompts); off until a GPU run checks it |
| `host_lens` | `check` | `off`, `on`, `check`, `check:N` | a step after a decode-state step or a prefill takes its lengths from the host, not a device pull; `check` compares the first N (32) with the device's |
| `catchup` | `off` | `off`, `on`, `N` (>= 2) | steps 0 extends the draft once per N steps (16 with `on`) instead of every step, replaying a state's draft-extend graph where one is N tokens wide (N = 4 with an s3 state); a triton or flashinfer draft (flashinfer's window planned from host lengths); off: its prefill iterations measured slower with `on` on triton, cause unknown |

`trees` (tree states from the adaptive config's `specctl.states`) and `trivial_verify` (steps-0 tokens as int64)
are patches too, always on where they apply; `SPECCTL_PATCHES` does not switch them.
"""

# SPECCTL_PATCHES: name -> (kind, default); `switch`: on/off, `check`: off/on/check/check:N, `steps`: off/on/N
PATCHES: dict[str, tuple[str, str]] = {
    "plain_decode": ("switch", "on"), "plain_flashinfer": ("switch", "on"), "plain_fa3": ("switch", "off"),
    "plain_logprobs": ("switch", "off"),
    "splitkv": ("switch", "on"), "draft_graphs": ("switch", "on"), "spec_alloc": ("switch", "on"),
    "fi_plan": ("check", "off"), "fi_extend": ("check", "off"), "host_lens": ("check", "check"),
    "catchup": ("steps", "off"),
}
ALWAYS_ON = ("trees", "trivial_verify")

RETIRED = {  # variables of earlier releases: what to set instead
    "FALLBACK_THRESHOLD": "SPECCTL_FALLBACK=N:config (e.g. 5:s3)",
    "FALLBACK_CONFIG": "SPECCTL_FALLBACK=N:config (e.g. 5:s3)",
    "SYNC_EVERY": "nothing (the TP sync period is fixed)",
    "PLAIN_DECODE": "SPECCTL_PATCHES=plain_decode=on|off",
    "PLAIN_DECODE_FLASHINFER": "SPECCTL_PATCHES=plain_flashinfer=on|off",
    "PLAIN_DECODE_LOGPROBS": "SPECCTL_PATCHES=plain_logprobs=on|off",
    "SPLITKV_VERIFY": "SPECCTL_PATCHES=splitkv=on|off",
    "DRAFT_EXTEND_GRAPHS": "SPECCTL_PATCHES=draft_graphs=on|off",
    "SPEC_ALLOC_LIST": "SPECCTL_PATCHES=spec_alloc=on|off",
    "FI_VERIFY_HOST_PLAN": "SPECCTL_PATCHES=fi_plan=off|on|check|check:N",
    "HOST_SEQ_LENS": "SPECCTL_PATCHES=host_lens=off|on|check|check:N",
    "DRAFT_CATCHUP": "SPECCTL_PATCHES=catchup=off|on|N",
}


@dataclass(frozen=True)
class PluginSettings:
    """Everything the plugin is told (see OPERATOR_TABLE); `from_env` reads it from `SPECCTL_*` once."""

    mode: str = "online"
    server_id: str = "sglang-0"
    telemetry_endpoint: Optional[str] = None  # None: no telemetry is sent
    policy_endpoint: Optional[str] = None  # None: no daemon is listened to
    fallback_threshold: int = DEFAULT_THRESHOLD
    fallback_config: Config = DEFAULT_CONFIG
    stale_after_s: float = 30.0
    policy_file: Optional[str] = None
    sync_every: int = SYNC_EVERY
    telemetry_hwm: int = 10_000
    curve_secret_key_file: Optional[str] = None
    curve_server_key_file: Optional[str] = None
    decision_log: Optional[str] = None
    # the patches (SPECCTL_PATCHES)
    plain_decode: bool = True
    splitkv_verify: bool = True
    draft_extend_graphs: bool = True
    spec_alloc_list: bool = True
    plain_decode_flashinfer: bool = True
    plain_decode_fa3: bool = False
    plain_decode_logprobs: bool = False
    fi_verify_host_plan: str = "off"
    fi_verify_check_steps: int = CHECK_STEPS
    fi_extend_host_plan: str = "off"
    fi_extend_check_steps: int = CHECK_STEPS
    host_seq_lens: str = "check"
    host_seq_lens_check_steps: int = CHECK_STEPS
    host_seq_lens_set: bool = False  # named in SPECCTL_PATCHES: where it cannot apply, a warning (else info)
    draft_catchup: int = 0  # steps-0 steps per draft catch-up; 0: off
    # SGLang's own SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND (its steps-0 stub draft input), read at the edge
    skip_zero_step_draft_extend: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"SPECCTL_MODE must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.mode == "file" and not self.policy_file:
            raise ValueError("SPECCTL_MODE=file needs SPECCTL_POLICY_FILE")
        if self.fallback_threshold < 1:
            raise ValueError(f"SPECCTL_FALLBACK=N:config needs N >= 1, got {self.fallback_threshold}")
        if not self.stale_after_s > 0:
            raise ValueError(f"SPECCTL_STALE_AFTER_S must be > 0, got {self.stale_after_s}")
        if self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {self.sync_every}")
        for name, mode, steps in (("fi_plan", self.fi_verify_host_plan, self.fi_verify_check_steps),
                                  ("fi_extend", self.fi_extend_host_plan, self.fi_extend_check_steps),
                                  ("host_lens", self.host_seq_lens, self.host_seq_lens_check_steps)):
            if mode not in CHECK_MODES:
                raise ValueError(f"SPECCTL_PATCHES: {name} must be one of on, off, check, check:N, not {mode!r}")
            if steps < 1:
                raise ValueError(f"SPECCTL_PATCHES: {name}=check:N needs N >= 1, got {steps}")
        if self.draft_catchup != 0 and self.draft_catchup < 2:
            raise ValueError(f"SPECCTL_PATCHES: catchup must be off, on or a number of steps >= 2, "
                             f"got {self.draft_catchup}")
        if (self.curve_secret_key_file is None) != (self.curve_server_key_file is None):
            raise ValueError("set both SPECCTL_CURVE_SECRET_KEY and SPECCTL_CURVE_SERVER_KEY (or neither)")

    def patch_modes(self) -> dict[str, str]:
        """Each switchable patch as SPECCTL_PATCHES would name it (`on`, `off`, `check:N`, a step count)."""
        def check(mode: str, n: int) -> str:
            return f"check:{n}" if mode == "check" else mode

        onoff = {True: "on", False: "off"}
        return {"plain_decode": onoff[self.plain_decode], "plain_flashinfer": onoff[self.plain_decode_flashinfer],
                "plain_fa3": onoff[self.plain_decode_fa3],
                "plain_logprobs": onoff[self.plain_decode_logprobs], "splitkv": onoff[self.splitkv_verify],
                "draft_graphs": onoff[self.draft_extend_graphs], "spec_alloc": onoff[self.spec_alloc_list],
                "fi_plan": check(self.fi_verify_host_plan, self.fi_verify_check_steps),
                "fi_extend": check(self.fi_extend_host_plan, self.fi_extend_check_steps),
                "host_lens": check(self.host_seq_lens, self.host_seq_lens_check_steps),
                "catchup": str(self.draft_catchup) if self.draft_catchup else "off"}

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, default_rundir: Optional[str] = None) -> "PluginSettings":
        """The settings the variables of OPERATOR_TABLE give (ValueError naming the bad one)."""

        def get(name: str) -> Optional[str]:
            v = env.get(ENV_PREFIX + name)
            return v.strip() if v is not None and v.strip() else None

        retired = [f"SPECCTL_{k} (set {v})" for k, v in RETIRED.items() if get(k) is not None]
        if retired:
            raise ValueError(f"no longer read: {'; '.join(retired)}")
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
        if get("FALLBACK"):
            kw["fallback_threshold"], kw["fallback_config"] = parse_fallback(get("FALLBACK"))  # type: ignore[arg-type]
        if get("STALE_AFTER_S"):
            try:
                kw["stale_after_s"] = float(get("STALE_AFTER_S"))  # type: ignore[arg-type]
            except ValueError:
                raise ValueError(f"SPECCTL_STALE_AFTER_S must be a number of seconds, not {get('STALE_AFTER_S')!r}") \
                    from None
        kw["curve_secret_key_file"] = get("CURVE_SECRET_KEY")
        kw["curve_server_key_file"] = get("CURVE_SERVER_KEY")
        kw["decision_log"] = get("DECISION_LOG")
        kw.update(parse_patches(get("PATCHES")))
        kw["skip_zero_step_draft_extend"] = (env.get("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND", "").strip().lower()
                                             in ("1", "true", "yes", "on"))
        if get("POLICY_FILE"):
            kw["policy_file"] = get("POLICY_FILE")
            kw.setdefault("mode", "file")
        return cls(**kw)


def parse_fallback(value: str) -> tuple[int, Config]:
    """SPECCTL_FALLBACK `N:config`, e.g. `5:s3`: speculate with config below batch N."""
    n, sep, cfg = value.partition(":")
    try:
        if not sep:
            raise ValueError("expected N:config")
        return int(n), wire.parse_config(cfg.strip()).key
    except ValueError as e:
        raise ValueError(f"SPECCTL_FALLBACK must be N:config (e.g. 5:s3), not {value!r}: {e}") from None


def parse_patches(value: Optional[str]) -> dict[str, Any]:
    """SPECCTL_PATCHES `name=value,...` as PluginSettings fields; every patch not named keeps its default."""
    given: dict[str, str] = {}
    for item in (value or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, v = item.partition("=")
        name, v = name.strip().lower(), v.strip().lower()
        if name in ALWAYS_ON:
            raise ValueError(f"SPECCTL_PATCHES: {name} is always on where it applies; it cannot be switched")
        if name not in PATCHES:
            raise ValueError(f"SPECCTL_PATCHES: unknown patch {name!r} (patches: {', '.join(PATCHES)})")
        if not sep or not v:
            raise ValueError(f"SPECCTL_PATCHES: {name} needs a value ({name}=...)")
        if name in given:
            raise ValueError(f"SPECCTL_PATCHES: {name} given twice")
        given[name] = v
    vals = {name: given.get(name, default) for name, (_, default) in PATCHES.items()}
    kw: dict[str, Any] = {}
    for name, field_ in (("plain_decode", "plain_decode"), ("plain_flashinfer", "plain_decode_flashinfer"),
                         ("plain_fa3", "plain_decode_fa3"),
                         ("plain_logprobs", "plain_decode_logprobs"), ("splitkv", "splitkv_verify"),
                         ("draft_graphs", "draft_extend_graphs"), ("spec_alloc", "spec_alloc_list")):
        if vals[name] not in SWITCH_ON + SWITCH_OFF:
            raise ValueError(f"SPECCTL_PATCHES: {name} must be on or off, not {vals[name]!r}")
        kw[field_] = vals[name] in SWITCH_ON
    for name, field_, steps_field in (("fi_plan", "fi_verify_host_plan", "fi_verify_check_steps"),
                                      ("fi_extend", "fi_extend_host_plan", "fi_extend_check_steps"),
                                      ("host_lens", "host_seq_lens", "host_seq_lens_check_steps")):
        mode, steps = _check_mode(vals[name], name)
        kw[field_] = mode
        if steps is not None:
            kw[steps_field] = steps
    kw["host_seq_lens_set"] = "host_lens" in given
    kw["draft_catchup"] = _steps(vals["catchup"])
    return kw


def _steps(v: str) -> int:
    if v in SWITCH_OFF:
        return 0
    if v in SWITCH_ON:
        return CATCHUP_ON
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"SPECCTL_PATCHES: catchup must be off, on or a number of steps, not {v!r}") from None


def _check_mode(v: str, name: str) -> tuple[str, Optional[int]]:
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
    raise ValueError(f"SPECCTL_PATCHES: {name} must be one of on, off, check, check:N, not {v!r}")
