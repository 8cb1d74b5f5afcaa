-- tests/spec/expert_store_spec.lua - training with the experts in an expert
-- store under a byte budget (moelua.expert_store; --expert-budget): the
-- same numbers as resident experts, the budget held at every allocation,
-- the policy's counters, checkpoints and a killed job, bad input.
local m = require "moelua"
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local data = require "moelua.data"
local train = require "moelua.train"
local mem = require "moelua.mem"
local fs = require "moelua.fs"
local support = require "tests.support"

local SEQ, D, F, E, L = 32, 16, 24, 4, 2
local EXPERT = 4 * 3 * D * F * 4      -- one slab: parameters, gradients, AdamW's two states (f32)

-- A directory on a disk (the store refuses tmpfs): under the build tree.
local root
local function dir(name) return root .. "/" .. name end

local function build_with(store, o)
  o = o or {}
  return function()
    local model = nn.Transformer.new{vocab = 256, dim = D, layers = L, heads = 2, kv_heads = 1, ffn = F,
                                     experts = E, topk = 2, seed = 3, checkpoint = o.checkpoint or "moe",
                                     store = store}
    local groups = model:param_groups{weight_decay = 0.1, sparse = o.sparse}
    return model, optim.AdamW(groups, {lr = 1e-2, weight_decay = 0.1}), groups
  end
end

local function corpus() return data.open{glob = root .. "/corpus.txt", seq_len = SEQ, seed = 0, holdout = 0} end

-- Trains `steps` steps (a checkpoint at the end in run_dir); returns the
-- result and the model.
local function run(run_dir, store, o)
  o = o or {}
  local cfg = {build = build_with(store, o), data = corpus(), seq_len = SEQ, steps = o.steps or 5,
               accum = o.accum or 2, clip = o.clip or 1.0, lr = function() return 1e-2 end, log_every = 1000,
               run_dir = run_dir, ckpt_every = o.ckpt_every or 0, keep = 10, resume = o.resume}
  local plan = train.plan(cfg)
  cfg.model, cfg.optimizer, cfg.groups = cfg.build()
  cfg.plan = plan
  local r = train.run(cfg)
  return r, cfg.model, plan
end

local function store_at(path, experts) return {path = path, budget = experts * EXPERT, prefetch = 2} end

