"""Durable daemon state: the current policy and the cost model, written atomically.

Each file is written to a temporary name, fsynced, and renamed over the live one after the live
one has been kept as `<name>.prev`; a file that does not parse (torn or truncated by hand) is
reported and the previous good copy is used instead.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

from . import wire
from .transport import PidLock

log = logging.getLogger("specctl.state")

POLICY_FILE = "policy.json"
MODEL_FILE = "model.json"
LOCK_FILE = "serve.lock"


def state_lock(directory: str | os.PathLike[str]) -> PidLock:
    """The lock `specctl serve` holds on its state dir for as long as it runs."""
    return PidLock(Path(directory) / LOCK_FILE, f"state dir {directory}")


def atomic_write(path: Path, data: bytes, *, keep_prev: bool = True) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    if keep_prev and path.exists():
        prev = path.with_name(path.name + ".prev")
        try:
            # the live file must parse before it becomes the fallback copy
            json.loads(path.read_bytes())
            os.replace(path, prev)
        except (ValueError, OSError):
            pass
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _remove_stale_tmp(directory: Path, names: tuple[str, ...]) -> int:
    """Temporary files left by a writer that was killed mid-write (its pid is gone): without
    this, every crash during a write would leave one behind for good."""
    removed = 0
    for name in names:
        for tmp in directory.glob(f".{name}.tmp.*"):
            try:
                pid = int(tmp.name.rsplit(".", 1)[1])
            except ValueError:
                continue
            if pid == os.getpid() or _alive(pid):
                continue
            try:
                tmp.unlink()
                removed += 1
            except OSError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


class StateStore:
    def __init__(self, directory: str | os.PathLike[str]):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.problems: list[str] = []  # what was wrong with files found at load time
        self.num_stale_tmp_removed = _remove_stale_tmp(self.dir, (POLICY_FILE, MODEL_FILE))

    # policy ---------------------------------------------------------------

    def save_policy(self, policy: wire.PolicyRecord) -> None:
        atomic_write(self.dir / POLICY_FILE, wire.encode(policy))

    def load_policy(self) -> Optional[wire.PolicyRecord]:
        for name in (POLICY_FILE, POLICY_FILE + ".prev"):
            p = self.dir / name
            if not p.exists():
                continue
            try:
                return wire.decode_policy(p.read_bytes())
            except (wire.WireError, OSError) as e:
                msg = f"{p}: unusable ({e}); trying the previous copy"
                self.problems.append(msg)
                log.warning(msg)
        return None

    # model ----------------------------------------------------------------

    def save_model(self, state: dict[str, Any]) -> None:
        atomic_write(self.dir / MODEL_FILE, json.dumps(state, separators=(",", ":")).encode())

    def load_model(self) -> Optional[dict[str, Any]]:
        for name in (MODEL_FILE, MODEL_FILE + ".prev"):
            p = self.dir / name
            if not p.exists():
                continue
            try:
                obj = json.loads(p.read_bytes())
                if not isinstance(obj, dict) or obj.get("kind") != "specctl.model":
                    raise ValueError("not a specctl model state")
                return obj
            except (ValueError, OSError) as e:
                msg = f"{p}: unusable ({e}); trying the previous copy"
                self.problems.append(msg)
                log.warning(msg)
        return None
