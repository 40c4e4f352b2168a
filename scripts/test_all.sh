#!/usr/bin/env bash
# `make test`: every test, then the plugin's sglang tests against each supported release.
# The suite mostly waits (subprocess daemons, sockets, refit intervals: about 80 s of CPU in 160 s
# on 2 cores), so it runs on 4 xdist workers, and beside it: the sglang CPU environments are built
# (they install specctl editable too, but no test builds in the source tree: test_packaging copies
# it), then the tests that read those environments' sglang sources and the per-release passes run.
# Each pass runs the tests marked `sglang` (the rest of tests/plugin does not touch sglang and runs
# in the suite). Their output follows the suite's.
# Usage: PY=.venv/bin/python TEST_JOBS=4 SGLANG_VERSIONS="0.5.17 0.5.23" scripts/test_all.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
JOBS=${TEST_JOBS:-4}
read -ra VERSIONS <<< "${SGLANG_VERSIONS:-0.5.17 0.5.23}"
mkdir -p .cache
L=.cache/test-logs
rm -rf "$L" && mkdir -p "$L"

sglang_side() {
    bash scripts/setup_sglang_cpu.sh "${VERSIONS[@]}" > "$L/setup.log" 2>&1 || return 1
    local pids=() rc=0
    "$PY" -m pytest -q -m sglang_sources > "$L/sources.log" 2>&1 & pids+=($!)
    for v in "${VERSIONS[@]}"; do
        ".cache/sglang-$v/bin/python" -m pytest -q -m sglang tests/plugin tests/policies/test_baselines.py tests/gpu/test_tensor_dump.py \
            > "$L/plugin-$v.log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=2; done
    return "$rc"
}

sglang_side &
side=$!
"$PY" -m pytest -q -n "$JOBS" -m "not sglang_sources"
suite=$?
wait "$side"
side_rc=$?
echo "== sglang CPU environments (scripts/setup_sglang_cpu.sh, beside the suite)"
cat "$L/setup.log"
[ "$side_rc" -eq 1 ] && { echo "scripts/setup_sglang_cpu.sh failed"; exit 1; }
echo "== tests that read the sglang sources of those environments"
cat "$L/sources.log"
for v in "${VERSIONS[@]}"; do
    echo "== plugin tests on sglang $v"
    cat "$L/plugin-$v.log"
done
[ "$suite" -eq 0 ] || exit "$suite"
exit "$side_rc"
