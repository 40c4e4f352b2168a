"""The SGLang side of the plugin: hooks around the EngineController (plugin/engine.py).

    REPLACE  AdaptiveSpeculativeParams           -> SpecctlSpeculativeParams: decide() per decode batch
    AROUND   EAGLEWorkerV2.forward_batch_generation  CUDA events around the decode step (rank 0); the
             batch's context (sum of its requests' host-side kv_committed_len, the same on every rank)
             read before SGLang asks the policy, for the decision and the step's telemetry
    AFTER    SchedulerBatchResultProcessor._resolve_spec_v2_tokens
             every rank, every decode result, same order: telemetry (rank 0), and every
             `sync_every` results rank 0's pending policy is broadcast on the TP group and applied.
    AFTER    EAGLEWorkerV2._build_trivial_verify_input
             the steps-0 tree's token as int64 (without the overlap scheduler it is the sampler's
             int32, which SGLang's verify_tree_greedy refuses: the first steps-0 step crashed)

The decode state (speculation off as a decode forward; plugin/plain_decode.py; SPECCTL_PLAIN_DECODE):

    AFTER    EAGLEWorkerV2.init_cuda_graphs        builds it on every TP rank; the ranks agree
    AROUND   EAGLEWorkerV2.verify                  at steps 0: the verify call runs with it
    AROUND   TpModelWorker.forward_batch_generation  the target forward of that call: a DECODE forward

The draft's steps-0 extends deferred to one per K steps (SPECCTL_DRAFT_CATCHUP, off by default;
plugin/draft_catchup.py):

    AROUND   EagleDraftWorker._draft_extend_for_decode   steps 0: the ring, SGLang's stubs; every K-th: the catch-up
    BEFORE   EagleDraftWorker.draft                      the catch-up after steps-0 steps
    AFTER    EagleDraftWorker._draft_extend_for_prefill  nothing pending for a prefilled request
    (built AFTER EAGLEWorkerV2.init_cuda_graphs, with the decode state; TP 1 only)

Each chain state's own draft-extend graphs (SPECCTL_DRAFT_EXTEND_GRAPHS, on by default; SGLang 0.5.17 only):

    AROUND   spec_utils.resolve_num_tokens_per_req   phase "draft_extend": the width in the spec bag (which
                                                  SGLang's _override_worker_state sets for each state's
                                                  build), not the startup ServerArgs' (0.5.17 reads that,
                                                  so every state's draft-extend graph has the launch
                                                  width and steps 0 / s1 / s2 extend eagerly; 0.5.23
                                                  reads the bag itself)

The speculative KV allocation's lengths as one list (SPECCTL_SPEC_ALLOC_LIST, on by default; SGLang 0.5.17 only):

    AROUND   eagle_utils.alloc_for_spec_decode    (the name eagle_prepare_for_decode calls) page size 1: the
                                                  next lengths handed over as a list, so the function's last
                                                  loop reads Python ints, not 2 ATen scalar calls per request
                                                  (int(nxt_kv_lens_cpu[i])); 0.5.23 calls .tolist() itself

The split-KV verify kernel (SPECCTL_SPLITKV_VERIFY, on by default; SGLang gates it to AMD gfx95):

    AFTER    TritonAttnBackend.__init__             use_verify_splitkv on every topk-1 backend on CUDA
                                                  (the kernel computes a causal chain; its own can_handle
                                                  sends everything else to the extend kernel), unless
                                                  SGLANG_ENABLE_SPLITKV_VERIFY is off

The sync-free flashinfer verify plan (SPECCTL_FI_VERIFY_HOST_PLAN, off by default; plugin/fi_verify_plan.py;
SGLang 0.5.17 only: on an SGLang with SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN the setting turns that on instead):

    AROUND   FlashInferAttnBackend.init_forward_metadata_out_graph   at capture: marks the topk-1 TARGET_VERIFY
                                                  wrappers (fa2, page size 1, full attention) after SGLang's plan()
    AROUND   FlashInferIndicesUpdaterPrefill.call_begin_forward       a marked wrapper is planned from seq_lens_cpu,
                                                  without plan()'s four blocking device-to-host reads

The decode state's sequence lengths kept on the host (SPECCTL_HOST_SEQ_LENS, `check` by default; plugin/host_seq_lens.py;
SGLang 0.5.17 only; with the decode state):

    (AROUND  EAGLEWorkerV2.forward_batch_generation, the hook above: the forward's rows, a prefill's lengths)
    AROUND   FutureMap.publish                     the rows it wrote take the lengths handed over (a prefill's,
                                                  or a decode-state step's: its planned ones plus one, from
                                                  the verify hook) or leave the host's copy (any other step)
    AROUND   FutureMap.resolve_seq_lens_cpu        rows the copy holds: SGLang's resolve without its host pull
                                                  and the wait for the previous step (flashinfer's), the
                                                  lengths from the copy

Tree states (topk > 1; only when the adaptive config has a `specctl.states` section, see
plugin/launch_args.py; each hook passes straight through otherwise):

    AROUND   EAGLEWorkerV2.build_adaptive_runtime_state   builds a tree's key as the tree: topk and
             width set on the workers, the spec bag and (0.5.17 reads them there) ServerArgs for the
             duration of the build; the state is tagged with its topk
    BEFORE   EAGLEWorkerV2.apply_runtime_state            the workers' and the bag's topk follow the
             state being applied (SGLang swaps steps and buffers, never topk)
    AROUND   EagleDraftWorker._draft_extend_for_decode / _draft_extend_for_prefill
             the draft's next-step top-k is always the widest topk of any state, whatever state
             runs: a chain step can hand over to the tree (the overlap FutureMap keeps that width)
    BEFORE   EagleDraftWorker.draft                       a chain drafts from the first column only
    AFTER    ModelRunner.max_decode_logits_rows           the shared logits buffer holds the tree's
             width (0.5.17 sizes it from the launch state's)

Imported only inside SGLang scheduler processes (plugin/__init__.py gates it). Every hook calls the
original first-class and swallows its own errors: a fault here falls back, never takes the server down.
The exceptions are the tree hooks that keep widths consistent (apply, draft extend, draft): they only
set attributes and slice a tensor, and skipping them on an error would hand a state the wrong width,
which SGLang would fail on one step later; a failed tree build is caught (the key becomes a chain).
"""

from __future__ import annotations

import functools
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from ..controller.wire import config_name
from ..policies.table import Config, chain
from .engine import EngineController, PluginSettings

log = logging.getLogger("specctl.plugin")


@dataclass(frozen=True)
class Targets:
    policy: str = "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams"
    forward: str = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation"
    result: str = ("sglang.srt.managers.scheduler_components.batch_result_processor."
                   "SchedulerBatchResultProcessor._resolve_spec_v2_tokens")
    # tree states only
    build: str = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.build_adaptive_runtime_state"
    apply: str = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.apply_runtime_state"
    extend_decode: str = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_decode"
    extend_prefill: str = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker._draft_extend_for_prefill"
    draft: str = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.draft"
    logits_rows: str = "sglang.srt.model_executor.model_runner.ModelRunner.max_decode_logits_rows"
    # the decode state only
    init_graphs: str = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.init_cuda_graphs"
    verify: str = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.verify"
    target_forward: str = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
    # the split-KV verify kernel only
    triton_init: str = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.__init__"
    # each chain state's own draft-extend graphs only (0.5.17)
    draft_width: str = "sglang.srt.speculative.spec_utils.resolve_num_tokens_per_req"
    # the speculative KV allocation's lengths as one list (0.5.17)
    spec_alloc: str = "sglang.srt.speculative.eagle_utils.alloc_for_spec_decode"
    # steps 0 without the overlap scheduler (int32 bonus tokens)
    trivial_verify: str = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2._build_trivial_verify_input"
    # the sync-free flashinfer verify plan only (0.5.17)
    fi_out_graph: str = ("sglang.srt.layers.attention.flashinfer_backend.FlashInferAttnBackend."
                         "init_forward_metadata_out_graph")
    fi_begin_forward: str = ("sglang.srt.layers.attention.flashinfer_backend.FlashInferIndicesUpdaterPrefill."
                             "call_begin_forward")
    # the decode state's lengths on the host only (0.5.17)
    fmap_publish: str = "sglang.srt.managers.overlap_utils.FutureMap.publish"
    fmap_resolve: str = "sglang.srt.managers.overlap_utils.FutureMap.resolve_seq_lens_cpu"

    def plain_targets(self) -> tuple[str, ...]:
        return (self.init_graphs, self.verify, self.target_forward)

    def catchup_targets(self) -> tuple[str, ...]:
        return (self.init_graphs, self.extend_decode, self.draft, self.extend_prefill)

    def fi_plan_targets(self) -> tuple[str, ...]:
        return (self.fi_out_graph, self.fi_begin_forward)

    def host_lens_targets(self) -> tuple[str, ...]:
        return (self.fmap_publish, self.fmap_resolve)

    def tree_targets(self) -> tuple[str, ...]:
        return (self.build, self.apply, self.extend_decode, self.extend_prefill, self.draft, self.logits_rows)


