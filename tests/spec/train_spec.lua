-- The training loop (lua/moelua/train.lua) and the recipes: the loss falls,
-- a resumed run repeats an uninterrupted one bit for bit, bad steps are
-- skipped, rollbacks restore and move on, Ctrl-C saves, options are checked.
local m = require "moelua"
local nn = require "moelua.nn"
local optim = require "moelua.optim"
local sched = require "moelua.sched"
local data = require "moelua.data"
local train = require "moelua.train"
local ckpt = require "moelua.ckpt"
local json = require "dkjson"
local fs = require "moelua.fs"
local support = require "tests.support"

local SEQ = 64

-- A fresh tiny model, corpus and optimizer (the same every call).
local function pieces()
  m.manual_seed(0)
  local model = nn.Transformer.new{vocab = 256, dim = 16, layers = 1, heads = 2, kv_heads = 1, ffn = 24,
                                   experts = 4, topk = 2, seed = 0, checkpoint = "moe"}
  local ds = data.open{glob = "/usr/include/std*.h", seq_len = SEQ, seed = 0, holdout = 0.01}
  local groups = model:param_groups{weight_decay = 0.1}
  local opt = optim.AdamW(groups, {lr = 3e-3, beta2 = 0.95})
  return model, ds, groups, opt
end

local function run(over)
  local model, ds, groups, opt = pieces()
  local cfg = {model = model, data = ds, optimizer = opt, groups = groups, seq_len = SEQ, steps = 6,
               lr = sched.warmup_cosine{peak = 3e-3, warmup = 2, total = 6}, clip = 1.0,
               aux_weight = 0.01, z_weight = 1e-3}
  for k, v in pairs(over or {}) do cfg[k] = v end
  return train.run(cfg), model
end

