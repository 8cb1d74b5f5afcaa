-- recipes/bench/matmul.lua: what a matmul from Lua costs over a raw
-- sgemm call of each library on the same buffers, in one process,
-- interleaved.
--   moelua recipes/bench/matmul.lua [--sizes 64,256,2048] [--reps 15] [--threads N]
-- One JSON object per size: median seconds per call of
--   raw        OpenBLAS's cblas_sgemm timed in C (no Lua)
--   raw_onednn oneDNN's dnnl_sgemm timed in C
--   lua_out    moelua.matmul(a, b, {out = c})   (argument checks, no allocation)
--   lua_alloc  moelua.matmul(a, b)              (a new result through the ledger each call)
-- and the ratios lua/raw. Targets (issue: host): 64^3 lua <= 2x raw; 2048^3 raw/lua >= 0.95.
local moelua = require "moelua"
local options = require "moelua.options"
local median = require("moelua.measure").median
local bench = moelua.bench

local opts = options.parse(arg, {
  {"sizes", "64,256,2048", "square sizes, comma-separated"},
  {"reps", 15, "timed samples per size (medians)", min = 1},
  {"threads", 0, "threads for the GEMMs (0: as started)", min = 0, max = 1024},
}, "usage: moelua recipes/bench/matmul.lua [options]")

-- Calls per timed sample: enough for ~20 ms of work, so the clock resolution is noise.
local function calls_for(n)
  local flops = 2 * n * n * n
  return math.max(1, math.floor(2e-2 * 5e10 / flops))
end

if opts.threads > 0 then moelua.threads(opts.threads) end

local sizes = {}
for word in (tostring(opts.sizes) .. ","):gmatch("([^,]*),") do
  local n = math.tointeger(tonumber(word))
  if not n or n < 1 then
    require("moelua.errors").user(string.format("option --sizes: '%s' is not a size (positive integers, " ..
                                                "comma-separated: 64,256,2048)", word))
  end
  sizes[#sizes + 1] = n
end

for _, n in ipairs(sizes) do
  moelua.manual_seed(n)
  local a, b = moelua.randn({n, n}), moelua.randn({n, n})
  local c = moelua.zeros({n, n})
  local calls = calls_for(n)
  local out_opts = {out = c}
  local raw, raw_dnnl, lua_out, lua_alloc = {}, {}, {}, {}
  bench.raw_sgemm(c, a, b, calls)   -- warm-up: the libraries' buffers, page faults
  bench.raw_sgemm(c, a, b, calls, "onednn")
  moelua.matmul(a, b, out_opts)
  for _ = 1, tonumber(opts.reps) do
    raw[#raw + 1] = bench.raw_sgemm(c, a, b, calls)
    raw_dnnl[#raw_dnnl + 1] = bench.raw_sgemm(c, a, b, calls, "onednn")
    local t0 = bench.now()
    for _ = 1, calls do moelua.matmul(a, b, out_opts) end
    lua_out[#lua_out + 1] = (bench.now() - t0) / calls
    t0 = bench.now()
    for _ = 1, calls do moelua.matmul(a, b) end
    lua_alloc[#lua_alloc + 1] = (bench.now() - t0) / calls
  end
  local r, rd, o, al = median(raw), median(raw_dnnl), median(lua_out), median(lua_alloc)
  local best = math.min(r, rd)
  print(string.format(
    '{"bench":"matmul","m":%d,"n":%d,"k":%d,"threads":%d,"calls":%d,"reps":%d,' ..
    '"raw_s":%.4e,"raw_onednn_s":%.4e,"lua_out_s":%.4e,"lua_alloc_s":%.4e,"out_over_raw":%.3f,' ..
    '"alloc_over_raw":%.3f,"raw_gflops":%.1f,"raw_onednn_gflops":%.1f,"lua_out_gflops":%.1f,' ..
    '"out_of_best":%.3f,"libraries":"%s"}',
    n, n, n, moelua.threads(), calls, tonumber(opts.reps), r, rd, o, al, o / r, al / r,
    2 * n ^ 3 / r / 1e9, 2 * n ^ 3 / rd / 1e9, 2 * n ^ 3 / o / 1e9, best / o, bench.gemm_libraries()))
end
