"""CURVE + ZAP allow-list on every daemon socket, refusal of public binds without keys, private
ipc directories: real sockets, the real Daemon, unauthenticated clients trying their luck."""

import os
import subprocess
import sys
import threading
import time

import pytest
import zmq

from specctl.controller import transport, wire
from specctl.controller.daemon import Daemon, Endpoints
from specctl.harness.drills import free_port
from specctl.harness.load import generate_certs
from specctl.controller.service import ControllerService, ServiceSettings

CLI = [sys.executable, "-m", "specctl.controller.cli"]


def _frame(server: str, i: int) -> bytes:
    return wire.encode_step_fields(server=server, rank=0, iter=i, ts=time.time(), batch_size=2, steps=1,
                                   topk=1, draft_tokens=2, accepted=[1, 0], step_ms=7.5)


def _tcp_endpoints():
    return {k: f"tcp://127.0.0.1:{free_port()}" for k in ("telemetry", "publish", "status")}


@pytest.fixture
def certs(tmp_path):
    return generate_certs(tmp_path / "certs")


@pytest.fixture
def curve_daemon(zctx, certs):
    keys = transport.load_server_keys(certs["server"], certs["allowed_dir"])
    eps = _tcp_endpoints()
    svc = ControllerService(ServiceSettings(refit_interval_s=0.2, heartbeat_s=0.1))
    d = Daemon(svc, Endpoints(eps["telemetry"], eps["publish"], eps["status"]), ctx=zctx, keys=keys)
    th = threading.Thread(target=d.run, daemon=True)
    th.start()
    yield d, eps
    d.stop_event.set()
    th.join(5)


def _client_keys(certs, name):
    return transport.load_client_keys(certs[name], certs["server_public"])


def _push(sender, server, num_frames, until=lambda: True, timeout_s=60.0):
    """Offer at least `num_frames` frames, 2 ms apart, and go on until `until()` holds (a refused
    handshake is retried by ZeroMQ, so keep trying); `timeout_s` bounds the wait, not a speed."""
    deadline = time.monotonic() + timeout_s
    i = 0
    while i < num_frames or not until():
        assert time.monotonic() < deadline, f"{server}: gave up after {i} frames"
        sender.send(_frame(server, i))
        i += 1
        time.sleep(0.002)
    return i


def test_unauthenticated_clients_cannot_push_telemetry_or_read_the_policy(curve_daemon, zctx, certs):
    daemon, eps = curve_daemon
    plain = {"telemetry": transport.TelemetrySender(zctx, eps["telemetry"]),
             "policy": transport.PolicyReceiver(zctx, eps["publish"])}
    rogue_keys = _client_keys(certs, "rogue")  # a valid CURVE key pair that is not on the list
    rogue = {"telemetry": transport.TelemetrySender(zctx, eps["telemetry"], keys=rogue_keys),
             "policy": transport.PolicyReceiver(zctx, eps["publish"], keys=rogue_keys)}
    _push(plain["telemetry"], "plain", 300)
    _push(rogue["telemetry"], "rogue", 300, until=lambda: daemon.num_clients_denied > 0)
    # the daemon publishes every 0.1 s: an admitted subscriber would have several frames by now
    assert plain["policy"].wait(800) is None
    assert rogue["policy"].wait(200) is None
    for keys in (None, rogue_keys):
        with pytest.raises(transport.TransportError, match="no answer"):
            transport.status_request(zctx, eps["status"], {"cmd": "policy"}, timeout_ms=400, keys=keys)
    assert plain["telemetry"].num_sent == 0 and rogue["telemetry"].num_sent == 0  # dropped, counted
    assert plain["telemetry"].num_dropped > 0 and rogue["telemetry"].num_dropped > 0
    svc = daemon.service
    assert svc.model.num_samples_ == 0 and not svc.servers
    assert sum(svc.status()["rejected"].values()) == 0  # nothing even reached the decoder
    assert daemon.num_clients_denied > 0  # the rogue key was seen and refused by ZAP

    good_keys = _client_keys(certs, "engine")
    good_tx = transport.TelemetrySender(zctx, eps["telemetry"], keys=good_keys)
    good_rx = transport.PolicyReceiver(zctx, eps["publish"], keys=good_keys)
    sent = _push(good_tx, "engine", 250, until=lambda: good_tx.num_sent >= 50)
    frame = good_rx.wait(30_000)
    assert frame is not None and wire.decode_policy(frame).version >= 1
    assert transport.status_request(zctx, eps["status"], {"cmd": "ping"}, keys=good_keys, timeout_ms=10_000) == {"kind": "pong"}
    deadline = time.monotonic() + 60
    while svc.model.num_samples_ < good_tx.num_sent and time.monotonic() < deadline:
        time.sleep(0.02)
    assert good_tx.num_sent > 0 and sent >= good_tx.num_sent
    assert svc.model.num_samples_ == good_tx.num_sent
    assert set(svc.servers) == {"engine"}  # nothing from "plain" or "rogue" ever got in
    for s in (*plain.values(), *rogue.values(), good_tx, good_rx):
        s.close()


