"""Context queries of the cost model: step time's dependence on the batch's context tokens,
g_c * b^e_c * L, and the context bands it was measured in (a mixin of training.costmodel.CostModel)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..policies.table import Config, ctx_band_index, mean_ctx
from .cells import (CTX_CLIP, CTX_EXPONENT_GAIN, CTX_EXPONENTS, CTX_SLOPE_Z, MEDIAN_SE, MIN_SETTLED, _CtxCell,
                    _CtxFit, _region_of, _TimeFit)


class ContextFit:
    """CostModel's context half: the `ctx_cells_` / `ctx_band_w_` cells and the `ctx_fits_` of the last refit."""

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
            # nothing to clip it against (a server's first steps include its warm-up: one unclipped step of
            # many times the cell's time can turn a batch exponent and the short context bands around)
            vals, _ = self.times_[key].settled()
            ref = float(np.median(vals)) if len(vals) >= MIN_SETTLED else None
        if ref is not None:
            # one wild step (a stall) would move a least-squares slope more than the context does
            cc.add(w, x, min(step_ms, CTX_CLIP * ref))
        cov = (c, _region_of(b), ctx_band_index(mean_ctx(ctx, batch_size)))
        self.ctx_band_w_[cov] = self.ctx_band_w_.get(cov, 0.0) + w

    # ------------------------------------------------------------------ fitting

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

