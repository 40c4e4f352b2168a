#!/bin/bash
# The MoE testbed target's checks, THERE after the staging calls (the site, /tmp/m/base, /tmp/m/draft):
#   bash benchmarks/gpu/moe_check.sh build                      /tmp/m/moe (build_moe.py) -> $OUT/moe.json
#   bash benchmarks/gpu/moe_check.sh serve base:0 moe:0 base:3 moe:3   one server at a time (MODEL:STEPS; steps 0 =
#        no speculation, one request at a time), MT-Bench turn 1 + HumanEval greedy through quick_accept.py
#        -> $OUT/accept_<tag>.json, and each server's median step at its concurrency (clean Decode-batch windows)
#   bash benchmarks/gpu/moe_check.sh compare                    $OUT/moe_check.json: greedy identity of moe:0 with
#        base:0 per prompt, accept lengths of moe:3 against base:3
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} TOKENIZERS_PARALLELISM=false
M=/tmp/m; mkdir -p $OUT
step=$1; shift
case $step in
  build)
    timeout ${MOE_TIMEOUT:-420} python3 benchmarks/gpu/build_moe.py --base $M/base --out $M/moe "$@" 2>&1 \
      | grep -v -i -e warn -e "Loading weights" | tee $OUT/build_moe.log | tail -12
    cp $M/moe/moe.json $OUT/ ;;
  serve)
    for f in $M/base/tokenizer* $M/base/chat_template.jinja $M/base/special_tokens_map.json; do [ -f "$f" ] && cp "$f" $M/draft/; done
    for spec in "$@"; do
      model=${spec%%:*}; S=${spec##*:}; tag=${model}_s$S; mem=0.3; env=()
      if [ $model = moe ]; then mem=0.55; env=(SGLANG_EXTERNAL_MODEL_PACKAGE=specctl_testbed_models
                                            PYTHONPATH=/tmp/site:$PWD/benchmarks/gpu/moe_models); fi
      SPEC=(); [ $S != 0 ] && SPEC=(--speculative-algorithm EAGLE3 --speculative-draft-model-path $M/draft
        --speculative-num-steps $S --speculative-eagle-topk 1 --speculative-num-draft-tokens $((S + 1)))
      env PYTHONPATH=/tmp/site "${env[@]}" python3 -m sglang.launch_server --model-path $M/$model "${SPEC[@]}" \
        --attention-backend ${BACKEND:-triton} --sampling-backend pytorch --grammar-backend none --mem-fraction-static $mem \
        --mm-feature-transport cpu --port 30000 --host 127.0.0.1 --max-running-requests 64 --cuda-graph-max-bs-decode 64 \
        --decode-log-interval 10 --disable-prefill-cuda-graph > $OUT/server_$tag.log 2>&1 &
      P=$!
      # steps 0 is the identity run: one request at a time, so that both servers decode every prompt in batches of
      # one (at 16 at once, two servers of the dense base part on 139 of 244 prompts: batching, not the model)
      conc=16; [ $S = 0 ] && conc=${IDENTITY_CONC:-1}
      PYTHONPATH=/tmp/site TOKDIR=$M/base timeout ${SERVE_TIMEOUT:-300} python3 benchmarks/gpu/quick_accept.py 30000 $OUT $tag \
        ${NEW_TOKENS:-128} $conc 2>&1 | tail -3
      python3 -c "import psutil,sys;p=psutil.Process(int(sys.argv[1]));[c.kill() for c in p.children(recursive=True)];p.kill()" $P
      sleep 3
      grep -E "Traceback|Error" $OUT/server_$tag.log | head -5
      grep -E "fused_moe|Using default MoE config|moe config|specctl testbed" -i $OUT/server_$tag.log | head -3
      # the server's own step at the run's concurrency (SGLang's Decode-batch lines): what a --tail N adds
      PYTHONPATH=/tmp/site:$PWD/benchmarks/gpu python3 -c "import sys, benchlib as B
r = B.parse_decode_lines(open(sys.argv[1]).read(), n=int(sys.argv[2]))
print(sys.argv[3], 'step at', sys.argv[2], 'running:', r.get('clean_step_ms_med'), 'ms (clean windows,', r.get('clean_lines'), 'lines)')" \
        $OUT/server_$tag.log $conc $tag
    done ;;
  compare)
    python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(tag):
    p = os.path.join(out, f"accept_{tag}.json")
    return json.load(open(p)) if os.path.exists(p) else None
res = {}
def parts(x, y, key):  # per prompt set: greedy outputs equal, and where the others first part
    for name in x:
        pairs = list(zip(x[name]["output_ids"], y[name]["output_ids"]))
        first = [next((i for i, (a1, b1) in enumerate(zip(a, b)) if a1 != b1), None if len(a) == len(b) else min(len(a), len(b)))
                 for a, b in pairs]
        res[f"{key}_{name}"] = {"identical": sum(f is None for f in first), "of": len(pairs),
                                "first_divergence": sorted(f for f in first if f is not None)}
b0, m0, b3 = load("base_s0"), load("moe_s0"), load("base_s3")
if b0 and m0:
    parts(b0, m0, "identity")
if b0 and b3:  # the control: the dense base against itself with speculation (what batching alone parts)
    parts(b0, b3, "control_base_s0_s3")
for name in ("mtbench", "humaneval"):
    b3, m3 = load("base_s3"), load("moe_s3")
    if b3 and m3:
        a, b = b3[name]["accept_length"], m3[name]["accept_length"]
        res[f"accept_{name}"] = {"base_s3": a, "moe_s3": b, "ratio": round(b / a, 4) if a else None}
json.dump(res, open(os.path.join(out, "moe_check.json"), "w"), indent=1)
print(json.dumps(res)[:1500])
PY
    ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
