#!/bin/bash
# The steps of a device call, run THERE from the repository root; each is idempotent and logs under $OUT.
#   bash benchmarks/gpu/device_call.sh stash                 install/verify what this call carried (install_bundle.sh)
#   bash benchmarks/gpu/device_call.sh models 1b,8b          GGUF -> /tmp/m/{base,<variants>} + greedy-identity check
#   bash benchmarks/gpu/device_call.sh train [train args]    self-distil a draft -> /tmp/m/draft, weights back in $OUT (15 MiB parts)
#   bash benchmarks/gpu/device_call.sh use-draft DIR         use a committed draft (e.g. benchmarks/gpu/draft/v2) as /tmp/m/draft
#   bash benchmarks/gpu/device_call.sh bench [run_bench args]  SGLang runs (needs the site: PYTHONPATH=/tmp/site)
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} TOKENIZERS_PARALLELISM=false
S=/tmp/specctl-stash; M=/tmp/m; mkdir -p $OUT $M
step=$1; shift
case $step in
  stash) bash benchmarks/gpu/install_bundle.sh $S /tmp/site > $OUT/install.log 2>&1; rc=$?; tail -4 $OUT/install.log; exit $rc ;;
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
    [ -f /tmp/site/.checked ] || { echo "NEED the site (site.txz carried + stash step)"; exit 3; }
    for f in $M/base/tokenizer* $M/base/chat_template.jinja $M/base/special_tokens_map.json; do [ -f "$f" ] && cp "$f" $M/draft/; done
    PYTHONPATH=/tmp/site timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/gpu/run_bench.py --draft $M/draft --out $OUT "$@" 2>&1 | tee -a $OUT/bench.log | grep -v "Decode batch" | tail -40 ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
