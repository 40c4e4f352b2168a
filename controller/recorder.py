"""`specctl serve --record DIR`: accepted telemetry frames as rotating gzip JSONL, bounded on disk.

    DIR/telemetry-20261129T120000Z-000007.jsonl.gz.part   being written (never read by train)
    DIR/telemetry-20261129T115500Z-000006.jsonl.gz        finalised: closed, fsynced, renamed
    ...                                                   oldest finalised files deleted first

One line per frame, exactly the telemetry line format of docs/architecture.md (`specctl train` and
`specctl replay` read the files). A file is finalised before it would exceed `rotate_bytes` on
disk, and on `close()`; before each new file, the oldest finalised files are deleted until they
and one full new file fit in `max_bytes`, so the directory never holds more than that. The daemon's ingest loop calls `write`, so it never
raises: disk errors drop the frame and are counted.
"""

from __future__ import annotations

import gzip
import logging
import os
import re
import time
from pathlib import Path
from typing import Callable, Optional

log = logging.getLogger("specctl.recorder")

SUFFIX = ".jsonl.gz"
PART = ".part"
DEFAULT_MAX_BYTES = 1024 * 1024 * 1024
DEFAULT_ROTATE_BYTES = 64 * 1024 * 1024
_OVERHEAD = 1024  # gzip header, trailer, final and flush blocks: generous
_NAME = re.compile(r"^(?P<prefix>.+)-(?P<stamp>\d{8}T\d{6}Z)-(?P<seq>\d{6,})\.jsonl\.gz(?P<part>\.part)?$")


