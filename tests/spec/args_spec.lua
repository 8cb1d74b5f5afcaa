-- Argument counts: a binding refuses arguments it does not take (README,
-- Tensors), naming its count and the first extra one, while calls with the
-- most arguments it takes, and with trailing nils, still work. One or more
-- bindings of every host/bindings/l_*.c file, and the messages that name
-- what the user gave (option 'out', a method's integer arguments).
local m = require "moelua"
local support = require "tests.support"
local errmsg, has = support.errmsg, support.has

local ops = require "moelua.ops"
local mem = require "moelua.mem"
local pool = require "moelua.pool"
local unit = require "moelua.unit"

-- errmsg without the position a Lua caller would add (C bindings add none).
local function refused(want, f, ...)
  assert.are.equal(want, errmsg(f, ...))
end

describe("moelua.ops", function()
  local x = m.randn({3, 2, 4})

  it("refuses an extra argument to every function", function()
    refused("moelua.ops.attention_forward: takes at most 3 arguments, got 4 (#4 is a table)",
            ops.attention_forward, x, x, x, {causal = false})
    refused("moelua.ops.rmsnorm_forward: takes at most 3 arguments, got 4 (#4 is a string)",
            ops.rmsnorm_forward, x, m.ones(4), 1e-5, "junk")
    refused("moelua.ops.rope_forward: takes at most 2 arguments, got 3 (#3 is a string)",
            ops.rope_forward, x, {}, "junk")
    refused("moelua.ops.rope_backward: takes at most 2 arguments, got 3 (#3 is a number)",
            ops.rope_backward, x, nil, 1)
    local ids = m.tensor({0, 1}, {dtype = "i64"})
    refused("moelua.ops.embedding_forward: takes at most 2 arguments, got 3 (#3 is a number)",
            ops.embedding_forward, ids, m.randn({5, 4}), 1)
    refused("moelua.ops.cross_entropy_forward: takes at most 4 arguments, got 5 (#5 is a boolean)",
            ops.cross_entropy_forward, m.randn({2, 4}), m.randn({5, 4}), ids, {}, true)
  end)

  it("takes the most arguments, and trailing nils", function()
    local y, rstd = ops.rmsnorm_forward(x, m.ones(4), 1e-5)
    assert.are.same({3, 2, 4}, y:shape())
    assert.are.same({6}, rstd:shape())
    assert.are.same({3, 2, 4}, ops.rmsnorm_forward(x, m.ones(4), nil, nil, nil):shape())
    assert.are.same({3, 2, 4}, ops.rope_forward(x, {theta = 500}):shape())
    assert.are.same({3, 2, 4}, ops.attention_forward(x, x, x, nil):shape())
  end)

  it("names a bad option 'out' as the user gave it", function()
    assert.are.equal("moelua.ops.rope_forward: option 'out' must be f32, got f64",
                     errmsg(ops.rope_forward, x, {out = m.zeros(3, 2, 4, {dtype = "f64"})}))
    assert.are.equal("moelua.ops.rope_forward: option 'out' is [3,2,2] but must be [3,2,4]",
                     errmsg(ops.rope_forward, x, {out = m.zeros(3, 2, 2)}))
    assert.are.equal("moelua.ops.rope_backward: option 'out' must be f32, got f64",
                     errmsg(ops.rope_backward, x, {out = x:to("f64")}))
    local big = m.randn({5, 2, 4})
    assert.are.equal("moelua.ops.rope_forward: option 'out' overlaps x but is not x itself",
                     errmsg(ops.rope_forward, big:narrow(1, 1, 4), {out = big:narrow(1, 2, 4)}))
    -- a bad x is still x's error, whatever out is
    assert.are.equal("moelua.ops.rope_forward: x must have 3 dims, got 2",
                     errmsg(ops.rope_forward, m.randn({2, 4}), {out = m.zeros(2, 2, 4)}))
    local y = m.zeros(3, 2, 4)
    assert.are.equal(y, ops.rope_forward(x, {out = y}))
    assert.are.equal(x, ops.rope_forward(x, {out = x}))   -- in place
  end)
end)

describe("tensor methods and functions", function()
  it("refuse an extra argument", function()
    local t = m.zeros(2, 3)
    refused("Tensor:release_storage: takes at most 1 argument, got 2 (#2 is a number)",
            t.release_storage, t, "a", 1)
    refused("Tensor:acquire_storage: takes no arguments, got 1 (#1 is a number)", t.acquire_storage, t, 1)
    refused("Tensor:storage_released: takes no arguments, got 1 (#1 is a number)",
            t.storage_released, t, 1)
    local r = m.reserve({4})
    refused("Tensor:commit_: takes no arguments, got 1 (#1 is a number)", r.commit_, r, 1)
    refused("Tensor:committed: takes no arguments, got 1 (#1 is a number)", t.committed, t, 1)
    refused("Tensor:free: takes no arguments, got 1 (#1 is a number)", t.free, t, 1)
    refused("Tensor:narrow: takes at most 3 arguments, got 4 (#4 is a number)", t.narrow, t, 1, 1, 1, 9)
    refused("Tensor:dim: takes no arguments, got 1 (#1 is a string)", t.dim, t, "x")
    refused("moelua.add: takes at most 2 arguments, got 3 (#3 is a number)", m.add, t, t, 1)
    refused("moelua.manual_seed: takes at most 1 argument, got 2 (#2 is a number)", m.manual_seed, 1, 2)
    assert.is_true(t:storage_released() == false)   -- the refusals changed nothing
  end)

  it("take their most arguments, and trailing nils", function()
    local t = m.zeros(2, 3)
    assert.are.same({2, 1}, t:narrow(2, 2, 1):shape())
    assert.are.same({3, 2}, t:transpose(1, 2, nil):shape())
    assert.are.equal(2, t:dim(nil))
    t:release_storage("moved away", nil)
    assert.is_true(t:storage_released())
    t:acquire_storage()
    assert.is_false(t:storage_released(nil))
    local r = m.reserve({4})
    assert.are.equal(r, r:commit_(nil))
    assert.is_true(r:committed())
    assert.are.same({{1, 2}}, m.tensor({{1, 2}}, {dtype = "f64"}):totable())
    t:free(nil)
    assert.are.equal("tensor(freed)", tostring(t))
  end)

  it("refuse what is not an options table where one is taken", function()
    refused("moelua.tensor: options must be a table, got string", m.tensor, {1, 2}, "f64")
    refused("moelua.arange: argument #2: expected an options table {dtype =, device =}, got string",
            m.arange, 3, "f64")
    refused("moelua.arange: argument #3: unexpected number after the options table",
            m.arange, 3, {dtype = "f64"}, 1)
    assert.are.same({0, 2, 4}, m.arange(0, 6, 2, {dtype = "i64"}):totable())
  end)
end)

describe("moelua.mem", function()
  it("refuses an extra argument", function()
    refused("moelua.mem.format_bytes: takes at most 1 argument, got 2 (#2 is a number)",
            mem.format_bytes, 10, 20)
    refused("moelua.mem.phase: takes at most 1 argument, got 2 (#2 is a string)", mem.phase, "a", "b")
    refused("moelua.mem.report: takes at most 1 argument, got 2 (#2 is a string)", mem.report, "cpu", "x")
    refused("moelua.mem.empty_cache: takes no arguments, got 1 (#1 is a number)", mem.empty_cache, 1)
  end)

  it("takes the most arguments, and trailing nils", function()
    assert.are.equal("10 B", mem.format_bytes(10, nil))
    assert.are.equal("string", type(mem.report("cpu")))
    mem.empty_cache(nil)
  end)
end)

describe("moelua.pool", function()
  it("refuses an extra argument", function()
    refused("moelua.pool.new: takes at most 2 arguments, got 3 (#3 is a number)", pool.new, 100, {}, 5)
    local p = pool.new(1024)
    refused("Pool:rewind: takes at most 1 argument, got 2 (#2 is a number)", p.rewind, p, 0, 1)
    refused("Pool:mark: takes no arguments, got 1 (#1 is a number)", p.mark, p, 1)
    refused("Pool:close: takes no arguments, got 1 (#1 is a boolean)", p.close, p, true)
    p:close()
  end)

  it("names the method for a bad integer argument", function()
    local p = pool.new(1024)
    refused("Pool:rewind: argument #2 (mark) must be an integer, got a fraction", p.rewind, p, 0.5)
    refused("Pool:rewind: argument #2 (mark) must be an integer, got string", p.rewind, p, "x")
    refused("Pool:reserve: argument #2 (bytes) must be an integer, got no value", p.reserve, p)
    p:rewind(0, nil)
    p:close(nil)
  end)
end)

describe("moelua.unit", function()
  local u = unit.new("u", {{name = "a", shape = {2, 3}}, {name = "b", shape = {4}}})

  it("refuses an extra argument", function()
    refused("Unit:numel: takes no arguments, got 1 (#1 is a number)", u.numel, u, 1)
    refused("Unit:partition: takes at most 2 arguments, got 3 (#3 is a number)", u.partition, u, 0, 2, 1)
    refused("moelua.unit.new: takes at most 2 arguments, got 3 (#3 is a string)", unit.new, "v", {}, "x")
  end)

  it("names the method for a bad integer argument", function()
    refused("Unit:partition: argument #2 (rank) must be an integer, got a fraction", u.partition, u, 0.5, 2)
    refused("Unit:pieces: argument #3 (len) must be an integer, got a fraction", u.pieces, u, 0, 1.5)
    refused("Unit:pieces: argument #2 (offset) must be an integer, got string", u.pieces, u, "a", 1)
  end)

  it("takes the most arguments, and trailing nils", function()
    assert.are.equal(10, u:numel(nil))
    assert.are.same({shard = 5, padded = 10, offset = 5, len = 5}, u:partition(1, 2, nil))
    assert.are.equal(2, #u:pieces(4, 4))
  end)
end)

describe("the other libraries", function()
  it("refuse an extra argument", function()
    local fs = require "moelua.fs"
    refused("moelua.fs.stat: takes at most 1 argument, got 2 (#2 is a number)", fs.stat, ".", 1)
    local dist = require "moelua.dist"
    refused("moelua.dist.rank: takes no arguments, got 1 (#1 is a number)", dist.rank, 1)
    local router = require "moelua.router"
    refused("moelua.router.scratch_bytes: takes at most 5 arguments, got 6 (#6 is a number)",
            router.scratch_bytes, 4, 8, 4, 16, true, 1)
    local experts = require "moelua.experts"
    refused("moelua.experts.dispatch: takes at most 3 arguments, got 4 (#4 is a number)",
            experts.dispatch, m.zeros({2, 1}, {dtype = "i64"}), 4, {}, 1)
    local optim_c = require "moelua.optim_c"
    refused("moelua.optim_c.grad_norm: takes at most 1 argument, got 2 (#2 is a number)",
            optim_c.grad_norm, {m.ones(3)}, 2)
    local io = require "moelua.io"
    refused("moelua.io.open: takes at most 1 argument, got 2 (#2 is a number)", io.open, "x", 1)
    local bench = require "moelua.bench"
    refused("moelua.bench.now: takes at most 1 argument, got 2 (#2 is a number)", bench.now, "cpu", 1)
    local host = require "moelua.host"
    refused("moelua.host.take_interrupt: takes no arguments, got 1 (#1 is a number)", host.take_interrupt, 1)
  end)

  it("take their most arguments, and trailing nils", function()
    local fs = require "moelua.fs"
    assert.are.equal("dir", fs.stat(".", nil).type)
    local router = require "moelua.router"
    assert.are.equal("number", type(router.scratch_bytes(4, 8, 4, 16, true, nil)))
    local optim_c = require "moelua.optim_c"
    assert.is_true(math.abs(optim_c.grad_norm({m.ones(4)}, nil) - 2) < 1e-12)
    local dist = require "moelua.dist"
    assert.are.equal(0, dist.rank(nil))
  end)
end)

describe("shapes given as integers", function()
  it("refuse what follows the shape, and name a size or index that is not an integer", function()
    local t = m.zeros(6)
    refused("Tensor:view: takes at most 2 arguments, got 3 (#3 is a string)", t.view, t, 2, 3, "x")
    refused("Tensor:view: takes at most 1 argument, got 2 (#2 is a number)", t.view, t, {2, 3}, 1)
    refused("Tensor:view: size of dim 1 must be an integer, got a fraction", t.view, t, 2.5, 3)
    refused("Tensor:view_at: takes at most 2 arguments, got 3 (#3 is a number)", t.view_at, t, 0, {2, 3}, 5)
    refused("Tensor:reshape: takes at most 2 arguments, got 3 (#3 is a table)", t.reshape, t, 3, 2, {})
    refused("Tensor:narrow: argument #3 (start) must be an integer, got a fraction", t.narrow, t, 1, 1.5, 2)
    refused("moelua.manual_seed: argument #1 (seed) must be an integer, got string", m.manual_seed, "x")
    refused("moelua.mem.format_bytes: argument #1 (n) must be an integer, got a fraction", mem.format_bytes, 1.5)
    local p = pool.new(1024)
    refused("Pool:tensor: takes at most 2 arguments, got 3 (#3 is a number)", p.tensor, p, {2}, {}, 1)
    p:close()
    assert.are.same({2, 3}, t:view(2, 3):shape())
    assert.are.same({3, 2}, t:view({3, -1}):shape())
    assert.are.same({2, 3}, t:view_at(0, 2, 3):shape())
    assert.are.same({3, 2}, t:reshape(3, 2, nil):shape())
  end)
end)

describe("a missing or wrong argument of a function or table type", function()
  it("is named with the function and the argument, not as Lua's 'bad argument'", function()
    local host = require "moelua.host"
    refused("moelua.mem.budget: argument #1 (budgets) must be a table, got no value", mem.budget)
    refused("moelua.mem.phase: argument #1 (phase) must be a string, got no value", mem.phase)
    refused("moelua.mem.scope: the category must be a string, got number", mem.scope, 1, function() end)
    refused("moelua.mem.scope: argument #2 (fn) must be a function, got nil", mem.scope, "acts", nil)
    refused("moelua.mem.plan: argument #1 (fn) must be a function, got number", mem.plan, 5)
    refused("moelua.host.hold_interrupts: argument #1 (fn) must be a function, got no value", host.hold_interrupts)
    refused("moelua.unit.new: argument #2 (segments) must be a table, got string", unit.new, "u", "x")
    refused("moelua.philox4x32_10: argument #2 (key) must be a table, got nil", m.philox4x32_10, {1, 2, 3, 4}, nil)
    refused("Tensor:normal_: argument #1 (options) must be a table, got number", m.zeros({2}).normal_, m.zeros({2}), 3)
  end)
end)
