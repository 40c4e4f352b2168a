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

import math
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from ..policies.table import OFF, Config, config_name
from .acceptance import AcceptanceEstimate
# Sample, regions, RING, FRESH_WARM and STEP_DRIFT_AT_HALF_LIFE are imported from here by their users too
from .cells import (_NAN, _REBASE_HALF_LIVES, FRESH_WARM, MEDIAN_SE, MIN_SETTLED, RING,  # noqa: F401
                    STEP_DRIFT_AT_HALF_LIFE, Sample, _AcceptCell, _CtxCell, _CtxFit, _robust_cv, _TimeCell, _TimeFit,
                    regions)
from .ctxfit import ContextFit


class CostModel(ContextFit, AcceptanceEstimate):
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
