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


def _kv_info_on_req_kv() -> bool:
    """Where the installed sglang keeps a request's kv_committed_len: 0.5.17 on the Req, 0.5.2x on
    its ReqKvInfo (req.kv); read from its schedule_batch.py, which does not import on CPU."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return False
    src = Path(list(spec.submodule_search_locations)[0], "srt", "managers", "schedule_batch.py")
    return src.exists() and "req.kv.kv_committed_len" in src.read_text()


class _KvInfo:
    __slots__ = ("kv_committed_len", "kv_allocated_len")

    def __init__(self, n: int):
        self.kv_committed_len = n
        self.kv_allocated_len = n + 4


class Req:
    """A Req as the context read sees it: its committed KV length where the installed sglang keeps it."""

    KV_ON_REQ_KV = _kv_info_on_req_kv()

    def __init__(self, committed: int):
        if self.KV_ON_REQ_KV:
            self.kv = _KvInfo(committed)
        else:
            self.kv_committed_len = committed
            self.kv = None


def default_ctx(forward_iter: int, batch_size: int) -> list[int]:
    return [200 + 3 * i for i in range(batch_size)]


class Batch:
    """The ScheduleBatch fields the worker and the hooks read. `ctx`: each request's committed KV
    length (None: requests without one, as a host that cannot tell)."""

    def __init__(self, batch_size: int, forward_iter: int, *, extend: bool = False,
                 ctx: Optional[list[int]] = None, no_ctx: bool = False):
        if no_ctx:
            self.reqs = [object()] * batch_size
        else:
            self.reqs = [Req(n) for n in (ctx if ctx is not None else default_ctx(forward_iter, batch_size))]
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


def telemetry_during(settings, start: Callable[[object], int], step: Callable[[int], int],
                     run: Callable[[int], int]) -> tuple[int, list]:
    """Real sockets at the plugin's endpoints: a policy PUB (the daemon's) and a telemetry PULL.
    `start(pub)` serves until a policy is in force and returns the next forward iteration;
    `step(it)` serves one decode step (repeated until a frame arrives: the plugin's PUSH has
    connected to this fresh PULL) and returns the next iteration; then `run(first)` serves on and
    returns the next iteration, and the step frame of every iteration it served comes back decoded."""
    import zmq

    from specctl.controller import transport, wire

    ctx = zmq.Context.instance()
    pull = transport.telemetry_pull(ctx, settings.telemetry_endpoint)
    pub = transport.policy_pub(ctx, settings.policy_endpoint)
    try:
        it = start(pub)
        deadline = time.monotonic() + 60  # a bound on waiting, not a speed
        while not pull.poll(10):  # frames sent before the PUSH reconnects are dropped (IMMEDIATE)
            assert time.monotonic() < deadline, "no telemetry frame reached the PULL"
            it = step(it)
        first = it
        end = run(first)
        recs: dict = {}
        while len(recs) < end - first:
            assert pull.poll(60_000), f"telemetry stopped after {len(recs)} of {end - first} frames"
            r = wire.decode_step(pull.recv())
            if r.iter >= first:  # not a frame of the steps before
                assert r.iter not in recs, f"two frames for iteration {r.iter}"
                recs[r.iter] = r
    finally:
        pull.close(linger=0)
        pub.close(linger=0)
    return first, [recs[i] for i in sorted(recs)]


def run_decode(worker: EAGLEWorkerV2Standin, processor: ResultProcessorStandin, sizes: list[int], *,
               start_iter: int = 0, overlap: bool = True, between: Optional[Callable[[int], None]] = None,
               ctx_of: Optional[Callable[[int, int], Optional[list[int]]]] = None) -> int:
    """SGLang's event loop for decode batches: with overlap, batch N+1 is launched before the
    result of batch N is processed (scheduler.py event_loop_overlap). `ctx_of(forward_iter,
    batch_size)`: the requests' committed KV lengths (None: requests without one)."""
    pending: Optional[tuple[Result, Batch]] = None
    it = start_iter
    for bs in sizes:
        if between is not None:
            between(it)
        if ctx_of is None:
            batch = Batch(bs, it)
        else:
            lens = ctx_of(it, bs)
            batch = Batch(bs, it, ctx=lens, no_ctx=lens is None)
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


