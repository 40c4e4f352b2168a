"""What every input reader shares: the per-file `FileReport`, line iteration over plain or gzip files
(damage reported, what precedes it kept), and the detection of a file's format."""

from __future__ import annotations

import gzip
import json
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional


from ..policies.table import Config
FORMATS = ("telemetry", "sglang-log", "bench-serving")
MAX_EXAMPLES = 5  # line-numbered examples kept per skip reason
MAX_LINE_BYTES = 64 * 1024 * 1024  # a "line" longer than this is garbage, skipped unread
_SNIFF_BYTES = 256 * 1024
_EXCERPT = 160

Progress = Callable[[int], None]  # called with the number of input bytes consumed since last call


# ---------------------------------------------------------------------------------------------
# report


@dataclass
class BenchPoint:
    """One bench_serving run: what was measured, for 'best measured configuration' decisions."""

    config: Config
    concurrency: int
    output_throughput: float  # tokens/s over the run, as bench_serving measured it
    path: str
    line: int


@dataclass
class FileReport:
    path: str
    format: str = "unknown"
    num_lines: int = 0
    num_used: int = 0  # lines that produced a sample (or a bench point)
    num_samples: int = 0
    num_ignored: int = 0  # lines that carry nothing for training (other log lines, blanks)
    skipped: Counter = field(default_factory=Counter)  # reason -> lines
    examples: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # file-level: unreadable, truncated, unknown
    notes: list[str] = field(default_factory=list)
    bench_points: list[BenchPoint] = field(default_factory=list)

    def skip(self, line: int, reason: str, text: str = "", detail: str = "") -> None:
        """Count a skipped line under a fixed `reason`; `detail` (this line's particulars) goes
        with the example only, so reasons stay few."""
        self.skipped[reason] += 1
        ex = self.examples.setdefault(reason, [])
        if len(ex) < MAX_EXAMPLES:
            t = text.strip()
            if detail:
                t = f"[{detail}] {t}"
            ex.append((line, t if len(t) <= _EXCERPT else t[:_EXCERPT] + "…"))

    def note(self, text: str) -> None:
        if text not in self.notes and len(self.notes) < 50:
            self.notes.append(text)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def to_obj(self) -> dict[str, Any]:
        return {
            "path": self.path, "format": self.format, "lines": self.num_lines,
            "used": self.num_used, "samples": self.num_samples, "ignored": self.num_ignored,
            "skipped": dict(self.skipped),
            "examples": {k: [list(e) for e in v] for k, v in self.examples.items()},
            "problems": list(self.problems), "notes": list(self.notes),
            "bench_points": len(self.bench_points),
        }


# ---------------------------------------------------------------------------------------------
# raw lines (plain or gzip), with damage reported instead of raised


def _open(path: Path):
    raw = open(path, "rb")
    if raw.read(2) == b"\x1f\x8b":
        raw.seek(0)
        return raw, gzip.GzipFile(fileobj=raw, mode="rb")
    raw.seek(0)
    return raw, raw


def iter_lines(path: Path, report: FileReport, progress: Optional[Progress] = None
               ) -> Iterator[tuple[int, str]]:
    """(line number, text) for every line; gzip is detected by its magic bytes. A truncated or
    corrupt gzip stream ends the file with a problem in the report, keeping what came before."""
    lineno = 0
    last_pos = 0
    try:
        raw, f = _open(path)
    except OSError as e:
        report.problems.append(f"cannot open: {e.strerror or e}")
        return
    try:
        while True:
            try:
                chunk = f.readline(MAX_LINE_BYTES)
            except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
                where = f"after line {lineno}" if lineno else "before the first line"
                kind = "truncated" if isinstance(e, EOFError) else "corrupt"
                report.problems.append(f"gzip stream {kind} {where} ({type(e).__name__}: {e}); "
                                       f"lines before it were used")
                return
            if not chunk:
                return
            lineno += 1
            if len(chunk) >= MAX_LINE_BYTES and not chunk.endswith(b"\n"):
                report.skip(lineno, "line_too_long", f"over {MAX_LINE_BYTES} bytes")
                try:
                    while True:  # drain the rest of that line
                        more = f.readline(MAX_LINE_BYTES)
                        if not more or more.endswith(b"\n"):
                            break
                except (EOFError, gzip.BadGzipFile, zlib.error, OSError):
                    report.problems.append(f"gzip stream damaged inside line {lineno}")
                    return
                continue
            if progress is not None and lineno % 512 == 0:
                pos = raw.tell()
                progress(pos - last_pos)
                last_pos = pos
            yield lineno, chunk.decode("utf-8", errors="replace").rstrip("\r\n")
    finally:
        report.num_lines = lineno
        if progress is not None:
            try:
                pos = raw.tell()
                progress(max(0, pos - last_pos))
            except (OSError, ValueError):
                pass
        try:
            f.close()
            raw.close()
        except OSError:
            pass


