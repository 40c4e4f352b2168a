"""The simulator's inputs: cost profiles (docs/architecture.md) (step time per configuration and batch size) and
workloads (request classes, phases), parsed and checked, shipped or from files."""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from specctl.policies.table import OFF, Config

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
            cfg = OFF
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


