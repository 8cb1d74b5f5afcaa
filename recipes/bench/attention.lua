-- recipes/bench/attention.lua: causal GQA attention (moelua.ops, f32) on
-- its own: forward and backward seconds and GFLOP/s, medians.
--   moelua recipes/bench/attention.lua [--seq-len 4096] [--heads 4] [--kv-heads 2]
--                                      [--head-dim 64] [--threads 2] [--reps 5]
-- One JSON object. FLOPs are the causal model's: forward 2 H hd S (S + 1)
-- (Q Kᵀ and P V over the S (S + 1) / 2 visible scores), backward 2.5 times
-- that (dV, dP, dQ, dK, and Q Kᵀ recomputed), as BENCHMARKS.md counts them.
local moelua = require "moelua"
local ops = require "moelua.ops"
local options = require "moelua.options"
local errors = require "moelua.errors"
local median = require("moelua.measure").median
local bench = moelua.bench

local opts = options.parse(arg, {
  {"seq-len", 4096, "tokens", min = 1},
  {"heads", 4, "query heads", min = 1},
  {"kv-heads", 2, "key/value heads (divides --heads)", min = 1},
  {"head-dim", 64, "head dim", min = 1},
  {"threads", 2, "threads", min = 1},
  {"reps", 5, "timed forward + backward pairs (medians)", min = 1},
}, "usage: moelua recipes/bench/attention.lua [options]")
local S, H, KV, hd = opts.seq_len, opts.heads, opts.kv_heads, opts.head_dim
if H % KV ~= 0 then errors.user(string.format("--kv-heads %d must divide --heads %d", KV, H)) end
moelua.threads(opts.threads)
local q, k, v = moelua.randn({S, H, hd}, {seed = 1}), moelua.randn({S, KV, hd}, {seed = 2}),
    moelua.randn({S, KV, hd}, {seed = 3})
local dout = moelua.randn({S, H, hd}, {seed = 4})
local fwd, bwd = {}, {}
for r = 0, opts.reps do   -- r = 0 warms up (page faults, the GEMM library's buffers)
  local t0 = bench.now()
  local out, lse = ops.attention_forward(q, k, v)
  local t1 = bench.now()
  local dq, dk, dv = ops.attention_backward(dout, q, k, v, out, lse)
  local t2 = bench.now()
  if r > 0 then fwd[r], bwd[r] = t1 - t0, t2 - t1 end
  out:free(); lse:free(); dq:free(); dk:free(); dv:free()
end
local flops = 2 * H * hd * S * (S + 1)
local f, b = median(fwd), median(bwd)
print(string.format('{"bench":"attention","seq_len":%d,"heads":%d,"kv_heads":%d,"head_dim":%d,"threads":%d,' ..
                    '"reps":%d,"fwd_s":%.4f,"bwd_s":%.4f,"fwd_gflops":%.1f,"bwd_gflops":%.1f,"libraries":"%s"}',
                    S, H, KV, hd, moelua.threads(), opts.reps, f, b, flops / f / 1e9, 2.5 * flops / b / 1e9,
                    bench.gemm_libraries()))
