"""What an operator adds to an SGLang launch to wire specctl in (no sglang import).

The adaptive config decides which runtime states and CUDA graphs SGLang builds at start-up; a
policy may only choose among them, so every configuration it may use is listed, in one slot that
covers every batch size.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..policies.fixed import DEFAULT_CONFIG, DEFAULT_THRESHOLD
from ..policies.table import Config

DEFAULT_CANDIDATES: tuple[Config, ...] = ((0, 1, 1), (1, 1, 2), (3, 1, 4))


@dataclass(frozen=True)
class LaunchArgs:
    adaptive_config: dict[str, Any]
    flags: list[str]
    env: dict[str, str]
    config_path: str

    def shell(self, launcher: str = "python -m sglang.launch_server") -> str:
        cfg = json.dumps(self.adaptive_config)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        flags = " ".join(shlex.quote(f) for f in self.flags)
        return (f"# set MODEL and DRAFT (its EAGLE-3 draft model); add your other server flags\n"
                f"cat > {shlex.quote(self.config_path)} <<'JSON'\n{cfg}\nJSON\n"
                f'{env} {launcher} --model-path "$MODEL" --speculative-draft-model-path "$DRAFT" {flags}\n')

    def to_obj(self) -> dict[str, Any]:
        return {"adaptive_config": self.adaptive_config, "flags": self.flags, "env": self.env,
                "config_path": self.config_path}


def candidate_problem(candidates: Sequence[Config]) -> Optional[str]:
    for c in candidates:
        if c[0] > 0 and c[1] != 1:
            return f"{c}: SGLang adaptive speculation runs chains (topk=1) only"
    if not candidates:
        return "no configurations given"
    return None


def build(candidates: Sequence[Config] = DEFAULT_CANDIDATES, *, algorithm: str = "EAGLE3",
          initial_steps: Optional[int] = None, config_path: str = "specctl-adaptive.json",
          server_id: str = "sglang-0", mode: str = "online", rundir: Optional[str] = None,
          fallback_threshold: int = DEFAULT_THRESHOLD, fallback_config: Config = DEFAULT_CONFIG,
          ) -> LaunchArgs:
    why = candidate_problem(candidates)
    if why:
        raise ValueError(why)
    steps = sorted({c[0] for c in candidates} | {0, fallback_config[0]})
    if initial_steps is None:
        # the largest candidate: SGLang 0.5.17 sizes a logits buffer from --speculative-num-steps
        initial_steps = steps[-1]
    if initial_steps not in steps:
        raise ValueError(f"initial steps {initial_steps} is not among the candidates {steps}")
    flags = [
        "--speculative-algorithm", algorithm,
        "--speculative-eagle-topk", "1",
        "--speculative-num-steps", str(initial_steps),
        "--speculative-num-draft-tokens", str(initial_steps + 1),
        "--speculative-adaptive",
        "--speculative-adaptive-config", config_path,
    ]
    env = {"SPECCTL_MODE": mode, "SPECCTL_SERVER_ID": server_id}
    if rundir:
        env["SPECCTL_RUNDIR"] = rundir
    if fallback_threshold != DEFAULT_THRESHOLD:
        env["SPECCTL_FALLBACK_THRESHOLD"] = str(fallback_threshold)
    if tuple(fallback_config) != DEFAULT_CONFIG:
        env["SPECCTL_FALLBACK_CONFIG"] = ",".join(map(str, fallback_config))
    # one slot from batch 1 up: every candidate is reachable (and CUDA-graph captured) at every size
    return LaunchArgs({"1": {"candidate_steps": steps}}, flags, env, config_path)
