#!/bin/bash
# Run THERE (the GPU machine), from the repository root, in every device call. Idempotent.
#   bash benchmarks/gpu/install_bundle.sh [STASH] [SITE]      (defaults /tmp/specctl-stash, /tmp/site)
# 1. copies whatever parts of benchmarks/gpu/bundle/ this call carried into STASH, each checked against
#    MANIFEST.json's sha256; joins every artifact whose parts are all there (joined sha256 checked);
#    artifacts may arrive over several warm calls (the GGUF needs two: a call carries <= 64 MiB)
# 2. installs what is complete and not yet installed: site.txz -> SITE (the overlay; use PYTHONPATH=SITE),
#    deepgemm.tgz -> SITE, jitcache.tgz -> / (tvm-ffi + Triton caches), aux.tgz -> STASH/aux
#    (gguf wheel, prompts), gguf -> STASH/SmolLM2-135M-Instruct.Q4_1.gguf, fa3.so.xz -> SITE/sgl_kernel (FA3, checked)
# 3. once SITE is installed: proves `import sglang.srt.entrypoints.http_server` (+ the EAGLE-3 modules) and
#    runs one sglang-kernel CUDA kernel (rmsnorm, against a torch reference); writes $OUT/bundle_check.json
# Exit 0 when nothing is corrupt and (if SITE is installed) the checks passed; 3 when the site is missing.
set -uo pipefail
STASH=${1:-/tmp/specctl-stash}; SITE=${2:-/tmp/site}; OUT=${OUT:-/tmp/out}; mkdir -p "$STASH" "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd); B=$HERE/bundle
T0=$(date +%s)
if [ -f "$B/MANIFEST.json" ] || [ -f "$STASH/MANIFEST.json" ]; then
  python3 "$HERE/bundle_manifest.py" stash "$B" "$STASH" | tee "$STASH/stash_report.jsonl" || echo "BUNDLE: corrupt or bad parts (see above)"
else
  echo "BUNDLE: no MANIFEST.json carried or stashed"; exit 3
fi
ok(){ [ -f "$STASH/$1.ok" ]; }
if ok site.txz && [ ! -f "$SITE/.installed" ]; then
  mkdir -p "$(dirname "$SITE")"; rm -rf "$SITE.tmp"; mkdir -p "$SITE.tmp"
  tar xJf "$STASH/site.txz" -C "$SITE.tmp" && rm -rf "$SITE" && mv "$SITE.tmp/site" "$SITE" && rm -rf "$SITE.tmp" && touch "$SITE/.installed" \
    && echo "installed site into $SITE ($(du -sh "$SITE" | cut -f1))"
fi
if ok deepgemm.tgz && [ -f "$SITE/.installed" ] && [ ! -f "$SITE/.deepgemm" ]; then tar xzf "$STASH/deepgemm.tgz" -C "$SITE" && touch "$SITE/.deepgemm"; fi
# FA3 (fa3.so.xz: sglang-kernel's flash_ops, sm90 cubins only; carried in parts over warm calls): into the site,
# checked against torch's attention before a server may use it ($OUT/fa3_check.json; a failed check removes it)
if ok fa3.so.xz && [ -f "$SITE/.installed" ] && [ ! -f "$SITE/.fa3" ]; then
  xz -dc "$STASH/fa3.so.xz" > "$SITE/sgl_kernel/flash_ops.abi3.so" \
    && PYTHONPATH=$SITE timeout 120 python3 "$HERE/fa3_check.py" "$OUT/fa3_check.json" \
    && touch "$SITE/.fa3" && echo "installed FA3 flash_ops into $SITE" \
    || { rm -f "$SITE/sgl_kernel/flash_ops.abi3.so"; echo "FA3: not installed (see $OUT/fa3_check.json)"; }
fi
if ok jitcache.tgz && [ ! -f "$STASH/.jit_restored" ]; then tar xzf "$STASH/jitcache.tgz" -C / 2>/dev/null && touch "$STASH/.jit_restored" && echo "restored JIT cache"; fi
# flashinfer's JIT cache for sm90 (staged with `stage … flashinfer-jit-cache-sm90.tgz`): without it each flashinfer
# server compiles for ~3.5 min
if ok flashinfer-jit-cache-sm90.tgz && [ ! -f "$STASH/.fi_restored" ]; then
  tar xzf "$STASH/flashinfer-jit-cache-sm90.tgz" -C / 2>/dev/null && touch "$STASH/.fi_restored" && echo "restored flashinfer JIT cache"
fi
# the same cache recompressed (plugin_smoke.sh pack: bundle/smoke/jitcache.txz, 1.3 MB instead of 3.8): carried
# instead of jitcache.tgz when the site call's 64 MiB are short; checked against bundle/smoke/SHA256SUMS
if [ ! -f "$STASH/.jit_restored" ] && [ -f "$B/smoke/jitcache.txz" ] && [ -f "$B/smoke/SHA256SUMS" ] \
   && (cd "$B/smoke" && grep ' jitcache.txz$' SHA256SUMS | sha256sum -c --quiet -); then
  xz -dc "$B/smoke/jitcache.txz" | tar xf - -C / 2>/dev/null && touch "$STASH/.jit_restored" && echo "restored JIT cache (smoke/jitcache.txz)"
fi
if ok aux.tgz && [ ! -d "$STASH/aux" ]; then tar xzf "$STASH/aux.tgz" -C "$STASH"; fi
if ok gguf && [ ! -f "$STASH/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then ln -f "$STASH/gguf" "$STASH/SmolLM2-135M-Instruct.Q4_1.gguf"; fi
echo "stash: $(ls "$STASH" | tr '\n' ' ')"
[ -f "$SITE/.installed" ] || { echo "SITE: not installed yet (site.txz incomplete)"; exit 3; }
[ -f "$SITE/.checked" ] && { echo "SITE: already checked"; exit 0; }
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
timeout 240 python3 - "$OUT/bundle_check.json" <<'EOF'
import json, sys, time, traceback
res = {"ok": False}
t = time.time()
try:
    import torch, transformers, sgl_kernel, flashinfer
    import sglang, sglang.srt.entrypoints.http_server  # noqa: F401
    import sglang.srt.models.llama_eagle3, sglang.srt.speculative.eagle_worker_v2  # noqa: F401
    import sglang.srt.layers.attention.triton_backend  # noqa: F401
    res.update(imports_s=round(time.time() - t, 1), sglang=sglang.__version__, sgl_kernel=sgl_kernel.__version__,
               flashinfer=flashinfer.__version__, transformers=transformers.__version__, torch=torch.__version__,
               torch_cuda=torch.version.cuda, gpu=torch.cuda.get_device_name())
    x = torch.randn(64, 576, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(576, device="cuda", dtype=torch.bfloat16) + 0.5
    y = sgl_kernel.rmsnorm(x, w, 1e-5)
    xf = x.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)) * w.float()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    res.update(kernel="sgl_kernel.rmsnorm", kernel_rel_err=rel, ok=bool(rel < 1e-2))
except Exception:
    res["error"] = traceback.format_exc()[-3000:]
json.dump(res, open(sys.argv[1], "w"), indent=1)
print("BUNDLE_CHECK", json.dumps({k: v for k, v in res.items() if k != "error"}), res.get("error", ""))
sys.exit(0 if res["ok"] else 1)
EOF
rc=$?; [ $rc -eq 0 ] && touch "$SITE/.checked"
echo "install_bundle: rc=$rc in $(( $(date +%s) - T0 ))s"; exit $rc
