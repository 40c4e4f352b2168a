#!/bin/bash
# The steps of a device call, run THERE from the repository root; each is idempotent and logs under $OUT.
#   bash benchmarks/gpu/device_call.sh stash                 install/verify what this call carried (install_bundle.sh)
#   bash benchmarks/gpu/device_call.sh models 1b,8b          GGUF -> /tmp/m/{base,<variants>} + greedy-identity check
#   bash benchmarks/gpu/device_call.sh train [train args]    self-distil a draft -> /tmp/m/draft, weights back in $OUT (15 MiB parts)
#   bash benchmarks/gpu/device_call.sh use-draft DIR         use a committed draft (e.g. benchmarks/gpu/draft/v2) as /tmp/m/draft
#   bash benchmarks/gpu/device_call.sh bench [run_bench args]  SGLang runs (needs the site: PYTHONPATH=/tmp/site)
#   bash benchmarks/gpu/device_call.sh sweep2 POLS0 POLS1 [run_bench args]   2 GPUs: one run_bench per GPU at
#        once (POLS0 on GPU 0, POLS1 on GPU 1), each packed to $OUT/g<N>.tgz + $OUT/bench-g<N>.json
#   bash benchmarks/gpu/device_call.sh checks C0 C1   2 GPUs: specctl_e2e.py subcommands (identity, online,
#        overhead; comma lists, "-" = none) on GPU 0 and GPU 1 at once -> $OUT/checks-g<N>.tgz + the JSONs
#   bash benchmarks/gpu/device_call.sh gate [N]   exit 3 unless the last sweep2 on GPU N built the decode state in some
#        server and no server turned it (or the catch-up) off; any other patch turned off is printed (start an expensive call with it: a broken build costs seconds, not a call)
#   bash benchmarks/gpu/device_call.sh tdump [tensor_dump.py args]   the no-spec server and the decode state with SGLang's
#        tensor dump, a few prompts at batch 1 -> $OUT/tensor-dump.json: the first module output where they part
#   bash benchmarks/gpu/device_call.sh ctxprofile [ctx_profile.py measure args]   decode steps of off / s1 / s3 at
#        two or more prompt lengths -> $OUT/ctx-steps.json, $OUT/profile-ctx.json, $OUT/ctx-logs.tgz
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} TOKENIZERS_PARALLELISM=false
S=/tmp/specctl-stash; M=/tmp/m; mkdir -p $OUT $M
step=$1; shift
need_site(){ [ -f /tmp/site/.checked ] || { echo "NEED the site (site.txz carried + stash step)"; exit 3; }; }
draft_tok(){ for f in $M/base/tokenizer* $M/base/chat_template.jinja $M/base/special_tokens_map.json; do [ -f "$f" ] && cp "$f" $M/draft/; done; }
case $step in
  stash) bash benchmarks/gpu/install_bundle.sh $S /tmp/site > $OUT/install.log 2>&1; rc=$?; tail -4 $OUT/install.log
    # the daemon's own needs beyond the overlay: scikit-learn, scipy, numpy, prometheus-client come with the image
    # (checked here); click travels as a wheel in bundle/extra when the image lacks it
    if [ -f /tmp/site/.installed ] && ! PYTHONPATH=/tmp/site python3 -c "import click" 2>/dev/null; then
      ls benchmarks/gpu/bundle/extra/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
        --target /tmp/site benchmarks/gpu/bundle/extra/*.whl && echo "installed bundle/extra wheels"; fi
    python3 -c "import sklearn, scipy, numpy, prometheus_client; print('daemon deps: sklearn', sklearn.__version__, 'scipy', scipy.__version__)" 2>&1 | tail -1
    exit $rc ;;
  models)
    [ -f $S/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "NEED the GGUF (gguf.part00 + gguf.part01 over two warm calls)"; exit 3; }
    PYTHONPATH=$S/aux/gguf-0.19.0-py3-none-any.whl timeout ${MODELS_TIMEOUT:-240} python3 benchmarks/gpu/build_models.py \
      --gguf $S/SmolLM2-135M-Instruct.Q4_1.gguf --out $M --variants "${1:-1b,8b}" --check ${CHECK:-20} 2>&1 \
      | grep -v -i -e warn -e "Loading weights" | tee $OUT/build_models.log | tail -5
    cp $M/models.json $OUT/ ;;
  train)
    [ -f $M/base/config.json ] || { echo "NEED /tmp/m/base (models step)"; exit 3; }
    timeout ${TRAIN_TIMEOUT:-420} python3 benchmarks/gpu/train_draft.py --target $M/base --prompts $S/aux/prompts --out $M/draft "$@" 2>&1 \
      | grep -v -i -e warn -e "Loading weights" -e clean_up | tee $OUT/train.log | tail -8
    cp $M/draft/train_report.json $M/draft/config.json $OUT/ && split -b 15M -d $M/draft/model.safetensors $OUT/draft.safetensors.part ;;
  use-draft)  # a committed draft dir; model-nohead.safetensors gets its lm_head back from /tmp/m/base (draft_io.py)
    mkdir -p $M/draft && cp "$1"/config.json $M/draft/
    if [ -f "$1"/model-nohead.safetensors ]; then python3 benchmarks/gpu/draft_io.py restore "$1"/model-nohead.safetensors $M/base $M/draft/model.safetensors
    else cp "$1"/model.safetensors $M/draft/; fi
    sha256sum $M/draft/model.safetensors ;;
  bench)
    need_site; draft_tok
    PYTHONPATH=/tmp/site timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/gpu/run_bench.py --draft $M/draft --out $OUT "$@" 2>&1 | tee -a $OUT/bench.log | grep -v "Decode batch" | tail -40 ;;
  tdump)
    need_site; draft_tok
    PYTHONPATH=/tmp/site timeout ${TDUMP_TIMEOUT:-500} python3 benchmarks/gpu/tensor_dump.py --model $M/8b --draft $M/draft \
      --out $OUT "$@" 2>&1 | tee $OUT/tdump.log | grep -v -i -e warn -e "Dump " | tail -30
    rm -rf /tmp/tdump ;;
  sweep2)
    need_site; draft_tok; P0=$1; P1=$2; shift 2
    for g in 0 1; do
      pols=$P0; [ $g = 1 ] && pols=$P1; [ "$pols" = - ] && continue
      # a host can keep $OUT between leases: 2026-12-03's third lease found the second's server logs and
      # telemetry in g0 and packed them with its own (same server names, other runs)
      rm -rf $OUT/g$g
      CUDA_VISIBLE_DEVICES=$g PYTHONPATH=/tmp/site timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/gpu/run_bench.py --draft $M/draft \
        --out $OUT/g$g --port0 $((31000 + 1000 * g)) --policies $pols "$@" > $OUT/g$g.log 2>&1 &
    done
    wait
    for g in 0 1; do
      [ -f $OUT/g$g.log ] || continue
      grep -v "Decode batch" $OUT/g$g.log | grep -E "^\[|Error|error" | tail -30
      cp $OUT/g$g/bench-*.json $OUT/bench-g$g.json 2>/dev/null; mv $OUT/g$g.log $OUT/g$g/run.log
      # what the decode state did in this sweep's servers, for a later call's `gate` (kept while the machine is warm)
      grep -rhoE "specctl: (decode state built[^;]*|draft catch-up on|split-KV verify kernel on|patch [a-z_.]+ off: .*)" \
        $OUT/g$g --include='*.log' | sort | uniq -c > /tmp/specctl-gate-g$g.txt
      tar czf $OUT/g$g.tgz -C $OUT g$g && rm -rf $OUT/g$g
    done ;;
  ctxprofile)
    need_site; draft_tok; mkdir -p $OUT/ctx
    PYTHONPATH=/tmp/site timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/gpu/ctx_profile.py measure --draft $M/draft --out $OUT/ctx "$@" 2>&1 \
      | tee $OUT/ctx.log | grep -v "Decode batch" | tail -40
    cp $OUT/ctx/ctx-steps.json $OUT/ctx/profile-ctx.json $OUT/ 2>/dev/null
    tar czf $OUT/ctx-logs.tgz -C $OUT ctx ctx.log && rm -rf $OUT/ctx $OUT/ctx.log ;;
  checks)  # checks C0 C1: comma lists of specctl_e2e.py subcommands run in turn on GPU 0 / GPU 1 ("-": none)
    need_site; draft_tok
    for g in 0 1; do
      list=$1; [ $g = 1 ] && list=$2; [ "$list" = - ] && continue
      ( export CUDA_VISIBLE_DEVICES=$g PYTHONPATH=/tmp/site
        k=0; for c in ${list//,/ }; do k=$((k + 1))
          model=$M/8b; [ $c = identity ] && model=$M/base
          t=${ONLINE_T:-300}; [ $c = identity ] && t=${ID_T:-200}; [ $c = overhead ] && t=${OVH_T:-260}
          timeout $t python3 benchmarks/gpu/specctl_e2e.py $c --model $model --draft $M/draft --out $OUT/c$g --port $((32000 + 1000 * g + 100 * k))
        done ) > $OUT/c$g.log 2>&1 &
    done
    wait
    for g in 0 1; do
      [ -f $OUT/c$g.log ] || continue
      grep -v "Decode batch" $OUT/c$g.log | grep -E "^\[|Error|error" | tail -30
      for f in identity overhead online; do [ -f $OUT/c$g/$f.json ] && cp $OUT/c$g/$f.json $OUT/; done
      mv $OUT/c$g.log $OUT/c$g/run.log; tar czf $OUT/checks-g$g.tgz -C $OUT c$g && rm -rf $OUT/c$g
    done ;;
  gate)  # before an expensive call: the last sweep's servers built the decode state and no step turned it off
    f=/tmp/specctl-gate-g${1:-0}.txt; [ -f $f ] || { echo "GATE: no earlier sweep on this machine"; exit 3; }
    cat $f
    grep -q "decode state built" $f || { echo "GATE: no server built the decode state"; exit 3; }
    ! grep -qE "patch (plain_decode|plain_flashinfer) off" $f || { echo "GATE: the decode state failed"; exit 3; }
    ! grep -qE "patch catchup off" $f || { echo "GATE: the draft catch-up failed"; exit 3; }
    ! grep -qE "patch [a-z_.]+ off" $f || echo "GATE: warning: a patch turned itself off (above)"
    echo "GATE: ok" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
