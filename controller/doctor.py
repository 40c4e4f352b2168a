"""`specctl doctor`: is specctl working? Per server and TP rank, from SGLang server logs (the
plugin's `specctl:` lines) and a daemon's status reply; problems found decide the exit code."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Optional

# SGLang's prefix: "[2026-11-30 12:00:30 TP1] " or "[2026-11-30 12:00:30.123 DP0 TP1 EP1] ", or no
# parallelism tag on a single GPU ("[2026-11-30 12:00:30] ")
PREFIX = re.compile(r"^\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)(?P<tags>(?: [A-Z]+\d+)*)\] (?P<msg>.*)$")
TP_TAG = re.compile(r"\bTP(\d+)\b")

STARTUP = re.compile(r"^startup (?P<json>\{.*\})\s*$")
PATCH_OFF = re.compile(r"^patch (?P<name>[\w.-]+) off: (?P<reason>.*)$")
POLICY = re.compile(r"^policy v(?P<version>\d+) \((?P<source>[\w-]+)\) in force from decode step (?P<step>\d+)")
FALLBACK = re.compile(r"^fixed-threshold fallback \((?P<table>[^)]*)\) from decode step (?P<step>\d+): (?P<reason>.*)$")
# lines of plugin versions that predate the start-up line
OLD_HOOKS_OK = re.compile(r"^all (?P<n>\d+) hooks in place")
OLD_HOOK_MISSING = re.compile(r"^hook on (?P<target>\S+) did not take effect")
OLD_READY = re.compile(r"^engine ready on TP rank (?P<rank>\d+)/(?P<world>\d+), mode (?P<mode>\w+)")
OLD_DECODE_STATE = re.compile(r"^decode state built")
OLD_NO_DECODE_STATE = re.compile(r"^(?:no decode state|decode state OFF)[,:]? ?(?P<reason>.*)$")
NOT_INSTALLED = re.compile(r"^not installed, bad settings: (?P<reason>.*)$")
UNVERIFIED = re.compile(r"^(?P<reason>cannot read SGLang's hook registry.*): hooks unverified")
INERT = re.compile(r"^SPECCTL_MODE=off, plugin inert")

# the patch whose state says which "speculation off" runs: the plugin's decode state, or SGLang's verify
OFF_PATH_PATCH = "plain_decode"

PROBLEM, WARNING, NOTE = "problem", "warning", "note"

RULES = """\
Problems (exit 1):
  - the daemon does not answer on its status endpoint
  - the daemon has had no telemetry from any server, or a server has been silent for --stale-after s
  - the daemon's refits raise (its policy no longer follows the telemetry)
  - a log has no `specctl:` line (the plugin did not load), or says the plugin is not installed
  - a rank's hooks did not all take effect, or could not be checked
  - fewer ranks started than the TP size says (a worker that did not finish starting)
  - the ranks of a server disagree (TP size, mode, patch states, or the policy in force at the end)
  - a patch was turned off after start-up (an internal failure; the step went to SGLang's own path)
  - the fixed-threshold fallback is in force at the end of the log (the reason is shown)
Warnings (exit 0): a patch off from start-up, a log from a plugin without the start-up line,
  telemetry frames rejected or shed by the daemon, CURVE clients refused, both off paths seen."""


@dataclass
class Finding:
    level: str  # PROBLEM, WARNING or NOTE
    where: str
    text: str


@dataclass
class RankState:
    """What one TP rank's log lines say, the last word on each subject winning."""

    server: str
    rank: int
    world_size: Optional[int] = None
    sglang: Optional[str] = None
    mode: Optional[str] = None
    startup_line: bool = False
    ready_line: bool = False
    hooks_missing: Optional[list[str]] = None  # None: not said
    hooks_in_place: Optional[int] = None  # old plugins: "all N hooks in place"
    hooks_unverified: Optional[str] = None
    patches: dict[str, str] = field(default_factory=dict)  # name -> "on" | "check" | "off: why"
    turned_off: dict[str, str] = field(default_factory=dict)  # after start-up: name -> why
    off_path: Optional[str] = None  # "decode" | "verify"
    off_path_why: Optional[str] = None
    policy_version: Optional[int] = None
    policy_source: Optional[str] = None
    fallback_reason: Optional[str] = None
    policy_since: Optional[datetime] = None
    policy_step: Optional[int] = None
    not_installed: Optional[str] = None
    inert: bool = False

    @property
    def name(self) -> str:
        world = f"/{self.world_size}" if self.world_size else ""
        return f"{self.server} TP{self.rank}{world}"


@dataclass
class LogReport:
    path: str
    num_lines: int = 0
    num_specctl_lines: int = 0
    first_ts: Optional[datetime] = None
    last_ts: Optional[datetime] = None
    ranks: dict[tuple[str, int], RankState] = field(default_factory=dict)
    bad_lines: list[str] = field(default_factory=list)


def _ts(text: str) -> Optional[datetime]:
    for fmt in ("%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S"):
        try:
            return datetime.strptime(text, fmt)
        except ValueError:
            pass
    return None


def parse_log(lines: Iterable[str], path: str = "server.log", server: Optional[str] = None) -> LogReport:
    """Read an SGLang server log's `specctl:` lines. `server`: the name for ranks whose lines do
    not say it (plugins without the start-up line); default: the log file's name."""
    rep = LogReport(path=path)
    default_server = server or Path(path).name
    rank_server: dict[int, str] = {}  # the server a rank's start-up line named
    for raw in lines:
        rep.num_lines += 1
        m = PREFIX.match(raw.rstrip("\r\n"))
        if not m:
            continue
        ts = _ts(m.group("ts"))
        if ts is not None:
            rep.first_ts = rep.first_ts or ts
            rep.last_ts = ts
        msg = m.group("msg")
        if not msg.startswith("specctl: "):
            continue
        rep.num_specctl_lines += 1
        msg = msg[len("specctl: "):]
        tag = TP_TAG.search(m.group("tags") or "")
        rank = int(tag.group(1)) if tag else None

        if sm := STARTUP.match(msg):
            try:
                obj = json.loads(sm.group("json"))
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                rep.bad_lines.append(f"unreadable start-up line ({e}): {msg[:120]}")
                continue
            r = int(obj.get("rank", rank or 0)) if rank is None else rank
            srv = str(obj.get("server") or default_server)
            rank_server[r] = srv
            st = rep.ranks[(srv, r)] = RankState(server=srv, rank=r)  # a restart starts afresh
            st.startup_line = True
            st.world_size = _int(obj.get("world_size"))
            st.sglang = obj.get("sglang")
            st.mode = obj.get("mode")
            hm = obj.get("hooks_missing")
            st.hooks_missing = [str(h) for h in hm] if isinstance(hm, list) else None
            patches = obj.get("patches") if isinstance(obj.get("patches"), dict) else {}
            st.patches = {str(k): str(v) for k, v in patches.items()}
            if OFF_PATH_PATCH in st.patches:
                state = st.patches[OFF_PATH_PATCH]
                st.off_path = "verify" if state.startswith("off") else "decode"
                st.off_path_why = state[len("off: "):] if state.startswith("off: ") else None
            pol = obj.get("policy") if isinstance(obj.get("policy"), dict) else {}
            st.policy_source = pol.get("source")
            st.policy_version = _int(pol.get("version"))
            st.fallback_reason = pol.get("fallback_reason")
            st.policy_since = ts
            if st.mode == "off":
                st.inert = True
            continue

        if rank is None:
            if om := OLD_READY.match(msg):
                rank = int(om.group("rank"))
            else:
                rank = 0
        srv = rank_server.get(rank, default_server)
        st = rep.ranks.get((srv, rank))
        if st is None:
            st = rep.ranks[(srv, rank)] = RankState(server=srv, rank=rank)

        if pm := PATCH_OFF.match(msg):
            st.turned_off.setdefault(pm.group("name"), pm.group("reason"))
            if pm.group("name") == OFF_PATH_PATCH:
                st.off_path, st.off_path_why = "verify", pm.group("reason")
        elif pm := POLICY.match(msg):
            st.policy_version, st.policy_source = int(pm.group("version")), pm.group("source")
            st.fallback_reason, st.policy_since, st.policy_step = None, ts, int(pm.group("step"))
        elif fm := FALLBACK.match(msg):
            st.policy_version, st.policy_source = None, "fallback"
            st.fallback_reason, st.policy_since, st.policy_step = fm.group("reason"), ts, int(fm.group("step"))
        elif om := OLD_READY.match(msg):
            st.ready_line = True
            st.world_size = st.world_size or int(om.group("world"))
            st.mode = st.mode or om.group("mode")
        elif hm := OLD_HOOKS_OK.match(msg):
            st.hooks_in_place = int(hm.group("n"))
            if st.hooks_missing is None:
                st.hooks_missing = []
        elif hm := OLD_HOOK_MISSING.match(msg):
            if not st.startup_line:
                st.hooks_missing = (st.hooks_missing or []) + [hm.group("target")]
        elif OLD_DECODE_STATE.match(msg):
            if st.off_path is None:
                st.off_path = "decode"
        elif nm := OLD_NO_DECODE_STATE.match(msg):
            if not st.startup_line or st.off_path != "verify":
                st.off_path, st.off_path_why = "verify", nm.group("reason") or None
        elif nm := NOT_INSTALLED.match(msg):
            st.not_installed = nm.group("reason")
        elif um := UNVERIFIED.match(msg):
            st.hooks_unverified = um.group("reason")
        elif INERT.match(msg):
            st.inert, st.mode = True, "off"
    return rep


def _int(v: Any) -> Optional[int]:
    try:
        return None if v is None else int(v)
    except (TypeError, ValueError):
        return None


def read_log(path: str | Path, server: Optional[str] = None) -> LogReport:
    with open(path, encoding="utf-8", errors="replace") as f:
        return parse_log(f, str(path), server)


# ------------------------------------------------------------------------------------ checks


def _age(since: Optional[datetime], end: Optional[datetime]) -> str:
    if since is None:
        return ""
    s = f" since {since:%H:%M:%S}"
    if end is not None:
        s += f" ({_duration((end - since).total_seconds())} before the log's last line)"
    return s


def _duration(s: float) -> str:
    s = max(0.0, s)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _hooks(st: RankState) -> str:
    if st.hooks_unverified:
        return "hooks unverified"
    if st.hooks_missing is None:
        return "hooks not reported"
    if st.hooks_missing:
        return f"hooks MISSING: {', '.join(_short_target(t) for t in st.hooks_missing)}"
    return f"all {st.hooks_in_place} hooks in place" if st.hooks_in_place else "hooks in place"


def _short_target(target: str) -> str:
    return ".".join(target.split(".")[-2:])


def _policy(st: RankState, end: Optional[datetime]) -> str:
    if st.policy_source == "fallback":
        return f"FALLBACK in force{_age(st.policy_since, end)}"
    if st.policy_version is not None:
        return f"policy v{st.policy_version} ({st.policy_source}) in force{_age(st.policy_since, end)}"
    if st.policy_source:
        return f"policy source {st.policy_source}"
    return "no policy line yet"


def check_log(rep: LogReport) -> tuple[list[str], list[Finding]]:
    """Lines to print for this log (one per rank), and what is wrong."""
    out: list[str] = []
    found: list[Finding] = []
    where = Path(rep.path).name
    if rep.num_specctl_lines == 0:
        found.append(Finding(PROBLEM, where, f"no 'specctl:' line in {rep.num_lines} lines: the plugin did not load "
                                             "(is specctl installed in the server's Python, and the server launched "
                                             "with the `specctl sglang-args` flags?)"))
        return [f"  (no specctl lines in {rep.num_lines} lines)"], found
    for line in rep.bad_lines:
        found.append(Finding(WARNING, where, line))
    by_server: dict[str, list[RankState]] = {}
    for (srv, _), st in sorted(rep.ranks.items()):
        by_server.setdefault(srv, []).append(st)
    for srv, ranks in by_server.items():
        rank_found: list[Finding] = []
        for st in ranks:
            out.append("  " + _rank_line(st, rep.last_ts))
            rank_found += _rank_findings(st, where, rep.last_ts)
        found += _merge_ranks(rank_found, srv) + _server_findings(srv, ranks, where)
    return out, found


def _rank_line(st: RankState, end: Optional[datetime]) -> str:
    if st.not_installed:
        return f"{st.name}: plugin NOT installed: {st.not_installed}"
    if st.inert:
        return f"{st.name}: plugin loaded, inert (SPECCTL_MODE=off)"
    facts = [f for f in (f"sglang {st.sglang}" if st.sglang else "", st.mode or "",
                         "" if st.startup_line else "plugin version without startup line") if f]
    parts = [f"{st.name}: loaded" + (f" ({', '.join(facts)})" if facts else ""), _hooks(st)]
    if st.off_path:
        parts.append(f"off path {st.off_path}")
    on = sorted(k for k, v in st.patches.items() if not v.startswith("off") and k not in st.turned_off)
    off = sorted(k for k, v in st.patches.items() if v.startswith("off") and k not in st.turned_off)
    if on or off or st.turned_off:
        cells = [f"on: {', '.join(on)}" if on else "", f"off: {', '.join(off)}" if off else "",
                 f"TURNED OFF: {', '.join(sorted(st.turned_off))}" if st.turned_off else ""]
        parts.append("patches " + "; ".join(c for c in cells if c))
    parts.append(_policy(st, end))
    return "; ".join(parts)


def _rank_findings(st: RankState, where: str, end: Optional[datetime]) -> list[Finding]:
    w = f"{where}: {st.name}"
    found = []
    if st.not_installed:
        found.append(Finding(PROBLEM, w, f"plugin not installed: {st.not_installed}"))
        return found
    if st.inert:
        return [Finding(NOTE, w, "plugin inert (SPECCTL_MODE=off): SGLang's own policy decides")]
    if not st.startup_line:
        found.append(Finding(WARNING, w, "plugin version without startup line: patches and hooks read from older lines"))
    if st.hooks_unverified:
        found.append(Finding(PROBLEM, w, f"hooks unverified: {st.hooks_unverified}"))
    elif st.hooks_missing:
        found.append(Finding(PROBLEM, w, f"hooks did not take effect: {', '.join(st.hooks_missing)}"))
    for name, why in st.turned_off.items():
        found.append(Finding(PROBLEM, w, f"patch {name} turned off after start-up: {why}"))
    for name, state in st.patches.items():
        if state.startswith("off") and name not in st.turned_off:
            found.append(Finding(WARNING, w, f"patch {name} {state}"))
    if st.policy_source == "fallback":
        found.append(Finding(PROBLEM, w, f"fixed-threshold fallback in force{_age(st.policy_since, end)}: "
                                         f"{st.fallback_reason}"))
    return found


def _server_findings(srv: str, ranks: list[RankState], where: str) -> list[Finding]:
    found = []
    w = f"{where}: {srv}"
    worlds = {st.world_size for st in ranks if st.world_size}
    if len(worlds) > 1:
        found.append(Finding(PROBLEM, w, f"ranks disagree on the TP size: {sorted(worlds)}"))
    elif worlds:
        world = worlds.pop()
        started = {st.rank for st in ranks if st.startup_line or st.ready_line}
        missing = sorted(set(range(world)) - started)
        if missing:
            found.append(Finding(PROBLEM, w, f"TP size {world} but no start-up line from rank(s) "
                                             f"{', '.join(map(str, missing))} (a worker that did not finish starting?)"))
    live = [st for st in ranks if not st.not_installed]
    if len(live) > 1:
        def patch_state(st: RankState, name: str) -> str:
            v = st.patches.get(name, "not reported")
            return "off" if name in st.turned_off or v.startswith("off") else v

        for name in sorted({k for st in live for k in st.patches} | {k for st in live for k in st.turned_off}):
            seen = {st.rank: patch_state(st, name) for st in live}
            if len(set(seen.values())) > 1:
                found.append(Finding(PROBLEM, w, f"ranks disagree on patch {name}: "
                                                 + ", ".join(f"TP{r} {v}" for r, v in sorted(seen.items()))))
        for what, get in (("mode", lambda s: str(s.mode)),
                          ("policy in force at the end",
                           lambda s: f"v{s.policy_version} ({s.policy_source})" if s.policy_version is not None
                           else str(s.policy_source))):
            seen = {st.rank: get(st) for st in live}
            if len(set(seen.values())) > 1:
                found.append(Finding(PROBLEM, w, f"ranks disagree on the {what}: "
                                                 + ", ".join(f"TP{r} {v}" for r, v in sorted(seen.items()))))
    return found


def _merge_ranks(found: list[Finding], server: str) -> list[Finding]:
    """One finding for the ranks of a server that say the same thing ('sglang-a TP0,TP1/2: ...')."""
    merged: dict[tuple[str, str, str], list[str]] = {}
    for f in found:
        head, _, rank = f.where.rpartition(f"{server} ")
        merged.setdefault((f.level, head, f.text), []).append(rank)
    out = []
    for (level, head, text), ranks in merged.items():
        world = ranks[0].partition("/")[2]
        names = ",".join(r.partition("/")[0] for r in ranks)
        out.append(Finding(level, f"{head}{server} {names}" + (f"/{world}" if world else ""), text))
    return out


def check_status(reply: dict[str, Any], endpoint: str, stale_after_s: float) -> tuple[list[str], list[Finding]]:
    """Lines to print for a daemon's status reply, and what is wrong."""
    out: list[str] = []
    found: list[Finding] = []
    d = reply.get("daemon") if isinstance(reply.get("daemon"), dict) else {}
    pol = reply.get("policy") if isinstance(reply.get("policy"), dict) else {}
    age = reply.get("policy_age_s")
    head = [f"daemon {endpoint}:"]
    if d.get("pid"):
        head.append(f"pid {d['pid']},")
    head.append(f"mode {reply.get('mode')}, up {_duration(float(reply.get('uptime_s') or 0))},")
    head.append(f"publishes policy v{pol.get('version')} ({pol.get('source')})"
                + (f", made {_duration(float(age))} ago" if isinstance(age, (int, float)) else "")
                + f"; evidence: {reply.get('evidence')}")
    out.append(" ".join(head))
    rates = d.get("records_per_s") if isinstance(d.get("records_per_s"), dict) else None
    servers = reply.get("servers") if isinstance(reply.get("servers"), dict) else {}
    if not servers:
        found.append(Finding(PROBLEM, endpoint, "no telemetry from any server yet (are the servers launched with "
                                                "SPECCTL_MODE=online and the daemon's SPECCTL_RUNDIR or endpoints?)"))
    for name, s in sorted(servers.items()):
        ago = float(s.get("last_seen_s_ago") or 0)
        rate = "rate unknown (daemon without rates)" if rates is None else (
            f"{rates[name]:.1f} records/s" if name in rates else "rate: measuring")
        offs = s.get("off_paths") or {}
        off = ", ".join(f"{k} {n}" for k, n in sorted(offs.items())) or "none yet"
        out.append(f"  server {name}: {s.get('records')} records (sent by TP rank {', '.join(map(str, s.get('ranks') or []))}), {rate}, "
                   f"last {ago:.1f} s ago; steps with speculation off by path: {off}")
        if ago > stale_after_s:
            found.append(Finding(PROBLEM, f"{endpoint}: {name}", f"no telemetry for {_duration(ago)} "
                                                                 f"(more than --stale-after {stale_after_s:g} s)"))
        if offs.get("decode") and offs.get("verify"):
            found.append(Finding(WARNING, f"{endpoint}: {name}",
                                 f"both off paths seen (decode {offs['decode']}, verify {offs['verify']}): "
                                 "the decode state went off at some point"))
    rejected = reply.get("rejected") if isinstance(reply.get("rejected"), dict) else {}
    num_rejected = sum(int(v) for v in rejected.values() if isinstance(v, (int, float)))
    out.append(f"  telemetry dropped by the daemon: {num_rejected} rejected"
               + (f" ({', '.join(f'{k} {v}' for k, v in sorted(rejected.items()))})" if rejected else "")
               + (f", {d.get('num_shed', 0)} shed{' (shedding now)' if d.get('shedding') else ''}, "
                  f"{d.get('num_clients_denied', 0)} CURVE clients refused" if d else ""))
    if num_rejected:
        found.append(Finding(WARNING, endpoint, f"{num_rejected} telemetry frames rejected: "
                                                + ", ".join(f"{k} {v}" for k, v in sorted(rejected.items()))))
    if d.get("num_shed"):
        found.append(Finding(WARNING, endpoint, f"{d['num_shed']} telemetry frames shed: the daemon fell behind"))
    if d.get("num_clients_denied"):
        found.append(Finding(WARNING, endpoint, f"{d['num_clients_denied']} CURVE clients refused (unknown keys)"))
    if d.get("num_tick_errors"):
        found.append(Finding(PROBLEM, endpoint, f"{d['num_tick_errors']} refits raised: policy v{pol.get('version')} "
                                                "stays in force (the daemon's log has the traceback)"))
    return out, found


def compare(reply: Optional[dict[str, Any]], logs: list[LogReport]) -> list[Finding]:
    """A daemon and logs of its servers, read together."""
    if not reply or not logs:
        return []
    found = []
    pol = reply.get("policy") if isinstance(reply.get("policy"), dict) else {}
    published = pol.get("version")
    servers = set(reply.get("servers") or {})
    for rep in logs:
        for (srv, rank), st in rep.ranks.items():
            if servers and srv not in servers and st.mode == "online" and st.startup_line:
                found.append(Finding(WARNING, f"{rep.path}: {st.name}",
                                     f"the daemon has no telemetry from server {srv!r} (it has: "
                                     f"{', '.join(sorted(servers))})"))
            if (isinstance(published, int) and st.policy_version is not None and st.policy_version < published
                    and st.policy_source == pol.get("source")):
                found.append(Finding(NOTE, f"{rep.path}: {st.name}",
                                     f"the log's last policy is v{st.policy_version}; the daemon publishes "
                                     f"v{published} (an older log, or the rank is not receiving)"))
    return found


def render(sections: list[tuple[str, list[str]]], findings: list[Finding]) -> str:
    lines = []
    for title, body in sections:
        lines.append(title)
        lines += body
    problems = [f for f in findings if f.level == PROBLEM]
    warnings = [f for f in findings if f.level == WARNING]
    notes = [f for f in findings if f.level == NOTE]
    for label, group in (("PROBLEM", problems), ("warning", warnings), ("note", notes)):
        for f in group:
            lines.append(f"{label}: {f.where}: {f.text}")
    lines.append(f"doctor: {len(problems)} problem(s), {len(warnings)} warning(s)"
                 + (" -- specctl is working" if not problems else ""))
    return "\n".join(lines)
