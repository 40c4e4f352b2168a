"""`specctl sglang-args`: the adaptive config lists every configuration the policy may use."""

from __future__ import annotations

import json

import pytest
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
    assert obj["env"]["SPECCTL_FALLBACK"].endswith(":1,1,2")


def test_cli_refuses_bad_initial_steps():
    r = CliRunner().invoke(sglang_args, ["--configs", "s1", "--initial-steps", "7"])
    assert r.exit_code == 2 and "not among the candidates" in r.output


def test_a_tree_is_one_more_state_beside_a_chain_launch():
    """The seed operator's tree (topk 4, steps 2, 16 tokens) with plain decode: SGLang's adaptive
    mode launches topk 1 only, so the launch is a chain and the tree rides in the specctl section."""
    args = launch_args.build([(0, 1, 1), (2, 4, 16)], fallback_config=(2, 4, 16))
    cfg = args.adaptive_config
    assert cfg["1"] == {"candidate_steps": [0, 1, 2]}  # s1 added: the chain the server launches as
    assert cfg[launch_args.SIZING_SLOT] == {"candidate_steps": [15]}  # buffers sized for 16 tokens
    assert cfg["specctl"] == {"states": {"2": [2, 4, 16]}}
    assert launch_args.tree_states(json.loads(json.dumps(cfg))) == {2: (2, 4, 16)}
    f = args.flags
    assert f[f.index("--speculative-eagle-topk") + 1] == "1"
    assert f[f.index("--speculative-num-steps") + 1] == "1"
    assert f[f.index("--page-size") + 1] == "1"
    assert args.env["SPECCTL_FALLBACK"].endswith(":2,4,16")
    # with chains given, the launch is the longest chain and the default fallback s3 is kept
    args = launch_args.build([(0, 1, 1), (1, 1, 2), (2, 4, 16), (3, 1, 4)])
    assert args.adaptive_config["1"] == {"candidate_steps": [0, 1, 2, 3]}
    assert args.flags[args.flags.index("--speculative-num-steps") + 1] == "3"
    # chain-only launches are unchanged: no sizing slot, no specctl section, no page-size flag
    plain = launch_args.build([(0, 1, 1), (3, 1, 4)])
    assert set(plain.adaptive_config) == {"1"} and "--page-size" not in plain.flags


@pytest.mark.parametrize("configs, initial, why", [
    ([(2, 4, 16), (2, 1, 3)], None, "both run 2 steps"),
    ([(2, 4, 30)], None, "verifies 3..21 tokens"),
    ([(1, 4, 5), (4, 1, 5)], None, "same number of tokens"),
    ([(0, 1, 1), (2, 4, 16), (3, 1, 4)], 2, "launches adaptive speculation as a chain"),
])
def test_tree_candidates_sglang_could_not_run_are_refused(configs, initial, why):
    with pytest.raises(ValueError, match=why):
        launch_args.build(configs, initial_steps=initial)


@pytest.mark.parametrize("section, why", [
    ({"states": [2, 4, 16]}, "must be"),
    ({"states": {"2": [3, 4, 16]}}, "must be \\[2, topk"),
    ({"states": {"2": [2, 4, "16"]}}, "must be \\[2, topk"),
    ({"states": {"2": [2, 4, 16], "3": [3, 4, 16]}}, "same number of tokens"),
])
def test_a_malformed_specctl_section_is_named(section, why):
    with pytest.raises(ValueError, match=why):
        launch_args.tree_states({"1": {"candidate_steps": [0, 2]}, "specctl": section})


def test_cli_prints_a_tree_launch():
    r = CliRunner().invoke(sglang_args, ["--configs", "off,s2k4n16", "--fallback-config", "s2k4n16", "--json"])
    assert r.exit_code == 0, r.output
    obj = json.loads(r.output)
    assert obj["adaptive_config"]["specctl"] == {"states": {"2": [2, 4, 16]}}


def test_cli_says_what_the_decode_state_costs_and_how_to_turn_it_off():
    r = CliRunner().invoke(sglang_args, ["--configs", "off,s1,s3"])
    assert r.exit_code == 0 and "decode state" in r.output and "SPECCTL_PATCHES=plain_decode=off" in r.output
    assert "SPECCTL_PATCHES=plain_decode=off python" not in r.output  # on by default: nothing in the environment
    r = CliRunner().invoke(sglang_args, ["--configs", "off,s1,s3", "--no-plain-decode"])
    assert r.exit_code == 0 and "SPECCTL_PATCHES=plain_decode=off " in r.output.splitlines()[-1]
    r = CliRunner().invoke(sglang_args, ["--configs", "off,s1,s3", "--no-plain-decode", "--json"])
    assert json.loads(r.output)["env"]["SPECCTL_PATCHES"] == "plain_decode=off"
