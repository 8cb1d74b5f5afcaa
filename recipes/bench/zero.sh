#!/usr/bin/env bash
# recipes/bench/zero.sh: ZeRO stages 0-3 at N = 1, 2, 4 ranks (mpiexec, one
# OpenMP and one OpenBLAS thread per rank) on a longctx model: every rank's
# ledger peak by category, tokens/s, and the seconds rank 0 spent in each
# kind of collective, from the last step of each run's metrics.jsonl.
#   recipes/bench/zero.sh [out_dir=runs/bench/zero] [steps=4] [model options...]
# Default model: D=256, 4 layers, 8 heads / 4 kv, E=8 top-2, F=512,
# seq_len 1024 (13.5 M parameters: 51.5 MiB in f32), checkpoint moe. Two cores cannot
# show a speed-up at N = 2 or 4 (the ranks share them): read it for memory.
# About 3 min on 2 cores. out_dir must not exist (earlier results stay).
set -uo pipefail
. "$(dirname "$0")/args.sh"
bench_help "$@"
cd "$(dirname "$0")/../.."
out=${1:-runs/bench/zero}
steps=${2:-4}
bench_fresh out_dir "$out"
bench_count steps "$steps"
shift $(($# < 2 ? $# : 2))
model=("$@")
[ ${#model[@]} -eq 0 ] && model=(--dim 256 --layers 4 --heads 8 --kv-heads 4 --experts 8 --ffn 512 --seq-len 1024)
mkdir -p "$out"
for n in 1 2 4; do
    for stage in 0 1 2 3; do
        dir="$out/n${n}_zero${stage}"
        OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 900 mpiexec -n "$n" ./moelua recipes/longctx.lua \
            "${model[@]}" --zero "$stage" --steps "$steps" --threads 1 --ckpt-every 0 --warmup 1 \
            --run-dir "$dir" --overwrite > "$dir.log" 2>&1 \
            || echo "N=$n zero $stage: no result (see $dir.log)" >&2
    done
done
./moelua recipes/bench/zero_summary.lua "$out"
