"""Patch draft_graphs: each chain state's draft-extend CUDA graph at its own width. SGLang 0.5.17
sizes every adaptive state's draft-extend graph runner from the startup ServerArgs (the launch width), so at
steps 0, s1 and s2 the runtime width differs from the captured one and the draft extends eagerly; the hook
answers the width of the state being built (the spec bag), as 0.5.23 does itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from specctl.plugin import sglang_source
from specctl.plugin.engine import PluginSettings
from specctl.plugin.guard import Patch
from specctl.plugin.patches import draft_graphs


class Bag:
    def __init__(self, n, topk=1, fail=False):
        self.n, self.topk, self.fail = n, topk, fail

    def get_spec(self):
        if self.fail:
            raise RuntimeError("config not published")
        return SimpleNamespace(speculative_num_draft_tokens=self.n, speculative_eagle_topk=self.topk)


def launch_width(*, phase, server_args, **kw):  # 0.5.17's rule for draft_extend: the startup ServerArgs
    return {"draft_extend": server_args.speculative_num_draft_tokens, "draft_decode": 1, "target_verify": 99}[phase]


SA = SimpleNamespace(speculative_num_draft_tokens=4)  # launched as s3


@pytest.mark.parametrize("bag, phase, want", [
    (Bag(1), "draft_extend", 1),               # the steps-0 state's build: its graph takes 1 token a request
    (Bag(2), "draft_extend", 2),               # s1
    (Bag(4), "draft_extend", 4),               # the launch state (or no build running): unchanged
    (Bag(16, topk=4), "draft_extend", 4),      # a tree: its build sets ServerArgs itself
    (Bag(1), "target_verify", 99),             # other phases are SGLang's
    (Bag(1), "draft_decode", 1),
    (Bag(None), "draft_extend", 4),            # nothing usable in the bag: SGLang's width
    (Bag(0), "draft_extend", 4),
    (Bag(1, fail=True), "draft_extend", 4),    # the bag cannot be read: SGLang's width, said once
])
def test_the_width_is_the_state_being_built(monkeypatch, bag, phase, want):
    monkeypatch.setattr(sglang_source, "runtime_context", lambda: bag)
    hook = Patch(draft_graphs.NAME).wrapped("AROUND", draft_graphs.around_draft_width)  # as install() registers it
    assert hook(launch_width, phase=phase, server_args=SA) == want


def test_settings_read_the_switch():
    assert PluginSettings.from_env({}).draft_extend_graphs is True  # on by default since the H200 measured it
    assert PluginSettings.from_env({"SPECCTL_PATCHES": "draft_graphs=off"}).draft_extend_graphs is False
    assert PluginSettings.from_env({"SPECCTL_PATCHES": "draft_graphs=on"}).draft_extend_graphs is True
    with pytest.raises(ValueError, match="SPECCTL_PATCHES: draft_graphs must be on or off"):
        PluginSettings.from_env({"SPECCTL_PATCHES": "draft_graphs=auto"})


@pytest.mark.sglang
def test_the_hook_is_registered_where_sglang_reads_the_launch_width():
    """With the switch on, install() registers the hook exactly where the installed SGLang's
    resolve_num_tokens_per_req takes server_args (0.5.17), not where it reads the spec bag (0.5.23)."""
    import sglang

    code = textwrap.dedent(r"""
        import json
        from sglang.srt.plugins.hook_registry import HookRegistry
        from specctl.plugin import sglang_hooks, sglang_source
        from specctl.plugin.engine import PluginSettings
        s = PluginSettings.from_env({"SPECCTL_PATCHES": "draft_graphs=on", "SPECCTL_TELEMETRY": "none",
                                     "SPECCTL_POLICY": "none"})
        sglang_hooks.install(s)
        print(json.dumps({"needed": sglang_source.draft_width_needed(),
                          "registered": sglang_hooks.SGLANG_TARGETS.draft_width in HookRegistry._hooks}))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["needed"] is (sglang.__version__ == "0.5.17") and out["registered"] is out["needed"]


def _source(module: str) -> str:
    import importlib.util

    with open(importlib.util.find_spec(module).origin, encoding="utf-8") as f:
        return f.read()


@pytest.mark.sglang
def test_the_source_contract_the_hook_relies_on():
    """Read from the installed SGLang (its speculative modules need CUDA-only imports): the draft-extend
    graph runner takes its capture width from resolve_num_tokens_per_req(phase="draft_extend", ...) by the
    name it imported from spec_utils; the state build overrides the spec bag's width; at run time the
    draft extend's width is the worker's (the state's), and a width other than the captured one means eager."""
    import ast

    import sglang

    runner = _source("sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner")
    assert "from sglang.srt.speculative.spec_utils import resolve_num_tokens_per_req" in runner
    calls = [n for n in ast.walk(ast.parse(runner)) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "resolve_num_tokens_per_req"]
    assert any(any(k.arg == "phase" and getattr(k.value, "value", None) == "draft_extend" for k in c.keywords)
               for c in calls)
    assert "spec_info.num_tokens_per_req != self.captured_req_width" in runner  # can_run_graph: else eager
    worker = _source("sglang.srt.speculative.eagle_worker_v2")
    assert '"adaptive_spec.capture_override"' in worker and "speculative_num_draft_tokens=speculative_num_draft_tokens" in worker
    assert "num_tokens_per_req=self.speculative_num_draft_tokens" in worker  # the draft extend's runtime width
    if sglang.__version__ == "0.5.17":
        assert "server_args=model_runner.server_args" in runner  # the launch width: what the hook corrects
