-- moelua.bench: the clock and the raw sgemm baseline that benchmarks divide by.
local m = require "moelua"
local bench = m.bench
local support = require "tests.support"
local errmsg = support.errmsg

describe("moelua.bench", function()
  it("now() is a monotonic clock in seconds", function()
    local t0 = bench.now()
    local t1 = bench.now()
    assert.is_true(t1 >= t0)
    assert.is_true(t1 - t0 < 1)
  end)

  it("raw_sgemm computes c = a b (the baseline does the same work as matmul)", function()
    local a, b = m.randn({5, 7}, {seed = 1}), m.randn({7, 3}, {seed = 2})
    local ref = m.matmul(a:to("f64"), b:to("f64"))
    for _, library in ipairs({"openblas", "onednn"}) do
      local c = m.zeros({5, 3})
      local per_call = bench.raw_sgemm(c, a, b, 3, library)
      assert.is_true(per_call > 0)
      local rel = support.relerr(support.values(c), support.values(ref))
      assert.is_true(rel < 1e-6, library .. ": normwise error " .. rel)
    end
  end)

  it("gemm_libraries() names both libraries, their versions and kernel paths", function()
    local line = bench.gemm_libraries()
    assert.matches("^OpenBLAS %d+%.%d+%.%d+ %(%w+%); oneDNN %d+%.%d+%.%d+ %(isa 0x%x+%)", line)
  end)

  it("refuses bad input with the function's name", function()
    local a, b, c = m.zeros({2, 3}), m.zeros({3, 4}), m.zeros({2, 4})
    assert.matches("moelua.bench.raw_sgemm: argument #4: calls must be >= 1", errmsg(bench.raw_sgemm, c, a, b, 0))
    assert.matches("expected c %[m,n%], a %[m,k%], b %[k,n%]", errmsg(bench.raw_sgemm, m.zeros({4, 2}), a, b, 1))
    assert.matches("expected dtype f32, got f64", errmsg(bench.raw_sgemm, c, a:to("f64"), b, 1))
    assert.matches("expected a contiguous tensor", errmsg(bench.raw_sgemm, c, m.zeros({3, 2}):t(), b, 1))
    assert.matches("expected a tensor, got number", errmsg(bench.raw_sgemm, 1, a, b, 1))
    assert.matches("argument #5 .*invalid option 'mkl'", errmsg(bench.raw_sgemm, c, a, b, 1, "mkl"))
  end)

  it("recipes/bench/matmul.lua refuses a --sizes word that is not a size, naming it", function()
    for _, v in ipairs({"0", "64,x", "-5", "2.5", ""}) do
      local p = assert(io.popen(support.host_command({"recipes/bench/matmul.lua", "--sizes", v, "--reps", "1"}) ..
                                " 2>&1"))
      local code, out = support.finish_child(p)
      assert.are.equal(1, code, out)
      support.has(out, "option --sizes: '" .. (v == "64,x" and "x" or v) .. "' is not a size")
      assert.is_nil(out:find("traceback", 1, true), out)
    end
  end)

  it("recipes/bench/mfu_summary.lua: a step's MFU and the MoE layer's share of its GEMM floor, each against the " ..
     "higher GEMM rate beside it", function()
    local dir = support.make_tmpdir()
    local gemm = '{"bench":"matmul","raw_gflops":%g,"raw_onednn_gflops":1,"lua_out_gflops":%g}\n'
    support.write_file(dir .. "/lines", gemm:format(100, 200) .. -- a step of 1e6 FLOPs a token at 1e5 tokens/s
                       '{"seq_len":4096,"tokens_per_s":1e5,"model_flop_per_token":1e6}\n' .. gemm:format(250, 3) ..
                       -- expert GEMMs at 72 GFLOP/s over its 0.1 ms
                       '{"bench":"moe_layer","gemm_gflops":72,"fwd_ms":0.04,"bwd_ms":0.06}\n' ..
                       gemm:format(80, 90))
    local p = assert(io.popen(support.host_command({"recipes/bench/mfu_summary.lua", dir .. "/lines"}) .. " 2>&1"))
    local code, out = support.finish_child(p)
    support.remove_dir(dir)
    assert.are.equal(0, code, out)
    support.has(out, "| 4096 | 100000 | 200.0 / 250.0 | 40.0% |")   -- 100 GFLOP/s of the best 250
    support.has(out, "| moe | 0.1 ms | 250.0 / 90.0 | 28.8% |")           -- 72 of 250
    support.has(out, "the MoE layer: its share of the GEMM floor, median 28.8% over 1 rounds")
    support.has(out, "seq_len 4096: MFU median 40.0% over 1 rounds")
  end)

  it("recipes/bench/train.lua prints a refused model option as its message, with no traceback", function()
    local p = assert(io.popen(support.host_command({"recipes/bench/train.lua", "--experts", "4", "--topk", "9",
                                                    "--steps", "1"}) .. " 2>&1"))
    local code, out = support.finish_child(p)
    assert.are.equal(1, code, out)
    support.has(out, "option 'topk' = 9 must be in 1..experts (4)")
    assert.is_nil(out:find("traceback", 1, true), out)
  end)

  describe("the benchmark scripts (recipes/bench/*.sh) check their arguments before they run anything", function()
    local function script(args)
      local words = {}
      for i, a in ipairs(args) do words[i] = support.shell_quote(a) end
      local p = assert(io.popen("timeout -k 5 60 " .. table.concat(words, " ") .. " 2>&1"))
      return support.finish_child(p)
    end

    it("-h and --help print the header comment and exit 0", function()
      for _, opt in ipairs({"-h", "--help"}) do
        local code, out = script({"recipes/bench/mfu.sh", opt})
        assert.are.equal(0, code, out)
        support.has(out, "recipes/bench/mfu.sh: the training step's model FLOP utilisation")
        support.has(out, "\n  recipes/bench/mfu.sh [rounds=3] [seq_lens=\"4096 16384\"]\n")
      end
    end)

    it("name a bad count, an extra argument, an option where a path goes, a bad configuration", function()
      local cases = {
        {{"recipes/bench/mfu.sh", "x"}, "mfu.sh: rounds must be a whole number >= 1, got 'x'"},
        {{"recipes/bench/mfu.sh", "1", "4096 0"}, "mfu.sh: seq_len (or moe) must be a whole number >= 1, got '0'"},
        {{"recipes/bench/mfu.sh", "1", "4096", "9"}, "mfu.sh: takes at most 2 arguments, got 3 (the first extra: '9')"},
        {{"recipes/bench/zero.sh", "--dim", "64"}, "zero.sh: expected out_dir, got the option '--dim'"},
        {{"recipes/bench/ep.sh", "/nonexistent/ep", "0"}, "ep.sh: steps must be a whole number >= 1, got '0'"},
        {{"recipes/bench/store.sh", "/nonexistent/store", "2", "gen"},
         "store.sh: part must be all or generate, got 'gen'"},
        {{"recipes/bench/train_compare.sh", "1", "/nonexistent/t.jsonl", "4096", "1", "1 2:passive"},
         "train_compare.sh: a configuration is <torch threads>[:<OMP_WAIT_POLICY>], got '2:passive'"},
        {{"recipes/bench/build_compare.sh"}, "build_compare.sh: needs OTHER_CHECKOUT"},
      }
      for _, c in ipairs(cases) do
        local code, out = script(c[1])
        assert.are.equal(2, code, out)
        support.has(out, c[2] .. "\nusage: recipes/bench/" .. c[1][1]:match("[^/]+$"))
      end
    end)

    it("refuse an output that exists: an earlier run's results are never overwritten", function()
      local path = os.tmpname()
      local f = assert(io.open(path, "w"))
      f:write("an earlier run\n")
      f:close()
      for _, args in ipairs({{"recipes/bench/train_compare.sh", "1", path},
                             {"recipes/bench/moe_layer_compare.sh", "1", path},
                             {"recipes/bench/train_memory.sh", path}}) do
        local code, out = script(args)
        assert.are.equal(2, code, out)
        support.has(out, "out " .. path .. " exists (an earlier run's results): give another path or remove it")
      end
      assert.are.equal("an earlier run\n", support.read_file(path))
      os.remove(path)
    end)
  end)
end)