SGLANG_TARGETS = Targets()
_RUNTIME: Optional["PluginRuntime"] = None


class CpuTimer:
    """Host-side timing, for hosts without CUDA (the CPU tests); a GPU step needs CudaEventTimer."""

    def start(self) -> Any:
        return time.perf_counter()

    def stop(self, mark: Any) -> Any:
        return (time.perf_counter() - mark) * 1000.0

    def elapsed_ms(self, token: Any) -> Optional[float]:
        return token


class CudaEventTimer:
    """CUDA events recorded on the forward stream around the step: under the overlap scheduler the
    call only launches work, so host time would measure launch. Events are pooled (no allocation
    per step) and read only once complete (never synchronised)."""

    def __init__(self, torch_mod: Any):
        self._torch = torch_mod
        self._pool: list[tuple[Any, Any]] = []

    def start(self) -> Any:
        pair = self._pool.pop() if self._pool else (
            self._torch.cuda.Event(enable_timing=True), self._torch.cuda.Event(enable_timing=True))
        pair[0].record()
        return pair

    def stop(self, pair: Any) -> Any:
        pair[1].record()
        return pair

    def elapsed_ms(self, pair: Any) -> Optional[float]:
        try:
            if not pair[1].query():
                return None
            return float(pair[0].elapsed_time(pair[1]))
        finally:
            if len(self._pool) < 16:
                self._pool.append(pair)


