-- tests/spec/math_errors_spec.lua - bad input to every binding of
-- host/bindings/l_tensor_math.c raises a Lua error whose message names the function
-- and says what was wrong. Values are in math_spec.lua.
local m = require "moelua"
local raises = require("tests.support").raises

local function i64(t) return m.tensor(t, {dtype = "i64"}) end
local function freed(...)
  local t = m.zeros(...)
  t:free()
  return t
end

local BIN_NAMES = {"add", "sub", "mul", "div", "maximum", "minimum"}

describe("elementwise binary: bad input", function()
  for _, name in ipairs(BIN_NAMES) do
    local fn = "moelua." .. name
    it(name .. ": wrong types, shapes, dtypes, freed tensors", function()
      local a = m.zeros(2, 3)
      raises(fn .. ": expected a tensor argument", m[name], 1, 2)
      raises(fn .. ": expected a tensor argument", m[name], nil, nil)
      raises(fn .. ": argument #2: expected a tensor or a number, got string", m[name], a, "x")
      raises(fn .. ": argument #2: expected a tensor or a number, got table", m[name], a, {1})
      raises(fn .. ": argument #1: expected a tensor or a number, got boolean", m[name], true, a)
      raises(fn .. ": argument #2: expected a tensor or a number, got no value", a[name], a)
      raises(fn .. ": shapes [2,3] and [3,2] do not broadcast", m[name], a, m.zeros(3, 2))
      raises(fn .. ": shapes [2,3] and [2] do not broadcast", m[name], a, m.zeros(2))
      raises(fn .. ": shapes [6] and [2,3] do not broadcast", m[name], m.zeros(6), a)
      raises(fn .. ": shapes [0] and [3] do not broadcast", m[name], m.zeros(0), m.zeros(3))
      raises(fn .. ": dtypes differ (f32 and f64): convert one with :to()", m[name], a,
             m.zeros({2, 3}, {dtype = "f64"}))
      raises(fn .. ": dtypes differ (i64 and i32)", m[name], m.zeros({3}, {dtype = "i64"}),
             m.zeros({3}, {dtype = "i32"}))
      raises(fn .. ": argument #1: the tensor was freed", m[name], freed(2, 3), a)
      raises(fn .. ": argument #2: the tensor was freed", m[name], a, freed(2, 3))
      raises(fn .. ": argument #1: the tensor was freed", m[name], freed(2, 3), 1)
      raises(fn .. ": argument #2: the tensor was freed", m[name], 1, freed(2, 3))
      raises(fn .. ": not supported on this device for this dtype", m[name], m.zeros({2}, {dtype = "u8"}),
             m.zeros({2}, {dtype = "u8"}))
      raises(fn .. ": not supported on this device for this dtype", m[name], m.zeros({2}, {dtype = "bf16"}), 1)
    end)
  end

  it("metamethods report the same errors", function()
    local a = m.zeros(2, 3)
    raises("moelua.add: argument #2: expected a tensor or a number, got string", function() return a + "1" end)
    raises("moelua.sub: argument #1: expected a tensor or a number, got table", function() return {} - a end)
    raises("moelua.mul: shapes [2,3] and [4] do not broadcast", function() return a * m.zeros(4) end)
    raises("moelua.div: dtypes differ (f32 and f64)", function() return a / a:to("f64") end)
    raises("Tensor:neg: argument #1: the tensor was freed", function() return -freed(2) end)
    raises("moelua.add: argument #1: the tensor was freed", function() return freed(2) + 1 end)
  end)

  for _, name in ipairs({"add_", "sub_", "mul_", "div_"}) do
    local fn = "moelua." .. name:sub(1, -2)
    it(name .. ": the first operand must be a contiguous tensor that takes the result", function()
      local a = m.zeros(2, 3)
      local f = a[name]
      raises(fn .. ": argument #1: expected a tensor, got number", f, 2, a)
      raises(fn .. ": shapes [3] and [2,3] do not broadcast into the first", f, m.zeros(3), a)
      raises(fn .. ": shapes [1] and [2,3] do not broadcast into the first", f, m.zeros(1), a)
      raises(fn .. ": shapes [2,3] and [3,2] do not broadcast into the first", f, a, m.zeros(3, 2))
      raises(fn .. ": dtypes differ (f32 and i64)", f, a, m.zeros({3}, {dtype = "i64"}))
      raises(fn .. ": a must be contiguous (call :contiguous())", f,
             m.zeros(3, 2):t(), 1)
      raises(fn .. ": a must be contiguous (call :contiguous())", f,
             m.zeros(3, 4):narrow(2, 1, 2), m.ones(2))
      raises(fn .. ": argument #1: the tensor was freed", f, freed(2, 3), 1)
      raises(fn .. ": argument #2: expected a tensor or a number, got no value", f, a)
    end)
  end

  it("a refused in-place op leaves the tensor unchanged", function()
    local base = m.zeros(3, 4)
    local v = base:t()
    assert.is_false(pcall(v.add_, v, 1))
    assert.is_false(pcall(v.exp_, v))
    assert.are.equal(0, base:sum():item())
  end)

  it("integer division: by zero, by a tensor, of a number by a tensor", function()
    for _, dt in ipairs({"i32", "i64"}) do
      local a = m.tensor({4, 6}, {dtype = dt})
      raises("moelua.div: integer division by zero", m.div, a, 0)
      raises("moelua.div: integer division by zero", function() return a / 0 end)
      raises("moelua.div: integer division by zero", a.div_, a, 0)
      raises("moelua.div: integer division is not supported between tensors", m.div, a, a)
      raises("moelua.div: integer division of a number by a tensor is not supported",
             function() return 12 / a end)
      raises("moelua.div: integer division of a number by a tensor is not supported",
             function() return 12 / m.tensor({0, 1}, {dtype = dt}) end)
    end
    -- floats divide by zero without error (inf), see math_spec
    assert.are.equal(math.huge, (m.ones(1) / 0):item())
  end)
end)

