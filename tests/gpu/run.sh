#!/usr/bin/env bash
# tests/gpu/run.sh - run every spec (or those named: paths relative to the
# bundle) on a GPU machine from the bundle (gpu-bundle/run.sh, made by
# tests/gpu/bundle.sh). Needs a CUDA driver,
# libcublas.so.13 and libnccl.so.2 (the CUDA install or PyTorch's
# nvidia-cublas / nvidia-nccl wheels: env.sh finds them); no Lua, busted,
# OpenBLAS or MPICH: the bundle carries the first three, and without
# mpiexec the MPI specs pend (gpu_nccl_spec is NCCL's 1-rank smoke test).
#
# Writes per-spec TAP output, the device description and summary.txt into
# $OUT when set, else ./results, in the order below. About 4 minutes at most: each spec has
# a timeout and the remaining specs are skipped once the overall budget
# (RUN_BUDGET_S, default 210 s) is spent.
# Exit status: 0 when every spec passed and CUDA was available.
set -u
cd "$(dirname "$0")"
. ./env.sh
RES=${OUT:-$B/results}
mkdir -p "$RES"
BUDGET=${RUN_BUDGET_S:-210}
SPEC_TIMEOUT=${SPEC_TIMEOUT_S:-120}
t_start=$(date +%s)

describe_device >"$RES/device.txt" 2>&1
cat "$RES/device.txt"

# The specs named as arguments (./run.sh tests/spec/gpu_*.lua), else all:
# gpu_spec first, then the other gpu_*_spec files, then the specs that
# take another path where CUDA is available (they mention it), then the
# rest (the budget may cut the tail, and the GPU is what this machine is for)
if [ $# -gt 0 ]; then
    specs=("$@")
else
    specs=(tests/spec/gpu_spec.lua)
    for s in tests/spec/gpu_*_spec.lua; do
        [ "$s" = tests/spec/gpu_spec.lua ] || specs+=("$s")
    done
    for s in tests/spec/*_spec.lua; do
        case $s in tests/spec/gpu_*) ;; *) grep -q cuda "$s" && specs+=("$s") ;; esac
    done
    for s in tests/spec/*_spec.lua; do
        case $s in tests/spec/gpu_*) ;; *) grep -q cuda "$s" || specs+=("$s") ;; esac
    done
fi

passed=0 failed=0 skipped_specs=0
: >"$RES/summary.txt"
for s in "${specs[@]}"; do
    if [ ! -f "$s" ]; then
        echo "$s: no such spec" | tee -a "$RES/summary.txt"; failed=$((failed + 1)); continue
    fi
    name=$(basename "$s" .lua)
    left=$((BUDGET - ($(date +%s) - t_start)))
    if [ "$left" -le 5 ]; then
        echo "$name: not run (time budget spent)" | tee -a "$RES/summary.txt"
        skipped_specs=$((skipped_specs + 1))
        continue
    fi
    lim=$((left < SPEC_TIMEOUT ? left : SPEC_TIMEOUT))
    t0=$(date +%s.%N)
    timeout -k 5 "$lim" ./moelua ./busted --output=TAP "$s" >"$RES/$name.tap" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    ok=$(grep -cE '^ok [0-9]+' "$RES/$name.tap")
    bad=$(grep -cE '^not ok [0-9]+' "$RES/$name.tap")
    note=""
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        note=" (timed out after ${lim}s)"; bad=$((bad + 1))
    elif [ "$rc" -ne 0 ] && [ "$bad" -eq 0 ]; then
        note=" (exit $rc: crash or load error)"; bad=1
    fi
    passed=$((passed + ok)); failed=$((failed + bad))
    printf '%-28s %4d passed %4d failed %7.2fs%s\n' "$name" "$ok" "$bad" \
        "$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')" "$note" | tee -a "$RES/summary.txt"
    if [ "$bad" -ne 0 ]; then
        grep -E -A12 '^not ok' "$RES/$name.tap" | head -80
        tail -20 "$RES/$name.tap"
    fi
done
echo "$passed passed, $failed failed, $skipped_specs specs not run" | tee -a "$RES/summary.txt"
grep -q "cuda_available: true" "$RES/device.txt" || { echo "CUDA was not available: GPU specs did not run"; exit 2; }
[ "$failed" -eq 0 ] && [ "$skipped_specs" -eq 0 ]
