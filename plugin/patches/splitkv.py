"""SGLang's split-KV verify attention kernel for topk-1 chains on CUDA (patch splitkv; SGLang gates it to AMD gfx95).

AFTER TritonAttnBackend.__init__: use_verify_splitkv on every topk-1 backend on CUDA (the kernel computes a causal
chain; its own can_handle sends everything else to the extend kernel), unless SGLANG_ENABLE_SPLITKV_VERIFY is off.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from .. import runtime as _rt
from .. import sglang_source
from ..guard import AFTER, Patch

NAME = "splitkv"
LOST = "verify attention stays SGLang's extend kernel"


def patch(rt: Any) -> Optional[Patch]:
    if not rt.settings.splitkv_verify:
        return None
    return Patch(NAME, lost=LOST).hook(AFTER, rt.targets.triton_init, after_triton_init)


def after_triton_init(ret: Any, backend: Any, *args: Any, **kwargs: Any) -> None:
    """Every TritonAttnBackend built for a topk-1 chain on CUDA verifies with the split-KV kernel."""
    rt = _rt.current()
    if not sglang_source.allows_splitkv():
        if rt is not None:
            rt.warn_once("split-KV verify kernel left off: SGLANG_ENABLE_SPLITKV_VERIFY is off", logging.INFO)
        return None
    topk = getattr(backend, "topk", None)
    if isinstance(topk, int) and topk <= 1 and str(getattr(backend, "device", "")).startswith("cuda") \
            and hasattr(backend, "verify_splitkv_fwd") and not getattr(backend, "use_verify_splitkv", False):
        backend.use_verify_splitkv = True
        if rt is not None:
            rt.warn_once("split-KV verify kernel on for topk-1 verify (SPECCTL_PATCHES=splitkv=off: the extend kernel)",
                         logging.INFO)
    return None
