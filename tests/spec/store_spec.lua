-- moelua.store (host/bindings/l_store.c over host/runtime/store.c): slot
-- views and direct transfers, the residency policy's counters, the ledger
-- books (slots under cache on cpu, the file's bytes on the file book),
-- close / <close> / collection removing the file and crediting both books,
-- plan mode, views of a closed store, and bad input to every function.
-- The policy's corner cases and the refusals that need a child process
-- (a file-size limit) are in tests/c/test_store.c.
local m = require "moelua"
local mem = m.mem
local store = require "moelua.store"
local support = require "tests.support"
local errmsg, has = support.errmsg, support.has

-- A directory on a disk: the system's temporary directory unless it is
-- tmpfs (the store refuses that), else one under build/.
local function disk_dir()
  local dir = support.make_tmpdir()
  local p = io.popen("stat -f -c %T " .. support.shell_quote(dir))
  local fs = p:read("a")
  p:close()
  if fs:match("tmpfs") or fs:match("ramfs") then
    support.remove_dir(dir)
    dir = "build/store-spec-" .. tostring(os.time()) .. "-" .. tostring(math.random(1 << 30))
    assert(os.execute("mkdir -p " .. support.shell_quote(dir)))
  end
  return dir
end

local function exists(path)
  local f = io.open(path, "rb")
  if f then f:close() end
  return f ~= nil
end

local dir
setup(function() dir = disk_dir() end)
teardown(function() support.remove_dir(dir) end)

local n = 0
local function fresh_path()
  n = n + 1
  return dir .. "/store-" .. n
end

local function open(o)
  o.path = o.path or fresh_path()
  return store.open(o), o.path
end

describe("moelua.store", function()
  it("slot views, write and read round trip every slab", function()
    local s <close> = open{slabs = 4, slab_bytes = 40, slots = 2}
    local v0, v1 = s:slot(0), s:slot(1)
    assert.are.same({10}, v0:size())
    assert.are.equal("f32", v0:dtype())
    support.store_round_trip(s)
    local st = s:stats()
    assert.are.equal(160, st.bytes_written)
    assert.are.equal(160, st.bytes_read)
    assert.are.same({4, 40, 2}, {st.slabs, st.slab_bytes, st.slots})
    -- a bf16 view of the same bytes: each f32 1.0 (0x3f800000) is the bf16 pair 0, 1 (little-endian)
    local b = s:slot(1, "bf16")
    assert.are.same({20}, b:size())
    assert.are.equal("bf16", b:dtype())
    v1:fill_(1)
    for i, x in ipairs(b:totable()) do assert.are.equal(i % 2 == 0 and 1 or 0, x, "element " .. i) end
  end)

  it("the policy: furthest next use with a schedule, LRU without", function()
    -- 3 slots, the cyclic order 0 1 2 3 0 1 2 3 (tests/c/test_store.c works it out)
    local order = {0, 1, 2, 3, 0, 1, 2, 3}
    local function run(s)
      local hits = {}
      for i, slab in ipairs(order) do
        local slot, hit = s:acquire(slab)
        assert.are.equal(slot, s:resident(slab))
        assert.is_true(slot >= 0 and slot < 3)
        hits[i] = hit
        s:release(slab)
      end
      return hits
    end
    local s <close> = open{slabs = 4, slab_bytes = 64, slots = 3, prefetch = 2}
    s:schedule(order)
    assert.are.same({false, false, false, false, true, true, false, true}, run(s))
    local st = s:stats()
    assert.are.same({3, 5, 2, 0, 4}, {st.hits, st.misses, st.evictions, st.writebacks, st.prefetches})
    assert.is_nil(s:resident(0))
    local lru <close> = open{slabs = 4, slab_bytes = 64, slots = 3}
    assert.are.same({false, false, false, false, false, false, false, false}, run(lru))
    assert.are.equal(5, lru:stats().evictions)
    assert.are.equal(0, lru:stats().prefetches, "no schedule, no hint")
  end)

  it("a dirty slab is written back before its slot is reused, and by flush", function()
    local s <close> = open{slabs = 3, slab_bytes = 16, slots = 1}
    local v = s:slot(0)
    local slot = s:acquire(0)
    assert.are.equal(0, slot)
    v:fill_(7)
    s:release(0, true)
    s:acquire(1)                                   -- evicts 0: written back
    s:release(1, false)
    assert.are.equal(1, s:stats().writebacks)
    s:acquire(0)
    assert.are.same({7, 7, 7, 7}, v:totable())
    v:fill_(9)
    s:release(0, true)
    s:flush()
    s:flush()
    assert.are.equal(2, s:stats().writebacks, "flush writes a dirty slab once")
    s:read(2, 0)                                   -- the slot leaves the policy
    assert.is_nil(s:resident(0))
    s:read(0, 0)
    assert.are.same({9, 9, 9, 9}, v:totable())
  end)

  it("all slots pinned is an error that says why", function()
    local s <close> = open{slabs = 3, slab_bytes = 16, slots = 2}
    s:acquire(0)
    s:acquire(1)
    assert.are.equal("Store:acquire: all 2 cache slots are in use: the budget holds fewer experts "
                     .. "than one step needs at once", errmsg(s.acquire, s, 2):gsub("^.-Store:", "Store:"))
    s:release(1)
    assert.are.equal(1, select(1, s:acquire(2)))
  end)
end)

describe("the ledger", function()
  it("slots under cache on cpu, the file's bytes on the file book; close gives both back", function()
    collectgarbage()
    local cpu0, file0 = mem.stats().cpu, mem.stats().file
    local s, path = open{slabs = 5, slab_bytes = 100, slots = 3, category = "optim"}
    local cpu1, file1 = mem.stats().cpu, mem.stats().file
    assert.are.equal(cpu0.current.cache + 3 * 128, cpu1.current.cache, "3 slots of stride 128")
    assert.are.equal(cpu0.allocs.cache + 1, cpu1.allocs.cache, "one allocation")
    assert.are.equal(file0.current.optim + 500, file1.current.optim)
    assert.are.equal(file0.total + 500, file1.total)
    has(mem.report("file"), "memory ledger (file)")
    local all = mem.report()
    has(all, "memory ledger (cpu)")
    has(all, "memory ledger (file)")
    assert.is_true(exists(path))
    s:close()
    s:close()                                      -- idempotent
    assert.is_false(exists(path), "close removes the file")
    assert.are.equal(cpu0.current.cache, mem.stats().cpu.current.cache)
    assert.are.equal(file0.total, mem.stats().file.total)
    assert.are.equal("moelua.Store(closed)", tostring(s))
    if mem.stats().file.total == 0 then
      assert.is_nil(mem.report():find("memory ledger (file)", 1, true), "an empty book is left out")
    end
  end)

  it("collection closes a store that is no longer referenced", function()
    collectgarbage()
    local file0 = mem.stats().file.total
    local path
    do
      local s
      s, path = open{slabs = 2, slab_bytes = 64, slots = 1}
      assert.is_true(exists(path))
    end
    collectgarbage()
    collectgarbage()
    assert.is_false(exists(path))
    assert.are.equal(file0, mem.stats().file.total)
  end)

  it("a file budget refuses the store before any file exists", function()
    local path = fresh_path()
    local old = mem.budget{device = "file", total = 1000}
    local msg = errmsg(store.open, {path = path, slabs = 20, slab_bytes = 100, slots = 1})
    mem.budget{device = "file", total = old.total}
    has(msg, "moelua.store.open: allocating 1.95 KiB (params) on file would exceed the total budget of 1000 B")
    has(msg, "memory ledger (file)")
    assert.is_false(exists(path))
  end)

  it("a cache budget on cpu refuses the slots", function()
    local path = fresh_path()
    local file0 = mem.stats().file.total
    local old = mem.budget{cache = 100}
    local msg = errmsg(store.open, {path = path, slabs = 2, slab_bytes = 64, slots = 2})
    mem.budget{cache = old.cache}
    has(msg, "(cache) on cpu would exceed the cache budget")
    assert.is_false(exists(path))
    assert.are.equal(file0, mem.stats().file.total)
  end)
end)

describe("plans", function()
  it("a store opened in a plan charges the plan's books and creates no file", function()
    local path = fresh_path()
    local stats
    local books = mem.plan(function()
      local s <close> = store.open{path = path, slabs = 8, slab_bytes = 256, slots = 2}
      s:schedule{0, 1, 2}
      s:acquire(0)
      s:release(0, true)
      s:write(1, 5)
      s:read(5, 1)
      s:flush()
      stats = s:stats()
      assert(not exists(path))
    end)
    assert.is_false(exists(path))
    assert.are.equal(8 * 256, books.file.peak.params - mem.stats().file.current.params)
    assert.is_true(books.cpu.peak.cache >= 2 * 256)
    -- its counters are a real store's: a miss and a read-back read 512 bytes, a write and the flush wrote 512
    assert.are.same({1, 512, 512}, {stats.misses, stats.bytes_read, stats.bytes_written})
  end)

  it("a store opened outside a plan cannot move slabs inside one", function()
    local s <close> = open{slabs = 2, slab_bytes = 64, slots = 1}
    local _, msg = mem.plan(function() s:acquire(0) end)
    has(msg, "Store:acquire: the store was opened outside moelua.mem.plan, which cannot move its slabs")
  end)
end)

describe("views of a closed store", function()
  it("are an error to use, not a crash", function()
    local s = open{slabs = 2, slab_bytes = 64, slots = 2}
    local v = s:slot(1)
    v:fill_(1)
    s:close()
    has(errmsg(v.totable, v), "the expert store was closed")
    has(errmsg(v.fill_, v, 2), "the expert store was closed")
    assert.are.equal("Store:slot: the store is closed", errmsg(s.slot, s, 0):gsub("^.-Store:", "Store:"))
    assert.are.equal("Store:acquire: the store is closed", errmsg(s.acquire, s, 0):gsub("^.-Store:", "Store:"))
    assert.are.equal("Store:stats: the store is closed", errmsg(s.stats, s):gsub("^.-Store:", "Store:"))
  end)
end)

describe("bad input", function()
  local function e(...) return (errmsg(...):gsub("^.-(moelua%.store%.open)", "%1"):gsub("^.-(Store:)", "%1")) end

  it("store.open names the option", function()
    has(errmsg(store.open), "table expected, got no value")
    assert.are.equal("moelua.store.open: option 'path' must be a file name, got nil",
                     e(store.open, {slabs = 1, slab_bytes = 4, slots = 1}))
    assert.are.equal("moelua.store.open: option 'slabs' is required (an integer >= 1)",
                     e(store.open, {path = fresh_path(), slab_bytes = 4, slots = 1}))
    assert.are.equal("moelua.store.open: option 'slabs' must be >= 1, got 0",
                     e(store.open, {path = fresh_path(), slabs = 0, slab_bytes = 4, slots = 1}))
    assert.are.equal("moelua.store.open: option 'slab_bytes' must be a multiple of 4 (slots are viewed as f32), got 10",
                     e(store.open, {path = fresh_path(), slabs = 1, slab_bytes = 10, slots = 1}))
    assert.are.equal("moelua.store.open: option 'slots' must be an integer, got string",
                     e(store.open, {path = fresh_path(), slabs = 1, slab_bytes = 4, slots = "two"}))
    assert.are.equal("moelua.store.open: option 'prefetch' must be >= 0, got -1",
                     e(store.open, {path = fresh_path(), slabs = 1, slab_bytes = 4, slots = 1, prefetch = -1}))
    assert.are.equal("moelua.store.open: option 'category': unknown category 'weights' (params, grads, optim, "
                     .. "acts, pool, comm, cache, other)",
                     e(store.open, {path = fresh_path(), slabs = 1, slab_bytes = 4, slots = 1, category = "weights"}))
    assert.are.equal("moelua.store.open: option 'category': expected {<category> = bytes >= 1 of a slab, ...} " ..
                     "(params, grads, optim, acts, pool, comm, cache, other)",
                     e(store.open, {path = fresh_path(), slabs = 1, slab_bytes = 8, slots = 1,
                                    category = {params = 4, weights = 4}}))
    assert.are.equal("moelua.store.open: a slab's bytes per category add up to 4, not slab_bytes (8)",
                     e(store.open, {path = fresh_path(), slabs = 1, slab_bytes = 8, slots = 1, category = {params = 4}}))
    has(e(store.open, {path = fresh_path(), slabs = 1, slab_bytes = 4, slots = 1, budget = 5}),
        "moelua.store.open: unknown option 'budget'")
  end)

  it("store.open refuses an existing file (kept) and tmpfs (removed)", function()
    local path = fresh_path()
    support.write_file(path, "mine")
    has(e(store.open, {path = path, slabs = 1, slab_bytes = 4, slots = 1}),
        "moelua.store.open: " .. path .. " exists: the store creates its file and never overwrites one")
    assert.are.equal("mine", support.read_file(path))
    local p = io.popen("stat -f -c %T /dev/shm 2>/dev/null")
    local fs = p:read("a")
    p:close()
    if fs:match("tmpfs") then
      local shm = "/dev/shm/moelua-store-spec-" .. tostring(math.random(1 << 30))
      assert.are.equal("moelua.store.open: " .. shm .. " is on tmpfs: its pages are memory, so the store "
                       .. "would not bound anything; put it on a disk",
                       e(store.open, {path = shm, slabs = 1, slab_bytes = 4, slots = 1}))
      assert.is_false(exists(shm))
    end
  end)

  it("slab and slot numbers, release, schedule", function()
    local s <close> = open{slabs = 3, slab_bytes = 16, slots = 2}
    assert.are.equal("Store:slot: slot 2 is outside [0, 2)", e(s.slot, s, 2))
    assert.are.equal('Store:slot: dtype must be "f32" or "bf16", got "f64"', e(s.slot, s, 0, "f64"))
    assert.are.equal("Store:read: slab -1 is outside [0, 3)", e(s.read, s, -1, 0))
    assert.are.equal("Store:read: slot 5 is outside [0, 2)", e(s.read, s, 0, 5))
    assert.are.equal("Store:write: slab 3 is outside [0, 3)", e(s.write, s, 0, 3))
    assert.are.equal("Store:acquire: slab 3 is outside [0, 3)", e(s.acquire, s, 3))
    assert.are.equal("Store:acquire: slab must be an integer, got string", e(s.acquire, s, "x"))
    assert.are.equal("Store:release: slab 1 is not acquired (release it once per acquire)", e(s.release, s, 1))
    s:acquire(1)
    assert.are.equal("Store:release: argument #3 (dirty) must be a boolean, got number", e(s.release, s, 1, 1))
    s:release(1)
    assert.are.equal("Store:schedule: argument #2: entry 2 must be an integer slab id, got string",
                     e(s.schedule, s, {0, "one"}))
    assert.are.equal("Store:schedule: schedule entry 3 is slab 7, outside [0, 3)", e(s.schedule, s, {0, 1, 7}))
    has(e(s.schedule, s), "table expected, got no value")
    has(e(s.resident, s, 9), "Store:resident: slab 9 is outside [0, 3)")
    has(errmsg(s.stats, {}), "moelua.Store expected")
  end)
end)
