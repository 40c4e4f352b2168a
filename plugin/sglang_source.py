"""What the installed SGLang offers, read where the plugin needs it: its source (with `ast`, before its modules
load), its switches, its runtime context and its TP group."""

from __future__ import annotations

import functools
from typing import Any


def sglang_function(module: str, name: str) -> Any:
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
def draft_width_needed() -> bool:
    """Whether this SGLang reads the draft-extend capture width from the startup ServerArgs (0.5.17:
    resolve_num_tokens_per_req takes server_args); 0.5.23 reads it from the spec bag itself."""
    fn = sglang_function("sglang.srt.speculative.spec_utils", "resolve_num_tokens_per_req")
    return fn is not None and any(x.arg == "server_args" for x in fn.args.args + fn.args.kwonlyargs)



@functools.lru_cache(maxsize=1)
def spec_alloc_reads_scalars() -> bool:
    """Whether this SGLang's alloc_for_spec_decode reads its next lengths one tensor scalar at a time
    (0.5.17: `int(nxt_kv_lens_cpu[i])` in a loop over the requests; 0.5.23 calls .tolist() once) and, at
    page size 1, nowhere else: every other read of nxt_kv_lens_cpu sits in the paged branch (the `else`
    of its `if ... page_size == 1`), which the hook leaves the tensor. Any other shape of the function:
    False (no hook)."""
    import ast

    fn = sglang_function("sglang.srt.mem_cache.allocation", "alloc_for_spec_decode")
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



@functools.lru_cache(maxsize=1)
def allows_splitkv() -> bool:
    """SGLang's own switch for the kernel (SGLANG_ENABLE_SPLITKV_VERIFY, default on): an operator who
    turned it off gets the extend kernel on CUDA too."""
    try:
        from sglang.srt.environ import envs

        return bool(envs.SGLANG_ENABLE_SPLITKV_VERIFY.get())
    except Exception:  # noqa: BLE001 - a release without the switch: nothing turned it off
        return True



SGLANG_VERIFY_HOST_PLAN = "SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN"


def verify_host_plan_switch() -> Any:
    """SGLang's own switch for the host-built verify plan (0.5.23: an EnvBool), or None where it has none."""
    try:
        from sglang.srt.environ import envs

        return getattr(envs, SGLANG_VERIFY_HOST_PLAN, None)
    except Exception:  # noqa: BLE001 - a release without the environ module: none
        return None



@functools.lru_cache(maxsize=1)
def overlap_debug_assert() -> bool:
    """SGLang's FutureMap debug mode poisons rows as it consumes them: the host copy stays out of its way (a
    module constant, read from the environment at its import: read once)."""
    try:
        from sglang.srt.managers import overlap_utils

        return bool(getattr(overlap_utils, "_DEBUG_ASSERT", False))
    except Exception:  # noqa: BLE001
        return True



def runtime_context() -> Any:
    """sglang.srt.runtime_context (get_context / get_spec / get_server_args); the CPU tests put a
    stand-in here, since the real module needs transformers and a published server config."""
    from sglang.srt import runtime_context

    return runtime_context



def tp_group() -> Any:
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
            return SingleProcess()  # no process group at all: there are no other ranks


class SingleProcess:
    """The TP group of a process with no torch.distributed at all (one rank, nothing to sync)."""

    rank_in_group = 0
    world_size = 1



def capture_sizes(runner: Any, width: int) -> list[int]:
    """The decode batch sizes SGLang captures graphs for at this width (what sizes the buffer)."""
    from sglang.srt.model_executor import model_runner as mr_mod

    return list(mr_mod.get_batch_sizes_to_capture(runner, width)[0])



def version() -> str:
    """The installed SGLang's version string ("unknown" where it cannot be read)."""
    try:
        from importlib.metadata import version as dist_version

        return dist_version("sglang")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        try:
            import sglang

            return str(getattr(sglang, "__version__", "unknown"))
        except Exception:  # noqa: BLE001
            return "unknown"
