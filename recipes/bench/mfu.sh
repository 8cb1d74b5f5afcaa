#!/usr/bin/env bash
# recipes/bench/mfu.sh: the training step's model FLOP utilisation against
# the best GEMM measured in the same minutes (issue 15). Each round runs,
# per seq_len, matmul.lua (2048³, 2 threads: the best of raw OpenBLAS, raw
# oneDNN and moelua.matmul), train.lua, and matmul.lua again; the round's
# MFU is tokens/s times the model's FLOPs per token (train.lua's
# model_flop_per_token) over the higher of the two GEMM rates. The word
# `moe` in seq_lens runs issue 15's MoE layer instead (moe_layer.lua: T
# 32768, D 512, F 1408, E 8, k 2, forward + backward, 3 reps): its share of
# the GEMM floor, the expert GEMMs' 6·T·k·3·D·F FLOPs at that best rate.
# Prints each round and the medians (recipes/bench/mfu_summary.lua).
#   recipes/bench/mfu.sh [rounds=3] [seq_lens="4096 16384"]
#   recipes/bench/mfu.sh 5 moe
# Model: train_compare.sh's (V=256, D=256, L=4, 4 heads, 2 kv heads, E=8,
# k=2, F=512), 3 timed steps after one warm-up step.
set -euo pipefail
. "$(dirname "$0")/args.sh"
bench_help "$@"
cd "$(dirname "$0")/../.."
bench_at_most 2 "$@"
rounds=${1:-3}
seqs=${2:-"4096 16384"}
bench_count rounds "$rounds"
for S in $seqs; do [ "$S" = moe ] || bench_count "seq_len (or moe)" "$S"; done
cfg="--dim 256 --layers 4 --heads 4 --kv-heads 2 --experts 8 --topk 2 --ffn 512"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
grep -o 'flags[^:]*: .*' /proc/cpuinfo | head -1 | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512bw|fma)$' \
    | tr '\n' ' ' | sed 's/^/cpu flags: /; s/$/\n/' >&2 || true
gemm() { ./moelua recipes/bench/matmul.lua --sizes 2048 --reps 5 --threads 2 | tail -1; }
for r in $(seq "$rounds"); do
    for S in $seqs; do
        gemm >> "$out"
        if [ "$S" = moe ]; then
            ./moelua recipes/bench/moe_layer.lua --tokens 32768 --reps 3 | tail -1 >> "$out"
        else
            ./moelua recipes/bench/train.lua --seq-len "$S" $cfg --steps 3 | tail -1 >> "$out"
        fi
        gemm >> "$out"
        echo "round $r $S done" >&2
    done
done
./moelua recipes/bench/mfu_summary.lua "$out"
