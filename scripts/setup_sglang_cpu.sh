#!/usr/bin/env bash
# Install sglang (the plugin's host) on the CPU for the plugin tests: one venv per version under
# .cache/sglang-<version>/ with CPU torch, sglang --no-deps, the few modules that its plugin,
# hook-registry and adaptive-speculation modules import, and specctl itself (editable).
# Idempotent: a venv whose stamp matches is left alone. Usage: setup_sglang_cpu.sh [VERSION...]
# Then: .cache/sglang-<version>/bin/python -m pytest tests/plugin   (once per version)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.5.17 0.5.23)

# sglang pins a CUDA torch; we install --no-deps and bring a CPU build instead. Every later pip
# call carries this constraint so that no dependency swaps torch for a CUDA wheel.
TORCH_VERSION="${SPECCTL_TORCH_VERSION:-2.13.0}"
# What sglang/__init__.py, sglang/srt/utils/common.py and the adaptive modules import on the way.
DEPS=(numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic
      pyzmq tqdm IPython aiohttp)

setup_one() {
    local version="$1"
    local dir="$ROOT/.cache/sglang-$version"
    local stamp="$dir/.specctl-stamp"
    local want="sglang=$version torch=$TORCH_VERSION deps=${DEPS[*]} v5"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$dir/bin/python" - "$version" <<'PYEOF'
import sys, importlib.metadata as md
assert md.version("sglang") == sys.argv[1]
import specctl.plugin, sglang.srt.plugins.hook_registry, sglang.srt.speculative.adaptive_runtime_state
PYEOF
    then
        echo "sglang $version: ready in $dir"
        return 0
    fi
    echo "sglang $version: installing into $dir"
    rm -rf "$dir"
    "$PY" -m venv "$dir"
    # --no-compile: byte-compiling all of torch, triton and the rest takes longer than installing
    # them; the check at the end compiles what the plugin and its tests import
    local pip=("$dir/bin/python" -m pip install --disable-pip-version-check --quiet --no-compile)
    local cons="$dir/constraints.txt"
    echo "torch==$TORCH_VERSION" > "$cons"
    local extra=()
    # 0.5.22+: sglang.srt.distributed (the TP group the plugin broadcasts on) imports tvm_ffi
    case "$version" in 0.5.1?|0.5.1?.*) ;; *) extra=(apache-tvm-ffi==0.1.11) ;; esac
    # one resolver run: torch, what sglang imports, and specctl with its test extras (any test of
    # the suite can run in this env). torch==2.13.0 resolves to the CPU wheel kept on this kind of
    # machine (pip's find-links); prefer the explicit +cpu local version where an index offers it.
    local rest=("${DEPS[@]}" "${extra[@]}" -e "$ROOT[test]")
    "${pip[@]}" -c "$cons" "torch==$TORCH_VERSION+cpu" "${rest[@]}" 2>/dev/null \
        || "${pip[@]}" -c "$cons" "torch==$TORCH_VERSION" "${rest[@]}"
    "${pip[@]}" -c "$cons" --no-deps "sglang==$version"
    local site
    site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    if ! "$dir/bin/python" -c 'import torchvision' 2>/dev/null; then
        # sglang <= 0.5.17 does `from torchvision.io import decode_jpeg` at import time
        # (utils/common.py); PyPI's torchvision does not load beside CPU torch, and the code paths
        # the plugin tests touch never decode an image. A stand-in on a .pth-added path:
        mkdir -p "$dir/stubs/torchvision"
        cat > "$dir/stubs/torchvision/__init__.py" <<'PYEOF'
"""Stand-in for tests on CPU (scripts/setup_sglang_cpu.sh): sglang imports torchvision.io only."""
PYEOF
        cat > "$dir/stubs/torchvision/io.py" <<'PYEOF'
def decode_jpeg(*args, **kwargs):
    raise RuntimeError("torchvision stand-in: image decoding is not available in the CPU test env")
PYEOF
        echo "$dir/stubs" > "$site/specctl-cpu-stubs.pth"
    fi
    # writes the bytecode of what it imports (pip did not), also where PYTHONDONTWRITEBYTECODE is set
    env -u PYTHONDONTWRITEBYTECODE "$dir/bin/python" - "$version" <<'PYEOF'
import sys, importlib.metadata as md
import torch, torch.distributed, pytest
assert md.version("sglang") == sys.argv[1], md.version("sglang")
if "+cpu" not in torch.__version__:
    print(f"warning: torch {torch.__version__} is not a CPU build (pip found no local +cpu wheel)")
import sglang.srt.plugins, sglang.srt.plugins.hook_registry
import sglang.srt.speculative.adaptive_spec_params, sglang.srt.speculative.adaptive_runtime_state
import sglang.srt.distributed.parallel_state
import specctl.plugin
print(f"sglang {md.version('sglang')} + torch {torch.__version__}: modules import")
PYEOF
    echo "$want" > "$stamp"
}

for v in "${VERSIONS[@]}"; do
    setup_one "$v"
done
