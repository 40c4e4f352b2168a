"""Step timers for the forward hook: CUDA events on a GPU, host time elsewhere."""

from __future__ import annotations

import time
from typing import Any, Optional


class CpuTimer:
    """Host-side timing, for hosts without CUDA (the CPU tests); a GPU step needs CudaEventTimer."""

    def start(self) -> Any:
        return time.perf_counter()

    def stop(self, mark: Any) -> Any:
        return (time.perf_counter() - mark) * 1000.0

    def elapsed_ms(self, token: Any) -> Optional[float]:
        return token


class CudaEventTimer:
    """CUDA events recorded on the forward stream around the step: under the overlap scheduler the
    call only launches work, so host time would measure launch. Events are pooled (no allocation
    per step) and read only once complete (never synchronised)."""

    def __init__(self, torch_mod: Any):
        self._torch = torch_mod
        self._pool: list[tuple[Any, Any]] = []

    def start(self) -> Any:
        pair = self._pool.pop() if self._pool else (
            self._torch.cuda.Event(enable_timing=True), self._torch.cuda.Event(enable_timing=True))
        pair[0].record()
        return pair

    def stop(self, pair: Any) -> Any:
        pair[1].record()
        return pair

    def elapsed_ms(self, pair: Any) -> Optional[float]:
        try:
            if not pair[1].query():
                return None
            return float(pair[0].elapsed_time(pair[1]))
        finally:
            if len(self._pool) < 16:
                self._pool.append(pair)


def default_timer() -> Any:
    try:
        import torch

        if torch.cuda.is_available():
            return CudaEventTimer(torch)
    except Exception:  # noqa: BLE001
        pass
    return CpuTimer()
