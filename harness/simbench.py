"""`specctl bench sim`: every policy on one seeded workload, the searched best static and threshold
baselines, the oracle ratio, a JSON record and a plot; plus `adaptive` — the real engine-side
controller fed by the real daemon service, on the simulator's clock or over live ZeroMQ.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..policies.baselines import PolicyName, build_baseline, parse_policy_name
from ..policies.table import OFF, Config, config_name
from ..training.simulator import Phase, Profile, SimResult, Workload, simulate

SEARCH_THRESHOLDS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 192, 256)


# ---------------------------------------------------------------------------------------------
# adaptive: EngineController + ControllerService wired through the same frame bytes as the sockets


def _chains(profile: Profile) -> dict[int, Config]:
    return {c[0]: c for c in profile.configs if c[1] == 1}


def _fallback_config(profile: Profile) -> Config:
    spec = sorted(s for s in _chains(profile) if s > 0)
    if not spec:
        return OFF
    lower = [s for s in spec if s <= 3]
    return _chains(profile)[lower[-1] if lower else spec[0]]


class AdaptivePolicy:
    """`adaptive`: the plugin's EngineController deciding, the daemon's ControllerService learning,
    in-process on virtual time. Telemetry leaves the engine as the frame bytes it would PUSH; the
    service's published policies come back as the frame bytes it would PUB; the service ticks every
    `tick_s` (the daemon's poll period). The batch's context, where the simulator knows it, reaches
    the engine's decision and its telemetry as the plugin's reading of it does."""

    uses_truth = False
    uses_ctx = True

    def __init__(self, profile: Profile, *, name: str = "adaptive", tick_s: float = 0.05,
                 service_overrides: Optional[dict[str, Any]] = None,
                 plugin_overrides: Optional[dict[str, Any]] = None):
        from ..controller import wire
        from ..controller.service import ControllerService, ServiceSettings
        from ..plugin.engine import EngineController, PluginSettings

        self.name = name
        self._wire = wire
        self.now = 0.0
        self.tick_s = tick_s
        self._next_tick = 0.0
        self._iter = 0
        chains = _chains(profile)
        self._config_for_steps = chains
        fb = _fallback_config(profile)
        self.service = ControllerService(
            ServiceSettings(candidates=tuple(chains.values()), fixed_config=fb, **(service_overrides or {})),
            clock=self._clock)
        self.engine = EngineController(
            PluginSettings(mode="online", telemetry_endpoint="sim://", policy_endpoint="sim://",
                           fallback_config=fb, **(plugin_overrides or {})),
            candidate_steps=chains.keys(), clock=self._clock)
        self.num_policies = 0
        self.versions: list[tuple[float, int]] = []
        self.offset_s = 0.0  # virtual time already served before this workload (warm_up)
        self.warm_s = 0.0
        self._tick()

    def warm_up(self, profile: Profile, workload: Workload, seconds: float, *, seed: Optional[int] = None) -> None:
        """Serve `seconds` of other traffic first, on the same engine and daemon, as a server that
        was already running (or a daemon restarted on its state dir) would have: `calibration_workload`
        (a concurrency sweep with an even class mix, its own seed); the measured run's clock then
        continues from there."""
        if seconds <= 0:
            return
        cal = calibration_workload(workload, seconds, seed=(workload.seed if seed is None else seed) + 1000)
        simulate(profile, cal, self)
        self.offset_s = self.now
        self.warm_s = seconds

    def _clock(self) -> float:
        return self.now

    def _tick(self) -> None:
        pol = self.service.tick()
        if pol is not None:
            self.engine.offer_policy_frame(self._wire.encode(pol))
            if not self.versions or self.versions[-1][1] != pol.version:
                self.versions.append((self.now, pol.version))
        self._next_tick = self.now + self.tick_s

    def decide(self, batch_size: int, ctx_tokens: Optional[int] = None) -> Config:
        return self._config_for_steps[self.engine.decide(batch_size, ctx_tokens)]

    def observe(self, batch_size: int, config: Config, accepted: Any, step_ms: float, now_s: float,
                ctx_tokens: Optional[int] = None) -> None:
        now_s += self.offset_s
        self.now = now_s
        frame = self.engine.step_record(
            iter=self._iter, ts=now_s, batch_size=batch_size, draft_tokens=config[2],
            accepted=accepted.tolist() if config[0] > 0 else None, step_ms=step_ms, ctx_tokens=ctx_tokens)
        self._iter += 1
        self.service.observe_frame(frame)
        if self.engine.note_result():
            self.engine.sync(None)
        if now_s >= self._next_tick:
            self._tick()


class LiveAdaptivePolicy:
    """`adaptive` against a running `specctl serve`: telemetry PUSHed, policies SUBscribed, on the
    wall clock (the simulator paces itself to it)."""

    uses_truth = False
    uses_ctx = True

    def __init__(self, profile: Profile, telemetry_endpoint: str, policy_endpoint: str, *,
                 name: str = "adaptive-live", clock: Callable[[], float] = time.time,
                 on_policy: Optional[Callable[[Any], None]] = None):
        import zmq

        from ..controller import transport, wire
        from ..plugin.engine import EngineController, PluginSettings

        self.name = name
        self._wire = wire
        self._clock = clock
        chains = _chains(profile)
        self._config_for_steps = chains
        self._ctx = zmq.Context()
        self.sender = transport.TelemetrySender(self._ctx, telemetry_endpoint)
        self.receiver = transport.PolicyReceiver(self._ctx, policy_endpoint)
        self.engine = EngineController(
            PluginSettings(mode="online", telemetry_endpoint=telemetry_endpoint,
                           policy_endpoint=policy_endpoint, fallback_config=_fallback_config(profile)),
            candidate_steps=chains.keys(), clock=clock)
        self.on_policy = on_policy
        self._iter = 0
        self.num_frames = 0

    def decide(self, batch_size: int, ctx_tokens: Optional[int] = None) -> Config:
        return self._config_for_steps[self.engine.decide(batch_size, ctx_tokens)]

    def observe(self, batch_size: int, config: Config, accepted: Any, step_ms: float, now_s: float,
                ctx_tokens: Optional[int] = None) -> None:
        frame = self.engine.step_record(
            iter=self._iter, ts=self._clock(), batch_size=batch_size, draft_tokens=config[2],
            accepted=accepted.tolist() if config[0] > 0 else None, step_ms=step_ms, ctx_tokens=ctx_tokens)
        self._iter += 1
        self.sender.send(frame)
        pol = self.receiver.poll()
        if pol is not None:
            self.num_frames += 1
            self.engine.offer_policy_frame(pol)
            if self.on_policy is not None:
                try:
                    self.on_policy(self._wire.decode_policy(pol))
                except self._wire.WireError:
                    pass
        if self.engine.note_result():
            self.engine.sync(None)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        self._ctx.term()


# ---------------------------------------------------------------------------------------------
# policies by name


WARM_OPTION = "warm_s"  # adaptive:warm_s=N: N s of calibration traffic served before the workload


def make_policy(name: str | PolicyName, profile: Profile, workload: Optional[Workload] = None,
                seed: Optional[int] = None) -> Any:
    pn = parse_policy_name(name) if isinstance(name, str) else name
    if pn.kind == "adaptive":
        opts = dict(pn.options)
        warm = opts.pop(WARM_OPTION, None)
        pol = AdaptivePolicy(profile, name=str(pn), service_overrides=service_overrides(tuple(opts.items())))
        if warm is not None:
            try:
                warm_s = float(warm)
            except ValueError:
                raise ValueError(f"adaptive option {WARM_OPTION}={warm!r}: expected seconds") from None
            if not warm_s > 0 or workload is None:
                raise ValueError(f"adaptive option {WARM_OPTION} needs seconds > 0 and a workload")
            pol.warm_up(profile, workload, warm_s, seed=seed)
        return pol
    return build_baseline(pn, profile.config_names, profile.configs, profile.step_ms_all,
                          profile.step_ms_all_ctx if profile.has_ctx else None)


def calibration_workload(workload: Workload, seconds: float, *, seed: int) -> Workload:
    """Traffic an already-running server would have served: the workload's request classes, mixed
    evenly, at concurrencies 1, 2, 4, ... up to the workload's peak, equal time at each."""
    peak = max([p.concurrency or 0 for p in workload.phases] + [workload.max_running or 0, 1])
    if all(p.concurrency is None for p in workload.phases):  # open loop: concurrency ~ peak rate x latency
        peak = max(peak, 64)
    levels = [1]
    while levels[-1] * 2 <= peak:
        levels.append(levels[-1] * 2)
    if levels[-1] < peak:
        levels.append(peak)
    mix = {c.name: 1.0 for c in workload.classes}
    phases = tuple(Phase(duration_s=seconds / len(levels), mix=mix, concurrency=c, name=f"cal-c{c}") for c in levels)
    return Workload(f"calibration-for-{workload.name}", seed, workload.classes, phases, workload.max_running)


def service_overrides(options: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """`adaptive:key=value` options as typed ServiceSettings fields."""
    import dataclasses

    from ..controller.service import ServiceSettings

    fields = {f.name: f for f in dataclasses.fields(ServiceSettings)}
    out: dict[str, Any] = {}
    for k, v in options:
        f = fields.get(k)
        if f is None or k in ("candidates", "fixed_config", "mode"):
            allowed = sorted([n for n in fields if n not in ("candidates", "fixed_config", "mode")] + [WARM_OPTION])
            raise ValueError(f"adaptive option {k!r} is not a controller setting; one of: {', '.join(allowed)}")
        default = f.default
        try:
            out[k] = type(default)(v) if default is not None and not isinstance(default, bool) else (
                v.lower() in ("1", "true", "yes") if isinstance(default, bool) else float(v))
        except ValueError:
            raise ValueError(f"adaptive option {k}={v!r}: expected a {type(default).__name__}") from None
    return out


def default_policy_names(profile: Profile) -> list[str]:
    """off, every static config, sglang-ema, adaptive, oracle (searched baselines are added apart)."""
    names = ["off"] if profile.off_index is not None else []
    names += [f"static:{n}" for n, c in zip(profile.config_names, profile.configs) if c[0] > 0]
    names += ["sglang-ema", "adaptive", "oracle"]
    return names


def _run_one(args: tuple[str, Profile, Workload, Optional[int]]) -> SimResult:
    name, profile, workload, seed = args
    return simulate(profile, workload, make_policy(name, profile, workload, seed), seed=seed)


def run_many(names: Sequence[str], profile: Profile, workload: Workload, *, seed: Optional[int] = None,
             jobs: int = 1) -> list[SimResult]:
    for n in names:
        pn = parse_policy_name(n)  # fail on a bad name before any simulation
        if pn.kind in ("static", "threshold", "off"):
            make_policy(pn, profile)
        elif pn.kind == "adaptive":
            service_overrides(tuple((k, v) for k, v in pn.options if k != WARM_OPTION))
    work = [(n, profile, workload, seed) for n in names]
    if jobs > 1 and len(work) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as ex:
            return list(ex.map(_run_one, work))
    return [_run_one(w) for w in work]


@dataclass
class SearchResult:
    best_static: Optional[SimResult]
    best_threshold: Optional[SimResult]
    num_simulated: int


def search_baselines(profile: Profile, workload: Workload, known: dict[str, SimResult], *,
                     seed: Optional[int] = None, jobs: int = 1) -> SearchResult:
    """Best single static config (off included) and best `threshold:N:config` by simulation.

    Thresholds are only distinct where N falls inside the batch sizes the workload reaches
    (elsewhere they equal off or a static), so N is searched over SEARCH_THRESHOLDS inside that
    range, for the two best speculative statics."""
    statics = [n for n in default_policy_names(profile) if n == "off" or n.startswith("static:")]
    todo = [n for n in statics if n not in known]
    done = dict(known)
    for n, r in zip(todo, run_many(todo, profile, workload, seed=seed, jobs=jobs)):
        done[n] = r
    ran = len(todo)
    best_static = max((done[n] for n in statics), key=lambda r: r.tokens_per_s, default=None)
    best_thr = None
    if profile.off_index is not None:
        bs = np.concatenate([r.trace_bs for r in done.values() if len(r.trace_bs)]) if done else np.array([1])
        lo, hi = int(bs.min()), int(bs.max())
        spec = sorted((n for n in statics if n != "off"), key=lambda n: -done[n].tokens_per_s)[:2]
        cands = [f"threshold:{N}:{n.split(':', 1)[1]}" for n in spec for N in SEARCH_THRESHOLDS if lo < N <= hi]
        cands = [c for c in cands if c not in done]
        for n, r in zip(cands, run_many(cands, profile, workload, seed=seed, jobs=jobs)):
            done[n] = r
        ran += len(cands)
        # a threshold at or below the smallest batch is `off`; above the largest, the static
        pool = [r for n, r in done.items() if n.startswith("threshold:")]
        pool += [_relabel(done[n], f"threshold:{hi + 1}:{n.split(':', 1)[1]}") for n in spec]
        if "off" in done:
            pool.append(_relabel(done["off"], f"threshold:1:{spec[0].split(':', 1)[1]}" if spec else "off"))
        best_thr = max(pool, key=lambda r: r.tokens_per_s, default=None)
    return SearchResult(best_static, best_thr, ran)


def _relabel(r: SimResult, name: str) -> SimResult:
    return replace(r, policy=name)


# ---------------------------------------------------------------------------------------------
# the benchmark


@dataclass
class BenchReport:
    profile: str
    workload: str
    seed: int
    results: list[SimResult]
    labels: list[str]  # what each result is (e.g. "best static" for a searched one)
    num_simulated: int
    wall_s: float
    open_loop: bool = False

    def oracle(self) -> Optional[SimResult]:
        return next((r for r in self.results if r.policy == "oracle"), None)

    def to_obj(self) -> dict[str, Any]:
        orc = self.oracle()
        out = []
        for r, label in zip(self.results, self.labels):
            s = r.summary()
            s["oracle_ratio"] = r.tokens_per_s / orc.tokens_per_s if orc else None
            if label:
                s["label"] = label
            if orc:
                for ph, oph in zip(s["phases"], orc.summary()["phases"]):
                    ph["oracle_ratio"] = ph["tokens_per_s"] / oph["tokens_per_s"] if oph["tokens_per_s"] else None
            out.append(s)
        return {"kind": "bench-sim", "profile": self.profile, "workload": self.workload, "seed": self.seed,
                "num_simulated": self.num_simulated, "wall_s": round(self.wall_s, 2), "results": out}


def run_bench(profile: Profile, workload: Workload, policies: Optional[Sequence[str]] = None, *,
              seed: Optional[int] = None, search: Optional[bool] = None, jobs: int = 1,
              progress: Optional[Callable[[str], None]] = None) -> BenchReport:
    """Run the named policies (default: all, plus the searched best static and best threshold);
    the oracle is always run, as the ratio's denominator."""
    t0 = time.perf_counter()
    names = list(policies) if policies else default_policy_names(profile)
    if "oracle" not in names:
        names.append("oracle")
    search = (not policies) if search is None else search
    if progress:
        progress(f"simulating {len(names)} policies on {workload.name} / {profile.name}")
    res = run_many(names, profile, workload, seed=seed, jobs=jobs)
    by_name = dict(zip(names, res))
    labels = [""] * len(res)
    n_sim = len(res)
    if search:
        if progress:
            progress("searching the best static configuration and the best tuned threshold")
        sr = search_baselines(profile, workload, by_name, seed=seed, jobs=jobs)
        n_sim += sr.num_simulated
        if sr.best_static is not None:
            res.append(_relabel(sr.best_static, f"best-static={sr.best_static.policy}"))
            labels.append("best static config (search)")
        if sr.best_threshold is not None:
            res.append(_relabel(sr.best_threshold, f"best-threshold={sr.best_threshold.policy}"))
            labels.append("best tuned threshold (search)")
    return BenchReport(profile.name, workload.name, workload.seed if seed is None else seed, res, labels,
                       n_sim, time.perf_counter() - t0,
                       open_loop=any(p.arrival_rate is not None for p in workload.phases))


def format_report(rep: BenchReport) -> str:
    obj = rep.to_obj()
    rows = obj["results"]
    w = max(12, max(len(r["policy"]) for r in rows))
    lines = [f"profile {rep.profile} · workload {rep.workload} · seed {rep.seed} · "
             f"{rep.num_simulated} simulations in {rep.wall_s:.1f} s", ""]
    hdr = f"{'policy':<{w}}  {'tok/s':>9}  {'x oracle':>8}  {'TPOT ms':>8}  {'p99 ms':>8}"
    lines += [hdr, "-" * len(hdr)]

    def f(x: Optional[float], fmt: str) -> str:
        return format(x, fmt) if x is not None else "-"

    for r in rows:
        lines.append(f"{r['policy']:<{w}}  {r['tokens_per_s']:>9.1f}  {f(r['oracle_ratio'], '.3f'):>8}  "
                     f"{f(r['mean_tpot_ms'], '.2f'):>8}  {f(r['p99_tpot_ms'], '.2f'):>8}")
    by = {r["policy"]: r for r in rows}
    bs = next((r for r in rows if r["policy"].startswith("best-static=")), None)
    bt = next((r for r in rows if r["policy"].startswith("best-threshold=")), None)
    for a in (r for r in rows if r["policy"].startswith("adaptive")):
        parts = []
        for label, ref in (("oracle", by.get("oracle")), ("best static", bs), ("best threshold", bt),
                           ("sglang-ema", by.get("sglang-ema"))):
            if ref is not None and ref["tokens_per_s"] > 0:
                parts.append(f"{a['tokens_per_s'] / ref['tokens_per_s']:.3f}x {label}")
        if parts:
            lines.append(f"{a['policy']}: " + ", ".join(parts))
    if rep.open_loop:
        lines.append("(open-loop phases: while the engine keeps up, tokens/s is the offered load for every "
                     "policy; compare TPOT)")
    phases = rows[0]["phases"]
    if len(phases) > 1:
        lines += ["", "per phase: tok/s (x oracle)"]
        pw = 16
        lines.append(f"{'policy':<{w}}  " + "  ".join(f"{p['name'][:pw]:>{pw}}" for p in phases))
        for r in rows:
            cells = [f"{p['tokens_per_s']:.0f} ({f(p.get('oracle_ratio'), '.2f')})" for p in r["phases"]]
            lines.append(f"{r['policy']:<{w}}  " + "  ".join(f"{c:>{pw}}" for c in cells))
    return "\n".join(lines)


def _verdict_refs(rep: BenchReport, operator: str) -> list[tuple[str, str, SimResult]]:
    """(key, words, result) of each reference present: the operator's policy, sglang-ema, off, the
    best static (the best of `off` and the `static:*` rows present) and the oracle."""
    by = {r.policy: r for r in rep.results}
    statics = [r for r in rep.results if r.policy == "off" or r.policy.startswith("static:")]
    best = max(statics, key=lambda r: r.tokens_per_s, default=None)
    refs = [("operator", f"the operator's {operator}", by.get(operator)),
            ("sglang-ema", "sglang-ema", by.get("sglang-ema")), ("off", "off", by.get("off")),
            ("best-static", f"the best static ({best.policy})" if best else "", best),
            ("oracle", "the oracle", by.get("oracle"))]
    return [(k, words, r) for k, words, r in refs if r is not None and r.tokens_per_s > 0]


def verdict(rep: BenchReport, subject: str, operator: str, label: Optional[str] = None) -> str:
    """One line: `subject`'s tokens/s as a ratio of the operator's policy, sglang-ema, off, the best
    static (the best of `off` and the `static:*` rows present) and the oracle, whichever are present;
    `label` names the subject (default: its policy name)."""
    me = next(r for r in rep.results if r.policy == subject)
    parts = [f"{me.tokens_per_s / r.tokens_per_s:.3f}x {words}" for _, words, r in _verdict_refs(rep, operator)]
    return f"verdict: {label or subject} {me.tokens_per_s:.1f} tok/s = " + ", ".join(parts)


_READER_WORDS = {"sglang-ema": "SGLang's adaptive", "off": "off (no speculation)"}
_READER_ORDER = ("operator", "off", "sglang-ema", "best-static", "oracle")


def verdict_lines(rep: BenchReport, subject: str, operator: str, name: str = "specctl") -> tuple[str, str]:
    """The verdict for a reader: the headline (`subject` against the operator's policy, or the first
    reference present) and the other ratios on a second line."""
    me = next(r for r in rep.results if r.policy == subject)
    refs = sorted(_verdict_refs(rep, operator), key=lambda ref: _READER_ORDER.index(ref[0]))
    if not refs:
        return f"{name} {me.tokens_per_s:.1f} tok/s", ""
    ratios: list[str] = []
    for i, (k, words, r) in enumerate(refs):
        if any(r is other for _, _, other in refs[:i]):
            continue  # the best static is `off`, or the operator's policy is: said once
        words = _READER_WORDS.get(k, words)
        if k == "off" and any(k2 == "best-static" and r2 is r for k2, _, r2 in refs):
            words = "off (no speculation, the best static)"
        ratios.append(f"{me.tokens_per_s / r.tokens_per_s:.3f}x {words}")
    return f"{name} {me.tokens_per_s:.1f} tok/s = {ratios[0]}", " · ".join(ratios[1:])


def _config_words(cfg: str) -> str:
    if cfg.lower() == "off":
        return "plain decode"
    if cfg[:1] == "s" and cfg[1:].isdigit():
        return f"{cfg[1:]} draft step{'s' if cfg[1:] != '1' else ''} ({cfg})"
    return cfg


def describe_policy(name: str) -> str:
    """A plot legend's words for a policy name."""
    pn = name.split("=", 1)[1] if name.startswith(("best-static=", "best-threshold=")) else name
    head, _, rest = pn.partition(":")
    if head == "off":
        text = "off: plain decode (no speculation)"
    elif head == "static":
        text = f"static:{rest}: always {_config_words(rest)}"
    elif head == "threshold":
        n, _, cfg = rest.partition(":")
        text = f"threshold:{n}:{cfg}: {_config_words(cfg)} below batch {n}, plain decode from {n}"
    elif head == "sglang-ema":
        text = "sglang-ema: SGLang's built-in --speculative-adaptive"
    elif head == "oracle":
        text = "oracle: best config each step, knowing true acceptance"
    elif name == "adaptive-live":
        text = "specctl live: engine + `specctl serve` over ZeroMQ"
    elif head == "adaptive":
        text = f"specctl ({name}) on the virtual clock"
    else:
        text = name
    if name.startswith("best-static="):
        text = "best static = " + text
    elif name.startswith("best-threshold="):
        text = "best threshold = " + text
    return text


def write_json(rep: BenchReport, path: str | Path, extra: Optional[dict[str, Any]] = None) -> None:
    obj = rep.to_obj()
    if extra:
        obj.update(extra)
    Path(path).write_text(json.dumps(obj, indent=1) + "\n")


# colours by role; the batch's is one no policy uses (Okabe-Ito, readable with colour blindness)
_SUBJECT_COLOUR = "black"
_THRESHOLD_COLOUR = "#D55E00"
_SGLANG_COLOUR = "#0072B2"
_OFF_COLOUR = "#009E73"
_ORACLE_COLOUR = "#9a9a9a"
_BATCH_COLOUR = "#CC79A7"
_PHASE_SHADE = "#ececec"


def _binned(r: SimResult, edges: np.ndarray, values: np.ndarray, *, rate: bool) -> np.ndarray:
    n = len(edges) - 1
    idx = np.clip(np.searchsorted(edges, r.trace_t, side="right") - 1, 0, n - 1)
    total = np.bincount(idx, weights=values, minlength=n)
    if rate:
        return total / (edges[1] - edges[0])
    cnt = np.bincount(idx, minlength=n)
    return np.where(cnt > 0, total / np.maximum(cnt, 1), np.nan)


def _phase_words(phase: Phase) -> str:
    classes = "+".join(sorted(phase.mix, key=lambda c: -phase.mix[c]))
    load = (f"{phase.concurrency} at a time" if phase.concurrency is not None
            else f"{phase.arrival_rate:g} req/s" if phase.arrival_rate is not None else "")
    return f"{classes}, {load}" if load else classes


def plot(results: Sequence[SimResult], path: str | Path, title: str = "", subtitle: str = "", *,
         ratios: str = "", operator: Optional[str] = None, workload: Optional[Workload] = None) -> None:
    """`figure` written to `path` as a PNG."""
    fig = figure(results, title, subtitle, ratios=ratios, operator=operator, workload=workload)
    import matplotlib.pyplot as plt

    fig.savefig(str(path), dpi=100, bbox_inches="tight")
    plt.close(fig)


def figure(results: Sequence[SimResult], title: str = "", subtitle: str = "", *, ratios: str = "",
           operator: Optional[str] = None, workload: Optional[Workload] = None) -> Any:
    """One page a newcomer reads: `title` (the verdict) large, then `ratios` and `subtitle`; over the
    workload's time, with its phases shaded, the throughput of specctl (its live run if there is one),
    the operator's threshold (`operator`, else the best searched threshold), sglang-ema, off and the
    oracle; the decisions of specctl and that threshold; the running batch of specctl's run. Beside
    the throughput, every policy's whole-run tokens/s, ranked."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install 'specctl[plot]'") from None
    if not results:
        raise ValueError("nothing to plot")
    by = {r.policy: r for r in results}
    subject = by.get("adaptive-live") or next((r for r in results if r.policy.startswith("adaptive")), results[0])
    threshold = by.get(operator) if operator else next(
        (r for r in results if r.policy.startswith(("best-threshold=", "threshold:"))), None)
    # (result, legend words, style), drawn in this order: the subject last, on top
    lines = [(by.get("oracle"), "oracle: the best configuration every step, knowing true acceptance (a ceiling)",
              {"color": _ORACLE_COLOUR, "lw": 1.4, "ls": "--"}),
             (by.get("off"), "off: plain decode, never speculate", {"color": _OFF_COLOUR, "lw": 1.6}),
             (by.get("sglang-ema"), "SGLang's adaptive (sglang-ema): --speculative-adaptive",
              {"color": _SGLANG_COLOUR, "lw": 1.6}),
             (threshold, (f"the operator's {describe_policy(operator)}" if threshold is not None and operator
                          else describe_policy(threshold.policy) if threshold is not None else ""),
              {"color": _THRESHOLD_COLOUR, "lw": 2.0}),
             (subject, "specctl" + (" live: engine + `specctl serve` over ZeroMQ" if subject.policy == "adaptive-live"
                                    else f" ({subject.policy})" if subject.policy.startswith("adaptive")
                                    else f": {subject.policy}"),
              {"color": _SUBJECT_COLOUR, "lw": 2.8})]
    lines = [(r, words, style) for r, words, style in lines if r is not None]
    lines = [x for i, x in enumerate(lines) if all(x[0] is not y[0] for y in lines[i + 1:])]

    dur = subject.duration_s
    nbins = int(min(240, max(20, dur / 2)))
    edges = np.linspace(0.0, dur, nbins + 1)
    mid = 0.5 * (edges[1:] + edges[:-1])

    fig = plt.figure(figsize=(15, 10.5))
    gs = fig.add_gridspec(3, 2, width_ratios=[3.3, 1], height_ratios=[3, 1.7, 1.2], hspace=0.36, wspace=0.05)
    ax1 = fig.add_subplot(gs[0, 0])
    ax2 = fig.add_subplot(gs[1, 0], sharex=ax1)
    ax3 = fig.add_subplot(gs[2, 0], sharex=ax1)
    key_ax = fig.add_subplot(gs[0, 1])
    key_ax.axis("off")
    rank_ax = fig.add_subplot(gs[1:, 1])
    for ax, name in ((ax1, "throughput"), (ax2, "decisions"), (ax3, "load"), (key_ax, "key"), (rank_ax, "ranking")):
        ax.set_label(name)

    ends = np.cumsum([p.duration_s for p in subject.phases])
    starts = np.concatenate([[0.0], ends[:-1]])
    for ax in (ax1, ax2, ax3):
        for i, (s0, e) in enumerate(zip(starts, ends)):
            if i % 2 == 0:
                ax.axvspan(s0, e, color=_PHASE_SHADE, lw=0, zorder=0)
        ax.grid(axis="y", alpha=0.35)
        ax.set_xlim(0, dur)
        ax.tick_params(labelsize=9)
    wl_phases = {p.name: p for p in workload.phases} if workload is not None else {}
    for s0, e, ph in zip(starts, ends, subject.phases):
        words = ph.name + (f"\n{_phase_words(wl_phases[ph.name])}" if ph.name in wl_phases else "")
        ax1.annotate(words, (0.5 * (s0 + e), 1.0), xycoords=("data", "axes fraction"), xytext=(0, 4),
                     textcoords="offset points", ha="center", va="bottom", fontsize=9.5, color="#333333")

    for r, words, style in lines:
        ax1.plot(mid, _binned(r, edges, r.trace_tokens, rate=True), label=words, **style)
    ax1.set_title(f"Throughput: output tokens/s, mean over each {edges[1] - edges[0]:.2g} s (higher is better)",
                  fontsize=11, loc="left", pad=34, fontweight="bold")
    ax1.set_ylabel("output tokens/s", fontsize=10)
    ax1.set_ylim(bottom=0)
    plt.setp(ax1.get_xticklabels(), visible=False)

    for r, words, style in lines:
        if r is subject or r is threshold:
            steps = np.array(r.config_steps, dtype=float)[r.trace_cfg]
            # the threshold drawn wide beneath: where specctl decides alike, both stay visible
            under = {**style, "lw": 5.0, "alpha": 0.55} if r is not subject else style
            ax2.plot(mid, _binned(r, edges, steps, rate=False), **under)
    ax2.set_title("Decisions: draft steps per decode step (0 = plain decode, no speculation)", fontsize=11,
                  loc="left", fontweight="bold")
    ticks = sorted({s: n for s, n in reversed(list(zip(subject.config_steps, subject.config_names)))}.items())
    ax2.set_yticks([s for s, _ in ticks], [f"{n} ({s})" if n != str(s) else n for s, n in ticks])
    ax2.set_ylim(-0.3, max(s for s, _ in ticks) + 0.3)
    ax2.set_ylabel("draft steps", fontsize=10)
    plt.setp(ax2.get_xticklabels(), visible=False)

    bs = _binned(subject, edges, subject.trace_bs.astype(float), rate=False)
    ax3.fill_between(mid, 0, bs, color=_BATCH_COLOUR, alpha=0.35, lw=0)
    ax3.plot(mid, bs, color=_BATCH_COLOUR, lw=1.8)
    ax3.set_title("Load: requests in the running batch (about the same under every policy)", fontsize=11,
                  loc="left", fontweight="bold")
    ax3.set_ylabel("batch size", fontsize=10)
    ax3.set_ylim(0, 1.25 * max(1.0, float(np.nanmax(bs)) if np.isfinite(bs).any() else 1.0))
    ax3.set_xlabel("time into the workload (s)", fontsize=10)

    colour_of = {id(r): style["color"] for r, _, style in lines}
    ranked = sorted(results, key=lambda r: r.tokens_per_s)
    ypos = np.arange(len(ranked))
    vals = np.array([r.tokens_per_s for r in ranked])
    cols = [colour_of.get(id(r), "#555555") for r in ranked]
    span = float(vals.max() - vals.min()) or 0.05 * float(vals.max()) or 1.0
    lo, hi = vals.min() - 0.08 * span, vals.max() + 0.22 * span  # room for the figures beside the dots
    rank_ax.hlines(ypos, lo, vals, color="#dddddd", lw=1.2, zorder=1)
    rank_ax.scatter(vals, ypos, c=cols, s=[70 if r is subject else 36 for r in ranked], zorder=2)
    digits = 1 if vals.max() < 1000 else 0  # near-equal policies differ in the first decimal
    for y, r, v in zip(ypos, ranked, vals):
        rank_ax.annotate(f"{v:.{digits}f}", (v, y), xytext=(6, 0), textcoords="offset points", va="center",
                         fontsize=8.5, fontweight="bold" if r is subject else "normal")
    names = ["specctl live" if r.policy == "adaptive-live" else
             "specctl (virtual clock)" if r.policy == "adaptive" else r.policy for r in ranked]
    rank_ax.set_yticks(ypos, names, fontsize=8.5)
    for lab, r, c in zip(rank_ax.get_yticklabels(), ranked, cols):
        lab.set_color(c if c != "#555555" else "#333333")
        if r is subject:
            lab.set_fontweight("bold")
    rank_ax.yaxis.tick_right()
    rank_ax.set_xlim(lo, hi)
    rank_ax.set_ylim(-0.6, len(ranked) - 0.4)
    rank_ax.tick_params(axis="x", labelsize=8)
    rank_ax.grid(axis="x", alpha=0.35)
    rank_ax.set_title("Whole run, every policy: output tokens/s", fontsize=11, loc="left", fontweight="bold")
    if any(r.policy.startswith("static:") for r in results):
        rank_ax.set_xlabel("static:sN = always N draft steps", fontsize=9)

    import textwrap

    handles = [plt.Line2D([], [], **style) for _, _, style in reversed(lines)]
    handles.append(plt.matplotlib.patches.Patch(color=_BATCH_COLOUR, alpha=0.5))
    labels = [textwrap.fill(words, 40, subsequent_indent="  ") for _, words, _ in reversed(lines)]
    labels.append("running batch (specctl's run)")
    key_ax.legend(handles, labels, loc="upper left", fontsize=9, frameon=False, handlelength=2.4,
                  borderaxespad=0.0, labelspacing=0.7, bbox_to_anchor=(0.0, 1.0))

    fig.text(0.5, 0.985, title or f"{subject.workload} on {subject.profile}", ha="center", va="top",
             fontsize=16, fontweight="bold")
    y = 0.952
    if ratios:
        fig.text(0.5, y, ratios, ha="center", va="top", fontsize=12.5)
        y -= 0.028
    if subtitle:
        fig.text(0.5, y, subtitle, ha="center", va="top", fontsize=10, color="#444444", linespacing=1.4)
        y -= 0.021 * (subtitle.count("\n") + 1)
    fig.subplots_adjust(left=0.06, right=0.86, top=y - 0.075, bottom=0.06)
    return fig


def config_label(profile: Profile, config: Config) -> str:
    i = profile.index_of(config)
    return profile.config_names[i] if i is not None else config_name(config)
