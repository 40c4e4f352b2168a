"""What an operator adds to an SGLang launch to wire specctl in (no sglang import).

The adaptive config decides which runtime states and CUDA graphs SGLang builds at start-up; a
policy may only choose among them, so every configuration it may use is listed, in one slot that
covers every batch size.

Trees (topk > 1). SGLang's adaptive mode refuses a topk != 1 launch (it logs a warning and runs the
static tree), and keys its runtime states by step count. So the server is launched as a topk-1
chain, and a tree is one more state under its step count, built and switched to by the plugin's
tree hooks (plugin/sglang_hooks.py). The JSON then carries two extra entries that SGLang reads
without knowing why:

    "specctl": {"states": {"2": [2, 4, 16]}}    what each non-chain key runs (SGLang skips
                                                non-digit keys; the plugin reads it)
    "<SIZING_SLOT>": {"candidate_steps": [15]}  a slot no batch reaches: SGLang sizes its draft-token
                                                buffers (KV reserve, req_to_token rows, eager
                                                buffers, logits rows) from max(candidate steps) + 1,
                                                which must cover the tree's 16 tokens
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..policies.fixed import DEFAULT_CONFIG, DEFAULT_THRESHOLD
from ..policies.table import Config, chain
from ..policies.table import config_name as name

DEFAULT_CANDIDATES: tuple[Config, ...] = ((0, 1, 1), (1, 1, 2), (3, 1, 4))
SPECCTL_KEY = "specctl"
SIZING_SLOT = "1000000"  # a batch size no server reaches: its candidate steps only size buffers
MAX_TREE_TOKENS = 64


# what the decode state (plugin/plain_decode.py) costs and how to turn it off, as `specctl sglang-args` says it
PLAIN_DECODE_NOTE = (
    "speculation off runs specctl's decode state: the target decodes through DECODE CUDA graphs the plugin "
    "captures at start-up beside SGLang's (one more set of decode graphs and an attention backend; the "
    "scheduler log says once what it took: 'specctl: decode state built: ... GB, ... s'; 0.2-0.7 GB and 4-10 s on "
    "the H200 testbed, where an off step cost 1.03-1.04x a no-spec decode step at c=1-64 with each state's "
    "draft extend in its own graph, patch draft_graphs, on by default); SPECCTL_PATCHES=plain_decode=off keeps "
    "SGLang's steps-0 state (a 1-token verify, 1.25-1.53x a decode step there). Speculative steps verify with "
    "SGLang's split-KV kernel on triton (0.84-0.86x the stock s3 step there; SPECCTL_PATCHES=splitkv=off: the "
    "extend kernel)")


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
        plain = ("# " + ("SPECCTL_PATCHES=plain_decode=off: speculation off is SGLang's 1-token verify"
                         if self.env.get("SPECCTL_PATCHES") == "plain_decode=off" else PLAIN_DECODE_NOTE) + "\n")
        return (f"# set MODEL and DRAFT (its EAGLE-3 draft model); add your other server flags\n{plain}"
                f"cat > {shlex.quote(self.config_path)} <<'JSON'\n{cfg}\nJSON\n"
                f'{env} {launcher} --model-path "$MODEL" --speculative-draft-model-path "$DRAFT" {flags}\n')

    def to_obj(self) -> dict[str, Any]:
        return {"adaptive_config": self.adaptive_config, "flags": self.flags, "env": self.env,
                "config_path": self.config_path}


def candidate_problem(candidates: Sequence[Config]) -> Optional[str]:
    if not candidates:
        return "no configurations given"
    by_steps: dict[int, Config] = {}
    for c in candidates:
        if c[0] == 0 and tuple(c) != (0, 1, 1):
            return f"{c}: steps 0 is plain decode (0,1,1)"
        if c[1] > 1 and not (c[0] >= 1 and c[0] + 1 <= c[2] <= min(MAX_TREE_TOKENS, tree_nodes(c[0], c[1]))):
            return (f"{name(c)}: a tree of {c[0]} steps and topk {c[1]} verifies "
                    f"{c[0] + 1}..{min(MAX_TREE_TOKENS, tree_nodes(c[0], c[1]))} tokens")
        other = by_steps.setdefault(c[0], tuple(c))
        if other != tuple(c):
            return (f"{name(other)} and {name(c)} both run {c[0]} steps: SGLang keys its runtime "
                    f"states by step count, so one of them has to go")
    widths = [c[2] for c in by_steps.values()]
    if len(set(widths)) != len(widths):
        return "two configurations verify the same number of tokens: telemetry could not tell them apart"
    return None


def tree_nodes(steps: int, topk: int) -> int:
    """Candidate nodes an EAGLE tree offers its verify: the root, topk at the first step, and topk
    of topk * topk expansions at every later step."""
    return 1 + topk + (steps - 1) * topk * topk


def tree_states(adaptive_config: Any) -> dict[int, Config]:
    """The non-chain states an adaptive config (the parsed JSON) asks for: {steps: (steps, topk, n)}.
    Raises ValueError naming the problem when the `specctl` section is malformed."""
    if not isinstance(adaptive_config, dict) or SPECCTL_KEY not in adaptive_config:
        return {}
    sec = adaptive_config[SPECCTL_KEY]
    states = sec.get("states") if isinstance(sec, dict) else None
    if not isinstance(states, dict):
        raise ValueError(f'adaptive config: "{SPECCTL_KEY}" must be {{"states": {{"<steps>": [steps, topk, n]}}}}')
    out: dict[int, Config] = {}
    for k, v in states.items():
        if not (str(k).isdigit() and isinstance(v, list) and len(v) == 3
                and all(isinstance(x, int) and not isinstance(x, bool) for x in v) and v[0] == int(k)):
            raise ValueError(f'adaptive config: "{SPECCTL_KEY}.states.{k}" must be [{k}, topk, draft_tokens], got {v!r}')
        out[int(k)] = (v[0], v[1], v[2])
    why = candidate_problem(list(out.values()))
    if why:
        raise ValueError(f"adaptive config: {why}")
    return out


def read_tree_states(cfg_path: Optional[str]) -> dict[int, Config]:
    """tree_states() of the JSON file SGLang was given (--speculative-adaptive-config)."""
    if not cfg_path:
        return {}
    with open(cfg_path) as f:
        return tree_states(json.load(f))


def build(candidates: Sequence[Config] = DEFAULT_CANDIDATES, *, algorithm: str = "EAGLE3",
          initial_steps: Optional[int] = None, config_path: str = "specctl-adaptive.json",
          server_id: str = "sglang-0", mode: str = "online", rundir: Optional[str] = None,
          fallback_threshold: int = DEFAULT_THRESHOLD, fallback_config: Config = DEFAULT_CONFIG,
          plain_decode: bool = True) -> LaunchArgs:
    cands = [tuple(c) for c in candidates]
    trees = {c[0]: c for c in cands if c[0] > 0 and c[1] > 1}
    if fallback_config[0] not in trees and tuple(fallback_config) not in cands:
        cands.append(tuple(fallback_config))  # the fallback must always have its state
    if trees and not any(c[0] > 0 and c[1] == 1 for c in cands):
        # the launch state is a chain (SGLang's adaptive mode runs topk 1 only): the shortest free one
        cands.append(chain(next(s for s in range(1, 64) if s not in trees)))
    why = candidate_problem(cands)
    if why:
        raise ValueError(why)
    steps = sorted({c[0] for c in cands} | {0})
    chains = [s for s in steps if s > 0 and s not in trees]
    if initial_steps is None:
        # the largest chain: SGLang 0.5.17 sizes a logits buffer from --speculative-num-steps
        initial_steps = chains[-1]
    if initial_steps not in steps:
        raise ValueError(f"initial steps {initial_steps} is not among the candidates {steps}")
    if initial_steps in trees:
        raise ValueError(f"initial steps {initial_steps} is the tree {name(trees[initial_steps])}: SGLang "
                         f"launches adaptive speculation as a chain (topk 1); pick a chain's steps")
    flags = [
        "--speculative-algorithm", algorithm,
        "--speculative-eagle-topk", "1",
        "--speculative-num-steps", str(initial_steps),
        "--speculative-num-draft-tokens", str(initial_steps + 1),
        "--speculative-adaptive",
        "--speculative-adaptive-config", config_path,
    ]
    if trees:
        flags += ["--page-size", "1"]  # the tree's KV layout for page > 1 needs a topk-aware reserve
    env = {"SPECCTL_MODE": mode, "SPECCTL_SERVER_ID": server_id}
    if rundir:
        env["SPECCTL_RUNDIR"] = rundir
    if fallback_threshold != DEFAULT_THRESHOLD or tuple(fallback_config) != DEFAULT_CONFIG:
        env["SPECCTL_FALLBACK"] = f"{fallback_threshold}:" + ",".join(map(str, fallback_config))
    if not plain_decode:
        env["SPECCTL_PATCHES"] = "plain_decode=off"
    # one slot from batch 1 up: every candidate is reachable (and CUDA-graph captured) at every size
    cfg: dict[str, Any] = {"1": {"candidate_steps": steps}}
    if trees:
        cfg[SIZING_SLOT] = {"candidate_steps": [max(c[2] for c in trees.values()) - 1]}
        cfg[SPECCTL_KEY] = {"states": {str(k): list(c) for k, c in sorted(trees.items())}}
    return LaunchArgs(cfg, flags, env, config_path)
