"""Patch fi_extend: flashinfer's prefill (EXTEND) plans given host indptrs. The settings; on SGLang 0.5.17 the two
hooks around SGLang's own backend code (tests/plugin/fi_extend_harness.py), against plan() on the same batches;
the source contract on every installed SGLang."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from specctl.plugin.engine import PluginSettings


@pytest.mark.parametrize("value, mode, steps", [
    (None, "off", 32),          # off until a GPU run has checked it
    ("off", "off", 32), ("on", "on", 32), ("check", "check", 32), ("check:5", "check", 5),
])
def test_settings_read_the_switch(value, mode, steps):
    env = {} if value is None else {"SPECCTL_PATCHES": f"fi_extend={value}"}
    s = PluginSettings.from_env(env)
    assert (s.fi_extend_host_plan, s.fi_extend_check_steps) == (mode, steps)
    assert s.patch_modes()["fi_extend"] == (f"check:{steps}" if mode == "check" else mode)


@pytest.mark.parametrize("value", ["auto", "check:", "check:0", "4"])
def test_settings_refuse_nonsense(value):
    with pytest.raises(ValueError, match="SPECCTL_PATCHES: fi_extend"):
        PluginSettings.from_env({"SPECCTL_PATCHES": f"fi_extend={value}"})


@pytest.mark.sglang  # torch: the sglang environments have it
@pytest.mark.parametrize("seq, pre, ragged, qo, kv", [
    ([7], [0], True, [0, 7], [0, 0]),
    ([7], [0], False, [0, 7], [0, 7]),
    ([5, 40, 9], [0, 32, 4], True, [0, 5, 13, 18], [0, 0, 32, 36]),
    ([5, 40, 9], [0, 32, 4], False, [0, 5, 13, 18], [0, 5, 45, 54]),
    ([], [], True, [0], [0]),
])
def test_the_host_layout_table(seq, pre, ragged, qo, kv):
    import torch

    from specctl.plugin.patches.fi_extend import extend_layout

    lay = extend_layout(torch.tensor(seq), pre, ragged)
    assert lay.qo_indptr.tolist() == qo and lay.kv_indptr.tolist() == kv
    assert lay.last_page_len.tolist() == [1] * len(seq) and lay.batch_size == len(seq)
    assert {t.dtype for t in (lay.qo_indptr, lay.kv_indptr, lay.last_page_len)} == {torch.int32}


@pytest.mark.sglang
@pytest.mark.parametrize("seq, pre, match", [([4, 5], [0], "2 sequence lengths for 1"), ([4], [5], "prefix longer")])
def test_the_host_layout_refuses_lengths_that_cannot_be_a_batch(seq, pre, match):
    import torch

    from specctl.plugin.patches.fi_extend import extend_layout

    with pytest.raises(ValueError, match=match):
        extend_layout(torch.tensor(seq), pre, True)


# ----------------------------------------------------------------------------- SGLang 0.5.17: the hooks


@pytest.fixture
def fx(import_sibling):
    import sglang

    if sglang.__version__ != "0.5.17":
        pytest.skip("the harness compiles SGLang 0.5.17's extend plan path (0.5.23 plans through KVLocPlan); "
                    "the source contract below covers the hooks' names there")
    return import_sibling("fi_extend_harness")


def hooked(h, hp):
    """The two hooks on this harness's classes, wrapped by SGLang's own hook wrapper (what apply_hooks installs)."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    def init_md(o, b, *a, **k):
        return hp.around_init_forward_metadata(o, b, a, k)

    def call_begin_forward(o, u, *a, **k):
        return hp.around_call_begin_forward(o, u, a, k)

    B, U = h.Backend, h.Updater
    B.init_forward_metadata = _wrap_fn(B.init_forward_metadata, init_md, HookType.AROUND)
    U.call_begin_forward = _wrap_fn(U.call_begin_forward, call_begin_forward, HookType.AROUND)
    return h


def extend_plan(mode="on", **kw):
    from specctl.plugin.patches.fi_extend import ExtendHostPlan

    return ExtendHostPlan(mode, pin=False, **kw)


