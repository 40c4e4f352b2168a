"""The cost model's measurements: the `Sample` it learns from, the cells it keeps per (configuration,
batch size) and per configuration, and the monotone step-time fit through them."""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
from sklearn.isotonic import IsotonicRegression

from ..policies.table import Config

RING = 64  # recent step times kept per (config, batch size) for the robust median
PRIOR_REQUESTS = 32.0  # pseudo-requests behind the trend prior of a deeper chain position
MIN_SETTLED = 3  # steady-state values needed before post-switch ones are ignored
# the median of n values with noise cv is off by about MEDIAN_SE * cv / sqrt(n) (sqrt(pi / 2))
MEDIAN_SE = 1.25
# post-switch values newer than every steady one that replace the steady values (see _TimeCell)
FRESH_WARM = 16
# how far a measured step time may have moved since it was measured: the relative standard error it
# gains per step-time half-life of age (linear in age); see CostModel.step_ms_errors
STEP_DRIFT_AT_HALF_LIFE = 0.1
# a batch size whose median is this many standard errors off the monotone fit keeps its median
MONOTONE_RELEASE_Z = 3.0
ACCEPT_CAP_PER_S = 64.0  # requests one second of traffic may weigh in the acceptance estimate
ACCEPT_STEPS_PER_REQUEST = 16.0  # of one request's steps in a second, this many count (see _AcceptCell)
ACCEPT_VAR_FLOOR = 0.05  # accepted-drafts variance assumed at least (a one-bar histogram has none)
_REBASE_HALF_LIVES = 256.0  # renormalise decayed weights long before 2**(age/half_life) overflows
# a context slope is used only where it is this many standard errors above 0 (else step time is
# taken not to depend on the context: no bands come of noise)
CTX_SLOPE_Z = 3.0
# the batch exponents e of the context term g * b^e * L tried (1 first: a cost per context token of the
# batch), and how much less unexplained step-time variance another must leave to be taken instead
CTX_EXPONENTS = (1.0, 0.75, 0.5, 0.25, 0.0)
CTX_EXPONENT_GAIN = 1e-3
CTX_CLIP = 4.0  # a step time this many times its cell's median is clipped there for the slope
_NAN = float("nan")



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
    ctx_tokens: Optional[int] = None  # context tokens of the whole batch, where known
    iter: Optional[int] = None  # the scheduler's forward iteration (telemetry; the GPU tooling's gap analysis)

    @classmethod
    def from_record(cls, rec: Any) -> "Sample":
        c = rec.config
        return cls(ts=rec.ts, config=(c.steps, c.topk, c.draft_tokens), batch_size=rec.batch_size,
                   step_ms=rec.step_ms, accepted=rec.accepted, server=rec.server, rank=rec.rank,
                   ctx_tokens=rec.ctx_tokens, iter=rec.iter)


