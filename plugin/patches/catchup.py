"""The draft kept in sync across plain decode by one extend per K steps instead of one per step (patch catchup;
off by default: measured faster per step, but its server's prefill iterations cost more, cause not found).

At steps 0 SGLang extends the draft by each step's one token, so that its KV and hidden state are in sync when
speculation resumes. Here a steps-0 step keeps the target's hidden state and the new token of each request in a ring of
K per request slot, and the draft is extended over what is pending in one forward: SGLang's own
draft-extend step (_draft_extend_for_decode) with a window of K tokens per request, the pending ones
first (the rest go to the padding slot and are never read):

    AROUND EagleDraftWorker._draft_extend_for_decode   steps 0: into the ring, and SGLang's zero stubs
                                                      for the step's draft outputs; every K-th steps-0
                                                      step in a row the catch-up, whose outputs they are
    BEFORE EagleDraftWorker.draft                      after any steps-0 step: the catch-up; its outputs
                                                      replace the stubs of the requests it extended
    AFTER  EagleDraftWorker._draft_extend_for_prefill  a prefilled request has nothing pending

Where a runtime state's draft-extend CUDA graph is K tokens a request wide (catchup=4 on a launch with an s3
state), the catch-up replays that graph (static buffers); otherwise it extends eagerly, allocating its window's
logits each time (K = 16 with catchup=on: 16 rows a request; whether those allocations are what makes the
prefill iterations dearer is what the catchup=4 A/B on the GPU is for).

When to catch up is decided by counting steps alone. What is pending per request is counted on the host, by
request-pool row (the scheduler's `req_pool_indices_cpu`), in the same hooks and the same order as the steps that
make it pending, so it is exact without a sync; each catch-up hands its counts to the GPU (a non-blocking copy of
one integer a request) for the window's rows. A triton draft plans its window on the GPU (SGLang's gpu_only
draft-extend path: no host lengths); a flashinfer draft plans a draft extend from host lengths (0.5.17: its
draft-extend graphs' fast_prefill_plan asserts seq_lens_cpu, its eager plan reads extend_prefix_lens_cpu), so its
window also gets them: where it starts, the step's host lengths (`seq_lens_cpu`, which SGLang resolves for every
flashinfer step) less what is pending. Other attention backends are refused (unsupported_reason). TP 1 only for
now: a failure on one rank alone would leave the ranks extending the draft on different steps.
Any failure turns it off for the rest of the process (logged once): the steps-0 steps extend the draft one by one
again, and the requests pending at that moment keep a draft with gaps until they finish (fewer accepted tokens, never a wrong one: the target's
verify decides every token). Imported only inside SGLang scheduler processes.
"""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace
from typing import Any, Callable, Optional

import numpy as np

from .. import runtime as _rt
from ..guard import AFTER, AROUND, BEFORE, Patch, PatchObject
from .plain_decode import FLASHINFER, TRITON, _attrs

NAME = "catchup"
LOST = "no draft catch-up: steps 0 extends the draft every step"
log = logging.getLogger("specctl.plugin")


