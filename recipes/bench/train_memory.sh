#!/usr/bin/env bash
# recipes/bench/train_memory.sh: peak activation memory (ledger acts + pool)
# against seq_len, one training step per run (train.lua --steps 1 --warmup 0:
# the peak covers that whole step), then the doubling ratios.
#   recipes/bench/train_memory.sh [out=runs/bench/train_memory.jsonl] [timeout_s=7200]
# Series: the default longctx model (D=64, L=2, 4 heads / 2 kv, E=4, k=2,
# F=128, checkpoint moe, save recompute) at 8192..65536, and the same with one
# layer at 8192..131072. Attention is O(S^2) in time: 65536 takes about 10 min
# and 131072 (one layer) about 25 min on 2 cores. Issue 4's criterion: doubling
# seq_len multiplies peak acts+pool by at most 2.05.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-runs/bench/train_memory.jsonl}
limit=${2:-7200}
mkdir -p "$(dirname "$out")"
: > "$out"
for S in 8192 16384 32768 65536; do
    timeout "$limit" ./moelua recipes/bench/train.lua --seq-len "$S" --steps 1 --warmup 0 >> "$out" \
        || echo "default model, seq_len $S: no result (timeout ${limit}s or error)" >&2
done
for S in 8192 16384 32768 65536 131072; do
    timeout "$limit" ./moelua recipes/bench/train.lua --seq-len "$S" --layers 1 --steps 1 --warmup 0 >> "$out" \
        || echo "1-layer model, seq_len $S: no result (timeout ${limit}s or error)" >&2
done
/usr/bin/python3 recipes/bench/train_memory_summary.py "$out"