describe("unary: bad input", function()
  for _, name in ipairs({"exp", "log", "sqrt", "rsqrt", "silu", "sigmoid", "tanh", "neg", "abs"}) do
    local fn = "Tensor:" .. name
    it(name .. ": wrong types, dtypes, freed, in place on a view", function()
      local f, f_ = m.zeros(1)[name], m.zeros(1)[name .. "_"]
      raises(fn .. ": argument #1: expected a tensor, got number", f, 5)
      raises(fn .. ": argument #1: expected a tensor, got nil", f, nil)
      raises(fn .. ": argument #1: expected a tensor, got string", f_, "x")
      raises(fn .. ": argument #1: the tensor was freed", f, freed(3))
      raises(fn .. ": argument #1: the tensor was freed", f_, freed(3))
      raises(fn .. ": not defined for dtype u8", f, m.zeros({2}, {dtype = "u8"}))
      raises(fn .. ": not defined for dtype bf16", f, m.zeros({2}, {dtype = "bf16"}))
      if name ~= "neg" and name ~= "abs" then
        raises(fn .. ": not defined for dtype i32", f, m.zeros({2}, {dtype = "i32"}))
        raises(fn .. ": not defined for dtype i64", f_, m.zeros({2}, {dtype = "i64"}))
      end
      raises(fn .. ": t must be contiguous (call :contiguous())", f_,
             m.zeros(3, 2):t())
    end)
  end
end)

