-- The memory planner (moelua.mem.plan, host/runtime/backend_plan.c, train.plan):
-- a dry run of the same code with kernels skipped predicts the ledger's
-- peak exactly, allocates nothing real, enforces the budgets with the usual
-- error, and leaves the run it plans unchanged.
local m = require "moelua"
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local sched = require "moelua.sched"
local data = require "moelua.data"
local train = require "moelua.train"
local support = require "tests.support"
local mem = m.mem

local MiB = 2^20

describe("mem.plan", function()
  it("charges a virtual book: sizes exact, nothing real allocated, kernels skipped", function()
    collectgarbage()
    local real = mem.stats().cpu
    local rss = real.rss
    local inside
    local books = mem.plan(function(n)
      local a = m.full({n, n}, 3.0)            -- 400 MB of f32 that no kernel touches
      local b = a:add(a)
      inside = {planning = mem.planning(), stats = mem.stats().cpu.total}
      inside.sum = b:sum():item()
    end, 10000)
    local plan = books.cpu
    assert.is_true(inside.planning)
    assert.is_false(mem.planning())
    assert.are.equal(0, inside.sum)            -- fill and add never ran
    assert.are.equal(real.total + 800000000 + 4, plan.total_peak)   -- a, b, the sum's scalar
    assert.are.equal(real.total + 800000000, inside.stats)
    assert.are.equal(real.total, plan.total)   -- everything freed when the plan ended
    local after = mem.stats().cpu
    assert.are.equal(real.total, after.total)
    assert.are.equal(real.total_peak, after.total_peak)
    assert.is_true(after.rss - rss < 64 * MiB, "the plan touched memory: rss grew by " .. (after.rss - rss))
  end)

  it("refuses an allocation over the budget with the budget error, nothing allocated", function()
    local prev = mem.budget{total = 64 * MiB}
    local refused = mem.stats().cpu.refused
    local ok, why, books = mem.plan(function() local a = m.zeros({100 * MiB // 4}) end)
    mem.budget(prev)
    assert.is_nil(ok)
    support.has(why, "moelua.mem.plan: the planned run failed (nothing was allocated)")
    support.has(why, "would exceed the total budget of 64.00 MiB")
    support.has(why, "memory ledger (cpu)")
    assert.is_true(books.cpu.refused > 0)
    assert.are.equal(refused, mem.stats().cpu.refused)   -- the real book refused nothing
  end)

  it("returns the error as raised, so that a user error is raised again as it is", function()
    local errors = require "moelua.errors"
    local ok, why, books, raised = mem.plan(function() errors.user("option --topk must be at least 1") end)
    assert.is_nil(ok)
    support.has(why, "the planned run failed (nothing was allocated): option --topk must be at least 1")
    assert.are.equal("table", type(books.cpu))
    assert.is_true(errors.is_user(raised))
    assert.are.equal("option --topk must be at least 1", tostring(raised))
    local _, _, _, bug = mem.plan(function() error("a bug", 0) end)
    assert.are.equal("a bug", bug)
  end)

  it("restores the host's RNG and category", function()
    m.manual_seed(7)
    local plain = m.randn({5}):totable()
    m.manual_seed(7)
    mem.category("grads")
    mem.plan(function() mem.category("acts"); local x = m.randn({1000}) end)
    assert.are.equal("grads", mem.category("other"))
    assert.are.same(plain, m.randn({5}):totable())
  end)

  it("keeps a phase set inside it to its own books", function()
    mem.phase("before the plan")
    local books = mem.plan(function() mem.phase("inside the plan"); local x = m.zeros({1 << 16}) end)
    assert.are.equal("inside the plan", books.cpu.peak_phase)
    mem.reset_peak()
    local x <close> = m.zeros({1 << 20})
    assert.are.equal("before the plan", mem.stats().cpu.peak_phase)
  end)

  it("reports a failing function and refuses nesting and leaked tensors", function()
    local ok, why = mem.plan(function() error("boom") end)
    assert.is_nil(ok)
    support.has(why, "boom")
    ok, why = mem.plan(function() return mem.plan(function() end) end)
    assert.is_nil(ok)
    support.has(why, "plans do not nest")
    local kept
    ok, why = mem.plan(function() kept = m.zeros({4}) end)
    assert.is_nil(ok)
    support.has(why, "1 tensor or pool of the plan is still referenced after it")
    support.raises("1 tensor or pool of an earlier plan is still alive", mem.plan, function() end)
    -- what it kept holds no memory on any device: every use is refused
    support.raises("made inside a memory plan that has ended", function() return kept:fill_(3) end)
    support.raises("made inside a memory plan that has ended", function() return kept:sum() end)
    support.raises("made inside a memory plan that has ended", function() return kept:view({2, 2}) end)
    kept = nil
    assert.is_table(mem.plan(function() end))
    support.raises("moelua.mem.plan: argument #1 (fn) must be a function, got number", mem.plan, 42)
  end)

  it("reads and writes no file inside a plan", function()
    local path = os.tmpname()
    local ok, why = mem.plan(function() m.save(path, {v = m.ones({3})}) end)
    assert.is_nil(ok)
    support.has(why, "moelua.save: files are not read or written inside a memory plan")
    ok, why = mem.plan(function() return require("moelua.io").open(path) end)
    assert.is_nil(ok)
    support.has(why, "moelua.io.open: files are not read or written inside a memory plan")
    os.remove(path)
  end)

  it("gives no real memory to a pool made outside it", function()
    local p = m.pool.new(1 << 20, {grow = true})
    local before = mem.stats().cpu.current.pool
    local ok, why = mem.plan(function() local t = p:tensor({1 << 20}) end)   -- 4 MiB: must grow
    assert.is_nil(ok)
    support.has(why, "this pool was made outside moelua.mem.plan")
    assert.are.equal(before, mem.stats().cpu.current.pool)
    assert.are.equal(1, p:stats().blocks)
    ok, why = mem.plan(function() p:reserve(1 << 22) end)
    assert.is_nil(ok)
    support.has(why, "Pool:reserve: reserving 4.00 MiB: this pool was made outside moelua.mem.plan")
    assert.is_table(mem.plan(function() local t = p:tensor({1000}) end))   -- fits: no new memory
    p:close()
  end)

  it("restores the seed and the thread count", function()
    local threads = m.threads()
    m.manual_seed(11)
    local plain = m.randn({3}):totable()
    m.manual_seed(11)
    mem.plan(function() m.manual_seed(99); m.threads(1); local x = m.randn({3}) end)
    assert.are.equal(threads, m.threads())
    assert.are.same(plain, m.randn({3}):totable())
  end)

  it("plans CUDA tensors on any build, with the caching allocator's rounding as reserved", function()
    local books = mem.plan(function()
      local a = m.zeros({1000}, {device = "cuda"})         -- 4000 B: a 4096 B block (512 B steps)
      local b = m.zeros({3, 1 << 18}, {device = "cuda"})   -- 3 MiB: a 4 MiB block (2 MiB steps above 1 MiB)
      local c = a:add(a)                                   -- ops run on the device's kernel table: skipped
      assert.are.equal("cuda", c:device())
    end)
    assert.are.equal(2 * 4000 + 3 * 2^20, books.cuda.total_peak)
    assert.are.equal(2 * 4096 + 4 * 2^20, books.cuda.reserved_peak)
    assert.are.equal(0, books.cuda.total)
    assert.are.equal(0, books.cpu.total_peak - mem.stats().cpu.total)
    if not m.cuda_available() then   -- outside a plan the device is refused, not planned
      assert.has_error(function() m.zeros({3}, {device = "cuda"}) end)
    end
  end)

  it("plans mixed precision on CUDA: bf16 params, f32 gradients, masters and AdamW states, per parameter", function()
    local o = {vocab = 64, dim = 32, layers = 2, heads = 4, kv_heads = 2, ffn = 48, experts = 4, topk = 2,
               device = "cuda", dtype = "bf16"}
    -- the parameters, counted from the shapes (Mixtral's): embedding and head, per layer two norms, q, k, v, o,
    -- the router and the experts' gate_up and down, the final norm
    local D, hd = o.dim, o.dim // o.heads
    local n = 2 * o.vocab * D + D + o.layers * (2 * D + 2 * D * D + 2 * D * o.kv_heads * hd + o.experts * D +
                                               3 * o.experts * o.ffn * D)
    local counted
    local books = mem.plan(function()
      local model = nn.Transformer.new(o)
      local opt = optim.AdamW(model:param_groups{weight_decay = 0.1}, {lr = 1e-3})
      local named = model:named_parameters()
      counted = 0
      for _, p in ipairs(named) do
        assert.are.equal("f32", p.tensor:dtype(), p.name)   -- the names are the masters'
        counted = counted + p.tensor:numel()
      end
      local loss = model:forward(m.tensor({1, 2, 3, 4, 5, 6, 7, 8, 9}):to("i64"))
      model:backward()
      opt:step()   -- commits AdamW's two moments
      model:zero_grad()
    end)
    assert.are.equal(n, counted)
    local peak = books.cuda.peak
    assert.are.equal(2 * n, peak.params)   -- bf16 weights
    assert.are.equal(4 * n, peak.grads)    -- f32 gradients
    assert.are.equal(12 * n, peak.optim)   -- f32 masters and both moments (address space, booked in a plan)
  end)

  it("books attention's per-thread scratch on the CPU and none on CUDA (its tiles live in shared memory)", function()
    local S, H, KV, hd = 256, 4, 2, 64
    local tensors = (S * H * hd * 2 + S * KV * hd * 2) * 4 + H * S * 8   -- q, out, k, v (f32) and lse (f64)
    local function booked(device)   -- the plan's peak beyond what was live before it
      local before = device == "cpu" and mem.stats().cpu.total or 0
      return mem.plan(function()
        local q = m.zeros({S, H, hd}, {device = device})
        local k, v = m.zeros({S, KV, hd}, {device = device}), m.zeros({S, KV, hd}, {device = device})
        m.ops.attention_forward(q, k, v)
      end)[device].total_peak - before
    end
    local scratch = booked("cpu") - tensors
    assert.is_true(scratch > 0 and scratch % (8 * m.threads()) == 0, "cpu scratch " .. scratch)
    assert.are.equal(tensors, booked("cuda"))
  end)

  it("books the scratch a CUDA dispatch takes from the ledger (its per-tile ranks)", function()
    local experts = require "moelua.experts"
    -- n = 2^21 assignments over E = 2048 experts: tiles of 2048 (at most 2^22
    -- ranks), B = 1024 tiles, int64 ranks [B, E] and drops [B]: 16 MiB + 8 KiB
    local T, k, E = 1 << 20, 2, 2048
    local n = T * k
    local B = n // 2048
    local scratch = (B * E + B) * 8
    local books = mem.plan(function()
      local idx = m.zeros({T, k}, {dtype = "i64", device = "cuda"})
      experts.dispatch(idx, E)
    end)
    -- idx, then offsets, order, counts, dropped, and the scratch while the sort runs
    local outputs = (E + 1) * 8 + n * 8 + E * 8 + n
    assert.are.equal(n * 8 + outputs + scratch, books.cuda.total_peak)
    assert.are.equal(0, books.cuda.total)
    -- the CPU sort needs no scratch: its peak is the tensors alone
    books = mem.plan(function()
      experts.dispatch(m.zeros({T, k}, {dtype = "i64"}), E)
    end)
    assert.are.equal(n * 8 + outputs, books.cpu.total_peak - mem.stats().cpu.total)
  end)
end)

-- The tiny model of train_spec, built by a function as recipes do.
local SEQ = 128
local function build(sparse)
  return function()
    local model = nn.Transformer.new{vocab = 256, dim = 16, layers = 2, heads = 2, kv_heads = 1, ffn = 24,
                                     experts = 4, topk = 2, seed = 0, checkpoint = "moe"}
    local groups = model:param_groups{weight_decay = 0.1, sparse = sparse}
    return model, optim.AdamW(groups, {lr = 3e-3}), groups
  end
end

local function run_cfg(ds, b)
  return {build = b, data = ds, seq_len = SEQ, steps = 1, clip = 1.0, lr = sched.constant(3e-3),
          aux_weight = 0.01, z_weight = 1e-3}
end

describe("train.plan", function()
  local ds
  before_each(function()
    ds = data.open{glob = "/usr/include/std*.h", seq_len = SEQ, seed = 0, holdout = 0.01}
  end)

  it("predicts the peak of a run exactly, per category; the pool never grows", function()
    -- 1024 tokens: the steps' pool, not the 1 MiB a model starts with, makes the peak
    local cfg = run_cfg(data.open{glob = "/usr/include/std*.h", seq_len = 1024, seed = 0, holdout = 0.01},
                        build(false))
    cfg.seq_len, cfg.steps, cfg.val_every, cfg.val_batches = 1024, 4, 2, 1
    collectgarbage()
    local base = mem.stats().cpu.total
    local plan = train.plan(cfg)
    assert.are.equal(base, plan.total)
    cfg.model, cfg.optimizer, cfg.groups = cfg.build()
    cfg.plan = plan
    -- a Lua heap the plan did not have (a corpus's file list, say): the
    -- tensors left to the collector die at the same points all the same
    local ballast = {}
    for i = 1, 200000 do ballast[i] = {i} end
    collectgarbage()
    mem.reset_peak()
    train.run(cfg)
    assert.are.equal(200000, #ballast)
    local real = mem.stats().cpu
    assert.are.equal(real.total_peak, plan.total_peak)
    assert.are.same(real.at_peak, plan.at_peak)
    for _, c in ipairs{"params", "grads", "optim", "acts", "pool", "comm", "cache", "other"} do
      assert.are.equal(plan.peak[c], real.peak[c], c)
    end
    assert.is_true(plan.at_peak.pool > 0 and plan.at_peak.acts > 0 and plan.at_peak.optim > 0)
    local ps = cfg.model.pool:stats()
    assert.are.equal(plan.pool_bytes, ps.high_water)
    assert.are.equal(0, ps.overflows)       -- taken at the planned size: no step grew it
    assert.are.equal(1, ps.blocks)
    assert.are.equal(plan.total_peak, plan.at_peak.pool + plan.at_peak.acts + plan.at_peak.params +
                     plan.at_peak.grads + plan.at_peak.optim + plan.at_peak.other)
    assert.is_true(plan.at_peak.pool > 2^20)
  end)

  it("without the plan the first step grows the pool, and the plan's peak is lower", function()
    local cfg = run_cfg(data.open{glob = "/usr/include/std*.h", seq_len = 1024, seed = 0}, build(false))
    cfg.steps, cfg.seq_len = 2, 1024
    collectgarbage()
    local plan = train.plan(cfg)
    cfg.model, cfg.optimizer, cfg.groups = cfg.build()
    collectgarbage()
    mem.reset_peak()
    train.run(cfg)
    assert.is_true(cfg.model.pool:stats().overflows > 0)
    assert.is_true(mem.stats().cpu.total_peak > plan.total_peak)
  end)

  it("counts lazy optimizer states for every expert (the worst case)", function()
    local dense = train.plan(run_cfg(ds, build(false)))
    local lazy = train.plan(run_cfg(ds, build(true)))
    -- lazy AdamW adds only per-expert step counters to AdamW's states
    assert.is_true(lazy.peak.optim >= dense.peak.optim)
    assert.is_true(lazy.peak.optim - dense.peak.optim < 4096)
  end)

  it("leaves the recipe's state and the data cursor alone", function()
    local cfg = run_cfg(ds, build(false))
    cfg.state = {n = 0}
    cfg.hook = function(_, state) state.n = state.n + 1 end
    ds:batch(6)
    train.plan(cfg)
    assert.are.equal(0, cfg.state.n)
    assert.are.equal(7, ds:state().cursor)
  end)

  it("over budget: nil, the budget error, and what the run needs", function()
    local cfg = run_cfg(ds, build(false))
    local need = train.plan(cfg).total_peak
    local prev = mem.budget{total = need - 4096}
    local plan, why, book = train.plan(cfg)
    local after = mem.budget(prev)
    assert.is_nil(plan)
    support.has(why, "would exceed the total budget")
    assert.are.equal(need, book.total_peak)
    assert.are.equal(need - 4096, after.total)   -- budgets restored
  end)

  it("a failing build raises, with the data cursor and the budgets restored", function()
    local cfg = run_cfg(ds, function() ds:batch(5); error("no such model") end)
    ds:batch(2)
    support.raises("no such model", train.plan, cfg)
    assert.are.equal(3, ds:state().cursor)
    local prev = mem.budget{total = 1 << 20}
    support.raises("no such model", train.plan, cfg)   -- fails before any allocation: no lifting
    assert.are.equal(1 << 20, mem.budget(prev).total)
  end)

  it("needs a build function", function()
    support.raises("build is required (a function returning model, optimizer, groups)", train.plan,
                   {data = ds, seq_len = SEQ})
  end)
end)

describe("recipes/longctx.lua", function()
  it("a seq_len over the budget fails before allocating, naming --seq-len", function()
    local dir = support.make_tmpdir()
    local p = assert(io.popen(support.host_command({"recipes/longctx.lua", "--seq-len", "131072",
                                                   "--budget-gib", "0.25", "--run-dir", dir .. "/run"})
                              .. " 2>&1"))
    local code, out = support.finish_child(p)
    assert.are_not.equal(0, code)
    assert.matches("%-%-seq%-len 131072 needs up to [%d.]+ MiB at its peak %(memory plan%), over the budget of " ..
                   "256%.00 MiB %(%-%-budget%-gib 0%.25%)", out)
    assert.is_nil(out:find("stack traceback", 1, true), out)   -- the refusal and its ledger only
    assert.is_nil(io.open(dir .. "/run/metrics.jsonl"))   -- nothing started
    support.remove_dir(dir)
  end)

  it("--device cuda plans the GPU run on any machine, then names why it cannot run here", function()
    if m.cuda_available() then return end   -- a GPU machine trains instead (tests/spec/gpu_train_spec.lua)
    local dir = support.make_tmpdir()
    local p = assert(io.popen(support.host_command({"recipes/longctx.lua", "--device", "cuda", "--seq-len", "256",
                                                   "--run-dir", dir .. "/run"}) .. " 2>&1"))
    local code, out = support.finish_child(p)
    assert.are_not.equal(0, code)
    assert.matches("memory plan %(cuda%): peak [%d.]+ MiB, no budget %(params [%d.]+, grads", out)
    assert.matches("%-%-device cuda: no usable GPU %(.+%); the plan above is what the run needs", out)
    assert.is_nil(out:find("stack traceback", 1, true))   -- a user error
    assert.is_nil(io.open(dir .. "/run/metrics.jsonl"))
    support.remove_dir(dir)
  end)

  it("--dtype bf16 plans mixed precision on cuda; the cpu refuses it, naming the option", function()
    local function run(args)
      local p = assert(io.popen(support.host_command(args) .. " 2>&1"))
      return support.finish_child(p)
    end
    local code, out = run({"recipes/longctx.lua", "--dtype", "bf16", "--seq-len", "256"})
    assert.are.equal(1, code, out)
    support.has(out, "--dtype bf16: mixed precision runs on --device cuda (the CPU's kernels are f32)")
    code, out = run({"recipes/longctx.lua", "--dtype", "f16", "--device", "cuda"})
    assert.are.equal(1, code, out)
    support.has(out, "--dtype f16: must be f32 or bf16")
    if m.cuda_available() then return end   -- a GPU machine trains instead (tests/spec/gpu_train_spec.lua)
    local dir = support.make_tmpdir()
    code, out = run({"recipes/longctx.lua", "--device", "cuda", "--dtype", "bf16", "--seq-len", "256",
                     "--run-dir", dir .. "/run"})
    assert.are_not.equal(0, code)
    assert.matches("memory plan %(cuda%): peak [%d.]+ MiB, no budget %(params [%d.]+, grads", out)
    assert.matches("%-%-device cuda: no usable GPU", out)
    support.remove_dir(dir)
  end)
end)
