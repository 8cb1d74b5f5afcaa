-- moelua.mem (host/bindings/l_mem.c) and the ledger as Lua sees it: budget refusals
-- (an error carrying the ledger table, existing tensors intact), collect and
-- retry, the default CPU budget, per-category budgets through mem.scope,
-- budgets larger than the machine refused unless forced,
-- stats, peaks and the breakdown at the peak, the timeline, a leak spec, a
-- <close> spec, freed tensors, and bad input to every function. The books
-- of the tiers beyond the devices (pinned, file) are here as books; the
-- expert store charges them (tests/spec/store_spec.lua).
local m = require "moelua"
local mem = m.mem
local support = require "tests.support"
local errmsg, has = support.errmsg, support.has

local function cpu() return mem.stats().cpu end

local with_budget = support.with_budget

local CATEGORIES = {"params", "grads", "optim", "acts", "pool", "comm", "cache", "other"}

describe("mem.format_bytes", function()
  it("prints bytes as the ledger's reports do, and refuses what is not a byte count", function()
    assert.are.equal("0 B", mem.format_bytes(0))
    assert.are.equal("1023 B", mem.format_bytes(1023))
    assert.are.equal("1.00 KiB", mem.format_bytes(1024))
    assert.are.equal("1.50 MiB", mem.format_bytes(1572864))
    assert.are.equal("20.00 GiB", mem.format_bytes(20 * 2^30 // 1))
    support.raises("moelua.mem.format_bytes: argument #1: expected bytes >= 0, got -1", mem.format_bytes, -1)
    support.raises("moelua.mem.format_bytes: argument #1 (n) must be an integer, got a fraction",
                   mem.format_bytes, 1.5)
  end)
end)

describe("budgets", function()
  it("a refusal is a Lua error with the ledger table; existing tensors stay valid", function()
    collectgarbage()
    local keep = m.full({10}, 3)
    local refused = cpu().refused
    local msg
    with_budget({total = cpu().total + 1000}, function()
      msg = errmsg(m.zeros, {1000})
    end)
    has(msg, "moelua.zeros: allocating 3.91 KiB (other) on cpu would exceed the total budget of")
    has(msg, "memory ledger (cpu)")
    for _, c in ipairs(CATEGORIES) do has(msg, c) end
    has(msg, "at peak")
    has(msg, "untracked (RSS - ledger)")
    assert.are.equal(refused + 1, cpu().refused, "the refusal is counted once (not once per try)")
    assert.are.same({3, 3, 3, 3, 3, 3, 3, 3, 3, 3}, keep:totable())
    assert.are.same({6, 6}, keep:narrow(1, 1, 2):add(keep:narrow(1, 3, 2)):totable())
  end)

  it("collects garbage once and retries before refusing", function()
    collectgarbage()
    collectgarbage("stop")
    local base = cpu().total
    do local dropped = m.zeros({8000}) end          -- 32000 bytes of garbage, not collected
    assert.are.equal(base + 32000, cpu().total)
    local ok, t, after
    with_budget({total = base + 40000}, function()   -- fits only once `dropped` is collected
      ok, t = pcall(m.zeros, {8000})
      after = cpu().total
    end)
    collectgarbage("restart")
    assert.is_true(ok, tostring(t))
    assert.are.equal(base + 32000, after, "dropped was collected, t took its place")
  end)

  it("garbage tensors are collected at the pace they are made, but not while the collector is stopped", function()
    local function churn()   -- 16 MiB of garbage, then 64 allocations of 256 KiB (each steps the collector)
      for _ = 1, 16 do local g = m.zeros({1 << 18}) end
      local keep = {}
      for i = 1, 64 do keep[i] = m.zeros({1 << 16}) end
      return cpu().total
    end
    collectgarbage()
    local base = cpu().total
    assert.is_true(churn() - base < 32 << 20, "collected while running")
    collectgarbage()
    collectgarbage("stop")   -- as a trainer's step holds it (moelua.train)
    local held = churn()
    collectgarbage("restart")
    assert.are.equal(base + (32 << 20), held)
    collectgarbage()
    assert.are.equal(base, cpu().total)
  end)

  it("without an explicit budget an impossible allocation is an error, not an OOM", function()
    local b = cpu().budget_total
    assert.is_true(b > 0, "the default CPU budget is set")
    local msg = errmsg(m.zeros, {1e12})
    has(msg, "moelua.zeros: allocating 3.64 TiB (other) on cpu would exceed the total budget")
    has(msg, "memory ledger (cpu)")
    assert.are.equal(b, cpu().budget_total)
  end)

  it("per category, through mem.scope", function()
    collectgarbage()
    local acts = cpu().current.acts
    with_budget({acts = acts + 4096}, function()
      local a = mem.scope("acts", m.zeros, {1024})          -- exactly the budget
      assert.are.equal("acts", a:category())
      local msg = errmsg(mem.scope, "acts", m.zeros, {1})
      has(msg, "moelua.zeros: allocating 4 B (acts) on cpu would exceed the acts budget of")
      has(msg, "memory ledger (cpu)")
      local o = m.zeros({1024})                              -- other is not limited
      assert.are.equal("other", o:category())
      assert.are.equal(acts + 4096, cpu().budget.acts)
    end)
    assert.are.equal(0, cpu().budget.acts, "with_budget restored it")
  end)

  it("returns the old budgets and 0 removes one", function()
    local old = mem.budget{params = 12345}
    for _, c in ipairs(CATEGORIES) do assert.is_number(old[c]) end
    assert.is_number(old.total)
    local mid = mem.budget{params = 0}
    assert.are.equal(12345, mid.params)
    assert.are.equal(0, cpu().budget.params)
    mem.budget(old)
  end)

  it("a budget for cuda is kept apart from cpu", function()
    local old = mem.budget{device = "cuda", acts = 1 << 20}
    assert.are.equal(1 << 20, mem.stats().cuda.budget.acts)
    assert.are.equal(0, cpu().budget.acts)
    mem.budget{device = "cuda", acts = old.acts}
  end)

  it("the pinned and file tiers have budgets of their own, never checked against the machine", function()
    for _, tier in ipairs({"pinned", "file"}) do
      local old = mem.budget{device = tier, total = 1 << 62, params = 1 << 20}
      assert.are.equal(1 << 62, mem.stats()[tier].budget_total, tier)
      assert.are.equal(1 << 20, mem.stats()[tier].budget.params, tier)
      assert.are_not.equal(1 << 62, cpu().budget_total)
      assert.are.equal(0, cpu().budget.params)
      assert.are.equal(tier, old.device, "the old budgets name their book")
      mem.budget(old)
      assert.are.equal(0, mem.stats()[tier].budget_total, tier)
      assert.are.equal(0, mem.stats()[tier].budget.params, tier)
    end
  end)
end)

-- A field of /proc/meminfo in GiB, formatted as the refusal prints it.
local function meminfo_gib(key)
  local text = assert(support.read_file("/proc/meminfo"))
  local kb = assert(tonumber(text:match(key .. ":%s*(%d+) kB")), key)
  return string.format("%.2f GiB", kb / 2^20)
end

describe("budgets the machine can hold", function()
  local errors = require "moelua.errors"

  it("refuses a CPU budget above MemAvailable + the ledger, naming both figures, as a user error", function()
    local before = mem.stats().cpu
    local ok, err = pcall(mem.budget, {total = 1e15})
    assert.is_false(ok)
    assert.is_true(errors.is_user(err), "a user error, printed without a traceback")
    local msg = tostring(err)
    has(msg, "moelua.mem.budget: the total budget of 931322.57 GiB is more than this machine can hold: ")
    has(msg, "(MemAvailable ")
    has(msg, " GiB the cpu ledger holds) of " .. meminfo_gib("MemTotal") .. " MemTotal")
    has(msg, "mem.budget{total = ..., force = true} sets it anyway")
    has(msg, "OOM killer")
    -- the figure: MemAvailable + held, within what the machine has
    local avail = assert(tonumber(msg:match("hold: ([%d.]+) GiB %(MemAvailable")))
    assert.is_true(avail > 0 and avail * 2^30 <= 1e15)
    assert.are.equal(before.budget_total, cpu().budget_total, "nothing changed")
  end)

  it("refuses a category budget too, before any key of the call is applied", function()
    local before = mem.stats().cpu
    local msg = errmsg(mem.budget, {total = 1 << 20, params = 1e15})
    has(msg, "moelua.mem.budget: the params budget of 931322.57 GiB is more than this machine can hold")
    has(msg, "mem.budget{params = ..., force = true}")
    assert.are.equal(before.budget_total, cpu().budget_total)
    assert.are.equal(before.budget.params, cpu().budget.params)
  end)

  it("accepts it with force = true, and small budgets and 0 as before", function()
    local old = mem.budget{total = 1e15, force = true}
    assert.are.equal(1e15, cpu().budget_total)
    assert.are.equal(1e15, mem.budget{total = 1 << 20}.total)
    assert.are.equal(1 << 20, cpu().budget_total)
    mem.budget{total = 0, params = 0}   -- 0 removes a budget: never refused
    assert.are.equal(0, cpu().budget_total)
    mem.budget(old)
    assert.are.equal(old.total, cpu().budget_total)
    assert.are.equal("moelua.mem.budget: option 'force' must be a boolean, got number",
                     errmsg(mem.budget, {total = 1, force = 1}))
  end)
end)

describe("mem.scope and mem.category", function()
  it("tag allocations, pass arguments and results through", function()
    assert.are.equal("other", mem.category())
    local t, c = mem.scope("params", function(n)
      return m.zeros({n}), mem.category()
    end, 3)
    assert.are.equal("params", c)
    assert.are.equal("params", t:category())
    assert.are.equal("other", mem.category())
    local a, b, d = mem.scope("grads", function(...) return ... end, 1, nil, 3)
    assert.are.same({1, nil, 3}, {a, b, d})
  end)

  it("nest and restore the category after an error", function()
    local msg = errmsg(mem.scope, "grads", function()
      mem.scope("optim", function() error("boom") end)
    end)
    has(msg, "boom")
    assert.are.equal("other", mem.category())
    local inner = mem.scope("acts", function()
      return mem.scope("cache", mem.category), mem.category()
    end)
    assert.are.equal("cache", inner)
    assert.are.equal("other", mem.category())
  end)

  it("category(name) sets it and returns the previous one", function()
    assert.are.equal("other", mem.category("comm"))
    assert.are.equal("comm", m.zeros({1}):category())
    assert.are.equal("comm", mem.category("other"))
    assert.are.equal("other", mem.category())
  end)
end)

describe("mem.stats", function()
  it("has every field for every device and tier", function()
    local s = mem.stats()
    for _, dev in ipairs({"cpu", "cuda", "pinned", "file"}) do
      local d = s[dev]
      for _, k in ipairs({"current", "peak", "at_peak", "budget", "allocs", "frees"}) do
        for _, c in ipairs(CATEGORIES) do
          assert.is_number(d[k][c], dev .. "." .. k .. "." .. c)
        end
      end
      for _, k in ipairs({"total", "total_peak", "reserved", "reserved_peak", "budget_total", "refused"}) do
        assert.is_number(d[k], dev .. "." .. k)
      end
    end
    assert.is_number(s.cpu.rss)
    assert.is_number(s.cpu.untracked)
    assert.is_true(s.cpu.rss > 0)
    assert.is_nil(s.file.rss, "RSS belongs to the cpu book alone")
    assert.is_nil(s.pinned.untracked)
  end)

  it("counts bytes, allocations and frees per category", function()
    collectgarbage()
    local s0 = cpu()
    local t = mem.scope("optim", m.zeros, {250})
    local s1 = cpu()
    assert.are.equal(s0.current.optim + 1000, s1.current.optim)
    assert.are.equal(s0.total + 1000, s1.total)
    assert.are.equal(s0.allocs.optim + 1, s1.allocs.optim)
    assert.is_true(s1.peak.optim >= s1.current.optim)
    assert.are.equal(s1.total, s1.reserved, "reserved follows total on the CPU")
    t:free()
    local s2 = cpu()
    assert.are.equal(s0.current.optim, s2.current.optim)
    assert.are.equal(s0.frees.optim + 1, s2.frees.optim)
  end)

  it("report prints the account book", function()
    local r = mem.report()
    has(r, "memory ledger (cpu)")
    for _, c in ipairs(CATEGORIES) do has(r, c) end
    has(mem.report("cuda"), "memory ledger (cuda)")
    has(mem.report("pinned"), "memory ledger (pinned)")
    local f = mem.report("file")
    has(f, "memory ledger (file)")
    assert.is_nil(f:find("untracked", 1, true), "a file has no RSS to compare: " .. f)
  end)

  it("mem.plan returns the book of every tier", function()
    local books = mem.plan(function() end)
    for _, tier in ipairs({"cpu", "cuda", "pinned", "file"}) do
      assert.is_number(books[tier].total_peak, tier)
    end
  end)
end)

describe("peaks", function()
  it("reset_peak makes the peaks the current values", function()
    collectgarbage()
    local t = m.zeros({4000})
    t:free()
    local s = cpu()
    assert.is_true(s.total_peak >= s.total + 16000)
    mem.reset_peak()
    s = cpu()
    assert.are.equal(s.total, s.total_peak)
    assert.are.same(s.current, s.peak)
    assert.are.same(s.current, s.at_peak)
    mem.reset_peak("cpu")
    assert.are.equal(cpu().total, cpu().total_peak)
  end)

  it("at_peak is the breakdown at the moment of the total peak", function()
    collectgarbage()
    collectgarbage("stop")
    mem.reset_peak()
    local base = cpu()
    local p = mem.scope("params", m.zeros, {1000})    -- 4000
    local a = mem.scope("acts", m.zeros, {2000})      -- 8000: peak base + 12000
    p:free()
    local a2 = mem.scope("acts", m.zeros, {500})      -- total base + 10000 < peak
    local s = cpu()
    assert.are.equal(base.total + 12000, s.total_peak)
    assert.are.equal(base.current.params + 4000, s.at_peak.params)
    assert.are.equal(base.current.acts + 8000, s.at_peak.acts)
    assert.are.equal(base.current.acts + 10000, s.peak.acts, "the category peak is its own")
    local a3 = mem.scope("acts", m.zeros, {1000})     -- base + 14000: a new peak
    s = cpu()
    collectgarbage("restart")
    assert.are.equal(base.total + 14000, s.total_peak)
    assert.are.equal(base.current.params, s.at_peak.params)
    assert.are.equal(base.current.acts + 14000, s.at_peak.acts)
    a, a2, a3 = nil, nil, nil
  end)
end)

describe("mem.timeline", function()
  it("samples bytes per category on every change up to cap, then counts drops", function()
    collectgarbage()
    collectgarbage("stop")
    mem.timeline{cap = 4}
    local a = m.zeros({10})
    local b = mem.scope("acts", m.zeros, {20})
    local c = m.zeros({30})
    local d = m.zeros({1})
    local s, dropped = mem.timeline()
    mem.timeline{cap = 0}
    collectgarbage("restart")
    assert.are.equal(4, #s)
    assert.are.equal(1, dropped)
    assert.are.equal(40, s[2].other - s[1].other)
    assert.are.equal(80, s[3].acts - s[2].acts)
    assert.are.equal(120, s[4].total - s[3].total)
    for i = 2, 4 do assert.is_true(s[i].t >= s[i - 1].t) end
    for _, c in ipairs(CATEGORIES) do assert.is_number(s[1][c]) end
    local off = mem.timeline()
    assert.are.equal(0, #off, "cap 0 turns it off")
    a, b, c, d = nil, nil, nil, nil
  end)

  it("keeps at most one sample per interval", function()
    mem.timeline{cap = 100, interval = 3600}
    for _ = 1, 5 do m.zeros({4}) end
    local s, dropped = mem.timeline()
    mem.timeline{cap = 0}
    assert.are.equal(1, #s)
    assert.are.equal(0, dropped)
  end)
end)

describe("lifetime", function()
  it("leaks nothing when a computation fails mid-way", function()
    collectgarbage()
    collectgarbage()
    local base = cpu().total
    local ok, err = pcall(function()
      local ts = {}
      for i = 1, 10 do ts[i] = mem.scope("acts", m.ones, {100}) end
      local s = ts[1]:add(ts[2])
      m.zeros({3}):add(m.zeros({4}))               -- shape mismatch: fails here
      return s
    end)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find("moelua.add", 1, true), tostring(err))
    local ok2 = pcall(function()
      local keep = m.zeros({1000})
      with_budget({total = cpu().total + 100}, function() return m.zeros({100000}) end)
      return keep
    end)
    assert.is_false(ok2)
    collectgarbage()
    collectgarbage()
    assert.are.equal(base, cpu().total)
  end)

  it("<close> frees at scope exit, before any collection", function()
    collectgarbage()
    collectgarbage("stop")
    local base = cpu().total
    do
      local t <close> = m.zeros({1000})
      assert.are.equal(base + 4000, cpu().total)
      do
        local u <close> = t:add(t)
        assert.are.equal(base + 8000, cpu().total)
      end
      assert.are.equal(base + 4000, cpu().total)
    end
    local after = cpu().total
    collectgarbage("restart")
    assert.are.equal(base, after)
  end)

  it("<close> frees when the scope is left by an error", function()
    collectgarbage()
    collectgarbage("stop")
    local base = cpu().total
    local ok = pcall(function()
      local t <close> = m.zeros({1000})
      error("leave")
    end)
    local after = cpu().total
    collectgarbage("restart")
    assert.is_false(ok)
    assert.are.equal(base, after)
  end)

  it("t:free() returns the bytes at once; using t afterwards is an error", function()
    collectgarbage()
    local base = cpu().total
    local t = m.ones({256})
    local view = t:narrow(1, 1, 4)
    assert.are.equal(base + 1024, cpu().total)
    t:free()
    assert.are.equal(base + 1024, cpu().total, "a live view keeps the storage")
    view:free()
    assert.are.equal(base, cpu().total)
    assert.are.equal("Tensor:shape: argument #1: the tensor was freed", errmsg(t.shape, t))
    has(errmsg(t.totable, t), "the tensor was freed")
    has(errmsg(t.fill_, t, 1), "the tensor was freed")
    has(errmsg(t.add, t, 1), "the tensor was freed")
    local x = m.ones({256})
    has(errmsg(x.add, x, t), "argument #2: the tensor was freed")
    assert.are.equal("tensor(freed)", tostring(t))
    t:free()                                       -- idempotent
    local mt = getmetatable(x)
    assert.are.equal(mt.__gc, mt.__close)
  end)
end)

describe("bad input", function()
  it("mem.report and mem.reset_peak", function()
    assert.are.equal("moelua.mem.report: unknown device 'tpu' (cpu, cuda, pinned, file)", errmsg(mem.report, "tpu"))
    assert.are.equal("moelua.mem.report: argument #1: expected a device name, got number",
                     errmsg(mem.report, 5))
    assert.are.equal("moelua.mem.reset_peak: unknown device 'tpu' (cpu, cuda, pinned, file)", errmsg(mem.reset_peak, "tpu"))
    assert.are.equal("moelua.mem.reset_peak: argument #1: expected a device name, got table",
                     errmsg(mem.reset_peak, {}))
  end)

  it("mem.budget", function()
    local before = cpu().budget_total
    has(errmsg(mem.budget), "moelua.mem.budget: argument #1 (budgets) must be a table, got no " ..
                            "value")
    has(errmsg(mem.budget, "x"), "must be a table, got string")
    has(errmsg(mem.budget, {bogus = 1}), "moelua.mem.budget: unknown option 'bogus' (total, device, force, or a category")
    has(errmsg(mem.budget, {[1] = 5}), "unknown option 'number'")
    assert.are.equal("moelua.mem.budget: option 'total' must be a whole byte count >= 0, got -1",
                     errmsg(mem.budget, {total = -1}))
    assert.are.equal("moelua.mem.budget: option 'params' must be a whole byte count >= 0, got string",
                     errmsg(mem.budget, {params = "lots"}))
    has(errmsg(mem.budget, {acts = 0 / 0}), "moelua.mem.budget: option 'acts' must be a whole byte count >= 0, got")
    has(errmsg(mem.budget, {total = 1e30}), "option 'total' must be a whole byte count >= 0")
    has(errmsg(mem.budget, {total = 1.5}), "option 'total' must be a whole byte count >= 0, got 1.5")
    assert.are.equal("moelua.mem.budget: unknown device 'tpu' (cpu, cuda, pinned, file)",
                     errmsg(mem.budget, {device = "tpu", total = 1}))
    -- validated before anything changes: a good key next to a bad one is not applied
    errmsg(mem.budget, {total = 1, bogus = 1})
    assert.are.equal(before, cpu().budget_total)
  end)

  it("mem.category and mem.scope", function()
    assert.are.equal("moelua.mem.category: unknown category 'bogus' (params, grads, optim, acts, pool, comm, cache, other)",
                     errmsg(mem.category, "bogus"))
    has(errmsg(mem.category, {}), "moelua.mem.category: the category must be a string, got table")
    has(errmsg(mem.scope, "bogus", print), "moelua.mem.scope: unknown category 'bogus'")
    has(errmsg(mem.scope, nil, print), "the category must be a string, got nil")
    has(errmsg(mem.scope, "acts"), "moelua.mem.scope: argument #2 (fn) must be a function, got no value")
    has(errmsg(mem.scope, "acts", 5), "argument #2 (fn) must be a function, got number")
    assert.are.equal("other", mem.category())
  end)

  it("mem.timeline", function()
    assert.are.equal("moelua.mem.timeline: unknown option 'bogus' (expected one of: cap, interval, device)",
                     errmsg(mem.timeline, {bogus = 1}))
    local cap = "moelua.mem.timeline: option 'cap' must be an integer in 0..1e8"
    assert.are.equal(cap, errmsg(mem.timeline, {cap = -1}))
    assert.are.equal(cap, errmsg(mem.timeline, {cap = "x"}))
    assert.are.equal(cap, errmsg(mem.timeline, {cap = 1.5}))
    assert.are.equal("moelua.mem.timeline: option 'interval' must be a number of seconds >= 0",
                     errmsg(mem.timeline, {interval = -1}))
    assert.are.equal("moelua.mem.timeline: option 'interval' must be a number of seconds >= 0",
                     errmsg(mem.timeline, {interval = "soon"}))
    has(errmsg(mem.timeline, {device = "tpu"}), "moelua.mem.timeline: unknown device 'tpu'")
    assert.are.equal("moelua.mem.timeline: unknown device 'tpu' (cpu, cuda, pinned, file)", errmsg(mem.timeline, "tpu"))
    assert.are.equal("moelua.mem.timeline: argument #1: expected a device name, got number",
                     errmsg(mem.timeline, 3))
  end)
end)