class DraftCatchup(PatchObject):
    """The rings, what is pending, and the step count of one EAGLE worker's draft. `torch` is given so
    that the CPU tests can run it on CPU tensors. `host_plan`: the draft's attention plans a draft extend from host
    lengths (flashinfer), so each window is given them."""

    def __init__(self, *, k: int, worker: Any, torch_mod: Any, patch: Optional[Patch] = None, graph: Any = None,
                 host_plan: bool = False):
        self.patch = patch if patch is not None else Patch(NAME, lost=LOST)
        if k < 2:
            raise ValueError(f"catchup needs a ring of at least 2 steps, not {k}")
        self.k = k
        # a runtime state's draft-extend CUDA graph captured k tokens a request wide (graph_of_width), or None: the
        # catch-up replays it (static buffers: no allocation, one launch) where SGLang's can_run_graph lets it (the
        # batch within its sizes), else extends eagerly (a window of k rows a request, its logits allocated anew)
        self.graph = graph
        self.torch = torch_mod
        self.host_plan = host_plan
        self.worker = worker  # EAGLEWorkerV2: its own zero stubs for skipped draft outputs
        dw = worker._draft_worker
        self.device = dw.device
        self.req_to_token = dw.req_to_token_pool.req_to_token  # [pool size, max context] KV slot per position
        pool = int(self.req_to_token.shape[0])
        self.pending = np.zeros(pool, dtype=np.int64)  # steps-0 tokens not yet in the draft, per request-pool row
        self.tokens = torch_mod.zeros((pool, k), dtype=torch_mod.int64, device=self.device)
        self.hidden: Any = None  # [pool, k, target hidden width], at the first steps-0 step (its width)
        self.window = torch_mod.arange(k, dtype=torch_mod.int64, device=self.device)
        self.since = 0  # steps-0 steps since the last catch-up: the same count on every TP rank
        self.extend_fn: Optional[Callable[..., Any]] = None  # SGLang's _draft_extend_for_decode, unhooked
        self.num_recorded = 0
        self.num_catchups = 0
        self.num_pulls = 0  # catch-ups of a host-planning draft whose batch had no host lengths: read from the GPU

    # ------------------------------------------------------------------ per step

    def around_extend(self, orig: Callable[..., Any], dw: Any, batch: Any, result: Any,
                      args: tuple, kwargs: dict) -> Any:
        """AROUND EagleDraftWorker._draft_extend_for_decode (the caller checked `on`)."""
        self.extend_fn = orig
        if dw.speculative_num_steps != 0 or batch.forward_mode.is_idle():
            return orig(dw, batch, result, *args, **kwargs)
        try:
            self.record(batch, result)
            self.since += 1
            nd = result.next_draft_input
            if self.since >= self.k:
                out, _ = self.catch_up(dw, batch, end_offset=1)
                nd.topk_p, nd.topk_index, nd.hidden_states = out.topk_p, out.topk_index, out.hidden_states
            else:
                self.worker._stub_skipped_draft_extend(batch, result)
        except Exception as e:  # noqa: BLE001 - this step extends as SGLang does; the catch-up is off
            self.patch.turn_off(f"a steps-0 step failed: {type(e).__name__}: {e}")
            log.exception("specctl: draft catch-up step failed")
            return orig(dw, batch, result, *args, **kwargs)
        return None

    def before_draft(self, dw: Any, batch: Any) -> None:
        """BEFORE EagleDraftWorker.draft: after steps-0 steps, extend what is pending before the draft
        reads its inputs (the caller checked `on`)."""
        if self.since == 0 or batch.forward_mode.is_idle():
            return
        try:
            out, extended = self.catch_up(dw, batch, end_offset=0)
            info = batch.spec_info
            t = self.torch
            m = extended[:, None]
            for name in ("topk_p", "topk_index", "hidden_states"):
                new, old = getattr(out, name), getattr(info, name)
                if new.shape != old.shape or new.dtype != old.dtype:
                    raise RuntimeError(f"draft input {name}: catch-up gave {tuple(new.shape)} {new.dtype}, the "
                                       f"batch holds {tuple(old.shape)} {old.dtype}")
                setattr(info, name, t.where(m, new, old))
        except Exception as e:  # noqa: BLE001 - the draft runs on what it has (accepts less, decides nothing)
            self.since = 0
            self.patch.turn_off(f"the catch-up before a draft failed: {type(e).__name__}: {e}")
            log.exception("specctl: draft catch-up before a draft failed")

    def after_prefill(self, batch: Any) -> None:
        """AFTER EagleDraftWorker._draft_extend_for_prefill: the prefill extended the draft over the
        prompt; a request slot taken over by a new request (or a retracted one prefilled again) has
        nothing pending."""
        if batch.forward_mode.is_idle():
            return
        try:
            self.pending[rows_of(batch)] = 0
        except Exception as e:  # noqa: BLE001
            self.patch.turn_off(f"resetting a prefilled request failed: {type(e).__name__}: {e}")

    # ------------------------------------------------------------------ the ring and the window

    def record(self, batch: Any, result: Any) -> None:
        """A steps-0 step of `batch`: each request's new token and the target's hidden state at the
        position it verified (the committed length: SGLang's draft extend would write the draft's KV
        there, input (new token, hidden state))."""
        t = self.torch
        hidden = result.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("the steps-0 step returned no target hidden states")
        if self.hidden is None:
            self.hidden = t.zeros((self.tokens.shape[0], self.k, hidden.shape[-1]), dtype=hidden.dtype,
                                  device=self.device)
            log.info("specctl: draft catch-up ring: %d request slots x %d steps x %d hidden (%.1f MB)",
                     self.hidden.shape[0], self.k, hidden.shape[-1],
                     self.hidden.numel() * self.hidden.element_size() / 1e6)
        rows = rows_of(batch)
        idx = batch.req_pool_indices.to(t.int64)
        ring = t.remainder(batch.seq_lens.to(t.int64), self.k)
        self.hidden[idx, ring] = hidden.to(self.hidden.dtype)
        self.tokens[idx, ring] = result.next_token_ids.to(t.int64)
        self.pending[rows] += 1  # a batch holds each row once
        self.num_recorded += 1

    def window_of(self, batch: Any, end_offset: int) -> SimpleNamespace:
        """Each request's pending positions [end - p, end) (end = committed length + end_offset) as a window
        of k rows: rows < p carry the ring's token and hidden state and the position's KV slot; the rest
        the padding slot 0 (SGLang's write target for padded rows), token 0, and are never read (attention
        is causal within the window and the draft's outputs are taken at row p - 1)."""
        t = self.torch
        idx = batch.req_pool_indices.to(t.int64)
        end = batch.seq_lens.to(t.int64) + end_offset
        host_rows = rows_of(batch)
        p_host = self.pending[host_rows]
        p = t.from_numpy(p_host).to(self.device, non_blocking=True)
        start = end - p
        pos = start[:, None] + self.window[None, :]
        valid = self.window[None, :] < p[:, None]
        ring = t.remainder(pos, self.k)
        rows = idx[:, None].expand_as(pos)
        zero = t.zeros_like(pos)
        r2t = self.req_to_token
        loc = r2t[rows, pos.clamp(0, r2t.shape[1] - 1)].to(t.int64)
        return SimpleNamespace(idx=idx, host_rows=host_rows, start=start, pending=p, pending_host=p_host, end=end,
                               tokens=t.where(valid, self.tokens[rows, ring], zero).reshape(-1),
                               hidden=self.hidden[rows, ring].reshape(-1, self.hidden.shape[-1]),
                               loc=t.where(valid, loc, zero).reshape(-1))

    def catch_up(self, dw: Any, batch: Any, end_offset: int) -> tuple[Any, Any]:
        """Extend the draft over every request's pending positions in one forward of SGLang's own
        draft-extend step, on a shallow copy of the batch (the real one goes on to the draft, or is
        done): (the draft outputs at each request's last pending position, which requests had any)."""
        if self.extend_fn is None:
            raise RuntimeError("no steps-0 draft extend has been seen: nothing to catch up with")
        if self.hidden is None:
            raise RuntimeError("nothing recorded")
        t = self.torch
        w = self.window_of(batch, end_offset)
        sub = copy.copy(batch)
        sub.seq_lens, sub.seq_lens_cpu, sub.seq_lens_sum, sub.out_cache_loc = w.start, None, None, w.loc
        if self.host_plan:  # SGLang's host path: prefix lengths and the window's lengths as lists, from these
            sub.seq_lens_cpu = self.host_start(batch, end_offset, w.pending_host)
            sub.seq_lens_sum = int(sub.seq_lens_cpu.sum())
        result = SimpleNamespace(logits_output=SimpleNamespace(hidden_states=w.hidden),
                                 accept_lens=w.pending.clamp(min=1).to(t.int32), next_token_ids=w.tokens,
                                 next_draft_input=SimpleNamespace(draft_probs=None, dsa_topk_indices=None),
                                 new_seq_lens=w.end, prepared_draft_extend_inputs=None)
        with _attrs(dw, speculative_num_draft_tokens=self.k, cuda_graph_runner_for_draft_extend=self.graph):
            self.extend_fn(dw, sub, result)
        self.pending[w.host_rows] = 0
        self.since = 0
        self.num_catchups += 1
        return result.next_draft_input, w.pending > 0

    def host_start(self, batch: Any, end_offset: int, pending: np.ndarray) -> Any:
        """Where each request's window starts, on the host: its committed length (the batch's host lengths, as
        SGLang resolved them for the step; read from the GPU where the batch has none, counted) plus `end_offset`,
        less what is pending."""
        t = self.torch
        lens = getattr(batch, "seq_lens_cpu", None)
        if lens is None:
            lens = batch.seq_lens.cpu()
            self.num_pulls += 1
            if self.num_pulls == 1:
                log.info("specctl: draft catch-up: a batch without host sequence lengths; its window's lengths "
                         "were read from the GPU (counted in num_pulls)")
        lens = t.as_tensor(lens, dtype=t.int64)
        return lens + end_offset - t.from_numpy(pending)


