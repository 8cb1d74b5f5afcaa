-- recipes/bench/mfu_summary.lua LINES: the table of recipes/bench/mfu.sh
-- from its JSON lines (matmul.lua's, train.lua's, moe_layer.lua's, in run
-- order): per train.lua run, its tokens/s and the best GEMM rate of the
-- matmul.lua runs just before and after it, MFU = tokens/s x
-- model_flop_per_token over the higher of the two; per moe_layer.lua run,
-- its forward + backward time and its share of the GEMM floor (its
-- gemm_gflops, the expert GEMMs' 6·T·k·3·D·F FLOPs over its time, over
-- that rate); then the median of each.
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
  elseif r.tokens_per_s then   -- each row: its model FLOP/s, how fast it ran, the GEMM sample before it
    rows[#rows + 1] = {S = r.seq_len, flops = r.tokens_per_s * r.model_flop_per_token,
                       speed = string.format("%.0f", r.tokens_per_s), g = #gemms}
  elseif r.bench == "moe_layer" then
    rows[#rows + 1] = {S = "moe", flops = r.gemm_gflops * 1e9,
                       speed = string.format("%.1f ms", r.fwd_ms + r.bwd_ms), g = #gemms}
  end
end
local by = {}
print("| seq_len | tokens/s (moe: fwd + bwd ms) | best GEMM before / after (GFLOP/s) | MFU (moe: share of the floor) |")
print("|---:|---:|---|---:|")
for _, r in ipairs(rows) do
  local best = math.max(gemms[r.g], gemms[r.g + 1])
  local mfu = r.flops / (best * 1e9)
  by[r.S] = by[r.S] or {}
  table.insert(by[r.S], mfu)
  print(string.format("| %s | %s | %.1f / %.1f | %.1f%% |", r.S, r.speed, gemms[r.g], gemms[r.g + 1], 100 * mfu))
end
local seqs = {}
for S in pairs(by) do seqs[#seqs + 1] = S end
table.sort(seqs, function(a, b)   -- seq_lens in order, then moe
  if type(a) ~= type(b) then return type(a) == "number" end
  return a < b
end)
for _, S in ipairs(seqs) do
  print(string.format(S == "moe" and "the MoE layer: its share of the GEMM floor, median %.1f%% over %d rounds"
                        or "seq_len " .. S .. ": MFU median %.1f%% over %d rounds", 100 * median(by[S]), #by[S]))
end
