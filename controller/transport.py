"""The one place ZeroMQ sockets are built (engine side and daemon side).

    engine rank 0..N                      specctl serve
    PUSH  connect, NOBLOCK, SNDHWM, ---->  PULL  bind      telemetry: one frame = one step record
          LINGER 0, drop on zmq.Again
    SUB   connect, CONFLATE, drained <---  PUB   bind      policy: one frame = newest policy record
          with NOBLOCK, keeps newest                         (re-sent as a heartbeat)
    REQ   connect, RCVTIMEO, one shot -->  REP   bind      status: {"cmd": ...} -> JSON reply

Endpoints default to `ipc://` sockets inside a 0700 runtime directory, or `tcp://127.0.0.1`; a
daemon holds a pid lock beside each ipc socket file (NAME.sock.lock) and removes both on exit.
A tcp endpoint on any other interface is refused unless CURVE keys and a client allow-list are
given (or `insecure`). With keys, every daemon socket runs CURVE and a ZAP handler
(`start_authenticator`, owned by the daemon) admits only the allowed client public keys.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import json
import logging
import os
import stat
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Iterator, Optional

import zmq

DEFAULT_TELEMETRY_HWM = 10_000
# per connected engine (ZeroMQ queues per pipe): a daemon that falls behind holds at most
# engines x (this + the engine's SNDHWM) frames (~1.8 GB measured for 64 engines), then engines
# drop; `--shed-when-behind` keeps queues short instead (benchmarks/results/reliability.md)
DEFAULT_INGEST_HWM = 20_000

log = logging.getLogger("specctl.transport")


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
    """Create (if needed) and check a private runtime directory for ipc sockets: a real
    directory (not a symlink), owned by this user, mode 0700 (tightened if it is ours)."""
    p = Path(base)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(p)
    if not stat.S_ISDIR(st.st_mode):
        raise TransportError(f"runtime dir {p} is not a directory (a symlink?): refusing to put sockets there")
    if st.st_uid != os.getuid():
        # someone else's directory (e.g. pre-created in /tmp): they could read our sockets
        raise TransportError(f"runtime dir {p} is owned by uid {st.st_uid}, not {os.getuid()}: "
                             "choose a private directory (SPECCTL_RUNDIR)")
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
    if insecure:
        return None
    if keys is None:
        return (
            f"{endpoint} is reachable from other hosts: give CURVE keys (specctl keys generate) "
            "and --curve-allowed-dir, or pass --insecure explicitly"
        )
    if keys.allowed_clients is None:
        # without an allow-list any holder of the (public) server key could feed the model
        return (
            f"{endpoint} is reachable from other hosts: CURVE needs a client allow-list "
            "(--curve-allowed-dir), or pass --insecure explicitly"
        )
    return None


def create_certificates(directory: str | os.PathLike[str], name: str) -> tuple[str, str]:
    """A CURVE certificate pair in DIRECTORY (made 0700): NAME.key (public) and NAME.key_secret (0600).
    Returns (public file, secret file)."""
    import zmq.auth

    os.makedirs(directory, mode=0o700, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret, 0o600)
    return str(public), str(secret)


def load_server_keys(secret_file: str | os.PathLike[str],
                     allowed_dir: Optional[str | os.PathLike[str]] = None) -> CurveKeys:
    """Server certificate (`specctl keys generate`) + the public certificates allowed in."""
    import zmq.auth

    public, secret = zmq.auth.load_certificate(secret_file)
    if secret is None:
        raise TransportError(f"{secret_file} holds no secret key (give the .key_secret file)")
    allowed = None
    if allowed_dir is not None:
        allowed = tuple(sorted(zmq.auth.load_certificates(allowed_dir).keys()))
    return CurveKeys(public=public, secret=secret, allowed_clients=allowed)


def load_client_keys(secret_file: str | os.PathLike[str],
                     server_public_file: str | os.PathLike[str]) -> CurveKeys:
    """A client's own certificate (its .key_secret file) + the server's public certificate."""
    import zmq.auth

    public, secret = zmq.auth.load_certificate(secret_file)
    if secret is None:
        raise TransportError(f"{secret_file} holds no secret key (give the .key_secret file)")
    server_public, _ = zmq.auth.load_certificate(server_public_file)
    return CurveKeys(public=public, secret=secret, server_public=server_public)


class ClientAllowList:
    """ZAP credentials callback: admits the listed client public keys (Z85), counts the rest."""

    def __init__(self, allowed: Optional[tuple[bytes, ...]]):
        self.allowed = None if allowed is None else frozenset(allowed)
        self.num_allowed = 0
        self.num_denied = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        ok = self.allowed is None or key in self.allowed
        with self._lock:
            if ok:
                self.num_allowed += 1
            else:
                self.num_denied += 1
        if not ok:
            log.warning("refused a CURVE client with an unknown public key %s", key.decode(errors="replace"))
        return ok


def start_authenticator(ctx: zmq.Context, keys: Optional[CurveKeys]) -> Optional[Any]:
    """Start the ZAP handler of `ctx` for CURVE server sockets (None without keys). Start it
    before binding: a handshake with no handler present is not checked. The caller stops it."""
    if keys is None:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    deadline = time.monotonic() + 2.0
    while True:
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("specctl.zap"))
        try:
            auth.start()
            break
        except zmq.ZMQError as e:
            if auth.zap_socket is not None:
                auth.zap_socket.close(linger=0)
            # a handler stopped a moment ago (a daemon closed in this context) releases its inproc
            # endpoint asynchronously; anything else, or a live handler, is an error
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise TransportError(f"cannot start the CURVE authenticator: {e} "
                                     "(one daemon with keys per ZeroMQ context)") from None
            time.sleep(0.01)
    auth.allow_list = ClientAllowList(keys.allowed_clients)
    auth.configure_curve_callback(domain="*", credentials_provider=auth.allow_list)
    return auth


class LockHeld(RuntimeError):
    """Another live process holds the lock; `pid` is what it wrote there (None if unreadable)."""

    def __init__(self, what: str, path: Path, pid: Optional[int]):
        holder = f"pid {pid}" if pid is not None else "another process"
        super().__init__(f"{what} is in use by {holder} (lock {path}): stop it first, or choose another")
        self.path = path
        self.pid = pid


class PidLock:
    """An exclusive flock on PATH that holds this process's pid. The kernel drops it when the holder
    dies, so a lock file left by a killed process is taken over, never obeyed; `release()` removes it."""

    def __init__(self, path: str | os.PathLike[str], what: str):
        self.path = Path(path)
        self.what = what
        self._fd: Optional[int] = None

    def acquire(self) -> "PidLock":
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                raise LockHeld(self.what, self.path, _read_pid(self.path)) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            # the holder released and removed the file between our open and our flock: a newer
            # file (maybe held by a third process) is the lock now; take that one
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()  # while still held: nobody can be holding the file we remove
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "PidLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None

def claim_ipc(endpoint: str) -> ContextManager[None]:
    """For an ipc endpoint: its runtime dir checked, a pid lock beside the socket file, a stale
    socket file removed; on exit the socket file (once its socket is closed) and the lock go. A
    live holder is refused by pid: ZeroMQ would otherwise rebind the path under it. Other
    endpoints: nothing (a second bind of a tcp port fails by itself)."""
    if not endpoint.startswith("ipc://"):
        return nullcontext()
    return _claimed_ipc(Path(endpoint[len("ipc://"):]), endpoint)


@contextmanager
def _claimed_ipc(path: Path, endpoint: str) -> Iterator[None]:
    try:
        runtime_dir(path.parent)
        lock = PidLock(path.with_name(path.name + ".lock"), endpoint).acquire()
    except LockHeld as e:
        raise TransportError(f"cannot bind {endpoint}: {e}") from None
    except OSError as e:
        raise TransportError(f"cannot bind {endpoint}: {e.strerror or e}") from None
    try:
        yield
    finally:
        # ZeroMQ's I/O thread removes the file of a closed listener a moment later; wait for it
        # while the lock is still held, so that it cannot remove the next daemon's file instead
        deadline = time.monotonic() + 1.0
        while path.is_socket() and time.monotonic() < deadline:
            time.sleep(0.005)
        try:
            if path.is_socket():
                path.unlink()
        except OSError:
            pass
        lock.release()


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
        sock.close(linger=0)
        raise TransportError("a CURVE client needs the server's public key")
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


def _bind(sock: zmq.Socket, endpoint: str, keys: Optional[CurveKeys], insecure: bool) -> None:
    why = check_endpoint(endpoint, keys=keys, insecure=insecure)
    if why:
        sock.close(linger=0)
        raise TransportError(why)
    try:
        _secure_server(sock, keys)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise TransportError(f"cannot bind {endpoint}: the CURVE server key is unusable ({e})") from None
    try:
        _prepare_ipc(endpoint)
    except (TransportError, OSError) as e:
        sock.close(linger=0)
        raise TransportError(f"cannot bind {endpoint}: {e}") from None
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise TransportError(f"cannot bind {endpoint}: {e}") from None


def _connect(sock: zmq.Socket, endpoint: str, keys: Optional[CurveKeys]) -> None:
    try:
        _secure_client(sock, keys)
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
    """One REQ round trip. Every way it can fail (no peer, a refused handshake, a timeout on the
    send or the receive, a reply that is not a JSON object) raises TransportError, never zmq's own."""
    no_answer = f"no answer from {endpoint} within {timeout_ms} ms (is `specctl serve` running?)"
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, 16 * 1024 * 1024)
    try:
        _connect(sock, endpoint, keys)
        try:
            # a REQ send blocks while it has no usable connection: a peer that is absent, or one
            # whose handshake refused us and tore the connection down before this line ran
            sock.send(json.dumps(request).encode())
            reply = sock.recv()
        except zmq.Again:
            raise TransportError(no_answer) from None
        except zmq.ZMQError as e:
            raise TransportError(f"{endpoint}: {e}") from None
        try:
            obj = json.loads(reply)
        except (ValueError, RecursionError):
            raise TransportError(f"{endpoint} answered something that is not JSON") from None
        if not isinstance(obj, dict):
            raise TransportError(f"{endpoint} answered JSON that is not an object")
        return obj
    finally:
        sock.close(linger=0)


