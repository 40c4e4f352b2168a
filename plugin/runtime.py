"""The seam between SGLang and the EngineController: transport, TP sync, telemetry, context reads, start-up checks.

    REPLACE AdaptiveSpeculativeParams -> plugin/policy.py; AROUND forward_batch_generation: step time and the
    batch's context; AFTER _resolve_spec_v2_tokens: telemetry (rank 0) and, every SYNC_EVERY results, rank 0's
    pending policy broadcast on the TP group and applied. The SGLang patches (plugin/patches/) run behind the guard.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from ..policies.table import Config, config_name
from . import sglang_source
from .engine import EngineController
from .guard import Guard, Patch, tp_agree
from .settings import PluginSettings
from .timers import default_timer

log = logging.getLogger("specctl.plugin")
TREE_PATCHES = ("trees", "trees.width")


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
    # flashinfer prefill (EXTEND) plans from host lengths only
    fi_init_metadata: str = "sglang.srt.layers.attention.flashinfer_backend.FlashInferAttnBackend.init_forward_metadata"
    # the decode state's lengths on the host only (0.5.17)
    fmap_publish: str = "sglang.srt.managers.overlap_utils.FutureMap.publish"
    fmap_resolve: str = "sglang.srt.managers.overlap_utils.FutureMap.resolve_seq_lens_cpu"

    def fi_plan_targets(self) -> tuple[str, ...]:
        return (self.fi_out_graph, self.fi_begin_forward)

    def host_lens_targets(self) -> tuple[str, ...]:
        return (self.fmap_publish, self.fmap_resolve)


SGLANG_TARGETS = Targets()


class PluginRuntime:
    """Process-wide plugin state: settings, transport (rank 0), TP group, timer, the engine."""

    def __init__(self, settings: PluginSettings, *, targets: Targets = SGLANG_TARGETS,
                 policy_file_bytes: Optional[bytes] = None,
                 tp_group_fn: Optional[Callable[[], Any]] = None,
                 zmq_context: Any = None, timer: Any = None,
                 clock: Callable[[], float] = time.monotonic,
                 patches: Iterable[Callable[["PluginRuntime"], Optional[Patch]]] = ()):
        self.settings = settings
        self.targets = targets
        self.policy_file_bytes = policy_file_bytes
        self.tp_group_fn = tp_group_fn or sglang_source.tp_group
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
        self.hooks_checked = False
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
        self._engine_failure: Optional[str] = None  # a must-run patch failed before the engine existed
        self._started = False  # the start-up line is logged once
        # the batch's context, read by the forward hook for get_steps_for_batch: (batch size, ctx_tokens)
        self._ctx_pending: Optional[tuple[int, int]] = None
        self._ctx_get: Optional[Callable[[Any], int]] = None  # per-request committed length, by version
        # the SGLang patches (plugin/patches/), each behind the guard; built last: a factory may read the above
        self.guard = Guard(p for p in (make(self) for make in patches) if p is not None)

    # what the patches built, where they are on (each hook asks `live(name)`)
    plain = property(lambda self: self._part("plain_decode"))
    catchup = property(lambda self: self._part("catchup"))
    fi_plan = property(lambda self: self._part("fi_plan"))
    host_lens = property(lambda self: self._part("host_lens"))
    fi_extend = property(lambda self: self._part("fi_extend"))

    def _part(self, name: str) -> Any:
        p = self.guard.get(name)
        return None if p is None else p.obj

    # ---------------------------------------------------------------- start-up

    def new_engine(self, candidate_steps: list[int],
                   trees: Optional[dict[int, Config]] = None) -> EngineController:
        """Called from SpecctlSpeculativeParams.__init__ (worker construction, after load_plugins
        applied the hooks and after the TP group exists, before SGLang builds its runtime states)."""
        usable = self._usable_trees(dict(trees or {}), candidate_steps)
        try:
            group = self.tp_group_fn()
            rank, world = int(getattr(group, "rank_in_group", 0)), int(getattr(group, "world_size", 1))
            no_group = None
        except Exception as e:  # noqa: BLE001
            group, rank, world = None, 0, 1
            no_group = f"no TP group ({type(e).__name__}: {e})"
        # may raise (a bad tree configuration, no candidate steps): nothing of this call is published before
        eng = EngineController(self.settings, candidate_steps=candidate_steps, states=usable,
                               clock=self.clock, rank=rank, initial_policy=self.policy_file_bytes)
        self.tp_group, self.rank, self.world_size = group, rank, world
        self.set_trees(usable)
        self.engine = eng
        if self._engine_failure is not None:
            eng.fail(self._engine_failure)
        if no_group is not None:
            # Without the group this process cannot tell its rank: every rank would think it is
            # rank 0 and apply policies at its own pace. The fixed fallback is the same everywhere.
            self.sync_on = False
            eng.fail(f"{no_group}; fixed-threshold policy on every rank")
        elif self.rank == 0:
            self._open_transport()
        if self.timer is None and self.rank == 0 and self.telemetry_on:
            self.timer = default_timer()
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
        tree_patches = [p for p in map(self.guard.get, TREE_PATCHES) if p is not None]
        why = None if tree_patches else "the tree patches are not installed"
        if why is not None:
            pass
        elif self.missing_hooks is None:
            why = "SGLang's hook registry could not be read, so the tree hooks are unverified"
        elif any(not p.on for p in tree_patches):
            missing = [t for p in tree_patches for t in dict.fromkeys(p.targets()) if t in self.missing_hooks]
            why = f"the tree hooks on {', '.join(missing) or '?'} did not take effect"
        elif not set(trees) <= set(candidate_steps):
            why = f"the adaptive config's slots do not list steps {sorted(set(trees) - set(candidate_steps))}"
        elif self.settings.skip_zero_step_draft_extend:
            why = ("SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND is set: its stub draft input is as wide as "
                   "the state's topk, not the tree's")
        if why:
            log.error("specctl: tree states %s NOT built: %s; SGLang builds steps %s as chains and "
                      "policies naming the trees are refused", names, why, sorted(trees))
            return {}
        log.info("specctl: tree states %s will be built beside the chains (launch topk 1)", names)
        return trees

    # ---------------------------------------------------------------- tree states

    def set_trees(self, trees: dict[int, Config]) -> None:
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
        """SGLang only logs a hook it could not apply: say which of ours are missing and turn off each patch
        missing one (the tree hooks only matter, and are only checked, when the adaptive config asks for trees)."""
        self.hooks_checked = True
        try:
            from sglang.srt.plugins.hook_registry import HookRegistry

            patched: Optional[set[str]] = set(HookRegistry._patched)
        except Exception as e:  # noqa: BLE001
            patched = None
            self.hook_problems = [f"cannot read SGLang's hook registry ({type(e).__name__}: {e})"]
            log.error("specctl: %s: hooks unverified", self.hook_problems[0])
        seam = {
            self.targets.policy: "specctl is not deciding anything (SGLang's own policy runs)",
            self.targets.forward: "no CUDA-event step time; step_ms falls back to the launch cadence",
            self.targets.result: ("no telemetry and no TP policy sync: daemon policies never apply "
                                  "(fallback, or the policy file)"),
        }
        skip = () if tree_hooks else TREE_PATCHES
        by_patch = self.guard.check(patched, skip=skip)
        if patched is None:
            self.missing_hooks = None
            return self.hook_problems
        missing = {t: why for t, why in seam.items() if t not in patched}
        for name, ts in by_patch.items():
            for t in ts:
                missing.setdefault(t, self.guard.patches[name].lost)
        self.missing_hooks = set(missing)
        self.hook_problems = [f"hook on {t} did not take effect: {why}" for t, why in missing.items()]
        for p in self.hook_problems:
            log.error("specctl: %s (SGLang logged the cause above as 'Failed to apply hooks')", p)
        if not self.hook_problems:
            n = len(seam) + sum(len(p.hooks) for name, p in self.guard.patches.items() if name not in skip)
            log.info("specctl: all %d hooks in place", n)
        return self.hook_problems

    def fail_engine(self, reason: str) -> None:
        """A patch that cannot be skipped failed: the engine's fixed policy (chains only) from now on."""
        if self.engine is not None:
            self.engine.fail(reason)
        elif self._engine_failure is None:
            self._engine_failure = reason

    # ---------------------------------------------------------------- patches built after the CUDA graphs

    def _group(self) -> Any:
        if self.tp_group is not None:
            return self.tp_group
        try:  # the policy object (which finds the group) was never built
            return self.tp_group_fn()
        except Exception:  # noqa: BLE001 - no group: a single process
            return sglang_source.SingleProcess()

    def build_plain(self, worker: Any) -> None:
        """AFTER init_cuda_graphs (every TP rank): the decode state, on every rank or on none."""
        from .patches import plain_decode

        p = self.guard.get(plain_decode.NAME)
        if p is None:
            return
        if not self.hooks_checked:
            self.check_hooks()
        agree = tp_agree(self._group())
        if not p.on:
            agree(False)  # the ranks agree all the same: every rank takes part in the same collective
            return
        kinds = plain_decode.backends(self.settings.plain_decode_flashinfer, self.settings.plain_decode_fa3)
        plain_decode.build(worker, agree=agree, backends=kinds, patch=p, logprobs=self.settings.plain_decode_logprobs)

    def build_catchup(self, worker: Any) -> None:
        """AFTER init_cuda_graphs (every TP rank): the draft catch-up. Nothing collective: every rank reaches the
        same answer from the same launch."""
        from .patches import catchup, plain_decode

        p = self.guard.get(catchup.NAME)
        if p is None:
            return
        if not self.hooks_checked:
            self.check_hooks()
        if p.on:
            catchup.build(worker, k=self.settings.draft_catchup, trees=bool(self.trees),
                          plain_reason=plain_decode.unsupported_reason(worker),
                          skip_zero_extend=self.settings.skip_zero_step_draft_extend, patch=p)

    def log_startup(self) -> None:
        """Once per process, on every rank, after the start-up checks: `specctl: startup {json}` (specctl doctor)."""
        if self._started:
            return
        self._started = True
        if not self.hooks_checked:
            self.check_hooks(tree_hooks=bool(self.trees))
        eng = self.engine
        line = {"server": self.settings.server_id, "rank": self.rank, "world_size": self.world_size,
                "sglang": sglang_source.version(), "mode": self.settings.mode,
                "hooks_missing": None if self.missing_hooks is None else sorted(self.missing_hooks),
                "patches": self.guard.status(),
                "policy": {"source": None if eng is None else eng.active_source,
                           "version": None if eng is None else eng.active_version,
                           "fallback_reason": "no engine: SGLang's own policy decides" if eng is None
                           else eng.fallback_reason}}
        log.info("specctl: startup %s", json.dumps(line, sort_keys=True))

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
            self.log_startup()  # idle: no decode-state build announced the start-up
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