@dataclass
class _TimeCell:
    """Step times of one (config, batch size): decayed weight + the most recent values, each
    with its timestamp.

    Steady values (not right after a configuration switch) are preferred. Post-switch values
    stand in while there are fewer than MIN_SETTLED steady ones, and once FRESH_WARM of them
    arrived after the newest steady value: a configuration the table left is then only measured
    by exploring steps, single steps between switches, and its last steady values would
    otherwise stand for it for good. Those were also the values that made the table leave it:
    a median of a few dozen noisy steps that happened to come out high, never revised. When
    the configuration runs steadily again, the superseded steady values are dropped, so its
    estimate goes on from the exploring steps' until MIN_SETTLED new steady values arrived."""

    weight: float = 0.0  # decayed, in the model's scaled units
    recent: deque = field(default_factory=lambda: deque(maxlen=RING))
    recent_ts: deque = field(default_factory=lambda: deque(maxlen=RING))
    warm_weight: float = 0.0  # steps right after a configuration switch
    warm: deque = field(default_factory=lambda: deque(maxlen=RING))
    warm_ts: deque = field(default_factory=lambda: deque(maxlen=RING))
    warm_since_steady: int = 0  # post-switch values taken since the newest steady one
    # the batch's ctx_tokens of each value (nan: unknown), beside `recent` and `warm`
    recent_ctx: deque = field(default_factory=lambda: deque(maxlen=RING))
    warm_ctx: deque = field(default_factory=lambda: deque(maxlen=RING))

    def _settled_from(self) -> tuple[bool, int]:
        """Which values stand for the cell: (the post-switch ones?, how many of the newest; 0 = all)."""
        fresh = min(self.warm_since_steady, len(self.warm))
        if fresh >= FRESH_WARM:
            return True, fresh
        return (len(self.recent) < MIN_SETTLED and bool(self.warm)), 0

    def settled(self) -> tuple[Sequence[float], float]:
        """The values the cell's median is taken over, and the decayed weight behind them."""
        warm, newest = self._settled_from()
        values = self.warm if warm else self.recent
        if newest:
            values = list(itertools.islice(values, len(values) - newest, None))  # type: ignore[assignment]
        return values, (self.warm_weight if warm else self.weight)

    def settled_newest_ts(self) -> float:
        """The timestamp of the newest value `settled` returns (-inf: none)."""
        stamps = self.warm_ts if self._settled_from()[0] else self.recent_ts
        return stamps[-1] if stamps else -math.inf

    def settled_ctx(self) -> Sequence[float]:
        """The ctx_tokens of the values `settled` returns, in the same order."""
        warm, newest = self._settled_from()
        ctx = self.warm_ctx if warm else self.recent_ctx
        return list(itertools.islice(ctx, len(ctx) - newest, None)) if newest else ctx

    def values_since(self, ts: float, enough: int) -> int:
        """How many values (steady or not) are stamped at or after ts, counting up to `enough`."""
        n = 0
        for stamps in (self.recent_ts, self.warm_ts):
            for t in reversed(stamps):
                if t < ts or n >= enough:
                    break
                n += 1
        return n


@dataclass
class _CtxCell:
    """Decayed weighted moments of (ctx_tokens x, step time t) of one (config, batch size), steps
    after a switch included (West's incremental algorithm): the context slope's sufficient
    statistics. Unlike the cell's ring of recent values these keep the whole step-time half-life,
    so traffic that alternates between short and long contexts is seen in both, whichever ran last."""

    w: float = 0.0
    mx: float = 0.0
    mt: float = 0.0
    mxx: float = 0.0
    mxt: float = 0.0
    mtt: float = 0.0

    def add(self, w: float, x: float, t: float) -> None:
        self.w += w
        r = w / self.w
        dx = x - self.mx
        dt = t - self.mt
        self.mx += r * dx
        self.mt += r * dt
        self.mxx += w * dx * (x - self.mx)
        self.mxt += w * dx * (t - self.mt)
        self.mtt += w * dt * (t - self.mt)

    def scale(self, f: float) -> None:
        self.w *= f
        self.mxx *= f
        self.mxt *= f
        self.mtt *= f


@dataclass
class _CtxFit:
    """Step time of one configuration against the context: `slope` g of the term g * b^e * L (ms per
    context token at batch 1; 0 where not significantly above 0), its standard error, the monotone fit of step time
    at no context (None: `slope` is 0 and the plain fit stands), the power-of-2 bands of mean
    context per request it was measured in, and their weighted mean."""

    slope: float
    slope_se: float
    at_zero: Optional["_TimeFit"]
    bands: tuple[int, ...]
    mean_ctx: float
    exponent: float = 1.0  # e: the context term is slope * b^e * L (slope: ms per context token at batch 1)


