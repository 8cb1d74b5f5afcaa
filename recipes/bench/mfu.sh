#!/usr/bin/env bash
# recipes/bench/mfu.sh: the training step's model FLOP utilisation against
# the best GEMM measured in the same minutes (issue 15). Each round runs,
# per seq_len, matmul.lua (2048³, 2 threads: the best of raw OpenBLAS, raw
# oneDNN and moelua.matmul), train.lua, and matmul.lua again; the round's
# MFU is tokens/s times the model's FLOPs per token (train.lua's
# model_flop_per_token) over the higher of the two GEMM rates.
# Prints each round and the medians.
#   recipes/bench/mfu.sh [rounds=3] [seq_lens="4096 16384"]
# Model: train_compare.sh's (V=256, D=256, L=4, 4 heads, 2 kv heads, E=8,
# k=2, F=512), 3 timed steps after one warm-up step.
set -euo pipefail
cd "$(dirname "$0")/../.."
rounds=${1:-3}
seqs=${2:-"4096 16384"}
cfg="--dim 256 --layers 4 --heads 4 --kv-heads 2 --experts 8 --topk 2 --ffn 512"
out=$(mktemp)
sum=$(mktemp --suffix .lua)
trap 'rm -f "$out" "$sum"' EXIT
grep -o 'flags[^:]*: .*' /proc/cpuinfo | head -1 | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512bw|fma)$' \
    | tr '\n' ' ' | sed 's/^/cpu flags: /; s/$/\n/' >&2 || true
gemm() { ./moelua recipes/bench/matmul.lua --sizes 2048 --reps 5 --threads 2 | tail -1; }
for r in $(seq "$rounds"); do
    for S in $seqs; do
        gemm >> "$out"
        ./moelua recipes/bench/train.lua --seq-len "$S" $cfg --steps 3 | tail -1 >> "$out"
        gemm >> "$out"
        echo "round $r seq_len $S done" >&2
    done
done
cat > "$sum" <<'LUA'
local json = require "dkjson"
local median = require("moelua.measure").median
local rows, gemms = {}, {}
for line in io.lines(arg[1]) do
  local r = json.decode(line)
  if r.bench == "matmul" then
    gemms[#gemms + 1] = math.max(r.raw_gflops, r.raw_onednn_gflops, r.lua_out_gflops)
  elseif r.tokens_per_s then
    rows[#rows + 1] = {S = r.seq_len, tps = r.tokens_per_s, flop = r.model_flop_per_token, g = #gemms}
  end
end
local by = {}
print("| seq_len | tokens/s | best GEMM before / after (GFLOP/s) | MFU |")
print("|---:|---:|---|---:|")
for _, r in ipairs(rows) do
  local best = math.max(gemms[r.g], gemms[r.g + 1])
  local mfu = r.tps * r.flop / (best * 1e9)
  by[r.S] = by[r.S] or {}
  table.insert(by[r.S], mfu)
  print(string.format("| %d | %.0f | %.1f / %.1f | %.1f%% |", r.S, r.tps, gemms[r.g], gemms[r.g + 1], 100 * mfu))
end
local seqs = {}
for S in pairs(by) do seqs[#seqs + 1] = S end
table.sort(seqs)
for _, S in ipairs(seqs) do
  print(string.format("seq_len %d: MFU median %.1f%% over %d rounds", S, 100 * median(by[S]), #by[S]))
end
LUA
./moelua "$sum" "$out"