# ---------------------------------------------------------------------------- start-up


def unsupported_reason(worker: Any, *, trees: bool, plain_reason: Optional[str],
                       skip_zero_extend: bool = False) -> Optional[str]:
    """Why this EAGLE worker cannot defer its steps-0 draft extends, or None; from the launch alone, so
    every TP rank answers alike. `plain_reason`: the decode state's answer for the same launch (the
    same kinds of models and features), `trees`: tree states configured (their draft is topk-wide),
    `skip_zero_extend`: SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND is set (read by the caller)."""
    if plain_reason is not None:
        return plain_reason
    if trees:
        return "tree states are configured (their draft inputs are topk wide)"
    if skip_zero_extend:
        return "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND is set: steps 0 extends nothing to catch up with"
    try:
        from sglang.srt.runtime_context import get_spec

        if get_spec().speculative_use_rejection_sampling:
            return "rejection sampling (its draft proposals are not stubbed by SGLang's skip path)"
    except Exception:  # noqa: BLE001 - a release without the switch has no rejection sampling
        pass
    sa = getattr(worker, "server_args", None)
    if int(getattr(sa, "tp_size", 1) or 1) > 1:
        # the catch-up's draft forward is collective: a rank that turned it off alone (a failure on that rank)
        # would extend the draft on other steps than the rest, and their collectives would never meet
        return "tensor parallelism (a failure on one rank alone would desynchronise the draft's collectives)"
    if getattr(sa, "enable_mixed_chunk", False):
        return "mixed chunked prefill (a decode request's pending tokens would be skipped by a mixed extend)"
    dw = getattr(worker, "_draft_worker", None)
    for name in ("_draft_extend_for_decode", "_draft_extend_for_prefill", "draft", "req_to_token_pool"):
        if not hasattr(dw, name):
            return f"the draft worker has no {name}"
    if not hasattr(worker, "_stub_skipped_draft_extend"):
        return "this SGLang has no _stub_skipped_draft_extend"
    backend = draft_backend(worker)
    if backend not in (TRITON, FLASHINFER):
        # a triton draft plans the window on the GPU, a flashinfer one from the host lengths the catch-up gives it;
        # others are unchecked (fa3 reads the window's width from the extend_seq_lens_cpu SGLang's gpu_only path
        # supplies, so it would plan as triton does, but neither its decode state nor this has run on a GPU)
        return f"the draft's attention backend is {backend} (the catch-up extends a triton or flashinfer draft)"
    return None