@dataclass
class _AcceptCell:
    """Acceptance of one configuration: decayed histogram of accepted drafts per request.

    Requests are gathered per second of timestamps and each second counts for at most
    ACCEPT_CAP_PER_S requests when folded in: recent seconds dominate even when they are sparse
    (a chain probed on 1 step in 64 while plain decode runs) and older ones were dense. A second
    also counts for at most ACCEPT_STEPS_PER_REQUEST steps of each request it saw (`cap`), so a
    second of two requests decoding a hundred steps weighs 32, not 64, against one step of 48
    fresh requests: when traffic surges onto new prompts, the few old ones give way sooner. The
    steps of one request do share its prompt (on H200 telemetry one request's ~60-85 steps in a
    second are worth 34-78 independent ones at batch 2, 4 and 8, and 8-18 at batch 16-100:
    benchmarks/gpu/acceptance_correlation.py), but 16 is below that at small batches: the value
    is the simulator's (a faster hand-over after surges, no loss on stationary traffic).

    For the estimate's standard error each folded second is one cluster: with y its tail counts
    as folded (y[i] = weight of requests with >= i accepted drafts), `sq` keeps the decayed sum of
    y y^T (how much the seconds scatter) and `q` that of wa * y (the within-second binomial
    variance of a second worth at most `cap` requests); both decay at twice the rate.
    """

    hist: list  # index a = accepted drafts (0..steps); a plain list: cheap scalar updates
    mean_sum: float = 0.0  # decayed sum of mean_accepted*requests from interval sources
    mean_weight: float = 0.0
    pend: Optional[list] = None  # raw counts of the second being gathered
    pend_second: Optional[int] = None
    pend_wa: float = 0.0  # decay scale of that second
    pend_req: int = 0  # the most requests one step of that second had (distinct requests, at least)
    # the last folded second, while it disagreed with the history before it:
    # (sign, its counts as folded, its decay scale)
    flagged: Optional[tuple[int, list, float]] = None
    sq: Optional[np.ndarray] = None  # (steps+1, steps+1)
    q: Optional[np.ndarray] = None  # (steps+1,)
    # the decayed weight of the records that measured this acceptance, and their weighted mean
    # timestamp: how old the evidence is (see CostModel._accept_age)
    ts_w: float = 0.0
    ts_mean: float = 0.0

    def fold(self, change_z: float = 0.0, ref: Optional[list] = None) -> Optional[float]:
        """Fold the gathered second into the history. With `change_z` > 0, two folded seconds in
        a row whose mean accepted drafts sit more than `change_z` standard errors from what the
        model believed, on the same side, mean the traffic has changed: the history is replaced
        by those two seconds. What the model believed is `ref` (a histogram over this cell's
        accepted counts; for chains the pooled evidence of every chain at least as long, see
        CostModel._accept_ref), else this cell's own history. Returns the factor the believed
        evidence's weight shrank by then (at most 1), else None."""
        p = self.pend
        if p is None:
            return None
        n = sum(p)
        shrunk = None
        if n > 0:
            f = self.pend_wa * min(1.0, self.cap() / n)
            add = [x * f for x in p]
            if change_z > 0:
                base = self.hist if ref is None else ref
                sign = self._deviation(p, n, change_z, base)
                if sign and self.flagged is not None and self.flagged[0] == sign:
                    before = sum(base)
                    self.hist = list(self.flagged[1])
                    self.sq, self.q = _moments(self.flagged[1], self.flagged[2])
                    shrunk = min(1.0, sum(self.hist) / before) if before > 0 else None
                    self.flagged = None
                else:
                    self.flagged = (sign, add, self.pend_wa) if sign else None
            h = self.hist
            for k, x in enumerate(add):
                if x:
                    h[k] += x
            sq, q = _moments(add, self.pend_wa)
            self.sq = sq if self.sq is None else self.sq + sq
            self.q = q if self.q is None else self.q + q
        self.pend = None
        self.pend_second = None
        return shrunk

    def cap(self) -> float:
        """What the second being gathered may weigh, in requests: at most ACCEPT_CAP_PER_S, and at
        most ACCEPT_STEPS_PER_REQUEST steps of each request it saw (see the class)."""
        return min(ACCEPT_CAP_PER_S, ACCEPT_STEPS_PER_REQUEST * max(1, self.pend_req))

    def scale(self, f: float) -> None:
        """Age the history by `f` (a weight factor): counts by f, second moments by f**2."""
        self.hist = [x * f for x in self.hist]
        self.ts_w *= f
        if self.sq is not None:
            self.sq = self.sq * (f * f)
            self.q = self.q * (f * f)  # type: ignore[operator]

    def _deviation(self, p: list, n: int, z: float, h: list) -> int:
        """+1 / -1 when the counts `p` (n requests) accept more / fewer drafts per request than
        the histogram `h`, beyond z standard errors of the difference; else 0. Requests count at
        most `cap`, as when folded."""
        w = sum(h)
        if w <= 0 or self.pend_wa <= 0:
            return 0
        m0 = sum(k * x for k, x in enumerate(h)) / w
        var = max(ACCEPT_VAR_FLOOR, sum((k - m0) ** 2 * x for k, x in enumerate(h)) / w)
        m1 = sum(k * x for k, x in enumerate(p)) / n
        se = math.sqrt(var * (1.0 / min(n, self.cap()) + self.pend_wa / w))
        d = (m1 - m0) / se
        return 1 if d > z else -1 if d < -z else 0

    def current(self) -> list:
        """The histogram with the second being gathered folded in (no mutation)."""
        p = self.pend
        if p is None or not sum(p):
            return self.hist
        f = self.pend_wa * min(1.0, self.cap() / sum(p))
        return [h + x * f for h, x in zip(self.hist, p)]

    def current_moments(self) -> tuple[np.ndarray, np.ndarray]:
        """(sq, q) with the second being gathered counted as one more cluster (no mutation)."""
        k = len(self.hist)
        sq = np.zeros((k, k)) if self.sq is None else self.sq
        q = np.zeros(k) if self.q is None else self.q
        p = self.pend
        if p is not None and sum(p):
            f = self.pend_wa * min(1.0, self.cap() / sum(p))
            s2, q2 = _moments([x * f for x in p], self.pend_wa)
            sq, q = sq + s2, q + q2
        return sq, q


