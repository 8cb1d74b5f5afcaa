#!/usr/bin/env bash
# tests/gpu/run.sh - run every spec on a GPU machine from the bundle
# (gpu-bundle/run.sh, made by tests/gpu/bundle.sh). Needs a CUDA driver and
# libcublas.so.13 (the CUDA install or PyTorch's nvidia-cublas wheel); no
# Lua, busted or OpenBLAS: the bundle carries them.
#
# Writes per-spec TAP output, the device description and summary.txt into
# $OUT when set, else ./results. gpu_spec runs first. About 4 minutes at
# most: each spec has a timeout and the remaining specs are skipped once
# the overall budget (RUN_BUDGET_S, default 210 s) is spent.
# Exit status: 0 when every spec passed and CUDA was available.
set -u
cd "$(dirname "$0")"
B=$PWD
RES=${OUT:-$B/results}
mkdir -p "$RES"
BUDGET=${RUN_BUDGET_S:-210}
SPEC_TIMEOUT=${SPEC_TIMEOUT_S:-120}
t_start=$(date +%s)

# cuBLAS: the CUDA install first, then a pip wheel (PyTorch), then ldconfig
cublas_dir=""
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -e "$d/libcublas.so.13" ] && { cublas_dir=$d; break; }
done
if [ -z "$cublas_dir" ] && command -v python3 >/dev/null; then
    for p in $(python3 -c 'import site,sys; print(" ".join(site.getsitepackages()+[site.getusersitepackages()]))' 2>/dev/null); do
        for d in "$p"/nvidia/cublas/lib "$p"/nvidia/cu13/lib; do
            [ -e "$d/libcublas.so.13" ] && { cublas_dir=$d; break 2; }
        done
    done
fi
if [ -z "$cublas_dir" ]; then
    f=$(ldconfig -p 2>/dev/null | awk '/libcublas\.so\.13 /{print $NF; exit}')
    [ -n "$f" ] && cublas_dir=$(dirname "$f")
fi

export LD_LIBRARY_PATH="$B/lib${cublas_dir:+:$cublas_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export MOELUA_LUA_DIR="$B/lua"
export LUA_PATH="$B/share/lua/5.4/?.lua;$B/share/lua/5.4/?/init.lua"
export LUA_CPATH="$B/lib/lua/5.4/?.so"
unset LUA_PATH_5_4 LUA_CPATH_5_4

{
    echo "date: $(date -u +%FT%TZ)"
    echo "host: $(uname -n) $(uname -r)"
    echo "cublas: ${cublas_dir:-NOT FOUND (GPU matmul specs will fail)}"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    ./moelua -e 'local m = require "moelua"; print("moelua cuda_available: " .. tostring(m.cuda_available()))'
} >"$RES/device.txt" 2>&1
cat "$RES/device.txt"

specs=(tests/spec/gpu_spec.lua)
for s in tests/spec/*_spec.lua; do
    [ "$s" = tests/spec/gpu_spec.lua ] || specs+=("$s")
done

passed=0 failed=0 skipped_specs=0
: >"$RES/summary.txt"
for s in "${specs[@]}"; do
    [ -f "$s" ] || continue
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
