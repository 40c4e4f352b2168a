"""Measure SGLang's accept length of a running server on MT-Bench turn 1 and HumanEval (chat prompts).
usage: quick_accept.py PORT OUTDIR TAG [max_new_tokens] [concurrency]"""
import sys, os, json, time, urllib.request as u, concurrent.futures as cf
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); import prompts as P
from transformers import AutoTokenizer
port, out, tag = sys.argv[1], sys.argv[2], sys.argv[3]
new = int(sys.argv[4]) if len(sys.argv) > 4 else 320; conc = int(sys.argv[5]) if len(sys.argv) > 5 else 16
t = AutoTokenizer.from_pretrained(os.environ.get("TOKDIR", "/tmp/m/base"))
def ids(x):
    e = t.apply_chat_template([{"role": "user", "content": x}], add_generation_prompt=True, tokenize=True)
    e = e["input_ids"] if hasattr(e, "keys") else e
    return list(e)
def post(b):
    r = u.Request(f"http://127.0.0.1:{port}/generate", json.dumps(b).encode(), {"Content-Type": "application/json"})
    return json.loads(u.urlopen(r, timeout=600).read())
T = time.time()
for i in range(200):
    try: u.urlopen(f"http://127.0.0.1:{port}/health", timeout=2); break
    except Exception: time.sleep(2)
print("ready after", round(time.time() - T, 1), flush=True)
S = os.environ.get("PROMPTS", "/tmp/specctl-stash/aux/prompts/")
res = {}
for name, ps in [("mtbench", P.load_mtbench(S + "mtbench_question.jsonl")), ("humaneval", P.load_humaneval(S + "HumanEval.jsonl.gz"))]:
    t0 = time.time()
    with cf.ThreadPoolExecutor(conc) as ex:
        R = list(ex.map(lambda p: post({"input_ids": ids(p["text"]), "sampling_params": {"temperature": 0, "max_new_tokens": new}}), ps))
    m = [r["meta_info"] for r in R]; ct = sum(x["completion_tokens"] for x in m); v = sum(x.get("spec_verify_ct", 0) for x in m)
    res[name] = {"accept_length": ct / v if v else None, "completion_tokens": ct, "verify_ct": v, "wall_s": round(time.time() - t0, 2),
                 "requests": len(R), "output_ids": [r.get("output_ids") for r in R]}
    print(tag, name, "accept_len", res[name]["accept_length"], "tok", ct, "wall", res[name]["wall_s"], flush=True)
json.dump(res, open(os.path.join(out, f"accept_{tag}.json"), "w"))
