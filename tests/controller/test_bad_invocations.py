"""Bad input to `specctl`, run as the operator runs it (a real subprocess): each ends with exit != 0,
no traceback, and one line that names the problem."""

import os
import re
import socket
import subprocess
import sys

import pytest

from specctl.controller import transport

CLI = [sys.executable, "-c", "from specctl.controller.cli import main; main()"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "a-file").write_text("x")
    (d / "garbage.json").write_bytes(b"\x00\xffnot json at all")
    (d / "not-a-policy.json").write_text('{"kind": "policy", "version": "seven"}')
    (d / "not-a-cert").write_text("hello\n")
    pub, _ = transport.create_certificates(d / "keys", "server")
    (d / "telemetry.jsonl").write_text('{"kind": "step"}\n' * 3)
    return {"dir": d, "file": d / "a-file", "garbage": d / "garbage.json", "notpolicy": d / "not-a-policy.json",
            "notcert": d / "not-a-cert", "public": pub, "rec": d / "telemetry.jsonl"}


@pytest.fixture(scope="module")
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


# (name, argv with {placeholders}, extra environment, what the error line must say)
CASES = [
    ("state dir under a file", "serve --state-dir {file}/state", {}, r"--state-dir.*{file}.*Not a directory"),
    ("state dir under /proc", "serve --state-dir /proc/specctl-state", {}, r"--state-dir.*/proc/specctl-state"),
    ("endpoint scheme", "serve --telemetry bogus://x", {}, r"--telemetry.*unsupported endpoint 'bogus://x'"),
    ("public tcp without keys", "serve --telemetry tcp://0.0.0.0:{port}", {}, r"reachable from other hosts"),
    ("endpoint in use", "serve --status tcp://127.0.0.1:{busy}", {},
     r"cannot bind tcp://127.0.0.1:{busy}.*(in use|Address already)"),
    ("not a number", "serve --refit-interval soon", {}, r"--refit-interval.*'soon' is not a valid float"),
    ("number out of range", "serve --threshold 0", {}, r"--threshold.*0 is not in the range x>=1"),
    ("explore period too small", "serve --explore-period 10", {}, r"explore_period below 50"),
    ("bad configuration", "serve --config s9x", {}, r"--config.*invalid configuration 's9x'"),
    ("bad configuration in a list", "serve --configs off,s1,zz", {}, r"--configs.*invalid configuration 'zz'"),
    ("bad metrics address", "serve --metrics nine", {}, r"--metrics.*\[HOST:\]PORT"),
    ("missing policy file", "serve --init-policy {dir}/nope.json", {}, r"--init-policy.*nope.json.*does not exist"),
    ("policy file that is not one", "serve --init-policy {notpolicy}", {}, r"--init-policy.*not a policy file"),
    ("unreadable policy file", "serve --init-policy /proc/self/mem", {}, r"--init-policy.*/proc/self/mem.*(error|denied)"),
    ("CURVE key that is not a certificate", "serve --curve-secret-key {notcert}", {},
     r"--curve-secret-key.*not a CURVE certificate"),
    ("CURVE public key given as the secret", "serve --curve-secret-key {public}", {},
     r"--curve-secret-key.*holds no secret key"),
    ("allow-list without a key", "serve --curve-allowed-dir {dir}", {}, r"--curve-allowed-dir needs --curve-secret-key"),
    ("no such option", "serve --mode-of-operation x", {}, r"No such option '--mode-of-operation'"),
    ("policy file missing", "policy show --file {dir}/nope.json", {}, r"nope.json.*No such file"),
    ("policy file garbage", "policy show --file {garbage}", {}, r"garbage.json: not a valid policy"),
    ("policy file unreadable", "policy show --file /proc/self/mem", {}, r"/proc/self/mem: Input/output error"),
    ("policy state dir missing", "policy show --state-dir {dir}/nostate", {}, r"nostate.*does not exist"),
    ("two policy sources", "policy show --file {garbage} --state-dir {dir}", {}, r"at most one of"),
    ("policy from nobody", "policy show --endpoint ipc://{dir}/nobody.sock", {}, r"no answer from ipc://.*nobody.sock"),
    ("policy from a bad endpoint", "policy show --endpoint nowhere", {}, r"cannot connect nowhere"),
    ("CURVE env half set", "policy show", {"SPECCTL_CURVE_SECRET_KEY": "{notcert}"},
     r"set both SPECCTL_CURVE_SECRET_KEY and SPECCTL_CURVE_SERVER_KEY"),
    ("CURVE env file missing", "policy show",
     {"SPECCTL_CURVE_SECRET_KEY": "{dir}/nokey", "SPECCTL_CURVE_SERVER_KEY": "{public}"},
     r"CURVE keys from .*(Invalid certificate file|No such file).*nokey"),
    ("replay with nothing listening", "replay {rec} --to ipc://{dir}/nobody-t.sock", {},
     r"nothing sent: .*nobody-t.sock: nothing is listening"),
    ("replay of a missing file", "replay {dir}/nope.jsonl", {}, r"nope.jsonl.*does not exist"),
    ("replay speed zero", "replay {rec} --speed 0", {}, r"--speed.*0.*range"),
    ("sglang-args bad configuration", "sglang-args --configs off,s9x", {}, r"invalid configuration 's9x'"),
    ("sglang-args bad fallback", "sglang-args --fallback-config bogus", {},
     r"--fallback-config.*invalid configuration 'bogus'"),
    ("sglang-args initial steps not a candidate", "sglang-args --configs off,s1,s3 --initial-steps 2", {},
     r"initial steps 2 is not among the candidates"),
    ("sglang-args modes disagree", "sglang-args --plugin-mode fixed --mode online", {}, r"--plugin-mode fixed and --mode online disagree"),
    ("train bad configuration", "train {rec} --out {dir}/p.json --configs off,zz", {}, r"--configs.*invalid configuration 'zz'"),
    ("keys into a file's child", "keys generate {file}/keys", {}, r"{file}.*(Not a directory|File exists)"),
    ("keys with a path as name", "keys generate {dir}/k --name ../x", {}, r"--name.*a plain file name"),
    ("doctor log missing", "doctor --log {dir}/server.log", {}, r"server.log.*does not exist"),
    ("doctor with no daemon", "doctor --endpoint ipc://{dir}/nobody-s.sock --timeout 0.3", {},
     r"PROBLEM: .*no answer from ipc://.*nobody-s.sock"),
]


