"""Patch spec_alloc: SGLang 0.5.17's alloc_for_spec_decode (every EAGLE decode step, on the scheduler
thread) ends with `req.kv.kv_allocated_len = max(..., int(nxt_kv_lens_cpu[i]))` for each request: two ATen
calls a request. The hook hands it the same lengths as a list of ints at page size 1 (0.5.23 calls .tolist()
itself). The installed SGLang's function is compiled from its own source here (its module imports
transformers, which the CPU environments lack), its collaborators recorded."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from specctl.plugin import sglang_source
from specctl.plugin.guard import Patch
from specctl.plugin.patches import spec_alloc
from specctl.plugin.engine import PluginSettings


def test_settings_read_the_switch():
    assert PluginSettings.from_env({}).spec_alloc_list is True
    assert PluginSettings.from_env({"SPECCTL_PATCHES": "spec_alloc=off"}).spec_alloc_list is False
    with pytest.raises(ValueError, match="SPECCTL_PATCHES: spec_alloc must be on or off"):
        PluginSettings.from_env({"SPECCTL_PATCHES": "spec_alloc=sometimes"})


def _installed_alloc_for_spec_decode(calls: list, compile_from):
    """sglang.srt.mem_cache.allocation.alloc_for_spec_decode as the installed SGLang writes it (compiled from its
    source: tests/plugin/sglang_source.py); the functions it calls record their arguments."""
    import sglang

    def record(name):
        def f(*a, **k):
            calls.append((name, a, k))
            return f"{name}-out"
        return f

    ns = {"alloc_token_slots": record("alloc_token_slots"), "assign_req_to_token_pool_func": record("assign"),
          "get_last_loc": record("get_last_loc"), "ALLOC_EXTEND_FUNCS": {"cpu": record("alloc_extend")},
          "_device_type": lambda b: "cpu", "evict_from_tree_cache": record("evict")}
    path = Path(sglang.__file__).parent / "srt" / "mem_cache" / "allocation.py"
    return compile_from(path, ns, ["alloc_for_spec_decode"])["alloc_for_spec_decode"]


def _call(fn, torch, *, page_size, lens, needed, seed=0):
    rnd = random.Random(seed)
    reqs = [SimpleNamespace(kv=SimpleNamespace(kv_allocated_len=rnd.randint(0, 400))) for _ in lens]
    tc = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(page_size=page_size))
    batch = SimpleNamespace(device="cpu", hisparse_coordinator=None)
    nxt = torch.tensor(lens, dtype=torch.int32)
    fn(tc, SimpleNamespace(req_to_token="r2t"), reqs=reqs, req_pool_indices="idx", cur_kv_lens="cur",
       cur_kv_lens_cpu=nxt - 1, nxt_kv_lens="nxt", nxt_kv_lens_cpu=nxt, num_needed_tokens=needed, batch=batch)
    return [r.kv.kv_allocated_len for r in reqs]


@pytest.mark.sglang
@pytest.mark.parametrize("page_size, needed", [(1, 0), (1, 37), (4, 64)])
def test_the_lengths_come_out_the_same(page_size, needed, import_sibling):
    """Through the hook or not, SGLang's function leaves every request the same allocated length and calls
    its allocator and req_to_token writer with the same arguments."""
    import sglang
    import torch

    needed_here = sglang_source.spec_alloc_reads_scalars()
    assert needed_here is (sglang.__version__ == "0.5.17")
    if not needed_here:  # 0.5.23 reads .tolist() itself: no hook is installed there (test below)
        return
    rnd = random.Random(7)
    for bs in (1, 3, 128):
        lens = [rnd.randint(0, 500) for _ in range(bs)]
        plain, hooked = [], []
        compile_from = import_sibling("sglang_source").compile_from
        fn_plain = _installed_alloc_for_spec_decode(plain, compile_from)
        fn_hooked = _installed_alloc_for_spec_decode(hooked, compile_from)
        want = _call(fn_plain, torch, page_size=page_size, lens=lens, needed=needed, seed=bs)
        got = _call(lambda *a, **k: spec_alloc.around_spec_alloc(fn_hooked, *a, **k), torch,
                    page_size=page_size, lens=lens, needed=needed, seed=bs)
        assert got == want
        assert [(n, len(a)) for n, a, _ in hooked] == [(n, len(a)) for n, a, _ in plain]
        if page_size > 1:  # the paged allocator got the tensor itself
            assert [type(a[4]).__name__ for n, a, _ in hooked if n == "alloc_extend"] == ["Tensor"]


def test_the_hook_hands_a_list_at_page_size_1_only():
    seen = []

    def orig(tree_cache, pool, **kw):
        seen.append(kw["nxt_kv_lens_cpu"])
        return "done"

    class Lens(list):
        def tolist(self):
            return list(self)

    t = Lens([5, 6])
    tc1 = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(page_size=1))
    tc4 = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(page_size=4))
    patch = Patch(spec_alloc.NAME)
    hook = patch.wrapped("AROUND", spec_alloc.around_spec_alloc)  # guarded, as install() registers it
    assert hook(orig, tc1, "pool", nxt_kv_lens_cpu=t) == "done"
    assert hook(orig, tc4, "pool", nxt_kv_lens_cpu=t) == "done"
    # no allocator to read: the call as SGLang made it, the patch off (said once)
    assert hook(orig, SimpleNamespace(), "pool", nxt_kv_lens_cpu=t) == "done"
    assert not patch.on and "AttributeError" in patch.off_reason
    assert [type(x) for x in seen] == [list, Lens, Lens] and seen[0] == [5, 6]


@pytest.mark.sglang
def test_the_hook_is_registered_where_sglang_reads_scalars():
    """install() registers it exactly where the installed SGLang loops over tensor scalars (0.5.17)."""
    import sglang

    code = textwrap.dedent(r"""
        import json
        from sglang.srt.plugins.hook_registry import HookRegistry
        from specctl.plugin import sglang_hooks
        from specctl.plugin.engine import PluginSettings
        out = {}
        for v in ("on", "off"):
            HookRegistry._hooks.clear()
            s = PluginSettings.from_env({"SPECCTL_PATCHES": "spec_alloc=" + v, "SPECCTL_TELEMETRY": "none",
                                         "SPECCTL_POLICY": "none"})
            sglang_hooks.install(s)
            out[v] = sglang_hooks.SGLANG_TARGETS.spec_alloc in HookRegistry._hooks
        print(json.dumps(out))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"on": sglang.__version__ == "0.5.17", "off": False}


@pytest.mark.sglang
def test_the_hooked_name_is_the_one_sglang_calls():
    """eagle_prepare_for_decode calls alloc_for_spec_decode by the name eagle_utils imported (the hook's
    target), with the next lengths as a keyword."""
    origin = importlib.util.find_spec("sglang").submodule_search_locations[0]
    with open(os.path.join(origin, "srt/speculative/eagle_utils.py"), encoding="utf-8") as f:
        src = f.read()
    assert "from sglang.srt.mem_cache.allocation import alloc_for_spec_decode" in src
    tree = ast.parse(src)
    prep = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "eagle_prepare_for_decode")
    calls = [c for c in ast.walk(prep) if isinstance(c, ast.Call) and getattr(c.func, "id", "") == "alloc_for_spec_decode"]
    assert len(calls) == 1 and "nxt_kv_lens_cpu" in {k.arg for k in calls[0].keywords}
