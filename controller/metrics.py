"""Prometheus metrics of `specctl serve`; each instance owns a registry, tests make their own."""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MAX_SERVER_LABELS = 256  # hostile or buggy peers must not blow up label cardinality


class Metrics:
    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.records_in = Counter("specctl_records_in", "Telemetry step records accepted",
                                  ["server"], registry=r)
        self.rejected = Counter("specctl_records_rejected", "Frames rejected, by reason",
                                ["reason"], registry=r)
        self.shed = Counter("specctl_records_shed", "Valid records not fitted because the daemon was behind",
                            registry=r)
        self.refits = Counter("specctl_refits", "Cost-model refits", registry=r)
        self.refit_seconds = Histogram("specctl_refit_seconds", "Time per refit",
                                       buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5), registry=r)
        self.published = Counter("specctl_policies_published", "Policy frames sent (new versions and heartbeats)",
                                 ["kind"], registry=r)
        self.policy_version = Gauge("specctl_policy_version", "Current policy version", registry=r)
        self.policy_info = Gauge("specctl_policy_row", "Current table: 1 per row",
                                 ["min_batch", "max_batch", "config"], registry=r)
        self.fit_error = Gauge("specctl_fit_error", "Median relative error of the step-time fit",
                               ["config"], registry=r)
        self.crossover = Gauge("specctl_spec_off_crossover_batch",
                               "First batch size decoded plainly for good (0: never)", registry=r)
        self.off_steps = Counter("specctl_off_steps", "Steps-0 records by the off path the engine ran "
                                 "(decode: the decode state; verify: SGLang's trivial verify; unknown: not said)",
                                 ["server", "path"], registry=r)
        self.status_requests = Counter("specctl_status_requests", "Status queries answered",
                                       ["result"], registry=r)
        self._servers: set[str] = set()

    def server_label(self, server: str) -> str:
        if server in self._servers:
            return server
        if len(self._servers) < MAX_SERVER_LABELS:
            self._servers.add(server)
            return server
        return "_other"

    def set_table(self, rows: list[tuple[int, Optional[int], str]]) -> None:
        self.policy_info.clear()
        for lo, hi, name in rows:
            self.policy_info.labels(str(lo), "inf" if hi is None else str(hi), name).set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def value(self, name: str, labels: Optional[dict[str, str]] = None) -> float:
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else float(v)
