"""Benchmark SGLang 0.5.17 + EAGLE-3 per speculation policy on the GPU machine (one command).

  python3 benchmarks/gpu/run_bench.py --model /tmp/m/8b --variant 8b --draft /tmp/m/draft \
      --policies off,static:s1,static:s2,static:s3,threshold:5:s3,sglang-adaptive \
      --levels 1,2,4,8,16,32,64,128 --phase --out $OUT [--parallel 3] [--deadline-s 540]

Per policy, a server (`python3 -m sglang.launch_server`) is launched; up to --parallel servers start at
once (start-up dominates), then each is measured alone (others idle with --sleep-on-idle) and killed; with
--interleave the group's servers stay up and take turns per (repetition, level), in an order rotated every
round, so that drift over the call lands on every policy alike (the figures to compare policies by):
  1. identity probe: 16 prompts, greedy, 64 tokens -> output ids (off vs spec must match token for token)
  2. concurrency sweep: closed loop of c streaming clients over MT-Bench turn-1 + HumanEval chat prompts
     (interleaved, fixed order), max_new_tokens --new-tokens, natural EOS; output tokens/s, median and p99
     TPOT, accept length (sum completion tokens / sum verify steps)
  3. phase-changing workload (--phase): PHASES below, concurrency and prompt class shifting over time
Step time per decode batch comes from SGLang's `Decode batch` log lines: 1000 * #running-req *
accept_len / gen_throughput (ms); the static policies' medians at each swept batch size give the cost
profile in the simulator format (specctl.profile/1).

With --phase-set alternating the phases are benchlib.alt_phases(--alt-concurrency): the prompts alternate
between the short benchmark ones (~100-300 tokens) and retrieval-augmented ones of --long-prompt-tokens (a
generated document, then the request; prompts.long_prompts), at concurrencies between the two spec->off
crossovers; compare `specctl` with
`specctl-noctx` (the same plugin, its daemon on --no-ctx-axis: one table for any context) with --interleave
--phase-repeats N: the servers take turns, and OUT/bench-<variant>.json gets `phase_pairs` (specctl ÷
specctl-noctx, run by run) and, per plugin policy, `table_flaps` of its last policy. (`specctl-gap`, the daemon
pricing the time between decode steps, ran on 2026-12-03 and is gone with `specctl serve --gap-term`.)

Policies: off | static:sN | threshold:T:sN (SGLang adaptive with slots {"1": [N], "T": [0]}: N steps below
batch size T, steps 0 from T up; SGLang pads a batch to a CUDA-graph size before the slot lookup; with
speculation 0.5.17 captures every size 1..8, then 10..32 by 2, 40..64 by 4, 72..256 by 8, so T <= 8 is
exact and a larger T should be one of those sizes) | sglang-adaptive (built-in EMA
policy, default config, launched at its largest candidate 7: the 0.5.17 logits-buffer bug) | specctl
(plugin in online mode + `specctl serve` started here with a fresh state dir, SGLANG_PLUGINS=specctl;
launched with an adaptive config whose candidates are 0..3; an unmeasured learning pass over
--specctl-learn levels first) | plugin-fixed:T:sN (threshold:T:sN decided by the plugin in fixed mode,
telemetry to a daemon: the same server with and without the plugin; plugin-fixed:1:sN = steps 0 at every batch
size). Any adaptive policy may end in +skipde (SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1 on its server), a plugin
policy in +verify (SPECCTL_PATCHES=plain_decode=off: "off" is SGLang's 1-token trivial verify, not the plugin's decode state).
pinned:C1/C2/... is one plugin server (online, no daemon) whose runs go through off (the decode state), C1, C2, ... in
turn: run_bench publishes each table itself (specctl_side.Override) and waits until the plugin logs it in force;
rows `pinned:...@C` (benchlib.pinned_run), decisions audited against every table published.
Any policy may end in +freezegc (SGLang's /freeze_gc once warm: benchlib.SERVER_ACTIONS); --log-gc counts each window's collections.
--resync POLS runs the draft-resync probe on those servers first (before anything else reaches them): see resync_probe.
specctl is installed as a PYTHONPATH folder (specctl_side.make_site), no wheel needed.
Writes OUT/bench-<variant>.json (the results format of issue 5), OUT/profile-<variant>.json, OUT/<policy>.log,
and per plugin policy OUT/specctl-<policy>/ (daemon log, every policy version, decision log, telemetry).
"""
import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as B  # noqa: E402
import prompts as P  # noqa: E402
from benchlib import (daemon_configs, identity_report, parse_decode_lines, parse_policy, phase_summary,  # noqa: E402
                      policy_launch_args, profile_from_runs, server_args, summarize_requests)
import specctl_side as SC  # noqa: E402

PHASES = [  # duration_s, concurrency, mix
    {"duration_s": 20, "concurrency": 2, "mix": {"code": 1.0}},
    {"duration_s": 20, "concurrency": 64, "mix": {"chat": 0.8, "code": 0.2}},
    {"duration_s": 20, "concurrency": 8, "mix": {"chat": 1.0}},
    {"duration_s": 20, "concurrency": 128, "mix": {"chat": 0.5, "code": 0.5}},
    {"duration_s": 20, "concurrency": 1, "mix": {"chat": 1.0}},
]
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def http(port, path, obj=None, t=10):
    r = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(obj).encode() if obj is not None else None,
                               headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=t) as f:
        return f.status, f.read().decode()


def flush_cache(port):
    """SGLang's /flush_cache: the radix cache emptied, so the next prompts are prefilled afresh at the probe's own
    batch (True), not read from KV another batch computed (the warm-up's, at batch 8: 2026-12-01's identity probes
    read the first 8 prompts' KV from there). SGLang refuses while requests run (the last ones of a closed loop
    can still be leaving): a few tries. False where every try was refused or failed."""
    for _ in range(10):
        try:
            if http(port, "/flush_cache", {}, t=30)[0] == 200:
                return True
        except Exception:  # noqa: BLE001 - urllib raises on 400
            pass
        time.sleep(0.3)
    return False


def freeze_gc(sv):
    """SGLang's /freeze_gc on a warm server -> the objects per generation its scheduler froze (its log line), or
    {"error": ...}: a server that refuses is measured as it is, and the record says so."""
    try:
        code, _ = http(sv["port"], "/freeze_gc", {}, t=30)
    except Exception as e:  # noqa: BLE001 - urllib raises on 4xx / 5xx
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    for _ in range(20):  # the scheduler logs the freeze after the HTTP answer
        got = B.gc_frozen(open(sv["log"], errors="replace").read())
        if got is not None:
            return got
        time.sleep(0.25)
    return {"error": f"/freeze_gc answered {code}, but the scheduler logged no freeze"}


OPENLOOP_SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openloop_shim")
OPENLOOP_KEYS = ("completed", "duration", "request_throughput", "output_throughput", "total_output_tokens",
                 "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
                 "median_itl_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms", "concurrency", "accept_length",
                 "max_concurrent_requests")


def sharegpt_file(path, items, tok, n, new_tokens, spread):
    """N conversations in ShareGPT's layout (bench_serving's sharegpt loader): the items' prompts in turn, each
    reply a text of exactly spread_tokens(new_tokens, spread, k) tokens under `tok` (the loader takes the output
    length from the reply's token count; the server is asked for that many with ignore_eos)."""
    word = " the"
    rows = []
    for k in range(n):
        want = B.spread_tokens(new_tokens, spread, k)
        m = want
        for _ in range(6):  # the loader counts tok.encode(reply), special tokens included
            got = len(tok.encode(word * m))
            if got == want:
                break
            m = max(1, m + want - got)
        rows.append({"id": f"{items[k % len(items)].get('id', k)}-{k}",
                     "conversations": [{"from": "human", "value": items[k % len(items)]["text"]},
                                       {"from": "gpt", "value": word * m}]})
    with open(path, "w") as f:
        json.dump(rows, f)
    return path


def bench_serving_cmd(python, port, model, tokenizer, dataset, rate, n, out_file, seed=1):
    """SGLang's own open-loop client against one server (Poisson arrivals at `rate`, the same `seed` for every
    server: the same prompts in the same order at the same arrival times)."""
    return [python, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1", "--port", str(port),
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "sharegpt", "--dataset-path", dataset,
            "--apply-chat-template", "--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed),
            "--ready-check-timeout-sec", "0", "--disable-tqdm", "--output-file", out_file]


