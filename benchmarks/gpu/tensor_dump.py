"""Where the decode state's batch-1 forward parts from the no-spec server's (issue 19 item 5).

2026-12-02 (third lease): at batch 1 the decode state's greedy outputs part from the no-spec server's for 12 of 16
prompts, with and without CUDA graphs alike, while the prefills are bit-identical and batch 16 agrees 16 / 16. This
runs both servers with SGLang's own tensor dump (`--debug-tensor-dump-output-folder`: eager, every leaf module's
output per forward pass, for the listed layers only; an EAGLE server writes its target's passes under `target/`),
sends the chosen prompts one at a time (greedy, a few tokens), matches the two servers' forward passes by their
positions, and reports, pass by pass, the first module output that differs and by how much.

    PYTHONPATH=/tmp/site python3 benchmarks/gpu/tensor_dump.py --model /tmp/m/8b --draft /tmp/m/draft \\
        --pids mtbench-87,mtbench-88,HumanEval/2 --new-tokens 4 --layers 0,1,2,3,4,8,16,32,69 --out $OUT

Writes $OUT/tensor-dump.json (small: the per-pass comparison, not the tensors; the dumps stay under --dump-dir).

2026-12-03: the answer. Sent one after another, each prompt's prefill reuses the chat template's cached prefix, and
an EAGLE server's radix cache keys on token pairs (0.5.17 `RadixKey.maybe_to_bigram_view`), so it reuses one token
less and prefills one more (37 against 38 rows): other GEMM shapes, other bf16 rounding, and a near-tie later parts
the texts. With `--flush` (the radix cache emptied before each prompt) every dumped module output of every pass,
prefill and decode, is bit-identical in both servers.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import benchlib as B  # noqa: E402
import prompts as P  # noqa: E402
import specctl_side as SC  # noqa: E402
from run_bench import closed_loop, flush_cache, kill_tree, start_server, wait_ready  # noqa: E402

DECODE_STATE = "plugin-fixed:1:s3"  # speculation off at every batch size: every step is the decode state's
TDUMP_SITE = os.path.join(HERE, "tdump_site")  # its sitecustomize.py lets SGLang's tensor dump take nested outputs


def passes(folder: str) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "*", "Pass*.pt")))


def launch(pol: str, model: str, draft: str, port: int, dump: str, layers: list[int], out: str, site: str | None):
    args, env_extra, cfg = B.policy_launch_args(pol, draft)
    if cfg is not None:
        cp = os.path.join(out, f"adaptive-{pol.replace(':', '_')}.json")
        json.dump(cfg, open(cp, "w"))
        args += ["--speculative-adaptive-config", cp]
    env = dict(os.environ, **env_extra)
    if B.parse_policy(pol)["kind"] == "plugin-fixed":  # no daemon: fixed mode needs none
        env.update({"SGLANG_PLUGINS": "specctl", "SPECCTL_MODE": "fixed", "SPECCTL_TELEMETRY": "none",
                    "SPECCTL_POLICY": "none", **env_extra})
        env = SC.with_pythonpath(env, TDUMP_SITE, site)  # TDUMP_SITE: SGLang's dumper on an EAGLE-3 target
    common = B.server_args(1, 0.3, max_total_tokens=20000)
    dump_args = ["--debug-tensor-dump-output-folder", dump, "--debug-tensor-dump-layers", *map(str, layers)]
    return start_server(model, port, common + args + dump_args, env,
                        os.path.join(out, f"tdump-{pol.replace(':', '_')}.log"))


def compare_pass(a_path: str, b_path: str) -> dict:
    """Module by module (the no-spec pass's order): shapes, and the max |a - b| where both are float tensors."""
    import torch

    a, b = torch.load(a_path, map_location="cpu"), torch.load(b_path, map_location="cpu")
    first, differing, per_key, missing = None, 0, {}, []
    for k, va in a.items():
        if k not in b:
            missing.append(k)
            continue
        vb = b[k]
        va = va[0] if isinstance(va, list) else va
        vb = vb[0] if isinstance(vb, list) else vb
        if not (torch.is_tensor(va) and torch.is_tensor(vb)):
            continue
        if va.shape != vb.shape:
            per_key[k] = f"shape {tuple(va.shape)} vs {tuple(vb.shape)}"
            first = first or k
            differing += 1
            continue
        if va.is_floating_point():
            d = float((va.float() - vb.float()).abs().max()) if va.numel() else 0.0
        else:
            d = float((va != vb).sum())
        if d:
            per_key[k] = d
            differing += 1
            first = first or k
    return {"keys": len(a), "differing": differing, "first_differing": first,
            "first_diff": per_key.get(first) if first else None, "missing_in_decode_state": missing[:10],
            "diffs": dict(list(per_key.items())[:40])}


def positions(path: str) -> tuple:
    import torch

    t = torch.load(path, map_location="cpu")
    pos = next((v for k, v in t.items() if k.endswith("forward_batch_info.positions")), None)
    return tuple(pos.tolist()) if pos is not None else ()


def compare_passes(off: list[str], decode_state: list[str]) -> list[dict]:
    """The two servers' pass files of one request, matched by the positions they ran (the prefill's 0..n-1, then
    one decode step each), compared in the decode state's order."""
    by_pos = {positions(p): p for p in off}
    rows = []
    for p in decode_state:
        pos = positions(p)
        if pos in by_pos:
            rows.append({"positions": [pos[0], pos[-1]] if pos else None, **compare_pass(by_pos[pos], p)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--pids", default="mtbench-87,mtbench-88,HumanEval/2",
                    help="prompt ids of run_bench's identity set (2026-12-02: mtbench-87 / -88 part at position 2)")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--layers", default="0,1,2,3,4,8,16,32,69", help="layer ids to dump (the 8b variant has 70)")
    ap.add_argument("--prompts", default="/tmp/specctl-stash/aux/prompts")
    ap.add_argument("--dump-dir", default="/tmp/tdump")
    ap.add_argument("--specctl-site", default="/tmp/specctl_site")
    ap.add_argument("--port0", type=int, default=33000)
    ap.add_argument("--flush", action="store_true", help="flush the radix cache before each prompt: every prompt prefilled whole")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    layers = [int(x) for x in a.layers.split(",") if x]
    tok = P.tokenizer_for(a.model)
    mtb, he = P.load_benchmark_sets(a.model, a.prompts, tok=tok)
    by_id = {x.get("id"): x for x in mtb + he}
    items = [by_id[p] for p in a.pids.split(",") if p in by_id]
    if not items:
        raise SystemExit(f"none of {a.pids} among the prompt ids ({sorted(by_id)[:6]} ...)")
    site = SC.make_site(a.specctl_site)
    shutil.rmtree(a.dump_dir, ignore_errors=True)
    dumps = {"off": os.path.join(a.dump_dir, "off"), DECODE_STATE: os.path.join(a.dump_dir, "decode-state")}
    targets = {"off": dumps["off"], DECODE_STATE: os.path.join(dumps[DECODE_STATE], "target")}
    servers = {pol: launch(pol, a.model, a.draft, a.port0 + 10 * k, dumps[pol], layers, a.out, site)
               for k, pol in enumerate(dumps)}
    result = {"layers": layers, "new_tokens": a.new_tokens, "prompts": [x.get("id") for x in items], "servers": {},
              "flush": a.flush}
    try:
        for pol, sv in servers.items():
            ok = wait_ready(sv, 400)
            result["servers"][pol] = {"cmd": sv["cmd"], "ready": ok}
            if not ok:
                raise SystemExit(f"{pol} did not start: see {sv['log']}")
        per_prompt = {}
        for x in items:
            rec = {}
            for pol, sv in servers.items():
                before = len(passes(targets[pol]))
                if a.flush:  # every prompt prefilled whole in both servers (an EAGLE server reuses one cached token less)
                    flush_cache(sv["port"])
                outs, _ = asyncio.run(closed_loop(sv["port"], [x], 1, 1, a.new_tokens, stream=False))
                time.sleep(1.0)  # the last pass file is written when the next forward's model output arrives
                rec[pol] = {"ids": outs[0].get("ids") if outs else None, "passes": passes(targets[pol])[before:]}
            per_prompt[x.get("id")] = rec
    finally:
        for sv in servers.values():
            kill_tree(sv["proc"])
    report = {}
    for pid, rec in per_prompt.items():
        rows = compare_passes(rec["off"]["passes"], rec[DECODE_STATE]["passes"])
        report[pid] = {"ids_off": rec["off"]["ids"], "ids_decode_state": rec[DECODE_STATE]["ids"],
                       "passes_off": len(rec["off"]["passes"]), "passes_decode_state": len(rec[DECODE_STATE]["passes"]),
                       "matched_passes": rows}
        print(pid, json.dumps([{k: r[k] for k in ("positions", "differing", "first_differing", "first_diff")}
                               for r in rows]), flush=True)
    result["report"] = report
    json.dump(result, open(os.path.join(a.out, "tensor-dump.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
