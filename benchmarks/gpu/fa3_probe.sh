#!/bin/bash
# THERE, without the site: is the bundle's FA3 (fa3.so.xz: sglang-kernel 0.4.5's flash_ops, sm90 cubins only,
# fatbin_prune.py) loadable and right? Carry fa3.so.xz.part00, part01, part02 over three warm calls (the last with
# fa3probe.tgz: sgl_kernel's own flash_attn.py and debug_utils.py), each with MANIFEST.json; each call runs
#   bash benchmarks/gpu/fa3_probe.sh
# The call that completes the parts runs fa3_check.py (paged decode, 4-token verify, page 16 against torch's
# attention) with the image's torch -> $OUT/fa3_check.json.
set -uo pipefail
OUT=${OUT:-/tmp/out}; S=/tmp/specctl-stash; mkdir -p "$OUT" "$S"
HERE=$(cd "$(dirname "$0")" && pwd)
python3 "$HERE/bundle_manifest.py" stash "$HERE/bundle" "$S" | grep -E "fa3" || true
[ -f "$S/fa3.so.xz.ok" ] && [ -f "$S/fa3probe.tgz.ok" ] || { echo "FA3 probe: parts still missing"; exit 0; }
P=/tmp/fa3pkg; rm -rf "$P"; mkdir -p "$P"
tar xzf "$S/fa3probe.tgz" -C "$P" && xz -dc "$S/fa3.so.xz" > "$P/sgl_kernel/flash_ops.abi3.so" || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
PYTHONPATH=$P timeout 300 python3 "$HERE/fa3_check.py" "$OUT/fa3_check.json"
