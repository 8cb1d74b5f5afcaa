-- moelua.pool (host/bindings/l_pool.c): pools as seen from Lua. Views, mark/rewind
-- in LIFO order, stale views after a rewind (also when the bytes are handed
-- out again), growth and its refusal by the ledger, pool bytes in the
-- ledger under `pool`, closing, CUDA pools where a GPU exists, and bad input
-- to every function with the message it must give.
local m = require "moelua"
local pool, mem = m.pool, m.mem
local support = require "tests.support"
local errmsg, has = support.errmsg, support.has

local function pool_bytes(dev)
  return mem.stats()[dev or "cpu"].current.pool
end

describe("pool.new", function()
  it("makes a moelua.Pool whose block is charged to the ledger under pool", function()
    collectgarbage()
    local before = pool_bytes()
    local p = pool.new(4096)
    assert.are.equal("moelua.Pool", getmetatable(p).__name)
    assert.are.equal(before + 4096, pool_bytes())
    local s = p:stats()
    assert.are.same({capacity = 4096, used = 0, high_water = 0, utilisation = 0, overflows = 0,
                     blocks = 1, slots = 0, grow = false, device = "cpu"}, s)
    p:close()
    assert.are.equal(before, pool_bytes())
  end)

  it("rounds the block up to 64 bytes and takes grow and device options", function()
    local p = pool.new(1000, {grow = true, device = "cpu"})
    local s = p:stats()
    assert.are.equal(1024, s.capacity)
    assert.is_true(s.grow)
    assert.are.equal("cpu", s.device)
    p:close()
  end)

  it("prints its device, usage and policy", function()
    local p = pool.new(2048)
    p:tensor({16})
    local s = tostring(p)
    has(s, "moelua.Pool(cpu")
    has(s, "64 B used of 2.00 KiB")
    has(s, "1 slots")
    has(s, "grow=false")
    p:close()
    assert.are.equal("moelua.Pool(closed)", tostring(p))
  end)
end)

describe("Pool:tensor", function()
  it("hands out views in the pool, tagged pool, that compute like tensors", function()
    local p = pool.new(4096)
    local before = mem.stats().cpu.allocs.pool
    local a = p:tensor({2, 3})
    assert.are.same({2, 3}, a:shape())
    assert.are.equal("f32", a:dtype())
    assert.are.equal("pool", a:category())
    assert.are.equal("cpu", a:device())
    a:fill_(2)
    assert.are.same({{2, 2, 2}, {2, 2, 2}}, a:totable())
    local b = p:tensor(4, {dtype = "i64"})
    assert.are.equal("i64", b:dtype())
    b:fill_(-3)
    assert.are.same({-3, -3, -3, -3}, b:totable())
    assert.are.same({{4, 4, 4}, {4, 4, 4}}, a:add(a):totable())
    assert.are.equal(before, mem.stats().cpu.allocs.pool, "views do not allocate from the ledger")
    local s = p:stats()
    assert.are.equal(2, s.slots)
    assert.are.equal(128, s.used)         -- 24 and 32 bytes, each rounded up to 64
    assert.are.equal(128 / 4096, s.utilisation)
    p:close()
  end)

  it("views of a pool view share its bytes", function()
    local p = pool.new(1024)
    local a = p:tensor({4, 4}):fill_(0)
    a:narrow(1, 2, 1):fill_(9)
    assert.are.same({0, 0, 0, 0}, a:totable()[1])
    assert.are.same({9, 9, 9, 9}, a:totable()[2])
    assert.are.same({16}, a:reshape({16}):shape())
  end)
end)

