"""Patch fi_plan on SGLang 0.5.17: the flashinfer plan of the TARGET_VERIFY CUDA graphs built from
the lengths the host already holds, as 0.5.23's SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN does, so that the verify prep
makes none of plan()'s four blocking device-to-host reads (docs/architecture.md, fix P2: V1-V4).

    AROUND FlashInferAttnBackend.init_forward_metadata_out_graph  at capture, after SGLang's own plan(): mark the
           verify wrappers it can serve (EAGLE verify, topk 1, fa2, page size 1, full attention, 16-bit/fp8 KV)
    AROUND FlashInferIndicesUpdaterPrefill.call_begin_forward      a marked wrapper's begin_forward is, for this call
           only, plan_from_host() with the batch's seq_lens_cpu; SGLang's own code still builds every device tensor

Everything is rank-local and computed from host values that are identical on every TP rank: no collective.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .. import runtime as _rt
from .. import sglang_source
from ..guard import AROUND, Patch, PatchObject

NAME = "fi_plan"
LOST = "flashinfer verify plans keep plan()'s blocking device-to-host reads"

log = logging.getLogger("specctl.plugin")

MARK = "_specctl_host_plan"  # on a wrapper: the draft width it was captured with
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)  # as 0.5.23 gates it
# the plan() arguments SGLang's verify never passes; any other value: the stock plan runs
_DEFAULTS = {"packed_custom_mask": None, "pos_encoding_mode": "NONE", "use_fp16_qk_reduction": False,
             "window_left": -1, "logits_soft_cap": None, "prefix_len_ptr": None, "token_pos_in_items_ptr": None,
             "token_pos_in_items_len": 0, "max_item_len_ptr": None, "seq_lens": None, "seq_lens_q": None,
             "block_tables": None, "max_token_per_sequence": None, "max_sequence_kv": None}


@dataclass(frozen=True)
class HostLayout:
    """The verify batch's attention layout, on the host: what plan() reads back from the device."""

    qo_indptr: torch.Tensor  # int32 [bs+1]: 0, w, 2w, ...  (generate_attn_arg_prefill's qo_indptr)
    kv_indptr: torch.Tensor  # int32 [bs+1]: 0, cumsum(kv_lens)  (its cum_kv_seq_len)
    kv_lens: torch.Tensor  # int32 [bs]: seq_lens + w, the committed prefix and the whole draft window
    mask_indptr: torch.Tensor  # int32 [bs+1]: byte offsets of each request's packed mask rows (w * kv_len bits)
    width: int
    max_kv_len: int

    @property
    def batch_size(self) -> int:
        return int(self.kv_lens.numel())


def host_layout(seq_lens_cpu: torch.Tensor, width: int) -> HostLayout:
    """From the host's seq_lens (CUDA-graph padded rows included: SGLang pads the device and the host lengths with
    the same fill value) and the draft width; page size 1."""
    kv_lens = seq_lens_cpu.to(torch.int32) + width
    bs = int(kv_lens.numel())
    qo = torch.arange(0, (bs + 1) * width, width, dtype=torch.int32)
    kv = torch.zeros(bs + 1, dtype=torch.int32)
    kv[1:] = torch.cumsum(kv_lens, 0)
    mask = torch.zeros(bs + 1, dtype=torch.int32)
    mask[1:] = torch.cumsum((kv_lens * width + 7) // 8, 0)
    return HostLayout(qo, kv, kv_lens, mask, width, int(kv_lens.max()) if bs else 0)


def capture_refusal(backend: Any, forward_batch: Any, pack_problem: Optional[str] = None) -> Optional[str]:
    """Why a TARGET_VERIFY capture keeps SGLang's plan() (None: its wrappers can take the host plan)."""
    from sglang.srt.speculative.spec_info import SpecInputType

    spec = forward_batch.spec_info
    if spec is None or getattr(spec, "spec_input_type", None) != SpecInputType.EAGLE_VERIFY:
        return "not an EAGLE verify"
    if getattr(spec, "topk", None) != 1:
        return f"topk {getattr(spec, 'topk', None)} (a tree)"
    if getattr(spec, "custom_mask", None) is None:
        return "no custom mask"
    if backend.prefill_backend != "fa2":
        return f"prefill backend {backend.prefill_backend}"
    why = layout_refusal(backend)
    if why is not None:
        return why
    if getattr(backend, "flashinfer_kv_cache_dtype", None) not in KV_DTYPES:
        return f"KV cache dtype {getattr(backend, 'flashinfer_kv_cache_dtype', None)}"
    if forward_batch.seq_lens_cpu is None:
        return "no host seq_lens"
    return pack_problem


def layout_refusal(backend: Any) -> Optional[str]:
    """Why a FlashInferAttnBackend's plans are not the one layout a host-built plan reproduces (one full-attention
    wrapper, page size 1, the KV cache itself), or None; shared with fi_extend."""
    if getattr(backend, "dispatch_reason", None) is not None:
        return f"{getattr(backend.dispatch_reason, 'name', backend.dispatch_reason)} wrappers"
    if getattr(backend, "use_sliding_window_kv_pool", False):
        return "a sliding-window KV pool"
    if getattr(backend, "page_size", 1) != 1:
        return f"page size {backend.page_size}"
    if getattr(backend, "prefill_uses_dequant_workspace", False):
        return "an FP4 dequant workspace"
    return None


def wrapper_refusal(w: Any) -> Optional[str]:
    if getattr(w, "_backend", None) != "fa2":
        return f"wrapper backend {getattr(w, '_backend', None)}"
    if not getattr(w, "is_cuda_graph_enabled", False):
        return "wrapper not in CUDA-graph mode"
    if getattr(w, "_cached_module", None) is None:
        return "no plan module from the capture's plan()"
    if not all(torch.is_tensor(getattr(w, b, None)) for b in ("_custom_mask_buf", "_mask_indptr_buf")):
        return "wrapper without custom-mask buffers"
    if "begin_forward" in vars(w):
        return "the wrapper's begin_forward is replaced already"
    return None


def _flashinfer_pack() -> Callable[..., Any]:
    """flashinfer's segment_packbits kernel itself (what plan() packs with), minus the allocation and the
    .item() read of its output size: (x, bit_indptr, byte_indptr, bitorder, out)."""
    from flashinfer.quantization.packbits import get_quantization_module

    return get_quantization_module().segment_packbits


@functools.lru_cache(maxsize=8)
def _plan_signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.plan)