class PluginRuntime:
    """Process-wide plugin state: settings, transport (rank 0), TP group, timer, the engine."""

    def __init__(self, settings: PluginSettings, *, targets: Targets = SGLANG_TARGETS,
                 policy_file_bytes: Optional[bytes] = None,
                 tp_group_fn: Optional[Callable[[], Any]] = None,
                 zmq_context: Any = None, timer: Any = None,
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.targets = targets
        self.policy_file_bytes = policy_file_bytes
        self.tp_group_fn = tp_group_fn or _sglang_tp_group
        self.zmq_context = zmq_context
        self.timer = timer
        self.clock = clock
        self.engine: Optional[EngineController] = None
        self.rank = 0
        self.world_size = 1
        self.tp_group: Any = None
        self.sender: Any = None
        self.receiver: Any = None
        self.telemetry_on = False
        self.sync_on = True
        self.hook_problems: list[str] = []
        self.missing_hooks: Optional[set[str]] = set()  # None: the registry could not be read
        # tree states (steps key -> (steps, topk, n)) this process builds and switches to; set from
        # the adaptive config when the policy object is made, before SGLang builds its states
        self.trees: dict[int, Config] = {}
        self.max_topk = 1
        self._trees_of: dict[str, dict[int, Config]] = {}  # adaptive-config path -> its tree states
        # launch_ts is time.monotonic(); the wire's ts is wall-clock seconds
        self.wall_offset_s = time.time() - time.monotonic()
        self._prev_launch: Optional[tuple[int, float]] = None
        self._warned: set[str] = set()
        self.plain: Any = None  # the decode state (plain_decode.PlainDecode), once built
        self.catchup: Any = None  # the deferred steps-0 draft extends (draft_catchup.DraftCatchup), once built
        self.fi_plan: Any = None  # fi_verify_plan.HostPlan while SPECCTL_FI_VERIFY_HOST_PLAN hooks SGLang
        self.host_lens: Any = None  # host_seq_lens.HostSeqLens while SPECCTL_HOST_SEQ_LENS hooks SGLang
        # the batch's context, read by the forward hook for get_steps_for_batch: (batch size, ctx_tokens)
        self._ctx_pending: Optional[tuple[int, int]] = None
        self._ctx_get: Optional[Callable[[Any], int]] = None  # per-request committed length, by version

    # ---------------------------------------------------------------- start-up

    def new_engine(self, candidate_steps: list[int],
                   trees: Optional[dict[int, Config]] = None) -> EngineController:
        """Called from SpecctlSpeculativeParams.__init__ (worker construction, after load_plugins
        applied the hooks and after the TP group exists, before SGLang builds its runtime states)."""
        self._set_trees(self._usable_trees(dict(trees or {}), candidate_steps))
        try:
            self.tp_group = self.tp_group_fn()
            self.rank = int(getattr(self.tp_group, "rank_in_group", 0))
            self.world_size = int(getattr(self.tp_group, "world_size", 1))
            no_group = None
        except Exception as e:  # noqa: BLE001
            self.tp_group, self.rank, self.world_size = None, 0, 1
            no_group = f"no TP group ({type(e).__name__}: {e})"
        eng = EngineController(self.settings, candidate_steps=candidate_steps, states=self.trees,
                               clock=self.clock, rank=self.rank, initial_policy=self.policy_file_bytes)
        self.engine = eng
        if no_group is not None:
            # Without the group this process cannot tell its rank: every rank would think it is
            # rank 0 and apply policies at its own pace. The fixed fallback is the same everywhere.
            self.sync_on = False
            eng.fail(f"{no_group}; fixed-threshold policy on every rank")
        elif self.rank == 0:
            self._open_transport()
        if self.timer is None and self.rank == 0 and self.telemetry_on:
            self.timer = _default_timer()
        log.info("specctl: engine ready on TP rank %d/%d, mode %s, runtime states %s, source %s%s",
                 self.rank, self.world_size, self.settings.mode, eng.describe_states(),
                 eng.active_source, f" ({eng.fallback_reason})" if eng.fallback_reason else "")
        return eng

    def _usable_trees(self, trees: dict[int, Config], candidate_steps: list[int]) -> dict[int, Config]:
        """The requested trees, or none (said loudly, and the keys are then built as chains) when
        this process cannot run them safely."""
        self.check_hooks(tree_hooks=bool(trees))
        if not trees:
            return {}
        names = ", ".join(config_name(c) for c in trees.values())
        why = None
        if self.missing_hooks is None:
            why = "SGLang's hook registry could not be read, so the tree hooks are unverified"
        elif any(t in self.missing_hooks for t in self.targets.tree_targets()):
            missing = [t for t in self.targets.tree_targets() if t in self.missing_hooks]
            why = f"the tree hooks on {', '.join(missing)} did not take effect"
        elif not set(trees) <= set(candidate_steps):
            why = f"the adaptive config's slots do not list steps {sorted(set(trees) - set(candidate_steps))}"
        elif _env_flag("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"):
            why = ("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND is set: its stub draft input is as wide as "
                   "the state's topk, not the tree's")
        if why:
            log.error("specctl: tree states %s NOT built: %s; SGLang builds steps %s as chains and "
                      "policies naming the trees are refused", names, why, sorted(trees))
            return {}
        log.info("specctl: tree states %s will be built beside the chains (launch topk 1)", names)
        return trees

    # ---------------------------------------------------------------- tree states

    def _set_trees(self, trees: dict[int, Config]) -> None:
        self.trees = trees
        self.max_topk = max([c[1] for c in trees.values()] + [1])  # read by a hook at every decode step

    def configured_trees(self, cfg_path: Optional[str]) -> dict[int, Config]:
        """The tree states an adaptive config file asks for (launch_args.read_tree_states), read once
        per path: the policy object and the logits-rows hook both need them at start-up."""
        key = cfg_path or ""
        if key not in self._trees_of:
            from .launch_args import read_tree_states

            self._trees_of[key] = read_tree_states(cfg_path)
        return dict(self._trees_of[key])

    def build_state(self, orig: Callable[..., Any], worker: Any, args: tuple, kwargs: dict) -> Any:
        """AROUND build_adaptive_runtime_state(steps, draft_tokens, cuda_graph_bs): a tree key is
        built as the tree; a build that fails leaves the key a chain (said, and the engine told)."""
        names = ("speculative_num_steps", "speculative_num_draft_tokens", "cuda_graph_bs")
        call = dict(zip(names, args))
        call.update(kwargs)
        cfg = self.trees.get(call.get("speculative_num_steps"))  # type: ignore[arg-type]
        if cfg is None:
            return orig(worker, *args, **kwargs)
        steps, topk, n = cfg
        try:
            with _tree_build_context(worker, topk, n):
                state = orig(worker, speculative_num_steps=steps, speculative_num_draft_tokens=n,
                             cuda_graph_bs=call.get("cuda_graph_bs"))
            state._specctl_topk = topk
        except Exception as e:  # noqa: BLE001 - the server starts, with a chain under this key
            log.exception("specctl: building the tree state %s failed (%s: %s); steps=%d is built "
                          "as a chain", config_name(cfg), type(e).__name__, e, steps)
            self._set_trees({k: c for k, c in self.trees.items() if k != steps})
            if self.engine is not None:
                self.engine.replace_state(steps, chain(steps),
                                          f"the tree {config_name(cfg)} could not be built: {type(e).__name__}: {e}")
            return orig(worker, *args, **kwargs)
        log.info("specctl: built tree state %s under steps key %d", config_name(cfg), steps)
        return state

    def before_apply(self, worker: Any, state: Any) -> None:
        """BEFORE apply_runtime_state: SGLang swaps steps, widths and buffers but never topk."""
        topk = getattr(state, "_specctl_topk", 1)
        if worker.topk != topk:
            worker.topk = topk
            worker._draft_worker.topk = topk
            _set_bag_topk("specctl.apply_tree_state", topk)

    def tree_logits_rows(self, runner: Any, rows: int) -> Optional[int]:
        """AFTER ModelRunner.max_decode_logits_rows: enough rows for the widest tree's graphs."""
        sa = runner.server_args
        path = getattr(sa, "speculative_adaptive_config", None)
        if not path or not getattr(sa, "speculative_adaptive", False):
            return None
        try:
            width = max([c[2] for c in self.configured_trees(path).values()] + [0])
        except (OSError, ValueError) as e:
            self.warn_once(f"cannot read tree states from {path}: {e}")
            return None
        if width <= 1:
            return None
        need = max(_capture_sizes(runner, width)) * width
        return need if need > rows else None

    def _open_transport(self) -> None:
        s = self.settings
        if self.sender is not None or self.receiver is not None:
            return  # one set of sockets per process, whatever the number of policy objects
        if s.telemetry_endpoint is None and (s.policy_endpoint is None or s.mode != "online"):
            return
        try:
            from ..controller.transport import PolicyReceiver, TelemetrySender, load_client_keys

            if self.zmq_context is None:
                import zmq

                self.zmq_context = zmq.Context.instance()
            keys = (load_client_keys(s.curve_secret_key_file, s.curve_server_key_file)
                    if s.curve_secret_key_file else None)
            if s.telemetry_endpoint is not None:
                self.sender = TelemetrySender(self.zmq_context, s.telemetry_endpoint, hwm=s.telemetry_hwm,
                                              keys=keys)
                self.telemetry_on = True
            if s.policy_endpoint is not None and s.mode == "online":
                self.receiver = PolicyReceiver(self.zmq_context, s.policy_endpoint, keys=keys)
        except Exception as e:  # noqa: BLE001
            self.sender = self.receiver = None
            self.telemetry_on = False
            self.warn_once(f"transport unavailable ({type(e).__name__}: {e}); no telemetry, no daemon policy")

    def check_hooks(self, tree_hooks: bool = False) -> list[str]:
        """SGLang only logs a hook it could not apply; say clearly which of ours are missing (the
        tree hooks only matter, and are only checked, when the adaptive config asks for trees)."""
        try:
            from sglang.srt.plugins.hook_registry import HookRegistry

            patched = set(HookRegistry._patched)
        except Exception as e:  # noqa: BLE001
            self.hook_problems = [f"cannot read SGLang's hook registry ({type(e).__name__}: {e})"]
            self.missing_hooks = None
            log.error("specctl: %s: hooks unverified", self.hook_problems[0])
            return self.hook_problems
        consequence = {
            self.targets.policy: "specctl is not deciding anything (SGLang's own policy runs)",
            self.targets.forward: "no CUDA-event step time; step_ms falls back to the launch cadence",
            self.targets.result: ("no telemetry and no TP policy sync: daemon policies never apply "
                                  "(fallback, or the policy file)"),
            self.targets.trivial_verify: ("steps 0 under --disable-overlap-schedule fails in SGLang's "
                                          "verify_tree_greedy (int32 bonus tokens)"),
        }
        if tree_hooks:
            consequence.update({t: "tree states cannot be built or switched to safely"
                                for t in self.targets.tree_targets()})
        if self.settings.plain_decode:
            consequence.update({t: "no decode state: speculation off runs SGLang's 1-token verify"
                                for t in self.targets.plain_targets()})
        if self.settings.draft_catchup:
            consequence.update({t: "no draft catch-up: steps 0 extends the draft every step"
                                for t in self.targets.catchup_targets()})
        if self.settings.splitkv_verify:
            consequence[self.targets.triton_init] = "verify attention stays SGLang's extend kernel"
        if self.settings.draft_extend_graphs and _draft_width_needed():
            consequence[self.targets.draft_width] = ("every state's draft-extend graph keeps the launch width: "
                                                     "steps 0 / s1 / s2 extend eagerly")
        if self.settings.spec_alloc_list and _spec_alloc_reads_scalars():
            consequence[self.targets.spec_alloc] = ("the speculative KV allocation reads each request's length as a "
                                                    "tensor scalar (2 ATen calls per request per step)")
        if self.fi_plan is not None:
            consequence.update({t: "flashinfer verify plans keep plan()'s blocking device-to-host reads"
                                for t in self.targets.fi_plan_targets()})
        if self.host_lens is not None:
            consequence.update({t: "every step pulls its sequence lengths from the device (SGLang's path)"
                                for t in self.targets.host_lens_targets()})
        self.missing_hooks = {t for t in consequence if t not in patched}
        self.hook_problems = [f"hook on {t} did not take effect: {why}"
                              for t, why in consequence.items() if t in self.missing_hooks]
        if self.host_lens is not None:  # its copy follows the forward, the publish and the resolve, or none of them
            gone = [t for t in (self.targets.forward, *self.targets.host_lens_targets()) if t in self.missing_hooks]
            if gone:
                self.host_lens.turn_off(f"the hooks on {', '.join(gone)} did not take effect")
        for p in self.hook_problems:
            log.error("specctl: %s (SGLang logged the cause above as 'Failed to apply hooks')", p)
        if not self.hook_problems:
            log.info("specctl: all %d hooks in place", len(consequence))
        return self.hook_problems

    def check_fi_hooks(self) -> None:
        """At the first flashinfer capture (whether or not specctl's policy runs): both verify-plan hooks must
        be in place, or none of it is used (a capture hook alone changes nothing; said, once)."""
        hp = self.fi_plan
        hp.wired = True
        try:
            from sglang.srt.plugins.hook_registry import HookRegistry

            missing = [t for t in self.targets.fi_plan_targets() if t not in HookRegistry._patched]
        except Exception as e:  # noqa: BLE001
            missing = [f"? (SGLang's hook registry unreadable: {type(e).__name__}: {e})"]
        if missing:
            hp.turn_off(f"the verify-plan hooks on {', '.join(missing)} did not take effect")

    # ---------------------------------------------------------------- the decode state

    def _not_in_place(self, targets: tuple[str, ...]) -> list[str]:
        """Of a feature's hook targets, those not verified in place (all of them where the registry could not be read)."""
        return [t for t in targets if self.missing_hooks is None or t in self.missing_hooks]

    def build_plain(self, worker: Any) -> None:
        """AFTER init_cuda_graphs (every TP rank): the decode state, or None with the reason logged."""
        from . import plain_decode

        self.plain = None
        missing = self._not_in_place(self.targets.plain_targets())
        if missing:
            # the ranks agree all the same: every rank took part in the same collective
            log.error("specctl: no decode state: the hooks on %s are not in place", ", ".join(missing))
            plain_decode.tp_agree(self.tp_group or _SingleProcess())(False)
            return
        group = self.tp_group
        if group is None:  # the policy object (which finds the group) was never built
            try:
                group = self.tp_group_fn()
            except Exception:  # noqa: BLE001 - no group: a single process
                group = _SingleProcess()
        self.plain = plain_decode.build(worker, agree=plain_decode.tp_agree(group),
                                        backends=plain_decode.backends(self.settings.plain_decode_flashinfer))
        if self.plain is not None:
            self.plain.logprobs = bool(self.settings.plain_decode_logprobs)

    def build_catchup(self, worker: Any) -> None:
        """AFTER init_cuda_graphs (every TP rank): the draft catch-up, or None with the reason logged.
        Nothing collective: every rank reaches the same answer from the same launch."""
        from . import draft_catchup, plain_decode

        self.catchup = None
        missing = self._not_in_place(self.targets.catchup_targets())
        if missing:
            log.error("specctl: no draft catch-up: the hooks on %s are not in place", ", ".join(missing))
            return
        self.catchup = draft_catchup.build(worker, k=self.settings.draft_catchup, trees=bool(self.trees),
                                           plain_reason=plain_decode.unsupported_reason(worker),
                                           skip_zero_extend=_env_flag("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND"))

    # ---------------------------------------------------------------- per step

    def on_forward(self, orig: Callable[..., Any], worker: Any, *args: Any, **kwargs: Any) -> Any:
        timer = self.timer
        mark = ctx = None
        self._ctx_pending = None
        try:
            batch = args[0] if args else kwargs["batch"]
            decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch)
        except Exception as e:  # noqa: BLE001
            self._disable_timing(e)
            decode = False
        if decode and self._wants_ctx():
            ctx = self._batch_ctx(batch)
            if ctx is not None:
                self._ctx_pending = (len(batch.reqs), ctx)
        if decode and timer is not None:
            try:
                mark = timer.start()
            except Exception as e:  # noqa: BLE001
                self._disable_timing(e)
        out = orig(worker, *args, **kwargs)
        self._ctx_pending = None  # asked for inside orig, or not at all: never used for another batch
        if mark is not None:
            try:
                out._specctl_timing = timer.stop(mark)
            except Exception as e:  # noqa: BLE001
                self._disable_timing(e)
        if ctx is not None and self.telemetry_on:
            try:
                out._specctl_ctx = ctx
            except Exception:  # noqa: BLE001 - a result without attributes: telemetry goes without it
                pass
        return out

    def _wants_ctx(self) -> bool:
        """Read the context where it is used: rank 0's telemetry, and every rank's decision while the
        table in force decides by context (bands, or rows for a context band): the same table on every
        rank at every step, so every rank reads it for the same batches."""
        eng = self.engine
        return self.telemetry_on or (eng is not None and bool(getattr(eng.table, "uses_ctx", False)))

    def _batch_ctx(self, batch: Any) -> Optional[int]:
        """Context tokens of a decode batch: the sum of its requests' kv_committed_len, host-side
        integers SGLang keeps for its own KV allocation and updates in the same order on every TP
        rank (0.5.17: on the Req; 0.5.2x: on req.kv). Under the overlap scheduler it lags the device
        by one verify; no tensor is touched."""
        try:
            reqs = batch.reqs
            get = self._ctx_get
            if get is None:
                if not reqs:
                    return None
                import operator

                get = operator.attrgetter("kv_committed_len" if hasattr(reqs[0], "kv_committed_len")
                                          else "kv.kv_committed_len")
                int(get(reqs[0]))
                self._ctx_get = get
            return int(sum(map(get, reqs)))
        except Exception as e:  # noqa: BLE001 - this batch goes by the rows naming no context
            # nothing sticky: a rank that read the context for telemetry alone must not decide otherwise
            # later than the ranks that did not; the same batch fails alike on every rank
            self._ctx_get = None
            self._ctx_pending = None
            self.warn_once(f"the batch's context is unreadable ({type(e).__name__}: {e}): such batches are "
                           f"decided by the rows naming no context, their telemetry carries no ctx_tokens")
            return None

    def take_ctx(self, batch_size: int) -> Optional[int]:
        """The context the forward hook read for this decode batch (get_steps_for_batch), once."""
        p, self._ctx_pending = self._ctx_pending, None
        return p[1] if p is not None and p[0] == batch_size else None

    def on_result(self, processor: Any, result: Any, batch: Any) -> None:
        """Every rank, every decode result, in the same order (the scheduler is SPMD)."""
        eng = self._engine_of(processor)
        if eng is None:
            return
        at_boundary = eng.note_result()
        if self.telemetry_on:
            try:
                self._send_step(eng, result, batch)
            except Exception as e:  # noqa: BLE001 - telemetry is rank 0's alone: never touch decisions
                self.telemetry_on = False
                self.warn_once(f"telemetry off after an error: {type(e).__name__}: {e}")
        if at_boundary and self.sync_on:
            self._sync(eng)

    def _send_step(self, eng: EngineController, result: Any, batch: Any) -> None:
        timing = getattr(result, "_specctl_timing", None)
        step_ms = self.timer.elapsed_ms(timing) if (timing is not None and self.timer is not None) else None
        it, launch = batch.forward_iter, batch.launch_ts
        prev, self._prev_launch = self._prev_launch, (it, launch)
        if step_ms is None:
            if prev is None or it != prev[0] + 1:
                return  # no event and no contiguous cadence: nothing honest to report
            step_ms = (launch - prev[1]) * 1000.0
        if not step_ms > 0:
            return
        width = result.speculative_num_draft_tokens or 1
        off_path = getattr(result, "_specctl_off_path", "verify") if width == 1 else None
        frame = eng.step_record(iter=it, ts=launch + self.wall_offset_s, batch_size=len(batch.reqs),
                                draft_tokens=width, accepted=result.num_correct_drafts_per_req_cpu,
                                step_ms=step_ms, ctx_tokens=getattr(result, "_specctl_ctx", None),
                                off_path=off_path)
        self.sender.send(frame)

    def _sync(self, eng: EngineController) -> None:
        if self.rank == 0 and self.receiver is not None:
            try:
                frame = self.receiver.poll()
                if frame is not None:
                    eng.offer_policy_frame(frame)
            except Exception as e:  # noqa: BLE001
                self.receiver = None
                # rank 0 alone saw this: it reaches the other ranks through the broadcast below
                eng.stage_fallback(f"policy intake failed: {type(e).__name__}: {e}")
        try:
            eng.sync(self._broadcast if self.world_size > 1 else None)
        except Exception as e:  # noqa: BLE001
            self.sync_on = False
            eng.fail(f"TP policy broadcast failed: {type(e).__name__}: {e}")

    def _broadcast(self, obj: Any) -> Any:
        return self.tp_group.broadcast_object(obj, src=0)

    # ---------------------------------------------------------------- helpers

    def _engine_of(self, processor: Any) -> Optional[EngineController]:
        worker = processor.model_worker
        ctl = getattr(worker, "adaptive_controller", None)
        if ctl is None:
            topk = getattr(worker, "topk", 1)
            if isinstance(topk, int) and topk > 1:
                # SGLang's adaptive_unsupported_reason refused this launch in the main process and only
                # warned there ("Falling back to static speculative params"): say what happened, here
                self.warn_once(
                    f"launched with --speculative-eagle-topk {topk}: SGLang's adaptive mode runs topk 1 only, so it "
                    f"fell back to the static tree and specctl is idle. Launch as a topk-1 chain with the tree as one "
                    f"more runtime state: `specctl sglang-args --configs off,s{worker.speculative_num_steps}k{topk}"
                    f"n{worker.speculative_num_draft_tokens} --fallback-config s{worker.speculative_num_steps}k{topk}"
                    f"n{worker.speculative_num_draft_tokens}` prints the flags", logging.ERROR)
            else:
                self.warn_once("SGLang runs without an adaptive controller (launch with "
                               "--speculative-adaptive; see `specctl sglang-args`): specctl is idle")
            return None
        eng = getattr(ctl.params, "specctl", None)
        if eng is None:
            self.warn_once(f"the adaptive policy is {type(ctl.params).__name__}, not specctl's: the "
                           f"REPLACE hook on {self.targets.policy} did not take effect")
        return eng

    def _disable_timing(self, e: Exception) -> None:
        self.timer = None
        self.warn_once(f"step timing off after an error: {type(e).__name__}: {e}")

    def warn_once(self, msg: str, level: int = logging.WARNING) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            log.log(level, "specctl: %s", msg)

    def close(self) -> None:
        for s in (self.sender, self.receiver):
            if s is not None:
                s.close()
        self.sender = self.receiver = None
        self.telemetry_on = False
        if self.engine is not None:
            self.engine.close_trace()


