#!/usr/bin/env bash
# recipes/bench/train_compare.sh: moelua's training step (train.lua) against
# the PyTorch eager baseline (train_torch.py) in each of its candidate thread
# configurations, interleaved: every round runs moelua and then every
# configuration once per seq_len (the configurations' order rotates from round
# to round), so machine noise hits all alike; then medians, and moelua against
# the best configuration per seq_len (train_summary.py).
#   recipes/bench/train_compare.sh [rounds=3] [out=runs/bench/train.jsonl] \
#       [seq_lens="1024 4096 16384"] [long_rounds=1] [configs="1 2 2:PASSIVE"]
# A configuration is <torch threads>[:<OMP_WAIT_POLICY>]; OpenBLAS keeps its
# own pool either way. Seq_lens above 4096 run only in the first long_rounds
# rounds (a 16384 step takes 20-45 s per process on 2 cores).
# Model: V=256, D=256, L=4, 4 heads (2 kv heads), E=8, k=2, F=512, AdamW.
# Steps timed after one warm-up step: 3 at seq_len <= 4096, 1 above.
# Needs `make bench-deps`. OPENBLAS_* variables are used as the environment
# sets them; the first line of $out (bench_env.py) records them. $out must
# not exist (earlier results stay).
set -euo pipefail
. "$(dirname "$0")/args.sh"
bench_help "$@"
cd "$(dirname "$0")/../.."
bench_at_most 5 "$@"
rounds=${1:-3}
out=${2:-runs/bench/train.jsonl}
seqs=${3:-"1024 4096 16384"}
long_rounds=${4:-1}
configs=(${5:-1 2 2:PASSIVE})
bench_count rounds "$rounds"
bench_fresh out "$out"
bench_counts seq_len "$seqs"
bench_count long_rounds "$long_rounds" 0
bench_configs "${configs[*]}"
mkdir -p "$(dirname "$out")"
py=/usr/bin/python3
$py recipes/bench/bench_env.py > "$out"
cfg="--dim 256 --layers 4 --heads 4 --kv-heads 2 --experts 8 --topk 2 --ffn 512"
n=${#configs[@]}
for r in $(seq "$rounds"); do
    for S in $seqs; do
        steps=3
        if [ "$S" -gt 4096 ]; then
            [ "$r" -gt "$long_rounds" ] && continue
            steps=1
        fi
        ./moelua recipes/bench/train.lua --seq-len "$S" $cfg --steps "$steps" >> "$out"
        for i in $(seq 0 $((n - 1))); do
            c=${configs[$(((i + r - 1) % n))]}
            threads=${c%%:*} policy=
            [ "$c" != "$threads" ] && policy=${c#*:}
            env -u OMP_WAIT_POLICY ${policy:+OMP_WAIT_POLICY=$policy} \
                $py recipes/bench/train_torch.py --seq-len "$S" $cfg --steps "$steps" --threads "$threads" >> "$out"
        done
        echo "round $r seq_len $S done" >&2
    done
done
$py recipes/bench/train_summary.py "$out"
