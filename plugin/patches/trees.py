"""Tree states beside the chains (patch trees; topk > 1, only where the adaptive config has a `specctl.states`
section, see plugin/launch_args.py; each hook passes straight through otherwise).

    AROUND build_adaptive_runtime_state   a tree's key is built as the tree (topk and width set for the build)
    BEFORE apply_runtime_state            the workers' and the bag's topk follow the state being applied
    AROUND _draft_extend_for_decode / _for_prefill   the draft's next-step top-k is the widest of any state
    BEFORE draft                          a chain drafts from the first column only
    AFTER  max_decode_logits_rows         the shared logits buffer holds the tree's width
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from ...policies.table import chain, config_name
from .. import runtime as _rt
from .. import sglang_source
from ..guard import AFTER, AROUND, BEFORE, Patch

NAME = "trees"
LOST = "tree states cannot be built or switched to safely"
log = logging.getLogger("specctl.plugin")


def patch(rt: Any) -> Patch:
    """Two kinds of hooks: the build and the logits sizing fall back on an error (a chain under the key,
    SGLang's sizing); apply, draft extend and draft keep widths consistent and must not be skipped (an error
    there falls the engine back to its fixed policy, which runs chains only, and propagates)."""
    t = rt.targets
    p = Patch(NAME, lost=LOST)
    # off (an error of ours around a build): SGLang builds chains from then on; the engine must not choose a tree
    p.when_off(lambda: rt.fail_engine(f"patch {NAME} is off"))
    p.hook(AROUND, t.build, around_build)
    p.hook(AFTER, t.logits_rows, after_logits_rows)
    return p


def width_patch(rt: Any) -> Patch:
    t = rt.targets
    p = Patch(NAME + ".width", lost=LOST, must_run=True, on_must_run_error=rt.fail_engine)
    p.hook(BEFORE, t.apply, before_apply_hook)
    p.hook(AROUND, t.extend_decode, around_draft_extend)
    p.hook(AROUND, t.extend_prefill, around_draft_extend)
    p.hook(BEFORE, t.draft, before_draft)
    return p


def build_state(rt: Any, orig: Callable[..., Any], worker: Any, args: tuple, kwargs: dict) -> Any:
    """AROUND build_adaptive_runtime_state(steps, draft_tokens, cuda_graph_bs): a tree key is
    built as the tree; a build that fails leaves the key a chain (said, and the engine told)."""
    names = ("speculative_num_steps", "speculative_num_draft_tokens", "cuda_graph_bs")
    call = dict(zip(names, args))
    call.update(kwargs)
    cfg = rt.trees.get(call.get("speculative_num_steps"))  # type: ignore[arg-type]
    if cfg is None:
        return orig(worker, *args, **kwargs)
    steps, topk, n = cfg
    try:
        with tree_build_context(worker, topk, n):
            state = orig(worker, speculative_num_steps=steps, speculative_num_draft_tokens=n,
                         cuda_graph_bs=call.get("cuda_graph_bs"))
        state._specctl_topk = topk
    except Exception as e:  # noqa: BLE001 - the server starts, with a chain under this key
        log.exception("specctl: building the tree state %s failed (%s: %s); steps=%d is built "
                      "as a chain", config_name(cfg), type(e).__name__, e, steps)
        rt.set_trees({k: c for k, c in rt.trees.items() if k != steps})
        if rt.engine is not None:
            rt.engine.replace_state(steps, chain(steps),
                                      f"the tree {config_name(cfg)} could not be built: {type(e).__name__}: {e}")
        return orig(worker, *args, **kwargs)
    log.info("specctl: built tree state %s under steps key %d", config_name(cfg), steps)
    return state

def before_apply(worker: Any, state: Any) -> None:
    """BEFORE apply_runtime_state: SGLang swaps steps, widths and buffers but never topk."""
    topk = getattr(state, "_specctl_topk", 1)
    if worker.topk != topk:
        worker.topk = topk
        worker._draft_worker.topk = topk
        _set_bag_topk("specctl.apply_tree_state", topk)

def tree_logits_rows(rt: Any, runner: Any, rows: int) -> Optional[int]:
    """AFTER ModelRunner.max_decode_logits_rows: enough rows for the widest tree's graphs."""
    sa = runner.server_args
    path = getattr(sa, "speculative_adaptive_config", None)
    if not path or not getattr(sa, "speculative_adaptive", False):
        return None
    try:
        width = max([c[2] for c in rt.configured_trees(path).values()] + [0])
    except (OSError, ValueError) as e:
        rt.warn_once(f"cannot read tree states from {path}: {e}")
        return None
    if width <= 1:
        return None
    need = max(sglang_source.capture_sizes(runner, width)) * width
    return need if need > rows else None


def around_build(orig: Callable[..., Any], worker: Any, *args: Any, **kwargs: Any) -> Any:
    rt = _rt.current()
    if rt is None or not rt.trees:
        return orig(worker, *args, **kwargs)
    return build_state(rt, orig, worker, args, kwargs)


def before_apply_hook(worker: Any, *args: Any, **kwargs: Any) -> None:
    rt = _rt.current()
    if rt is not None and rt.trees:
        before_apply(worker, args[0] if args else kwargs["state"])
    return None


def around_draft_extend(orig: Callable[..., Any], draft_worker: Any, *args: Any, **kwargs: Any) -> Any:
    """The next step's draft input is always max_topk wide, whichever state runs now."""
    rt = _rt.current()
    width = rt.max_topk if rt is not None else 1
    own = draft_worker.topk
    if width <= own:
        return orig(draft_worker, *args, **kwargs)
    draft_worker.topk = width
    try:
        return orig(draft_worker, *args, **kwargs)
    finally:
        draft_worker.topk = own


def before_draft(draft_worker: Any, *args: Any, **kwargs: Any) -> None:
    """A chain (or a narrower tree) drafts from the first columns of the wide top-k: column 0 is
    the argmax the chain would have taken itself."""
    rt = _rt.current()
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


def after_logits_rows(ret: Any, runner: Any, *args: Any, **kwargs: Any) -> Any:
    rt = _rt.current()
    if rt is None:
        return None
    try:
        return tree_logits_rows(rt, runner, int(ret))
    except Exception as e:  # noqa: BLE001 - SGLang's own sizing stands; a tree graph may then fail
        rt.warn_once(f"logits-rows hook error: {type(e).__name__}: {e}")
        return None


@contextmanager
def tree_build_context(worker: Any, topk: int, n: int) -> Iterator[None]:
    """What a tree build must see, undone afterwards: topk on both workers and in the spec bag
    (backends and 0.5.23's graph runners read it there), and topk and width in ServerArgs, where
    0.5.17's draft graph runners read them (through its sanctioned override(), provenance kept)."""
    rc = sglang_source.runtime_context()
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
    sglang_source.runtime_context().get_context().override(source, speculative_eagle_topk=topk)

