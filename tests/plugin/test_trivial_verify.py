"""The steps-0 tree's token dtype (AFTER EAGLEWorkerV2._build_trivial_verify_input): without the
overlap scheduler the previous bonus token is the sampler's int32, which SGLang's verify_tree_greedy
refuses (the first steps-0 step after a prefill crashed the scheduler on the H200, 2026-12-02)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from specctl.plugin.patches import trivial_verify

pytestmark = pytest.mark.sglang  # torch comes with the sglang environments
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_the_tree_token_is_int64_with_the_same_ids(dtype):
    dtype = getattr(torch, dtype)
    ids = torch.tensor([5, 49151, 0, 17], dtype=dtype)
    ret = SimpleNamespace(draft_token=ids, positions=torch.arange(4))
    assert trivial_verify.after_trivial_verify_input(ret, None, None) is None  # SGLang's object, changed in place
    assert ret.draft_token.dtype == torch.int64
    assert ret.draft_token.tolist() == ids.tolist()
    if dtype == torch.int64:
        assert ret.draft_token is ids  # nothing copied where SGLang's dtype is right already


def test_an_input_without_a_token_tensor_is_left_alone():
    ret = SimpleNamespace(draft_token=None)
    assert trivial_verify.after_trivial_verify_input(ret, None, None) is None
    assert ret.draft_token is None
    assert trivial_verify.after_trivial_verify_input(None, None, None) is None


@pytest.mark.parametrize("plain", ["on", "off"])
def test_install_registers_it_on_sglangs_method_with_or_without_the_decode_state(plain):
    """The crash is SGLang's trivial verify's, so the hook goes in whether the decode state is on
    or not; the method it wraps exists in this SGLang (its module needs CUDA to import: read the source)."""
    code = r"""
import json, sys
from sglang.srt.plugins.hook_registry import HookRegistry
from specctl.plugin import sglang_hooks
from specctl.plugin.engine import PluginSettings
s = PluginSettings.from_env({"SPECCTL_PATCHES": "plain_decode=" + sys.argv[1], "SPECCTL_TELEMETRY": "none",
                             "SPECCTL_POLICY": "none"})
sglang_hooks.install(s)
t = sglang_hooks.SGLANG_TARGETS.trivial_verify
print(json.dumps({"hooks": [getattr(h, "__name__", "") for _, h, _ in HookRegistry._hooks.get(t, [])]}))
"""
    p = subprocess.run([sys.executable, "-c", code, plain], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["hooks"] == ["after_trivial_verify_input"]
    from specctl.plugin.runtime import SGLANG_TARGETS

    mod, _cls, meth = SGLANG_TARGETS.trivial_verify.rsplit(".", 2)
    with open(importlib.util.find_spec(mod).origin, encoding="utf-8") as f:
        assert f"def {meth}(self, batch" in f.read()
