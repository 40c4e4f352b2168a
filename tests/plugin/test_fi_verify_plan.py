"""Patch fi_plan (docs/architecture.md, fix P2): the TARGET_VERIFY flashinfer plan of SGLang
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
    env = {} if value is None else {"SPECCTL_PATCHES": f"fi_plan={value}"}
    s = PluginSettings.from_env(env)
    assert (s.fi_verify_host_plan, s.fi_verify_check_steps) == (mode, steps)


@pytest.mark.parametrize("value", ["auto", "check:", "check:x", "check:0", "on:3"])
def test_settings_refuse_nonsense(value):
    with pytest.raises(ValueError, match="SPECCTL_PATCHES: fi_plan"):
        PluginSettings.from_env({"SPECCTL_PATCHES": f"fi_plan={value}"})


# ----------------------------------------------------------------------------- SGLang 0.5.17: the hooks

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).parent


def _has_own_opt_in() -> bool:
    from specctl.plugin import sglang_source

    return sglang_source.verify_host_plan_switch() is not None


@pytest.fixture
def fi(import_sibling):
    """tests/plugin/fi_harness.py, on an SGLang without its own opt-in (0.5.17)."""
    if _has_own_opt_in():
        pytest.skip("this SGLang has SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN: the setting turns that on, no hooks")
    return import_sibling("fi_harness")


def hooked(h, hp):
    """The two hooks on this harness's classes, wrapped by SGLang's own hook wrapper (what apply_hooks installs)."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    def out_graph(o, b, *a, **k):
        return hp.around_out_graph(o, b, a, k)

    def call_begin_forward(o, u, *a, **k):
        return hp.around_call_begin_forward(o, u, a, k)

    B, U = h.Backend, h.Updater
    B.init_forward_metadata_out_graph = _wrap_fn(B.init_forward_metadata_out_graph, out_graph, HookType.AROUND)
    U.call_begin_forward = _wrap_fn(U.call_begin_forward, call_begin_forward, HookType.AROUND)
    return h


def host_plan(fi, mode="on", **kw):
    from specctl.plugin.patches.fi_plan import HostPlan

    return HostPlan(mode, pack=fi.segment_packbits_kernel, **kw)


READS = ["packed_mask_size", "qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len"]  # V1, V2, V3, V4
# raw batches (padded to the captured 1, 2, 4, 8), one after the other on the same wrappers
BATCHES = [[17], [5, 40, 9], [3, 3, 3, 3, 3], [60, 1, 22, 7, 15, 33, 2, 8], [50, 2]]


@pytest.mark.sglang
@pytest.mark.parametrize("width", [1, 2, 4])
def test_the_host_plan_leaves_what_plan_leaves_without_reading_the_device(fi, width):
    stock, mine = fi.Harness(width=width), hooked(fi.Harness(width=width), hp := host_plan(fi))
    stock.capture()
    mine.capture()
    assert all(getattr(w, "_specctl_host_plan", None) == width
               for ws in mine.backend.prefill_cuda_graph_metadata.values() for w in ws)
    for i, lens in enumerate(BATCHES):
        (ws,), (wm,) = stock.replay(stock.batch(lens, seed=i)), mine.replay(mine.batch(lens, seed=i))
        assert stock.reads.names == READS and mine.reads.names == []
        assert fi.state_diff(fi.wrapper_state(ws), fi.wrapper_state(wm)) == []
        assert "begin_forward" not in vars(wm)  # the override lives for one call only
        stock.reads.names.clear()
    assert hp.on and hp.num_host_plans == len(BATCHES) and hp.num_marked == 4


