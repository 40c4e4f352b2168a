"""The decode state (plugin/plain_decode.py): its step logic on stand-ins of what SGLang's verify does,
its build/agree/fallback rules, its wiring through the real HookRegistry, and the shape of SGLang's own
code it relies on (read from the installed sglang's source, 0.5.17 and 0.5.23). The forward itself
runs on the GPU (benchmarks/gpu/offpath.py)."""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from specctl.plugin.patches import plain_decode as pd


class Mode:
    def __init__(self, name):
        self.name = name

    def is_idle(self):
        return self.name == "IDLE"

    def __repr__(self):
        return self.name


DECODE, TARGET_VERIFY, IDLE = Mode("DECODE"), Mode("TARGET_VERIFY"), Mode("IDLE")
FULL = "FULL"


class RecordingForwardBatch:
    """ForwardBatch.init_new, recording what the ScheduleBatch looked like when it was called."""

    seen: list = []
    fail = False

    @classmethod
    def init_new(cls, batch, mr, *, capture_hidden_mode, return_hidden_states_before_norm):
        if cls.fail:
            raise RuntimeError("init_new stand-in failure")
        fb = SimpleNamespace(forward_mode=batch.forward_mode, spec_info=batch.spec_info,
                             seq_lens=np.array(batch.seq_lens), seq_lens_cpu=None if batch.seq_lens_cpu is None
                             else np.array(batch.seq_lens_cpu), seq_lens_sum=batch.seq_lens_sum,
                             input_ids=batch.input_ids, out_cache_loc=batch.out_cache_loc,
                             capture_hidden_mode=capture_hidden_mode, batch_size=len(batch.seq_lens))
        cls.seen.append(fb)
        return fb


class Runner:
    def __init__(self, max_bs, name="runner"):
        self.max_bs, self.name = max_bs, name

    def can_run_graph(self, fb):
        return fb.batch_size <= self.max_bs


class ModelRunner:
    def __init__(self):
        self.attn_backend = "steps0-backend"
        self.decode_cuda_graph_runner = Runner(64, "steps0-verify-graphs")
        self.war_fastpath_read_done_event = None


class TargetWorker:
    """TpModelWorker.forward_batch_generation: records the forward batch and what the model runner
    held when it ran; `explode` makes the forward raise for a given mode."""

    def __init__(self, plain_ref):
        self.model_runner = ModelRunner()
        self.calls = []
        self.explode_on = None
        self._plain = plain_ref

    def forward_batch_generation(self, batch=None, forward_batch=None, is_verify=False):
        plain = self._plain()
        if plain is not None and plain.pending is not None and is_verify:  # the AROUND hook's dispatch
            return pd.around_target_forward(plain, TargetWorker._orig, self, (),
                                            dict(batch=batch, forward_batch=forward_batch, is_verify=is_verify))
        return TargetWorker._orig(self, batch=batch, forward_batch=forward_batch, is_verify=is_verify)

    @staticmethod
    def _orig(self, batch=None, forward_batch=None, is_verify=False):
        mr = self.model_runner
        if self.explode_on is forward_batch.forward_mode:
            raise RuntimeError("forward stand-in failure")
        self.calls.append(dict(mode=forward_batch.forward_mode, backend=mr.attn_backend,
                               runner=getattr(mr.decode_cuda_graph_runner, "name", None), fb=forward_batch))
        if forward_batch.forward_mode is DECODE:
            mr.war_fastpath_read_done_event = "event"
        return SimpleNamespace(logits_output=f"logits-{forward_batch.forward_mode}")


