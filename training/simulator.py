"""Discrete-event simulation of an SGLang-style continuous-batching decode loop with speculation.

Reads the DESIGN.md cost-profile and workload files; seeded, deterministic, numpy-vectorised.
"""

from __future__ import annotations

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
    """Step time per configuration, piecewise-linear in batch size (linear beyond the ends)."""

    name: str
    config_names: tuple[str, ...]
    configs: tuple[Config, ...]
    points: tuple[tuple[tuple[float, float], ...], ...]  # per config, sorted (batch, step_ms)
    noise_cv: float = 0.0
    _table: np.ndarray = field(default=None, repr=False, compare=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        b = np.arange(_TABLE_MAX_BATCH + 1, dtype=float)
        table = np.stack([_interp(b, pts) for pts in self.points])
        object.__setattr__(self, "_table", table)

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
        try:
            pts = tuple(sorted((float(p[0]), float(p[1])) for p in pts_raw))
        except (TypeError, ValueError, IndexError, KeyError):
            raise bad(f"step_ms.{name} must be a list of [batch_size, ms] pairs") from None
        if not pts:
            raise bad(f"step_ms.{name} is empty")
        for b, ms in pts:
            if not (math.isfinite(b) and math.isfinite(ms)) or b < 1 or ms <= 0:
                raise bad(f"step_ms.{name} has point [{b}, {ms}]: batch must be >= 1 and ms > 0")
        if len({p[0] for p in pts}) != len(pts):
            raise bad(f"step_ms.{name} repeats a batch size")
        names.append(str(name))
        configs.append(cfg)
        points.append(pts)
    extra = set(step_obj) - set(names)
    if extra:
        raise bad(f"step_ms names configs not in 'configs': {sorted(extra)}")
    cv = obj.get("noise_cv", 0.0)
    if not isinstance(cv, (int, float)) or not math.isfinite(cv) or not 0 <= cv < 1:
        raise bad(f"noise_cv must be a number in [0, 1), got {cv!r}")
    return Profile(name=str(obj.get("name") or Path(source).stem), config_names=tuple(names),
                   configs=tuple(configs), points=tuple(points), noise_cv=float(cv))


# ---------------------------------------------------------------------------------------------
# workload


@dataclass(frozen=True)
class RequestClass:
    name: str
    accept: Mapping[str, tuple[float, ...]]  # config name -> per-position conditional acceptance
    output_tokens: tuple[int, int]  # uniform integer range, inclusive


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
        classes.append(RequestClass(str(cname), accept, (int(ot[0]), int(ot[1]))))
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
    expected tokens per request of every profile config for the batch (the oracle)."""

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


class _Grow:
    """Append-only numpy column that doubles its capacity."""

    def __init__(self, dtype: Any, cap: int = 4096):
        self.a = np.empty(cap, dtype=dtype)
        self.n = 0

    def append(self, v: Any) -> None:
        if self.n == len(self.a):
            self.a = np.concatenate([self.a, np.empty_like(self.a)])
        self.a[self.n] = v
        self.n += 1

    def view(self) -> np.ndarray:
        return self.a[: self.n]


class _Requests:
    """The request stream of a workload: request i has the same uniforms under every policy
    (common random numbers), so policies are compared on the same draws."""

    def __init__(self, workload: Workload, max_steps: int):
        self.workload = workload
        self.max_steps = max_steps
        self.seed = workload.seed
        self._attr = np.random.default_rng([self.seed, 1]).random((1024, 2))
        self.num_created = 0
        self.u = np.empty(1 << 16, dtype=np.float32)  # per-token uniforms of all requests, concatenated
        self.u_used = 0
        self.class_index = {c.name: i for i, c in enumerate(workload.classes)}

    def create(self, phase: Phase) -> tuple[int, int, int]:
        """(class index, output tokens, offset of its uniforms)."""
        i = self.num_created
        self.num_created += 1
        if i >= len(self._attr):
            more = np.random.default_rng([self.seed, 1, len(self._attr)]).random((len(self._attr), 2))
            self._attr = np.concatenate([self._attr, more])
        u_cls, u_len = self._attr[i]
        acc = 0.0
        cname = next(iter(phase.mix))
        for cname, w in phase.mix.items():
            acc += w
            if u_cls < acc:
                break
        ci = self.class_index[cname]
        lo, hi = self.workload.classes[ci].output_tokens
        length = lo + min(int(u_len * (hi - lo + 1)), hi - lo)
        n = length + self.max_steps + 1
        while self.u_used + n > len(self.u):
            self.u = np.concatenate([self.u, np.empty_like(self.u)])
        off = self.u_used
        self.u[off: off + n] = np.random.default_rng([self.seed, 2, i]).random(n, dtype=np.float32)
        self.u_used += n
        return ci, length, off


def simulate(profile: Profile, workload: Workload, policy: SimPolicy, *,
             seed: Optional[int] = None, on_step: Optional[Callable[[float, int, int, int], None]] = None,
             clock: Optional[Callable[[], float]] = None) -> SimResult:
    """Run one policy over the whole workload on virtual time and return its figures.

    `seed` overrides the workload's; `on_step(t_s, batch_size, config_index, tokens)` is called
    after every step (live displays); `clock`, if given, is a wall clock the loop paces itself to
    (live mode: one virtual second per wall second)."""
    import time as _time

    if seed is not None:
        workload = Workload(workload.name, seed, workload.classes, workload.phases, workload.max_running)
    wall0 = _time.perf_counter()
    A = accept_matrix(profile, workload)
    tau = expected_tau(A)  # [class, config]
    max_steps = A.shape[2]
    n_cls = len(workload.classes)
    cfg_index = {c: i for i, c in enumerate(profile.configs)}
    cfg_steps = np.array([c[0] for c in profile.configs])
    uses_truth = bool(getattr(policy, "uses_truth", False))
    reqs = _Requests(workload, max_steps)
    pos_ar = np.arange(max_steps)
    noise_cv = profile.noise_cv
    sigma = math.sqrt(math.log1p(noise_cv * noise_cv)) if noise_cv > 0 else 0.0
    noise_rng = np.random.default_rng([workload.seed, 3])
    noise_block = np.empty(0)
    nb_i = 0

    # running batch, as parallel arrays
    r_cls = np.empty(0, dtype=np.int64)
    r_len = np.empty(0, dtype=np.int64)
    r_pos = np.empty(0, dtype=np.int64)
    r_off = np.empty(0, dtype=np.int64)
    r_t0 = np.empty(0, dtype=float)
    queue: deque[tuple[int, int, int]] = deque()  # waiting for a running slot (max_running)
    cls_count = np.zeros(n_cls, dtype=np.int64)

    ends = np.cumsum([p.duration_s for p in workload.phases])
    total_s = float(ends[-1])
    phases = [PhaseStats(p.name, p.duration_s) for p in workload.phases]
    # open-loop arrivals per phase, from their own stream: the same under every policy
    arrivals: list[np.ndarray] = []
    for j, p in enumerate(workload.phases):
        start = float(ends[j] - p.duration_s)
        if p.arrival_rate:
            rng = np.random.default_rng([workload.seed, 4, j])
            n_est = int(p.arrival_rate * p.duration_s * 1.5 + 20)
            t = start + np.cumsum(rng.exponential(1.0 / p.arrival_rate, n_est))
            while t[-1] < ends[j]:
                t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(1.0 / p.arrival_rate, n_est))])
            arrivals.append(t[t < ends[j]])
        else:
            arrivals.append(np.empty(0))
    arr_j, arr_k = 0, 0

    tr_t, tr_bs, tr_cfg, tr_tok = _Grow(float), _Grow(np.int32), _Grow(np.int16), _Grow(np.int32)
    tpots = _Grow(float)
    now = 0.0
    phase_j = 0
    in_system = 0  # running + queued
    max_running = workload.max_running or (1 << 30)
    total_tokens = 0
    step_no = 0
    new_cls: list[int] = []
    new_len: list[int] = []
    new_off: list[int] = []
    new_t0: list[float] = []

    def admit(item: tuple[int, int, int]) -> None:
        new_cls.append(item[0])
        new_len.append(item[1])
        new_off.append(item[2])
        new_t0.append(now)

    while now < total_s:
        while phase_j < len(ends) - 1 and now >= ends[phase_j]:
            phase_j += 1
        phase = workload.phases[phase_j]
        # arrivals: open-loop events up to now; closed loop tops up to its concurrency
        while arr_j <= phase_j:
            if arr_k < len(arrivals[arr_j]) and (arr_j < phase_j or arrivals[arr_j][arr_k] <= now):
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
        running = len(r_cls) + len(new_cls)
        while queue and running < max_running:
            admit(queue.popleft())
            running += 1
        if new_cls:
            r_cls = np.concatenate([r_cls, np.array(new_cls, dtype=np.int64)])
            r_len = np.concatenate([r_len, np.array(new_len, dtype=np.int64)])
            r_off = np.concatenate([r_off, np.array(new_off, dtype=np.int64)])
            r_pos = np.concatenate([r_pos, np.zeros(len(new_cls), dtype=np.int64)])
            r_t0 = np.concatenate([r_t0, np.array(new_t0)])
            for c in new_cls:
                cls_count[c] += 1
            new_cls.clear(); new_len.clear(); new_off.clear(); new_t0.clear()
        bs = len(r_cls)
        if bs == 0:
            # idle: jump to the next arrival or the next phase boundary (both lie after `now`)
            nxt = float(ends[phase_j])
            if arr_k < len(arrivals[phase_j]):
                nxt = min(nxt, float(arrivals[phase_j][arr_k]))
            now = max(nxt, now)
            continue

        if uses_truth:
            batch_tau = cls_count @ tau / bs
            config = policy.decide_with_truth(bs, batch_tau)  # type: ignore[attr-defined]
        else:
            config = policy.decide(bs)
        k = cfg_index.get(config)
        if k is None:
            raise SimFileError(f"policy {policy.name!r} chose configuration {config} "
                               f"({config_name(config)}), which profile {profile.name!r} does not measure; "
                               f"it has {', '.join(profile.config_names)}")
        s = int(cfg_steps[k])
        if s > 0:
            u = reqs.u[r_off[:, None] + r_pos[:, None] + pos_ar[None, :s]]
            ok = u < A[r_cls, k, :s]
            accepted = np.cumprod(ok, axis=1).sum(axis=1)
        else:
            accepted = np.zeros(bs, dtype=np.int64)
        remaining = r_len - r_pos
        emitted = np.minimum(accepted + 1, remaining)
        ms = profile.step_ms(k, bs)
        if sigma > 0:
            if nb_i >= len(noise_block):
                noise_block = noise_rng.lognormal(-0.5 * sigma * sigma, sigma, 8192)
                nb_i = 0
            ms *= float(noise_block[nb_i])
            nb_i += 1
        toks = int(emitted.sum())
        st = phases[phase_j]
        st.output_tokens += toks
        st.num_steps += 1
        st.batch_sum += bs
        cn = profile.config_names[k]
        st.config_steps[cn] = st.config_steps.get(cn, 0) + 1
        tr_t.append(now); tr_bs.append(bs); tr_cfg.append(k); tr_tok.append(toks)
        total_tokens += toks
        step_no += 1
        now += ms / 1000.0
        policy.observe(bs, config, accepted, ms, now)
        if on_step is not None:
            on_step(now, bs, k, toks)
        if clock is not None:
            lag = now - clock()
            if lag > 0:
                _time.sleep(lag)
        r_pos = r_pos + emitted
        done = r_pos >= r_len
        if done.any():
            nd = int(done.sum())
            for t0, n in zip(r_t0[done], r_len[done]):
                tpots.append((now - t0) * 1000.0 / n)
                st.tpot_ms.append((now - t0) * 1000.0 / n)
            for c in r_cls[done]:
                cls_count[c] -= 1
            keep = ~done
            r_cls, r_len, r_pos, r_off, r_t0 = r_cls[keep], r_len[keep], r_pos[keep], r_off[keep], r_t0[keep]
            in_system -= nd

    return SimResult(
        policy=policy.name, profile=profile.name, workload=workload.name, duration_s=total_s,
        output_tokens=total_tokens, num_steps=step_no, tpot_ms=tpots.view().copy(), phases=phases,
        trace_t=tr_t.view().copy(), trace_bs=tr_bs.view().copy(), trace_cfg=tr_cfg.view().copy(),
        trace_tokens=tr_tok.view().copy(), config_names=profile.config_names,
        config_steps=tuple(int(c[0]) for c in profile.configs), wall_s=_time.perf_counter() - wall0)
