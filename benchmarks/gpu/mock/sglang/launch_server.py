# A stand-in for `python3 -m sglang.launch_server` (CPU, stdlib) to exercise run_bench.py without a GPU:
#   PYTHONPATH=benchmarks/gpu/mock python3 benchmarks/gpu/run_bench.py --model <dir with a tokenizer> ...
# Serves /health and /generate (streaming or not) with fake tokens and prints SGLang-style Decode-batch lines.
# A step takes longer the more context its requests hold (#token counts the running requests' prompts and
# streamed tokens so far), and longer with speculation: enough physics for the context-profile tooling's tests.
import sys, json, time, threading, random
from http.server import ThreadingHTTPServer, BaseHTTPRequestHandler
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
spec = "--speculative-algorithm" in args
steps = int(args[args.index("--speculative-num-steps") + 1]) if spec else 0
state = {"running": 0, "tokens": 0}
lock = threading.Lock()
# specctl's plugin, online (run_bench's pinned servers): the REAL engine decides every step from the tables it
# receives at SPECCTL_RUNDIR's policy endpoint, logs as the plugin does, and writes SPECCTL_DECISION_LOG
engine = receiver = None
import os
if os.environ.get("SGLANG_PLUGINS") == "specctl" and os.environ.get("SPECCTL_MODE") == "online" and "--speculative-adaptive-config" in args:
    import logging, zmq
    from specctl.controller import transport
    from specctl.plugin.engine import EngineController
    from specctl.plugin.launch_args import read_tree_states
    from specctl.plugin.settings import PluginSettings
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="[x] %(message)s")
    cfg_path = args[args.index("--speculative-adaptive-config") + 1]
    settings = PluginSettings.from_env(os.environ)
    engine = EngineController(settings, candidate_steps=json.load(open(cfg_path))["1"]["candidate_steps"],
                              states=read_tree_states(cfg_path))
    receiver = transport.PolicyReceiver(zmq.Context(), settings.policy_endpoint)
    sender = transport.TelemetrySender(zmq.Context(), settings.telemetry_endpoint) if settings.telemetry_endpoint else None
    n_iter = 0
def step_s():
    n = max(1, state["running"])
    return 0.002 * (1 + 0.3 * steps) * (1 + state["tokens"] / n / 4000.0)