class Worker:
    """EAGLEWorkerV2 at the verify call: `verify` does what run_eagle_verify does around the target
    forward (0.5.17 eagle_worker_common.py / eagle_utils.py eagle_prepare_for_verify)."""

    def __init__(self, steps=0):
        self.speculative_num_steps = steps
        self.plain = None
        self._target_worker = TargetWorker(lambda: self.plain)
        self.plans = []

    def verify(self, batch, grammar_barrier=None):
        mr = self._target_worker.model_runner
        vi = batch.spec_info
        batch.input_ids = vi.draft_token
        batch.out_cache_loc = np.array(batch.seq_lens) + 1000  # one slot per request
        batch.forward_mode = TARGET_VERIFY
        fb = SimpleNamespace(forward_mode=TARGET_VERIFY, batch_size=len(batch.seq_lens))
        can = bool(mr.decode_cuda_graph_runner and mr.decode_cuda_graph_runner.can_run_graph(fb))
        self.plans.append(getattr(mr.decode_cuda_graph_runner, "name", None) if can else None)
        out = self._target_worker.forward_batch_generation(batch=None, forward_batch=fb, is_verify=True)
        return SimpleNamespace(logits_output=out.logits_output, can_run_cuda_graph=can,
                               speculative_num_draft_tokens=1, verify_input=vi)


def make_batch(seq_lens=(7, 9, 12), *, cpu=True, logprob=False, mode=DECODE):
    sl = np.array(seq_lens)
    return SimpleNamespace(forward_mode=mode, spec_info=SimpleNamespace(draft_token=np.array([5, 6, 7][:len(sl)])),
                           seq_lens=sl, seq_lens_cpu=np.array(sl) if cpu else None,
                           seq_lens_sum=int(sl.sum()) if cpu else None, return_logprob=logprob,
                           return_hidden_states=False, input_ids=None, out_cache_loc=None)


def make_plain(max_bs=16):
    RecordingForwardBatch.seen = []
    RecordingForwardBatch.fail = False
    return pd.PlainDecode(runner=Runner(max_bs, "decode-graphs"), backend="decode-backend",
                          forward_batch=RecordingForwardBatch, decode_mode=DECODE, full_hidden=FULL)


def verify_step(worker, batch):
    """The AROUND hook on verify as sglang_hooks dispatches it."""
    plain = worker.plain
    if plain is None or not plain.on or worker.speculative_num_steps != 0:
        return worker.verify(batch)
    return pd.around_verify(plain, Worker.verify, worker, batch, (), {})


# ------------------------------------------------------------------ one step


@pytest.mark.parametrize("cpu", [True, False])
def test_steps0_target_forward_is_a_decode_forward_and_the_batch_comes_back_as_verify_left_it(cpu):
    w = Worker()
    w.plain = make_plain()
    batch = make_batch(cpu=cpu)
    committed, committed_cpu, vi = batch.seq_lens, batch.seq_lens_cpu, batch.spec_info
    res = verify_step(w, batch)
    fb = RecordingForwardBatch.seen[-1]
    # the forward: DECODE, no spec_info, lengths + 1, the verify's token and slot, aux hidden states
    assert fb.forward_mode is DECODE and fb.spec_info is None and fb.capture_hidden_mode == FULL
    assert list(fb.seq_lens) == [8, 10, 13]
    assert (fb.seq_lens_cpu is None) == (not cpu)
    if cpu:
        assert list(fb.seq_lens_cpu) == [8, 10, 13] and fb.seq_lens_sum == 31
    assert list(fb.input_ids) == [5, 6, 7] and list(fb.out_cache_loc) == [1007, 1009, 1012]
    call = w._target_worker.calls[-1]
    assert call["mode"] is DECODE and call["backend"] == "decode-backend" and call["runner"] == "decode-graphs"
    # SGLang planned no verify graph for this step (the steps-0 runner was hidden)
    assert w.plans == [None]
    # after: the committed lengths (the same objects: never modified in place), the verify input,
    # the model runner's own backend and graphs, and the result says which "off" ran
    assert batch.seq_lens is committed and list(committed) == [7, 9, 12]
    assert batch.seq_lens_cpu is committed_cpu and batch.spec_info is vi and batch.forward_mode is TARGET_VERIFY
    mr = w._target_worker.model_runner
    assert mr.attn_backend == "steps0-backend" and mr.decode_cuda_graph_runner.name == "steps0-verify-graphs"
    assert mr.war_fastpath_read_done_event is None
    assert res._specctl_off_path == pd.DECODE and res.can_run_cuda_graph is True
    assert w.plain.pending is None and w.plain.status()["decode_steps"] == 1