def draft_backend(worker: Any) -> str:
    """The class name of the attention backend SGLang's steps-0 draft extend plans with (prepare_for_draft_extend:
    the draft model runner's)."""
    dw = getattr(worker, "_draft_worker", None)
    return type(getattr(getattr(dw, "draft_runner", None), "attn_backend", None)).__name__


def rows_of(batch: Any) -> np.ndarray:
    """The batch's request-pool rows as the scheduler holds them on the host (ScheduleBatch.req_pool_indices_cpu,
    in the order of req_pool_indices)."""
    rows = getattr(batch, "req_pool_indices_cpu", None)
    if rows is None:
        raise RuntimeError("the batch has no host request-pool rows (req_pool_indices_cpu)")
    return np.asarray(rows.numpy() if hasattr(rows, "numpy") else rows, dtype=np.int64)


def graph_of_width(worker: Any, k: int) -> Any:
    """The draft-extend CUDA graph runner of a built chain state that is k tokens a request wide
    (SpecRuntimeState.cuda_graph_runner_for_draft_extend, captured_req_width k: the launch state at the launch's
    draft tokens, every other chain state at steps + 1 with draft_graphs on 0.5.17 and by itself on 0.5.23), or
    None. Read once at start-up from SGLang's adaptive controller, the same on every rank."""
    states = getattr(getattr(worker, "adaptive_controller", None), "_states", None)
    if not isinstance(states, dict):
        return None
    for state in states.values():  # built in the same order on every rank
        runner = getattr(state, "cuda_graph_runner_for_draft_extend", None)
        if (runner is not None and getattr(runner, "captured_req_width", None) == k
                and getattr(state, "speculative_num_draft_tokens", None) == k):
            return runner
    return None


