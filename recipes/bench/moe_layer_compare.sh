#!/usr/bin/env bash
# recipes/bench/moe_layer_compare.sh: moelua's MoE layer against the two
# PyTorch eager baselines, each in every candidate thread configuration,
# interleaved (each round runs every implementation and configuration once
# per config, the configurations' order rotating from round to round, so
# machine noise hits all of them alike), then medians and moelua against the
# best baseline per shape (moe_layer_summary.py).
#   recipes/bench/moe_layer_compare.sh [rounds=3] [out=runs/bench/moe_layer.jsonl] \
#       [configs="1 2 2:PASSIVE"]
# A configuration is <torch threads>[:<OMP_WAIT_POLICY>]; OpenBLAS keeps its
# own pool either way. Needs `make bench-deps` (Debian's python3-torch).
# OPENBLAS_* variables are used as the environment sets them; the first line
# of $out (bench_env.py) records them. $out must not exist (earlier results
# stay).
set -euo pipefail
. "$(dirname "$0")/args.sh"
bench_help "$@"
cd "$(dirname "$0")/../.."
bench_at_most 3 "$@"
rounds=${1:-3}
out=${2:-runs/bench/moe_layer.jsonl}
configs=(${3:-1 2 2:PASSIVE})
bench_count rounds "$rounds"
bench_fresh out "$out"
bench_configs "${configs[*]}"
mkdir -p "$(dirname "$out")"
py=/usr/bin/python3
$py recipes/bench/bench_env.py > "$out"
n=${#configs[@]}
torch_all() {   # torch_all <round> <moe_layer_torch.py args...>: every configuration once
    local r=$1 i c threads policy
    shift
    for i in $(seq 0 $((n - 1))); do
        c=${configs[$(((i + r - 1) % n))]}
        threads=${c%%:*} policy=
        [ "$c" != "$threads" ] && policy=${c#*:}
        env -u OMP_WAIT_POLICY ${policy:+OMP_WAIT_POLICY=$policy} \
            $py recipes/bench/moe_layer_torch.py "$@" --threads "$threads" --reps 1 >> "$out"
    done
}
for r in $(seq "$rounds"); do
    for T in 4096 16384 32768; do
        ./moelua recipes/bench/moe_layer.lua --tokens "$T" --reps 1 >> "$out"
        for impl in sorted hf; do
            torch_all "$r" --impl "$impl" --tokens "$T"
        done
    done
    ./moelua recipes/bench/moe_layer.lua --tokens 16384 --dim 256 --ffn 512 --experts 64 --topk 8 --reps 1 >> "$out"
    torch_all "$r" --impl sorted --tokens 16384 --dim 256 --ffn 512 --experts 64 --topk 8
    for s in save 0.5 recompute; do
        ./moelua recipes/bench/moe_layer.lua --tokens 32768 --save "$s" --reps 1 >> "$out"
    done
    echo "round $r done" >&2
done
./moelua recipes/bench/moe_layer.lua --router-memory 1 >> "$out"
$py recipes/bench/moe_layer_summary.py "$out"
