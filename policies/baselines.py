"""The policies specctl is measured against: off, static, threshold, SGLang's EMA policy, the oracle.

Each is a small object with `decide(batch_size) -> Config` and `observe(...)`, the shape the
simulator drives; `parse_policy_name` reads the `--policy` names of `specctl bench sim`.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import numpy as np

from .fixed import fixed_threshold
from .fixed import static as static_table
from .table import OFF, Config, PolicyTable, chain, config_name

POLICY_KINDS = ("off", "static", "threshold", "sglang-ema", "adaptive", "oracle")


# ---------------------------------------------------------------------------------------------
# names


@dataclass(frozen=True)
class PolicyName:
    """A parsed `--policy` name; `config` is kept as text until a profile resolves it."""

    kind: str
    config: Optional[str] = None
    threshold: Optional[int] = None
    options: tuple[tuple[str, str], ...] = ()  # adaptive:key=value,... (controller settings)

    def __str__(self) -> str:
        if self.options:
            return self.kind + ":" + ",".join(f"{k}={v}" for k, v in self.options)
        if self.kind == "static":
            return f"static:{self.config}"
        if self.kind == "threshold":
            return f"threshold:{self.threshold}:{self.config}"
        return self.kind


def parse_policy_name(text: str) -> PolicyName:
    """`off`, `static:<config>`, `threshold:<N>:<config>`, `sglang-ema`, `adaptive`, `oracle`.

    `adaptive:key=value,...` overrides controller-service settings (experiments, e.g.
    `adaptive:refit_interval_s=2`).
    <config> is a profile config name, `off`, `sN` (chain), `sNkKnD` or `steps,topk,draft_tokens`."""
    t = text.strip()
    head, _, rest = t.partition(":")
    kind = head.lower()
    if kind == "adaptive" and rest:
        opts = []
        for part in rest.split(","):
            k, eq, v = part.partition("=")
            if not eq or not k.strip() or not v.strip():
                raise ValueError(f"policy {text!r}: expected adaptive:key=value[,key=value...]")
            opts.append((k.strip(), v.strip()))
        return PolicyName("adaptive", options=tuple(opts))
    if kind in ("off", "sglang-ema", "adaptive", "oracle"):
        if rest:
            raise ValueError(f"policy {text!r}: {kind!r} takes no argument")
        return PolicyName(kind)
    if kind == "static":
        if not rest:
            raise ValueError(f"policy {text!r}: expected static:<config>, e.g. static:s3")
        return PolicyName("static", config=rest)
    if kind == "threshold":
        n_text, _, cfg = rest.partition(":")
        if not n_text or not cfg:
            raise ValueError(f"policy {text!r}: expected threshold:<N>:<config>, e.g. threshold:5:s3")
        try:
            n = int(n_text)
        except ValueError:
            raise ValueError(f"policy {text!r}: threshold N must be an integer, got {n_text!r}") from None
        if n < 1:
            raise ValueError(f"policy {text!r}: threshold N must be >= 1")
        return PolicyName("threshold", config=cfg, threshold=n)
    raise ValueError(f"unknown policy {text!r}; expected one of: off, static:<config>, "
                     "threshold:<N>:<config>, sglang-ema, adaptive, oracle")


def parse_config_text(text: str) -> Config:
    """`off`, `sN`, `sNkKnD` or `steps,topk,draft_tokens` -> (steps, topk, draft_tokens)."""
    t = text.strip().lower()
    try:
        if t == "off":
            return OFF
        if "," in t:
            a, b, c = (int(x) for x in t.split(","))
            return OFF if a == 0 else (a, b, c)
        if t.startswith("s") and "k" in t and "n" in t:
            k, n = t.index("k"), t.index("n")
            return (int(t[1:k]), int(t[k + 1:n]), int(t[n + 1:]))
        if t.startswith("s"):
            return chain(int(t[1:]))
    except ValueError:
        pass
    raise ValueError(f"invalid configuration {text!r}: expected a profile config name, 'off', 'sN', "
                     "'sNkKnD' or 'steps,topk,draft_tokens'")


def resolve_config(text: str, names: Sequence[str], configs: Sequence[Config]) -> Config:
    """A config named in a policy, looked up by the profile's own names first."""
    if text in names:
        return configs[list(names).index(text)]
    cfg = parse_config_text(text)
    if cfg not in configs:
        have = ", ".join(f"{n}={c}" for n, c in zip(names, configs))
        raise ValueError(f"configuration {text!r} = {cfg} is not in the profile ({have})")
    return cfg


# ---------------------------------------------------------------------------------------------
# table policies: off, static, threshold