local function events(dir, kind)
  local out = {}
  for line in io.lines(dir .. "/metrics.jsonl") do
    local obj = json.decode(line)
    if obj.event == kind or (kind == nil and obj.event == nil) then out[#out + 1] = obj end
  end
  return out
end

describe("train.run", function()
  local dir
  before_each(function() dir = support.make_tmpdir() end)
  after_each(function() support.remove_dir(dir) end)

  it("lowers the loss of a tiny model and logs every step", function()
    local r = run{steps = 12, lr = sched.constant(5e-3), run_dir = dir}
    assert.is_true(r.final_loss < r.first_loss - 0.3,
                   string.format("loss %.4f -> %.4f", r.first_loss, r.final_loss))
    local steps = events(dir)
    assert.are.equal(12, #steps)
    for _, k in ipairs({"loss", "ce", "aux", "z", "lr", "temperature", "tokens_per_s", "ledger_peak",
                        "loads", "phases", "grad_norm"}) do
      assert.is_not_nil(steps[1][k], "metrics lack " .. k)
    end
    assert.are.equal(4, #steps[1].loads[1].counts)
    assert.is_true(steps[1].ledger_peak.params > 0)
    assert.are.equal(1, #events(dir, "checkpoint"))         -- the final one
  end)

  it("resumes bit-exactly from a checkpoint", function()
    local a = run{run_dir = dir .. "/a", ckpt_every = 3, keep = 5}
    local b = run{run_dir = dir .. "/b", resume = dir .. "/a/ckpt/step-000002"}
    assert.are.equal(3, b.first_step)
    for step = 3, 5 do
      assert.are.equal(string.format("%a", a.losses[step]), string.format("%a", b.losses[step]),
                       "step " .. step)
    end
  end)

  -- A checkpoint edited after its save, with its MANIFEST.sha256 written again.
  local function remanifest(step)
    local fs = require "moelua.fs"
    local lines = {}
    for line in io.lines(step .. "/MANIFEST.sha256") do
      local rel = line:match("^%x+  (.+)$")
      lines[#lines + 1] = fs.sha256(step .. "/" .. rel) .. "  " .. rel
    end
    support.write_file(step .. "/MANIFEST.sha256", table.concat(lines, "\n") .. "\n")
  end

  it("refuses a trainer.json whose fields are not what a save writes, naming the field", function()
    local json = require "dkjson"
    run{run_dir = dir .. "/a", ckpt_every = 3, keep = 5}
    local step = dir .. "/a/ckpt/step-000002"
    local saved = support.read_file(step .. "/trainer.json")
    local cases = {
      {function(t) t.step = 5.5 end, "step must be an integer >= 0, got 5.5"},
      {function(t) t.step = "five" end, 'step must be an integer >= 0, got "five"'},
      {function(t) t.step = -3 end, "step must be an integer >= 0, got -3"},
      {function(t) t.optim = nil end, "optim must be an object, got nil"},
      {function(t) t.ema = "x" end, 'ema must be an object, got "x"'},
      {function(t) t.ema.var = -1 end, "ema.var must be a finite number >= 0, got -1"},
      {function(t) t.rng.seed = "a" end, 'rng.seed must be an integer, got "a"'},
      {function(t) t.optim.group_steps = {1} end, "optim.group_steps must be a list of "},
      {function(t) t.optim.group_steps[1] = -1 end, "optim.group_steps[1] must be an integer >= 0, got -1"},
    }
    for _, c in ipairs(cases) do
      local t = json.decode(saved)
      c[1](t)
      support.write_file(step .. "/trainer.json", json.encode(t))
      remanifest(step)
      local model, ds, groups, opt = pieces()
      local ok, err = pcall(train.run, {model = model, data = ds, optimizer = opt, groups = groups, seq_len = SEQ,
                                        steps = 4, resume = step})
      assert.is_false(ok)
      assert.is_true(require("moelua.errors").is_user(err), tostring(err))
      support.has(tostring(err), "moelua.train: " .. step .. "/trainer.json: " .. c[2])
    end
  end)

  it("refuses a checkpoint whose optimizer states do not fit the parameters, naming the tensor", function()
    local mio = require "moelua.io"
    run{run_dir = dir .. "/a", ckpt_every = 3, keep = 5}
    local step = dir .. "/a/ckpt/step-000002"
    -- transpose one state and write the manifest again, so only the shape is wrong
    local name = "model.layers.0.self_attn.k_proj.weight"   -- [8, 16]
    for _, f in ipairs({"optim/exp_avg.safetensors"}) do
      local t = mio.load(step .. "/" .. f)
      t[name] = t[name]:t():contiguous()
      mio.save(step .. "/" .. f, t, {format = "pt"})
    end
    remanifest(step)
    local model, ds, groups, opt = pieces()
    local msg = support.errmsg(train.run, {model = model, data = ds, optimizer = opt, groups = groups,
                                          seq_len = SEQ, steps = 4, run_dir = dir .. "/b", resume = step})
    support.has(msg, "optim exp_avg of '" .. name .. "' has shape [16,8], the parameter [8,16]")
  end)

  it("skips a step with a non-finite loss and counts it", function()
    local model, ds, groups, opt = pieces()
    local forward, at = model.forward, nil
    model.forward = function(self, tokens, s)   -- the loss of step 2's batch is NaN
      local l, st = forward(self, tokens, s)
      if at == 2 then l = 0 / 0 end
      return l, st
    end
    local r = run{model = model, data = ds, groups = groups, optimizer = opt,
                  hook = function(step) at = step end}
    assert.are.equal(1, r.skipped)
    assert.is_true(r.final_loss == r.final_loss)
  end)

  it("refuses, at the step that makes it, a recipe state a checkpoint cannot hold", function()
    local err = support.errmsg(run, {run_dir = dir, ckpt_every = 0, state = {},
                                     hook = function(step, state) if step == 3 then state.fn = print end end})
    support.has(err, "moelua.train: step 3: the recipe's state cannot be saved in a checkpoint " ..
                     "(state.fn: a function cannot be saved in JSON)")
    support.has(support.errmsg(run, {run_dir = dir .. "/b", state = {loss = 0 / 0}}),
                "moelua.train: step 0: the recipe's state cannot be saved in a checkpoint (state.loss: ")
  end)

  it("refuses a hook's control that is not a finite number in its range", function()
    support.has(support.errmsg(run, {hook = function(step, _, ctl) if step == 2 then ctl.aux_weight = 0 / 0 end end}),
                "moelua.train: step 2: the hook's ctl: aux_weight must be a finite number >= 0")
    support.has(support.errmsg(run, {hook = function(_, _, ctl) ctl.capacity_factor = 1.25 end}),
                "the hook's ctl: capacity_factor must be 0 (no capacity) for a model with moe policy \"dropless\"")
    -- the edges: lr_scale 0 holds the weights, a dropless model's capacity_factor 0
    local r = run{steps = 2, hook = function(_, _, ctl) ctl.lr_scale, ctl.capacity_factor = 0, 0 end}
    assert.is_true(r.final_loss == r.final_loss)
  end)

  it("rolls back on router collapse, moves the data on and calls the recipe", function()
    local calls = 0
    local model, ds, groups, opt = pieces()
    support.plant_collapse(model, 2, 2)           -- a collapse of two steps from step 2 on
    local r = run{steps = 5, run_dir = dir, ckpt_every = 1, keep = 5, model = model, data = ds, groups = groups,
                  optimizer = opt, alarms = {hot_steps = 1}, rollback = {collapse_steps = 2},
                  on_rollback = function(state, event)
                    calls = calls + 1
                    state.rollbacks = (state.rollbacks or 0) + 1
                    assert.are.equal("router collapse", event.reason)
                  end}
    assert.are.equal(1, r.rollbacks)
    assert.are.equal(1, calls)
    local ev = events(dir, "rollback")
    assert.are.equal(1, #ev)
    assert.are.equal(1, ev[1].resume_step)        -- step 0's checkpoint: step 1's weights routed step 2 into it
    assert.is_true(ev[1].data_offset > 0)
  end)

  it("refuses a misspelt or mistyped option by name before the first step", function()
    local model, ds, groups, opt = pieces()
    local base = {model = model, data = ds, optimizer = opt, groups = groups, seq_len = SEQ, steps = 2}
    local function with(k, v)
      local c = {}
      for n, x in pairs(base) do c[n] = x end
      c[k] = v
      return c
    end
    support.has(support.errmsg(train.run, with("ckpt_evry", 2)),
                "moelua.train.run: unknown option 'ckpt_evry' (expected one of: accum, alarms, attach,")
    support.has(support.errmsg(train.plan, with("kep", 1)), "moelua.train.plan: unknown option 'kep'")
    support.has(support.errmsg(train.run, with("on_alarm", 5)),
                "moelua.train.run: option 'on_alarm' must be a function, got 5")
    support.has(support.errmsg(train.run, with("lr", 5)), "moelua.train.run: option 'lr' must be a function, got 5")
    support.has(support.errmsg(train.run, with("data", 5)), "moelua.train.run: option 'data' must be a table, got 5")
    support.has(support.errmsg(train.run, with("ckpt_every", 2.5)),
                "moelua.train.run: option 'ckpt_every' must be an integer >= 0, got 2.5")
    support.has(support.errmsg(train.run, with("keep", 0)),
                "moelua.train.run: option 'keep' must be an integer >= 1, got 0")
    support.has(support.errmsg(train.run, with("clip", -1)),
                "moelua.train.run: clip must be > 0 (leave it out for no clipping), got -1")
    support.has(support.errmsg(train.run, with("clip", 0)), "moelua.train.run: clip must be > 0")
    support.has(support.errmsg(train.run, 5), "moelua.train.run: options must be a table, got number")
    -- a schedule may be a callable table; `x and {...}` passes false for none
    local sched_t = setmetatable({}, {__call = function() return 1e-3 end})
    local c = with("lr", sched_t)
    c.reload, c.steps = false, 1
    local r = train.run(c)
    assert.is_true(r.final_loss == r.final_loss)
  end)

  it("refuses rollback and alarm settings outside their kind, by name", function()
    local function refused(over, part) support.has(support.errmsg(run, over), part) end
    refused({rollback = {max_rollbacks = 0 / 0}},
            "moelua.train.run: option 'rollback.max_rollbacks' must be an integer >= 0, got ")
    refused({rollback = {window = 2.5}}, "option 'rollback.window' must be an integer >= 1, got 2.5")
    refused({rollback = {max_skipped = 0}}, "option 'rollback.max_skipped' must be an integer >= 1, got 0")
    refused({rollback = {spike_sigma = 0}},
            "option 'rollback.spike_sigma' must be a finite number > 0 or math.huge, got 0")
    refused({rollback = {spike_sigma = 0 / 0}},
            "option 'rollback.spike_sigma' must be a finite number > 0 or math.huge, got ")
    refused({rollback = {windw = 5}},
            "unknown option 'rollback.windw' (expected one of: collapse_steps, max_rollbacks, max_skipped,")
    refused({alarms = {hot_steps = 0}}, "option 'alarms.hot_steps' must be an integer >= 1, got 0")
    refused({alarms = {collapse = 1}}, "option 'alarms.collapse' must be a finite number > 1 or math.huge, got 1")
    refused({alarms = 5}, "moelua.train.run: option 'alarms' must be a table, got 5")
    local r = run{steps = 2, rollback = {window = 50.0, max_rollbacks = 0, spike_sigma = math.huge},
                  alarms = {hot = 2, collapse = math.huge}}   -- math.huge: off
    assert.is_true(r.final_loss == r.final_loss)
  end)

  it("runs the hook once per step whatever it returns, and takes a nil control as its default", function()
    local calls = 0
    local r = run{steps = 3, run_dir = dir, hook = function(_, _, ctl)
      calls = calls + 1
      ctl.temperature = nil
      return false
    end}
    assert.are.equal(3, calls)
    assert.are.equal(3, #r.losses + 1)
    assert.are.equal(1.0, events(dir)[1].temperature)
  end)

  it("checks the lr schedule's value and, on an error before the update, saves the step before", function()
    local function lr(bad) return function(step) if step == 3 then return bad end return 1e-3 end end
    for i, bad in ipairs({0 / 0, "0.1", -1e-3}) do
      local run_dir = dir .. "/" .. i
      local err = support.errmsg(run, {run_dir = run_dir, lr = lr(bad)})
      support.has(err, "moelua.train: step 3: the lr schedule returned ")
      support.has(err, ", not a finite number >= 0; step 2 is saved in " .. run_dir .. "/ckpt/step-000002")
    end
    local stopped = events(dir .. "/1", "stopped")[1]
    assert.are.same({event = "stopped", step = 3, reason = "error", checkpoint = dir .. "/1/ckpt/step-000002"},
                    stopped)
    -- the saved step is the one before the failure, as an uninterrupted run has it
    local whole = run{run_dir = dir .. "/whole", lr = lr(1e-3)}
    local resumed = run{run_dir = dir .. "/1", resume = dir .. "/1/ckpt/step-000002", lr = lr(1e-3)}
    assert.are.equal(string.format("%a", whole.losses[3]), string.format("%a", resumed.losses[3]))
    -- the recipe's state is the step before's too: the failed step's hook ran for nothing
    local err = support.errmsg(run, {run_dir = dir .. "/s", state = {n = 0}, hook = function(step, state)
      state.n = state.n + 1
      if step == 2 then error("hook failed") end
    end})
    support.has(err, "hook failed")
    support.has(err, "(step 1 is saved in " .. dir .. "/s/ckpt/step-000001)")
    assert.are.equal(2, ckpt.load(dir .. "/s/ckpt/step-000001").trainer.recipe_state.n)
  end)

  it("refuses before the first step what a checkpoint could not hold, or a run would refuse later", function()
    local model, ds, groups, opt = pieces()
    local base = {model = model, data = ds, optimizer = opt, groups = groups, seq_len = SEQ, steps = 2}
    local function with(over)
      local c = {}
      for n, x in pairs(base) do c[n] = x end
      for n, x in pairs(over) do c[n] = x end
      return c
    end
    support.has(support.errmsg(train.run, with{run_dir = dir, provenance = {options = {f = print}}}),
                "moelua.train.run: provenance cannot be saved in a checkpoint (provenance.options.f: a function")
    assert.is_nil(fs.stat(dir .. "/metrics.jsonl"))
    support.has(support.errmsg(train.run, with{aux_weight = 0 / 0}),
                "moelua.train.run: option 'aux_weight' must be a finite number >= 0, got ")
    support.has(support.errmsg(train.run, with{log_every = 0 / 0}),
                "option 'log_every' must be a finite number >= 1, got ")
    support.has(support.errmsg(train.run, with{attach = {}}),
                "moelua.train.run: attach must be what moelua.remote.listen(run_dir) returns")
    -- train.plan refuses the same, with the pieces from build
    local function build_with(o)
      return function()
        local mo, _, g = pieces()
        return mo, o == "SGD" and optim.SGD(g, {lr = 0.1}) or optim.AdamW(g, {lr = 1e-3}), g
      end
    end
    local function plan(over)
      local c = {data = ds, seq_len = SEQ, steps = 2, build = build_with(over.opt)}
      over.opt = nil
      for n, x in pairs(over) do c[n] = x end
      return support.errmsg(train.plan, c)
    end
    support.has(plan{opt = "SGD", run_dir = dir .. "/p"}, "checkpoints carry AdamW states; use AdamW or no run_dir")
    support.has(plan{attach = {}}, "moelua.train.plan: attach must be what moelua.remote.listen(run_dir) returns")
    local recipe = dir .. "/hooks.lua"
    support.write_file(recipe, "return {hook = function() end}\n")
    support.has(plan{reload = {file = recipe, names = "hook"}}, "moelua.train.run: reload.names must be a list")
    support.has(plan{reload = {file = recipe, names = {"hok"}}}, "reload.names: 'hok' is not a reloadable hook")
    support.has(plan{reload = {file = recipe, nmes = {"hook"}}}, "moelua.train.run: reload: unknown option 'nmes'")
  end)

  it("resumes a run whose experts are frozen under lazy Adam", function()
    local function frozen(over)
      local model, ds = pieces()
      local groups = model:param_groups{weight_decay = 0.1, sparse = true, freeze = {experts = true}}
      over.model, over.data, over.groups, over.optimizer = model, ds, groups, optim.AdamW(groups, {lr = 3e-3})
      return over
    end
    run(frozen{steps = 2, run_dir = dir})
    local r = run(frozen{steps = 3, run_dir = dir, resume = dir .. "/ckpt/step-000001"})
    assert.are.equal(2, r.first_step)
  end)

  it("refuses a resume at another count of micro-batches per step unless it takes no step", function()
    run{steps = 2, accum = 2, run_dir = dir}
    local saved = dir .. "/ckpt/step-000001"
    local err = support.errmsg(run, {steps = 4, accum = 1, resume = saved, run_dir = dir})
    support.has(err, "moelua.train: " .. saved .. " was trained with 2 micro-batches per step (ranks x accum), " ..
                     "this run takes 1 (1 rank x accum 1): the batch would change and the data would be read " ..
                     "again from an earlier window; keep ranks x accum at 2 (here: --accum 2)")
    assert.is_true(require("moelua.errors").is_user(select(2, pcall(run, {steps = 4, resume = saved, run_dir = dir}))))
    assert.are.equal(2, run{steps = 2, accum = 1, resume = saved, run_dir = dir}.first_step)   -- no step: saved as loaded
    local r = run{steps = 4, accum = 2, resume = saved, run_dir = dir}
    assert.are.equal(2, r.first_step)
    assert.is_number(r.losses[3])
  end)

  it("refuses a run without its pieces", function()
    local model, ds, groups, opt = pieces()
    support.has(support.errmsg(train.run, {model = model, data = ds, optimizer = opt}),
                "moelua.train.run: groups is required (the optimizer's param groups)")
    assert.matches("^[^:]*train_spec%.lua:%d+: moelua%.train%.run: model is required",   -- at the caller's line
                   select(2, pcall(function() local r = train.run{}; return r end)))
    support.has(support.errmsg(train.plan, {data = ds}),
                "moelua.train.plan: build is required (a function returning model, optimizer, groups)")
    support.has(support.errmsg(train.plan, {data = ds, build = function() return model end}),
                "moelua.train.plan: build returned no optimizer (it returns model, optimizer, groups)")
    local sgd = optim.SGD(groups, {lr = 0.1})
    assert.matches("checkpoints carry AdamW states",
                   support.errmsg(train.run, {model = model, data = ds, optimizer = sgd, groups = groups,
                                              seq_len = SEQ, run_dir = dir}))
  end)
end)

describe("recipes", function()
  it("tiny trains, checkpoints and reports the ledger", function()
    local dir = support.make_tmpdir()
    local p = assert(io.popen(support.host_command({"recipes/tiny.lua", "--steps", "4", "--seq-len", "64",
                                                   "--run-dir", dir, "--ckpt-every", "2"}) .. " 2>&1"))
    local code, out = support.finish_child(p)
    assert.are.equal(0, code, out)
    assert.matches("loss [%d.]+ %-> [%d.]+ over steps 0..3", out)
    assert.matches("memory ledger %(cpu%)", out)
    assert.matches("optim", out)
    assert.is_not_nil(ckpt.latest(dir .. "/ckpt"))
    support.remove_dir(dir)
  end)

  it("README's recipe runs as written: trains, refuses a second run, resumes and validates", function()
    local dir = support.make_tmpdir()
    local readme = support.read_file("README.md")
    local a = assert(readme:find("```lua\n-- myrecipe.lua", 1, true), "README's recipe example")
    local b = assert(readme:find("\n```\n", a, true))
    support.write_file(dir .. "/myrecipe.lua", readme:sub(a + 7, b))
    local function recipe(args)
      local all = {dir .. "/myrecipe.lua", "--seq-len", "64", "--run-dir", dir .. "/run"}
      for _, v in ipairs(args) do all[#all + 1] = v end
      return support.finish_child(assert(io.popen(support.host_command(all) .. " 2>&1")))
    end
    local code, out = recipe({"--steps", "2"})
    assert.are.equal(0, code, out)
    code, out = recipe({"--steps", "2"})
    assert.are.equal(1, code, out)
    support.has(out, "Continue it with --resume " .. dir .. "/run/ckpt, replace it with --overwrite")
    code, out = recipe({"--steps", "11", "--resume", dir .. "/run/ckpt"})
    assert.are.equal(0, code, out)
    assert.are.equal(1, #support.metrics(dir .. "/run", "validation"), out)   -- val_every = 10: at step 9
    assert.are.equal(10, ckpt.load(dir .. "/run/ckpt").trainer.step)
    support.remove_dir(dir)
  end)

  it("name a bad option before allocating anything", function()
    local p = assert(io.popen(support.host_command({"recipes/tiny.lua", "--sq-len", "64"}) .. " 2>&1"))
    local code, out = support.finish_child(p)
    assert.are_not.equal(0, code)
    assert.matches("unknown option %-%-sq%-len", out)
    p = assert(io.popen(support.host_command({"recipes/tiny.lua", "--steps", "many"}) .. " 2>&1"))
    code, out = support.finish_child(p)
    assert.are_not.equal(0, code)
    assert.matches("option %-%-steps expects a number, got 'many'", out)
  end)

  it("refuse to resume past --steps, or into another shape, writing nothing; say when nothing is left", function()
    local dir = support.make_tmpdir()
    local function tiny(extra)
      local args = {"recipes/tiny.lua", "--seq-len", "64", "--run-dir", dir .. "/run"}
      for _, a in ipairs(extra) do args[#args + 1] = a end
      return support.finish_child(assert(io.popen(support.host_command(args) .. " 2>&1")))
    end
    local code, out = tiny({"--steps", "3"})
    assert.are.equal(0, code, out)
    local metrics = support.read_file(dir .. "/run/metrics.jsonl")
    code, out = tiny({"--steps", "2", "--resume", dir .. "/run/ckpt"})
    assert.are.equal(1, code, out)
    assert.matches("holds step 2, past the last step of steps = 2 %(step 1%): " ..
                   "steps %(a recipe's %-%-steps%) must be at least 3", out)
    code, out = tiny({"--steps", "5", "--dim", "64", "--resume", dir .. "/run/ckpt"})
    assert.are.equal(1, code, out)
    assert.matches("does not match the model: config.json has hidden_size = 32, the model has 64 %(option dim%)", out)
    assert.matches("%(the tensors' shapes follow from these: build the model with the checkpoint's options%)\n$", out)
    assert.is_nil(out:find("has shape", 1, true), out)   -- not every tensor again
    assert.is_nil(out:find("traceback", 1, true), out)
    assert.are.equal(2, ckpt.load(dir .. "/run/ckpt").trainer.step)
    assert.are.equal(metrics, support.read_file(dir .. "/run/metrics.jsonl"))
    -- resumed at its last step: nothing to train, and the recipe says so
    code, out = tiny({"--steps", "3", "--resume", dir .. "/run/ckpt"})
    assert.are.equal(0, code, out)
    assert.matches("no step left to train: the checkpoint holds step 2, the last of %-%-steps 3", out)
    assert.are.equal(2, ckpt.load(dir .. "/run/ckpt").trainer.step)
    support.remove_dir(dir)
  end)

  it("print a model shape, a choice, a corpus or a run directory that cannot be, without a traceback", function()
    local dir = support.make_tmpdir()
    for _, c in ipairs({
      {{"--topk", "9"}, "option 'topk' = 9 must be in 1..experts %(4%)"},
      {{"--kv-heads", "3"}, "option 'kv_heads' = 3 must divide heads = 4"},
      {{"--checkpoint", "bogus"}, "option %-%-checkpoint must be one of none, attention, moe, full, got 'bogus'"},
      {{"--save", "bogus"}, "option %-%-save must be one of save, recompute, got 'bogus'"},
      {{"--data", dir .. "/missing/*.h"}, "moelua.data.open: moelua.fs.glob: '" .. dir:gsub("%p", "%%%0") ..
                                          "/missing/%*.h'"},   -- not /nonexistent: a machine may have one
      {{"--run-dir", "/proc/moelua-run"}, "moelua.train: the run directory cannot be created: moelua.fs.mkdir_p: " ..
                                          "cannot create '/proc/moelua%-run'"},
      {{"--run-dir", "/proc/moelua-run", "--expert-budget", "1MiB"}, "moelua.train: the run directory cannot be " ..
                                                                    "created: moelua.fs.mkdir_p: cannot create"},
      {{"--budget-gib", "1e-300"}, "%-%-budget%-gib 1e%-300 is less than one byte: give a budget in GiB, or 0 for " ..
                                   "90%% of the memory available"},
      {{"--budget-gib", "1e30"}, "%-%-budget%-gib 1e%+30 is out of range"},
      {{"--budget-gib", "100000"}, "%-%-budget%-gib 100000: moelua%.mem%.budget: the total budget of .* %-%-force%-budget " ..
                                   "sets it anyway"},
      {{"--force-budget"}, "%-%-force%-budget accepts a %-%-budget%-gib above the memory available: give it with " ..
                           "%-%-budget%-gib"},
    }) do
      local args = {"recipes/tiny.lua", "--steps", "1", "--run-dir", dir .. "/run"}
      for _, a in ipairs(c[1]) do args[#args + 1] = a end
      local code, out = support.finish_child(assert(io.popen(support.host_command(args) .. " 2>&1")))
      assert.are.equal(1, code, out)
      assert.matches(c[2], out)
      assert.is_nil(out:find("traceback", 1, true), out)
      assert.is_nil(require("moelua.fs").stat(dir .. "/run/ckpt"), c[1][1])
    end
    support.remove_dir(dir)
  end)

  it("list every option with --help", function()
    local p = assert(io.popen(support.host_command({"recipes/longctx.lua", "--help"}) .. " 2>&1"))
    local code, out = support.finish_child(p)
    assert.are.equal(0, code)
    for _, o in ipairs({"--seq-len", "--experts", "--resume", "--budget-gib", "--checkpoint"}) do
      assert.is_truthy(out:find(o, 1, true), o)
    end
  end)

  it("stop a job on SIGTERM as on Ctrl-C", function()
    local path = os.tmpname()
    support.write_file(path, [[
      io.stdout:setvbuf("no")
      local m = require "moelua"
      print(io.open("/proc/self/stat"):read("n"))
      local a = m.randn({512, 512})
      local ok, err = pcall(function()
        print("ready")
        for _ = 1, 100000 do m.matmul(a, a) end
      end)
      print("caught", ok, err)
      os.exit(3)
    ]])
    local p = assert(io.popen(support.host_command({path}) .. " 2>&1", "r"))
    local pid = p:read("n")
    p:read("l")
    assert.are.equal("ready", p:read("l"))
    assert(os.execute("kill -TERM " .. math.tointeger(pid)))
    local code, out = support.finish_child(p)
    os.remove(path)
    assert.are.equal(3, code, out)
    assert.matches("caught\tfalse\t[^\n]*interrupted", out)
  end)

  it("save a checkpoint and exit non-zero on Ctrl-C", function()
    local dir = support.make_tmpdir()
    local code, out = support.interrupt_child(string.format([[
      io.stdout:setvbuf("no")
      print(io.open("/proc/self/stat"):read("n"))
      arg = {[0] = "recipes/tiny.lua", "--steps", "100000", "--seq-len", "512", "--run-dir", %q,
             "--ckpt-every", "0"}
      local train = require "moelua.train"
      local run, say = train.run, print
      print = function() end                 -- the recipe's banner would come before "ready"
      train.run = function(cfg)
        local hook = cfg.hook
        cfg.log_every = 1e9
        cfg.hook = function(step, state, ctl)
          if step == 2 then say("ready"); print = say end
          return hook(step, state, ctl)
        end
        return run(cfg)
      end
      dofile("recipes/tiny.lua")
    ]], dir), 0.5)
    assert.are_not.equal(0, code)
    assert.matches("interrupted at step %d+; saved ", out)
    assert.is_not_nil(ckpt.latest(dir .. "/ckpt"))
    support.remove_dir(dir)
  end)

  -- A script that trains tiny in its own run directory and presses Ctrl-C
  -- (sends itself SIGINT) from `trigger`, Lua code run before training
  -- that may call ctrl_c() and wrap `on_step(step)`, called at each step's
  -- start (the recipe's hook).
  local function ctrl_c_child(dir, trigger, ckpt_every)
    local path = os.tmpname()
    support.write_file(path, string.format([[
      local pid = math.tointeger(io.open("/proc/self/stat"):read("n"))
      -- not os.execute: system() ignores SIGINT in the caller while its child runs
      local function ctrl_c() io.popen("kill -INT " .. pid):close() end
      local function on_step(step) end
      -- t[name] presses Ctrl-C at its first call while armed (after the call when `after`)
      local armed = false
      local function ctrl_c_in(t, name, after)
        local f = t[name]
        t[name] = function(...)
          if armed and not after then armed = false; ctrl_c() end
          local r = table.pack(f(...))
          if armed and after then armed = false; ctrl_c() end
          return table.unpack(r, 1, r.n)
        end
      end
      %s
      arg = {[0] = "recipes/tiny.lua", "--steps", "50", "--seq-len", "64", "--run-dir", %q,
             "--ckpt-every", "%d"}
      local train = require "moelua.train"
      local run = train.run
      train.run = function(cfg)
        local hook = cfg.hook
        cfg.hook = function(step, state, ctl)
          on_step(step)
          return hook(step, state, ctl)
        end
        return run(cfg)
      end
      dofile("recipes/tiny.lua")
    ]], trigger, dir, ckpt_every or 0))
    local code, out = support.finish_child(assert(io.popen(support.host_command({path}) .. " 2>&1")))
    os.remove(path)
    return code, out
  end

  -- Ctrl-C at step 3, and `extra` more from inside the interrupt save (at
  -- its first fsync): Ctrl-C pressed again while the checkpoint is being written.
  local function ctrl_c_during_save(dir, extra)
    return ctrl_c_child(dir, string.format([[
      local fs = require "moelua.fs"
      local fsync, sent = fs.fsync, false
      fs.fsync = function(...)            -- the save's first fsync: its files are being written
        if not sent then
          sent = true
          for _ = 1, %d do ctrl_c() end
        end
        return fsync(...)
      end
      on_step = function(step) if step == 3 then ctrl_c() end end
    ]], extra))
  end

  it("finish the bookkeeping between steps before a Ctrl-C stops them", function()
    local dir = support.make_tmpdir()
    -- pressed while step 3's metrics line is being encoded: the hook raises at the next Lua instruction
    local code, out = ctrl_c_child(dir, [[
      local json = require "dkjson"
      local encode = json.encode
      json.encode = function(obj, ...)
        if obj.step == 3 and not obj.event then ctrl_c() end
        return encode(obj, ...)
      end
    ]])
    assert.are.equal(1, code, out)
    assert.matches("interrupt held until the work in progress is done", out)
    assert.matches("interrupted at step 4; saved [^\n]*step%-000003", out)
    assert.is_nil(out:find("stack traceback", 1, true), out)
    assert.are.equal(3, ckpt.load(dir .. "/ckpt").trainer.step)
    local lines = support.read_file(dir .. "/metrics.jsonl")
    assert.matches('"step":3', lines)    -- the line was written whole
    support.remove_dir(dir)
  end)

  it("hold a Ctrl-C during the update: the step stands and is saved as done", function()
    local dir = support.make_tmpdir()
    -- pressed during step 3's optimizer call (its C call returns before the hook can fire)
    local code, out = ctrl_c_child(dir, [[
      local optim = require "moelua.optim"
      local ctor = optim.AdamW
      optim.AdamW = function(...)
        local o = ctor(...)
        ctrl_c_in(o, "step", true)
        return o
      end
      on_step = function(step) armed = step == 3 end
    ]])
    assert.are.equal(1, code, out)
    assert.matches("interrupted at step 4; saved [^\n]*step%-000003", out)
    local c = ckpt.load(dir .. "/ckpt")
    assert.are.equal(3, c.trainer.step)
    assert.are.equal(4, c.trainer.optim.t)   -- steps 0 to 3: the saved step holds its own update
    assert.matches('"step":3[,}]', support.read_file(dir .. "/metrics.jsonl"))
    support.remove_dir(dir)
  end)

  it("save the recipe state a step started from when Ctrl-C abandons it after its hook ran", function()
    local dir = support.make_tmpdir()
    local code, out = ctrl_c_child(dir, [[
      local train = require "moelua.train"
      local run = train.run
      train.run = function(cfg)   -- a hook that counts its calls in the recipe state
        local hook = cfg.hook
        cfg.hook = function(step, state, ctl)
          state.calls = (state.calls or 0) + 1
          return hook(step, state, ctl)
        end
        return run(cfg)
      end
      ctrl_c_in(require("moelua.nn").Transformer, "forward")   -- in step 3's forward, after its hook
      on_step = function(step) armed = step == 3 end
    ]])
    assert.are.equal(1, code, out)
    assert.matches("interrupted at step 3; saved [^\n]*step%-000002", out)
    assert.are.equal(3, ckpt.load(dir .. "/ckpt").trainer.recipe_state.calls)   -- steps 0, 1, 2
    support.remove_dir(dir)
  end)

  it("finish the final save before a Ctrl-C during it stops the run, and log it", function()
    local dir = support.make_tmpdir()
    local code, out = ctrl_c_child(dir, [[
      local fs = require "moelua.fs"
      local fsync, sent = fs.fsync, false
      fs.fsync = function(...)            -- --ckpt-every 0: the only save is the final one
        if not sent then sent = true; ctrl_c() end
        return fsync(...)
      end
    ]])
    assert.are.equal(1, code, out)
    assert.matches("interrupted at step 50 %(during the final save, which finished%); saved [^\n]*step%-000049", out)
    assert.are.equal(49, ckpt.load(dir .. "/ckpt").trainer.step)
    assert.matches('"event":"interrupted"', support.read_file(dir .. "/metrics.jsonl"))
    support.remove_dir(dir)
  end)

  it("interrupt validation like a step, and save the step before it", function()
    local dir = support.make_tmpdir()
    -- --ckpt-every 3 validates after step 2; Ctrl-C in its first forward
    local code, out = ctrl_c_child(dir, [[
      local Transformer = require("moelua.nn").Transformer
      local forward, armed = Transformer.forward, false
      Transformer.forward = function(self, tokens, rng_step)
        if armed and rng_step == 0 then armed = false; ctrl_c() end
        return forward(self, tokens, rng_step)
      end
      on_step = function(step) armed = step == 2 end
    ]], 3)
    assert.are.equal(1, code, out)
    assert.matches("interrupted at step 3; saved [^\n]*step%-000002", out)
    assert.is_nil(out:find("stack traceback", 1, true), out)
    assert.are.equal(2, ckpt.load(dir .. "/ckpt").trainer.step)
    assert.is_nil(support.read_file(dir .. "/metrics.jsonl"):find('"event":"validation"', 1, true))
    support.remove_dir(dir)
  end)

  it("hold a second Ctrl-C until the interrupt checkpoint is written; it loads", function()
    local dir = support.make_tmpdir()
    local code, out = ctrl_c_during_save(dir, 1)
    assert.are.equal(1, code, out)
    assert.matches("interrupt held until the work in progress is done", out)
    assert.matches("interrupted at step 3; saved [^\n]*step%-000002", out)
    assert.is_nil(out:find("stack traceback", 1, true), out)
    local c = ckpt.load(dir .. "/ckpt")
    assert.are.equal(2, c.trainer.step)
    support.remove_dir(dir)
  end)

  it("abort the save on a third Ctrl-C, saying so; --resume then names the half-written save", function()
    local dir = support.make_tmpdir()
    local code, out = ctrl_c_during_save(dir, 2)
    assert.are.equal(130, code, out)
    assert.matches("abort", out)
    local p = assert(io.popen(support.host_command({"recipes/tiny.lua", "--run-dir", dir, "--resume",
                                                   dir .. "/ckpt"}) .. " 2>&1"))
    local code2, out2 = support.finish_child(p)
    assert.are.equal(1, code2, out2)
    assert.matches("step%-000002%.tmp is a save that did not finish", out2)
    support.remove_dir(dir)
  end)
end)
