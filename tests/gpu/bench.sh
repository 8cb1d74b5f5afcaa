#!/usr/bin/env bash
# tests/gpu/bench.sh - the GPU benchmarks, one command on a GPU machine from
# the bundle (gpu-bundle/bench.sh, copied there by tests/gpu/bundle.sh).
# Needs what run.sh needs, plus python3 with PyTorch (CUDA) and
# transformers for the baselines; no network.
#
#   1 peak         torch.matmul 8192^3, bf16 and f32: the measured peaks
#   2 moe T        one MoE layer at Mixtral width (D 4096, F 14336, E 8,
#                  k 2), forward + backward, T = 16384 then 32768: moelua
#                  bf16 and f32 (recipes/bench/moe_layer.lua --device cuda
#                  --dtype) and PyTorch eager Hugging Face
#                  MixtralSparseMoeBlock in bf16 and f32
#                  (recipes/bench/moe_layer_torch_gpu.py)
#   3 train        one training step of the longctx model at seq 32768 on
#                  cuda (recipes/bench/train.lua --device cuda), bf16 then
#                  f32, then the benchmarks' model (D 256, L 4, E 8, F 512)
#   4 extras       while budget is left: moelua's layer at T 32768 with
#                  4096-row expert tiles; torch's grouped_mm experts (bf16)
#   5 summary      summary.txt: moelua against torch eager in each dtype, each
#                  run's share of the measured peak, tokens/s and MFU
#                  (tests/gpu/bench_summary.py)
#
# Writes into $OUT when set, else ./results: device.txt, commands.txt (each
# step's command, exit status, seconds), peak.jsonl, moe.jsonl (moelua and
# torch lines), train.jsonl, <step>.log (each step's stderr and stray
# output) and summary.txt. Every step has a timeout, a failing step does
# not stop the others, and steps are skipped once the budget
# (BENCH_BUDGET_S, default 300 s) is spent. PYTHON picks the interpreter
# (default python3). Exit status: 0 when every step ran and succeeded.
set -u
cd "$(dirname "$0")"
. ./env.sh
RES=${OUT:-$B/results}
mkdir -p "$RES"
BUDGET=${BENCH_BUDGET_S:-300}
PY=${PYTHON:-python3}
t_start=$(date +%s)

describe_device >"$RES/device.txt" 2>&1
{ "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available())' 2>&1 | tail -1
  "$PY" -c 'import transformers; print("transformers", transformers.__version__)' 2>&1 | tail -1
} >>"$RES/device.txt"
cat "$RES/device.txt"
grep -q "cuda_available: true" "$RES/device.txt" \
    || echo "bench.sh: moelua reports CUDA unavailable: the moelua steps will fail (see device.txt)"

: >"$RES/commands.txt"
failed=0 skipped=0
# step NAME LIMIT_S OUTFILE CMD...: run CMD with the smaller of LIMIT_S and
# the budget left, stdout appended to OUTFILE, stderr to NAME.log
step() {
    local name=$1 lim=$2 out=$3; shift 3
    local left=$((BUDGET - ($(date +%s) - t_start)))
    if [ "$left" -le 10 ]; then
        echo "== $name: not run (time budget spent)" | tee -a "$RES/commands.txt"
        skipped=$((skipped + 1))
        return
    fi
    [ "$left" -lt "$lim" ] && lim=$left
    echo "== $name (timeout ${lim}s): $*" | tee -a "$RES/commands.txt"
    local t0=$SECONDS
    timeout -k 5 "$lim" "$@" >>"$RES/$out" 2>"$RES/$name.log"
    local rc=$?
    local note=""
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then note=" (timed out)"; fi
    echo "   $name: exit $rc$note, $((SECONDS - t0)) s" | tee -a "$RES/commands.txt"
    if [ "$rc" -ne 0 ]; then
        failed=$((failed + 1))
        tail -5 "$RES/$name.log" | sed 's/^/   | /'
    fi
}

MOE=(--dim 4096 --ffn 14336 --experts 8 --topk 2)
# the corpus: the bundle's Lua sources (the machine may lack /usr/include)
TRAIN=(--seq-len 32768 --warmup 1 --data 'lua/**/*.lua' --device cuda)
BENCHMODEL=(--dim 256 --layers 4 --heads 4 --kv-heads 2 --experts 8 --topk 2 --ffn 512)
: >"$RES/peak.jsonl"; : >"$RES/moe.jsonl"; : >"$RES/train.jsonl"

step peak 60 peak.jsonl "$PY" recipes/bench/moe_layer_torch_gpu.py --what peak --dtype bf16,f32 --reps 10 --warmup 3
for T in 16384 32768; do
    step "moe_moelua_bf16_$T" 60 moe.jsonl ./moelua recipes/bench/moe_layer.lua --device cuda --dtype bf16 \
        --tokens "$T" "${MOE[@]}" --reps 3
    step "moe_torch_$T" 60 moe.jsonl "$PY" recipes/bench/moe_layer_torch_gpu.py --what moe --tokens "$T" "${MOE[@]}" \
        --dtype bf16,f32 --reps 3 --warmup 2
    step "moe_moelua_f32_$T" 100 moe.jsonl ./moelua recipes/bench/moe_layer.lua --device cuda --tokens "$T" "${MOE[@]}" \
        --reps 3
done
step train_longctx_bf16 60 train.jsonl ./moelua recipes/bench/train.lua "${TRAIN[@]}" --dtype bf16 --steps 2
step train_longctx 60 train.jsonl ./moelua recipes/bench/train.lua "${TRAIN[@]}" --steps 2
step train_benchmodel 90 train.jsonl ./moelua recipes/bench/train.lua "${TRAIN[@]}" --steps 1 "${BENCHMODEL[@]}"
step moe_moelua_32768_tile4096 60 moe.jsonl ./moelua recipes/bench/moe_layer.lua --device cuda --tokens 32768 "${MOE[@]}" \
    --tile 4096 --reps 3
step moe_torch_32768_grouped_mm 45 moe.jsonl "$PY" recipes/bench/moe_layer_torch_gpu.py --what moe --tokens 32768 "${MOE[@]}" \
    --dtype bf16 --experts-impl grouped_mm --reps 3 --warmup 2

echo "== summary"
"$PY" tests/gpu/bench_summary.py "$RES" >"$RES/summary.txt" 2>&1 || failed=$((failed + 1))
cat "$RES/summary.txt"
echo "bench.sh: $failed steps failed, $skipped not run, $(($(date +%s) - t_start)) s; results in $RES"
[ "$failed" -eq 0 ] && [ "$skipped" -eq 0 ]