# ----------------------------------------------------------------------------- tree states
# What SGLang 0.5.17's EAGLEWorkerV2 / EagleDraftWorker do with topk and widths around a state
# switch (eagle_worker_v2.py: _override_worker_state, apply_runtime_state, draft,
# _draft_extend_for_prefill/_decode; base_spec_worker.py: _rebuild_topk1_chain_buffers;
# overlap_utils.py: the FutureMap relay sized by its first stash), with the checks whose failure on
# a GPU is a crash raised here as the same kind of error.


class ServerArgsStandin:
    """ServerArgs: read by 0.5.17's draft graph runners; changed only through override()."""

    def __init__(self, cfg_path: str, steps: int):
        self.speculative_eagle_topk = 1
        self.speculative_num_steps = steps
        self.speculative_num_draft_tokens = steps + 1
        self.speculative_adaptive = True
        self.speculative_adaptive_config = cfg_path
        self.mutations: list[tuple[str, dict]] = []

    def override(self, source: str, **fields) -> None:
        self.mutations.append((source, dict(fields)))
        for k, v in fields.items():
            setattr(self, k, v)


class RuntimeContextStandin:
    """sglang.srt.runtime_context: get_context().override() writes the spec bag, get_spec() reads it."""

    def __init__(self, server_args: ServerArgsStandin):
        from types import SimpleNamespace

        self.sa = server_args
        self.bag = SimpleNamespace(speculative_eagle_topk=server_args.speculative_eagle_topk,
                                   speculative_num_steps=server_args.speculative_num_steps,
                                   speculative_num_draft_tokens=server_args.speculative_num_draft_tokens)

    def get_context(self):
        return self

    def get_spec(self):
        return self.bag

    def get_server_args(self):
        return self.sa

    def override(self, source: str, **fields) -> None:
        for k, v in fields.items():
            setattr(self.bag, k, v)


class _DraftInput:
    def __init__(self, bs: int, topk: int):
        import torch

        self.topk_p = torch.rand(bs, topk)
        self.topk_index = torch.arange(bs * topk).reshape(bs, topk)


def _size_mismatch(a: int, b: int) -> RuntimeError:
    return RuntimeError(f"The size of tensor a ({a}) must match the size of tensor b ({b}) at non-singleton dimension 1")


class DraftWorkerStandin:
    def __init__(self, server_args: ServerArgsStandin):
        from types import SimpleNamespace

        self.server_args = server_args
        self.draft_runner = SimpleNamespace(server_args=server_args)
        self.topk = server_args.speculative_eagle_topk
        self.speculative_num_steps = server_args.speculative_num_steps
        self.speculative_num_draft_tokens = server_args.speculative_num_draft_tokens
        self.relay_width: Optional[int] = None  # FutureMap topk buffers: sized by the first stash
        self.drafted: list[tuple[int, int]] = []  # (steps, topk) of every draft
        self._rebuild_topk1_chain_buffers()

    def _rebuild_topk1_chain_buffers(self) -> None:
        if self.topk != 1:
            return
        assert self.speculative_num_draft_tokens == self.speculative_num_steps + 1, (
            "topk=1 requires speculative_num_draft_tokens == speculative_num_steps + 1, "
            f"got {self.speculative_num_draft_tokens} and {self.speculative_num_steps}")

    def _stash(self, info: _DraftInput) -> _DraftInput:
        w = info.topk_index.shape[1]
        if self.relay_width is None:
            self.relay_width = w
        elif w != self.relay_width:
            raise _size_mismatch(w, self.relay_width)
        return info

    def _draft_extend_for_prefill(self, batch: Batch, *args) -> _DraftInput:
        return self._stash(_DraftInput(len(batch.reqs), self.topk))  # fast_topk(probs, self.topk)

    def _draft_extend_for_decode(self, batch: Batch, result: Result) -> _DraftInput:
        # argmax when topk == 1, fast_topk(probs, self.topk) otherwise; one row per request
        return self._stash(_DraftInput(len(batch.reqs), self.topk))

    def draft(self, batch: Batch) -> None:
        w = batch.spec_info.topk_index.shape[1]
        if w != self.topk:  # the chain fast path / the draft graph's static [bs, topk] buffers
            raise _size_mismatch(w, self.topk)
        self.drafted.append((self.speculative_num_steps, self.topk))


