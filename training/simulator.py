"""Discrete-event simulation of an SGLang-style continuous-batching decode loop with speculation.

Reads the DESIGN.md cost-profile and workload files; seeded, deterministic, numpy-vectorised.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import deque
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import numpy as np

from specctl.policies.table import Config, config_name

PROFILE_SCHEMA = "specctl.profile/1"
WORKLOAD_SCHEMA = "specctl.workload/1"
_TABLE_MAX_BATCH = 1024  # step times are tabulated up to here, computed beyond


class SimFileError(ValueError):
    """A profile or workload file that cannot be used; the message names the file and the field."""


# ---------------------------------------------------------------------------------------------
# cost profile


@dataclass(frozen=True)
class Profile:
    """Step time per configuration, piecewise-linear in batch size (linear beyond the ends).

    Optional context term: `points` were measured at `ctx_tokens` mean context tokens per request;
    `ctx_points` holds the same curves measured at other mean contexts. Step time is then
    piecewise-linear in the batch's mean context too (between the contexts measured, per
    configuration and batch size; linear beyond them)."""

    name: str
    config_names: tuple[str, ...]
    configs: tuple[Config, ...]
    points: tuple[tuple[tuple[float, float], ...], ...]  # per config, sorted (batch, step_ms)
    noise_cv: float = 0.0
    ctx_tokens: Optional[float] = None
    ctx_points: tuple[tuple[float, tuple[tuple[tuple[float, float], ...], ...]], ...] = ()  # (ctx, points)
    _table: np.ndarray = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    _ctx_levels: tuple[float, ...] = field(default=(), repr=False, compare=False)
    _ctx_tables: tuple[np.ndarray, ...] = field(default=(), repr=False, compare=False)
    _ctx_curves: tuple[tuple[tuple[tuple[float, float], ...], ...], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        b = np.arange(_TABLE_MAX_BATCH + 1, dtype=float)
        table = np.stack([_interp(b, pts) for pts in self.points])
        object.__setattr__(self, "_table", table)
        if self.ctx_points:
            levels = sorted([(float(self.ctx_tokens or 0.0), self.points)] + [(float(c), p) for c, p in self.ctx_points])
            object.__setattr__(self, "_ctx_levels", tuple(c for c, _ in levels))
            object.__setattr__(self, "_ctx_curves", tuple(p for _, p in levels))
            object.__setattr__(self, "_ctx_tables", tuple(
                table if p is self.points else np.stack([_interp(b, pts) for pts in p]) for _, p in levels))

    @property
    def has_ctx(self) -> bool:
        """Whether step time depends on the context (a profile measured at several contexts)."""
        return bool(self._ctx_levels)

    @property
    def num_configs(self) -> int:
        return len(self.configs)

    def index_of(self, config: Config) -> Optional[int]:
        try:
            return self.configs.index(tuple(config))  # type: ignore[arg-type]
        except ValueError:
            return None

    @property
    def off_index(self) -> Optional[int]:
        for i, c in enumerate(self.configs):
            if c[0] == 0:
                return i
        return None

    def step_ms(self, config_index: int, batch_size: int) -> float:
        """Noise-free step time."""
        if batch_size <= _TABLE_MAX_BATCH:
            return float(self._table[config_index, batch_size])
        return float(_interp(np.array([float(batch_size)]), self.points[config_index])[0])

    def step_ms_all(self, batch_size: int) -> np.ndarray:
        """Noise-free step time of every configuration at one batch size."""
        if batch_size <= _TABLE_MAX_BATCH:
            return self._table[:, batch_size]
        bb = np.array([float(batch_size)])
        return np.array([_interp(bb, pts)[0] for pts in self.points])

    def _at_level(self, j: int, batch_size: int) -> np.ndarray:
        if batch_size <= _TABLE_MAX_BATCH:
            return self._ctx_tables[j][:, batch_size]
        bb = np.array([float(batch_size)])
        return np.array([_interp(bb, pts)[0] for pts in self._ctx_curves[j]])

    def step_ms_all_ctx(self, batch_size: int, mean_ctx: float) -> np.ndarray:
        """Noise-free step time of every configuration at one batch size when its requests hold
        `mean_ctx` context tokens on average (the plain step_ms_all without a context term)."""
        if not self._ctx_levels:
            return self.step_ms_all(batch_size)
        xs = self._ctx_levels
        j = min(max(bisect.bisect_right(xs, mean_ctx) - 1, 0), len(xs) - 2)
        lo, hi = self._at_level(j, batch_size), self._at_level(j + 1, batch_size)
        w = (mean_ctx - xs[j]) / (xs[j + 1] - xs[j])
        # a falling extrapolation (below the smallest context measured) keeps a floor, as in batch size
        return np.maximum(lo + w * (hi - lo), 0.1 * np.minimum(lo, hi))

    def step_ms_ctx(self, config_index: int, batch_size: int, mean_ctx: float) -> float:
        return float(self.step_ms_all_ctx(batch_size, mean_ctx)[config_index])


def _interp(b: np.ndarray, pts: Sequence[tuple[float, float]]) -> np.ndarray:
    xs = np.array([p[0] for p in pts], dtype=float)
    ys = np.array([p[1] for p in pts], dtype=float)
    if len(xs) == 1:
        return np.full_like(b, ys[0])
    out = np.interp(b, xs, ys)
    lo = b < xs[0]
    hi = b > xs[-1]
    out[lo] = ys[0] + (b[lo] - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0])
    out[hi] = ys[-1] + (b[hi] - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    # a falling extrapolation must not reach zero; keep a floor at a tenth of the smallest point
    return np.maximum(out, 0.1 * float(ys.min()))


def parse_profile(obj: Any, source: str = "<profile>") -> Profile:
    def bad(msg: str) -> SimFileError:
        return SimFileError(f"{source}: {msg}")

    if not isinstance(obj, Mapping):
        raise bad("a profile is a JSON object")
    if obj.get("schema") != PROFILE_SCHEMA:
        raise bad(f"schema must be {PROFILE_SCHEMA!r}, got {obj.get('schema')!r}")
    configs_obj = obj.get("configs")
    if not isinstance(configs_obj, Mapping) or not configs_obj:
        raise bad("'configs' must be a non-empty object of name -> {steps, topk, draft_tokens}")
    step_obj = obj.get("step_ms")
    if not isinstance(step_obj, Mapping):
        raise bad("'step_ms' must be an object of config name -> [[batch, ms], ...]")
    names: list[str] = []
    configs: list[Config] = []
    points: list[tuple[tuple[float, float], ...]] = []

    def curve(where: str, pts_raw: Any) -> tuple[tuple[float, float], ...]:
        try:
            pts = tuple(sorted((float(p[0]), float(p[1])) for p in pts_raw))
        except (TypeError, ValueError, IndexError, KeyError):
            raise bad(f"{where} must be a list of [batch_size, ms] pairs") from None
        if not pts:
            raise bad(f"{where} is empty")
        for b, ms in pts:
            if not (math.isfinite(b) and math.isfinite(ms)) or b < 1 or ms <= 0:
                raise bad(f"{where} has point [{b}, {ms}]: batch must be >= 1 and ms > 0")
        if len({p[0] for p in pts}) != len(pts):
            raise bad(f"{where} repeats a batch size")
        return pts

    for name, c in configs_obj.items():
        where = f"configs.{name}"
        if not isinstance(c, Mapping):
            raise bad(f"{where} must be an object with steps, topk, draft_tokens")
        try:
            cfg = (int(c["steps"]), int(c.get("topk", 1)), int(c.get("draft_tokens", int(c["steps"]) + 1)))
        except (KeyError, TypeError, ValueError):
            raise bad(f"{where} needs integer 'steps', 'topk' and 'draft_tokens'") from None
        if cfg[0] < 0 or cfg[1] < 1 or cfg[2] < 1:
            raise bad(f"{where} has steps < 0, topk < 1 or draft_tokens < 1: {dict(c)}")
        if cfg[0] == 0:
            cfg = (0, 1, 1)
        if cfg in configs:
            raise bad(f"{where} repeats configuration {cfg} of {names[configs.index(cfg)]!r}")
        pts_raw = step_obj.get(name)
        if pts_raw is None:
            raise bad(f"step_ms has no entry for config {name!r}")
        pts = curve(f"step_ms.{name}", pts_raw)
        names.append(str(name))
        configs.append(cfg)
        points.append(pts)
    extra = set(step_obj) - set(names)
    if extra:
        raise bad(f"step_ms names configs not in 'configs': {sorted(extra)}")
    cv = obj.get("noise_cv", 0.0)
    if not isinstance(cv, (int, float)) or not math.isfinite(cv) or not 0 <= cv < 1:
        raise bad(f"noise_cv must be a number in [0, 1), got {cv!r}")
    ctx_tokens, ctx_points = _parse_ctx_term(obj, names, curve, bad)
    return Profile(name=str(obj.get("name") or Path(source).stem), config_names=tuple(names),
                   configs=tuple(configs), points=tuple(points), noise_cv=float(cv),
                   ctx_tokens=ctx_tokens, ctx_points=ctx_points)


def _parse_ctx_term(obj: Mapping[str, Any], names: list[str], curve: Callable[[str, Any], Any],
                    bad: Callable[[str], SimFileError]) -> tuple[Optional[float], tuple]:
    """The optional context term: `ctx_tokens` (the mean context per request `step_ms` was measured
    at) and `ctx_step_ms` (a list of {ctx_tokens, step_ms}: every config's curve at another mean context)."""
    ref, extra = obj.get("ctx_tokens"), obj.get("ctx_step_ms")
    if ref is None and extra is None:
        return None, ()
    if not isinstance(ref, (int, float)) or isinstance(ref, bool) or not math.isfinite(ref) or ref < 0:
        raise bad(f"ctx_tokens (the mean context per request step_ms was measured at) must be a number >= 0, "
                  f"got {ref!r}")
    if not isinstance(extra, list) or not extra:
        raise bad("ctx_step_ms must be a non-empty list of {ctx_tokens, step_ms} (curves at other contexts)")
    seen = {float(ref)}
    out = []
    for i, e in enumerate(extra):
        where = f"ctx_step_ms[{i}]"
        if not isinstance(e, Mapping) or set(e) - {"ctx_tokens", "step_ms"}:
            raise bad(f"{where} must be an object with ctx_tokens and step_ms only")
        c = e.get("ctx_tokens")
        if not isinstance(c, (int, float)) or isinstance(c, bool) or not math.isfinite(c) or c < 0:
            raise bad(f"{where}.ctx_tokens must be a number >= 0, got {c!r}")
        if float(c) in seen:
            raise bad(f"{where}.ctx_tokens {c} repeats a context already measured")
        seen.add(float(c))
        sm = e.get("step_ms")
        if not isinstance(sm, Mapping) or set(sm) != set(names):
            raise bad(f"{where}.step_ms must name every config ({', '.join(names)}), got "
                      f"{sorted(sm) if isinstance(sm, Mapping) else sm!r}")
        out.append((float(c), tuple(curve(f"{where}.step_ms.{n}", sm[n]) for n in names)))
    return float(ref), tuple(out)


# ---------------------------------------------------------------------------------------------
# workload


@dataclass(frozen=True)
class RequestClass:
    name: str
    accept: Mapping[str, tuple[float, ...]]  # config name -> per-position conditional acceptance
    output_tokens: tuple[int, int]  # uniform integer range, inclusive
    ctx_tokens: Optional[tuple[int, int]] = None  # prompt tokens, uniform integer range (optional)


@dataclass(frozen=True)
class Phase:
    duration_s: float
    mix: Mapping[str, float]  # class -> weight (normalised)
    concurrency: Optional[int] = None  # closed loop
    arrival_rate: Optional[float] = None  # open loop, Poisson per second
    name: str = ""


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    classes: tuple[RequestClass, ...]
    phases: tuple[Phase, ...]
    max_running: Optional[int] = None  # optional cap on the running batch; the rest queue

    @property
    def duration_s(self) -> float:
        return float(sum(p.duration_s for p in self.phases))

    @property
    def class_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    @property
    def has_ctx(self) -> bool:
        """Whether any request class gives its prompt length (the batch's context is then known)."""
        return any(c.ctx_tokens is not None for c in self.classes)


def parse_workload(obj: Any, source: str = "<workload>") -> Workload:
    def bad(msg: str) -> SimFileError:
        return SimFileError(f"{source}: {msg}")

    if not isinstance(obj, Mapping):
        raise bad("a workload is a JSON object")
    if obj.get("schema") != WORKLOAD_SCHEMA:
        raise bad(f"schema must be {WORKLOAD_SCHEMA!r}, got {obj.get('schema')!r}")
    seed = obj.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise bad(f"seed must be a non-negative integer, got {seed!r}")
    classes_obj = obj.get("classes")
    if not isinstance(classes_obj, Mapping) or not classes_obj:
        raise bad("'classes' must be a non-empty object of name -> {accept, output_tokens}")
    classes: list[RequestClass] = []
    for cname, c in classes_obj.items():
        where = f"classes.{cname}"
        if not isinstance(c, Mapping):
            raise bad(f"{where} must be an object")
        acc_obj = c.get("accept", {})
        if not isinstance(acc_obj, Mapping):
            raise bad(f"{where}.accept must be an object of config name -> [rates per position]")
        accept: dict[str, tuple[float, ...]] = {}
        for k, rates in acc_obj.items():
            if not isinstance(rates, list) or not all(
                isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1 for r in rates
            ):
                raise bad(f"{where}.accept.{k} must be a list of acceptance rates in [0, 1], got {rates!r}")
            accept[str(k)] = tuple(float(r) for r in rates)
        ot = c.get("output_tokens")
        if (not isinstance(ot, list) or len(ot) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in ot)
                or ot[0] < 1 or ot[1] < ot[0]):
            raise bad(f"{where}.output_tokens must be [min, max] integers with 1 <= min <= max, got {ot!r}")
        ct = c.get("ctx_tokens")
        if ct is not None and (not isinstance(ct, list) or len(ct) != 2
                               or not all(isinstance(x, int) and not isinstance(x, bool) for x in ct)
                               or ct[0] < 0 or ct[1] < ct[0]):
            raise bad(f"{where}.ctx_tokens (prompt tokens) must be [min, max] integers with 0 <= min <= max, got {ct!r}")
        classes.append(RequestClass(str(cname), accept, (int(ot[0]), int(ot[1])),
                                    None if ct is None else (int(ct[0]), int(ct[1]))))
    names = {c.name for c in classes}
    phases_obj = obj.get("phases")
    if not isinstance(phases_obj, list) or not phases_obj:
        raise bad("'phases' must be a non-empty list")
    phases: list[Phase] = []
    for i, p in enumerate(phases_obj):
        where = f"phases[{i}]"
        if not isinstance(p, Mapping):
            raise bad(f"{where} must be an object")
        dur = p.get("duration_s")
        if not isinstance(dur, (int, float)) or isinstance(dur, bool) or not math.isfinite(dur) or dur <= 0:
            raise bad(f"{where}.duration_s must be a positive number, got {dur!r}")
        conc, rate = p.get("concurrency"), p.get("arrival_rate")
        if (conc is None) == (rate is None):
            raise bad(f"{where} needs exactly one of 'concurrency' (closed loop) or 'arrival_rate' (open loop)")
        if conc is not None and (not isinstance(conc, int) or isinstance(conc, bool) or conc < 0):
            raise bad(f"{where}.concurrency must be a non-negative integer, got {conc!r}")
        if rate is not None and (not isinstance(rate, (int, float)) or isinstance(rate, bool)
                                 or not math.isfinite(rate) or rate < 0):
            raise bad(f"{where}.arrival_rate must be a non-negative number, got {rate!r}")
        mix = p.get("mix")
        if not isinstance(mix, Mapping) or not mix:
            raise bad(f"{where}.mix must be a non-empty object of class -> weight")
        unknown = [k for k in mix if k not in names]
        if unknown:
            raise bad(f"{where}.mix names unknown class(es) {unknown}; classes are {sorted(names)}")
        if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w >= 0 for w in mix.values()):
            raise bad(f"{where}.mix weights must be non-negative numbers")
        total = float(sum(mix.values()))
        if total <= 0:
            raise bad(f"{where}.mix weights sum to 0")
        phases.append(Phase(float(dur), {k: float(w) / total for k, w in mix.items()},
                            None if conc is None else int(conc), None if rate is None else float(rate),
                            str(p.get("name", f"phase{i}"))))
    mr = obj.get("max_running")
    if mr is not None and (not isinstance(mr, int) or isinstance(mr, bool) or mr < 1):
        raise bad(f"max_running must be a positive integer, got {mr!r}")
    return Workload(name=str(obj.get("name") or Path(source).stem), seed=int(seed), classes=tuple(classes),
                    phases=tuple(phases), max_running=mr)