describe("mark and rewind", function()
  it("release in LIFO order and keep the high-water mark", function()
    local p = pool.new(4096)
    local frame = p:tensor({32}):fill_(1)          -- 128 bytes
    local mark = p:mark()
    assert.are.equal(1, mark)
    local t1 = p:tensor({64})                      -- 256 bytes
    local inner = p:mark()
    local t2 = p:tensor({16})                      -- 64 bytes
    assert.are.equal(448, p:stats().used)
    p:rewind(inner)
    assert.are.equal(2, p:stats().slots)
    assert.are.same({64}, t1:shape())
    has(errmsg(t2.shape, t2), "stale pool view")
    p:rewind(mark)
    local s = p:stats()
    assert.are.equal(1, s.slots)
    assert.are.equal(128, s.used)
    assert.are.equal(448, s.high_water)
    assert.are.equal(32, #frame:totable(), "a view below the mark stays valid")
  end)

  it("a view used after its frame was rewound raises, naming the function", function()
    local p = pool.new(1024)
    local mark = p:mark()
    local v = p:tensor({8}):fill_(5)
    p:rewind(mark)
    assert.are.equal("Tensor:totable: argument #1: stale pool view (its frame was rewound)",
                     errmsg(v.totable, v))
    has(errmsg(v.fill_, v, 1), "Tensor:fill_: argument #1: stale pool view")
    local x = m.ones({8})
    has(errmsg(x.add, x, v), "argument #2: stale pool view")
    assert.are.equal("tensor(stale pool view)", tostring(v))
  end)

  it("an old view never reads the bytes handed out again after a rewind", function()
    local p = pool.new(1024)
    local mark = p:mark()
    local old = p:tensor({8}):fill_(1)
    local view = old:narrow(1, 1, 4)
    p:rewind(mark)
    local new = p:tensor({8})
    assert.are.same({1, 1, 1, 1, 1, 1, 1, 1}, new:totable(), "the same bytes are reused")
    new:fill_(7)
    has(errmsg(old.totable, old), "stale pool view")
    has(errmsg(view.totable, view), "stale pool view")
    has(errmsg(old.copy_, old, m.zeros({8})), "stale pool view")
    assert.are.same({7, 7, 7, 7, 7, 7, 7, 7}, new:totable())
  end)

  it("reset rewinds to 0", function()
    local p = pool.new(1024)
    local a, b = p:tensor({4}), p:tensor({4})
    p:reset()
    assert.are.equal(0, p:stats().slots)
    assert.are.equal(0, p:stats().used)
    assert.are.equal(128, p:stats().high_water)
    has(errmsg(a.shape, a), "stale pool view")
    has(errmsg(b.shape, b), "stale pool view")
    assert.are.same({4}, p:tensor({4}):shape())
  end)

  it("a mark above the current depth or below 0 is an error", function()
    local p = pool.new(1024)
    p:tensor({1})
    assert.are.equal("Pool:rewind: argument #2: mark 5 is above the current depth 1",
                     errmsg(p.rewind, p, 5))
    assert.are.equal("Pool:rewind: argument #2: mark must be >= 0, got -1", errmsg(p.rewind, p, -1))
    has(errmsg(p.rewind, p, "x"), "Pool:rewind: argument #2 (mark) must be an integer, got string")
    has(errmsg(p.rewind, p), "Pool:rewind: argument #2 (mark) must be an integer, got no value")
    has(errmsg(p.rewind, p, 1.5), "Pool:rewind: argument #2 (mark) must be an integer, got a fraction")
    assert.are.equal(1, p:stats().slots, "a refused rewind changes nothing")
  end)
end)

describe("overflow", function()
  it("with grow=false is an error saying what was needed and what was in use", function()
    local p = pool.new(256, {grow = false})
    local a = p:tensor({48}):fill_(3)              -- 192 bytes
    assert.are.equal("Pool:tensor: pool full: the tensor needs 128 B, 192 B of 256 B are in use (grow=false)",
                     errmsg(p.tensor, p, {20}))
    local s = p:stats()
    assert.are.equal(1, s.overflows)
    assert.are.equal(1, s.slots)
    assert.are.equal(256, s.capacity)
    assert.are.equal(48, #a:totable())
    assert.are.same({16}, p:tensor({16}):shape(), "what still fits is handed out")
  end)

  it("grow=false is the default", function()
    local p = pool.new(64)
    p:tensor({16})
    has(errmsg(p.tensor, p, {1}), "pool full")
  end)

  it("with grow=true adds a block from the ledger without moving live views", function()
    collectgarbage()
    local before = pool_bytes()
    local p = pool.new(256, {grow = true})
    local a = p:tensor({64}):fill_(3)              -- fills the first block
    local b = p:tensor({64}):fill_(4)
    local s = p:stats()
    assert.are.equal(2, s.blocks)
    assert.are.equal(512, s.capacity)
    assert.are.equal(1, s.overflows)
    assert.are.equal(before + 512, pool_bytes())
    for _, v in ipairs(a:totable()) do assert.are.equal(3, v) end
    for _, v in ipairs(b:totable()) do assert.are.equal(4, v) end
    p:reset()                                      -- a grown pool, emptied: one block of its high-water mark
    assert.are.equal(1, p:stats().blocks)
    assert.are.equal(512, p:stats().capacity)
    assert.are.equal(before + 512, pool_bytes())
    p:tensor({64}); p:tensor({64})
    assert.are.same({1, 1}, {p:stats().blocks, p:stats().overflows}, "the same step fits without growing")
  end)

  it("growth refused by the ledger is an error with the ledger table; views stay valid", function()
    collectgarbage()
    local cur = pool_bytes()
    local old = mem.budget{pool = cur + 300}
    local p = pool.new(256, {grow = true})
    local a = p:tensor({64}):fill_(6)
    local refused = mem.stats().cpu.refused
    local msg = errmsg(p.tensor, p, {1})
    mem.budget{pool = old.pool}
    has(msg, "Pool:tensor: growing the pool for the tensor (needs 64 B, 256 B of 256 B in use) on cpu would exceed the pool budget of 300 B\n")
    has(msg, "memory ledger (cpu)")
    has(msg, "at peak")
    assert.is_true(mem.stats().cpu.refused > refused)
    assert.are.equal(1, p:stats().blocks)
    assert.are.equal(cur + 256, pool_bytes())
    for _, v in ipairs(a:totable()) do assert.are.equal(6, v) end
  end)

  it("a pool the budget cannot hold is an error with the ledger table", function()
    collectgarbage()
    local old = mem.budget{pool = pool_bytes() + 1024}
    local msg = errmsg(pool.new, 4096)
    mem.budget{pool = old.pool}
    has(msg, "moelua.pool.new: allocating a pool of 4.00 KiB on cpu would exceed the pool budget of 1.00 KiB\n")
    has(msg, "memory ledger (cpu)")
  end)

  it("pool.new and growth collect garbage once and retry before refusing", function()
    collectgarbage()
    collectgarbage("stop")
    local cur = pool_bytes()
    do local dropped = pool.new(512) end           -- garbage, not yet collected
    assert.are.equal(cur + 512, pool_bytes())
    local old = mem.budget{pool = cur + 512}
    local ok, p = pcall(pool.new, 256, {grow = true})   -- fits only once `dropped` is collected
    local ok2, err2, ok3, err3
    if ok then
      p:tensor({64})                               -- fills the block
      do local dropped2 = pool.new(256) end        -- garbage again
      ok2, err2 = pcall(p.tensor, p, {1})          -- growth by 256 fits only after collecting
      ok3, err3 = pcall(p.tensor, p, {64}, {dtype = "f64"})  -- nothing left to collect
    end
    mem.budget{pool = old.pool}
    collectgarbage("restart")
    assert.is_true(ok, tostring(p))
    assert.is_true(ok2, tostring(err2))
    assert.are.equal(2, p:stats().blocks)
    assert.is_false(ok3)
    has(tostring(err3), "would exceed the pool budget")
  end)
end)

describe("Pool:reserve", function()
  it("makes an empty pool one block of the size asked, so the next step does not grow", function()
    local p = pool.new(1024, {grow = true})
    local before = pool_bytes()
    p:reserve(100000)
    local st = p:stats()
    assert.are.equal(100032, st.capacity)          -- rounded up to 64 bytes
    assert.are.equal(1, st.blocks)
    assert.are.equal(before - 1024 + 100032, pool_bytes())
    local a, b = p:tensor({12500}), p:tensor({12484})   -- 50048 + 49984 bytes (64-byte slots)
    assert.are.equal(0, p:stats().overflows)
    a, b = nil, nil
    p:reset()
    p:reserve(100000)                                -- the same size: nothing changes
    assert.are.equal(1, p:stats().blocks)
    p:reserve(512)                                   -- and it shrinks
    assert.are.equal(512, p:stats().capacity)
    assert.are.equal(before - 1024 + 512, pool_bytes())
    p:close()
  end)

  it("refuses a pool with live slots, and a budget refusal keeps the blocks", function()
    local p = pool.new(4096)
    local v = p:tensor({4})
    assert.are.equal("Pool:reserve: the pool has 1 live slot (reserve an empty pool: reset it first)",
                     errmsg(p.reserve, p, 8192))
    p:reset()
    local prev = mem.budget{total = mem.stats().cpu.total + 8192}
    local msg = errmsg(p.reserve, p, 1 << 20)
    mem.budget(prev)
    has(msg, "Pool:reserve: reserving 1.00 MiB on cpu would exceed the total budget")
    has(msg, "memory ledger (cpu)")
    assert.are.equal(4096, p:stats().capacity)
    assert.are.equal(1, p:stats().blocks)
    v = nil
    p:close()
  end)

  it("checks its arguments", function()
    local p = pool.new(64)
    has(errmsg(p.reserve, p), "Pool:reserve: argument #2 (bytes) must be an integer, got no value")
    assert.are.equal("Pool:reserve: argument #2: size must be >= 0 bytes, got -5", errmsg(p.reserve, p, -5))
    has(errmsg(p.reserve, 7, 64), "moelua.Pool expected, got number")
    p:close()
    assert.are.equal("Pool:reserve: the pool is closed", errmsg(p.reserve, p, 64))
  end)
end)

describe("closing", function()
  it("close, __close and __gc are one idempotent release", function()
    collectgarbage()
    local before = pool_bytes()
    do
      local p <close> = pool.new(8192)
      assert.are.equal(before + 8192, pool_bytes())
    end
    assert.are.equal(before, pool_bytes(), "freed at scope exit, before any collection")
    local p = pool.new(1024)
    p:close()
    p:close()
    assert.are.equal(before, pool_bytes())
    local mt = getmetatable(p)
    assert.are.equal(mt.__gc, mt.__close)
    mt.__gc(p)
    mt.__gc(42)                                    -- never raises, even on a wrong value
  end)

  it("a closed pool refuses every method", function()
    local p = pool.new(64)
    p:close()
    assert.are.equal("Pool:tensor: the pool is closed", errmsg(p.tensor, p, {1}))
    assert.are.equal("Pool:mark: the pool is closed", errmsg(p.mark, p))
    assert.are.equal("Pool:rewind: the pool is closed", errmsg(p.rewind, p, 0))
    assert.are.equal("Pool:reset: the pool is closed", errmsg(p.reset, p))
    assert.are.equal("Pool:stats: the pool is closed", errmsg(p.stats, p))
  end)

  it("views keep the bytes of a closed pool until they are collected", function()
    collectgarbage()
    local before = pool_bytes()
    local p = pool.new(1024)
    local v = p:tensor({4}):fill_(2)
    p:close()
    assert.are.same({2, 2, 2, 2}, v:totable())
    assert.are.equal(before + 1024, pool_bytes())
    v = nil
    collectgarbage()
    assert.are.equal(before, pool_bytes())
  end)

  it("a view outlives the pool object it came from", function()
    local v = pool.new(1024):tensor({3}):fill_(8)
    collectgarbage()
    collectgarbage()
    assert.are.same({8, 8, 8}, v:totable())
  end)

  it("leaks nothing when a frame fails half-way", function()
    collectgarbage()
    local before = mem.stats().cpu.total
    local ok = pcall(function()
      local p = pool.new(1024)
      local a = p:tensor({16}):fill_(1)
      local b = a:add(a)
      p:tensor({1000})                             -- pool full
      return b
    end)
    assert.is_false(ok)
    collectgarbage()
    collectgarbage()
    assert.are.equal(before, mem.stats().cpu.total)
  end)
end)

describe("devices", function()
  if m.cuda_available() then
    it("a CUDA pool works through the backend table", function()
      collectgarbage()
      local before = pool_bytes("cuda")
      local p = pool.new(1 << 20, {device = "cuda"})
      assert.are.equal(before + (1 << 20), pool_bytes("cuda"))
      local a = p:tensor({4, 256}, {dtype = "f32"}):fill_(1.5)
      assert.are.equal("cuda", a:device())
      assert.are.equal("pool", a:category())
      local host = a:to("cpu"):totable()
      assert.are.equal(1.5, host[4][256])
      local mark = p:mark()
      local b = p:tensor({8})
      p:rewind(mark)
      has(errmsg(b.to, b, "cpu"), "stale pool view")
      p:close()
      a, b = nil, nil
      collectgarbage()
      assert.are.equal(before, pool_bytes("cuda"))
    end)
  else
    it("a CUDA pool without a GPU is an error, not a crash", function()
      has(errmsg(pool.new, 1024, {device = "cuda"}), "moelua.pool.new: device cuda is not available")
    end)
  end
end)

describe("bad input", function()
  it("pool.new", function()
    has(errmsg(pool.new), "moelua.pool.new: argument #1 (bytes) must be an integer, got no value")
    has(errmsg(pool.new, "x"), "moelua.pool.new: argument #1 (bytes) must be an integer, got string")
    has(errmsg(pool.new, 1.5), "moelua.pool.new: argument #1 (bytes) must be an integer, got a fraction")
    assert.are.equal("moelua.pool.new: argument #1: size must be >= 0 bytes, got -1", errmsg(pool.new, -1))
    assert.are.equal("moelua.pool.new: options must be a table, got number", errmsg(pool.new, 64, 5))
    assert.are.equal("moelua.pool.new: unknown option 'bogus' (expected one of: grow, device)",
                     errmsg(pool.new, 64, {bogus = 1}))
    assert.are.equal("moelua.pool.new: option 'grow' must be a boolean, got number",
                     errmsg(pool.new, 64, {grow = 1}))
    has(errmsg(pool.new, 64, {device = "tpu"}), "moelua.pool.new: option 'device': unknown device 'tpu'")
    has(errmsg(pool.new, math.maxinteger), "would exceed the total budget")
  end)

  it("Pool:tensor", function()
    local p = pool.new(1024)
    has(errmsg(p.tensor, p, "x"), "Pool:tensor: argument #2: expected a shape")
    has(errmsg(p.tensor, p, {-1}), "Pool:tensor: size of dim 1 is negative (-1)")
    has(errmsg(p.tensor, p, {1.5}), "Pool:tensor: size of dim 1 must be an integer, got a fraction")
    has(errmsg(p.tensor, p, {2}, {dtype = "q8"}), "Pool:tensor: option 'dtype': unknown dtype 'q8'")
    assert.are.equal("Pool:tensor: unknown option 'device' (expected one of: dtype)",
                     errmsg(p.tensor, p, {2}, {device = "cpu"}))
    assert.are.equal("Pool:tensor: argument #3: expected an options table, got string",
                     errmsg(p.tensor, p, {2}, "f32"))
    has(errmsg(p.tensor, p, {2 ^ 40, 2 ^ 40}), "too many elements")
    has(errmsg(p.tensor, 5, {2}), "moelua.Pool expected, got number")
    has(errmsg(p.tensor, m.zeros({1}), {2}), "moelua.Pool expected")
    assert.are.equal(0, p:stats().slots, "refused requests take no slot")
  end)

  it("the other methods check self", function()
    local p = pool.new(64)
    has(errmsg(p.mark, {}), "moelua.Pool expected, got table")
    has(errmsg(p.rewind, nil, 0), "moelua.Pool expected, got nil")
    has(errmsg(p.reset, "p"), "moelua.Pool expected, got string")
    has(errmsg(p.stats, 1), "moelua.Pool expected, got number")
    has(errmsg(tostring, setmetatable({}, {__tostring = getmetatable(p).__tostring})),
        "moelua.Pool expected")
  end)
end)
