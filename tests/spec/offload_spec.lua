-- tests/spec/offload_spec.lua - AdamW's states in a store (moelua.optim's
-- offload; --offload-optimizer): the same losses, parameters and states
-- as resident states, only the staging resident, the plan exact,
-- checkpoints that resume and roll back, an expert store beside it, bad input.
local m = require "moelua"
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local data = require "moelua.data"
local train = require "moelua.train"
local mem = require "moelua.mem"
local fs = require "moelua.fs"
local support = require "tests.support"

local SEQ, D, F, E, L = 32, 16, 24, 4, 2
local CHUNK, SLOTS = 1000, 2             -- small chunks: many slabs, evictions every step
local STRIDE = (8 * CHUNK + 63) // 64 * 64   -- a slot: a chunk of exp_avg and of exp_avg_sq, 64-byte aligned

-- A directory on a disk (the store refuses tmpfs): under the build tree.
local root
local function dir(name) return root .. "/" .. name end

-- o: sparse, checkpoint, offload (a store path), store (an expert store's
-- options), bad ({[batch] = true}: the loss is NaN there, a planted bad batch).
local function build_with(o)
  return function()
    local model = nn.Transformer.new{vocab = 256, dim = D, layers = L, heads = 2, kv_heads = 1, ffn = F,
                                     experts = E, topk = 2, seed = 3, checkpoint = o.checkpoint or "moe",
                                     store = o.store}
    if o.bad then
      local forward = model.forward
      model.forward = function(self, tokens, s)
        local l, st = forward(self, tokens, s)
        if o.bad[o.current] then return 0 / 0, st end
        return l, st
      end
    end
    local groups = model:param_groups{weight_decay = 0.1, sparse = o.sparse}
    local offload = o.offload and {path = o.offload, chunk = CHUNK, slots = SLOTS}
    return model, optim.AdamW(groups, {lr = 1e-2, weight_decay = 0.1, offload = offload}), groups
  end
end

-- Trains o.steps (5) steps, a checkpoint at the end in run_dir; returns
-- the result, the model, the optimizer and the plan.
local function run(run_dir, o)
  local ds = data.open{glob = root .. "/corpus.txt", seq_len = SEQ, seed = 0, holdout = 0}
  if o.bad then
    local batch = ds.batch
    ds.batch = function(self, i) o.current = i; return batch(self, i) end
  end
  local cfg = {build = build_with(o), data = ds, seq_len = SEQ, steps = o.steps or 5,
               accum = 2, clip = o.clip or 1.0, lr = function() return 1e-2 end, log_every = 1000,
               run_dir = run_dir, ckpt_every = o.ckpt_every or 0, keep = 10, resume = o.resume,
               rollback = o.bad and {max_skipped = 1} or nil,
               alarms = o.bad and {collapse = 1e9} or nil}   -- (a collapse would make the checkpoint not good)
  local plan = train.plan(cfg)
  cfg.model, cfg.optimizer, cfg.groups = cfg.build()
  cfg.plan = plan
  local r = train.run(cfg)
  return r, cfg.model, cfg.optimizer, plan
end

local function current(book, cat) return mem.stats()[book].current[cat] or 0 end

