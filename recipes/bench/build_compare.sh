#!/usr/bin/env bash
# recipes/bench/build_compare.sh: this checkout's training step against
# another build of moelua (a refactor must not cost speed or memory),
# interleaved: every round runs both builds once per seq_len, each with its
# own recipes/bench/train.lua, so machine noise hits both alike; then the
# medians of the per-round ratios (this / other) of tokens/s, peak RSS and
# the ledger's peak.
#   recipes/bench/build_compare.sh OTHER_CHECKOUT [rounds=3] [seq_lens="1024 4096"]
# OTHER_CHECKOUT is a built tree (e.g. `git worktree add /tmp/base REV &&
# make -C /tmp/base`). Model: train_compare.sh's (V=256, D=256, L=4, 4 heads,
# 2 kv heads, E=8, k=2, F=512), 3 timed steps after one warm-up step.
set -euo pipefail
. "$(dirname "$0")/args.sh"
bench_help "$@"
cd "$(dirname "$0")/../.."
bench_at_most 3 "$@"
[ $# -ge 1 ] || bench_refuse "needs OTHER_CHECKOUT"
other=$1 rounds=${2:-3} seqs=${3:-"1024 4096"}
bench_word OTHER_CHECKOUT "$other"
bench_count rounds "$rounds"
bench_counts seq_len "$seqs"
[ -x "$other/moelua" ] || { echo "build_compare.sh: $other/moelua missing (make -C $other)" >&2; exit 1; }
cfg="--dim 256 --layers 4 --heads 4 --kv-heads 2 --experts 8 --topk 2 --ffn 512 --steps 3"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
grep -o 'flags[^:]*: .*' /proc/cpuinfo | head -1 | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512bw|fma)$' \
    | tr '\n' ' ' | sed 's/^/cpu flags: /; s/$/\n/' >&2
for r in $(seq "$rounds"); do
    for S in $seqs; do
        (cd "$other" && ./moelua recipes/bench/train.lua --seq-len "$S" $cfg) | sed "s/^{/{\"build\":\"other\",\"round\":$r,/" >> "$out"
        ./moelua recipes/bench/train.lua --seq-len "$S" $cfg | sed "s/^{/{\"build\":\"this\",\"round\":$r,/" >> "$out"
        echo "round $r seq_len $S done" >&2
    done
done
lua5.4 - "$out" <<'LUA'
local json = require "dkjson"
local rows = {}
for line in io.lines(arg[1]) do
  local r = json.decode(line)
  if r and r.build then
    rows[r.seq_len] = rows[r.seq_len] or {}
    local k = r.seq_len
    rows[k][r.round] = rows[k][r.round] or {}
    rows[k][r.round][r.build] = r
  end
end
local function median(t)
  table.sort(t)
  local n = #t
  return n % 2 == 1 and t[(n + 1) // 2] or (t[n // 2] + t[n // 2 + 1]) / 2
end
print("| seq_len | tokens/s this | tokens/s other | ratio (median of rounds) | per round | peak RSS ratio | ledger peak this / other (MiB) |")
print("|---:|---:|---:|---:|---|---:|---:|")
local seqs = {}
for S in pairs(rows) do seqs[#seqs + 1] = S end
table.sort(seqs)
for _, S in ipairs(seqs) do
  local tt, to, rt, rr, lt, lo = {}, {}, {}, {}, {}, {}
  for _, pair in pairs(rows[S]) do
    local a, b = pair.this, pair.other
    if a and b then
      tt[#tt + 1], to[#to + 1] = a.tokens_per_s, b.tokens_per_s
      rt[#rt + 1] = a.tokens_per_s / b.tokens_per_s
      rr[#rr + 1] = a.peak_rss_bytes / b.peak_rss_bytes
      lt[#lt + 1], lo[#lo + 1] = a.peak_ledger_bytes.total, b.peak_ledger_bytes.total
    end
  end
  local each = {}
  for i, r in ipairs(rt) do each[i] = string.format("%.2f", r) end
  print(string.format("| %d | %.0f | %.0f | %.3f | %s | %.3f | %.1f / %.1f |", S, median(tt), median(to),
                      median(rt), table.concat(each, ", "), median(rr), median(lt) / 2^20, median(lo) / 2^20))
end
LUA
