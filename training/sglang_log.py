"""SGLang server logs -> cost-model `Sample`s: decode-log lines (interval averages), the server's arguments,
runtime-state switches, and the prefill cost estimated from them."""

from __future__ import annotations

import calendar
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from ..controller import wire
from ..policies.table import OFF, Config
from .costmodel import Sample
from .lines import _DECODE, _PREFIX, FileReport, Progress, iter_lines

DEFAULT_DECODE_LOG_INTERVAL = 40  # SGLang's --decode-log-interval default (0.5.17 and 0.5.23)


# ---------------------------------------------------------------------------------------------
# (a) SGLang server logs

# report_decode_stats (managers/scheduler_components/metrics_reporter.py, 0.5.17 and 0.5.23):
#   f"Decode batch{iter_msg}, #running-req: {n}, {token_usage_msg}"
#   + (spec only) f"accept len: {x:.2f}, accept rate: {y:.2f}, " [+ "cap len: ..., " ...]
#   + f"{cuda|cpu|npu|musa} graph: {bool}, gen throughput (token/s): {z:.2f}, #queue-req: {q}"
#   [+ ", est. decode TFLOPS/s ..." | ", fwd occupancy: ..."]
# `#queue-req` usually ends the line (SGLang's own debug_utils/log_parser.py regex wants a comma
# after it, so it misses the default format); here anything may follow.
_ACCEPT = re.compile(r"\baccept len: (?P<al>[-+0-9.eEinfa]+), accept rate: (?P<ar>[-+0-9.eEinfa]+)")
_THROUGHPUT = re.compile(r"\bgen throughput \(token/s\): (?P<thr>[-+0-9.eEinfa]+)")
_QUEUE = re.compile(r"#queue-req: (?P<q>\d+)")
_GRAPH = re.compile(r"\b(?:cuda|cpu|npu|musa) graph: (?P<g>True|False)")
_PREFILL = re.compile(r"^Prefill batch(?: \[\d+\])?, #new-seq: (?P<seqs>\d+), #new-token: (?P<tokens>\d+), "
                      r".*?#running-req: (?P<running>\d+)")
# eagle_worker_v2.apply_runtime_state (0.5.17 and 0.5.23, rank 0):
_SWITCH = re.compile(r"^Switch adaptive runtime state: steps (?P<a>\d+) -> (?P<b>\d+), "
                     r"draft_tokens (?P<c>\d+) -> (?P<d>\d+)")
# adaptive_spec_params.AdaptiveStepSlot (0.5.17 and 0.5.23, rank 0): a slot's decision; the
# runtime switch that follows it logs the line above.
_UPDATED = re.compile(r"^Adaptive spec params updated: steps (?P<a>\d+) -> (?P<b>\d+)")
_BUILT = re.compile(r"^Built adaptive runtime state steps=(?P<s>\d+):")
# 0.5.17: `server_args=ServerArgs(model_path='...', speculative_num_steps=3, ...)` (dataclass repr)
# 0.5.23: `server_args={'model_path': '...', 'speculative_num_steps': 3, ...}` (resolved dict)
_ARGS_PREFIX = "server_args="
_MESSAGE_START = re.compile(r"(?:Decode batch|Prefill batch|Switch adaptive runtime state|"
                            r"Adaptive spec params updated|Built adaptive runtime state|server_args=)")


def _arg(text: str, name: str) -> Optional[str]:
    m = re.search(r"[\s,({]'?" + re.escape(name) + r"'?\s*[=:]\s*('[^']*'|\"[^\"]*\"|[^,)}\s]+)", text)
    if m is None:
        return None
    v = m.group(1).strip("'\"")
    return None if v in ("None", "null") else v


def _int_arg(text: str, name: str) -> Optional[int]:
    """A count (steps, topk, draft tokens, log interval): negative or absurd values count as absent."""
    v = _arg(text, name)
    try:
        n = None if v is None else int(v)
    except ValueError:
        return None
    return n if n is not None and 0 <= n <= 1_000_000 else None


