"""Cost-model policy: per batch size, the configuration with the best predicted goodput.

goodput(c, b) = b * tau(c) / t(c, b). Inputs are plain arrays (the fitted model lives in
`specctl.training`); the output is a `PolicyTable` with hysteresis against the previous table; `measuring_gain` says
which configurations are worth measuring where the table does not run them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from .table import OFF, Config, PolicyTable, Row, rows_from_choices

DEFAULT_MARGIN = 0.01  # a new best must beat the current choice by at least 1% to move a boundary
DEFAULT_MAX_MARGIN = 0.05  # however uncertain the estimates, a 5% shortfall is not kept
DEFAULT_EXPLORE_PERIOD = 64  # one exploring step in 64 = 1.6% of steps (budget: 2%)


@dataclass(frozen=True)
class Option:
    """One candidate: its tokens per step and predicted step time at b = 1..len(step_ms).

    `trusted` (optional, same length): where the prediction rests on measurements nearby rather
    than on a long extrapolation; a configuration is never chosen over, or abandoned for,
    another where either is untrusted. `step_ms_se` (optional, same length): the relative
    standard error of `step_ms`; `step_ms_thin_se` (optional, same length): its part that rests
    on batch sizes with fewer values than a median window settles on (see `Tolerance`).
    """

    config: Config
    tokens_per_step: float
    step_ms: np.ndarray
    trusted: Optional[np.ndarray] = None
    step_ms_se: Optional[np.ndarray] = None
    step_ms_thin_se: Optional[np.ndarray] = None

    def goodput(self) -> np.ndarray:
        b = np.arange(1, len(self.step_ms) + 1, dtype=float)
        return 1000.0 * b * self.tokens_per_step / self.step_ms

    def trust(self) -> np.ndarray:
        return np.ones(len(self.step_ms), bool) if self.trusted is None else np.asarray(self.trusted, bool)

    def step_var(self) -> np.ndarray:
        return np.zeros(len(self.step_ms)) if self.step_ms_se is None else np.asarray(self.step_ms_se, float) ** 2

    def step_thin_var(self) -> np.ndarray:
        return (np.zeros(len(self.step_ms)) if self.step_ms_thin_se is None
                else np.asarray(self.step_ms_thin_se, float) ** 2)


@dataclass(frozen=True)
class Tolerance:
    """How much worse than the best a configuration may look and still be kept, per pair of
    options and batch size: z standard errors of ln goodput(i) - ln goodput(j), at least
    `margin` and at most `max_margin`.

    ln goodput = ln b + ln tau - ln t, so the variance of the difference adds the tokens-per-step
    part (`tau_log_var`: the variance of ln tau_i - ln tau_j, correlated where options share
    measurements) and both step-time predictions' (`Option.step_ms_se`). Goodput estimates
    closer than z of their standard errors are a tie the data cannot break: moving a boundary
    for it follows noise. `margin` is the floor: a smaller difference is not worth a new table
    even when it is certain. `max_margin` is the cap: keeping a configuration that looks worse
    costs its apparent shortfall on every step, and the standard errors stop shrinking once the
    estimates' windows are full (the acceptance EWMA's effective seconds, the step-time median's
    recent values), so without a cap an engine whose step times scatter by 30% would stay with
    its first choice, right or wrong. That reason does not hold for a step time resting on one or
    two values (a configuration just measured for the first time): its error is real and the next
    values shrink it, so the cap rises to z standard errors of that thin part: one lucky value
    does not displace the previous choice. Island merging (`thin` False) keeps the cap: there a
    wide tolerance would make changes, not prevent them. z = 0 (or no variances): `margin` alone.
    """

    margin: float = DEFAULT_MARGIN
    z: float = 0.0
    tau_log_var: Optional[np.ndarray] = None  # (options, options)
    max_margin: float = DEFAULT_MAX_MARGIN
    thin: bool = True  # lift the cap for thin step times (keeping a choice; not merging runs)

    def between(self, options: Sequence[Option], i: int, j: int) -> np.ndarray:
        """Allowed relative shortfall of option i against option j, per batch size."""
        n = len(options[i].step_ms)
        if self.z <= 0 or i == j:
            return np.full(n, self.margin)
        var = options[i].step_var() + options[j].step_var()
        if self.tau_log_var is not None:
            var = var + float(self.tau_log_var[i, j])
        cap = self.max_margin
        if self.thin:
            cap = np.maximum(cap, self.z * np.sqrt(options[i].step_thin_var() + options[j].step_thin_var()))
        return np.clip(self.z * np.sqrt(var), self.margin, np.maximum(self.margin, cap))


def goodput_matrix(options: Sequence[Option]) -> np.ndarray:
    """Tokens/s, shape (len(options), max batch)."""
    return np.vstack([o.goodput() for o in options])


def choose(options: Sequence[Option], previous: Optional[PolicyTable] = None,
           margin: float = DEFAULT_MARGIN, default: Optional[PolicyTable] = None, *,
           z: float = 0.0, tau_log_var: Optional[np.ndarray] = None,
           max_margin: float = DEFAULT_MAX_MARGIN) -> list[Config]:
    """Per batch size (index 0 = batch 1), the chosen configuration.

    Hysteresis: where the previous table's choice is still an option and its goodput is within
    the tolerance of the best (see `Tolerance`: z standard errors of the difference, between
    `margin` and `max_margin`), it is kept. So a boundary moves only when the new best wins by
    more than the estimates can tell apart, and estimates wobbling within their noise do not
    move it back and forth; a clear win moves it at the first refit that shows it. Then runs
    whose advantage is within the tolerance are merged into a neighbour (`_merge_islands`).
    Partial evidence: where `default`'s choice is not a trusted option at a batch size (never
    measured there, or only by a long extrapolation), the default stays: there is nothing to
    compare it with.
    """
    if not options:
        raise ValueError("no options to choose from")
    tol = Tolerance(margin, z, tau_log_var, max_margin)
    g = goodput_matrix(options)
    trust = np.vstack([o.trust() for o in options])
    gt = np.where(trust, g, -np.inf)
    best = np.argmax(gt, axis=0)
    idx = {o.config: i for i, o in enumerate(options)}
    out: list[Optional[Config]] = [options[i].config if np.isfinite(gt[i, b0]) else None
                                   for b0, i in enumerate(best)]
    pinned = [False] * len(out)
    for b0 in range(g.shape[1]):
        d = default.lookup(b0 + 1) if default is not None else None
        j = idx.get(d) if d is not None else None
        if d is not None and (j is None or not trust[j, b0]):
            out[b0], pinned[b0] = d, True
        elif out[b0] is None:  # nothing trusted and no default: the best extrapolation
            out[b0] = options[int(np.argmax(g[:, b0]))].config
    allowed = _Allowed(options, tol, best)
    if previous is not None:
        for b0 in range(g.shape[1]):
            if pinned[b0]:
                continue
            prev = previous.lookup(b0 + 1)
            j = idx.get(prev)
            if j is not None and trust[j, b0] and g[j, b0] >= g[best[b0], b0] * (1.0 - allowed.at(j, b0)):
                out[b0] = prev
    # the dead band of island merging (see _merge_islands) comes with the standard errors; with
    # z = 0 the margin-only rule stays exactly as it was
    had = [previous.lookup(b0 + 1) for b0 in range(g.shape[1])] if previous is not None and z > 0 else None
    merged = _merge_islands([None if p else c for c, p in zip(out, pinned)], gt, idx,
                            _Allowed(options, replace(tol, thin=False), best), had)
    return [c if p else m for c, p, m in zip(out, pinned, merged)]  # type: ignore[misc]


class _Allowed:
    """Tolerance of option j against the best option at each batch size (`Tolerance.between`
    computed once per pair)."""

    def __init__(self, options: Sequence[Option], tol: Tolerance, best: np.ndarray):
        self.options, self.tol, self.best = options, tol, best
        self.cache: dict[tuple[int, int], np.ndarray] = {}

    def at(self, j: int, b0: int) -> float:
        i = int(self.best[b0])
        t = self.cache.get((j, i))
        if t is None:
            t = self.cache[(j, i)] = self.tol.between(self.options, j, i)
        return float(t[b0])

    def __call__(self, j: int, a: int, e: int) -> np.ndarray:
        return np.array([self.at(j, b0) for b0 in range(a, e)])


def _merge_islands(choices: list[Config], g: np.ndarray, idx: dict[Config, int],
                   allowed: _Allowed, had: Optional[list[Config]] = None) -> list[Config]:
    """Absorb a run of batch sizes into a neighbouring run when the neighbour's configuration
    is within tolerance of the best at every batch size of the run: near-ties between two
    configurations (s2 vs s3, say) otherwise fragment the table into noise-driven slivers, and
    an island whose advantage is within the uncertainty of the estimates is not evidence of
    anything. Of two neighbours that qualify, the one fewer tolerances away wins. `g` is -inf
    where a configuration is untrusted: a run is never merged into one untrusted there.

    Where the previous table (`had`) already ran the run's configuration, the neighbour must be
    within half the tolerance: a dead band between making an island (the hysteresis in `choose`
    lets a new best in only beyond the full tolerance) and unmaking it, so that an advantage
    hovering at the tolerance does not add and remove the island at alternate refits."""
    out = list(choices)
    best = g.max(axis=0)
    # None marks pinned batch sizes (partial evidence): they are never merged into or from
    while True:
        runs = []  # (start, end_exclusive, config)
        s = 0
        for i in range(1, len(out) + 1):
            if i == len(out) or out[i] != out[s]:
                runs.append((s, i, out[s]))
                s = i
        if len(runs) < 2:
            return out
        merged = False
        for k in sorted(range(len(runs)), key=lambda k: runs[k][1] - runs[k][0]):
            a, e, own = runs[k]
            if own is None:
                continue
            cands = [runs[n][2] for n in (k - 1, k + 1) if 0 <= n < len(runs) and runs[n][2] is not None]
            scored = []
            for c in cands:
                bb = best[a:e]
                known = np.isfinite(bb)  # -inf: nothing trusted there, any choice is a guess
                ratio = np.where(known, g[idx[c], a:e] / np.where(known, bb, 1.0), 1.0)
                ratio = np.where(np.isfinite(ratio), ratio, -1.0)  # c untrusted where others are
                loss = 1.0 - ratio
                tol = allowed(idx[c], a, e)
                if had is not None:
                    tol = np.where([had[b0] == own for b0 in range(a, e)], 0.5 * tol, tol)
                if np.all(loss <= tol):
                    scored.append((float(np.max(loss / np.maximum(tol, 1e-12))), c))
            if scored:
                c = min(scored)[1]
                out[a:e] = [c] * (e - a)
                merged = True
                break
        if not merged:
            return out


def measuring_gain(options: Sequence[Option], chosen: Sequence[Config], lo: int, *, z: float,
                   margin: float = DEFAULT_MARGIN, tau_log_var: Optional[np.ndarray] = None,
                   candidates: Sequence[Config] = (),
                   measured: Optional[dict[Config, Sequence[int]]] = None) -> dict[Config, float]:
    """What measuring each configuration at batch sizes lo .. lo + len(chosen) - 1 could gain,
    against the table's choice there (`chosen`, one per batch size): an upper confidence bound on
    how much better its goodput may be, in ln goodput.

    gain(c, b) = ln g_c(b) - ln g_chosen(b) - ln(1 + margin) + z * sd, sd the standard error of the
    difference that measuring c can shrink: c's own step time (noise, interpolation, age) and the
    acceptance of both (`tau_log_var`, correlated where they share measurements). It is capped by
    the same bound with c's tokens per step at all drafts accepted (steps + 1) in place of its
    uncertain acceptance: a configuration that could not win even then is not worth a step. A
    region's gain is the largest over its batch sizes where c is not the choice (c runs, and is
    measured, where it is) and, where `measured` names batch sizes c has step times at there, over
    those only: between them its prediction interpolates, with an error spanning the whole gap,
    and exploring steps come at the traffic's batch sizes anyway.

    inf: nothing to compare there, i.e. c, or the choice, has no trusted prediction at some batch
    size (never measured, or only by a long extrapolation); `candidates` not among `options` (no
    step time or no acceptance yet) get inf too. A gain > 0 means the data cannot rule out that c
    beats the choice by more than `margin`: the daemon measures it (controller.service). With
    z = 0 only a predicted win counts."""
    idx = {o.config: i for i, o in enumerate(options)}
    n = len(chosen)
    out: dict[Config, float] = {c: float("inf") for c in candidates if c not in idx and c not in chosen}
    ln_g = {o.config: np.log(np.maximum(o.goodput()[lo - 1:lo - 1 + n], 1e-300)) for o in options}
    trust = {o.config: o.trust()[lo - 1:lo - 1 + n] for o in options}
    chosen_idx = [idx.get(ch) for ch in chosen]
    lead = np.log1p(margin)
    for o in options:
        c, i = o.config, idx[o.config]
        other = np.array([ch != c for ch in chosen])
        if not other.any():
            continue
        own = np.zeros(n, bool)
        for b in (measured or {}).get(c, ()):
            if lo <= b < lo + n:
                own[b - lo] = True
        if (own & other).any():
            other &= own
        best = -np.inf
        var_c = o.step_var()[lo - 1:lo - 1 + n]
        cap = np.log((c[0] + 1.0) / max(o.tokens_per_step, 1e-9))
        for k in np.flatnonzero(other):
            j = chosen_idx[k]
            if j is None or not trust[c][k] or not trust[options[j].config][k]:
                best = float("inf")
                break
            diff = ln_g[c][k] - ln_g[options[j].config][k] - lead
            tv = float(tau_log_var[i, j]) if tau_log_var is not None else 0.0
            ucb = diff + z * np.sqrt(var_c[k] + tv)
            best = max(best, float(min(ucb, diff + cap + z * np.sqrt(var_c[k]))))
        out[c] = best
    return out


def derive(options: Sequence[Option], *, previous: Optional[PolicyTable] = None,
           margin: float = DEFAULT_MARGIN, explore: Sequence[Row] = (),
           explore_period: int = DEFAULT_EXPLORE_PERIOD, version: int = 0,
           source: str = "online", default: Optional[PolicyTable] = None,
           z: float = 0.0, tau_log_var: Optional[np.ndarray] = None,
           max_margin: float = DEFAULT_MAX_MARGIN) -> PolicyTable:
    choices = choose(options, previous, margin, default, z=z, tau_log_var=tau_log_var, max_margin=max_margin)
    rows = rows_from_choices(choices)
    if len(rows) > 256:  # pathological near-ties: drop hysteresis rather than ship a huge table
        rows = rows_from_choices(choose(options, None, 0.0, default))
    return PolicyTable(rows=rows, explore=tuple(explore),
                       explore_period=explore_period if explore else 0,
                       version=version, source=source)


def crossover(table: PolicyTable) -> Optional[int]:
    """First batch size from which the table decodes plainly for good (None: never)."""
    return table.spec_off_crossover()


__all__ = ["Option", "Tolerance", "choose", "derive", "measuring_gain", "goodput_matrix", "crossover", "OFF"]
