"""`specctl serve`: the ControllerService behind real sockets (telemetry PULL, policy PUB,
status REP) plus a Prometheus /metrics endpoint. Single-threaded event loop."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import zmq

from . import transport, wire
from .service import ControllerService

log = logging.getLogger("specctl.daemon")

DRAIN_MAX = 4096  # frames taken per loop turn before status and publishing get a turn
DRAIN_BUDGET_S = 0.005  # ... or this much time, whichever comes first: bounds status latency
MAX_SHED_STRIDE = 64  # when behind, fit one frame in at most this many


@dataclass(frozen=True)
class Endpoints:
    telemetry: str
    publish: str
    status: Optional[str] = None


class Daemon:
    """Built all or nothing: every step that leaves something behind (a lock, the ZAP thread, a
    bound socket and its file, the metrics server) registers its undo first, and a failure at any
    step undoes the earlier ones; `close()` runs the same undo list."""

    def __init__(self, service: ControllerService, endpoints: Endpoints, *,
                 ctx: Optional[zmq.Context] = None, keys: Optional[transport.CurveKeys] = None,
                 insecure: bool = False, metrics_port: Optional[int] = None,
                 metrics_host: str = "127.0.0.1", shed_when_behind: bool = False):
        ctx = ctx or zmq.Context.instance()
        for ep in (endpoints.telemetry, endpoints.publish, endpoints.status):
            why = ep and transport.check_endpoint(ep, keys=keys, insecure=insecure)
            if why:
                raise transport.TransportError(why)
        if metrics_port is not None and metrics_host not in LOOPBACK_HOSTS and not insecure:
            raise transport.TransportError(
                f"metrics on {metrics_host} would be reachable from other hosts; pass --insecure to allow")
        if keys is not None and keys.allowed_clients is None:
            log.warning("CURVE without a client allow-list: any client holding the server's public "
                        "key may connect (give --curve-allowed-dir to restrict)")
        with contextlib.ExitStack() as undo:
            for ep in (endpoints.telemetry, endpoints.publish, endpoints.status):
                if ep:
                    undo.enter_context(transport.claim_ipc(ep))
            # the ZAP handler lives exactly as long as this daemon's sockets
            auth = transport.start_authenticator(ctx, keys)
            if auth is not None:
                undo.callback(auth.stop)
            pull = transport.telemetry_pull(ctx, endpoints.telemetry, keys=keys, insecure=insecure)
            undo.callback(pull.close, linger=0)
            pub = transport.policy_pub(ctx, endpoints.publish, keys=keys, insecure=insecure)
            undo.callback(pub.close, linger=0)
            rep = None
            if endpoints.status:
                rep = transport.status_rep(ctx, endpoints.status, keys=keys, insecure=insecure)
                undo.callback(rep.close, linger=0)
            metrics_server = None
            if metrics_port is not None:
                metrics_server = _start_metrics(service, metrics_host, metrics_port)
                undo.callback(_stop_metrics, metrics_server)
            self._undo = undo.pop_all()
        self.service = service
        self.endpoints = endpoints
        self.ctx = ctx
        self.auth = auth
        self.pull, self.pub, self.rep = pull, pub, rep
        self.metrics_server = metrics_server
        self.metrics_addr = (metrics_host, metrics_port)
        self.stop_event = threading.Event()
        # Off by default: a full queue then back-pressures the senders (engines drop and count,
        # `specctl replay` waits), so nothing sent by replay is lost.
        self.shed_when_behind = shed_when_behind
        self.shedding = False
        self.keep_every = 1  # when shedding: fit one frame in this many (adapts to the overload)
        self.num_shed = 0
        self.rates = RateMeter(service)

    def run(self, stop: Optional[threading.Event] = None) -> None:
        stop = stop or self.stop_event
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        if self.rep is not None:
            poller.register(self.rep, zmq.POLLIN)
        svc = self.service
        log.info("serving: telemetry %s, policy %s, status %s", self.endpoints.telemetry,
                 self.endpoints.publish, self.endpoints.status)
        self._publish(safe_tick(svc))
        try:
            while not stop.is_set():
                events = dict(poller.poll(50))
                if self.pull in events:
                    self._drain()
                if self.rep is not None and self.rep in events:
                    self._answer()
                self._publish(safe_tick(svc))
                self.rates.sample()
        finally:
            self.close()

    def _drain(self) -> None:
        svc = self.service
        recv = self.pull.recv
        budget_end = time.perf_counter() + DRAIN_BUDGET_S
        stride = self.keep_every if self.shedding else 1
        n = 0
        emptied = False
        while n < DRAIN_MAX:
            try:
                frame = recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                emptied = True
                break
            n += 1
            if stride > 1 and n % stride:
                # behind: frames are counted and skipped, so the model keeps up with a uniform
                # sample instead of lagging further behind the engines (and queues stay short)
                svc.metrics.shed.inc()
                self.num_shed += 1
            else:
                svc.observe_frame(frame)
            if not n & 63 and time.perf_counter() > budget_end:
                break
        if not self.shed_when_behind:
            return
        # a turn that ends with frames still queued means a backlog: skip more next turn;
        # an emptied queue relaxes it again
        if emptied:
            self.keep_every = max(1, self.keep_every // 2)
        else:
            self.keep_every = min(MAX_SHED_STRIDE, self.keep_every * 2)
        self.shedding = self.keep_every > 1

    def _answer(self) -> None:
        try:
            raw = self.rep.recv(zmq.NOBLOCK)  # type: ignore[union-attr]
        except zmq.Again:
            return
        try:
            req = json.loads(raw)
            cmd = req.get("cmd") if isinstance(req, dict) else None
            if cmd == "status":
                reply: dict[str, Any] = self.status()
            elif cmd == "policy":
                reply = wire.to_obj(self.service.policy)
            elif cmd == "ping":
                reply = {"kind": "pong"}
            else:
                reply = {"error": f"unknown command {cmd!r}; use status, policy or ping"}
            result = "error" if "error" in reply else "ok"
        except (ValueError, RecursionError):  # RecursionError: nested too deeply
            reply, result = {"error": "request is not JSON"}, "error"
        self.service.metrics.status_requests.labels(result).inc()
        self.rep.send(json.dumps(reply, default=str).encode())  # type: ignore[union-attr]

    def _publish(self, policy: Optional[wire.PolicyRecord]) -> None:
        if policy is None:
            return
        try:
            self.pub.send(wire.encode(policy), zmq.NOBLOCK)
        except zmq.Again:
            pass  # PUB never blocks; a slow subscriber gets the next heartbeat

    def close(self) -> None:
        """Persist the model, close the recorder, then undo the construction (sockets closed and
        their files removed, ZAP and metrics stopped, locks released). Safe to call twice."""
        try:
            self.service.persist_model()
        except OSError as e:
            log.error("could not persist model state: %s", e)
        if self.service.recorder is not None:
            self.service.recorder.close()
        self._undo.close()

    @property
    def num_clients_denied(self) -> int:
        """CURVE clients refused by the allow-list so far."""
        return self.auth.allow_list.num_denied if self.auth is not None else 0

    def status(self) -> dict[str, Any]:
        """The service's status plus what only the daemon knows (added keys only: older clients
        read the reply as before)."""
        reply = self.service.status()
        reply["daemon"] = {
            "pid": os.getpid(),
            "endpoints": {"telemetry": self.endpoints.telemetry, "publish": self.endpoints.publish,
                          "status": self.endpoints.status},
            "shedding": self.shedding,
            "num_shed": self.num_shed,
            "num_clients_denied": self.num_clients_denied,
            "num_tick_errors": self.service.num_tick_errors,
            "records_per_s": self.rates.per_server(),
            "rate_window_s": RATE_WINDOW_S,
        }
        return reply


RATE_WINDOW_S = 10.0


class RateMeter:
    """Telemetry records per second per server, over the last RATE_WINDOW_S / 2 to RATE_WINDOW_S,
    from the service's record counts sampled as the loop turns (no per-record work)."""

    def __init__(self, service: ControllerService):
        self.service = service
        self._snaps: list[tuple[float, dict[str, int]]] = []  # at most two, oldest first

    def _counts(self) -> dict[str, int]:
        return {k: v.records for k, v in list(self.service.servers.items())[:64]}

    def sample(self) -> None:
        now = self.service.clock()
        if self._snaps and now - self._snaps[-1][0] < RATE_WINDOW_S / 2:
            return
        self._snaps = self._snaps[-1:] + [(now, self._counts())]

    def per_server(self) -> dict[str, float]:
        """{} until a snapshot is at least a second old."""
        self.sample()
        t0, base = self._snaps[0]
        dt = self.service.clock() - t0
        if dt < 1.0:
            return {}
        return {k: round((n - base.get(k, 0)) / dt, 2) for k, n in self._counts().items()}


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _start_metrics(service: ControllerService, host: str, port: int) -> Any:
    from prometheus_client import start_http_server

    try:
        started = start_http_server(port, addr=host, registry=service.metrics.registry)
    except OSError as e:
        raise transport.TransportError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
    return started[0] if isinstance(started, tuple) else None