def open_loop_summary(rows):
    """Per (policy, rate): the median run's figures (by output throughput) and every run's throughput and TTFT."""
    out = {}
    for r in rows:
        out.setdefault((r["policy"], r["rate"]), []).append(r)
    summary = []
    for (pol, rate), rs in sorted(out.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ok = [r for r in rs if r.get("output_throughput") is not None]
        if not ok:
            summary.append({"policy": pol, "rate": rate, "runs": len(rs), "error": rs[-1].get("error")})
            continue
        med = sorted(ok, key=lambda r: r["output_throughput"])[(len(ok) - 1) // 2]
        summary.append({"policy": pol, "rate": rate, "runs": len(ok),
                        **{k: med.get(k) for k in OPENLOOP_KEYS},
                        "median_ttft_ms_median": B.pct([r["median_ttft_ms"] for r in ok], 0.5),
                        "repeats_output_throughput": [r["output_throughput"] for r in ok],
                        "repeats_median_ttft_ms": [r["median_ttft_ms"] for r in ok]})
    return summary


MOE_MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "moe_models")


def target_env(model, variant):
    """({"env", "path"} or None, the record's model name): the MoE target (build_moe.py) is served through the
    testbed's external model package, which SGLang 0.5.17 imports by name (SGLANG_EXTERNAL_MODEL_PACKAGE)."""
    try:
        cfg = json.load(open(os.path.join(model, "config.json")))
    except (OSError, ValueError):
        cfg = {}
    if cfg.get("model_type") == "qwen2_moe":
        tail = len(cfg.get("mlp_only_layers") or [])
        name = (f"Qwen2-MoE of SmolLM2-135M-Instruct ({cfg.get('num_experts')} experts, "
                f"top-{cfg.get('num_experts_per_tok')}{f', {tail} zero-output dense tail layers' if tail else ''}, "
                f"build_moe.py)")
        return {"env": {"SGLANG_EXTERNAL_MODEL_PACKAGE": "specctl_testbed_models"}, "path": MOE_MODELS}, name
    return None, "SmolLM2-135M-Instruct" + ("" if variant == "base" else f" zero-padded ({variant})")


def start_server(model, port, args, env, logpath):
    """`python3 -m sglang.launch_server` on 127.0.0.1:port, output to logpath: {"port", "proc", "log", "t", "cmd"}."""
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port)] + args
    p = subprocess.Popen(cmd, stdout=open(logpath, "w"), stderr=subprocess.STDOUT, env=env)
    return {"port": port, "proc": p, "log": logpath, "t": time.time(), "cmd": " ".join(cmd[1:])}


def wait_ready(sv, limit, deadline=float("inf")):
    """A launched server ({"proc", "port", "t"}) answers /health within `limit` s of its launch (and before the
    epoch `deadline`); False as soon as its process has exited."""
    while time.time() - sv["t"] < limit and time.time() < deadline:
        if sv["proc"].poll() is not None:
            return False
        try:
            if http(sv["port"], "/health", t=2)[0] == 200:
                return True
        except Exception:
            pass
        time.sleep(1)
    return False


def kill_tree(proc):
    try:
        import psutil
        p = psutil.Process(proc.pid)
        for c in p.children(recursive=True) + [p]:
            try:
                c.kill()
            except Exception:
                pass
    except Exception:
        try:
            proc.kill()
        except Exception:
            pass


def top2_rows(meta):
    """[logprob 1, id 1, logprob 2, id 2] per output position from SGLang's `output_top_logprobs`."""
    return [[t[0][0], t[0][1], t[1][0], t[1][1]] if t and len(t) >= 2 else None
            for t in meta.get("output_top_logprobs") or []]


def top2_margins(meta):
    """log p(top-1) - log p(top-2) per output position from SGLang's `output_top_logprobs` (None where absent)."""
    return [(t[0][0] - t[1][0]) if t and len(t) >= 2 and t[0][0] is not None and t[1][0] is not None else None
            for t in meta.get("output_top_logprobs") or []]


def prompt_logprobs(meta):
    """(log p of every prompt token after the first, from the prefill's logits; the first output token's top-2
    as [[logprob, id], ...]) from SGLang's meta_info of a logprob_start_len=0 request."""
    lp = [t[0] for t in (meta.get("input_token_logprobs") or [])[1:]]
    top = (meta.get("output_top_logprobs") or [None])[0] or []
    return lp, [[t[0], t[1]] for t in top[:2]]


def client_session():
    """The benchmark's HTTP client: no cap on open connections. aiohttp's default connector holds at most 100,
    so until 2026-12-03 every "c = 128" level and phase ran at most 100 requests at a time."""
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900), connector=aiohttp.TCPConnector(limit=0))


