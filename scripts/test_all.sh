#!/usr/bin/env bash
# `make test`: every test, then the plugin's sglang tests against each supported release.
# The suite mostly waits (subprocess daemons, sockets, refit intervals: about 80 s of CPU in 160 s
# on 2 cores), so it runs on 4 xdist workers, and beside it: the sglang CPU environments are built
# (they install specctl editable too, but no test builds in the source tree: test_packaging copies
# it), then the tests that read those environments' sglang sources and the per-release passes run.
# Each pass runs the tests marked `sglang`; the suite leaves them out (in its interpreter they could
# only skip) and runs everything else. Their output follows the suite's; the last line adds up every
# pass: `N passed, M skipped` (and any failed / errors), and the exit status is non-zero if any part failed.
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
        ".cache/sglang-$v/bin/python" -m pytest -q -m sglang tests/plugin tests/policies/test_baselines.py tests/gpu/test_tensor_dump.py tests/gpu/test_build_moe.py tests/gpu/test_gc_log.py \
            > "$L/plugin-$v.log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=2; done
    return "$rc"
}

sglang_side &
side=$!
color=(); [ -t 1 ] && color=(--color=yes)  # the suite's output goes through tee
"$PY" -m pytest -q ${color[@]+"${color[@]}"} -n "$JOBS" -m "not sglang_sources and not sglang" 2>&1 | tee "$L/suite.log"
suite=${PIPESTATUS[0]}
wait "$side"
side_rc=$?
# pytest's last summary line of each pass ("12 passed, 3 skipped, 40 deselected in 9.1s"), added up;
# a pass that printed none (it did not run, or crashed) is named
total() {
    local f line n word passed=0 skipped=0 failed=0 errors=0 missing=()
    for f in "$@"; do
        line=$([ -f "$f" ] && sed 's/\x1b\[[0-9;]*m//g' "$f" \
            | grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)' | tail -n 1)
        [ -n "$line" ] || { missing+=("$(basename "$f" .log)"); continue; }
        while read -r n word; do
            case "$word" in
                passed) passed=$((passed + n)) ;;
                skipped) skipped=$((skipped + n)) ;;
                failed) failed=$((failed + n)) ;;
                error|errors) errors=$((errors + n)) ;;
            esac
        done < <(grep -oE '[0-9]+ [a-z]+' <<< "$line")
    done
    echo "== the whole run: the suite, the sglang-source tests, the plugin on sglang ${VERSIONS[*]}"
    [ ${#missing[@]} -eq 0 ] || echo "no pytest summary from: ${missing[*]}"
    local out="$passed passed, $skipped skipped"
    [ "$failed" -eq 0 ] || out="$out, $failed failed"
    [ "$errors" -eq 0 ] || out="$out, $errors error$([ "$errors" -eq 1 ] || echo s)"
    echo "$out"
}

echo "== sglang CPU environments (scripts/setup_sglang_cpu.sh, beside the suite)"
cat "$L/setup.log"
logs=("$L/suite.log")
if [ "$side_rc" -eq 1 ]; then
    echo "scripts/setup_sglang_cpu.sh failed: the sglang passes did not run"
else
    echo "== tests that read the sglang sources of those environments"
    cat "$L/sources.log"
    logs+=("$L/sources.log")
    for v in "${VERSIONS[@]}"; do
        echo "== plugin tests on sglang $v"
        cat "$L/plugin-$v.log"
        logs+=("$L/plugin-$v.log")
    done
fi
total "${logs[@]}"
[ "$suite" -eq 0 ] || exit "$suite"
exit "$side_rc"
