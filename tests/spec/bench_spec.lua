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

  it("recipes/bench/train.lua prints a refused model option as its message, with no traceback", function()
    local p = assert(io.popen(support.host_command({"recipes/bench/train.lua", "--experts", "4", "--topk", "9",
                                                    "--steps", "1"}) .. " 2>&1"))
    local code, out = support.finish_child(p)
    assert.are.equal(1, code, out)
    support.has(out, "option 'topk' = 9 must be in 1..experts (4)")
    assert.is_nil(out:find("traceback", 1, true), out)
  end)
end)