def _stop_metrics(server: Any) -> None:
    if server is not None:
        server.shutdown()
        server.server_close()


_TICK_ERRORS: set[str] = set()


def safe_tick(service: ControllerService) -> Optional[wire.PolicyRecord]:
    """service.tick(), but a refit that raises (a bug, or telemetry nobody foresaw) keeps the
    current policy in force instead of ending the daemon; the engines keep their heartbeats."""
    try:
        return service.tick()
    except Exception as e:  # noqa: BLE001 - the daemon must outlive one bad refit
        service.num_tick_errors += 1
        msg = f"{type(e).__name__}: {e}"
        if msg not in _TICK_ERRORS and len(_TICK_ERRORS) < 100:
            _TICK_ERRORS.add(msg)
            log.exception("refit failed; policy v%d stays in force", service.policy.version)
        now = service.clock()
        if now - service.last_publish >= service.settings.heartbeat_s:
            # refits fail every interval from now on: the heartbeat must not depend on them
            service.last_publish = now
            service.metrics.published.labels("heartbeat").inc()
            return service.policy
        return None


def serve_forever(daemon: Daemon) -> None:
    import signal

    def _stop(signum: int, frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        daemon.stop_event.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    daemon.run()


def wait_for_status(ctx: zmq.Context, endpoint: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """Poll the status endpoint until the daemon answers (tests, demo)."""
    deadline = time.monotonic() + timeout_s
    last: Optional[Exception] = None
    while time.monotonic() < deadline:
        try:
            return transport.status_request(ctx, endpoint, {"cmd": "ping"}, timeout_ms=500)
        except transport.TransportError as e:
            last = e
            time.sleep(0.05)
    raise transport.TransportError(f"daemon at {endpoint} did not answer within {timeout_s} s: {last}")
