"""Each chain state's own draft-extend CUDA graph width (patch draft_graphs; SGLang 0.5.17 only).

AROUND spec_utils.resolve_num_tokens_per_req, phase "draft_extend": the width in the spec bag (which SGLang's
_override_worker_state sets for each state's build), not the startup ServerArgs' (0.5.17 reads that, so every
state's draft-extend graph has the launch width and steps 0 / s1 / s2 extend eagerly; 0.5.23 reads the bag).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from .. import sglang_source
from ..guard import AROUND, Patch

NAME = "draft_graphs"
LOST = "every state's draft-extend graph keeps the launch width: steps 0 / s1 / s2 extend eagerly"
log = logging.getLogger("specctl.plugin")


def patch(rt: Any) -> Optional[Patch]:
    if not rt.settings.draft_extend_graphs:
        return None
    if not sglang_source.draft_width_needed():
        log.info("specctl: draft_graphs=on: this SGLang sizes each state's draft-extend graph from the state's own "
                 "width already; nothing to do")
        return None
    return Patch(NAME, lost=LOST).hook(AROUND, rt.targets.draft_width, around_draft_width)


def around_draft_width(orig: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Outside a build the bag holds the launch width, so nothing changes. Chains only: a tree's build sets
    ServerArgs itself (patches/trees.py)."""
    own = orig(*args, **kwargs)
    if kwargs.get("phase") != "draft_extend":
        return own
    spec = sglang_source.runtime_context().get_spec()
    n, topk = spec.speculative_num_draft_tokens, spec.speculative_eagle_topk
    if isinstance(n, int) and 1 <= n and (topk or 1) == 1:
        if n != own:
            log.info("specctl: a draft-extend CUDA graph captured at width %d (the state being built), "
                     "not the launch width %d (draft_graphs)", n, own)
        return n
    return own
