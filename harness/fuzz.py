"""Hostile-input drills for `specctl bench reliability`: property-based cases (hypothesis, a test extra,
imported inside each fuzzer) through the real decoders, readers and engine."""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional


from ..controller import wire
from ..controller.state import StateStore

from .drills import CANDIDATE_STEPS, _settings, policy_for_version


# ============================================================================ hostile input
#
# Property-based (hypothesis): every case goes through the real decoder / reader; the outcome is
# "accepted" (and then the result must satisfy its invariants) or a rejection with a reason.
# Anything else raised is a crash; an accepted result that breaks an invariant is a bad policy or
# a bad sample. Both are counted with the first examples, never raised, so a run reports figures.


class Violation(AssertionError):
    """An accepted input produced something it must not (a bad policy, a bad sample)."""


@dataclass
class FuzzTally:
    target: str
    tried: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason -> cases
    crashes: int = 0
    violations: int = 0
    examples: list[str] = field(default_factory=list)
    extra: Counter = field(default_factory=Counter)

    def to_obj(self) -> dict[str, Any]:
        return {"target": self.target, "tried": self.tried, "accepted": self.accepted,
                "rejected": sum(self.rejected.values()), "rejected_by_reason": dict(self.rejected.most_common(12)),
                "crashes": self.crashes, "violations": self.violations, "examples": self.examples[:5],
                **dict(self.extra)}


STEP_BASES: list[dict[str, Any]] = [
    {"kind": "step", "schema": 1, "server": "sglang-0", "rank": 0, "iter": 18234, "ts": 1764441600.125,
     "batch_size": 4, "config": {"steps": 3, "topk": 1, "draft_tokens": 4}, "accepted": [3, 1, 0, 2],
     "step_ms": 11.8, "ctx_tokens": 51234},
    {"kind": "step", "schema": 1, "server": "s", "rank": 1, "iter": 0, "ts": 1.0, "batch_size": 1,
     "config": {"steps": 0, "topk": 1, "draft_tokens": 1}, "step_ms": 6.0},
    {"kind": "step", "schema": 1, "server": "tree", "rank": 0, "iter": 5, "ts": 2.0, "batch_size": 2,
     "config": {"steps": 2, "topk": 4, "draft_tokens": 8}, "accepted": [2, 0], "step_ms": 9.5},
]
POLICY_BASES: list[dict[str, Any]] = [
    {"kind": "policy", "schema": 1, "version": 7, "created_at": 1764441600.0, "source": "online",
     "table": [{"min_batch": 1, "max_batch": 6, "config": {"steps": 3, "topk": 1, "draft_tokens": 4}},
               {"min_batch": 7, "max_batch": None, "config": {"steps": 0, "topk": 1, "draft_tokens": 1}}],
     "model": {"samples": 10}},
    {"kind": "policy", "schema": 1, "version": 2, "created_at": 5.0, "source": "fixed",
     "table": [{"min_batch": 1, "max_batch": None, "config": {"steps": 1, "topk": 1, "draft_tokens": 2}}],
     "explore": [{"min_batch": 1, "max_batch": 8, "config": {"steps": 3, "topk": 1, "draft_tokens": 4}}],
     "explore_period": 64},
    {"kind": "policy", "schema": 1, "version": 9, "created_at": 6.0, "source": "online",
     "table": [{"min_batch": 1, "max_batch": None, "config": {"steps": 0, "topk": 1, "draft_tokens": 1}}],
     "challenge": [{"min_batch": 4, "max_batch": 7, "config": {"steps": 1, "topk": 1, "draft_tokens": 2}}],
     "challenge_period": 16},
]
BENCH_BASE: dict[str, Any] = {
    "backend": "sglang", "dataset_name": "random", "request_rate": float("inf"), "max_concurrency": 16,
    "duration": 100.0, "completed": 256, "output_throughput": 2100.5, "median_tpot_ms": 7.9,
    "accept_length": 2.6,
    "server_info": {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
                    "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
                    "speculative_adaptive": False, "max_running_requests": 256, "tp_size": 1,
                    "version": "0.5.23"},
}
SGLANG_LINES: list[str] = [
    "[2025-11-29 12:00:00] server_args=ServerArgs(model_path='/m', tp_size=1, max_running_requests=256, "
    "speculative_algorithm='EAGLE3', speculative_num_steps=3, speculative_eagle_topk=1, "
    "speculative_num_draft_tokens=4, decode_log_interval=40)",
    "[2025-11-29 12:00:00] server_args={'model_path': '/m', 'tp_size': 1, 'speculative_algorithm': 'EAGLE3', "
    "'speculative_num_steps': 3, 'speculative_eagle_topk': 1, 'speculative_num_draft_tokens': 4, "
    "'speculative_adaptive': True, 'decode_log_interval': 10, 'max_running_requests': None}",
    "[2025-11-29 12:00:30] Decode batch, #running-req: 2, #token: 1491, token usage: 0.01, cuda graph: True, "
    "gen throughput (token/s): 305.34, #queue-req: 0",
    "[2025-11-29 12:00:30.092 TP0] Decode batch, #running-req: 4, #token: 2237, token usage: 0.01, "
    "accept len: 2.73, accept rate: 0.57, cuda graph: True, gen throughput (token/s): 1172.80, #queue-req: 0",
    "[2025-11-29 12:00:31.180 TP0] Decode batch [4321], #running-req: 64, #token: 9000, token usage: 0.31, "
    "accept len: 1.92, accept rate: 0.46, cuda graph: True, gen throughput (token/s): 8000.10, #queue-req: 3",
    "[2025-11-29 12:00:30] Prefill batch, #new-seq: 2, #new-token: 586, #cached-token: 0, token usage: 0.05, "
    "#running-req: 0, #queue-req: 0, #pending-token: 0, cuda graph: False, input throughput (token/s): 10.0",
    "[2025-11-29 12:00:30.092 TP0] Built adaptive runtime state steps=1: elapsed=1.92s, mem=0.41GB",
    "[2025-11-29 12:00:30.694 TP0] Adaptive spec params updated: steps 3 -> 1 (ema_accept_len=3.25)",
    "[2025-11-29 12:00:30.695 TP0] Switch adaptive runtime state: steps 3 -> 1, draft_tokens 4 -> 2",
]
HOSTILE_NUMBER_TEXT = ["nan", "NaN", "inf", "-inf", "Infinity", "-1", "-0.0", "0", "1e309", "1e-320",
                       "99999999999999999999999", "", "abc", "0x10", "1_000", "+3", ".", "--1", "2.5.1"]