@functools.lru_cache(maxsize=8)
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def _dtype(d: Any) -> torch.dtype:
    return getattr(torch, d) if isinstance(d, str) else d  # flashinfer's canonicalize_torch_dtype


def _is_default(value: Any, default: Any) -> bool:
    return value is None if default is None else (not torch.is_tensor(value) and value == default)


def _as_list(info: Any) -> Any:
    try:
        return [int(x) for x in info]
    except TypeError:
        return info


class HostPlan(PatchObject):
    """Process-wide switch and counters. mode "on", or "check": the first `check_steps` plans are made both
    ways (the host plan, then plan() over it, whose result stands) and compared. Any fault or mismatch turns
    it off for the process, said once; every later plan is plan()'s."""

    def __init__(self, mode: str = "on", *, check_steps: int = 32, pack: Optional[Callable[..., Any]] = None,
                 patch: Optional[Patch] = None):
        self.patch = patch if patch is not None else Patch(NAME, lost=LOST, mode=mode)
        self.mode = mode
        self.check_left = check_steps if mode == "check" else 0
        self.num_marked = 0
        self.num_host_plans = 0
        self.num_checked = 0
        self._pack = pack

    # ------------------------------------------------------------------ hooks

    def around_out_graph(self, orig: Callable[..., Any], backend: Any, args: tuple, kwargs: dict) -> Any:
        out = orig(backend, *args, **kwargs)
        in_capture = args[1] if len(args) > 1 else kwargs.get("in_capture", False)
        if not in_capture or not self.on:
            return out
        try:
            fb = args[0] if args else kwargs["forward_batch"]
            if fb.forward_mode.is_target_verify():
                self.mark(backend, fb)
        except Exception as e:  # noqa: BLE001 - SGLang's plan() stays
            self.patch.turn_off(f"marking a verify capture failed: {type(e).__name__}: {e}")
        return out

    def around_call_begin_forward(self, orig: Callable[..., Any], updater: Any, args: tuple, kwargs: dict) -> Any:
        w = args[1] if len(args) > 1 else kwargs.get("wrapper_paged")
        width = getattr(w, MARK, None)
        if width is None or not self.on:
            return orig(updater, *args, **kwargs)
        try:
            call = _signature(inspect.unwrap(orig)).bind(updater, *args, **kwargs).arguments
            seq_lens_cpu = call.get("seq_lens_cpu")
            why = self._replay_refusal(call, seq_lens_cpu, width)
            if why is not None:
                self.say(f"a verify plan kept plan()'s device reads: {why}")
                return orig(updater, *args, **kwargs)
            w.begin_forward = functools.partial(self.plan, w, host_layout(seq_lens_cpu, width))
        except Exception as e:  # noqa: BLE001
            self.patch.turn_off(f"preparing a host plan failed: {type(e).__name__}: {e}")
            return orig(updater, *args, **kwargs)
        try:
            return orig(updater, *args, **kwargs)
        finally:
            vars(w).pop("begin_forward", None)

    # ------------------------------------------------------------------ capture

    def mark(self, backend: Any, forward_batch: Any) -> int:
        bs = forward_batch.batch_size
        why = capture_refusal(backend, forward_batch, self._pack_problem())
        if why is not None:
            self.say(f"TARGET_VERIFY graphs keep plan()'s device reads (patch fi_plan): {why}",
                     logging.WARNING if why.startswith("flashinfer") else logging.INFO)
            return 0
        n = 0
        for w in backend.prefill_cuda_graph_metadata[bs]:
            why = wrapper_refusal(w)
            if why is not None:
                self.say(f"a TARGET_VERIFY wrapper keeps plan()'s device reads: {why}")
                continue
            setattr(w, MARK, int(forward_batch.spec_info.draft_token_num))
            n += 1
        self.num_marked += n
        if n:
            self.say("TARGET_VERIFY flashinfer plans built from host values, without plan()'s blocking "
                     "device-to-host reads (fi_plan=" +
                     (f"check: the first {self.check_left} compared with plan()'s)" if self.check_left else "on)"))
        return n

    def _pack_problem(self) -> Optional[str]:
        if self._pack is None:
            try:
                self._pack = _flashinfer_pack()
            except Exception as e:  # noqa: BLE001
                return f"flashinfer's segment_packbits kernel is unavailable ({type(e).__name__}: {e})"
        return None

    # ------------------------------------------------------------------ replay

    @staticmethod
    def _replay_refusal(call: dict, seq_lens_cpu: Any, width: int) -> Optional[str]:
        from sglang.srt.speculative.spec_info import SpecInputType

        spec = call.get("spec_info")
        if spec is None or getattr(spec, "spec_input_type", None) != SpecInputType.EAGLE_VERIFY or spec.topk != 1:
            return "not a topk-1 EAGLE verify"
        if spec.draft_token_num != width:
            return f"draft width {spec.draft_token_num}, captured at {width}"
        if seq_lens_cpu is None:
            return "no host seq_lens"
        seq_lens = call.get("seq_lens")
        if seq_lens is None or len(seq_lens_cpu) != len(seq_lens):
            return "host and device batch sizes differ"
        if call.get("prefix_lens") is not None or call.get("use_ragged"):
            return "a prefix or ragged layout"
        return None

    def plan(self, w: Any, layout: HostLayout, *args: Any, **kwargs: Any) -> None:
        """The marked wrapper's begin_forward during one call_begin_forward: plan() from host values."""
        stock = functools.partial(type(w).plan, w)
        if not self.on:
            return stock(*args, **kwargs)
        try:
            if self.check_left > 0:
                return self._check(w, layout, stock, args, kwargs)
            why = self.plan_from_host(w, layout, args, kwargs)
        except Exception as e:  # noqa: BLE001 - plan() redoes every write
            self.patch.turn_off(f"a host-built verify plan failed: {type(e).__name__}: {e}")
            return stock(*args, **kwargs)
        if why is not None:
            self.say(f"a verify plan kept plan()'s device reads: {why}")
            return stock(*args, **kwargs)
        self.num_host_plans += 1
        return None

    def plan_from_host(self, w: Any, layout: HostLayout, args: tuple, kwargs: dict) -> Optional[str]:
        """BatchPrefillWithPagedKVCacheWrapper.plan (flashinfer 0.6.15, CUDA-graph mode, fa2, custom mask),
        the same writes in the same order, with the host layout where plan() reads the device: qo/kv indptr
        and last_page_len `.to("cpu")` (V2-V4) and segment_packbits' `.item()` of the packed size (V1).
        Returns why it did nothing (every check comes before the first write), or None when planned."""
        a = _plan_signature(type(w)).bind(w, *args, **kwargs)
        a.apply_defaults()
        p = a.arguments
        bad = [k for k, v in _DEFAULTS.items() if not _is_default(p.get(k, v), v)]
        if bad:
            return f"plan() called with {', '.join(bad)}"
        qo, kv, last = p["qo_indptr"], p["paged_kv_indptr"], p["paged_kv_last_page_len"]
        kv_indices = p["paged_kv_indices"]
        mask, page_size, bs = p["custom_mask"], p["page_size"], layout.batch_size
        if mask is None or page_size != 1:
            return "no custom mask" if mask is None else f"page size {page_size}"
        if len(qo) != bs + 1 or len(kv) != bs + 1 or kv.dtype != torch.int32:
            return "the device indptrs do not match the host batch"
        total = int(layout.qo_indptr[-1])
        if bs != w._fixed_batch_size or (w._max_total_num_rows is not None and total > w._max_total_num_rows):
            return "the batch exceeds the captured wrapper"  # plan() raises: let it
        if len(kv_indices) > len(w._paged_kv_indices_buf) or bs > w._kv_lens_buffer.shape[0]:
            return "the batch exceeds the wrapper's buffers"
        if int(layout.mask_indptr[-1]) > w._custom_mask_buf.numel():
            return "the packed mask exceeds the wrapper's mask buffer"
        nb = p["non_blocking"]
        head_dim_vo = p["head_dim_vo"] if p["head_dim_vo"] is not None else p["head_dim_qk"]
        fixed = -1 if p["fixed_split_size"] is None else p["fixed_split_size"]
        q_dtype = _dtype(p["q_data_type"])
        kv_dtype = q_dtype if p["kv_data_type"] is None else _dtype(p["kv_data_type"])
        o_dtype = q_dtype if p["o_data_type"] is None else _dtype(p["o_data_type"])

        w._batch_size = bs
        w._num_qo_heads, w._num_kv_heads = p["num_qo_heads"], p["num_kv_heads"]
        # the mask's bit offsets on the device, as plan()'s _compute_page_mask_indptr computes them
        bits = torch.empty_like(qo)
        bits[0] = 0
        bits[1:] = torch.cumsum((qo[1:] - qo[:-1]) * ((kv[1:] - kv[:-1] - 1) * page_size + last), 0)
        w._prefix_len_ptr = w._token_pos_in_items_ptr = w._max_item_len_ptr = None
        w._token_pos_in_items_len = 0
        w._qo_indptr_last = total
        w._max_q_len = layout.width
        w._kv_lens_buffer[:bs].copy_(layout.kv_lens, non_blocking=nb)
        w._max_kv_len = layout.max_kv_len
        if w._max_total_num_rows is None:
            w._max_total_num_rows = total
        w._qo_indptr_buf.copy_(qo, non_blocking=nb)
        w._paged_kv_indptr_buf.copy_(kv, non_blocking=nb)
        w._paged_kv_last_page_len_buf.copy_(last, non_blocking=nb)
        w._paged_kv_indices_buf[: len(kv_indices)].copy_(kv_indices,
                                                         non_blocking=(kv_indices.device == w.device) and nb)
        # plan() packs into a new tensor sized by a device read, then copies it into the buffer; the kernel
        # writes through the byte offsets, so it can pack into the buffer directly
        w._mask_indptr_buf.copy_(layout.mask_indptr, non_blocking=nb)
        self._pack(mask.contiguous().view(-1), bits.to(torch.int32), w._mask_indptr_buf, "little", w._custom_mask_buf)
        w._cached_q_data_type, w._cached_kv_data_type, w._cached_o_data_type = q_dtype, kv_dtype, o_dtype
        w._block_tables = None
        w._plan_info = w._cached_module.plan(
            w._float_workspace_buffer, w._int_workspace_buffer, w._pin_memory_int_workspace_buffer,
            layout.qo_indptr, layout.kv_indptr, layout.kv_lens, w._max_total_num_rows or total, bs,
            p["num_qo_heads"], p["num_kv_heads"], page_size, w.is_cuda_graph_enabled, p["head_dim_qk"], head_dim_vo,
            p["causal"], p["window_left"], fixed or -1, p["disable_split_kv"], 0)
        w._causal, w._pos_encoding_mode = p["causal"], p["pos_encoding_mode"]
        w._use_fp16_qk_reduction, w._window_left = p["use_fp16_qk_reduction"], p["window_left"]
        w._logits_soft_cap = 0.0 if p["logits_soft_cap"] is None else p["logits_soft_cap"]
        w._sm_scale, w._rope_scale, w._rope_theta = p["sm_scale"], p["rope_scale"], p["rope_theta"]
        w._seq_lens_kv = w._seq_lens_q = None
        return None

    # ------------------------------------------------------------------ self-check

    def _check(self, w: Any, layout: HostLayout, stock: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        n_mine = int(layout.mask_indptr[-1])
        under = w._custom_mask_buf[:n_mine].clone()  # what plan() will not overwrite if it packs fewer bytes
        why = self.plan_from_host(w, layout, args, kwargs)
        if why is not None:
            self.say(f"a verify plan kept plan()'s device reads: {why}")
            return stock(*args, **kwargs)
        mine = snapshot(w, n_mine, layout)
        stock(*args, **kwargs)  # over ours: plan()'s device reads wait for our copies, and its state stands
        n_theirs = int(w._mask_indptr_buf[-1])
        if n_mine > n_theirs:
            w._custom_mask_buf[n_theirs:n_mine].copy_(under[n_theirs:])
        theirs = snapshot(w, n_theirs, layout)
        self.check_left -= 1
        self.num_checked += 1
        diff = [k for k in theirs if not _same(mine[k], theirs[k])]
        if diff:
            detail = "; ".join(f"{k}: host {_show(mine[k])} vs plan() {_show(theirs[k])}" for k in diff[:3])
            self.patch.turn_off(f"self-check: the host-built verify plan differs from plan()'s in {', '.join(diff)} "
                          f"({detail})")
        elif self.check_left == 0:
            self.say(f"self-check passed: {self.num_checked} host-built verify plans equal plan()'s "
                     f"(plan info, packed mask, indptrs); host plans from now on")
        return None

    # ------------------------------------------------------------------ helpers



def snapshot(w: Any, mask_bytes: int, layout: HostLayout) -> dict[str, Any]:
    """What a graph replay reads from a wrapper after its plan (copies: the next plan overwrites them)."""
    bs = layout.batch_size
    return {
        "plan_info": _as_list(w._plan_info),
        "host": (w._qo_indptr_last, w._max_q_len, w._max_kv_len, w._batch_size, w._max_total_num_rows),
        "qo_indptr": w._qo_indptr_buf.clone(),
        "kv_indptr": w._paged_kv_indptr_buf.clone(),
        "last_page_len": w._paged_kv_last_page_len_buf.clone(),
        "kv_indices": w._paged_kv_indices_buf[: int(layout.kv_indptr[-1])].clone(),
        "kv_lens": w._kv_lens_buffer[:bs].clone(),
        "mask_indptr": w._mask_indptr_buf.clone(),
        "packed_mask": w._custom_mask_buf[:mask_bytes].clone(),
    }


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a == b


def _show(x: Any) -> str:
    if torch.is_tensor(x):
        x = x.flatten()[:8].tolist() + (["..."] if x.numel() > 8 else [])
    s = str(x)
    return s if len(s) <= 120 else s[:117] + "..."


# ---------------------------------------------------------------------------- hooks


def patch(rt: Any) -> Optional[Patch]:
    """The host-built verify plan's hooks, or None where fi_plan is off or SGLang has its own (then turned on)."""
    s = rt.settings
    if s.fi_verify_host_plan == "off":
        return None
    field = sglang_source.verify_host_plan_switch()
    if field is not None:
        _use_sglang_switch(field, s.fi_verify_host_plan)
        return None
    p = Patch(NAME, lost=LOST, mode=s.fi_verify_host_plan)
    p.publish(HostPlan(s.fi_verify_host_plan, check_steps=s.fi_verify_check_steps, patch=p))
    p.hook(AROUND, rt.targets.fi_out_graph, around_out_graph)
    p.hook(AROUND, rt.targets.fi_begin_forward, around_call_begin_forward)
    return p


def _use_sglang_switch(field: Any, mode: str) -> None:
    """fi_plan on an SGLang that has its own switch: turn that on, unless the operator set it."""
    name = sglang_source.SGLANG_VERIFY_HOST_PLAN
    if field.is_set():
        log.info("specctl: fi_plan=%s: %s is set (%s) and stays as set; no plugin hook", mode, name, field.get())
        return
    field.set(True)
    unchecked = "; its plan is not self-checked (check mode compares plans on SGLang 0.5.17 only)"
    log.info("specctl: fi_plan=%s: turned on this SGLang's own %s (no plugin hook)%s",
             mode, name, unchecked if mode == "check" else "")


def around_out_graph(orig: Callable[..., Any], backend: Any, *args: Any, **kwargs: Any) -> Any:
    rt = _rt.current()
    if rt is not None and not rt.hooks_checked:  # a capture before any policy object: both hooks, or none of it
        rt.check_hooks()
    hp = _rt.live("fi_plan")
    if hp is None:
        return orig(backend, *args, **kwargs)
    return hp.around_out_graph(orig, backend, args, kwargs)


def around_call_begin_forward(orig: Callable[..., Any], updater: Any, *args: Any, **kwargs: Any) -> Any:
    hp = _rt.live("fi_plan")
    if hp is None:
        return orig(updater, *args, **kwargs)
    return hp.around_call_begin_forward(orig, updater, args, kwargs)