@pytest.fixture
def immediate_ctx():
    """A context whose sockets queue only on completed connections (ZMQ_IMMEDIATE): a REQ send then
    blocks for as long as no handshake has succeeded, which is what a busy machine produces at
    random when a refused handshake tears the connection down before the request is sent."""
    ctx = zmq.Context()
    ctx.setsockopt(zmq.IMMEDIATE, 1)
    yield ctx
    ctx.destroy(linger=0)


def test_status_request_whose_send_cannot_complete_says_no_answer(curve_daemon, immediate_ctx, certs, tmp_path):
    _, eps = curve_daemon
    cases = {
        "no peer": (f"ipc://{transport.runtime_dir(tmp_path / 'empty')}/status.sock", None),
        "plain client refused by CURVE": (eps["status"], None),
        "unknown CURVE key refused by ZAP": (eps["status"], _client_keys(certs, "rogue")),
    }
    for case, (endpoint, keys) in cases.items():
        t0 = time.monotonic()
        with pytest.raises(transport.TransportError, match="no answer") as err:
            transport.status_request(immediate_ctx, endpoint, {"cmd": "policy"}, timeout_ms=300, keys=keys)
        assert time.monotonic() - t0 < 30, case
        assert endpoint in str(err.value), case
    # the same context reaches the daemon once the key is right: the refusals above were the keys'
    good = transport.status_request(immediate_ctx, eps["status"], {"cmd": "ping"}, timeout_ms=10_000,
                                    keys=_client_keys(certs, "engine"))
    assert good == {"kind": "pong"}


def _daemon(zctx, eps, **kw):
    svc = ControllerService(ServiceSettings())
    return Daemon(svc, Endpoints(eps["telemetry"], eps["publish"], eps["status"]), ctx=zctx, **kw)


def test_public_tcp_needs_keys_and_an_allow_list_unless_insecure(zctx, certs, tmp_path):
    public = {"telemetry": f"tcp://0.0.0.0:{free_port()}", "publish": f"ipc://{tmp_path}/run/p.sock",
              "status": f"tcp://127.0.0.1:{free_port()}"}
    with pytest.raises(transport.TransportError, match="reachable from other hosts.*--insecure"):
        _daemon(zctx, public)
    keys_no_list = transport.load_server_keys(certs["server"])
    with pytest.raises(transport.TransportError, match="allow-list"):
        _daemon(zctx, public, keys=keys_no_list)
    for name in ("*", "eth0", "192.168.1.7", "[::]", "example.org"):
        assert transport.check_endpoint(f"tcp://{name}:5555") is not None, name
    for name in ("127.0.0.1", "127.3.2.1", "localhost", "[::1]"):
        assert transport.check_endpoint(f"tcp://{name}:5555") is None, name
    # explicitly insecure: binds, and answers (reached here through loopback)
    d = _daemon(zctx, public, insecure=True)
    assert d.pull.getsockopt(zmq.LAST_ENDPOINT).decode() == public["telemetry"]
    d.close()
    public = {**public, "telemetry": f"tcp://0.0.0.0:{free_port()}", "status": f"tcp://127.0.0.1:{free_port()}"}
    d = _daemon(zctx, public, keys=transport.load_server_keys(certs["server"], certs["allowed_dir"]))
    assert d.pull.getsockopt(zmq.CURVE_SERVER) and d.pub.getsockopt(zmq.CURVE_SERVER)
    d.close()