RAGGED_READS = ["ragged_qo_indptr", "ragged_kv_indptr", "qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len"]
PAGED_READS = ["qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len"]
# (seq_lens, prefix_lens, request slots), one after the other on the same wrappers: whole prompts (no radix cache),
# prompts after cached prefixes, one request, a chunk after an earlier chunk
BATCHES = [([83], [0], [3]), ([221, 49, 135], [0, 0, 0], [0, 5, 9]), ([140, 64], [128, 0], [2, 7]),
           ([300, 12, 77, 5], [256, 8, 0, 4], [11, 1, 4, 6]), ([1], [0], [20])]


def run(h, batches, **kw):
    out = []
    for seq, pre, slots in batches:
        out.append(h.plan(h.batch(seq, pre, slots=slots, **kw)))
    return out


@pytest.mark.sglang
@pytest.mark.parametrize("use_paged", [False, True])
def test_host_indptrs_leave_what_plan_leaves_without_reading_the_device(fx, use_paged):
    stock, mine = fx.Harness(), hooked(fx.Harness(), hp := extend_plan())
    stock.backend.use_paged = mine.backend.use_paged = use_paged
    for (seq, pre, slots) in BATCHES:
        s, m = stock.plan(stock.batch(seq, pre, slots=slots)), mine.plan(mine.batch(seq, pre, slots=slots))
        assert stock.reads.names == (PAGED_READS if use_paged else RAGGED_READS) and mine.reads.names == []
        assert s["use_ragged"] == m["use_ragged"] == (not use_paged)
        assert fx.same(s["paged"], m["paged"]) == [] and fx.same(s["ragged"], m["ragged"]) == []
        assert "begin_forward" not in vars(mine.backend.prefill_wrappers_paged[0])  # for one call only
        assert "begin_forward" not in vars(mine.backend.prefill_wrapper_ragged)
        stock.reads.names.clear()
    assert hp.on and hp.num_host_plans == len(BATCHES) * (1 if use_paged else 2)
    assert not hasattr(mine.backend, "_specctl_extend_host")


@pytest.mark.sglang
@pytest.mark.parametrize("kw, field, value, why", [
    ({}, "is_multimodal", True, "multimodal or multi-item scoring"),
    ({}, "page_size", 16, "page size 16"),
    ({}, "use_sliding_window_kv_pool", True, "a sliding-window KV pool"),
    ({"wrapper_backend": "cutlass"}, None, None, "wrapper backend cutlass"),
])
def test_batches_it_cannot_serve_keep_plan(fx, caplog, kw, field, value, why):
    stock, mine = fx.Harness(**kw), hooked(fx.Harness(**kw), hp := extend_plan())
    if field is not None:
        setattr(stock.backend, field, value)
        setattr(mine.backend, field, value)
    with caplog.at_level(logging.INFO, logger="specctl.plugin"):
        for (seq, pre, slots) in BATCHES[:3]:
            s, m = stock.plan(stock.batch(seq, pre, slots=slots)), mine.plan(mine.batch(seq, pre, slots=slots))
            assert mine.reads.names == stock.reads.names and "qo_indptr" in stock.reads.names
            assert fx.same(s["paged"], m["paged"]) == [] and fx.same(s["ragged"], m["ragged"]) == []
            stock.reads.names.clear()
            mine.reads.names.clear()
    assert hp.on and hp.num_host_plans == 0
    said = [r.getMessage() for r in caplog.records if "kept plan()'s device reads" in r.getMessage()]
    assert len(said) == 1 and why in said[0]


@pytest.mark.sglang
def test_other_forward_modes_pass_through_untouched(fx):
    mine = hooked(fx.Harness(), hp := extend_plan())
    mine.plan(mine.batch([40, 9], [0, 0], mode=fx.Mode.MIXED))
    assert mine.reads.names == RAGGED_READS and hp.num_host_plans == 0 and hp.on


