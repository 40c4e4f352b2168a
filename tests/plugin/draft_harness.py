"""SGLang's steps-0 draft extend on CPU, for tests/plugin/test_draft_catchup.py.

SGLang's own code, compiled from the installed sources (eagle_worker_v2.py and eagle_worker_common.py import
CUDA-only packages): EagleDraftWorker._draft_extend_for_decode, prepare_for_draft_extend and
EAGLEWorkerV2._stub_skipped_draft_extend, of whichever release this interpreter has (0.5.17 or 0.5.23). What they
call beyond that is stood in for: ForwardBatch.init_new (the fields the draft forward reads; positions as SGLang's
compute_position makes them for an extend) and the draft model, a toy one-layer "draft" whose output at a position
depends on every KV value before it (read through req_to_token, as attention reads the cache) and on the rows before
it in the same window (causal, as SGLang's extend attention), and which writes one KV value per row into the slot
out_cache_loc names. A gap, a wrong slot or a wrong order in the draft's KV changes what comes out.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

import sglang

from sglang_source import compile_from

SPEC = Path(sglang.__file__).parent / "srt" / "speculative"
DRAFT_VOCAB = 97


class Mode:
    def __init__(self, name: str):
        self.name = name

    def is_idle(self) -> bool:
        return self.name == "IDLE"

    def is_decode_or_idle(self) -> bool:
        return self.name in ("DECODE", "IDLE")

    def is_draft_extend_v2(self) -> bool:
        return self.name == "DRAFT_EXTEND_V2"

    def __repr__(self) -> str:
        return self.name


ForwardMode = SimpleNamespace(DRAFT_EXTEND_V2=Mode("DRAFT_EXTEND_V2"), IDLE=Mode("IDLE"), DECODE=Mode("DECODE"),
                              TARGET_VERIFY=Mode("TARGET_VERIFY"))
CaptureHiddenMode = SimpleNamespace(NULL="NULL", FULL="FULL", LAST="LAST")


class EagleDraftExtendInput:
    """eagle_info.EagleDraftExtendInput's fields that this path reads and writes."""

    def __init__(self, hidden_states=None, num_correct_drafts=None, num_accept_tokens=None, num_tokens_per_req=1,
                 num_tokens_for_logprob_per_req=1, num_front_tokens=0, positions=None):
        self.hidden_states, self.num_correct_drafts, self.num_accept_tokens = hidden_states, num_correct_drafts, num_accept_tokens
        self.num_tokens_per_req, self.num_tokens_for_logprob_per_req = num_tokens_per_req, num_tokens_for_logprob_per_req
        self.num_front_tokens, self.positions = num_front_tokens, positions


class ForwardBatch:
    @staticmethod
    def init_new(batch: Any, runner: Any, *, capture_hidden_mode: Any = None, return_hidden_states_before_norm: bool,
                 **_: Any) -> SimpleNamespace:
        """What the draft forward reads of SGLang's ForwardBatch.init_new for an extend-mode batch."""
        assert batch.forward_mode.is_draft_extend_v2()
        prefix, ext = batch.prefix_lens, batch.extend_lens
        prefix_cpu = ext_cpu = None
        if isinstance(prefix, list):  # SGLang's host path: the lists become the *_cpu mirrors
            assert isinstance(ext, list)
            prefix_cpu, ext_cpu = prefix, ext
            prefix, ext = torch.tensor(prefix), torch.tensor(ext)
        positions = torch.cat([torch.arange(int(p), int(p) + int(e)) for p, e in zip(prefix, ext)])
        return SimpleNamespace(forward_mode=batch.forward_mode, batch_size=len(batch.seq_lens), input_ids=batch.input_ids,
                               req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
                               seq_lens_cpu=batch.seq_lens_cpu, seq_lens_sum=batch.seq_lens_sum,
                               extend_prefix_lens_cpu=prefix_cpu, extend_seq_lens_cpu=ext_cpu,
                               out_cache_loc=batch.out_cache_loc, spec_info=batch.spec_info,
                               extend_prefix_lens=prefix.to(torch.int64), extend_seq_lens=ext.to(torch.int64),
                               positions=positions, capture_hidden_mode=capture_hidden_mode,
                               return_logprob=getattr(batch, "return_logprob", False),
                               mark_forward_metadata_ready=lambda: None)


class TritonAttnBackend:
    """The draft's attention backend, by the name the catch-up checks: its metadata needs no host lengths."""

    def init_forward_metadata(self, fb: Any) -> None:
        return None


