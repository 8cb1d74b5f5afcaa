-- Tensor core: creation, dtypes and conversions, views, copies, printing,
-- the Philox generator, and bad input to every binding of host/bindings/l_tensor.c.
local m = require "moelua"
local support = require "tests.support"
local errmsg = support.errmsg

local function same_bits(a, b)
  assert.are.equal(#a, #b)
  for i = 1, #a do
    assert.are.equal(string.format("%a", a[i]), string.format("%a", b[i]), "element " .. i)
  end
end

describe("creation", function()
  it("zeros, ones, full, empty take a table or integers and options", function()
    assert.are.same({{0, 0, 0}, {0, 0, 0}}, m.zeros({2, 3}):totable())
    assert.are.same({{1, 1}, {1, 1}}, m.ones(2, 2):totable())
    assert.are.same({7, 7, 7}, m.full({3}, 7, {dtype = "i32"}):totable())
    local e = m.empty({4, 5}, {dtype = "f64"})
    assert.are.same({4, 5}, e:shape())
    assert.are.equal("f64", e:dtype())
    assert.are.equal("cpu", e:device())
  end)

  it("arange follows Python's half-open convention", function()
    assert.are.same({0, 1, 2, 3}, m.arange(4, {dtype = "i64"}):totable())
    assert.are.same({2, 4, 6}, m.arange(2, 8, 2, {dtype = "i32"}):totable())
    assert.are.same({5, 4, 3}, m.arange(5, 2, -1, {dtype = "i64"}):totable())
    assert.are.same({}, m.arange(3, 3):totable())
    local t = m.arange(0, 1, 0.25, {dtype = "f64"}):totable()
    assert.are.same({0, 0.25, 0.5, 0.75}, t)
  end)

  it("tensor() reads nested tables and numbers", function()
    local t = m.tensor({{1, 2, 3}, {4, 5, 6}}, {dtype = "f64"})
    assert.are.same({2, 3}, t:shape())
    assert.are.same({{1, 2, 3}, {4, 5, 6}}, t:totable())
    assert.are.equal(2.5, m.tensor(2.5):item())
    assert.are.equal(0, m.tensor(2.5):dim())
  end)

  it("supports zero-size and 8-dim shapes", function()
    local z = m.zeros({0, 3})
    assert.are.equal(0, z:numel())
    assert.are.same({}, z:totable())
    local big = m.ones({1, 2, 1, 2, 1, 2, 1, 2})
    assert.are.equal(16, big:numel())
    assert.are.equal(8, big:dim())
  end)
end)

describe("dtype conversion", function()
  it("rounds bf16 to nearest even and keeps NaN and infinity", function()
    local v = m.tensor({1 + 2^-8, 1 + 3 * 2^-8, -(1 + 2^-8), 1 / 0, -1 / 0, 3.4e38}, {dtype = "f64"})
    local back = v:to("bf16"):to("f64"):totable()
    assert.are.same({1, 1 + 2^-6, -1, 1 / 0, -1 / 0, 1 / 0}, back)
    local nan = m.tensor({0 / 0}):to("bf16"):to("f32"):item()
    assert.is_true(nan ~= nan)
  end)

  it("rounds f16 to nearest even, with subnormals and overflow", function()
    local v = m.tensor({65504, 65520, 2^-24, 2^-25, 1.5 * 2^-24, 1 + 2^-11, 1 + 3 * 2^-11, -2^-14},
                       {dtype = "f64"})
    assert.are.same({65504, 1 / 0, 2^-24, 0, 2^-23, 1, 1 + 2^-9, -2^-14}, v:to("f16"):to("f64"):totable())
    local nan = m.tensor({0 / 0}):to("f16"):to("f64"):item()
    assert.is_true(nan ~= nan)
  end)

  it("truncates floats to integers, saturating, with NaN -> 0", function()
    local v = m.tensor({2.9, -2.9, 1e30, -1e30, 0 / 0, 300, -5}, {dtype = "f64"})
    assert.are.same({2, -2, 2147483647, -2147483648, 0, 300, -5}, v:to("i32"):totable())
    assert.are.same({2, 0, 255, 0, 0, 255, 0}, v:to("u8"):totable())
    assert.are.same({2, -2, math.maxinteger, math.mininteger, 0, 300, -5}, v:to("i64"):totable())
    local edge = m.tensor({2^63, -2^63, 2^62}, {dtype = "f64"}):to("i64"):totable()
    assert.are.same({math.maxinteger, math.mininteger, 1 << 62}, edge)
  end)

  it("keeps i64 exact beyond 2^53 through copies", function()
    local big = m.tensor({0}, {dtype = "i64"})
    big:fill_(2^53)
    big:add_(1)   -- computed in double: 2^53 + 1 rounds; integer reads stay integers
    assert.are.equal("integer", math.type(big:item()))
    local c = m.arange(3, {dtype = "i32"}):to("i64")
    assert.are.same({0, 1, 2}, c:totable())
  end)
end)

describe("views", function()
  local x
  before_each(function() x = m.arange(12, {dtype = "f64"}):view(3, 4) end)

  it("narrow and select share storage (1-based)", function()
    local n = x:narrow(2, 2, 2)
    assert.are.same({{1, 2}, {5, 6}, {9, 10}}, n:totable())
    assert.is_false(n:is_contiguous())
    n:fill_(-1)
    assert.are.same({0, -1, -1, 3}, x:select(1, 1):totable())
    assert.are.same({3, 7, 11}, x:select(2, -1):totable())
  end)

  it("transpose and t() swap strides without copying", function()
    local t = x:t()
    assert.are.same({4, 3}, t:shape())
    assert.are.same({1, 4}, t:stride())
    assert.are.same({0, 4, 8}, t:select(1, 1):totable())
    assert.are.same({{0, 4, 8}, {1, 5, 9}, {2, 6, 10}, {3, 7, 11}}, t:contiguous():totable())
  end)

  it("view needs contiguity; reshape copies when it must; -1 is inferred", function()
    assert.are.same({2, 6}, x:view(2, -1):shape())
    assert.matches("not contiguous", errmsg(function() return x:t():view(12) end))
    assert.are.same({0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}, x:t():reshape(-1):totable())
    assert.matches("do not divide", errmsg(function() return x:view(5, -1) end))
  end)

  it("storage_offset and same_storage locate a view in its flat buffer", function()
    local flat = m.zeros({10})
    local v = flat:view_at(4, {2, 3})
    assert.are.equal(4, v:storage_offset())
    assert.are.equal(5, v:narrow(2, 2, 2):storage_offset())
    assert.is_true(v:same_storage(flat))
    assert.is_false(v:same_storage(m.zeros({10})))
    assert.matches("Tensor:same_storage: argument #2: expected a tensor", errmsg(v.same_storage, v, 3))
  end)

  it("view_at maps the flat-unit layout onto a flat buffer", function()
    local flat = m.zeros({10}, {dtype = "f64"})
    local w = flat:view_at(2, {2, 3})
    w:fill_(5)
    assert.are.same({0, 0, 5, 5, 5, 5, 5, 5, 0, 0}, flat:totable())
    assert.matches("do not fit", errmsg(function() return flat:view_at(8, {3}) end))
    assert.matches("do not fit", errmsg(function() return flat:view_at(-1, {3}) end))
  end)

  it("copy_ converts dtype into a strided destination", function()
    local dst = m.zeros({3, 4}, {dtype = "f32"})
    dst:narrow(2, 1, 2):copy_(m.ones({3, 2}, {dtype = "i64"}))
    assert.are.same({{1, 1, 0, 0}, {1, 1, 0, 0}, {1, 1, 0, 0}}, dst:totable())
    assert.matches("shapes %[3,2%] and %[2%] differ",
                   errmsg(function() dst:narrow(2, 1, 2):copy_(m.ones({2})) end))
  end)

  it("clone and to() always copy", function()
    local c = x:clone()
    c:fill_(0)
    assert.are.equal(11, x:select(1, 3):select(1, 4):item())
    local f = x:to({dtype = "f32"})
    assert.are.equal("f32", f:dtype())
    assert.are.same(x:totable(), f:totable())
  end)
end)

describe("printing", function()
  it("shows shape, dtype, device, leading values and statistics", function()
    local s = tostring(m.arange(10, {dtype = "f64"}):view(2, 5))
    assert.matches("^tensor%(%[2,5%], f64, cpu, {0, 1, 2, 3, 4, 5, %.%.%.}, min 0 mean 4%.5 max 9%)$", s)
    assert.are.equal("tensor([0], f32, cpu)", tostring(m.zeros({0})))
    assert.are.equal("tensor([2], i64, cpu, {123456789, -9223372036854775808})",
                     tostring(m.tensor({123456789, math.mininteger}, {dtype = "i64"})))
    -- a view prints its first row, copies nothing whole and skips the statistics
    local before = m.mem.stats().cpu.allocs.other
    assert.are.equal("tensor([5,2], f64, cpu, {0, 5, ...})", tostring(m.arange(10, {dtype = "f64"}):view(2, 5):t()))
    assert.is_true(m.mem.stats().cpu.allocs.other - before <= 2)
    local t = m.zeros({2})
    t:free()
    assert.are.equal("tensor(freed)", tostring(t))
  end)
end)

describe("Philox-4x32-10", function()
  it("matches Random123's known-answer vectors", function()
    local function hex(...) return string.format("%08x %08x %08x %08x", ...) end
    assert.are.equal("6627e8d5 e169c58d bc57ac4c 9b00dbd8", hex(m.philox4x32_10({0, 0, 0, 0}, {0, 0})))
    local f = 0xffffffff
    assert.are.equal("408f276d 41c83b0e a20bc7c6 6d5451fd", hex(m.philox4x32_10({f, f, f, f}, {f, f})))
    assert.are.equal("d16cfe09 94fdcceb 5001e420 24126ea1",
      hex(m.philox4x32_10({0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0})))
  end)

  it("draws element i from counter offset + i/4, lane i mod 4", function()
    local u = m.rand({8}, {seed = 0, offset = 0, dtype = "f64"}):totable()
    local l0 = m.philox4x32_10({0, 0, 0, 0}, {0, 0})
    assert.are.equal((l0 >> 8) * 2^-24, u[1])
    local a = m.rand({10}, {seed = 5, offset = 0, dtype = "f64"})
    local b = m.rand({6}, {seed = 5, offset = 1, dtype = "f64"})
    same_bits(a:narrow(1, 5, 6):totable(), b:totable())
    local na = m.randn({10}, {seed = 5, offset = 0, dtype = "f64"})
    local nb = m.randn({6}, {seed = 5, offset = 1, dtype = "f64"})
    same_bits(na:narrow(1, 5, 6):totable(), nb:totable())
  end)

  it("gives the same numbers for any thread count", function()
    local saved = m.threads()
    m.threads(1)
    local one = m.randn({50000}, {seed = 9, offset = 3}):totable()
    m.threads(2)
    local two = m.randn({50000}, {seed = 9, offset = 3}):totable()
    m.threads(4)
    local four = m.randn({50000}, {seed = 9, offset = 3}):totable()
    m.threads(saved)
    same_bits(one, two)
    same_bits(one, four)
  end)

  it("has the right moments", function()
    local u = m.rand({200000}, {seed = 1, dtype = "f64"})
    assert.is_true(math.abs(u:mean():item() - 0.5) < 0.005)
    assert.is_true(u:min():item() >= 0 and u:max():item() < 1)
    local n = m.randn({200000}, {seed = 2, dtype = "f64", mean = 3, std = 2})
    local mean = n:mean():item()
    local var = n:sub(mean):mul(n:sub(mean)):mean():item()
    assert.is_true(math.abs(mean - 3) < 0.02, "mean " .. mean)
    assert.is_true(math.abs(math.sqrt(var) - 2) < 0.02, "std " .. math.sqrt(var))
    local r = m.rand({1000}, {seed = 3, lo = -2, hi = -1})
    assert.is_true(r:min():item() >= -2 and r:max():item() < -1)
  end)

  it("advances the host generator and restarts on manual_seed", function()
    m.manual_seed(42)
    local a = m.randn({5}):totable()
    local b = m.randn({5}):totable()
    assert.are_not.same(a, b)
    assert.are.same({seed = 42, offset = 4}, m.rng_state())
    m.manual_seed(42)
    assert.are.same(a, m.randn({5}):totable())
    local state = m.rng_state()
    local c = m.randn({3}):totable()
    m.rng_state(state)
    assert.are.same(c, m.randn({3}):totable())
  end)
end)

describe("bad input", function()
  it("names the function and the problem", function()
    assert.matches("moelua.zeros: size of dim 2 is negative %(%-1%)", errmsg(m.zeros, {2, -1}))
    assert.matches("moelua.zeros: size of dim 1 must be an integer, got a fraction", errmsg(m.zeros, {1.5}))
    assert.matches("moelua.zeros: unknown option 'dtpye'", errmsg(m.zeros, {2}, {dtpye = "f32"}))
    assert.matches("option 'dtype': unknown dtype 'f8'", errmsg(m.ones, {2}, {dtype = "f8"}))
    assert.matches("option 'device': unknown device 'tpu'", errmsg(m.ones, {2}, {device = "tpu"}))
    assert.matches("at most 8 are supported", errmsg(m.zeros, {1, 1, 1, 1, 1, 1, 1, 1, 1}))
    assert.matches("too many elements", errmsg(m.zeros, {2^40, 2^40}))
    assert.matches("expected a shape", errmsg(m.zeros, "x"))
    assert.matches("moelua.full: argument #2: expected the fill value", errmsg(m.full, {2}))
    assert.matches("moelua.arange: step must be a non%-zero number", errmsg(m.arange, 0, 1, 0))
    assert.matches("moelua.arange: expected arange", errmsg(m.arange, "3"))
    assert.matches("ragged table", errmsg(m.tensor, {{1, 2}, {3}}))
    assert.matches("element 2 is string, not a number", errmsg(m.tensor, {1, "a"}))
    assert.matches("expected a table or a number", errmsg(m.tensor, "abc"))
    assert.matches("random draws need a float dtype", errmsg(m.rand, {2}, {dtype = "i32"}))
    assert.matches("option 'offset' must be >= 0", errmsg(m.randn, {2}, {offset = -1}))
    assert.matches("moelua.threads: thread count must be in 1..1024", errmsg(m.threads, 0))
    assert.matches("counter word 1 must be an integer", errmsg(m.philox4x32_10, {-1, 0, 0, 0}, {0, 0}))
    -- arguments a binding does not take: refused, never ignored
    assert.matches("moelua.zeros: argument #2: expected an options table {dtype =, device =}, got string",
                   errmsg(m.zeros, {2, 3}, "f64"), nil, true)
    assert.matches("moelua.ones: argument #3: expected an options table", errmsg(m.ones, 2, 3, "f64"), nil, true)
    assert.matches("moelua.zeros: argument #4: unexpected number after the options table",
                   errmsg(m.zeros, {2}, {dtype = "f64"}, nil, 1), nil, true)
    assert.matches("moelua.zeros: argument #3: unexpected number after the arguments",
                   errmsg(m.zeros, {2}, nil, 1), nil, true)
    assert.matches("moelua.full: argument #3: expected an options table", errmsg(m.full, {2}, 1, "f64"), nil, true)
    assert.matches("moelua.full: argument #4: unexpected number after the options table",
                   errmsg(m.full, {2}, 1, {dtype = "f64"}, 7), nil, true)
    assert.are.equal(2, m.zeros({2, 3}):size(1, nil))   -- a trailing nil is no argument
    assert.are.equal("f32", m.zeros({2}, nil):dtype())
    local t = m.tensor({{1, 2}, {3, 4}})
    assert.matches("Tensor:softmax: takes no arguments, got 1 (#1 is a number)", errmsg(t.softmax, t, 1), nil, true)
    assert.matches("Tensor:topk: takes at most 1 argument, got 2 (#2 is a number)", errmsg(t.topk, t, 1, 1), nil, true)
    assert.matches("Tensor:sum: takes at most 1 argument, got 2", errmsg(t.sum, t, 1, 2), nil, true)
    assert.matches("moelua.matmul: takes at most 3 arguments, got 4", errmsg(m.matmul, t, t, nil, 1), nil, true)
    assert.matches("Tensor:cumsum: expected a dim (an integer, 1-based or negative from the end), got nil",
                   errmsg(t.cumsum, t), nil, true)
    assert.matches("Tensor:cumsum: expected a dim (an integer, 1-based or negative from the end), got a fraction",
                   errmsg(t.cumsum, t, 1.5), nil, true)
    assert.matches("Tensor:stride: dim 3 out of range for a 2-dim tensor", errmsg(t.stride, t, 3), nil, true)
    assert.are.same({2, 1, 2, 1}, {t:stride(1), t:stride(-1), t:t():stride(2), t:t():stride(1)})
    assert.matches("moelua.randn: option 'mean' must be a number, got string", errmsg(m.randn, {3}, {mean = "a"}),
                   nil, true)
    assert.matches("moelua.rand: option 'seed' must be an integer, got a fraction", errmsg(m.rand, {3}, {seed = 0.5}),
                   nil, true)
    -- each draw takes its own distribution's options, not the other's
    assert.matches("moelua.rand: unknown option 'mean' (expected one of: dtype, device, lo, hi, seed, offset)",
                   errmsg(m.rand, {3}, {mean = 3}), nil, true)
    assert.matches("moelua.randn: unknown option 'lo' (expected one of: dtype, device, mean, std, seed, offset)",
                   errmsg(m.randn, {3}, {lo = 1}), nil, true)
    assert.matches("moelua.rng_state: the state has no 'seed'", errmsg(m.rng_state, {1, 2}), nil, true)
    assert.matches("moelua.rng_state: expected a state {seed =, offset =}", errmsg(m.rng_state, "x"), nil, true)
    assert.matches("moelua.rng_state: option 'offset' must be >= 0, got -1",
                   errmsg(m.rng_state, {seed = 1, offset = -1}), nil, true)
    assert.matches("Tensor:fill_: expected the fill value (a number), got string", errmsg(t.fill_, t, "a"), nil, true)
    assert.matches("moelua.mem.stats: takes no arguments, got 1", errmsg(m.mem.stats, "x"), nil, true)
    assert.matches("moelua.arange: too many elements (1e+300)", errmsg(m.arange, 1e300), nil, true)
  end)

  it("refuses out-of-range dims and ranges on views", function()
    local x = m.zeros({3, 4})
    assert.matches("Tensor:narrow: dim 3 out of range for a 2%-dim tensor", errmsg(x.narrow, x, 3, 1, 1))
    assert.matches("range %[3, 5%] is outside dim 1 of size 3", errmsg(x.narrow, x, 1, 3, 3))
    assert.matches("Tensor:select: index 0 is outside dim 2", errmsg(x.select, x, 2, 0))
    assert.matches("shape has 10 elements, the tensor has 12", errmsg(x.view, x, 2, 5))
    assert.matches("Tensor:t: expected a 2%-dim tensor", errmsg(m.zeros({2, 2, 2}).t, m.zeros({2, 2, 2})))
    assert.matches("neither a dtype", errmsg(x.to, x, "gpu"))
    assert.matches("expected a tensor with one element", errmsg(x.item, x))
  end)

  it("refuses non-tensors and freed tensors", function()
    local x = m.zeros({2})
    assert.matches("Tensor:narrow: argument #1: expected a tensor, got table", errmsg(x.narrow, {}, 1, 1, 1))
    x:free()
    x:free()   -- idempotent
    assert.matches("Tensor:shape: argument #1: the tensor was freed", errmsg(x.shape, x))
    assert.matches("the tensor was freed", errmsg(function() return x + 1 end))
  end)

  it("says when a device is not built in or not present", function()
    if m.cuda_available() then return end
    assert.matches("moelua.zeros: device cuda is not available", errmsg(m.zeros, {2}, {device = "cuda"}))
  end)
end)

-- ---- reserved storage (host/runtime/tensor.h: ml_storage_reserve) -----------

describe("reserved storage", function()
  local function cpu() return m.mem.stats().cpu end
  local function optim_bytes() return cpu().current.optim or 0 end

  it("reserve charges nothing; commit_ charges the view's bytes as zeros; free credits them", function()
    collectgarbage(); collectgarbage()
    local base = optim_bytes()
    local r = m.mem.scope("optim", m.reserve, {4, 100}, {dtype = "f64"})
    assert.are.equal("optim", r:category())
    assert.are.same({4, 100}, r:shape())
    assert.are.equal(base, optim_bytes())
    assert.is_false(r:committed())
    assert.matches("tensor%(%[4,100%], f64, cpu, reserved, not committed%)", tostring(r))
    local row = r:select(1, 2)
    assert.is_true(rawequal(row, row:commit_()))
    assert.are.equal(base + 800, optim_bytes())
    assert.is_true(row:committed())
    assert.is_false(r:committed())
    assert.are.equal(0, row:abs():max():item())
    r:select(1, 3):commit_()                          -- adjacent commits cover a view of both
    assert.is_true(r:narrow(1, 2, 2):committed())
    assert.is_false(r:narrow(1, 2, 3):committed())
    assert.are.equal(0, r:narrow(1, 2, 2):sum():item())
    assert.is_true(m.zeros({2}):committed())          -- a storage that was not reserved
    r, row = nil, nil
    collectgarbage(); collectgarbage()
    assert.are.equal(base, optim_bytes())
  end)

  it("refuses ops on uncommitted elements, overlapping commits and bad input, naming them", function()
    local r = m.reserve({16})
    local v = r:view_at(4, {4})
    assert.matches("moelua.add: a: the tensor is reserved but not committed", errmsg(function() return v + 1 end))
    assert.matches("Tensor:copy_: .*reserved but not committed", errmsg(v.copy_, v, m.zeros({4})))
    assert.matches("Tensor:item: argument #1: the tensor is reserved but not committed",
                   errmsg(v.item, r:view_at(0, {1})))
    assert.matches("Tensor:totable: argument #1: the tensor is reserved but not committed", errmsg(v.totable, v))
    v:commit_()
    assert.are.same({0, 0, 0, 0}, v:totable())
    assert.matches("Tensor:sum: t: the tensor is reserved but not committed",
                   errmsg(function() return r:sum() end))
    assert.matches("Tensor:commit_: bytes %[24, 40%) overlap the committed bytes %[16, 32%)",
                   errmsg(v.commit_, r:view_at(6, {4})))
    assert.matches("Tensor:commit_: t must be contiguous", errmsg(v.commit_, m.reserve({4, 4}):t()))
    assert.matches("Tensor:commit_: the storage is not reserved", errmsg(v.commit_, m.zeros({2})))
    assert.matches("Tensor:commit_: argument #1: expected a tensor, got number", errmsg(v.commit_, 3))
    assert.matches("Tensor:committed: argument #1: expected a tensor, got no value", errmsg(v.committed))
    assert.matches("moelua.reserve: size of dim 1 is negative", errmsg(m.reserve, {-1}))
    assert.matches("moelua.reserve: unknown option 'dtpye'", errmsg(m.reserve, {2}, {dtpye = "f32"}))
    assert.matches("Tensor:release_storage: a reserved storage is committed range by range",
                   errmsg(r.release_storage, r))
    local f = m.reserve({2})
    f:free()
    assert.matches("Tensor:commit_: argument #1: the tensor was freed", errmsg(f.commit_, f))
    if not m.cuda_available() then
      assert.matches("moelua.reserve: device cuda is not available", errmsg(m.reserve, {2}, {device = "cuda"}))
    end
  end)

  it("a commit is refused by a budget with the ledger table, like an allocation", function()
    collectgarbage(); collectgarbage()
    local r = m.mem.scope("optim", m.reserve, {1 << 20})   -- 4 MiB, over the budget below
    local old = m.mem.budget({total = cpu().total + 65536})
    local ok1, err1 = pcall(function() return r:view_at(0, {8192}):commit_() end)   -- 32 KiB fits
    local ok2, err2 = pcall(function() return r:view_at(8192, {1 << 19}):commit_() end)
    m.mem.budget(old)
    assert.is_true(ok1, tostring(err1))
    assert.is_false(ok2)
    assert.matches("Tensor:commit_: committing 2.00 MiB %(optim%) on cpu would exceed the total budget of", err2)
    assert.matches("memory ledger %(cpu%)", err2)
    assert.is_false(r:view_at(8192, {1}):committed())      -- a refused commit commits nothing
  end)

  it("takes resident memory only as it is committed (a large reservation)", function()
    collectgarbage(); collectgarbage()
    local rss0 = cpu().rss
    local r = m.reserve({64 << 20})                  -- 256 MiB of f32, reserved
    local rss1 = cpu().rss
    r:view_at(0, {1 << 20}):commit_()                -- 4 MiB committed
    local rss2 = cpu().rss
    assert.is_true(rss1 - rss0 < (16 << 20), "reserving took " .. (rss1 - rss0) .. " bytes")
    assert.is_true(rss2 - rss1 >= (3 << 20) and rss2 - rss1 < (32 << 20),
                   "committing 4 MiB took " .. (rss2 - rss1) .. " bytes")
  end)
end)
