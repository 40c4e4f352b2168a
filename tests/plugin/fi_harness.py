"""SGLang 0.5.17's TARGET_VERIFY flashinfer plan path on CPU, for tests/plugin/test_fi_verify_plan.py.

SGLang's own code, compiled from the installed sources (flashinfer_backend.py and eagle_info.py import CUDA-only
packages): FlashInferAttnBackend.init_forward_metadata_out_graph / _prepare_cuda_graph_metadata /
_create_prefill_wrappers, FlashInferIndicesUpdaterPrefill.update_single_wrapper / call_begin_forward,
fast_prefill_plan, PrefillMetadata, WrapperDispatch and EagleVerifyInput.generate_attn_arg_prefill, whose triton
kv-index kernel runs in TRITON_INTERPRET mode (set by tests/plugin/conftest.py). The attributes the backend's
__init__ / init_cuda_graph_state would set are set here (they need a model runner), sized the same way.

flashinfer is GPU-only, so CpuPrefillWrapper stands in for BatchPrefillWithPagedKVCacheWrapper: its constructor and
plan() (flashinfer 0.6.15.post1 prefill.py:1715-1779 and 2230-2450, the CUDA-graph fa2 path), with two kernels
replaced by CPU references (segment_packbits; the scheduler `_cached_module.plan`, here an echo of its host
arguments) and every device-to-host read counted (V1-V4 of docs/architecture.md).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any, List, Optional, Union

import numpy as np
import torch

import sglang
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

from sglang_source import compile_from

SRT = Path(sglang.__file__).parent / "srt"
FI_BACKEND = SRT / "layers" / "attention" / "flashinfer_backend.py"
EAGLE_INFO = SRT / "speculative" / "eagle_info.py"


# ----------------------------------------------------------------------------- flashinfer's part, on the CPU


def segment_packbits_kernel(x, input_indptr, output_indptr, bitorder, y):
    """What flashinfer's SegmentPackBitsKernel writes (csrc/quantization.cu, include/flashinfer/quantization.cuh):
    segment i of x, packed 8 to a byte, at y[output_indptr[i]:]; batch size from input_indptr; no check on y."""
    assert x.dtype == torch.bool and x.is_contiguous()
    assert input_indptr.dtype == output_indptr.dtype == torch.int32 and len(input_indptr) == len(output_indptr)
    bits, ii, oo = x.to(torch.uint8).numpy(), input_indptr.tolist(), output_indptr.tolist()
    for i in range(len(ii) - 1):
        packed = np.packbits(bits[ii[i]:ii[i + 1]], bitorder=bitorder)
        y[oo[i]:oo[i] + len(packed)] = torch.from_numpy(packed)


class PlanModule:
    """The wrapper's `_cached_module`: `plan` is C++ that reads its indptrs as host int32 arrays and returns the
    plan info; here it checks that contract and echoes what the plan depends on."""

    def __init__(self):
        self.calls = 0

    def plan(self, float_ws, int_ws, pinned_ws, qo_indptr, kv_indptr, kv_lens, total_num_rows, batch_size,
             num_qo_heads, num_kv_heads, page_size, cuda_graph, head_dim_qk, head_dim_vo, causal, window_left,
             *fa2_args):
        for t in (qo_indptr, kv_indptr, kv_lens):
            assert t.device.type == "cpu" and t.dtype == torch.int32 and t.is_contiguous()
        self.calls += 1
        return ([int(total_num_rows), int(batch_size), num_qo_heads, num_kv_heads, page_size, int(cuda_graph),
                 head_dim_qk, head_dim_vo, int(causal), window_left] + [int(x) for x in fa2_args]
                + qo_indptr.tolist() + kv_indptr.tolist() + kv_lens.tolist())


@dataclass
class Reads:
    """Device-to-host reads plan() made (on a GPU each one blocks the host until the stream gets there)."""

    names: List[str] = field(default_factory=list)

    def to_cpu(self, name: str, t: torch.Tensor) -> torch.Tensor:
        self.names.append(name)
        return t.to("cpu")


class CpuPrefillWrapper:
    """BatchPrefillWithPagedKVCacheWrapper (flashinfer 0.6.15.post1), the CUDA-graph path, on CPU tensors."""

    reads: Reads  # set per harness
    module: PlanModule

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None, paged_kv_last_page_len_buf=None,
                 custom_mask_buf=None, mask_indptr_buf=None, backend="auto", jit_args=None, jit_kwargs=None):
        self._jit_module = None
        self._kv_layout = kv_layout
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        # flashinfer: torch.empty (and a pinned host copy); zeros here, so that two harnesses compare equal
        self._kv_lens_buffer = torch.zeros((32768,), dtype=torch.int32)
        self._int_workspace_buffer = torch.zeros((1024,), dtype=torch.uint8)
        self._pin_memory_int_workspace_buffer = torch.zeros((1024,), dtype=torch.uint8)
        self._use_cuda_graph = use_cuda_graph
        if use_cuda_graph:
            self._fixed_batch_size = len(qo_indptr_buf) - 1
            assert len(paged_kv_indptr_buf) == self._fixed_batch_size + 1
            assert len(paged_kv_last_page_len_buf) == self._fixed_batch_size
        else:
            self._fixed_batch_size = 0
        self._qo_indptr_buf = qo_indptr_buf
        self._paged_kv_indptr_buf = paged_kv_indptr_buf
        self._paged_kv_indices_buf = paged_kv_indices_buf
        self._paged_kv_last_page_len_buf = paged_kv_last_page_len_buf
        self._custom_mask_buf = custom_mask_buf
        self._mask_indptr_buf = mask_indptr_buf
        self._max_total_num_rows = None
        self._backend = backend
        self._plan_info = None
        self._cached_module = None
        self._seq_lens_kv = None
        self._seq_lens_q = None
        self._block_tables = None

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, head_dim_vo=None, custom_mask=None, packed_custom_mask=None,
             causal=False, pos_encoding_mode="NONE", use_fp16_qk_reduction=False, sm_scale=None, window_left=-1,
             logits_soft_cap=None, rope_scale=None, rope_theta=None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None,
             token_pos_in_items_len=0, max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None, disable_split_kv=False):
        q_data_type = getattr(torch, q_data_type) if isinstance(q_data_type, str) else q_data_type
        kv_data_type = q_data_type if kv_data_type is None else (
            getattr(torch, kv_data_type) if isinstance(kv_data_type, str) else kv_data_type)
        o_data_type = q_data_type if o_data_type is None else o_data_type
        if logits_soft_cap is None:
            logits_soft_cap = 0.0
        if head_dim_vo is None:
            head_dim_vo = head_dim_qk
        if fixed_split_size is None:
            fixed_split_size = -1
        batch_size = len(qo_indptr) - 1
        self._batch_size = batch_size
        self._num_qo_heads = num_qo_heads
        self._num_kv_heads = num_kv_heads
        if custom_mask is not None or packed_custom_mask is not None:
            mask_indptr = torch.empty_like(qo_indptr)  # _compute_page_mask_indptr
            mask_indptr[0] = 0
            mask_indptr[1:] = torch.cumsum((qo_indptr[1:] - qo_indptr[:-1]) * (
                (paged_kv_indptr[1:] - paged_kv_indptr[:-1] - 1) * page_size + paged_kv_last_page_len), 0)
        if packed_custom_mask is None and custom_mask is not None:
            x = custom_mask.contiguous().view(-1)  # segment_packbits (quantization/packbits.py:82-137)
            seglen = mask_indptr[1:] - mask_indptr[:-1]
            indptr_new = torch.zeros(len(mask_indptr), dtype=mask_indptr.dtype, device=mask_indptr.device)
            indptr_new[1:] = torch.cumsum((seglen + 7) // 8, 0)
            output_nnzs = self.reads.to_cpu("packed_mask_size", indptr_new[-1]).item()  # V1
            y = torch.empty(output_nnzs, dtype=torch.uint8, device=x.device)
            segment_packbits_kernel(x, mask_indptr.to(torch.int32), indptr_new.to(torch.int32), "little", y)
            packed_custom_mask, mask_indptr = y, indptr_new.to(torch.int32)
        self._prefix_len_ptr = prefix_len_ptr
        self._token_pos_in_items_ptr = token_pos_in_items_ptr
        self._token_pos_in_items_len = token_pos_in_items_len
        self._max_item_len_ptr = max_item_len_ptr
        qo_indptr_host = self.reads.to_cpu("qo_indptr", qo_indptr)  # V2
        self._qo_indptr_last = int(qo_indptr_host[-1])
        total_num_rows = self._qo_indptr_last
        self._max_q_len = max(qo_indptr_host[1:] - qo_indptr_host[:-1]).item()
        paged_kv_indptr_host = self.reads.to_cpu("paged_kv_indptr", paged_kv_indptr)  # V3
        last_page_len_host = self.reads.to_cpu("paged_kv_last_page_len", paged_kv_last_page_len)  # V4
        kv_lens_arr_host = (torch.clamp(paged_kv_indptr_host[1:] - paged_kv_indptr_host[:-1] - 1, min=0) * page_size
                            + last_page_len_host)  # page.get_seq_lens
        required_size = len(kv_lens_arr_host)
        self._kv_lens_buffer[:required_size].copy_(kv_lens_arr_host, non_blocking=non_blocking)
        self._max_kv_len = max(kv_lens_arr_host).item()
        assert self.is_cuda_graph_enabled  # the only path SGLang's verify graphs take
        if self._max_total_num_rows is None:
            self._max_total_num_rows = total_num_rows
        elif total_num_rows > self._max_total_num_rows:
            raise ValueError("The total number of rows in qo_indptr cannot exceed the number set at capture")
        if batch_size != self._fixed_batch_size:
            raise ValueError("The batch size should be fixed during the lifecycle of the wrapper")
        if len(paged_kv_indices) > len(self._paged_kv_indices_buf):
            raise ValueError("The length of paged_kv_indices exceeds the allocated buffer size.")
        self._qo_indptr_buf.copy_(qo_indptr, non_blocking=non_blocking)
        self._paged_kv_indptr_buf.copy_(paged_kv_indptr, non_blocking=non_blocking)
        self._paged_kv_last_page_len_buf.copy_(paged_kv_last_page_len, non_blocking=non_blocking)
        self._paged_kv_indices_buf[: len(paged_kv_indices)].copy_(paged_kv_indices, non_blocking=non_blocking)
        if packed_custom_mask is not None:
            assert torch.is_tensor(self._custom_mask_buf) and torch.is_tensor(self._mask_indptr_buf)
            self._custom_mask_buf[: len(packed_custom_mask)].copy_(packed_custom_mask, non_blocking=non_blocking)
            self._mask_indptr_buf.copy_(mask_indptr, non_blocking=non_blocking)
        self._cached_q_data_type = q_data_type
        self._cached_kv_data_type = kv_data_type
        self._cached_o_data_type = o_data_type
        self._cached_module = self.module  # get_batch_prefill_module(...): cached, the same object each plan
        self._block_tables = block_tables
        args = [self._float_workspace_buffer, self._int_workspace_buffer, self._pin_memory_int_workspace_buffer,
                qo_indptr_host, paged_kv_indptr_host, kv_lens_arr_host, self._max_total_num_rows or total_num_rows,
                batch_size, num_qo_heads, num_kv_heads, page_size, self.is_cuda_graph_enabled, head_dim_qk,
                head_dim_vo, causal, window_left]
        if self._backend == "fa2":
            args += [fixed_split_size or -1, disable_split_kv, 0]
        self._plan_info = self._cached_module.plan(*args)
        self._causal = causal
        self._pos_encoding_mode = pos_encoding_mode
        self._use_fp16_qk_reduction = use_fp16_qk_reduction
        self._window_left = window_left
        self._logits_soft_cap = logits_soft_cap
        self._sm_scale = sm_scale
        self._rope_scale = rope_scale
        self._rope_theta = rope_theta
        self._seq_lens_kv = seq_lens
        self._seq_lens_q = seq_lens_q if seq_lens_q is not None else seq_lens

    begin_forward = plan


# ----------------------------------------------------------------------------- SGLang's part, from its source


def kv_indices_kernel():
    """sglang's create_flashinfer_kv_indices_triton; it runs on CPU tensors in TRITON_INTERPRET mode, which
    tests/plugin/conftest.py sets before anything imports triton (triton reads it when a kernel is decorated)."""
    import triton

    if not triton.knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET=1 must be set before triton is imported (tests/plugin/conftest.py)")
    from sglang.kernels.ops.attention.utils import create_flashinfer_kv_indices_triton

    return create_flashinfer_kv_indices_triton


class Mode(enum.Enum):
    TARGET_VERIFY = "target_verify"

    def is_target_verify(self):
        return True

    def is_decode_or_idle(self):
        return False

    def is_dllm_extend(self):
        return False

    def is_draft_extend_v2(self):
        return False

    def is_extend(self):
        return True

    def is_idle(self):
        return False


def _fast_decode_plan(*a, **k):  # flashinfer's; only installed on decode wrappers
    raise AssertionError("a decode plan in a verify test")


def load_sglang() -> SimpleNamespace:
    """The SGLang definitions this path runs, once per process."""
    ns: dict = {"torch": torch, "partial": partial, "Optional": Optional, "List": List, "Union": Union,
                "dataclass": dataclass, "Enum": enum.Enum, "auto": enum.auto, "logger": None,
                "SpecInput": SpecInput, "SpecInputType": SpecInputType, "ForwardMode": Mode,
                "create_flashinfer_kv_indices_triton": kv_indices_kernel(),
                "BatchPrefillWithPagedKVCacheWrapper": CpuPrefillWrapper, "fast_decode_plan": _fast_decode_plan,
                "MultiItemScoringParams": None}
    compile_from(FI_BACKEND, ns, ["WrapperDispatch", "fast_prefill_plan", "DecodeMetadata", "PrefillMetadata"])
    backend = compile_from(FI_BACKEND, ns, ["init_forward_metadata_out_graph", "_prepare_cuda_graph_metadata",
                                            "_create_prefill_wrappers", "get_cuda_graph_seq_len_fill_value"],
                           cls="FlashInferAttnBackend")
    updater = compile_from(FI_BACKEND, ns, ["update_single_wrapper", "call_begin_forward"],
                           cls="FlashInferIndicesUpdaterPrefill")
    verify = compile_from(EAGLE_INFO, ns, ["generate_attn_arg_prefill"], cls="EagleVerifyInput")
    return SimpleNamespace(ns=ns, backend=backend, updater=updater, verify=verify)


_SGLANG = None


def sglang_defs() -> SimpleNamespace:
    global _SGLANG
    if _SGLANG is None:
        _SGLANG = load_sglang()
    return _SGLANG


def verify_input_class() -> type:
    d = sglang_defs()

    class EagleVerifyInput(SpecInput):
        """The fields of eagle_info.EagleVerifyInput that the attention backend reads, and its own
        generate_attn_arg_prefill."""

        generate_attn_arg_prefill = d.verify["generate_attn_arg_prefill"]

        def __init__(self, custom_mask, topk, draft_token_num, seq_lens_cpu=None):
            super().__init__(SpecInputType.EAGLE_VERIFY)
            self.custom_mask, self.topk, self.draft_token_num = custom_mask, topk, draft_token_num
            self.num_tokens_per_req = draft_token_num
            self.seq_lens_cpu = seq_lens_cpu

    return EagleVerifyInput


# ----------------------------------------------------------------------------- one target verify graph runner


class Harness:
    """One FlashInferAttnBackend with its verify CUDA-graph wrappers, as the decode graph runner drives it: capture
    at the captured batch sizes, then replays with padded batches (seq_lens and seq_lens_cpu padded with the
    backend's fill value, as cuda_graph_buffer_registry's FILL_SENTINEL slots do). Fresh classes per harness:
    hooks patch only this one."""

    def __init__(self, *, width=4, topk=1, capture_bs=(1, 2, 4, 8), max_context_len=96, page_size=1,
                 prefill_backend="fa2", dispatch_reason=None, kv_dtype=torch.bfloat16, num_pool=12):
        d = sglang_defs()
        self.ns, self.width, self.topk, self.capture_bs = d.ns, width, topk, tuple(capture_bs)
        self.reads, self.module = Reads(), PlanModule()
        self.Wrapper = type("CpuPrefillWrapper", (CpuPrefillWrapper,), {"reads": self.reads, "module": self.module})
        self.Backend = type("FlashInferAttnBackend", (), dict(d.backend))
        self.Updater = type("FlashInferIndicesUpdaterPrefill", (), dict(d.updater))
        self.VerifyInput = verify_input_class()
        self.ns_wrapper_swap()
        b = self.Backend.__new__(self.Backend)
        max_bs, max_tokens = max(capture_bs), max(capture_bs) * width
        # __init__ (flashinfer_backend.py:291-526)
        b.prefill_backend, b.decode_backend, b.page_size = prefill_backend, "fa2", page_size
        b.dispatch_reason = None if dispatch_reason is None else self.ns["WrapperDispatch"][dispatch_reason]
        b.num_wrappers, b.use_sliding_window_kv_pool, b.prefill_uses_dequant_workspace = 1, False, False
        b.flashinfer_kv_cache_dtype, b.max_context_len, b.skip_prefill = kv_dtype, max_context_len, False
        b.workspace_buffer = torch.zeros(1024, dtype=torch.uint8)
        b.kv_indptr = [torch.zeros((max_bs + 1,), dtype=torch.int32)]
        b.kv_last_page_len = torch.ones((max_bs,), dtype=torch.int32)
        b.qo_indptr = [torch.zeros((max_bs + 1,), dtype=torch.int32)]
        b.prefill_cuda_graph_metadata, b.decode_cuda_graph_metadata, b.forward_metadata = {}, {}, None
        # init_cuda_graph_state (l.1000-1040)
        b.cuda_graph_kv_indices = [torch.zeros((max_tokens * max_context_len,), dtype=torch.int32)]
        b.cuda_graph_custom_mask = torch.zeros((max_tokens * max_context_len), dtype=torch.uint8)
        b.cuda_graph_qk_indptr = [x.clone() for x in b.kv_indptr]
        b.cuda_graph_qo_indptr = [x.clone() for x in b.kv_indptr]
        # FlashInferIndicesUpdaterPrefill.__init__ (l.1741-1773)
        u = self.Updater.__new__(self.Updater)
        u.num_qo_heads, u.num_kv_heads, u.head_dim = 8, 2, 64
        u.data_type, u.q_data_type, u.sliding_window_size = kv_dtype, torch.bfloat16, None
        u.attn_backend, u.kv_indptr, u.kv_last_page_len, u.qo_indptr = b, b.kv_indptr, b.kv_last_page_len, b.qo_indptr
        self.req_to_token = (torch.arange(num_pool * max_context_len, dtype=torch.int32).view(num_pool, max_context_len)
                             * 7 + 3) % 100_003
        u.req_to_token, u._swa_kv_pool, u.prefill_wrapper_ragged = self.req_to_token, None, None
        u.update = u.update_single_wrapper
        b.indices_updater_prefill = u
        self.backend, self.updater, self.num_pool = b, u, num_pool
        self.fill = b.get_cuda_graph_seq_len_fill_value()

    def ns_wrapper_swap(self):
        # the backend's methods look BatchPrefillWithPagedKVCacheWrapper up in their globals: this harness's class
        self.ns["BatchPrefillWithPagedKVCacheWrapper"] = self.Wrapper

    def capture(self):
        """Every captured batch size, as DecodeCudaGraphRunner.capture_one_batch_size calls the backend."""
        self.ns_wrapper_swap()
        w = self.width
        for bs in self.capture_bs:
            mask = torch.ones(bs * w * self.backend.max_context_len, dtype=torch.bool)  # buffers.custom_mask
            fb = SimpleNamespace(
                batch_size=bs, forward_mode=Mode.TARGET_VERIFY, req_pool_indices=torch.zeros(bs, dtype=torch.int64),
                seq_lens=torch.full((bs,), self.fill, dtype=torch.int64),
                seq_lens_cpu=torch.full((bs,), self.fill, dtype=torch.int64), seq_lens_sum=bs * self.fill,
                encoder_lens=None, positions=torch.zeros(bs * w, dtype=torch.int64), out_cache_loc=None,
                spec_info=self.VerifyInput(mask, self.topk, w))
            self.backend.init_forward_metadata_out_graph(fb, in_capture=True)
        self.reads.names.clear()

    def batch(self, seq_lens, seed=0, host_seq_lens=None):
        """A raw verify batch: its lengths, request slots and tree mask (random bits: every bit is checked)."""
        g = torch.Generator().manual_seed(seed)
        bs, w = len(seq_lens), self.width
        mask = torch.rand(sum((n + w) * w for n in seq_lens), generator=g) < 0.5
        rng = random.Random(seed)
        slots = rng.sample(range(self.num_pool), bs)
        return SimpleNamespace(seq_lens=list(seq_lens), host=list(host_seq_lens or seq_lens), slots=slots,
                               spec_info=self.VerifyInput(mask, self.topk, w))

    def replay(self, batch):
        """DecodeCudaGraphRunner.load_batch + build_replay_fb_view: pad to the next captured size, then the
        backend's out-of-graph metadata; returns the wrappers the graph would read."""
        self.ns_wrapper_swap()
        raw = len(batch.seq_lens)
        bs = next(c for c in self.capture_bs if c >= raw)
        pad = bs - raw
        fb = SimpleNamespace(
            batch_size=bs, forward_mode=Mode.TARGET_VERIFY,
            req_pool_indices=torch.tensor(batch.slots + [0] * pad, dtype=torch.int64),
            seq_lens=torch.tensor(batch.seq_lens + [self.fill] * pad, dtype=torch.int64),
            seq_lens_cpu=torch.tensor(batch.host + [self.fill] * pad, dtype=torch.int64),
            seq_lens_sum=sum(batch.seq_lens) + pad * self.fill, encoder_lens=None,
            positions=torch.zeros(bs * self.width, dtype=torch.int64), out_cache_loc=None, spec_info=batch.spec_info)
        self.backend.init_forward_metadata_out_graph(fb)
        return self.backend.prefill_cuda_graph_metadata[bs]


def as_module(h: Harness, name: str) -> ModuleType:
    """The harness's classes as an importable module (HookRegistry resolves dotted targets by import)."""
    import sys

    mod = ModuleType(name)
    mod.FlashInferAttnBackend, mod.FlashInferIndicesUpdaterPrefill = h.Backend, h.Updater
    sys.modules[name] = mod
    return mod


STATE_SKIP = {"_cached_module", "_float_workspace_buffer", "_specctl_host_plan"}  # the last: the mark


def wrapper_state(w: Any) -> dict:
    """Everything a plan left on a wrapper (what the captured graph and later plans read)."""
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in vars(w).items() if k not in STATE_SKIP}


def state_diff(a: dict, b: dict) -> list:
    keys = sorted(set(a) | set(b))
    out = []
    for k in keys:
        x, y = a.get(k, "<missing>"), b.get(k, "<missing>")
        if torch.is_tensor(x) and torch.is_tensor(y):
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        else:
            same = type(x) is type(y) and x == y
        if not same:
            out.append(k)
    return out
