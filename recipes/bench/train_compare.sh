#!/usr/bin/env bash
# recipes/bench/train_compare.sh: moelua's training step (train.lua) against
# the PyTorch eager baseline (train_torch.py), interleaved: every round runs
# both implementations once per seq_len, so machine noise hits both alike;
# then medians and ratios (train_summary.py).
#   recipes/bench/train_compare.sh [rounds=3] [out=runs/bench/train.jsonl] [seq_lens="1024 4096 16384"]
# Model: V=256, D=256, L=4, 4 heads (2 kv heads), E=8, k=2, F=512, AdamW.
# Steps timed after one warm-up step: 3 at seq_len <= 4096, 1 at 16384
# (a 16384 step takes 40-100 s on 2 cores). Needs `make bench-deps`.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
out=${2:-runs/bench/train.jsonl}
seqs=${3:-"1024 4096 16384"}
mkdir -p "$(dirname "$out")"
: > "$out"
py=/usr/bin/python3
cfg="--dim 256 --layers 4 --heads 4 --kv-heads 2 --experts 8 --topk 2 --ffn 512"
for r in $(seq "$rounds"); do
    for S in $seqs; do
        steps=3; [ "$S" -gt 4096 ] && steps=1
        ./moelua recipes/bench/train.lua --seq-len "$S" $cfg --steps "$steps" >> "$out"
        $py recipes/bench/train_torch.py --seq-len "$S" $cfg --steps "$steps" >> "$out"
        echo "round $r seq_len $S done" >&2
    done
done
$py recipes/bench/train_summary.py "$out"