def build(worker: Any, *, k: int, trees: bool, plain_reason: Optional[str],
          skip_zero_extend: bool = False, patch: Optional[Patch] = None) -> Optional[DraftCatchup]:
    """AFTER init_cuda_graphs, every TP rank: the catch-up, or None with the patch off and the reason logged once.
    Nothing here is collective; the ring of hidden states is allocated at the first steps-0 step."""
    patch = patch if patch is not None else Patch(NAME, lost=LOST)

    def make() -> Any:
        why = unsupported_reason(worker, trees=trees, plain_reason=plain_reason, skip_zero_extend=skip_zero_extend)
        if why is not None:
            return why
        import torch

        return DraftCatchup(k=k, worker=worker, torch_mod=torch, patch=patch, graph=graph_of_width(worker, k),
                            host_plan=draft_backend(worker) == FLASHINFER)

    cu = patch.build(make)
    if cu is not None:
        log.info("specctl: draft catch-up on: steps 0 extends the draft once per %d steps (and before the first "
                 "draft after plain decode) instead of every step, %s, planned %s (SPECCTL_PATCHES=catchup=off: "
                 "every step)", k,
                 "replaying the draft-extend CUDA graph of the state that is %d tokens wide where the batch fits it" % k
                 if cu.graph is not None else
                 "eagerly (no runtime state's draft-extend graph is %d tokens wide)" % k,
                 "from host lengths (flashinfer draft)" if cu.host_plan else "on the GPU (triton draft)")
    return cu


# ---------------------------------------------------------------------------- hooks


def patch(rt: Any) -> Optional[Patch]:
    """The catch-up's hooks, or None where catchup is off."""
    if not rt.settings.draft_catchup:
        return None
    t = rt.targets
    p = Patch(NAME, lost=LOST)
    p.hook(AFTER, t.init_graphs, after_init_graphs)
    p.hook(AROUND, t.extend_decode, around_extend)
    p.hook(BEFORE, t.draft, before_draft)
    p.hook(AFTER, t.extend_prefill, after_prefill)
    return p


def after_init_graphs(ret: Any, worker: Any, *args: Any, **kwargs: Any) -> None:
    rt = _rt.current()
    if rt is not None:
        rt.build_catchup(worker)
    return None


def around_extend(orig: Callable[..., Any], draft_worker: Any, *args: Any, **kwargs: Any) -> Any:
    cu = _rt.live("catchup")
    if cu is None:
        return orig(draft_worker, *args, **kwargs)
    batch, args, rest = _rt.first_arg(args, kwargs, "batch")
    result, args, rest = _rt.first_arg(args, rest, "batch_result")
    return cu.around_extend(orig, draft_worker, batch, result, args, rest)


def before_draft(draft_worker: Any, *args: Any, **kwargs: Any) -> None:
    cu = _rt.live("catchup")
    if cu is not None:
        cu.before_draft(draft_worker, args[0] if args else kwargs["batch"])
    return None


def after_prefill(ret: Any, draft_worker: Any, *args: Any, **kwargs: Any) -> None:
    cu = _rt.live("catchup")
    if cu is not None:
        cu.after_prefill(args[0] if args else kwargs["batch"])
    return None  # keep SGLang's return value
