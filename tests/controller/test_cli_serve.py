"""`specctl serve` flags reach the ControllerService (the daemon loop itself is tested in test_daemon.py)."""
from click.testing import CliRunner

from specctl.controller import cli, daemon


def test_serve_passes_the_model_settings(tmp_path, monkeypatch):
    got = {}

    def fake_serve_forever(d):
        got["settings"] = d.service.settings
        d.close()

    monkeypatch.setattr(daemon, "serve_forever", fake_serve_forever)
    run = tmp_path / "run"
    res = CliRunner().invoke(cli.main, ["serve", "--state-dir", str(tmp_path / "state"), "--accept-change-z", "0",
                                        "--explore-decided-z", "2.5", "--accept-half-life", "4",
                                        "--switch-z", "3", "--max-margin", "0.08", "--refresh-s", "45",
                                        "--challenge-period", "32", "--no-ctx-axis"],
                             env={"SPECCTL_RUNDIR": str(run)})
    assert res.exit_code == 0, res.output
    s = got["settings"]
    assert (s.accept_change_z, s.explore_decided_z, s.accept_half_life_s) == (0.0, 2.5, 4.0)
    assert (s.switch_z, s.max_margin, s.refresh_s, s.challenge_period) == (3.0, 0.08, 45.0, 32)
    assert s.ctx_axis is False
    res = CliRunner().invoke(cli.main, ["serve", "--accept-change-z", "-1"], env={"SPECCTL_RUNDIR": str(run)})
    assert res.exit_code != 0 and "accept-change-z" in res.output
    res = CliRunner().invoke(cli.main, ["serve", "--refresh-s", "-5"], env={"SPECCTL_RUNDIR": str(run)})
    assert res.exit_code != 0 and "refresh-s" in res.output
    res = CliRunner().invoke(cli.main, ["serve", "--challenge-period", "4"], env={"SPECCTL_RUNDIR": str(run)})
    assert res.exit_code != 0 and "challenge_period below 8" in res.output


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
