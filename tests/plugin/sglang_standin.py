"""What SGLang's EAGLEWorkerV2 and SchedulerBatchResultProcessor do around the adaptive policy,
for the CPU tests (the real classes need CUDA-only modules). Everything the policy touches is
SGLang's own: the real AdaptiveController, SpecRuntimeState and AdaptiveSpeculativeParams (as
patched by load_plugins); this file stands in for the GPU work only.

Call shapes follow sglang 0.5.17 / 0.5.23: eagle_worker_v2.py (__init__ adaptive block,
init_cuda_graphs, forward_batch_generation decode branch, on_verify_complete_cpu,
build_adaptive_runtime_state / apply_runtime_state) and batch_result_processor.py
(_resolve_spec_v2_tokens -> model_worker.on_verify_complete_cpu).
"""

from __future__ import annotations

import inspect
import time
from typing import Callable, Optional


class _Mode:
    def __init__(self, extend: bool):
        self._extend = extend

    def is_extend(self) -> bool:
        return self._extend


class _SeqLens:
    def __init__(self, n: int):
        self.shape = (n,)


class Batch:
    """The ScheduleBatch fields the worker and the hooks read."""

    def __init__(self, batch_size: int, forward_iter: int, *, extend: bool = False):
        self.reqs = [object()] * batch_size
        self.seq_lens = _SeqLens(batch_size)
        self.forward_mode = _Mode(extend)
        self.is_extend_in_batch = False
        self.forward_iter = forward_iter
        self.launch_ts = time.monotonic()


class Result:
    """The GenerationBatchResult fields (a plain dataclass in SGLang: extra attributes allowed)."""

    def __init__(self, draft_tokens: int, accept_lens: list[int]):
        self.speculative_num_draft_tokens = draft_tokens
        self.accept_lens = accept_lens
        self.num_correct_drafts_per_req_cpu: Optional[list[int]] = None


def _new_style_controller() -> bool:
    from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController

    return "policy" in inspect.signature(AdaptiveController.__init__).parameters


class EAGLEWorkerV2Standin:
    def __init__(self, initial_steps: int, cfg_path: Optional[str],
                 accept: Callable[[int, int, int], list[int]]):
        from sglang.srt.speculative import adaptive_runtime_state as ars

        self.speculative_num_steps = initial_steps
        self.speculative_num_draft_tokens = initial_steps + 1
        self.accept = accept  # (forward_iter, batch_size, steps) -> accepted drafts per request
        if _new_style_controller():  # 0.5.21+: eagle_worker_v2.py builds the policy
            from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

            self.adaptive_controller = ars.AdaptiveController(
                self, AdaptiveSpeculativeParams(initial_steps=self.speculative_num_steps, cfg_path=cfg_path))
        else:  # 0.5.15-0.5.19: the controller builds it from its module global
            self.adaptive_controller = ars.AdaptiveController(self, config_path=cfg_path)
        self.built: dict[int, Optional[list[int]]] = {}
        self.switches: list[tuple[int, int]] = []
        self.used: dict[int, tuple[int, int]] = {}  # forward_iter -> (batch_size, steps)

    def init_cuda_graphs(self, cuda_graph_bs: Optional[list[int]]) -> None:
        from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

        self.adaptive_controller.register(SpecRuntimeState(
            speculative_num_steps=self.speculative_num_steps,
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
            draft_attn_backend=None, cuda_graph_runner=None, target_attn_backend=object(),
            target_graph_runner=None, draft_extend_attn_backend=None,
            cuda_graph_runner_for_draft_extend=None))
        self.adaptive_controller.init_states(cuda_graph_bs=cuda_graph_bs)

    def build_adaptive_runtime_state(self, speculative_num_steps: int, speculative_num_draft_tokens: int,
                                     cuda_graph_bs: Optional[list[int]] = None):
        from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

        self.built[speculative_num_steps] = cuda_graph_bs
        return SpecRuntimeState(
            speculative_num_steps=speculative_num_steps,
            speculative_num_draft_tokens=speculative_num_draft_tokens,
            draft_attn_backend=None, cuda_graph_runner=None, target_attn_backend=object(),
            target_graph_runner=None, draft_extend_attn_backend=None,
            cuda_graph_runner_for_draft_extend=None)

    def apply_runtime_state(self, state) -> None:
        if state.speculative_num_steps != self.speculative_num_steps:
            self.switches.append((self.speculative_num_steps, state.speculative_num_steps))
        self.speculative_num_steps = state.speculative_num_steps
        self.speculative_num_draft_tokens = state.speculative_num_draft_tokens

    def forward_batch_generation(self, batch: Batch, on_publish=None, grammar_barrier=None) -> Result:
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            return Result(1, [1] * len(batch.reqs))
        self.activate_step_by_batch(batch.seq_lens.shape[0])
        steps = self.speculative_num_steps
        self.used[batch.forward_iter] = (len(batch.reqs), steps)
        acc = self.accept(batch.forward_iter, len(batch.reqs), steps)
        assert all(0 <= a <= steps for a in acc)
        return Result(self.speculative_num_draft_tokens, [a + 1 for a in acc])

    def activate_step_by_batch(self, batch_size: int) -> None:
        if self.adaptive_controller is not None:
            self.adaptive_controller.activate_step_by_batch(batch_size)

    def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int], batch_size: int) -> None:
        if self.adaptive_controller is not None:
            self.adaptive_controller.on_verify_complete(num_correct_drafts_per_req, batch_size)


class ResultProcessorStandin:
    def __init__(self, model_worker: EAGLEWorkerV2Standin):
        self.model_worker = model_worker

    def _resolve_spec_v2_tokens(self, result: Result, batch: Batch) -> list[list[int]]:
        result.num_correct_drafts_per_req_cpu = [n - 1 for n in result.accept_lens]
        self.model_worker.on_verify_complete_cpu(result.num_correct_drafts_per_req_cpu,
                                                 batch_size=len(batch.reqs))
        return [[0] * n for n in result.accept_lens]


def run_decode(worker: EAGLEWorkerV2Standin, processor: ResultProcessorStandin, sizes: list[int], *,
               start_iter: int = 0, overlap: bool = True, between: Optional[Callable[[int], None]] = None) -> int:
    """SGLang's event loop for decode batches: with overlap, batch N+1 is launched before the
    result of batch N is processed (scheduler.py event_loop_overlap)."""
    pending: Optional[tuple[Result, Batch]] = None
    it = start_iter
    for bs in sizes:
        if between is not None:
            between(it)
        batch = Batch(bs, it)
        res = worker.forward_batch_generation(batch)
        if overlap:
            if pending is not None:
                processor._resolve_spec_v2_tokens(*pending)
            pending = (res, batch)
        else:
            processor._resolve_spec_v2_tokens(res, batch)
        it += 1
    if pending is not None:
        processor._resolve_spec_v2_tokens(*pending)
    return it