describe("reductions: bad input", function()
  local REDS = {"sum", "mean", "max", "min", "argmax"}
  for _, name in ipairs(REDS) do
    local fn = "Tensor:" .. name
    it(name .. ": dtypes, dims, freed", function()
      local a = m.zeros(2, 3)
      local f = a[name]
      raises(fn .. ": argument #1: expected a tensor, got number", f, 1)
      raises(fn .. ": argument #1: the tensor was freed", f, freed(2))
      raises(fn .. ": expected an f32 or f64 tensor, got i64", f, m.zeros({2}, {dtype = "i64"}))
      raises(fn .. ": expected an f32 or f64 tensor, got i32", f, m.zeros({2}, {dtype = "i32"}), 1)
      raises(fn .. ": expected an f32 or f64 tensor, got bf16", f, m.zeros({2}, {dtype = "bf16"}))
      raises(fn .. ": dim 3 out of range for a 2-dim tensor (dims are 1-based)", f, a, 3)
      raises(fn .. ": dim 0 out of range for a 2-dim tensor (dims are 1-based)", f, a, 0)
      raises(fn .. ": dim -3 out of range for a 2-dim tensor (dims are 1-based)", f, a, -3)
      raises(fn .. ": dim 1 out of range for a 0-dim tensor (dims are 1-based)", f, m.zeros({}), 1)
      raises("expected a dim (an integer, 1-based or negative from the end), got a fraction", f, a, 1.5)
      raises("expected a dim (an integer, 1-based or negative from the end), got string", f, a, "rows")
    end)
  end

  for _, name in ipairs({"max", "min", "argmax"}) do
    it(name .. ": empty input has no identity", function()
      local fn = "Tensor:" .. name
      raises(fn .. ": reduction of an empty tensor has no identity", m.zeros(0)[name], m.zeros(0))
      raises(fn .. ": reduction of an empty tensor has no identity", m.zeros(0)[name], m.zeros(3, 0))
      raises(fn .. ": reduction over an empty dim has no identity", m.zeros(0)[name], m.zeros(3, 0), 2)
      raises(fn .. ": reduction over an empty dim has no identity", m.zeros(0)[name], m.zeros(0, 3), -2)
    end)
  end

  it("cumsum: dims, dtypes, freed", function()
    local a = m.zeros(2, 3)
    raises("Tensor:cumsum: dim 3 out of range for a 2-dim tensor (dims are 1-based)", a.cumsum, a, 3)
    raises("Tensor:cumsum: dim 1 out of range for a 0-dim tensor", a.cumsum, m.zeros({}), 1)
    raises("expected a dim (an integer, 1-based or negative from the end), got nil", a.cumsum, a)
    raises("Tensor:cumsum: not defined for dtype u8", a.cumsum, m.zeros({2}, {dtype = "u8"}), 1)
    raises("Tensor:cumsum: not defined for dtype f16", a.cumsum, m.zeros({2}, {dtype = "f16"}), 1)
    raises("Tensor:cumsum: argument #1: the tensor was freed", a.cumsum, freed(2), 1)
    raises("Tensor:cumsum: argument #1: expected a tensor, got table", a.cumsum, {1, 2}, 1)
  end)
end)

describe("softmax / log_softmax / topk: bad input", function()
  for _, name in ipairs({"softmax", "log_softmax"}) do
    it(name .. ": dtypes, 0-dim, freed", function()
      local fn = "Tensor:" .. name
      local f = m.zeros(1)[name]
      raises(fn .. ": expected an f32 or f64 tensor, got i64", f, m.zeros({2}, {dtype = "i64"}))
      raises(fn .. ": expected an f32 or f64 tensor, got f16", f, m.zeros({2}, {dtype = "f16"}))
      raises(fn .. ": expected at least one dim", f, m.zeros({}))
      raises(fn .. ": argument #1: the tensor was freed", f, freed(2))
      raises(fn .. ": argument #1: expected a tensor, got nil", f, nil)
    end)
  end

  it("topk: NaN, k out of range, wrong types, dtypes, 0-dim, freed", function()
    local a = m.zeros(3, 4)
    local f = a.topk
    raises("Tensor:topk: NaN in the input (top-k refuses NaN scores)", f, m.tensor({1, 0 / 0, 2}), 1)
    raises("Tensor:topk: NaN", f, m.tensor({{1, 2}, {3, 0 / 0}}, {dtype = "f64"}), 2)
    raises("Tensor:topk: k = 5 is outside [0, 4] (the size of the last dim)", f, a, 5)
    raises("Tensor:topk: k = -1 is outside [0, 4] (the size of the last dim)", f, a, -1)
    raises("Tensor:topk: k = " .. math.maxinteger .. " is outside [0, 4]", f, a, math.maxinteger)
    raises("Tensor:topk: k = " .. math.mininteger .. " is outside [0, 4]", f, a, math.mininteger)
    raises("Tensor:topk: k = 1 is outside [0, 0]", f, m.zeros(3, 0), 1)
    raises("Tensor:topk: expected k (an integer), got a fraction", f, a, 1.5)
    raises("Tensor:topk: expected k (an integer), got nil", f, a)
    raises("Tensor:topk: expected an f32 or f64 tensor, got i64", f, m.zeros({4}, {dtype = "i64"}), 1)
    raises("Tensor:topk: expected at least one dim", f, m.zeros({}), 1)
    raises("Tensor:topk: argument #1: the tensor was freed", f, freed(4), 1)
    raises("Tensor:topk: argument #1: expected a tensor, got number", f, 4, 1)
  end)
end)

