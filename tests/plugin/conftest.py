"""Plugin tests: `sglang`-marked ones need the real sglang modules (scripts/setup_sglang_cpu.sh);
they run once per installed sglang version: `.cache/sglang-<version>/bin/python -m pytest tests/plugin`."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

# SGLang's triton kernels run on CPU tensors in triton's interpreter (fi_harness.py runs the kv-index one); it
# must be on before triton is first imported, as triton reads it when a kernel is decorated
os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = Path(__file__).parent
STANDIN = "specctl_sglang_standin"


def _sglang_problem() -> str | None:
    if importlib.util.find_spec("sglang") is None:
        return ("needs the sglang modules, absent from this interpreter: `make test` runs it under each "
                "release's CPU environment (.cache/sglang-<version>/bin/python -m pytest -m sglang tests/plugin)")
    try:
        import sglang.srt.plugins.hook_registry  # noqa: F401
        import sglang.srt.speculative.adaptive_runtime_state  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"sglang is installed but its plugin/adaptive modules do not import: {type(e).__name__}: {e}"
    return None


SGLANG_PROBLEM = _sglang_problem()


def pytest_collection_modifyitems(config, items):
    if SGLANG_PROBLEM is None:
        return
    skip = pytest.mark.skip(reason=SGLANG_PROBLEM)
    for item in items:
        if "sglang" in item.keywords:
            item.add_marker(skip)


def load_standin():
    if STANDIN not in sys.modules:
        spec = importlib.util.spec_from_file_location(STANDIN, HERE / "sglang_standin.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[STANDIN] = mod
        spec.loader.exec_module(mod)
    return sys.modules[STANDIN]


@pytest.fixture(scope="module")
def plugged():
    """This pytest process as an SGLang scheduler process: SPECCTL_* set, load_plugins() called
    from a frame named run_scheduler_process (as sglang's scheduler.py does), and our two
    worker-side hooks also registered on the CPU stand-ins (the real targets need CUDA)."""
    rundir = tempfile.mkdtemp(prefix="specctl-plugin-")
    env = {"SPECCTL_RUNDIR": rundir, "SPECCTL_SERVER_ID": "cpu-test", "SPECCTL_STALE_AFTER_S": "5"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        def run_scheduler_process():
            from sglang.srt.plugins import load_plugins

            load_plugins()

        run_scheduler_process()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from specctl.plugin import runtime as plugin_runtime
    from specctl.plugin.patches import trees

    rt = plugin_runtime.current()
    assert rt is not None, "load_plugins() did not run specctl's register()"
    load_standin()
    HookRegistry.register(f"{STANDIN}.EAGLEWorkerV2Standin.forward_batch_generation",
                          plugin_runtime.around_forward, HookType.AROUND)
    HookRegistry.register(f"{STANDIN}.ResultProcessorStandin._resolve_spec_v2_tokens",
                          plugin_runtime.after_resolve, HookType.AFTER)
    # the tree hooks, on the tree stand-ins (the real targets need CUDA-only modules); the start-up
    # check then looks for these
    tree = dict(build=f"{STANDIN}.TreeWorkerStandin.build_adaptive_runtime_state",
                apply=f"{STANDIN}.TreeWorkerStandin.apply_runtime_state",
                extend_decode=f"{STANDIN}.DraftWorkerStandin._draft_extend_for_decode",
                extend_prefill=f"{STANDIN}.DraftWorkerStandin._draft_extend_for_prefill",
                draft=f"{STANDIN}.DraftWorkerStandin.draft")
    tree["logits_rows"] = f"{STANDIN}.ModelRunnerStandin.max_decode_logits_rows"
    # the tree patches, guarded as install() registers them, on the stand-ins; the start-up check looks for these
    standin_rt = SimpleNamespace(targets=dataclasses.replace(rt.targets, **tree), fail_engine=rt.fail_engine)
    for p in (trees.patch(standin_rt), trees.width_patch(standin_rt)):
        rt.guard.patches[p.name] = p
        for target, kind, fn in p.hooks:
            HookRegistry.register(target, p.wrapped(kind, fn), getattr(HookType, kind))
    HookRegistry.apply_hooks()
    rt.targets = standin_rt.targets
    rt.settings = dataclasses.replace(rt.settings, sync_every=4)  # a TP sync every 4 results (16 in a server)
    yield rt
    rt.close()
    _unpatch_policy_class()
    HookRegistry.reset()
    plugin_runtime.publish(None)
    # the next module loads the plugin afresh, with unwrapped stand-ins
    import sglang.srt.plugins

    import specctl.plugin

    sglang.srt.plugins._plugins_loaded = False
    specctl.plugin._registered = False
    sys.modules.pop(STANDIN, None)


def _unpatch_policy_class():
    """Undo the REPLACE everywhere it was propagated, so that later tests in this process (e.g. the
    SGLang-port test of policies/) see SGLang's own class again."""
    import sglang.srt.speculative.adaptive_spec_params as asp

    ours = asp.AdaptiveSpeculativeParams
    if ours.__name__ != "SpecctlSpeculativeParams":
        return
    original = ours.__mro__[1]
    for mod in list(sys.modules.values()):
        try:
            names = [k for k, v in vars(mod).items() if v is ours]
        except TypeError:
            continue
        for k in names:
            setattr(mod, k, original)


@pytest.fixture(scope="session")
def import_sibling():
    """`import_sibling(name)`: a module beside these tests (a CPU harness of SGLang code), imported with this
    folder on sys.path for the import only."""
    import importlib

    def load(name: str):
        sys.path.insert(0, str(HERE))
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(str(HERE))

    return load


@pytest.fixture
def standin_module():
    """`standin_module(name)`: a fresh module in sys.modules whose classes hooks can target by dotted name; the
    hooks registered on its targets and the module itself are gone after the test."""
    import types

    made = []

    def make(name: str):
        mod = types.ModuleType(name)
        sys.modules[name] = mod
        made.append(name)
        return mod

    yield make
    from sglang.srt.plugins.hook_registry import HookRegistry

    for name in made:
        for k in [k for k in HookRegistry._hooks if k.startswith(name + ".")]:
            HookRegistry._hooks.pop(k)
            HookRegistry._patched.discard(k)
        sys.modules.pop(name, None)
