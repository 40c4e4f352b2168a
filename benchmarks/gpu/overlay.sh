# Sourced (bash) by plugin_smoke.sh and tp2_check.sh, THERE, from the repository root: the SGLang 0.5.17 overlay
# and specctl as a PYTHONPATH folder, without network.
#
#   G=benchmarks/gpu; . $G/overlay.sh
#   overlay_install LOGFILE    sha256 of bundle/site.txz.part00 + bundle/smoke/*.txz (MANIFEST.json, SHA256SUMS)
#                              -> $SITE (once: $SITE/.installed), deep_gemm into it, JIT cache restored to /
#   specctl_site LOGFILE       $SP/specctl -> this checkout + the sglang.srt.plugins entry point;
#                              exports PYTHONPATH=$SITE:$SP and checks that specctl.plugin imports
# Both return non-zero on failure. carry: benchmarks/gpu/bundle/{site.txz.part00,MANIFEST.json,smoke}.
G=${G:-benchmarks/gpu}; B=${B:-$G/bundle}; SITE=${SITE:-/tmp/site}; SP=${SP:-/tmp/specctl_site}

overlay_install() {
  local logf=$1
  if [ -f "$SITE/.installed" ]; then echo "overlay already at $SITE" >> "$logf"; return 0; fi
  python3 - "$B" >> "$logf" 2>&1 <<'EOF'
import hashlib, json, os, sys
b = sys.argv[1]; m = json.load(open(os.path.join(b, "MANIFEST.json")))
want = {p["name"]: p["sha256"] for p in m["artifacts"]["site.txz"]["parts"]}
for ln in open(os.path.join(b, "smoke", "SHA256SUMS")):
    h, name = ln.split(); want["smoke/" + name] = h
bad = []
for name, sha in want.items():
    h = hashlib.sha256()
    with open(os.path.join(b, name), "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""): h.update(chunk)
    ok = h.hexdigest() == sha; bad += [] if ok else [name]
    print("sha256", name, "ok" if ok else "MISMATCH")
sys.exit(1 if bad else 0)
EOF
  [ $? -eq 0 ] || { echo "bundle sha256 mismatch (or missing bundle files: carry them)" | tee -a "$logf"; return 3; }
  rm -rf "$SITE.tmp" && mkdir -p "$SITE.tmp" && tar xJf "$B/site.txz.part00" -C "$SITE.tmp" && rm -rf "$SITE" \
    && mv "$SITE.tmp/site" "$SITE" && tar xJf "$B/smoke/deepgemm.txz" -C "$SITE" && touch "$SITE/.installed" \
    || { echo "overlay install FAILED" | tee -a "$logf"; return 3; }
  tar xJf "$B/smoke/jitcache.txz" -C / 2>/dev/null && echo "restored JIT cache" | tee -a "$logf"
  return 0
}

specctl_site() {
  local logf=$1
  python3 "$G/plugin_smoke.py" site . "$SP" >/dev/null || { echo "specctl site FAILED" | tee -a "$logf"; return 3; }
  export PYTHONPATH=$SITE:$SP
  echo "overlay ready ($(du -sh "$SITE" | cut -f1)); $(python3 -c 'import importlib.metadata as m; print([e.value for e in m.entry_points(group="sglang.srt.plugins")])' 2>&1)" | tee -a "$logf"
  python3 -c 'import specctl.plugin, specctl.plugin.sglang_hooks, specctl.plugin.patches.plain_decode, zmq, pydantic, sys; print("specctl.plugin imports OK; sklearn loaded:", "sklearn" in sys.modules)' 2>&1 | tee -a "$logf"
  python3 -c 'import specctl.plugin, zmq, pydantic' 2>/dev/null || { echo "specctl.plugin does not import" | tee -a "$logf"; return 3; }
}
