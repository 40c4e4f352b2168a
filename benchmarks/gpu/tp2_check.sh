#!/bin/bash
# TP=2 consistency check of the specctl plugin inside SGLang 0.5.17, on nvidia-h200-x2, in ONE device call.
# Run THERE from the repository root:   LIMIT=420 bash benchmarks/gpu/tp2_check.sh
# carry: benchmarks/gpu/bundle/site.txz.part00 benchmarks/gpu/bundle/MANIFEST.json benchmarks/gpu/bundle/smoke
#
# 1. overlay + specctl site (overlay.sh, as plugin_smoke.sh); tiny random "agree" models (tiny_models.py)
# 2. policy PUBLISHER (tp2_check.py publish: the daemon's PUB, a new version every $PERIOD s, tables
#    cycling over steps {0,1,3}) and the telemetry PULL listener (plugin_smoke.py listen)
# 3. sglang.launch_server --tp-size 2 --disable-custom-all-reduce, EAGLE3 topk 1, adaptive (candidates 0,1,3;
#    launch steps 3), SPECCTL_MODE=online, SPECCTL_DECISION_LOG=$OUT/decisions-rank{rank}.txt
# 4. closed-loop /generate at concurrency 1,2,4,8,16,32 (a few s each) until rank 0 logged $TARGET decisions
#    or the deadline; stop the server (SIGTERM, then SIGKILL to its process group)
# 5. tp2_check.py compare: rank 0 vs rank 1 line by line, versions applied, tables followed -> summary.json
# $OUT (7 files): tp2.log summary.json decisions-rank0.txt decisions-rank1.txt server.log client.json extra.tar.xz
#   (extra: telemetry.jsonl published.jsonl listener.log publisher.log)
# TP2_TREE=1: the tree (topk 4, 2 steps, 16 tokens) is one more runtime state (key 2) beside off, s1, s3, launched
#   with `specctl sglang-args`' adaptive config and flags; the published tables name it (tp2_check.py TREE_TABLES)
# Overridable for a CPU dry run (tests/gpu/test_tp2_check.py): OUT LIMIT TARGET MIN_DECISIONS LEVELS PERIOD
#   PORT RUNDIR SITE SP M PREFILL_GRAPH(=1: keep the prefill CUDA graph) TP2_LEVEL_S TP2_MAX_NEW TP2_REQ_TIMEOUT
set -u
set -m  # every background job in its own process group: the server's children are killed with it
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# nvidia-h200-x2: NVLink multicast stays off, in every process started here (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}  # SGLang's CPU (gloo) groups: one host, loopback
OUT=$(realpath -m "${OUT:-/tmp/out}"); mkdir -p "$OUT"
LIMIT=${LIMIT:-420}; TARGET=${TARGET:-12000}; MIN_DECISIONS=${MIN_DECISIONS:-10000}
LEVELS=${LEVELS:-1,2,4,8,16,32}; PERIOD=${PERIOD:-0.5}
T0=$(date +%s); DEADLINE=$(( T0 + LIMIT - 90 ))  # no new load level after this; worst case (a hang:
# 30 s request timeouts) the driver is killed at DEADLINE + 60, leaving 30 s for stop, compare, pack
el(){ echo $(( $(date +%s) - T0 )); }
log(){ echo "[$(el)s] $*" | tee -a "$OUT/tp2.log"; }
G=benchmarks/gpu; M=${M:-/tmp/m-tiny}; RUNDIR=${RUNDIR:-/tmp/specctl}
PORT=${PORT:-30000}; URL=http://127.0.0.1:$PORT
TEL=ipc://$RUNDIR/t.sock; POL=ipc://$RUNDIR/p.sock
SPID=; PPID_=; LPID=

alive(){ [ -n "$1" ] && [ -e /proc/$1 ]; }
stop_group(){  # PID GRACE_S: SIGTERM to PID, wait, then SIGKILL to its process group and what it spawned
  local p=$1 grace=$2 kids i
  alive $p || { kill -KILL -- -$p 2>/dev/null; return 0; }
  kids=$(pgrep -g $p 2>/dev/null | tr '\n' ' ')
  kill -TERM $p 2>/dev/null
  for i in $(seq $(( grace * 2 ))); do alive $p || break; sleep 0.5; done
  kill -KILL -- -$p 2>/dev/null
  for k in $kids; do alive $k && kill -KILL $k 2>/dev/null; done
  return 0
}
cleanup(){
  [ -n "$SPID" ] && stop_group $SPID 10
  [ -n "$PPID_" ] && stop_group $PPID_ 2
  [ -n "$LPID" ] && stop_group $LPID 2
  SPID=; PPID_=; LPID=
}
trap cleanup EXIT

