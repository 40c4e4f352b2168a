"""Discrete-event simulation of an SGLang-style continuous-batching decode loop with speculation.

Reads the cost-profile and workload files (docs/architecture.md); seeded, deterministic, numpy-vectorised.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from specctl.policies.table import OFF, Config, config_name

# the inputs' types and loaders, imported from here by the benches, the CLI and the tests
from .simfiles import (Phase, Profile, SimFileError, Workload, load_profile, load_workload,  # noqa: F401
                       parse_profile, parse_workload, shipped_names)


# ---------------------------------------------------------------------------------------------
# acceptance model


def accept_matrix(profile: Profile, workload: Workload) -> np.ndarray:
    """A[class, config, position]: per-position conditional acceptance; 0 where unusable.

    A class's `accept` is matched to a profile config by the profile's name for it, else by the
    canonical name (`s3`, `s2k4n8`). Positions a list leaves out accept nothing."""
    max_steps = max(1, max(c[0] for c in profile.configs))
    A = np.zeros((len(workload.classes), profile.num_configs, max_steps))
    for ci, cls in enumerate(workload.classes):
        for k, (name, cfg) in enumerate(zip(profile.config_names, profile.configs)):
            if cfg[0] == 0:
                continue
            rates = cls.accept.get(name, cls.accept.get(config_name(cfg)))
            if rates is None:
                continue
            n = min(len(rates), cfg[0])
            A[ci, k, :n] = rates[:n]
    return A


def expected_tau(A: np.ndarray) -> np.ndarray:
    """tau[class, config] = 1 + sum_i prod_{j<=i} a_j: expected tokens per request per step."""
    return 1.0 + np.cumprod(A, axis=2).sum(axis=2)


# ---------------------------------------------------------------------------------------------
# simulation


class SimPolicy(Protocol):
    """What the simulator drives. `decide` picks the configuration for this step's batch; `observe`
    sees what the engine would report after it. A policy with `uses_truth = True` is handed the true
    expected tokens per request of every profile config for the batch, each request's capped by the
    tokens it has left (the oracle): `decide_with_truth(batch_size, tau)`, and `ctx_tokens=` the
    batch's context where the profile has a context term. A policy with `uses_ctx = True` gets the
    batch's context tokens as `decide(batch_size, ctx_tokens=...)` and `observe(..., ctx_tokens=...)`
    where the workload or the profile has a context (the plugin's reading of it)."""

    name: str

    def decide(self, batch_size: int) -> Config: ...

    def observe(self, batch_size: int, config: Config, accepted: np.ndarray, step_ms: float,
                now_s: float) -> None: ...


@dataclass
class PhaseStats:
    name: str
    duration_s: float
    output_tokens: int = 0
    num_steps: int = 0
    batch_sum: int = 0
    tpot_ms: list = field(default_factory=list)
    config_steps: dict = field(default_factory=dict)  # config name -> steps used

    def summary(self) -> dict[str, Any]:
        tp = np.array(self.tpot_ms) if self.tpot_ms else None
        return {
            "name": self.name,
            "duration_s": self.duration_s,
            "output_tokens": int(self.output_tokens),
            "tokens_per_s": self.output_tokens / self.duration_s,
            "num_steps": int(self.num_steps),
            "mean_batch": self.batch_sum / self.num_steps if self.num_steps else 0.0,
            "mean_tpot_ms": float(tp.mean()) if tp is not None else None,
            "p99_tpot_ms": float(np.percentile(tp, 99)) if tp is not None else None,
            "num_finished": len(self.tpot_ms),
            "config_share": {k: v / self.num_steps for k, v in sorted(self.config_steps.items())}
            if self.num_steps else {},
        }


@dataclass
class SimResult:
    policy: str
    profile: str
    workload: str
    duration_s: float
    output_tokens: int
    num_steps: int
    tpot_ms: np.ndarray  # per finished request: decode time / output tokens
    phases: list[PhaseStats]
    trace_t: np.ndarray  # per step: start time (s)
    trace_bs: np.ndarray
    trace_cfg: np.ndarray  # config index
    trace_tokens: np.ndarray
    config_names: tuple[str, ...]
    config_steps: tuple[int, ...]
    wall_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s

    def summary(self) -> dict[str, Any]:
        tp = self.tpot_ms
        return {
            "policy": self.policy,
            "tokens_per_s": self.tokens_per_s,
            "output_tokens": int(self.output_tokens),
            "num_steps": int(self.num_steps),
            "mean_tpot_ms": float(tp.mean()) if len(tp) else None,
            "p99_tpot_ms": float(np.percentile(tp, 99)) if len(tp) else None,
            "num_finished": int(len(tp)),
            "phases": [p.summary() for p in self.phases],
            "wall_s": round(self.wall_s, 3),
        }


class _Requests:
    """The request stream of a workload. Request i draws the same uniforms under every policy
    (common random numbers: its class/length pair and its per-token draws come from streams
    indexed by i), so policies are compared on the same luck. Running requests hold a row of
    `U` (a slot); per-token draws are generated 64 requests at a time."""

    BLOCK = 64

    def __init__(self, workload: Workload, max_steps: int):
        self.workload = workload
        self.seed = workload.seed
        self.stride = max(c.output_tokens[1] for c in workload.classes) + max_steps + 1
        self.num_created = 0
        self._attr = np.empty((0, 2))
        self._block_i = -1
        self._block = np.empty((0, self.stride), dtype=np.float32)
        self.U = np.empty((self.BLOCK, self.stride), dtype=np.float32)
        self.free = list(range(self.BLOCK - 1, -1, -1))
        self.class_index = {c.name: i for i, c in enumerate(workload.classes)}
        self._mix_cache: dict[int, tuple[list[float], list[int]]] = {}
        self._prompt_i = -1
        self._prompt = np.empty(0)

    def create(self, phase: Phase) -> tuple[int, int, int, int]:
        """(class index, output tokens, slot, prompt tokens). Prompt lengths come from a stream of
        their own (workloads without them draw exactly what they always drew)."""
        i = self.num_created
        self.num_created += 1
        if i >= len(self._attr):
            n = max(1024, len(self._attr))
            more = np.random.default_rng([self.seed, 1, len(self._attr)]).random((n, 2))
            self._attr = np.concatenate([self._attr, more])
        u_cls, u_len = self._attr[i]
        cum, idx = self._mix_cache.get(id(phase)) or self._mix(phase)
        ci = idx[-1]
        for c, k in zip(cum, idx):
            if u_cls < c:
                ci = k
                break
        lo, hi = self.workload.classes[ci].output_tokens
        length = lo + min(int(u_len * (hi - lo + 1)), hi - lo)
        b = i // self.BLOCK
        if b != self._block_i:
            self._block = np.random.default_rng([self.seed, 2, b]).random((self.BLOCK, self.stride), dtype=np.float32)
            self._block_i = b
        if not self.free:
            old = len(self.U)
            self.U = np.concatenate([self.U, np.empty_like(self.U)])
            self.free = list(range(len(self.U) - 1, old - 1, -1))
        slot = self.free.pop()
        self.U[slot] = self._block[i % self.BLOCK]
        prompt = 0
        ct = self.workload.classes[ci].ctx_tokens
        if ct is not None:
            k = i // self.BLOCK
            if k != self._prompt_i:
                self._prompt = np.random.default_rng([self.seed, 5, k]).random(self.BLOCK)
                self._prompt_i = k
            prompt = ct[0] + min(int(self._prompt[i % self.BLOCK] * (ct[1] - ct[0] + 1)), ct[1] - ct[0])
        return ci, length, slot, prompt

    def _mix(self, phase: Phase) -> tuple[list[float], list[int]]:
        cum, idx, acc = [], [], 0.0
        for name, w in phase.mix.items():
            acc += w
            cum.append(acc)
            idx.append(self.class_index[name])
        self._mix_cache[id(phase)] = (cum, idx)
        return cum, idx

    def release(self, slots: Sequence[int]) -> None:
        self.free.extend(slots)


def simulate(profile: Profile, workload: Workload, policy: SimPolicy, *,
             seed: Optional[int] = None, on_step: Optional[Callable[[float, int, int, int], None]] = None,
             clock: Optional[Callable[[], float]] = None) -> SimResult:
    """Run one policy over the whole workload on virtual time and return its figures.

    `seed` overrides the workload's; `on_step(t_s, batch_size, config_index, tokens)` is called
    after every step (live displays); `clock`, if given, is a wall clock (seconds since start) the
    loop paces itself to: one virtual second per wall second (live mode)."""
    import time as _time

    if seed is not None:
        workload = Workload(workload.name, seed, workload.classes, workload.phases, workload.max_running)
    wall0 = _time.perf_counter()
    # the batch's context (prompt + tokens generated so far, every request): computed only where the
    # profile's step times or the workload's requests know it, and handed only to policies that read it
    use_ctx = profile.has_ctx or workload.has_ctx
    ctx_policy = use_ctx and bool(getattr(policy, "uses_ctx", False))
    ctx_truth = profile.has_ctx
    A = accept_matrix(profile, workload)
    tau = expected_tau(A)  # [class, config]
    max_steps = A.shape[2]
    n_cls = len(workload.classes)
    cfg_index = {c: i for i, c in enumerate(profile.configs)}
    cfg_steps = [int(c[0]) for c in profile.configs]
    A_by_cfg = [np.ascontiguousarray(A[:, k, : max(1, cfg_steps[k])]) for k in range(profile.num_configs)]
    uses_truth = bool(getattr(policy, "uses_truth", False))
    # CP[class, config, j] = sum_{i<=j} P(accepted >= i): E[min(1 + accepted, R)] = 1 + CP[.., min(s, R-1)]
    CP = np.concatenate([np.zeros(A.shape[:2] + (1,)), np.cumsum(np.cumprod(A, axis=2), axis=2)], axis=2)
    cfg_steps_ar = np.array(cfg_steps)
    cfg_ar = np.arange(profile.num_configs)
    reqs = _Requests(workload, max_steps)
    pos_ar = np.arange(max_steps)
    table = profile._table
    table_max = table.shape[1] - 1
    sigma = math.sqrt(math.log1p(profile.noise_cv ** 2)) if profile.noise_cv > 0 else 0.0
    noise_rng = np.random.default_rng([workload.seed, 3])
    noise_block: list[float] = []
    nb_i = 0

    # the running batch, as parallel arrays; `r_rem` = output tokens still to emit
    r_cls = np.empty(0, dtype=np.int64)
    r_len = np.empty(0, dtype=np.int64)
    r_rem = np.empty(0, dtype=np.int64)
    r_slot = np.empty(0, dtype=np.int64)
    r_ptr = np.empty(0, dtype=np.int64)  # flat index into reqs.U of each request's next draw
    r_t0 = np.empty(0, dtype=float)
    r_prompt = np.empty(0, dtype=np.int64)  # prompt tokens (0 without a context in the workload)
    ctx_tokens: Optional[int] = None
    queue: deque[tuple[int, int, int, int]] = deque()  # waiting for a running slot (max_running)
    cls_count = np.zeros(n_cls, dtype=np.int64)
    comp_version = 0  # bumped when the batch's class composition changes
    truth_key: tuple[int, int] = (-1, -1)
    truth_cfg: Config = OFF

    ends = [float(e) for e in np.cumsum([p.duration_s for p in workload.phases])]
    total_s = ends[-1]
    # open-loop arrivals per phase, from their own stream: the same under every policy
    arrivals: list[list[float]] = []
    for j, p in enumerate(workload.phases):
        start = ends[j] - p.duration_s
        if p.arrival_rate:
            rng = np.random.default_rng([workload.seed, 4, j])
            n_est = int(p.arrival_rate * p.duration_s * 1.5 + 20)
            t = start + np.cumsum(rng.exponential(1.0 / p.arrival_rate, n_est))
            while t[-1] < ends[j]:
                t = np.concatenate([t, t[-1] + np.cumsum(rng.exponential(1.0 / p.arrival_rate, n_est))])
            arrivals.append([float(x) for x in t[t < ends[j]]])
        else:
            arrivals.append([])
    arr_j, arr_k = 0, 0

    tr_t: list[float] = []
    tr_bs: list[int] = []
    tr_cfg: list[int] = []
    tr_tok: list[int] = []
    fin_t: list[float] = []
    fin_tpot: list[float] = []
    now = 0.0
    phase_j = 0
    last_phase = len(ends) - 1
    in_system = 0  # running + queued
    max_running = workload.max_running or (1 << 30)
    total_tokens = 0
    new: list[tuple[int, int, int, int]] = []

    while now < total_s:
        while phase_j < last_phase and now >= ends[phase_j]:
            phase_j += 1
        phase = workload.phases[phase_j]
        # arrivals: open-loop events up to now; closed loop tops up to its concurrency
        while arr_j <= phase_j:
            arr = arrivals[arr_j]
            if arr_k < len(arr) and (arr_j < phase_j or arr[arr_k] <= now):
                queue.append(reqs.create(workload.phases[arr_j]))
                in_system += 1
                arr_k += 1
            elif arr_j < phase_j:
                arr_j += 1
                arr_k = 0
            else:
                break
        if phase.concurrency is not None:
            while in_system < phase.concurrency:
                queue.append(reqs.create(phase))
                in_system += 1
        if queue:
            running = len(r_cls)
            while queue and running < max_running:
                new.append(queue.popleft())
                running += 1
            if new:
                nc = np.array([x[0] for x in new], dtype=np.int64)
                nl = np.array([x[1] for x in new], dtype=np.int64)
                r_cls = np.concatenate([r_cls, nc])
                r_len = np.concatenate([r_len, nl])
                r_rem = np.concatenate([r_rem, nl])
                ns = np.array([x[2] for x in new], dtype=np.int64)
                r_slot = np.concatenate([r_slot, ns])
                r_ptr = np.concatenate([r_ptr, ns * reqs.stride])
                r_t0 = np.concatenate([r_t0, np.full(len(new), now)])
                if use_ctx:
                    r_prompt = np.concatenate([r_prompt, np.array([x[3] for x in new], dtype=np.int64)])
                cls_count += np.bincount(nc, minlength=n_cls)
                comp_version += 1
                new.clear()
        bs = len(r_cls)
        if bs == 0:
            # idle: jump to the next arrival or the next phase boundary (both lie after `now`)
            nxt = ends[phase_j]
            if arr_j == phase_j and arr_k < len(arrivals[phase_j]):
                nxt = min(nxt, arrivals[phase_j][arr_k])
            now = max(nxt, now)
            continue

        if use_ctx:
            ctx_tokens = int(r_prompt.sum() + (r_len - r_rem).sum())
        if uses_truth and ctx_truth:
            # step times move with the context at every step: no caching by composition
            m = np.minimum(cfg_steps_ar, (r_rem - 1)[:, None])
            config = policy.decide_with_truth(bs, 1.0 + CP[r_cls[:, None], cfg_ar, m].mean(axis=0),  # type: ignore[attr-defined]
                                              ctx_tokens=ctx_tokens)
        elif uses_truth and r_rem.min() <= max_steps:
            # some request cannot use every draft position: its truth is capped by what it has left
            m = np.minimum(cfg_steps_ar, (r_rem - 1)[:, None])
            config = policy.decide_with_truth(bs, 1.0 + CP[r_cls[:, None], cfg_ar, m].mean(axis=0))  # type: ignore[attr-defined]
            truth_key = (-1, -1)
        elif uses_truth:
            # a truth-using policy is a pure function of (batch size, composition): ask on change
            if truth_key != (bs, comp_version):
                truth_key = (bs, comp_version)
                truth_cfg = policy.decide_with_truth(bs, cls_count @ tau / bs)  # type: ignore[attr-defined]
            config = truth_cfg
        elif ctx_policy:
            config = policy.decide(bs, ctx_tokens=ctx_tokens)  # type: ignore[call-arg]
        else:
            config = policy.decide(bs)
        k = cfg_index.get(config)
        if k is None:
            raise SimFileError(f"policy {policy.name!r} chose configuration {config} "
                               f"({config_name(config)}), which profile {profile.name!r} does not measure; "
                               f"it has {', '.join(profile.config_names)}")
        s = cfg_steps[k]
        if s > 0:
            ok = reqs.U.ravel()[r_ptr[:, None] + pos_ar[:s]] < A_by_cfg[k][r_cls]
            accepted = ok.cumprod(axis=1).sum(axis=1)
            emitted = np.minimum(accepted + 1, r_rem)
            toks = int(emitted.sum())
        else:
            accepted = np.zeros(bs, dtype=np.int64)
            emitted = 1
            toks = bs
        if ctx_truth:
            ms = profile.step_ms_ctx(k, bs, ctx_tokens / bs)  # type: ignore[operator]
        else:
            ms = float(table[k, bs]) if bs <= table_max else profile.step_ms(k, bs)
        if sigma > 0:
            if nb_i >= len(noise_block):
                noise_block = noise_rng.lognormal(-0.5 * sigma * sigma, sigma, 8192).tolist()
                nb_i = 0
            ms *= noise_block[nb_i]
            nb_i += 1
        tr_t.append(now)
        tr_bs.append(bs)
        tr_cfg.append(k)
        tr_tok.append(toks)
        total_tokens += toks
        now += ms / 1000.0
        if ctx_policy:
            policy.observe(bs, config, accepted, ms, now, ctx_tokens=ctx_tokens)  # type: ignore[call-arg]
        else:
            policy.observe(bs, config, accepted, ms, now)
        if on_step is not None:
            on_step(now, bs, k, toks)
        if clock is not None:
            lag = now - clock()
            if lag > 0:
                _time.sleep(lag)
        r_rem = r_rem - emitted
        r_ptr = r_ptr + emitted
        if r_rem.min() <= 0:
            done = r_rem <= 0
            nd = int(done.sum())
            fin_t.extend([now] * nd)
            fin_tpot.extend(((now - r_t0[done]) * 1000.0 / r_len[done]).tolist())
            cls_count -= np.bincount(r_cls[done], minlength=n_cls)
            comp_version += 1
            reqs.release(r_slot[done].tolist())
            keep = ~done
            r_cls, r_len, r_rem, r_slot, r_t0 = r_cls[keep], r_len[keep], r_rem[keep], r_slot[keep], r_t0[keep]
            r_ptr = r_ptr[keep]
            if use_ctx:
                r_prompt = r_prompt[keep]
            in_system -= nd

    trace_t = np.array(tr_t)
    trace_bs = np.array(tr_bs, dtype=np.int32)
    trace_cfg = np.array(tr_cfg, dtype=np.int16)
    trace_tok = np.array(tr_tok, dtype=np.int64)
    phases = _phase_stats(workload, ends, profile.config_names, trace_t, trace_bs, trace_cfg, trace_tok,
                          np.array(fin_t), np.array(fin_tpot))
    return SimResult(
        policy=policy.name, profile=profile.name, workload=workload.name, duration_s=total_s,
        output_tokens=total_tokens, num_steps=len(tr_t), tpot_ms=np.array(fin_tpot), phases=phases,
        trace_t=trace_t, trace_bs=trace_bs, trace_cfg=trace_cfg, trace_tokens=trace_tok,
        config_names=profile.config_names, config_steps=tuple(cfg_steps),
        wall_s=_time.perf_counter() - wall0)


def _phase_stats(workload: Workload, ends: list[float], config_names: Sequence[str], t: np.ndarray,
                 bs: np.ndarray, cfg: np.ndarray, tok: np.ndarray, fin_t: np.ndarray,
                 fin_tpot: np.ndarray) -> list[PhaseStats]:
    """Per phase, from the step trace: a step belongs to the phase it started in; a request's
    TPOT to the phase it finished in."""
    ph = np.minimum(np.searchsorted(ends, t, side="right"), len(ends) - 1)
    fph = np.minimum(np.searchsorted(ends, fin_t, side="right"), len(ends) - 1) if len(fin_t) else fin_t
    out = []
    for j, p in enumerate(workload.phases):
        m = ph == j
        st = PhaseStats(p.name, p.duration_s, output_tokens=int(tok[m].sum()), num_steps=int(m.sum()),
                        batch_sum=int(bs[m].sum()))
        st.tpot_ms = fin_tpot[fph == j].tolist() if len(fin_t) else []
        counts = np.bincount(cfg[m], minlength=len(config_names))
        st.config_steps = {config_names[i]: int(n) for i, n in enumerate(counts) if n}
        out.append(st)
    return out
