"""Acceptance queries of the cost model: tokens per step per configuration, pooled by chain
position, and the variance of their differences (a mixin of training.costmodel.CostModel)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..policies.table import Config
from .cells import ACCEPT_VAR_FLOOR, PRIOR_REQUESTS, _AcceptCell


class AcceptanceEstimate:
    """CostModel's acceptance half: reads the `accept_` cells that CostModel.observe fills."""

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

    def accept_weight(self, c: Config) -> float:
        """Decayed number of requests behind tau(c) (for uncertainty reporting)."""
        acc = self.accept_.get(tuple(c))  # type: ignore[arg-type]
        if acc is None:
            return 0.0
        return float(sum(acc.current()) + acc.mean_weight) * self._now_factor(self.accept_half_life_s)