class Recorder:
    """Write frames (bytes, one record each) to rotating compressed files in `directory`.

    `flush_s`: a gzip sync-flush at most this often, so a crash loses little and the `.part`
    file stays readable up to there. Files left as `.part` by a crash are finalised at start-up.
    """

    def __init__(self, directory: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES,
                 rotate_bytes: Optional[int] = None, prefix: str = "telemetry",
                 flush_s: float = 5.0, compresslevel: int = 6,
                 clock: Callable[[], float] = time.time):
        if rotate_bytes is None:
            rotate_bytes = min(DEFAULT_ROTATE_BYTES, max(4096, max_bytes // 8))
        if rotate_bytes < 4096 or max_bytes < rotate_bytes:
            raise ValueError(f"need 4096 <= rotate_bytes ({rotate_bytes}) <= max_bytes ({max_bytes})")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = int(max_bytes)
        self.rotate_bytes = int(rotate_bytes)
        self.prefix = prefix
        self.flush_s = flush_s
        self.compresslevel = compresslevel
        self.clock = clock
        self.num_written = 0
        self.num_dropped = 0
        self.num_files = 0  # finalised by this recorder
        self.num_deleted = 0
        self.last_error: Optional[str] = None
        self._raw = None
        self._gz: Optional[gzip.GzipFile] = None
        self._path: Optional[Path] = None
        self._last_flush = 0.0
        self._pending = 0  # uncompressed bytes written since the last sync-flush
        self._closed = False
        self._seq = 1 + max((s for s, _ in self._existing()), default=0)
        self._recover()

    # ------------------------------------------------------------------ public

    def write(self, frame: bytes) -> None:
        if self._closed:
            self.num_dropped += 1
            return
        line = frame.rstrip(b"\r\n")
        if not line or b"\n" in line:
            # a raw newline inside a frame would split it into two broken lines
            self.num_dropped += 1
            return
        n = len(line) + 1
        if n + _OVERHEAD > self.rotate_bytes:
            self.num_dropped += 1  # could never fit in one file
            return
        try:
            if self._gz is not None and self._size_bound() + n > self.rotate_bytes:
                self._finalise()
            if self._gz is None:
                self._open_new()
            assert self._gz is not None and self._raw is not None
            self._gz.write(line + b"\n")
            self._pending += n
            self.num_written += 1
            now = self.clock()
            # a sync-flush makes the on-disk size exact again (compressed output never exceeds
            # its input by more than _OVERHEAD) and bounds what a crash can lose
            if now - self._last_flush >= self.flush_s or self._pending > self.rotate_bytes // 8:
                self._gz.flush()
                self._pending = 0
                self._last_flush = now
        except OSError as e:
            self._fail(e)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._finalise()
        except OSError as e:
            self._fail(e)
        self._closed = True

    def files(self) -> list[Path]:
        """Finalised files, oldest first."""
        return [p for _, p in sorted(self._existing()) if not p.name.endswith(PART)]

    def disk_bytes(self) -> int:
        total = 0
        for _, p in self._existing():
            try:
                total += p.stat().st_size
            except OSError:
                pass
        return total

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _size_bound(self) -> int:
        """An upper bound of the current file's size once closed."""
        assert self._raw is not None
        return self._raw.tell() + self._pending + _OVERHEAD

    def _existing(self) -> list[tuple[int, Path]]:
        out = []
        try:
            entries = list(self.dir.iterdir())
        except OSError:
            return out
        for p in entries:
            m = _NAME.match(p.name)
            if m and m.group("prefix") == self.prefix:
                out.append((int(m.group("seq")), p))
        return out

    def _recover(self) -> None:
        """Finalise `.part` files a crashed daemon left: they are gzip streams cut at the last
        sync-flush, which readers report as truncated but still read."""
        for _, p in sorted(self._existing()):
            if p.name.endswith(PART):
                try:
                    os.replace(p, p.with_name(p.name[: -len(PART)]))
                except OSError as e:
                    log.warning("cannot finalise %s: %s", p, e)

    def _open_new(self) -> None:
        self._make_room()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.clock()))
        path = self.dir / f"{self.prefix}-{stamp}-{self._seq:06d}{SUFFIX}{PART}"
        self._seq += 1
        raw = open(path, "xb")
        try:
            gz = gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=self.compresslevel,
                               mtime=0)
        except Exception:
            raw.close()
            raise
        self._raw, self._gz, self._path = raw, gz, path
        self._pending = 0
        self._last_flush = self.clock()

    def _finalise(self) -> None:
        gz, raw, path = self._gz, self._raw, self._path
        self._gz = self._raw = self._path = None
        if gz is None or raw is None or path is None:
            return
        try:
            gz.close()
            raw.flush()
            os.fsync(raw.fileno())
        finally:
            raw.close()
        final = path.with_name(path.name[: -len(PART)])
        os.replace(path, final)
        _fsync_dir(self.dir)
        self.num_files += 1

    def _make_room(self) -> None:
        """Delete the oldest finalised files until they and one new file fit in max_bytes."""
        done = sorted((s, p) for s, p in self._existing() if not p.name.endswith(PART))
        sizes = []
        for s, p in done:
            try:
                sizes.append((s, p, p.stat().st_size))
            except OSError:
                pass
        total = sum(sz for _, _, sz in sizes)
        budget = self.max_bytes - self.rotate_bytes
        for _, p, sz in sizes:
            if total <= budget:
                break
            try:
                p.unlink()
                self.num_deleted += 1
                total -= sz
            except FileNotFoundError:
                total -= sz
            except OSError as e:
                log.warning("cannot delete %s: %s", p, e)

    def _fail(self, e: OSError) -> None:
        self.num_dropped += 1
        msg = f"{type(e).__name__}: {e}"
        if msg != self.last_error:
            log.warning("recording telemetry failed (%s); frames are dropped until a new file opens",
                        msg)
        self.last_error = msg
        # abandon the current file; the next write starts a new one
        gz, raw, path = self._gz, self._raw, self._path
        self._gz = self._raw = self._path = None
        for f in (gz, raw):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass
        if path is not None:
            try:
                os.replace(path, path.with_name(path.name[: -len(PART)]))
            except OSError:
                pass


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