export TP2_TREE=${TP2_TREE:-0}  # the publisher and the compare step read it too
log "tp2_check: LIMIT=$LIMIT TARGET=$TARGET LEVELS=$LEVELS PERIOD=$PERIOD TP2_TREE=$TP2_TREE OUT=$OUT"
log "env: NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader 2>&1 | tee -a "$OUT/tp2.log"
  NG=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  [ "$NG" -ge 2 ] || { log "need 2 GPUs for TP=2, found $NG: stop"; exit 4; }
  nvidia-smi topo -m 2>&1 | head -4 >> "$OUT/tp2.log"
fi

# ---- 1. overlay, specctl site, models
. $G/overlay.sh
overlay_install "$OUT/tp2.log" || exit 3
specctl_site "$OUT/tp2.log" || exit 3
[ -f $M/draft_agree/config.json ] || python3 $G/tiny_models.py $M 2>&1 | grep -v -i -e warn -e Writing | tail -3 | tee -a "$OUT/tp2.log"
[ -f $M/draft_agree/config.json ] || { log "models FAILED"; exit 3; }
log "models ready: $(ls $M | tr '\n' ' ')"

# ---- 2. publisher + telemetry listener
mkdir -p "$RUNDIR" && chmod 700 "$RUNDIR"
rm -f "$RUNDIR/t.sock" "$RUNDIR/p.sock" "$OUT"/decisions-rank*.txt "$OUT/published.jsonl" "$OUT/telemetry.jsonl"
python3 $G/plugin_smoke.py listen $TEL "$OUT/telemetry.jsonl" > /tmp/tp2_listener.log 2>&1 &
LPID=$!
python3 $G/tp2_check.py publish $POL "$OUT/published.jsonl" $PERIOD > /tmp/tp2_publisher.log 2>&1 &
PPID_=$!
sleep 1
alive $PPID_ || { log "publisher died:"; cat /tmp/tp2_publisher.log | tee -a "$OUT/tp2.log"; exit 3; }
alive $LPID || { log "listener died:"; cat /tmp/tp2_listener.log | tee -a "$OUT/tp2.log"; exit 3; }
log "publisher at $POL (every $PERIOD s; $(wc -l < "$OUT/published.jsonl") published so far), listener at $TEL"

# ---- 3. server, TP=2
unset SPECCTL_POLICY_FILE SPECCTL_RUNDIR
# no prefill CUDA graph: saves the ~52 s capture seen in the smoke test (decode graphs stay); PREFILL_GRAPH=1 keeps it
[ "${PREFILL_GRAPH:-0}" = 1 ] && PREFILL_FLAG= || PREFILL_FLAG=--disable-prefill-cuda-graph
export SGLANG_PLUGINS=specctl SPECCTL_MODE=online SPECCTL_POLICY=$POL SPECCTL_TELEMETRY=$TEL \
  SPECCTL_STALE_AFTER_S=60 SPECCTL_SERVER_ID=tp2-h200 SPECCTL_DECISION_LOG="$OUT/decisions-rank{rank}.txt"