@pytest.mark.sglang
def test_the_host_layout_is_what_sglang_builds_on_the_device(fi):
    """generate_attn_arg_prefill's indptrs (SGLang's device-side code, here on CPU) and the packed mask's byte
    offsets of plan()'s segment_packbits, for a padded batch."""
    import torch

    from specctl.plugin.patches.fi_plan import host_layout

    h = fi.Harness(width=3)
    seq_lens = torch.tensor([9, 30, 1, 1], dtype=torch.int64)  # two padded rows (fill value 1)
    b = h.batch([9, 30])
    kv_indices, kv_indptr, qo_indptr, mask = b.spec_info.generate_attn_arg_prefill(
        torch.tensor([0, 1, 0, 0]), seq_lens, int(seq_lens.sum()), h.req_to_token)
    lay = host_layout(seq_lens, 3)
    assert torch.equal(lay.qo_indptr, qo_indptr) and torch.equal(lay.kv_indptr, kv_indptr)
    assert torch.equal(lay.kv_lens, kv_indptr[1:] - kv_indptr[:-1]) and lay.max_kv_len == 33
    bits = (qo_indptr[1:] - qo_indptr[:-1]) * (kv_indptr[1:] - kv_indptr[:-1])
    assert lay.mask_indptr.tolist() == [0] + torch.cumsum((bits + 7) // 8, 0).tolist()
    assert int(bits.sum()) == mask.numel() and len(kv_indices) == int(kv_indptr[-1])



@pytest.mark.sglang
@pytest.mark.parametrize("kw, why", [
    (dict(topk=2), "topk 2"),
    (dict(page_size=16), "page size 16"),
    (dict(prefill_backend="fa3"), "prefill backend fa3"),
    (dict(dispatch_reason="SLIDING_WINDOW"), "SLIDING_WINDOW wrappers"),
    (dict(dispatch_reason="CROSS_ATTENTION"), "CROSS_ATTENTION wrappers"),
    (dict(kv_dtype="float32"), "KV cache dtype torch.float32"),
])
def test_captures_it_cannot_serve_keep_plan(fi, caplog, kw, why):
    import torch

    kw = {k: getattr(torch, v) if k == "kv_dtype" else v for k, v in kw.items()}
    stock, mine = fi.Harness(**kw), hooked(fi.Harness(**kw), hp := host_plan(fi))
    with caplog.at_level(logging.INFO, logger="specctl.plugin"):
        stock.capture()
        mine.capture()
        for i, lens in enumerate(BATCHES[:3]):
            (ws,), (wm,) = stock.replay(stock.batch(lens, seed=i)), mine.replay(mine.batch(lens, seed=i))
            assert mine.reads.names == stock.reads.names == READS
            assert fi.state_diff(fi.wrapper_state(ws), fi.wrapper_state(wm)) == []
            stock.reads.names.clear()
            mine.reads.names.clear()
    assert hp.num_marked == hp.num_host_plans == 0 and hp.on
    said = [r.getMessage() for r in caplog.records if "keep plan()'s device reads" in r.getMessage()]
    assert len(said) == 1 and why in said[0]


@pytest.mark.sglang
def test_a_fault_falls_back_to_plan_for_that_step_and_turns_the_hook_off(fi, caplog):
    def broken(*a):
        raise RuntimeError("injected")

    from specctl.plugin.patches.fi_plan import HostPlan

    stock, mine = fi.Harness(), hooked(fi.Harness(), hp := HostPlan("on", pack=broken))
    stock.capture()
    mine.capture()
    with caplog.at_level(logging.ERROR, logger="specctl.plugin"):
        for i, lens in enumerate(BATCHES):
            (ws,), (wm,) = stock.replay(stock.batch(lens, seed=i)), mine.replay(mine.batch(lens, seed=i))
            assert mine.reads.names == READS  # plan() for that step, and for every later one
            assert fi.state_diff(fi.wrapper_state(ws), fi.wrapper_state(wm)) == []
            stock.reads.names.clear()
            mine.reads.names.clear()
    assert not hp.on and "RuntimeError: injected" in hp.off_reason and hp.num_host_plans == 0
    assert [r.getMessage().count("injected") for r in caplog.records] == [1]  # said once


@pytest.mark.sglang
def test_check_mode_compares_the_first_plans_then_plans_from_host(fi, caplog):
    stock, mine = fi.Harness(), hooked(fi.Harness(), hp := host_plan(fi, "check", check_steps=3))
    stock.capture()
    mine.capture()
    with caplog.at_level(logging.INFO, logger="specctl.plugin"):
        for i, lens in enumerate(BATCHES):
            (ws,), (wm,) = stock.replay(stock.batch(lens, seed=i)), mine.replay(mine.batch(lens, seed=i))
            assert mine.reads.names == (READS if i < 3 else [])  # checking: plan() runs too
            assert fi.state_diff(fi.wrapper_state(ws), fi.wrapper_state(wm)) == []
            stock.reads.names.clear()
            mine.reads.names.clear()
    assert hp.on and hp.num_checked == 3 and hp.num_host_plans == 2
    assert sum("self-check passed: 3" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.sglang
@pytest.mark.parametrize("host_lag", [1, -1])
def test_check_mode_catches_host_lengths_that_are_not_the_devices(fi, caplog, host_lag):
    """Were seq_lens_cpu ever not the device's lengths (the premise P2 rests on): plan()'s result stands and the
    hook goes off."""
    stock, mine = fi.Harness(), hooked(fi.Harness(), hp := host_plan(fi, "check", check_steps=8))
    stock.capture()
    mine.capture()
    lens = [12, 30, 7]
    host = [12, 30 + host_lag, 7]
    with caplog.at_level(logging.ERROR, logger="specctl.plugin"):
        (ws,) = stock.replay(stock.batch(lens, seed=3))
        (wm,) = mine.replay(mine.batch(lens, seed=3, host_seq_lens=host))
        assert fi.state_diff(fi.wrapper_state(ws), fi.wrapper_state(wm)) == []
        mine.reads.names.clear()
        (wm,) = mine.replay(mine.batch([5, 6], seed=4))
    assert mine.reads.names == READS  # off: plan() from then on
    assert not hp.on and hp.off_reason.startswith("self-check")
    assert "plan_info" in hp.off_reason and "kv_lens" in hp.off_reason
    assert sum("self-check" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.sglang
def test_a_replay_the_capture_did_not_plan_for_keeps_plan(fi, caplog):
    stock, mine = fi.Harness(), hooked(fi.Harness(), hp := host_plan(fi))
    stock.capture()
    mine.capture()
    b = mine.batch([9, 4], seed=5)
    b.spec_info.topk = 3  # a tree's verify input on a chain's wrappers
    with caplog.at_level(logging.INFO, logger="specctl.plugin"):
        (wm,) = mine.replay(b)
    bs = stock.batch([9, 4], seed=5)
    bs.spec_info.topk = 3
    (ws,) = stock.replay(bs)
    assert mine.reads.names == READS and fi.state_diff(fi.wrapper_state(ws), fi.wrapper_state(wm)) == []
    assert hp.on and hp.num_host_plans == 0
    assert any("not a topk-1 EAGLE verify" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- install(): which path, which hooks

def _run(code: str, env_extra=None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN"}
    env.update(env_extra or {}, PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180,
                       env=env, cwd=str(HERE))
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


INSTALL = r"""
    import json, os, sys
    from sglang.srt.plugins.hook_registry import HookRegistry
    from specctl.plugin import sglang_hooks
    from specctl.plugin.engine import PluginSettings
    from specctl.plugin import sglang_source
    s = PluginSettings.from_env({"SPECCTL_PATCHES": "fi_plan=" + (sys.argv[1] if len(sys.argv) > 1 else "on"),
                                 "SPECCTL_TELEMETRY": "none", "SPECCTL_POLICY": "none"})
    rt = sglang_hooks.install(s)
    t = sglang_hooks.SGLANG_TARGETS
    own = sglang_source.verify_host_plan_switch()
    print(json.dumps({"hooks": [x in HookRegistry._hooks for x in t.fi_plan_targets()],
                      "hooked": rt.fi_plan is not None, "own": None if own is None else own.get(),
                      "env": os.environ.get("SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN")}))
"""


@pytest.mark.sglang
@pytest.mark.parametrize("mode", ["on", "check", "off"])
def test_install_hooks_where_sglang_has_no_opt_in_and_turns_its_own_on_where_it_has(mode):
    import sglang

    got = _run(INSTALL.replace('sys.argv[1] if len(sys.argv) > 1 else "on"', repr(mode)))
    wanted = mode != "off"
    if sglang.__version__ == "0.5.17":
        assert got == {"hooks": [wanted, wanted], "hooked": wanted, "own": None, "env": None}
    else:  # 0.5.23: SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN, no hook of ours
        assert got == {"hooks": [False, False], "hooked": False, "own": wanted, "env": "True" if wanted else None}


@pytest.mark.sglang
def test_an_operators_own_setting_of_sglangs_opt_in_stands():
    if not _has_own_opt_in():
        pytest.skip("this SGLang has no SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN")
    got = _run(INSTALL, {"SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN": "0"})
    assert got == {"hooks": [False, False], "hooked": False, "own": False, "env": "0"}


WIRED = r"""
    import dataclasses, json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    import fi_harness
    from sglang.srt.plugins.hook_registry import HookRegistry
    from specctl.plugin import sglang_hooks
    from specctl.plugin.engine import PluginSettings
    h = fi_harness.Harness()
    fi_harness.as_module(h, "specctl_fi_targets")
    t = sglang_hooks.Targets(
        fi_out_graph="specctl_fi_targets.FlashInferAttnBackend.init_forward_metadata_out_graph",
        fi_begin_forward=sys.argv[1])
    s = PluginSettings.from_env({"SPECCTL_PATCHES": "fi_plan=on", "SPECCTL_TELEMETRY": "none",
                                 "SPECCTL_POLICY": "none"})
    rt = sglang_hooks.install(s, targets=t)
    rt.fi_plan._pack = fi_harness.segment_packbits_kernel  # flashinfer's CUDA kernel, on the CPU
    HookRegistry.apply_hooks()
    h.capture()
    h.replay(h.batch([7, 19, 3]))
    hp = rt.fi_plan
    print(json.dumps({"patched": [x in HookRegistry._patched for x in t.fi_plan_targets()], "on": hp.on,
                      "reason": hp.off_reason, "marked": hp.num_marked, "host_plans": hp.num_host_plans,
                      "reads": h.reads.names}))
"""


@pytest.mark.sglang
def test_through_sglangs_hook_registry_the_verify_plan_reads_nothing(fi):
    target = "specctl_fi_targets.FlashInferIndicesUpdaterPrefill.call_begin_forward"
    got = _run(WIRED.replace("sys.argv[1]", repr(target)))
    assert got == {"patched": [True, True], "on": True, "reason": None, "marked": 4, "host_plans": 1, "reads": []}


@pytest.mark.sglang
def test_a_hook_that_did_not_take_effect_turns_it_off_at_the_first_capture(fi):
    got = _run(WIRED.replace("sys.argv[1]", repr("specctl_fi_targets.NoSuchUpdater.call_begin_forward")))
    assert got["patched"] == [True, False] and not got["on"] and "NoSuchUpdater" in got["reason"]
    assert got["marked"] == got["host_plans"] == 0 and got["reads"] == READS


def _source(rel: str) -> str:
    import sglang

    return (Path(sglang.__file__).parent / rel).read_text()


@pytest.mark.sglang
def test_the_source_contract_the_hooks_rely_on(fi):
    """What the harness cannot show: how the graph runner calls the backend, and what pads the host lengths."""
    import ast
    import importlib.metadata as md

    fb = ast.parse(_source("srt/layers/attention/flashinfer_backend.py"))
    upd = next(n for n in fb.body if isinstance(n, ast.ClassDef) and n.name == "FlashInferIndicesUpdaterPrefill")
    cbf = next(n for n in upd.body if isinstance(n, ast.FunctionDef) and n.name == "call_begin_forward")
    assert [a.arg for a in cbf.args.args][:3] == ["self", "wrapper_ragged", "wrapper_paged"]  # the hook's fast path
    runner = _source("srt/model_executor/runner/decode_cuda_graph_runner.py")
    assert "attn_backend.init_forward_metadata_out_graph(forward_batch, in_capture=True)" in runner
    assert "attn_backend.init_forward_metadata_out_graph(fb_view)" in runner
    assert "None if forward_batch.seq_lens_cpu is None else buffers.seq_lens_cpu[:bs]" in runner
    reg = _source("srt/model_executor/cuda_graph_buffer_registry.py")
    for slot in ('"seq_lens",', '"seq_lens_cpu",'):  # device and host lengths padded alike
        i = reg.index(slot)
        assert "PaddingPolicy.FILL_SENTINEL" in reg[i:i + 300] and "pad_value=seq_len_fill_value" in reg[i:i + 300]
    # the flashinfer whose plan() the harness ports (tests/plugin/fi_harness.py)
    assert "flashinfer_python[cu13]==0.6.15.post1" in [r.replace(" ", "") for r in md.requires("sglang")]
