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


def verdict(rep: BenchReport, subject: str, operator: str, label: Optional[str] = None) -> str:
    """One line: `subject`'s tokens/s as a ratio of the operator's policy, sglang-ema, off, the best
    static (the best of `off` and the `static:*` rows present) and the oracle, whichever are present;
    `label` names the subject (default: its policy name)."""
    by = {r.policy: r for r in rep.results}
    me = by[subject]
    statics = [r for r in rep.results if r.policy == "off" or r.policy.startswith("static:")]
    best = max(statics, key=lambda r: r.tokens_per_s, default=None)
    refs = [(f"the operator's {operator}", by.get(operator)), ("sglang-ema", by.get("sglang-ema")),
            ("off", by.get("off")), (f"the best static ({best.policy})" if best else "", best),
            ("the oracle", by.get("oracle"))]
    parts = [f"{me.tokens_per_s / r.tokens_per_s:.3f}x {label}" for label, r in refs
             if r is not None and r.tokens_per_s > 0]
    return f"verdict: {label or subject} {me.tokens_per_s:.1f} tok/s = " + ", ".join(parts)


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


def plot(results: Sequence[SimResult], path: str | Path, title: str = "", subtitle: str = "") -> None:
    """Three panels over the workload's time: each policy's throughput, each policy's decisions
    (draft steps; 0 = plain decode), and the running batch of specctl's run (the first result if
    there is none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install 'specctl[plot]'") from None
    if not results:
        raise ValueError("nothing to plot")
    dur = results[0].duration_s
    nbins = int(min(240, max(20, dur)))
    edges = np.linspace(0.0, dur, nbins + 1)
    mid = 0.5 * (edges[1:] + edges[:-1])
    width = edges[1] - edges[0]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(14, 9.5), sharex=True,
                                        gridspec_kw={"height_ratios": [3, 2, 1.2]})
    for ax in (ax1, ax2):
        ax.set_prop_cycle(color=plt.cm.tab20.colors[::2] + plt.cm.tab20.colors[1::2])
    for r in results:
        idx = np.clip(np.searchsorted(edges, r.trace_t, side="right") - 1, 0, nbins - 1)
        tok = np.bincount(idx, weights=r.trace_tokens, minlength=nbins) / width
        steps_arr = np.array(r.config_steps)[r.trace_cfg]
        cnt = np.bincount(idx, minlength=nbins)
        mean_steps = np.where(cnt > 0, np.bincount(idx, weights=steps_arr, minlength=nbins) / np.maximum(cnt, 1), np.nan)
        style = {"lw": 2.2, "color": "black", "ls": ":" if "live" in r.policy else "-"} if r.policy.startswith("adaptive") else (
            {"lw": 1.0, "ls": "--", "color": "grey"} if r.policy == "oracle" else {"lw": 1.0})
        ax1.plot(mid, tok, label=f"{describe_policy(r.policy)}  [{r.tokens_per_s:.0f} tok/s]", **style)
        ax2.plot(mid, mean_steps, **style)
    subject = next((r for r in results if r.policy == "adaptive-live"),
                   next((r for r in results if r.policy.startswith("adaptive")), results[0]))
    idx = np.clip(np.searchsorted(edges, subject.trace_t, side="right") - 1, 0, nbins - 1)
    cnt = np.bincount(idx, minlength=nbins)
    ax3.plot(mid, np.where(cnt > 0, np.bincount(idx, weights=subject.trace_bs, minlength=nbins) / np.maximum(cnt, 1),
                           np.nan), color="tab:purple")
    ax1.set_title("Throughput: output tokens/s of each policy, per time bin (higher is better)",
                  fontsize=9, loc="left")
    ax1.set_ylabel("output tokens/s")
    ax1.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
               title="policy (what it does)  [whole-run tok/s]", title_fontsize=7.5)
    max_steps = max(max(r.config_steps) for r in results)
    ax2.set_title("Decisions: EAGLE-3 draft steps per decode step, mean over each time bin "
                  "(0 = plain decode, no speculation)", fontsize=9, loc="left")
    ax2.set_ylabel("draft steps")
    ax2.set_ylim(-0.2, max_steps + 0.2)
    who = ("specctl's live run" if subject.policy == "adaptive-live" else
           "specctl's run" if subject.policy.startswith("adaptive") else f"the {subject.policy} run")
    ax3.set_title(f"Load: requests in the running batch during {who} (in a closed loop, about the same "
                  "under every policy); the workload's phases are named at the top", fontsize=9, loc="left")
    ax3.set_ylabel("batch size")
    ax3.set_ylim(0, 1.4 * max(1, int(subject.trace_bs.max()) if len(subject.trace_bs) else 1))
    ax3.set_xlabel("time into the workload (s)")
    ends = np.cumsum([p.duration_s for p in subject.phases])
    starts = np.concatenate([[0.0], ends[:-1]])
    for ax in (ax1, ax2, ax3):
        for e in ends[:-1]:
            ax.axvline(e, color="lightgrey", lw=0.8, zorder=0)
        ax.grid(alpha=0.3)
    for s0, e, ph in zip(starts, ends, subject.phases):
        ax3.annotate(ph.name, (0.5 * (s0 + e), 1.0), xycoords=("data", "axes fraction"), xytext=(0, -2),
                     textcoords="offset points", ha="center", va="top", fontsize=7.5, color="dimgrey")
    fig.suptitle(title or f"{subject.workload} on {subject.profile}")
    if subtitle:
        fig.text(0.5, 0.945, subtitle, ha="center", va="top", fontsize=8)
        fig.tight_layout(rect=(0, 0, 1, 0.94))
    else:
        fig.tight_layout()
    fig.savefig(str(path), dpi=110, bbox_inches="tight")  # the legend sits outside the axes
    plt.close(fig)


def config_label(profile: Profile, config: Config) -> str:
    i = profile.index_of(config)
    return profile.config_names[i] if i is not None else config_name(config)