def test_beyond_the_captured_sizes_the_decode_forward_runs_eagerly():
    w = Worker()
    w.plain = make_plain(max_bs=2)
    res = verify_step(w, make_batch((3, 4, 5)))
    assert RecordingForwardBatch.seen[-1].forward_mode is DECODE
    assert res.can_run_cuda_graph is False and res._specctl_off_path == pd.DECODE
    assert w.plain.status()["graph_steps"] == 0 and w.plain.status()["decode_steps"] == 1


def test_speculating_steps_never_touch_the_decode_state():
    w = Worker(steps=3)
    w.plain = make_plain()
    res = verify_step(w, make_batch())
    assert RecordingForwardBatch.seen == [] and w.plans == ["steps0-verify-graphs"]
    assert w._target_worker.calls[-1]["mode"] is TARGET_VERIFY
    assert not hasattr(res, "_specctl_off_path")


@pytest.mark.parametrize("batch_kw, reason", [
    (dict(logprob=True), "log-probabilities requested"),
    (dict(mode=IDLE), "idle batch"),
])
def test_steps_the_decode_state_does_not_cover_run_the_trivial_verify(batch_kw, reason):
    w = Worker()
    w.plain = make_plain()
    batch = make_batch(**batch_kw)
    assert pd.step_reason(w, batch) == reason
    res = verify_step(w, batch)
    assert RecordingForwardBatch.seen == [] and w.plans == ["steps0-verify-graphs"]
    assert not hasattr(res, "_specctl_off_path") and w.plain.on
    assert w.plain.status()["verify_steps"] == 1


def test_with_the_logprob_switch_logprob_steps_run_the_decode_forward():
    """SPECCTL_PLAIN_DECODE_LOGPROBS=on: a step whose batch asks for log-probabilities runs the decode
    forward (SGLang's verify computes them from its logits); idle steps still run the trivial verify."""
    w = Worker()
    w.plain = make_plain()
    w.plain.logprobs = True
    batch = make_batch(logprob=True)
    assert pd.step_reason(w, batch, logprobs=True) is None
    assert pd.step_reason(w, make_batch(mode=IDLE), logprobs=True) == "idle batch"
    res = verify_step(w, batch)
    assert res._specctl_off_path == pd.DECODE and w._target_worker.calls[-1]["mode"] is DECODE
    assert w.plain.on and w.plain.status()["decode_steps"] == 1 and w.plain.status()["verify_steps"] == 0


def test_a_logprob_step_that_fails_after_the_decode_forward_runs_again_as_the_trivial_verify(caplog):
    """SGLang's code after the decode forward (its log-probabilities) raising: the step runs again as
    the trivial verify, the decode state is off for good, logged once; without log-probabilities the
    same failure is SGLang's own and propagates, as it would without the plugin."""
    class FailingAfterForward(Worker):
        fail_left = 1

        def verify(self, batch, grammar_barrier=None):
            out = Worker.verify(self, batch, grammar_barrier)
            if self.plain is not None and self.plain.ran and FailingAfterForward.fail_left:
                FailingAfterForward.fail_left -= 1
                raise IndexError("compute_spec_v2_logprobs stand-in failure")
            return out

    w = FailingAfterForward()
    w.plain = make_plain()
    w.plain.logprobs = True
    batch = make_batch(logprob=True)
    with caplog.at_level(logging.ERROR, logger="specctl.plugin"):
        res = pd.around_verify(w.plain, FailingAfterForward.verify, w, batch, (), {})
    modes = [c["mode"] for c in w._target_worker.calls]
    assert modes == [DECODE, TARGET_VERIFY]  # the decode forward, then the step again as the trivial verify
    assert w._target_worker.calls[-1]["backend"] == "steps0-backend"
    assert res.logits_output == "logits-TARGET_VERIFY" and not hasattr(res, "_specctl_off_path")
    assert not w.plain.on and "log-probabilities" in w.plain.off_reason and w.plain.pending is None
    assert sum("patch plain_decode off" in r.message for r in caplog.records) == 1
    w2 = FailingAfterForward()
    FailingAfterForward.fail_left = 1
    w2.plain = make_plain()
    with pytest.raises(IndexError):
        pd.around_verify(w2.plain, FailingAfterForward.verify, w2, make_batch(), (), {})


