"""Patch fi_extend (flashinfer): a prefill's attention plan built from the lengths the host holds, so that
flashinfer's plan() makes none of its blocking device-to-host reads (issue 45: an EAGLE-3 server's prefill
iterations under churn).

Why: SGLang plans an EXTEND batch (FlashInferIndicesUpdaterPrefill.call_begin_forward) with indptrs it builds on the
device, and flashinfer's plan() reads them back (`qo_indptr.to("cpu")`, `paged_kv_indptr.to("cpu")`,
`paged_kv_last_page_len.to("cpu")`, "only required if qo_indptr/paged_kv_indptr are device tensors"): the host waits
until the stream gets there. A no-spec server pays that once per prefill, for the previous step. An EAGLE-3 server
plans a second EXTEND right after the target's prefill is queued, the draft's extend over the prompt
(EagleDraftWorker._draft_extend_for_prefill): its reads wait for the whole target prefill, and the host prepares
nothing while it runs. The lengths are host values already: the scheduler builds the batch's device lengths from
the same lists (ForwardBatch.seq_lens_cpu, extend_prefix_lens_cpu), and plan() takes host indptrs as they are.
That wait costs only where a prefill's GPU time exceeds the host's: on the testbed's short prompts (100-500 tokens,
8B-class target, breakable prefill graphs) the prefill iteration is host-bound and plan()'s reads waited 0.05 ms
a window (the 2026-12-07 flashinfer churn profile: extend GPU 12-20 ms, host 45-58 ms); long prompts (a few
thousand tokens: GPU time above the host's) are where it should show. Off until a GPU run measures it.

    AROUND FlashInferAttnBackend.init_forward_metadata          an EXTEND batch (the target's prefill, the draft's
           extend over it; eager or in a breakable prefill CUDA graph, which plans eagerly): its host lengths, for
           this call only
    AROUND FlashInferIndicesUpdaterPrefill.call_begin_forward   the ragged and paged wrappers' begin_forward, for this
           call only, get host indptrs in place of the device ones; SGLang's own code still builds every device
           tensor (kv_indices included) and plan() does the rest as it would

Full prefill CUDA graphs (init_forward_metadata_out_graph, slot-padded views), verify and draft-extend-v2 plans,
sliding windows, multimodal / multi-item batches, page sizes above 1 keep plan()'s reads (fi_plan serves verify).
`check` (or `check:N`): the first N plans also read the device indptrs and compare (the reads they replace); a
difference turns the patch off for the process, logged once, and that plan uses the device's. Rank-local:
every TP rank holds the same batch and lengths, so every rank plans alike; no collective.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import runtime as _rt
from ..guard import AROUND, Patch, PatchObject
from .fi_plan import _show, _signature, layout_refusal

NAME = "fi_extend"
LOST = "flashinfer prefill plans keep plan()'s blocking device-to-host reads"

# flashinfer backends whose plan() takes host indptrs as they are (cutlass plans on the indptrs' device; cudnn,
# cute-dsl and trtllm-gen take other paths)
HOST_INDPTR_BACKENDS = ("auto", "fa2", "fa3")
PENDING = "_specctl_extend_host"  # on the attention backend, during one init_forward_metadata: (seq, prefix)


@dataclass(frozen=True)
class ExtendLayout:
    """An EXTEND batch's plan indptrs, on the host, as call_begin_forward builds them on the device."""

    qo_indptr: torch.Tensor  # int32 [bs+1]: 0, cumsum(seq_lens - prefix_lens)
    kv_indptr: torch.Tensor  # int32 [bs+1]: 0, cumsum(prefix_lens) for a ragged plan, cumsum(seq_lens) otherwise
    last_page_len: torch.Tensor  # int32 [bs]: ones (page size 1)

    @property
    def batch_size(self) -> int:
        return int(self.last_page_len.numel())


def extend_layout(seq_lens_cpu: Any, prefix_lens_cpu: Any, use_ragged: bool, pin: bool = False) -> ExtendLayout:
    """From the batch's host lengths (seq_lens_cpu: a tensor; prefix_lens_cpu: SGLang's list) and whether the
    plan is ragged (the paged wrapper then covers the prefix only); `pin`: page-locked (the copies plan() makes to the
    device are asynchronous then)."""
    seq = torch.as_tensor(seq_lens_cpu).to(torch.int64).flatten()
    pre = torch.as_tensor(list(prefix_lens_cpu), dtype=torch.int64).flatten()
    if seq.numel() != pre.numel():
        raise ValueError(f"{seq.numel()} sequence lengths for {pre.numel()} prefix lengths")
    if bool((pre > seq).any()) or bool((pre < 0).any()):
        raise ValueError("a prefix longer than its sequence")
    bs = int(seq.numel())
    qo = torch.zeros(bs + 1, dtype=torch.int32)
    qo[1:] = torch.cumsum(seq - pre, 0)
    kv = torch.zeros(bs + 1, dtype=torch.int32)
    kv[1:] = torch.cumsum(pre if use_ragged else seq, 0)
    last = torch.ones(bs, dtype=torch.int32)
    if pin:
        qo, kv, last = qo.pin_memory(), kv.pin_memory(), last.pin_memory()
    return ExtendLayout(qo, kv, last)