_RUNTIME: Optional[PluginRuntime] = None


def current() -> Optional[PluginRuntime]:
    """The process's runtime, once install() has built it completely."""
    return _RUNTIME


def publish(rt: Optional[PluginRuntime]) -> None:
    global _RUNTIME
    _RUNTIME = rt


def live(part: str) -> Any:
    """The runtime's `part` (plain, catchup, host_lens, fi_plan, fi_extend) while it is on, else None."""
    obj = getattr(_RUNTIME, part, None)
    return obj if obj is not None and obj.on else None


def first_arg(args: tuple, kwargs: dict, name: str) -> tuple[Any, tuple, dict]:
    """A hooked method's first argument after self, passed by position or as `name`; the rest as they came."""
    if args:
        return args[0], args[1:], kwargs
    rest = dict(kwargs)
    return rest.pop(name), args, rest


def around_forward(orig: Callable[..., Any], worker: Any, *args: Any, **kwargs: Any) -> Any:
    rt = _RUNTIME
    if rt is None or (rt.timer is None and not rt._wants_ctx()):
        return orig(worker, *args, **kwargs)
    return rt.on_forward(orig, worker, *args, **kwargs)


def after_resolve(ret: Any, processor: Any, *args: Any, **kwargs: Any) -> None:
    rt = _RUNTIME
    if rt is not None:
        try:
            result = args[0] if args else kwargs["result"]
            batch = args[1] if len(args) > 1 else kwargs["batch"]
            rt.on_result(processor, result, batch)
        except Exception as e:  # noqa: BLE001
            rt.warn_once(f"result hook error: {type(e).__name__}: {e}")
    return None  # keep SGLang's return value


def after_init_graphs(ret: Any, worker: Any, *args: Any, **kwargs: Any) -> None:
    """Registered after every patch's own: the patches are built, the start-up line can say what is true."""
    rt = _RUNTIME
    if rt is not None:
        try:
            rt.log_startup()
        except Exception as e:  # noqa: BLE001 - a diagnostic line: never a reason to stop the server
            log.warning("specctl: no start-up line (%s: %s)", type(e).__name__, e)
    return None