# ---------------------------------------------------------------------------------------------
# format detection

# SGLang's logging prefix: `[%(asctime)s{.ms}{ DPx PPy ATTN_CPz MOE_DPw TPv EPu}] msg`, optionally
# behind a Ray actor tag `(SchedulerActor pid=123, ip=...)`. The rank tags' order changed between
# versions (0.5.23: DP PP ATTN_CP MOE_DP TP EP), so any sequence of NAME<digits> tags is accepted.
_PREFIX = re.compile(
    r"^(?:\((?P<actor>\w+) pid=(?P<pid>\d+)(?:,\s*ip=[\d.]+)?\)\s*)?"
    r"\[(?P<date>\d{4}-\d{2}-\d{2}) (?P<time>\d{2}:\d{2}:\d{2})(?:[.,](?P<frac>\d{1,6}))?"
    r"(?P<tags>(?:\s+[A-Z][A-Z_]*\d+)*)\]\s?(?P<msg>.*)$"
)
# an SGLang decode-log line's message (its fields: sglang_log)
_DECODE = re.compile(r"^Decode batch(?: \[(?P<iter>\d+)\])?, #running-req: (?P<running>\d+), (?P<rest>.*)$")


def _json_obj(text: str) -> Optional[dict]:
    t = text.strip()
    if not t.startswith("{"):
        return None
    try:
        obj = json.loads(t)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
        return None
    return obj if isinstance(obj, dict) else None


def _is_bench(obj: dict) -> bool:
    return "output_throughput" in obj and ("max_concurrency" in obj or "median_tpot_ms" in obj)


def detect_format(path: Path) -> tuple[str, Optional[str]]:
    """(format, problem): format is one of FORMATS or "unknown"; problem says why it is unknown."""
    try:
        raw, f = _open(path)
    except OSError as e:
        return "unknown", f"cannot open: {e.strerror or e}"
    head = b""
    try:
        try:
            while len(head) < _SNIFF_BYTES:
                # small reads: a truncated gzip stream still yields what precedes the damage
                chunk = f.read(min(8192, _SNIFF_BYTES - len(head)))
                if not chunk:
                    break
                head += chunk
        except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
            if not head:
                return "unknown", f"not a readable gzip stream ({type(e).__name__}: {e})"
    finally:
        f.close()
        raw.close()
    if not head.strip():
        return "unknown", "empty file"
    votes: Counter = Counter()
    lines = head.decode("utf-8", errors="replace").splitlines()
    if len(head) >= _SNIFF_BYTES and len(lines) > 1:
        lines = lines[:-1]  # the last one is probably cut by the sniff window
    for text in lines[:400]:
        if not text.strip():
            continue
        obj = _json_obj(text)
        if obj is not None:
            if obj.get("kind") in ("step", "policy"):
                votes["telemetry"] += 1
            elif _is_bench(obj):
                votes["bench-serving"] += 1
            continue
        if _PREFIX.match(text):
            votes["sglang-log"] += 1
        elif "Decode batch" in text and _DECODE.match(text[text.index("Decode batch"):]):
            votes["sglang-log"] += 1  # a custom logging format
    if not votes:
        if len(lines) == 1 and lines[0].lstrip().startswith("{") and len(head) >= _SNIFF_BYTES:
            # one huge JSON line (bench_serving --output-details): decide on its keys
            if '"output_throughput"' in lines[0] and '"max_concurrency"' in lines[0]:
                return "bench-serving", None
        return "unknown", ("no SGLang log lines, bench_serving results or specctl telemetry "
                           "records in the first lines")
    return votes.most_common(1)[0][0], None


