-- recipes/bench/mfu_summary.lua LINES: the table of recipes/bench/mfu.sh
-- from its JSON lines (matmul.lua's, train.lua's, in run order): per
-- train.lua run, its tokens/s and the best GEMM rate of the matmul.lua runs
-- just before and after it, MFU = tokens/s x model_flop_per_token over the
-- higher of the two; then the median per seq_len.
local json = require "dkjson"
local median = require("moelua.measure").median
local rows, gemms = {}, {}
local f = arg[1] and io.open(arg[1])
if not f then require("moelua.errors").user("usage: moelua recipes/bench/mfu_summary.lua LINES (mfu.sh's JSON lines; "
                                             .. "got " .. tostring(arg[1]) .. ")") end
for line in f:lines() do
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