log "launch server --tp-size 2 (SPECCTL_MODE=$SPECCTL_MODE SPECCTL_POLICY=$POL SPECCTL_DECISION_LOG=$SPECCTL_DECISION_LOG)"
if [ "${TP2_TREE:-0}" = 1 ]; then
  # the tree as runtime state 2 beside off, s1, s3: the adaptive config and flags of `specctl sglang-args`
  SPEC_FLAGS=$(python3 -c "
import json, sys
from specctl.plugin import launch_args
a = launch_args.build([(0, 1, 1), (1, 1, 2), (2, 4, 16), (3, 1, 4)], config_path=sys.argv[1])
json.dump(a.adaptive_config, open(sys.argv[1], 'w'))
print(' '.join(a.flags))" "$OUT/adaptive.json") || { log "sglang-args FAILED"; exit 3; }
else
  SPEC_FLAGS="--speculative-algorithm EAGLE3 --speculative-eagle-topk 1 --speculative-num-steps 3 \
    --speculative-num-draft-tokens 4 --speculative-adaptive --speculative-adaptive-config $G/plugin_smoke_adaptive.json"
fi
log "speculative flags: $SPEC_FLAGS"
python3 -m sglang.launch_server --host 127.0.0.1 --port $PORT \
  --model-path $M/target_agree --speculative-draft-model-path $M/draft_agree \
  --tp-size 2 --disable-custom-all-reduce \
  --attention-backend triton --sampling-backend pytorch --grammar-backend none --mem-fraction-static 0.3 \
  --cuda-graph-max-bs-decode 32 $PREFILL_FLAG --mm-feature-transport cpu \
  --decode-log-interval 40 --max-running-requests 32 --watchdog-timeout 120 \
  $SPEC_FLAGS > "$OUT/server.log" 2>&1 &
SPID=$!

# ---- 4. load until TARGET decisions (rank 0's log) or the deadline
DT=$(( DEADLINE - $(date +%s) + 60 )); [ $DT -ge 20 ] || DT=20
timeout $DT python3 $G/tp2_check.py drive $URL "$OUT/client.json" \
  "$OUT/decisions-rank0.txt" $DEADLINE $TARGET $LEVELS $SPID 2>&1 | tee -a "$OUT/tp2.log"
log "driver done (rc ${PIPESTATUS[0]}); server alive: $(alive $SPID && echo yes || echo NO)"
if ! grep -q '"ready": true' "$OUT/client.json" 2>/dev/null || ! grep -q -E '"stopped_because": "(target|deadline)"' "$OUT/client.json"; then
  { echo "---- server NOT ready, or the load stopped early: server.log tail"; tail -60 "$OUT/server.log" | cut -c1-300
    echo "---- error lines"; grep -n -E "Error|error:|Traceback|NCCL|CUDA|Killed|exception" "$OUT/server.log" | cut -c1-300 | tail -30
  } | tee -a "$OUT/tp2.log"
fi
log "decision lines: rank0 $(grep -vc '^#' "$OUT/decisions-rank0.txt" 2>/dev/null) rank1 $(grep -vc '^#' "$OUT/decisions-rank1.txt" 2>/dev/null)"
log "stopping the server"
SG=$SPID; stop_group $SPID 15; SPID=
sleep 1
stop_group $PPID_ 2; PPID_=
stop_group $LPID 2; LPID=
left=$(pgrep -g $SG 2>/dev/null | tr '\n' ' ')
log "server stopped; processes of its group left: ${left:-none}"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-compute-apps=pid,name,used_memory --format=csv,noheader 2>&1 | head -5 | tee -a "$OUT/tp2.log"

# ---- 5. compare
{ echo "---- publisher / listener"; tail -5 /tmp/tp2_publisher.log; tail -5 /tmp/tp2_listener.log; } >> "$OUT/tp2.log"
echo "---- specctl / switch / error lines (server.log)" >> "$OUT/tp2.log"
grep -E "specctl|Switch adaptive|Failed to apply|Traceback|Error|NCCL" "$OUT/server.log" | grep -v "in force from decode step" \
  | cut -c1-260 | sed -E 's/^\[[0-9: -]+/[/' | sort | uniq -c | sort -rn | head -30 >> "$OUT/tp2.log"
python3 $G/tp2_check.py compare "$OUT" $MIN_DECISIONS 2>&1 | tee -a "$OUT/tp2.log"; CRC=${PIPESTATUS[0]}
( cd "$OUT" && cp /tmp/tp2_listener.log listener.log 2>/dev/null; cp /tmp/tp2_publisher.log publisher.log 2>/dev/null
  tar cJf extra.tar.xz --ignore-failed-read telemetry.jsonl published.jsonl listener.log publisher.log 2>/dev/null \
    && rm -f telemetry.jsonl published.jsonl listener.log publisher.log )
[ "$(stat -c %s "$OUT/server.log" 2>/dev/null || echo 0)" -gt 12000000 ] && xz -T4 "$OUT/server.log"
log "done (verdict rc $CRC); \$OUT: $(ls "$OUT" | tr '\n' ' ')"
exit $CRC