def make_policy_class(base: type) -> type:
    """The REPLACE for SGLang's AdaptiveSpeculativeParams: same constructor, same protocol
    (candidate_steps, set_cuda_graph_bs, cuda_graph_bs_for_step, get_steps_for_batch,
    on_verify_complete); decisions come from the EngineController."""

    class SpecctlSpeculativeParams(base):  # type: ignore[misc, valid-type]
        def __init__(self, initial_steps: int, cfg_path: Optional[str] = None):
            super().__init__(initial_steps, cfg_path)
            self.specctl: Optional[EngineController] = None
            self._sizing_only: frozenset[int] = frozenset()
            rt = _RUNTIME
            if rt is None:
                log.error("specctl: policy built without a plugin runtime; SGLang's policy decides")
                return
            from .launch_args import SIZING_SLOT

            sizing = self._slots.get(int(SIZING_SLOT))
            if sizing is not None:
                # the sizing slot's steps only size buffers: no runtime state for them (decided before
                # anything can fail, so that SGLang's own policy never builds them either)
                used = {s for bs, slot in self._slots.items() if bs != int(SIZING_SLOT)
                        for s in slot.candidate_steps}
                self._sizing_only = frozenset(set(sizing.candidate_steps) - used)
            try:
                self.specctl = rt.new_engine(list(self.candidate_steps), rt.configured_trees(cfg_path))
            except Exception as e:  # noqa: BLE001
                log.exception("specctl: engine start failed (%s); SGLang's policy decides", e)

        @property
        def candidate_steps(self) -> list[int]:  # SGLang builds one runtime state per entry
            every = sorted({s for slot in self._slots.values() for s in slot.candidate_steps})
            return [s for s in every if s not in getattr(self, "_sizing_only", ())]

        def get_steps_for_batch(self, batch_size: int) -> int:
            eng = self.specctl
            if eng is None:
                return super().get_steps_for_batch(batch_size)
            rt = _RUNTIME
            return eng.decide(batch_size, rt.take_ctx(batch_size) if rt is not None else None)

        def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> Optional[int]:
            if self.specctl is None:
                return super().on_verify_complete(num_correct_drafts_per_req, batch_size)
            return None  # never switch here: the next get_steps_for_batch decides

        def cuda_graph_bs_for_step(self, step: int) -> Optional[list[int]]:
            if self.specctl is None:
                return super().cuda_graph_bs_for_step(step)
            # the table may choose any built step at any batch size: capture graphs for all
            cg = self._cuda_graph_bs
            return None if cg is None else list(cg)

    return SpecctlSpeculativeParams


