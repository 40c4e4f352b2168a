"""The decode state: "off" inside an EAGLE-3 server as a true decode forward, not a 1-token verify.

SGLang's steps-0 state verifies one token per request (TARGET_VERIFY: the extend attention kernel
with a custom mask, the verify graph). Here the target's forward of that step is a DECODE forward
through decode CUDA graphs the plugin captures at start-up, with the decode attention kernels and
the hidden states EAGLE-3's draft needs; everything around it stays SGLang's own:

    EAGLEWorkerV2.forward_batch_generation      (SGLang, unchanged)
      _build_trivial_verify_input               (SGLang: the bonus tokens as a 1-node tree)
      verify  ── AROUND (here) ───────────────  steps 0 and the decode state is on: the steps-0 verify
        run_eagle_verify                           graph is hidden for the call, so SGLang plans no verify
          eagle_prepare_for_verify                 graph; the batch is remembered
          TpModelWorker.forward_batch_generation ── AROUND (here): a DECODE ForwardBatch built fresh from
                                                   the ScheduleBatch (spec_info None, seq_lens + 1 as new
                                                   tensors), run with the plugin's backend and graphs
          eagle_sample, bonus tokens, result    (SGLang: one token per request, width 1)
      on_publish, _draft_extend_for_decode      (SGLang: the draft's KV and hidden state stay in sync)

    AFTER  EAGLEWorkerV2.init_cuda_graphs       build the runner (every TP rank), agree on the TP group

Any failure while building, or in a step, turns the decode state off for the rest of the process
(logged once, with the reason) and the step runs SGLang's trivial verify: never a crash, never a
wrong token. Imported only inside SGLang scheduler processes (plugin/sglang_hooks.py registers it).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from .. import runtime as _rt
from ..guard import AFTER, AROUND, Patch, PatchObject

NAME = "plain_decode"
LOST = "no decode state: speculation off runs SGLang's 1-token verify"
log = logging.getLogger("specctl.plugin")

DECODE, VERIFY = "decode", "verify"  # which "off" ran: telemetry's off_path


class PlainDecode(PatchObject):
    """The decode state of one EAGLE worker: its graph runner (None = eager only), its attention
    backend, and whether it is on. The per-step hooks read `on`, `pending` and `logprobs` only."""

    def __init__(self, *, runner: Any, backend: Any, forward_batch: Any, decode_mode: Any, full_hidden: Any,
                 build_s: float = 0.0, mem_gb: float = 0.0, logprobs: bool = False, patch: Optional[Patch] = None):
        self.patch = patch if patch is not None else Patch(NAME, lost=LOST, collective=True)
        self.runner = runner
        # SGLang's ForwardBatch, ForwardMode.DECODE and CaptureHiddenMode.FULL (given, so that the CPU
        # tests, where forward_batch_info does not import, can run the step logic on stand-ins)
        self.forward_batch, self.decode_mode, self.full_hidden = forward_batch, decode_mode, full_hidden
        self.backend = backend
        self.max_bs = int(getattr(runner, "max_bs", 0)) if runner is not None else 0
        self.build_s = build_s
        self.mem_gb = mem_gb
        # plain_logprobs: steps with log-probability requests run the decode forward too
        # (SGLang's verify computes them from its logits, as for the 1-token verify); off: they run the
        # trivial verify
        self.logprobs = logprobs
        self.pending: Any = None  # the ScheduleBatch of the verify call in flight
        # the rows and committed host lengths the last decode forward planned with (patch host_lens)
        self.planned: Optional[tuple[Any, Any]] = None
        self.ran = False  # the forward of the verify call in flight was the decode forward
        self.last_graph = False
        self.num_decode_steps = 0
        self.num_graph_steps = 0
        self.num_verify_steps = 0  # steps-0 steps that ran the trivial verify (a per-step reason)

    def status(self) -> dict[str, Any]:
        return {"on": self.on, "off_reason": self.off_reason, "graph_max_bs": self.max_bs,
                "build_s": round(self.build_s, 2), "mem_gb": round(self.mem_gb, 3),
                "decode_steps": self.num_decode_steps, "graph_steps": self.num_graph_steps,
                "verify_steps": self.num_verify_steps}


# ---------------------------------------------------------------------------- start-up


def unsupported_reason(worker: Any) -> Optional[str]:
    """Why this EAGLE worker cannot run the decode state, or None. Everything here is derived from
    the launch configuration, so every TP rank reaches the same answer before any capture starts
    (a rank failing half-way through a collective capture would hang the others)."""
    ctl = getattr(worker, "adaptive_controller", None)
    if ctl is None:
        return "no adaptive controller (launch with --speculative-adaptive)"
    states = getattr(ctl, "_states", None)
    if not isinstance(states, dict) or 0 not in states:
        return "no steps-0 runtime state (the adaptive config lists no 0)"
    algo = getattr(worker, "speculative_algorithm", None)
    if algo is None or getattr(algo, "name", None) not in ("EAGLE", "EAGLE3"):
        return f"speculative algorithm {getattr(algo, 'name', algo)} (EAGLE / EAGLE3 only)"
    if getattr(worker, "topk", 1) != 1:
        return f"launched with topk {worker.topk} (the steps-0 state is built for topk 1)"
    sa = worker.server_args
    flags = {"enable_dp_attention": "DP attention", "enable_two_batch_overlap": "two-batch overlap",
             "enable_pdmux": "PD multiplexing", "enable_lora": "LoRA", "enable_torch_compile": "torch.compile",
             "enable_multi_layer_eagle": "multi-layer EAGLE", "enable_return_hidden_states": "returned hidden states"}
    for name, what in flags.items():
        if getattr(sa, name, False):
            return f"{what} is on"
    if int(getattr(sa, "pp_size", 1) or 1) != 1:
        return "pipeline parallelism"
    mr = worker._target_worker.model_runner
    if getattr(mr, "sliding_window_size", None) is not None:
        return "a sliding-window model"
    alloc = getattr(mr, "token_to_kv_pool_allocator", None)
    if getattr(alloc, "translate_kv_loc", None) is not None or getattr(alloc, "translate_kv_loc_dense", None) is not None:
        return "a unified / virtual KV pool"
    kv = alloc.get_kvcache() if alloc is not None and hasattr(alloc, "get_kvcache") else None
    if getattr(kv, "clear_unaccepted_c128_draft_states", None) is not None:
        return "a KV cache with draft-state bookkeeping"
    mc = getattr(mr, "model_config", None)
    if getattr(mc, "is_hybrid", False) or getattr(mc, "model_is_mrope", False) or getattr(mc, "is_encoder_decoder", False):
        return "a hybrid, mrope or encoder-decoder model"
    if "Hybrid" in type(getattr(mr, "req_to_token_pool", None)).__name__:
        return "a hybrid (mamba / linear attention) request pool"
    if getattr(mr, "hisparse_coordinator", None) is not None:
        return "hierarchical sparse attention"
    if getattr(mr, "watermark_state", None) is not None:
        return "watermarking"
    return None


TRITON, FLASHINFER, FA3 = "TritonAttnBackend", "FlashInferAttnBackend", "FlashAttentionBackend"
SWITCH = {FLASHINFER: "plain_flashinfer", FA3: "plain_fa3"}  # the SPECCTL_PATCHES switch of each optional backend


def backends(flashinfer: bool = False, fa3: bool = False) -> tuple[str, ...]:
    """The attention backends the decode state is built on: triton, flashinfer unless plain_flashinfer=off, fa3
    with plain_fa3=on (its decode path without spec_info is SGLang's no-spec one)."""
    return (TRITON,) + ((FLASHINFER,) if flashinfer else ()) + ((FA3,) if fa3 else ())


def refused(kind: str, backends: tuple[str, ...]) -> Optional[str]:
    """Why the decode state is not built on attention backend class `kind`, or None."""
    if kind in backends:
        return None
    hint = f"; SPECCTL_PATCHES={SWITCH[kind]}=on builds it there" if kind in SWITCH else ""
    return f"attention backend {kind} (the decode state supports {', '.join(backends)}{hint})"


def build(worker: Any, *, agree: Callable[[bool], bool], backends: tuple[str, ...] = (TRITON,),
          patch: Optional[Patch] = None, logprobs: bool = False) -> Optional[PlainDecode]:
    """AFTER init_cuda_graphs: capture the decode state's graphs (the decode batch sizes of the launch) with a
    fresh attention backend of the launch's kind, published only if every TP rank built it (`agree`, gloo MIN:
    every rank votes, whatever happened). None when it cannot run here; the patch is then off, said once."""
    patch = patch if patch is not None else Patch(NAME, lost=LOST, collective=True)

    def make() -> Any:
        why = unsupported_reason(worker)
        if why is not None:
            return why
        return _capture(worker, backends, patch=patch, logprobs=logprobs)

    plain = patch.build(make, agree=agree)
    if plain is None:
        return None
    graphs = (f"DECODE graphs for batch sizes up to {plain.max_bs} (eager above)" if plain.runner is not None
              else "no CUDA graphs in this launch: eager DECODE forwards")
    log.info("specctl: decode state built: %s, %.2f GB, %.1f s; "
             "speculation off runs a decode forward (SPECCTL_PATCHES=plain_decode=off: the trivial verify)",
             graphs, plain.mem_gb, plain.build_s)
    return plain


def _capture(worker: Any, backends: tuple[str, ...], **kw: Any) -> PlainDecode:
    from sglang.srt.utils import get_available_gpu_memory

    mr = worker._target_worker.model_runner
    steps0 = worker.adaptive_controller._states[0]
    tic = time.perf_counter()
    before = get_available_gpu_memory(worker.device, worker.gpu_id)
    # the steps-0 state's spec settings (1 draft token) while the backend and graphs are made, as
    # SGLang does for each runtime state; the launch's decode batch sizes (cuda_graph_bs=None)
    with worker._override_worker_state(0, 1, cuda_graph_bs=None):
        keep = mr.init_new_workspace
        try:
            # never share a backend: init_cuda_graph_state reallocates it under the live graphs
            backend = mr._get_attention_backend(init_new_workspace=True)
        finally:
            mr.init_new_workspace = keep
        why = refused(type(backend).__name__, backends)
        if why is not None:
            raise RuntimeError(why)
        runner = None
        if getattr(steps0, "target_graph_runner", None) is not None:  # CUDA graphs on (SGLang built one)
            runner = runner_class()(mr, attn_backend=backend, speculative_num_steps=0,
                                    speculative_num_draft_tokens=1)
    after = get_available_gpu_memory(worker.device, worker.gpu_id)
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

    return PlainDecode(runner=runner, backend=backend, forward_batch=ForwardBatch, decode_mode=ForwardMode.DECODE,
                       full_hidden=CaptureHiddenMode.FULL, build_s=time.perf_counter() - tic, mem_gb=before - after,
                       **kw)


_RUNNER_CLASS: Optional[type] = None


def runner_class() -> type:
    """DecodeCudaGraphRunner capturing DECODE (not TARGET_VERIFY, which a speculative model runner
    forces) with the EAGLE-3 aux hidden states (CaptureHiddenMode.FULL) and no spec_info."""
    global _RUNNER_CLASS
    if _RUNNER_CLASS is None:
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

        class PlainDecodeCudaGraphRunner(DecodeCudaGraphRunner):
            def capture(self) -> None:  # __init__ calls it last, after the mode fields are set
                if getattr(self, "ragged_verify_mode", False):
                    raise RuntimeError("compact ragged verify graphs are on (SGLANG_RAGGED_VERIFY_MODE)")
                self.capture_forward_mode = ForwardMode.DECODE
                self.capture_hidden_mode = CaptureHiddenMode.FULL
                super().capture()

            def get_spec_info(self, num_tokens: int) -> None:
                return None  # a decode graph: no EagleVerifyInput rides the capture

        _RUNNER_CLASS = PlainDecodeCudaGraphRunner
    return _RUNNER_CLASS


# ---------------------------------------------------------------------------- per step


def step_reason(worker: Any, batch: Any, logprobs: bool = False) -> Optional[str]:
    """Why this steps-0 step runs the trivial verify, or None (the same on every TP rank: it reads
    the batch's request flags and the step count only). `logprobs`: log-probability requests run the
    decode forward too."""
    if worker.speculative_num_steps != 0:
        return "speculating"
    if batch.forward_mode.is_idle():
        return "idle batch"
    if batch.return_logprob and not logprobs:
        return "log-probabilities requested"
    if getattr(batch, "return_hidden_states", False):
        return "hidden states requested"
    return None


def around_verify(plain: PlainDecode, orig: Callable[..., Any], worker: Any, batch: Any,
                  args: tuple, kwargs: dict) -> Any:
    """AROUND EAGLEWorkerV2.verify at steps 0 with the decode state on (the caller checked)."""
    if step_reason(worker, batch, plain.logprobs) is not None:
        plain.num_verify_steps += 1
        return orig(worker, batch, *args, **kwargs)
    mr = worker._target_worker.model_runner
    plain.pending, plain.ran, plain.planned = batch, False, None
    try:
        with _attrs(mr, decode_cuda_graph_runner=None):  # SGLang plans no verify graph for this step
            result = orig(worker, batch, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 - only where SGLang's own code after our forward raised
        if not (batch.return_logprob and plain.ran):
            raise
        # SGLang's log-probabilities of the decode forward's logits failed: this step runs again as
        # the trivial verify (its preparation re-derives the same cache slots and inputs from the
        # committed batch; its forward rewrites the KV the decode forward wrote), and the decode
        # state is off from here on
        plain.patch.turn_off(f"log-probabilities of a decode-state step failed in SGLang's verify: {type(e).__name__}: {e}")
        log.exception("specctl: decode state step with log-probabilities failed")
        plain.pending = None
        return orig(worker, batch, *args, **kwargs)
    finally:
        plain.pending = None
    if plain.ran:
        result.can_run_cuda_graph = plain.last_graph
        result._specctl_off_path = DECODE
    elif plain.on:  # the verify ran eagerly: the target-forward hook never saw this step
        plain.patch.turn_off("the target forward of a steps-0 verify did not reach the decode-state hook")
    return result


def around_target_forward(plain: PlainDecode, orig: Callable[..., Any], target_worker: Any,
                          args: tuple, kwargs: dict) -> Any:
    """AROUND TpModelWorker.forward_batch_generation(batch=None, forward_batch=<verify>, is_verify=True)
    inside a decode-state verify call: the target runs a DECODE forward of the same step instead.
    If that fails, the verify forward batch runs (eagerly: no verify graph was planned for it) and
    the decode state is off from the next step on."""
    batch = plain.pending
    plain.pending = None  # one forward per verify call
    mr = target_worker.model_runner
    try:
        fb = decode_forward_batch(plain, batch, mr)
        can_graph = bool(plain.runner is not None and plain.runner.can_run_graph(fb))
        with _attrs(mr, attn_backend=plain.backend, decode_cuda_graph_runner=plain.runner):
            out = orig(target_worker, batch=None, forward_batch=fb, is_verify=True)
    except Exception as e:  # noqa: BLE001 - the step still runs, as the trivial verify
        plain.patch.turn_off(f"a decode forward failed: {type(e).__name__}: {e}")
        log.exception("specctl: decode state step failed")
        return orig(target_worker, *args, **kwargs)
    mr.war_fastpath_read_done_event = None  # a DECODE replay publishes one; only the draft's is read
    plain.ran, plain.last_graph = True, can_graph
    plain.planned = (getattr(batch, "req_pool_indices_cpu", None), batch.seq_lens_cpu)
    plain.num_decode_steps += 1
    plain.num_graph_steps += int(can_graph)
    return out


def decode_forward_batch(plain: PlainDecode, batch: Any, mr: Any) -> Any:
    """A DECODE ForwardBatch of this step from the ScheduleBatch as eagle_prepare_for_verify left it
    (input_ids = the bonus tokens, out_cache_loc = one slot per request, seq_lens = the committed
    length). Decode attention reads the new token's KV too, so it sees seq_lens + 1, as new tensors:
    the committed ones belong to the FutureMap and the overlap snapshot. Every field it changes is
    restored before it returns, so nothing of this forward reaches sampling, the draft extend or the
    next step."""
    bs = len(batch.seq_lens)
    keep = (batch.forward_mode, batch.spec_info, batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum)
    try:
        batch.forward_mode = plain.decode_mode
        batch.spec_info = None  # a verify/draft input in a decode batch is how graphs get wrong shapes
        batch.seq_lens = keep[2] + 1
        batch.seq_lens_cpu = None if keep[3] is None else keep[3] + 1
        batch.seq_lens_sum = None if keep[4] is None else keep[4] + bs
        return plain.forward_batch.init_new(batch, mr, capture_hidden_mode=plain.full_hidden,
                                            return_hidden_states_before_norm=False)
    finally:
        batch.forward_mode, batch.spec_info, batch.seq_lens, batch.seq_lens_cpu, batch.seq_lens_sum = keep


@contextmanager
def _attrs(obj: Any, **values: Any) -> Iterator[None]:
    """Set attributes for the duration of a call (SGLang's own state switch sets these two)."""
    old = {k: getattr(obj, k) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


# ---------------------------------------------------------------------------- hooks


def patch(rt: Any) -> Optional[Patch]:
    """The decode state's hooks, or None where plain_decode is off."""
    if not rt.settings.plain_decode:
        return None
    t = rt.targets
    p = Patch(NAME, lost=LOST, collective=True)
    p.hook(AFTER, t.init_graphs, after_init_graphs)
    p.hook(AROUND, t.verify, around_verify_hook)
    p.hook(AROUND, t.target_forward, around_target_forward_hook)
    return p


def after_init_graphs(ret: Any, worker: Any, *args: Any, **kwargs: Any) -> None:
    rt = _rt.current()
    if rt is not None:
        rt.build_plain(worker)
    return None


def around_verify_hook(orig: Callable[..., Any], worker: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    plain = _rt.live("plain")
    if plain is None or worker.speculative_num_steps != 0:
        return orig(worker, batch, *args, **kwargs)
    plain.planned = None
    out = around_verify(plain, orig, worker, batch, args, kwargs)
    hl = _rt.live("host_lens")
    if hl is not None and plain.planned is not None and plain.ran and plain.on:
        try:
            hl.on_decode_step(*plain.planned)
        except Exception as e:  # noqa: BLE001 - the next step pulls its lengths as SGLang does
            hl.patch.turn_off(f"{type(e).__name__}: {e}")
    return out


def around_target_forward_hook(orig: Callable[..., Any], target_worker: Any, *args: Any, **kwargs: Any) -> Any:
    plain = _rt.live("plain")
    if plain is None or plain.pending is None or not kwargs.get("is_verify"):
        return orig(target_worker, *args, **kwargs)
    return around_target_forward(plain, orig, target_worker, args, kwargs)