describe("expert store in training", function()
  setup(function()
    root = support.disk_dir("expert_store_spec")
    support.write_corpus(root .. "/corpus.txt", 11, 3000)
    m.threads(1)
  end)
  teardown(function() support.remove_dir(root) end)

  for _, case in ipairs{{what = "dense AdamW, clipped, moe recompute", o = {clip = 0.05}},
                        {what = "lazy Adam, no recompute", o = {sparse = true, checkpoint = "none"}}} do
    it("a budget of two experts trains bitwise like resident experts (5 steps, 2 micro-batches): " .. case.what, function()
      local tag = case.o.sparse and "lazy" or "dense"
      local r0 = run(dir("res_" .. tag), nil, case.o)
      local r2, model = run(dir("st_" .. tag), store_at(dir("st_" .. tag .. ".store"), 2), case.o)
      for s = 0, 4 do assert.are.equal(r0.losses[s], r2.losses[s], "step " .. s) end
      -- parameters and optimizer states: the final checkpoints, byte for byte
      support.same_checkpoint_files(dir("res_" .. tag .. "/ckpt/step-000004"), dir("st_" .. tag .. "/ckpt/step-000004"))
      local st = model.expert_store:stats()
      assert.are.equal(2, st.slots)
      assert.is_true(st.evictions > 0 and st.writebacks > 0, "the budget was not a bound: nothing was evicted")
    end)
  end

  it("holds the cache at or under the budget at every allocation, and plans the run exactly", function()
    local budget = 3 * EXPERT
    mem.timeline{cap = 1000000, interval = 0}
    mem.reset_peak()
    local r, model, plan = run(dir("bound"), {path = dir("bound.store"), budget = budget})
    local samples, dropped = mem.timeline()
    mem.timeline{cap = 0}
    assert.are.equal(0, dropped)
    local most = 0
    for _, s in ipairs(samples) do most = math.max(most, s.cache) end
    assert.is_true(most > 0 and most <= budget, string.format("cache peak %d, budget %d", most, budget))
    assert.is_true(#r.losses >= 0)
    assert.are.equal(plan.total_peak, mem.stats().cpu.total_peak)
    -- the plan's store traffic per step (its second) is the run's second step's, every expert routed here
    local steps = {}
    for _, o in ipairs(support.metrics(dir("bound"))) do
      if o.step and not o.event then steps[#steps + 1] = o.expert_store end
    end
    local a, b, want = steps[1], steps[2], plan.per_step.experts
    assert.are.same({want.read, want.written, want.hits, want.misses},
                    {b.bytes_read - a.bytes_read, b.bytes_written - a.bytes_written, b.hits - a.hits,
                     b.misses - a.misses})
    assert.is_true(want.read > 0 and want.written > 0)
    -- the backing file: every expert's slab, on the file tier while the store is open,
    -- a quarter parameters, a quarter gradients, half AdamW states
    local file = mem.stats().file
    assert.are.equal(L * E * EXPERT, file.total)
    assert.are.same({L * E * EXPERT // 4, L * E * EXPERT // 4, L * E * EXPERT // 2},
                    {file.current.params, file.current.grads, file.current.optim})
    local path = dir("bound.store")
    assert.is_not_nil(fs.stat(path))
    model.expert_store:close()
    assert.is_nil(fs.stat(path), "a closed store removes its file")
    assert.are.equal(0, mem.stats().file.total)
  end)

  it("counts the hits, misses and evictions of the step's known order (one layer, two slots)", function()
    -- L = 1 is not this file's model: a model of one layer, accum 1, no recompute
    local path = dir("order.store")
    local model = nn.Transformer.new{vocab = 256, dim = D, layers = 1, heads = 2, kv_heads = 1, ffn = F, experts = E,
                                     topk = 2, seed = 3, store = {path = path, budget = 2 * EXPERT, prefetch = 1}}
    local groups = model:param_groups{weight_decay = 0.1}
    local opt = optim.AdamW(groups, {lr = 1e-2})
    local tokens = corpus():batch(0)
    model:zero_grad()
    model:forward(tokens, 0)
    for e = 1, E do assert.is_true(model:active_experts(1):totable()[e] > 0, "expert " .. e .. " had no tokens") end
    model.zero:begin_backward(true, 1)
    model:backward{}
    model.zero:reduce_grads(1)
    model.zero:clip_grad_norm(groups, math.huge)
    opt:step(1e-2)
    model.zero:after_step(opt, 1e-2)
    -- The order: forward 0 1 2 3, backward 0 1 2 3 (one schedule, from the
    -- routing); the optimizer queues each expert's update instead of a pass
    -- over the slabs. 2 slots, a miss evicts the slab needed furthest ahead
    -- (never again: the least recently used). Slots after each access:
    --   forward   0 m {0}, 1 m {0 1}, 2 m evict 1 (next at 5 > 4) {0 2}, 3 m evict 2 {0 3}
    --   backward  0 h, 1 m evict 0 (8 > 7) {1 3}, 2 m evict 1 (9 > 7) {2 3}, 3 h
    local es = model.expert_store
    local st = es:stats()
    assert.are.same({hits = 2, misses = 6, evictions = 4},
                    {hits = st.hits, misses = st.misses, evictions = st.evictions})
    assert.is_true(st.prefetches > 0 and st.prefetches <= st.misses)
    for e = 0, E - 1 do assert.are.equal(1, #es.queued[e], "expert " .. e .. "'s update is queued") end
    -- the next forward runs them, each at its expert's acquire (its slab then dirty):
    --   0 m evict 3 (its next use, 3, is after 2's) {2 0}, 1 m evict 0 (4 > 2) {2 1}, 2 h, 3 m
    model:forward(tokens, 0)
    assert.is_nil(next(es.queued), "every queued update ran")
    assert.are.same({st.hits + 1, st.misses + 3}, {es:stats().hits, es:stats().misses})
    es:close()
  end)

  it("frees an expert's slot when its kernel raises (Ctrl-C, a NaN): a one-slot store steps on", function()
    local model = nn.Transformer.new{vocab = 256, dim = D, layers = 1, heads = 2, kv_heads = 1, ffn = F, experts = E,
                                     topk = 2, seed = 3, store = {path = dir("raise.store"), budget = EXPERT}}
    local experts = require "moelua.experts"
    local tokens = corpus():batch(0)
    local function step()
      model:zero_grad()
      model:forward(tokens, 0)
      model.zero:begin_backward(true, 1)
      model:backward{}
    end
    for _, fn in ipairs{"forward", "backward"} do
      local real = experts[fn]
      experts[fn] = function() experts[fn] = real; error("interrupted!", 0) end   -- once
      local ok, err = pcall(step)
      experts[fn] = real
      assert.are.same({false, "interrupted!"}, {ok, err})
      step()   -- "all 1 cache slots are in use" when the raise kept its slot
    end
    assert.are.equal(1, model.expert_store:stats().slots)
    model.expert_store:close()
  end)

  it("a run killed mid-step resumes from its last checkpoint like an uninterrupted run", function()
    local ref = run(dir("whole"), store_at(dir("whole.store"), 2), {steps = 6, ckpt_every = 3})
    -- the same run, killed (SIGKILL) during step 4's backward: a child process
    local script = dir("killed.lua")
    support.write_file(script, string.format([[
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local data = require "moelua.data"
local train = require "moelua.train"
require("moelua").threads(1)
local function build()
  local model = nn.Transformer.new{vocab = 256, dim = %d, layers = %d, heads = 2, kv_heads = 1, ffn = %d,
    experts = %d, topk = 2, seed = 3, checkpoint = "moe", store = {path = %q, budget = %d, prefetch = 2}}
  local groups = model:param_groups{weight_decay = 0.1}
  return model, optim.AdamW(groups, {lr = 1e-2, weight_decay = 0.1}), groups
end
local cfg = {build = build, data = data.open{glob = %q, seq_len = %d, seed = 0, holdout = 0}, seq_len = %d,
             steps = 6, accum = 2, clip = 1.0, lr = function() return 1e-2 end, log_every = 1000,
             run_dir = %q, ckpt_every = 3, keep = 10}
cfg.model, cfg.optimizer, cfg.groups = build()
cfg.plan = train.plan(cfg)
local step_of = 0
local orig = cfg.model.backward
function cfg.model:backward(w)
  step_of = step_of + 1
  if step_of == 9 then os.execute("kill -9 " .. io.open("/proc/self/stat"):read("n")) end
  return orig(self, w)
end
train.run(cfg)
]], D, L, F, E, dir("killed.store"), 2 * EXPERT, root .. "/corpus.txt", SEQ, SEQ, dir("killed")))
    local code = os.execute(support.host_command({script}) .. " >/dev/null 2>&1")
    assert.is_not_true(code)
    assert.is_not_nil(fs.stat(dir("killed.store")), "the killed job left its store")
    assert.is_not_nil(fs.stat(dir("killed/ckpt/step-000002")))
    assert.is_nil(fs.stat(dir("killed/ckpt/step-000005")))
    -- resume: the stale store is the recipe's to remove (train.expert_store_path); here by hand
    os.remove(dir("killed.store"))
    local r = run(dir("killed"), store_at(dir("killed.store"), 2),
                  {steps = 6, ckpt_every = 3, resume = dir("killed/ckpt/step-000002")})
    for s = 3, 5 do assert.are.equal(ref.losses[s], r.losses[s], "step " .. s) end
    support.same_checkpoint_files(dir("whole/ckpt/step-000005"), dir("killed/ckpt/step-000005"))
  end)

  it("generation with a budget of one expert gives the bytes and routing of resident experts", function()
    local inspect = require "moelua.inspect"
    local ck = dir("whole/ckpt/step-000005")   -- the run of the test above
    local o = {n = 12, temperature = 1.0, top_p = 0.95, seed = 7, seq_len = 24}
    local resident = inspect.open(ck):generate("alpha beta", o)
    local h = inspect.open(ck, {store = {path = dir("gen.store"), budget = 3 * D * F * 4, inference = true}})
    local stored = h:generate("alpha beta", o)
    assert.are.equal(resident.text, stored.text)
    assert.are.same(resident.trace, stored.trace)
    local st = h.model.expert_store:stats()
    assert.are.equal(1, st.slots)
    assert.are.equal(3 * D * F * 4, st.slab_bytes)   -- inference: the parameters alone
    assert.is_true(st.misses > 0 and st.bytes_read > 0)
    h.model.expert_store:close()
    assert.is_nil(fs.stat(dir("gen.store")))
  end)

  it("recipes/generate.lua prints the continuation and the store's traffic", function()
    local args = {"recipes/generate.lua", "--ckpt", dir("whole/ckpt"), "--prompt", "alpha", "--n", "8",
                  "--greedy", "--expert-budget", "64KiB", "--expert-store", dir("gen2.store")}
    local code, out = support.finish_child(assert(io.popen(support.host_command(args) .. " 2>&1")))
    assert.are.equal(0, code, out)
    assert.are.equal("alpha", out:sub(1, 5), out)   -- the prompt, then the bytes as they are drawn
    support.has(out, "8 bytes in ")
    assert.is_not_nil(out:find("experts: %d+ of 8 resident %(%d+%.%d+ MiB%), hit rate [%d.]+%% %(%d+ hits, %d+ misses%)"), out)
    assert.is_nil(fs.stat(dir("gen2.store")), "the store's file is removed at exit")
    for _, c in ipairs{{{"--top-p", "1.5"}, "option %-%-top%-p must be at most 1, got 1.5"},
                       {{"--top-p", "0"}, "option %-%-top%-p must be at least 1e%-06, got 0"},
                       {{"--expert-store", dir("lone.store")}, "%-%-expert%-store: the expert store's file is used " ..
                                                               "only with %-%-expert%-budget %(give both, or neither%)"},
                       {{"--expert-prefetch", "1"}, "%-%-expert%-prefetch: the expert store's hints are used only " ..
                                                    "with %-%-expert%-budget"},
                       {{"--greedy", "--temperature", "0.5"}, "%-%-temperature: %-%-greedy takes the most likely " ..
                                                              "byte, whatever the temperature"},
                       {{"--temperature", "0", "--top-p", "0.5"}, "%-%-top%-p: greedy decoding %(%-%-greedy or " ..
                                                                  "%-%-temperature 0%) takes the most likely byte"},
                       {{"--greedy", "--seed", "3"}, "%-%-seed: greedy decoding %(%-%-greedy or %-%-temperature 0%) " ..
                                                     "draws nothing to seed"},
                       {{"--threads", "1025"}, "option %-%-threads must be at most 1024, got 1025"},
                       {{"--seq-len", "1000000000"},
                        "recipes/generate%.lua: %-%-seq%-len 1000000000 does not fit: the planned run failed " ..
                        "%(nothing was allocated%)"}} do
      args = {"recipes/generate.lua", "--ckpt", dir("whole/ckpt"), "--prompt", "alpha", table.unpack(c[1])}
      code, out = support.finish_child(assert(io.popen(support.host_command(args) .. " 2>&1")))
      assert.are.equal(1, code, out)
      assert.matches(c[2], out)
      assert.is_nil(out:find("traceback", 1, true), out)
      assert.are_not.equal("alpha", out:sub(1, 5), out)   -- refused before the prompt is echoed
    end
    -- a reader that stops early (| head): an error, and the store's file is removed all the same
    args = {"recipes/generate.lua", "--ckpt", dir("whole/ckpt"), "--prompt", "alpha", "--n", "4000",
            "--expert-budget", "64KiB", "--expert-store", dir("pipe.store")}
    local p = assert(io.popen("{ " .. support.host_command(args) .. " 2>&3 | head -c 3 > /dev/null; } 3>&1"))
    code, out = support.finish_child(p)
    support.has(out, "recipes/generate.lua: writing the text: Broken pipe")
    assert.is_nil(fs.stat(dir("pipe.store")), "the store's file is removed")
  end)

  describe("bad input", function()
    local function recipe(args)
      local p = assert(io.popen(support.host_command(args) .. " 2>&1"))
      return support.finish_child(p)
    end

    it("a budget below one expert, a size that is not one, a store on tmpfs, ZeRO or expert parallelism", function()
      local base = {"recipes/longctx.lua", "--steps", "1", "--seq-len", "64", "--data", root .. "/corpus.txt"}
      local function with(extra, run_dir)
        local a = {table.unpack(base)}
        for _, v in ipairs(extra) do a[#a + 1] = v end
        a[#a + 1], a[#a + 2] = "--run-dir", dir(run_dir)
        return a
      end
      for _, c in ipairs{
        {{"--expert-budget", "1KiB"}, "--expert-budget 1.00 KiB is smaller than one expert ("},
        -- one byte short of longctx's 393216-byte expert: bytes, as the rounded sizes read alike
        {{"--expert-budget", "393215"}, "--expert-budget 393215 B is smaller than one expert (393216 B: "},
        {{"--expert-budget", "lots"}, "option --expert-budget expects a size such as 64MiB or 1.5GiB"},
        {{"--expert-budget", "0"}, "option --expert-budget must be at least 1 byte and below 4 EiB, got '0'"},
        {{"--expert-budget", "8MiB", "--expert-store", "/dev/shm/moelua_spec.store"},
         "--expert-store: /dev/shm/moelua_spec.store is on tmpfs"},
        {{"--expert-budget", "8MiB", "--zero", "1"}, "--expert-budget: the expert store is not built for sharded training yet"},
        {{"--expert-store", dir("lone.store")}, "--expert-store: the expert store's file is used only with --expert-budget"},
        {{"--expert-prefetch", "1"}, "--expert-prefetch: the expert store's hints are used only with --expert-budget"},
      } do
        local code, out = recipe(with(c[1], "bad"))
        assert.are.equal(1, code, out)
        support.has(out, c[2])
        assert.is_nil(out:find("traceback", 1, true), out)
      end
      -- expert parallelism, planned for 2 ranks: the --ep given, and the one the store needs
      local code, out = recipe({"plan", "recipes/longctx.lua", "--seq-len", "64", "--world", "2", "--ep", "2",
                                "--expert-budget", "8MiB"})
      assert.are.equal(1, code, out)
      support.has(out, "--expert-budget: the expert store is not built for expert parallelism yet (got --ep 2; " ..
                       "it needs --ep 1)")
      assert.is_nil(fs.stat("/dev/shm/moelua_spec.store"))
      assert.is_nil(fs.stat(dir("bad/ckpt")), "nothing was written")
    end)

    it("the Lua API: options named, whole-number floats taken, an expert out of range refused", function()
      local ES = require "moelua.expert_store"
      local o = {path = dir("api.store"), budget = 1e6, layers = 2, experts = 4, dim = 8, ffn = 16}
      local function new_with(k, v)
        local c = {}
        for a, b in pairs(o) do c[a] = b end
        c[k] = v
        local ok, err = pcall(function() local es = ES.new(c); return es end)
        assert.is_false(ok)
        return tostring(err)
      end
      support.has(new_with("bugdet", 5), "expert_store_spec.lua:")
      support.has(new_with("bugdet", 5), "moelua.expert_store.new: unknown option 'bugdet' (expected one of: budget,")
      support.has(new_with("budget", "1MiB"), "option 'budget' must be an integer >= 1, got string")
      support.has(new_with("layers", 0), "option 'layers' must be an integer >= 1, got 0")
      support.has(new_with("ffn", nil), "option 'ffn' is required")
      support.has(new_with("prefetch", -1), "option 'prefetch' must be an integer >= 0, got -1")
      local function model_with(store)
        local ok, err = pcall(nn.Transformer.new, {vocab = 16, dim = 8, layers = 1, heads = 2, ffn = 8,
                                                   experts = 2, topk = 1, store = store})
        assert.is_false(ok)
        return tostring(err)
      end
      support.has(model_with{path = dir("m.store"), budget = 64.5},
                  "option 'store.budget' must be an integer >= 1, got 64.5")
      support.has(model_with{path = dir("m.store"), budget = 2 ^ 20, prefech = 2},
                  "unknown option 'store.prefech' (expected one of: budget, inference, path, prefetch)")
      support.has(model_with{budget = 2 ^ 20}, "option 'store.path' is required on the cpu")
      local es = ES.new(o)   -- budget 1e6: a float that is a whole number
      for _, le in ipairs{{0, 4}, {2, 0}, {0, -1}, {0.5, 0}} do
        local ok, err = pcall(function() local v = es:acquire(le[1], le[2]); return v end)
        assert.is_false(ok)
        support.has(tostring(err), "expert_store_spec.lua:")
        support.has(tostring(err), string.format("moelua.expert_store: no expert (layer %s, expert %s): " ..
                                                 "layers 0..1, experts 0..3", tostring(le[1]), tostring(le[2])))
      end
      for _, f in ipairs{function() es:with(2, 0, false, function() end) end,
                         function() es:edit_params(0, 4, function() end) end} do
        local ok, err = pcall(f)
        assert.is_false(ok)
        assert.matches("^[^:]*expert_store_spec%.lua:%d+: moelua%.expert_store: no expert", tostring(err))
      end
      es:acquire(1, 3)
      es:release(1, 3)
      assert.is_not_nil(fs.stat(dir("api.store")))
      es:close()
      assert.is_nil(fs.stat(dir("api.store")), "close removes the file")
    end)

    it("a disk too small for the backing file: a clear error, no partial file", function()
      -- the file-size limit stands for a full disk (fallocate fails with EFBIG;
      -- SIGXFSZ ignored, as a full disk sends none)
      local args = {"recipes/longctx.lua", "--steps", "1", "--seq-len", "64", "--data", root .. "/corpus.txt",
                    "--expert-budget", "1MiB", "--run-dir", dir("full")}
      local words = {}
      for i, a in ipairs(args) do words[i] = support.shell_quote(a) end
      local cmd = "trap '' XFSZ; ulimit -f 1024; " .. support.shell_quote(support.host_path()) .. " " .. table.concat(words, " ")
      local p = assert(io.popen("bash -c " .. support.shell_quote(cmd) .. " 2>&1"))
      local code, out = support.finish_child(p)
      assert.are.equal(1, code, out)
      support.has(out, "--expert-store: ")
      support.has(out, dir("full") .. "/experts.store")
      assert.is_nil(out:find("traceback", 1, true), out)
      assert.is_nil(fs.stat(dir("full") .. "/experts.store"), "the partial file is removed")
    end)
  end)
end)
