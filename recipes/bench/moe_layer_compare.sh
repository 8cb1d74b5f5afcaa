#!/usr/bin/env bash
# recipes/bench/moe_layer_compare.sh: moelua's MoE layer against the two
# PyTorch eager baselines, interleaved (each round runs every implementation
# once per config, so machine noise hits all of them alike), then medians.
#   recipes/bench/moe_layer_compare.sh [rounds=3] [out=runs/bench/moe_layer.jsonl]
# Needs `make bench-deps` (Debian's python3-torch) for the baselines.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
out=${2:-runs/bench/moe_layer.jsonl}
mkdir -p "$(dirname "$out")"
: > "$out"
py=/usr/bin/python3
for r in $(seq "$rounds"); do
    for T in 4096 16384 32768; do
        ./moelua recipes/bench/moe_layer.lua --tokens "$T" --reps 1 >> "$out"
        for impl in sorted hf; do
            $py recipes/bench/moe_layer_torch.py --impl "$impl" --tokens "$T" --reps 1 >> "$out"
        done
    done
    ./moelua recipes/bench/moe_layer.lua --tokens 16384 --dim 256 --ffn 512 --experts 64 --topk 8 --reps 1 >> "$out"
    $py recipes/bench/moe_layer_torch.py --impl sorted --tokens 16384 --dim 256 --ffn 512 --experts 64 --topk 8 --reps 1 >> "$out"
    for s in save 0.5 recompute; do
        ./moelua recipes/bench/moe_layer.lua --tokens 32768 --save "$s" --reps 1 >> "$out"
    done
done
./moelua recipes/bench/moe_layer.lua --router-memory 1 >> "$out"
$py recipes/bench/moe_layer_summary.py "$out"
