"""One TP rank for test_plain_decode.py's 2-process test: SGLang's real GroupCoordinator on gloo,
the plugin runtime building the decode state on a stand-in worker; rank FAIL_RANK's capture fails
(an out-of-memory, as a real capture can) -> OUTDIR/plain-rank<R>.json says whether this rank runs it.

usage: tp_plain_rank.py RANK WORLD PORT FAIL_RANK OUTDIR   (FAIL_RANK -1: no rank fails)
"""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

rank, world, port, fail_rank, outdir = (int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                        Path(sys.argv[5]))

import sglang.srt.distributed.parallel_state as ps  # noqa: E402

ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                distributed_init_method=f"tcp://127.0.0.1:{port}")
tp = ps.init_model_parallel_group([list(range(world))], rank, "gloo", use_pynccl=False,
                                  use_custom_allreduce=False, use_message_queue_broadcaster=True,
                                  group_name="tp")

from specctl.plugin import sglang_hooks  # noqa: E402
from specctl.plugin.patches import plain_decode  # noqa: E402
from specctl.plugin.settings import PluginSettings  # noqa: E402


def capture(worker, backends, **kw):
    if rank == fail_rank:
        raise MemoryError(f"stand-in capture out of memory on rank {rank}")
    return plain_decode.PlainDecode(runner=SimpleNamespace(max_bs=64), backend="decode-backend",
                                    forward_batch=None, decode_mode=None, full_hidden=None, **kw)


plain_decode._capture = capture
mr = SimpleNamespace(sliding_window_size=None, token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: None),
                     model_config=SimpleNamespace(), req_to_token_pool=SimpleNamespace(),
                     hisparse_coordinator=None, watermark_state=None)
worker = SimpleNamespace(adaptive_controller=SimpleNamespace(_states={0: object(), 3: object()}),
                         speculative_algorithm=SimpleNamespace(name="EAGLE3"), topk=1,
                         server_args=SimpleNamespace(pp_size=1), _target_worker=SimpleNamespace(model_runner=mr))
settings = PluginSettings(telemetry_endpoint=None, policy_endpoint=None)
rt = sglang_hooks.PluginRuntime(settings, tp_group_fn=lambda: tp, patches=[plain_decode.patch])
rt.hooks_checked = True  # the hooks are not registered here: whether they took effect is test_plain_decode's concern
rt.build_plain(worker)
import torch.distributed as dist  # noqa: E402

dist.barrier(group=tp.cpu_group)  # neither rank leaves the group while the other still uses it
(outdir / f"plain-rank{rank}.json").write_text(json.dumps({"rank": rank, "built": rt.plain is not None}))
# Leave without the interpreter's teardown: the group's gloo and message-queue threads are still joinable then,
# and their C++ destructors can abort ("terminate called without an active exception": seen once in
# `.ci/run` on 2026-12-03) after everything this rank had to say is written
sys.stdout.flush()
os._exit(0)
