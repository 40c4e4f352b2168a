"""The online cost model: measured step time per configuration vs batch size, and acceptance.

`CostModel` follows the scikit-learn estimator contract (`__init__` stores parameters, `fit` /
`partial_fit` set trailing-underscore state and return self, `predict_*` check it is fitted).
Recent traffic dominates: a step-time sample's weight halves every `half_life_s` of its timestamp
age (a property of model + hardware: slow); acceptance halves every `accept_half_life_s` (a
property of the traffic: it shifts within a minute when the prompt mix does).

Context: where telemetry carries `ctx_tokens` (the batch's context tokens, all requests), step
time is t(c, b, L) = f_c(b) + g_c * b^e_c * L, L the mean context per request: g_c and the batch
exponent e_c from the within-(config, batch size) covariance of step time and ctx_tokens (e_c the one
of CTX_EXPONENTS that explains the most of it; 1, a cost per context token of the batch, unless
another explains clearly more), f_c the same monotone fit as without context, through step times
with the context term taken off. e_c < 1 where an attention kernel is latency-bound at small
batches: on the H200 an EAGLE-3 s3 verify cost 4.9 µs per context token at batch 1 and 0.6-1.3 µs
per context token of the batch at batch 4-8 (e = 0.25 there); one cost per batch token (e = 1)
carried the small batches' figure to batch 100 and made s3 look 40 % cheaper at short contexts.
Without ctx_tokens nothing of this runs and every figure is what it was.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np
from sklearn.isotonic import IsotonicRegression

from specctl.policies.table import ctx_band_index, mean_ctx

Config = tuple[int, int, int]  # (steps, topk, draft_tokens)
OFF: Config = (0, 1, 1)
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
    ctx_tokens: Optional[int] = None  # context tokens of the whole batch, where known

    @classmethod
    def from_record(cls, rec: Any) -> "Sample":
        c = rec.config
        return cls(ts=rec.ts, config=(c.steps, c.topk, c.draft_tokens), batch_size=rec.batch_size,
                   step_ms=rec.step_ms, accepted=rec.accepted, server=rec.server, rank=rec.rank,
                   ctx_tokens=rec.ctx_tokens)


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


class CostModel:
    """Step time t(c, b) (monotone in b within the noise, median-robust, warm-up steps after a
    switch dropped) and tokens per step tau(c) = 1 + E[accepted drafts] per configuration.

    Chains (topk 1) share per-position conditional acceptance a_i, pooled over every chain
    configuration that reached position i, so tau of a chain never measured at its full length
    is still predicted: tau(s) = 1 + sum_{i<=s} prod_{j<=i} a_j.
    """

    def __init__(self, *, half_life_s: float = 600.0, accept_half_life_s: float = 8.0,
                 accept_change_z: float = 0.0, warmup_steps: int = 2,
                 min_region_samples: float = 16.0, max_batch: int = 4096,
                 step_drift: float = STEP_DRIFT_AT_HALF_LIFE):
        self.half_life_s = half_life_s
        self.step_drift = step_drift
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
        self.cell_cv_: dict[tuple[Config, int], float] = {}  # robust step-time cv per cell, at refit
        self.cell_n_: dict[tuple[Config, int], float] = {}  # values behind each cell's median, at refit
        self.cell_age_: dict[tuple[Config, int], float] = {}  # s since each cell's newest settled value
        self.step_cv_: Optional[float] = None
        # context (telemetry with ctx_tokens only): slope statistics per cell, decayed step times per
        # (config, log2 batch region's first batch size, power-of-2 band of mean context), the fits
        # as of the last refit
        self.ctx_cells_: dict[tuple[Config, int], _CtxCell] = {}
        self.ctx_band_w_: dict[tuple[Config, int, int], float] = {}
        self.ctx_fits_: dict[Config, _CtxFit] = {}
        self.cell_median_: dict[tuple[Config, int], float] = {}  # as of the last refit

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
        for cc in self.ctx_cells_.values():
            cc.scale(f)
        for k in self.ctx_band_w_:
            self.ctx_band_w_[k] *= f
        for acc in self.accept_.values():
            acc.scale(fa)  # ts_w too
            acc.pend_wa *= fa
            if acc.flagged is not None:
                acc.flagged = (acc.flagged[0], [x * fa for x in acc.flagged[1]], acc.flagged[2] * fa)
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
            if s.accepted is not None or s.mean_accepted is not None:
                w_ts = wa * (len(s.accepted) if s.accepted is not None else s.batch_size)
                if w_ts > 0:
                    acc.ts_w += w_ts
                    acc.ts_mean += (s.ts - acc.ts_mean) * (w_ts / acc.ts_w)
            if s.accepted is not None:
                second = int(s.ts)
                if acc.pend_second != second:
                    ref = self._accept_ref(c) if self.accept_change_z > 0 and acc.pend is not None else None
                    shrunk = acc.fold(self.accept_change_z, ref)
                    if shrunk is not None:
                        self.num_accept_changes_ += 1
                    if shrunk is not None and c[1] == 1:
                        # chains pool their acceptance by position: a change seen on one chain
                        # ages the others' history alike
                        for k, other in self.accept_.items():
                            if k != c and k[1] == 1:
                                other.scale(shrunk)
                                other.flagged = None
                    acc.pend = [0] * (steps + 1)
                    acc.pend_second = second
                    acc.pend_wa = wa
                    acc.pend_req = 0
                p = acc.pend
                acc.pend_req = max(acc.pend_req, len(s.accepted))
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
        ctx = s.ctx_tokens
        if s.weight > 1:
            self._add_time(c, s.batch_size, w, s.step_ms, False, s.ts, ctx)  # type: ignore[arg-type]
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
        self._add_time(c, s.batch_size, w, s.step_ms, warm, s.ts, ctx)  # type: ignore[arg-type]

    def _add_time(self, c: Config, batch_size: int, w: float, step_ms: float, warm: bool, ts: float,
                  ctx: Optional[int] = None) -> None:
        b = min(batch_size, self.max_batch)
        cell = self.times_.get((c, b))
        if cell is None:
            cell = self.times_[(c, b)] = _TimeCell()
        x = _NAN if ctx is None else float(ctx)
        if warm:
            # kept aside: used only where a configuration never runs long enough to settle
            # (an engine switching every step pays the switch every step)
            cell.warm_weight += w
            cell.warm.append(step_ms)
            cell.warm_ts.append(ts)
            cell.warm_ctx.append(x)
            cell.warm_since_steady += 1
            if ctx is not None:
                self._add_ctx(c, b, w, x, step_ms, batch_size, ctx)
        else:
            if cell.warm_since_steady >= FRESH_WARM:  # the steady values were superseded (see _TimeCell)
                cell.recent.clear()
                cell.recent_ts.clear()
                cell.recent_ctx.clear()
            cell.weight += w
            cell.recent.append(step_ms)
            cell.recent_ts.append(ts)
            cell.recent_ctx.append(x)
            cell.warm_since_steady = 0
            if ctx is not None:
                self._add_ctx(c, b, w, x, step_ms, batch_size, ctx)

    def _add_ctx(self, c: Config, b: int, w: float, x: float, step_ms: float, batch_size: int, ctx: int) -> None:
        """Steps right after a switch count too: a configuration the table runs in one context
        band is measured in the others only by exploring steps, single steps after a switch; what a
        switch costs (a few % of a step) biases the slope far less than leaving it unmeasured."""
        key = (c, b)
        cc = self.ctx_cells_.get(key)
        if cc is None:
            cc = self.ctx_cells_[key] = _CtxCell()
        ref = self.cell_median_.get(key)
        if ref is None:
            # no refit has seen this cell yet: its own values so far (this step's included) are the reference
            # once there are MIN_SETTLED of them; before that the step stays out of the slope, as there is
            # nothing to clip it against. A server's first steps include its warm-up (2026-12-06, H100: a 735 ms
            # first step at batch 1 with 6 tokens of context, unclipped, turned s3's batch exponent from 0.25
            # to 1 and its short context bands to plain decode from batch 8)
            vals, _ = self.times_[key].settled()
            ref = float(np.median(vals)) if len(vals) >= MIN_SETTLED else None
        if ref is not None:
            # one wild step (a stall) would move a least-squares slope more than the context does
            cc.add(w, x, min(step_ms, CTX_CLIP * ref))
        cov = (c, _region_of(b), ctx_band_index(mean_ctx(ctx, batch_size)))
        self.ctx_band_w_[cov] = self.ctx_band_w_.get(cov, 0.0) + w

    # ------------------------------------------------------------------ fitting

    def refit(self) -> "CostModel":
        settled = {k: cell.settled() for k, cell in self.times_.items()}
        f = self._now_factor()
        self.cell_n_ = {k: min(float(len(values)), weight * f) for k, (values, weight) in settled.items()}
        self.cell_age_ = {k: max(0.0, self.now_ - cell.settled_newest_ts()) for k, cell in self.times_.items()}
        self.cell_cv_ = {k: _robust_cv(values) for k, (values, _) in settled.items() if len(values) >= MIN_SETTLED}
        self.step_cv_ = float(np.median(list(self.cell_cv_.values()))) if self.cell_cv_ else None
        by_config: dict[Config, list[tuple[int, float, float, float]]] = {}
        for (c, b), (values, weight) in settled.items():
            if values:
                # the relative standard error of this cell's median; inf while the engine's noise
                # is unknown, or while the cell has fewer than MIN_SETTLED values (one slow step
                # is not a dip), so that the cell stays pooled
                n, cv = self._cell_noise((c, b))
                se = MEDIAN_SE * cv / math.sqrt(n) if self.step_cv_ is not None and n >= MIN_SETTLED else math.inf
                med = self.cell_median_[(c, b)] = float(np.median(values))
                by_config.setdefault(c, []).append((b, med, weight, se))
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
        if self.ctx_cells_:
            self._refit_ctx()
        return self

    def _refit_ctx(self) -> None:
        """Per configuration: the context coefficient g and batch exponent e (weighted least squares of
        step time on b^(e-1) * ctx_tokens within each batch size, pooled over batch sizes: a cell's own
        level is its batch size's f; e the one of CTX_EXPONENTS leaving the least residual), kept where g
        is CTX_SLOPE_Z standard errors above 0; then f through the cells' medians of
        t - g * b^(e-1) * ctx_tokens over their recent values, as the plain fit is made."""
        now_f = self._now_factor()
        fits: dict[Config, _CtxFit] = {}
        by_config: dict[Config, list[tuple[int, _CtxCell]]] = {}
        for (c, b), cc in self.ctx_cells_.items():
            by_config.setdefault(c, []).append((b, cc))
        for c, cells in by_config.items():
            stt = sum(cc.mtt for _, cc in cells) * now_f
            n = sum(cc.w for _, cc in cells) * now_f
            dof = n - len(cells) - 1.0
            slope, se, exponent, best = 0.0, math.inf, 1.0, math.inf
            for e in CTX_EXPONENTS:  # the regressor b^(e-1) * ctx_tokens: within a cell, ctx_tokens scaled
                szz = sum(cc.mxx * b ** (2 * e - 2) for b, cc in cells) * now_f
                szt = sum(cc.mxt * b ** (e - 1) for b, cc in cells) * now_f
                if not (szz > 0 and dof > 0):
                    continue
                g = szt / szz
                resid = max(0.0, stt - g * szt)
                if resid < best * (1.0 - CTX_EXPONENT_GAIN):
                    slope, se, exponent, best = g, math.sqrt(resid / dof / szz), e, resid
            if not (slope > 0 and slope > CTX_SLOPE_Z * se):
                slope, exponent = 0.0, 1.0
            per_band: dict[int, float] = {}
            for (cfg, _, k), w in self.ctx_band_w_.items():
                if cfg == c:
                    per_band[k] = per_band.get(k, 0.0) + w
            bands = tuple(sorted(k for k, w in per_band.items() if w * now_f >= 1.0))
            wsum = sum(cc.w for _, cc in cells)
            # the mean context per request the slope was measured around (cells at their own batch size)
            mean = sum(cc.w * cc.mx / b for b, cc in cells) / wsum if wsum > 0 else 0.0
            at_zero = self._fit_at_zero(c, slope, exponent) if slope > 0 else None
            if slope > 0 and at_zero is None:
                slope = 0.0
            fits[c] = _CtxFit(slope=slope, slope_se=se, at_zero=at_zero, bands=bands, mean_ctx=mean, exponent=exponent)
        self.ctx_fits_ = fits

    def _fit_at_zero(self, c: Config, slope: float, exponent: float = 1.0) -> Optional["_TimeFit"]:
        pts = []
        for (k, b), cell in self.times_.items():
            if k != c:
                continue
            values, weight = cell.settled()
            ctxs = cell.settled_ctx()
            g = slope * float(b) ** (exponent - 1.0)  # ms per context token of the batch at this batch size
            corrected = [t - g * x for t, x in zip(values, ctxs) if x == x]  # x == x: not nan
            if not corrected:
                continue
            n, cv = self._cell_noise((c, b))
            se = MEDIAN_SE * cv / math.sqrt(n) if self.step_cv_ is not None and n >= MIN_SETTLED else math.inf
            pts.append((b, max(float(np.median(corrected)), 1e-6), weight, se))
        if not pts:
            return None
        pts.sort()
        f = _TimeFit.build(pts)
        if len(f.b) == 1 and self.fitted_ and c in self.fitted_ and len(self.fitted_[c].b) >= 2:
            f.borrow_shape(self.fitted_[c])
        return f

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

    def has_ctx(self) -> bool:
        """Whether any step time came with its batch's ctx_tokens (as of the last refit)."""
        return bool(self.ctx_fits_)

    def ctx_slope(self, c: Config) -> tuple[float, float]:
        """(g, its standard error) of c's context term g * b^e * L (ms per context token at batch 1;
        with e = 1, per context token of the batch at any batch size); (0, inf) where unmeasured.
        A slope not significantly above 0 reads 0. `ctx_exponent` gives e."""
        f = self.ctx_fits_.get(tuple(c))  # type: ignore[arg-type]
        return (0.0, math.inf) if f is None else (f.slope, f.slope_se)

    def ctx_exponent(self, c: Config) -> float:
        """The batch exponent e of c's context term g * b^e * L (1 where unmeasured)."""
        f = self.ctx_fits_.get(tuple(c))  # type: ignore[arg-type]
        return 1.0 if f is None else f.exponent

    def ctx_bands(self, c: Optional[Config] = None) -> list[int]:
        """Power-of-2 bands of mean context per request (policies.table.ctx_band_index) with at
        least one decayed step time of c (of any configuration when c is None)."""
        out: set[int] = set()
        for k, f in self.ctx_fits_.items():
            if c is None or k == tuple(c):
                out.update(f.bands)
        return sorted(out)

    def ctx_band_samples(self) -> dict[int, float]:
        """Decayed step times per power-of-2 band of mean context, all configurations."""
        f = self._now_factor()
        out: dict[int, float] = {}
        for (_, _, k), w in self.ctx_band_w_.items():
            out[k] = out.get(k, 0.0) + w * f
        return out

    def ctx_coverage(self) -> dict[tuple[Config, int, int], float]:
        """Decayed step times per (config, log2 batch region's first batch size, context band)."""
        f = self._now_factor()
        return {k: w * f for k, w in self.ctx_band_w_.items()}

    def ctx_trusted(self, c: Config, band: int) -> bool:
        """Whether c's step time at that context band rests on measurements at most one band
        (a factor of 2) away: a slope carries a prediction that far, not further."""
        f = self.ctx_fits_.get(tuple(c))  # type: ignore[arg-type]
        return f is not None and bool(f.bands) and f.bands[0] - 1 <= band <= f.bands[-1] + 1

    def predict_step_ms_ctx(self, c: Config, batch_sizes: Sequence[int] | np.ndarray,
                            mean_ctx_tokens: float) -> np.ndarray:
        """Step time of c at these batch sizes when every request has `mean_ctx_tokens` of context:
        f_c(b) + g_c * b^e_c * L where g_c is significant, else the plain prediction."""
        f = self.ctx_fits_.get(tuple(c))  # type: ignore[arg-type]
        if f is None or f.at_zero is None:
            return self.predict_step_ms(c, batch_sizes)
        b = np.asarray(batch_sizes, dtype=float)
        return np.maximum(f.at_zero.predict(b) + f.slope * b ** f.exponent * float(mean_ctx_tokens), 1e-6)

    def step_ms_ctx_errors(self, c: Config, batch_sizes: Sequence[int] | np.ndarray,
                           mean_ctx_tokens: float) -> tuple[np.ndarray, np.ndarray]:
        """step_ms_errors at a mean context: the plain errors, plus the slope's standard error
        carried from the measured mean context to this one."""
        se, thin = self.step_ms_errors(c, batch_sizes)
        f = self.ctx_fits_.get(tuple(c))  # type: ignore[arg-type]
        if f is None or f.at_zero is None or not math.isfinite(f.slope_se):
            return se, thin
        b = np.asarray(batch_sizes, dtype=float)
        pred = self.predict_step_ms_ctx(c, b, mean_ctx_tokens)
        carry = f.slope_se * b ** f.exponent * abs(float(mean_ctx_tokens) - f.mean_ctx) / pred
        return np.sqrt(se ** 2 + carry ** 2), thin

    def _accept_ref(self, c: Config) -> Optional[list]:
        """What the model believes chain `c` accepts, as a histogram over its accepted counts
        0..steps: the histories of every chain at least as long as `c`, each record's accepted
        count capped at c's steps (a chain's first s positions are the s-chain: the prefix
        property the per-position pooling rests on). A shift in what `c` measures is judged
        against this, not against `c`'s own history alone: the estimate that decides is pooled,
        so evidence a longer chain gathered before the traffic changed (and that `c`, running
        now, never had) would otherwise never be found stale. None for trees (measured alone)."""
        steps, topk, _ = c
        if topk != 1:
            return None
        out = [0.0] * (steps + 1)
        for a in self._chains_reaching(steps):
            for i, x in enumerate(a.hist):
                if x:
                    out[min(i, steps)] += x
        return out

    def _chains_reaching(self, steps: int) -> list["_AcceptCell"]:
        """The acceptance cells of every chain (topk 1) with at least `steps` draft steps: those whose
        records speak for all positions of a `steps`-chain."""
        return [a for k, a in self.accept_.items() if k[1] == 1 and k[0] >= steps]

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

    def tau_log_diff_var(self, configs: Sequence[Config]) -> np.ndarray:
        """Variance of ln tau(c_i) - ln tau(c_j) for every pair of `configs` (n x n, 0 on the
        diagonal; inf where a tau is unknown).

        Chains share the pooled per-position acceptances a_p, so their taus are correlated and
        the variance of a difference is (g_i - g_j)^T Cov(a) (g_i - g_j), with g = d ln tau / d a
        (the delta method). Cov(a) is estimated two ways and the larger variance is kept:
        - between seconds: each folded second is a cluster, and a_p = A_p / R_p is a ratio
          estimator over them; its cluster-robust (sandwich) variance sum_k w_k^2 (A_pk - a_p
          R_pk)^2 / R_p^2 measures how much the seconds the decayed average is made of disagree,
          traffic fluctuations and per-request correlation included. It is scaled by K / (K - 1),
          K = (sum w_k)^2 / sum w_k^2 the effective number of seconds behind the average (about
          23 for an 8 s half-life at steady traffic; 2 right after a detected shift);
        - within seconds: binomial, a_p (1 - a_p) over the effective number of requests, each
          second worth at most its `_AcceptCell.cap` as when folded; the floor where the seconds
          happen to agree, or are too few (K <= 1) to say.
        A deeper position's trend prior adds PRIOR_REQUESTS binomial pseudo-requests. Trees (and
        interval-averaged sources) measure tau directly and count as independent of the rest.
        """
        keys = [tuple(c) for c in configs]
        n = len(keys)
        grads: list[Optional[np.ndarray]] = []
        own_var = np.zeros(n)
        depth = max((c[0] for c in keys if c[1] == 1), default=0)
        chain = self._chain_cov(depth) if depth > 0 else None
        for i, c in enumerate(keys):
            tau = self.tokens_per_step(c)  # type: ignore[arg-type]
            grads.append(None)
            if c[0] == 0:
                continue
            if tau is None:
                own_var[i] = math.inf
                continue
            acc = self.accept_.get(c)  # type: ignore[arg-type]
            interval_only = acc is not None and sum(acc.current()) <= 0 and acc.mean_weight > 0
            if c[1] == 1 and chain is not None and not interval_only:
                a = chain[0][: c[0]]
                # tau = 1 + sum_i prod_{j<=i} a_j, so d tau / d a_m =
                # prod_{j<m} a_j * (1 + sum_{i>m} prod_{m<j<=i} a_j)
                g = np.zeros(depth)
                for m in range(c[0]):
                    g[m] = np.prod(a[:m]) * (1.0 + np.sum(np.cumprod(a[m + 1:])))
                grads[i] = g / tau
            else:
                own_var[i] = self._direct_tau_var(c) / (tau * tau)  # type: ignore[arg-type]
        out = np.zeros((n, n))
        for i in range(n):
            for j in range(i + 1, n):
                v = own_var[i] + own_var[j]
                gi, gj = grads[i], grads[j]
                if gi is not None or gj is not None:
                    d = (gi if gi is not None else 0.0) - (gj if gj is not None else 0.0)
                    v += max(float(d @ chain[1] @ d), float(d @ chain[2] @ d))  # type: ignore[index]
                out[i, j] = out[j, i] = v
        age = np.array([self._accept_age(c) for c in keys])  # type: ignore[arg-type]
        grow = np.exp2(np.minimum(age / self.accept_half_life_s, 60.0))
        return out * np.maximum(grow[:, None], grow[None, :])

    def _accept_age(self, c: Config) -> float:
        """How much older c's acceptance evidence is than that of an estimate measured all along, in
        seconds: the weighted mean age of the records behind it (for a chain, those of the chains
        reaching all its positions: a shorter one leaves the deeper positions as they were) less
        accept_half_life_s / ln 2, the mean age of an exponentially decayed average fed steadily
        up to now. 0 for plain decode. tau_log_diff_var doubles the variance of a difference per
        half-life of the staler one's: its estimators weigh the records relative to each other,
        which a pause in the measurements does not change, but the traffic's acceptance may have
        moved since. That is what has acceptance measured again where the table decodes plainly
        (until all drafts accepted would not win there): a few probing steps bring the mean age
        down only in proportion to their weight, and the variance of what they measured is their
        own, small sample's."""
        if c[0] == 0:
            return 0.0
        if c[1] == 1:
            cells = self._chains_reaching(c[0])
        else:
            cells = [a for a in (self.accept_.get(c),) if a is not None]
        w = sum(a.ts_w for a in cells)
        if w <= 0:
            return 0.0
        mean_ts = sum(a.ts_w * a.ts_mean for a in cells) / w
        return max(0.0, self.now_ - mean_ts - self.accept_half_life_s / math.log(2.0))

    def _chain_cov(self, depth: int) -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(a, between-seconds Cov(a), within-seconds Cov(a)) of the pooled chain positions
        1..depth, as acceptance_by_position computes a (see tau_log_diff_var)."""
        a = self.acceptance_by_position((depth, 1, depth + 1))
        if a is None:
            return None
        f = self._now_factor(self.accept_half_life_s)
        reached = np.zeros(depth)
        resid = np.zeros((depth, depth))  # sum over seconds of u u^T, u_p = y_{p+1} - a_p y_p
        binom = np.zeros(depth)
        y0 = y00 = 0.0
        for k, cell in self.accept_.items():
            if k[1] != 1:
                continue
            h = np.asarray(cell.current(), dtype=float)
            sq, q = cell.current_moments()
            m = min(len(h) - 1, depth)
            tail = np.cumsum(h[::-1])[::-1]
            reached[:m] += tail[:m]
            lin = np.zeros((m, len(h)))  # u = lin @ y
            lin[np.arange(m), np.arange(m) + 1] = 1.0
            lin[np.arange(m), np.arange(m)] = -a[:m]
            resid[:m, :m] += lin @ sq @ lin.T
            binom[:m] += q[:m]
            y0 += tail[0]
            y00 += sq[0, 0]
        prior = np.where(np.arange(depth) > 0, PRIOR_REQUESTS, 0.0)
        denom = reached * f + prior
        if denom[0] <= 0:
            return None
        ab = a * (1.0 - a)
        outer = np.outer(denom, denom)
        k_eff = y0 * y0 / y00 if y00 > 0 else 0.0
        between = resid * (f * f) * (k_eff / (k_eff - 1.0)) / outer if k_eff > 1.0 + 1e-9 else np.zeros_like(resid)
        within = np.diag((binom * f * f + prior) * ab / (denom * denom))
        between += np.diag(prior * ab / (denom * denom))
        return a, between, within

    def _direct_tau_var(self, c: Config) -> float:
        """Variance of E[accepted drafts] measured on c's own histogram (trees, interval sources)."""
        acc = self.accept_.get(c)
        if acc is None:
            return math.inf
        h = np.asarray(acc.current(), dtype=float)
        f = self._now_factor(self.accept_half_life_s)
        if h.sum() <= 0:
            n = acc.mean_weight * f
            m = acc.mean_sum / acc.mean_weight if acc.mean_weight > 0 else 0.0
            return max(ACCEPT_VAR_FLOOR, m * (c[0] - m) / max(c[0], 1)) / n if n > 0 else math.inf
        sq, q = acc.current_moments()
        ks = np.arange(len(h))
        mean = float((ks * h).sum() / h.sum())
        var_req = max(ACCEPT_VAR_FLOOR, float(((ks - mean) ** 2 * h).sum() / h.sum()))
        w = np.ones(len(h))
        w[0] = -mean  # sum_{i>=1} y_i - mean * y_0 = accepted - mean * requests
        y0 = h.sum()
        k_eff = y0 * y0 / sq[0, 0] if sq[0, 0] > 0 else 0.0
        between = float(w @ sq @ w) / (y0 * y0) * (k_eff / (k_eff - 1.0)) if k_eff > 1.0 + 1e-9 else 0.0
        within = var_req * float(q[0]) / (y0 * y0)
        return max(between, within)

    def step_ms_errors(self, c: Config, batch_sizes: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(relative standard error of the predicted step time of c, its thin part) at each batch size.

        - Noise, at a measured batch size: the prediction is the median of its n recent values
          (isotonic pooling aside, which only narrows it), off by about 1.25 cv / sqrt(n), n at
          most the cell's decayed weight. cv is the engine's noise (step_time_cv, pooled over
          cells), or the cell's own robust cv where that is larger: some batch sizes are
          noisier than most. Between measured batch sizes the prediction interpolates them, and
          so does this variance; beyond them it is the nearest end's.
        - Where the batch size was not measured: step time is monotone in b, so between two
          measured batch sizes the true value is anywhere between the two measured ones, a
          uniform spread over the gap adding (gap / t)^2 / 12; beyond the measured range,
          anywhere between the end's value and twice the linear extrapolation's distance from
          it, adding (distance / t)^2 / 3.
        - Age: a step time measured a while ago may have moved since (clocks, thermals, another
          tenant, a driver): its standard error grows by step_drift per half-life of the age of
          the cell's newest value, linearly (such changes are slow trends that persist, not
          jitter: seconds add next to nothing, ten minutes 10% with the default). Without it a
          configuration the table left keeps the certainty of its last measurement for good and
          is never measured again; with it, a comparison the data once decided opens again as its
          evidence ages (the exploration rule, policies.costmodel.measuring_gain, then measures
          it) and the switch tolerance of a long-unmeasured configuration widens up to its cap.
        The noise part is 0 while the engine's noise is unknown. The thin part is the noise part
        of the batch sizes with fewer than MIN_SETTLED values only (nothing else)."""
        bs = np.asarray(batch_sizes, dtype=float)
        f = self._check().get(tuple(c))  # type: ignore[arg-type]
        if f is None:
            raise KeyError(f"no step-time measurements for {config_name(c)}")
        if not len(bs):
            return np.zeros(0), np.zeros(0)
        var, thin_b = np.zeros(len(f.b)), np.zeros(len(f.b))
        if self.step_cv_ is not None:
            for i, b in enumerate(f.b):
                n, cv = self._cell_noise((tuple(c), int(b)))  # type: ignore[arg-type]
                var[i] = (MEDIAN_SE * cv) ** 2 / n if n > 0 else math.inf
                if n < MIN_SETTLED:
                    thin_b[i] = var[i]
        var = var + self._drift_var(tuple(c), f.b)  # type: ignore[arg-type]
        if len(f.b) == 1:
            noise, thin = np.full(len(bs), var[0]), np.full(len(bs), thin_b[0])
        else:
            x = np.clip(bs, f.b[0], f.b[-1])
            hi = np.clip(np.searchsorted(f.b, x), 1, len(f.b) - 1)
            lo = hi - 1
            lam = (x - f.b[lo]) / (f.b[hi] - f.b[lo])

            def interpolate(v: np.ndarray) -> np.ndarray:
                with np.errstate(invalid="ignore"):  # 0 * inf: a cell with no weight left, not used here
                    return (np.where(lam < 1.0, (1.0 - lam) ** 2 * v[lo], 0.0)
                            + np.where(lam > 0.0, lam ** 2 * v[hi], 0.0))

            noise, thin = interpolate(var), interpolate(thin_b)
        pred = np.maximum(f.predict(bs), 1e-9)
        outside = np.where(bs < f.b[0], f.predict(f.b[:1])[0] - pred,
                           np.where(bs > f.b[-1], pred - f.predict(f.b[-1:])[0], 0.0)) / pred
        if len(f.b) == 1:
            return np.sqrt(noise + outside ** 2 / 3.0), np.sqrt(thin)
        gap = np.where((lam > 0) & (lam < 1), (f.y[hi] - f.y[lo]) / pred, 0.0)
        return np.sqrt(noise + gap ** 2 / 12.0 + outside ** 2 / 3.0), np.sqrt(thin)

    def _drift_var(self, c: Config, batch_sizes: np.ndarray) -> np.ndarray:
        """The relative variance the measured cells of c at these batch sizes gained with age."""
        if self.step_drift <= 0:
            return np.zeros(len(batch_sizes))
        ages = np.array([self.cell_age_.get((c, int(b)), 0.0) for b in batch_sizes])
        return (self.step_drift * ages / self.half_life_s) ** 2

    def _cell_noise(self, key: tuple[Config, int]) -> tuple[float, float]:
        """(n, cv) behind the median of one (configuration, batch size) cell, as of the last refit:
        n its recent values, at most its decayed weight; cv the engine's pooled step-time noise, or
        the cell's own where larger (0 while neither is known)."""
        return self.cell_n_.get(key, 0.0), max(self.step_cv_ or 0.0, self.cell_cv_.get(key, 0.0))

    def accept_weight(self, c: Config) -> float:
        """Decayed number of requests behind tau(c) (for uncertainty reporting)."""
        acc = self.accept_.get(tuple(c))  # type: ignore[arg-type]
        if acc is None:
            return 0.0
        return float(sum(acc.current()) + acc.mean_weight) * self._now_factor(self.accept_half_life_s)

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

    def values_since(self, c: Config, lo: int, hi: int, ts: float, enough: int) -> int:
        """Step times of c at batch sizes lo..hi stamped at or after ts (counted up to `enough`)."""
        n, c = 0, tuple(c)
        for b in range(max(1, lo), min(hi, self.max_batch) + 1):
            cell = self.times_.get((c, b))  # type: ignore[arg-type]
            if cell is not None:
                n += cell.values_since(ts, enough - n)
                if n >= enough:
                    break
        return n

    def step_time_cv(self) -> Optional[float]:
        """Robust coefficient of variation of the step time at a fixed configuration and batch
        size, as of the last refit: the median over (configuration, batch size) cells of
        1.4826 * MAD / median of their recent values; None while no cell has MIN_SETTLED
        values. Pooled because the
        noise is the engine's (scheduling, clocks), and a configuration that is only explored
        now and then never gathers enough values of its own."""
        return self.step_cv_

    def step_samples(self, c: Config) -> float:
        """Decayed step-time samples of c (all batch sizes), as of the newest timestamp."""
        w = sum(cell.weight + cell.warm_weight for (k, _), cell in self.times_.items() if k == tuple(c))
        return w * self._now_factor()

    def measured_range(self, c: Config) -> tuple[int, int, int]:
        """(lowest, highest, number of) batch sizes with step-time data for c."""
        b = self.measured_batches(c)
        return (b[0], b[-1], len(b)) if b else (0, 0, 0)

    def measured_batches(self, c: Config) -> list[int]:
        """The batch sizes with step times of c, as of the last refit."""
        f = self._check().get(tuple(c))  # type: ignore[arg-type]
        return [] if f is None else [int(b) for b in f.b]

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
        ctx = bool(self.ctx_cells_)  # without context the state is written as it always was

        def ctxs(values: Iterable[float]) -> list[Optional[float]]:
            return [None if x != x else x for x in values]  # JSON has no nan

        out = {
            "kind": "specctl.model", "version": 1,
            "half_life_s": self.half_life_s, "accept_half_life_s": self.accept_half_life_s,
            "t0": self.t0_, "now": self.now_,
            "num_samples": self.num_samples_, "warmup_dropped": self.num_warmup_dropped_,
            "times": [[list(c), b, cell.weight, list(cell.recent), cell.warm_weight, list(cell.warm),
                       list(cell.recent_ts), list(cell.warm_ts)]
                      + ([ctxs(cell.recent_ctx), ctxs(cell.warm_ctx)] if ctx else [])
                      for (c, b), cell in self.times_.items()],
            "accept": [[list(c), list(a.current()), a.mean_sum, a.mean_weight,
                        *(m.tolist() for m in a.current_moments())] for c, a in self.accept_.items()],
        }
        if ctx:
            out["ctx"] = [[list(c), b, cc.w, cc.mx, cc.mt, cc.mxx, cc.mxt, cc.mtt]
                          for (c, b), cc in self.ctx_cells_.items()]
            out["ctx_coverage"] = [[list(c), lo, k, w] for (c, lo, k), w in self.ctx_band_w_.items()]
        return out

    def set_state(self, state: dict[str, Any]) -> "CostModel":
        if state.get("kind") != "specctl.model" or state.get("version") != 1:
            raise ValueError("not a specctl model state (kind/version)")
        self._reset()
        self.t0_ = state["t0"]
        self.now_ = float(state["now"])
        self.num_samples_ = int(state["num_samples"])
        self.num_warmup_dropped_ = int(state.get("warmup_dropped", 0))
        for c, b, w, recent, ww, warm, *stamps in state["times"]:
            cell = _TimeCell(weight=float(w), warm_weight=float(ww))
            cell.recent.extend(float(x) for x in recent[-RING:])
            cell.warm.extend(float(x) for x in warm[-RING:])
            # states written before values were stamped: stamped with the state's newest time
            if len(stamps) not in (0, 2, 4):
                raise ValueError("model state: a step-time cell has neither 6, 8 nor 10 fields")
            rc, wc = (stamps[2], stamps[3]) if len(stamps) == 4 else ([None] * len(recent), [None] * len(warm))
            stamps = stamps[:2]
            if len(rc) != len(recent) or len(wc) != len(warm):
                raise ValueError("model state: step times and their contexts differ in number")
            cell.recent_ctx.extend(_NAN if x is None else float(x) for x in rc[-RING:])
            cell.warm_ctx.extend(_NAN if x is None else float(x) for x in wc[-RING:])
            rts, wts = stamps if stamps else ([self.now_] * len(recent), [self.now_] * len(warm))
            if len(rts) != len(recent) or len(wts) != len(warm):
                raise ValueError("model state: step times and their timestamps differ in number")
            cell.recent_ts.extend(float(x) for x in rts[-RING:])
            cell.warm_ts.extend(float(x) for x in wts[-RING:])
            newest = cell.recent_ts[-1] if cell.recent_ts else -math.inf
            cell.warm_since_steady = sum(1 for t in cell.warm_ts if t > newest)
            self.times_[(tuple(c), int(b))] = cell  # type: ignore[index]
        for c, hist, ms, mw, *moments in state["accept"]:
            # the evidence's age is not kept: taken as the steady one of a cell measured up to now
            cell = _AcceptCell(hist=[float(x) for x in hist], mean_sum=float(ms), mean_weight=float(mw),
                               ts_w=float(sum(hist)) + float(mw),
                               ts_mean=self.now_ - self.accept_half_life_s / math.log(2.0))
            if moments:  # absent in states written before standard errors were kept
                k = len(cell.hist)
                cell.sq = np.asarray(moments[0], dtype=float).reshape(k, k)
                cell.q = np.asarray(moments[1], dtype=float).reshape(k)
            self.accept_[tuple(c)] = cell  # type: ignore[index]
        for c, b, *m in state.get("ctx", ()):
            self.ctx_cells_[(tuple(c), int(b))] = _CtxCell(*(float(x) for x in m))  # type: ignore[index]
        for c, lo, k, w in state.get("ctx_coverage", ()):
            self.ctx_band_w_[(tuple(c), int(lo), int(k))] = float(w)  # type: ignore[index]
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
                cf = self.ctx_fits_.get(c)
                if cf is not None:  # only where telemetry carries ctx_tokens
                    entry["ctx_ms_per_ktoken"] = round(1000.0 * cf.slope, 6)  # at batch 1: g of g * b^e * L
                    entry["ctx_batch_exponent"] = cf.exponent
                    entry["ctx_bands"] = list(cf.bands)
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
