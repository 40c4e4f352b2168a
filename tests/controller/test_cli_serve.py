"""`specctl serve` flags reach the ControllerService (the daemon loop itself is tested in test_daemon.py)."""
import pytest
from click.testing import CliRunner

from specctl.controller import cli, daemon


def _serve_settings(tmp_path, monkeypatch, *args):
    got = {}

    def fake_serve_forever(d):
        got["settings"], got["metrics"] = d.service.settings, d.metrics_addr
        d.close()

    monkeypatch.setattr(daemon, "serve_forever", fake_serve_forever)
    res = CliRunner().invoke(cli.main, ["serve", "--state-dir", str(tmp_path / "state"), *args],
                             env={"SPECCTL_RUNDIR": str(tmp_path / "run")})
    return res, got


def test_serve_passes_the_model_settings(tmp_path, monkeypatch):
    res, got = _serve_settings(tmp_path, monkeypatch, "--switch-z", "3", "--explore-period", "128",
                               "--no-ctx-axis", "--refit-interval", "0.5")
    assert res.exit_code == 0, res.output
    s = got["settings"]
    assert (s.switch_z, s.explore_period, s.ctx_axis, s.refit_interval_s) == (3.0, 128, False, 0.5)
    assert got["metrics"][1] is None


def test_serve_takes_at_most_four_learning_flags_and_checks_them(tmp_path, monkeypatch):
    import click

    serve = cli.main.commands["serve"]
    names = {o.name for o in serve.params if isinstance(o, click.Option)}
    assert len(names) <= 21, sorted(names)
    assert names & {"switch_z", "explore_period", "ctx_axis", "refit_interval"} == {
        "switch_z", "explore_period", "ctx_axis", "refit_interval"}
    for gone in ("--refresh-s", "--challenge-period", "--explore-decided-z", "--max-margin"):
        res = CliRunner().invoke(cli.main, ["serve", gone, "1"], env={"SPECCTL_RUNDIR": str(tmp_path)})
        assert res.exit_code != 0 and "No such option" in res.output, gone
    res, _ = _serve_settings(tmp_path, monkeypatch, "--explore-period", "10")
    assert res.exit_code != 0 and "explore_period below 50" in res.output


@pytest.mark.parametrize("arg, want", [
    ("9464", ("127.0.0.1", 9464)), ("0.0.0.0:9464", ("0.0.0.0", 9464)), ("[::1]:9090", ("::1", 9090)),
    ("nine", None), ("127.0.0.1:0", None), ("host:70000", None), (":9090", None),
])
def test_metrics_address_parsing(arg, want):
    import click

    if want is None:
        with pytest.raises(click.BadParameter, match=r"\[HOST:\]PORT"):
            cli._parse_metrics(None, None, arg)
    else:
        assert cli._parse_metrics(None, None, arg) == want


def test_serve_metrics_on_loopback_and_refused_elsewhere_without_insecure(tmp_path, monkeypatch):
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    seen = {}

    def fake_serve_forever(d):
        seen["addr"] = d.metrics_addr
        seen["body"] = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        d.close()

    monkeypatch.setattr(daemon, "serve_forever", fake_serve_forever)
    res = CliRunner().invoke(cli.main, ["serve", "--state-dir", str(tmp_path / "s"), "--metrics", str(port)],
                             env={"SPECCTL_RUNDIR": str(tmp_path / "run")})
    assert res.exit_code == 0, res.output
    assert seen["addr"] == ("127.0.0.1", port) and b"specctl_" in seen["body"]
    res = CliRunner().invoke(cli.main, ["serve", "--state-dir", str(tmp_path / "s2"), "--metrics", "0.0.0.0:1"],
                             env={"SPECCTL_RUNDIR": str(tmp_path / "run2")})
    assert res.exit_code != 0 and "reachable from other hosts" in res.output


def test_keys_generate_writes_a_loadable_pair_with_a_private_secret(tmp_path):
    import os
    import stat

    from specctl.controller import transport

    d = tmp_path / "k"
    res = CliRunner().invoke(cli.main, ["keys", "generate", str(d), "--name", "engine"])
    assert res.exit_code == 0, res.output
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(d / "engine.key_secret").st_mode) == 0o600
    transport.create_certificates(d, "server")
    keys = transport.load_client_keys(d / "engine.key_secret", d / "server.key")
    assert keys.secret and keys.server_public