def _moments(add: Sequence[float], wa: float) -> tuple[np.ndarray, np.ndarray]:
    """One second's cluster terms: y y^T and wa * y, y = tail counts of its (folded) histogram."""
    y = np.cumsum(np.asarray(add, dtype=float)[::-1])[::-1]
    return np.outer(y, y), wa * y


@dataclass
class _TimeFit:
    """Isotonic (non-decreasing) fit through per-batch medians inside the measured range; linear
    extrapolation outside it, with slopes from a weighted least-squares line over each end.

    Monotone only within the noise: a real engine's step time is not monotone in the batch size
    everywhere (CUDA-graph buckets, kernel choices; the measured H200 profiles dip at some sizes).
    Strictly monotone, a configuration measured mostly at one size (where the table runs it) and
    thinly at the next (where it is only explored) has the thin size's measurements pooled into
    the heavy one's. So a batch size whose own median lies more than `release_z` standard errors
    from the isotonic value keeps its median, and the rest are refitted without it. The caller
    gives a batch size with fewer than MIN_SETTLED values an infinite standard error: on the GPU
    single slow steps would otherwise stand as dips, and near-tie tables churn."""

    b: np.ndarray
    t: np.ndarray  # medians
    w: np.ndarray
    y: np.ndarray  # isotonic values
    slope_lo: float
    slope_hi: float
    borrowed: Optional["_TimeFit"] = None

    @classmethod
    def build(cls, pts: Sequence[tuple[int, float, float, float]],
              release_z: float = MONOTONE_RELEASE_Z) -> "_TimeFit":
        """`pts`: (batch size, median, weight, relative standard error of the median), sorted by
        batch size; `release_z` 0 = strictly monotone."""
        b = np.array([p[0] for p in pts], dtype=float)
        t = np.array([p[1] for p in pts], dtype=float)
        w = np.array([max(p[2], 1e-12) for p in pts], dtype=float)
        y = t.copy()
        if len(b) >= 2:
            y = IsotonicRegression(increasing=True).fit(b, t, sample_weight=w).predict(b)
            if release_z > 0:
                se = np.array([p[3] for p in pts], dtype=float) * t
                free = np.abs(t - y) > release_z * se
                keep = ~free
                if free.any():
                    y[free] = t[free]
                    y[keep] = t[keep] if keep.sum() < 2 else IsotonicRegression(increasing=True).fit(
                        b[keep], t[keep], sample_weight=w[keep]).predict(b[keep])
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


def _region_of(b: int) -> int:
    """First batch size of the log2 region (see `regions`) holding b."""
    return 1 << (max(1, int(b)).bit_length() - 1)


def _robust_cv(values: Sequence[float]) -> float:
    """1.4826 * MAD / median (0 for a non-positive median); plain Python: a few dozen values."""
    n = len(values)
    v = sorted(values)
    med = 0.5 * (v[n // 2] + v[(n - 1) // 2])
    dev = sorted(abs(x - med) for x in v)
    return 1.4826 * 0.5 * (dev[n // 2] + dev[(n - 1) // 2]) / med if med > 0 else 0.0


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
