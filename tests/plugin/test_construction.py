"""Construction is all-or-nothing: a failure at any step of building the plugin (install) or an engine (new_engine,
EngineController) leaves nothing half-built behind: no runtime published, no hook registered, no file opened, no
tree state set; and the log says what is then true. The start-up line an operator (and `specctl doctor`) reads."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from specctl.plugin import engine as engine_mod
from specctl.plugin import runtime as plugin_runtime
from specctl.plugin.settings import PluginSettings


class Boom(RuntimeError):
    pass


def boom(*a, **k):
    raise Boom("injected")


# ----------------------------------------------------------------------------- install (SGLang's real registry)

@pytest.fixture
def registry():
    from sglang.srt.plugins.hook_registry import HookRegistry

    before = {k: list(v) for k, v in HookRegistry._hooks.items()}
    yield HookRegistry
    HookRegistry._hooks.clear()
    HookRegistry._hooks.update(before)
    plugin_runtime.publish(None)


def _install(**kw):
    from specctl import plugin

    return plugin.install(PluginSettings(telemetry_endpoint=None, policy_endpoint=None), **kw)


@pytest.mark.sglang
def test_a_failure_at_any_install_step_registers_and_publishes_nothing(registry, monkeypatch, caplog):
    from specctl.plugin import sglang_hooks

    before = {k: list(v) for k, v in registry._hooks.items()}
    steps = [f"factory {mod}.{fn}" for mod, fn in sglang_hooks.PATCHES] + ["policy class"]
    rt = _install()
    n_hooks = sum(len(v) for v in registry._hooks.values()) - sum(len(v) for v in before.values())
    assert rt is not None and n_hooks >= 3
    registry._hooks.clear()
    registry._hooks.update({k: list(v) for k, v in before.items()})
    plugin_runtime.publish(None)
    steps += [f"register {k}" for k in range(n_hooks)]
    real_register = registry.register.__func__
    for step in steps:
        with monkeypatch.context() as m:
            if step.startswith("factory"):
                mod, fn = step.split()[1].split(".")
                m.setattr(__import__(f"specctl.plugin.patches.{mod}", fromlist=[fn]), fn, boom)
            elif step == "policy class":
                m.setattr(sglang_hooks, "make_policy_class", boom)
            else:
                k, calls = int(step.split()[1]), []

                def register(cls, *a, _k=k, _calls=calls, **kw):
                    _calls.append(1)
                    if len(_calls) > _k:
                        raise Boom("injected")
                    return real_register(cls, *a, **kw)

                m.setattr(registry, "register", classmethod(register))
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="specctl.plugin"):
                assert _install() is None, step
        assert plugin_runtime.current() is None, step
        assert {k: list(v) for k, v in registry._hooks.items() if v} == before, step
        assert any("hooks not registered" in r.getMessage() and "SGLang runs its own policy" in r.getMessage()
                   for r in caplog.records), step


# ----------------------------------------------------------------------------- new_engine / EngineController

ENGINE_STEPS = ["usable trees", "TP group", "engine", "state configs", "fallback", "apply"]


@pytest.mark.parametrize("step", ENGINE_STEPS)
def test_a_failure_at_any_engine_step_leaves_the_runtime_as_it_was(step, tmp_path, monkeypatch):
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps({"kind": "policy", "schema": 1, "version": 3, "source": "file",
                                  "rows": [{"min_batch": 1, "max_batch": None,
                                            "config": {"steps": 1, "topk": 1, "draft_tokens": 2}}]}))
    log_path = tmp_path / "d{rank}.txt"
    settings = PluginSettings(mode="file", policy_file=str(policy), decision_log=str(log_path),
                              telemetry_endpoint=f"ipc://{tmp_path}/t.sock", policy_endpoint=None)
    rt = plugin_runtime.PluginRuntime(settings, policy_file_bytes=policy.read_bytes(), tp_group_fn=lambda: None)
    target = {"usable trees": (rt, "_usable_trees"), "TP group": (rt, "tp_group_fn"),
              "engine": (plugin_runtime, "EngineController"), "state configs": (engine_mod, "state_configs"),
              "fallback": (engine_mod.EngineController, "_build_fallback"),
              "apply": (engine_mod.EngineController, "apply")}[step]
    monkeypatch.setattr(*target, boom)
    if step == "TP group":  # no group is a known state: the engine starts on the fixed policy, every rank alike
        eng = rt.new_engine([0, 1, 3])
        assert rt.engine is eng and eng.failed and rt.sender is None
        eng.close_trace()
        return
    with pytest.raises(Boom):
        rt.new_engine([0, 1, 3])
    assert rt.engine is None and rt.trees == {} and rt.max_topk == 1
    assert rt.sender is None and rt.receiver is None and not rt.telemetry_on
    assert not (tmp_path / "d0.txt").exists()  # the decision log is opened last


@pytest.mark.sglang
def test_a_tree_config_the_engine_refuses_sets_no_tree_state(plugged):
    """{"specctl": {"states": {"2": [2, 2, 4]}}} passes tree_states, then the engine refuses it (two states of
    width 4): nothing of it may stay set."""
    was_engine = plugged.engine
    with pytest.raises(ValueError, match="both verify 4 tokens"):
        plugged.new_engine([0, 1, 2, 3], {2: (2, 2, 4)})
    assert plugged.trees == {} and plugged.max_topk == 1 and plugged.engine is was_engine


# ----------------------------------------------------------------------------- the start-up line

STARTUP = r"""
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")