def install(settings: PluginSettings, *, targets: Targets = SGLANG_TARGETS,
            policy_file_bytes: Optional[bytes] = None, **runtime_kw: Any) -> PluginRuntime:
    """Register the three hooks with SGLang's HookRegistry (applied by load_plugins afterwards)."""
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global _RUNTIME
    rt = PluginRuntime(settings, targets=targets, policy_file_bytes=policy_file_bytes, **runtime_kw)
    _RUNTIME = rt
    mod, name = targets.policy.rsplit(".", 1)
    base = getattr(pkgutil.resolve_name(mod), name)
    HookRegistry.register(targets.policy, make_policy_class(base), HookType.REPLACE)
    HookRegistry.register(targets.forward, _around_forward, HookType.AROUND)
    HookRegistry.register(targets.result, _after_resolve, HookType.AFTER)
    # tree states: pass-throughs unless the adaptive config asks for a tree
    HookRegistry.register(targets.build, _around_build, HookType.AROUND)
    HookRegistry.register(targets.apply, _before_apply, HookType.BEFORE)
    HookRegistry.register(targets.extend_decode, _around_draft_extend, HookType.AROUND)
    HookRegistry.register(targets.extend_prefill, _around_draft_extend, HookType.AROUND)
    HookRegistry.register(targets.draft, _before_draft, HookType.BEFORE)
    HookRegistry.register(targets.logits_rows, _after_logits_rows, HookType.AFTER)
    HookRegistry.register(targets.trivial_verify, _after_trivial_verify_input, HookType.AFTER)
    if settings.splitkv_verify:
        HookRegistry.register(targets.triton_init, _after_triton_init, HookType.AFTER)
    # fixes of what one SGLang release does and another does itself: registered where the source needs them
    for on, needed, target, hook, already in (
            (settings.draft_extend_graphs, _draft_width_needed, targets.draft_width, _around_draft_width,
             "SPECCTL_DRAFT_EXTEND_GRAPHS=on: this SGLang sizes each state's draft-extend graph from the state's own "
             "width already"),
            (settings.spec_alloc_list, _spec_alloc_reads_scalars, targets.spec_alloc, _around_spec_alloc,
             "SPECCTL_SPEC_ALLOC_LIST=on: this SGLang reads the speculative KV allocation's lengths as one list "
             "already")):
        if on and needed():
            HookRegistry.register(target, hook, HookType.AROUND)
        elif on:
            log.info("specctl: %s; nothing to do", already)
    if settings.fi_verify_host_plan != "off":
        if _sglang_verify_host_plan() is not None:
            _use_sglang_verify_host_plan(settings.fi_verify_host_plan)
        else:
            from .fi_verify_plan import HostPlan

            rt.fi_plan = HostPlan(settings.fi_verify_host_plan, check_steps=settings.fi_verify_check_steps)
            HookRegistry.register(targets.fi_out_graph, _around_fi_out_graph, HookType.AROUND)
            HookRegistry.register(targets.fi_begin_forward, _around_fi_call_begin_forward, HookType.AROUND)
    if settings.host_seq_lens != "off":
        why = _host_lens_problem(settings, targets)
        if why is None:
            from .host_seq_lens import HostSeqLens

            rt.host_lens = HostSeqLens(settings.host_seq_lens, check_steps=settings.host_seq_lens_check_steps)
            HookRegistry.register(targets.fmap_publish, _around_fmap_publish, HookType.AROUND)
            HookRegistry.register(targets.fmap_resolve, _around_fmap_resolve, HookType.AROUND)
        else:  # the default quietly, a setting the operator gave loudly
            (log.warning if settings.host_seq_lens_set else log.info)(
                "specctl: SPECCTL_HOST_SEQ_LENS=%s: %s", settings.host_seq_lens, why)
    if settings.plain_decode or settings.draft_catchup:
        HookRegistry.register(targets.init_graphs, _after_init_graphs, HookType.AFTER)
    if settings.plain_decode:
        HookRegistry.register(targets.verify, _around_verify, HookType.AROUND)
        HookRegistry.register(targets.target_forward, _around_target_forward, HookType.AROUND)
    if settings.draft_catchup:
        HookRegistry.register(targets.extend_decode, _around_extend_catchup, HookType.AROUND)
        HookRegistry.register(targets.draft, _before_draft_catchup, HookType.BEFORE)
        HookRegistry.register(targets.extend_prefill, _after_prefill_catchup, HookType.AFTER)
    return rt