describe("optimizer offload", function()
  setup(function()
    root = support.disk_dir("offload_spec")
    support.write_corpus(root .. "/corpus.txt", 11, 3000)
    m.threads(1)
  end)
  teardown(function() support.remove_dir(root) end)

  for _, case in ipairs{{what = "dense AdamW, clipped, moe recompute", o = {clip = 0.05}},
                        {what = "lazy Adam, no recompute", o = {sparse = true, checkpoint = "none"}}} do
    it("trains bitwise like resident states, holding only the staging (5 steps, 2 micro-batches): " ..
       case.what, function()
      local tag = case.o.sparse and "lazy" or "dense"
      local r0 = run(dir("res_" .. tag), case.o)
      collectgarbage(); collectgarbage()
      local optim0, cache0 = current("cpu", "optim"), current("cpu", "cache")
      mem.reset_peak()
      local o = {offload = dir("off_" .. tag .. ".store")}
      for k, v in pairs(case.o) do o[k] = v end
      local r1, _, opt, plan = run(dir("off_" .. tag), o)
      assert.are.equal(plan.total_peak, mem.stats().cpu.total_peak, "the plan is the run's peak")
      for s = 0, 4 do assert.are.equal(r0.losses[s], r1.losses[s], "step " .. s) end
      -- parameters, states (and a lazy group's counts): the final checkpoints, byte for byte
      local files = case.o.sparse and {"model.safetensors", "optim/exp_avg.safetensors", "optim/exp_avg_sq.safetensors",
                                        "optim/steps.safetensors"} or nil
      support.same_checkpoint_files(dir("res_" .. tag .. "/ckpt/step-000004"), dir("off_" .. tag .. "/ckpt/step-000004"), files)
      -- resident: the staging slots and a lazy group's i64 counts (both `optim`), nothing else
      local counts, sparse = 0, 0
      for i, g in ipairs(opt.groups) do
        local steps = opt.state[i].steps
        counts, sparse = counts + (steps and 8 * steps:numel() or 0), sparse + (g.experts and 1 or 0)
      end
      assert.is_true(not case.o.sparse or sparse > 0)
      assert.are.equal(case.o.sparse and 8 * E * sparse or 0, counts)
      assert.are.equal(counts + SLOTS * STRIDE, current("cpu", "optim") - optim0)
      assert.are.equal(0, current("cpu", "cache") - cache0)
      local st = opt:offload_stats()
      -- the plan's traffic per step is the run's
      local steps = {}
      for _, m in ipairs(support.metrics(dir("off_" .. tag))) do
        if m.step and not m.event then steps[#steps + 1] = m.optim_store end
      end
      local a, b, want = steps[1], steps[2], plan.per_step.optim
      assert.are.same({want.read, want.written, want.misses},
                      {b.bytes_read - a.bytes_read, b.bytes_written - a.bytes_written, b.misses - a.misses})
      assert.is_true(case.o.sparse or want.read > 0)
      assert.are.equal(SLOTS, st.slots)
      assert.is_true(st.slabs > 4 * SLOTS and st.evictions > 0 and st.writebacks > 0, "the staging was not a bound")
      assert.are.equal(st.slabs * 8 * CHUNK, current("file", "optim"))
      local path = dir("off_" .. tag .. ".store")
      assert.is_not_nil(fs.stat(path))
      opt:close()
      assert.is_nil(fs.stat(path), "a closed store removes its file")
      assert.are.equal(0, current("file", "optim"))
    end)
  end

  it("resumes from a checkpoint like an uninterrupted run (dense and lazy)", function()
    for _, sparse in ipairs{false, true} do
      local tag = sparse and "lazy" or "dense"
      local ref = run(dir("whole_" .. tag), {offload = dir("whole_" .. tag .. ".store"), sparse = sparse, steps = 6,
                                             ckpt_every = 3})
      local r = run(dir("resumed_" .. tag), {offload = dir("resumed_" .. tag .. ".store"), sparse = sparse, steps = 6,
                                             ckpt_every = 3, resume = dir("whole_" .. tag .. "/ckpt/step-000002")})
      for s = 3, 5 do assert.are.equal(ref.losses[s], r.losses[s], tag .. " step " .. s) end
      support.same_checkpoint_files(dir("whole_" .. tag .. "/ckpt/step-000005"), dir("resumed_" .. tag .. "/ckpt/step-000005"))
      collectgarbage(); collectgarbage()
    end
  end)

  it("holds Ctrl-C through the offloaded pass: the step completes, is saved and resumes", function()
    -- a child: SIGINT to itself from inside the pass of step 4 (the first chunk's update)
    local script = dir("int.lua")
    support.write_file(script, string.format([[
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local data = require "moelua.data"
local train = require "moelua.train"
local C = require "moelua.optim_c"
require("moelua").threads(1)
local armed = false
local update = C.adamw_step
C.adamw_step = function(...)
  if armed then   -- (popen: os.execute's system() ignores SIGINT while it waits)
    armed = false
    io.popen("kill -INT " .. io.open("/proc/self/stat"):read("n")):close()
  end
  return update(...)
end
local function build()
  local model = nn.Transformer.new{vocab = 256, dim = %d, layers = %d, heads = 2, kv_heads = 1, ffn = %d,
    experts = %d, topk = 2, seed = 3, checkpoint = "moe"}
  local groups = model:param_groups{weight_decay = 0.1}
  return model, optim.AdamW(groups, {lr = 1e-2, weight_decay = 0.1,
                                     offload = {path = %q, chunk = %d, slots = %d}}), groups
end
local cfg = {build = build, data = data.open{glob = %q, seq_len = %d, seed = 0, holdout = 0}, seq_len = %d,
             steps = 6, accum = 2, clip = 1.0, lr = function() return 1e-2 end, log_every = 1000,
             run_dir = %q, ckpt_every = 3, keep = 10,
             hook = function(step) armed = step == 4 end}
cfg.plan = train.plan(cfg)
cfg.model, cfg.optimizer, cfg.groups = build()
train.run(cfg)
]], D, L, F, E, dir("int.store"), CHUNK, SLOTS, root .. "/corpus.txt", SEQ, SEQ, dir("int")))
    local code, out = support.finish_child(assert(io.popen(support.host_command({script}) .. " 2>&1")))
    assert.are.equal(1, code, out)
    support.has(out, "interrupted at step 5; saved " .. dir("int/ckpt/step-000004"))
    assert.is_nil(fs.stat(dir("int.store")), "the store's file is removed at exit")
    -- step 4 whole: resuming from it gives the uninterrupted run's step 5 (the test above)
    run(dir("int"), {offload = dir("int2.store"), steps = 6, ckpt_every = 3, resume = dir("int/ckpt/step-000004")})
    support.same_checkpoint_files(dir("whole_dense/ckpt/step-000005"), dir("int/ckpt/step-000005"))
  end)

  it("rolls back to a checkpoint like resident states (a planted bad batch, lazy Adam)", function()
    -- checkpoint at step 2; batch 8 (step 4) is NaN: skipped, then a rollback
    -- that restores the optimizer's live (offloaded) states
    local r0 = run(dir("rb_res"), {sparse = true, steps = 7, ckpt_every = 3, bad = {[8] = true}})
    local r1 = run(dir("rb_off"), {sparse = true, steps = 7, ckpt_every = 3, bad = {[8] = true},
                                   offload = dir("rb_off.store")})
    assert.are.equal(1, r0.rollbacks)
    assert.are.equal(1, r1.rollbacks)
    for s = 0, 6 do assert.are.equal(r0.losses[s], r1.losses[s], "step " .. s) end
    support.same_checkpoint_files(dir("rb_res/ckpt/step-000006"), dir("rb_off/ckpt/step-000006"))
    collectgarbage(); collectgarbage()
  end)

  it("works beside an expert store: the store's experts keep their own states", function()
    local EXPERT = 4 * 3 * D * F * 4
    local function store(name) return {path = dir(name), budget = 2 * EXPERT, prefetch = 2} end
    local r0 = run(dir("es"), {store = store("es.store"), steps = 3})
    local r1, model, opt = run(dir("es_off"), {store = store("es_off.store"), offload = dir("es_off.optim"), steps = 3})
    for s = 0, 2 do assert.are.equal(r0.losses[s], r1.losses[s], "step " .. s) end
    support.same_checkpoint_files(dir("es/ckpt/step-000002"), dir("es_off/ckpt/step-000002"))
    assert.is_true(opt:offload_stats().misses > 0)
    model.expert_store:close()
    opt:close()
    collectgarbage(); collectgarbage()
  end)

  describe("bad input", function()
    local function groups()
      local model = nn.Transformer.new{vocab = 256, dim = D, layers = 1, heads = 2, kv_heads = 1, ffn = F,
                                       experts = E, topk = 2, seed = 3}
      return model:param_groups{weight_decay = 0.1}
    end

    it("the API: a path on tmpfs, an existing file, unknown keys, states asked for as tensors", function()
      support.raises("moelua.optim.AdamW: option 'offload': /dev/shm/moelua_offload_spec.store is on tmpfs",
                     optim.AdamW, groups(), {offload = {path = "/dev/shm/moelua_offload_spec.store"}})
      assert.is_nil(fs.stat("/dev/shm/moelua_offload_spec.store"))
      support.write_file(dir("exists.store"), "x")
      support.raises("option 'offload': " .. dir("exists.store") .. " exists",
                     optim.AdamW, groups(), {offload = {path = dir("exists.store")}})
      support.raises("option 'offload': unknown key 'budget' (expected one of: chunk, path, slots)",
                     optim.AdamW, groups(), {offload = {path = dir("x.store"), budget = 1}})
      support.raises("option 'offload': 'chunk' must be an integer >= 1 (elements), got 0",
                     optim.AdamW, groups(), {offload = {path = dir("x.store"), chunk = 0}})
      local opt = optim.AdamW(groups(), {offload = {path = dir("api.store"), chunk = 64}})
      support.raises("AdamW:state_tensor: the states of group 1 are offloaded", opt.state_tensor, opt, 1, "exp_avg")
      support.raises("AdamW:read_state: group 1 has no exp_avg yet", opt.read_state, opt, 1, "exp_avg", nil, 0, 1,
                     function() end)
      support.raises("AdamW:read_state: elements [0, 0 + 1000000) are outside", opt.read_state, opt, 1, "exp_avg",
                     nil, 0, 1000000, function() end)
      -- written through the staging, read back the same, across chunks
      local n = opt.groups[1].params:numel()
      opt:write_state(1, "exp_avg_sq", nil, 10, n - 20, function(v, at) v:copy_(m.arange(at, at + v:numel())) end)
      local seen = {}
      opt:read_state(1, "exp_avg_sq", nil, 0, n, function(v, at)
        for j, x in ipairs(v:totable()) do seen[at + j] = x end
      end)
      assert.are.same({0, 0, 0}, {seen[1], seen[10], seen[n]})
      assert.are.same({0, 1, n - 21}, {seen[11], seen[12], seen[n - 10]})
      opt:close()
      assert.is_nil(fs.stat(dir("api.store")))
    end)

    it("the API: a resident optimizer's state_dict loads into an offloaded one, markers come out", function()
      local gs = groups()
      for _, g in ipairs(gs) do g.grads:copy_(m.randn({g.grads:numel()})) end
      local res = optim.AdamW(gs, {lr = 1e-2})
      res:step()
      local off = optim.AdamW(gs, {offload = {path = dir("load.store"), chunk = 100}})
      off:load_state_dict(res:state_dict())
      local sd = off:state_dict()
      assert.are.same({1, 1, true, true}, {sd.t, sd.groups[1].step, sd.groups[1].exp_avg, sd.groups[1].exp_avg_sq})
      for i, g in ipairs(gs) do
        for _, k in ipairs{"exp_avg", "exp_avg_sq"} do
          local got = {}
          off:read_state(i, k, nil, 0, g.params:numel(), function(v, at)
            for j, x in ipairs(v:totable()) do got[at + j] = x end
          end)
          assert.are.same(res:state_dict().groups[i][k]:totable(), got, k .. " of group " .. i)
        end
      end
      off:close()
    end)

    it("the recipe: --zero 1, a run directory on tmpfs", function()
      local base = {"recipes/longctx.lua", "--steps", "1", "--seq-len", "64", "--data", root .. "/corpus.txt",
                    "--offload-optimizer"}
      local shm = "/dev/shm/moelua_offload_spec_run"
      support.remove_dir(shm)
      for _, c in ipairs{
        {{"--zero", "1", "--run-dir", dir("bad")},
         "--offload-optimizer: not built for sharded training yet (--zero 1 on 1 rank): use one process at --zero 0"},
        {{"--run-dir", shm}, "--offload-optimizer: " .. shm .. "/optim.store is on tmpfs"},
      } do
        local a = {table.unpack(base)}
        for _, v in ipairs(c[1]) do a[#a + 1] = v end
        local code, out = support.finish_child(assert(io.popen(support.host_command(a) .. " 2>&1")))
        assert.are.equal(1, code, out)
        support.has(out, c[2])
        assert.is_nil(out:find("traceback", 1, true), out)
      end
      assert.is_nil(fs.stat(shm .. "/optim.store"), "the refused store left no file")
      assert.is_nil(fs.stat(dir("bad/ckpt")), "nothing was written")
      support.remove_dir(shm)
    end)
  end)
end)
