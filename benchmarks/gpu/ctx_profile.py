"""Decode step time at two or more context lengths, per configuration: a simulator profile with a context term.

  THERE (the GPU machine, one command):
  python3 benchmarks/gpu/ctx_profile.py measure --model /tmp/m/8b --draft /tmp/m/draft --out $OUT \
      [--policies off,static:s1,static:s3] [--prompt-tokens 512,7680] [--levels 1,4,16,32,64] \
      [--new-tokens 384] [--rounds 3] [--deadline-s 540]
  HERE (turn the call's output into a shipped profile; several calls' outputs, each with other policies, merge:
  an H100 holds two 8B testbed servers, so there `--policies off,static:s3` and `--policies static:s1` are two calls):
  python3 benchmarks/gpu/ctx_profile.py convert OUT/ctx-steps.json [OUT2/ctx-steps.json ...] --name NAME \
      --out training/data/profiles/NAME.json

measure: one server per policy (`off` is a server without speculation), all up at once, taking turns per
(round, prompt length, concurrency) in an order rotated every round. A turn is a wave: c requests sent at
once, each a distinct retrieval-augmented prompt of about L tokens (prompts.long_prompts: a generated
document, then an MT-Bench / HumanEval request), greedy, exactly --new-tokens tokens (ignore_eos). Every
prefill happens at the wave's start, so the `Decode batch` lines at exactly c running requests after the first
two are decode steps alone: step ms = 1000 * c * accept_len / gen_throughput, context per request =
#token / c. A closed loop would interleave prefills of L-token prompts with every few decode steps.
Writes OUT/ctx-steps.json (every wave), OUT/profile-ctx.json (the profile, as `convert` makes it) and the
server logs. prompt + new tokens must fit the model's context (SmolLM2: 8192, hence 7680 + 384).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics as st
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prompts as P  # noqa: E402
import run_bench as RB  # noqa: E402
from benchlib import parse_decode_lines, policy_launch_args, profile_with_ctx, server_args  # noqa: E402

T0 = time.time()
METHOD = ("waves of c requests at once (distinct ~L-token prompts, exactly new-tokens tokens each): decode step ms = "
          "1000 * c * accept_len / gen_throughput of the Decode-batch lines at exactly c running requests after the "
          "first two; context per request = #token / c")


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def wave(port, items, new):
    """len(items) requests at once, each exactly `new` tokens (ignore_eos), greedy; -> (ok count, wall s).
    One thread per request (stdlib: the waves need no streaming)."""
    import threading
    import urllib.request

    ok = [False] * len(items)

    def one(i, ids):
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=900) as f:
                ok[i] = json.loads(f.read()).get("meta_info", {}).get("completion_tokens", 0) == new
        except Exception:  # noqa: BLE001 - counted as a failed request
            pass

    t = time.time()
    threads = [threading.Thread(target=one, args=(i, x["ids"])) for i, x in enumerate(items)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sum(ok), time.time() - t


def wave_steps(log_text, c):
    """Step time and context of one wave from the server log lines it printed: lines at exactly c running
    requests, the first two dropped (they span the prefills)."""
    lines = [ln for ln in log_text.splitlines() if "Decode batch" in ln and f"#running-req: {c}," in ln]
    return parse_decode_lines("\n".join(["(first line, dropped)"] + lines[2:]), c)


def model_context(model_dir):
    """max_position_embeddings of the model's config.json, or None."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            return int(json.load(f).get("max_position_embeddings"))
    except (OSError, ValueError, TypeError):
        return None


def prompt_tol(length, new_tokens, ctx_max, tol=0.02):
    """How far a long prompt may miss its length (prompts.long_prompts' tol): 2 %, less where 2 % more would not
    fit the model's context with the new tokens (7,680 + 2 % + 384 > SmolLM2's 8,192)."""
    if not ctx_max:
        return tol
    return min(tol, max(0.001, (ctx_max - new_tokens - length) / length))


KV_HEADROOM = 1.1  # SGLang admits a request only with room for the running ones' remaining output too


def kv_cap_problem(cap, concurrency, longest_prompt, new_tokens):
    """Why a KV cap (--max-total-tokens, 0 = none) cannot hold a wave of `concurrency` requests at once, or None.
    2026-12-06 (H100, G1): 214,000 tokens for 32 prompts of ~6,160 tokens + 384 new ones (209,500) admitted 31,
    the 32nd waited in the queue, and the wave had no step at 32 running requests; 10 % over the wave's tokens."""
    need = concurrency * (longest_prompt + new_tokens)
    if cap and cap < KV_HEADROOM * need:
        return (f"--max-total-tokens {cap} is short of {KV_HEADROOM} x {concurrency} x ({longest_prompt} + {new_tokens}) "
                f"= {int(KV_HEADROOM * need)}: SGLang would queue the wave's last requests, which then has no step "
                f"at {concurrency} running requests")
    return None