def runtime() -> Optional[PluginRuntime]:
    return _RUNTIME


def _live(part: str) -> Any:
    """The runtime's `part` (plain, catchup, host_lens) while it is on, else None: each hook's first question."""
    obj = getattr(_RUNTIME, part, None)
    return obj if obj is not None and obj.on else None


def _around_forward(orig: Callable[..., Any], worker: Any, *args: Any, **kwargs: Any) -> Any:
    rt = _RUNTIME
    hl = _live("host_lens")
    if hl is not None:
        _host_lens_begin(hl, args, kwargs)
    if rt is None or (rt.timer is None and not rt._wants_ctx()):
        return orig(worker, *args, **kwargs)
    return rt.on_forward(orig, worker, *args, **kwargs)


def _after_resolve(ret: Any, processor: Any, *args: Any, **kwargs: Any) -> None:
    rt = _RUNTIME
    if rt is not None:
        try:
            result = args[0] if args else kwargs["result"]
            batch = args[1] if len(args) > 1 else kwargs["batch"]
            rt.on_result(processor, result, batch)
        except Exception as e:  # noqa: BLE001
            rt.warn_once(f"result hook error: {type(e).__name__}: {e}")
    return None  # keep SGLang's return value


@functools.lru_cache(maxsize=1)
def _sglang_allows_splitkv() -> bool:
    """SGLang's own switch for the kernel (SGLANG_ENABLE_SPLITKV_VERIFY, default on): an operator who
    turned it off gets the extend kernel on CUDA too."""
    try:
        from sglang.srt.environ import envs

        return bool(envs.SGLANG_ENABLE_SPLITKV_VERIFY.get())
    except Exception:  # noqa: BLE001 - a release without the switch: nothing turned it off
        return True


def _after_triton_init(ret: Any, backend: Any, *args: Any, **kwargs: Any) -> None:
    """Every TritonAttnBackend built for a topk-1 chain on CUDA verifies with the split-KV kernel."""
    try:
        if not _sglang_allows_splitkv():
            rt = _RUNTIME
            if rt is not None:
                rt.warn_once("split-KV verify kernel left off: SGLANG_ENABLE_SPLITKV_VERIFY is off", logging.INFO)
            return None
        topk = getattr(backend, "topk", None)
        if isinstance(topk, int) and topk <= 1 and str(getattr(backend, "device", "")).startswith("cuda") \
                and hasattr(backend, "verify_splitkv_fwd"):
            if not getattr(backend, "use_verify_splitkv", False):
                backend.use_verify_splitkv = True
                rt = _RUNTIME
                if rt is not None:
                    rt.warn_once("split-KV verify kernel on for topk-1 verify (SPECCTL_SPLITKV_VERIFY=off: the extend kernel)",
                                 logging.INFO)
    except Exception as e:  # noqa: BLE001 - SGLang's own choice stands
        log.warning("specctl: split-KV verify hook error (%s: %s); SGLang's kernel choice stands", type(e).__name__, e)
    return None


def _sglang_function(module: str, name: str) -> Any:
    """The ast.FunctionDef of a top-level function in the installed SGLang's source, or None (no such module,
    function or file). Read, not imported: the plugin loads before SGLang's speculative modules do, and the
    answers decide which hooks to register."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin:
            return None
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except Exception:  # noqa: BLE001 - an SGLang without it: nothing to fix
        return None
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


@functools.lru_cache(maxsize=1)
def _draft_width_needed() -> bool:
    """Whether this SGLang reads the draft-extend capture width from the startup ServerArgs (0.5.17:
    resolve_num_tokens_per_req takes server_args); 0.5.23 reads it from the spec bag itself."""
    fn = _sglang_function("sglang.srt.speculative.spec_utils", "resolve_num_tokens_per_req")
    return fn is not None and any(x.arg == "server_args" for x in fn.args.args + fn.args.kwonlyargs)


def _around_draft_width(orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND resolve_num_tokens_per_req: a draft-extend graph runner gets the width of the state
    being built (the spec bag's, set by SGLang's _override_worker_state), as 0.5.23 does; outside a
    build the bag holds the launch width, so nothing changes. Chains only: a tree's build sets
    ServerArgs itself (_tree_build_context). Any problem: SGLang's own answer."""
    if kwargs.get("phase") != "draft_extend":
        return orig(*args, **kwargs)
    own = orig(*args, **kwargs)
    try:
        spec = _runtime_context().get_spec()
        n, topk = spec.speculative_num_draft_tokens, spec.speculative_eagle_topk
        if isinstance(n, int) and 1 <= n and (topk or 1) == 1:
            if n != own:
                log.info("specctl: a draft-extend CUDA graph captured at width %d (the state being built), "
                         "not the launch width %d (SPECCTL_DRAFT_EXTEND_GRAPHS)", n, own)
            return n
    except Exception as e:  # noqa: BLE001
        rt = _RUNTIME
        msg = f"draft-extend width hook error ({type(e).__name__}: {e}); SGLang's width stands"
        if rt is not None:
            rt.warn_once(msg)
        else:
            log.warning("specctl: %s", msg)
    return own


@functools.lru_cache(maxsize=1)
def _spec_alloc_reads_scalars() -> bool:
    """Whether this SGLang's alloc_for_spec_decode reads its next lengths one tensor scalar at a time
    (0.5.17: `int(nxt_kv_lens_cpu[i])` in a loop over the requests; 0.5.23 calls .tolist() once) and, at
    page size 1, nowhere else: every other read of nxt_kv_lens_cpu sits in the paged branch (the `else`
    of its `if ... page_size == 1`), which the hook leaves the tensor. Any other shape of the function:
    False (no hook)."""
    import ast

    fn = _sglang_function("sglang.srt.mem_cache.allocation", "alloc_for_spec_decode")
    if fn is None:
        return False
    name = "nxt_kv_lens_cpu"
    reads = {id(n) for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name}
    scalar = {id(n.value) for n in ast.walk(fn) if isinstance(n, ast.Subscript)
              and isinstance(n.value, ast.Name) and n.value.id == name}
    paged: set[int] = set()
    for n in ast.walk(fn):
        if isinstance(n, ast.If) and "page_size" in ast.unparse(n.test) and "== 1" in ast.unparse(n.test):
            paged |= {id(m) for part in n.orelse for m in ast.walk(part)}
            if any(isinstance(m, ast.Name) and m.id == name for part in n.body for m in ast.walk(part)):
                return False
    return bool(scalar) and reads <= scalar | paged