def run_scheduler_process():
    from sglang.srt.plugins import load_plugins
    load_plugins()

run_scheduler_process()
from specctl.plugin import runtime
assert runtime.current() is not None
runtime.after_init_graphs(None, None)  # what SGLang calls after EAGLEWorkerV2.init_cuda_graphs (CUDA-only here)
runtime.after_init_graphs(None, None)  # once per process
"""


@pytest.mark.sglang
def test_the_startup_line_of_a_real_install_says_what_is_true(tmp_path):
    import sglang

    env = dict(os.environ, PYTHONWARNINGS="ignore", SPECCTL_RUNDIR=str(tmp_path), SPECCTL_SERVER_ID="doc-test",
               SPECCTL_PATCHES="catchup=on,host_lens=off")
    p = subprocess.run([sys.executable, "-c", STARTUP], capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("specctl: startup ")]
    assert len(lines) == 1, p.stdout[-3000:]
    got = json.loads(lines[0][len("specctl: startup "):])
    assert set(got) == {"server", "rank", "world_size", "sglang", "mode", "hooks_missing", "patches", "policy"}
    assert (got["server"], got["rank"], got["world_size"], got["mode"]) == ("doc-test", 0, 1, "online")
    assert got["sglang"] == sglang.__version__
    # on CPU SGLang cannot import the worker modules: their hooks are missing, and the patches on them are off
    assert any("EAGLEWorkerV2" in t for t in got["hooks_missing"])
    assert got["patches"]["plain_decode"].startswith("off: the hooks on ")
    assert got["patches"]["catchup"].startswith("off: ") and "host_lens" not in got["patches"]
    assert all(v in ("on", "check") or v.startswith("off: ") for v in got["patches"].values())
    assert got["policy"] == {"source": None, "version": None,
                             "fallback_reason": "no engine: SGLang's own policy decides"}
    for name in ("plain_decode", "catchup"):  # each turn-off said once, in the operator's words
        assert sum(ln.startswith(f"specctl: patch {name} off: ") for ln in p.stdout.splitlines()) == 1


def test_the_policy_class_uses_only_sglangs_public_protocol():
    """SGLang keeps its slots and graph sizes private (upstream moved them since): the REPLACE reads neither."""
    from pathlib import Path

    src = (Path(__file__).parents[2] / "plugin" / "policy.py").read_text()
    assert "._slots" not in src and "._cuda_graph_bs" not in src
