-- recipes/bench/moe_layer.lua: forward + backward of one MoE layer (f32, CPU or CUDA; bf16 on CUDA).
--   moelua recipes/bench/moe_layer.lua --tokens 32768            one config
--   moelua recipes/bench/moe_layer.lua --device cuda --dtype bf16 --tokens 32768 --dim 4096 --ffn 14336
--   moelua recipes/bench/moe_layer.lua --suite issue             the issue's configs
--   moelua recipes/bench/moe_layer.lua --router-memory 1         router memory vs T (E = 64)
-- Options: --tokens --dim --ffn --experts --topk --chunk --tile --save
-- (save | recompute | a partial_recompute fraction) --reps --device (cpu | cuda)
-- --dtype (f32 | bf16: mixed precision, cuda only).
-- One JSON object per config: the config, fwd_ms and bwd_ms (medians over
-- reps after one warm-up step), gemm_gflops (expert GEMM FLOPs / time),
-- floor_pct (time the expert GEMMs would take at this run's raw sgemm rate /
-- measured time), peak bytes (ledger total and per category, and the
-- process's peak RSS). On cuda the line also holds "device":"cuda": the
-- layer, x and dy live on the GPU (x and dy drawn on the CPU and copied),
-- "dtype" names the layer's (bf16: bf16 x, weights and dy, f32 gradients),
-- each clock read waits for the GPU's queued work, the peaks are the cuda
-- ledger's (peak_reserved_bytes: its caching allocator's reservation), and
-- sgemm_gflops / floor_pct are null (the floor is a CPU BLAS figure). The
-- PyTorch baselines are moe_layer_torch.py (CPU) and moe_layer_torch_gpu.py
-- (CUDA, f32 and bf16) beside it.
local moelua = require "moelua"
local errors = require "moelua.errors"
local moe = require "moelua.moe"
local options = require "moelua.options"
local measure = require "moelua.measure"
local bench, mem = moelua.bench, moelua.mem
local median, peak_rss = measure.median, measure.peak_rss

local opts = options.parse(arg, {
  {"tokens", 4096, "tokens T", min = 1}, {"dim", 512, "model width D", min = 1},
  {"ffn", 1408, "expert hidden width F", min = 1}, {"experts", 8, "experts E", min = 1},
  {"topk", 2, "experts per token", min = 1}, {"chunk", 2048, "router chunk", min = 1},
  {"tile", 256, "expert GEMM tile rows", min = 1}, {"save", "save", "save | recompute | a partial_recompute fraction"},
  {"reps", 3, "timed repetitions (medians)", min = 1},
  {"suite", "", "issue: the issue's configs", choices = {"", "issue"}},
  {"router-memory", 0, "1: router memory against T (E = 64)", min = 0, max = 1},
  {"device", "cpu", "where the layer runs: cpu or cuda"},
  {"dtype", "f32", "f32, or bf16 on cuda (mixed precision)"},
}, "usage: moelua recipes/bench/moe_layer.lua [options]")

local device = options.need_device(opts.device)
if opts.dtype ~= "f32" and not (opts.dtype == "bf16" and device == "cuda") then
  errors.user(string.format("--dtype %s: f32, or bf16 with --device cuda", opts.dtype))
end
if device == "cuda" and opts.router_memory ~= 0 then
  errors.user("--router-memory measures the CPU ledger: run it with --device cpu")
end

-- Raw sgemm rate on the experts' main shape (a 2048-row block of tokens
-- through the gate_up projection), measured in this run: the better of
-- OpenBLAS and oneDNN, each on its own threads (the best GEMM here).
local function sgemm_gflops(D, F)
  local a, b, c = moelua.randn({2048, D}), moelua.randn({D, 2 * F}), moelua.zeros({2048, 2 * F})
  local best = 0
  for _, library in ipairs({"openblas", "onednn"}) do
    bench.raw_sgemm(c, a, b, 1, library)
    local t = {}
    for r = 1, 5 do t[r] = bench.raw_sgemm(c, a, b, 1, library) end
    best = math.max(best, 2 * 2048 * D * 2 * F / median(t) / 1e9)
  end
  return best
end