@pytest.mark.sglang
def test_a_fault_falls_back_to_plan_and_turns_the_patch_off(fx, caplog, monkeypatch):
    from specctl.plugin.patches import fi_extend

    def broken(*a, **k):
        raise RuntimeError("injected")

    monkeypatch.setattr(fi_extend, "extend_layout", broken)
    stock, mine = fx.Harness(), hooked(fx.Harness(), hp := extend_plan())
    with caplog.at_level(logging.ERROR, logger="specctl.plugin"):
        for s, m in zip(run(stock, BATCHES), run(mine, BATCHES)):
            assert fx.same(s["paged"], m["paged"]) == [] and fx.same(s["ragged"], m["ragged"]) == []
    assert mine.reads.names == stock.reads.names  # plan() for that step and every later one
    assert not hp.on and "RuntimeError: injected" in hp.off_reason and hp.num_host_plans == 0
    assert [r.getMessage().count("injected") for r in caplog.records] == [1]  # said once


@pytest.mark.sglang
def test_check_mode_compares_the_first_plans_then_reads_nothing(fx, caplog):
    stock, mine = fx.Harness(), hooked(fx.Harness(), hp := extend_plan("check", check_steps=3))
    checked = []
    with caplog.at_level(logging.INFO, logger="specctl.plugin"):
        for seq, pre, slots in BATCHES:
            s, m = stock.plan(stock.batch(seq, pre, slots=slots)), mine.plan(mine.batch(seq, pre, slots=slots))
            assert fx.same(s["paged"], m["paged"]) == [] and fx.same(s["ragged"], m["ragged"]) == []
            assert mine.reads.names == []  # plan() itself read nothing: the check's reads are the patch's own
            checked.append(hp.num_checked)
    assert checked == [2, 3, 3, 3, 3]  # the ragged and paged plans of batch 0, batch 1's ragged plan
    assert hp.on and hp.num_checked == 3 and hp.num_host_plans == 2 * len(BATCHES)
    assert sum("self-check passed: 3" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.sglang
@pytest.mark.parametrize("host", [dict(host_seq_lens=[221, 50, 135]), dict(host_prefix_lens=[0, 1, 0])])
def test_check_mode_catches_host_lengths_that_are_not_the_devices(fx, caplog, host):
    """Were the host lengths ever not the device's (the premise): plan() with the device's stands, the patch goes."""
    stock, mine = fx.Harness(), hooked(fx.Harness(), hp := extend_plan("check", check_steps=8))
    seq, pre, slots = BATCHES[1]
    with caplog.at_level(logging.ERROR, logger="specctl.plugin"):
        s = stock.plan(stock.batch(seq, pre, slots=slots))
        m = mine.plan(mine.batch(seq, pre, slots=slots, **host))
    assert fx.same(s["paged"], m["paged"]) == [] and fx.same(s["ragged"], m["ragged"]) == []
    assert not hp.on and hp.off_reason.startswith("self-check") and hp.num_host_plans == 0
    mine.reads.names.clear()
    mine.plan(mine.batch([5, 6], [0, 0]))
    assert mine.reads.names == RAGGED_READS  # off: plan() from then on
    assert sum("self-check" in r.getMessage() for r in caplog.records) == 1


# ----------------------------------------------------------------------------- every installed SGLang


def _source(rel: str) -> str:
    import sglang

    return (Path(sglang.__file__).parent / rel).read_text()


@pytest.mark.sglang
def test_the_source_contract_the_hooks_rely_on():
    """The names the hooks bind and the calls they expect, on this SGLang (0.5.17 and the newest)."""
    import ast

    fb = ast.parse(_source("srt/layers/attention/flashinfer_backend.py"))
    cls = {n.name: n for n in fb.body if isinstance(n, ast.ClassDef)}
    meth = {(c, f.name): f for c in ("FlashInferAttnBackend", "FlashInferIndicesUpdaterPrefill")
            for f in cls[c].body if isinstance(f, ast.FunctionDef)}
    init_md = meth[("FlashInferAttnBackend", "init_forward_metadata")]
    assert [a.arg for a in init_md.args.args] == ["self", "forward_batch"]
    cbf = meth[("FlashInferIndicesUpdaterPrefill", "call_begin_forward")]
    names = {a.arg for a in cbf.args.args + cbf.args.kwonlyargs}
    assert {"wrapper_ragged", "wrapper_paged", "seq_lens", "prefix_lens", "kv_start_idx", "use_ragged", "spec_info",
            "use_sliding_window_kv_pool", "multi_item_params", "cross_attention_custom_mask", "seq_lens_cpu",
            "custom_kv_indices"} <= names
    text = ast.get_source_segment(_source("srt/layers/attention/flashinfer_backend.py"), cbf)
    # the device indptrs SGLang builds for a normal extend, from the lengths the host holds too
    assert "kv_indptr[1 : bs + 1] = torch.cumsum(paged_kernel_lens, dim=0)" in text
    assert "qo_indptr[1 : bs + 1] = torch.cumsum(seq_lens - prefix_lens, dim=0)" in text
    assert "self.kv_last_page_len[:bs]," in text
    body = ast.get_source_segment(_source("srt/layers/attention/flashinfer_backend.py"), init_md)
    assert "extend_prefix_lens_cpu=forward_batch.extend_prefix_lens_cpu" in body
    # a breakable prefill CUDA graph replays with the eager init_forward_metadata unless the backend opts into
    # captured metadata, which flashinfer does not
    assert "use_captured_forward_metadata_for_breakable_cuda_graph" not in \
        _source("srt/layers/attention/flashinfer_backend.py")
    runner = _source("srt/model_executor/runner/prefill_cuda_graph_runner.py")
    assert "attn_backend.init_forward_metadata(forward_batch)" in runner
    # the draft's extend over a prefill is an EXTEND forward of the draft runner, planned eagerly
    worker = _source("srt/speculative/eagle_worker_v2.py")
    assert "def _draft_extend_for_prefill" in worker and "self.draft_runner.forward(forward_batch)" in worker


# ----------------------------------------------------------------------------- through SGLang's hook registry

WIRED = r"""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    import fi_extend_harness as fx
    from types import ModuleType
    from sglang.srt.plugins.hook_registry import HookRegistry
    from specctl.plugin import sglang_hooks
    from specctl.plugin.engine import PluginSettings
    h = fx.Harness()
    h.Backend.init_forward_metadata_out_graph = lambda self, fb, in_capture=False: None  # fi_plan's target (unused)
    mod = ModuleType("specctl_fx_targets")
    mod.FlashInferAttnBackend, mod.FlashInferIndicesUpdaterPrefill = h.Backend, h.Updater
    sys.modules["specctl_fx_targets"] = mod
    t = sglang_hooks.Targets(
        fi_out_graph="specctl_fx_targets.FlashInferAttnBackend.init_forward_metadata_out_graph",
        fi_begin_forward="specctl_fx_targets.FlashInferIndicesUpdaterPrefill.call_begin_forward",
        fi_init_metadata=sys.argv[1])
    s = PluginSettings.from_env({"SPECCTL_PATCHES": "fi_extend=on,fi_plan=on", "SPECCTL_TELEMETRY": "none",
                                 "SPECCTL_POLICY": "none"})
    rt = sglang_hooks.install(s, targets=t)
    HookRegistry.apply_hooks()
    problems = rt.check_hooks()  # the harness's targets; SGLang's CUDA-only modules do not import here
    h.plan(h.batch([83, 40], [0, 32], slots=[3, 5]))
    hp = rt.fi_extend
    print(json.dumps({"on": hp is not None and hp.on, "problems": [p for p in problems if "specctl_fx_targets" in p],
                      "host_plans": 0 if hp is None else hp.num_host_plans, "reads": h.reads.names}))
"""


def _run(code: str) -> dict:
    import json
    import os
    import subprocess
    import sys
    import textwrap

    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"}, cwd=str(Path(__file__).parent))
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.sglang
def test_through_sglangs_hook_registry_a_prefill_plan_reads_nothing(fx):
    """Both hooks applied by SGLang's own registry, beside fi_plan's AROUND on the same call_begin_forward."""
    got = _run(WIRED.replace("sys.argv[1]", repr("specctl_fx_targets.FlashInferAttnBackend.init_forward_metadata")))
    assert got == {"on": True, "problems": [], "host_plans": 2, "reads": []}


@pytest.mark.sglang
def test_a_hook_that_did_not_take_effect_turns_it_off_and_plan_reads_as_before(fx):
    got = _run(WIRED.replace("sys.argv[1]", repr("specctl_fx_targets.NoSuchBackend.init_forward_metadata")))
    assert not got["on"] and got["host_plans"] == 0 and got["reads"] == RAGGED_READS
    assert any("NoSuchBackend" in p for p in got["problems"])