@pytest.mark.parametrize("where", ["init_new", "forward"])
def test_a_failing_step_runs_as_the_trivial_verify_and_the_decode_state_stays_off(where, caplog):
    w = Worker()
    w.plain = make_plain()
    if where == "init_new":
        RecordingForwardBatch.fail = True
    else:
        w._target_worker.explode_on = DECODE
    batch = make_batch()
    committed = batch.seq_lens
    with caplog.at_level(logging.ERROR, logger="specctl.plugin"):
        res = verify_step(w, batch)
    # this step: the verify forward batch ran (eagerly: no verify graph was planned for it)
    assert w._target_worker.calls[-1]["mode"] is TARGET_VERIFY
    assert w._target_worker.calls[-1]["backend"] == "steps0-backend"
    assert res.logits_output == "logits-TARGET_VERIFY" and not hasattr(res, "_specctl_off_path")
    assert batch.seq_lens is committed and batch.forward_mode is TARGET_VERIFY
    assert not w.plain.on and "failed" in w.plain.off_reason
    assert sum("patch plain_decode off" in r.message for r in caplog.records) == 1
    # the next steps: SGLang's own path, with its verify graphs
    RecordingForwardBatch.fail = False
    w._target_worker.explode_on = None
    for _ in range(3):
        verify_step(w, make_batch())
    assert w.plans[-3:] == ["steps0-verify-graphs"] * 3
    assert sum("patch plain_decode off" in r.message for r in caplog.records) == 1


def test_a_verify_whose_target_forward_skips_the_hook_turns_the_decode_state_off():
    w = Worker()
    w.plain = make_plain()
    tw = w._target_worker
    tw.forward_batch_generation = lambda **kw: TargetWorker._orig(tw, **kw)  # the AROUND hook not applied
    verify_step(w, make_batch())
    assert not w.plain.on and "did not reach" in w.plain.off_reason


# ------------------------------------------------------------------ build / agree


class Algo:
    def __init__(self, name):
        self.name = name


def fake_worker(**over):
    mr = SimpleNamespace(sliding_window_size=None, token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: None),
                         model_config=SimpleNamespace(), req_to_token_pool=SimpleNamespace(),
                         hisparse_coordinator=None, watermark_state=None)
    w = SimpleNamespace(adaptive_controller=SimpleNamespace(_states={0: object(), 3: object()}),
                        speculative_algorithm=Algo("EAGLE3"), topk=1, server_args=SimpleNamespace(pp_size=1),
                        _target_worker=SimpleNamespace(model_runner=mr))
    for k, v in over.items():
        obj, _, attr = k.rpartition("__")
        target = {"": w, "sa": w.server_args, "mr": mr}[obj]
        setattr(target, attr, v)
    return w


class HybridReqToTokenPool:
    pass


