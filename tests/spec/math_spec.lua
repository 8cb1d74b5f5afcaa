-- tests/spec/math_spec.lua - values of the tensor math (host/bindings/l_tensor_math.c,
-- kernels/*.c) against float64 references computed in plain Lua on tables.
--
-- Tolerances are normwise relative errors ||x - ref|| / ||ref||:
--   TOL.f32 = 1e-6   elementwise, unary, reductions, softmax (one rounding
--                    to f32, ~6e-8, plus libm's few ulp)
--   TOL.f64 = 1e-12
--   MM_TOL.f32 = 1e-5  sgemm accumulates k <= 64 products in f32
--   MM_TOL.f64 = 1e-12
-- Integer dtypes, index ops, max/min/topk values and everything labelled
-- "bit-identical" are compared exactly.
-- Bad input is in math_errors_spec.lua.
local m = require "moelua"
local support = require "tests.support"

local THREADS0 = m.threads()   -- the determinism specs must leave this as they found it
local TOL = {f32 = 1e-6, f64 = 1e-12}
local MM_TOL = {f32 = 1e-5, f64 = 1e-12}
local FLOATS = {"f32", "f64"}
local INTS = {"i32", "i64"}

-- ---- helpers ---------------------------------------------------------------

local vals, relerr, assert_close = support.values, support.relerr, support.assert_close

local function numel(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

local function assert_exact(t, ref, what)
  assert.are.same(ref, vals(t), what)
end

local gen = support.generator(1000)
local randn, rand = gen.randn, gen.rand

-- an integer-valued tensor of dtype dt with values in [lo, hi]
local function randint(shape, dt, lo, hi)
  local u = vals(rand(shape, "f64"))
  for i = 1, #u do u[i] = lo + math.floor(u[i] * (hi - lo + 1)) end
  return m.tensor(u, {dtype = dt}):reshape(shape), u
end

local function is_nan(x) return x ~= x end

-- ---- elementwise binary ----------------------------------------------------

local BIN = {
  add = function(x, y) return x + y end,
  sub = function(x, y) return x - y end,
  mul = function(x, y) return x * y end,
  div = function(x, y) return x / y end,
  maximum = function(x, y) return math.max(x, y) end,
  minimum = function(x, y) return math.min(x, y) end,
}
local BIN_NAMES = {"add", "sub", "mul", "div", "maximum", "minimum"}

-- out[i] = a[i % na] op b[i % nb] over the broadcast result (row-major:
-- a trailing-dims operand repeats with period numel)
local function ref_binary(f, a, b, n)
  local r = {}
  for i = 0, n - 1 do r[i + 1] = f(a[i % #a + 1], b[i % #b + 1]) end
  return r
end

describe("elementwise binary", function()
  -- {shape of a, shape of b, shape of the result}
  local CASES = {
    {{5, 7}, {5, 7}, {5, 7}},
    {{5, 7}, {7}, {5, 7}},          -- [T,D] op [D]
    {{7}, {5, 7}, {5, 7}},          -- [D] op [T,D]
    {{2, 3, 4}, {3, 4}, {2, 3, 4}},
    {{2, 3, 4}, {4}, {2, 3, 4}},
    {{5, 7}, {}, {5, 7}},           -- 0-dim tensor
    {{}, {5, 7}, {5, 7}},
    {{5, 7}, {1}, {5, 7}},
    {{1, 3}, {3}, {1, 3}},
    {{3}, {1, 3}, {1, 3}},
    {{}, {}, {}},
    {{0, 7}, {7}, {0, 7}},          -- an expert with no tokens
    {{7}, {0, 7}, {0, 7}},
    {{0}, {0}, {0}},
    {{0}, {}, {0}},
  }
  it("f32 add / sub / mul / div across tiles, broadcast or not, in place: the correctly rounded result", function()
    -- 21000 elements: two of the kernel's 16384-element tiles, whose runs without a wrap vectorise
    local function f32(x) return (string.unpack("f", string.pack("f", x))) end
    for _, sh in ipairs{{{3000, 7}, {3000, 7}}, {{3000, 7}, {7}}, {{7}, {3000, 7}}} do
      for _, name in ipairs{"add", "sub", "mul", "div"} do
        local a, b = randn(sh[1], "f32"), rand(sh[2], "f32", 0.5, 2)
        local want = ref_binary(function(x, y) return f32(BIN[name](x, y)) end, vals(a), vals(b), 21000)
        assert_exact(m[name](a, b), want, name .. " [" .. table.concat(sh[1], ",") .. "] op [" ..
                     table.concat(sh[2], ",") .. "]")
      end
    end
    local c, b = randn({3000, 7}, "f32"), randn({3000, 7}, "f32")
    local want = ref_binary(function(x, y) return f32(x + y) end, vals(c), vals(b), 21000)
    assert_exact(c:add_(b), want, "add_ in place")
  end)

  for _, dt in ipairs(FLOATS) do
    for _, name in ipairs(BIN_NAMES) do
      it(name .. " " .. dt .. " over shapes and broadcasts", function()
        for _, c in ipairs(CASES) do
          local a = randn(c[1], dt)
          local b = name == "div" and rand(c[2], dt, 0.5, 2) or randn(c[2], dt)
          local out = m[name](a, b)
          assert.are.same(c[3], out:shape())
          assert.are.equal(dt, out:dtype())
          local what = string.format("%s %s [%s] op [%s]", name, dt, table.concat(c[1], ","),
                                     table.concat(c[2], ","))
          assert_close(out, ref_binary(BIN[name], vals(a), vals(b), numel(c[3])), TOL[dt], what)
          assert_exact(a[name](a, b), vals(out), what .. " (method)")
        end
      end)
    end

    it("number op tensor and tensor op number, " .. dt, function()
      local a = rand({4, 6}, dt, 0.5, 2)
      local av = vals(a)
      local function check(t, f, what) assert_close(t, ref_binary(f, av, {0}, #av), TOL[dt], what) end
      check(a + 2.5, function(x) return x + 2.5 end, "t + 2.5")
      check(2.5 + a, function(x) return 2.5 + x end, "2.5 + t")
      check(a - 1.25, function(x) return x - 1.25 end, "t - 1.25")
      check(1.25 - a, function(x) return 1.25 - x end, "1.25 - t")
      check(a * 3, function(x) return x * 3 end, "t * 3")
      check(3 * a, function(x) return 3 * x end, "3 * t")
      check(a / 3, function(x) return x / 3 end, "t / 3")
      check(3 / a, function(x) return 3 / x end, "3 / t")
      check(-a, function(x) return -x end, "-t")
      check(a:maximum(1), function(x) return math.max(x, 1) end, "maximum(t, 1)")
      check(m.minimum(1, a), function(x) return math.min(1, x) end, "minimum(1, t)")
      check(m.sub(1, a), function(x) return 1 - x end, "moelua.sub(1, t)")
      check(m.div(a, 0.5), function(x) return x / 0.5 end, "moelua.div(t, 0.5)")
    end)

    it("non-contiguous operands (transpose, narrow), " .. dt, function()
      local big = randn({6, 9}, dt)
      local at = big:t()                       -- [9,6], strides {1,9}
      local b = randn({9, 6}, dt)
      assert.is_false(at:is_contiguous())
      assert_close(at + b, ref_binary(BIN.add, vals(at), vals(b), 54), TOL[dt], "t() + b")
      assert_close(b * at, ref_binary(BIN.mul, vals(b), vals(at), 54), TOL[dt], "b * t()")
      local nar = big:narrow(2, 3, 4)          -- [6,4] with row stride 9
      local bias = randn({8}, dt):narrow(1, 2, 4)
      assert.is_false(nar:is_contiguous())
      assert_close(nar - bias, ref_binary(BIN.sub, vals(nar), vals(bias), 24), TOL[dt], "narrow - bias")
      assert_close(nar / 4, ref_binary(BIN.div, vals(nar), {4}, 24), TOL[dt], "narrow / 4")
      assert_close(2 - at, ref_binary(BIN.sub, {2}, vals(at), 54), TOL[dt], "2 - t()")
    end)

    it("in-place variants write into the first operand and return it, " .. dt, function()
      for _, name in ipairs({"add", "sub", "mul", "div"}) do
        local a = rand({5, 7}, dt, 0.5, 2)
        local b = rand({7}, dt, 0.5, 2)
        local want = vals(m[name](a, b))
        local r = a[name .. "_"](a, b)
        assert.is_true(rawequal(r, a), name .. "_ returns self")
        assert_exact(a, want, name .. "_ tensor")
        local want_s = vals(m[name](a, 3))
        assert.is_true(rawequal(a[name .. "_"](a, 3), a))
        assert_exact(a, want_s, name .. "_ number")
        -- a non-contiguous second operand is fine
        local bt = rand({7, 5}, dt, 0.5, 2):t()
        local want_t = vals(m[name](a, bt))
        a[name .. "_"](a, bt)
        assert_exact(a, want_t, name .. "_ transposed operand")
      end
      -- a view of a larger tensor, contiguous: in place reaches the storage
      local base = m.zeros({4, 3}, {dtype = dt})
      base:narrow(1, 2, 2):add_(1)
      assert_exact(base, {0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0}, "contiguous narrow add_")
    end)
  end

  it("maximum / minimum propagate NaN from either side", function()
    local nan = 0 / 0
    for _, dt in ipairs(FLOATS) do
      local a = m.tensor({nan, 1, 2, nan}, {dtype = dt})
      local b = m.tensor({1, nan, 0, nan}, {dtype = dt})
      for _, r in ipairs({vals(a:maximum(b)), vals(a:minimum(b)), vals(b:maximum(a))}) do
        assert.is_true(is_nan(r[1]) and is_nan(r[2]) and is_nan(r[4]), dt)
      end
      assert.are.equal(2, vals(a:maximum(b))[3])
      assert.are.equal(0, vals(a:minimum(b))[3])
      assert.is_true(is_nan(vals(a:maximum(0))[1]))
    end
  end)

  it("division by zero in floats gives inf and NaN", function()
    local r = vals(m.tensor({1, -1, 0}) / 0)
    assert.are.equal(math.huge, r[1])
    assert.are.equal(-math.huge, r[2])
    assert.is_true(is_nan(r[3]))
  end)

  for _, dt in ipairs(INTS) do
    it("add / sub / mul, exact, " .. dt, function()
      local a, av = randint({4, 5}, dt, -1000, 1000)
      local b, bv = randint({5}, dt, -1000, 1000)
      for _, name in ipairs({"add", "sub", "mul"}) do
        local out = m[name](a, b)
        assert.are.equal(dt, out:dtype())
        assert_exact(out, ref_binary(BIN[name], av, bv, 20), name .. " " .. dt)
        assert_exact(m[name](b, a), ref_binary(BIN[name], bv, av, 20), name .. " " .. dt .. " reversed")
        assert_exact(m[name](a, 7), ref_binary(BIN[name], av, {7}, 20), name .. " " .. dt .. " number")
        assert_exact(m[name](7, a), ref_binary(BIN[name], {7}, av, 20), "number " .. name .. " " .. dt)
      end
      assert_exact(a:t() + 1, ref_binary(BIN.add, vals(a:t()), {1}, 20), "transposed + 1")
      assert_exact(a:maximum(0), ref_binary(BIN.maximum, av, {0}, 20), "maximum")
      local c = a:clone()
      c:mul_(b)
      assert_exact(c, ref_binary(BIN.mul, av, bv, 20), "mul_")
      assert_exact(m.zeros({0, 5}, {dtype = dt}) + b, {}, "empty")
    end)

    it("division by a number truncates toward zero, " .. dt, function()
      local a = m.tensor({7, -7, 6, -1, 0}, {dtype = dt})
      assert_exact(a / 2, {3, -3, 3, 0, 0})
      assert_exact(a:div(-2), {-3, 3, -3, 0, 0})
    end)
  end

  it("m.tensor keeps i64 values beyond 2^53 exactly", function()
    local big = (1 << 62) + 1
    assert.are.equal(big, m.tensor({big, -big}, {dtype = "i64"}):totable()[1])
    assert.are.equal(-big, m.tensor({big, -big}, {dtype = "i64"}):totable()[2])
    assert.are.equal(big, m.tensor(big, {dtype = "i64"}):item())
  end)
end)

-- ---- unary -----------------------------------------------------------------

local UN = {
  exp = math.exp,
  log = math.log,
  sqrt = math.sqrt,
  rsqrt = function(x) return 1 / math.sqrt(x) end,
  silu = function(x) return x / (1 + math.exp(-x)) end,
  sigmoid = function(x) return 1 / (1 + math.exp(-x)) end,
  tanh = function(x)
    if math.abs(x) > 20 then return x > 0 and 1 or -1 end
    local e = math.exp(2 * x)
    return (e - 1) / (e + 1)
  end,
  neg = function(x) return -x end,
  abs = math.abs,
}
local UN_NAMES = {"exp", "log", "sqrt", "rsqrt", "silu", "sigmoid", "tanh", "neg", "abs"}
local POSITIVE = {log = true, sqrt = true, rsqrt = true}

local function map(f, xs)
  local r = {}
  for i = 1, #xs do r[i] = f(xs[i]) end
  return r
end

describe("unary", function()
  for _, dt in ipairs(FLOATS) do
    for _, name in ipairs(UN_NAMES) do
      it(name .. " " .. dt .. ": contiguous, transposed, narrow, empty, in place", function()
        local function input(shape)
          return POSITIVE[name] and rand(shape, dt, 0.1, 4) or randn(shape, dt) * 3
        end
        local a = input({6, 5})
        assert_close(a[name](a), map(UN[name], vals(a)), TOL[dt], name .. " contiguous")
        local at = input({5, 6}):t()
        assert_close(at[name](at), map(UN[name], vals(at)), TOL[dt], name .. " transposed")
        local an = input({6, 9}):narrow(2, 2, 5)
        assert_close(an[name](an), map(UN[name], vals(an)), TOL[dt], name .. " narrow")
        local s = input({})
        assert.are.same({}, s[name](s):shape())
        assert_close(s[name](s), {UN[name](s:item())}, TOL[dt], name .. " 0-dim")
        local e = m.zeros({0, 3}, {dtype = dt})
        assert.are.same({0, 3}, e[name](e):shape())
        local want = vals(a[name](a))
        assert.is_true(rawequal(a[name .. "_"](a), a))
        assert_exact(a, want, name .. "_ equals " .. name)
      end)
    end
  end

  it("special values: exp(-inf) = 0, log(0) = -inf, silu/sigmoid saturate, tanh(+-inf)", function()
    local inf = math.huge
    for _, dt in ipairs(FLOATS) do
      assert.are.same({0, 1, inf}, vals(m.tensor({-inf, 0, inf}, {dtype = dt}):exp()))
      assert.are.same({-inf, 0}, vals(m.tensor({0, 1}, {dtype = dt}):log()))
      assert.is_true(is_nan(vals(m.tensor({-1}, {dtype = dt}):log())[1]))
      assert.are.same({0, 1}, vals(m.tensor({-1000, 1000}, {dtype = dt}):sigmoid()))
      local s = vals(m.tensor({-1000, 1000}, {dtype = dt}):silu())
      assert.are.equal(0, s[1])
      assert.are.equal(1000, s[2])
      assert.are.same({-1, 1}, vals(m.tensor({-inf, inf}, {dtype = dt}):tanh()))
      assert.are.same({inf}, vals(m.tensor({0}, {dtype = dt}):rsqrt()))
    end
  end)

  for _, dt in ipairs(INTS) do
    it("neg / abs exact, " .. dt, function()
      local a, av = randint({3, 4}, dt, -50, 50)
      assert_exact(a:neg(), map(UN.neg, av))
      assert_exact(-a, map(UN.neg, av))
      assert_exact(a:abs(), map(UN.abs, av))
      assert_exact(a:t():abs(), map(UN.abs, vals(a:t())))
      local c = a:clone()
      c:abs_()
      assert_exact(c, map(UN.abs, av))
      assert.are.equal(dt, c:dtype())
    end)
  end

  it("integer negation wraps at the minimum (two's complement)", function()
    assert_exact(m.tensor({-2147483648, 5}, {dtype = "i32"}):neg(), {-2147483648, -5})
    assert_exact(m.tensor({math.mininteger, -5}, {dtype = "i64"}):abs(), {math.mininteger, 5})
  end)
end)

-- ---- reductions ------------------------------------------------------------

-- reduce flat values of `shape` over dim d (1-based) with f(acc, x), init
local function ref_reduce(xs, shape, d, init, f)
  local outer, inner = 1, 1
  for i = 1, d - 1 do outer = outer * shape[i] end
  for i = d + 1, #shape do inner = inner * shape[i] end
  local r, out = shape[d], {}
  for o = 0, outer - 1 do
    for i = 0, inner - 1 do
      local acc = init
      for j = 0, r - 1 do acc = f(acc, xs[(o * r + j) * inner + i + 1], j) end
      out[#out + 1] = acc
    end
  end
  return out
end

local function add(a, x) return a + x end

local function ref_sum(xs, shape, d) return ref_reduce(xs, shape, d, 0, add) end
local function ref_mean(xs, shape, d)
  return map(function(s) return s / shape[d] end, ref_sum(xs, shape, d))
end
-- first position of the max (min) as {value, index}
local function ref_ext(xs, shape, d, sign)
  local best = ref_reduce(xs, shape, d, nil, function(acc, x, j)
    if acc == nil or sign * x > sign * acc[1] then return {x, j} end
    return acc
  end)
  return map(function(p) return p[1] end, best), map(function(p) return p[2] end, best)
end

local function total(xs)
  local s = 0
  for i = 1, #xs do s = s + xs[i] end
  return s
end

describe("reductions", function()
  for _, dt in ipairs(FLOATS) do
    it("sum / mean of everything and over each dim, " .. dt, function()
      local shape = {4, 5, 6}
      local a = randn(shape, dt)
      local av = vals(a)
      local s = a:sum()
      assert.are.same({}, s:shape())
      assert.are.equal(dt, s:dtype())
      assert_close(s, {total(av)}, TOL[dt], "sum()")
      assert_close(a:mean(), {total(av) / #av}, TOL[dt], "mean()")
      for d = 1, 3 do
        local want_shape = {}
        for i = 1, 3 do if i ~= d then want_shape[#want_shape + 1] = shape[i] end end
        assert.are.same(want_shape, a:sum(d):shape())
        assert_close(a:sum(d), ref_sum(av, shape, d), TOL[dt], "sum(" .. d .. ")")
        assert_close(a:mean(d), ref_mean(av, shape, d), TOL[dt], "mean(" .. d .. ")")
      end
      assert_exact(a:sum(-1), vals(a:sum(3)), "sum(-1) = sum(3)")
      assert_exact(a:mean(-3), vals(a:mean(1)), "mean(-3) = mean(1)")
    end)

    it("sum / mean of non-contiguous views, " .. dt, function()
      local at = randn({7, 3}, dt):t()        -- [3,7]
      local atv = vals(at)
      assert_close(at:sum(), {total(atv)}, TOL[dt])
      assert_close(at:sum(2), ref_sum(atv, {3, 7}, 2), TOL[dt])
      assert_close(at:mean(1), ref_mean(atv, {3, 7}, 1), TOL[dt])
      local an = randn({5, 8}, dt):narrow(2, 3, 4)
      assert_close(an:sum(1), ref_sum(vals(an), {5, 4}, 1), TOL[dt])
    end)

    it("sum / mean of empty tensors, " .. dt, function()
      assert.are.equal(0, m.zeros({0}, {dtype = dt}):sum():item())
      assert.is_true(is_nan(m.zeros({0}, {dtype = dt}):mean():item()))
      local e = m.zeros({3, 0}, {dtype = dt})
      assert_exact(e:sum(2), {0, 0, 0})
      assert.are.same({0}, e:sum(1):shape())
      local mean2 = vals(e:mean(2))
      assert.is_true(#mean2 == 3 and is_nan(mean2[1]))
      -- max over a non-empty dim of an empty tensor: an empty result (no tokens)
      local v, i = e:max(1)
      assert.are.same({0}, v:shape())
      assert.are.same({0}, i:shape())
      assert.are.same({0}, m.zeros({0, 4}, {dtype = dt}):argmax(2):shape())
      assert.are.same({0}, m.zeros({0, 4}, {dtype = dt}):min(-1):shape())
    end)

    it("max / min / argmax with values and first-position indices, " .. dt, function()
      local shape = {3, 4, 5}
      local a, av = randint(shape, dt, -3, 3)     -- many ties
      for d = 1, 3 do
        local v, i = a:max(d)
        local rv, ri = ref_ext(av, shape, d, 1)
        assert_exact(v, rv, "max values dim " .. d)
        assert_exact(i, ri, "max indices dim " .. d)
        assert.are.equal("i64", i:dtype())
        assert_exact(a:argmax(d), ri, "argmax dim " .. d)
        local nv, ni = a:min(d)
        local rnv, rni = ref_ext(av, shape, d, -1)
        assert_exact(nv, rnv, "min values dim " .. d)
        assert_exact(ni, rni, "min indices dim " .. d)
      end
      local v, i = a:max()
      local rv, ri = ref_ext(av, {#av}, 1, 1)
      assert.are.same({}, v:shape())
      assert.are.same({rv[1], ri[1]}, {v:item(), i:item()})
      assert.are.equal(ri[1], a:argmax():item())
      local nv, ni = a:min()
      local rnv, rni = ref_ext(av, {#av}, 1, -1)
      assert.are.same({rnv[1], rni[1]}, {nv:item(), ni:item()})
      -- a transposed view
      local at = a:reshape(12, 5):t()
      local tv, ti = at:max(2)
      local rtv, rti = ref_ext(vals(at), {5, 12}, 2, 1)
      assert_exact(tv, rtv)
      assert_exact(ti, rti)
    end)

    it("max / argmax: NaN wins, at its first position, " .. dt, function()
      local nan, inf = 0 / 0, math.huge
      local a = m.tensor({{1, nan, 3, nan}, {-inf, -inf, -inf, -inf}, {2, 5, 5, nan}}, {dtype = dt})
      local v, i = a:max(2)
      local vv = vals(v)
      assert.is_true(is_nan(vv[1]) and vv[2] == -inf and is_nan(vv[3]))
      assert_exact(i, {1, 0, 3})
      assert_exact(a:argmax(2), {1, 0, 3})
      local nv, ni = a:min(2)
      assert.is_true(is_nan(vals(nv)[1]))
      assert_exact(ni, {1, 0, 3})
      local tv, ti = a:max()
      assert.is_true(is_nan(tv:item()))
      assert.are.equal(1, ti:item())
      -- over dim 1: columns 2 and 4 have their NaN in row 1
      assert_exact(a:argmax(1), {2, 0, 2, 0})
    end)

    it("whole-tensor argmax across many blocks keeps the first position, " .. dt, function()
      local n = 4096 * 10 + 7
      local a = m.zeros({n}, {dtype = dt})
      a:narrow(1, 5000, 1):fill_(2)
      a:narrow(1, 30000, 1):fill_(2)
      a:narrow(1, 40000, 1):fill_(1)
      local v, i = a:max()
      assert.are.same({2, 4999}, {v:item(), i:item()})
      a:narrow(1, 35000, 1):fill_(0 / 0)
      a:narrow(1, 38000, 1):fill_(0 / 0)
      local v2, i2 = a:max()
      assert.is_true(is_nan(v2:item()))
      assert.are.equal(34999, i2:item())
      local _, i3 = (-a):min()
      assert.are.equal(34999, i3:item())
    end)
  end

  it("the sum accumulates in f64 even for f32 input", function()
    -- 1 + 2^-30 * 2^20 ones: in f32 arithmetic the small terms would vanish
    local n = 1 << 20
    local a = m.full({n + 1}, 2 ^ -30)
    a:narrow(1, 1, 1):fill_(1)
    assert.are.equal(1 + n * 2 ^ -30, a:sum():item())
  end)
end)

describe("determinism across thread counts", function()
  local function bits(t) return map(function(x) return string.format("%a", x) end, vals(t)) end

  for _, dt in ipairs(FLOATS) do
    it("sum / mean (total and over a dim) are bit-identical for 1, 2 and 4 threads, " .. dt, function()
      local old = m.threads()
      finally(function() m.threads(old) end)
      local n = 4096 * 24 + 123                 -- 25 blocks of ML_REDUCE_BLOCK
      local a = randn({n}, dt) * 100 + 1
      local a2 = a:narrow(1, 1, 311 * 316):reshape(311, 316)
      local results = {}
      for _, nt in ipairs({1, 2, 4}) do
        m.threads(nt)
        assert.are.equal(nt, m.threads())
        results[nt] = {
          sum = string.format("%a", a:sum():item()),
          mean = string.format("%a", a:mean():item()),
          sum1 = bits(a2:sum(1)), sum2 = bits(a2:sum(2)),
          mean1 = bits(a2:mean(1)), mean2 = bits(a2:mean(-1)),
          cumsum = bits(a2:cumsum(2)),
          argmax = vals(a2:argmax(2)),
        }
      end
      assert.are.same(results[1], results[2])
      assert.are.same(results[1], results[4])
      -- and the totals are right
      local av = vals(a)
      assert_close(m.tensor(tonumber(results[1].sum), {dtype = "f64"}), {total(av)}, TOL[dt])
    end)
  end

  it("m.threads is back to its value before the specs above", function()
    assert.are.equal(THREADS0, m.threads())
  end)
end)

-- ---- cumsum ----------------------------------------------------------------

local function ref_cumsum(xs, shape, d)
  local outer, inner = 1, 1
  for i = 1, d - 1 do outer = outer * shape[i] end
  for i = d + 1, #shape do inner = inner * shape[i] end
  local r, out = shape[d], {}
  for o = 0, outer - 1 do
    for i = 0, inner - 1 do
      local acc = 0
      for j = 0, r - 1 do
        local k = (o * r + j) * inner + i + 1
        acc = acc + xs[k]
        out[k] = acc
      end
    end
  end
  return out
end

describe("cumsum", function()
  for _, dt in ipairs(FLOATS) do
    it("over each dim, transposed, empty, " .. dt, function()
      local shape = {3, 4, 5}
      local a = randn(shape, dt)
      local av = vals(a)
      for d = 1, 3 do
        local c = a:cumsum(d)
        assert.are.same(shape, c:shape())
        assert_close(c, ref_cumsum(av, shape, d), TOL[dt], "cumsum(" .. d .. ")")
      end
      assert_exact(a:cumsum(-1), vals(a:cumsum(3)))
      local at = randn({6, 4}, dt):t()
      assert_close(at:cumsum(2), ref_cumsum(vals(at), {4, 6}, 2), TOL[dt], "transposed")
      assert.are.same({0, 3}, m.zeros({0, 3}, {dtype = dt}):cumsum(1):shape())
      assert.are.same({3, 0}, m.zeros({3, 0}, {dtype = dt}):cumsum(2):shape())
    end)
  end
  for _, dt in ipairs(INTS) do
    it("exact for " .. dt, function()
      local a, av = randint({4, 6}, dt, -100, 100)
      assert_exact(a:cumsum(1), ref_cumsum(av, {4, 6}, 1))
      assert_exact(a:cumsum(2), ref_cumsum(av, {4, 6}, 2))
      assert.are.equal(dt, a:cumsum(1):dtype())
      -- offsets of routed tokens: cumsum of counts
      assert_exact(m.tensor({3, 0, 2, 5}, {dtype = dt}):cumsum(1), {3, 3, 5, 10})
    end)
  end
end)

-- ---- softmax, log_softmax --------------------------------------------------

local function ref_softmax(xs, cols, log)
  local out = {}
  for r0 = 0, #xs // cols - 1 do
    local mx = -math.huge
    for j = 1, cols do mx = math.max(mx, xs[r0 * cols + j]) end
    local s = 0
    for j = 1, cols do s = s + math.exp(xs[r0 * cols + j] - mx) end
    for j = 1, cols do
      local z = xs[r0 * cols + j] - mx
      out[r0 * cols + j] = log and z - math.log(s) or math.exp(z) / s
    end
  end
  return out
end

describe("softmax / log_softmax", function()
  for _, dt in ipairs(FLOATS) do
    it("rows of [T,E], [B,T,E], 1-dim, transposed, " .. dt, function()
      for _, shape in ipairs({{7, 8}, {2, 3, 5}, {9}, {4, 1}}) do
        local a = randn(shape, dt) * 4
        local cols = shape[#shape]
        local sm = a:softmax()
        assert.are.same(shape, sm:shape())
        assert_close(sm, ref_softmax(vals(a), cols), TOL[dt], "softmax")
        assert_close(a:log_softmax(), ref_softmax(vals(a), cols, true), TOL[dt], "log_softmax")
      end
      local at = randn({6, 5}, dt):t()
      assert_close(at:softmax(), ref_softmax(vals(at), 6), TOL[dt], "transposed")
      assert_close(at:log_softmax(), ref_softmax(vals(at), 6, true), TOL[dt], "transposed log")
    end)

    it("large values do not overflow, -inf gets probability 0, " .. dt, function()
      local big = dt == "f32" and 3e38 or 1e308
      local a = m.tensor({{1000, 1001, 1002}, {big, big, -big}, {-1e4, -1e4 - 1, -1e4 - 2},
                          {-math.huge, 0, -math.huge}}, {dtype = dt})
      local sm = vals(a:softmax())
      for _, x in ipairs(sm) do assert.is_false(is_nan(x) or x == math.huge) end
      local e = math.exp(1)
      local p = {1 / (1 + e + e * e), e / (1 + e + e * e), e * e / (1 + e + e * e)}
      local want = {p[1], p[2], p[3], 0.5, 0.5, 0, p[3], p[2], p[1], 0, 1, 0}
      assert(relerr(sm, want) <= TOL[dt], "softmax of large rows")
      local ls = vals(a:log_softmax())
      assert(math.abs(ls[3] - math.log(p[3])) <= 1e-6)
      assert.are.equal(-math.huge, ls[10])
      assert.are.equal(0, ls[11])
      assert.are.equal(-math.huge, ls[6])
    end)

    it("log_softmax is consistent with softmax and rows sum to 1, " .. dt, function()
      local a = randn({16, 32}, dt) * 10
      assert_close(a:log_softmax():exp(), vals(a:softmax()), TOL[dt] * 10, "exp(log_softmax)")
      assert_close(a:softmax():sum(2), vals(m.ones({16}, {dtype = dt})), TOL[dt], "row sums")
      -- log_softmax = x - logsumexp(x), shift invariant
      assert_close((a + 1e3):log_softmax(), vals(a:log_softmax()), TOL[dt] * 1e3 * 4, "shift")
    end)

    it("empty shapes, " .. dt, function()
      assert.are.same({0, 4}, m.zeros({0, 4}, {dtype = dt}):softmax():shape())
      assert.are.same({3, 0}, m.zeros({3, 0}, {dtype = dt}):log_softmax():shape())
    end)
  end
end)

-- ---- topk ------------------------------------------------------------------

-- values and indices (0-based) of the k largest per row, ties to the lower index
local function ref_topk(xs, cols, k)
  local v, ix = {}, {}
  for r0 = 0, #xs // cols - 1 do
    local order = {}
    for j = 1, cols do order[j] = j - 1 end
    table.sort(order, function(p, q)
      local a, b = xs[r0 * cols + p + 1], xs[r0 * cols + q + 1]
      if a ~= b then return a > b end
      return p < q
    end)
    for q = 1, k do
      v[#v + 1] = xs[r0 * cols + order[q] + 1]
      ix[#ix + 1] = order[q]
    end
  end
  return v, ix
end

describe("topk", function()
  it("ties go to the lower index", function()
    local v, i = m.tensor({1, 3, 3, 2}):topk(2)
    assert_exact(v, {3, 3})
    assert_exact(i, {1, 2})
    local _, i2 = m.tensor({{5, 5, 5, 5}, {0, 1, 0, 1}}):topk(3)
    assert_exact(i2, {0, 1, 2, 1, 3, 0})
  end)

  for _, dt in ipairs(FLOATS) do
    it("random rows with ties, k in {0, 1, 2, 8, cols}, and k > 64, " .. dt, function()
      for _, c in ipairs({{{6, 8}, {0, 1, 2, 8}}, {{3, 100}, {5, 64, 65, 70, 100}}, {{2, 2, 9}, {3}}}) do
        local shape, ks = c[1], c[2]
        local a, av = randint(shape, dt, -5, 5)
        local cols = shape[#shape]
        for _, k in ipairs(ks) do
          local v, i = a:topk(k)
          local want_shape = {table.unpack(shape)}
          want_shape[#want_shape] = k
          assert.are.same(want_shape, v:shape())
          assert.are.same(want_shape, i:shape())
          assert.are.equal(dt, v:dtype())
          assert.are.equal("i64", i:dtype())
          local rv, ri = ref_topk(av, cols, k)
          assert_exact(v, rv, "values k=" .. k)
          assert_exact(i, ri, "indices k=" .. k)
        end
      end
    end)

    it("distinct random values, transposed input, -inf entries, " .. dt, function()
      local a = randn({5, 12}, dt)
      local rv, ri = ref_topk(vals(a), 12, 4)
      local v, i = a:topk(4)
      assert_exact(v, rv)
      assert_exact(i, ri)
      local at = randn({9, 4}, dt):t()
      local tv, ti = at:topk(3)
      local rtv, rti = ref_topk(vals(at), 9, 3)
      assert_exact(tv, rtv)
      assert_exact(ti, rti)
      local inf = math.huge
      local w, wi = m.tensor({-inf, -inf, 1, -inf}, {dtype = dt}):topk(3)
      assert_exact(w, {1, -inf, -inf})
      assert_exact(wi, {2, 0, 1})
    end)

    it("NaN is refused, k = 0 gives empty results, empty rows, " .. dt, function()
      local a = m.tensor({{1, 2}, {0 / 0, 1}}, {dtype = dt})
      assert.has_error(function() a:topk(1) end)
      local ok, err = pcall(a.topk, a, 2)
      assert.is_false(ok)
      assert.matches("NaN", err)
      local v, i = m.tensor({{1, 2, 3}}, {dtype = dt}):topk(0)
      assert.are.same({1, 0}, v:shape())
      assert.are.same({1, 0}, i:shape())
      local ev, ei = m.zeros({0, 5}, {dtype = dt}):topk(2)
      assert.are.same({0, 2}, ev:shape())
      assert.are.same({0, 2}, ei:shape())
    end)
  end
end)

-- ---- index ops -------------------------------------------------------------

local function i64(t) return m.tensor(t, {dtype = "i64"}) end

describe("index ops", function()
  for _, dt in ipairs({"f32", "f64", "i32", "i64"}) do
    it("index_select over each dim, repeated and empty indices, " .. dt, function()
      local a, av = randint({4, 5}, dt, -9, 9)
      local r1 = a:index_select(1, i64({3, 0, 3}))
      assert.are.same({3, 5}, r1:shape())
      local want = {}
      for _, row in ipairs({3, 0, 3}) do
        for j = 1, 5 do want[#want + 1] = av[row * 5 + j] end
      end
      assert_exact(r1, want)
      local r2 = a:index_select(-1, i64({4, 1}))
      want = {}
      for row = 0, 3 do
        want[#want + 1] = av[row * 5 + 5]
        want[#want + 1] = av[row * 5 + 2]
      end
      assert_exact(r2, want)
      assert.are.same({0, 5}, a:index_select(1, m.zeros({0}, {dtype = "i64"})):shape())
      -- transposed source: rows of a:t() are columns of a
      assert_exact(a:t():index_select(1, i64({2})), {av[3], av[8], av[13], av[18]})
      assert.are.equal(dt, r1:dtype())
    end)

    it("gather over each dim, " .. dt, function()
      local a, av = randint({3, 4}, dt, -9, 9)
      local idx = {{3, 0}, {1, 1}, {0, 2}}
      local g = a:gather(2, i64(idx))
      assert.are.same({3, 2}, g:shape())
      local want = {}
      for r = 1, 3 do
        for j = 1, 2 do want[#want + 1] = av[(r - 1) * 4 + idx[r][j] + 1] end
      end
      assert_exact(g, want)
      local idx1 = {{2, 0, 1, 2}, {0, 0, 0, 0}}
      local g1 = a:gather(1, i64(idx1))
      want = {}
      for r = 1, 2 do
        for c = 1, 4 do want[#want + 1] = av[idx1[r][c] * 4 + c] end
      end
      assert_exact(g1, want)
      assert.are.same({3, 0}, a:gather(2, m.zeros({3, 0}, {dtype = "i64"})):shape())
      -- rows of width 0
      local e = m.zeros({4, 0}, {dtype = dt})
      assert.are.same({3, 0}, e:index_select(1, i64({0, 3, 3})):shape())
      assert.are.same({2, 0}, e:gather(1, m.zeros({2, 0}, {dtype = "i64"})):shape())
      assert.are.same({4, 0}, e:scatter_add_(1, m.zeros({2, 0}, {dtype = "i64"}),
                                             m.zeros({2, 0}, {dtype = dt})):shape())
    end)
  end

  for _, dt in ipairs({"f32", "f64", "i32", "i64"}) do
    it("scatter_add_ accumulates repeated indices, each dim, " .. dt, function()
      local t = m.zeros({3, 4}, {dtype = dt})
      local src, sv = randint({5, 4}, dt, -9, 9)
      local idx = {{0, 1, 2, 0}, {2, 2, 2, 2}, {0, 0, 1, 1}, {1, 0, 0, 2}, {0, 1, 2, 0}}
      local r = t:scatter_add_(1, i64(idx), src)
      assert.is_true(rawequal(r, t))
      local want = {}
      for i = 1, 12 do want[i] = 0 end
      for j = 1, 5 do
        for c = 1, 4 do
          local k = idx[j][c] * 4 + c
          want[k] = want[k] + sv[(j - 1) * 4 + c]
        end
      end
      assert_exact(t, want, "dim 1")
      -- dim 2 onto a non-zero target
      local t2, tv = randint({2, 3}, dt, -9, 9)
      local s2, s2v = randint({2, 4}, dt, -9, 9)
      local idx2 = {{0, 0, 2, 0}, {1, 2, 1, 1}}
      t2:scatter_add_(-1, i64(idx2), s2)
      for r0 = 1, 2 do
        for j = 1, 4 do
          local k = (r0 - 1) * 3 + idx2[r0][j] + 1
          tv[k] = tv[k] + s2v[(r0 - 1) * 4 + j]
        end
      end
      assert_exact(t2, tv, "dim 2")
      -- a transposed source is read in logical order
      local t3 = m.zeros({2, 3}, {dtype = dt})
      local s3 = m.tensor({{1, 2}, {3, 4}, {5, 6}}, {dtype = dt}):t()   -- {{1,3,5},{2,4,6}}
      t3:scatter_add_(1, i64({{1, 1, 0}, {1, 0, 0}}), s3)
      assert_exact(t3, {0, 4, 11, 3, 3, 0})
    end)
  end

  it("scatter_add_ in f32 agrees with an f64 reference over many repeats", function()
    local n = 2000
    local src = randn({n, 3}, "f32")
    local u = vals(rand({n}, "f64"))
    local ix = {}
    for j = 1, n do
      local b = math.floor(u[j] * 5)
      ix[j] = {b, b, (b + 1) % 5}
    end
    local t = m.zeros({5, 3})
    t:scatter_add_(1, i64(ix), src)
    local sv, want = vals(src), {}
    for i = 1, 15 do want[i] = 0 end
    for j = 1, n do
      for c = 1, 3 do
        local k = ix[j][c] * 3 + c
        want[k] = want[k] + sv[(j - 1) * 3 + c]
      end
    end
    -- n sequential f32 additions: error grows like n * eps
    assert_close(t, want, 1e-5)
  end)

  it("bincount counts 0-based indices, empty input, unused bins", function()
    local _, u = randint({200}, "i64", 0, 6)
    local want = {0, 0, 0, 0, 0, 0, 0, 0, 0}
    for _, x in ipairs(u) do want[x + 1] = want[x + 1] + 1 end
    local c = m.bincount(i64(u), 9)
    assert.are.equal("i64", c:dtype())
    assert_exact(c, want)
    assert_exact(m.bincount(m.zeros({0}, {dtype = "i64"}), 3), {0, 0, 0})
    assert.are.same({0}, m.bincount(m.zeros({0}, {dtype = "i64"}), 0):shape())
    -- a topk result routed through bincount: expert loads
    local _, ix = m.tensor({{0.1, 0.5, 0.4}, {0.7, 0.2, 0.1}}):topk(2)
    assert_exact(m.bincount(ix:reshape(-1), 3), {1, 2, 1})
  end)
end)

-- ---- matmul ----------------------------------------------------------------

-- C = A B for flat row-major A [mm,kk], B [kk,nn]
local function ref_mm(a, b, mm, kk, nn)
  local c = {}
  for i = 0, mm - 1 do
    for j = 0, nn - 1 do
      local s = 0
      for p = 0, kk - 1 do s = s + a[i * kk + p + 1] * b[p * nn + j + 1] end
      c[i * nn + j + 1] = s
    end
  end
  return c
end

describe("matmul", function()
  local SIZES = {1, 3, 17, 64}

  for _, dt in ipairs(FLOATS) do
    it("[m,k]x[k,n] for m,n,k in {1,3,17,64}, transposed operands on either side, " .. dt, function()
      for _, mm in ipairs(SIZES) do
        for _, kk in ipairs(SIZES) do
          for _, nn in ipairs(SIZES) do
            local a, b = randn({mm, kk}, dt), randn({kk, nn}, dt)
            local at, bt = randn({kk, mm}, dt):t(), randn({nn, kk}, dt):t()
            local av, bv, atv, btv = vals(a), vals(b), vals(at), vals(bt)
            local tag = string.format("%s m=%d k=%d n=%d", dt, mm, kk, nn)
            local c = m.matmul(a, b)
            assert.are.same({mm, nn}, c:shape())
            assert_close(c, ref_mm(av, bv, mm, kk, nn), MM_TOL[dt], tag .. " NN")
            if mm ~= nn or kk == 3 then   -- a sample of the transposed layouts
              assert_close(m.matmul(at, b), ref_mm(atv, bv, mm, kk, nn), MM_TOL[dt], tag .. " TN")
              assert_close(m.matmul(a, bt), ref_mm(av, btv, mm, kk, nn), MM_TOL[dt], tag .. " NT")
              assert_close(m.matmul(at, bt), ref_mm(atv, btv, mm, kk, nn), MM_TOL[dt], tag .. " TT")
            end
          end
        end
      end
    end)

    it("a product above 32 GFLOP runs in blocks of rows (Ctrl-C between them): rows on both sides of a seam, " ..
       dt, function()
      -- 2 M K N = 3.3e10 FLOP: two blocks of 1400 rows, so rows 1400 and 1401 are in two blocks; each row
      -- against the same row alone in f64 (one small GEMM: no blocks)
      local M, K, N = 2800, 2400, 2500
      local a, at, b = randn({M, K}, dt), randn({K, M}, dt):t(), randn({K, N}, dt)
      local b64 = b:to("f64")
      for _, A in ipairs({a, at}) do
        local c = m.matmul(A, b)
        for _, r in ipairs({1, 1400, 1401, M}) do
          local ref = m.matmul(A:narrow(1, r, 1):to("f64"), b64)
          assert_close(c:narrow(1, r, 1), vals(ref), MM_TOL[dt], "row " .. r)
        end
      end
    end)

    it("narrow views with a leading dim larger than the columns, " .. dt, function()
      local A = randn({20, 40}, dt)
      local B = randn({30, 50}, dt)
      local a = A:narrow(1, 2, 17):narrow(2, 5, 13)      -- [17,13], lda 40
      local b = B:narrow(1, 3, 13):narrow(2, 7, 9)       -- [13,9], ldb 50
      assert.is_false(a:is_contiguous())
      assert_close(m.matmul(a, b), ref_mm(vals(a), vals(b), 17, 13, 9), MM_TOL[dt], "narrow x narrow")
      -- narrow of a transposed view: a transposed operand with lda > rows
      local at = randn({40, 20}, dt):t():narrow(1, 4, 17):narrow(2, 1, 13)   -- [17,13]
      assert_close(m.matmul(at, b), ref_mm(vals(at), vals(b), 17, 13, 9), MM_TOL[dt], "T narrow")
      -- one column / one row of a wider tensor
      local col = A:narrow(2, 3, 1)                      -- [20,1], lda 40
      local row = B:narrow(1, 2, 1):narrow(2, 1, 9)      -- [1,9]
      assert_close(m.matmul(col, row), ref_mm(vals(col), vals(row), 20, 1, 9), MM_TOL[dt], "outer")
      -- a select()ed row as the left operand, a non-BLAS layout (copied)
      local C3 = randn({4, 6, 5}, dt)
      local strided = C3:transpose(1, 3)                 -- [5,6,4] strides {1,5,30}
      local s2 = strided:select(3, 2)                    -- [5,6], strides {1,5}: transposed
      assert_close(m.matmul(s2, b:narrow(1, 1, 6)), ref_mm(vals(s2), vals(b:narrow(1, 1, 6)), 5, 6, 9),
                   MM_TOL[dt], "select view")
    end)

    it("batched [B,m,k]x[B,k,n] and [B,m,k]x[k,n], transposed batches, " .. dt, function()
      local Bn, mm, kk, nn = 3, 5, 7, 4
      local a, b, w = randn({Bn, mm, kk}, dt), randn({Bn, kk, nn}, dt), randn({kk, nn}, dt)
      local av, bv, wv = vals(a), vals(b), vals(w)
      local function slice(xs, i, len)
        return {table.unpack(xs, (i - 1) * len + 1, i * len)}
      end
      local function ref_batched(xv, yv, shared)
        local out = {}
        for i = 1, Bn do
          local c = ref_mm(slice(xv, i, mm * kk), shared and yv or slice(yv, i, kk * nn), mm, kk, nn)
          table.move(c, 1, #c, #out + 1, out)
        end
        return out
      end
      local c = m.matmul(a, b)
      assert.are.same({Bn, mm, nn}, c:shape())
      assert_close(c, ref_batched(av, bv), MM_TOL[dt], "batched")
      assert_close(m.matmul(a, w), ref_batched(av, wv, true), MM_TOL[dt], "shared weight")
      -- transposed last two dims, and a batch dim that is not outermost in memory
      local aT = randn({Bn, kk, mm}, dt):transpose(2, 3)
      local bT = randn({Bn, nn, kk}, dt):transpose(-1, -2)
      assert_close(m.matmul(aT, bT), ref_batched(vals(aT), vals(bT)), MM_TOL[dt], "batched TT")
      local aB = randn({mm, Bn, kk}, dt):transpose(1, 2)  -- [B,m,k], batch stride k
      assert_close(m.matmul(aB, b), ref_batched(vals(aB), bv), MM_TOL[dt], "batch-strided")
      assert_close(m.matmul(aB, w:t():t()), ref_batched(vals(aB), wv, true), MM_TOL[dt], "batch-strided x w")
      assert.are.same({0, mm, nn}, m.matmul(randn({0, mm, kk}, dt), w):shape())
    end)

    it("out / alpha / beta accumulate into C, " .. dt, function()
      local a, b = randn({6, 5}, dt), randn({5, 3}, dt)
      local ab = ref_mm(vals(a), vals(b), 6, 5, 3)
      local c0 = randn({6, 3}, dt)
      local c0v = vals(c0)
      local c = c0:clone()
      local r = m.matmul(a, b, {out = c, alpha = 0.5, beta = 2})
      assert.is_true(rawequal(r, c))
      local want = {}
      for i = 1, 18 do want[i] = 0.5 * ab[i] + 2 * c0v[i] end
      assert_close(c, want, MM_TOL[dt], "alpha/beta")
      -- out alone overwrites (beta defaults to 0), even a NaN
      local cn = m.full({6, 3}, 0 / 0, {dtype = dt})
      m.matmul(a, b, {out = cn})
      assert_close(cn, ab, MM_TOL[dt], "out, beta 0")
      -- beta = 1 accumulates gradients: two calls add up
      local g = m.zeros({6, 3}, {dtype = dt})
      m.matmul(a, b, {out = g, beta = 1})
      m.matmul(a, b, {out = g, beta = 1})
      assert_close(g, map(function(x) return 2 * x end, ab), MM_TOL[dt], "beta 1 twice")
      -- alpha without out scales
      assert_close(m.matmul(a, b, {alpha = -3}), map(function(x) return -3 * x end, ab), MM_TOL[dt],
                   "alpha only")
      -- batched out
      local a3, b3 = randn({2, 6, 5}, dt), randn({2, 5, 3}, dt)
      local c3 = m.ones({2, 6, 3}, {dtype = dt})
      m.matmul(a3, b3, {out = c3, beta = 1})
      local plain = vals(m.matmul(a3, b3))
      assert_close(c3, map(function(x) return x + 1 end, plain), MM_TOL[dt], "batched beta 1")
    end)

    it("k = 0 gives beta * C, m = 0 and n = 0 give empty results, " .. dt, function()
      local a, b = m.zeros({3, 0}, {dtype = dt}), m.zeros({0, 4}, {dtype = dt})
      local c = m.matmul(a, b)
      assert.are.same({3, 4}, c:shape())
      assert_exact(c, vals(m.zeros({3, 4})), "k = 0, no out")
      local c1 = m.full({3, 4}, 2, {dtype = dt})
      m.matmul(a, b, {out = c1, beta = 0.5})
      assert_exact(c1, vals(m.ones({3, 4})), "k = 0, beta 0.5")
      local cn = m.full({3, 4}, 0 / 0, {dtype = dt})
      m.matmul(a, b, {out = cn})
      assert_exact(cn, vals(m.zeros({3, 4})), "k = 0, beta 0 does not read C")
      assert.are.same({0, 4}, m.matmul(m.zeros({0, 5}, {dtype = dt}), m.zeros({5, 4}, {dtype = dt})):shape())
      assert.are.same({3, 0}, m.matmul(m.zeros({3, 5}, {dtype = dt}), m.zeros({5, 0}, {dtype = dt})):shape())
      assert.are.same({2, 3, 4}, m.matmul(m.zeros({2, 3, 0}, {dtype = dt}), b):shape())
    end)
  end

  it("f64 is computed in f64 (below f32 resolution)", function()
    local a = m.tensor({{1 + 2 ^ -40, 1}}, {dtype = "f64"})
    local b = m.tensor({{1}, {-1}}, {dtype = "f64"})
    assert.are.equal(2 ^ -40, m.matmul(a, b):item())
  end)
end)
