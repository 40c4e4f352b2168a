"""SGLang 0.5.17's flashinfer EXTEND (prefill) plan path on CPU, for tests/plugin/test_fi_extend_plan.py.

SGLang's own code, compiled from the installed sources (flashinfer_backend.py imports CUDA-only packages):
FlashInferAttnBackend.init_forward_metadata / _prepare_dequant_workspace_metadata_for_extend,
FlashInferIndicesUpdaterPrefill.update_single_wrapper / call_begin_forward, MultiItemScoringParams, PrefillMetadata,
DecodeMetadata, WrapperDispatch, fast_prefill_plan; its kv-index triton kernel runs in TRITON_INTERPRET mode
(tests/plugin/conftest.py). The attributes the backend's __init__ would set are set here.

flashinfer is GPU-only: CpuPagedWrapper and CpuRaggedWrapper stand in for BatchPrefillWithPagedKVCacheWrapper and
BatchPrefillWithRaggedKVCacheWrapper, their plan() without CUDA graphs (flashinfer 0.6.15.post1 prefill.py:2080-2502
and 3208-3595, the fa2 path), the scheduler `_cached_module.plan` an echo of its host arguments. A read is a
`.to("cpu")` of a tensor that lives in one of the backend's device buffers (qo_indptr, kv_indptr, kv_last_page_len):
on a GPU each one blocks the host until the stream gets there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List, Optional, Union

import torch

import sglang
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

from fi_harness import PlanModule, kv_indices_kernel
from sglang_source import compile_from

SRT = Path(sglang.__file__).parent / "srt"
FI_BACKEND = SRT / "layers" / "attention" / "flashinfer_backend.py"


@dataclass
class Reads:
    device: List[int] = field(default_factory=list)  # storage pointers of the backend's device buffers
    names: List[str] = field(default_factory=list)

    def to_cpu(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() in self.device:
            self.names.append(name)
        return t.to("cpu")


class _Wrapper:
    reads: Reads
    module: PlanModule

    def __init__(self, float_workspace_buffer, kv_layout="NHD", backend="fa2"):
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._kv_layout, self._backend, self._jit_module = kv_layout, backend, None
        self._int_workspace_buffer = torch.zeros((1024,), dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.zeros((1024,), dtype=torch.uint8)
        self._kv_lens_buffer = torch.zeros((32768,), dtype=torch.int32)
        self._max_total_num_rows = None
        self._cached_module = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False


class CpuPagedWrapper(_Wrapper):
    """BatchPrefillWithPagedKVCacheWrapper.plan, no CUDA graph, no custom mask, fa2."""

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False):
        assert custom_mask is None and packed_custom_mask is None, "no mask on this path"
        head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
        batch_size = len(qo_indptr) - 1
        self._batch_size, self._num_qo_heads, self._num_kv_heads = batch_size, num_qo_heads, num_kv_heads
        self._prefix_len_ptr, self._token_pos_in_items_ptr = prefix_len_ptr, token_pos_in_items_ptr
        self._token_pos_in_items_len, self._max_item_len_ptr = token_pos_in_items_len, max_item_len_ptr
        qo_indptr_host = self.reads.to_cpu("qo_indptr", qo_indptr)
        self._qo_indptr_last = int(qo_indptr_host[-1])
        total_num_rows = self._qo_indptr_last
        self._max_q_len = max(qo_indptr_host[1:] - qo_indptr_host[:-1]).item()
        paged_kv_indptr_host = self.reads.to_cpu("paged_kv_indptr", paged_kv_indptr)
        last_page_len_host = self.reads.to_cpu("paged_kv_last_page_len", paged_kv_last_page_len)
        kv_lens_arr_host = (torch.clamp(paged_kv_indptr_host[1:] - paged_kv_indptr_host[:-1] - 1, min=0) * page_size
                            + last_page_len_host)  # page.get_seq_lens
        self._kv_lens_buffer[:len(kv_lens_arr_host)].copy_(kv_lens_arr_host, non_blocking=non_blocking)
        self._max_kv_len = max(kv_lens_arr_host).item() if len(kv_lens_arr_host) else 0
        self._qo_indptr_buf = qo_indptr.to(self.device, non_blocking=non_blocking)
        self._paged_kv_indptr_buf = paged_kv_indptr.to(self.device, non_blocking=non_blocking)
        self._paged_kv_indices_buf = paged_kv_indices.to(self.device, non_blocking=non_blocking)
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len.to(self.device, non_blocking=non_blocking)
        self._custom_mask_buf = self._mask_indptr_buf = None
        self._cached_q_data_type, self._cached_kv_data_type = q_data_type, kv_data_type or q_data_type
        self._cached_module = self.module
        self._block_tables = block_tables
        self._plan_info = self._cached_module.plan(
            self._float_workspace_buffer, self._int_workspace_buffer, self._pin_memory_int_workspace_buffer,
            qo_indptr_host, paged_kv_indptr_host, kv_lens_arr_host.to(torch.int32),
            self._max_total_num_rows or total_num_rows, batch_size, num_qo_heads, num_kv_heads, page_size, False,
            head_dim_qk, head_dim_vo, causal, window_left, fixed_split_size or -1, disable_split_kv, 0)
        self._causal, self._window_left, self._sm_scale = causal, window_left, sm_scale
        self._seq_lens_kv, self._seq_lens_q = seq_lens, seq_lens_q if seq_lens_q is not None else seq_lens

    begin_forward = plan


class CpuRaggedWrapper(_Wrapper):
    """BatchPrefillWithRaggedKVCacheWrapper.plan, no CUDA graph, no custom mask, fa2."""

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None,
             custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode="NONE",
             use_fp16_qk_reduction=False, window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None,
             rope_theta=None, q_data_type="float16", kv_data_type=None, o_data_type=None, non_blocking=True,
             prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None,
             fixed_split_size=None, disable_split_kv=False, seq_lens=None, seq_lens_q=None,
             max_token_per_sequence=None, max_sequence_kv=None, v_indptr=None, o_indptr=None):
        assert custom_mask is None and packed_custom_mask is None, "no mask on this path"
        head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
        batch_size = len(qo_indptr) - 1
        if len(kv_indptr) != batch_size + 1:
            raise ValueError("The kv_indptr length should be equal to mask_indptr length.")
        qo_indptr_host = self.reads.to_cpu("ragged_qo_indptr", qo_indptr)
        kv_indptr_host = self.reads.to_cpu("ragged_kv_indptr", kv_indptr)
        self._qo_indptr_last = int(qo_indptr_host[-1])
        total_num_rows = self._qo_indptr_last
        self._qo_indptr_buf = qo_indptr.to(self.device, non_blocking=non_blocking)
        self._kv_indptr_buf = kv_indptr.to(self.device, non_blocking=non_blocking)
        self._o_indptr_buf, self._v_indptr_buf = self._qo_indptr_buf, self._kv_indptr_buf
        self._cached_q_data_type, self._cached_kv_data_type = q_data_type, kv_data_type or q_data_type
        kv_len_arr = kv_indptr_host[1:] - kv_indptr_host[:-1]
        self._cached_module = self.module
        self._plan_info = self._cached_module.plan(
            self._float_workspace_buffer, self._int_workspace_buffer, self._pin_memory_int_workspace_buffer,
            qo_indptr_host, kv_indptr_host, kv_len_arr.to(torch.int32), self._max_total_num_rows or total_num_rows,
            batch_size, num_qo_heads, num_kv_heads, 1, False, head_dim_qk, head_dim_vo, causal, window_left,
            fixed_split_size or -1, disable_split_kv, 0)
        self._causal, self._window_left, self._sm_scale = causal, window_left, sm_scale

    begin_forward = plan


class Mode(enum.Enum):
    """The ForwardMode members this path asks about (the plugin reads the member's name)."""

    EXTEND = "extend"
    MIXED = "mixed"
    DECODE = "decode"

    def is_decode_or_idle(self):
        return self is Mode.DECODE

    def is_target_verify(self):
        return False

    def is_extend_without_speculative(self):
        return self is not Mode.DECODE


def load_sglang() -> SimpleNamespace:
    ns: dict = {"torch": torch, "partial": partial, "Optional": Optional, "List": List, "Union": Union,
                "dataclass": dataclass, "Enum": enum.Enum, "auto": enum.auto, "logger": None,
                "SpecInput": SpecInput, "SpecInputType": SpecInputType, "ForwardMode": Mode,
                "create_flashinfer_kv_indices_triton": kv_indices_kernel(),
                "is_in_tc_piecewise_cuda_graph": lambda: False}
    compile_from(FI_BACKEND, ns, ["WrapperDispatch", "MultiItemScoringParams", "fast_prefill_plan",
                                  "DecodeMetadata", "PrefillMetadata"])
    backend = compile_from(FI_BACKEND, ns, ["init_forward_metadata", "_prepare_dequant_workspace_metadata_for_extend"],
                           cls="FlashInferAttnBackend")
    updater = compile_from(FI_BACKEND, ns, ["update_single_wrapper", "call_begin_forward"],
                           cls="FlashInferIndicesUpdaterPrefill")
    return SimpleNamespace(ns=ns, backend=backend, updater=updater)


sglang_defs = lru_cache(maxsize=1)(load_sglang)  # the SGLang definitions, compiled once per process


class Harness:
    """One FlashInferAttnBackend planning EXTEND batches eagerly (as the scheduler's prefill and the EAGLE draft's
    extend over it do, and a breakable prefill CUDA graph's replay). Fresh classes per harness: hooks patch only
    this one."""

    def __init__(self, *, max_bs=16, max_context_len=512, num_pool=24, wrapper_backend="fa2", page_size=1):
        d = sglang_defs()
        self.ns, self.max_context_len, self.num_pool = d.ns, max_context_len, num_pool
        self.reads, self.module = Reads(), PlanModule()
        extra = {"reads": self.reads, "module": self.module}
        self.Paged = type("CpuPagedWrapper", (CpuPagedWrapper,), dict(extra))
        self.Ragged = type("CpuRaggedWrapper", (CpuRaggedWrapper,), dict(extra))
        self.Backend = type("FlashInferAttnBackend", (), dict(d.backend))
        self.Updater = type("FlashInferIndicesUpdaterPrefill", (), dict(d.updater))
        b = self.Backend.__new__(self.Backend)
        ws = torch.zeros(1024, dtype=torch.uint8)
        # __init__ (flashinfer_backend.py:291-526), the attributes this path reads
        b.prefill_backend, b.page_size, b.num_wrappers, b.dispatch_reason = "fa2", page_size, 1, None
        b.use_sliding_window_kv_pool, b.prefill_uses_dequant_workspace, b._swa_kv_pool = False, False, None
        b.is_multimodal, b.enable_mis, b.enable_deterministic, b.use_paged = False, False, False, False
        b.prefill_split_tile_size, b.dq_page_table, b.dq_paged_kernel_lens = None, None, None
        b.kv_indptr = [torch.zeros((max_bs + 1,), dtype=torch.int32)]
        b.kv_last_page_len = torch.ones((max_bs,), dtype=torch.int32)
        b.qo_indptr = [torch.zeros((max_bs + 1,), dtype=torch.int32)]
        b.prefill_wrapper_ragged = self.Ragged(ws, backend=wrapper_backend)
        b.prefill_wrappers_paged = [self.Paged(ws, backend=wrapper_backend)]
        b.forward_metadata = None
        self.reads.device += [t.untyped_storage().data_ptr() for t in (b.kv_indptr[0], b.qo_indptr[0],
                                                                        b.kv_last_page_len)]
        # FlashInferIndicesUpdaterPrefill.__init__ (l.1741-1773)
        u = self.Updater.__new__(self.Updater)
        u.num_qo_heads, u.num_kv_heads, u.head_dim = 8, 2, 64
        u.data_type, u.q_data_type, u.sliding_window_size = torch.bfloat16, torch.bfloat16, None
        u.attn_backend, u.kv_indptr, u.kv_last_page_len, u.qo_indptr = b, b.kv_indptr, b.kv_last_page_len, b.qo_indptr
        self.req_to_token = (torch.arange(num_pool * max_context_len, dtype=torch.int32)
                             .view(num_pool, max_context_len) * 7 + 3) % 100_003
        u.req_to_token, u._swa_kv_pool, u.prefill_wrapper_ragged = self.req_to_token, None, b.prefill_wrapper_ragged
        u.update = u.update_single_wrapper
        b.indices_updater_prefill = u
        self.backend, self.updater = b, u

    def batch(self, seq_lens, prefix_lens=None, *, mode=Mode.EXTEND, slots=None, host_seq_lens=None,
              host_prefix_lens=None) -> SimpleNamespace:
        """A ForwardBatch with the fields this path reads; host_* give host lengths other than the device's."""
        bs = len(seq_lens)
        prefix_lens = list(prefix_lens) if prefix_lens is not None else [0] * bs
        slots = list(slots) if slots is not None else list(range(bs))
        host_seq = list(host_seq_lens) if host_seq_lens is not None else list(seq_lens)
        host_pre = list(host_prefix_lens) if host_prefix_lens is not None else list(prefix_lens)
        return SimpleNamespace(
            batch_size=bs, forward_mode=mode, req_pool_indices=torch.tensor(slots, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64), seq_lens_cpu=torch.tensor(host_seq, dtype=torch.int64),
            seq_lens_sum=sum(seq_lens), extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int64),
            extend_prefix_lens_cpu=host_pre, extend_seq_lens_cpu=[s - p for s, p in zip(host_seq, host_pre)],
            encoder_lens=None, out_cache_loc=None, spec_info=None, cross_attention_custom_mask=None)

    def plan(self, fb) -> dict:
        """init_forward_metadata on the batch; what the wrappers hold after it."""
        self.backend.init_forward_metadata(fb)
        b = self.backend
        return {"ragged": state(b.prefill_wrapper_ragged), "paged": state(b.prefill_wrappers_paged[0]),
                "use_ragged": b.forward_metadata.use_ragged}


SKIP = {"_float_workspace_buffer", "_cached_module", "_int_workspace_buffer", "_pin_memory_int_workspace_buffer"}


def state(w: Any) -> dict:
    """Everything a plan left on a wrapper that the kernels read (copies)."""
    out = {}
    for k, v in vars(w).items():
        if k in SKIP or k == "begin_forward":
            continue
        out[k] = v.clone() if torch.is_tensor(v) else v
    if "_paged_kv_indices_buf" in out:  # SGLang allocates 256 spare entries it never writes (torch.empty)
        out["_paged_kv_indices_buf"] = out["_paged_kv_indices_buf"][: int(out["_paged_kv_indptr_buf"][-1])]
    return out


def same(a: dict, b: dict) -> list:
    """The keys where two wrapper states differ (tensors by value, dtype and shape)."""
    diff = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if torch.is_tensor(x) and torch.is_tensor(y):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                diff.append(k)
        elif x != y:
            diff.append(k)
    return diff
