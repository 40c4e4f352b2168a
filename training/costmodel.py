"""The online cost model: measured step time per configuration vs batch size, and acceptance.

`CostModel` follows the scikit-learn estimator contract (`__init__` stores parameters, `fit` /
`partial_fit` set trailing-underscore state and return self, `predict_*` check it is fitted).
Recent traffic dominates: a step-time sample's weight halves every `half_life_s` of its timestamp
age (a property of model + hardware: slow); acceptance halves every `accept_half_life_s` (a
property of the traffic: it shifts within a minute when the prompt mix does).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np
from sklearn.isotonic import IsotonicRegression

Config = tuple[int, int, int]  # (steps, topk, draft_tokens)
OFF: Config = (0, 1, 1)
RING = 32  # recent step times kept per (config, batch size) for the robust median
PRIOR_REQUESTS = 32.0  # pseudo-requests behind the trend prior of a deeper chain position
MIN_SETTLED = 3  # steady-state values needed before post-switch ones are ignored
ACCEPT_CAP_PER_S = 64.0  # requests one second of traffic may weigh in the acceptance estimate
ACCEPT_VAR_FLOOR = 0.05  # accepted-drafts variance assumed at least (a one-bar histogram has none)
_REBASE_HALF_LIVES = 256.0  # renormalise decayed weights long before 2**(age/half_life) overflows


def config_name(c: Config) -> str:
    if c[0] == 0:
        return "off"
    return f"s{c[0]}" if c[1] == 1 else f"s{c[0]}k{c[1]}n{c[2]}"


def regions(max_batch: int) -> list[tuple[int, int]]:
    """Log2 batch-size regions [1,1], [2,3], [4,7], ... covering 1..max_batch."""
    out, lo = [], 1
    while lo <= max_batch:
        out.append((lo, 2 * lo - 1))
        lo *= 2
    return out


@dataclass(slots=True)
class Sample:
    """One measurement the model learns from.

    Telemetry gives one decode step (`weight` 1, per-request `accepted`); interval-averaged sources
    (SGLang decode-log lines, bench_serving runs) give `weight` = steps it stands for and
    `mean_accepted` = mean accepted drafts per request instead of the list.
    """

    ts: float
    config: Config
    batch_size: int
    step_ms: Optional[float]
    accepted: Optional[Sequence[int]] = None
    weight: float = 1.0
    mean_accepted: Optional[float] = None
    server: str = ""
    rank: int = 0

    @classmethod
    def from_record(cls, rec: Any) -> "Sample":
        c = rec.config
        return cls(ts=rec.ts, config=(c.steps, c.topk, c.draft_tokens), batch_size=rec.batch_size,
                   step_ms=rec.step_ms, accepted=rec.accepted, server=rec.server, rank=rec.rank)


@dataclass
class _TimeCell:
    """Step times of one (config, batch size): decayed weight + the most recent values."""

    weight: float = 0.0  # decayed, in the model's scaled units
    recent: deque = field(default_factory=lambda: deque(maxlen=RING))
    warm_weight: float = 0.0  # steps right after a configuration switch
    warm: deque = field(default_factory=lambda: deque(maxlen=RING))

    def settled(self) -> tuple[deque, float]:
        """The steady-state values if there are enough, else the post-switch ones."""
        if len(self.recent) >= MIN_SETTLED or not self.warm:
            return self.recent, self.weight
        return self.warm, self.warm_weight


@dataclass
class _AcceptCell:
    """Acceptance of one configuration: decayed histogram of accepted drafts per request.

    Requests are gathered per second of timestamps and each second counts for at most
    ACCEPT_CAP_PER_S requests when folded in: recent seconds dominate even when they are sparse
    (a chain probed on 1 step in 64 while plain decode runs) and older ones were dense.
    """

    hist: list  # index a = accepted drafts (0..steps); a plain list: cheap scalar updates
    mean_sum: float = 0.0  # decayed sum of mean_accepted*requests from interval sources
    mean_weight: float = 0.0
    pend: Optional[list] = None  # raw counts of the second being gathered
    pend_second: Optional[int] = None
    pend_wa: float = 0.0  # decay scale of that second
    # the last folded second, while it disagreed with the history before it: (sign, its counts)
    flagged: Optional[tuple[int, list]] = None

    def fold(self, change_z: float = 0.0) -> Optional[float]:
        """Fold the gathered second into the history. With `change_z` > 0, two folded seconds in
        a row whose mean accepted drafts sit more than `change_z` standard errors from the
        history, on the same side, mean the traffic has changed: the history is replaced by
        those two seconds. Returns the factor the history's weight shrank by then, else None."""
        p = self.pend
        if p is None:
            return None
        n = sum(p)
        shrunk = None
        if n > 0:
            f = self.pend_wa * min(1.0, ACCEPT_CAP_PER_S / n)
            add = [x * f for x in p]
            if change_z > 0:
                sign = self._deviation(p, n, change_z)
                if sign and self.flagged is not None and self.flagged[0] == sign:
                    before = sum(self.hist)
                    self.hist = list(self.flagged[1])
                    shrunk = sum(self.hist) / before if before > 0 else None
                    self.flagged = None
                else:
                    self.flagged = (sign, add) if sign else None
            h = self.hist
            for k, x in enumerate(add):
                if x:
                    h[k] += x
        self.pend = None
        self.pend_second = None
        return shrunk

    def _deviation(self, p: list, n: int, z: float) -> int:
        """+1 / -1 when the counts `p` (n requests) accept more / fewer drafts per request than
        the history, beyond z standard errors of the difference; else 0. Requests count at most
        ACCEPT_CAP_PER_S, as when folded."""
        h = self.hist
        w = sum(h)
        if w <= 0 or self.pend_wa <= 0:
            return 0
        m0 = sum(k * x for k, x in enumerate(h)) / w
        var = max(ACCEPT_VAR_FLOOR, sum((k - m0) ** 2 * x for k, x in enumerate(h)) / w)
        m1 = sum(k * x for k, x in enumerate(p)) / n
        se = math.sqrt(var * (1.0 / min(n, ACCEPT_CAP_PER_S) + self.pend_wa / w))
        d = (m1 - m0) / se
        return 1 if d > z else -1 if d < -z else 0

    def current(self) -> list:
        """The histogram with the second being gathered folded in (no mutation)."""
        p = self.pend
        if p is None or not sum(p):
            return self.hist
        f = self.pend_wa * min(1.0, ACCEPT_CAP_PER_S / sum(p))
        return [h + x * f for h, x in zip(self.hist, p)]