class TablePolicy:
    """A fixed PolicyTable, looked up per step; learns nothing."""

    def __init__(self, name: str, table: PolicyTable):
        self.name = name
        self.table = table
        self.num_steps = 0

    def decide(self, batch_size: int) -> Config:
        c = self.table.decide(batch_size, self.num_steps)
        self.num_steps += 1
        return c

    def observe(self, batch_size: int, config: Config, accepted: Any, step_ms: float, now_s: float) -> None:
        return None


def off_policy() -> TablePolicy:
    return TablePolicy("off", static_table(OFF))


def static_policy(config: Config, label: Optional[str] = None) -> TablePolicy:
    return TablePolicy(label or f"static:{config_name(config)}", static_table(config))


def threshold_policy(threshold: int, config: Config, label: Optional[str] = None) -> TablePolicy:
    return TablePolicy(label or f"threshold:{threshold}:{config_name(config)}",
                       fixed_threshold(threshold, config))


# ---------------------------------------------------------------------------------------------
# SGLang 0.5.23 `--speculative-adaptive` default policy (speculative/adaptive_spec_params.py)

SGLANG_DEFAULT_ADAPTIVE_CONFIG: dict[str, dict[str, Any]] = {
    "1": {"candidate_steps": [1, 3, 5, 7], "up_hysteresis": 0.0, "down_hysteresis": -0.25, "ceiling_coeff": 0},
    "8": {"candidate_steps": [0, 1, 3], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "32": {"candidate_steps": [0, 1], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
    "64": {"candidate_steps": [0], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0},
}


def sglang_spec_cuda_graph_bs(max_bs: int = 256) -> list[int]:
    """SGLang's decode CUDA-graph batch sizes with speculation on (cuda_graph_hook.py)."""
    bs = (list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4))
          + list(range(72, 257, 8)) + list(range(272, max_bs + 1, 16)))
    bs = [b for b in bs if b <= max_bs]
    if max_bs not in bs:
        bs.append(max_bs)
    return bs