@dataclass
class ServerArgs:
    """The speculative settings found in a `server_args=` line."""

    algorithm: Optional[str]
    steps: Optional[int]
    topk: Optional[int]
    draft_tokens: Optional[int]
    adaptive: bool
    decode_log_interval: int

    @property
    def config(self) -> Optional[Config]:
        if not self.algorithm:
            return OFF
        if self.steps is None:
            return None
        if self.steps == 0:
            return OFF
        if self.steps > wire.MAX_STEPS or (self.topk or 1) > wire.MAX_TOPK:
            return None  # not a configuration anyone runs: a damaged line
        topk = self.topk or 1
        draft = self.draft_tokens
        if draft is None or (topk == 1 and draft != self.steps + 1):
            draft = self.steps + 1 if topk == 1 else draft
        return None if draft is None or draft > wire.MAX_DRAFT_TOKENS else (self.steps, topk, draft)


def parse_server_args(text: str) -> ServerArgs:
    alg = _arg(text, "speculative_algorithm")
    return ServerArgs(
        algorithm=alg if alg and alg.upper() not in ("NONE",) else None,
        steps=_int_arg(text, "speculative_num_steps"),
        topk=_int_arg(text, "speculative_eagle_topk"),
        draft_tokens=_int_arg(text, "speculative_num_draft_tokens"),
        adaptive=(_arg(text, "speculative_adaptive") or "False") in ("True", "true"),
        decode_log_interval=_int_arg(text, "decode_log_interval") or DEFAULT_DECODE_LOG_INTERVAL,
    )


def _float(s: str) -> Optional[float]:
    try:
        v = float(s)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def draft_widths_consistent(accept_len: float, accept_rate: float) -> Optional[tuple[float, float]]:
    """Range of (draft_tokens - 1) that the 2-decimal `accept len` / `accept rate` pair allows.

    SGLang prints accept len = tokens / request-steps and accept rate = correct drafts /
    (request-steps x (draft_tokens_now - 1)), so (len - 1) / rate = draft_tokens_now - 1 whatever
    mix of configurations the interval ran: it identifies the configuration active at the log
    line, never whether the interval was mixed. None when the pair carries no information.
    """
    if accept_rate - 0.005 <= 0 or accept_len - 0.005 <= 1.0:
        return None
    lo = (accept_len - 0.005 - 1.0) / (accept_rate + 0.005)
    hi = (accept_len + 0.005 - 1.0) / (accept_rate - 0.005)
    return lo, hi


def _infer_chain(al: float, ar: float) -> Optional[Config]:
    rng = draft_widths_consistent(al, ar)
    if rng is None:
        return None
    ks = [k for k in range(1, 65) if rng[0] - 1e-9 <= k <= rng[1] + 1e-9]
    return (ks[0], 1, ks[0] + 1) if len(ks) == 1 else None


@dataclass
class _Stream:
    """One scheduler's log stream (a prefix tag set): what ran since its last decode line."""

    config: Optional[Config] = None
    seen_decode: bool = False
    segment: int = 0  # bumped at every configuration change (names the sample's run)
    switches: list[str] = field(default_factory=list)  # switch lines since the last decode line
    prefills: int = 0
    prefill_tokens: int = 0
    last_running: Optional[int] = None  # #running-req at the previous decode line
    idle: bool = False  # a prefill started from an empty running batch inside the interval
    saw_switch_line: bool = False
    hinted: bool = False  # a 'params updated' hint changed `config` since the last switch line
    before_hint: Optional[Config] = None  # the state before that hint


def _ts(m: re.Match) -> float:
    try:
        y, mo, d = (int(x) for x in m.group("date").split("-"))
        h, mi, s = (int(x) for x in m.group("time").split(":"))
        t = float(calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0)))
    except (ValueError, OverflowError):
        return 0.0
    frac = m.group("frac")
    if frac:
        t += int(frac) / 10 ** len(frac)
    return max(0.0, t)