class CostModel:
    """Step time t(c, b) (monotone in b, median-robust, warm-up steps after a switch dropped) and
    tokens per step tau(c) = 1 + E[accepted drafts] per configuration.

    Chains (topk 1) share per-position conditional acceptance a_i, pooled over every chain
    configuration that reached position i, so tau of a chain never measured at its full length
    is still predicted: tau(s) = 1 + sum_{i<=s} prod_{j<=i} a_j.
    """

    def __init__(self, *, half_life_s: float = 600.0, accept_half_life_s: float = 8.0,
                 accept_change_z: float = 0.0, warmup_steps: int = 2,
                 min_region_samples: float = 16.0, max_batch: int = 4096):
        self.half_life_s = half_life_s
        self.accept_half_life_s = accept_half_life_s
        self.accept_change_z = accept_change_z
        self.warmup_steps = warmup_steps
        self.min_region_samples = min_region_samples
        self.max_batch = max_batch

    # ------------------------------------------------------------------ ingestion

    def _reset(self) -> None:
        self.t0_: Optional[float] = None
        self.now_: float = 0.0
        self.times_: dict[tuple[Config, int], _TimeCell] = {}
        self.accept_: dict[Config, _AcceptCell] = {}
        self.last_config_: dict[tuple[str, int], tuple[Config, int]] = {}
        self.num_samples_: int = 0
        self.num_warmup_dropped_: int = 0
        self.num_accept_changes_: int = 0  # acceptance histories replaced on a detected shift
        self.fitted_: Optional[dict[Config, "_TimeFit"]] = None

    def fit(self, samples: Iterable[Sample]) -> "CostModel":
        self._reset()
        return self.partial_fit(samples)

    def partial_fit(self, samples: Iterable[Sample]) -> "CostModel":
        if not hasattr(self, "times_"):
            self._reset()
        for s in samples:
            self.observe(s)
        self.refit()
        return self

    def _scale(self, ts: float) -> tuple[float, float]:
        """Weights (step time, acceptance) of a sample stamped `ts`, relative to t0."""
        if self.t0_ is None:
            self.t0_ = ts
        if ts > self.now_:
            self.now_ = ts
        age = ts - self.t0_
        if age > _REBASE_HALF_LIVES * min(self.half_life_s, self.accept_half_life_s):
            self._rebase(ts)
            age = 0.0
        return 2.0 ** (age / self.half_life_s), 2.0 ** (age / self.accept_half_life_s)

    def _rebase(self, ts: float) -> None:
        age = ts - self.t0_  # type: ignore[operator]
        f = 2.0 ** (-age / self.half_life_s)
        fa = 2.0 ** (-age / self.accept_half_life_s)
        for cell in self.times_.values():
            cell.weight *= f
            cell.warm_weight *= f
        for acc in self.accept_.values():
            acc.hist = [x * fa for x in acc.hist]
            acc.pend_wa *= fa
            if acc.flagged is not None:
                acc.flagged = (acc.flagged[0], [x * fa for x in acc.flagged[1]])
            acc.mean_sum *= fa
            acc.mean_weight *= fa
        self.t0_ = ts

    def observe(self, s: Sample) -> None:
        """Take one sample (hot path of the daemon: keep it O(batch size) and allocation-light)."""
        if not hasattr(self, "times_"):
            self._reset()
        wt, wa = self._scale(s.ts)
        w = s.weight * wt
        wa *= s.weight
        self.num_samples_ += 1
        c = tuple(s.config)
        steps = c[0]
        # acceptance: counted for every speculative step, warm-up or not
        if steps > 0:
            acc = self.accept_.get(c)  # type: ignore[arg-type]
            if acc is None:
                acc = self.accept_[c] = _AcceptCell(hist=[0.0] * (steps + 1))  # type: ignore[index]
            if s.accepted is not None:
                second = int(s.ts)
                if acc.pend_second != second:
                    shrunk = acc.fold(self.accept_change_z)
                    if shrunk is not None:
                        self.num_accept_changes_ += 1
                    if shrunk is not None and c[1] == 1:
                        # chains pool their acceptance by position: a change seen on one chain
                        # ages the others' history alike
                        for k, other in self.accept_.items():
                            if k != c and k[1] == 1:
                                other.hist = [x * shrunk for x in other.hist]
                                other.flagged = None
                    acc.pend = [0] * (steps + 1)
                    acc.pend_second = second
                    acc.pend_wa = wa
                p = acc.pend
                counts = s.accepted.count  # C-speed passes beat a per-request Python loop
                for k in range(steps + 1):
                    n = counts(k)
                    if n:
                        p[k] += n  # type: ignore[index]
            elif s.mean_accepted is not None:
                acc.mean_sum += wa * s.batch_size * s.mean_accepted
                acc.mean_weight += wa * s.batch_size
        if s.step_ms is None or not (s.step_ms > 0 and math.isfinite(s.step_ms)):
            return
        # step time: the first steps after a switch pay for state changes; skip them (single
        # steps only: an interval-averaged sample has already diluted them)
        if s.weight > 1:
            self._add_time(c, s.batch_size, w, s.step_ms)  # type: ignore[arg-type]
            return
        key = (s.server, s.rank)
        prev = self.last_config_.get(key)
        if prev is None:
            n = self.warmup_steps + 1  # no history: nothing to say it follows a switch
        elif prev[0] != c:
            n = 1
        else:
            n = prev[1] + 1
        self.last_config_[key] = (c, n)  # type: ignore[assignment]
        warm = n <= self.warmup_steps
        if warm:
            self.num_warmup_dropped_ += 1
        self._add_time(c, s.batch_size, w, s.step_ms, warm)  # type: ignore[arg-type]

    def _add_time(self, c: Config, batch_size: int, w: float, step_ms: float, warm: bool = False) -> None:
        b = min(batch_size, self.max_batch)
        cell = self.times_.get((c, b))
        if cell is None:
            cell = self.times_[(c, b)] = _TimeCell()
        if warm:
            # kept aside: used only where a configuration never runs long enough to settle
            # (an engine switching every step pays the switch every step)
            cell.warm_weight += w
            cell.warm.append(step_ms)
        else:
            cell.weight += w
            cell.recent.append(step_ms)

    # ------------------------------------------------------------------ fitting

    def refit(self) -> "CostModel":
        by_config: dict[Config, list[tuple[int, float, float]]] = {}
        for (c, b), cell in self.times_.items():
            values, weight = cell.settled()
            if values:
                by_config.setdefault(c, []).append((b, float(np.median(values)), weight))
        fits: dict[Config, _TimeFit] = {}
        for c, pts in by_config.items():
            pts.sort()
            fits[c] = _TimeFit.build(pts)
        # a configuration seen at one batch size only borrows the shape of the best-covered one
        shape = max((f for f in fits.values() if len(f.b) >= 2), key=lambda f: len(f.b), default=None)
        for f in fits.values():
            if len(f.b) == 1 and shape is not None:
                f.borrow_shape(shape)
        self.fitted_ = fits
        return self

    def _check(self) -> dict[Config, "_TimeFit"]:
        if getattr(self, "fitted_", None) is None:
            raise RuntimeError("CostModel is not fitted yet: call fit() or partial_fit() first")
        return self.fitted_  # type: ignore[return-value]

    # ------------------------------------------------------------------ prediction

    def configs(self) -> list[Config]:
        fits = self._check()
        return sorted(set(fits) | set(self.accept_) | {OFF})

    def has_step_time(self, c: Config) -> bool:
        return tuple(c) in self._check()

    def predict_step_ms(self, c: Config, batch_sizes: Sequence[int] | np.ndarray) -> np.ndarray:
        fits = self._check()
        f = fits.get(tuple(c))  # type: ignore[arg-type]
        if f is None:
            raise KeyError(f"no step-time measurements for {config_name(c)}")
        return f.predict(np.asarray(batch_sizes, dtype=float))

    def acceptance_by_position(self, c: Config) -> Optional[np.ndarray]:
        """Conditional acceptance a_i (i = 1..steps) pooled over chains, or None if unmeasured."""
        steps, topk, _ = c
        if steps == 0:
            return np.zeros(0)
        reached = np.zeros(steps)
        accepted = np.zeros(steps)
        cells = [(k, a) for k, a in self.accept_.items() if (k[1] == 1 and topk == 1) or k == tuple(c)]
        for k, a in cells:
            h = np.asarray(a.current(), dtype=float)
            s = len(h) - 1
            tail = np.cumsum(h[::-1])[::-1]  # tail[i] = requests with >= i accepted
            n = min(s, steps)
            # position i (1-based) was reached by requests with >= i-1 accepted; accepted by >= i
            reached[:n] += tail[0:n]
            accepted[:n] += tail[1 : n + 1]
        if reached[0] <= 0:
            return None
        # in requests as of now: stale counts (a position only a rarely used chain reaches)
        # shrink, and the estimate falls back toward the trend of the fresh lower positions
        f = self._now_factor(self.accept_half_life_s)
        reached *= f
        accepted *= f
        out = np.zeros(steps)
        out[0] = accepted[0] / reached[0]
        for i in range(1, steps):
            prev = out[i - 1]
            trend = min(1.0, prev / out[i - 2]) if i >= 2 and out[i - 2] > 0 else 1.0
            prior = prev * trend
            out[i] = (accepted[i] + PRIOR_REQUESTS * prior) / (reached[i] + PRIOR_REQUESTS)
        return out

    def tokens_per_step(self, c: Config) -> Optional[float]:
        """tau(c) = 1 + E[accepted drafts per request]; 1 for plain decode; None if unknown."""
        c = tuple(c)  # type: ignore[assignment]
        if c[0] == 0:
            return 1.0
        own = self.accept_.get(c)
        if own is not None and sum(own.current()) <= 0 and own.mean_weight > 0:
            return 1.0 + own.mean_sum / own.mean_weight
        a = self.acceptance_by_position(c)
        if a is None:
            if own is not None and own.mean_weight > 0:
                return 1.0 + own.mean_sum / own.mean_weight
            return None
        if c[1] != 1:  # trees: the accepted path length is measured directly
            h = np.asarray(own.current(), dtype=float) if own is not None else None
            if h is not None and h.sum() > 0:
                return 1.0 + float((np.arange(len(h)) * h).sum() / h.sum())
        return 1.0 + float(np.cumprod(a).sum())

    def accept_weight(self, c: Config) -> float:
        """Decayed number of requests behind tau(c) (for uncertainty reporting)."""
        acc = self.accept_.get(tuple(c))  # type: ignore[arg-type]
        if acc is None:
            return 0.0
        return float(sum(acc.current()) + acc.mean_weight) * self._now_factor(self.accept_half_life_s)

    def accept_weight_total(self, chains_only: bool = True) -> float:
        """Decayed requests behind the (pooled) chain acceptance estimate."""
        return sum(self.accept_weight(c) for c in self.accept_ if not chains_only or c[1] == 1)

    def _now_factor(self, half_life_s: Optional[float] = None) -> float:
        if self.t0_ is None:
            return 0.0
        return 2.0 ** (-(self.now_ - self.t0_) / (half_life_s or self.half_life_s))

    def region_samples(self, c: Config, max_batch: int) -> list[tuple[int, int, float]]:
        """(lo, hi, decayed samples) per log2 region for configuration c."""
        f = self._now_factor()
        out = []
        for lo, hi in regions(max_batch):
            wsum = sum(cell.weight + cell.warm_weight for (k, b), cell in self.times_.items()
                       if k == tuple(c) and lo <= b <= hi)
            out.append((lo, hi, wsum * f))
        return out

    def step_time_cv(self) -> Optional[float]:
        """Robust coefficient of variation of the step time at a fixed configuration and batch
        size: the median over (configuration, batch size) cells of 1.4826 * MAD / median of
        their recent values; None while no cell has MIN_SETTLED values. Pooled because the
        noise is the engine's (scheduling, clocks), and a configuration that is only explored
        now and then never gathers enough values of its own."""
        cvs = []
        for cell in self.times_.values():
            values, _ = cell.settled()
            if len(values) >= MIN_SETTLED:
                v = np.asarray(values, dtype=float)
                med = float(np.median(v))
                if med > 0:
                    cvs.append(1.4826 * float(np.median(np.abs(v - med))) / med)
        return float(np.median(cvs)) if cvs else None

    def step_samples(self, c: Config) -> float:
        """Decayed step-time samples of c (all batch sizes), as of the newest timestamp."""
        w = sum(cell.weight + cell.warm_weight for (k, _), cell in self.times_.items() if k == tuple(c))
        return w * self._now_factor()

    def measured_range(self, c: Config) -> tuple[int, int, int]:
        """(lowest, highest, number of) batch sizes with step-time data for c."""
        f = self._check().get(tuple(c))  # type: ignore[arg-type]
        if f is None:
            return (0, 0, 0)
        return (int(f.b[0]), int(f.b[-1]), len(f.b))

    def max_observed_batch(self) -> int:
        return max((b for (_, b) in self.times_), default=0)

    def fit_error(self) -> dict[str, float]:
        """Median relative error of the fitted curve against the per-batch medians, per config."""
        fits = self._check()
        out = {}
        for c, f in fits.items():
            pred = f.predict(f.b)
            out[config_name(c)] = float(np.median(np.abs(pred - f.t) / np.maximum(f.t, 1e-9)))
        return out

    # ------------------------------------------------------------------ persistence

    def get_state(self) -> dict[str, Any]:
        """JSON-able aggregate state (not raw samples): restarts resume from it."""
        if not hasattr(self, "times_"):
            self._reset()
        return {
            "kind": "specctl.model", "version": 1,
            "half_life_s": self.half_life_s, "accept_half_life_s": self.accept_half_life_s,
            "t0": self.t0_, "now": self.now_,
            "num_samples": self.num_samples_, "warmup_dropped": self.num_warmup_dropped_,
            "times": [[list(c), b, cell.weight, list(cell.recent), cell.warm_weight, list(cell.warm)]
                      for (c, b), cell in self.times_.items()],
            "accept": [[list(c), list(a.current()), a.mean_sum, a.mean_weight] for c, a in self.accept_.items()],
        }

    def set_state(self, state: dict[str, Any]) -> "CostModel":
        if state.get("kind") != "specctl.model" or state.get("version") != 1:
            raise ValueError("not a specctl model state (kind/version)")
        self._reset()
        self.t0_ = state["t0"]
        self.now_ = float(state["now"])
        self.num_samples_ = int(state["num_samples"])
        self.num_warmup_dropped_ = int(state.get("warmup_dropped", 0))
        for c, b, w, recent, ww, warm in state["times"]:
            cell = _TimeCell(weight=float(w), warm_weight=float(ww))
            cell.recent.extend(float(x) for x in recent[-RING:])
            cell.warm.extend(float(x) for x in warm[-RING:])
            self.times_[(tuple(c), int(b))] = cell  # type: ignore[index]
        for c, hist, ms, mw in state["accept"]:
            self.accept_[tuple(c)] = _AcceptCell(hist=[float(x) for x in hist],  # type: ignore[index]
                                                 mean_sum=float(ms), mean_weight=float(mw))
        return self.refit()

    def summary(self, max_batch: Optional[int] = None) -> dict[str, Any]:
        fits = self._check()
        mb = max_batch or max(self.max_observed_batch(), 1)
        f = self._now_factor()
        per = {}
        for c in self.configs():
            tau = self.tokens_per_step(c)
            entry: dict[str, Any] = {
                "config": {"steps": c[0], "topk": c[1], "draft_tokens": c[2]},
                "tokens_per_step": None if tau is None else round(tau, 4),
                "accept_samples": round(self.accept_weight(c), 1),
            }
            if c in fits:
                tf = fits[c]
                entry["step_ms_points"] = len(tf.b)
                entry["batch_range"] = [int(tf.b[0]), int(tf.b[-1])]
                entry["step_samples"] = round(float(tf.w.sum()) * f, 1)
                entry["regions"] = [
                    {"min_batch": lo, "max_batch": hi, "samples": round(n, 1)}
                    for lo, hi, n in self.region_samples(c, mb)
                ]
                a = self.acceptance_by_position(c)
                if a is not None and len(a):
                    entry["accept_rate_by_position"] = [round(float(x), 4) for x in a]
            per[config_name(c)] = entry
        return {
            "samples": self.num_samples_,
            "warmup_dropped": self.num_warmup_dropped_,
            "accept_changes": self.num_accept_changes_,
            "half_life_s": self.half_life_s,
            "accept_half_life_s": self.accept_half_life_s,
            "fit_error": {k: round(v, 4) for k, v in self.fit_error().items()},
            "configs": per,
        }


