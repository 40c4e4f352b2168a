"""Synthetic telemetry from a known ground truth (linear step time, fixed per-position acceptance).

Used by tests, benchmarks and the shipped demo recording to check that the control loop recovers
the true spec->off crossover.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np

Config = tuple[int, int, int]


@dataclass(frozen=True)
class ConfigTruth:
    config: Config
    base_ms: float  # step time at batch 0 (intercept)
    per_req_ms: float  # slope per request in the batch
    accept: tuple[float, ...] = ()  # conditional acceptance per position (chain)

    def step_ms(self, b: np.ndarray | float) -> np.ndarray | float:
        return self.base_ms + self.per_req_ms * b

    def tokens_per_step(self) -> float:
        return 1.0 + float(np.cumprod(self.accept[: self.config[0]]).sum()) if self.config[0] else 1.0


@dataclass(frozen=True)
class GroundTruth:
    configs: tuple[ConfigTruth, ...]

    def goodput(self, c: ConfigTruth, b: np.ndarray) -> np.ndarray:
        return b * c.tokens_per_step() / c.step_ms(b)

    def best(self, max_batch: int = 4096) -> list[Config]:
        b = np.arange(1, max_batch + 1, dtype=float)
        g = np.vstack([self.goodput(c, b) for c in self.configs])
        return [self.configs[i].config for i in np.argmax(g, axis=0)]

    def crossover(self, max_batch: int = 4096) -> Optional[int]:
        """First batch size from which plain decode is best for good."""
        best = self.best(max_batch)
        last_spec = max((i for i, c in enumerate(best) if c[0] > 0), default=None)
        if last_spec is None:
            return 1
        if last_spec == len(best) - 1:
            return None
        return last_spec + 2


def truth_with_crossover(crossover: float, *, accept: Sequence[float] = (0.8, 0.7, 0.6),
                         steps: int = 3, off_base_ms: float = 6.0, off_slope_ms: float = 0.02,
                         spec_base_extra_ms: float = 1.5) -> GroundTruth:
    """A truth whose `steps` chain is exactly as good as plain decode at batch `crossover`."""
    off = ConfigTruth((0, 1, 1), off_base_ms, off_slope_ms)
    tau = 1.0 + float(np.cumprod(accept[:steps]).sum())
    # goodput equal at x: tau / (a + k x) = 1 / (a0 + k0 x)  =>  k = (tau (a0 + k0 x) - a) / x
    a = off_base_ms + spec_base_extra_ms
    x = float(crossover) - 0.5  # boundary between crossover-1 (spec) and crossover (off)
    k = (tau * (off_base_ms + off_slope_ms * x) - a) / x
    if k <= 0:
        raise ValueError(f"cannot place a crossover at {crossover} with these costs")
    spec = ConfigTruth((steps, 1, steps + 1), a, k, tuple(accept[:steps]))
    return GroundTruth((off, spec))


def generate(truth: GroundTruth, *, num_steps: int, batch_sizes: Sequence[int], seed: int = 0,
             noise_cv: float = 0.03, server: str = "synth-0", t0: float = 1_764_441_600.0,
             dwell: int = 16) -> Iterator[dict]:
    """Telemetry record dicts (DESIGN.md form): configurations visited round-robin, each for
    `dwell` consecutive steps at one batch size (like an engine that switches now and then)."""
    rng = np.random.default_rng(seed)
    ts = t0
    it = 0
    n_cfg = len(truth.configs)
    while it < num_steps:
        b = int(batch_sizes[rng.integers(len(batch_sizes))])
        ct = truth.configs[(it // dwell) % n_cfg]
        steps = ct.config[0]
        for _ in range(dwell):
            if it >= num_steps:
                break
            ms = float(ct.step_ms(b)) * max(0.05, 1.0 + noise_cv * rng.standard_normal())
            rec = {"kind": "step", "schema": 1, "server": server, "rank": 0, "iter": it,
                   "ts": round(ts, 6), "batch_size": b,
                   "config": {"steps": steps, "topk": ct.config[1], "draft_tokens": ct.config[2]},
                   "step_ms": round(ms, 4)}
            if steps:
                u = rng.random((b, steps))
                ok = u < np.asarray(ct.accept[:steps])
                # chain: accepted = length of the leading run of successes
                acc = np.where(ok.all(axis=1), steps, np.argmin(ok, axis=1))
                rec["accepted"] = acc.tolist()
            yield rec
            ts += ms / 1000.0
            it += 1
