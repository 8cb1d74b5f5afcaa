-- tests/spec/gpu_store_spec.lua - the expert store on the GPU (issue 13:
-- "pinned host memory, a copy stream, a slot reused only after the event
-- of its last kernel completes"), f32 on cuda: the key checks of
-- expert_store_spec.lua there. The slabs live in pinned host memory (the
-- `pinned` book), the slots in GPU memory (`cache` on the cuda book).
--
-- Same device, same kernels, same order of the experts: a budget of two
-- experts trains bitwise like resident experts, as on the CPU.
--
-- Without a CUDA device the file is one pending test. With
-- MOELUA_GPU_SPEC_DEVICE=cpu it runs on the CPU (checks the spec; the
-- backing tier is then the file tier).
local m = require "moelua"
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local data = require "moelua.data"
local train = require "moelua.train"
local mem = require "moelua.mem"
local store = require "moelua.store"
local zero = require "moelua.zero"
local support = require "tests.support"

local DEV = os.getenv("MOELUA_GPU_SPEC_DEVICE") or "cuda"

if DEV == "cuda" and not m.cuda_available() then
  describe("GPU expert store", function()
    pending("no CUDA device: GPU specs skipped")
  end)
  return
end

local SEQ, D, F, E, L = 32, 16, 24, 4, 2
local EXPERT = 4 * 3 * D * F * 4      -- one slab: parameters, gradients, AdamW's two states (f32)
local TIER = DEV == "cuda" and "pinned" or "file"

local root
local function dir(name) return root .. "/" .. name end

local function build_with(store, offload, dtype)
  return function()
    local model = nn.Transformer.new{vocab = 256, dim = D, layers = L, heads = 2, kv_heads = 1, ffn = F,
                                     experts = E, topk = 2, seed = 3, checkpoint = "moe", store = store,
                                     device = DEV, dtype = dtype or "f32", zero = zero.new{offload = offload ~= nil}}
    local groups = model:param_groups{weight_decay = 0.1, offload = offload ~= nil}
    return model, optim.AdamW(groups, {lr = 1e-2, weight_decay = 0.1, offload = offload}), groups
  end
end

-- Trains o.steps (5) steps of 2 micro-batches, clipped (a checkpoint at the
-- end in run_dir), AdamW's states offloaded with o.offload, in o.dtype
-- (f32); returns the result, the model, the plan and the optimizer.
local function run(run_dir, store, o)
  o = o or {}
  local cfg = {build = build_with(store, o.offload, o.dtype), data = data.open{glob = dir("corpus.txt"), seq_len = SEQ, seed = 0,
                                                           holdout = 0},
               seq_len = SEQ, steps = o.steps or 5, accum = 2, clip = 0.05, lr = function() return 1e-2 end,
               log_every = 1000, run_dir = run_dir, ckpt_every = o.ckpt_every or 0, keep = 10, resume = o.resume}
  local plan = train.plan(cfg)
  cfg.model, cfg.optimizer, cfg.groups = cfg.build()
  cfg.plan = plan
  return train.run(cfg), cfg.model, plan, cfg.optimizer
end

local EXPERT_BF16 = 18 * 3 * D * F   -- with mixed precision: f32 masters, gradients and states, a bf16 copy

-- path: the cpu's file (a cuda store has none)
local function store_of(name, experts, bytes)
  return {path = dir(name .. ".store"), budget = experts * (bytes or EXPERT)}
end

describe("moelua.store on " .. DEV, function()
  local raw, n = nil, 0
  setup(function() raw = support.disk_dir("gpu_store_spec_raw") end)
  teardown(function() support.remove_dir(raw) end)
  local function open(o)   -- a cuda store takes no path
    n = n + 1
    o.device = DEV
    o.path = DEV == "cpu" and raw .. "/s" .. n or nil
    return store.open(o)
  end

  it("slot views on the device; write, read and the policy's write-back move every slab's bytes", function()
    local s <close> = open{slabs = 4, slab_bytes = 40, slots = 2}
    local v0 = s:slot(0)
    assert.are.equal(DEV, v0:device())
    assert.are.equal(4 * 40, mem.stats()[TIER].total)
    support.store_round_trip(s)
    -- a dirty slab written back at eviction (LRU: 2 leaves for 1), read again
    local at = s:acquire(2)
    s:slot(at):fill_(7)
    s:release(2, true)
    s:acquire(3)
    s:release(3)
    assert.are.equal(at, (s:acquire(1)))
    s:release(1)
    assert.are.equal(1, s:stats().writebacks)
    local back = s:acquire(2)
    assert.are_not.equal(at, back)
    for _, x in ipairs(s:slot(back):totable()) do assert.are.equal(7, x) end
    s:release(2)
  end)

  it("a cuda store takes no file", function()
    if DEV ~= "cuda" then return end
    local ok, err = pcall(store.open, {device = "cuda", path = "x", slabs = 1, slab_bytes = 4, slots = 1})
    assert.is_false(ok)
    assert.is_not_nil(tostring(err):find("pinned host memory, not in a file", 1, true), err)
    local s <close> = store.open{device = "cuda", slabs = 1, slab_bytes = 4, slots = 1}
    assert.is_not_nil(tostring(s):find("pinned host memory", 1, true))
  end)
end)

describe("GPU expert store (" .. DEV .. ", f32)", function()
  setup(function()
    root = support.disk_dir("gpu_store_spec")
    support.write_corpus(dir("corpus.txt"), 11, 3000)
    m.threads(1)
  end)
  teardown(function() support.remove_dir(root) end)

  it("a budget of two experts trains bitwise like resident experts (5 steps), the cache within it", function()
    local r0 = run(dir("resident"), nil)
    collectgarbage()   -- the resident model's bytes, before the stored run's peak
    mem.timeline{cap = 1000000, interval = 0, device = DEV}
    mem.reset_peak()
    local r2, model, plan = run(dir("stored"), store_of("stored", 2))
    local samples, dropped = mem.timeline(DEV)
    mem.timeline{cap = 0, device = DEV}
    for s = 0, 4 do assert.are.equal(r0.losses[s], r2.losses[s], "step " .. s) end
    -- parameters and optimizer states: the final checkpoints (the full experts), byte for byte
    support.same_checkpoint_files(dir("resident/ckpt/step-000004"), dir("stored/ckpt/step-000004"))
    local st = model.expert_store:stats()
    assert.are.equal(2, st.slots)
    assert.is_true(st.evictions > 0 and st.writebacks > 0, "the budget was not a bound: nothing was evicted")
    -- the cache on the device's book: never over the budget at any allocation
    assert.are.equal(0, dropped)
    local most = 0
    for _, s in ipairs(samples) do most = math.max(most, s.cache) end
    assert.is_true(most > 0 and most <= 2 * EXPERT, string.format("cache peak %d, budget %d", most, 2 * EXPERT))
    local dev = mem.stats()[DEV]
    assert.is_true(dev.peak.cache > 0 and dev.peak.cache <= 2 * EXPERT, "ledger peak " .. dev.peak.cache)
    assert.are.equal(plan.total_peak, dev.total_peak, "the plan of the run with its store")
    -- the backing tier holds every slab: a quarter parameters, a quarter gradients, half AdamW states
    local tier = mem.stats()[TIER]
    assert.are.equal(L * E * EXPERT, tier.total)
    assert.are.same({L * E * EXPERT // 4, L * E * EXPERT // 4, L * E * EXPERT // 2},
                    {tier.current.params, tier.current.grads, tier.current.optim})
    model.expert_store:close()
    assert.are.equal(0, mem.stats()[TIER].total, "a closed store gives its backing bytes back")
    assert.are.equal(0, mem.stats()[DEV].current.cache)
  end)

  it("AdamW's states offloaded (--offload-optimizer) train bitwise like resident ones; only the staging is on " ..
     "the device", function()
    local CHUNK = 1000
    local r0 = run(dir("opt_resident"), nil)
    collectgarbage()
    collectgarbage()   -- (a finalised tensor's storage goes in the second cycle)
    mem.reset_peak()
    local before = mem.stats()[DEV].current.optim
    local r1, model, plan, opt = run(dir("opt_offloaded"), nil,
                                     {offload = {path = DEV == "cpu" and dir("opt.store") or nil, chunk = CHUNK}})
    for s = 0, 4 do assert.are.equal(r0.losses[s], r1.losses[s], "step " .. s) end
    support.same_checkpoint_files(dir("opt_resident/ckpt/step-000004"), dir("opt_offloaded/ckpt/step-000004"))
    -- both states of every parameter in the backing tier; on the device, the two staging slots
    local n = 0
    for _, p in ipairs(model:named_parameters()) do n = n + p.tensor:numel() end
    assert.are.equal((n + CHUNK - 1) // CHUNK * 8 * CHUNK, mem.stats()[TIER].current.optim)
    assert.are.equal(2 * 8 * CHUNK, mem.stats()[DEV].current.optim - before)   -- (8000 bytes: 64-byte aligned)
    assert.are.equal(plan.total_peak, mem.stats()[DEV].total_peak, "the plan of the run with its offload")
    opt:close()
    assert.are.equal(0, mem.stats()[TIER].total, "a closed optimizer gives its backing bytes back")
  end)

  it("saves and resumes: a run resumed from a checkpoint equals the uninterrupted one", function()
    local ref, model = run(dir("whole"), store_of("whole", 2), {steps = 6, ckpt_every = 3})
    model.expert_store:close()
    local r, again = run(dir("resumed"), store_of("resumed", 2),
                         {steps = 6, ckpt_every = 3, resume = dir("whole/ckpt/step-000002")})
    again.expert_store:close()
    for s = 3, 5 do assert.are.equal(ref.losses[s], r.losses[s], "step " .. s) end
    support.same_checkpoint_files(dir("whole/ckpt/step-000005"), dir("resumed/ckpt/step-000005"))
    -- the checkpoint holds the full experts: resident experts resume from it alike
    local rr = run(dir("resident_resumed"), nil, {steps = 6, ckpt_every = 3, resume = dir("whole/ckpt/step-000002")})
    for s = 3, 5 do assert.are.equal(ref.losses[s], rr.losses[s], "step " .. s) end
  end)
end)

describe("GPU expert store (bf16: mixed precision)", function()
  if DEV ~= "cuda" then return end   -- (the CPU's kernels are f32)
  setup(function()
    root = support.disk_dir("gpu_store_spec_bf16")
    support.write_corpus(dir("corpus.txt"), 11, 3000)
    m.threads(1)
  end)
  teardown(function() support.remove_dir(root) end)

  it("a budget of two experts trains bitwise like resident bf16 experts, the masters in the slabs", function()
    local r0 = run(dir("resident"), nil, {dtype = "bf16"})
    collectgarbage()
    mem.reset_peak()
    local r2, model, plan = run(dir("stored"), store_of("stored", 2, EXPERT_BF16), {dtype = "bf16"})
    for s = 0, 4 do assert.are.equal(r0.losses[s], r2.losses[s], "step " .. s) end
    -- the checkpoints hold the f32 masters and states: byte for byte
    support.same_checkpoint_files(dir("resident/ckpt/step-000004"), dir("stored/ckpt/step-000004"))
    local st = model.expert_store:stats()
    assert.are.equal(2, st.slots)
    assert.is_true(st.evictions > 0, "the budget was not a bound: nothing was evicted")
    local dev = mem.stats()[DEV]
    assert.is_true(dev.peak.cache > 0 and dev.peak.cache <= 2 * EXPERT_BF16, "ledger peak " .. dev.peak.cache)
    assert.are.equal(plan.total_peak, dev.total_peak, "the plan of the run with its store")
    -- per expert: the bf16 copy (2 bytes a parameter), f32 gradients (4), masters and states (12)
    local n, tier = 3 * D * F, mem.stats()[TIER]
    assert.are.same({L * E * 2 * n, L * E * 4 * n, L * E * 12 * n},
                    {tier.current.params, tier.current.grads, tier.current.optim})
    model.expert_store:close()
  end)

  it("resumes from its checkpoint like the uninterrupted run, and resident bf16 experts resume from it alike",
     function()
    local ref, model = run(dir("whole"), store_of("whole", 2, EXPERT_BF16), {steps = 6, ckpt_every = 3,
                                                                            dtype = "bf16"})
    model.expert_store:close()
    local r, again = run(dir("resumed"), store_of("resumed", 2, EXPERT_BF16),
                         {steps = 6, ckpt_every = 3, resume = dir("whole/ckpt/step-000002"), dtype = "bf16"})
    again.expert_store:close()
    for s = 3, 5 do assert.are.equal(ref.losses[s], r.losses[s], "step " .. s) end
    support.same_checkpoint_files(dir("whole/ckpt/step-000005"), dir("resumed/ckpt/step-000005"))
    local rr = run(dir("resident_resumed"), nil, {steps = 6, ckpt_every = 3, dtype = "bf16",
                                                  resume = dir("whole/ckpt/step-000002")})
    for s = 3, 5 do assert.are.equal(ref.losses[s], rr.losses[s], "step " .. s) end
  end)

  it("AdamW's states offloaded train bitwise like resident ones; the f32 masters in host memory", function()
    local CHUNK = 1000
    local r0 = run(dir("opt_resident"), nil, {dtype = "bf16"})
    collectgarbage()
    collectgarbage()
    local before = mem.stats()
    mem.reset_peak()
    local r1, model, plan, opt = run(dir("opt_offloaded"), nil, {dtype = "bf16", offload = {chunk = CHUNK}})
    for s = 0, 4 do assert.are.equal(r0.losses[s], r1.losses[s], "step " .. s) end
    support.same_checkpoint_files(dir("opt_resident/ckpt/step-000004"), dir("opt_offloaded/ckpt/step-000004"))
    local n, padded = 0, 0
    for _, p in ipairs(model:named_parameters()) do n = n + p.tensor:numel() end
    for _, u in ipairs(model.units) do padded = padded + u.master:numel() end
    assert.is_true(padded >= n)
    local now = mem.stats()
    -- host memory: the masters (the units' padded lengths); pinned: both states; the device: the
    -- two state slots and the masters' chunk
    assert.are.equal(4 * padded, now.cpu.current.optim - before.cpu.current.optim)
    assert.are.equal((n + CHUNK - 1) // CHUNK * 8 * CHUNK, now.pinned.current.optim)
    assert.are.equal(2 * 8 * CHUNK + 4 * CHUNK, now.cuda.current.optim - before.cuda.current.optim)
    assert.are.equal(plan.total_peak, now.cuda.total_peak, "the plan of the run with its offload")
    opt:close()
    assert.are.equal(0, mem.stats().pinned.total)
  end)

  it("a budget below one bf16 expert names the option and its size", function()
    local ok, err = pcall(nn.Transformer.new, {vocab = 256, dim = D, layers = L, heads = 2, kv_heads = 1, ffn = F,
                                               experts = E, topk = 2, device = "cuda", dtype = "bf16",
                                               store = store_of("small", 1, EXPERT_BF16 - 64)})
    assert.is_false(ok)
    assert.is_not_nil(tostring(err):find("--expert-budget", 1, true), err)
    assert.is_not_nil(tostring(err):find("its f32 masters, gradients and AdamW states and its bf16 copy", 1, true), err)
  end)
end)

-- Prefetch on cuda is a copy-ahead: after each acquire the next `prefetch`
-- scheduled slabs that are not resident are copied into slots at once (a
-- free one, else the one a miss would evict, never a slab needed sooner),
-- and their acquires are hits. The CPU hints instead (its counters are
-- store_spec.lua's), so the counters here are cuda's.
describe("GPU expert store: copy-ahead (" .. DEV .. ")", function()
  local raw, n = nil, 0
  setup(function()
    raw = support.disk_dir("gpu_store_spec_ahead")
    support.write_corpus(raw .. "/corpus.txt", 11, 3000)
    root = raw
    m.threads(1)
  end)
  teardown(function() support.remove_dir(raw) end)
  local function open(o)
    n = n + 1
    o.device = DEV
    o.path = DEV == "cpu" and raw .. "/s" .. n or nil
    return store.open(o)
  end
  local function counters(st)
    return {hits = st.hits, misses = st.misses, prefetches = st.prefetches, evictions = st.evictions,
            writebacks = st.writebacks}
  end

  it("turns misses into hits, and the copied slabs' bytes are there at the acquire", function()
    if DEV ~= "cuda" then return end
    -- 2 slots, slabs 0 1 2 in turn, prefetch 1:
    --   0  miss into slot 0; copy-ahead 1 into the free slot 1
    --   1  hit; copy-ahead 2 evicts 0 (never needed again), dirty: written back first
    --   2  hit
    -- Without prefetch: three misses (and the same eviction).
    for _, depth in ipairs{1, 0} do
      local s <close> = open{slabs = 3, slab_bytes = 40, slots = 2, prefetch = depth}
      local v = s:slot(0)
      for slab = 0, 2 do
        v:fill_(slab + 0.5)
        s:write(0, slab)
      end
      s:schedule{0, 1, 2}
      local got = {}
      for _, slab in ipairs{0, 1, 2} do
        local at, hit = s:acquire(slab)
        got[#got + 1] = hit
        for _, x in ipairs(s:slot(at):totable()) do assert.are.equal(slab + 0.5, x, "slab " .. slab) end
        if slab == 0 then s:slot(at):fill_(9) end
        s:release(slab, slab == 0)
      end
      local st = s:stats()
      if depth == 1 then
        assert.are.same({false, true, true}, got)
        assert.are.same({hits = 2, misses = 1, prefetches = 2, evictions = 1, writebacks = 1}, counters(st))
      else
        assert.are.same({false, false, false}, got)
        assert.are.same({hits = 0, misses = 3, prefetches = 0, evictions = 1, writebacks = 1}, counters(st))
      end
      assert.are.same({3 * 40, 4 * 40}, {st.bytes_read, st.bytes_written})   -- (the fill's three writes)
      -- slab 0's write-back (queued before slab 2's copy into its slot) holds the kernel's bytes
      s:schedule{}
      local at = s:acquire(0)
      for _, x in ipairs(s:slot(at):totable()) do assert.are.equal(9, x) end
      s:release(0)
    end
  end)

  -- 2 slots, the order 0 1 0 2, prefetch 2:
  --   0  miss into slot 0; copy-ahead 1 into the free slot 1 (0 is resident)
  --   1  hit; 2 (index 3) is not copied: the only unpinned slot holds 0,
  --      needed sooner (index 2)
  --   0  hit; copy-ahead 2 evicts 1 (never needed again)
  --   2  hit
  local function refusal(s, check)
    s:schedule{0, 1, 0, 2}
    local got = {}
    for i, slab in ipairs{0, 1, 0, 2} do
      local _, hit = s:acquire(slab)
      got[i] = hit
      if i == 2 then check() end
      s:release(slab)
    end
    return got, counters(s:stats()), s:stats().bytes_read
  end

  it("never evicts a slab needed before the one it would copy; a plan takes the same slots", function()
    if DEV ~= "cuda" then return end
    local s <close> = open{slabs = 3, slab_bytes = 40, slots = 2, prefetch = 2}
    local got, c, read = refusal(s, function()
      assert.is_nil(s:resident(2), "2 was copied ahead over 0, which is needed first")
      assert.are.equal(0, s:resident(0))
    end)
    assert.are.same({false, true, true, true}, got)
    assert.are.same({hits = 3, misses = 1, prefetches = 2, evictions = 1, writebacks = 0}, c)
    assert.are.equal(3 * 40, read)
    -- inside a plan the policy is the same: no byte moves, and the counters (bytes too) are the run's
    local pgot, pc, pread
    mem.plan(function()
      local p <close> = store.open{device = DEV, slabs = 3, slab_bytes = 40, slots = 2, prefetch = 2}
      pgot, pc, pread = refusal(p, function() assert.is_nil(p:resident(2)) end)
    end)
    assert.are.same(got, pgot)
    assert.are.same(c, pc)
    assert.are.equal(read, pread)
  end)

  -- Copy-ahead moves reads earlier without adding any: each copy takes the
  -- slot its miss would have taken, so the traffic, the evictions and the
  -- write-backs are prefetch 0's, and every copy turns a miss into a hit.
  it("trains bitwise alike with prefetch 2 and 0 and with resident experts (budgets of 2 and 3 experts)",
     function()
    local r0 = run(dir("ahead_resident"), nil, {steps = 3})
    for _, budget in ipairs{2, 3} do
      local st = {}
      for _, depth in ipairs{0, 2} do
        local name = string.format("ahead_b%d_p%d", budget, depth)
        local o = store_of(name, budget)
        o.prefetch = depth
        local r, model = run(dir(name), o, {steps = 3})
        for s = 0, 2 do assert.are.equal(r0.losses[s], r.losses[s], name .. " step " .. s) end
        support.same_checkpoint_files(dir("ahead_resident/ckpt/step-000002"), dir(name .. "/ckpt/step-000002"))
        st[depth] = model.expert_store:stats()
        model.expert_store:close()
      end
      local p0, p2 = st[0], st[2]
      if DEV == "cuda" then
        assert.is_true(p2.prefetches > 0, "budget " .. budget .. ": nothing was copied ahead")
        assert.are.equal(p0.hits + p2.prefetches, p2.hits, "budget " .. budget .. ": a copy is a hit")
        assert.are.equal(p0.hits + p0.misses, p2.hits + p2.misses)
      end
      for _, k in ipairs{"bytes_read", "bytes_written", "evictions", "writebacks"} do
        assert.are.equal(p0[k], p2[k], "budget " .. budget .. ": " .. k)
      end
    end
  end)
end)
