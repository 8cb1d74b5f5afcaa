#!/usr/bin/env bash
# recipes/bench/train_memory.sh: peak activation memory (ledger acts + pool)
# against seq_len, then the doubling ratios. Each run takes one warm-up step
# (the pools grow to their high-water mark and are consolidated into one
# block, the optimizer states appear), resets the ledger's peaks and measures
# one step: the steady state of a training run.
#   recipes/bench/train_memory.sh [out=runs/bench/train_memory.jsonl] [timeout_s=7200]
# Each line also holds the plan's prediction (train.lua plans the same code
# first). Series: the default longctx model (D=64, L=2, 4 heads / 2 kv, E=4,
# k=2, F=128, checkpoint moe, save recompute) and the same with one layer,
# both at 8192..131072. Attention is O(S^2) in time: a 131072 step takes
# about 3 min (default model) on 2 cores, the whole script about 25 min.
# Issue 4's criterion: doubling seq_len multiplies peak acts+pool by at most
# 2.05. $out must not exist (earlier results stay).
set -uo pipefail
. "$(dirname "$0")/args.sh"
bench_help "$@"
cd "$(dirname "$0")/../.."
bench_at_most 2 "$@"
out=${1:-runs/bench/train_memory.jsonl}
limit=${2:-7200}
bench_fresh out "$out"
bench_count timeout_s "$limit"
mkdir -p "$(dirname "$out")"
: > "$out"
for S in 8192 16384 32768 65536 131072; do
    timeout "$limit" ./moelua recipes/bench/train.lua --seq-len "$S" --steps 1 --warmup 1 >> "$out" \
        || echo "default model, seq_len $S: no result (timeout ${limit}s or error)" >&2
done
for S in 8192 16384 32768 65536 131072; do
    timeout "$limit" ./moelua recipes/bench/train.lua --seq-len "$S" --layers 1 --steps 1 --warmup 1 >> "$out" \
        || echo "1-layer model, seq_len $S: no result (timeout ${limit}s or error)" >&2
done
/usr/bin/python3 recipes/bench/train_memory_summary.py "$out"
