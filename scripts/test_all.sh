#!/usr/bin/env bash
# `make test`: every test, then the plugin's sglang tests against each supported release.
# The suite mostly waits (subprocess daemons, sockets, refit intervals: about 80 s of CPU in 160 s
# on 2 cores), so it runs on 4 xdist workers while the sglang CPU environments are built beside it
# (they install specctl editable too, but no test builds in the source tree: test_packaging copies it);
# the tests that read those environments' sglang sources run once they are there, and the
# per-release passes side by side. Each pass runs the tests marked `sglang` (the rest of
# tests/plugin does not touch sglang and ran in the suite).
# Usage: PY=.venv/bin/python TEST_JOBS=4 SGLANG_VERSIONS="0.5.17 0.5.23" scripts/test_all.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
JOBS=${TEST_JOBS:-4}
read -ra VERSIONS <<< "${SGLANG_VERSIONS:-0.5.17 0.5.23}"
mkdir -p .cache
log=.cache/setup-sglang.log
bash scripts/setup_sglang_cpu.sh "${VERSIONS[@]}" > "$log" 2>&1 &
setup=$!
"$PY" -m pytest -q -n "$JOBS" -m "not sglang_sources"
suite=$?
echo "== sglang CPU environments (built beside the suite)"
wait "$setup"
built=$?
cat "$log"
[ "$built" -eq 0 ] || { echo "scripts/setup_sglang_cpu.sh failed (rc $built)"; exit "$built"; }
[ "$suite" -eq 0 ] || exit "$suite"
echo "== tests that read the sglang sources of those environments"
"$PY" -m pytest -q -m sglang_sources || exit $?
pids=()
for v in "${VERSIONS[@]}"; do
    ".cache/sglang-$v/bin/python" -m pytest -q -m sglang tests/plugin tests/policies/test_baselines.py \
        > ".cache/plugin-tests-$v.log" 2>&1 &
    pids+=($!)
done
rc=0
for i in "${!VERSIONS[@]}"; do
    wait "${pids[$i]}" || rc=1
    echo "== plugin tests on sglang ${VERSIONS[$i]}"
    cat ".cache/plugin-tests-${VERSIONS[$i]}.log"
done
exit "$rc"
