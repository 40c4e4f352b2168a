"""The one place ZeroMQ sockets are built (engine side and daemon side).

    engine rank 0..N                      specctl serve
    PUSH  connect, NOBLOCK, SNDHWM, ---->  PULL  bind      telemetry: one frame = one step record
          LINGER 0, drop on zmq.Again
    SUB   connect, CONFLATE, drained <---  PUB   bind      policy: one frame = newest policy record
          with NOBLOCK, keeps newest                         (re-sent as a heartbeat)
    REQ   connect, RCVTIMEO, one shot -->  REP   bind      status: {"cmd": ...} -> JSON reply

Endpoints default to `ipc://` sockets inside a 0700 runtime directory, or `tcp://127.0.0.1`.
A tcp endpoint on any other interface is refused unless CURVE keys are given (or `insecure`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import zmq

DEFAULT_TELEMETRY_HWM = 10_000
DEFAULT_INGEST_HWM = 200_000


class TransportError(ValueError):
    pass


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded CURVE key material. A server needs its own pair; a client needs its own pair
    plus the server's public key. `allowed_clients` (server side) restricts who may connect."""

    public: bytes
    secret: bytes
    server_public: Optional[bytes] = None
    allowed_clients: Optional[tuple[bytes, ...]] = None


def runtime_dir(base: str | os.PathLike[str]) -> Path:
    """Create (if needed) and check a private runtime directory for ipc sockets."""
    p = Path(base)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = p.stat()
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        os.chmod(p, 0o700)
    return p


def default_endpoints(rundir: str | os.PathLike[str]) -> dict[str, str]:
    d = Path(rundir)
    return {
        "telemetry": f"ipc://{d / 'telemetry.sock'}",
        "publish": f"ipc://{d / 'policy.sock'}",
        "status": f"ipc://{d / 'status.sock'}",
    }


def check_endpoint(endpoint: str, *, keys: Optional[CurveKeys] = None, insecure: bool = False) -> Optional[str]:
    """Return why `endpoint` must not be used, or None. Loopback and ipc need no keys."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return None
    if not endpoint.startswith("tcp://"):
        return f"unsupported endpoint {endpoint!r}: use ipc://PATH or tcp://HOST:PORT"
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass  # '*', a hostname or an interface name: reachable from other hosts
    if keys is None and not insecure:
        return (
            f"{endpoint} is reachable from other hosts: give CURVE keys (specctl keys generate) "
            "or pass --insecure explicitly"
        )
    return None


def _prepare_ipc(endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        path = Path(endpoint[len("ipc://"):])
        runtime_dir(path.parent)
        if path.exists() and path.is_socket():
            path.unlink()  # stale socket from a killed daemon


def _secure_server(sock: zmq.Socket, keys: Optional[CurveKeys]) -> None:
    if keys is None:
        return
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def _secure_client(sock: zmq.Socket, keys: Optional[CurveKeys]) -> None:
    if keys is None:
        return
    if keys.server_public is None:
        raise TransportError("a CURVE client needs the server's public key")
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


def _bind(sock: zmq.Socket, endpoint: str, keys: Optional[CurveKeys], insecure: bool) -> None:
    why = check_endpoint(endpoint, keys=keys, insecure=insecure)
    if why:
        sock.close(linger=0)
        raise TransportError(why)
    _secure_server(sock, keys)
    _prepare_ipc(endpoint)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise TransportError(f"cannot bind {endpoint}: {e}") from None


def _connect(sock: zmq.Socket, endpoint: str, keys: Optional[CurveKeys]) -> None:
    _secure_client(sock, keys)
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise TransportError(f"cannot connect {endpoint}: {e}") from None


# ---------------------------------------------------------------- engine side


class TelemetrySender:
    """Never blocks the decode step: NOBLOCK send, full queue or no peer -> drop and count."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, hwm: int = DEFAULT_TELEMETRY_HWM,
                 keys: Optional[CurveKeys] = None):
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        # Queue only on completed connections: with no daemon, frames are dropped at once instead
        # of piling up as stale telemetry.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        _connect(sock, endpoint, keys)
        self.sock = sock
        self.num_sent = 0
        self.num_dropped = 0

    def send(self, frame: bytes) -> bool:
        try:
            self.sock.send(frame, zmq.NOBLOCK, copy=True)
        except zmq.Again:
            self.num_dropped += 1
            return False
        self.num_sent += 1
        return True

    def close(self) -> None:
        self.sock.close(linger=0)


class PolicyReceiver:
    """SUB with CONFLATE: only the newest policy frame is kept; `poll()` never blocks."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, keys: Optional[CurveKeys] = None):
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.CONFLATE, 1)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        _connect(sock, endpoint, keys)
        self.sock = sock

    def poll(self) -> Optional[bytes]:
        newest = None
        while True:
            try:
                newest = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return newest

    def wait(self, timeout_ms: int) -> Optional[bytes]:
        if self.sock.poll(timeout_ms, zmq.POLLIN):
            return self.poll()
        return None

    def close(self) -> None:
        self.sock.close(linger=0)


# ---------------------------------------------------------------- daemon side


def telemetry_pull(ctx: zmq.Context, endpoint: str, *, hwm: int = DEFAULT_INGEST_HWM,
                   keys: Optional[CurveKeys] = None, insecure: bool = False) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, 4 * 1024 * 1024)  # oversized frames kill the peer, not us
    _bind(sock, endpoint, keys, insecure)
    return sock


def policy_pub(ctx: zmq.Context, endpoint: str, *, keys: Optional[CurveKeys] = None,
               insecure: bool = False) -> zmq.Socket:
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 16)
    _bind(sock, endpoint, keys, insecure)
    return sock


def status_rep(ctx: zmq.Context, endpoint: str, *, keys: Optional[CurveKeys] = None,
               insecure: bool = False) -> zmq.Socket:
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)
    _bind(sock, endpoint, keys, insecure)
    return sock


# ---------------------------------------------------------------- clients (CLI, replay)


def status_request(ctx: zmq.Context, endpoint: str, request: dict[str, Any], *,
                   timeout_ms: int = 2000, keys: Optional[CurveKeys] = None) -> dict[str, Any]:
    """One REQ round trip; raises TransportError on timeout or a non-JSON reply."""
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    try:
        _connect(sock, endpoint, keys)
        sock.send(json.dumps(request).encode())
        try:
            reply = sock.recv()
        except zmq.Again:
            raise TransportError(f"no answer from {endpoint} within {timeout_ms} ms (is `specctl serve` running?)") from None
        try:
            return json.loads(reply)
        except ValueError:
            raise TransportError(f"{endpoint} answered something that is not JSON") from None
    finally:
        sock.close(linger=0)


def telemetry_blocking_push(ctx: zmq.Context, endpoint: str, *, hwm: int = 1000,
                            keys: Optional[CurveKeys] = None, send_timeout_ms: int = 10_000) -> zmq.Socket:
    """For `specctl replay`: a PUSH whose send blocks at the high-water mark, so that no
    recorded frame is lost to it (the engine-side sender drops instead)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)  # a daemon that takes nothing: fail, not hang
    _connect(sock, endpoint, keys)
    return sock