def batch_refusal(backend: Any, forward_batch: Any) -> Optional[str]:
    """Why an init_forward_metadata call keeps plan()'s reads (None: its EXTEND plans can take host indptrs)."""
    if getattr(forward_batch.forward_mode, "name", None) != "EXTEND":  # ForwardMode.EXTEND, not MIXED or a draft's
        return "not an EXTEND batch"
    if getattr(backend, "is_multimodal", False) or getattr(backend, "enable_mis", False):
        return "multimodal or multi-item scoring"
    why = layout_refusal(backend)
    if why is not None:
        return why
    if getattr(forward_batch, "encoder_lens", None) is not None:
        return "an encoder-decoder batch"
    if getattr(forward_batch, "cross_attention_custom_mask", None) is not None:
        return "a cross-attention mask"
    if forward_batch.seq_lens_cpu is None or forward_batch.extend_prefix_lens_cpu is None:
        return "no host lengths"
    if len(forward_batch.extend_prefix_lens_cpu) != forward_batch.batch_size:
        return "host prefix lengths do not match the batch"
    return None


def call_refusal(call: dict, pending: tuple) -> Optional[str]:
    """Why one call_begin_forward keeps plan()'s reads (`call`: its bound arguments; `pending`: the batch's)."""
    seq_lens_cpu, _ = pending
    if call.get("spec_info") is not None:
        return "a speculative layout"
    if call.get("kv_start_idx") is not None or call.get("use_sliding_window_kv_pool"):
        return "a sliding window"
    if call.get("custom_kv_indices") is not None or call.get("cross_attention_custom_mask") is not None:
        return "custom kv indices or mask"
    mip = call.get("multi_item_params")
    if mip is not None and mip.is_enabled():
        return "multi-item scoring"
    if call.get("prefix_lens") is None:
        return "no prefix lengths"
    seq = call.get("seq_lens")
    if seq is None or len(seq) != len(seq_lens_cpu) or call.get("seq_lens_cpu") is not seq_lens_cpu:
        return "not the batch's own lengths"
    return None