@pytest.mark.parametrize("name, argv, env_extra, want", CASES, ids=[c[0] for c in CASES])
def test_bad_invocation_is_one_line_naming_the_problem(name, argv, env_extra, want, files, busy_port, tmp_path):
    values = {**{k: str(v) for k, v in files.items()}, "port": str(_free_port()), "busy": str(busy_port)}
    env = {**os.environ, "SPECCTL_RUNDIR": str(tmp_path / "run"), "XDG_STATE_HOME": str(tmp_path / "state")}
    env.pop("SPECCTL_CURVE_SECRET_KEY", None)
    env.pop("SPECCTL_CURVE_SERVER_KEY", None)
    env.update({k: v.format(**values) for k, v in env_extra.items()})
    args = [a.format(**values) for a in argv.split()]
    res = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    assert "Traceback" not in out, out
    errors = [ln for ln in out.splitlines() if ln.startswith(("Error:", "PROBLEM:"))]
    assert len(errors) == 1, out
    assert re.search(want.format(**{k: re.escape(v) for k, v in values.items()}), errors[0]), out


def test_the_table_holds_twenty_cases_or_more():
    assert len(CASES) >= 20


def _all_commands(group, prefix=()):
    import click

    for name, cmd in group.commands.items():
        yield (*prefix, name), cmd
        if isinstance(cmd, click.Group):
            yield from _all_commands(cmd, (*prefix, name))


# commands whose options other parts of the tree own (bench, demo, bench reliability)
NOT_HERE = {"bench", "demo"}


def test_every_option_has_help_and_the_config_options_share_one_syntax():
    import click

    from specctl.controller.cli import main
    from specctl.controller.cli_options import parse_configs

    missing = []
    for path, cmd in _all_commands(main):
        if path[0] in NOT_HERE:
            continue
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden and not p.help:
                missing.append(f"{' '.join(path)} {p.opts[0]}")
    assert [p for p in main.params if isinstance(p, click.Option) and not p.help] == []
    assert missing == []
    want = ((0, 1, 1), (1, 1, 2), (3, 1, 4))
    for text in ("off,s1,s3", "off s1 s3", "off;s1;s3", "0,1,1 1,1,2 3,1,4", "off,s1,s3,s3"):
        assert parse_configs(text) == want, text
    assert parse_configs("s2k4n16") == ((2, 4, 16),)
    assert parse_configs("3,1,4") == ((3, 1, 4),)
    # the option that takes a list has the same name wherever it appears (older names kept)
    for path in (("serve",), ("sglang-args",), ("train",)):
        cmd = main
        for part in path:
            cmd = cmd.commands[part]
        assert any("--configs" in p.opts for p in cmd.params), path


def test_sglang_args_says_which_runtime_states_it_adds_and_why():
    res = subprocess.run([*CLI, "sglang-args", "--configs", "off,s9", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    import json

    obj = json.loads(res.stdout)
    assert obj["adaptive_config"]["1"]["candidate_steps"] == [0, 3, 9]  # s3 is the default fallback's
    assert obj["notes"] == ["added s3 to --configs: it is --fallback-config (s3), which needs a runtime state; "
                            "pass one of --configs as --fallback-config to avoid it"]
    res = subprocess.run([*CLI, "sglang-args", "--configs", "off,s9", "--fallback-config", "s9", "--plugin-mode",
                          "fixed"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "# added" not in res.stdout and "SPECCTL_MODE=fixed" in res.stdout, res.stdout