def _around_spec_alloc(orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND eagle_utils.alloc_for_spec_decode (0.5.17): at page size 1 the function reads
    nxt_kv_lens_cpu only in its last loop, `req.kv.kv_allocated_len = max(..., int(nxt_kv_lens_cpu[i]))`,
    so the same values as a list of ints give the same lengths without two ATen calls per request.
    Paged allocators (page size > 1) hand the tensor to the allocator: unchanged. Any problem: the call
    as SGLang made it."""
    nxt = kwargs.get("nxt_kv_lens_cpu")
    try:
        tree_cache = args[0] if args else kwargs["tree_cache"]
        if nxt is not None and hasattr(nxt, "tolist") and tree_cache.token_to_kv_pool_allocator.page_size == 1:
            kwargs["nxt_kv_lens_cpu"] = nxt.tolist()  # this call's own kwargs dict
    except Exception as e:  # noqa: BLE001 - the list is stored last: SGLang's own arguments stand
        rt = _RUNTIME
        msg = f"speculative KV allocation hook error ({type(e).__name__}: {e}); SGLang's loop stands"
        if rt is not None:
            rt.warn_once(msg)
        else:
            log.warning("specctl: %s", msg)
    return orig(*args, **kwargs)


SGLANG_VERIFY_HOST_PLAN = "SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN"


def _sglang_verify_host_plan() -> Any:
    """SGLang's own switch for the host-built verify plan (0.5.23: an EnvBool), or None where it has none."""
    try:
        from sglang.srt.environ import envs

        return getattr(envs, SGLANG_VERIFY_HOST_PLAN, None)
    except Exception:  # noqa: BLE001 - a release without the environ module: none
        return None


def _use_sglang_verify_host_plan(mode: str) -> None:
    """SPECCTL_FI_VERIFY_HOST_PLAN on an SGLang that has its own: turn that on, unless the operator set it."""
    field = _sglang_verify_host_plan()
    if field.is_set():
        log.info("specctl: SPECCTL_FI_VERIFY_HOST_PLAN=%s: %s is set (%s) and stays as set; no plugin hook",
                 mode, SGLANG_VERIFY_HOST_PLAN, field.get())
        return
    field.set(True)
    unchecked = "; its plan is not self-checked (check mode compares plans on SGLang 0.5.17 only)"
    log.info("specctl: SPECCTL_FI_VERIFY_HOST_PLAN=%s: turned on this SGLang's own %s (no plugin hook)%s",
             mode, SGLANG_VERIFY_HOST_PLAN, unchecked if mode == "check" else "")


def _around_fi_out_graph(orig: Callable[..., Any], backend: Any, *args: Any, **kwargs: Any) -> Any:
    rt = _RUNTIME
    hp = rt.fi_plan if rt is not None else None
    if hp is None:
        return orig(backend, *args, **kwargs)
    if not hp.wired:
        rt.check_fi_hooks()
    return hp.around_out_graph(orig, backend, args, kwargs)


def _around_fi_call_begin_forward(orig: Callable[..., Any], updater: Any, *args: Any, **kwargs: Any) -> Any:
    rt = _RUNTIME
    hp = rt.fi_plan if rt is not None else None
    if hp is None:
        return orig(updater, *args, **kwargs)
    return hp.around_call_begin_forward(orig, updater, args, kwargs)


def _after_init_graphs(ret: Any, worker: Any, *args: Any, **kwargs: Any) -> None:
    rt = _RUNTIME
    if rt is None:
        return None
    if rt.settings.plain_decode:
        try:
            rt.build_plain(worker)
        except Exception as e:  # noqa: BLE001 - the server starts without it
            rt.plain = None
            log.exception("specctl: no decode state (%s: %s)", type(e).__name__, e)
    if rt.settings.draft_catchup:
        try:
            rt.build_catchup(worker)
        except Exception as e:  # noqa: BLE001 - the server starts without it: steps 0 extends every step
            rt.catchup = None
            log.exception("specctl: no draft catch-up (%s: %s)", type(e).__name__, e)
    return None


def _around_extend_catchup(orig: Callable[..., Any], draft_worker: Any, *args: Any, **kwargs: Any) -> Any:
    cu = _live("catchup")
    if cu is None:
        return orig(draft_worker, *args, **kwargs)
    batch, args, rest = _first_arg(args, kwargs, "batch")
    result, args, rest = _first_arg(args, rest, "batch_result")
    return cu.around_extend(orig, draft_worker, batch, result, args, rest)


def _before_draft_catchup(draft_worker: Any, *args: Any, **kwargs: Any) -> None:
    cu = _live("catchup")
    if cu is not None:
        cu.before_draft(draft_worker, args[0] if args else kwargs["batch"])
    return None


def _after_prefill_catchup(ret: Any, draft_worker: Any, *args: Any, **kwargs: Any) -> None:
    cu = _live("catchup")
    if cu is not None:
        cu.after_prefill(args[0] if args else kwargs["batch"])
    return None  # keep SGLang's return value


def _after_trivial_verify_input(ret: Any, worker: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER EAGLEWorkerV2._build_trivial_verify_input: the 1-node tree's token is the previous bonus
    token, which is int32 when it comes straight from the sampler (a prefill's, or a steps-0 step's,
    without the overlap scheduler; the overlap scheduler's FutureMap hands back int64), and SGLang's
    verify_tree_greedy refuses anything but int64 ("Expected 'candidates' to be of type long": the
    first steps-0 step after a prefill crashed the scheduler on the H200, 2026-12-02). The same ids
    as int64: a no-op where they are int64 already, the same on every rank."""
    tok = getattr(ret, "draft_token", None)
    if tok is not None and hasattr(tok, "long"):
        ret.draft_token = tok.long()  # the same tensor where it is int64 already
    return None  # keep SGLang's return value (changed in place)


def _around_verify(orig: Callable[..., Any], worker: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    plain = _live("plain")
    if plain is None or worker.speculative_num_steps != 0:
        return orig(worker, batch, *args, **kwargs)
    from . import plain_decode

    plain.planned = None
    out = plain_decode.around_verify(plain, orig, worker, batch, args, kwargs)
    hl = _live("host_lens")
    if hl is not None and plain.planned is not None and plain.ran and plain.on:
        try:
            hl.on_decode_step(*plain.planned)
        except Exception as e:  # noqa: BLE001 - the next step pulls its lengths as SGLang does
            hl.turn_off(f"{type(e).__name__}: {e}")
    return out


def _host_lens_begin(hl: Any, args: tuple, kwargs: dict) -> None:
    """SPECCTL_HOST_SEQ_LENS: the rows of the forward starting, and a prefill's lengths (an EXTEND batch's host
    and device lengths come from one list: ScheduleBatch.prepare_for_extend), for the publish inside it."""
    try:
        batch = args[0] if args else kwargs["batch"]
        mode = batch.forward_mode
        prefill = getattr(mode, "name", None) == "EXTEND"
        hl.begin_forward(batch.req_pool_indices_cpu, batch.seq_lens_cpu if prefill else None)
    except Exception as e:  # noqa: BLE001 - the next step pulls its lengths as SGLang does
        hl.turn_off(f"{type(e).__name__}: {e}")


def _host_lens_problem(settings: PluginSettings, targets: Targets) -> Optional[str]:
    """Why SPECCTL_HOST_SEQ_LENS cannot apply here, or None."""
    if not settings.plain_decode:
        return "it keeps the decode state's lengths, and SPECCTL_PLAIN_DECODE is off; nothing done"
    import pkgutil

    from .host_seq_lens import supported

    mod, cls, name = targets.fmap_resolve.rsplit(".", 2)
    try:
        resolve = getattr(getattr(pkgutil.resolve_name(mod), cls), name)
    except Exception as e:  # noqa: BLE001
        return f"{targets.fmap_resolve} not found ({type(e).__name__}: {e}); nothing done"
    return supported(resolve)


def _first_arg(args: tuple, kwargs: dict, name: str) -> tuple[Any, tuple, dict]:
    """A hooked method's first argument after self, passed by position or as `name`; the rest as they came."""
    if args:
        return args[0], args[1:], kwargs
    rest = dict(kwargs)
    return rest.pop(name), args, rest


@functools.lru_cache(maxsize=1)
def _overlap_debug_assert() -> bool:
    """SGLang's FutureMap debug mode poisons rows as it consumes them: the host copy stays out of its way (a
    module constant, read from the environment at its import: read once)."""
    try:
        from sglang.srt.managers import overlap_utils

        return bool(getattr(overlap_utils, "_DEBUG_ASSERT", False))
    except Exception:  # noqa: BLE001
        return True


def _around_fmap_publish(orig: Callable[..., Any], fmap: Any, *args: Any, **kwargs: Any) -> Any:
    hl = _live("host_lens")
    if hl is None:
        return orig(fmap, *args, **kwargs)
    from .host_seq_lens import around_publish

    indices, args, rest = _first_arg(args, kwargs, "future_indices")
    return around_publish(hl, orig, fmap, indices, *args, **rest)


def _around_fmap_resolve(orig: Callable[..., Any], fmap: Any, *args: Any, **kwargs: Any) -> Any:
    hl = _live("host_lens")
    if hl is None:
        return orig(fmap, *args, **kwargs)
    from .host_seq_lens import around_resolve

    batch, args, rest = _first_arg(args, kwargs, "batch")
    return around_resolve(hl, _overlap_debug_assert, orig, fmap, batch, *args, **rest)


def _around_target_forward(orig: Callable[..., Any], target_worker: Any, *args: Any, **kwargs: Any) -> Any:
    rt = _RUNTIME
    plain = rt.plain if rt is not None else None
    if plain is None or plain.pending is None or not kwargs.get("is_verify"):
        return orig(target_worker, *args, **kwargs)
    from . import plain_decode

    return plain_decode.around_target_forward(plain, orig, target_worker, args, kwargs)


def _around_build(orig: Callable[..., Any], worker: Any, *args: Any, **kwargs: Any) -> Any:
    rt = _RUNTIME
    if rt is None or not rt.trees:
        return orig(worker, *args, **kwargs)
    return rt.build_state(orig, worker, args, kwargs)


def _before_apply(worker: Any, *args: Any, **kwargs: Any) -> None:
    rt = _RUNTIME
    if rt is not None and rt.trees:
        # not guarded: running a state with the wrong topk would be worse than an error here
        rt.before_apply(worker, args[0] if args else kwargs["state"])
    return None


def _around_draft_extend(orig: Callable[..., Any], draft_worker: Any, *args: Any, **kwargs: Any) -> Any:
    """The next step's draft input is always max_topk wide, whichever state runs now."""
    rt = _RUNTIME
    width = rt.max_topk if rt is not None else 1
    own = draft_worker.topk
    if width <= own:
        return orig(draft_worker, *args, **kwargs)
    draft_worker.topk = width
    try:
        return orig(draft_worker, *args, **kwargs)
    finally:
        draft_worker.topk = own


def _before_draft(draft_worker: Any, *args: Any, **kwargs: Any) -> None:
    """A chain (or a narrower tree) drafts from the first columns of the wide top-k: column 0 is
    the argmax the chain would have taken itself."""
    rt = _RUNTIME
    if rt is None or rt.max_topk <= 1:
        return None
    batch = args[0] if args else kwargs["batch"]
    info = batch.spec_info
    idx = getattr(info, "topk_index", None)
    k = draft_worker.topk
    if idx is not None and idx.dim() == 2 and idx.shape[1] > k:
        info.topk_index = idx[:, :k].contiguous()
        info.topk_p = info.topk_p[:, :k].contiguous()
    return None


def _after_logits_rows(ret: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    rt = _RUNTIME
    if rt is None:
        return None
    try:
        return rt.tree_logits_rows(runner, int(ret))
    except Exception as e:  # noqa: BLE001 - SGLang's own sizing stands; a tree graph may then fail
        rt.warn_once(f"logits-rows hook error: {type(e).__name__}: {e}")
        return None


@contextmanager
def _tree_build_context(worker: Any, topk: int, n: int) -> Iterator[None]:
    """What a tree build must see, undone afterwards: topk on both workers and in the spec bag
    (backends and 0.5.23's graph runners read it there), and topk and width in ServerArgs, where
    0.5.17's draft graph runners read them (through its sanctioned override(), provenance kept)."""
    rc = _runtime_context()
    dw = worker._draft_worker
    own = (worker.topk, dw.topk)
    bag_topk = rc.get_spec().speculative_eagle_topk
    args = {}
    for sa in (rc.get_server_args(), getattr(worker, "server_args", None),
               getattr(getattr(dw, "draft_runner", None), "server_args", None),
               getattr(getattr(getattr(worker, "_target_worker", None), "model_runner", None), "server_args", None)):
        if sa is not None and hasattr(sa, "override"):
            args[id(sa)] = (sa, sa.speculative_eagle_topk, sa.speculative_num_draft_tokens)
    try:
        worker.topk = dw.topk = topk
        _set_bag_topk("specctl.tree_build", topk)
        for sa, _, _ in args.values():
            sa.override("specctl.tree_build", speculative_eagle_topk=topk, speculative_num_draft_tokens=n)
        yield
    finally:  # the workers first: a failed build is retried as a chain, which must see topk 1
        worker.topk, dw.topk = own
        for sa, k0, n0 in args.values():
            sa.override("specctl.tree_build_restore", speculative_eagle_topk=k0, speculative_num_draft_tokens=n0)
        _set_bag_topk("specctl.tree_build_restore", bag_topk)


def _set_bag_topk(source: str, topk: int) -> None:
    _runtime_context().get_context().override(source, speculative_eagle_topk=topk)


def _capture_sizes(runner: Any, width: int) -> list[int]:
    """The decode batch sizes SGLang captures graphs for at this width (what sizes the buffer)."""
    from sglang.srt.model_executor import model_runner as mr_mod

    return list(mr_mod.get_batch_sizes_to_capture(runner, width)[0])


def _runtime_context() -> Any:
    """sglang.srt.runtime_context (get_context / get_spec / get_server_args); the CPU tests put a
    stand-in here, since the real module needs transformers and a published server config."""
    from sglang.srt import runtime_context

    return runtime_context


def _env_flag(name: str) -> bool:
    import os

    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _sglang_tp_group() -> Any:
    import warnings

    from sglang.srt.distributed.parallel_state import get_tp_group

    with warnings.catch_warnings():
        # 0.5.22+ deprecate it for get_parallel().tp_group, which it returns; 0.5.17 has only this
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return get_tp_group()
        except (AssertionError, RuntimeError):  # 0.5.17 asserts; 0.5.23 raises RuntimeError
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                raise  # other ranks exist but this one cannot name its group: fail safe
            return _SingleProcess()  # no process group at all: there are no other ranks


class _SingleProcess:
    """The TP group of a process with no torch.distributed at all (one rank, nothing to sync)."""

    rank_in_group = 0
    world_size = 1


def _default_timer() -> Any:
    try:
        import torch

        if torch.cuda.is_available():
            return CudaEventTimer(torch)
    except Exception:  # noqa: BLE001
        pass
    return CpuTimer()