describe("index ops: bad input", function()
  it("index_select: dims, index dtype and shape, out-of-range indices (0-based), freed", function()
    local a = m.zeros(4, 5)
    local f = a.index_select
    local fn = "Tensor:index_select: "
    raises(fn .. "dim 3 out of range for a 2-dim tensor (dims are 1-based)", f, a, 3, i64({0}))
    raises(fn .. "idx must be i64, got i32", f, a, 1, m.zeros({2}, {dtype = "i32"}))
    raises(fn .. "idx must be i64, got f32", f, a, 1, m.zeros(2))
    raises(fn .. "idx must be 1-dim, got 2 dims", f, a, 1, i64({{0}}))
    raises(fn .. "idx: index 4 at position 1 is outside [0, 4) (indices are 0-based)", f, a, 1,
           i64({0, 4}))
    raises(fn .. "idx: index 5 at position 0 is outside [0, 5) (indices are 0-based)", f, a, 2,
           i64({5}))
    raises(fn .. "idx: index -1 at position 2 is outside [0, 5)", f, a, -1, i64({0, 1, -1}))
    raises(fn .. "argument #3: expected a tensor, got table", f, a, 1, {0, 1})
    raises(fn .. "argument #3: the tensor was freed", f, a, 1, (function()
      local t = i64({0}); t:free(); return t end)())
    raises(fn .. "argument #1: the tensor was freed", f, freed(4, 5), 1, i64({0}))
    raises("expected a dim (an integer, 1-based or negative from the end), got nil", f, a, nil, i64({0}))
  end)

  it("gather: index shape, dtype, range, freed", function()
    local a = m.zeros(3, 4)
    local f = a.gather
    local fn = "Tensor:gather: "
    raises(fn .. "index shape [2,2] must equal [3,4] except in dim 2", f, a, 2, i64({{0, 1}, {0, 1}}))
    raises(fn .. "index shape [3] must equal [3,4] except in dim 1", f, a, 1, i64({0, 1, 2}))
    raises(fn .. "idx must be i64, got f32", f, a, 2, m.zeros(3, 1))
    raises(fn .. "idx: index 4 at position 2 is outside [0, 4) (indices are 0-based)", f, a, 2,
           i64({{0}, {3}, {4}}))
    raises(fn .. "idx: index 3 at position 1 is outside [0, 3)", f, a, 1, i64({{0, 3, 0, 0}}))
    raises(fn .. "dim 0 out of range for a 2-dim tensor", f, a, 0, i64({{0}}))
    raises(fn .. "argument #1: the tensor was freed", f, freed(3, 4), 2, i64({{0}, {0}, {0}}))
    raises(fn .. "argument #3: expected a tensor, got nil", f, a, 2, nil)
  end)

  it("scatter_add_: target, source, index checks", function()
    local t = m.zeros(3, 4)
    local f = t.scatter_add_
    local fn = "Tensor:scatter_add_: "
    local idx = i64({{0, 1, 2, 0}})
    raises(fn .. "t must be contiguous (call :contiguous())", f, m.zeros(4, 3):t(), 1,
           idx, m.zeros(1, 4))
    raises(fn .. "source dtype f64 differs from f32", f, t, 1, idx, m.zeros({1, 4}, {dtype = "f64"}))
    raises(fn .. "source shape [2,4] differs from index shape [1,4]", f, t, 1, idx, m.zeros(2, 4))
    raises(fn .. "source shape [4] differs from index shape [1,4]", f, t, 1, idx, m.zeros(4))
    raises(fn .. "index shape [1,3] must equal [3,4] except in dim 1", f, t, 1, i64({{0, 1, 2}}),
           m.zeros(1, 3))
    raises(fn .. "idx: index 3 at position 2 is outside [0, 3) (indices are 0-based)", f, t, 1,
           i64({{0, 1, 3, 0}}), m.zeros(1, 4))
    raises(fn .. "idx: index -2 at position 0 is outside [0, 4)", f, t, 2, i64({{-2}, {0}, {0}}),
           m.zeros(3, 1))
    raises(fn .. "idx must be i64, got i32", f, t, 1,
           m.zeros({1, 4}, {dtype = "i32"}), m.zeros(1, 4))
    raises(fn .. "not defined for dtype u8", f, m.zeros({3, 4}, {dtype = "u8"}), 1, idx,
           m.zeros({1, 4}, {dtype = "u8"}))
    raises(fn .. "argument #4: the tensor was freed", f, t, 1, idx, freed(1, 4))
    raises(fn .. "argument #1: the tensor was freed", f, freed(3, 4), 1, idx, m.zeros(1, 4))
    raises(fn .. "dim 3 out of range for a 2-dim tensor", f, t, 3, idx, m.zeros(1, 4))
    -- nothing was added by any refused call
    assert.are.equal(0, t:sum():item())
  end)

  it("bincount: nbins, index dtype, shape and range", function()
    local fn = "moelua.bincount: "
    raises(fn .. "nbins must be >= 0, got -1", m.bincount, i64({0}), -1)
    raises(fn .. "idx must be 1-dim, got 2 dims", m.bincount, i64({{0}}), 2)
    raises(fn .. "idx must be i64, got f32", m.bincount, m.zeros(3), 2)
    raises(fn .. "idx: index 3 at position 1 is outside [0, 3) (indices are 0-based)",
           m.bincount, i64({0, 3}), 3)
    raises(fn .. "idx: index 0 at position 0 is outside [0, 0)", m.bincount, i64({0}), 0)
    raises(fn .. "argument #1: expected a tensor, got table", m.bincount, {0, 1}, 2)
    raises(fn .. "argument #1: the tensor was freed", m.bincount, (function()
      local t = i64({0}); t:free(); return t end)(), 2)
    raises("moelua.bincount: argument #2 (nbins) must be an integer, got nil", m.bincount, i64({0}))
  end)
end)

