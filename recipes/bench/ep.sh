#!/usr/bin/env bash
# recipes/bench/ep.sh: expert parallelism at N = 4 ranks (mpiexec, one
# OpenMP and one OpenBLAS thread per rank), ep = 1, 2, 4 at ZeRO stages 0
# and 3, on a longctx model: every rank's ledger peak by category, tokens/s,
# the seconds each rank waited in all-to-all and the bytes it sent in them
# against the analytic count (recipes/bench/ep_summary.lua), from the last
# step of each run's metrics.jsonl.
#   recipes/bench/ep.sh [out_dir=runs/bench/ep] [steps=4] [model options...]
# Default model: the one of recipes/bench/zero.sh (D=256, 4 layers, 8 heads /
# 4 kv, E=8 top-2, F=512, seq_len 1024, checkpoint moe). Two cores cannot
# show a speed-up at N = 4 (four ranks share them): read it for memory and
# bytes. About 3-6 min on 2 cores. out_dir must not exist (earlier results
# stay).
set -uo pipefail
. "$(dirname "$0")/args.sh"
bench_help "$@"
cd "$(dirname "$0")/../.."
out=${1:-runs/bench/ep}
steps=${2:-4}
bench_fresh out_dir "$out"
bench_count steps "$steps"
shift $(($# < 2 ? $# : 2))
model=("$@")
[ ${#model[@]} -eq 0 ] && model=(--dim 256 --layers 4 --heads 8 --kv-heads 4 --experts 8 --ffn 512 --seq-len 1024)
mkdir -p "$out"
for ep in 1 2 4; do
    for stage in 0 3; do
        dir="$out/n4_ep${ep}_zero${stage}"
        OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 900 mpiexec -n 4 ./moelua recipes/longctx.lua \
            "${model[@]}" --ep "$ep" --zero "$stage" --steps "$steps" --threads 1 --ckpt-every 0 --warmup 1 \
            --run-dir "$dir" --overwrite > "$dir.log" 2>&1 \
            || echo "N=4 ep $ep zero $stage: no result (see $dir.log)" >&2
    done
done
./moelua recipes/bench/ep_summary.lua "$out"