def _load_json(path: Path, kind: str) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SimFileError(f"{path}: no such {kind} file") from None
    except OSError as e:
        raise SimFileError(f"{path}: cannot read {kind} file: {e.strerror or e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SimFileError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None


def _shipped(kind: str) -> Path:
    return Path(str(resources.files("specctl.training").joinpath("data", kind)))


def shipped_names(kind: str) -> list[str]:
    """Names of the profiles ('profiles') or workloads ('workloads') shipped with specctl."""
    d = _shipped(kind)
    return sorted(p.stem for p in d.glob("*.json")) if d.is_dir() else []


def resolve(name_or_path: str | Path, kind: str) -> Path:
    """A path as given if it exists, else a shipped file of that name (with or without .json)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    stem = p.name[:-5] if p.name.endswith(".json") else p.name
    cand = _shipped(kind) / f"{stem}.json"
    if str(name_or_path) == p.name and cand.exists():
        return cand
    names = ", ".join(shipped_names(kind)) or "none"
    raise SimFileError(f"{name_or_path}: no such file, and no shipped {kind[:-1]} of that name "
                       f"(shipped: {names})")


def load_profile(name_or_path: str | Path) -> Profile:
    path = resolve(name_or_path, "profiles")
    return parse_profile(_load_json(path, "profile"), str(path))


def load_workload(name_or_path: str | Path) -> Workload:
    path = resolve(name_or_path, "workloads")
    return parse_workload(_load_json(path, "workload"), str(path))


# ---------------------------------------------------------------------------------------------
# acceptance model


def accept_matrix(profile: Profile, workload: Workload) -> np.ndarray:
    """A[class, config, position]: per-position conditional acceptance; 0 where unusable.

    A class's `accept` is matched to a profile config by the profile's name for it, else by the
    canonical name (`s3`, `s2k4n8`). Positions a list leaves out accept nothing."""
    max_steps = max(1, max(c[0] for c in profile.configs))
    A = np.zeros((len(workload.classes), profile.num_configs, max_steps))
    for ci, cls in enumerate(workload.classes):
        for k, (name, cfg) in enumerate(zip(profile.config_names, profile.configs)):
            if cfg[0] == 0:
                continue
            rates = cls.accept.get(name, cls.accept.get(config_name(cfg)))
            if rates is None:
                continue
            n = min(len(rates), cfg[0])
            A[ci, k, :n] = rates[:n]
    return A


def expected_tau(A: np.ndarray) -> np.ndarray:
    """tau[class, config] = 1 + sum_i prod_{j<=i} a_j: expected tokens per request per step."""
    return 1.0 + np.cumprod(A, axis=2).sum(axis=2)


# ---------------------------------------------------------------------------------------------
# simulation


class SimPolicy(Protocol):
    """What the simulator drives. `decide` picks the configuration for this step's batch; `observe`
    sees what the engine would report after it. A policy with `uses_truth = True` is handed the true
    expected tokens per request of every profile config for the batch, each request's capped by the
    tokens it has left (the oracle): `decide_with_truth(batch_size, tau)`, and `ctx_tokens=` the
    batch's context where the profile has a context term. A policy with `uses_ctx = True` gets the
    batch's context tokens as `decide(batch_size, ctx_tokens=...)` and `observe(..., ctx_tokens=...)`
    where the workload or the profile has a context (the plugin's reading of it)."""

    name: str

    def decide(self, batch_size: int) -> Config: ...

    def observe(self, batch_size: int, config: Config, accepted: np.ndarray, step_ms: float,
                now_s: float) -> None: ...


@dataclass
class PhaseStats:
    name: str
    duration_s: float
    output_tokens: int = 0
    num_steps: int = 0
    batch_sum: int = 0
    tpot_ms: list = field(default_factory=list)
    config_steps: dict = field(default_factory=dict)  # config name -> steps used

    def summary(self) -> dict[str, Any]:
        tp = np.array(self.tpot_ms) if self.tpot_ms else None
        return {
            "name": self.name,
            "duration_s": self.duration_s,
            "output_tokens": int(self.output_tokens),
            "tokens_per_s": self.output_tokens / self.duration_s,
            "num_steps": int(self.num_steps),
            "mean_batch": self.batch_sum / self.num_steps if self.num_steps else 0.0,
            "mean_tpot_ms": float(tp.mean()) if tp is not None else None,
            "p99_tpot_ms": float(np.percentile(tp, 99)) if tp is not None else None,
            "num_finished": len(self.tpot_ms),
            "config_share": {k: v / self.num_steps for k, v in sorted(self.config_steps.items())}
            if self.num_steps else {},
        }


@dataclass
class SimResult:
    policy: str
    profile: str
    workload: str
    duration_s: float
    output_tokens: int
    num_steps: int
    tpot_ms: np.ndarray  # per finished request: decode time / output tokens
    phases: list[PhaseStats]
    trace_t: np.ndarray  # per step: start time (s)
    trace_bs: np.ndarray
    trace_cfg: np.ndarray  # config index
    trace_tokens: np.ndarray
    config_names: tuple[str, ...]
    config_steps: tuple[int, ...]
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s

    def summary(self) -> dict[str, Any]:
        tp = self.tpot_ms
        return {
            "policy": self.policy,
            "tokens_per_s": self.tokens_per_s,
            "output_tokens": int(self.output_tokens),
            "num_steps": int(self.num_steps),
            "mean_tpot_ms": float(tp.mean()) if len(tp) else None,
            "p99_tpot_ms": float(np.percentile(tp, 99)) if len(tp) else None,
            "num_finished": int(len(tp)),
            "phases": [p.summary() for p in self.phases],
            "wall_s": round(self.wall_s, 3),
        }


class _Requests:
    """The request stream of a workload. Request i draws the same uniforms under every policy
    (common random numbers: its class/length pair and its per-token draws come from streams
    indexed by i), so policies are compared on the same luck. Running requests hold a row of
    `U` (a slot); per-token draws are generated 64 requests at a time."""

    BLOCK = 64

    def __init__(self, workload: Workload, max_steps: int):
        self.workload = workload
        self.seed = workload.seed
        self.stride = max(c.output_tokens[1] for c in workload.classes) + max_steps + 1
        self.num_created = 0
        self._attr = np.empty((0, 2))
        self._block_i = -1
        self._block = np.empty((0, self.stride), dtype=np.float32)
        self.U = np.empty((self.BLOCK, self.stride), dtype=np.float32)
        self.free = list(range(self.BLOCK - 1, -1, -1))
        self.class_index = {c.name: i for i, c in enumerate(workload.classes)}
        self._mix_cache: dict[int, tuple[list[float], list[int]]] = {}
        self._prompt_i = -1
        self._prompt = np.empty(0)

    def create(self, phase: Phase) -> tuple[int, int, int, int]:
        """(class index, output tokens, slot, prompt tokens). Prompt lengths come from a stream of
        their own (workloads without them draw exactly what they always drew)."""
        i = self.num_created
        self.num_created += 1
        if i >= len(self._attr):
            n = max(1024, len(self._attr))
            more = np.random.default_rng([self.seed, 1, len(self._attr)]).random((n, 2))
            self._attr = np.concatenate([self._attr, more])
        u_cls, u_len = self._attr[i]
        cum, idx = self._mix_cache.get(id(phase)) or self._mix(phase)
        ci = idx[-1]
        for c, k in zip(cum, idx):
            if u_cls < c:
                ci = k
                break
        lo, hi = self.workload.classes[ci].output_tokens
        length = lo + min(int(u_len * (hi - lo + 1)), hi - lo)
        b = i // self.BLOCK
        if b != self._block_i:
            self._block = np.random.default_rng([self.seed, 2, b]).random((self.BLOCK, self.stride), dtype=np.float32)
            self._block_i = b
        if not self.free:
            old = len(self.U)
            self.U = np.concatenate([self.U, np.empty_like(self.U)])
            self.free = list(range(len(self.U) - 1, old - 1, -1))
        slot = self.free.pop()
        self.U[slot] = self._block[i % self.BLOCK]
        prompt = 0
        ct = self.workload.classes[ci].ctx_tokens
        if ct is not None:
            k = i // self.BLOCK
            if k != self._prompt_i:
                self._prompt = np.random.default_rng([self.seed, 5, k]).random(self.BLOCK)
                self._prompt_i = k
            prompt = ct[0] + min(int(self._prompt[i % self.BLOCK] * (ct[1] - ct[0] + 1)), ct[1] - ct[0])
        return ci, length, slot, prompt

    def _mix(self, phase: Phase) -> tuple[list[float], list[int]]:
        cum, idx, acc = [], [], 0.0
        for name, w in phase.mix.items():
            acc += w
            cum.append(acc)
            idx.append(self.class_index[name])
        self._mix_cache[id(phase)] = (cum, idx)
        return cum, idx

    def release(self, slots: Sequence[int]) -> None:
        self.free.extend(slots)


def simulate(profile: Profile, workload: Workload, policy: SimPolicy, *,
             seed: Optional[int] = None, on_step: Optional[Callable[[float, int, int, int], None]] = None,
             clock: Optional[Callable[[], float]] = None) -> SimResult:
    """Run one policy over the whole workload on virtual time and return its figures.

    `seed` overrides the workload's; `on_step(t_s, batch_size, config_index, tokens)` is called
    after every step (live displays); `clock`, if given, is a wall clock (seconds since start) the
    loop paces itself to: one virtual second per wall second (live mode)."""
    import time as _time

    if seed is not None:
        workload = Workload(workload.name, seed, workload.classes, workload.phases, workload.max_running)
    wall0 = _time.perf_counter()
    # the batch's context (prompt + tokens generated so far, every request): computed only where the
    # profile's step times or the workload's requests know it, and handed only to policies that read it
    use_ctx = profile.has_ctx or workload.has_ctx
    ctx_policy = use_ctx and bool(getattr(policy, "uses_ctx", False))
    ctx_truth = profile.has_ctx
    A = accept_matrix(profile, workload)
    tau = expected_tau(A)  # [class, config]
    max_steps = A.shape[2]
    n_cls = len(workload.classes)
    cfg_index = {c: i for i, c in enumerate(profile.configs)}
    cfg_steps = [int(c[0]) for c in profile.configs]
    A_by_cfg = [np.ascontiguousarray(A[:, k, : max(1, cfg_steps[k])]) for k in range(profile.num_configs)]
    uses_truth = bool(getattr(policy, "uses_truth", False))
    # CP[class, config, j] = sum_{i<=j} P(accepted >= i): E[min(1 + accepted, R)] = 1 + CP[.., min(s, R-1)]
    CP = np.concatenate([np.zeros(A.shape[:2] + (1,)), np.cumsum(np.cumprod(A, axis=2), axis=2)], axis=2)
    cfg_steps_ar = np.array(cfg_steps)
    cfg_ar = np.arange(profile.num_configs)
    reqs = _Requests(workload, max_steps)
    pos_ar = np.arange(max_steps)
    table = profile._table
    table_max = table.shape[1] - 1
    sigma = math.sqrt(math.log1p(profile.noise_cv ** 2)) if profile.noise_cv > 0 else 0.0
    noise_rng = np.random.default_rng([workload.seed, 3])
    noise_block: list[float] = []
    nb_i = 0

    # the running batch, as parallel arrays; `r_rem` = output tokens still to emit
    r_cls = np.empty(0, dtype=np.int64)
    r_len = np.empty(0, dtype=np.int64)
    r_rem = np.empty(0, dtype=np.int64)
    r_slot = np.empty(0, dtype=np.int64)
    r_ptr = np.empty(0, dtype=np.int64)  # flat index into reqs.U of each request's next draw
    r_t0 = np.empty(0, dtype=float)
    r_prompt = np.empty(0, dtype=np.int64)  # prompt tokens (0 without a context in the workload)
    ctx_tokens: Optional[int] = None
    queue: deque[tuple[int, int, int, int]] = deque()  # waiting for a running slot (max_running)
    cls_count = np.zeros(n_cls, dtype=np.int64)
    comp_version = 0  # bumped when the batch's class composition changes
    truth_key: tuple[int, int] = (-1, -1)
    truth_cfg: Config = (0, 1, 1)

    ends = [float(e) for e in np.cumsum([p.duration_s for p in workload.phases])]
    total_s = ends[-1]
    # open-loop arrivals per phase, from their own stream: the same under every policy
    arrivals: list[list[float]] = []
    for j, p in enumerate(workload.phases):
        start = ends[j] - p.duration_s
        if p.arrival_rate:
            rng = np.random.default_rng([workload.seed, 4, j])
            n_est = int(p.arrival_rate * p.duration_s * 1.5 + 20)
            t = start + np.cumsum(rng.exponential(1.0 / p.arrival_rate, n_est))
            while t[-1] < ends[j]:
                t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(1.0 / p.arrival_rate, n_est))])
            arrivals.append([float(x) for x in t[t < ends[j]]])
        else:
            arrivals.append([])
    arr_j, arr_k = 0, 0

    tr_t: list[float] = []
    tr_bs: list[int] = []
    tr_cfg: list[int] = []
    tr_tok: list[int] = []
    fin_t: list[float] = []
    fin_tpot: list[float] = []
    now = 0.0
    phase_j = 0
    last_phase = len(ends) - 1
    in_system = 0  # running + queued
    max_running = workload.max_running or (1 << 30)
    total_tokens = 0
    new: list[tuple[int, int, int, int]] = []

    while now < total_s:
        while phase_j < last_phase and now >= ends[phase_j]:
            phase_j += 1
        phase = workload.phases[phase_j]
        # arrivals: open-loop events up to now; closed loop tops up to its concurrency
        while arr_j <= phase_j:
            arr = arrivals[arr_j]
            if arr_k < len(arr) and (arr_j < phase_j or arr[arr_k] <= now):
                queue.append(reqs.create(workload.phases[arr_j]))
                in_system += 1
                arr_k += 1
            elif arr_j < phase_j:
                arr_j += 1
                arr_k = 0
            else:
                break
        if phase.concurrency is not None:
            while in_system < phase.concurrency:
                queue.append(reqs.create(phase))
                in_system += 1
        if queue:
            running = len(r_cls)
            while queue and running < max_running:
                new.append(queue.popleft())
                running += 1
            if new:
                nc = np.array([x[0] for x in new], dtype=np.int64)
                nl = np.array([x[1] for x in new], dtype=np.int64)
                r_cls = np.concatenate([r_cls, nc])
                r_len = np.concatenate([r_len, nl])
                r_rem = np.concatenate([r_rem, nl])
                ns = np.array([x[2] for x in new], dtype=np.int64)
                r_slot = np.concatenate([r_slot, ns])
                r_ptr = np.concatenate([r_ptr, ns * reqs.stride])
                r_t0 = np.concatenate([r_t0, np.full(len(new), now)])
                if use_ctx:
                    r_prompt = np.concatenate([r_prompt, np.array([x[3] for x in new], dtype=np.int64)])
                cls_count += np.bincount(nc, minlength=n_cls)
                comp_version += 1
                new.clear()
        bs = len(r_cls)
        if bs == 0:
            # idle: jump to the next arrival or the next phase boundary (both lie after `now`)
            nxt = ends[phase_j]
            if arr_j == phase_j and arr_k < len(arrivals[phase_j]):
                nxt = min(nxt, arrivals[phase_j][arr_k])
            now = max(nxt, now)
            continue

        if use_ctx:
            ctx_tokens = int(r_prompt.sum() + (r_len - r_rem).sum())
        if uses_truth and ctx_truth:
            # step times move with the context at every step: no caching by composition
            m = np.minimum(cfg_steps_ar, (r_rem - 1)[:, None])
            config = policy.decide_with_truth(bs, 1.0 + CP[r_cls[:, None], cfg_ar, m].mean(axis=0),  # type: ignore[attr-defined]
                                              ctx_tokens=ctx_tokens)
        elif uses_truth and r_rem.min() <= max_steps:
            # some request cannot use every draft position: its truth is capped by what it has left
            m = np.minimum(cfg_steps_ar, (r_rem - 1)[:, None])
            config = policy.decide_with_truth(bs, 1.0 + CP[r_cls[:, None], cfg_ar, m].mean(axis=0))  # type: ignore[attr-defined]
            truth_key = (-1, -1)
        elif uses_truth:
            # a truth-using policy is a pure function of (batch size, composition): ask on change
            if truth_key != (bs, comp_version):
                truth_key = (bs, comp_version)
                truth_cfg = policy.decide_with_truth(bs, cls_count @ tau / bs)  # type: ignore[attr-defined]
            config = truth_cfg
        elif ctx_policy:
            config = policy.decide(bs, ctx_tokens=ctx_tokens)  # type: ignore[call-arg]
        else:
            config = policy.decide(bs)
        k = cfg_index.get(config)
        if k is None:
            raise SimFileError(f"policy {policy.name!r} chose configuration {config} "
                               f"({config_name(config)}), which profile {profile.name!r} does not measure; "
                               f"it has {', '.join(profile.config_names)}")
        s = cfg_steps[k]
        if s > 0:
            ok = reqs.U.ravel()[r_ptr[:, None] + pos_ar[:s]] < A_by_cfg[k][r_cls]
            accepted = ok.cumprod(axis=1).sum(axis=1)
            emitted = np.minimum(accepted + 1, r_rem)
            toks = int(emitted.sum())
        else:
            accepted = np.zeros(bs, dtype=np.int64)
            emitted = 1
            toks = bs
        if ctx_truth:
            ms = profile.step_ms_ctx(k, bs, ctx_tokens / bs)  # type: ignore[operator]
        else:
            ms = float(table[k, bs]) if bs <= table_max else profile.step_ms(k, bs)
        if sigma > 0:
            if nb_i >= len(noise_block):
                noise_block = noise_rng.lognormal(-0.5 * sigma * sigma, sigma, 8192).tolist()
                nb_i = 0
            ms *= noise_block[nb_i]
            nb_i += 1
        tr_t.append(now)
        tr_bs.append(bs)
        tr_cfg.append(k)
        tr_tok.append(toks)
        total_tokens += toks
        now += ms / 1000.0
        if ctx_policy:
            policy.observe(bs, config, accepted, ms, now, ctx_tokens=ctx_tokens)  # type: ignore[call-arg]
        else:
            policy.observe(bs, config, accepted, ms, now)
        if on_step is not None:
            on_step(now, bs, k, toks)
        if clock is not None:
            lag = now - clock()
            if lag > 0:
                _time.sleep(lag)
        r_rem = r_rem - emitted
        r_ptr = r_ptr + emitted
        if r_rem.min() <= 0:
            done = r_rem <= 0
            nd = int(done.sum())
            fin_t.extend([now] * nd)
            fin_tpot.extend(((now - r_t0[done]) * 1000.0 / r_len[done]).tolist())
            cls_count -= np.bincount(r_cls[done], minlength=n_cls)
            comp_version += 1
            reqs.release(r_slot[done].tolist())
            keep = ~done
            r_cls, r_len, r_rem, r_slot, r_t0 = r_cls[keep], r_len[keep], r_rem[keep], r_slot[keep], r_t0[keep]
            r_ptr = r_ptr[keep]
            if use_ctx:
                r_prompt = r_prompt[keep]
            in_system -= nd

    trace_t = np.array(tr_t)
    trace_bs = np.array(tr_bs, dtype=np.int32)
    trace_cfg = np.array(tr_cfg, dtype=np.int16)
    trace_tok = np.array(tr_tok, dtype=np.int64)
    phases = _phase_stats(workload, ends, profile.config_names, trace_t, trace_bs, trace_cfg, trace_tok,
                          np.array(fin_t), np.array(fin_tpot))
    return SimResult(
        policy=policy.name, profile=profile.name, workload=workload.name, duration_s=total_s,
        output_tokens=total_tokens, num_steps=len(tr_t), tpot_ms=np.array(fin_tpot), phases=phases,
        trace_t=trace_t, trace_bs=trace_bs, trace_cfg=trace_cfg, trace_tokens=trace_tok,
        config_names=profile.config_names, config_steps=tuple(cfg_steps),
        wall_s=_time.perf_counter() - wall0)


def _phase_stats(workload: Workload, ends: list[float], config_names: Sequence[str], t: np.ndarray,
                 bs: np.ndarray, cfg: np.ndarray, tok: np.ndarray, fin_t: np.ndarray,
                 fin_tpot: np.ndarray) -> list[PhaseStats]:
    """Per phase, from the step trace: a step belongs to the phase it started in; a request's
    TPOT to the phase it finished in."""
    ph = np.minimum(np.searchsorted(ends, t, side="right"), len(ends) - 1)
    fph = np.minimum(np.searchsorted(ends, fin_t, side="right"), len(ends) - 1) if len(fin_t) else fin_t
    out = []
    for j, p in enumerate(workload.phases):
        m = ph == j
        st = PhaseStats(p.name, p.duration_s, output_tokens=int(tok[m].sum()), num_steps=int(m.sum()),
                        batch_sum=int(bs[m].sum()))
        st.tpot_ms = fin_tpot[fph == j].tolist() if len(fin_t) else []
        counts = np.bincount(cfg[m], minlength=len(config_names))
        st.config_steps = {config_names[i]: int(n) for i, n in enumerate(counts) if n}
        out.append(st)
    return out