def test_serve_with_curve_keys_end_to_end(tmp_path, zctx, certs):
    """The CLI plumbing: `specctl serve --curve-secret-key --curve-allowed-dir` on a public tcp
    endpoint starts; an allowed engine is answered on every socket, a key-less client is not."""
    run = transport.runtime_dir(tmp_path / "run")
    eps = {"telemetry": f"tcp://0.0.0.0:{free_port()}", "publish": f"ipc://{run}/policy.sock",
           "status": f"ipc://{run}/status.sock"}
    proc = subprocess.Popen(CLI + ["serve", "--telemetry", eps["telemetry"], "--publish", eps["publish"],
                                   "--status", eps["status"], "--state-dir", str(tmp_path / "state"),
                                   "--heartbeat", "0.1", "--curve-secret-key", str(certs["server"]),
                                   "--curve-allowed-dir", str(certs["allowed_dir"])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        keys = _client_keys(certs, "engine")
        deadline = time.monotonic() + 60
        while True:
            try:
                transport.status_request(zctx, eps["status"], {"cmd": "ping"}, timeout_ms=500, keys=keys)
                break
            except transport.TransportError:
                assert proc.poll() is None, proc.stderr.read().decode()
                assert time.monotonic() < deadline
        with pytest.raises(transport.TransportError):
            transport.status_request(zctx, eps["status"], {"cmd": "ping"}, timeout_ms=300)
        tx = transport.TelemetrySender(zctx, eps["telemetry"].replace("0.0.0.0", "127.0.0.1"), keys=keys)
        rx = transport.PolicyReceiver(zctx, eps["publish"], keys=keys)
        assert rx.wait(30_000) is not None
        _push(tx, "engine", 150, until=lambda: tx.num_sent >= 20)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = transport.status_request(zctx, eps["status"], {"cmd": "status"}, keys=keys, timeout_ms=10_000)
            if st["records_in"] == tx.num_sent > 0:
                break
            time.sleep(0.05)
        assert st["records_in"] == tx.num_sent > 0
        tx.close()
        rx.close()
        # the CLI's own clients read the plugin's SPECCTL_CURVE_* names
        env = {**os.environ, "SPECCTL_CURVE_SECRET_KEY": str(certs["engine"]),
               "SPECCTL_CURVE_SERVER_KEY": str(certs["server_public"])}
        shown = subprocess.run(CLI + ["policy", "show", "--json", "--endpoint", eps["status"]],
                               capture_output=True, text=True, timeout=60, env=env)
        assert shown.returncode == 0, shown.stderr
        assert wire.policy_from_obj(__import__("json").loads(shown.stdout)).version >= 1
        env.pop("SPECCTL_CURVE_SERVER_KEY")
        half = subprocess.run(CLI + ["policy", "show", "--endpoint", eps["status"]],
                              capture_output=True, text=True, timeout=60, env=env)
        assert half.returncode != 0 and "set both" in half.stderr
    finally:
        proc.kill()
        proc.wait(10)
        proc.stderr.close()


def test_ipc_sockets_live_in_a_private_directory(zctx, tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    eps = {k: f"ipc://{loose}/{k}.sock" for k in ("telemetry", "publish", "status")}
    d = _daemon(zctx, eps)
    try:
        assert (os.stat(loose).st_mode & 0o777) == 0o700
    finally:
        d.close()
    fresh = tmp_path / "a" / "b"
    d = _daemon(zctx, {k: f"ipc://{fresh}/{k}.sock" for k in ("telemetry", "publish", "status")})
    d.close()
    assert (os.stat(fresh).st_mode & 0o777) == 0o700
    # a symlink planted where the sockets go, and a directory someone else owns: refused
    (tmp_path / "link").symlink_to(loose)
    with pytest.raises(transport.TransportError, match="not a directory"):
        _daemon(zctx, {k: f"ipc://{tmp_path}/link/{k}.sock" for k in ("telemetry", "publish", "status")})
    if os.getuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        with pytest.raises(transport.TransportError, match="owned by uid 65534"):
            _daemon(zctx, {k: f"ipc://{theirs}/{k}.sock" for k in ("telemetry", "publish", "status")})


def test_plugin_runtime_talks_curve_with_keys_from_its_settings(curve_daemon, certs):
    """The SGLang-side transport (PluginRuntime) with SPECCTL_CURVE_* settings: telemetry is
    admitted and the policy arrives; the same runtime without keys gets neither."""
    from specctl.plugin.engine import PluginSettings
    from specctl.plugin.sglang_hooks import PluginRuntime

    d, eps = curve_daemon
    env = {"SPECCTL_TELEMETRY": eps["telemetry"], "SPECCTL_POLICY": eps["publish"],
           "SPECCTL_SERVER_ID": "curvy", "SPECCTL_CURVE_SECRET_KEY": str(certs["engine"]),
           "SPECCTL_CURVE_SERVER_KEY": str(certs["server_public"])}
    settings = PluginSettings.from_env(env)
    assert settings.curve_secret_key_file == str(certs["engine"])

    class OneRank:
        rank_in_group, world_size = 0, 1

    rt = PluginRuntime(settings, tp_group_fn=OneRank)
    rt.new_engine([0, 1, 3])
    assert rt.sender is not None and rt.receiver is not None
    _push(rt.sender, "curvy", 50, until=lambda: d.service.servers.get("curvy") is not None)
    assert rt.receiver.wait(30_000) is not None
    rt.close()

    plain = PluginRuntime(PluginSettings.from_env({k: v for k, v in env.items() if "CURVE" not in k}
                                                  | {"SPECCTL_SERVER_ID": "plain"}),
                          tp_group_fn=OneRank)
    plain.new_engine([0, 1, 3])
    _push(plain.sender, "plain", 500)
    assert "plain" not in d.service.servers
    assert plain.receiver.wait(500) is None
    plain.close()
    with pytest.raises(ValueError, match="both"):
        PluginSettings.from_env({"SPECCTL_CURVE_SECRET_KEY": str(certs["engine"])})
