#!/bin/bash
# usage: bash benchmarks/gpu/quick_accept.sh STEPS...   (server per step count on /tmp/m/base with /tmp/m/draft)
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}; bash benchmarks/gpu/install_bundle.sh 2>&1 | tail -3
export PYTHONPATH=/tmp/site; cp /tmp/m/base/tok* /tmp/m/base/chat* /tmp/m/draft/ 2>/dev/null
for S in "$@"; do
  if [ "$S" = 0 ]; then SPEC=""; else SPEC="--speculative-algorithm EAGLE3 --speculative-draft-model-path /tmp/m/draft --speculative-num-steps $S --speculative-eagle-topk 1 --speculative-num-draft-tokens $((S+1))"; fi
  python3 -m sglang.launch_server --model-path ${MODEL:-/tmp/m/base} $SPEC --attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.3 --mm-feature-transport cpu --port 30000 --max-running-requests 64 --cuda-graph-max-bs-decode 64 --decode-log-interval 10 > $OUT/s$S.log 2>&1 &
  P=$!; python3 benchmarks/gpu/quick_accept.py 30000 $OUT s$S 320 16; python3 -c "import psutil,sys;p=psutil.Process(int(sys.argv[1]));[c.kill() for c in p.children(recursive=True)];p.kill()" $P; sleep 3; grep -E "accept len" $OUT/s$S.log | tail -2; grep -E "Traceback|Error" $OUT/s$S.log | head -5
done
