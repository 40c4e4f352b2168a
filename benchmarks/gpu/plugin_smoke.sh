#!/bin/bash
# The specctl SGLang plugin inside a real SGLang 0.5.17 server: a smoke test in ONE device call.
# Run THERE from the repository root:   bash benchmarks/gpu/plugin_smoke.sh
# carry: benchmarks/gpu/bundle/site.txz.part00 benchmarks/gpu/bundle/MANIFEST.json benchmarks/gpu/bundle/smoke
#   (since session 4 the site has two parts: stash site.txz.part01 in a warm call before this one)
#   (48.1 MB + 3.1 MB; the tree is ~13 MB: 64 MiB in all is the limit). bundle/smoke/ holds the JIT cache and
#   deep_gemm recompressed with xz (jitcache.tgz + deepgemm.tgz = 7.4 MB do not fit beside the site):
#   here, once:  bash benchmarks/gpu/plugin_smoke.sh pack
#
# 1. overlay (sha256 against MANIFEST.json) -> /tmp/site, deep_gemm, JIT cache; specctl as a folder on
#    PYTHONPATH with a dist-info carrying the `sglang.srt.plugins` entry point (plugin_smoke.py site)
# 2. tiny random "agree" target + EAGLE-3 draft (tiny_models.py; every draft token is accepted)
# 3. pyzmq PULL listener on SPECCTL_TELEMETRY -> $OUT/telemetry.jsonl
# 4. sglang.launch_server, EAGLE3 topk 1, adaptive config of `specctl sglang-args --configs off,s1,s3`
#    (plugin_smoke_adaptive.json, launch steps 3 = the largest candidate), SPECCTL_MODE=file with the
#    table of plugin_smoke.py (bs 1 -> s3, bs 2-3 -> s1, bs >= 4 -> off)
# 5. closed-loop /generate at concurrency 1, 2, 8, 1 (64 new tokens, 3 rounds each)
# 6. $OUT: smoke.log server.log telemetry.jsonl client.json summary.json
set -u
if [ "${1:-}" = pack ]; then  # HERE: bundle/{jitcache,deepgemm}.tgz -> bundle/smoke/*.txz (xz -9e) + SHA256SUMS
  B=benchmarks/gpu/bundle; mkdir -p $B/smoke
  for f in jitcache deepgemm; do gzip -dc $B/$f.tgz | xz -9e -T4 -c > $B/smoke/$f.txz || exit 1; done
  (cd $B/smoke && sha256sum jitcache.txz deepgemm.txz > SHA256SUMS && ls -l); exit 0
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LIMIT=${LIMIT:-390}; T0=$(date +%s)
el(){ echo $(( $(date +%s) - T0 )); }
log(){ echo "[$(el)s] $*" | tee -a "$OUT/smoke.log"; }
G=benchmarks/gpu; B=$G/bundle; SITE=/tmp/site; SP=/tmp/specctl_site; M=/tmp/m-tiny  # never /tmp/m: tiny_models.py writes draft/ there, over the real EAGLE-3 draft
PORT=30000; URL=http://127.0.0.1:$PORT; TEL=ipc:///tmp/specctl/t.sock

# ---- 1. overlay (benchmarks/gpu/overlay.sh: shared with tp2_check.sh)
. $G/overlay.sh
overlay_install "$OUT/smoke.log" || exit 3
specctl_site "$OUT/smoke.log" || exit 3

# ---- 2. models
[ -f $M/draft_agree/config.json ] || python3 $G/tiny_models.py $M 2>&1 | grep -v -i -e warn -e Writing | tail -3 | tee -a "$OUT/smoke.log"
log "models ready: $(ls $M | tr '\n' ' ')"

# ---- 3. telemetry listener, policy file
mkdir -p /tmp/specctl && chmod 700 /tmp/specctl
python3 $G/plugin_smoke.py policy /tmp/specctl/policy.json >/dev/null
python3 $G/plugin_smoke.py listen $TEL "$OUT/telemetry.jsonl" > /tmp/listener.log 2>&1 &
LPID=$!
sleep 1

# ---- 4. server
export SGLANG_PLUGINS=specctl SPECCTL_MODE=file SPECCTL_POLICY_FILE=/tmp/specctl/policy.json \
  SPECCTL_TELEMETRY=$TEL SPECCTL_POLICY=none SPECCTL_SERVER_ID=smoke-h200
log "launch server (env: SGLANG_PLUGINS=$SGLANG_PLUGINS SPECCTL_MODE=$SPECCTL_MODE SPECCTL_TELEMETRY=$TEL)"
python3 -m sglang.launch_server --host 127.0.0.1 --port $PORT \
  --model-path $M/target_agree --speculative-draft-model-path $M/draft_agree \
  --attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.3 \
  --cuda-graph-max-bs-decode 32 --mm-feature-transport cpu --decode-log-interval 10 --max-running-requests 32 \
  --speculative-algorithm EAGLE3 --speculative-eagle-topk 1 --speculative-num-steps 3 --speculative-num-draft-tokens 4 \
  --speculative-adaptive --speculative-adaptive-config $G/plugin_smoke_adaptive.json \
  > "$OUT/server.log" 2>&1 &
SPID=$!

# ---- 5. drive
timeout $(( LIMIT - $(el) - 20 )) python3 $G/plugin_smoke.py drive $URL "$OUT/client.json" $(( LIMIT - $(el) - 60 )) 1,2,8,1 $SPID 2>&1 | tee -a "$OUT/smoke.log"
sleep 1
KIDS=$(pgrep -P $SPID | tr '\n' ' ')
kill $SPID 2>/dev/null; for i in $(seq 15); do [ -e /proc/$SPID ] || break; sleep 1; done
for k in $SPID $KIDS; do [ -e /proc/$k ] && kill -9 $k 2>/dev/null; done
kill $LPID 2>/dev/null
cat /tmp/listener.log >> "$OUT/smoke.log"
grep -q '"ready": true' "$OUT/client.json" 2>/dev/null || { echo "---- server log tail (not ready)"; tail -40 "$OUT/server.log" | cut -c1-300; } | tee -a "$OUT/smoke.log"

# ---- 6. summary
log "telemetry frames: $(wc -l < "$OUT/telemetry.jsonl" 2>/dev/null || echo 0)"
python3 $G/plugin_smoke.py summary "$OUT" 2>&1 | tee -a "$OUT/smoke.log"
echo "---- specctl / switch / error lines" | tee -a "$OUT/smoke.log"
grep -E "specctl|Switch adaptive|Failed to apply|Traceback|Error" "$OUT/server.log" | cut -c1-260 | sort | uniq -c | sort -rn | head -30 | tee -a "$OUT/smoke.log"
log "done"