@pytest.mark.parametrize("over, why", [
    ({}, None),
    (dict(adaptive_controller=None), "no adaptive controller"),
    (dict(adaptive_controller=SimpleNamespace(_states={3: object()})), "no steps-0 runtime state"),
    (dict(speculative_algorithm=Algo("STANDALONE")), "EAGLE / EAGLE3 only"),
    (dict(speculative_algorithm=Algo("FROZEN_KV_MTP")), "EAGLE / EAGLE3 only"),
    (dict(topk=4), "topk 4"),
    (dict(sa__enable_dp_attention=True), "DP attention"),
    (dict(sa__enable_two_batch_overlap=True), "two-batch overlap"),
    (dict(sa__enable_lora=True), "LoRA"),
    (dict(sa__pp_size=2), "pipeline parallelism"),
    (dict(mr__sliding_window_size=4096), "sliding-window"),
    (dict(mr__token_to_kv_pool_allocator=SimpleNamespace(translate_kv_loc=lambda x: x)), "unified / virtual KV pool"),
    (dict(mr__req_to_token_pool=HybridReqToTokenPool()), "hybrid"),
    (dict(mr__watermark_state=object()), "watermarking"),
])
def test_unsupported_launches_are_named_before_anything_is_captured(over, why):
    got = pd.unsupported_reason(fake_worker(**over))
    assert (got is None) if why is None else (why in got)


def test_build_needs_every_rank_and_logs_why_not(monkeypatch, caplog):
    built = []
    monkeypatch.setattr(pd, "_capture", lambda worker, backends, **kw: built.append(worker) or make_plain())
    w = fake_worker()
    assert pd.build(w, agree=lambda ok: ok) is not None
    with caplog.at_level(logging.WARNING, logger="specctl.plugin"):
        assert pd.build(w, agree=lambda ok: False) is None  # another rank failed: nobody runs it
    assert "another TP rank could not build it" in caplog.text
    votes = []
    assert pd.build(fake_worker(topk=4), agree=lambda ok: votes.append(ok) or ok) is None
    assert votes == [False] and len(built) == 2  # unsupported: still votes, never captures

    def boom(worker, backends, **kw):
        raise MemoryError("capture out of memory")

    monkeypatch.setattr(pd, "_capture", boom)
    caplog.clear()
    votes.clear()
    with caplog.at_level(logging.WARNING, logger="specctl.plugin"):
        assert pd.build(w, agree=lambda ok: votes.append(ok) or ok) is None
    assert votes == [False] and "MemoryError: capture out of memory" in caplog.text


def test_the_build_line_says_whether_graphs_were_captured(monkeypatch, caplog):
    """--disable-cuda-graph: SGLang built no verify graph, so the decode state decodes eagerly; its start-up
    line says so instead of "graphs up to 0"."""
    for runner, want in ((SimpleNamespace(max_bs=64), "DECODE graphs for batch sizes up to 64 (eager above)"),
                         (None, "no CUDA graphs in this launch: eager DECODE forwards")):
        plain = make_plain()
        plain.runner, plain.max_bs = runner, int(getattr(runner, "max_bs", 0)) if runner else 0
        monkeypatch.setattr(pd, "_capture", lambda worker, backends, p=plain, **kw: p)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="specctl.plugin"):
            assert pd.build(fake_worker(), agree=lambda ok: ok) is plain
        assert f"decode state built: {want}" in caplog.text


def test_flashinfer_is_a_decode_state_backend_unless_turned_off_and_fa3_only_when_turned_on():
    from specctl.plugin.engine import PluginSettings

    assert pd.backends(False) == ("TritonAttnBackend",)
    assert pd.backends(True) == ("TritonAttnBackend", "FlashInferAttnBackend")
    assert pd.backends(True, True) == ("TritonAttnBackend", "FlashInferAttnBackend", "FlashAttentionBackend")
    assert PluginSettings.from_env({}).plain_decode_fa3 is False  # until a GPU run compares it with no-spec fa3
    assert PluginSettings.from_env({"SPECCTL_PATCHES": "plain_fa3=on"}).plain_decode_fa3 is True
    assert PluginSettings.from_env({}).plain_decode_flashinfer is True  # since its GPU checks
    assert PluginSettings.from_env({"SPECCTL_PATCHES": "plain_flashinfer=off"}).plain_decode_flashinfer is False
    with pytest.raises(ValueError, match="plain_flashinfer must be on or off"):
        PluginSettings.from_env({"SPECCTL_PATCHES": "plain_flashinfer=sometimes"})