def _rank(tags: str) -> int:
    m = re.search(r"\bTP(\d+)", tags)
    return int(m.group(1)) if m else 0


def read_sglang_log(path: Path, report: FileReport, progress: Optional[Progress] = None, *,
                    server: Optional[str] = None) -> Iterator[Sample]:
    """Samples from `Decode batch` lines: one per log interval of `decode_log_interval` decode
    steps, step_ms = 1000 x #running-req x accept_len / gen_throughput.

    Which configuration ran comes from the `server_args=` line (static settings), then from
    `Switch adaptive runtime state` / `Adaptive spec params updated` lines, else it is inferred
    from accept len / accept rate. Intervals in which the configuration changed are dropped: their
    accept len and step time mix two configurations (the accept-rate bias of
    reference/sglang-integration.md §4). Also dropped: the first interval of a server (it spans
    start-up), intervals containing a prefill that started from an empty batch (idle time) and
    intervals over which #running-req moved by more than 10% (it is a snapshot at the end).
    The time of the prefill batches inside the kept intervals is estimated per server
    (`estimate_prefill_ms`) and subtracted.
    The overlap scheduler runs at most one batch of an interval with the previous configuration.
    """
    name = server or path.name
    args: Optional[ServerArgs] = None
    interval = DEFAULT_DECODE_LOG_INTERVAL
    streams: dict[str, _Stream] = {}
    epoch = 0
    inferred = 0
    # (sample, prefill batches per step, 1k prefill tokens per step) of the current server
    pending: list[tuple[Sample, float, float]] = []

    def flush() -> Iterator[Sample]:
        """One server's intervals, with the prefill time they contain estimated and removed."""
        if not pending:
            return
        beta = estimate_prefill_ms(pending)
        with_prefill = sum(1 for _, x1, x2 in pending if x1 > 0)
        if beta is not None and with_prefill:
            report.note(f"server {epoch}: {with_prefill} of {len(pending)} used intervals contain "
                        f"prefill batches; their time, estimated at {beta[0]:.3f} ms per prefill "
                        f"batch + {beta[1]:.3f} ms per 1k new tokens, was subtracted")
        elif with_prefill:
            report.note(f"server {epoch}: {with_prefill} of {len(pending)} used intervals contain "
                        f"prefill batches; too little variation to estimate their time, so step "
                        f"times of those intervals include it")
        for s, x1, x2 in pending:
            if beta is not None:
                corrected = s.step_ms - beta[0] * x1 - beta[1] * x2  # type: ignore[operator]
                s.step_ms = max(corrected, 0.5 * s.step_ms)  # type: ignore[operator]
            report.num_samples += 1
            yield s
        pending.clear()

    def stream(key: str) -> _Stream:
        st = streams.get(key)
        if st is None:
            st = streams[key] = _Stream(config=args.config if args is not None else None)
        return st

    for lineno, text in iter_lines(path, report, progress):
        m = _PREFIX.match(text)
        if m is not None:
            msg = m.group("msg")
            key = f"{m.group('pid') or ''}{m.group('tags') or ''}".strip()
            ts, rank = _ts(m), _rank(m.group("tags") or "")
        else:
            # a custom SGLANG_LOGGING_CONFIG_PATH format: find the message, no time or ranks
            at = _MESSAGE_START.search(text)
            if at is None:
                report.num_ignored += 1
                continue
            msg, key, ts, rank = text[at.start():], "", 0.0, 0

        if msg.startswith(_ARGS_PREFIX):
            a = parse_server_args(msg)
            if args is not None:
                report.note(f"line {lineno}: another server_args line: a new server; "
                            f"configuration tracking restarts")
            yield from flush()
            args = a
            interval = a.decode_log_interval
            epoch += 1
            streams.clear()
            if a.config is None:
                report.note(f"line {lineno}: server_args line without usable speculative settings")
            report.note(f"line {lineno}: server settings: algorithm {a.algorithm or 'none'}, "
                        f"steps {a.steps}, topk {a.topk}, draft tokens {a.draft_tokens}, "
                        f"adaptive {a.adaptive}, decode_log_interval {a.decode_log_interval}")
            report.num_ignored += 1
            continue

        sw = _SWITCH.match(msg)
        if sw is not None:
            st = stream(key)
            a_, b_, c_, d_ = (int(sw.group(x)) for x in "abcd")
            new: Config = OFF if b_ == 0 else (b_, 1, d_)
            old: Config = OFF if a_ == 0 else (a_, 1, c_)
            base = st.before_hint if st.hinted else st.config
            st.hinted, st.before_hint = False, None
            if base is not None and base != old:
                report.note(f"line {lineno}: switch from steps {a_} but the tracked configuration "
                            f"was steps {st.config[0]}")
            st.config = new
            st.segment += 1
            st.switches.append(f"steps {a_} -> {b_}")
            st.saw_switch_line = True
            report.num_ignored += 1
            continue

        up = _UPDATED.match(msg)
        if up is not None:
            st = stream(key)
            a_, b_ = int(up.group("a")), int(up.group("b"))
            st.switches.append(f"steps {a_} -> {b_} (params updated)")
            if not st.saw_switch_line:
                # only the slot decision was logged: take it as the new state until a runtime
                # switch line (authoritative, carries the draft width) says otherwise
                if not st.hinted:
                    st.hinted, st.before_hint = True, st.config
                st.config = OFF if b_ == 0 else (b_, 1, b_ + 1)
                st.segment += 1
            report.num_ignored += 1
            continue

        pf = _PREFILL.match(msg)
        if pf is not None:
            st = stream(key)
            st.prefills += 1
            st.prefill_tokens += int(pf.group("tokens"))
            if int(pf.group("running")) == 0:
                st.idle = True
            report.num_ignored += 1
            continue

        if _BUILT.match(msg):
            report.note(f"adaptive runtime state built for steps={_BUILT.match(msg).group('s')}")  # type: ignore[union-attr]
            report.num_ignored += 1
            continue

        if not msg.startswith("Decode batch"):
            report.num_ignored += 1
            continue

        d = _DECODE.match(msg)
        if d is None:
            # not SGLang's line (or mangled before #running-req): leave the stream's state alone
            report.skip(lineno, "unparseable decode line", text)
            continue
        st = stream(key)
        first = not st.seen_decode
        switches, prefills, prefill_tokens, idle = st.switches, st.prefills, st.prefill_tokens, st.idle
        st.seen_decode = True
        st.switches, st.prefills, st.prefill_tokens, st.idle = [], 0, 0, False
        rest = d.group("rest")
        prev_running, st.last_running = st.last_running, int(d.group("running"))
        tm = _THROUGHPUT.search(rest)
        if tm is None or _QUEUE.search(rest) is None:
            report.skip(lineno, "truncated decode line (no gen throughput / #queue-req)", text)
            continue
        running = int(d.group("running"))
        thr = _float(tm.group("thr"))
        am = _ACCEPT.search(rest)
        al = ar = None
        if am is not None:
            al, ar = _float(am.group("al")), _float(am.group("ar"))
            if al is None or ar is None or al < 1.0 or ar < 0:
                report.skip(lineno, "bad accept len / accept rate", text)
                continue
        if first:
            report.skip(lineno, "first interval of a server (spans start-up and idle time)", text)
            continue
        if switches:
            report.skip(lineno, "configuration changed inside the interval", text,
                        detail=", ".join(switches[:3]) + (", …" if len(switches) > 3 else ""))
            continue
        if idle:
            report.skip(lineno, "interval spans an idle period (a prefill started from an empty batch)",
                        text)
            continue
        if running <= 0 or thr is None or thr <= 0:
            report.skip(lineno, "no decode work in the interval (#running-req or throughput 0)", text)
            continue
        if prev_running is not None and abs(running - prev_running) > max(
                1, round(0.1 * max(running, prev_running))):
            # #running-req is a snapshot at the end; the interval's mean batch lay elsewhere
            report.skip(lineno, "batch size changed inside the interval", text,
                        detail=f"#running-req {prev_running} -> {running}")
            continue

        # the configuration that ran
        cfg = st.config
        if am is None:
            if cfg is not None and cfg != OFF:
                report.skip(lineno, "decode line without accept len while the configuration speculates",
                            text)
                continue
            cfg = OFF  # SGLang prints no accept fields when speculation is off
        else:
            rng = draft_widths_consistent(al, ar)  # type: ignore[arg-type]
            if cfg is None:
                cfg = _infer_chain(al, ar)  # type: ignore[arg-type]
                if cfg is None:
                    report.skip(lineno, "configuration unknown (no server_args / switch lines, "
                                "accept len and rate do not identify it)", text)
                    continue
                inferred += 1
                st.config = cfg
            elif rng is not None and not (rng[0] - 1e-9 <= cfg[2] - 1 <= rng[1] + 1e-9):
                # the tracked state is wrong (a switch line went missing): trust the log line
                report.skip(lineno, "accept len / accept rate contradict the tracked configuration",
                            text, detail=f"tracked draft tokens {cfg[2]}")
                st.config = _infer_chain(al, ar)  # type: ignore[arg-type]
                st.segment += 1
                continue
            elif cfg == OFF and al > 1.005:  # type: ignore[operator]
                report.skip(lineno, "accept len above 1 while the tracked configuration is off", text)
                continue
        tau = 1.0 if cfg == OFF else float(al)  # type: ignore[arg-type]
        step_ms = 1000.0 * running * tau / thr
        report.num_used += 1
        pending.append((Sample(ts=ts, config=cfg, batch_size=running, step_ms=step_ms,
                               weight=float(interval),
                               mean_accepted=None if cfg == OFF else tau - 1.0,
                               server=f"{name}#{epoch}.{key or '-'}.{st.segment}", rank=rank),
                        prefills / interval, prefill_tokens / 1000.0 / interval))
    yield from flush()
    if args is None:
        report.note("no server_args line: configurations come from switch lines or are inferred "
                    f"from accept len / accept rate; decode_log_interval assumed {interval}")
    if inferred:
        report.note(f"{inferred} intervals: configuration inferred from accept len / accept rate "
                    f"(assumes chains, topk 1)")



