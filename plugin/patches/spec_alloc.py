"""The speculative KV allocation's lengths as one list (patch spec_alloc; SGLang 0.5.17 only).

AROUND eagle_utils.alloc_for_spec_decode (the name eagle_prepare_for_decode calls): at page size 1 the function
reads nxt_kv_lens_cpu only in its last loop, one tensor scalar per request (2 ATen calls each); the same values as
a list of ints give the same lengths. Paged allocators get the tensor unchanged. 0.5.23 calls .tolist() itself.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from .. import sglang_source
from ..guard import AROUND, Patch

NAME = "spec_alloc"
LOST = ("the speculative KV allocation reads each request's length as a tensor scalar (2 ATen "
        "calls per request per step)")
log = logging.getLogger("specctl.plugin")


def patch(rt: Any) -> Optional[Patch]:
    if not rt.settings.spec_alloc_list:
        return None
    if not sglang_source.spec_alloc_reads_scalars():
        log.info("specctl: spec_alloc=on: this SGLang reads the speculative KV allocation's lengths as one list "
                 "already; nothing to do")
        return None
    return Patch(NAME, lost=LOST).hook(AROUND, rt.targets.spec_alloc, around_spec_alloc)


def around_spec_alloc(orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    nxt = kwargs.get("nxt_kv_lens_cpu")
    tree_cache = args[0] if args else kwargs["tree_cache"]
    if nxt is not None and hasattr(nxt, "tolist") and tree_cache.token_to_kv_pool_allocator.page_size == 1:
        kwargs["nxt_kv_lens_cpu"] = nxt.tolist()  # this call's own kwargs dict
    return orig(*args, **kwargs)