def test_the_runtime_builds_on_the_backends_its_settings_name(monkeypatch):
    from specctl.plugin import sglang_hooks
    from specctl.plugin.engine import PluginSettings

    seen = []
    monkeypatch.setattr(pd, "build", lambda worker, agree, backends, patch, logprobs: seen.append(backends))
    for env, want in (({"SPECCTL_PATCHES": "plain_flashinfer=off"}, ("TritonAttnBackend",)),
                      ({}, ("TritonAttnBackend", "FlashInferAttnBackend")),
                      ({"SPECCTL_PATCHES": "plain_fa3=on,plain_flashinfer=off"},
                       ("TritonAttnBackend", "FlashAttentionBackend"))):
        settings = PluginSettings.from_env({"SPECCTL_TELEMETRY": "none", "SPECCTL_POLICY": "none", **env})
        rt = sglang_hooks.PluginRuntime(settings, tp_group_fn=_OneRank, patches=[pd.patch])
        rt.hooks_checked = True  # as if every hook took effect
        rt.build_plain(object())
        assert seen[-1] == want


class _OneRank:
    pass


@pytest.mark.sglang
@pytest.mark.parametrize("path, cls, switch", [
    ("srt/layers/attention/flashattention_backend.py", "FlashAttentionBackend", "plain_fa3"),
    ("srt/layers/attention/flashinfer_backend.py", "FlashInferAttnBackend", "plain_flashinfer"),
    ("srt/layers/attention/triton_backend.py", "TritonAttnBackend", None),
])
def test_a_backend_the_settings_leave_out_is_refused_naming_its_switch(path, cls, switch):
    """Against SGLang's class names: a backend renamed upstream would otherwise never get the decode state."""
    assert any(isinstance(n, ast.ClassDef) and n.name == cls for n in _sglang_src(path).body)
    for flashinfer, fa3 in ((False, False), (True, False), (False, True), (True, True)):
        on = {None: True, "plain_flashinfer": flashinfer, "plain_fa3": fa3}[switch]
        why = pd.refused(cls, pd.backends(flashinfer, fa3))
        assert (why is None) if on else (f"SPECCTL_PATCHES={switch}=on builds it there" in why)
    assert pd.refused("AiterAttnBackend", pd.backends(True, True)).endswith("FlashAttentionBackend)")


# ------------------------------------------------------------------ against the real sglang modules


def _sglang_src(rel: str) -> ast.Module:
    spec = importlib.util.find_spec("sglang")
    path = Path(spec.submodule_search_locations[0]) / rel
    return ast.parse(path.read_text())


def _func(tree: ast.AST, name: str, cls: str | None = None) -> ast.FunctionDef:
    scope = tree
    if cls is not None:
        scope = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in ast.walk(scope) if isinstance(n, ast.FunctionDef) and n.name == name)


def _calls(fn: ast.AST) -> list[ast.Call]:
    return sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call)), key=lambda c: (c.lineno, c.col_offset))


def _call_name(c: ast.Call) -> str:
    f = c.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