@dataclass
class _TimeFit:
    """Isotonic (non-decreasing) fit through per-batch medians inside the measured range; linear
    extrapolation outside it, with slopes from a weighted least-squares line over each end."""

    b: np.ndarray
    t: np.ndarray  # medians
    w: np.ndarray
    y: np.ndarray  # isotonic values
    slope_lo: float
    slope_hi: float
    borrowed: Optional["_TimeFit"] = None

    @classmethod
    def build(cls, pts: list[tuple[int, float, float]]) -> "_TimeFit":
        b = np.array([p[0] for p in pts], dtype=float)
        t = np.array([p[1] for p in pts], dtype=float)
        w = np.array([max(p[2], 1e-12) for p in pts], dtype=float)
        if len(b) >= 2:
            y = IsotonicRegression(increasing=True).fit(b, t, sample_weight=w).predict(b)
        else:
            y = t.copy()
        slope_lo = _end_slope(b, y, w, low=True)
        slope_hi = _end_slope(b, y, w, low=False)
        return cls(b=b, t=t, w=w, y=y, slope_lo=slope_lo, slope_hi=slope_hi)

    def borrow_shape(self, other: "_TimeFit") -> None:
        self.borrowed = other

    def predict(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        if len(self.b) == 1:
            if self.borrowed is None:
                return np.full(x.shape, self.y[0])
            # same relative shape as the best-covered configuration, anchored at our one point
            ref = self.borrowed.predict(np.concatenate([self.b, x]))
            return self.y[0] * ref[1:] / max(ref[0], 1e-9)
        out = np.interp(x, self.b, self.y)
        lo, hi = self.b[0], self.b[-1]
        below = x < lo
        above = x > hi
        out[below] = self.y[0] - self.slope_lo * (lo - x[below])
        out[above] = self.y[-1] + self.slope_hi * (x[above] - hi)
        return np.maximum(out, 1e-6)


def _end_slope(b: np.ndarray, y: np.ndarray, w: np.ndarray, *, low: bool) -> float:
    """Non-negative weighted LSQ slope over the lowest/highest half of the points (>= 2)."""
    n = len(b)
    if n < 2:
        return 0.0
    k = max(2, (n + 1) // 2)
    sl = slice(0, k) if low else slice(n - k, n)
    bb, yy, ww = b[sl], y[sl], w[sl]
    ww = ww / ww.sum()
    mb = (ww * bb).sum()
    my = (ww * yy).sum()
    var = (ww * (bb - mb) ** 2).sum()
    if var <= 0:
        return 0.0
    return max(0.0, float((ww * (bb - mb) * (yy - my)).sum() / var))