async def one_request(session, port, ids, new, out, stream=True, pid=None, top2=False, ignore_eos=False,
                      prefill_lp=False):
    """Streaming /generate; records ttft, latency, tokens, verify count (stream=False: also the output ids, and
    with top2 the top-1 minus top-2 log-probability of every output position; with prefill_lp the prompt's
    log-probabilities from the prefill, `prompt_lp`, and the first output token's top-2, `first_top2`)."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new}, "stream": stream}
    if ignore_eos:
        body["sampling_params"]["ignore_eos"] = True
    if top2:
        body.update(return_logprob=True, top_logprobs_num=2)
    if prefill_lp:
        body.update(return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
    t = time.perf_counter()
    ttft, meta, text_ids = None, {}, []
    try:
        if not stream:
            async with session.post(f"http://127.0.0.1:{port}/generate", json=body) as r:
                o = await r.json()
            out.append({"ttft": None, "latency": time.perf_counter() - t, "tokens": o["meta_info"].get("completion_tokens", 0),
                        "verify_ct": o["meta_info"].get("spec_verify_ct"), "t_end": time.time(), "ids": o.get("output_ids"),
                        "pid": pid, **({"top2": top2_margins(o["meta_info"]), "top2_rows": top2_rows(o["meta_info"])}
                                       if top2 else {})})
            if prefill_lp:
                out[-1]["prompt_lp"], out[-1]["first_top2"] = prompt_logprobs(o["meta_info"])
            return
        async with session.post(f"http://127.0.0.1:{port}/generate", json=body) as r:
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                o = json.loads(data)
                if ttft is None:
                    ttft = time.perf_counter() - t
                meta = o.get("meta_info", meta)
                if o.get("output_ids") is not None:
                    text_ids = o["output_ids"]
        lat = time.perf_counter() - t
        out.append({"ttft": ttft, "latency": lat, "tokens": meta.get("completion_tokens", 0),
                    "verify_ct": meta.get("spec_verify_ct"), "t_end": time.time(), "ids": text_ids})
    except Exception as e:
        out.append({"error": repr(e)[:200], "t_end": time.time()})


async def closed_loop(port, items, conc, n_req, new, stream=True, top2=False, ignore_eos=False, prefill_lp=False,
                      spread=0):
    """conc clients sending n_req requests (items in order, cycled); the k-th request drawn asks for
    spread_tokens(new, spread, k) tokens."""
    out, it = [], enumerate(items * (1 + n_req // max(1, len(items))))
    async with client_session() as s:
        async def worker(k):
            for _ in range(k):
                j, x = next(it)
                await one_request(s, port, x["ids"], B.spread_tokens(new, spread, j), out, stream, x.get("id"),
                                  top2=top2, ignore_eos=ignore_eos, prefill_lp=prefill_lp)
        per = [n_req // conc + (1 if i < n_req % conc else 0) for i in range(conc)]
        t = time.time()
        await asyncio.gather(*[worker(k) for k in per if k])
        return out, time.time() - t


async def phase_loop(port, pools, phases, new, seed=0, spread=0):
    """The phase workload: every request's record carries the phase it was sent in (`phase`); returns (records,
    wall, the epoch the first phase began at). The n-th request sent asks for spread_tokens(new, spread, n)."""
    rng = random.Random(seed)
    out, idx = [], {k: 0 for k in pools}
    sent = [0]

    async def tagged(s, k, ids):
        got = []
        sent[0] += 1
        await one_request(s, port, ids, B.spread_tokens(new, spread, sent[0] - 1), got)
        for o in got:
            o["phase"] = k
        out.extend(got)

    async with client_session() as s:
        inflight = set()
        t_start = time.time()
        for k, ph in enumerate(phases):
            t_end = time.time() + ph["duration_s"]
            classes, weights = zip(*ph["mix"].items())
            while time.time() < t_end:
                while len(inflight) < ph["concurrency"]:
                    c = rng.choices(classes, weights)[0]
                    item = pools[c][idx[c] % len(pools[c])]
                    idx[c] += 1
                    task = asyncio.ensure_future(tagged(s, k, item["ids"]))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
                await asyncio.sleep(0.005)
        if inflight:
            await asyncio.gather(*inflight)
        return out, time.time() - t_start, t_start


async def traced_request(session, port, ids, new, trace, out_ids=None):
    """Streaming /generate with ignore_eos: every chunk's completion_tokens into trace; the last entry is
    (completion_tokens, spec_verify_ct) of the finished request (SGLang 0.5.17 reports spec_verify_ct only
    when a request finishes: tokenizer_manager's _calculate_spec_decoding_metrics). With out_ids (a list): the
    output ids, whether the chunks carry all ids so far (SGLang's default) or only the new ones."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True},
            "stream": True}
    async with session.post(f"http://127.0.0.1:{port}/generate", json=body) as r:
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            o = json.loads(line[5:].strip())
            m = o.get("meta_info", {})
            if m.get("completion_tokens") is not None:
                trace.append((m["completion_tokens"], m.get("spec_verify_ct")))
                got = o.get("output_ids")
                if out_ids is not None and got is not None:
                    # SGLang's default stream carries every id so far (a live reference: at times ahead of its
                    # meta_info; the finished chunk is exact); an incremental stream only the new ones
                    if len(got) >= m["completion_tokens"]:
                        out_ids[:] = got
                    else:
                        out_ids.extend(got)


def log_accept(text, running, min_tokens):
    """Mean `accept len` of SGLang's Decode-batch lines with exactly `running` requests holding at least
    min_tokens KV tokens (#token), and how many lines that is: the accept length at those positions."""
    acc = []
    for ln in text.splitlines():
        if "Decode batch" not in ln:
            continue
        a, b, t = B.R_RUN.search(ln), B.R_ACC.search(ln), B.R_TOK.search(ln)
        if a and b and t and int(a.group(1)) == running and int(t.group(1)) >= min_tokens:
            acc.append(float(b.group(1)))
    return (round(sum(acc) / len(acc), 4) if acc else None), len(acc)


def _read_from(path, offset):
    with open(path, errors="replace") as f:
        f.seek(offset)
        return f.read()


def _whole_accept(traces):
    """Tokens per verify step over whole requests (their final stream chunks)."""
    tok = sum(tr[-1][0] for tr in traces if tr and tr[-1][1])
    ver = sum(tr[-1][1] for tr in traces if tr and tr[-1][1])
    return round(tok / ver, 4) if ver else None


async def resync_probe(port, log_path, probes, fillers, *, probe_tokens=2400, off_s=30.0, filler_c=60,
                       filler_tokens=128, min_tail=200):
    """Does the draft stay in sync across a long plain-decode stretch? On a threshold:5 server (speculating
    below batch 5): (1) the 4 probe prompts alone (c=4, speculating throughout) for probe_tokens each, ignore_eos:
    the reference; (2) the same 4 probes again, now beside filler_c closed-loop fillers (batch 64: plain decode)
    for off_s; the fillers then stop and drain, and the probes finish speculating at c=4 (the tail).
    accept_before / accept_after: the mean accept length of the server's Decode-batch lines at exactly 4 running
    requests holding at least T0 KV tokens, T0 = the probes' prompts + their tokens where the tail began: the same
    positions in both runs. The log, not the stream: SGLang reports a request's verify count only when it finishes.
    Greedy text at batch 64 parts from batch 4's at bf16 near-ties, so after the stretch the reference's positions
    hold other text (2026-12-02: the control without draft extend kept its acceptance). Hence (3), the reference
    that can tell: with the radix cache flushed (so target and draft KV are prefilled afresh, in sync by
    construction), each probe's prompt + the run's own tokens up to where its tail began, continued at c = 4 for
    the tail's length: `accept_same_text` (its lines, all at >= T0) against accept_after, and per probe how many
    leading tail tokens both continuations share (`same_text_tokens`). A probe that finished during the plain
    stretch, or a tail shorter than min_tail tokens, leaves the figures None (say why in `invalid`)."""
    await asyncio.sleep(0.5)
    async with client_session() as s:
        ref = [[] for _ in probes]
        off0, t0 = os.path.getsize(log_path), time.time()
        await asyncio.gather(*[traced_request(s, port, p["ids"], probe_tokens, tr) for p, tr in zip(probes, ref)])
        ref_s = time.time() - t0
        await asyncio.sleep(0.5)  # the reference's last log lines
        ref_text = _read_from(log_path, off0)
        run = [[] for _ in probes]
        run_ids = [[] for _ in probes]
        t0 = time.time()
        probe_tasks = [asyncio.ensure_future(traced_request(s, port, p["ids"], probe_tokens, tr, oi))
                       for p, tr, oi in zip(probes, run, run_ids)]
        out, idx, inflight = [], 0, set()
        while time.time() - t0 < off_s and not any(t.done() for t in probe_tasks):
            while len(inflight) < filler_c:
                item = fillers[idx % len(fillers)]
                idx += 1
                task = asyncio.ensure_future(one_request(s, port, item["ids"], filler_tokens, out))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
            await asyncio.sleep(0.01)
        off_stretch_s = time.time() - t0
        tail_from = [tr[-1][0] if tr else 0 for tr in run]
        if inflight:
            await asyncio.gather(*inflight)
        tail_off = os.path.getsize(log_path)
        await asyncio.gather(*probe_tasks)
        await asyncio.sleep(0.5)
        run_text = _read_from(log_path, tail_off)
        # (3) the same-text reference: the run's own tokens before its tail, prefilled afresh, continued at c = 4
        same = [[] for _ in probes]
        same_ids = [[] for _ in probes]
        flushed = await asyncio.get_running_loop().run_in_executor(None, flush_cache, port)
        same_off = os.path.getsize(log_path)
        await asyncio.gather(*[traced_request(s, port, p["ids"] + oi[:k], max(1, probe_tokens - k), tr, si)
                               for p, oi, k, tr, si in zip(probes, run_ids, tail_from, same, same_ids)])
        await asyncio.sleep(0.5)
        same_text = _read_from(log_path, same_off)
    invalid = None
    if any(t >= probe_tokens for t in tail_from):
        invalid = "a probe finished during the plain-decode stretch (raise probe_tokens)"
    elif probe_tokens - max(tail_from) < min_tail:
        invalid = f"a tail shorter than {min_tail} tokens (raise probe_tokens)"
    t0_tokens = sum(len(p["ids"]) for p in probes) + sum(tail_from)
    before, n_before = log_accept(ref_text, len(probes), t0_tokens)
    after, n_after = log_accept(run_text, len(probes), t0_tokens)
    same_acc, n_same = log_accept(same_text, len(probes), t0_tokens)
    shared = []
    for oi, k, si in zip(run_ids, tail_from, same_ids):
        tail = oi[k:]
        shared.append(next((i for i, (x, y) in enumerate(zip(tail, si)) if x != y), min(len(tail), len(si))))
    if not all(len(oi) == probe_tokens for oi in run_ids):
        invalid = invalid or "the run's output ids are incomplete (no same-text reference)"
    if invalid:
        before = after = same_acc = None
    return {"accept_before": before, "accept_after": after, "lines_before": n_before, "lines_after": n_after,
            "accept_same_text": same_acc, "lines_same_text": n_same, "same_text_tokens": shared,
            "same_text_cache_flushed": flushed,
            "invalid": invalid, "tail_from_tokens": tail_from, "window_min_kv_tokens": t0_tokens,
            "probe_tokens": probe_tokens, "whole_request_accept_before": _whole_accept(ref),
            "whole_request_accept_after": _whole_accept(run), "off_stretch_s": round(off_stretch_s, 1),
            "fillers": len(out), "filler_errors": sum(1 for o in out if "error" in o), "reference_s": round(ref_s, 1),
            "probe_c": len(probes), "filler_c": filler_c}


def profile_server(port, out_dir, name, c, items, steps=40, new_tokens=1024, wait_s=120.0, churn=False, spread=0,
                   stack=False):
    """A torch profile of `steps` forward steps of one server under a closed loop at concurrency c (SGLang's
    /start_profile: CPU + GPU activities, no shapes; stacks only with `stack`: torch's Python tracer, whose
    `python_function` events trace_steps turns into self / inclusive time per function; it slows every Python
    call, so such a profile's step times are not the server's), reduced here by trace_steps.py to
    OUT/prof-<name>-c<c>.json; the raw trace (tens of MB) is deleted. The reduction, or {"error": ...}.
    The load ignores EOS, so all c requests are still decoding when the profile starts (2026-12-01, without:
    the c=16 profiles caught batches of 5 and 6). churn: instead, a closed loop of 8c requests of new_tokens that
    end at EOS, so requests finish and arrive between steps as in the phase workload (trace_steps'
    `prefill_windows`: what the steps around the prefills cost), with the run's caps spread (`spread`, as
    --new-tokens-spread) and the profile started after about three requests' lifetimes: at one cap and 3 s in,
    2026-12-03's profiles of two servers caught one the first cohort's arrival burst (11 prefills in 27
    windows) and the other a calm stretch between cohorts (1 in 37), and could not be compared."""
    import glob
    import threading

    import trace_steps
    d = os.path.join(out_dir, f"trace-{name}-c{c}")
    os.makedirs(d, exist_ok=True)
    stop = threading.Event()

    def load():
        while not stop.is_set():
            if churn:
                asyncio.run(closed_loop(port, items, c, 8 * c, new_tokens, spread=spread))
            else:
                asyncio.run(closed_loop(port, items, c, c, new_tokens, ignore_eos=True))

    th = threading.Thread(target=load, daemon=True)
    th.start()
    res: dict = {"label": f"{name} c={c}"}
    try:
        # every request in its decode phase; with churn, past the first cohort (three longest lifetimes at ~12 ms
        # a step, prefills included: 5.8 s at caps 128 +- 32)
        time.sleep(max(3.0, 3 * 0.012 * (new_tokens + spread)) if churn else 3.0)
        http(port, "/start_profile", {"output_dir": d, "num_steps": steps, "activities": ["CPU", "GPU"],
                                      "with_stack": stack, "record_shapes": False, "profile_id": f"{name}-c{c}"}, t=60)
        t0, last = time.time(), -1
        while time.time() - t0 < wait_s:
            got = glob.glob(os.path.join(d, "*.trace.json*"))
            size = sum(os.path.getsize(x) for x in got)
            if got and size == last:  # written and no longer growing
                break
            last = size
            time.sleep(2.0)
        got = sorted(glob.glob(os.path.join(d, "*.trace.json*")))
        if not got:
            res["error"] = f"no trace in {wait_s:.0f} s"
        else:
            res = trace_steps.reduce_events(trace_steps.load(got[0]), res["label"])
            res["trace_bytes"] = os.path.getsize(got[0])
    except Exception as e:  # noqa: BLE001 - a failed profile costs its row, not the call
        res["error"] = repr(e)[:300]
    finally:
        stop.set()
        th.join(timeout=120)
        shutil.rmtree(d, ignore_errors=True)
    with open(os.path.join(out_dir, f"prof-{name}-c{c}.json"), "w") as f:
        json.dump(res, f, indent=1)
    return res


def finish_plugin_run(sv, srv, out):
    """Stop the daemon; keep every policy version, audit the decision log against them, count SGLang's
    own switch lines; pack the telemetry recording."""
    d = sv["side"]
    try:
        d.stop()
        sdir = os.path.dirname(d.log_path)
        d.save(os.path.join(sdir, "policies.json"))
        from specctl.policies.fixed import DEFAULT_CONFIG, DEFAULT_THRESHOLD, fixed_threshold
        p = parse_policy(sv["policy"])  # plugin-fixed:T:C sets the plugin's fallback; specctl:TREE falls back to its tree
        fb = fixed_threshold(p.get("threshold", DEFAULT_THRESHOLD), tuple(p["config"]) if "config" in p else DEFAULT_CONFIG)
        dec = SC.read_decisions(os.path.join(sdir, "decisions-rank0.txt"))
        aud = SC.audit_decisions(dec, {v: x["policy"] for v, x in d.policies.items()}, fallback=fb)
        aud["sglang_switch_lines"] = SC.count_switch_lines(open(sv["log"]).read())
        aud["policy_versions_seen"] = len(d.policies)
        if d.policies:  # speculating rows after the first plain-decode row, per table of the last policy
            from benchlib import policy_flaps
            last = d.policies[max(d.policies)]["policy"]
            aud["table_flaps"] = policy_flaps(last)
            aud["ctx_bands"] = sum(1 for k in aud["table_flaps"] if k != "any")
        srv["specctl"] = aud
        log(f"{sv['policy']}: {aud['checked']}/{aud['decisions']} decisions audited, match {aud['match_frac']}, "
            f"{aud['step_changes']} step changes vs {aud['sglang_switch_lines']} SGLang switch lines, "
            f"{aud['policy_versions_seen']} policy versions")
    except Exception as e:  # noqa: BLE001 - the benchmark row stays; say what failed
        srv["specctl_error"] = repr(e)[:300]
        log("specctl finish failed:", repr(e)[:300])


def finish_pinned_run(sv, srv):
    """A pinned server's end: stop publishing; audit its decision log against every table published (lines `F`: its
    fallback, plain decode at every batch size); keep the switches (how long each took to come in force)."""
    try:
        sv["pinner"].stop()
        if sv.get("recorder") is not None:
            sv["recorder"].stop()  # the telemetry recording is closed (read by offpath_results from the logs)
        from specctl.policies.fixed import fixed_threshold
        fb = fixed_threshold(1, B.pinned_fallback_config(parse_policy(sv["policy"])))
        dec = SC.read_decisions(os.path.join(sv["sdir"], "decisions-rank0.txt"))
        published = sv["pinner"].published
        aud = SC.audit_decisions(dec, published, fallback=fb)
        aud["sglang_switch_lines"] = SC.count_switch_lines(open(sv["log"], errors="replace").read())
        aud["policy_versions_seen"] = len(published)
        aud["pin_switches"] = sv["pin_switches"]
        srv["specctl"] = aud
        with open(os.path.join(sv["sdir"], "policies.json"), "w") as f:
            json.dump({"policies": [dict(version=v, policy=x) for v, x in sorted(published.items())],
                       "pin_switches": sv["pin_switches"]}, f, indent=1)
        slow = [x for x in sv["pin_switches"] if x["s"] is None]
        log(f"{sv['policy']}: {aud['checked']}/{aud['decisions']} decisions audited, match {aud['match_frac']}, "
            f"{len(sv['pin_switches'])} pins ({len(slow)} never in force)")
    except Exception as e:  # noqa: BLE001 - the benchmark rows stay; say what failed
        srv["specctl_error"] = repr(e)[:300]
        log("pinned finish failed:", repr(e)[:300])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--variant", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--policies", default="off,static:s1,static:s2,static:s3,threshold:5:s3,sglang-adaptive")
    ap.add_argument("--levels", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--new-tokens-spread", type=int, default=0,
                    help="the levels' and phases' requests get max_new_tokens in new-tokens +- this (a fixed sequence, "
                         "the same for every server): no lockstep cohorts at one cap (benchlib.spread_tokens)")
    ap.add_argument("--req-per-level", default="max(3*c,24)", help="python expression in c")
    ap.add_argument("--repeats", type=int, default=1, help="closed loops per level (same requests); the row is the "
                                                               "median one, with every repetition's tok/s and the spread")
    ap.add_argument("--interleave", action="store_true",
                    help="measure a group's servers round robin per (repetition, level) instead of one after another")
    ap.add_argument("--phase", action="store_true")
    ap.add_argument("--phase-first", action="store_true", help="with --interleave: the phase runs before the sweep")
    ap.add_argument("--phase-repeats", type=int, default=1,
                    help="phase runs per server (same requests); with --interleave the servers take turns, the order "
                         "rotated each round")
    ap.add_argument("--identity-c", type=int, default=16,
                    help="concurrency of the greedy identity probe (16 prompts, 64 tokens); below a threshold policy's "
                         "T it compares the speculating states")
    ap.add_argument("--identity-tokens", type=int, default=64, help="new tokens per identity prompt (16 prompts)")
    ap.add_argument("--resync", default="", help="comma list of policies (threshold:5-like, speculating at c=4, "
                                                 "off at c=64) to run resync_probe on, before anything else")
    ap.add_argument("--profile", default="", help="comma list of POLICY@C: a torch profile of that server at "
                                                 "concurrency C after its measurements (a profiled server stays slower), reduced by trace_steps.py (all C "
                                                 "requests decoding); POLICY@C:churn: requests of --new-tokens ending "
                                                 "at EOS and arriving between steps, as in the phase workload; "
                                                 "POLICY@C:stack: with Python stacks (torch's Python tracer: self and "
                                                 "inclusive time per function; at most 12 steps; list it after the "
                                                 "same server's plain profile, whose step times it does not disturb)")
    ap.add_argument("--profile-steps", type=int, default=40, help="forward steps per profile")
    ap.add_argument("--resync-off-s", type=float, default=30.0, help="the plain-decode stretch of the resync probe (s)")
    ap.add_argument("--resync-probe-tokens", type=int, default=2400,
                    help="tokens per resync probe: enough that every probe outlives the plain stretch (at ~25 ms a "
                         "step at batch 64, 30 s is ~1200 tokens) and keeps a tail of >= 200 tokens")
    ap.add_argument("--accept-eval", action="store_true", help="all MT-Bench turn-1 / HumanEval prompts at c=16, per spec policy")
    ap.add_argument("--accept-tokens", type=int, default=320)
    ap.add_argument("--phase-scale", type=float, default=1.0, help="multiply phase durations")
    ap.add_argument("--phase-set", choices=("default", "alternating"), default="default",
                    help="alternating: short and --long-prompt-tokens prompts taking turns at --alt-concurrency")
    ap.add_argument("--alt-concurrency", default="32,48",
                    help="--phase-set alternating: a short and a long phase at each of these concurrencies, "
                         "between the two crossovers (benchlib.alt_phases; 32,48: the H200 testbed's table flapped "
                         "between s3 and off from batch 14 to 76 on such traffic; 8,16 for SGLang's stock verify on "
                         "the H100 testbed)")
    ap.add_argument("--long-prompt-tokens", type=int, default=6000, help="the long prompts of --phase-set alternating")
    ap.add_argument("--tokenizer", default=None, help="tokenizer dir (default: --model); 'simple' for CPU tests")
    ap.add_argument("--out", required=True)
    ap.add_argument("--results", default=None, help="also write the results JSON here")
    ap.add_argument("--parallel", type=int, default=3)
    ap.add_argument("--mem-fraction", default="0", help="per server; 0 = 0.8/parallel; fit:GB = each server's weights "
                    "+ GB of the memory free when it starts, the servers of a group starting one after another (how "
                    "several MoE servers fit on one GPU)")
    ap.add_argument("--attention-backend", default="triton", choices=("triton", "flashinfer", "fa3"),
                    help="every server's attention backend (fa3, SGLang's default on Hopper, needs the bundle's "
                         "fa3.so.xz installed; the decode state runs on triton and flashinfer)")
    ap.add_argument("--max-total-tokens", type=int, default=0,
                    help="cap each server's KV pool (tokens): with it, servers started at once on one GPU can all "
                         "use a high --mem-fraction (SGLang checks the fraction against the memory free at its "
                         "own load time, which other servers' pools have taken)")
    ap.add_argument("--deadline-s", type=float, default=540)
    ap.add_argument("--prompts", default="/tmp/specctl-stash/aux/prompts")
    ap.add_argument("--specctl-learn", default="1,2,4,8,16,32,64,128",
                    help="specctl: unmeasured closed-loop levels before the measurement (the daemon learns)")
    ap.add_argument("--specctl-site", default="/tmp/specctl_site")
    ap.add_argument("--prefill-graph", action="store_true", help="keep SGLang's prefill CUDA graphs (slow start)")
    ap.add_argument("--no-radix-cache", action="store_true",
                    help="every server with --disable-radix-cache: each prefill is the whole prompt, as with new "
                         "prompts (with the cache the recycled prompts prefill 1-2 tokens: benchlib.server_args)")
    ap.add_argument("--request-stats", action="store_true",
                    help="every server logs each finished request's queue time (SGLang's ReqTimeStats); the bench "
                         "JSON summarises it per server (`request_stats`): how arrivals cluster, how long they wait")
    ap.add_argument("--log-gc", action="store_true",
                    help="every server with SGLANG_LOG_GC=1 (its scheduler logs each garbage collection): each run's "
                         "and phase run's `gc` gives the collections in its window per generation (benchlib.gc_summary)")
    ap.add_argument("--open-loop", default="",
                    help="request rates (req/s, comma list): after the levels, SGLang's own client (python -m "
                         "sglang.bench_serving --backend sglang: Poisson arrivals, the MT-Bench/HumanEval prompts as a "
                         "ShareGPT file, caps as the levels') runs every rate against every server, --repeats rounds, "
                         "the servers' order rotated each round; rows in the record's `open_loop`")
    ap.add_argument("--open-loop-s", type=float, default=30.0,
                    help="seconds of arrivals per open-loop run: num_prompts = rate x this")
    ap.add_argument("--bench-python", default=sys.executable, help="the python that runs sglang.bench_serving")
    ap.add_argument("--bench-pythonpath", default=None,
                    help="the client's PYTHONPATH (default: this process's; the datasets stand-in is put first)")
    ap.add_argument("--port0", type=int, default=31000)
    a = ap.parse_args()
    for spec in (x for x in a.profile.split(",") if x):
        c, *mods = spec.rpartition("@")[2].split(":")
        if "@" not in spec or not c.isdigit() or set(mods) - {"churn", "stack"}:
            ap.error(f"--profile {spec!r}: expected POLICY@C, POLICY@C:churn or POLICY@C:stack")
    os.makedirs(a.out, exist_ok=True)
    deadline = T0 + a.deadline_s
    # the measurements stop early enough for the profiles, which come after them (profiles_of): ~40 s each
    measure_end = deadline - 45 * len([x for x in a.profile.split(",") if x])
    tok = P.tokenizer_for(a.tokenizer or a.model)
    mtb, he = P.load_benchmark_sets(a.model, a.prompts, tok=tok)
    mixed = [x for pair in zip(mtb, he) for x in pair] + he[len(mtb):]
    pools = {"chat": mtb, "code": he}
    phase_set = B.alt_phases(a.alt_concurrency) if a.phase_set == "alternating" else PHASES
    if a.phase_set == "alternating":
        pools = {"short": mixed, "long": P.long_prompts(tok, mixed, a.long_prompt_tokens, P.gen_train_prompts(2000, seed=5))}
    levels = [int(x) for x in a.levels.split(",") if x]
    policies = [p for p in a.policies.split(",") if p]
    maxc = B.max_concurrency(levels, [ph["concurrency"] for ph in phase_set] if a.phase else (), a.identity_c,
                             resync=bool(a.resync))
    try:
        memf_mode, memf = B.parse_mem_fraction(a.mem_fraction)
    except ValueError as e:
        ap.error(str(e))
    memf = memf or round(0.8 / max(1, min(a.parallel, len(policies))), 3)
    if memf_mode == "fit" and a.max_total_tokens:
        # SGLang would size a smaller pool and queue requests at the top levels: say so before any server starts
        need = B.kv_gb(a.max_total_tokens, a.model, a.draft)
        if need > memf:
            ap.error(f"--max-total-tokens {a.max_total_tokens}: this model's and its draft's KV take {need:.1f} GB, "
                     f"more than fit:{memf:g} leaves each server; give fit:{math.ceil(need + 0.5)} or fewer tokens")
    shared = dict(max_total_tokens=a.max_total_tokens, prefill_graph=a.prefill_graph, request_stats=a.request_stats,
                  attention_backend=a.attention_backend, radix_cache=not a.no_radix_cache)
    plugin_pols = [p for p in policies if parse_policy(p)["kind"] in ("specctl", "plugin-fixed")]
    pinned_pols = [p for p in policies if parse_policy(p)["kind"] == "pinned"]
    site = SC.make_site(a.specctl_site) if plugin_pols or pinned_pols else None
    model_env, model_name = target_env(a.model, a.variant)
    result = {"gpu": None, "sglang": "0.5.17", "attention_backend": a.attention_backend, "model": model_name,
              "variant": a.variant, "draft": a.draft, "new_tokens": a.new_tokens, "new_tokens_spread": a.new_tokens_spread, "prompts": "MT-Bench turn 1 + HumanEval (chat)",
              "runs": [], "phase_runs": [], "servers": {}, "identity": {}, "identity_concurrency": a.identity_c}
    try:
        result["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                       text=True).stdout.strip().splitlines()[0]
    except Exception:
        pass
    todo = list(enumerate(policies))
    rates = [float(x) for x in a.open_loop.split(",") if x]
    if rates and not a.interleave:
        ap.error("--open-loop runs with --interleave (the servers take turns at each rate)")
    openloop_data = (sharegpt_file(os.path.join(a.out, "openloop-sharegpt.json"), mixed, tok,
                                   int(max(rates) * a.open_loop_s) + 8, a.new_tokens, a.new_tokens_spread)
                     if rates else None)

    def launch(k, pol):
        port = a.port0 + 10 * k
        flags = fraction_args(pol)  # first: a server that does not fit starts nothing, its daemon neither
        args, env_extra, cfg = policy_launch_args(pol, a.draft)
        if cfg is not None:
            cp = os.path.join(a.out, f"adaptive-{B.file_tag(pol)}.json")
            json.dump(cfg, open(cp, "w"))
            args += ["--speculative-adaptive-config", cp]
        env = dict(os.environ, **env_extra)
        if a.log_gc:
            env["SGLANG_LOG_GC"] = "1"
        if model_env:  # the MoE target: SGLang imports its model class from the testbed's external package
            env = SC.with_pythonpath(dict(env, **model_env["env"]), model_env["path"])
        side = None
        if pol in plugin_pols:
            tag = pol.replace(":", "_")
            sdir = os.path.join(a.out, f"specctl-{tag}")
            os.makedirs(sdir, exist_ok=True)
            rundir = f"/tmp/specctl-run-{port}"
            shutil.rmtree(f"/tmp/specctl-state-{port}", ignore_errors=True)  # every run learns from scratch
            pp = parse_policy(pol)
            kind, configs = pp["kind"], daemon_configs(pp)
            extra = () if kind == "specctl" else ("--mode", "fixed")
            if pp.get("ctx_axis") is False:
                extra += ("--no-ctx-axis",)
            if configs:  # a tree: the daemon's fallback is the plugin's (the tree below the threshold)
                extra += ("--config", ",".join(map(str, pp["config"])), "--threshold", str(pp.get("threshold", 5)))
            side = SC.Daemon(rundir=rundir, state_dir=f"/tmp/specctl-state-{port}", site=site,
                             log_path=os.path.join(sdir, "serve.log"), record_dir=os.path.join(sdir, "telemetry"),
                             configs=configs or SC.CONFIGS, extra=extra)
            side.start()
            mode = "online" if kind == "specctl" else "fixed"
            env.update(SC.plugin_env(mode=mode, rundir=rundir, server_id=f"{a.variant}-{tag}",
                                     decision_log=os.path.join(sdir, "decisions-rank{rank}.txt")))
            env.update(env_extra)  # plugin-fixed: its threshold and config
            env = SC.with_pythonpath(env, site)  # keeps the model package's path
        pin = {}
        if pol in pinned_pols:  # no daemon: this process publishes one table at a time (ensure_pin), the decode state first
            sdir = os.path.join(a.out, f"specctl-{B.file_tag(pol)}")
            os.makedirs(sdir, exist_ok=True)
            rundir = f"/tmp/specctl-run-{port}"
            os.makedirs(rundir, mode=0o700, exist_ok=True)
            os.chmod(rundir, 0o700)
            pin = {"pinner": SC.Override(rundir, B.pin_rows("off"), version=1), "pin": "off", "pin_version": 1,
                   "pin_switches": [], "sdir": sdir}
            pin["pinner"].start()
            # a daemon only to record the plugin's step telemetry (each step's own time, by configuration); its
            # tables go to an endpoint nobody listens to: the plugin follows the pinner's
            pp = parse_policy(pol)
            pin["recorder"] = SC.Daemon(
                rundir=rundir, state_dir=f"/tmp/specctl-state-{port}", site=site,
                log_path=os.path.join(sdir, "serve.log"), record_dir=os.path.join(sdir, "telemetry"),
                configs=",".join(B.pin_names(pp)),
                extra=("--mode", "fixed", "--publish", f"ipc://{rundir}/recorder-policy.sock", "--threshold", "1",
                       "--config", B.config_name(B.pinned_fallback_config(pp))))
            shutil.rmtree(f"/tmp/specctl-state-{port}", ignore_errors=True)
            pin["recorder"].start()
            env.update(SC.plugin_env(mode="online", rundir=rundir, server_id=f"{a.variant}-pinned-{port}",
                                     decision_log=os.path.join(sdir, "decisions-rank{rank}.txt")))
            env.update(env_extra)
            env = SC.with_pythonpath(env, site)
        lp = os.path.join(a.out, f"{a.variant}-{B.file_tag(pol)}.log")
        return {"policy": pol, "side": side, **pin, **start_server(a.model, port, flags + args, env, lp)}

    def fraction_args(pol):
        """The flags every server shares, with this one's --mem-fraction-static (fit: from the memory free now)."""
        if memf_mode != "fit":
            return server_args(maxc, memf, **shared)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise ValueError(f"--mem-fraction fit needs nvidia-smi's free memory: {e}") from e
        free = B.gpu_free_gb(smi, os.environ.get("CUDA_VISIBLE_DEVICES"))
        load = B.weights_gb(a.model, a.draft if parse_policy(pol)["kind"] != "off" else None)
        f = B.fit_fraction(free, load, memf)
        log(f"{pol}: --mem-fraction-static {f} ({free:.1f} GB free, {load:.1f} GB of weights + {memf} GB)")
        return server_args(maxc, f, **shared)

    def identity_pass(port, **kw):
        """The identity probe's 16 prompts, the radix cache flushed first: (all flushes took, outputs). At
        --identity-c 1 each prompt goes alone after a flush of its own, so every server prefills it whole: sent one
        after another, a prompt reuses the shared chat-template prefix the previous one cached, and an EAGLE server's
        radix cache keys on token pairs and reuses one token less, so its prefill has another length, other GEMM
        shapes and other bf16 rounding than the no-spec server's (tensor_dump.py, 2026-12-03)."""
        if a.identity_c != 1:
            ok = flush_cache(port)
            return ok, asyncio.run(closed_loop(port, mixed[:16], a.identity_c, 16, a.identity_tokens, stream=False,
                                               **kw))[0]
        ok, outs = True, []
        for x in mixed[:16]:
            ok &= flush_cache(port)
            outs += asyncio.run(closed_loop(port, [x], 1, 1, a.identity_tokens, stream=False, **kw))[0]
        return ok, outs

    def prepare(sv):
        """Warm-up, specctl's learning pass, the identity probe, the accept-length evaluation."""
        pol, srv = sv["policy"], result["servers"][sv["policy"]]
        asyncio.run(closed_loop(sv["port"], mixed[:8], 8, 8, 16))
        # a burst at the call's largest batch, 4 tokens a request: the first full-size prefill chunks run here, not
        # in a measured round (2026-12-07, H100, flashinfer, prefill graphs: an EAGLE-3 server's first 8,192-token
        # chunk stalled 13 s inside its first c = 128 round; the no-spec server's did not); its wall time is kept
        t_burst = time.time()
        asyncio.run(closed_loop(sv["port"], mixed, maxc, maxc, 4))
        srv["warmup_burst"] = {"concurrency": maxc, "s": round(time.time() - t_burst, 2)}
        if parse_policy(pol).get("freeze_gc"):  # warm: what is alive now lives on (+freezegc)
            srv["gc_frozen"] = freeze_gc(sv)
        if parse_policy(pol)["kind"] == "specctl" and a.specctl_learn:
            t_learn = time.time()
            for c in (int(x) for x in a.specctl_learn.split(",") if x):
                if time.time() > deadline - 60:
                    break
                asyncio.run(closed_loop(sv["port"], mixed[len(mixed) // 2:], c, max(2 * c, 8), a.new_tokens))
                if "long" in pools:  # the alternating workload: the daemon sees the long contexts too
                    asyncio.run(closed_loop(sv["port"], pools["long"][len(pools["long"]) // 2:], c, max(2 * c, 8),
                                            a.new_tokens))
            srv["learn_s"] = round(time.time() - t_learn, 1)
            log(f"specctl learned for {srv['learn_s']} s; policy:", json.dumps(sv["side"].status()["policy"]["table"])[:600])
        srv["identity_cache_flushed"], outs = identity_pass(sv["port"])
        result["identity"][pol] = {o.get("pid"): o.get("ids") for o in outs}
        if pol == "off" or parse_policy(pol).get("plain_decode_logprobs"):
            # how close each of the reference's choices was (a pass of its own: the ids above come from
            # requests without logprobs, as every server's do; a spec server runs logprob steps through its
            # trivial verify, so only the no-spec server is asked — and a decode-state server with +lp, whose
            # logprob steps run its decode forward: its top-2 against the no-spec server's, position by position)
            flushed, outs = identity_pass(sv["port"], top2=True)
            srv["identity_cache_flushed"] &= flushed
            result.setdefault("identity_top2", {})[pol] = {o.get("pid"): o.get("top2_rows") for o in outs}
            same = sum(1 for o in outs if o.get("ids") == result["identity"][pol].get(o.get("pid")))
            if pol == "off":
                result["identity_margins"] = {o.get("pid"): o.get("top2") for o in outs}
                result["identity_margins_ids_same"] = same
            else:
                srv["identity_logprob_pass_ids_same"] = same  # its logprob steps decode what its plain ones do
        # the prefill alone (one output token), its logits kept for every prompt position: do the servers'
        # prefills agree, so that any later parting is the decode steps'? (2026-12-01: speculating, adaptive and
        # the decode state all parted from the no-spec server at the same positions)
        srv["prefill_cache_flushed"] = flush_cache(sv["port"])
        outs, _ = asyncio.run(closed_loop(sv["port"], mixed[:16], a.identity_c, 16, 1, stream=False,
                                          prefill_lp=True))
        result.setdefault("prefill_lp", {})[pol] = {o.get("pid"): {"prompt_lp": o.get("prompt_lp"),
                                                                   "first_top2": o.get("first_top2")}
                                                    for o in outs if "error" not in o}
        pp = parse_policy(pol)
        never_speculates = pp["kind"] == "plugin-fixed" and pp["threshold"] <= 1
        # a pinned server is prepared under its decode state: its runs give each configuration's accept length
        if a.accept_eval and pol != "off" and not never_speculates and pp["kind"] != "pinned":
            acc = {}
            for name, items in (("mtbench", mtb), ("humaneval", he)):
                outs, wall = asyncio.run(closed_loop(sv["port"], items, 16, len(items), a.accept_tokens))
                acc[name] = summarize_requests(outs, wall)
            result.setdefault("accept_eval", {})[pol] = acc
            log(f"{pol} accept length: mtbench {acc['mtbench']['accept_length']}, humaneval {acc['humaneval']['accept_length']}")

    def expand_pinned(live):
        """A pinned server's runs, one entry per configuration (the decode state first), sharing its process: each
        measurement of an entry first puts its configuration in force (ensure_pin)."""
        out = []
        for sv in live:
            p = parse_policy(sv["policy"])
            if p["kind"] != "pinned":
                out.append(sv)
                continue
            out += [{"policy": f"{sv['policy']}@{pin}", "base": sv, "pin": pin, "port": sv["port"], "log": sv["log"],
                     "proc": sv["proc"], "side": None} for pin in B.pin_names(p)]
        return out

    def ensure_pin(sv, c):
        """Publish sv's configuration at every batch size unless it is in force, and wait until the plugin has put
        it in force (its log line `specctl: policy vN`, at a sync boundary: decode steps of a few short requests)."""
        base = sv.get("base")
        if base is None or base["pin"] == sv["pin"]:
            return
        base["pin_version"] += 1
        ver, t0 = base["pin_version"], time.time()
        off = os.path.getsize(sv["log"])
        base["pinner"].set(B.pin_rows(sv["pin"]), ver)
        base["pin"] = sv["pin"]
        k = max(1, min(c, 4))
        while time.time() - t0 < 60:  # the engine applies a table at a sync boundary (every 16 decode results)
            asyncio.run(closed_loop(sv["port"], mixed, k, k, 32))
            with open(sv["log"], errors="replace") as f:
                f.seek(off)
                if f"specctl: policy v{ver} (" in f.read():
                    base["pin_switches"].append({"pin": sv["pin"], "version": ver, "s": round(time.time() - t0, 2)})
                    return
        base["pin_switches"].append({"pin": sv["pin"], "version": ver, "s": None})
        log(f"{sv['policy']}: policy v{ver} not in force after {time.time() - t0:.0f} s (the audit will say)")

    def measure(sv, c):
        """One closed loop at concurrency c (always the same request set): the summary + the log lines' steps."""
        ensure_pin(sv, c)
        n_req = int(eval(a.req_per_level, {"max": max, "min": min}, {"c": c}))
        off = os.path.getsize(sv["log"])
        outs, wall = asyncio.run(closed_loop(sv["port"], mixed, c, n_req, a.new_tokens, spread=a.new_tokens_spread))
        r = summarize_requests(outs, wall)
        time.sleep(0.3)
        with open(sv["log"]) as f:
            f.seek(off)
            text = f.read()
        r["log"] = parse_decode_lines(text, c)
        if a.log_gc:
            r["gc"] = B.gc_summary(text, wall)
        r["t_start"] = round(time.time() - wall - T0, 1)
        return r

    def add_row(pol, c, reps):
        med = sorted(reps, key=lambda r: r["output_tokens_per_s"] or 0)[(len(reps) - 1) // 2]
        row = {"policy": pol, "concurrency": c, **med}
        if len(reps) > 1:
            tps = [r["output_tokens_per_s"] for r in reps]
            row["repeats_tok_s"] = tps
            row["repeats_t_start"] = [r["t_start"] for r in reps]
            row["repeats_step_ms"] = [r["log"].get("step_ms_med") for r in reps]
            row["repeats_step_lines"] = [r["log"].get("n_lines", 0) for r in reps]
            row["repeats_clean_step_ms"] = [r["log"].get("clean_step_ms_med") for r in reps]
            row["repeats_clean_lines"] = [r["log"].get("clean_lines", 0) for r in reps]
            if a.log_gc:
                row["repeats_gc_ms_per_s"] = [(r.get("gc") or {}).get("ms_per_s", 0.0) for r in reps]
            row["spread"] = round((max(tps) - min(tps)) / med["output_tokens_per_s"], 4) if med["output_tokens_per_s"] else None
        result["runs"].append(row)
        log(f"{pol} c={c}: {row['output_tokens_per_s']} tok/s, tpot med {row['median_tpot_ms']} ms, "
            f"acc {row['accept_length']}, log step {row['log'].get('step_ms_med')} ms" +
            (f", repeats {row['repeats_tok_s']}" if len(reps) > 1 else ""))

    def phase_rounds(live):
        for rep in range(a.phase_repeats):
            k = rep % max(1, len(live))
            for sv in live[k:] + live[:k]:
                phase(sv)

    def phase(sv):
        pol = sv["policy"]
        phases = [dict(p, duration_s=p["duration_s"] * a.phase_scale) for p in phase_set]
        if not a.phase or time.time() > measure_end - 20 - sum(p["duration_s"] for p in phases):
            return
        ensure_pin(sv, 1)
        off = os.path.getsize(sv["log"])
        outs, wall, t_first = asyncio.run(phase_loop(sv["port"], pools, phases, a.new_tokens,
                                                     spread=a.new_tokens_spread))
        with open(sv["log"]) as f:
            f.seek(off)
            lines = f.read()
        sw = re.findall(r"Adaptive spec params updated: steps (\d+) -> (\d+)", lines)
        row = {"policy": pol, **summarize_requests(outs, wall), "adaptive_switches": len(sw), "phases": phases,
               **({"gc": B.gc_summary(lines, wall)} if a.log_gc else {}),
               "per_phase": phase_summary(outs, phases, t_first), "phase_set": a.phase_set,
               "t_start": round(time.time() - wall - T0, 1)}
        result["phase_runs"].append(row)
        log(f"{pol} phase: {row['output_tokens_per_s']} tok/s, tpot med {row['median_tpot_ms']} ms, switches {len(sw)}")

    def open_loop(sv, rate, rep):
        """One bench_serving run of `rate` against this server: a row of result["open_loop_runs"]."""
        n = max(8, int(round(rate * a.open_loop_s)))
        out_file = os.path.join(a.out, f"openloop-{B.file_tag(sv['policy'])}-r{rate}-{rep}.jsonl")
        env = dict(os.environ)
        if a.bench_pythonpath is not None:
            env["PYTHONPATH"] = a.bench_pythonpath
        env = SC.with_pythonpath(env, OPENLOOP_SHIM)
        ensure_pin(sv, 1)
        cmd = bench_serving_cmd(a.bench_python, sv["port"], a.model, a.tokenizer or a.model, openloop_data, rate, n,
                                out_file)
        t0 = time.time()
        row = {"policy": sv["policy"], "rate": rate, "rep": rep, "num_prompts": n, "t_start": round(t0 - T0, 1)}
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                               timeout=max(30.0, min(deadline - time.time(), 4 * a.open_loop_s + 120)))
            with open(out_file) as f:
                row.update({k: v for k, v in json.loads(f.read().splitlines()[-1]).items() if k in OPENLOOP_KEYS})
            if p.returncode:
                row["error"] = f"bench_serving exited {p.returncode}: {p.stderr[-400:]}"
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired) as e:
            row["error"] = f"{type(e).__name__}: {e}"[:600]
        result.setdefault("open_loop_runs", []).append(row)
        log(f"{sv['policy']} open loop {rate} req/s: {row.get('output_throughput')} tok/s, "
            f"ttft med {row.get('median_ttft_ms')} ms, tpot med {row.get('median_tpot_ms')} ms"
            + (f", {row['error'][:200]}" if "error" in row else ""))

    def open_loop_rounds(live):
        for rep in range(a.repeats):
            for i, rate in enumerate(rates):
                if time.time() > measure_end - a.open_loop_s - 30:
                    log("deadline: stop open loop")
                    return
                k = (rep * len(rates) + i) % max(1, len(live))
                for sv in live[k:] + live[:k]:
                    open_loop(sv, rate, rep)

    def retire(sv):
        if sv.get("base") is not None:  # a pinned server's run: the server goes once
            sv["retired"] = True
            return retire(sv["base"])
        if sv.get("retired"):
            return
        sv["retired"] = True
        kill_tree(sv["proc"])
        if sv.get("side"):
            finish_plugin_run(sv, result["servers"][sv["policy"]], a.out)
        if sv.get("pinner"):
            finish_pinned_run(sv, result["servers"][sv["policy"]])
        if a.request_stats:  # the whole log's requests (the phases' arrival times are in the phase runs' t_start)
            try:
                result["servers"][sv["policy"]]["request_stats"] = B.request_stats(
                    open(sv["log"], errors="replace").read(), cap=None if a.new_tokens_spread else a.new_tokens)
            except OSError as e:
                result["servers"][sv["policy"]]["request_stats"] = {"error": str(e)}

    def profiles_of(servers):
        """The --profile specs of these servers, AFTER their measurements: a torch profile leaves its server
        slower for the rest of its life (Kineto does not finalise CUPTI when a profile stops, pytorch#144455;
        2026-12-03 fourth lease, calls K and K2: profiled servers up to 25 % below unprofiled runs of the same
        build at c = 64 / 128), so nothing a profiled server measures afterwards is comparable."""
        for spec in (x for x in a.profile.split(",") if x):
            pol, c = spec.rsplit("@", 1)
            c, *mods = c.split(":")
            churn, stack = "churn" in mods, "stack" in mods
            for sv in (sv for sv in servers if sv["policy"] == pol and not sv.get("retired")):
                if time.time() > deadline - 40:
                    log("deadline: no profile", spec)
                    break
                ensure_pin(sv, int(c))
                name = B.file_tag(pol)
                r = profile_server(sv["port"], a.out, name + "".join(f"-{m}" for m in mods), int(c),
                                   mixed, min(a.profile_steps, 12) if stack else a.profile_steps, stack=stack,
                                   **({"new_tokens": a.new_tokens, "churn": True,
                                       "spread": a.new_tokens_spread} if churn else {}))
                result.setdefault("profiles", {})[spec] = r
                log(f"profile {spec}:", json.dumps({k: r.get(k) for k in ("steps", "median", "error") if k in r}))

    while todo:
        group = []  # launch a group, wait until all of it is up (others idle with --sleep-on-idle while one runs)
        while todo and len(group) < a.parallel:
            k, pol = todo.pop(0)
            if memf_mode == "fit" and group:  # one start at a time: each sizes itself from what the last left free
                group[-1]["ok"] = wait_ready(group[-1], 400, deadline)
            try:
                group.append(launch(k, pol))
            except ValueError as e:  # no room left for it (fit): it starts in the next group
                log("not launched", pol, f"{type(e).__name__}: {e}")
                if not group:
                    raise
                todo.insert(0, (k, pol))
                break
            log("launched", pol)
        for x in group:
            if "ok" not in x:
                x["ok"] = wait_ready(x, 400, deadline)
            result["servers"][x["policy"]] = {"cmd": x["cmd"], "ready": x["ok"], "ready_s": round(time.time() - x["t"], 1)}
            if x.get("side") is not None:
                result["servers"][x["policy"]]["daemon_args"] = list(x["side"].extra)
        live = []
        for sv in group:
            if not sv["ok"]:
                log("NOT READY", sv["policy"], open(sv["log"]).read()[-2000:])
                retire(sv)
            else:
                log("ready", sv["policy"], result["servers"][sv["policy"]]["ready_s"], "s")
                live.append(sv)
        try:
            for sv in live:
                if sv["policy"] in a.resync.split(","):
                    r = asyncio.run(resync_probe(sv["port"], sv["log"], mixed[:B.RESYNC_PROBES], mixed[16:],
                                                 off_s=a.resync_off_s, filler_c=B.RESYNC_FILLERS,
                                                 probe_tokens=a.resync_probe_tokens))
                    result.setdefault("resync", {})[sv["policy"]] = r
                    log(f"{sv['policy']} resync: {r}")
            for sv in live:
                prepare(sv)
            for sv in [sv for sv in live if sv["policy"] in a.resync.split(",")]:  # probed only: gone
                retire(sv)
            live = expand_pinned([sv for sv in live if not sv.get("retired")])
            if a.interleave and a.phase_first:
                phase_rounds(live)
            if a.interleave:
                # round robin: every (repetition, level) runs each policy once, in an order rotated each round,
                # so that a drift of the machine over the call lands on every policy alike
                reps = {(sv["policy"], c): [] for sv in live for c in levels}
                for rep in range(a.repeats):
                    for i, c in enumerate(levels):
                        if time.time() > measure_end - 20:
                            break
                        k = (rep * len(levels) + i) % max(1, len(live))
                        for sv in live[k:] + live[:k]:
                            reps[(sv["policy"], c)].append(measure(sv, c))
                for sv in live:
                    for c in levels:
                        if reps[(sv["policy"], c)]:
                            add_row(sv["policy"], c, reps[(sv["policy"], c)])
                if rates:
                    open_loop_rounds(live)
                if not a.phase_first:
                    phase_rounds(live)
                profiles_of(live)
            else:
                for sv in live:
                    for c in levels:
                        if time.time() > measure_end - 20:
                            log("deadline: stop sweep", sv["policy"])
                            break
                        add_row(sv["policy"], c, [measure(sv, c) for _ in range(a.repeats)])
                    for _ in range(a.phase_repeats):
                        phase(sv)
                    profiles_of([sv])
                    sv["done"] = True
                    base = sv.get("base")
                    if base is None or all(x.get("done") for x in live if x.get("base") is base):
                        retire(sv)  # a pinned server goes after its last configuration
                        time.sleep(2)
        finally:
            for sv in live:
                retire(sv)
    if result.get("open_loop_runs"):
        result["open_loop"] = open_loop_summary(result["open_loop_runs"])
    from benchlib import paired_ratios
    by_pol = {}
    for x in result["phase_runs"]:
        by_pol.setdefault(x["policy"], []).append(x["output_tokens_per_s"])
    pairs = B.ctx_pairs(by_pol)  # run k of one with run k of the other (they took turns)
    if pairs:
        result["phase_pairs"] = {f"{a} / {b}": paired_ratios(by_pol[a], by_pol[b]) for a, b in pairs}
        log("phase runs, with ÷ without the context axis:", result["phase_pairs"])
    outputs = result["identity"]
    result["identity"] = identity_report(outputs, margins=result.get("identity_margins"))
    result["identity_ids"] = outputs  # every policy's greedy output ids: where two part, and to what
    if len(result.get("identity_top2") or {}) > 1:
        result["identity_logits"] = B.logit_report(result["identity_top2"], identity=result["identity"])
        log("top-2 vs off:", json.dumps(result["identity_logits"])[:1500])
    if result.get("prefill_lp"):
        result["prefill_identity"] = B.prefill_report(result["prefill_lp"])
        for per in result["prefill_lp"].values():  # the report keeps what matters; the first tokens stay
            for x in per.values():
                x.pop("prompt_lp", None)
        log("prefill vs off:", json.dumps(result["prefill_identity"])[:1500])
    trees = sorted({p for p in outputs if p.startswith("static:") and parse_policy(p)["config"][1] > 1})
    for ref in trees:  # a tree's own greedy outputs: what specctl:TREE and threshold:T:TREE should reproduce
        result[f"identity_vs_{ref}"] = identity_report(outputs, ref)
    result["profiles_after_measurements"] = True  # see profiles_of
    card = next((c for c in ("h200", "h100", "b200") if c in (result["gpu"] or "").lower()), "gpu")
    prof = profile_from_runs(result["runs"], f"{card}-smollm2-135m-{a.variant}")  # the card it ran on
    json.dump(result, open(os.path.join(a.out, f"bench-{a.variant}.json"), "w"), indent=1)
    json.dump(prof, open(os.path.join(a.out, f"profile-{a.variant}.json"), "w"), indent=1)
    if a.results:
        json.dump(result, open(a.results, "w"), indent=1)
    log("identity vs off:", result["identity"])
    log("profile:", json.dumps(prof)[:1500])


if __name__ == "__main__":
    main()
