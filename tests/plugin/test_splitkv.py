"""The split-KV verify patch (SPECCTL_PATCHES splitkv): which TritonAttnBackend instances get SGLang's
split-KV verify kernel, and that install() registers the hook only when asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from specctl.plugin import sglang_source
from specctl.plugin.engine import PluginSettings
from specctl.plugin.patches import splitkv


def backend(topk, device="cuda", flag=False, kernel=True):
    b = SimpleNamespace(topk=topk, device=device, use_verify_splitkv=flag)
    if kernel:
        b.verify_splitkv_fwd = lambda *a, **k: True
    return b


@pytest.mark.parametrize("b, on", [
    (backend(1), True),                      # a topk-1 chain on CUDA: the causal split-KV kernel is exact
    (backend(0), True),                      # a backend built without speculation (topk 0): decode never verifies
    (backend(4), False),                     # a tree: not causal, the kernel would be wrong
    (backend(1, device="cpu"), False),
    (backend(1, kernel=False), False),       # a release without the kernel
    (backend(None), False),
    (backend(4, flag=True), True),           # SGLang's own choice (gfx95) is never taken back
])
def test_only_topk1_cuda_backends_get_the_split_kv_kernel(b, on):
    assert splitkv.after_triton_init(None, b) is None
    assert b.use_verify_splitkv is on


def test_settings_read_the_switch_and_refuse_nonsense():
    assert PluginSettings.from_env({}).splitkv_verify is True  # on by default since its GPU checks passed
    assert PluginSettings.from_env({"SPECCTL_PATCHES": "splitkv=off"}).splitkv_verify is False
    assert PluginSettings.from_env({"SPECCTL_PATCHES": "splitkv=on"}).splitkv_verify is True
    with pytest.raises(ValueError, match="SPECCTL_PATCHES: splitkv must be on or off"):
        PluginSettings.from_env({"SPECCTL_PATCHES": "splitkv=maybe"})


def test_sglangs_own_switch_off_keeps_the_extend_kernel(monkeypatch):
    monkeypatch.setattr(sglang_source, "allows_splitkv", lambda: False)
    b = backend(1)
    assert splitkv.after_triton_init(None, b) is None
    assert b.use_verify_splitkv is False


@pytest.mark.sglang
@pytest.mark.parametrize("value, allowed", [(None, True), ("0", False), ("false", False), ("1", True)])
def test_sglangs_switch_is_read_as_sglang_reads_it(value, allowed):
    code = r"""
from specctl.plugin import sglang_source
print(sglang_source.allows_splitkv())
"""
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_ENABLE_SPLITKV_VERIFY"}
    if value is not None:
        env["SGLANG_ENABLE_SPLITKV_VERIFY"] = value
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(env, PYTHONWARNINGS="ignore"))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip().splitlines()[-1] == str(allowed)


@pytest.mark.sglang
def test_install_registers_the_hook_only_when_asked():
    code = r"""
import json, sys
from sglang.srt.plugins.hook_registry import HookRegistry
from specctl.plugin import sglang_hooks
from specctl.plugin.engine import PluginSettings
s = PluginSettings.from_env({"SPECCTL_PATCHES": "splitkv=" + sys.argv[1], "SPECCTL_TELEMETRY": "none",
                             "SPECCTL_POLICY": "none"})
sglang_hooks.install(s)
print(json.dumps(sorted(HookRegistry._hooks)))
"""
    from specctl.plugin.runtime import SGLANG_TARGETS

    target = SGLANG_TARGETS.triton_init
    for v, want in (("on", True), ("off", False)):
        p = subprocess.run([sys.executable, "-c", code, v], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONWARNINGS="ignore"))
        assert p.returncode == 0, p.stderr[-2000:]
        assert (target in json.loads(p.stdout.strip().splitlines()[-1])) is want
