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
from ..policies.table import OFF, Config, PolicyTable, Row, config_name, rows_to_obj
from ..training.costmodel import CostModel, Sample
from ..training.fit import FitSettings, TableFitter
from . import wire
from .metrics import Metrics
from .state import StateStore

log = logging.getLogger("specctl.service")


@dataclass(frozen=True)
class ServiceSettings(FitSettings):
    """The fit's settings (training.fit.FitSettings) plus the daemon's cadence and fallback."""

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
    persist_model_s: float = 30.0
    max_future_s: float = 300.0  # records stamped further ahead of our clock are rejected

    def __post_init__(self) -> None:
        if self.mode not in ("online", "fixed"):
            raise ValueError(f"mode must be 'online' or 'fixed', not {self.mode!r}")
        if (self.refit_interval_s <= 0 or self.partial_refit_s <= 0 or self.heartbeat_s <= 0
                or self.half_life_s <= 0):
            raise ValueError("refit intervals, heartbeat and half-life must be > 0")
        if self.partial_refit_for_s < 0:
            raise ValueError("partial_refit_for_s must be >= 0")
        super().__post_init__()
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
        self.fitter = TableFitter(settings)
        self.servers: dict[str, ServerStats] = {}
        self.started_at = clock()
        self.last_refit = -float("inf")
        self.last_publish = -float("inf")
        self.last_persist = clock()
        self.num_refits = 0
        self.num_tick_errors = 0  # refits that raised (the daemon's safe_tick counts them)
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
            # a version names one table: the persisted fixed table again keeps its number, anything else (a learned
            # policy, or a fixed one of another threshold or config) gets the next, so that engines log the change
            # and the decision audit can tell the tables apart
            self.policy = self._record(fallback, version=1, source="fixed")
            if loaded is not None:
                same = loaded.source == "fixed" and loaded.table == self.policy.table
                self.policy = self.policy.model_copy(update={"version": loaded.version + (0 if same else 1)})
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

    @property
    def model(self) -> CostModel:
        """The fitter's cost model (one model: what the service ingests is what the tables come from)."""
        return self.fitter.model

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

    def refit(self) -> bool:
        """Refit the model and re-derive the table; True if a new policy version was made."""
        t0 = time.perf_counter()
        now = self.clock()
        self.last_refit = now
        self._new_telemetry = False
        self.model.refit()
        mb = self.fitter.table_max_batch()
        options = self.fitter.options(mb)
        self.evidence = self.fitter.evidence_problem(options)
        self.fitter.forget_band_choices()
        current = PolicyTable.from_policy_obj(wire.to_obj(self.policy))
        if self.settings.mode == "online" and options:
            # with partial evidence (say, plain decode never measured yet) the configurations
            # that were measured compete where the current table uses one of them; elsewhere
            # the current table's choice stays
            usable = set(self.fitter.candidates())
            base = current if all(c in usable for c in current.configs()) else None
            z = self.settings.switch_z
            tau_log_var = self.model.tau_log_diff_var([o.config for o in options]) if z > 0 else None
            derived = cmpolicy.derive(options, previous=current if self.policy.source == "online" else None,
                                      margin=self.settings.margin, default=base, z=z,
                                      max_margin=self.settings.max_margin, tau_log_var=tau_log_var)
            bands = self.fitter.ctx_bands(options, derived, current if self.policy.source == "online" else None,
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

    def _explore_rows(self, table: PolicyTable, options: list[cmpolicy.Option],
                      tau_log_var: Optional[np.ndarray]) -> tuple[Row, ...]:
        """The exploration rule (TableFitter.explore_rows) against the current policy's rows; none in fixed mode."""
        if self.settings.mode != "online":
            return ()
        had = frozenset((r.min_batch, r.config.key, r.min_ctx) for r in self.policy.explore or ())
        return self.fitter.explore_rows(table, options, tau_log_var, had)

    def _model_summary(self, options: list[cmpolicy.Option], table: PolicyTable) -> dict[str, Any]:
        summary = self.fitter.model_summary(options)
        summary["evidence"] = self.evidence or "ok"
        paths: dict[str, int] = {}
        for st in self.servers.values():
            for k, v in st.off_paths.items():
                paths[k] = paths.get(k, 0) + v
        if paths:
            summary["off_paths"] = dict(sorted(paths.items()))
        x = table.spec_off_crossover()
        summary["spec_off_crossover"] = x
        if table.bands and self.fitter.band_summary_:
            summary["ctx_bands"] = self.fitter.band_summary_
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