describe("matmul: bad input", function()
  local fn = "moelua.matmul: "
  it("shapes that do not agree", function()
    raises(fn .. "shapes [4,3] and [5,2] do not agree on the inner dimension", m.matmul, m.zeros(4, 3),
           m.zeros(5, 2))
    raises(fn .. "shapes [2,4,3] and [2,4,3] do not agree on the inner dimension", m.matmul,
           m.zeros(2, 4, 3), m.zeros(2, 4, 3))
    raises(fn .. "shapes [2,4,3] and [3,3,2] do not agree on the batch dimension", m.matmul,
           m.zeros(2, 4, 3), m.zeros(3, 3, 2))
    raises(fn .. "shapes [3,4] and [3,2] do not agree on the inner dimension", m.matmul,
           m.zeros(4, 3):t(), m.zeros(3, 2))
    raises(fn .. "expected [m,k]x[k,n], [B,m,k]x[B,k,n] or [B,m,k]x[k,n]; got 1 and 2 dims", m.matmul,
           m.zeros(3), m.zeros(3, 2))
    raises("got 2 and 3 dims", m.matmul, m.zeros(4, 3), m.zeros(2, 3, 2))
    raises("got 4 and 2 dims", m.matmul, m.zeros(1, 2, 4, 3), m.zeros(3, 2))
    raises("got 0 and 0 dims", m.matmul, m.zeros({}), m.zeros({}))
  end)

  it("types, dtypes, freed operands", function()
    local a, b = m.zeros(2, 3), m.zeros(3, 4)
    raises(fn .. "argument #1: expected a tensor, got table", m.matmul, {{1}}, b)
    raises(fn .. "argument #2: expected a tensor, got number", m.matmul, a, 2)
    raises(fn .. "dtypes differ (f32 and f64)", m.matmul, a, b:to("f64"))
    raises(fn .. "a must be f32 or f64, got i64", m.matmul, a:to("i64"), b:to("i64"))
    raises(fn .. "a must be f32 or f64, got bf16", m.matmul, a:to("bf16"), b:to("bf16"))
    raises(fn .. "argument #1: the tensor was freed", m.matmul, freed(2, 3), b)
    raises(fn .. "argument #2: the tensor was freed", m.matmul, a, freed(3, 4))
  end)

  it("options: unknown keys, out of the wrong shape, dtype, layout or type", function()
    local a, b = m.zeros(2, 3), m.zeros(3, 4)
    raises(fn .. "unknown option 'gamma' (expected one of: out, alpha, beta)", m.matmul, a, b, {gamma = 1})
    raises(fn .. "options must be a table, got number", m.matmul, a, b, 2)
    raises(fn .. "out is [4,2] but must be [2,4]", m.matmul, a, b, {out = m.zeros(4, 2)})
    raises(fn .. "out must have 2 dims, got 3", m.matmul, a, b, {out = m.zeros(1, 2, 4)})
    raises(fn .. "out must be f32, got f64", m.matmul, a, b,
           {out = m.zeros({2, 4}, {dtype = "f64"})})
    raises(fn .. "option 'out': expected a tensor, got number", m.matmul, a, b, {out = 1})
    raises(fn .. "out must be contiguous (call :contiguous())", m.matmul,
           a, b, {out = m.zeros(4, 2):t()})
    raises(fn .. "option 'out': the tensor was freed", m.matmul, a, b,
           {out = freed(2, 4)})
    raises("number expected, got string", m.matmul, a, b, {out = m.zeros(2, 4), alpha = "x"})
    raises("number expected, got table", m.matmul, a, b, {out = m.zeros(2, 4), beta = {}})
    raises("number expected, got boolean", m.matmul, a, b, {alpha = true})
  end)

  it("out may share a buffer with an input only where they do not overlap", function()
    local flat = m.zeros(2 * 3 + 3 * 4 + 2 * 4)           -- one flat unit: a, b and c side by side
    local a, b = flat:view_at(0, {2, 3}), flat:view_at(6, {3, 4})
    local c = flat:view_at(18, {2, 4})
    a:fill_(1); b:fill_(2)
    m.matmul(a, b, {out = c})
    assert.are.same({{6, 6, 6, 6}, {6, 6, 6, 6}}, c:totable())
    raises(fn .. "out overlaps an input", m.matmul, a, b, {out = flat:view_at(4, {2, 4})})
  end)
end)