def _hostile_value(st: Any) -> Any:
    # fresh objects each draw: a shared list mutated in place by later mutations can grow into a
    # DAG whose JSON expansion is exponential
    return st.one_of(
        st.none(), st.booleans(),
        st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([float("nan"), float("inf"), float("-inf"), -1, -1.5, 0, 1e308, 2 ** 63, -(2 ** 63)]),
        st.text(max_size=16), st.builds(lambda: [1] * 70_000), st.builds(lambda: [[[[[]]]]]),
        st.lists(st.integers(min_value=-5, max_value=100), max_size=8),
        st.dictionaries(st.text(max_size=6), st.integers(), max_size=3),
    )


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:8]):
            out += _paths(v, prefix + (i,))
    return out


def _mutate(draw: Callable[[Any], Any], st: Any, obj: dict[str, Any]) -> None:
    op = draw(st.sampled_from(["replace", "replace", "delete", "add", "schema", "kind", "config",
                               "number"]))
    paths = _paths(obj)
    if op == "schema":
        obj["schema"] = draw(st.one_of(st.integers(min_value=-3, max_value=10), _hostile_value(st)))
        return
    if op == "kind":
        obj["kind"] = draw(st.sampled_from(["step", "policy", "Step", "", "status", None, 1]))
        return
    if op == "config":  # unknown / inconsistent configurations
        cfg = {"steps": draw(st.integers(-2, 80)), "topk": draw(st.integers(-1, 80)),
               "draft_tokens": draw(st.integers(-1, 5000))}
        table = obj.get("table")
        rows = [r for r in table if isinstance(r, dict)] if isinstance(table, list) else []
        if rows:
            draw(st.sampled_from(rows))["config"] = cfg
        else:
            obj["config"] = cfg
        return
    if op == "add":
        parent = obj
        if paths:
            p = draw(st.sampled_from(paths))
            target = obj
            for k in p[:-1]:
                target = target[k]
            parent = target if isinstance(target, dict) else obj
        parent[draw(st.sampled_from(["extra", "Kind", "schema_", "__proto__", "version2"]))] = draw(_hostile_value(st))
        return
    if not paths:
        return
    p = draw(st.sampled_from(paths))
    target = obj
    for k in p[:-1]:
        target = target[k]
    if op == "delete":
        if isinstance(target, dict):
            target.pop(p[-1], None)
        elif isinstance(target, list) and target:
            target.pop(p[-1] if p[-1] < len(target) else -1)
        return
    if op == "number":
        target[p[-1]] = draw(st.sampled_from([float("nan"), float("inf"), -1, -0.0, 0, 1e300, 2 ** 64]))
        return
    target[p[-1]] = draw(_hostile_value(st))


