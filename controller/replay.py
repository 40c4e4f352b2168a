"""`specctl replay`: stream a telemetry recording (.jsonl or .jsonl.gz) into a daemon."""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional

import zmq

from . import transport

if TYPE_CHECKING:
    from .service import ControllerService, ServiceSettings


@dataclass
class ReplayReport:
    sent: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)  # first few, with line numbers


def iter_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rb") as f:  # type: ignore[operator]
        for i, line in enumerate(f, 1):
            yield i, line.rstrip(b"\r\n")


def replay(path: str | Path, sock: zmq.Socket, *, speed: Optional[float] = None,
           sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
           progress: Optional[Callable[[int], None]] = None) -> ReplayReport:
    """Send each JSON line as one frame. Lines that are not JSON objects are skipped and
    reported (the daemon validates the rest and counts its own rejects). With `speed`, frames
    are paced at `speed` x the recorded `ts` cadence; otherwise the socket's blocking send at the
    high-water mark paces them at the rate the daemon takes them."""
    rep = ReplayReport()
    first_ts: Optional[float] = None
    start = clock()
    try:
        for lineno, line in iter_lines(path):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deeply
                rep.skipped += 1
                if len(rep.problems) < 10:
                    rep.problems.append(f"line {lineno}: {e}")
                continue
            if speed:
                ts = obj.get("ts")
                if isinstance(ts, (int, float)):
                    if first_ts is None:
                        first_ts = float(ts)
                    due = (float(ts) - first_ts) / speed
                    ahead = due - (clock() - start)
                    if ahead > 0:
                        sleep(ahead)
            try:
                sock.send(line)
            except zmq.Again:
                rep.problems.append(f"line {lineno}: the daemon took nothing for 10 s; stopped")
                break
            rep.sent += 1
            if progress is not None and rep.sent % 10000 == 0:
                progress(rep.sent)
    except (OSError, EOFError) as e:  # truncated gzip, unreadable file
        rep.problems.append(f"{path}: stopped reading: {e}")
    return rep


def replay_to(path: str | Path, endpoint: str, *, speed: Optional[float] = None,
              ctx: Optional[zmq.Context] = None, keys: Optional[transport.CurveKeys] = None) -> ReplayReport:
    ctx = ctx or zmq.Context.instance()
    sock = transport.telemetry_blocking_push(ctx, endpoint, keys=keys)
    try:
        return replay(path, sock, speed=speed)
    finally:
        sock.close()  # keeps LINGER so queued frames are delivered


def recording_frames(paths: Iterable[str | Path]) -> list[tuple[float, bytes]]:
    """The frames of one or more recordings, in the order given, as (ts, frame) for `replay_into`. A line
    whose `ts` cannot be read carries the previous line's forward (the daemon counts and drops a malformed
    one as it would live); blank lines are left out."""
    frames: list[tuple[float, bytes]] = []
    ts = 0.0
    for path in paths:
        for _, line in iter_lines(path):
            line = line.strip()
            if not line:
                continue
            try:
                ts = float(json.loads(line).get("ts", ts))
            except (ValueError, AttributeError, TypeError, RecursionError):
                pass
            frames.append((ts, line))
    return frames


def replay_into(frames: Iterable[tuple[float, bytes]], settings: "ServiceSettings",
                refit_every_s: float = 1.0) -> "ControllerService":
    """A recording's frames, (ts, frame) in order, into an in-process ControllerService on their own
    timestamps (its clock is the frames' ts), refitted every `refit_every_s` of them as `specctl serve`
    does by default and once more a second after the last: what the daemon would have made of them."""
    from .service import ControllerService

    now = [0.0]
    svc = ControllerService(settings, clock=lambda: now[0])
    last: Optional[float] = None
    for ts, frame in frames:
        now[0] = ts
        svc.observe_frame(frame)
        if last is None or now[0] - last >= refit_every_s:
            svc.refit()
            last = now[0]
    now[0] += 1.0
    svc.refit()
    return svc

