"""The daemon's logic with no sockets: ingest step records, refit, derive and version the policy.

`specctl serve` wraps it in ZeroMQ (controller/daemon.py); the simulator drives the same object
on its virtual clock. The clock, state store, metrics and recorder are injected.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from ..policies import costmodel as cmpolicy
from ..policies.fixed import DEFAULT_CONFIG, DEFAULT_THRESHOLD, fixed_threshold, static
from ..policies.table import (OFF, Band, Config, PolicyTable, Row, config_name, ctx_band_range, rows_from_choices,
                              rows_to_obj)
from ..training.costmodel import STEP_DRIFT_AT_HALF_LIFE, CostModel, Sample, regions
from . import wire
from .metrics import Metrics
from .state import StateStore

log = logging.getLogger("specctl.service")

MAX_SEEN_CANDIDATES = 16  # configurations taken from telemetry when --configs is not given
MAX_EXPLORE_ROWS = 256


@dataclass(frozen=True)
class ServiceSettings:
    mode: str = "online"  # online | fixed
    threshold: int = DEFAULT_THRESHOLD
    fixed_config: Config = DEFAULT_CONFIG
    refit_interval_s: float = 1.0
    # while the evidence is partial (no telemetry yet, plain decode or speculation never measured)
    # the first measurement that completes it is worth a table at once: refit this often then,
    # when telemetry came in since the last refit, for at most partial_refit_for_s from the first
    # such telemetry (an engine that never runs what is missing does not keep the daemon busy)
    partial_refit_s: float = 0.1
    partial_refit_for_s: float = 30.0
    heartbeat_s: float = 2.0
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
    # rule, ControllerService._explore_rows). 0 = margin alone, and only predicted wins measured
    switch_z: float = 2.0
    max_margin: float = cmpolicy.DEFAULT_MAX_MARGIN
    # the exploration budget: one step in this many runs a configuration worth measuring (0 = none)
    explore_period: int = cmpolicy.DEFAULT_EXPLORE_PERIOD
    # steps of traffic a (batch region, context band) needs before configurations are measured in it
    min_region_samples: float = 16.0
    # per batch region (and context band), how many of the configurations worth measuring share the
    # exploring steps: those with the largest bound (see ControllerService._explore_rows; 0 = all)
    explore_per_region: int = 2
    max_batch: int = 1024
    persist_model_s: float = 30.0
    max_future_s: float = 300.0  # records stamped further ahead of our clock are rejected
    # where telemetry carries ctx_tokens and step time depends on it, publish a table per band of
    # mean context per request (see ControllerService.ctx_bands); False: one table for any context
    ctx_axis: bool = True
    def __post_init__(self) -> None:
        if self.mode not in ("online", "fixed"):
            raise ValueError(f"mode must be 'online' or 'fixed', not {self.mode!r}")
        if (self.refit_interval_s <= 0 or self.partial_refit_s <= 0 or self.heartbeat_s <= 0
                or self.half_life_s <= 0):
            raise ValueError("refit intervals, heartbeat and half-life must be > 0")
        if self.partial_refit_for_s < 0:
            raise ValueError("partial_refit_for_s must be >= 0")
        if self.switch_z < 0 or not (0.0 <= self.margin <= 1.0 and 0.0 <= self.max_margin <= 1.0):
            raise ValueError("switch_z must be >= 0, margin and max_margin in [0, 1]")
        if self.explore_period and self.explore_period < 50:
            raise ValueError("explore_period below 50 would explore more than 2% of steps")
        if self.step_drift < 0:
            raise ValueError("step_drift must be >= 0")
        if self.candidates is not None and tuple(self.fixed_config) not in {tuple(c) for c in self.candidates}:
            names = ", ".join(config_name(c) for c in sorted(self.candidates))
            raise ValueError(f"the fallback configuration {config_name(self.fixed_config)} is not among the "
                             f"engines' runtime states ({names}): engines would refuse every fallback table; "
                             f"set --config to one of them")


@dataclass
class ServerStats:
    records: int = 0
    last_ts: float = 0.0
    last_seen: float = 0.0
    ranks: set = field(default_factory=set)
    counter: Any = None  # this server's records_in child (label lookup once, not per record)
    off_paths: dict = field(default_factory=dict)  # steps-0 records by off path ("unknown": not said)
    off_counters: dict = field(default_factory=dict)  # their metric children, looked up once


class ControllerService:
    def __init__(self, settings: ServiceSettings = ServiceSettings(), *,
                 clock: Callable[[], float] = time.time, store: Optional[StateStore] = None,
                 metrics: Optional[Metrics] = None, recorder: Any = None,
                 init_policy: Optional[wire.PolicyRecord] = None):
        self.settings = settings
        self.clock = clock
        self.store = store
        self.metrics = metrics or Metrics()
        self.recorder = recorder
        self.model = CostModel(half_life_s=settings.half_life_s,
                               accept_half_life_s=settings.accept_half_life_s,
                               accept_change_z=settings.accept_change_z,
                               warmup_steps=settings.warmup_steps,
                               min_region_samples=settings.min_region_samples,
                               step_drift=settings.step_drift)
        self.model.fit([])
        self.servers: dict[str, ServerStats] = {}
        self.started_at = clock()
        self.last_refit = -float("inf")
        self.last_publish = -float("inf")
        self.last_persist = clock()
        self.num_refits = 0
        self.last_refit_ms = 0.0
        self.evidence: Optional[str] = "no telemetry yet"
        self._dirty = True  # current policy not yet published
        fallback = fixed_threshold(settings.threshold, settings.fixed_config)
        if settings.candidates is not None and OFF not in settings.candidates:
            # engines without a plain-decode state: the fallback speculates at every size
            fallback = static(settings.fixed_config)
        self.fallback = fallback
        self._new_telemetry = False  # records taken since the last refit
        self._partial_since: Optional[float] = None  # first telemetry while the evidence was partial
        self.band_summary: list[dict[str, Any]] = []  # the context bands of the last refit (ctx_bands)
        # per context band of the last refit: (band index, its options, its choice per batch size)
        self._band_choices: list[tuple[int, list[cmpolicy.Option], list[Config]]] = []

        loaded = None
        self.resumed_version: Optional[int] = None  # the policy version taken from the state dir
        if store is not None:
            loaded = store.load_policy()
            state = store.load_model()
            if state is not None:
                try:
                    self.model.set_state(state)
                except (ValueError, KeyError, TypeError) as e:
                    store.problems.append(f"model state unusable ({e}); starting with an empty model")
                    log.warning("model state unusable (%s); starting with an empty model", e)
                    self.model.fit([])
        if settings.mode == "fixed":
            version = (loaded.version + 1) if loaded is not None and loaded.source != "fixed" else (
                loaded.version if loaded is not None else 1)
            self.policy = self._record(fallback, version=version, source="fixed")
            if loaded is None or loaded.table != self.policy.table:
                self._persist_policy()
        elif loaded is not None:
            self.policy = loaded
            self.resumed_version = loaded.version
        elif init_policy is not None:
            self.policy = init_policy.model_copy(update={"version": max(init_policy.version, 1)})
            self._persist_policy()
        else:
            self.policy = self._record(fallback, version=1, source="fixed")
            self._persist_policy()
        self._update_policy_metrics()

    # ------------------------------------------------------------------ ingest

    def observe_frame(self, frame: bytes) -> bool:
        """Decode and take one telemetry frame; a bad frame is counted by reason and dropped."""
        try:
            rec = wire.decode_step(frame)
        except wire.WireError as e:
            self.metrics.rejected.labels(e.reason).inc()
            return False
        if not self.observe(rec):
            return False
        if self.recorder is not None:
            self.recorder.write(frame)
        return True

    def observe(self, rec: wire.StepRecord) -> bool:
        now = self.clock()
        if rec.ts > now + self.settings.max_future_s:
            self.metrics.rejected.labels("ts_in_future").inc()
            return False
        self.model.observe(Sample.from_record(rec))
        self._new_telemetry = True
        st = self.servers.get(rec.server)
        if st is None:
            if len(self.servers) >= 4096:
                self.metrics.rejected.labels("too_many_servers").inc()
                return False
            st = self.servers[rec.server] = ServerStats()
            st.counter = self.metrics.records_in.labels(self.metrics.server_label(rec.server))
        st.records += 1
        st.last_ts = rec.ts
        st.last_seen = now
        if len(st.ranks) < 1024:
            st.ranks.add(rec.rank)
        st.counter.inc()
        if rec.config.steps == 0:
            path = rec.off_path or "unknown"
            c = st.off_counters.get(path)
            if c is None:
                c = st.off_counters[path] = self.metrics.off_steps.labels(self.metrics.server_label(rec.server), path)
            st.off_paths[path] = st.off_paths.get(path, 0) + 1
            c.inc()
        return True

    # ------------------------------------------------------------------ refit / publish

    def tick(self) -> Optional[wire.PolicyRecord]:
        """Refit when due; return the policy to publish (a new version, or the current one as a
        heartbeat) or None when nothing is due."""
        now = self.clock()
        due = self.settings.refit_interval_s
        if self.evidence is None:
            self._partial_since = None
        elif self._new_telemetry:
            if self._partial_since is None:
                self._partial_since = now
            if now - self._partial_since < self.settings.partial_refit_for_s:
                due = min(due, self.settings.partial_refit_s)
        if self.settings.mode == "online" and now - self.last_refit >= due:
            self.refit()
        if self.store is not None and now - self.last_persist >= self.settings.persist_model_s:
            self.persist_model()
        if self._dirty:
            self._dirty = False
            self.last_publish = now
            self.metrics.published.labels("new").inc()
            return self.policy
        if now - self.last_publish >= self.settings.heartbeat_s:
            self.last_publish = now
            self.metrics.published.labels("heartbeat").inc()
            return self.policy
        return None

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

    def _evidence_problem(self, options: list[cmpolicy.Option]) -> Optional[str]:
        if self.model.num_samples_ == 0:
            return "no telemetry yet"
        have = {o.config for o in options}
        if OFF not in have and OFF in self.candidates():
            return "partial: no steps measured with speculation off"
        if not any(c[0] > 0 for c in have):
            return "partial: no steps measured with speculation on (with acceptance)"
        return None

    def refit(self) -> bool:
        """Refit the model and re-derive the table; True if a new policy version was made."""
        t0 = time.perf_counter()
        now = self.clock()
        self.last_refit = now
        self._new_telemetry = False
        self.model.refit()
        mb = self.table_max_batch()
        options = self.options(mb)
        self.evidence = self._evidence_problem(options)
        self._band_choices = []
        current = PolicyTable.from_policy_obj(wire.to_obj(self.policy))
        if self.settings.mode == "online" and options:
            # with partial evidence (say, plain decode never measured yet) the configurations
            # that were measured compete where the current table uses one of them; elsewhere
            # the current table's choice stays
            usable = set(self.candidates())
            base = current if all(c in usable for c in current.configs()) else None
            z = self.settings.switch_z
            tau_log_var = self.model.tau_log_diff_var([o.config for o in options]) if z > 0 else None
            derived = cmpolicy.derive(options, previous=current if self.policy.source == "online" else None,
                                      margin=self.settings.margin, default=base, z=z,
                                      max_margin=self.settings.max_margin, tau_log_var=tau_log_var)
            bands = self.ctx_bands(options, derived, current if self.policy.source == "online" else None,
                                   tau_log_var=tau_log_var)
            explore = self._explore_rows(derived, options, tau_log_var)
            table = PolicyTable(rows=derived.rows, explore=explore,
                                explore_period=self.settings.explore_period if explore else 0, bands=bands)
            source = "online"
        elif self.policy.source == "online":
            # A learned table outlives a thin window (e.g. right after a restart): keep it
            # until the evidence says otherwise; engines still fall back if it goes stale.
            table, source = current, "online"
        else:
            explore = self._explore_rows(current, options, None)
            table = PolicyTable(rows=current.rows, explore=explore,
                                explore_period=self.settings.explore_period if explore else 0)
            source = self.policy.source
        changed = (table.rows != current.rows or table.explore != current.explore
                   or table.bands != current.bands
                   or source != self.policy.source)
        self.num_refits += 1
        self.metrics.refits.inc()
        if changed:
            self.policy = self._record(table, version=self.policy.version + 1, source=source,
                                       options=options)
            self._persist_policy()
            self.persist_model()  # the model that produced this version, kept alongside it
            self._dirty = True
            self._update_policy_metrics()
        else:
            # keep the fit summary fresh for `policy show` without minting a version
            self.policy = self.policy.model_copy(update={"model": self._model_summary(options, table)})
        for name, err in self.model.fit_error().items():
            self.metrics.fit_error.labels(name).set(err)
        self.last_refit_ms = (time.perf_counter() - t0) * 1000.0
        self.metrics.refit_seconds.observe(self.last_refit_ms / 1000.0)
        return changed

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
        bands choose alike. `self.band_summary` keeps what `policy show` prints per band, and
        `self._band_choices` each band's options and choices before merging (what the exploration
        rule compares with there). `z`: the tolerance's standard errors, if not `switch_z` (`specctl
        train` chooses with 0); `tau_log_var`: the options' acceptance variance, if already computed."""
        self.band_summary = []
        self._band_choices = []
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
            self._band_choices.append((k, opts, choices))
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
        probes = [p for p in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if p <= len(b)]
        for lo, hi, rows, _, opts, at in merged:
            self.band_summary.append({
                "min_ctx": lo, "max_ctx": hi, "predicted_at_ctx": at,
                "spec_off_crossover": PolicyTable(rows=rows).spec_off_crossover(),
                "predicted_goodput_tok_s": {config_name(o.config): [[p, round(float(o.goodput()[p - 1]), 1)]
                                                                    for p in probes] for o in opts}})
        return tuple(Band(lo, hi, rows) for lo, hi, rows, *_ in merged)

    def _explore_rows(self, table: PolicyTable, options: list[cmpolicy.Option],
                      tau_log_var: Optional[np.ndarray]) -> tuple[Row, ...]:
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
        Nothing in fixed mode, or with explore_period 0."""
        if self.settings.explore_period <= 0 or self.settings.mode != "online":
            return ()
        top = self.model.max_observed_batch()
        if top <= 0:
            return ()
        z, margin, cands = self.settings.switch_z, self.settings.margin, self.candidates()
        measured = {o.config: self.model.measured_batches(o.config) for o in options}
        rows: list[Row] = []
        had = {(r.min_batch, r.config.key, r.min_ctx) for r in self.policy.explore or ()}
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
        if self._band_choices:
            traffic: dict[tuple[int, int], float] = {}
            for (_, lo, k), n in self.model.ctx_coverage().items():
                traffic[(lo, k)] = traffic.get((lo, k), 0.0) + n
            for k, opts, choices in self._band_choices:
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

    def _model_summary(self, options: list[cmpolicy.Option], table: PolicyTable) -> dict[str, Any]:
        summary = self.model.summary(max_batch=max(1, self.model.max_observed_batch()))
        probes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if b <= len(options[0].step_ms)] if options else []
        summary["predicted_goodput_tok_s"] = {
            config_name(o.config): [[b, round(float(o.goodput()[b - 1]), 1)] for b in probes]
            for o in options
        }
        summary["predicted_step_ms"] = {
            config_name(o.config): [[b, round(float(o.step_ms[b - 1]), 4)] for b in probes]
            for o in options
        }
        summary["evidence"] = self.evidence or "ok"
        paths: dict[str, int] = {}
        for st in self.servers.values():
            for k, v in st.off_paths.items():
                paths[k] = paths.get(k, 0) + v
        if paths:
            summary["off_paths"] = dict(sorted(paths.items()))
        x = table.spec_off_crossover()
        summary["spec_off_crossover"] = x
        if table.bands and self.band_summary:
            summary["ctx_bands"] = self.band_summary
        return summary

    def _record(self, table: PolicyTable, *, version: int, source: str,
                options: Optional[list[cmpolicy.Option]] = None) -> wire.PolicyRecord:
        obj: dict[str, Any] = {
            "kind": "policy", "schema": wire.SCHEMA_VERSION, "version": version,
            "created_at": self.clock(), "source": source,
            "table": table.to_rows_obj(),
            "model": self._model_summary(options or [], table),
        }
        if table.explore:
            obj["explore"] = rows_to_obj(table.explore)
            obj["explore_period"] = table.explore_period
        return wire.policy_from_obj(obj)

    def _persist_policy(self) -> None:
        if self.store is not None:
            self.store.save_policy(self.policy)

    def persist_model(self) -> None:
        if self.store is not None:
            self.store.save_model(self.model.get_state())
            self.last_persist = self.clock()

    def _update_policy_metrics(self) -> None:
        m = self.metrics
        m.policy_version.set(self.policy.version)
        m.set_table([(r.min_batch, r.max_batch, r.config.name) for r in self.policy.table if r.ctx_band is None])
        t = PolicyTable.from_policy_obj(wire.to_obj(self.policy))
        x = t.spec_off_crossover()
        m.crossover.set(0 if x is None else x)

    # ------------------------------------------------------------------ queries

    def status(self) -> dict[str, Any]:
        now = self.clock()
        m = self.metrics
        rejected = {}
        for metric in m.rejected.collect():
            for s in metric.samples:
                if s.name.endswith("_total"):
                    rejected[s.labels["reason"]] = int(s.value)
        return {
            "kind": "status",
            "mode": self.settings.mode,
            "uptime_s": round(now - self.started_at, 3),
            "records_in": self.model.num_samples_,
            "rejected": rejected,
            "refits": self.num_refits,
            "last_refit_ms": round(self.last_refit_ms, 3),
            "evidence": self.evidence or "ok",
            "servers": {k: {"records": v.records, "ranks": sorted(v.ranks)[:16],
                            "last_seen_s_ago": round(now - v.last_seen, 3), "off_paths": dict(v.off_paths)}
                        for k, v in list(self.servers.items())[:64]},
            "policy": wire.to_obj(self.policy),
            "policy_age_s": round(now - self.policy.created_at, 3),
            "resumed_policy_version": self.resumed_version,
        }

