#!/usr/bin/env bash
# Install sglang (the plugin's host) on the CPU for the plugin tests: one venv per version under
# .cache/sglang-<version>/ holding sglang --no-deps (and what that release alone needs), on top of
# one shared venv .cache/sglang-base/ with CPU torch, the few modules that sglang's plugin,
# hook-registry and adaptive-speculation modules import, and specctl itself (editable, with its
# test extras). The versions see the base through a .pth line: torch and the rest are installed
# (and written to disk) once, not once per version.
# Idempotent: a venv whose stamp matches is left alone. Usage: setup_sglang_cpu.sh [VERSION...]
# Then: .cache/sglang-<version>/bin/python -m pytest -m sglang tests/plugin   (once per version)
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
BASE="$ROOT/.cache/sglang-base"
BASE_WANT="torch=$TORCH_VERSION deps=${DEPS[*]} v6"
CONS="$BASE/constraints.txt"

# --no-compile: byte-compiling all of torch, triton and the rest takes longer than installing them;
# each version's check compiles what the plugin and its tests import
pip_in() { "$1/bin/python" -m pip install --disable-pip-version-check --quiet --no-compile "${@:2}"; }
site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

setup_base() {
    if [ -f "$BASE/.specctl-stamp" ] && [ "$(cat "$BASE/.specctl-stamp")" = "$BASE_WANT" ] \
        && "$BASE/bin/python" -c 'import torch, specctl.plugin' 2>/dev/null; then
        return 0
    fi
    echo "sglang CPU base (torch $TORCH_VERSION, sglang's import-time modules, specctl): installing into $BASE"
    rm -rf "$BASE"
    "$PY" -m venv "$BASE"
    echo "torch==$TORCH_VERSION" > "$CONS"
    # one resolver run: torch, what sglang imports, and specctl with its test extras (any test of
    # the suite can run here). torch==2.13.0 resolves to the CPU wheel kept on this kind of
    # machine (pip's find-links); prefer the explicit +cpu local version where an index offers it.
    local rest=("${DEPS[@]}" -e "$ROOT[test]")
    pip_in "$BASE" -c "$CONS" "torch==$TORCH_VERSION+cpu" "${rest[@]}" 2>/dev/null \
        || pip_in "$BASE" -c "$CONS" "torch==$TORCH_VERSION" "${rest[@]}"
    echo "$BASE_WANT" > "$BASE/.specctl-stamp"
}

setup_one() {
    local version="$1"
    local dir="$ROOT/.cache/sglang-$version"
    local stamp="$dir/.specctl-stamp"
    local want="sglang=$version base=($BASE_WANT)"
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
    local site
    site="$(site_of "$dir")"
    # the base's packages (and its .pth files: specctl's editable finder) after this venv's own
    echo "import site; site.addsitedir('$(site_of "$BASE")')" > "$site/specctl-sglang-base.pth"
    # 0.5.22+: sglang.srt.distributed (the TP group the plugin broadcasts on) imports tvm_ffi
    case "$version" in 0.5.1?|0.5.1?.*) ;; *) pip_in "$dir" -c "$CONS" apache-tvm-ffi==0.1.11 ;; esac
    pip_in "$dir" -c "$CONS" --no-deps "sglang==$version"
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
assert [e.value for e in md.entry_points(group="sglang.srt.plugins") if e.name == "specctl"] == ["specctl.plugin:register"]
print(f"sglang {md.version('sglang')} + torch {torch.__version__}: modules import")
PYEOF
    echo "$want" > "$stamp"
}

setup_base
for v in "${VERSIONS[@]}"; do
    setup_one "$v"
done
