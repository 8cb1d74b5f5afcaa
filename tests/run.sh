#!/usr/bin/env bash
# tests/run.sh - every suite of moelua: C unit tests (tests/c, TAP) and
# busted specs run inside the host (tests/spec). Prints the time per suite
# and ends with one line "N passed, N failed, N skipped" (CI reads it); exits non-zero
# when anything failed or a suite crashed.
#   MOELUA      the host binary (default ./moelua)
#   TEST_BUILD  where the C test binaries are (default build/cpu)
#   SUITES      a pattern to run a subset (default: all)
#   EMU_GPU     1: the GPU specs once more, as emu/*, on the emulated CUDA
#               build (tests/tools/cuda_emu/moelua.sh), so the CUDA code runs
#               without a GPU; make test sets it when build/cuda/moelua
#               exists (`make CUDA=1`, as CI builds first)
set -u
cd "$(dirname "$0")/.."
MOELUA=${MOELUA:-./moelua}
TEST_BUILD=${TEST_BUILD:-build/cpu}
SUITES=${SUITES:-}
passed=0 failed=0 skipped=0 crashed=0 suites=0
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT

run_suite() {  # name, command...
    local name=$1; shift
    [ -n "$SUITES" ] && [[ "$name" != *$SUITES* ]] && return
    suites=$((suites + 1))
    local out="$log/$(echo "$name" | tr '/' '_').out" t0 t1 ok bad skip rc
    t0=$(date +%s.%N)
    "$@" >"$out" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    skip=$(grep -cE '^ok [0-9]+ .*# SKIP' "$out")
    ok=$(( $(grep -cE '^ok [0-9]+' "$out") - skip ))
    bad=$(grep -cE '^not ok [0-9]+' "$out")
    if [ "$rc" -ne 0 ] && [ "$bad" -eq 0 ]; then
        bad=1   # a crash or a load error counts as a failure
        crashed=$((crashed + 1))
    elif [ "$ok" -eq 0 ] && [ "$bad" -eq 0 ] && [ "$skip" -eq 0 ]; then
        bad=1   # a suite that ran no test is a broken suite, not a pass
        echo "not ok - $name ran no test" >> "$out"
    fi
    passed=$((passed + ok)); failed=$((failed + bad)); skipped=$((skipped + skip))
    printf '%-34s %4d passed %4d failed %4d skipped %7.2fs\n' "$name" "$ok" "$bad" "$skip" "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')"
    if [ "$bad" -ne 0 ]; then
        grep -E -A12 '^not ok' "$out" | head -60
        [ "$rc" -ne 0 ] && tail -20 "$out"
    fi
}

if ! ls "$TEST_BUILD"/tests/test_* >/dev/null 2>&1; then
    echo "note: no C tests in $TEST_BUILD/tests (make test, or make build/tests, builds them)" >&2
fi
for t in "$TEST_BUILD"/tests/test_*; do
    [ -x "$t" ] || continue
    run_suite "c/$(basename "$t")" "$t"
done
# The collectives again on 4 ranks, one OpenMP and one OpenBLAS thread each
# (only rank 0 prints TAP; the other ranks' failures reach it). MPICH's own
# MPI_Init leaks 1 KiB from a library it unloads (no frame to suppress):
# under ASan leak checks are off for MPI runs only; the plain run keeps them.
if [ -x "$TEST_BUILD/tests/test_comm" ]; then
    run_suite "c/test_comm (mpiexec -n 4)" env OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
        ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" \
        mpiexec -n 4 "$TEST_BUILD/tests/test_comm"
fi
for spec in tests/spec/*_spec.lua; do
    run_suite "spec/$(basename "$spec" .lua)" "$MOELUA" /usr/bin/busted --output=TAP "$spec"
done
if [ "${EMU_GPU:-}" = 1 ] && { [ -z "$SUITES" ] || [[ emu/gpu_ == *$SUITES* ]] || [[ $SUITES == emu/* ]]; }; then
    if tests/tools/cuda_emu/moelua.sh >"$log/emu_build.out" 2>&1; then
        for spec in tests/spec/gpu_spec.lua tests/spec/gpu_*_spec.lua; do
            run_suite "emu/$(basename "$spec" .lua)" build/cuda_emu/moelua /usr/bin/busted --output=TAP "$spec"
        done
    else
        run_suite "emu/build" sh -c "tail -20 '$log/emu_build.out'; exit 1"
    fi
fi
if [ "$suites" -eq 0 ]; then   # nothing ran: no pass to report
    echo "no suite matches SUITES='$SUITES' (names: c/test_*, spec/*_spec, emu/gpu_*)" >&2
    failed=$((failed + 1))
fi
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
