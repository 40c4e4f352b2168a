"""Synthetic telemetry from a known ground truth (linear step time, fixed per-position acceptance;
optionally a term linear in the batch's context tokens).

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
    per_ctx_token_ms: float = 0.0  # slope per context token of the batch (all requests)

    def step_ms(self, b: np.ndarray | float, ctx_tokens: np.ndarray | float = 0.0) -> np.ndarray | float:
        if self.per_ctx_token_ms:
            return self.base_ms + self.per_req_ms * b + self.per_ctx_token_ms * ctx_tokens
        return self.base_ms + self.per_req_ms * b

    def tokens_per_step(self) -> float:
        return 1.0 + float(np.cumprod(self.accept[: self.config[0]]).sum()) if self.config[0] else 1.0


@dataclass(frozen=True)
class GroundTruth:
    configs: tuple[ConfigTruth, ...]

    def goodput(self, c: ConfigTruth, b: np.ndarray, mean_ctx: float = 0.0) -> np.ndarray:
        return b * c.tokens_per_step() / c.step_ms(b, b * mean_ctx)

    def best(self, max_batch: int = 4096, mean_ctx: float = 0.0) -> list[Config]:
        b = np.arange(1, max_batch + 1, dtype=float)
        g = np.vstack([self.goodput(c, b, mean_ctx) for c in self.configs])
        return [self.configs[i].config for i in np.argmax(g, axis=0)]

    def crossover(self, max_batch: int = 4096, mean_ctx: float = 0.0) -> Optional[int]:
        """First batch size from which plain decode is best for good (at that mean context per
        request)."""
        best = self.best(max_batch, mean_ctx)
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


def truth_with_ctx_crossovers(short: tuple[int, int] = (300, 76), long: tuple[int, int] = (6000, 14), *,
                              accept: Sequence[float] = (0.8, 0.7, 0.6), steps: int = 3,
                              off_base_ms: float = 6.0, off_slope_ms: float = 0.02,
                              off_ctx_ms: float = 1e-5, spec_base_extra_ms: float = 1.5) -> GroundTruth:
    """A truth whose chain is exactly as good as plain decode at batch `short[1]` when every request
    has `short[0]` tokens of context, and at batch `long[1]` with `long[0]` tokens: the crossover moves
    with the context, as on the H200 (plain decode's context cost `off_ctx_ms` per token; the chain's
    per-request and per-context-token slopes solved for)."""
    tau = 1.0 + float(np.cumprod(accept[:steps]).sum())
    a = off_base_ms + spec_base_extra_ms
    # at each (L, x): tau (a0 + k0 x + g0 L x) = a + k x + g L x, linear in (k, g)
    rows, rhs = [], []
    for L, cross in (short, long):
        x = float(cross) - 0.5
        rows.append([x, L * x])
        rhs.append(tau * (off_base_ms + off_slope_ms * x + off_ctx_ms * L * x) - a)
    k, g = np.linalg.solve(np.array(rows), np.array(rhs))
    if k <= 0 or g <= 0:
        raise ValueError(f"cannot place crossovers {short} and {long} with these costs")
    off = ConfigTruth((0, 1, 1), off_base_ms, off_slope_ms, per_ctx_token_ms=off_ctx_ms)
    spec = ConfigTruth((steps, 1, steps + 1), a, float(k), tuple(accept[:steps]), per_ctx_token_ms=float(g))
    return GroundTruth((off, spec))


def generate(truth: GroundTruth, *, num_steps: int, batch_sizes: Sequence[int], seed: int = 0,
             noise_cv: float = 0.03, server: str = "synth-0", t0: float = 1_764_441_600.0,
             dwell: int = 16, ctx_per_request: Optional[Sequence[int]] = None,
             ctx_phase_steps: int = 2000) -> Iterator[dict]:
    """Telemetry record dicts (docs/architecture.md form): configurations visited round-robin, each for
    `dwell` consecutive steps at one batch size (like an engine that switches now and then).

    `ctx_per_request` (optional): the traffic's mean context per request, phase after phase of
    `ctx_phase_steps` steps (e.g. [300, 6000]: alternating short and long prompts); each record then
    carries ctx_tokens (batch size x a mean within 20% of the phase's, from its own random stream:
    the records without it are what they always were)."""
    rng = np.random.default_rng(seed)
    ctx_rng = np.random.default_rng([seed, 7]) if ctx_per_request else None
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
            ctx = None
            if ctx_rng is not None:
                level = ctx_per_request[(it // ctx_phase_steps) % len(ctx_per_request)]  # type: ignore[index]
                ctx = int(round(b * level * ctx_rng.uniform(0.8, 1.2)))
            ms = float(ct.step_ms(b, ctx or 0)) * max(0.05, 1.0 + noise_cv * rng.standard_normal())
            rec = {"kind": "step", "schema": 1, "server": server, "rank": 0, "iter": it,
                   "ts": round(ts, 6), "batch_size": b,
                   "config": {"steps": steps, "topk": ct.config[1], "draft_tokens": ct.config[2]},
                   "step_ms": round(ms, 4)}
            if ctx is not None:
                rec["ctx_tokens"] = ctx
            if steps:
                u = rng.random((b, steps))
                ok = u < np.asarray(ct.accept[:steps])
                # chain: accepted = length of the leading run of successes
                acc = np.where(ok.all(axis=1), steps, np.argmin(ok, axis=1))
                rec["accepted"] = acc.tolist()
            yield rec
            ts += ms / 1000.0
            it += 1