class ExtendHostPlan(PatchObject):
    """Process-wide switch and counters. mode "on", or "check": the first `check_steps` plans compare the host
    indptrs with the device's first (a read each, as plan() makes); any difference or fault turns it off."""

    def __init__(self, mode: str = "on", *, check_steps: int = 32, pin: Optional[bool] = None,
                 patch: Optional[Patch] = None):
        self.patch = patch if patch is not None else Patch(NAME, lost=LOST, mode=mode)
        self.mode = mode
        self.check_left = check_steps if mode == "check" else 0
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.num_host_plans = 0  # wrapper plans given host indptrs
        self.num_checked = 0

    # ------------------------------------------------------------------ hooks

    def around_init_forward_metadata(self, orig: Callable[..., Any], backend: Any, args: tuple, kwargs: dict) -> Any:
        if not self.on:
            return orig(backend, *args, **kwargs)
        try:
            fb = args[0] if args else kwargs["forward_batch"]
            why = batch_refusal(backend, fb)
        except Exception as e:  # noqa: BLE001 - SGLang's plan stays
            self.patch.turn_off(f"reading a batch failed: {type(e).__name__}: {e}")
            return orig(backend, *args, **kwargs)
        if why is not None:
            if why != "not an EXTEND batch":
                self.say(f"an EXTEND plan kept plan()'s device reads: {why}")
            return orig(backend, *args, **kwargs)
        setattr(backend, PENDING, (fb.seq_lens_cpu, fb.extend_prefix_lens_cpu))
        try:
            return orig(backend, *args, **kwargs)
        finally:
            vars(backend).pop(PENDING, None)

    def around_call_begin_forward(self, orig: Callable[..., Any], updater: Any, args: tuple, kwargs: dict) -> Any:
        pending = getattr(getattr(updater, "attn_backend", None), PENDING, None)
        if pending is None or not self.on:
            return orig(updater, *args, **kwargs)
        try:
            call = _signature(inspect.unwrap(orig)).bind(updater, *args, **kwargs).arguments
            why = call_refusal(call, pending)
            if why is not None:
                self.say(f"an EXTEND plan kept plan()'s device reads: {why}")
                return orig(updater, *args, **kwargs)
            layout = extend_layout(pending[0], pending[1], bool(call["use_ragged"]), self.pin)
            ws = [call["wrapper_paged"]] + ([call["wrapper_ragged"]] if call["use_ragged"] else [])
            if any("begin_forward" in vars(w) for w in ws):
                self.say("an EXTEND plan kept plan()'s device reads: a wrapper's begin_forward is replaced already")
                return orig(updater, *args, **kwargs)
            for w in ws:
                w.begin_forward = functools.partial(self.plan, w, layout, w is call["wrapper_paged"])
        except Exception as e:  # noqa: BLE001
            self.patch.turn_off(f"preparing a host plan failed: {type(e).__name__}: {e}")
            return orig(updater, *args, **kwargs)
        try:
            return orig(updater, *args, **kwargs)
        finally:
            for w in ws:
                vars(w).pop("begin_forward", None)

    # ------------------------------------------------------------------ the wrapper's plan

    def plan(self, w: Any, layout: ExtendLayout, paged: bool, *args: Any, **kwargs: Any) -> Any:
        """One wrapper's begin_forward during a call_begin_forward: plan() with the host indptrs in place of the
        device ones SGLang passed (same values: checked in `check` mode); anything unexpected: plan() as called."""
        stock = functools.partial(type(w).plan, w)
        if not self.on:
            return stock(*args, **kwargs)
        try:
            bound = _signature(type(w).plan).bind(w, *args, **kwargs)
            p = bound.arguments
            names = ("qo_indptr", "paged_kv_indptr", "paged_kv_last_page_len") if paged else ("qo_indptr", "kv_indptr")
            host = (layout.qo_indptr, layout.kv_indptr, layout.last_page_len) if paged else \
                (layout.qo_indptr, layout.qo_indptr)
            why = self._plan_refusal(p, names, host, paged)
            if why is None and self.check_left > 0:
                why = self._check(p, names, host)
        except Exception as e:  # noqa: BLE001 - plan() as SGLang called it
            self.patch.turn_off(f"a host-indptr plan failed: {type(e).__name__}: {e}")
            return stock(*args, **kwargs)
        if why is not None:
            self.say(f"an EXTEND plan kept plan()'s device reads: {why}")
            return stock(*args, **kwargs)
        for name, t in zip(names, host):
            p[name] = t
        self.num_host_plans += 1
        return type(w).plan(*bound.args, **bound.kwargs)

    @staticmethod
    def _plan_refusal(p: dict, names: tuple, host: tuple, paged: bool) -> Optional[str]:
        backend = getattr(p["self"], "_backend", None)
        if backend not in HOST_INDPTR_BACKENDS:
            return f"wrapper backend {backend}"
        if getattr(p["self"], "is_cuda_graph_enabled", False):
            return "a CUDA-graph wrapper"
        for name, t in zip(names, host):
            d = p.get(name)
            if not torch.is_tensor(d) or d.shape != t.shape or d.dtype != torch.int32:
                return f"{name} is not the batch's int32 [{t.numel()}]"
        if p.get("custom_mask") is not None or p.get("packed_custom_mask") is not None:
            return "a custom mask"
        if paged and (p.get("seq_lens") is not None or p.get("page_size") != 1):
            return "explicit kv lengths or a page size above 1"
        return None

    def _check(self, p: dict, names: tuple, host: tuple) -> Optional[str]:
        """The reads this replaces, made once more: the device's indptrs against the host's."""
        diff = [n for n, t in zip(names, host) if not torch.equal(p[n].to("cpu"), t)]
        self.check_left -= 1
        self.num_checked += 1
        if diff:
            detail = "; ".join(f"{n}: host {_show(t)} vs device {_show(p[n])}" for n, t in zip(names, host) if n in diff)
            self.patch.turn_off(f"self-check: host prefill indptrs differ from the device's in {', '.join(diff)} "
                                f"({detail})")
            return "the self-check failed"
        if self.check_left == 0:
            self.say(f"self-check passed: {self.num_checked} prefill plans' host indptrs equal the device's; "
                     "host indptrs from now on")
        return None


# ---------------------------------------------------------------------------- hooks


def patch(rt: Any) -> Optional[Patch]:
    """The host-indptr prefill plan's hooks, or None where fi_extend is off."""
    s = rt.settings
    if s.fi_extend_host_plan == "off":
        return None
    p = Patch(NAME, lost=LOST, mode=s.fi_extend_host_plan)
    p.publish(ExtendHostPlan(s.fi_extend_host_plan, check_steps=s.fi_extend_check_steps, patch=p))
    p.hook(AROUND, rt.targets.fi_init_metadata, around_init_forward_metadata)
    p.hook(AROUND, rt.targets.fi_begin_forward, around_call_begin_forward)
    return p


def around_init_forward_metadata(orig: Callable[..., Any], backend: Any, *args: Any, **kwargs: Any) -> Any:
    hp = _rt.live(NAME)
    if hp is None:
        return orig(backend, *args, **kwargs)
    return hp.around_init_forward_metadata(orig, backend, args, kwargs)


def around_call_begin_forward(orig: Callable[..., Any], updater: Any, *args: Any, **kwargs: Any) -> Any:
    hp = _rt.live(NAME)
    if hp is None:
        return orig(updater, *args, **kwargs)
    return hp.around_call_begin_forward(orig, updater, args, kwargs)