@pytest.mark.sglang
def test_sglang_source_has_the_shape_the_decode_state_relies_on():
    """Fails loudly on a version whose code moved (the hooks would then silently do nothing)."""
    ew = _sglang_src("srt/speculative/eagle_worker_v2.py")
    fbg = _func(ew, "forward_batch_generation", "EAGLEWorkerV2")
    order = [_call_name(c) for c in _calls(fbg)]
    seq = [n for n in order if n in ("_build_trivial_verify_input", "verify", "_draft_extend_for_decode")]
    assert seq[:3] == ["_build_trivial_verify_input", "verify", "_draft_extend_for_decode"], seq
    for name in ("init_cuda_graphs", "verify", "_override_worker_state"):
        _func(ew, name, "EAGLEWorkerV2")
    verify_args = [a.arg for a in _func(ew, "verify", "EAGLEWorkerV2").args.args]
    assert verify_args[:2] == ["self", "batch"]

    common = _sglang_src("srt/speculative/eagle_worker_common.py")
    rv = _func(common, "run_eagle_verify")
    names = [_call_name(c) for c in _calls(rv)]
    assert names.index("eagle_prepare_for_verify") < names.index("forward_batch_generation") < names.index("eagle_sample")
    fwd = next(c for c in _calls(rv) if _call_name(c) == "forward_batch_generation")
    kw = {k.arg: k.value for k in fwd.keywords}
    assert isinstance(kw["batch"], ast.Constant) and kw["batch"].value is None
    assert isinstance(kw["is_verify"], ast.Constant) and kw["is_verify"].value is True and "forward_batch" in kw

    utils = _sglang_src("srt/speculative/eagle_utils.py")
    prep = ast.unparse(_func(utils, "eagle_prepare_for_verify"))
    # hiding the steps-0 runner (None) must make SGLang skip the verify graph's plan
    assert "bool(\n        target_worker.model_runner.decode_cuda_graph_runner and" in prep or \
        "bool(target_worker.model_runner.decode_cuda_graph_runner and" in prep

    dcg = _sglang_src("srt/model_executor/runner/decode_cuda_graph_runner.py")
    init = _func(dcg, "__init__", "DecodeCudaGraphRunner")
    last = ast.unparse(init.body[-1])
    assert "self.capture()" in last, "capture() is no longer the last step of __init__"
    assert "capture_forward_mode" in ast.unparse(init)
    for name in ("get_spec_info", "can_run_graph", "load_batch", "execute", "capture"):
        _func(dcg, name, "DecodeCudaGraphRunner")

    fbi = _sglang_src("srt/model_executor/forward_batch_info.py")
    init_new = _func(fbi, "init_new", "ForwardBatch")
    kwonly = [a.arg for a in init_new.args.kwonlyargs]
    assert "capture_hidden_mode" in kwonly and "return_hidden_states_before_norm" in kwonly

    tpw = _sglang_src("srt/managers/tp_worker.py")
    params = [a.arg for a in _func(tpw, "forward_batch_generation", "TpModelWorker").args.args]
    assert params[:3] == ["self", "batch", "forward_batch"] and "is_verify" in params

    triton = _sglang_src("srt/layers/attention/triton_backend.py")
    cls = next(n for n in ast.walk(triton) if isinstance(n, ast.ClassDef) and n.name == "TritonAttnBackend")
    flag = [n for n in cls.body if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "needs_cpu_seq_lens"]
    assert flag and flag[0].value.value is False  # no per-step host sync for triton


@pytest.mark.sglang
def test_the_hooks_are_registered_and_verified_through_the_real_registry(tmp_path):
    """install() registers the three decode-state hooks; with SPECCTL_PATCHES=plain_decode=off none of them."""
    import subprocess
    import sys

    code = r"""
import json, sys
from sglang.srt.plugins.hook_registry import HookRegistry
from specctl.plugin import sglang_hooks
from specctl.plugin.engine import PluginSettings
s = PluginSettings.from_env({"SPECCTL_PATCHES": "plain_decode=" + sys.argv[1], "SPECCTL_TELEMETRY": "none",
                             "SPECCTL_POLICY": "none"})
rt = sglang_hooks.install(s)
print(json.dumps({"plain": s.plain_decode, "hooks": sorted(HookRegistry._hooks)}))
"""
    out = {}
    for v in ("on", "off"):
        p = subprocess.run([sys.executable, "-c", code, v], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONWARNINGS="ignore"))
        assert p.returncode == 0, p.stderr[-2000:]
        out[v] = __import__("json").loads(p.stdout.strip().splitlines()[-1])
    t = __import__("specctl.plugin.sglang_hooks", fromlist=["SGLANG_TARGETS"]).SGLANG_TARGETS
    assert out["on"]["plain"] is True and out["off"]["plain"] is False
    for target in (t.verify, t.target_forward):
        assert target in out["on"]["hooks"] and target not in out["off"]["hooks"]
    assert t.init_graphs in out["off"]["hooks"]  # the start-up line, logged after the patches' builds