describe("scalars with integer tensors", function()
  it("refuses a fractional number instead of truncating it", function()
    raises("moelua.add: a fractional number (0.5) with an integer tensor", function()
      return i64({1, 2}) + 0.5
    end)
    raises("moelua.mul: a fractional number (2.5)", m.mul, m.tensor({1}, {dtype = "i32"}), 2.5)
    assert.are.same({3, 4}, (i64({1, 2}) + 2.0):totable())
  end)
end)

-- CUDA tensors cannot be created without a device; these run where one exists.
if m.cuda_available() then
  describe("device mismatch", function()
    local msg = "tensors are on different devices (cpu and cuda)"
    it("every two-tensor binding refuses cpu with cuda", function()
      local a, g = m.zeros(2, 3), m.zeros(2, 3, {device = "cuda"})
      for _, name in ipairs(BIN_NAMES) do raises("moelua." .. name .. ": " .. msg, m[name], a, g) end
      raises("moelua.matmul: " .. msg, m.matmul, a, m.zeros(3, 2, {device = "cuda"}))
      raises("Tensor:index_select: " .. msg, a.index_select, a, 1, i64({0}):to("cuda"))
      raises("Tensor:gather: " .. msg, a.gather, a, 2, i64({{0}, {0}}):to("cuda"))
      raises("Tensor:scatter_add_: " .. msg, a.scatter_add_, a, 1, i64({{0, 0, 0}}):to("cuda"),
             m.zeros(1, 3))
      raises("Tensor:scatter_add_: " .. msg, a.scatter_add_, a, 1, i64({{0, 0, 0}}),
             m.zeros(1, 3, {device = "cuda"}))
    end)
  end)
end
