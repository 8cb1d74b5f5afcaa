-- moelua.unit (host/bindings/l_unit.c) and released storage
-- (Tensor:release_storage / acquire_storage / storage_released in
-- host/bindings/l_tensor.c): the segment table, partitions, pieces, views
-- of a flat buffer, bad input with its messages; a view used after its
-- storage was released is an error that says why, usable again after an
-- acquire; the ledger's bytes through release and acquire, inside a memory
-- plan on the plan's books, and a budget refusing an acquire.
local m = require "moelua"
local unit = require "moelua.unit"
local mem = m.mem
local support = require "tests.support"
local errmsg, has = support.errmsg, support.has

local function cpu() return mem.stats().cpu end

local with_budget = support.with_budget

local function example()
  return unit.new("layers.0.dense", {
    {name = "q", shape = {64, 64}},
    {name = "input_layernorm", shape = {64}, weight_decay = 0},
    {name = "wg", shape = {8, 64}, lr_mult = 0.1, frozen = false},
    {name = "gate_up", shape = {8, 256, 64}, experts = 8},
  })
end

local N = 64 * 64 + 64 + 8 * 64 + 8 * 256 * 64

describe("unit.new", function()
  it("lays the segments out back to back", function()
    local u = example()
    assert.are.equal("moelua.Unit", getmetatable(u).__name)
    assert.are.equal("layers.0.dense", u:name())
    assert.are.equal(N, u:numel())
    assert.are.equal(4, #u)
    assert.are.equal("Unit layers.0.dense (" .. N .. " elements, 4 segments)", tostring(u))
    local s = u:segments()
    assert.are.same({name = "q", offset = 0, numel = 4096, shape = {64, 64}, lr_mult = 1,
                     frozen = false}, s[1])
    assert.are.same({name = "input_layernorm", offset = 4096, numel = 64, shape = {64},
                     weight_decay = 0, lr_mult = 1, frozen = false}, s[2])
    assert.are.same({name = "wg", offset = 4160, numel = 512, shape = {8, 64}, lr_mult = 0.1,
                     frozen = false}, s[3])
    assert.are.same({name = "gate_up", offset = 4672, numel = 131072, shape = {8, 256, 64},
                     lr_mult = 1, frozen = false, experts = 8}, s[4])
    assert.are.same(s[3], u:segment("wg"))
    assert.is_nil(u:segment("nope"))
  end)

  it("keeps frozen segments and a unit of none", function()
    local u = unit.new("head", {{name = "w", shape = {3}, frozen = true}})
    assert.is_true(u:segment("w").frozen)
    local empty = unit.new("nothing", {})
    assert.are.equal(0, empty:numel())
    assert.are.same({shard = 0, padded = 0, offset = 0, len = 0}, empty:partition(1, 2))
  end)

  it("refuses bad input with a message naming the segment", function()
    has(errmsg(unit.new, {}, {}), "argument #1 (name) must be a string, got table")
    has(errmsg(unit.new, "u"), "argument #2 (segments) must be a table, got no value")
    has(errmsg(unit.new, "", {}), "moelua.unit.new: a unit name must have 1 to 95 characters")
    has(errmsg(unit.new, "u", {42}), "moelua.unit.new: segment #1: expected a table, got number")
    has(errmsg(unit.new, "u", {{shape = {2}}}), "moelua.unit.new: segment #1: name must be a string, got nil")
    has(errmsg(unit.new, "u", {{name = "", shape = {2}}}),
        "moelua.unit.new: segment #1: name must have 1 to 95 characters, got 0")
    has(errmsg(unit.new, "u", {{name = "a"}}), "moelua.unit.new: segment #1: shape must be a table, got nil")
    has(errmsg(unit.new, "u", {{name = "a", shape = {2}}, {name = "b", shape = {2, 0}}}),
        "moelua.unit.new: segment 'b': size of dim 2 must be >= 1, got 0")
    has(errmsg(unit.new, "u", {{name = "a", shape = {-2}}}),
        "moelua.unit.new: segment #1: size of dim 1 is negative (-2)")
    has(errmsg(unit.new, "u", {{name = "a", shape = {1.5}}}),
        "moelua.unit.new: segment #1: size of dim 1 must be an integer, got a fraction")
    has(errmsg(unit.new, "u", {{name = "a", shape = {2}}, {name = "a", shape = {3}}}),
        "moelua.unit.new: segment 'a' appears twice")
    has(errmsg(unit.new, "u", {{name = "a", shape = {2}, bias = 1}}),
        "moelua.unit.new: segment #1: unknown option 'bias' (expected one of: name, shape, weight_decay, lr_mult, frozen, experts)")
    has(errmsg(unit.new, "u", {{name = "a", shape = {4, 2}, experts = 2}}),
        "moelua.unit.new: segment 'a': experts must be 0 or the size of dim 1 (4), got 2")
    has(errmsg(unit.new, "u", {{name = "a", shape = {4}, experts = -1}}),
        "moelua.unit.new: segment #1: option 'experts' must be in [0, 2147483647], got -1")
    has(errmsg(unit.new, "u", {{name = "a", shape = {4}, weight_decay = -0.1}}),
        "moelua.unit.new: segment 'a': weight_decay must be finite and >= 0, got -0.1")
    has(errmsg(unit.new, "u", {{name = "a", shape = {4}, lr_mult = "x"}}),
        "moelua.unit.new: segment #1: option 'lr_mult' must be a number, got string")
    has(errmsg(unit.new, "u", {{name = "a", shape = {4}, frozen = 1}}),
        "moelua.unit.new: segment #1: option 'frozen' must be a boolean, got number")
    has(errmsg(unit.new, "u", {{name = "a", shape = {1 << 40, 1 << 30}}}),
        "moelua.unit.new: segment #1: shape has too many elements")
    has(errmsg(unit.new, "u", {{name = "a", shape = {1 << 62}}, {name = "b", shape = {1 << 62}}}),
        "moelua.unit.new: segment 'b': the unit would have more than")
  end)
end)

describe("Unit:partition", function()
  it("splits 10 elements into equal, padded shards over 1 to 4 ranks", function()
    local u = unit.new("u", {{name = "a", shape = {4}}, {name = "b", shape = {6}}})
    local lens = {{10}, {5, 5}, {4, 4, 2}, {3, 3, 3, 1}}
    for world = 1, 4 do
      local shard = (10 + world - 1) // world
      for rank = 0, world - 1 do
        assert.are.same({shard = shard, padded = shard * world, offset = rank * shard,
                         len = lens[world][rank + 1]}, u:partition(rank, world))
      end
    end
    local nine = unit.new("u", {{name = "a", shape = {9}}})
    assert.are.same({shard = 3, padded = 12, offset = 9, len = 0}, nine:partition(3, 4))
  end)

  it("refuses a rank or world out of range", function()
    local u = example()
    has(errmsg(u.partition, u, 0, 0), "Unit:partition: world must be in [1, 2147483647], got 0")
    has(errmsg(u.partition, u, 4, 4), "Unit:partition: rank must be in [0, 3], got 4")
    has(errmsg(u.partition, u, -1, 4), "Unit:partition: rank must be in [0, 3], got -1")
    has(errmsg(u.partition, u, 0), "Unit:partition: argument #3 (world) must be an integer, got no value")
    has(errmsg(u.partition, {}, 0, 1), "(moelua.Unit expected, got table)")
  end)
end)

describe("Unit:pieces", function()
  it("cuts a range at the segment boundaries; padding belongs to none", function()
    local u = example()
    assert.are.same({
      {segment = "q", index = 1, offset = 4000, seg_offset = 4000, n = 96},
      {segment = "input_layernorm", index = 2, offset = 4096, seg_offset = 0, n = 64},
      {segment = "wg", index = 3, offset = 4160, seg_offset = 0, n = 512},
      {segment = "gate_up", index = 4, offset = 4672, seg_offset = 0, n = 28},
    }, u:pieces(4000, 700))
    assert.are.same({{segment = "wg", index = 3, offset = 4170, seg_offset = 10, n = 5}},
                    u:pieces(4170, 5))
    local p = u:partition(3, 4)   -- the last shard runs into the padding
    local pieces = u:pieces(p.offset, p.shard)
    assert.are.equal(1, #pieces)
    assert.are.equal(p.len, pieces[1].n)
    assert.are.same({}, u:pieces(N, 10))
    assert.are.same({}, u:pieces(0, 0))
  end)

  it("refuses a negative or overflowing range", function()
    local u = example()
    has(errmsg(u.pieces, u, -1, 2), "Unit:pieces: offset must be >= 0, got -1")
    has(errmsg(u.pieces, u, 0, -2), "Unit:pieces: len must be in [0, ")
    has(errmsg(u.pieces, u, 10, math.maxinteger), "Unit:pieces: len must be in [0, ")
    has(errmsg(u.pieces, u, "a", 1), "Unit:pieces: argument #2 (offset) must be an integer, got string")
  end)
end)

describe("Unit:views", function()
  it("gives each segment its view of a flat buffer", function()
    local u = unit.new("u", {{name = "a", shape = {2, 3}}, {name = "b", shape = {4}}})
    local flat = m.arange(0, 12)
    local v = u:views(flat)
    assert.are.same({2, 3}, v.a:shape())
    assert.are.equal(6, v.b:storage_offset())
    assert.is_true(v.a:same_storage(flat))
    assert.are.same({6, 7, 8, 9}, v.b:totable())
    v.a:fill_(-1)
    assert.are.equal(-1, flat:totable()[6])
    local w = u:views(m.zeros({20}):narrow(1, 5, 10))   -- a view at an offset works too
    assert.are.equal(4 + 6, w.b:storage_offset())
  end)

  it("refuses a flat buffer of the wrong form", function()
    local u = unit.new("u", {{name = "a", shape = {2, 3}}, {name = "b", shape = {4}}})
    has(errmsg(u.views, u, m.zeros({9})), "Unit:views: flat has 9 elements, unit u needs 10")
    has(errmsg(u.views, u, m.zeros({2, 5})), "Unit:views: flat must be a contiguous 1-D tensor, got 2 dims")
    has(errmsg(u.views, u, m.zeros({10, 2}):select(2, 1)),
        "Unit:views: flat must be a contiguous 1-D tensor, got 1 dims (not contiguous)")
    has(errmsg(u.views, u, 3), "Unit:views: argument #2: expected a tensor, got number")
    local freed = m.zeros({10})
    freed:free()
    has(errmsg(u.views, u, freed), "Unit:views: argument #2: the tensor was freed")
  end)
end)

describe("released storage", function()
  local WHY = "unit layers.0.dense is released (ZeRO-3 gathers it only while in use)"

  it("returns the bytes; every view is then an error that says why", function()
    collectgarbage()
    local base = cpu().current.params
    local u = unit.new("u", {{name = "a", shape = {2, 3}}, {name = "b", shape = {4}}})
    local flat = mem.scope("params", m.zeros, {10})
    local v = u:views(flat)
    assert.are.equal(base + 40, cpu().current.params)
    assert.is_false(flat:storage_released())
    flat:release_storage(WHY)
    assert.are.equal(base, cpu().current.params)
    assert.is_true(flat:storage_released())
    assert.is_true(v.a:storage_released())   -- views share the storage
    has(errmsg(v.a.sum, v.a), "Tensor:sum: argument #1: " .. WHY)
    has(errmsg(v.b.copy_, v.b, m.ones({4})), WHY)
    has(errmsg(m.add, m.ones({4}), v.b), WHY)
    -- views and metadata need no memory: a model builds its views of a released unit
    local again = u:views(flat)
    assert.are.same({4}, again.b:shape())
    assert.are.same({2}, flat:narrow(1, 1, 2):shape())
    has(errmsg(again.b.sum, again.b), WHY)
    assert.are.equal("tensor([4], f32, cpu, released)", tostring(v.b))
    flat:release_storage("again")            -- already released: nothing happens
    assert.are.equal(base, cpu().current.params)
    has(errmsg(v.a.sum, v.a), WHY)

    v.a:acquire_storage()                    -- through any view: the one storage
    assert.are.equal(base + 40, cpu().current.params)
    assert.is_false(flat:storage_released())
    v.b:copy_(m.ones({4}))                   -- usable again (contents were undefined)
    assert.are.equal(4, v.b:sum():item())
    flat:acquire_storage()                   -- holding its memory: nothing happens
    assert.are.equal(base + 40, cpu().current.params)
    assert.are.equal("params", v.a:category())
  end)

  it("a released storage gives nothing more back when freed", function()
    collectgarbage()
    local base, frees = cpu().current.params, cpu().frees.params
    do
      local t = mem.scope("params", m.zeros, {100})
      t:release_storage()
      has(errmsg(t.sum, t), "its memory was released")
    end
    collectgarbage()
    collectgarbage()
    assert.are.equal(base, cpu().current.params)
    assert.are.equal(frees + 1, cpu().frees.params)
  end)

  it("an acquire over a budget is the allocation error with the ledger", function()
    collectgarbage()
    local flat = mem.scope("params", m.zeros, {1024})
    flat:release_storage("r")
    local msg
    with_budget({params = cpu().current.params + 4095}, function()
      msg = errmsg(flat.acquire_storage, flat)
    end)
    has(msg, "Tensor:acquire_storage: allocating 4.00 KiB (params) on cpu would exceed the params budget of")
    has(msg, "memory ledger (cpu)")
    assert.is_true(flat:storage_released())
    has(errmsg(flat.sum, flat), "r")
    flat:acquire_storage()
    assert.is_false(flat:storage_released())
  end)

  it("refuses pool views and freed tensors", function()
    local p = m.pool.new(4096)
    local pv = p:tensor({4})
    has(errmsg(pv.release_storage, pv, "x"),
        "Tensor:release_storage: a pool view's memory belongs to its pool (rewind the pool instead)")
    assert.is_false(pv:storage_released())
    p:close()
    local t = m.zeros({3})
    t:free()
    has(errmsg(t.release_storage, t), "Tensor:release_storage: argument #1: the tensor was freed")
    has(errmsg(t.acquire_storage, t), "Tensor:acquire_storage: argument #1: the tensor was freed")
    has(errmsg(t.storage_released, t), "Tensor:storage_released: argument #1: the tensor was freed")
    has(errmsg(m.zeros({3}).release_storage, m.zeros({3}), {}), "(string expected, got table)")
  end)

  it("inside a memory plan, acquire and release balance on the plan's books", function()
    collectgarbage()
    local flat = mem.scope("params", m.zeros, {256})   -- 1 KiB, made outside the plan
    local v = unit.new("u", {{name = "w", shape = {16, 16}}}):views(flat).w
    flat:release_storage("between steps")
    local real = cpu().current.params
    local books = mem.plan(function()
      flat:acquire_storage()
      v:fill_(1)
      flat:release_storage("after use")
      local t = mem.scope("params", m.zeros, {64})      -- made and released in the plan
      t:release_storage()
    end)
    assert.is_table(books)
    assert.are.equal(real, books.cpu.current.params)
    assert.are.equal(real + 1024, books.cpu.peak.params)
    assert.are.equal(real, cpu().current.params)   -- nothing real was allocated
    assert.is_true(flat:storage_released())
    has(errmsg(v.sum, v), "after use")
    flat:acquire_storage()                          -- real memory again after the plan
    assert.are.equal(real + 1024, cpu().current.params)
    v:fill_(2)
    assert.are.equal(512, v:sum():item())
  end)

  it("a storage acquired in a plan and kept is refused like a kept plan tensor", function()
    collectgarbage()
    local flat = mem.scope("params", m.zeros, {16})
    flat:release_storage("r")
    local ok, why = mem.plan(function() flat:acquire_storage() end)
    assert.is_nil(ok)
    has(why, "1 tensor or pool of the plan is still referenced after it")
    has(errmsg(flat.sum, flat), "made inside a memory plan that has ended")
    flat:release_storage("back")                    -- releasing it ends that
    assert.is_true(type(mem.plan(function() end)) == "table")
    flat:acquire_storage()
    assert.are.equal(0, flat:fill_(0):sum():item())
  end)
end)