def logger():
    global steps, n_iter
    while True:
        time.sleep(0.02)
        n = state["running"]
        if n and engine is not None:  # a decode step: frames in, a sync boundary every sync_every results, a decision
            while (frame := receiver.poll()) is not None:
                engine.offer_policy_frame(frame)
            if engine.note_result():
                engine.sync()
            steps = engine.decide(n)
            n_iter += 1
            if sender is not None:  # the step's record, as the plugin sends it (the daemon records it)
                sender.send(engine.step_record(iter=n_iter, ts=time.time(), batch_size=n, draft_tokens=steps + 1,
                                               accepted=[steps // 2] * n if steps else None, step_ms=1000.0 * step_s(),
                                               off_path="decode" if steps == 0 else None))
        if n:
            for _ in range(300):  # a step's host work leaves cyclic garbage only the collector frees, as a scheduler's does
                cyc = []; cyc.append(cyc)
            acc_len = 1 + steps * 0.5 if spec else 1.0
            acc = f"accept len: {acc_len:.2f}, " if spec else ""
            print(f"[x] Decode batch, #running-req: {n}, #token: {state['tokens']}, token usage: 0.01, {acc}gen throughput (token/s): {n * acc_len / step_s():.2f}, #queue-req: 0", flush=True)
threading.Thread(target=logger, daemon=True).start()
import gc, os
if os.environ.get("SGLANG_LOG_GC") == "1":  # as SGLang's configure_gc_logger: this process's own collections
    gc_t0 = {}
    def gc_log(phase, info):
        g = info.get("generation", "?")
        if phase == "start":
            gc_t0[g] = time.time(); print(f"[x] GC start: Time {time.time()} | Generation {g}", flush=True)
        else:
            print(f"[x] GC end: Time {time.time()} | Generation {g} | Duration: {time.time() - gc_t0.get(g, time.time()):.4f}s | "
                  f"Collected: {info.get('collected', '?')} | Uncollectable: {info.get('uncollectable', '?')} ", flush=True)
    gc.callbacks.append(gc_log)
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        if self.path == "/server_info":  # what sglang.bench_serving reads after a run
            o = json.dumps({"internal_states": [{"avg_spec_accept_length": 1 + steps * 0.5 if spec else None}]}).encode()
            self.send_response(200); self.send_header("Content-Type", "application/json"); self.end_headers(); self.wfile.write(o)
            return
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/flush_cache":  # SGLang: the radix cache emptied (refused while requests run)
            ok = state["running"] == 0
            print("Cache flushed successfully!" if ok else "Cache not flushed: requests are running", flush=True)
            self.send_response(200 if ok else 400); self.end_headers(); self.wfile.write(b"flushed" if ok else b"busy")
            return
        if self.path == "/freeze_gc":  # SGLang: gc.freeze() in the scheduler, which logs the objects it froze
            before = [len(gc.get_objects(g)) for g in range(3)]
            gc.freeze()
            after = [len(gc.get_objects(g)) for g in range(3)]
            print("[x] Freezing GC in Scheduler process. " + ", ".join(f"gen{g}: {before[g]}->{after[g]}" for g in range(3)), flush=True)
            self.send_response(200); self.end_headers(); self.wfile.write(b"Garbage collection frozen.\n")
            return
        if self.path == "/start_profile":  # a small chrome trace of body["num_steps"] decode steps, as SGLang writes it
            import gzip, os
            ev = []
            for k in range(body.get("num_steps") or 5):
                t = 10000 * k
                ev += [{"ph": "X", "cat": "user_annotation", "name": "step[DECODE bs=4]", "ts": t, "dur": 1000, "pid": 1, "tid": 7},
                       {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t + 100, "dur": 5, "pid": 1, "tid": 7, "args": {"correlation": k}},
                       {"ph": "X", "cat": "kernel", "name": "decode_kernel", "ts": t + 500, "dur": 6000, "pid": 0, "tid": 9, "args": {"correlation": k}}]
                if body.get("with_stack"):  # torch's Python tracer: a 3 ms call holding a 1 ms one, each step
                    ev += [{"ph": "X", "cat": "python_function", "name": "scheduler.py(1): run_batch", "ts": t + 50, "dur": 3000, "pid": 1, "tid": 7},
                           {"ph": "X", "cat": "python_function", "name": "worker.py(2): verify", "ts": t + 60, "dur": 1000, "pid": 1, "tid": 7}]
            path = os.path.join(body["output_dir"], f"{body.get('profile_id', 'p')}-TP-0.trace.json.gz")
            with gzip.open(path, "wt") as f:
                json.dump({"traceEvents": ev}, f)
            self.send_response(200); self.end_headers(); self.wfile.write(b"Start profiling.\n")
            return
        if "input_ids" not in body:  # a text prompt (sglang.bench_serving): one id per character
            body["input_ids"] = [ord(ch) % 1000 for ch in body.get("text", "")]
        new = body["sampling_params"]["max_new_tokens"]; ids = [sum(body["input_ids"]) % 1000 + i for i in range(new)]
        with lock: state["running"] += 1; state["tokens"] += len(body["input_ids"])
        vct = new if not spec else int(new / (1 + steps * 0.5)) + 1
        grown = 0  # the tokens this request has added to #token so far
        try:
            if body.get("stream"):
                self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
                for i in range(0, new, 8):
                    time.sleep(0.002)
                    n_i = min(new, i + 8)
                    with lock: state["tokens"] += n_i - grown
                    grown = n_i
                    meta = {"completion_tokens": n_i}
                    if n_i == new and spec:  # as 0.5.17: the verify count only once the request has finished
                        meta["spec_verify_ct"] = vct
                    o = {"text": "x", "output_ids": ids[i:i + 8], "meta_info": meta}
                    self.wfile.write(f"data: {json.dumps(o)}\n\n".encode()); self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")
            else:
                time.sleep(0.01)
                if body["sampling_params"].get("ignore_eos"):  # a fixed-length decode: as long as its steps take
                    for _ in range(vct):
                        time.sleep(step_s())
                meta = {"completion_tokens": new, "spec_verify_ct": vct if spec else None}
                if body.get("return_logprob"):  # top-k log-probabilities per output position: [[logprob, id, text], ...]
                    k = body.get("top_logprobs_num", 1)
                    meta["output_top_logprobs"] = [[[-0.1 * (j + 1) - (i % 3), t + j, None] for j in range(k)] for i, t in enumerate(ids)]
                    if body.get("logprob_start_len") == 0:  # the prompt's, from the prefill: [logprob, id, text]
                        # (None for the first token); a speculative server's prefill parts from the plain one's
                        # at position 2 of every other prompt, as a stand-in for a target forward that differs
                        part = spec and sum(body["input_ids"]) % 2 == 0
                        meta["input_token_logprobs"] = [[None if i == 0 else -0.01 * (t % 7) - (1e-4 if part and i == 3 else 0), t, None]
                                                        for i, t in enumerate(body["input_ids"])]
                o = json.dumps({"text": "x", "output_ids": ids, "meta_info": meta}).encode()
                self.send_response(200); self.send_header("Content-Type", "application/json"); self.send_header("Content-Length", str(len(o))); self.end_headers(); self.wfile.write(o)
        finally:
            with lock: state["running"] -= 1; state["tokens"] -= len(body["input_ids"]) + grown
            if "--enable-request-time-stats-logging" in args:  # as SGLang's Req.log_time_stats
                print(f"[x] ReqTimeStats(rid=r{id(self)}, input_len={len(body['input_ids'])}, cached_input_len=0, "
                      f"output_len={new}, attempts=1, type=unified): queue_duration=0.50ms, forward_duration=12.00ms, "
                      f"entry_time={time.time():.3f}", flush=True)
time.sleep(1)
ThreadingHTTPServer.request_queue_size = 256  # a listen backlog for 64+ clients at once (the default 5 stalls them)
ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
