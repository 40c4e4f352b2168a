"""SPECCTL_FI_VERIFY_HOST_PLAN (docs/flashinfer-spec-copies.md, fix P2): the TARGET_VERIFY flashinfer plan of SGLang
0.5.17 built from host values. The settings; on 0.5.23 SGLang's own opt-in; on 0.5.17 the two hooks around SGLang's
own backend code (tests/plugin/fi_harness.py), against plan()'s result on the same batch."""

from __future__ import annotations

import pytest

from specctl.plugin.engine import PluginSettings


@pytest.mark.parametrize("value, mode, steps", [
    (None, "off", 32),          # off until a GPU run has checked it
    ("off", "off", 32), ("0", "off", 32),
    ("on", "on", 32), ("ON", "on", 32), ("1", "on", 32),
    ("check", "check", 32), ("check:200", "check", 200),
])
def test_settings_read_the_switch(value, mode, steps):
    env = {} if value is None else {"SPECCTL_FI_VERIFY_HOST_PLAN": value}
    s = PluginSettings.from_env(env)
    assert (s.fi_verify_host_plan, s.fi_verify_check_steps) == (mode, steps)


@pytest.mark.parametrize("value", ["auto", "check:", "check:x", "check:0", "on:3"])
def test_settings_refuse_nonsense(value):
    with pytest.raises(ValueError, match="SPECCTL_FI_VERIFY_HOST_PLAN"):
        PluginSettings.from_env({"SPECCTL_FI_VERIFY_HOST_PLAN": value})