def estimate_prefill_ms(items: Sequence[tuple[Sample, float, float]], min_rows: int = 8
                        ) -> Optional[tuple[float, float]]:
    """(ms per prefill batch, ms per 1k new tokens) hidden in interval step times.

    A decode-log interval's wall time also holds the prefill batches run inside it. Within one
    (configuration, batch size) cell the decode step time is the same, so the spread of step_ms
    against prefill work per step gives its cost: least squares on cell-demeaned values
    (fixed effects), coefficients kept non-negative. None when there is too little variation.
    """
    cells: dict[tuple, list[tuple[float, float, float]]] = {}
    for s, x1, x2 in items:
        cells.setdefault((tuple(s.config), s.batch_size), []).append((float(s.step_ms), x1, x2))  # type: ignore[arg-type]
    rows = []
    for vals in cells.values():
        if len(vals) < 3:
            continue
        a = np.asarray(vals, dtype=float)
        rows.append(a - a.mean(axis=0))
    if not rows:
        return None
    m = np.vstack(rows)
    if len(m) < min_rows:
        return None
    y, x = m[:, 0], m[:, 1:]
    beta = np.zeros(2)
    for cols in ((0, 1), (0,), (1,)):
        xs = x[:, cols]
        if np.linalg.matrix_rank(xs) < len(cols) or float((xs ** 2).sum()) <= 0:
            continue
        b, *_ = np.linalg.lstsq(xs, y, rcond=None)
        if (b >= 0).all():
            beta[list(cols)] = b
            break
    else:
        return None
    return float(beta[0]), float(beta[1])