def telemetry_blocking_push(ctx: zmq.Context, endpoint: str, *, hwm: int = 1000,
                            keys: Optional[CurveKeys] = None, send_timeout_ms: int = 10_000,
                            connect_timeout_ms: int = 3000) -> zmq.Socket:
    """For `specctl replay`: a PUSH whose send blocks at the high-water mark, so that no
    recorded frame is lost to it (the engine-side sender drops instead). Returned only once a
    daemon has completed the handshake: with none listening (or one refusing our keys) it raises
    TransportError instead of queueing frames that nobody takes."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)  # a daemon that takes nothing: fail, not hang
    sock.setsockopt(zmq.IMMEDIATE, 1)  # frames go only to a connection that completed its handshake
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                      | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    try:
        _connect(sock, endpoint, keys)
        why = _await_handshake(monitor, connect_timeout_ms)
    finally:
        if not sock.closed:
            sock.disable_monitor()
        monitor.close(linger=0)
    if why is not None:
        sock.close(linger=0)
        raise TransportError(f"{endpoint}: {why}")
    return sock


def _await_handshake(monitor: zmq.Socket, timeout_ms: int) -> Optional[str]:
    """None once a handshake succeeded; else why not (the last refusal, or nobody answering)."""
    from zmq.utils.monitor import recv_monitor_message

    refused = None
    deadline = time.monotonic() + timeout_ms / 1000
    while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
        if not monitor.poll(left_ms):
            break
        event = recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return None
        refused = ("the daemon refused our CURVE key" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
                   else "the peer failed the ZeroMQ handshake (CURVE keys on one side only?)")
    return refused or f"nothing is listening (no handshake within {timeout_ms} ms; is `specctl serve` running?)"