class FlashInferAttnBackend:
    """A flashinfer draft's attention backend, by the name the catch-up checks: its draft-extend plan reads host
    lengths (0.5.17's extend path: extend_prefix_lens_cpu for the paged part and the no-prefix test, seq_lens_cpu
    and seq_lens_sum for the indptrs), so each plan checks that the host has them and that they are the batch's
    device lengths (a plan from other lengths than the kernels run with reads the wrong KV)."""

    def __init__(self) -> None:
        self.plans: list = []

    def init_forward_metadata(self, fb: Any) -> None:
        check_host_lengths(fb)
        self.plans.append(list(fb.extend_prefix_lens_cpu))


def check_host_lengths(fb: Any) -> None:
    for name, dev in (("seq_lens_cpu", fb.seq_lens), ("extend_prefix_lens_cpu", fb.extend_prefix_lens),
                      ("extend_seq_lens_cpu", fb.extend_seq_lens)):
        host = getattr(fb, name, None)
        assert host is not None, f"flashinfer plans a draft extend from {name}, and the batch has none"
        assert [int(x) for x in host] == [int(x) for x in dev], f"{name} {list(host)} != the device's {dev.tolist()}"
    assert fb.seq_lens_sum == int(fb.seq_lens.sum()), "seq_lens_sum is not the lengths' sum"


class ToyDraft:
    """A one-layer 'draft model' over a KV pool of float64 scalars, one per slot. Row r of request i (position
    q = prefix_i + r, token x, target hidden h): its context c = the sum of the KV values of positions < prefix_i
    (read through req_to_token) and of the window's rows before it; its KV value 7x + 3q + sum(h) + (c mod 1009);
    its output hidden state h / 2 + c; its logits one-hot at c mod the vocabulary. Integer-valued throughout, so
    the same KV gives the same outputs whatever the order of the sums."""

    def __init__(self, req_to_token: torch.Tensor, num_slots: int, attn_backend: Any = None):
        self.req_to_token = req_to_token
        self.kv = torch.zeros(num_slots, dtype=torch.float64)
        self.calls: list = []
        self.canary_manager = None
        self.spec_algorithm = SimpleNamespace(is_standalone=lambda: False)
        self.model_config = SimpleNamespace(model_is_mrope=False, vocab_size=DRAFT_VOCAB)
        self.attn_backend = attn_backend if attn_backend is not None else TritonAttnBackend()

    def forward(self, fb: Any) -> SimpleNamespace:
        hidden = fb.spec_info.hidden_states.to(torch.float64)
        out_h = torch.zeros_like(hidden)
        logits = torch.zeros((hidden.shape[0], DRAFT_VOCAB), dtype=torch.float64)
        row = 0
        rows_per_req = [int(e) for e in fb.extend_seq_lens]
        self.calls.append(rows_per_req)
        for i, n in enumerate(rows_per_req):
            req, prefix = int(fb.req_pool_indices[i]), int(fb.extend_prefix_lens[i])
            ctx = float(self.kv[self.req_to_token[req, :prefix].long()].sum())
            for r in range(n):
                q = int(fb.positions[row])
                assert q == prefix + r
                kv = 7.0 * int(fb.input_ids[row]) + 3.0 * q + float(hidden[row].sum()) + float(int(ctx) % 1009)
                ctx += kv
                self.kv[int(fb.out_cache_loc[row])] = kv
                out_h[row] = hidden[row] / 2 + ctx
                logits[row, int(ctx) % DRAFT_VOCAB] = 1.0
                row += 1
        return SimpleNamespace(logits_output=SimpleNamespace(next_token_logits=logits, hidden_states=out_h))


def _nothing(*a: Any, **k: Any) -> None:
    return None


def load() -> SimpleNamespace:
    """SGLang's functions, compiled once per process into one namespace with the stand-ins."""
    ns: dict = {"torch": torch, "Optional": Optional, "Any": Any, "contextlib": contextlib,
                "EagleDraftExtendInput": EagleDraftExtendInput, "ForwardBatch": ForwardBatch, "ForwardMode": ForwardMode,
                "CaptureHiddenMode": CaptureHiddenMode, "maybe_detect_oob": _nothing, "maybe_detect_nan": _nothing,
                "maybe_detect_inf": _nothing, "is_npu": lambda: False, "_is_hip": False, "_is_npu": False,
                "get_spec": lambda: SimpleNamespace(speculative_use_rejection_sampling=False),
                "context_tuple": contextlib.ExitStack}
    compile_from(SPEC / "eagle_worker_common.py", ns, ["prepare_for_draft_extend"])
    extend = compile_from(SPEC / "eagle_worker_v2.py", ns, ["_draft_extend_for_decode"], cls="EagleDraftWorker")
    stub = compile_from(SPEC / "eagle_worker_v2.py", ns, ["_stub_skipped_draft_extend"], cls="EAGLEWorkerV2")
    return SimpleNamespace(ns=ns, extend=extend["_draft_extend_for_decode"], stub=stub["_stub_skipped_draft_extend"])