def _frames_strategy(st: Any, bases: list[dict[str, Any]]) -> Any:
    import copy

    @st.composite
    def frames(draw: Any) -> bytes:
        kind = draw(st.sampled_from(["bytes", "truncated", "mutated", "mutated", "mutated", "valid",
                                     "nested", "text"]))
        if kind == "bytes":
            return draw(st.binary(max_size=512))
        if kind == "text":
            return draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")
        if kind == "nested":
            depth = draw(st.integers(1, 200_000))
            return b"[" * depth + b"]" * draw(st.integers(0, depth))
        base = copy.deepcopy(draw(st.sampled_from(bases)))
        enc = json.dumps(base).encode()
        if kind == "valid":
            return enc
        if kind == "truncated":
            return enc[: draw(st.integers(0, len(enc) - 1))]
        for _ in range(draw(st.integers(1, 3))):
            _mutate(draw, st, base)
        if draw(st.integers(0, 5)) == 0:
            _huge_list(draw, st, base)  # last, so no later mutation multiplies it
        return json.dumps(base, allow_nan=True, default=str).encode()

    return frames()


def _huge_list(draw: Callable[[Any], Any], st: Any, obj: dict[str, Any]) -> None:
    n = draw(st.sampled_from([0, 1025, 65537, 70000]))
    if obj.get("kind") == "policy":
        obj["table"] = [{"min_batch": i + 1, "max_batch": None if i == n - 1 else i + 1,
                         "config": {"steps": 1, "topk": 1, "draft_tokens": 2}} for i in range(n)]
    else:
        obj["accepted"] = [1] * n
        if draw(st.booleans()):
            obj["batch_size"] = n


