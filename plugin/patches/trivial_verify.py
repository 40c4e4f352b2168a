"""Steps 0's 1-node tree token as int64 (patch trivial_verify): SGLang's verify_tree_greedy refuses the sampler's int32.

AFTER EAGLEWorkerV2._build_trivial_verify_input: without the overlap scheduler the previous bonus token comes
straight from the sampler as int32; the same ids as int64, a no-op where they are int64 already.
"""

from __future__ import annotations

from typing import Any

from ..guard import AFTER, Patch

NAME = "trivial_verify"
LOST = ("steps 0 under --disable-overlap-schedule fails in SGLang's verify_tree_greedy (int32 "
        "bonus tokens)")


def patch(rt: Any) -> Patch:
    return Patch(NAME, lost=LOST).hook(AFTER, rt.targets.trivial_verify, after_trivial_verify_input)


def after_trivial_verify_input(ret: Any, worker: Any, *args: Any, **kwargs: Any) -> None:
    tok = getattr(ret, "draft_token", None)
    if tok is not None and hasattr(tok, "long"):
        ret.draft_token = tok.long()  # the same tensor where it is int64 already
    return None  # keep SGLang's return value (changed in place)