class SGLangStepSlot:
    """One batch-size slot: EMA of mean accepted drafts per request, stepped through candidates.

    A line-by-line port of SGLang's `AdaptiveStepSlot` (0.5.23), logging removed."""

    def __init__(self, initial_steps: int, cfg: Mapping[str, Any]):
        candidates = sorted(set(cfg["candidate_steps"]))
        if not candidates:
            raise ValueError("candidate_steps must have at least 1 value")
        self.candidate_steps = candidates
        self.ema_alpha = cfg.get("ema_alpha", 0.2)
        self.update_interval = cfg.get("update_interval", 5)
        self.warmup_batches = cfg.get("warmup_batches", 10)
        self.down_hysteresis = cfg.get("down_hysteresis", -0.25)
        self.up_hysteresis = cfg.get("up_hysteresis", 0.0)
        self.ceiling_coeff = cfg.get("ceiling_coeff", 0)
        if initial_steps in self.candidate_steps:
            self.current_steps = initial_steps
        else:
            self.current_steps = self.candidate_steps[len(self.candidate_steps) // 2]
        self.ema_accept_len = float(self.current_steps - 1)
        self._batch_count = 0

    def update(self, num_correct_drafts_per_req: Sequence[int]) -> bool:
        if len(num_correct_drafts_per_req) == 0:
            return False
        # SGLang gates on the slot's CURRENT steps, not the steps that produced this data
        if self.current_steps > 0:
            batch_avg = float(sum(num_correct_drafts_per_req)) / len(num_correct_drafts_per_req)
            self.ema_accept_len = (1 - self.ema_alpha) * self.ema_accept_len + self.ema_alpha * batch_avg
        self._batch_count += 1
        if self._batch_count <= self.warmup_batches:
            return False
        if (self._batch_count - self.warmup_batches) % self.update_interval != 0:
            return False
        return self._recompute_params()

    def _recompute_params(self) -> bool:
        old_steps = self.current_steps
        current_idx = self.candidate_steps.index(old_steps)
        old_idx = current_idx
        # at steps 0 the EMA is frozen, so SGLang always probes the next candidate up
        if old_steps == 0:
            current_idx = min(current_idx + 1, len(self.candidate_steps) - 1)
            target = self.candidate_steps[current_idx]
            if target > 0 and self.ema_accept_len < 0:
                self.ema_accept_len = float(target - 1)
            return self._apply_target_steps(old_steps, target)
        while current_idx > 0:
            prev_step = self.candidate_steps[current_idx - 1]
            drop_threshold = 0.5 if prev_step == 0 else prev_step - 0.5
            drop_threshold += self.down_hysteresis
            if self.ema_accept_len <= drop_threshold:
                current_idx -= 1
            else:
                break
        moved_down = current_idx < old_idx
        if not moved_down:
            while current_idx < len(self.candidate_steps) - 1:
                current_step = self.candidate_steps[current_idx]
                rise_threshold = current_step - 0.5 + self.up_hysteresis
                if self.ema_accept_len > rise_threshold:
                    current_idx += 1
                else:
                    break
        target = self.candidate_steps[current_idx]
        if self.ceiling_coeff > 0:
            ceiling = max(1, math.ceil(self.ema_accept_len * self.ceiling_coeff))
            if target > ceiling and target <= old_steps:
                while current_idx > 0 and self.candidate_steps[current_idx] > ceiling:
                    current_idx -= 1
                target = self.candidate_steps[current_idx]
        return self._apply_target_steps(old_steps, target)

    def _apply_target_steps(self, old_steps: int, target: int) -> bool:
        if target != old_steps:
            self.current_steps = target
            return True
        return False


class SGLangAdaptiveParams:
    """SGLang's `AdaptiveSpeculativeParams`: pad the batch to a captured CUDA-graph size, route it
    to the slot with the largest key <= that size."""

    def __init__(self, initial_steps: Optional[int] = None,
                 config: Mapping[str, Any] = SGLANG_DEFAULT_ADAPTIVE_CONFIG):
        bs_entries = {int(k): v for k, v in config.items() if str(k).isdigit()}
        if not bs_entries:
            raise ValueError("an adaptive config needs at least one integer-string batch-size key")
        for k, e in bs_entries.items():
            steps = e.get("candidate_steps")
            if not isinstance(steps, list) or not steps or not all(isinstance(s, int) and s >= 0 for s in steps):
                raise ValueError(f"BS {k}: candidate_steps must be a list of non-negative ints, got {steps!r}")
        union = sorted({s for e in bs_entries.values() for s in e["candidate_steps"]})
        if initial_steps is None:
            # server_args: --speculative-num-steps defaults to the middle candidate
            initial_steps = union[len(union) // 2]
        defaults = {k: v for k, v in config.items() if not str(k).isdigit()}
        self._bs_list = sorted(bs_entries)
        self._slots = {bs: SGLangStepSlot(initial_steps, {**defaults, **bs_entries[bs]}) for bs in self._bs_list}
        self._cuda_graph_bs: Optional[list[int]] = None
        self.candidate_steps = union

    def set_cuda_graph_bs(self, cuda_graph_bs: Optional[Sequence[int]]) -> None:
        self._cuda_graph_bs = sorted(cuda_graph_bs) if cuda_graph_bs else None

    def get_steps_for_batch(self, batch_size: int) -> int:
        return self._route(batch_size).current_steps

    def on_verify_complete(self, num_correct_drafts_per_req: Sequence[int], batch_size: int) -> Optional[int]:
        slot = self._route(batch_size)
        if slot.update(num_correct_drafts_per_req):
            return slot.current_steps
        return None

    def slot_for(self, batch_size: int) -> SGLangStepSlot:
        return self._route(batch_size)

    def _route(self, batch_size: int) -> SGLangStepSlot:
        return self._slots[self._find_closest_bs(self._pad_to_cuda_graph_bs(batch_size))]

    def _pad_to_cuda_graph_bs(self, batch_size: int) -> int:
        if self._cuda_graph_bs is None:
            return batch_size
        idx = bisect.bisect_left(self._cuda_graph_bs, batch_size)
        return self._cuda_graph_bs[idx] if idx < len(self._cuda_graph_bs) else batch_size

    def _find_closest_bs(self, target: int) -> int:
        idx = bisect.bisect_right(self._bs_list, target) - 1
        return self._bs_list[max(0, idx)]


def snap_adaptive_config(config: Mapping[str, Any], available_steps: Sequence[int]) -> dict[str, Any]:
    """The same config with every candidate step moved to the nearest step the profile has
    (ties go down): what an operator would write for a server that only built those states."""
    avail = sorted(set(available_steps))
    if not avail:
        raise ValueError("the profile has no chain (topk=1) configuration to map SGLang's steps onto")

    def snap(s: int) -> int:
        return min(avail, key=lambda a: (abs(a - s), a))

    out: dict[str, Any] = {}
    for k, v in config.items():
        if str(k).isdigit():
            out[k] = {**v, "candidate_steps": sorted({snap(int(s)) for s in v["candidate_steps"]})}
        else:
            out[k] = v
    return out


class SGLangEMA:
    """SGLang's built-in adaptive policy driven as the engine drives it.

    The overlap scheduler (SGLang's default) issues step N+1 before it processes step N's verify
    result, so with `overlap=True` step N's accepted counts reach the policy after step N+1's
    decision."""

    uses_truth = False

    def __init__(self, available: Mapping[int, Config], *, name: str = "sglang-ema",
                 config: Mapping[str, Any] = SGLANG_DEFAULT_ADAPTIVE_CONFIG,
                 cuda_graph_bs: Optional[Sequence[int]] = None, initial_steps: Optional[int] = None,
                 overlap: bool = True):
        self.name = name
        self._config_for_steps = dict(available)
        self.params = SGLangAdaptiveParams(initial_steps, snap_adaptive_config(config, list(available)))
        self.params.set_cuda_graph_bs(sglang_spec_cuda_graph_bs() if cuda_graph_bs is None else cuda_graph_bs)
        self.overlap = overlap
        self._pending: Optional[tuple[list[int], int]] = None

    def decide(self, batch_size: int) -> Config:
        steps = self.params.get_steps_for_batch(batch_size)
        if self._pending is not None:
            acc, bs = self._pending
            self._pending = None
            self.params.on_verify_complete(acc, bs)
        return self._config_for_steps[steps]

    def observe(self, batch_size: int, config: Config, accepted: Any, step_ms: float, now_s: float) -> None:
        acc = accepted.tolist() if hasattr(accepted, "tolist") else list(accepted)
        if self.overlap:
            self._pending = (acc, batch_size)
        else:
            self.params.on_verify_complete(acc, batch_size)


# ---------------------------------------------------------------------------------------------
# oracle


class Oracle:
    """Per step, the configuration with the best expected goodput b*tau(c)/t(c, b), given the TRUE
    expected tokens per request of the batch (the simulator hands them over) and the noise-free
    step time. The envelope every controller is measured against (docs/architecture.md)."""

    uses_truth = True

    def __init__(self, configs: Sequence[Config], step_ms_all: Callable[[int], np.ndarray], name: str = "oracle",
                 step_ms_all_ctx: Optional[Callable[[int, float], np.ndarray]] = None):
        self.name = name
        self.configs = list(configs)
        self._step_ms_all = step_ms_all
        self._step_ms_all_ctx = step_ms_all_ctx  # (batch size, mean context per request), where it matters

    def decide_with_truth(self, batch_size: int, tau: np.ndarray, ctx_tokens: Optional[int] = None) -> Config:
        if ctx_tokens is not None and self._step_ms_all_ctx is not None:
            return self.configs[int(np.argmax(tau / self._step_ms_all_ctx(batch_size, ctx_tokens / batch_size)))]
        return self.configs[int(np.argmax(tau / self._step_ms_all(batch_size)))]

    def decide(self, batch_size: int) -> Config:
        raise TypeError("the oracle needs the batch's true acceptance: call decide_with_truth")

    def observe(self, batch_size: int, config: Config, accepted: Any, step_ms: float, now_s: float) -> None:
        return None


def build_baseline(name: PolicyName | str, config_names: Sequence[str], configs: Sequence[Config],
                   step_ms_all: Callable[[int], np.ndarray],
                   step_ms_all_ctx: Optional[Callable[[int, float], np.ndarray]] = None) -> Any:
    """A baseline policy for a profile with these configs; `adaptive` is built by the simulator
    side (it runs the controller service), not here. `step_ms_all_ctx`: step times at a mean
    context per request, for a profile with a context term (the oracle uses it)."""
    pn = parse_policy_name(name) if isinstance(name, str) else name
    if pn.kind == "off":
        if OFF not in configs:
            raise ValueError("policy 'off': the profile has no steps=0 configuration")
        return off_policy()
    if pn.kind == "static":
        cfg = resolve_config(pn.config or "", config_names, configs)
        return static_policy(cfg, f"static:{pn.config}")
    if pn.kind == "threshold":
        cfg = resolve_config(pn.config or "", config_names, configs)
        if OFF not in configs:
            raise ValueError(f"policy {pn}: the profile has no steps=0 configuration to switch to")
        return threshold_policy(int(pn.threshold or 1), cfg, str(pn))
    if pn.kind == "sglang-ema":
        # map SGLang's step counts onto the profile's chains (topk 1)
        return SGLangEMA({c[0]: c for c in configs if c[1] == 1})
    if pn.kind == "oracle":
        return Oracle(configs, step_ms_all, step_ms_all_ctx=step_ms_all_ctx)
    raise ValueError(f"policy {pn}: not a baseline")