def _fuzz(target: str, strategy: Any, check: Callable[[Any, FuzzTally], str], num_cases: int,
          seed: int) -> FuzzTally:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    tally = FuzzTally(target)

    @hseed(seed)
    @settings(max_examples=num_cases, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def prop(case: Any) -> None:
        tally.tried += 1
        try:
            outcome = check(case, tally)
        except Violation as e:
            tally.violations += 1
            if len(tally.examples) < 5:
                tally.examples.append(f"violation: {e} <- {repr(case)[:300]}")
            return
        except Exception as e:  # noqa: BLE001 - a crash is what we count
            tally.crashes += 1
            if len(tally.examples) < 5:
                import traceback

                where = traceback.extract_tb(e.__traceback__)[-1]
                tally.examples.append(f"crash: {type(e).__name__}: {str(e)[:200]} at "
                                      f"{Path(where.filename).name}:{where.lineno} <- {repr(case)[:300]}")
            return
        if outcome == "accepted":
            tally.accepted += 1
        else:
            tally.rejected[outcome] += 1

    quiet = [logging.getLogger(n) for n in ("specctl.state", "specctl.plugin", "specctl.service")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)  # every rejection is logged once by design: thousands here
    try:
        prop()
    finally:
        for q, lv in zip(quiet, levels):
            q.setLevel(lv)
    return tally


def _check_step(rec: wire.StepRecord) -> None:
    if not (math.isfinite(rec.ts) and math.isfinite(rec.step_ms) and rec.step_ms > 0 and rec.batch_size >= 1):
        raise Violation(f"accepted a step with ts={rec.ts} step_ms={rec.step_ms} bs={rec.batch_size}")
    if rec.config.steps > 0 and (rec.accepted is None or len(rec.accepted) != rec.batch_size):
        raise Violation("accepted a speculative step without one accepted count per request")


def _strip_model(rec: Any) -> Any:
    return rec.model_copy(update={"model": {}}) if isinstance(rec, wire.PolicyRecord) else rec


def _check_policy(rec: wire.PolicyRecord) -> None:
    wire.check_table_covers(list(rec.table))
    if _strip_model(wire.decode_policy(wire.encode(rec))) != _strip_model(rec):
        raise Violation("an accepted policy does not round-trip")


def fuzz_wire(num_cases: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """wire.decode on hostile frames, and the same frames into the daemon's ingest
    (ControllerService.observe_frame), whose model must still refit to a valid policy."""
    from hypothesis import strategies as st

    from ..controller.metrics import Metrics
    from ..controller.service import ControllerService, ServiceSettings

    svc = ControllerService(ServiceSettings(), metrics=Metrics(), clock=lambda: 1764441700.0)

    def check(frame: bytes, tally: FuzzTally) -> str:
        try:
            rec = wire.decode(frame)
        except wire.WireError as e:
            outcome = e.reason
        else:
            outcome = "accepted"
            if isinstance(rec, wire.StepRecord):
                _check_step(rec)
            else:
                _check_policy(rec)
            again = wire.decode(wire.encode(rec))
            if again != rec and _strip_model(again) != _strip_model(rec):
                raise Violation("an accepted record does not round-trip")
            if again != rec:
                # NaN/inf inside the free-form `model` summary: serialised as null, so the
                # summary (informational, never used to decide) differs; the table does not
                tally.extra["policies_with_nonfinite_model_summary"] += 1
        try:
            step: Optional[wire.StepRecord] = wire.decode_step(frame)
        except wire.WireError:
            step = None
        should_take = step is not None and step.ts <= svc.clock() + svc.settings.max_future_s
        took = svc.observe_frame(frame)
        if took != should_take:
            raise Violation(f"the daemon {'took' if took else 'refused'} a frame decode_step "
                            f"{'rejects' if step is None else 'accepts'}")
        if took and outcome != "accepted":
            tally.extra["steps_taken_without_kind"] += 1  # decode_step defaults `kind`
        return outcome

    tally = _fuzz("wire decoder + daemon ingest", _frames_strategy(st, STEP_BASES + POLICY_BASES),
                  check, num_cases, seed)
    from ..controller.daemon import safe_tick

    try:
        svc.last_refit = -float("inf")  # due now
        safe_tick(svc)  # what the daemon's loop runs
        _check_policy(svc.policy)
        tally.extra["daemon_policy_after"] = f"v{svc.policy.version} {svc.policy.source}"  # type: ignore[assignment]
        errors = getattr(svc, "num_tick_errors", 0)
        if errors:
            # contained by the daemon (the policy in force stays), but a service bug: reported
            tally.extra["refit_failures_contained"] += errors
            try:
                svc.refit()
            except Exception as e:  # noqa: BLE001
                tally.examples.append(f"refit failure (contained): {type(e).__name__}: {str(e)[:200]}")
    except Exception as e:  # noqa: BLE001
        tally.crashes += 1
        tally.examples.append(f"crash: refit after the fuzzed ingest: {type(e).__name__}: {e}")
    tally.extra["daemon_records_taken"] = svc.model.num_samples_
    return tally.to_obj()


def _policy_table_frames(st: Any) -> Any:
    """Valid-looking policies whose rows or exploration rows may name step counts with no runtime
    state (and challenge rows, which older daemons wrote and engines ignore)."""

    @st.composite
    def frames(draw: Any) -> bytes:
        def config() -> dict[str, int]:
            steps = draw(st.integers(0, 8))
            topk = 1 if steps == 0 else draw(st.sampled_from([1, 1, 1, 2]))
            dt = 1 if steps == 0 else (steps + 1 if topk == 1 else draw(st.integers(steps + 1, 16)))
            return {"steps": steps, "topk": topk, "draft_tokens": dt}

        n = draw(st.integers(1, 6))
        rows, lo = [], 1
        for i in range(n):
            hi = None if i == n - 1 else lo + draw(st.integers(0, 40))
            rows.append({"min_batch": lo, "max_batch": hi, "config": config()})
            lo = (hi or 0) + 1
        obj = {"kind": "policy", "schema": 1, "version": draw(st.integers(0, 10 ** 6)),
               "created_at": 1.0, "source": "online", "table": rows}
        for key, period in (("explore", 64), ("challenge", 16)):
            if draw(st.booleans()):
                a = draw(st.integers(1, 64))
                obj[key] = [{"min_batch": a, "max_batch": a + draw(st.integers(0, 64)), "config": config()}]
                obj[key + "_period"] = period
        return json.dumps(obj).encode()

    return frames()


def fuzz_engine_policy(num_cases: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """Policy frames into the engine (EngineController.offer_policy_frame + sync): whatever
    arrives, every decision names a step count the engine has a runtime state for; a table whose
    rows or exploration rows name any other step count (or a tree) is refused and the engine stays
    on its fallback; challenge rows (older daemons) are ignored."""
    from hypothesis import strategies as st

    from ..plugin.engine import EngineController

    settings = _settings(policy_endpoint="ipc:///nowhere", sync_every=1, stale_after_s=1e9)
    candidates = frozenset(CANDIDATE_STEPS)
    probe = (1, 2, 3, 5, 7, 8, 16, 41, 64, 200, 65536, 10 ** 7)

    def check(frame: bytes, tally: FuzzTally) -> str:
        eng = EngineController(settings, candidate_steps=CANDIDATE_STEPS)
        why = eng.offer_policy_frame(frame)
        if eng.note_result():
            eng.sync()
        for b in probe:
            s = eng.decide(b)
            if s not in candidates:
                raise Violation(f"decided steps={s} at batch {b}: no runtime state")
        if eng.failed:
            raise Violation(f"engine failed: {eng.failed}")
        if why is not None:
            return why
        try:
            rec = wire.decode_policy(frame)
        except wire.WireError as e:
            return e.reason
        # exploring steps run their rows' configurations too: they need runtime states as well
        names = {(r.config.steps, r.config.topk) for r in list(rec.table) + list(rec.explore or [])}
        runnable = all(s in candidates and (s == 0 or k == 1) for s, k in names)
        if eng.active_source == "fallback":
            if runnable:
                raise Violation(f"refused a runnable policy: {eng.fallback_reason}")
            tally.extra["refused_no_runtime_state"] += 1
            return "refused: step count without runtime state (or a tree)"
        if not runnable:
            raise Violation("applied a policy naming a step count without a runtime state")
        return "accepted"

    strategy = st.one_of(_frames_strategy(st, POLICY_BASES), _policy_table_frames(st))
    return _fuzz("engine policy intake", strategy, check, num_cases, seed).to_obj()


def fuzz_policy_files(num_cases: int = 10_000, seed: int = 0,
                      workdir: Optional[str | os.PathLike[str]] = None) -> dict[str, Any]:
    """Hostile bytes as the daemon's persisted policy.json (a good .prev beside it): the store
    returns the file's policy only if it is valid, else the previous copy, never raises."""
    from hypothesis import strategies as st

    d = Path(workdir or tempfile.mkdtemp(prefix="specctl-fuzz-"))
    d.mkdir(parents=True, exist_ok=True)
    prev = policy_for_version(3)
    (d / "policy.json.prev").write_bytes(wire.encode(prev))

    def check(frame: bytes, tally: FuzzTally) -> str:
        (d / "policy.json").write_bytes(frame)
        store = StateStore(d)
        pol = store.load_policy()
        try:
            want: Optional[wire.PolicyRecord] = wire.decode_policy(frame)
        except wire.WireError as e:
            want = None
            reason = e.reason
        if want is not None:
            if pol is None or _strip_model(pol) != _strip_model(want):  # NaN in `model` != itself
                raise Violation("a valid policy file was not the one loaded")
            return "accepted"
        if pol != prev:
            raise Violation(f"an invalid policy file gave {pol!r} instead of the previous copy")
        if not store.problems:
            raise Violation("an unusable policy file was not reported")
        return reason

    return _fuzz("policy files (StateStore)", _frames_strategy(st, POLICY_BASES), check, num_cases, seed).to_obj()


def _check_sample(s: Any) -> None:
    steps, topk, draft = s.config
    ok = (math.isfinite(s.ts) and isinstance(s.batch_size, int) and s.batch_size >= 1
          and (s.step_ms is None or (math.isfinite(s.step_ms) and s.step_ms > 0))
          and math.isfinite(s.weight) and s.weight > 0
          and (s.mean_accepted is None or (math.isfinite(s.mean_accepted) and s.mean_accepted >= 0))
          and 0 <= steps <= wire.MAX_STEPS and 1 <= topk <= wire.MAX_TOPK and 1 <= draft <= wire.MAX_DRAFT_TOKENS
          and (s.accepted is None or all(isinstance(a, int) and 0 <= a <= steps for a in s.accepted)))
    if not ok:
        raise Violation(f"reader produced a bad sample {s!r:.300}")


def _file_strategy(st: Any, line: Any, *, gz: bool = True) -> Any:
    @st.composite
    def files(draw: Any) -> tuple[bytes, Optional[str]]:
        lines = draw(st.lists(st.one_of(line, st.just(b""), st.binary(max_size=80)), min_size=0, max_size=12))
        data = b"\n".join(lines)
        if draw(st.booleans()):
            data += b"\n"
        if gz and draw(st.integers(0, 4)) == 0:
            import gzip

            data = gzip.compress(data)
            if draw(st.booleans()):
                data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
        return data, draw(st.sampled_from([None, "forced", "forced"]))

    return files()


def _sglang_run(st: Any) -> Any:
    """A plausible log: server_args, then decode lines 0.1-2 s apart (some of them damaged)."""

    @st.composite
    def runs(draw: Any) -> bytes:
        new = draw(st.booleans())
        lines = [SGLANG_LINES[1] if new else SGLANG_LINES[0]]
        t = 30.0
        damaged = _sglang_line(st)
        for i in range(draw(st.integers(2, 30))):
            t += draw(st.floats(0.05, 2.0))
            stamp = f"[2025-11-29 12:{int(t // 60):02d}:{t % 60:06.3f}{' TP0' if new else ''}]"
            running = draw(st.sampled_from([1, 2, 4, 8, 64, 0, 10 ** 9]))
            al = draw(st.sampled_from(["2.73", "1.00", "4.00", "0.50", "nan", "9.99"]))
            text = (f"{stamp} Decode batch, #running-req: {running}, #token: 1491, token usage: 0.01, "
                    f"accept len: {al}, accept rate: 0.57, cuda graph: True, "
                    f"gen throughput (token/s): {draw(st.sampled_from(['305.34', '0.00', '-5', 'inf', '1e9']))}, "
                    f"#queue-req: 0")
            lines.append(draw(damaged) if draw(st.integers(0, 9)) == 0 else text.encode())
        return b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines)

    return runs()


def _sglang_line(st: Any) -> Any:
    import re

    num = re.compile(r"(?<=[:= (])-?\d+(?:\.\d+)?")

    @st.composite
    def lines(draw: Any) -> bytes:
        text = draw(st.sampled_from(SGLANG_LINES))
        op = draw(st.sampled_from(["keep", "numbers", "numbers", "truncate", "splice", "bools"]))
        if op == "numbers":
            matches = list(num.finditer(text))
            if matches:
                out, last = [], 0
                for m in matches:
                    out.append(text[last:m.start()])
                    out.append(draw(st.sampled_from(HOSTILE_NUMBER_TEXT + [m.group(0)] * 3)))
                    last = m.end()
                text = "".join(out) + text[last:]
        elif op == "truncate":
            text = text[: draw(st.integers(0, len(text)))]
        elif op == "splice":
            i = draw(st.integers(0, len(text)))
            text = text[:i] + draw(st.text(max_size=30)) + text[i:]
        elif op == "bools":
            text = text.replace("True", draw(st.sampled_from(["False", "None", "1", ""])))
        return text.encode("utf-8", "surrogatepass")

    return lines()


def _bench_line(st: Any) -> Any:
    import copy

    @st.composite
    def lines(draw: Any) -> bytes:
        obj = copy.deepcopy(BENCH_BASE)
        for _ in range(draw(st.integers(0, 3))):
            _mutate(draw, st, obj)
        return json.dumps(obj, allow_nan=True, default=str).encode()

    return lines()


def _fuzz_reader(target: str, fmt: str, line: Any, num_cases: int, seed: int,
                 workdir: Optional[str | os.PathLike[str]]) -> dict[str, Any]:
    from hypothesis import strategies as st

    from ..training.costmodel import CostModel
    from ..training.readers import FileReport, read_file
    from ..controller.replay import replay

    d = Path(workdir or tempfile.mkdtemp(prefix="specctl-fuzz-"))
    d.mkdir(parents=True, exist_ok=True)
    path = d / "input"
    model = CostModel()
    model.fit([])

    class _NullSock:
        def send(self, data: bytes) -> None:
            pass

    def check(case: tuple[bytes, Optional[str]], tally: FuzzTally) -> str:
        data, mode = case
        path.write_bytes(data)
        rep = FileReport(path=str(path))
        n = 0
        for s in read_file(path, rep, fmt=fmt if mode == "forced" else None):
            _check_sample(s)
            model.observe(s)
            n += 1
        tally.extra["samples"] += n
        tally.extra["lines_skipped"] += rep.num_skipped
        if fmt == "telemetry":
            replay(path, _NullSock())  # `specctl replay` reads the same files
        if n:
            return "accepted"  # (damaged lines beside the good ones are counted in lines_skipped)
        if rep.problems:
            return "file problem: " + rep.problems[0].split(":")[0][:60]
        if rep.num_skipped:
            return "lines skipped: " + sorted(rep.skipped)[0][:60]
        return "nothing usable (ignored)"

    tally = _fuzz(target, _file_strategy(st, line), check, num_cases, seed)
    try:
        model.refit()
    except Exception as e:  # noqa: BLE001
        tally.crashes += 1
        tally.examples.append(f"crash: cost-model refit on the fuzzed samples: {type(e).__name__}: {e}")
    return tally.to_obj()


def fuzz_telemetry_files(num_cases: int = 10_000, seed: int = 0, workdir: Optional[str] = None) -> dict[str, Any]:
    from hypothesis import strategies as st

    return _fuzz_reader("telemetry JSONL (train reader + replay)", "telemetry",
                        _frames_strategy(st, STEP_BASES + POLICY_BASES), num_cases, seed, workdir)


def fuzz_sglang_logs(num_cases: int = 10_000, seed: int = 0, workdir: Optional[str] = None) -> dict[str, Any]:
    from hypothesis import strategies as st

    return _fuzz_reader("SGLang server logs", "sglang-log", st.one_of(_sglang_line(st), _sglang_run(st)),
                        num_cases, seed, workdir)


def fuzz_bench_serving(num_cases: int = 10_000, seed: int = 0, workdir: Optional[str] = None) -> dict[str, Any]:
    from hypothesis import strategies as st

    return _fuzz_reader("bench_serving JSONL", "bench-serving", _bench_line(st), num_cases, seed, workdir)


FUZZ_TARGETS: dict[str, Callable[..., dict[str, Any]]] = {
    "wire": fuzz_wire, "engine_policy": fuzz_engine_policy, "policy_files": fuzz_policy_files,
    "telemetry_files": fuzz_telemetry_files, "sglang_logs": fuzz_sglang_logs,
    "bench_serving": fuzz_bench_serving,
}


# ============================================================================ the whole run