class TreeWorkerStandin(EAGLEWorkerV2Standin):
    """EAGLEWorkerV2 with a draft worker: topk lives on both workers, the spec bag and ServerArgs."""

    def __init__(self, initial_steps: int, cfg_path: str, accept, rc: RuntimeContextStandin):
        self.server_args = rc.sa
        self.rc = rc
        self.topk = rc.sa.speculative_eagle_topk
        self._draft_worker = DraftWorkerStandin(rc.sa)
        self.seen_at_build: dict[int, dict] = {}
        self.fail_build: Optional[int] = None
        self.verified: list[tuple[int, int, int]] = []  # (steps, topk, width) of every verify
        self._next_input: Optional[_DraftInput] = None
        super().__init__(initial_steps, cfg_path, accept)

    def build_adaptive_runtime_state(self, speculative_num_steps: int, speculative_num_draft_tokens: int,
                                     cuda_graph_bs: Optional[list[int]] = None):
        dw = self._draft_worker
        backup = (dw.speculative_num_steps, dw.speculative_num_draft_tokens,
                  self.speculative_num_steps, self.speculative_num_draft_tokens)
        dw.speculative_num_steps = self.speculative_num_steps = speculative_num_steps
        dw.speculative_num_draft_tokens = self.speculative_num_draft_tokens = speculative_num_draft_tokens
        try:
            dw._rebuild_topk1_chain_buffers()
            self.seen_at_build[speculative_num_steps] = dict(
                draft_tokens=speculative_num_draft_tokens, worker_topk=self.topk, draft_topk=dw.topk,
                bag_topk=self.rc.bag.speculative_eagle_topk,
                server_args=(self.server_args.speculative_eagle_topk, self.server_args.speculative_num_draft_tokens))
            if self.fail_build == speculative_num_steps and speculative_num_draft_tokens != speculative_num_steps + 1:
                raise RuntimeError("CUDA out of memory (stand-in)")
            return super().build_adaptive_runtime_state(speculative_num_steps, speculative_num_draft_tokens,
                                                        cuda_graph_bs)
        finally:
            (dw.speculative_num_steps, dw.speculative_num_draft_tokens,
             self.speculative_num_steps, self.speculative_num_draft_tokens) = backup
            dw._rebuild_topk1_chain_buffers()

    def apply_runtime_state(self, state) -> None:
        if self.speculative_num_steps == state.speculative_num_steps:
            return
        self.switches.append((self.speculative_num_steps, state.speculative_num_steps))
        dw = self._draft_worker
        self.speculative_num_steps = dw.speculative_num_steps = state.speculative_num_steps
        self.speculative_num_draft_tokens = dw.speculative_num_draft_tokens = state.speculative_num_draft_tokens
        dw._rebuild_topk1_chain_buffers()
        self.rc.override("adaptive_spec.restore", speculative_num_steps=state.speculative_num_steps,
                         speculative_num_draft_tokens=state.speculative_num_draft_tokens)

    def forward_batch_generation(self, batch: Batch, on_publish=None, grammar_barrier=None) -> Result:
        dw = self._draft_worker
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            self._next_input = dw._draft_extend_for_prefill(batch)
            return Result(1, [1] * len(batch.reqs))
        self.activate_step_by_batch(batch.seq_lens.shape[0])
        steps, n = self.speculative_num_steps, self.speculative_num_draft_tokens
        batch.spec_info = self._next_input
        if steps > 0:
            dw.draft(batch)
        # verify: a tree's 16 tokens are laid out by topk; a chain's n is steps + 1
        if (self.topk > 1) != (steps > 0 and n != steps + 1) or self.topk != dw.topk:
            raise RuntimeError(f"verify of steps={steps} n={n} with topk {self.topk}/{dw.topk}")
        self.verified.append((steps, self.topk, n))
        self.used[batch.forward_iter] = (len(batch.reqs), steps)
        acc = self.accept(batch.forward_iter, len(batch.reqs), steps)
        res = Result(n, [a + 1 for a in acc])
        self._next_input = dw._draft_extend_for_decode(batch, res)
        return res


class ModelRunnerStandin:
    """ModelRunner.max_decode_logits_rows (0.5.17): graph batch sizes x the launch state's width."""

    CAPTURE_BS = [1, 2, 4, 8, 16, 32, 64, 128, 160]

    def __init__(self, server_args: ServerArgsStandin):
        self.server_args = server_args

    def max_decode_logits_rows(self) -> int:
        return max(self.CAPTURE_BS) * self.server_args.speculative_num_draft_tokens
