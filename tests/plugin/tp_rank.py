"""One TP rank for test_sglang_cpu.py's 2-process test: SGLang's real GroupCoordinator on gloo
(with its shared-memory MessageQueue broadcaster, SGLang's default), the plugin loaded through
load_plugins(), the stand-in worker around SGLang's AdaptiveController, 3000 decode steps.

usage: tp_rank.py RANK WORLD PORT POLICY_ENDPOINT OUTDIR
"""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

rank, world, port, endpoint, outdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
# rank 0 sends telemetry (to no one: a PUSH drops), so it reads each batch's context for that alone while
# the other rank reads it only where the policy decides by it: their decisions must agree anyway
os.environ.update({"SPECCTL_POLICY": endpoint,
                   "SPECCTL_TELEMETRY": f"ipc://{outdir}/telemetry.sock" if rank == 0 else "none",
                   "SPECCTL_SERVER_ID": "tp-test", "SPECCTL_STALE_AFTER_S": "30"})

import torch.distributed as dist  # noqa: E402
import sglang.srt.distributed.parallel_state as ps  # noqa: E402

ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                distributed_init_method=f"tcp://127.0.0.1:{port}")
tp = ps.init_model_parallel_group([list(range(world))], rank, "gloo", use_pynccl=False,
                                  use_custom_allreduce=False, use_message_queue_broadcaster=True,
                                  group_name="tp")


def run_scheduler_process():
    from sglang.srt.plugins import load_plugins

    load_plugins()


run_scheduler_process()

from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402

import dataclasses  # noqa: E402

from specctl.plugin import runtime as plugin_runtime  # noqa: E402
from specctl.plugin import sglang_source  # noqa: E402

# make `tp` SGLang's TP group, where the plugin's default accessor looks for it
ps._TP = tp  # <= 0.5.19: get_tp_group() returns this module global
try:
    found = sglang_source.tp_group()
except RuntimeError:  # 0.5.22+: it reads the runtime context, not written yet
    found = None
if found is not tp:
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_group=tp)
assert sglang_source.tp_group() is tp
rt = plugin_runtime.current()
rt.settings = dataclasses.replace(rt.settings, sync_every=8)  # a TP broadcast every 8 results (16 in a server)
spec = importlib.util.spec_from_file_location("specctl_sglang_standin", Path(__file__).with_name("sglang_standin.py"))
st = importlib.util.module_from_spec(spec)
sys.modules["specctl_sglang_standin"] = st
spec.loader.exec_module(st)
HookRegistry.register("specctl_sglang_standin.EAGLEWorkerV2Standin.forward_batch_generation",
                      plugin_runtime.around_forward, HookType.AROUND)
HookRegistry.register("specctl_sglang_standin.ResultProcessorStandin._resolve_spec_v2_tokens",
                      plugin_runtime.after_resolve, HookType.AFTER)
HookRegistry.apply_hooks()

cfg = outdir / f"adaptive{rank}.json"
cfg.write_text(json.dumps({"1": {"candidate_steps": [0, 1, 3]}}))
worker = st.EAGLEWorkerV2Standin(3, str(cfg), lambda it, bs, steps: [min(steps, (it + i) % 3) for i in range(bs)])
worker.init_cuda_graphs([1, 2, 4, 8, 16, 32])
eng = worker.adaptive_controller.params.specctl
assert eng.rank == rank, (eng.rank, rank)

bcast_ns = []
_bcast = rt._broadcast


def timed_broadcast(obj):
    t0 = time.perf_counter_ns()
    try:
        return _bcast(obj)
    finally:
        bcast_ns.append(time.perf_counter_ns() - t0)


rt._broadcast = timed_broadcast
dist.barrier(group=tp.cpu_group)
if rank == 0:
    (outdir / "running").write_text("1")
sizes = [(i * 7) % 13 + 1 for i in range(3000)]
versions = []


def between(it):
    versions.append(eng.active_version)
    time.sleep(0.001)


def ctx_of(it, bs):  # ~300 context tokens a request for 40 batches, then ~6000: every rank sees the same
    return [(300 if (it // 40) % 2 == 0 else 6000) + (i * 13) % 41 for i in range(bs)]


st.run_decode(worker, st.ResultProcessorStandin(worker), sizes, between=between, ctx_of=ctx_of)
dist.barrier(group=tp.cpu_group)
steps = [worker.used[i][1] for i in range(len(sizes))]
(outdir / f"rank{rank}.json").write_text(json.dumps({
    "steps": steps, "versions": versions, "sizes": sizes, "receiver": rt.receiver is not None,
    "ctx": [sum(ctx_of(i, bs)) for i, bs in enumerate(sizes)],
    "status": eng.status(), "broadcast_us_median": sorted(bcast_ns)[len(bcast_ns) // 2] / 1000,
    "num_broadcasts": len(bcast_ns)}))
print(f"rank {rank}: {eng.status()}; {len(bcast_ns)} broadcasts, median "
      f"{sorted(bcast_ns)[len(bcast_ns) // 2] / 1000:.1f} us", flush=True)
# Leave without the interpreter's teardown: the group's gloo and message-queue threads are still joinable then,
# and their C++ destructors can abort ("terminate called without an active exception": seen once in
# `.ci/run` on 2026-12-03) after everything this rank had to say is written
sys.stdout.flush()
os._exit(0)