local function json(t, order)
  local parts = {}
  for _, k in ipairs(order) do
    local v = t[k]
    if type(v) == "table" then
      local inner = {}
      for _, c in ipairs({"params", "grads", "optim", "acts", "pool", "comm", "cache", "other"}) do
        inner[#inner + 1] = string.format('"%s":%d', c, v[c])
      end
      v = "{" .. table.concat(inner, ",") .. "}"
    elseif type(v) == "string" then
      v = '"' .. v .. '"'
    elseif math.type(v) == "float" then
      v = string.format("%.4g", v)
    elseif v == nil then
      v = "null"
    end
    parts[#parts + 1] = string.format('"%s":%s', k, tostring(v))
  end
  return "{" .. table.concat(parts, ",") .. "}"
end

local function run(c)
  local layer_opts = {dim = c.dim, ffn = c.ffn, experts = c.experts, topk = c.topk, chunk = c.chunk,
                      tile = c.tile, init_std = 0.02, aux_weight = 0.01, z_weight = 1e-3, device = device,
                      dtype = opts.dtype}
  if tonumber(c.save) then layer_opts.partial_recompute = tonumber(c.save) else layer_opts.save = c.save end
  local layer = moe.new(layer_opts)
  local x = moelua.randn({c.tokens, c.dim}, {seed = 1})
  local dy = moelua.randn({c.tokens, c.dim}, {seed = 2})
  if device ~= "cpu" then
    local hx, hdy, to = x, dy, {device = device, dtype = opts.dtype}
    x, dy = hx:to(to), hdy:to(to)
    hx:free(); hdy:free()
  end
  local rate = device == "cpu" and sgemm_gflops(c.dim, c.ffn) or nil
  layer:forward(x, 0)                           -- warm-up: the pool grows once
  layer:backward(dy)
  collectgarbage()
  mem.reset_peak()
  local fwd, bwd = {}, {}
  for r = 1, c.reps do
    layer:zero_grad()
    local t0 = bench.now(device)
    layer:forward(x, r)
    local t1 = bench.now(device)
    layer:backward(dy)
    local t2 = bench.now(device)
    fwd[r], bwd[r] = t1 - t0, t2 - t1
  end
  local st = mem.stats()[device]
  -- expert GEMMs: forward 2*T*k*3*D*F, backward twice that (recompute adds one gate_up GEMM)
  local flops = 6 * c.tokens * c.topk * 3 * c.dim * c.ffn
  local f, b = median(fwd), median(bwd)
  return {
    bench = "moe_layer", impl = "moelua", device = device ~= "cpu" and device or nil,
    dtype = device ~= "cpu" and opts.dtype or nil,
    tokens = c.tokens, dim = c.dim, ffn = c.ffn,
    experts = c.experts, topk = c.topk, chunk = c.chunk, tile = c.tile, recompute = tostring(c.save),
    threads = moelua.threads(), reps = c.reps, fwd_ms = 1e3 * f, bwd_ms = 1e3 * b,
    gemm_gflops = flops / (f + b) / 1e9, sgemm_gflops = rate,
    floor_pct = rate and 100 * (flops / (rate * 1e9)) / (f + b),
    peak_bytes = st.total_peak, peak_by_category = st.peak, peak_rss_bytes = peak_rss(),
    peak_reserved_bytes = device ~= "cpu" and st.reserved_peak or nil,
    gemm = bench.gemm_libraries(),
  }
end

local ORDER = {"bench", "impl", "tokens", "dim", "ffn", "experts", "topk", "chunk", "tile", "recompute",
               "threads", "reps", "fwd_ms", "bwd_ms", "gemm_gflops", "sgemm_gflops", "floor_pct",
               "peak_bytes", "peak_by_category", "peak_rss_bytes", "gemm"}
if device ~= "cpu" then   -- the CPU line stays as it was
  table.insert(ORDER, 3, "device")
  table.insert(ORDER, 4, "dtype")
  ORDER[#ORDER + 1] = "peak_reserved_bytes"   -- the caching allocator's, as torch's max_memory_reserved
end

local function config(over)
  local c = {}
  for k, v in pairs(opts) do c[k] = v end
  for k, v in pairs(over or {}) do c[k] = v end
  return c
end

if opts.router_memory ~= 0 then
  -- Router memory beyond its O(T*k) outputs does not grow with T: the
  -- ledger peak of one forward minus the outputs' bytes, at E = 64.
  local router = moelua.router
  for _, T in ipairs({4096, 131072}) do
    local D, E, k = 256, 64, 8
    local x, wg = moelua.randn({T, D}), moelua.randn({E, D}, {std = 0.02})
    collectgarbage()
    mem.reset_peak()
    local before = mem.stats().cpu.total
    local idx, w, s = router.forward(x, wg, {k = k, chunk = opts.chunk})
    local peak = mem.stats().cpu.total_peak - before
    local outputs = idx:numel() * 8 + w:numel() * 4 + 2 * E * 8
    print(string.format('{"bench":"router_memory","tokens":%d,"dim":%d,"experts":%d,"topk":%d,"chunk":%d,' ..
                        '"peak_bytes":%d,"output_bytes":%d,"beyond_outputs_bytes":%d,"dense_logits_bytes":%d}',
                        T, D, E, k, opts.chunk, peak, outputs, peak - outputs, T * E * 4))
    local _ = s
  end
elseif opts.suite == "issue" then
  for _, T in ipairs({4096, 16384, 32768}) do print(json(run(config{tokens = T}), ORDER)) end
  print(json(run(config{tokens = 16384, dim = 256, ffn = 512, experts = 64, topk = 8}), ORDER))
  for _, s in ipairs({"save", 0.5, "recompute"}) do print(json(run(config{tokens = 32768, save = s}), ORDER)) end
else
  print(json(run(config()), ORDER))
end