def measure(a):
    os.makedirs(a.out, exist_ok=True)
    deadline = T0 + a.deadline_s
    lengths = [int(x) for x in a.prompt_tokens.split(",") if x]
    levels = [int(x) for x in a.levels.split(",") if x]
    policies = [p for p in a.policies.split(",") if p]
    ctx_max = model_context(a.model)
    if ctx_max and max(lengths) + a.new_tokens > ctx_max:
        raise SystemExit(f"prompt {max(lengths)} + {a.new_tokens} new tokens exceed the model's context {ctx_max}")
    tok = P.tokenizer_for(a.tokenizer or a.model)
    mtb, he = P.load_benchmark_sets(a.model, a.prompts, tok=tok)
    asks = [x for pair in zip(mtb, he) for x in pair]
    filler = P.gen_train_prompts(2000, seed=5)
    pools = {L: P.long_prompts(tok, asks[:max(levels)], L, filler, tol=prompt_tol(L, a.new_tokens, ctx_max))
             for L in lengths}
    longest = {L: max(x["n_tokens"] for x in items) for L, items in pools.items()}
    for L, n in longest.items():
        if ctx_max and n + a.new_tokens > ctx_max:
            raise SystemExit(f"a {L}-token prompt came out at {n} tokens: with {a.new_tokens} new tokens it "
                             f"exceeds the model's context {ctx_max} (SGLang would refuse it and the wave lose it)")
    kv = max(lengths) * max(levels) + a.new_tokens * max(levels)
    problem = kv_cap_problem(a.max_total_tokens, max(levels), max(longest.values()), a.new_tokens)
    if problem:
        raise SystemExit(problem)
    memf = a.mem_fraction or round(0.8 / max(1, len(policies)), 3)
    common = server_args(max(levels), memf, max_total_tokens=a.max_total_tokens, prefill_graph=False)
    common += ["--context-length", str(max(lengths) + a.new_tokens + 64)] if a.context_length else []
    res = {"gpu": None, "method": METHOD, "prompt_tokens": lengths, "levels": levels,
           "new_tokens": a.new_tokens, "kv_tokens_needed": kv, "waves": [], "servers": {}}
    try:
        import subprocess
        res["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                    text=True).stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        pass
    live = []
    try:
        for k, pol in enumerate(policies):
            args, env_extra, cfg = policy_launch_args(pol, a.draft)
            if cfg is not None:
                raise SystemExit(f"{pol}: measure static policies and off only (a server per configuration)")
            lp = os.path.join(a.out, f"ctx-{pol.replace(':', '_')}.log")
            sv = {"policy": pol, **RB.start_server(a.model, a.port0 + 10 * k, common + args, dict(os.environ, **env_extra), lp)}
            live.append(sv)
            log("launched", pol)
        for sv in live:
            ok = RB.wait_ready(sv, 400, deadline)
            res["servers"][sv["policy"]] = {"cmd": sv["cmd"], "ready": ok, "ready_s": round(time.time() - sv["t"], 1)}
            if not ok:
                raise SystemExit(f"{sv['policy']} NOT ready:\n" + open(sv["log"]).read()[-2000:])
        for sv in live:  # warm-up: CUDA graphs, allocator, both prompt lengths
            for L in lengths:
                wave(sv["port"], pools[L][:4], 16)
        turn = 0
        for rnd in range(a.rounds):
            for L in lengths:
                for c in levels:
                    if time.time() > deadline - 30:
                        log("deadline: stop")
                        raise StopIteration
                    k = turn % len(live)
                    turn += 1
                    for sv in live[k:] + live[:k]:
                        off = os.path.getsize(sv["log"])
                        n_ok, wall = wave(sv["port"], pools[L][:c], a.new_tokens)
                        time.sleep(0.3)
                        with open(sv["log"]) as f:
                            f.seek(off)
                            st_ = wave_steps(f.read(), c)
                        row = {"policy": sv["policy"], "round": rnd, "prompt_tokens": L, "concurrency": c,
                               "ok": n_ok, "wall_s": round(wall, 3), **st_}
                        res["waves"].append(row)
                        log(f"{sv['policy']} L={L} c={c} round {rnd}: step {st_.get('step_ms_med')} ms, "
                            f"ctx {st_.get('ctx_per_req_med')} tokens a request, {n_ok}/{c} ok, {st_.get('n_lines')} lines")
    except StopIteration:
        pass
    finally:
        for sv in live:
            RB.kill_tree(sv["proc"])
    json.dump(res, open(os.path.join(a.out, "ctx-steps.json"), "w"), indent=1)
    try:
        prof = to_profile(res, a.name)
        json.dump(prof, open(os.path.join(a.out, "profile-ctx.json"), "w"), indent=1)
        log("profile:", json.dumps(prof)[:1500])
    except ValueError as e:
        log("no profile:", e)


def rows_of(res):
    """One row per (policy, prompt length, concurrency): the median over rounds of the waves' step time and
    context, every round kept."""
    groups = {}
    for w in res["waves"]:
        groups.setdefault((w["policy"], w["prompt_tokens"], w["concurrency"]), []).append(w)
    rows = []
    for (pol, L, c), ws in sorted(groups.items()):
        steps = [w["step_ms_med"] for w in ws if w.get("step_ms_med")]
        ctx = [w["ctx_per_req_med"] for w in ws if w.get("ctx_per_req_med")]
        cvs = [w["step_ms_cv"] for w in ws if w.get("step_ms_cv") is not None]
        rows.append({"policy": pol, "prompt_tokens": L, "concurrency": c, "rounds_step_ms": steps,
                     "step_ms": round(st.median(steps), 4) if steps else None,
                     "ctx_per_req": round(st.median(ctx), 1) if ctx else None,
                     "step_ms_cv": round(st.median(cvs), 4) if cvs else None})
    return rows


def to_profile(res, name, source=None):
    src = {"method": "ctx_profile.py waves: median over rounds of the Decode-batch step time at c running requests",
           "gpu": res.get("gpu"), "prompt_tokens": res.get("prompt_tokens"), "new_tokens": res.get("new_tokens")}
    if source:
        src["waves"] = source
    return profile_with_ctx(rows_of(res), name, source=src)


def merge_steps(paths):
    """Several measure calls' ctx-steps.json as one: their waves together (a GPU that holds fewer servers at once,
    e.g. an H100 two 8B testbed servers, measures the policies over several calls). They must come from the same
    kind of GPU, prompt lengths and new tokens, and no policy measured by two of them."""
    runs = [json.load(open(p)) for p in paths]
    res = dict(runs[0], waves=[], servers={})
    for p, r in zip(paths, runs):
        for key in ("gpu", "prompt_tokens", "new_tokens"):
            if r.get(key) != res.get(key):
                raise SystemExit(f"{p}: {key} {r.get(key)!r} differs from {paths[0]}'s {res.get(key)!r}: one profile "
                                 f"holds step times of one setting")
        twice = {w["policy"] for w in r["waves"]} & {w["policy"] for w in res["waves"]}
        if twice:
            raise SystemExit(f"{p}: policies {sorted(twice)} were measured by an earlier file too")
        res["waves"] += r["waves"]
        res["servers"].update(r.get("servers", {}))
    return res


def convert(a):
    res = merge_steps(a.steps)
    src = [os.path.relpath(p) for p in a.steps]
    prof = to_profile(res, a.name, source=src[0] if len(src) == 1 else src)
    json.dump(prof, open(a.out, "w"), indent=1)
    print("wrote", a.out)
    for r in rows_of(res):
        print(f"{r['policy']:12s} L={r['prompt_tokens']:6d} c={r['concurrency']:4d}  step {r['step_ms']} ms  "
              f"ctx {r['ctx_per_req']} a request  rounds {r['rounds_step_ms']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--model", required=True)
    m.add_argument("--draft", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--name", default="h200-sglang-smollm2-135m-ctx")
    m.add_argument("--policies", default="off,static:s1,static:s3")
    m.add_argument("--prompt-tokens", default="512,7680")
    m.add_argument("--levels", default="1,4,16,32,64")
    m.add_argument("--new-tokens", type=int, default=384)
    m.add_argument("--rounds", type=int, default=3)
    m.add_argument("--mem-fraction", type=float, default=0.0, help="per server; 0 = 0.8/servers")
    m.add_argument("--max-total-tokens", type=int, default=0, help="cap each server's KV pool (tokens); it must hold 1.1 x "
                                                                   "max(levels) * (max(prompt-tokens) + new-tokens)")
    m.add_argument("--context-length", action="store_true", help="pass --context-length prompt + new + 64")
    m.add_argument("--prompts", default="/tmp/specctl-stash/aux/prompts")
    m.add_argument("--tokenizer", default=None, help="tokenizer dir (default: --model); 'simple' for CPU tests")
    m.add_argument("--deadline-s", type=float, default=540)
    m.add_argument("--port0", type=int, default=32000)
    c = sub.add_parser("convert")
    c.add_argument("steps", nargs="+", help="one or more measure calls' ctx-steps.json (same GPU kind and setting)")
    c.add_argument("--name", required=True)
    c.add_argument("--out", required=True)
    a = ap.parse_args()
    measure(a) if a.cmd == "measure" else convert(a)


if __name__ == "__main__":
    main()