@pytest.mark.sglang
def test_the_hooks_dispatch_a_steps0_verify_through_the_real_registry(standin_module, monkeypatch):
    """The real HookRegistry wraps stand-in classes with sglang_hooks' AROUND functions: the verify
    hook and the target-forward hook together turn a steps-0 verify into a decode forward."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from specctl.plugin import runtime as plugin_runtime

    mod = standin_module("specctl_plain_standin")

    class StandinTarget(TargetWorker):
        def forward_batch_generation(self, batch=None, forward_batch=None, is_verify=False):
            return TargetWorker._orig(self, batch=batch, forward_batch=forward_batch, is_verify=is_verify)

    class StandinWorker(Worker):
        def __init__(self, steps=0):
            super().__init__(steps)
            self._target_worker = StandinTarget(lambda: None)

    mod.StandinWorker, mod.StandinTarget = StandinWorker, StandinTarget
    plain = make_plain()
    HookRegistry.register(f"{mod.__name__}.StandinWorker.verify",
                          plain.patch.wrapped("AROUND", pd.around_verify_hook), HookType.AROUND)
    HookRegistry.register(f"{mod.__name__}.StandinTarget.forward_batch_generation",
                          plain.patch.wrapped("AROUND", pd.around_target_forward_hook), HookType.AROUND)
    HookRegistry.apply_hooks()
    assert f"{mod.__name__}.StandinWorker.verify" in HookRegistry._patched
    monkeypatch.setattr(plugin_runtime, "_RUNTIME", SimpleNamespace(plain=plain))
    w = mod.StandinWorker()
    res = w.verify(make_batch())
    assert res._specctl_off_path == pd.DECODE
    assert w._target_worker.calls[-1]["mode"] is DECODE and w.plans == [None]
    w.speculative_num_steps = 2
    res = w.verify(make_batch())
    assert not hasattr(res, "_specctl_off_path") and w._target_worker.calls[-1]["mode"] is TARGET_VERIFY


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize("fail_rank", [-1, 0, 1])
def test_two_gloo_ranks_run_the_decode_state_only_if_both_built_it(tmp_path, fail_rank):
    """SGLang's real GroupCoordinator on gloo: a capture that fails on one rank leaves both ranks
    on the trivial verify (a per-rank mismatch would not hang, it would diverge silently)."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = Path(__file__).with_name("tp_plain_rank.py")
    procs = [subprocess.Popen([sys.executable, str(here), str(r), "2", str(port), str(fail_rank), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
    try:
        outs = [p.communicate(timeout=180)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n\n".join(o[-3000:] for o in outs)
    built = [json.loads((tmp_path / f"plain-rank{r}.json").read_text())["built"] for r in range(2)]
    assert built == ([True, True] if fail_rank < 0 else [False, False])
    if fail_rank >= 0:
        assert "MemoryError" in outs[fail_rank] and "another TP rank could not build it" in outs[1 - fail_rank]


def test_the_logprob_switch_is_off_by_default_and_read_from_the_environment():
    from specctl.plugin.engine import PluginSettings

    assert PluginSettings.from_env({}).plain_decode_logprobs is False
    assert PluginSettings.from_env({"SPECCTL_PATCHES": "plain_logprobs=on"}).plain_decode_logprobs is True
    with pytest.raises(ValueError, match="plain_logprobs must be on or off"):
        PluginSettings.from_env({"SPECCTL_PATCHES": "plain_logprobs=sometimes"})
