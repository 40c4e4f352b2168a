"""plugin/settings.py: the operator's twelve SPECCTL_* variables, SPECCTL_PATCHES, and clear errors for the rest."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specctl.plugin import launch_args
from specctl.plugin.settings import OPERATOR_TABLE, PATCHES, RETIRED, PluginSettings

OPERATOR_VARS = ["SPECCTL_MODE", "SPECCTL_SERVER_ID", "SPECCTL_RUNDIR", "SPECCTL_TELEMETRY", "SPECCTL_POLICY",
                 "SPECCTL_POLICY_FILE", "SPECCTL_FALLBACK", "SPECCTL_STALE_AFTER_S", "SPECCTL_CURVE_SECRET_KEY",
                 "SPECCTL_CURVE_SERVER_KEY", "SPECCTL_DECISION_LOG", "SPECCTL_PATCHES"]


def test_the_table_documents_exactly_the_twelve_variables_and_every_patch():
    documented = re.findall(r"^\| `(SPECCTL_[A-Z_]+)` \|", OPERATOR_TABLE, re.M)
    assert documented == OPERATOR_VARS
    assert re.findall(r"^\| `([a-z0-9_]+)` \|", OPERATOR_TABLE, re.M) == list(PATCHES)


def test_no_part_of_the_product_reads_a_variable_the_table_does_not_document():
    """The plugin, the daemon and the commands name SPECCTL_* variables as string literals; every one of them is
    one of the table's twelve (the daemon's state dir and status endpoint are options, not variables)."""
    root = Path(__file__).resolve().parents[2]
    named = set()
    for pkg in ("plugin", "controller", "policies", "training", "harness"):
        for f in (root / pkg).rglob("*.py"):
            named |= set(re.findall(r"[\"'](SPECCTL_[A-Z0-9_]+)[\"']", f.read_text()))
    assert named and named <= set(OPERATOR_VARS), sorted(named - set(OPERATOR_VARS))


def test_the_defaults_are_the_patch_defaults():
    s = PluginSettings.from_env({})
    assert s.patch_modes() == {"plain_decode": "on", "plain_flashinfer": "on", "plain_fa3": "off", "plain_logprobs": "off",
                               "splitkv": "on", "draft_graphs": "on", "spec_alloc": "on", "fi_plan": "off",
                               "fi_extend": "off", "host_lens": "check:32", "catchup": "off"}
    assert {k: v[1] for k, v in PATCHES.items()}["host_lens"] == "check"


def test_patches_override_the_defaults_they_name():
    s = PluginSettings.from_env({"SPECCTL_PATCHES": "catchup=on, host_lens=off,fi_plan=check:64"})
    assert (s.draft_catchup, s.host_seq_lens, s.fi_verify_host_plan, s.fi_verify_check_steps) == (16, "off", "check", 64)
    assert s.host_seq_lens_set and s.plain_decode  # the rest keep their defaults


@pytest.mark.parametrize("value, message", [
    ("catchups=on", "unknown patch 'catchups'"),
    ("host_lens=maybe", "host_lens must be one of on, off, check, check:N, not 'maybe'"),
    ("splitkv", "splitkv needs a value"),
    ("splitkv=on,splitkv=off", "splitkv given twice"),
    ("trees=off", "trees is always on where it applies"),
])
def test_a_bad_patch_list_names_the_problem(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PluginSettings.from_env({"SPECCTL_PATCHES": value})


@pytest.mark.parametrize("old", sorted(RETIRED))
def test_a_retired_variable_says_what_to_set_instead(old):
    with pytest.raises(ValueError, match=f"SPECCTL_{old} \\(set "):
        PluginSettings.from_env({f"SPECCTL_{old}": "on"})


def test_the_fallback_is_threshold_and_config_in_one():
    s = PluginSettings.from_env({"SPECCTL_FALLBACK": "9:s1"})
    assert (s.fallback_threshold, s.fallback_config) == (9, (1, 1, 2))
    assert PluginSettings.from_env({"SPECCTL_FALLBACK": "3:off"}).fallback_config == (0, 1, 1)
    for bad in ("s3", "x:s3", "4:s3k9"):
        with pytest.raises(ValueError, match="SPECCTL_FALLBACK must be N:config"):
            PluginSettings.from_env({"SPECCTL_FALLBACK": bad})


def test_what_sglang_args_prints_reads_back():
    args = launch_args.build([(0, 1, 1), (1, 1, 2), (3, 1, 4)], fallback_threshold=7, fallback_config=(1, 1, 2),
                             plain_decode=False)
    s = PluginSettings.from_env(args.env)
    assert (s.fallback_threshold, s.fallback_config, s.plain_decode) == (7, (1, 1, 2), False)


def test_sglangs_skip_flag_is_read_at_the_edge():
    assert PluginSettings.from_env({"SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND": "1"}).skip_zero_step_draft_extend
    assert not PluginSettings.from_env({}).skip_zero_step_draft_extend