_LOADED: Optional[SimpleNamespace] = None


def sglang() -> SimpleNamespace:
    global _LOADED
    if _LOADED is None:
        _LOADED = load()
    return _LOADED


class Server:
    """An EAGLE worker's draft side at steps 0, its request slots, and SGLang's draft extend on the toy draft.
    Hidden states of width `width` (the target's); draft outputs of the same width. `backend`: the draft's
    attention, "triton" (plans on the GPU; batches carry no host lengths, as SGLang resolves none for a triton
    launch) or "flashinfer" (plans from host lengths, which every batch carries, as SGLang resolves them)."""

    def __init__(self, *, slots: int = 6, max_len: int = 96, width: int = 3, backend: str = "triton"):
        sg = sglang()
        self.width = width
        self.host_lens = backend == "flashinfer"
        self.req_to_token = torch.zeros((slots, max_len), dtype=torch.int32)
        for s in range(1, slots):  # slot 0 is SGLang's padding row; KV slot 0 its padding slot
            self.req_to_token[s] = 1 + (s - 1) * max_len + torch.arange(max_len, dtype=torch.int32)
        attn = {"triton": TritonAttnBackend, "flashinfer": FlashInferAttnBackend}[backend]()
        self.draft = ToyDraft(self.req_to_token, 1 + (slots - 1) * max_len, attn)
        self.dw = SimpleNamespace(device="cpu", speculative_num_steps=0, speculative_num_draft_tokens=1, topk=1,
                                  draft_runner=self.draft, cuda_graph_runner_for_draft_extend=None,
                                  plan_stream=None, plan_stream_ctx=contextlib.nullcontext(),
                                  seed_dsa_topk_from_draft_extend=False,
                                  req_to_token_pool=SimpleNamespace(req_to_token=self.req_to_token))
        self.dw._draft_extend_for_decode = lambda batch, result, **kw: sg.extend(self.dw, batch, result, **kw)
        self.worker = SimpleNamespace(_draft_worker=self.dw, draft_worker=self.dw, topk=1, device="cpu")
        sg.ns["get_draft_recurrent_hidden_state_spec"] = lambda runner: (width, torch.float64)
        self.worker._stub_skipped_draft_extend = lambda batch, out: sg.stub(self.worker, batch, out)
        self.extend = sg.extend

    def batch(self, reqs: list[int], seq_lens: list[int], mode: Mode = ForwardMode.TARGET_VERIFY) -> SimpleNamespace:
        """A decode batch as SGLang's steps-0 verify leaves it: seq_lens = the committed lengths, out_cache_loc
        = one KV slot per request, at that position."""
        idx = torch.tensor(reqs, dtype=torch.int64)
        lens = torch.tensor(seq_lens, dtype=torch.int64)
        host = self.host_lens
        return SimpleNamespace(req_pool_indices=idx, req_pool_indices_cpu=idx.clone(), seq_lens=lens,
                               seq_lens_cpu=lens.clone() if host else None,
                               seq_lens_sum=int(lens.sum()) if host else None,
                               out_cache_loc=self.req_to_token[idx, lens].to(torch.int64), forward_mode=mode,
                               input_ids=None, spec_info=None, return_logprob=False, reqs=[None] * len(reqs),
                               model_config=SimpleNamespace(vocab_size=DRAFT_VOCAB), multimodal_inputs=[None] * len(reqs))

    def step_result(self, tokens: list[int], hidden: torch.Tensor) -> SimpleNamespace:
        """What run_eagle_verify returns at steps 0: one accepted token per request, the target's hidden state."""
        n = len(tokens)
        return SimpleNamespace(logits_output=SimpleNamespace(hidden_states=hidden),
                               accept_lens=torch.ones(n, dtype=torch.int32),
                               next_token_ids=torch.tensor(tokens, dtype=torch.int32),
                               next_draft_input=SimpleNamespace(), new_seq_lens=None,
                               prepared_draft_extend_inputs=None)
