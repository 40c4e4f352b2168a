"""The REPLACE for SGLang's AdaptiveSpeculativeParams: its protocol, with decisions from the EngineController."""

from __future__ import annotations

import logging
from typing import Any, Optional

from . import runtime as _rt
from .engine import EngineController

log = logging.getLogger("specctl.plugin")


def make_policy_class(base: type) -> type:
    """SGLang's class with the same constructor and protocol (candidate_steps, set_cuda_graph_bs,
    cuda_graph_bs_for_step, get_steps_for_batch, on_verify_complete); only public members of the base are used."""

    class SpecctlSpeculativeParams(base):  # type: ignore[misc, valid-type]
        def __init__(self, initial_steps: int, cfg_path: Optional[str] = None):
            self._sizing_only: frozenset[int] = frozenset()
            self._graph_bs: Optional[list[int]] = None
            super().__init__(initial_steps, cfg_path)
            self.specctl: Optional[EngineController] = None
            rt = _rt.current()
            if rt is None:
                log.error("specctl: policy built without a plugin runtime; SGLang's policy decides")
                return
            try:
                # the sizing slot's steps only size buffers: no runtime state for them (decided first, so that
                # SGLang's own policy never builds them either once anything after it fails)
                self._sizing_only = sizing_only_steps(cfg_path)
                self.specctl = rt.new_engine(list(self.candidate_steps), rt.configured_trees(cfg_path))
            except Exception as e:  # noqa: BLE001
                log.exception("specctl: engine start failed (%s); SGLang's policy decides", e)

        @property
        def candidate_steps(self) -> list[int]:  # SGLang builds one runtime state per entry
            return [s for s in super().candidate_steps if s not in getattr(self, "_sizing_only", ())]

        def set_cuda_graph_bs(self, cuda_graph_bs: Optional[list[int]]) -> None:
            self._graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None
            super().set_cuda_graph_bs(cuda_graph_bs)

        def get_steps_for_batch(self, batch_size: int) -> int:
            eng = self.specctl
            if eng is None:
                return super().get_steps_for_batch(batch_size)
            rt = _rt.current()
            return eng.decide(batch_size, rt.take_ctx(batch_size) if rt is not None else None)

        def on_verify_complete(self, num_correct_drafts_per_req: list[int], batch_size: int) -> Optional[int]:
            if self.specctl is None:
                return super().on_verify_complete(num_correct_drafts_per_req, batch_size)
            return None  # never switch here: the next get_steps_for_batch decides

        def cuda_graph_bs_for_step(self, step: int) -> Optional[list[int]]:
            if self.specctl is None:
                return super().cuda_graph_bs_for_step(step)
            # the table may choose any built step at any batch size: capture graphs for all
            return None if self._graph_bs is None else list(self._graph_bs)

    return SpecctlSpeculativeParams


def sizing_only_steps(cfg_path: Optional[str]) -> frozenset[int]:
    """Steps only the adaptive config's sizing slot lists (launch_args.SIZING_SLOT), read from the file SGLang read;
    none without a file (SGLang's default config has no sizing slot)."""
    if not cfg_path:
        return frozenset()
    import json

    from .launch_args import SIZING_SLOT

    with open(cfg_path) as f:
        cfg: Any = json.load(f)
    slots = {k: v.get("candidate_steps", []) for k, v in cfg.items() if str(k).isdigit() and isinstance(v, dict)}
    sizing = slots.pop(SIZING_SLOT, None)
    if sizing is None:
        return frozenset()
    used = {s for steps in slots.values() for s in steps}
    return frozenset(set(sizing) - used)
