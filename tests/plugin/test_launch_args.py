"""`specctl sglang-args`: the adaptive config lists every configuration the policy may use."""

from __future__ import annotations

import json

from click.testing import CliRunner

from specctl.controller.cli_sglang import sglang_args
from specctl.plugin import launch_args


def test_every_candidate_and_the_fallback_are_built_in_one_slot():
    args = launch_args.build([(1, 1, 2), (5, 1, 6)])
    # off and the fallback's steps=3 are added: the fallback must always have its states
    assert args.adaptive_config == {"1": {"candidate_steps": [0, 1, 3, 5]}}
    f = args.flags
    assert f[f.index("--speculative-num-steps") + 1] == "5"
    assert f[f.index("--speculative-num-draft-tokens") + 1] == "6"
    assert f[f.index("--speculative-eagle-topk") + 1] == "1"
    assert "--speculative-adaptive" in f
    assert f[f.index("--speculative-adaptive-config") + 1] == "specctl-adaptive.json"


def test_cli_prints_a_copy_paste_snippet_and_json():
    r = CliRunner().invoke(sglang_args, ["--configs", "off,s1,s3", "--server-id", "a b"])
    assert r.exit_code == 0, r.output
    assert "--speculative-adaptive-config specctl-adaptive.json" in r.output
    assert '{"1": {"candidate_steps": [0, 1, 3]}}' in r.output
    assert "SPECCTL_SERVER_ID='a b'" in r.output
    r = CliRunner().invoke(sglang_args, ["--configs", "s2", "--fallback-config", "s1", "--json"])
    obj = json.loads(r.output)
    assert obj["adaptive_config"]["1"]["candidate_steps"] == [0, 1, 2]
    assert obj["env"]["SPECCTL_FALLBACK_CONFIG"] == "1,1,2"


def test_cli_refuses_trees_and_bad_initial_steps():
    r = CliRunner().invoke(sglang_args, ["--configs", "s2k4n8"])
    assert r.exit_code == 2 and "topk=1" in r.output
    r = CliRunner().invoke(sglang_args, ["--configs", "s1", "--initial-steps", "7"])
    assert r.exit_code == 2 and "not among the candidates" in r.output
