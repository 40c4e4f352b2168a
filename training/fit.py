"""From the cost model to tables: the options per configuration, context bands, exploration rows.

`TableFitter` is what the daemon (controller.service) refits every second and what `specctl train`
fits once, offline; the choice of rows itself is policies.costmodel's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..controller import wire
from ..policies import costmodel as cmpolicy
from ..policies.table import OFF, Band, Config, PolicyTable, Row, config_name, ctx_band_range, rows_from_choices
from .costmodel import STEP_DRIFT_AT_HALF_LIFE, CostModel, regions

log = logging.getLogger("specctl.service")

MAX_SEEN_CANDIDATES = 16  # configurations taken from telemetry when --configs is not given
MAX_EXPLORE_ROWS = 256
PROBES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # batch sizes a summary predicts at


@dataclass(frozen=True)
class FitSettings:
    """The cost model's memories and the table rule's tolerances (the daemon's ServiceSettings adds
    its cadence and fallback to these)."""

    half_life_s: float = 600.0  # step-time memory (hardware: slow to change)
    accept_half_life_s: float = 8.0  # acceptance memory (traffic: shifts within seconds)
    # two seconds in a row this many standard errors off what the model believes a chain accepts
    # (pooled over every chain at least as long) replace that chain's history
    # (0 = off: shifts are then followed at the pace of accept_half_life_s)
    accept_change_z: float = 3.0
    # the relative standard error a measured step time gains per half_life_s of age (see
    # CostModel.step_ms_errors): what reopens a comparison the data once decided
    step_drift: float = STEP_DRIFT_AT_HALF_LIFE
    warmup_steps: int = 2
    # configurations the engines have runtime states for; None = those seen in telemetry + off
    candidates: Optional[tuple[Config, ...]] = None
    margin: float = cmpolicy.DEFAULT_MARGIN
    # the uncertainty the daemon acts on, in standard errors of the goodput difference (acceptance
    # and step time): a boundary moves, and an island stands, only where the better configuration
    # wins by more (policies.costmodel.Tolerance; `margin` the floor, `max_margin` the cap), and a
    # configuration is measured where it may win by more than `margin` within it (the exploration
    # rule, TableFitter.explore_rows). 0 = margin alone, and only predicted wins measured
    switch_z: float = 2.0
    max_margin: float = cmpolicy.DEFAULT_MAX_MARGIN
    # the exploration budget: one step in this many runs a configuration worth measuring (0 = none)
    explore_period: int = cmpolicy.DEFAULT_EXPLORE_PERIOD
    # steps of traffic a (batch region, context band) needs before configurations are measured in it
    min_region_samples: float = 16.0
    # per batch region (and context band), how many of the configurations worth measuring share the
    # exploring steps: those with the largest bound (see TableFitter.explore_rows; 0 = all)
    explore_per_region: int = 2
    max_batch: int = 1024
    # where telemetry carries ctx_tokens and step time depends on it, publish a table per band of
    # mean context per request (see TableFitter.ctx_bands); False: one table for any context
    ctx_axis: bool = True

    def __post_init__(self) -> None:
        if self.half_life_s <= 0:
            raise ValueError("half_life_s must be > 0")
        if self.switch_z < 0 or not (0.0 <= self.margin <= 1.0 and 0.0 <= self.max_margin <= 1.0):
            raise ValueError("switch_z must be >= 0, margin and max_margin in [0, 1]")
        if self.explore_period and self.explore_period < 50:
            raise ValueError("explore_period below 50 would explore more than 2% of steps")
        if self.step_drift < 0:
            raise ValueError("step_drift must be >= 0")


class TableFitter:
    """The cost model (`model`) and the tables derived from it. After `ctx_bands`, `band_summary_`
    holds what `policy show` prints per band and `band_choices_` each band's options and choices."""

    def __init__(self, settings: FitSettings = FitSettings()):
        self.settings = settings
        self.model = CostModel(half_life_s=settings.half_life_s,
                               accept_half_life_s=settings.accept_half_life_s,
                               accept_change_z=settings.accept_change_z,
                               warmup_steps=settings.warmup_steps,
                               min_region_samples=settings.min_region_samples,
                               step_drift=settings.step_drift)
        self.model.fit([])
        self.band_summary_: list[dict[str, Any]] = []
        # per context band of the last ctx_bands: (band index, its options, its choice per batch size)
        self.band_choices_: list[tuple[int, list[cmpolicy.Option], list[Config]]] = []

    def forget_band_choices(self) -> None:
        """A refit that chooses no bands must not explore by the last ones (their summary stays for
        `policy show` while the table keeps its bands)."""
        self.band_choices_ = []

    def candidates(self) -> list[Config]:
        if self.settings.candidates is not None:
            return sorted(set(self.settings.candidates))  # exactly the engines' runtime states
        # seen in telemetry: an engine only reports configurations it has runtime states for;
        # bounded, so a flood of distinct configurations cannot blow up tables or refits
        seen = sorted(set(self.model.configs()) - {OFF},
                      key=lambda c: -self.model.step_samples(c))[:MAX_SEEN_CANDIDATES]
        return sorted(set(seen) | {OFF})

    def table_max_batch(self) -> int:
        return int(min(self.settings.max_batch, max(64, 2 * self.model.max_observed_batch())))

    def options(self, max_batch: Optional[int] = None) -> list[cmpolicy.Option]:
        """Candidates with both a step-time fit and a known tau, predicted at b = 1..max_batch."""
        mb = max_batch or self.table_max_batch()
        b = np.arange(1, mb + 1)
        out = []
        for c in self.candidates():
            tau = self.model.tokens_per_step(c)
            if tau is None or not self.model.has_step_time(c):
                continue
            lo, hi, _ = self.model.measured_range(c)
            # a step-time curve is trusted up to twice its largest measured batch size and down to
            # a quarter of its smallest, however wide its span: step time bends upwards where the
            # GPU saturates, a knee the measured range need not show; beyond, the configuration
            # is untrusted, and so measured there by the exploration rule, not extrapolated
            trusted = (b >= lo / 4.0) & (b <= hi * 2)
            se = thin = None
            t = self.model.predict_step_ms(c, b)
            if self.settings.switch_z > 0:
                se, thin = self.model.step_ms_errors(c, b)
            out.append(cmpolicy.Option(c, tau, t, trusted, se, thin))
        return out

    def evidence_problem(self, options: list[cmpolicy.Option]) -> Optional[str]:
        """What the options lack for a table (None: enough evidence)."""
        if self.model.num_samples_ == 0:
            return "no telemetry yet"
        have = {o.config for o in options}
        if OFF not in have and OFF in self.candidates():
            return "partial: no steps measured with speculation off"
        if not any(c[0] > 0 for c in have):
            return "partial: no steps measured with speculation on (with acceptance)"
        return None

    def ctx_bands(self, options: list[cmpolicy.Option], table: PolicyTable,
                  previous: Optional[PolicyTable] = None, *, z: Optional[float] = None,
                  tau_log_var: Optional[np.ndarray] = None) -> tuple[Band, ...]:
        """The table per band of mean context per request, where step time depends on the context.

        Bands are powers of 2 of the mean context (policies.table.ctx_band_index), from the lowest to
        the highest one the telemetry shows min_region_samples steps in. Each band's table is chosen
        as `table` (the rows for any context) is, from the step times the model predicts at the band's
        middle (CostModel.predict_step_ms_ctx: f_c(b) + g_c * b^e_c * L), with the same tolerance, and
        hysteresis against the band of `previous` that covered that context. A configuration counts
        as measured only within one band of the contexts it ran at; where `table`'s choice is not,
        `table`'s choice stays. Neighbouring bands with the same rows are one band; the lowest is
        extended down to 0 and the highest up without bound. Nothing (one table for any context)
        when the telemetry carries no ctx_tokens, no configuration's step time depends on it, or all
        bands choose alike. `self.band_summary_` keeps what `policy show` prints per band, and
        `self.band_choices_` each band's options and choices before merging (what the exploration
        rule compares with there). `z`: the tolerance's standard errors, if not `switch_z` (`specctl
        train` chooses with 0); `tau_log_var`: the options' acceptance variance, if already computed."""
        self.band_summary_ = []
        self.band_choices_ = []
        if not self.settings.ctx_axis or not options or not self.model.has_ctx():
            return ()
        if not any(self.model.ctx_slope(o.config)[0] > 0 for o in options):
            return ()
        traffic = self.model.ctx_band_samples()
        seen = sorted(k for k, n in traffic.items() if n >= self.settings.min_region_samples)
        if not seen:
            return ()
        z = self.settings.switch_z if z is None else z
        if tau_log_var is None and z > 0:  # refit passes the one it computed for the same options
            tau_log_var = self.model.tau_log_diff_var([o.config for o in options])
        b = np.arange(1, len(options[0].step_ms) + 1)
        per_band: list[tuple[int, int, tuple[Row, ...], float, list[cmpolicy.Option]]] = []
        for k in range(seen[0], seen[-1] + 1):
            lo, hi = ctx_band_range(k)
            at = 0.5 * (lo + hi)
            opts = []
            for o in options:
                se = thin = None
                t = self.model.predict_step_ms_ctx(o.config, b, at)
                if z > 0:
                    se, thin = self.model.step_ms_ctx_errors(o.config, b, at)
                trusted = o.trust() & self.model.ctx_trusted(o.config, k)
                opts.append(cmpolicy.Option(o.config, o.tokens_per_step, t, trusted, se, thin))
            prev = PolicyTable(rows=previous.rows_for(int(at))) if previous is not None else None
            choices = cmpolicy.choose(opts, prev, self.settings.margin, table, z=z, tau_log_var=tau_log_var,
                                      max_margin=self.settings.max_margin)
            rows = rows_from_choices(choices)
            if len(rows) > 256:  # as derive(): pathological near-ties
                choices = cmpolicy.choose(opts, None, 0.0, table)
                rows = rows_from_choices(choices)
            self.band_choices_.append((k, opts, choices))
            per_band.append((lo, hi, rows, traffic.get(k, 0.0), opts))
        merged: list[list[Any]] = []  # [lo, hi, rows, traffic, opts of the busiest band, its middle]
        for lo, hi, rows, n, opts in per_band:
            if merged and merged[-1][2] == rows:
                m = merged[-1]
                m[1] = hi
                if n > m[3]:
                    m[3], m[4], m[5] = n, opts, 0.5 * (lo + hi)
            else:
                merged.append([lo, hi, rows, n, opts, 0.5 * (lo + hi)])
        if len(merged) < 2:
            return ()
        merged[0][0], merged[-1][1] = 0, None
        if len(table.rows) + sum(len(m[2]) for m in merged) > wire.MAX_TABLE_ROWS:
            log.warning("context bands dropped: %d rows would exceed a policy's %d", len(table.rows)
                        + sum(len(m[2]) for m in merged), wire.MAX_TABLE_ROWS)
            return ()
        probes = [p for p in PROBES if p <= len(b)]
        for lo, hi, rows, _, opts, at in merged:
            self.band_summary_.append({
                "min_ctx": lo, "max_ctx": hi, "predicted_at_ctx": at,
                "spec_off_crossover": PolicyTable(rows=rows).spec_off_crossover(),
                "predicted_goodput_tok_s": {config_name(o.config): [[p, round(float(o.goodput()[p - 1]), 1)]
                                                                    for p in probes] for o in opts}})
        return tuple(Band(lo, hi, rows) for lo, hi, rows, *_ in merged)

    def explore_rows(self, table: PolicyTable, options: list[cmpolicy.Option], tau_log_var: Optional[np.ndarray],
                     had: frozenset = frozenset()) -> tuple[Row, ...]:
        """The exploration rule: the (batch region, configuration) pairs worth a step of the
        budget (one step in `explore_period` runs one of them, in turn).

        In each log2 batch region the traffic has reached, a configuration the table does not run
        everywhere there is measured while the data cannot rule out that it beats the table's
        choice by more than `margin` (policies.costmodel.measuring_gain: an upper bound of
        `switch_z` standard errors on its goodput advantage). The standard errors are the cost
        model's: a configuration never measured in the region has none to bound it and is
        measured; one measured a few times has a wide step-time error, shrinking as its steps come
        in; an acceptance not measured lately (while the table decodes plainly) loses its weight,
        so its error grows until it is measured again, unless even all drafts accepted would not
        win there; a step time ages (CostModel.step_ms_errors), so a comparison the data once
        decided reopens as its evidence gets old; and a near-tie stays measured until the
        difference is known to within `margin`. Where step time depends on the context, the same
        rule runs per context band that has min_region_samples steps of traffic in the region,
        against that band's choice (rows naming the band cover only batches of its mean context).
        Of those, the `explore_per_region` with the largest bound get the region's exploring steps,
        in turn (the budget is small: spread over every open comparison, none settles; the bounds
        are recomputed every refit, so the next ones take over as these settle). A row the last
        policy had stays while its bound is within `margin` of 0 (a dead band: a near-tie's bound
        hovering at 0 would otherwise add and drop the row, a new policy version each time).
        `had`: (min_batch, config, min_ctx) of the last policy's exploring rows. Nothing with
        explore_period 0."""
        if self.settings.explore_period <= 0:
            return ()
        top = self.model.max_observed_batch()
        if top <= 0:
            return ()
        z, margin, cands = self.settings.switch_z, self.settings.margin, self.candidates()
        measured = {o.config: self.model.measured_batches(o.config) for o in options}
        rows: list[Row] = []
        keep = -float(np.log1p(margin))

        def add(lo: int, hi: int, gains: dict[Config, float], **ctx: Any) -> None:
            ok = sorted(((-g, c) for c, g in gains.items()
                         if g > 0.0 or (g > keep and (lo, c, ctx.get("min_ctx")) in had)))
            if self.settings.explore_per_region:
                ok = ok[:self.settings.explore_per_region]
            rows.extend(Row(lo, hi, c, **ctx) for _, c in ok)

        if options:
            top = min(top, len(options[0].step_ms))  # the batch sizes predictions were made for
        for lo, hi in regions(top):
            end = min(hi, top)
            chosen = [table.lookup(b) for b in range(lo, end + 1)]
            add(lo, hi, cmpolicy.measuring_gain(options, chosen, lo, z=z, margin=margin,
                                                tau_log_var=tau_log_var, candidates=cands, measured=measured))
        if self.band_choices_:
            traffic: dict[tuple[int, int], float] = {}
            for (_, lo, k), n in self.model.ctx_coverage().items():
                traffic[(lo, k)] = traffic.get((lo, k), 0.0) + n
            for k, opts, choices in self.band_choices_:
                band_lo, band_hi = ctx_band_range(k)
                for lo, hi in regions(top):
                    if traffic.get((lo, k), 0.0) < self.settings.min_region_samples:
                        continue
                    end = min(hi, top)
                    add(lo, hi, cmpolicy.measuring_gain(opts, choices[lo - 1:end], lo, z=z, margin=margin,
                                                        tau_log_var=tau_log_var, candidates=cands,
                                                        measured=measured),
                        min_ctx=band_lo, max_ctx=band_hi)
        rows.sort(key=lambda r: (r.min_batch, r.config, -1 if r.min_ctx is None else r.min_ctx))
        return tuple(rows[:MAX_EXPLORE_ROWS])

    def model_summary(self, options: list[cmpolicy.Option]) -> dict[str, Any]:
        """The model's summary with each option's predicted goodput and step time at probe batch sizes."""
        summary = self.model.summary(max_batch=max(1, self.model.max_observed_batch()))
        probes = [b for b in PROBES if b <= len(options[0].step_ms)] if options else []
        summary["predicted_goodput_tok_s"] = {
            config_name(o.config): [[b, round(float(o.goodput()[b - 1]), 1)] for b in probes]
            for o in options
        }
        summary["predicted_step_ms"] = {
            config_name(o.config): [[b, round(float(o.step_ms[b - 1]), 4)] for b in probes]
            for o in options
        }
        return summary
